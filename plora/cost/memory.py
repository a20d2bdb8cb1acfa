"""Per-GPU memory of a packed LoRA job (PLoRA App. A, made concrete for HF training).

The job's peak memory on each of its ``d`` GPUs is split as the planner needs it (Eq. 14):

``M = M_base + Σ_k M_lora,k``

* ``M_base`` (:func:`base_memory`): frozen weights (bf16, or NF4 for QLoRA), the FSDP gather
  buffer, and a fixed reserve for the CUDA context and cuBLAS/NCCL workspaces.
* ``M_lora,k`` (:func:`adapter_memory`): everything that grows with config k: its LoRA
  parameters, gradients and AdamW state, the LoRA activations of its tokens
  (``b·s·r`` per targeted projection, plus the dropout input copy and mask), **and the frozen
  base's activations for its own b·s tokens**. The paper books base activations under
  ``M_base``; in a packed job every config brings its own rows, so they scale with the pack
  and belong to the config.

Precision (:class:`Precision`). The default :data:`PEFT_AMP` is what PEFT + HF ``Trainer``
do under bf16 autocast: LoRA weights stay fp32 (4 B), fp32 grads (4 B), AdamW m and v
(8 B) -- 16 bytes per LoRA parameter. :data:`PURE_BF16` (torchtune, the paper's prototype)
keeps everything in bf16: 2 + 2 + 4 = 8 bytes, which is the paper's
``c_prec·(1 + c_grad)`` with ``c_grad = 3``.

Activations per token (frozen base, so no weight-gradient inputs are kept except what LoRA
needs), per layer, in bytes with bf16 activations ``a = 2``:

* attention: RMSNorm (eager HF keeps an fp32 copy: 4h; fused: 2h), its output (q/k/v and
  LoRA input, a·h), q, k, v and the attention output (``a·(2·q_dim + 2·kv_dim)``), the
  softmax statistics (4·heads); eager attention adds the fp32 softmax and the probabilities
  (bf16: ``6·heads·s``);
* MLP: RMSNorm and its output as above, gate and up outputs, SiLU(gate) and the product fed
  to down_proj (``4·a·i``; a fused SwiGLU recomputes SiLU: ``3·a·i``);
* logits (:class:`Loss`): bf16 logits, their fp32 copy and the saved log-softmax, plus its
  gradient during backward: 14·V bytes per token (eager HF); chunked CE (8 chunks) 3.5·V;
  a fused linear-cross-entropy keeps none.

With activation checkpointing each layer keeps only its input (``a·h``) and one layer's
activations are rebuilt at a time (added once). Parallelism (App. A.1.1): tensor parallel
shards the projections, their LoRA factor on the sharded side (colwise base: B sharded;
rowwise base: A sharded) and the activations inside attention/MLP -- embeddings, norms and the
LM head stay whole on every GPU; pipeline parallel keeps ``L/d`` layers per GPU; FSDP shards
the decoder's base weights (ZeRO-3; the LM head stays whole, as ``packed_loss`` calls it
outside the decoder) and splits the rows over GPUs. The adapters under FSDP are what
``zero_stage`` says: 0 (the default, what :func:`plora.parallel.fsdp.apply_fsdp` does) keeps
them replicated -- whole parameters, gradients and AdamW state on every GPU; 1-3 shard them as
ZeRO does (1: optimizer; 2: + grads; 3: + params).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from plora.config import ConfigError
from plora.cost import Strategy
from plora.model_spec import ModelSpec

GIB = float(1 << 30)

#: Bytes per weight of a bitsandbytes NF4 layer with double quantization: 4-bit codes, an
#: 8-bit absmax per 64 weights and an fp32 constant per 256 blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1.0 / 64 + 4.0 / (64 * 256)


_COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})


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


def _logit_bytes(loss: Loss, a: float) -> float:
    """Bytes per token per vocab entry kept for the loss (see :class:`Loss`)."""
    upcast = 4.0 if a < 4 else 0.0  # the fp32 copy of low-precision logits
    if loss is Loss.EAGER:
        return a + upcast + 8.0  # logits, fp32 copy, log-softmax, its gradient
    if loss is Loss.CHUNKED:
        return a + (upcast + 8.0) / 8
    return 0.0


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
    adapters replicated, as ``plora.parallel`` runs them; 1-3 shard them (DeepSpeed-style)."""
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


def check_parallel(d: int, strategy: Strategy | None) -> Strategy | None:
    """Validate a parallel degree; returns ``None`` for d = 1 (no split)."""
    if not isinstance(d, int) or d < 1 or d & (d - 1):
        raise ConfigError(f"parallel degree d={d!r} must be a power of two >= 1")
    if d == 1:
        return None
    if strategy is None:
        raise ConfigError(f"d={d} needs a strategy (tp, fsdp or pp)")
    return Strategy(strategy)


def projection_params(spec: ModelSpec) -> int:
    """Weights of every decoder projection (the ones LoRA wraps and QLoRA quantizes)."""
    return spec.num_layers * sum(spec.projection_params(p) for p in spec.projection_shapes)


def base_weight_bytes(spec: ModelSpec, precision: Precision) -> float:
    """Frozen weights: projections at ``base_weight_bytes``; embeddings, head and norms in the
    activation dtype (bf16 even for QLoRA, fp32 when training in fp32)."""
    proj = projection_params(spec)
    rest = spec.total_params - proj
    return proj * precision.base_weight_bytes + rest * max(2.0, precision.activation_bytes)


def pp_stage_weight_bytes(spec: ModelSpec, precision: Precision, stages: int) -> list[float]:
    """Frozen weights of each of ``stages`` pipeline stages as ``plora.parallel.pp`` cuts the
    model: ``⌈L/P⌉`` or ``⌊L/P⌋`` consecutive decoder layers (earlier stages the longer runs),
    the input embedding on stage 0, the final norm and the LM head (``V·h`` even when tied: the
    last stage keeps the shared matrix for its head) on stage ``P-1``."""
    rest_bytes = max(2.0, precision.activation_bytes)
    proj = sum(spec.projection_params(p) for p in spec.projection_shapes)
    layer = proj * precision.base_weight_bytes + (spec.layer_params - proj) * rest_bytes
    base, extra = divmod(spec.num_layers, stages)
    out = [(base + (p < extra)) * layer for p in range(stages)]
    out[0] += spec.embedding_params * rest_bytes
    out[-1] += (spec.vocab_size * spec.hidden_size + spec.hidden_size) * rest_bytes
    return out


def base_memory(
    spec: ModelSpec,
    *,
    d: int = 1,
    strategy: Strategy | None = None,
    options: MemoryOptions = MemoryOptions(),
) -> MemoryBreakdown:
    """``M_base`` per GPU: frozen weights (sharded by tp/pp/fsdp), FSDP gather buffer, reserve.

    What each strategy shards is what ``plora.parallel`` shards: TP the seven projections (the
    rest whole), FSDP everything in the decoder (the LM head, tied or not, stays whole), PP
    whole decoder layers: the busiest stage's, with the embeddings on the first stage and the
    final norm and LM head (tied or not) on the last (:func:`pp_stage_weight_bytes`).
    """
    strat = check_parallel(d, strategy)
    weights = base_weight_bytes(spec, options.precision)
    rest_bytes = max(2.0, options.precision.activation_bytes)
    if strat is Strategy.TP:
        proj = spec.num_layers * sum(spec.projection_params(p) for p in spec.projection_shapes)
        proj_bytes = proj * options.precision.base_weight_bytes
        per_gpu = proj_bytes / d + (weights - proj_bytes)
    elif strat is Strategy.FSDP:
        head = spec.vocab_size * spec.hidden_size * rest_bytes  # a whole copy even when tied
        untied = spec.lm_head_params * rest_bytes
        per_gpu = (weights - untied) / d + head
    elif strat is Strategy.PP:
        per_gpu = max(pp_stage_weight_bytes(spec, options.precision, d))
    else:
        per_gpu = weights
    comps = {"base_weights": per_gpu, "reserved": options.reserved_bytes}
    if strat is Strategy.FSDP:
        # Two layers unsharded at a time: the one computing and the one being prefetched.
        layer = spec.layer_params * options.precision.base_weight_bytes
        comps["fsdp_gather_buffer"] = 2.0 * layer * (d - 1) / d
    if options.precision.dequant_bytes > 0:
        # the largest projection dequantized (its shard under TP), alive during its GEMM
        tp = d if strat is Strategy.TP else 1
        largest = max(spec.projection_params(p) for p in spec.projection_shapes) / tp
        comps["dequant_buffer"] = largest * options.precision.dequant_bytes / 2.0
    return MemoryBreakdown(components=comps)


def base_activation_bytes_per_token(
    spec: ModelSpec,
    seq_len: int,
    *,
    d: int = 1,
    strategy: Strategy | None = None,
    options: MemoryOptions = MemoryOptions(),
) -> dict[str, float]:
    """Saved frozen-base activations per token a GPU processes: ``{"layers": .., "logits": ..}``.

    Under pipeline parallelism a GPU holds ``L/d`` layers (and, on the last stage, the logits);
    under FSDP each GPU processes ``1/d`` of the rows (the caller divides the tokens).
    """
    strat = check_parallel(d, strategy)
    a = options.precision.activation_bytes
    h, i = spec.hidden_size, spec.intermediate_size
    norm = (a if options.fused_kernels else 4.0) * h + 4.0
    # Replicated under TP (no sequence parallelism): norms and their outputs.
    replicated = 2.0 * (norm + a * h)
    # Sharded under TP: attention tensors and MLP intermediates.
    attn = a * (2 * spec.q_dim + 2 * spec.kv_dim) + 4.0 * spec.num_heads
    if options.attention is Attention.EAGER:
        attn += (4.0 + (a if a < 4 else 0.0)) * spec.num_heads * seq_len  # fp32 softmax + probs
    mlp = (3.0 if options.fused_kernels else 4.0) * a * i
    tp = d if strat is Strategy.TP else 1
    per_layer = replicated + (attn + mlp) / tp
    n_layers = spec.num_layers / d if strat is Strategy.PP else spec.num_layers
    # checkpointing: the layer inputs plus one rebuilt layer; else every layer + the final norm
    kept = a * h * n_layers + per_layer if options.checkpointing else per_layer * n_layers + norm
    logits = _logit_bytes(Loss(options.loss), a) * spec.vocab_size
    scale = options.activation_scale
    return {"layers": scale * kept, "logits": scale * logits}


def adapter_param_count(
    spec: ModelSpec,
    rank: int,
    targets: tuple[str, ...],
    *,
    d: int = 1,
    strategy: Strategy | None = None,
) -> float:
    """LoRA parameters held per GPU (TP shards B of colwise and A of rowwise projections)."""
    strat = check_parallel(d, strategy)
    if strat is Strategy.TP:
        total = 0.0
        for t in targets:
            fan_in, fan_out = spec.projection_shape(t)
            total += (
                rank * (fan_in + fan_out / d) if t in _COLWISE else rank * (fan_in / d + fan_out)
            )
        return total * spec.num_layers
    full = float(spec.lora_params(rank, targets))
    return full / d if strat is Strategy.PP else full


def adapter_memory(
    spec: ModelSpec,
    *,
    rank: int,
    targets: tuple[str, ...],
    batch_size: int,
    seq_len: int,
    dropout: float = 0.0,
    d: int = 1,
    strategy: Strategy | None = None,
    options: MemoryOptions = MemoryOptions(),
) -> MemoryBreakdown:
    """``M_lora,k`` per GPU: adapter state + LoRA and base activations of its ``b·s`` tokens."""
    strat = check_parallel(d, strategy)
    prec = options.precision
    n = adapter_param_count(spec, rank, targets, d=d, strategy=strat)
    params, grads, opt = (
        n * prec.adapter_param_bytes,
        n * prec.adapter_grad_bytes,
        n * prec.optimizer_bytes,
    )
    if strat is Strategy.FSDP:
        z = options.zero_stage
        opt = opt / d if z >= 1 else opt
        grads = grads / d if z >= 2 else grads
        params = params / d if z >= 3 else params
    tokens = float(batch_size * seq_len)
    if strat is Strategy.FSDP:  # rows are split over the d GPUs
        tokens /= d
    a = prec.activation_bytes
    # x·A (rank r) per targeted projection; with dropout also dropout(x) and its 1-byte mask.
    lora_act = 0.0
    for t in targets:
        fan_in: float = spec.projection_shape(t)[0]
        if strat is Strategy.TP and t not in _COLWISE:
            fan_in /= d
        lora_act += a * rank + ((a + 1.0) * fan_in if dropout > 0 else 0.0)
    layers_live: float = 1 if options.checkpointing else spec.num_layers
    if strat is Strategy.PP:
        layers_live = max(1.0, layers_live / d)
    base_act = base_activation_bytes_per_token(spec, seq_len, d=d, strategy=strat, options=options)
    return MemoryBreakdown(
        components={
            "lora_params": params,
            "lora_grads": grads,
            "optimizer": opt,
            "lora_activations": tokens * lora_act * layers_live,
            "base_activations": tokens * base_act["layers"],
            "logits": tokens * base_act["logits"],
        }
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
    "adapter_memory",
    "adapter_param_count",
    "base_activation_bytes_per_token",
    "base_memory",
    "base_weight_bytes",
    "check_parallel",
    "pp_stage_weight_bytes",
    "projection_params",
    "quantized",
]
