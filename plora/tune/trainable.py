"""The Ray Tune trainable of plora: one lightweight proxy trial per config, packed training below.

A Tune user keeps ``tune.Tuner``, searchers, schedulers and the ``ResultGrid``::

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from plora.tune.scheduler import PLoRAScheduler
    from plora.tune.trainable import plora_trainable

    asha = ASHAScheduler(time_attr="adapter_step", max_t=100)   # max_t: the configs' max_steps
    tuner = tune.Tuner(plora_trainable("sweeps/quickstart.yaml"),
                       param_space={"lr": tune.loguniform(1e-4, 1e-2), "rank": tune.choice([4, 8])},
                       tune_config=tune.TuneConfig(metric="loss", mode="min", num_samples=16,
                                                   scheduler=PLoRAScheduler(asha)))
    best = tuner.fit().get_best_result().checkpoint     # the best adapter, PEFT format

Each trial is a *proxy*: it asks for a tiny CPU share and no GPU (a Tune request cannot be all
zeros), registers its config with the experiment's :class:`~plora.runtime.actors.tune_service.TuneService`
(a named actor the Tune driver creates here, so it lives and dies with the driver), then
reports its adapter's step metrics as they stream (``adapter_step`` is the monotone time
attribute for schedulers: the adapter's own optimizer step), and ends with a checkpoint that
is the adapter's PEFT directory and its eval metrics. The sweep itself -- plan, packs on the
GPUs, refills, re-plans -- runs in the service, into ``<experiment dir>/plora/``.

Tune's controller starts every pending trial (``choose_trial_to_run`` only orders them), so many
proxies wait at once and the planner sees many configs; the service bounds what really trains.
:func:`plora_trainable` raises ``TUNE_MAX_PENDING_TRIALS_PG`` for that unless it is set.

Result keys (every report): ``loss`` (the adapter's train loss of that step), ``adapter_step``,
``lr``, ``grad_norm``, ``tokens``, ``tokens_per_s`` (its tokens over the packed step's wall
time), ``config_id``, ``max_steps`` (0: by epochs),
``plora_relay`` (the sweep's relay actor, for :class:`~plora.tune.scheduler.PLoRAScheduler`); the last report adds
``eval_loss``, ``eval_metric``, ``final_train_loss``, ``status`` (done / stopped),
``early_stopped`` and ``steps``. Tune's own loggers get every report: its default
TensorBoard, CSV and JSON loggers write each trial's curves into the trial's folder of the
experiment (``tensorboard --logdir <storage>/<name>``), as any callback passed to ``RunConfig``
(MLflow, W&B) gets them; the packed sweep's own curves are in ``<experiment>/plora/tensorboard/``
(and its ``logging:`` sinks). A trial its scheduler paused (HyperBand, a soft median rule)
is stopped by Tune while its adapter leaves its pack with its train-state; when Tune runs the
trial again its proxy asks for the config to be queued again and follows it on from there.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

from plora.config import ConfigError, SweepConfig
from plora.sweepdir.schema import ConfigStatus
from plora.tune.services import SERVICES as _SERVICES

PROXY_CPUS = 0.01
"""The CPU share a proxy trial asks for (Tune refuses an all-zero request)."""
PENDING_TRIALS = 256
"""``TUNE_MAX_PENDING_TRIALS_PG`` set for the user unless set: trials started at once."""
IDLE_POLL_S = 1.0
"""Longest wait between a proxy's reads while its adapter has nothing new (queued, or paused):
the wait doubles from ``poll_s`` each empty read and drops back at the next new step: sixteen
queued proxies reading 5 times a second would take most of a core of a small box
(``examples/tune_asha.py``), beside the one worker that trains."""


def plora_trainable(
    sweep: SweepConfig | str | os.PathLike[str],
    *,
    options: Any = None,
    cost: Any = None,
    settle_s: float = 1.0,
    linger_s: float = 30.0,
    poll_s: float = 0.2,
    name: str | None = None,
) -> Any:
    """A Tune trainable training each trial's config packed with the others (call in the driver).

    Args:
        sweep: The sweep (its YAML path or :class:`SweepConfig`): base model, dataset and
            hardware; its ``space`` names the parameters a trial's config may set (the rest
            take the space's fixed values). ``search``/``num_samples`` are Tune's business here.
        options: :class:`plora.runtime.driver.RunOptions` for the packed sweep.
        cost: Override the cost model (tests).
        settle_s: Seconds without a new trial before the registered configs are planned.
        linger_s: Seconds, every config ended, before the worker groups are released (an
            adaptive searcher's next trials may come); at the driver's exit the sweep ends
            without lingering.
        poll_s: How often a proxy trial reads its adapter's new metrics while it trains
            (up to :data:`IDLE_POLL_S` while it has none).
        name: The service actor's name (default ``plora-tune-<sweep name>-<random>``).

    Returns:
        A function trainable with its resources set (pass it to ``tune.Tuner`` or
        ``tune.Tuner.restore(..., trainable=...)``).
    """
    from ray import tune

    from plora.runtime.actors.tune_service import start_service

    if not isinstance(sweep, SweepConfig):
        sweep = SweepConfig.from_yaml(Path(sweep))
    sweep.check_trainable()
    os.environ.setdefault("TUNE_MAX_PENDING_TRIALS_PG", str(PENDING_TRIALS))
    name = name or f"plora-tune-{sweep.name}-{uuid.uuid4().hex[:6]}"
    _release_ended()
    service = start_service(
        sweep, name=name, options=options, cost=cost, settle_s=settle_s, linger_s=linger_s
    )
    import ray

    ray.get(service.sweep_dir.remote())  # created and answering before any trial starts
    if not _SERVICES:
        atexit.register(release_services)  # after ray.init: runs before Ray's own shutdown
    _SERVICES[name] = service

    def plora_proxy(config: dict[str, Any]) -> None:
        _follow(config, service_name=name, poll_s=poll_s)

    plora_proxy.__name__ = "plora_proxy"
    plora_proxy.__qualname__ = "plora_proxy"
    return tune.with_resources(plora_proxy, {"cpu": PROXY_CPUS})


def release_services(timeout_s: float = 60.0) -> None:
    """End every sweep this driver's :func:`plora_trainable` calls started (``sweep_done``
    logged, worker groups stopped, the sweep directory's lock released) instead of lingering,
    and let their service actors go (each holds a driver's imports, about 0.6 GB).

    Runs at the driver's exit; call it in a notebook once the Tuners are done. A trainable
    made before is then spent: ``Tuner.restore`` needs a new :func:`plora_trainable`.
    """
    import ray

    if ray.is_initialized():
        for service in _SERVICES.values():
            with contextlib.suppress(Exception):  # a service already gone has nothing to end
                ray.get(service.finish.remote(timeout_s), timeout=timeout_s + 5)
    _SERVICES.clear()  # the last handles: Ray ends an actor no handle refers to


def _release_ended() -> None:
    """Let go of the services of earlier :func:`plora_trainable` calls whose sweep ran and
    ended (every config ended and ``linger_s`` passed: that Tuner is done), so a notebook that
    runs Tuner after Tuner keeps one idle service, not one per Tuner. A service that has not
    run yet, or still runs, is kept."""
    import ray

    if not ray.is_initialized():  # handles of a Ray session that was shut down
        _SERVICES.clear()
        return
    for name, service in list(_SERVICES.items()):
        try:
            ended = ray.get(service.ended.remote(), timeout=30)
        except ray.exceptions.GetTimeoutError:  # busy: keep it
            continue
        except ray.exceptions.RayError:  # already gone
            ended = True
        if ended:
            del _SERVICES[name]


def _experiment_dir() -> str:
    """The Tune experiment directory (on storage every node mounts; not a cloud URI)."""
    from ray import tune

    storage = tune.get_context().get_storage()
    fs = storage.storage_filesystem
    if getattr(fs, "type_name", "local") != "local":
        raise ConfigError(
            f"RunConfig.storage_path={storage.storage_path}: plora writes adapters and its sweep "
            "directory there, so it must be a local or shared (NFS) path, not a cloud URI"
        )
    return str(Path(storage.experiment_fs_path).absolute())


def _follow(config: dict[str, Any], *, service_name: str, poll_s: float) -> None:
    """A proxy trial: register the config, report its metrics as they come, end with its adapter."""
    import ray
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    try:
        service = ray.get_actor(service_name)
    except ValueError:
        raise RuntimeError(
            f"plora's Tune service {service_name!r} is gone: its sweep ended and "
            "release_services() (or a later plora_trainable() call) let it go; pass a new "
            "plora_trainable(...) to the Tuner (or to Tuner.restore)"
        ) from None

    last_step, last = 0, dict[str, Any]()

    def register() -> Any:
        """``(config_id, relay name, max_steps, ended)``: :meth:`TuneService.register`."""
        return ray.get(service.register.remote(config, trial_id, _experiment_dir(), last_step))

    config_id, relay_name, max_steps, ended = register()
    relay: Any = None
    wait_s = poll_s
    while True:
        if ended is not None:  # it ended in a run of the sweep that ended before we read it
            result, unread = ended
            for m in unread:
                last = _step_report(m, config_id, relay_name, max_steps)
                tune.report(last)
            _finish(result, last, config_id=config_id, relay_name=relay_name)
            return
        if relay is None:
            try:
                relay = ray.get_actor(relay_name)
            except ValueError:  # the sweep is starting (or restarting): ask again
                time.sleep(poll_s)
                config_id, relay_name, max_steps, ended = register()
                continue
            wait_s = poll_s  # a new run of the sweep: its first rows may come at once
            # this trial runs (again): a config its scheduler paused is queued again and
            # continues where it left (a config that is not paused is left as it is)
            # (the steps a run of this trial before a pause reported are not reported again)
            try:
                resumed = ray.get(relay.resume_config.remote(config_id, "trial started"))
            except ray.exceptions.RayActorError:  # that run of the sweep just ended: again
                relay = None
                continue
            last_step = max(last_step, resumed)
        try:
            rows, result = ray.get(relay.history.remote(config_id, last_step))
        except ray.exceptions.RayActorError:  # that run of the sweep ended: register again
            relay = None
            config_id, relay_name, max_steps, ended = register()
            continue
        for m in rows:
            last = _step_report(m, config_id, relay_name, max_steps)
            tune.report(last)
            last_step = m.step
        if (
            result is not None and result.get("status") != ConfigStatus.PAUSED
        ):  # paused: Tune stops us
            _finish(result, last, config_id=config_id, relay_name=relay_name)
            return
        wait_s = poll_s if rows else min(2.0 * wait_s, max(poll_s, IDLE_POLL_S))
        time.sleep(wait_s)


def _step_report(m: Any, config_id: str, relay_name: str, max_steps: int) -> dict[str, Any]:
    """What a proxy reports to Tune for one of its adapter's steps (a ``StepMetrics``)."""
    return {
        "loss": m.loss, "adapter_step": m.step, "lr": m.lr, "grad_norm": m.grad_norm,
        "tokens": m.tokens, "tokens_per_s": m.tokens / m.time_s if m.time_s > 0 else 0.0,
        "config_id": config_id, "plora_relay": relay_name, "max_steps": max_steps,
    }  # fmt: skip


def _finish(
    result: dict[str, Any], last: dict[str, Any], *, config_id: str, relay_name: str
) -> None:
    """The trial's last report: eval metrics and the adapter's PEFT directory as checkpoint."""
    from ray import tune

    status = str(result.get("status"))
    if status == "failed":
        raise RuntimeError(f"config {config_id} failed in plora: {result.get('error')}")
    steps = int(result.get("steps") or 0)
    final = {
        **last,
        "config_id": config_id,
        "plora_relay": relay_name,
        "adapter_step": max(steps, int(last.get("adapter_step", 0))),
        "loss": last.get("loss", result.get("final_train_loss")),
        "final_train_loss": result.get("final_train_loss"),
        "eval_loss": result.get("eval_loss"),
        "eval_metric": result.get("eval_metric"),
        "status": status,
        "early_stopped": status == "stopped",
        "steps": steps,
    }
    path = result.get("adapter_path")
    checkpoint = None
    if path and Path(path).is_dir():
        checkpoint = tune.Checkpoint.from_directory(path)
    tune.report(final, checkpoint=checkpoint)


__all__ = [
    "PENDING_TRIALS",
    "PROXY_CPUS",
    "plora_trainable",
    "release_services",
]
