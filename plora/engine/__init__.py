"""The packed multi-LoRA training engine.

* :mod:`plora.engine.lora` -- :class:`PackedLoRALinear`, :func:`inject`, slot routing contexts.
* :mod:`plora.engine.trainer` -- :class:`PackedTrainer` (one forward/backward per step over
  every active adapter, per-adapter loss, AdamW, schedule and clipping).
* :mod:`plora.engine.packed_optim` -- :class:`PackedAdamW` (one AdamW step over every adapter's
  rows of the packed parameters, per-adapter lr, weight decay, step count and clipping).
* :mod:`plora.engine.checkpoint` -- PEFT-format export, exact train-state checkpoints.
* :mod:`plora.engine.api` -- the typed engine/runtime boundary (request, outcome, hooks).
* :class:`PackSession` -- a resident base model serving successive packs (a worker's engine);
  :func:`run_pack` -- load and train one pack to completion.

Submodules load lazily so that ``import plora.engine`` stays light (no transformers import).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "PackedLoRALinear": "plora.engine.lora",
    "inject": "plora.engine.lora",
    "set_kernel_backend": "plora.engine.fused",
    "packed_segments": "plora.engine.lora",
    "use_slot": "plora.engine.lora",
    "base_only": "plora.engine.lora",
    "PackedTrainer": "plora.engine.trainer",
    "PackedAdamW": "plora.engine.packed_optim",
    "StepMetrics": "plora.engine.reports",
    "StepProfile": "plora.engine.reports",
    "PackProfile": "plora.engine.reports",
    "AdapterStatus": "plora.engine.reports",
    "export_peft_adapter": "plora.engine.checkpoint",
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
