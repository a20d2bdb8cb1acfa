"""Whether the frozen base runs Liger-Kernel's fused ops: ``training.fused_kernels``.

One switch, one resolution, read by every part that must agree on it:

* the engine (:func:`plora.engine.liger.apply_fused_kernels`) patches the loaded base model's
  RMSNorm, SwiGLU MLP and RoPE with Liger-Kernel's Triton kernels when the switch resolves on;
* the cost model (:func:`plora.cost.build.build_cost_model`) books the fused activation memory
  (``MemoryOptions.fused_kernels``) and starts from the Liger step-time coefficients, and the
  profile store keeps fused steps apart (:func:`fused_profile_key`, which also keeps a graphed
  sweep's steps apart);
* ``plora validate`` / ``plora sweep`` refuse ``on`` where it cannot run, before any Ray work.

``auto`` (the default) resolves on exactly when ``liger_kernel`` is importable, the base runs on
CUDA (Liger is Triton-only: never on CPU) and its ``model_type`` is one Liger patches
(:data:`LIGER_MODEL_TYPES`); ``on`` demands it (an error names what is missing); ``off`` never.
"""

from __future__ import annotations

import importlib.util
from enum import StrEnum
from typing import Any

from plora.config.errors import ConfigError
from plora.config.validate import as_switch

#: The sweep-file key of the switch (for error messages).
FUSED_KERNELS_KEY = "training.fused_kernels"
#: How to get Liger-Kernel (plora's optional extra).
LIGER_INSTALL = 'pip install "plora[liger]"'
#: ``model_type`` s whose RMSNorm, SwiGLU and RoPE Liger-Kernel patches (``apply_liger_kernel_to_*``)
#: and plora trains (:data:`plora.model_spec.SUPPORTED_MODEL_TYPES`).
LIGER_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")


class FusedKernels(StrEnum):
    """``training.fused_kernels``: Liger-Kernel's fused ops on the frozen base."""

    AUTO = "auto"
    """On when Liger-Kernel is installed, the base runs on CUDA and its model type is supported."""
    ON = "on"
    """Always; an error when it cannot be (not installed, CPU, unsupported model type)."""
    OFF = "off"
    """Never: the stock Hugging Face modules."""

    @classmethod
    def parse(cls, value: Any, key: str = FUSED_KERNELS_KEY) -> FusedKernels:
        """``value`` as a member (``True``/``False`` read as on/off, as YAML writes them)."""
        fix = "auto uses Liger-Kernel when it is installed and the base runs on CUDA"
        return cls(as_switch(value, key, fix=fix))


def liger_installed() -> bool:
    """Whether ``liger_kernel`` is importable here (found, not imported: it pulls in Triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def use_fused_kernels(
    setting: FusedKernels | str | bool,
    *,
    cuda: bool,
    model_type: str,
    installed: bool | None = None,
    key: str = FUSED_KERNELS_KEY,
) -> bool:
    """Resolve the switch: whether the base runs Liger-Kernel's fused ops.

    Args:
        setting: auto | on | off.
        cuda: whether the base runs on a CUDA device (the sweep's ``hardware.gpu_type`` is not
            ``cpu``; the engine's device).
        model_type: the base's HF ``model_type``.
        installed: whether ``liger_kernel`` is importable; None: probe this environment.
        key: the key named in errors.

    Raises:
        ConfigError: ``on`` where it cannot run (one line: what is missing and what to do).
    """
    mode = FusedKernels.parse(setting, key)
    if mode is FusedKernels.OFF:
        return False
    have = liger_installed() if installed is None else installed
    if mode is FusedKernels.AUTO:
        return have and cuda and model_type in LIGER_MODEL_TYPES
    if not cuda:
        raise ConfigError(
            "Liger-Kernel's fused ops are Triton kernels and run on CUDA only; this base runs "
            "on CPU", key=key, value=str(mode), fix="use auto or off on CPU",
        )  # fmt: skip
    if model_type not in LIGER_MODEL_TYPES:
        raise ConfigError(
            f"plora applies Liger-Kernel to model types {', '.join(LIGER_MODEL_TYPES)}, not "
            f"{model_type!r}", key=key, value=str(mode), fix="use auto or off for this model",
        )  # fmt: skip
    if not have:
        raise ConfigError(
            "Liger-Kernel is not installed", key=key, value=str(mode),
            fix=f"{LIGER_INSTALL} (or set {key}: auto)",
        )  # fmt: skip
    return True


def fused_profile_key(profile_key: str, fused: bool, cuda_graphs: bool = False) -> str:
    """The profile-store name of a base's measured steps: fused steps are faster and use less
    activation memory than stock ones, so they are profiled apart (``Qwen/Qwen2.5-3B+liger``);
    so are the steps of a sweep whose one-GPU steps replay as CUDA graphs
    (``training.cuda_graphs``: less host overhead; ``Qwen/Qwen2.5-3B+liger+graphs``)."""
    return profile_key + ("+liger" if fused else "") + ("+graphs" if cuda_graphs else "")


__all__ = [
    "FUSED_KERNELS_KEY",
    "LIGER_INSTALL",
    "LIGER_MODEL_TYPES",
    "FusedKernels",
    "fused_profile_key",
    "liger_installed",
    "use_fused_kernels",
]
