"""The worker: one Ray actor per GPU of a job; runs ``plora.engine.run_pack`` on its pack.

Between steps the engine calls the worker's hooks: per-adapter metrics are streamed to the
coordinator's relay actor (batched, a few small calls per second) and control -- stop one adapter,
add a queued config to a free slot -- is polled from it. Results come back as small dicts (ids,
numbers, paths); adapters and checkpoints go to the sweep directory, never through Ray's object
store.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from plora.config import LoRAConfig


class RelayHooks:
    """``plora.engine`` hooks that talk to the coordinator relay.

    Args:
        relay: The :class:`plora.runtime.monitor.CoordinatorActor` handle.
        job_id: This job's id (the relay keys control and metrics by it).
        flush_every_s: Send buffered metrics at most this often (and before every poll).
        poll_every_s: Ask for control at most this often (0: every step).
    """

    def __init__(
        self, relay: Any, job_id: str, *, flush_every_s: float = 1.0, poll_every_s: float = 0.0
    ) -> None:
        self.relay = relay
        self.job_id = job_id
        self.flush_every_s = flush_every_s
        self.poll_every_s = poll_every_s
        self._buffer: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self._last_poll = -1e9

    def on_metrics(self, metrics: Sequence[Any]) -> None:
        """Buffer ``StepMetrics`` (as dicts); send when the buffer is old enough."""
        self._buffer.extend(_as_dict(m) for m in metrics)
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self, *, wait: bool = False) -> None:
        """Send buffered metrics; ``wait`` blocks until the relay has them."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        rows, self._buffer = self._buffer, []
        ref = self.relay.push_metrics.remote(self.job_id, rows)
        if wait:
            ray.get(ref)

    def poll(self) -> Any:
        """The engine's ``Control`` for this step (metrics are flushed first, in order)."""
        from plora.engine.records import Control

        now = time.monotonic()
        if now - self._last_poll < self.poll_every_s:
            return Control(stop=frozenset(), add=(), abort=False)
        self._last_poll = now
        self.flush()
        ctl = ray.get(self.relay.poll.remote(self.job_id))
        return Control(
            stop=frozenset(ctl.get("stop", ())),
            add=tuple(LoRAConfig.from_dict(d) for d in ctl.get("add", ())),
            abort=bool(ctl.get("abort", False)),
        )


class PackWorker:
    """One rank of a job. Created by :func:`plora.runtime.job.launch_job` in a placement group.

    Args:
        rank: This worker's rank in the job's group (0..d-1).
        world_size: d, the job's GPU count.
        job_id: The job's id.
        relay: The coordinator relay actor handle.
        threads: ``torch.set_num_threads`` on CPU (1 keeps concurrent jobs from oversubscribing).
    """

    def __init__(
        self, *, rank: int, world_size: int, job_id: str, relay: Any, threads: int = 1
    ) -> None:
        import torch

        self.rank = rank
        self.world_size = world_size
        self.job_id = job_id
        self.relay = relay
        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            # Logical GPUs on a CPU machine: no CUDA device to pin, keep to one core.
            torch.set_num_threads(max(1, threads))

    def node_info(self) -> dict[str, Any]:
        """Where this worker runs: node id, host, IP, the GPU ids Ray gave it."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
        }

    def free_port(self) -> int:
        """A free TCP port on this worker's node (rank 0 hosts the process-group store)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def init_group(self, master_addr: str, master_port: int) -> str:
        """Join the job's torch.distributed group (NCCL on GPU, gloo on CPU); returns the backend."""
        import torch.distributed as dist

        backend = "nccl" if self.cuda else "gloo"
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
            )
        return backend

    def all_reduce_check(self, value: float) -> float:
        """Sum ``value`` over the group (a liveness check of the process group)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t)
        return float(t.item())

    def run(self, job: Mapping[str, Any]) -> dict[str, Any]:
        """Train the pack with ``plora.engine.run_pack``.

        Args:
            job: ``{"configs": [LoRAConfig dicts], "model", "dataset", "out_dir",
                "checkpoint_dir", "checkpoint_every", "checkpoint_every_s", "resume"}``.

        Returns:
            ``{"status": "ok", "results": {config_id: ConfigResult as dict}, "profile": {...}}``,
            or ``{"status": "oom", "error": ...}`` on ``torch.OutOfMemoryError``.
        """
        import torch

        run_pack = _resolve(str(job.get("entry") or "plora.engine:run_pack"))
        hooks = RelayHooks(
            self.relay, self.job_id, poll_every_s=float(job.get("poll_every_s", 0.0))
        )
        configs = [LoRAConfig.from_dict(d) for d in job["configs"]]
        try:
            result = run_pack(
                model=job["model"],
                configs=configs,
                dataset=job["dataset"],
                out_dir=job["out_dir"],
                device="cuda" if self.cuda else "cpu",
                checkpoint_dir=job.get("checkpoint_dir"),
                checkpoint_every=job.get("checkpoint_every"),
                resume=bool(job.get("resume", True)),
                hooks=hooks,
                **({"gradient_checkpointing": True} if job.get("gradient_checkpointing") else {}),
                **(
                    {"checkpoint_every_s": job["checkpoint_every_s"]}
                    if job.get("checkpoint_every_s") is not None
                    else {}
                ),
            )
        except torch.OutOfMemoryError as e:
            hooks.flush(wait=True)
            if self.cuda:
                torch.cuda.empty_cache()
            return {"status": "oom", "error": str(e).splitlines()[0][:300]}
        hooks.flush(wait=True)
        return {
            "status": "ok",
            "results": {cid: _as_dict(r) for cid, r in result.results.items()},
            "profile": profile_dict(result.profile, configs),
        }


def _resolve(entry: str) -> Any:
    """``"pkg.module:function"`` -> the function."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def profile_dict(
    profile: Any, configs: Sequence[LoRAConfig], *, max_steps: int = 16
) -> dict[str, Any]:
    """A small view of the engine's ``PackProfile`` for the cost-model refit.

    Keeps up to ``max_steps`` measured steps after the first (warm-up) one, each as
    ``{"time_s", "seq_len", "peak_memory_bytes", "adapters"}``.
    """
    steps = list(getattr(profile, "steps", ()))
    steps = steps[1:] if len(steps) > 1 else steps
    n0 = len(configs)
    rows = [
        {
            "time_s": float(s.time_s),
            "seq_len": int(s.seq_len),
            "peak_memory_bytes": int(s.peak_memory_bytes),
            "adapters": int(s.adapters),
        }
        for s in steps
        if int(s.adapters) == n0  # steps where exactly the launched pack was active
    ][:max_steps]
    return {
        "device": str(getattr(profile, "device", "")),
        "config_ids": [c.config_id for c in configs],
        "step_time_s": float(getattr(profile, "mean_step_time_s", 0.0) or 0.0),
        "steps": rows,
    }


def _as_dict(x: Any) -> dict[str, Any]:
    if isinstance(x, Mapping):
        return dict(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = {}
        for f in dataclasses.fields(x):
            v = getattr(x, f.name)
            out[f.name] = str(v) if hasattr(v, "__fspath__") or isinstance(v, type) else v
        return _small(out)
    raise TypeError(f"cannot send {type(x).__name__} to the coordinator")


def _small(d: dict[str, Any]) -> dict[str, Any]:
    """Keep numbers, strings and short lists (profiles can hold per-step arrays)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, (list, tuple)) and len(v) > 64:
            v = list(v)[-64:]
        if hasattr(v, "value") and isinstance(getattr(v, "value", None), str):
            v = v.value
        out[k] = v
    return out


__all__ = ["PackWorker", "RelayHooks", "profile_dict"]
