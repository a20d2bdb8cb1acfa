"""The packed multi-LoRA training engine.

* :mod:`plora.engine.lora` -- :class:`PackedLoRALinear`, the packed layer and its math;
  :mod:`plora.engine.adapters` -- :func:`inject`, adapters into slots, slot routing contexts.
* :mod:`plora.engine.data` -- load and tokenize (:mod:`.rows`, :mod:`.example`); per-adapter
  streams and a step's packed batch (:mod:`.batch`).
* :mod:`plora.engine.trainer` -- :class:`PackedTrainer` (one forward/backward per step over
  every active adapter, per-adapter loss, AdamW, schedule and clipping); its adapters'
  running records and what a step reports (:mod:`.step_record`).
* :mod:`plora.engine.packed_optim` -- :class:`PackedAdamW` (one AdamW step over every adapter's
  rows of the packed parameters, per-adapter lr, weight decay, step count and clipping).
* :mod:`plora.engine.checkpoint` -- PEFT-format export, exact train-state checkpoints.
* :mod:`plora.engine.api` -- the typed engine/runtime boundary (request, outcome, hooks);
  :mod:`plora.engine.reports` -- what the trainer reports (step metrics, profiles, statuses).
* :mod:`plora.engine.run` -- :class:`PackSession`, a resident base model serving successive
  packs (a worker's engine), and :func:`run_pack`, load and train one pack to completion.
* :mod:`plora.engine.liger` -- :func:`apply_fused_kernels`, Liger-Kernel's fused RMSNorm,
  SwiGLU and RoPE on the loaded base (``training.fused_kernels``; CUDA only).

Submodules load lazily so that ``import plora.engine`` stays light (no transformers import).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "PackedLoRALinear": "plora.engine.lora",
    "inject": "plora.engine.adapters",
    "set_kernel_backend": "plora.engine.fused",
    "packed_segments": "plora.engine.adapters",
    "use_slot": "plora.engine.adapters",
    "base_only": "plora.engine.adapters",
    "PackedTrainer": "plora.engine.trainer",
    "apply_fused_kernels": "plora.engine.liger",
    "PackedAdamW": "plora.engine.packed_optim",
    "StepMetrics": "plora.engine.reports",
    "StepProfile": "plora.engine.reports",
    "PackProfile": "plora.engine.reports",
    "AdapterStatus": "plora.engine.reports",
    "export_peft_adapter": "plora.engine.export",
    "save_train_state": "plora.engine.checkpoint",
    "load_train_state": "plora.engine.checkpoint",
    "run_pack": "plora.engine.run",
    "PackSession": "plora.engine.run",
    "PackResult": "plora.engine.run",
    "Control": "plora.engine.reports",
    "CheckpointPolicy": "plora.engine.api",
    "ConfigResult": "plora.engine.api",
    "EngineSpec": "plora.engine.api",
    "JobTimings": "plora.engine.api",
    "OutcomeStatus": "plora.engine.api",
    "PackEngine": "plora.engine.api",
    "PackHooks": "plora.engine.api",
    "PackOutcome": "plora.engine.api",
    "PackRequest": "plora.engine.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'plora.engine' has no attribute {name!r}")
