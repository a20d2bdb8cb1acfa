"""QLoRA bases: the decoder's frozen projections stored in 4-bit NormalFloat (NF4).

:func:`quantize_model` replaces the weight of every targeted ``nn.Linear`` of the decoder
(``layers.N.*.{q,k,v,o,gate,up,down}_proj``) by a frozen torchao ``NF4Tensor``; the module
stays an ``nn.Linear`` (so :func:`plora.engine.adapters.inject` and PEFT wrap it as usual) and
``F.linear`` on it dispatches to torchao's ``linear_nf4``::

    y = x · deq(W_q)ᵀ + b,     deq(W_q)[j] = NF4[c_j] · (s8_k / f_g + μ)        (block k ∋ j)

with ``c_j`` the 4-bit code of weight ``j`` (two per byte), ``s8_k`` the int8 absmax scale of
its block of :data:`BLOCK_SIZE` weights, double-quantized per group ``g`` of
:data:`SCALER_BLOCK_SIZE` blocks (``f_g`` one factor per group, ``μ`` the mean scale): 0.5 +
1/64 + 2/16384 ≈ 0.516 bytes per weight in bf16 (QLoRA, Dettmers et al. 2023, App. E). The
dequantized weight is computed in the dtype the model was loaded in (bf16 on GPUs, fp32 on the
CPU) whenever the layer runs, forward and backward (``linear_nf4`` saves the 4-bit tensor, not
the dense one); embeddings, norms and the LM head stay in the model dtype.

Library. torchao's ``NF4Tensor`` (the ``qlora`` extra) rather than bitsandbytes ``Linear4bit``:
it is a pure-PyTorch tensor subclass (no CUDA binary needed), so the same code quantizes and
trains on the CPU -- where the equivalence tests run -- and on any GPU; it is what torchtune's
QLoRA recipes use and it composes with FSDP2 (``fsdp_pre_all_gather``). bitsandbytes' 4-bit
GEMM is a GEMV for batch-1 inference; for training it also dequantizes and then runs a dense
GEMM, so it would buy no speed here. The format is bitsandbytes' NF4 with
``bnb_4bit_use_double_quant`` (blocks of 64, scales double-quantized in groups of 256, codes
from the unrounded block absmax); the scales' second quantization differs (torchao: linear
int8, bitsandbytes: its 8-bit dynamic map), so the same checkpoint quantized by either library
gives weights that agree to within that rounding, not bit for bit.

Block sizes. Projections whose weight count is not a multiple of 64 cannot be stored in NF4
(no real model has one; a :class:`~plora.config.ConfigError` names the module). The scale
groups are 256 blocks where the block count allows it and the largest power of two dividing it
otherwise (toy models: a 32x64 projection has 32 blocks).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from plora.config import PROJECTIONS, QUANTIZATIONS, ConfigError
from plora.utils import import_torchao_quietly

#: Weights per NF4 block (one absmax scale each), as in QLoRA and bitsandbytes.
BLOCK_SIZE = 64
#: Blocks per double-quantization group of the scales.
SCALER_BLOCK_SIZE = 256
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def require_torchao() -> Any:
    """``torchao``'s NF4 module, or a one-line :class:`ConfigError` saying how to install it."""
    try:
        return import_torchao_quietly()
    except ImportError as err:
        raise ConfigError(
            f"cannot import torchao ({err})",
            key="model.quantization",
            value="nf4",
            fix="pip install 'plora[qlora]' (torchao), or set quantization: none",
        ) from None


_NF4_MODULES = (
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
    "torchao.dtypes.nf4tensor",
)


def is_nf4(tensor: Any) -> bool:
    """Whether ``tensor`` is a torchao ``NF4Tensor`` (False without importing torchao)."""
    for name in _NF4_MODULES:
        mod = sys.modules.get(name)
        if mod is not None and isinstance(tensor, mod.NF4Tensor):
            return True
    return False


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer whose weight is stored in NF4."""
    return isinstance(module, nn.Linear) and is_nf4(module.weight)


def scaler_block_size(numel: int) -> int:
    """Blocks per scale group for a weight of ``numel`` values (see the module docstring)."""
    blocks = numel // BLOCK_SIZE
    size = SCALER_BLOCK_SIZE
    while blocks % size:
        size //= 2
    return size


def to_nf4(weight: torch.Tensor, *, name: str = "weight") -> torch.Tensor:
    """``weight`` (out, in) as a frozen ``NF4Tensor`` with double-quantized block scales."""
    nf4 = require_torchao()
    if weight.numel() % BLOCK_SIZE:
        raise ConfigError(
            f"{name}: {tuple(weight.shape)} has {weight.numel()} weights, not a multiple of "
            f"{BLOCK_SIZE}: it cannot be stored in NF4",
            key="model.quantization",
            value="nf4",
            fix="use quantization: none for this model",
        )
    return nf4.to_nf4(
        weight.detach().contiguous(),
        block_size=BLOCK_SIZE,
        scaler_block_size=scaler_block_size(weight.numel()),
    )


def quantize_model(
    model: nn.Module,
    method: str = "nf4",
    *,
    targets: Iterable[str] = PROJECTIONS,
    device: str | torch.device | None = None,
) -> int:
    """Store the ``targets`` projections of every decoder layer of ``model`` in ``method``.

    Each weight is moved to ``device`` (default: where it is) and quantized there, one layer
    at a time, so a GPU never holds more than one dense projection beyond the quantized model;
    move the rest of the model afterwards (``model.to(device)`` keeps NF4 weights NF4).
    Already-quantized layers are skipped; the model's parameters are frozen.

    Args:
        model: a Llama/Qwen2-style causal LM (``...layers.N.self_attn.q_proj`` ...).
        method: ``"nf4"`` (``"none"`` does nothing).
        targets: projection names to quantize.
        device: where to quantize (and keep) the projection weights.

    Returns:
        How many projections were quantized by this call.
    """
    if method not in QUANTIZATIONS:
        raise ConfigError(
            "unknown quantization", key="model.quantization", value=method,
            fix=f"use one of {', '.join(QUANTIZATIONS)}",
        )  # fmt: skip
    if method == "none":
        return 0
    targets = tuple(targets)
    model.requires_grad_(False)
    count = 0
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or not _LAYER_RE.search(name + "."):
            continue
        if not isinstance(module, nn.Linear) or is_nf4(module.weight):
            continue
        weight = module.weight.detach()
        if device is not None:
            weight = weight.to(device)
        module.weight = nn.Parameter(to_nf4(weight, name=name), requires_grad=False)
        count += 1
    if count == 0 and not any(is_quantized(m) for m in model.modules()):
        raise ConfigError(
            "no Llama/Qwen2-style projection (layers.N.*.q_proj ...) to quantize",
            key="model.quantization",
            value=method,
            fix="use quantization: none for this model",
        )
    return count


def dense_weight(module: nn.Linear, dtype: torch.dtype) -> torch.Tensor:
    """``module``'s weight as a dense ``dtype`` tensor (dequantized if it is NF4)."""
    weight: Any = module.weight
    if is_nf4(weight):
        return weight.get_original_weight().to(dtype)
    return weight.to(dtype)


@contextlib.contextmanager
def recompute_saved(dense: torch.Tensor, rebuild: Any) -> Iterator[None]:
    """Autograd keeps ``rebuild()`` instead of ``dense`` for backward inside the block.

    A fused kernel that takes a dequantized weight saves it for ``dX = dY·W``; kept, the dense
    weights of every layer would live until backward and the 4-bit storage would save nothing.
    Inside this context a saved tensor that is ``dense`` (or a view of its storage) is stored
    as a recipe and rebuilt -- dequantized again -- when backward needs it, as ``linear_nf4``
    does for the unfused path.

    Every other saved tensor goes to the saved-tensor hooks this context was entered under
    (:func:`torch.utils.checkpoint`'s, under activation checkpointing): autograd applies only
    the innermost hooks, so passing them through unchanged would keep the kernel's inputs and
    LoRA intermediates of every checkpointed layer alive until backward (measured on the CPU:
    ``a·(3h + i)`` bytes per token and layer beyond the layer input a checkpoint keeps,
    ``tests/unit/test_qlora_checkpoint_memory.py``).
    """
    # the hooks live as long as the graph: they must not hold ``dense`` itself
    ptr, device = dense.untyped_storage().data_ptr(), dense.device
    # the enclosing (pack, unpack) pair, None outside any (torch has no public getter for it)
    outer = _enclosing_saved_tensor_hooks()

    def pack(t: torch.Tensor) -> Any:
        if t.device == device and t.untyped_storage().data_ptr() == ptr:
            return _Rebuild(rebuild, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
        return t if outer is None else _Outer(outer[0](t), outer[1])

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _Rebuild):
            return saved()
        if isinstance(saved, _Outer):
            return saved.unpack(saved.packed)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _enclosing_saved_tensor_hooks() -> tuple[Any, Any] | None:
    """The innermost saved-tensor hooks already active (a checkpoint's), or None; None also
    where this torch has no such getter (older releases: their checkpoints then keep what the
    fused path saves, as before)."""
    try:
        top: tuple[Any, Any] | None = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):
        return None
    return top


class _Outer:
    """A saved tensor as the enclosing hooks packed it (e.g. a checkpoint's holder), and their
    unpack hook."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: Any, unpack: Any) -> None:
        self.packed, self.unpack = packed, unpack


class _Rebuild:
    """A saved tensor to rebuild in backward: ``rebuild()`` viewed with the saved geometry."""

    __slots__ = ("offset", "rebuild", "shape", "stride")

    def __init__(self, rebuild: Any, shape: tuple, stride: tuple, offset: int) -> None:
        self.rebuild, self.shape, self.stride, self.offset = rebuild, shape, stride, offset

    def __call__(self) -> torch.Tensor:
        return self.rebuild().as_strided(self.shape, self.stride, self.offset)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes held by the NF4 weights of ``model`` (codes, scales and group factors)."""
    total = 0
    for module in model.modules():
        if is_quantized(module):
            w: Any = module.weight
            for part in (w.quantized_data, w.quantized_scalers, w.quantization_factor):
                total += part.numel() * part.element_size()
    return total


__all__ = [
    "BLOCK_SIZE",
    "SCALER_BLOCK_SIZE",
    "dense_weight",
    "import_torchao_quietly",
    "is_nf4",
    "is_quantized",
    "quantize_model",
    "quantized_bytes",
    "recompute_saved",
    "require_torchao",
    "scaler_block_size",
    "to_nf4",
]
