"""Liger-Kernel's fused RMSNorm, SwiGLU and RoPE on the frozen base: :func:`apply_fused_kernels`.

The one place plora applies Liger-Kernel (``training.fused_kernels``, resolved by
:func:`plora.config.fused.use_fused_kernels`): the resident engine calls it on the model it loads
for training and packed evaluation (:class:`plora.engine.session.PackSession`), and the benchmarks
call it to measure what a sweep runs.

What changes, per model instance. Liger's ``apply_liger_kernel_to_<model_type>(model=...)``
binds its ``LigerRMSNorm.forward`` on every norm of the instance and ``LigerSwiGLUMLP.forward``
on every MLP (the MLP still calls its own ``gate_proj`` / ``up_proj`` / ``down_proj``, so packed
LoRA layers injected there keep working), i.e. per layer ``y = rms_norm(x) ⊙ w`` and
``down(silu(gate(x)) ⊙ up(x))`` in one Triton kernel each, forward and backward. It also
rebinds names module-wide in ``transformers.models.<type>.modeling_<type>``: the norm and MLP
classes (every model built later in the process) and ``apply_rotary_pos_emb`` (every model of
that type, already built or not). plora keeps the per-instance patches and undoes the module-wide
ones at once, except RoPE, which the attention reads from the module at call time: it becomes a
switch that runs Liger's kernel only inside the attention modules of a patched model (a context
variable set by their forward -- also when activation checkpointing recomputes a layer in
backward) and the stock function everywhere else. So a model built later in the same process
(another pack's reference, a CPU model in a test) runs unpatched, and Liger never runs on CPU.

Not applied: Liger's cross-entropy and fused linear cross-entropy. plora's loss
(:mod:`plora.engine.loss`) is its own fused linear + cross-entropy that weights each adapter's
tokens by ``1 / N_i`` (each adapter's own mean); the trainer calls the decoder and that loss,
never the model's ``forward(labels=...)``, so the loss is unchanged by this module.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plora.config.fused import FusedKernels, use_fused_kernels

#: Set while a patched model's attention runs: RoPE then takes Liger's kernel.
_IN_FUSED_LAYER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "plora_in_fused_layer", default=False
)
#: Instance attribute marking a model patched here (the call is idempotent).
_MARK = "_plora_fused_kernels"


def apply_fused_kernels(
    model: nn.Module,
    setting: FusedKernels | str | bool = FusedKernels.AUTO,
    *,
    device: torch.device | str | None = None,
) -> bool:
    """Patch ``model``'s RMSNorm, SwiGLU and RoPE with Liger-Kernel's when ``setting`` resolves on.

    Args:
        model: a HF causal LM (its ``config.model_type`` picks Liger's patch).
        setting: auto | on | off (``training.fused_kernels``).
        device: where the model runs; default the device of its first parameter. Liger runs on
            CUDA only: on any other device the model is left as it is (``on`` raises).

    Returns:
        Whether the model now runs Liger's fused ops.

    Raises:
        ConfigError: ``on`` where it cannot run (not installed, not CUDA, unsupported type).
    """
    if getattr(model, _MARK, False):
        return True
    if device is None:
        device = next(iter(model.parameters())).device
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    cuda = torch.device(device).type == "cuda"
    if not use_fused_kernels(setting, cuda=cuda, model_type=model_type):
        return False
    import liger_kernel.transformers as lk

    patch = getattr(lk, f"apply_liger_kernel_to_{model_type}")
    patch_instance(model, patch)
    return True


def patch_instance(model: nn.Module, patch: Callable[..., None]) -> None:
    """Run Liger's ``patch(model=model, ...)`` and confine it to ``model`` (module docstring).

    Args:
        model: the HF causal LM to patch.
        patch: Liger's ``apply_liger_kernel_to_<model_type>``.
    """
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    names = (type(model).__module__, f"transformers.models.{model_type}.modeling_{model_type}")
    modules = []
    for name in dict.fromkeys(names):  # imported first: the patch rebinds names in it
        with contextlib.suppress(ImportError):
            modules.append(importlib.import_module(name))
    before = [dict(vars(m)) for m in modules]
    kwargs = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                  fused_linear_cross_entropy=False)  # fmt: skip
    accepted = inspect.signature(patch).parameters
    patch(model=model, **{k: v for k, v in kwargs.items() if k in accepted})
    for modeling, old_vars in zip(modules, before, strict=True):
        _confine(modeling, old_vars)
    decoder: Any = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    for layer in decoder.layers:
        # the attention, not the layer: checkpointing recomputes the layer's class forward
        # (transformers' GradientCheckpointingLayer), which still calls the attention module
        attn = getattr(layer, "self_attn", layer)
        attn.forward = _scoped(attn.forward)
    setattr(model, _MARK, True)


def _confine(modeling: types.ModuleType, before: dict[str, Any]) -> None:
    """Undo what a patch rebound in ``modeling``: classes back, functions behind a switch."""
    for name, value in list(vars(modeling).items()):
        old = before.get(name, _MISSING)
        if old is value:
            continue
        if old is _MISSING:
            delattr(modeling, name)
        elif isinstance(value, types.FunctionType) and not isinstance(old, type):
            # a function the attention looks up at call time (RoPE): switched per model
            stock = old.stock if isinstance(old, _LayerSwitch) else old
            setattr(modeling, name, _LayerSwitch(stock=stock, fused=value))
        else:  # a class: the instance's modules are patched already; later models stay stock
            setattr(modeling, name, old)


class _LayerSwitch:
    """A module-level function that takes Liger's version inside a patched model's attention."""

    def __init__(self, *, stock: Callable[..., Any], fused: Callable[..., Any]) -> None:
        self.stock, self.fused = stock, fused
        self.__name__ = getattr(stock, "__name__", "switch")
        self.__doc__ = getattr(stock, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.fused if _IN_FUSED_LAYER.get() else self.stock
        return fn(*args, **kwargs)


def _scoped(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run with :data:`_IN_FUSED_LAYER` set (and reset after, on error too)."""

    def scoped_forward(*args: Any, **kwargs: Any) -> Any:
        token = _IN_FUSED_LAYER.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _IN_FUSED_LAYER.reset(token)

    return scoped_forward


def is_fused(model: nn.Module) -> bool:
    """Whether :func:`apply_fused_kernels` patched ``model``."""
    return bool(getattr(model, _MARK, False))


_MISSING = object()

__all__ = ["apply_fused_kernels", "is_fused", "patch_instance"]
