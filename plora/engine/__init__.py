"""The packed multi-LoRA training engine: one copy of the base model, many adapters per step.

:class:`PackSession` (:mod:`.session`) serves successive packs on a resident model, each a
:class:`~.job.PackJob` over a :class:`~.trainer.PackedTrainer`; :mod:`.api` is the typed
boundary with the runtime. ARCHITECTURE.md lists the modules by role. Submodules load lazily so
that ``import plora.engine`` stays light (no transformers import).
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
    "run_pack": "plora.engine.session",
    "PackSession": "plora.engine.session",
    "PackResult": "plora.engine.session",
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
