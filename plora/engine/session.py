"""Train packs on a resident base model: :class:`PackSession` (a worker's engine) and ``run_pack``.

A :class:`PackSession` loads the base model, its tokenizer and the dataset once and then serves
successive :class:`~plora.engine.api.PackRequest` s on that one copy: each request builds a
:class:`~plora.engine.trainer.PackedTrainer` on the resident model, trains until every config
ends, and releases its slots, so the next pack starts on a clean base without a reload.

The job loop (steps, export behind evaluation, checkpoints, resume) is
:class:`plora.engine.job.PackJob`.

:func:`run_pack` is the one-shot form (load, train one pack, return), for scripts and tests.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from plora.config import CudaGraphs, DatasetSpec, LoRAConfig, ModelRef
from plora.config.fused import FusedKernels
from plora.engine import checkpoint as ckpt
from plora.engine.api import (
    CheckpointPolicy,
    ConfigResult,
    EngineSpec,
    OutcomeStatus,
    PackHooks,
    PackOutcome,
    PackRequest,
)
from plora.engine.job import JobClock, PackJob
from plora.engine.liger import apply_fused_kernels
from plora.engine.reports import Control
from plora.engine.trainer import PackedTrainer, PackProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class PackResult:
    """Every config's result and the pack's measured profile (:func:`run_pack`)."""

    results: dict[str, ConfigResult] = field(default_factory=dict)
    profile: PackProfile | None = None
    notes: tuple[str, ...] = ()
    """What the run should report (a damaged checkpoint skipped on resume, ...)."""


class PackSession:
    """A base model resident on one device, serving successive packs (:class:`PackEngine`).

    Args:
        spec: the base model, dataset and engine options; loaded here, once.
        load_device: where the base is loaded (default the session's device); a CPU-offloaded
            FSDP job loads it on the host and lets FSDP move it
            (:class:`~plora.parallel.session.ParallelPackSession`).
    """

    def __init__(self, spec: EngineSpec, *, load_device: str | None = None) -> None:
        from plora.engine.data import load_dataset
        from plora.models import load_model, resolve_model_path

        t0 = time.perf_counter()
        self.spec = spec
        self.device = torch.device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model, self.tokenizer = load_model(
            spec.model, dtype=dtype, device=load_device or self.device
        )
        t1 = time.perf_counter()
        self.fused_kernels = apply_fused_kernels(self.model, spec.fused_kernels, device=self.device)
        """Whether the base runs Liger-Kernel's fused ops (training and packed evaluation)."""
        t2 = time.perf_counter()
        self.data = load_dataset(spec.dataset, self.tokenizer)
        self.model_path = resolve_model_path(spec.model)
        t3 = time.perf_counter()
        self.load_s = t3 - t0
        self.load_parts = {"model": t1 - t0, "kernels": t2 - t1, "data": t3 - t2}
        """Seconds of ``load_s`` by part: the base model (and tokenizer), its fused kernels'
        patching, the dataset's tokenization."""
        self.model_loads = 1
        self._load_charged = False

    #: Whether this process writes checkpoints and results (one rank of a parallel job does).
    _writer = True

    def _trainer_kwargs(self, request: PackRequest) -> dict[str, Any]:
        """What every trainer of one pack on the resident model is built with."""
        return dict(
            device=self.device,
            seq_len=self.spec.dataset.max_seq_len,
            max_rows=request.rows_limit(self.spec.max_rows),
            gradient_checkpointing=self.spec.gradient_checkpointing,
            base_model_name_or_path=ckpt.adapter_base_name(
                self.spec.model, self.model_path, request.out_dir
            ),
            cuda_graphs=self.spec.cuda_graphs.trainer_arg,
        )

    def _trainer(self, request: PackRequest) -> PackedTrainer:
        """A fresh trainer on the resident model for one pack."""
        return PackedTrainer(self.model, self.tokenizer, self.data, **self._trainer_kwargs(request))

    @staticmethod
    def _agree(value: Any) -> Any:
        """The value every process of the job acts on (one process: its own)."""
        return value

    def run(self, request: PackRequest, hooks: PackHooks | None = None) -> PackOutcome:
        """Train ``request.configs`` packed until each finishes, is stopped or the job aborts.

        Out of memory is an outcome (``OutcomeStatus.OOM``), not an exception: the session
        stays usable for a smaller pack.
        """
        load_s = 0.0 if self._load_charged else self.load_s
        self._load_charged = True
        clock = JobClock()
        trainer = None
        job: PackJob | None = None
        try:
            with clock.phase("start"):
                trainer = self._trainer(request)
                job = PackJob(
                    trainer, self.data, self.tokenizer, request, clock,
                    agree=self._agree, writer=self._writer,
                )  # fmt: skip
                job.start()
            job.train(hooks)
            job.drain_exports()  # the outcome names adapter directories: they exist now
        except torch.OutOfMemoryError as e:
            notes = tuple(job.notes) if job is not None else ()
            return PackOutcome(
                job_id=request.job_id,
                status=OutcomeStatus.OOM,
                timings=clock.timings(load_s=load_s, model_loads=self.model_loads),
                error=str(e).splitlines()[0][:300] if str(e) else "out of memory",
                notes=notes,
            )
        finally:
            if job is not None:
                job.exports.close()  # no write outlives its job (errors: raised above or moot)
            if trainer is not None:
                for cid in list(trainer.adapters):
                    trainer.release(cid)  # the next pack starts on a clean base
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        assert job is not None  # set before the loop ran
        return PackOutcome(
            job_id=request.job_id,
            results=dict(job.results),
            profile=job.trainer.profile(),
            timings=clock.timings(load_s=load_s, model_loads=self.model_loads),
            notes=tuple(job.notes),
        )


def run_pack(
    *,
    model: ModelRef | str | dict[str, Any],
    configs: list[LoRAConfig],
    dataset: DatasetSpec | dict[str, Any],
    out_dir: str | os.PathLike[str],
    device: str | torch.device | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    checkpoint_every_s: float | None = None,
    resume: bool = True,
    hooks: PackHooks | None = None,
    max_rows: int | None = None,
    gradient_checkpointing: bool = False,
    evaluate: bool = True,
    fused_kernels: FusedKernels | str = FusedKernels.AUTO,
    cuda_graphs: CudaGraphs | str | bool = CudaGraphs.AUTO,
) -> PackResult:
    """Load ``model`` and train ``configs`` packed on it until each finishes or is stopped.

    The one-shot form of :class:`PackSession` (which a resident worker keeps for many packs).

    Args:
        model: the base model (``ModelRef``, its dict, or a name/path).
        configs: the pack.
        dataset: the data (``DatasetSpec`` or its dict).
        out_dir: adapters go to ``out_dir/adapters/<config_id>/`` (PEFT format).
        device: ``"cuda"``/``"cpu"``; default CUDA when available (bf16 base + autocast).
        checkpoint_dir: train-state checkpoints and the results so far.
        checkpoint_every: checkpoint every this many steps (None: only at the end).
        checkpoint_every_s: also checkpoint when this many seconds passed since the last one
            (None: no time-based checkpoints).
        resume: continue from ``checkpoint_dir`` when it holds a train-state.
        hooks: metrics sink and control source (see :class:`PackHooks`).
        max_rows: most sequences per forward (gradient accumulation beyond).
        gradient_checkpointing: recompute base activations in backward.
        evaluate: evaluate each completed adapter on the eval split.
        fused_kernels: Liger-Kernel's fused ops on the base: auto | on | off
            (:func:`plora.engine.liger.apply_fused_kernels`).
        cuda_graphs: replay the steady step as CUDA graphs: auto | on | off
            (:class:`~plora.config.CudaGraphs`).

    Raises:
        torch.OutOfMemoryError: the pack does not fit even with gradient accumulation.
    """
    policy = CheckpointPolicy(
        dir=None if checkpoint_dir is None else str(checkpoint_dir),
        every_steps=checkpoint_every,
        every_s=checkpoint_every_s,
    )
    request = PackRequest(
        job_id="run_pack",
        configs=tuple(configs),
        out_dir=str(out_dir),
        checkpoint=policy,
        resume=resume,
        evaluate=evaluate,
    )
    ref = ModelRef(**model) if isinstance(model, dict) else model
    spec = DatasetSpec(**dataset) if isinstance(dataset, dict) else dataset
    session = PackSession(
        EngineSpec(
            model=ModelRef(name_or_path=ref) if isinstance(ref, str) else ref,
            dataset=spec,
            gradient_checkpointing=gradient_checkpointing,
            device=None if device is None else str(device),
            max_rows=max_rows,
            fused_kernels=FusedKernels.parse(fused_kernels, "fused_kernels"),
            cuda_graphs=CudaGraphs.parse(cuda_graphs),
        )
    )
    outcome = session.run(request, hooks)
    if outcome.status is OutcomeStatus.OOM:
        raise torch.OutOfMemoryError(outcome.error or "out of memory")
    return PackResult(results=dict(outcome.results), profile=outcome.profile, notes=outcome.notes)


__all__ = [
    "ConfigResult",
    "Control",
    "PackHooks",
    "PackResult",
    "PackSession",
    "run_pack",
]
