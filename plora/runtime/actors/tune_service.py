"""The coordinator behind the Ray Tune integration: one named actor per Tune experiment.

:class:`TuneService` is what Tune proxy trials (:mod:`plora.tune.trainable`) register their
configs with. On the first registration it starts the sweep -- :func:`plora.runtime.driver.run_sweep`
in a thread of the actor, with a :class:`~plora.tune.source.RegistrationSource` as its config
source -- into ``<experiment dir>/plora/`` (a sweep directory like any other: plan, jobs,
metrics, results, decisions, adapters). Trials follow their config through the sweep's relay
(:meth:`~plora.runtime.actors.relay.CoordinatorActor.history`); a scheduler's STOP reaches the
coordinator through the relay's ``stop_config``.

Lifetime. The service is created by the Tune driver (:func:`plora.tune.trainable.plora_trainable`)
so it dies with it: a killed driver takes the service, the relay and the worker groups along;
a driver that exits normally first ends the sweep (:meth:`TuneService.finish`, at exit).
``Tuner.restore`` then creates a new service whose first registration finds the sweep
directory's ``state.json`` and resumes it (finished configs stay finished, interrupted jobs
restart from their checkpoints). When every registered config ended and nothing came for
``linger_s`` seconds the sweep ends (worker groups stopped); a later registration starts a
resumed run on the same directory. The driver lets an ended service go when it makes its next
trainable, or at :func:`plora.tune.trainable.release_services` (a notebook's Tuners do not each
leave one behind); Ray ends an actor no handle refers to.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from plora.config import SweepConfig
from plora.engine.reports import StepMetrics
from plora.runtime.driver import RunOptions, run_sweep
from plora.sweepdir.schema import STATE_JSON, ConfigStatus
from plora.sweepdir.store import SweepStore
from plora.tune.source import RegistrationSource
from plora.tune.space import config_from_tune

ENDED = frozenset({ConfigStatus.DONE, ConfigStatus.STOPPED, ConfigStatus.FAILED})
"""A config's statuses once it ended for good (a paused one will train again)."""
SWEEP_SUBDIR = "plora"
"""The sweep directory's name inside the Tune experiment directory."""


def config_id_of(trial_id: str) -> str:
    """The config id of a Tune trial (stable across ``Tuner.restore``)."""
    return f"t-{trial_id}"


class TuneService:
    """Registers Tune trials' configs and runs them as one plora sweep (a Ray actor).

    Args:
        sweep: The sweep (base model, dataset, hardware; its space names the parameters
            trials may set).
        options: Runtime knobs for the sweep.
        cost: Override the cost model (tests).
        name: The service's actor name; the sweep's relay is ``<name>-r<run>-coordinator``.
        settle_s: Quiet seconds after a registration before configs are planned.
        linger_s: Idle seconds with every config ended before the sweep ends.
    """

    def __init__(
        self,
        sweep: SweepConfig,
        *,
        options: RunOptions | None = None,
        cost: Any = None,
        name: str = "plora-tune",
        settle_s: float = 1.0,
        linger_s: float = 30.0,
    ) -> None:
        self.sweep = sweep
        self.options = options or RunOptions()
        self.cost = cost
        self.name = name
        self.settle_s = settle_s
        self.linger_s = linger_s
        self._lock = threading.Lock()
        self._out: Path | None = None
        self._source: RegistrationSource | None = None
        self._thread: threading.Thread | None = None
        self._runs = 0
        self._relay = ""
        self._error: str | None = None
        self._announced: dict[Path, list[str]] = {}  # expect() before the first registration

    def register(
        self, params: dict[str, Any], trial_id: str, experiment_dir: str, after_step: int = 0
    ) -> tuple[str, str, int, tuple[dict[str, Any], list[StepMetrics]] | None]:
        """Register a trial's config; returns ``(config_id, relay actor name, max_steps,
        ended)`` (``max_steps`` 0 for a config trained by epochs). ``ended`` is, when the config
        already ended in an earlier run of this service, its results row and its steps past
        ``after_step`` (the trial's last reported one), from the sweep directory: its trial
        missed them before that run ended (a proxy descheduled past ``linger_s``). No run is
        started for it, as a new one would end as soon, again before the trial read them.

        Raises:
            ConfigError: ``params`` is not a point of the sweep's space (one line, the key).
            RuntimeError: the sweep of this service failed (its first line).
        """
        config = config_from_tune(params, self.sweep, config_id=config_id_of(trial_id))
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"plora sweep failed: {self._error}")
            out = (Path(experiment_dir) / SWEEP_SUBDIR).absolute()
            if self._out is not None and out != self._out:
                raise RuntimeError(
                    f"{self.name} runs the sweep of {self._out.parent}; trial {trial_id} is of "
                    f"{experiment_dir}: give each Tuner its own plora_trainable(...)"
                )
            self._out = out
            steps = int(config.max_steps or 0)
            if self._source is None or not self._source.add(config):
                if self._thread is not None:
                    self._thread.join()  # the last run is ending: its source refused
                ended = _ended(out, config.config_id, after_step) if self._runs else None
                if ended is not None:
                    return config.config_id, self._relay, steps, ended
                self._start()
                assert self._source is not None
                self._source.add(config)
            return config.config_id, self._relay, steps, None

    def expect(self, trial_ids: list[str], experiment_dir: str) -> None:
        """Trials Tune added to ``experiment_dir`` and is starting: their configs are planned
        with the first ones, not after them (:meth:`RegistrationSource.expect`). Announced before
        the first registration, they wait for the sweep's source; another experiment's are
        ignored."""
        out = (Path(experiment_dir) / SWEEP_SUBDIR).absolute()
        ids = [config_id_of(t) for t in trial_ids]
        with self._lock:
            if self._out is not None and out != self._out:
                return
            if self._source is None:
                self._announced.setdefault(out, []).extend(ids)
            else:
                self._source.expect(ids)

    def finish(self, timeout_s: float = 60.0) -> bool:
        """The Tune experiment ended: end the sweep once its configs ended (no lingering) and
        wait for it up to ``timeout_s``; True when it ended (``sweep_done``, lock released)."""
        if self._source is not None:
            self._source.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.running()

    def sweep_dir(self) -> str | None:
        """The sweep directory (None before the first registration)."""
        return None if self._out is None else str(self._out)

    def ended(self) -> bool:
        """True once a sweep ran here and ended (every config ended and ``linger_s`` passed,
        or :meth:`finish`): nothing runs until a new registration."""
        return self._out is not None and self._runs > 0 and not self.running()

    def running(self) -> bool:
        """True while a sweep thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def error(self) -> str | None:
        """The first line of the error that ended the last run, if any."""
        return self._error

    def _start(self) -> None:
        assert self._out is not None
        self._runs += 1
        prefix = f"{self.name}-r{self._runs}"
        self._relay = f"{prefix}-coordinator"
        source = RegistrationSource(settle_s=self.settle_s, linger_s=self.linger_s)
        source.expect(self._announced.pop(self._out, []))
        self._announced.clear()
        self._source = source
        resume = (self._out / STATE_JSON).is_file()
        options = RunOptions(
            **{**_fields(self.options), "actor_prefix": prefix, "follow_configs": True}
        )
        out = self._out
        started = threading.Event()

        def run() -> None:
            started.set()
            try:
                run_sweep(
                    None if resume else self.sweep, out, resume=resume, options=options,
                    source=source, cost=self.cost,
                )  # fmt: skip
            except BaseException as e:  # reported to every later registration
                logging.getLogger(__name__).exception("plora sweep under Tune failed")
                text = str(e).strip()
                self._error = (text.splitlines()[0] if text else type(e).__name__)[:300]

        self._thread = threading.Thread(target=run, name=f"{prefix}-sweep", daemon=True)
        self._thread.start()
        started.wait()


def _ended(
    out: Path, config_id: str, after_step: int
) -> tuple[dict[str, Any], list[StepMetrics]] | None:
    """``config_id``'s row of the sweep's ``results.parquet`` when it ended (done, stopped or
    failed; a paused config has not; paths resolved, missing values None) and its steps past
    ``after_step`` from ``metrics.parquet`` (a step trained twice: its last attempt's)."""
    import pandas as pd

    store = SweepStore(out)
    res = store.read_results()
    if res.empty or "config_id" not in res:
        return None
    rows = res[res["config_id"] == config_id]
    if rows.empty or rows.iloc[-1]["status"] not in ENDED:
        return None
    result = {k: None if pd.api.types.is_scalar(v) and pd.isna(v) else v
              for k, v in rows.iloc[-1].to_dict().items()}  # fmt: skip
    m = store.read_metrics()
    m = m[(m["config_id"] == config_id) & (m["step"] > after_step)]
    m = m.sort_values(["step", "attempt"]).drop_duplicates("step", keep="last")
    steps = [
        StepMetrics(
            config_id=config_id,
            step=int(r.step),
            loss=float(r.loss),
            lr=float(r.lr),
            tokens=int(r.tokens),
            grad_norm=float(r.grad_norm),
            time_s=float(r.step_time_s),
        )
        for r in m.itertuples()
    ]
    return result, steps


def _fields(options: RunOptions) -> dict[str, Any]:
    return {k: getattr(options, k) for k in RunOptions.__dataclass_fields__}


def start_service(
    sweep: SweepConfig,
    *,
    name: str,
    options: RunOptions | None = None,
    cost: Any = None,
    settle_s: float = 1.0,
    linger_s: float = 30.0,
) -> Any:
    """The named :class:`TuneService` actor (created here, so owned by the caller: the Tune
    driver); an existing one of that name is returned as it is."""
    import ray

    from plora.runtime.actors.cluster import connect

    connect(None, num_gpus=sweep.hardware.num_gpus)
    return (
        ray.remote(TuneService)
        .options(name=name, get_if_exists=True, num_cpus=0, max_concurrency=64)
        .remote(
            sweep,
            options=options,
            cost=cost,
            name=name,
            settle_s=settle_s,
            linger_s=linger_s,
        )
    )


__all__ = ["SWEEP_SUBDIR", "TuneService", "config_id_of", "start_service"]
