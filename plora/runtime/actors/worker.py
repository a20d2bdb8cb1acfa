"""The worker: one resident Ray actor per GPU; it loads the base model once and trains the packs
of successive jobs on it (:class:`plora.engine.api.PackEngine`).

Between steps the engine calls the worker's hooks: each step's report (per-adapter metrics and
the step's measurements) is streamed to the coordinator's relay actor (batched, a few small calls
per second) and control -- stop one adapter, add a queued config to a free slot, abort -- is
polled from it. Requests, reports, control and outcomes are the engine's frozen dataclasses,
passed through Ray as they are; adapters and checkpoints go to the sweep directory, never through
Ray's object store.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from plora.engine.api import (
    Control,
    EngineSpec,
    PackEngine,
    PackOutcome,
    PackRequest,
    StepReport,
)

#: Longest wait, after the model loaded, for the first job's kernel warm-up process to finish
#: (it compiles what the first step would compile anyway; a stuck one is stopped).
WARMUP_WAIT_S = 60.0
#: Longest wait after that for the Liger-Kernel warm-up process, which is then stopped: it holds
#: GPU memory the first step's plan did not count, and saves that step a second or two, which a
#: longer wait would not pay for.
FUSED_WARMUP_WAIT_S = 3.0


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerInfo:
    """Where a worker runs and what loading its engine cost."""

    node_id: str
    host: str
    ip: str
    gpu_ids: tuple[str, ...]
    pid: int
    load_s: float = 0.0
    """Seconds to build the engine (base model and dataset load), ``build_s`` not counted."""
    build_s: float = 0.0
    """Seconds of the engine's build spent building a built-in tiny base model on its first use
    on this machine (or waiting for the process building it): once per machine, not part of the
    group's start-up that the profile store keeps."""
    load_parts: dict[str, float] = field(default_factory=dict)
    """``load_s`` by part, where the engine reports them: ``import`` (the engine's modules),
    ``model``, ``kernels``, ``data`` (:class:`~plora.engine.session.PackSession`), ``parallelize``."""
    loaded_at: float = 0.0
    """Wall-clock time (epoch seconds) the engine was built (0: not loaded); the sweep's
    timeline places ``workers`` by it (:mod:`plora.runtime.timeline`)."""


def _tiny_build_s() -> float:
    """Seconds this process spent building a built-in tiny model (or waiting for another process
    building it): read only where plora's model loading imported the module (an engine that
    loads no model pays no transformers import for it)."""
    tiny = sys.modules.get("plora.models.tiny")
    return float(tiny.build_seconds()) if tiny is not None else 0.0


class RelayHooks:
    """The engine's :class:`~plora.engine.api.SyncHooks`, talking to the coordinator relay.

    Args:
        relay: The :class:`plora.runtime.actors.relay.CoordinatorActor` handle.
        job_id: This job's id (the relay keys control and reports by it).
        flush_every_s: Send buffered reports at most this often (and before every poll).
        poll_every_s: Ask for control at most this often (0: every step).
    """

    def __init__(
        self, relay: Any, job_id: str, *, flush_every_s: float = 1.0, poll_every_s: float = 0.0
    ) -> None:
        self.relay = relay
        self.job_id = job_id
        self.flush_every_s = flush_every_s
        self.poll_every_s = poll_every_s
        self._buffer: list[StepReport] = []
        self._last_flush = time.monotonic()
        self._last_poll = -1e9
        self._unsynced = False  # reports since the last confirmed sync

    def on_step(self, report: StepReport) -> None:
        """Buffer the step's report; send when the buffer is old enough."""
        self._buffer.append(report)
        self._unsynced = True
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self, *, wait: bool = False) -> None:
        """Send buffered reports; ``wait`` blocks until the relay has them."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        reports, self._buffer = self._buffer, []
        ref = self.relay.push_reports.remote(self.job_id, reports)
        if wait:
            ray.get(ref)

    def sync(self, *, timeout_s: float = 120.0) -> None:
        """Return once every report so far is on disk in the sweep directory (the engine calls
        this before each checkpoint, so a crash never leaves a checkpoint ahead of its metrics).
        After ``timeout_s`` without the driver's answer it returns anyway (logged); with no
        report since the last sync it returns at once. A sync waits for the driver's next drain:
        at most one driver tick (``RunOptions.tick_s``) per checkpoint."""
        if not self._unsynced:
            return
        self.flush()
        ticket = ray.get(self.relay.request_sync.remote(self.job_id))
        deadline = time.monotonic() + timeout_s
        while ray.get(self.relay.synced.remote(self.job_id)) < ticket:
            if time.monotonic() > deadline:
                logging.getLogger(__name__).warning(
                    "job %s: metrics not confirmed durable after %.0f s; checkpointing anyway",
                    self.job_id,
                    timeout_s,
                )
                return
            time.sleep(0.02)
        self._unsynced = False

    def poll(self) -> Control:
        """This step's control (reports are flushed first, so the coordinator sees them first)."""
        now = time.monotonic()
        if now - self._last_poll < self.poll_every_s:
            return Control()
        self._last_poll = now
        self.flush()
        return ray.get(self.relay.poll.remote(self.job_id))


class PackWorker:
    """One rank of a resident worker group (created by :mod:`plora.runtime.actors.group`).

    Args:
        rank: This worker's rank in its group (0..d-1).
        world_size: d, the group's GPU count.
        relay: The coordinator relay actor handle.
        engine: The engine class (``engine(spec)`` loads the base model; a ``PackEngine``);
            None: :class:`plora.engine.session.PackSession` for d = 1, and for d > 1
            :class:`plora.parallel.session.ParallelPackSession` on the group's process group
            with ``strategy`` -- imported in the worker (the driver need not import torch).
        strategy: The group's strategy (``tp``, ``fsdp``, ``pp``) when d > 1.
        spec: What the engine loads.
        threads: ``torch.set_num_threads`` on CPU (1 keeps concurrent workers from
            oversubscribing).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        relay: Any,
        engine: type[PackEngine] | None = None,
        spec: EngineSpec | None = None,
        threads: int = 1,
        strategy: str | None = None,
    ) -> None:
        import torch

        self.rank = rank
        self.world_size = world_size
        self.strategy = strategy
        self.relay = relay
        self._engine_cls = engine
        self._spec = spec
        self._default_engine = engine is None  # a PackSession: its kernels can be warmed up
        self.warmup: Any = None
        """The first job's kernel warm-up report (:func:`plora.engine.warmup.finish_warmup`)."""
        self.engine: PackEngine | None = None
        self._loaded = threading.Event()  # calls run on two threads: ``run`` waits for ``load``
        self._running = threading.Lock()  # one job at a time, even when the next one is queued
        # while this rank still finishes the last (rank 0 returned first)
        self._load_error: str | None = None
        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            # Logical GPUs on a CPU machine: no CUDA device to pin, keep to one core.
            torch.set_num_threads(max(1, threads))

    def node_info(
        self,
        load_s: float = 0.0,
        build_s: float = 0.0,
        load_parts: dict[str, float] | None = None,
        loaded_at: float = 0.0,
    ) -> WorkerInfo:
        """Where this worker runs: node id, host, IP, the GPU ids Ray gave it."""
        ctx = ray.get_runtime_context()
        return WorkerInfo(
            node_id=ctx.get_node_id(),
            host=socket.gethostname(),
            ip=ray.util.get_node_ip_address(),
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
            pid=os.getpid(),
            load_s=load_s,
            build_s=build_s,
            load_parts=dict(load_parts or {}),
            loaded_at=loaded_at,
        )

    def load(self, master: tuple[str, int] | None = None) -> WorkerInfo:
        """Join the group's process group first when ``master`` (rank 0's :meth:`rendezvous`)
        is given, then build the engine (load the base model and the dataset) once; where and
        how long the build took."""
        if self._spec is None:
            raise RuntimeError("this worker was created without an engine spec to load")
        t0, built_before = time.perf_counter(), _tiny_build_s()
        try:
            if master is not None:
                self.init_group(*master)
                t0 = time.perf_counter()
            t_import = time.perf_counter()
            if self._engine_cls is None and self.world_size > 1:
                from plora.parallel.session import ParallelPackSession

                t_import = time.perf_counter() - t_import
                self.engine = ParallelPackSession.for_job(
                    self._spec, self.world_size, self.strategy
                )
            else:
                if self._engine_cls is None:
                    from plora.engine.session import PackSession

                    self._engine_cls = PackSession
                t_import = time.perf_counter() - t_import
                self.engine = self._engine_cls(self._spec)
        except Exception as e:
            self._load_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            raise
        finally:
            self._loaded.set()
        build_s = _tiny_build_s() - built_before
        parts = {"import": t_import, **getattr(self.engine, "load_parts", {})}
        logging.getLogger(__name__).info(
            "engine loaded: %s", ", ".join(f"{k} {v:.1f} s" for k, v in parts.items())
        )
        return self.node_info(
            load_s=time.perf_counter() - t0 - build_s,
            build_s=build_s,
            load_parts=parts,
            loaded_at=time.time(),
        )

    def rendezvous(self) -> tuple[str, int]:
        """This node's IP and a free port on it: where rank 0 hosts the process-group store."""
        return ray.util.get_node_ip_address(), self.free_port()

    def free_port(self) -> int:
        """A free TCP port on this worker's node (rank 0 hosts the process-group store)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def init_group(self, master_addr: str, master_port: int) -> str:
        """Join the group's torch.distributed group (NCCL on GPU, gloo on CPU); the backend."""
        import torch.distributed as dist

        backend = "nccl" if self.cuda else "gloo"
        if self.cuda:
            import torch

            torch.cuda.set_device(0)  # the one GPU Ray made visible to this worker
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

    def run_job(self, request: PackRequest) -> PackOutcome:
        """Train one job's pack on the resident engine; reports are flushed before returning.

        In a group of d > 1 every rank runs the job; only rank 0 talks to the relay (metrics
        out, control in: the engine hands its control to the other ranks), and rank 0's
        outcome is the job's.
        """
        warming = None if self._loaded.is_set() else self._warm_up(request)
        self._loaded.wait()
        self._finish_warm_up(warming, request.job_id)  # never longer than compiling here
        if self.engine is None:
            raise RuntimeError(f"the worker could not load the base model: {self._load_error}")
        with self._running:
            if self.rank != 0:
                return self.engine.run(request, None)
            hooks = RelayHooks(self.relay, request.job_id, poll_every_s=request.poll_every_s)
            try:
                return self.engine.run(request, hooks)
            finally:
                hooks.flush(wait=True)

    def _warm_up(self, request: PackRequest) -> Any:
        """Compile the first job's kernels in child processes while ``load`` still runs (one
        GPU, the default engine): the packed LoRA kernels, and Liger-Kernel's ops in a second
        child (:mod:`plora.engine.warmup`); the first step then reads them from Triton's disk
        cache. Returns the two children (either may be None)."""
        if not (self.cuda and self._default_engine and self.world_size == 1 and self._spec):
            return None
        from plora.engine.warmup import start_fused_warmup, start_warmup

        children = []
        for start in (start_warmup, start_fused_warmup):
            try:
                children.append(start(self._spec, request))
            except Exception as e:  # an optimization only: the first step compiles instead
                logging.getLogger(__name__).warning("kernel warm-up not started: %s", e)
                children.append(None)
        return tuple(children)

    def _finish_warm_up(self, children: Any, job_id: str) -> None:
        """Wait for :meth:`_warm_up`'s children (:data:`WARMUP_WAIT_S`, then
        :data:`FUSED_WARMUP_WAIT_S` more for the second); one still running is stopped, so none
        runs beside the first step."""
        if children is None:
            return
        from plora.engine.warmup import finish_warmup

        packed, fused = children
        log = logging.getLogger(__name__)
        if packed is not None:
            self.warmup = finish_warmup(packed, timeout_s=WARMUP_WAIT_S)
            log.info("kernel warm-up, %s: %s", job_id, self.warmup)
        if fused is not None:
            report = finish_warmup(fused, timeout_s=FUSED_WARMUP_WAIT_S)
            log.info("fused-kernel warm-up, %s: %s", job_id, report)


__all__ = ["PackWorker", "RelayHooks", "WorkerInfo"]
