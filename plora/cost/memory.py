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

Precision and the other options: :mod:`plora.cost.memory_options` (re-exported here).

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

CPU offload (``fsdp_offload``, FSDP2's ``CPUOffloadPolicy``): the decoder's shards live in
pinned host memory, so a GPU holds only what FSDP leaves whole (the LM head), the two layers in
flight -- each its shard copied in from the host plus the gathered whole -- and the root unit's
embeddings, which stay gathered from the first forward to the end of backward. Adapters and
activations are booked as under ``fsdp``. Host memory is not modelled: each rank pins its
``1/d`` of the decoder (and loads the whole base on the host before sharding it).
"""

from __future__ import annotations

from plora.config import FSDP_STRATEGIES, ConfigError
from plora.cost import Strategy
from plora.cost.memory_options import (
    FULL_FP32,
    GIB,
    NF4_BYTES_PER_PARAM,
    PEFT_AMP,
    PURE_BF16,
    QLORA_NF4,
    QLORA_NF4_FP32,
    Attention,
    Loss,
    MemoryBreakdown,
    MemoryOptions,
    Precision,
    quantized,
)
from plora.model_spec import ModelSpec

_COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})


def _logit_bytes(loss: Loss, a: float) -> float:
    """Bytes per token per vocab entry kept for the loss (see :class:`Loss`)."""
    upcast = 4.0 if a < 4 else 0.0  # the fp32 copy of low-precision logits
    if loss is Loss.EAGER:
        return a + upcast + 8.0  # logits, fp32 copy, log-softmax, its gradient
    if loss is Loss.CHUNKED:
        return a + (upcast + 8.0) / 8
    return 0.0


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
    rest whole), FSDP everything in the decoder (the LM head, tied or not, stays whole;
    ``fsdp_offload`` keeps the shards in host memory, see the module docstring), PP
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
    elif strat is Strategy.FSDP_OFFLOAD:  # the decoder's shards are in host memory
        per_gpu = spec.vocab_size * spec.hidden_size * rest_bytes
    elif strat is Strategy.PP:
        per_gpu = max(pp_stage_weight_bytes(spec, options.precision, d))
    else:
        per_gpu = weights
    comps = {"base_weights": per_gpu, "reserved": options.reserved_bytes}
    layer = spec.layer_params * options.precision.base_weight_bytes
    if strat is Strategy.FSDP:
        # Two layers unsharded at a time: the one computing and the one being prefetched.
        comps["fsdp_gather_buffer"] = 2.0 * layer * (d - 1) / d
    elif strat is Strategy.FSDP_OFFLOAD:
        # The same two layers, each its shard copied from the host plus the gathered whole;
        # the root unit (embeddings, final norm) stays gathered through forward and backward.
        comps["fsdp_gather_buffer"] = 2.0 * layer * (d + 1) / d
        comps["fsdp_root_gathered"] = (spec.embedding_params + spec.hidden_size) * rest_bytes
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
    pipeline_micro_batches: int | None = None,
) -> MemoryBreakdown:
    """``M_lora,k`` per GPU: adapter state + LoRA and base activations of its ``b·s`` tokens.

    Under pipeline parallelism 1F1B keeps at most ``P`` of a step's ``M`` micro-batches in
    flight on its busiest stage (the first), so ``min(M, P) / M`` of the rows' activations are
    live there; ``pipeline_micro_batches`` is ``M`` (``None``: ``M = P``, what a job's trainer
    runs when nothing sets it -- every row live).
    """
    strat = check_parallel(d, strategy)
    prec = options.precision
    n = adapter_param_count(spec, rank, targets, d=d, strategy=strat)
    params, grads, opt = (
        n * prec.adapter_param_bytes,
        n * prec.adapter_grad_bytes,
        n * prec.optimizer_bytes,
    )
    if strat in FSDP_STRATEGIES:
        z = options.zero_stage
        opt = opt / d if z >= 1 else opt
        grads = grads / d if z >= 2 else grads
        params = params / d if z >= 3 else params
    tokens = float(batch_size * seq_len)
    if strat in FSDP_STRATEGIES:  # rows are split over the d GPUs
        tokens /= d
    if strat is Strategy.PP and pipeline_micro_batches is not None:
        m = max(int(pipeline_micro_batches), d)  # 1F1B needs one micro-batch per stage
        tokens *= d / m
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
