"""Ray side of the coordinator: connecting to a cluster, its GPU pool, and the relay actor.

The :class:`~plora.runtime.coordinator.Coordinator` runs in the driver (next to the sweep dir);
workers reach it through :class:`CoordinatorActor`, a thin named actor that buffers per-adapter
step reports from workers and hands each job the control (stop / add) the coordinator posted for it.
The driver drains and posts a few times per second.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections import defaultdict
from typing import Any

import ray

from plora.config import ConfigError
from plora.engine.api import Control, StepMetrics, StepReport


class CoordinatorActor:
    """Relay between workers and the driver's coordinator (one per sweep, named).

    Worker side: :meth:`push_reports`, :meth:`poll`. Driver side: :meth:`drain`,
    :meth:`post_control`, :meth:`post_results`, :meth:`forget`, :meth:`set_snapshot`. Others
    (a Tune proxy trial following one config, a user) may call :meth:`stop_config`,
    :meth:`config_view` and :meth:`snapshot`.
    """

    def __init__(self) -> None:
        self._reports: dict[str, list[StepReport]] = defaultdict(list)
        self._control: dict[str, Control] = {}
        self._aborted: set[str] = set()
        self._stops: list[str] = []
        self._snapshot: dict[str, Any] = {}
        self._last: dict[str, StepMetrics] = {}
        self._results: dict[str, dict[str, Any]] = {}

    def push_reports(self, job_id: str, reports: list[StepReport]) -> None:
        self._reports[job_id].extend(reports)
        for report in reports:
            for m in report.metrics:
                self._last[m.config_id] = m

    def post_results(self, results: dict[str, dict[str, Any]]) -> None:
        """Result rows (``results.parquet`` shape) of configs that ended."""
        self._results.update(results)

    def config_view(self, config_id: str) -> dict[str, Any]:
        """One config as seen now: its latest step metrics and, once it ended, its result."""
        last = self._last.get(config_id)
        return {
            "last": None if last is None else dataclasses.asdict(last),
            "result": self._results.get(config_id),
        }

    def poll(self, job_id: str) -> Control:
        ctl = self._control.pop(job_id, None) or Control()
        if job_id in self._aborted:
            ctl = dataclasses.replace(ctl, abort=True)
        return ctl

    def drain(self) -> tuple[dict[str, list[StepReport]], list[str]]:
        """``({job_id: step reports}, config ids asked to stop)`` since the last drain."""
        out, self._reports = dict(self._reports), defaultdict(list)
        stops, self._stops = self._stops, []
        return out, stops

    def post_control(self, job_id: str, control: Control) -> None:
        cur = self._control.get(job_id) or Control()
        self._control[job_id] = Control(
            stop=cur.stop | control.stop,
            add=cur.add + control.add,
            abort=cur.abort or control.abort,
        )

    def abort(self, job_id: str) -> None:
        self._aborted.add(job_id)

    def forget(self, job_id: str) -> None:
        self._control.pop(job_id, None)
        self._aborted.discard(job_id)

    def stop_config(self, config_id: str) -> None:
        self._stops.append(config_id)

    def set_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._snapshot = snapshot

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot


def start_relay(name: str) -> Any:
    """Create the named relay actor on the driver's node (0 CPUs, so it never blocks jobs)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(CoordinatorActor)
        .options(
            name=name,
            num_cpus=0,
            max_concurrency=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=True),
        )
        .remote()
    )


def connect(address: str | None, *, num_gpus: int) -> bool:
    """Connect to Ray; returns True when this call started a local (embedded) cluster.

    ``address`` None and no ``RAY_ADDRESS``: start a local Ray; on a machine without CUDA it gets
    ``num_gpus`` *logical* GPUs so jobs can be placed (the engine then runs on CPU). Otherwise
    connect to ``address`` (``auto``, ``ray://...`` or ``host:port``).

    Raises:
        ConfigError: the address cannot be reached.
    """
    if ray.is_initialized():
        return False
    where = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS") or None
    runtime_env = {"env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}}
    if address is None:
        kwargs: dict[str, Any] = {}
        if not _has_cuda():
            kwargs["num_gpus"] = num_gpus
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        try:
            ray.init(
                include_dashboard=False, log_to_driver=False, runtime_env=runtime_env, **kwargs
            )
        except ValueError:  # a `ray start` cluster on this machine was found: use it as it is
            if not kwargs:
                raise
            ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
            return False
        return True
    check_address(address)
    try:  # the job's runtime_env (``ray job submit --working-dir``) is left as submitted
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{where} {address}: cannot connect to a Ray cluster ({first}); start one with "
            "`ray start --head` or drop --address to run locally"
        ) from None
    return False


def check_address(address: str | None, *, timeout_s: float = 3.0) -> None:
    """Fail fast on an unreachable ``host:port`` (Ray itself retries for minutes)."""
    where = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None or address == "auto" or address.startswith("local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"{where} {address}: not host:port, ray://host:port or auto; "
            "e.g. --address 10.0.0.1:6379"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            f"{where} {address}: cannot reach a Ray cluster ({e.strerror or e}); start one with "
            "`ray start --head` or drop --address to run locally"
        ) from None


def check_gpus(num_gpus: int) -> float:
    """The cluster's GPU count; ConfigError when it has fewer than the sweep wants."""
    have = float(ray.cluster_resources().get("GPU", 0.0))
    if have < num_gpus:
        raise ConfigError(
            f"hardware.num_gpus: the sweep wants {num_gpus} GPUs but the Ray cluster has "
            f"{have:g}; lower hardware.num_gpus or add GPU nodes"
        )
    return have


def cpus_per_worker() -> float:
    """CPUs to reserve per GPU worker: 1, or the cluster's CPU/GPU ratio when smaller."""
    res = ray.cluster_resources()
    gpus = float(res.get("GPU", 0.0)) or 1.0
    return max(0.01, min(1.0, float(res.get("CPU", 1.0)) / gpus))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


__all__ = [
    "CoordinatorActor",
    "check_address",
    "check_gpus",
    "connect",
    "cpus_per_worker",
    "start_relay",
]
