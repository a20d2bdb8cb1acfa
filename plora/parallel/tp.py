"""Tensor parallelism (Megatron) for the packed engine: base and LoRA factors split together.

Plan. Of the seven projections, ``q/k/v/gate/up`` are *column-wise* (the base weight ``W``
(out, in) split on ``out``: each rank computes its heads / its slice of the MLP) and
``o/down`` *row-wise* (``W`` split on ``in``; the partial outputs are summed). With ``T`` ranks,
rank ``t`` holds columns or rows ``[t·n/T, (t+1)·n/T)``. The LoRA placements follow the base's
(torchtitan ``components/lora.py``), for ``y = x Wᵀ + s (x Aᵀ) Bᵀ`` with ``A`` (r, in), ``B`` (out, r):

=========== ===================== ======================= ==========================
base        ``W``                 ``A``                   ``B`` (stored ``Bt`` (r, out))
=========== ===================== ======================= ==========================
column-wise ``Shard(0)`` (out)    ``Replicate()``         ``Shard(0)`` (out)
row-wise    ``Shard(1)`` (in)     ``Shard(1)`` (in)       ``Replicate()``
=========== ===================== ======================= ==========================

Column-wise: ``x`` is whole on every rank and ``y_t = x W_tᵀ + s (x Aᵀ) B_tᵀ`` is rank ``t``'s
slice of ``y``. Backward: ``∂x`` and ``∂A`` are partial sums over ranks (all-reduced).
Row-wise: ``x_t`` is rank ``t``'s slice of ``x`` and ``y = Σ_t [x_t W_tᵀ + s (x_t A_tᵀ) Bᵀ]``
(one all-reduce; ``(Σ_t x_t A_tᵀ) Bᵀ = Σ_t (x_t A_tᵀ) Bᵀ``, so the LoRA delta rides along the
base's reduction) with the bias added on rank 0 only. Backward: ``∂B`` is a partial sum.
Attention and MLP in between run on local heads / local features unchanged (HF reshapes
with ``-1`` heads). The embeddings, norms and LM head stay replicated, so the loss is the
same on every rank.

Why local shards and explicit collectives, not DTensor parameters. ``PackedLoRALinear``
re-allocates ``A``/``Bt`` as plain parameters whenever an adapter joins or leaves (between
steps), :class:`~plora.engine.packed_optim.PackedAdamW` adopts them into flat buffers
(``param.data = view``), and the fused kernels take local tensors with a segment table; a
DTensor parameter survives none of these, and wrapping each kernel call in ``to_local`` /
``from_local`` is the same two collectives with more machinery. So each rank keeps its local
shards as ordinary tensors and the layer gets Megatron's two conjugate operators as module
hooks: ``f`` on the input of a block of column-wise layers (identity forward, all-reduce of
``∂x`` backward; one per attention and one per MLP, since q/k/v and gate/up read the block's
input -- true of the Llama/Qwen2 families the engine wraps) and ``g`` after a row-wise layer
(all-reduce forward, identity backward): per layer and token, 2 all-reduces of ``h`` values
forward and 2 backward. The partial parameter
gradients (``∂A`` column-wise, ``∂Bt`` row-wise) are all-reduced by
:class:`plora.parallel.optim.ParallelPackedAdamW` before its step, which also sums each slot's
gradient norm over the shards. Keyed dropout draws full-width masks and slices them
(``PackedLoRALinear.in_slice``), so masks equal the single-process ones.
"""

from __future__ import annotations

from enum import StrEnum

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from plora.engine.adapters import packed_layers
from plora.engine.lora import PackedLoRALinear
from plora.model_spec import ModelSpec


class TPStyle(StrEnum):
    """How a projection's base weight is split."""

    COLWISE = "colwise"
    """``W`` split on out: input whole, output sharded on its last dim."""
    ROWWISE = "rowwise"
    """``W`` split on in: input sharded on its last dim, output summed over ranks."""


#: The plan of the seven projections of a Llama/Qwen2 decoder layer.
TP_PLAN: dict[str, TPStyle] = {
    "q_proj": TPStyle.COLWISE,
    "k_proj": TPStyle.COLWISE,
    "v_proj": TPStyle.COLWISE,
    "o_proj": TPStyle.ROWWISE,
    "gate_proj": TPStyle.COLWISE,
    "up_proj": TPStyle.COLWISE,
    "down_proj": TPStyle.ROWWISE,
}


def lora_placements(style: TPStyle) -> tuple[Placement, Placement]:
    """``(A, B)`` placements derived from the base's split (``A`` (r, in), ``B`` (out, r))."""
    if style is TPStyle.COLWISE:
        return Replicate(), Shard(0)
    return Shard(1), Replicate()


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _span(n: int, size: int, rank: int, what: str) -> slice:
    if n % size:
        raise ValueError(f"apply_tp: {what}={n} is not divisible by tp={size}")
    step = n // size
    return slice(rank * step, (rank + 1) * step)


def _shard_layer(layer: PackedLoRALinear, style: TPStyle, group, name: str) -> None:
    """Keep this rank's shard of ``layer``'s base weight, bias and packed factors."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    base = layer.base_layer
    with torch.no_grad():
        if style is TPStyle.COLWISE:
            cut = _span(layer.out_features, size, rank, f"{name}.out_features")
            base.weight = nn.Parameter(base.weight[cut].clone(), requires_grad=False)
            if base.bias is not None:
                base.bias = nn.Parameter(base.bias[cut].clone(), requires_grad=False)
            layer._replace(layer.A.detach().clone(), layer.Bt.detach()[:, cut].clone())
        else:
            cut = _span(layer.in_features, size, rank, f"{name}.in_features")
            base.weight = nn.Parameter(base.weight[:, cut].clone(), requires_grad=False)
            if base.bias is not None and rank != 0:
                base.register_parameter(
                    "bias", None
                )  # the bias is added once, by rank 0, before the all-reduce
            layer.in_slice = cut
            layer._replace(layer.A.detach()[:, cut].clone(), layer.Bt.detach().clone())
            layer.register_forward_hook(lambda _m, _args, out: _ReduceFromTP.apply(out, group))
    base.out_features, base.in_features = base.weight.shape
    layer.tp_style = style
    layer.tp_group = group


def apply_tp(model: nn.Module, *, tp_group: dist.ProcessGroup, plan=TP_PLAN) -> None:
    """Split every packed projection of ``model`` over ``tp_group`` by ``plan`` (in place).

    Call after ``plora.engine.adapters.inject`` (all seven projections wrapped) and before any
    adapter is added or the model is sharded by FSDP; adapters added later are created at
    full size and sliced (same init as one process). Needs ``num_attention_heads``,
    ``num_key_value_heads`` and ``intermediate_size`` divisible by the TP degree
    (:meth:`plora.model_spec.ModelSpec.parallel_problem`).

    Args:
        model: a Llama/Qwen2-style causal LM with :class:`PackedLoRALinear` projections.
        tp_group: the TP process group (``mesh["tp"].get_group()``).
        plan: ``{projection: TPStyle}``; every packed projection must be in it.
    """
    size = dist.get_world_size(tp_group)
    cfg = getattr(model, "config", None)
    problem = None if cfg is None else ModelSpec.from_hf_config(cfg).parallel_problem("tp", size)
    if problem:  # the planner's rule (ModelSpec.parallel_problem): it never plans this
        raise ValueError(f"apply_tp: {problem}")
    layers = packed_layers(model)
    if not layers:
        raise ValueError("apply_tp: no PackedLoRALinear in the model; inject it first")
    for name, layer in layers.items():
        if layer.tp_style is not None:
            raise ValueError(f"apply_tp: {name} is already tensor-parallel")
        if layer.specs:
            raise ValueError(f"apply_tp: {name} has adapters; apply TP before adding any")
        proj = name.rsplit(".", 1)[-1]
        if proj not in plan:
            raise ValueError(f"apply_tp: no TP style for {name}; plan has {sorted(plan)}")
        _shard_layer(layer, TPStyle(plan[proj]), tp_group, name)
    # One ``f`` per block input, not per projection: q/k/v read the attention's input and
    # gate/up the MLP's, so one all-reduce of ∂x per block (Megatron's 2 per layer backward).
    parents = {n.rsplit(".", 1)[0] for n, m in layers.items() if m.tp_style is TPStyle.COLWISE}
    for parent in sorted(parents):
        model.get_submodule(parent).register_forward_pre_hook(
            _copy_block_input(tp_group), with_kwargs=True
        )


def _copy_block_input(group):
    """A pre-hook putting ``f`` on a block's input (first positional or ``hidden_states``)."""

    def hook(module, args, kwargs):
        if args:
            return (_CopyToTP.apply(args[0], group), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {
                **kwargs,
                "hidden_states": _CopyToTP.apply(kwargs["hidden_states"], group),
            }
        raise RuntimeError(f"apply_tp: cannot find the input of {type(module).__name__}")

    return hook


def _sharded_dim(layer: PackedLoRALinear, factor: str) -> Shard | None:
    """The dim along which ``factor`` ("A" or "B") of ``layer`` is split over its TP group, or
    None when the layer is not tensor-parallel or the factor is replicated."""
    if layer.tp_style is None:
        return None
    dim = lora_placements(layer.tp_style)[0 if factor == "A" else 1]
    return dim if isinstance(dim, Shard) else None


def gather_factor(layer: PackedLoRALinear, factor: str, t: torch.Tensor) -> torch.Tensor:
    """The full ``A`` (r, in) or ``B`` (out, r) of one slot from this rank's shard ``t``.

    A collective over ``layer.tp_group`` (every TP rank must call it, in the same order);
    returns ``t`` itself for a layer that is not tensor-parallel or a replicated factor.
    """
    dim = _sharded_dim(layer, factor)
    if dim is None:
        return t
    # on the factors' device: NCCL moves no host tensors (a train-state's are on the host)
    src = t.to(layer.A.device).contiguous()
    parts = [torch.empty_like(src) for _ in range(dist.get_world_size(layer.tp_group))]
    dist.all_gather(parts, src, group=layer.tp_group)
    return torch.cat(parts, dim=dim.dim).to(t.device)


def shard_factor(layer: PackedLoRALinear, factor: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of one slot's whole ``A`` (r, in) or ``B`` (out, r): the inverse of
    :func:`gather_factor` (no communication)."""
    dim = _sharded_dim(layer, factor)
    if dim is None:
        return t
    group = layer.tp_group
    return t.chunk(dist.get_world_size(group), dim=dim.dim)[dist.get_rank(group)].clone()


__all__ = ["TP_PLAN", "TPStyle", "apply_tp", "gather_factor", "lora_placements", "shard_factor"]
