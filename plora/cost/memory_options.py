"""What a job's memory depends on besides its shapes: precision, kernels, options, and the
per-component result (the vocabulary of :mod:`plora.cost.memory`'s App. A formulas).

Precision (:class:`Precision`). The default :data:`PEFT_AMP` is what PEFT + HF ``Trainer``
do under bf16 autocast: LoRA weights stay fp32 (4 B), fp32 grads (4 B), AdamW m and v
(8 B) -- 16 bytes per LoRA parameter. :data:`PURE_BF16` (torchtune, the paper's prototype)
keeps everything in bf16: 2 + 2 + 4 = 8 bytes, which is the paper's
``c_prec·(1 + c_grad)`` with ``c_grad = 3``.

QLoRA (:func:`quantized`) stores the base projections as NF4 and dequantizes them per layer;
:class:`Loss` and :class:`Attention` say which kernels keep which activations;
:class:`MemoryOptions` bundles them with checkpointing, ZeRO stage and the reserve;
:class:`MemoryBreakdown` is the bytes per GPU by component the formulas return.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from plora.config import ConfigError

GIB = float(1 << 30)

#: Bytes per weight of a bitsandbytes NF4 layer with double quantization: 4-bit codes, an
#: 8-bit absmax per 64 weights and an fp32 constant per 256 blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1.0 / 64 + 4.0 / (64 * 256)


class Loss(StrEnum):
    """How the LM head and cross-entropy keep logits alive."""

    EAGER = "eager"
    """HF: logits, their fp32 copy, the saved log-softmax and its gradient (bf16: 14·V B/token;
    fp32: 12·V)."""
    CHUNKED = "chunked"
    """torchtune-style chunked CE (8 chunks): logits + one chunk's fp32 work (bf16: 3.5·V)."""
    FUSED = "fused"
    """Fused linear-cross-entropy (Liger) or plora's chunked-and-recomputed CE: logits are
    never materialized for all tokens."""


class Attention(StrEnum):
    """Attention kernel: memory-efficient (SDPA/flash, no s² tensor) or eager (keeps probs)."""

    SDPA = "sdpa"
    EAGER = "eager"


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """Bytes per element of each memory component."""

    base_weight_bytes: float = 2.0
    """Frozen projection weights: 2 (bf16) or :data:`NF4_BYTES_PER_PARAM` (QLoRA)."""
    adapter_param_bytes: float = 4.0
    """LoRA A and B."""
    adapter_grad_bytes: float = 4.0
    """Their gradients."""
    optimizer_bytes: float = 8.0
    """AdamW state per LoRA parameter (m and v)."""
    activation_bytes: float = 2.0
    """Saved activations (bf16 autocast: 2)."""
    dequant_bytes: float = 0.0
    """Bytes moved per projection weight and pass to use a quantized base: the dense copy
    written by the dequantization and read by the GEMM (QLoRA in bf16: 2 + 2 = 4; fp32: 8);
    0 for a dense base. Forward and backward each dequantize again (the step-time model), and
    one projection's dense copy is alive at a time (``dequant_buffer`` in :func:`base_memory`)."""


#: PEFT under bf16 autocast: fp32 LoRA weights, grads and AdamW state (16 B/param).
PEFT_AMP = Precision()
#: Everything in bf16 (torchtune's LoRA recipes; the paper's prototype): 8 B/param.
PURE_BF16 = Precision(adapter_param_bytes=2.0, adapter_grad_bytes=2.0, optimizer_bytes=4.0)
#: Everything fp32 (CPU training).
FULL_FP32 = Precision(base_weight_bytes=4.0, activation_bytes=4.0)
#: QLoRA: NF4 base projections dequantized to bf16 per layer, PEFT-style fp32 adapters.
QLORA_NF4 = Precision(base_weight_bytes=NF4_BYTES_PER_PARAM, dequant_bytes=4.0)
#: QLoRA on the CPU: NF4 base projections, everything else fp32.
QLORA_NF4_FP32 = Precision(
    base_weight_bytes=NF4_BYTES_PER_PARAM, activation_bytes=4.0, dequant_bytes=8.0
)


def quantized(precision: Precision, quantization: str) -> Precision:
    """``precision`` with its base projections stored as ``quantization`` (``none`` | ``nf4``).

    ``nf4``: :data:`NF4_BYTES_PER_PARAM` per projection weight, dequantized per layer into the
    activation dtype (:attr:`Precision.dequant_bytes`); the adapters' bytes are unchanged.
    """
    if quantization == "none":
        return precision
    if quantization != "nf4":
        raise ConfigError(f"quantization={quantization!r}: use none or nf4")
    dense = max(2.0, precision.activation_bytes)
    return replace(precision, base_weight_bytes=NF4_BYTES_PER_PARAM, dequant_bytes=2.0 * dense)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryOptions:
    """How the job is run, as far as memory is concerned."""

    precision: Precision = PEFT_AMP
    """Bytes per element; see :data:`PEFT_AMP`, :data:`PURE_BF16`, :data:`QLORA_NF4`."""
    checkpointing: bool = False
    """Per-layer activation checkpointing."""
    fused_kernels: bool = False
    """Fused RMSNorm and SwiGLU (e.g. Liger-Kernel)."""
    loss: Loss = Loss.EAGER
    """How logits are kept for the loss."""
    attention: Attention = Attention.SDPA
    """Attention kernel."""
    zero_stage: int = 0
    """ZeRO stage of the adapter state under FSDP (base weights are always sharded): 0 keeps
    adapters replicated, as ``plora.parallel`` runs them; 1-3 shard them as ZeRO does."""
    reserved_bytes: float = 1.0 * GIB
    """CUDA context, cuBLAS and NCCL workspaces: outside the torch allocator's count."""
    activation_scale: float = 1.0
    """Multiplier on base activations (set by a refit against measured peaks)."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.reserved_bytes < 0 or self.activation_scale <= 0:
            raise ConfigError("reserved_bytes must be >= 0 and activation_scale > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes per GPU by component; ``total`` is their sum."""

    components: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Sum of all components, bytes."""
        return float(sum(self.components.values()))

    def gib(self) -> dict[str, float]:
        """Components in GiB, rounded to 3 decimals, plus ``total``."""
        out = {k: round(v / GIB, 3) for k, v in self.components.items()}
        out["total"] = round(self.total / GIB, 3)
        return out

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        keys = dict.fromkeys([*self.components, *other.components])
        return MemoryBreakdown(
            components={k: self.components.get(k, 0.0) + other.components.get(k, 0.0) for k in keys}
        )


__all__ = [
    "FULL_FP32",
    "GIB",
    "NF4_BYTES_PER_PARAM",
    "PEFT_AMP",
    "PURE_BF16",
    "QLORA_NF4",
    "QLORA_NF4_FP32",
    "Attention",
    "Loss",
    "MemoryBreakdown",
    "MemoryOptions",
    "Precision",
    "quantized",
]
