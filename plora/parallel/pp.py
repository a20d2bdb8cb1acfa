"""Pipeline parallelism for the packed engine: decoder layers in stages, 1F1B, adapter-filled.

Stages. With ``P`` stages the ``L`` decoder layers are cut into ``P`` consecutive runs of
``⌈L/P⌉`` or ``⌊L/P⌋`` (:func:`stage_layers`). Stage 0 also holds the embeddings, the last
stage the final norm and the LM head; every rank keeps only its own modules (the others are
replaced by parameter-free placeholders, so module names -- and PEFT keys -- do not change).
Each stage recomputes the causal mask and the rotary embeddings from the micro-batch's
attention mask (cheap, and nothing but the hidden states ``(R_mb, S, H)`` crosses stages).

Micro-batches. A step's rows (every adapter's batch, slot order) are cut into ``M``
token-balanced contiguous bins (:func:`plora.parallel.balance.balanced_micro_batches`), each
padded to the same ``(R_mb, S)`` (pad rows: one attended pad token, labels -100, no adapter),
and run by ``torch.distributed.pipelining.Schedule1F1B``. A bin holds consecutive rows of one
or more adapters, so the pipeline's micro-batches carry every adapter's work back to back:
while stage ``p`` runs adapter ``i``'s tail, stage ``p+1`` already runs adapter ``j``'s head
(mLoRA's adapter-filled pipeline, LoRAFusion's multi-LoRA micro-batches); with ``M ≥ P`` the
1F1B bubble is ``(P-1)/(M+P-1)`` of the step. 1F1B needs ``M ≥ P``: with fewer rows than
that (one adapter of batch size 1 left in a 2-stage job) the empty bins run as *idle*
micro-batches, one pad row through an active adapter with no target token, which adds exactly
zero to every gradient and loss (as FSDP's idle ranks do). Routing (which rows go through
which slot) is host-side per micro-batch: every stage knows the step's bins (all ranks draw
the same batches) and 1F1B runs a stage's forwards in micro-batch order, so the stage takes
the next bin's segment table at each forward (checked at the end of the step).

Gradients. Each micro-batch backpropagates its share ``Σ_{t ∈ mb} CE_t / N_i`` (``N_i`` of the
whole step batch) and the schedule does *not* rescale (``scale_grads=False``), so the
accumulated gradient is the full batch's; per-slot norms are summed over stages by
:class:`plora.parallel.optim.ParallelPackedAdamW`.

Evaluation (no gradients, any rows and routing) runs the stages forward only, one after the
other: :class:`plora.parallel.pp_eval.PipelinedCausalLM`.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from plora.engine.adapters import packed_segments


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """Decoder layers of ``stage`` (0-based): consecutive, earlier stages one more if uneven."""
    if not 0 <= stage < stages or stages > n_layers:
        raise ValueError(f"stage_layers: stage {stage} of {stages} for {n_layers} layers")
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class _Elsewhere(nn.Module):
    """Placeholder of a decoder layer held by another pipeline stage."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer lives on another pipeline stage")


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchRouting:
    """What a stage needs of one micro-batch besides the hidden states."""

    attention_mask: torch.Tensor | None
    """``(R_mb, S)`` long, 1 on real tokens; ``None``: right-padded rows whose padding is no
    target, run causally with no mask (SDPA's ``is_causal``: flash attention, and no device sync
    in transformers' check of the mask, which would stall the host at every micro-batch)."""
    segments: tuple[tuple[int, int, int], ...] | None
    """``(slot, start, stop)`` rows of each adapter in the micro-batch; ``None``: the caller
    routes the rows (``packed_segments`` around the forward, as evaluation does)."""
    dropout_keys: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """``{slot: (adapter step, row offset)}`` for keyed dropout."""
    position_ids: torch.Tensor | None = None
    """``(R_mb, S)`` RoPE positions (left-padded generation); ``None``: ``0 … S-1``."""


def _mask_kwargs(config: Any, h: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    """Arguments of transformers' ``create_causal_mask`` as this release names them, no cache
    (5.17 calls the cache ``past_key_values``, 5.24 ``cache``; older ones also take
    ``input_embeds`` and ``cache_position``: ``0 … S-1`` without a cache, whatever the
    position ids)."""
    from transformers.masking_utils import create_causal_mask

    names = inspect.signature(create_causal_mask).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask,
                              "position_ids": position_ids}  # fmt: skip
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = h
    for name in ("cache", "past_key_values"):
        if name in names:
            kwargs[name] = None
    if "cache_position" in names:
        kwargs["cache_position"] = torch.arange(h.shape[1], device=h.device)
    return kwargs


class PipelineStageModule(nn.Module):
    """One pipeline stage of a HF causal LM: ``(input_ids | hidden) -> hidden``.

    Shapes: stage 0 takes ``input_ids`` ``(R_mb, S)``; later stages the previous stage's
    hidden states ``(R_mb, S, H)``; every stage returns ``(R_mb, S, H)`` (the last one after the
    final norm). Set the step's micro-batches with :meth:`feed` before running the schedule.
    """

    model: nn.Module  #: the whole (PP-pruned) model: a reference, not a submodule
    _decoder: nn.Module  #: its decoder (``model.model``): a reference too

    def __init__(self, model: nn.Module, *, stage: int, stages: int) -> None:
        super().__init__()
        decoder = getattr(model, str(model.base_model_prefix))
        cfg = decoder.config
        if getattr(decoder, "has_sliding_layers", False):
            raise ValueError("apply_pp: sliding-window attention layers are not supported")
        self.config = cfg
        object.__setattr__(self, "model", model)  # a reference, not a submodule (no cycle)
        object.__setattr__(self, "_decoder", decoder)
        self.stage, self.stages = stage, stages
        self.layer_ids = stage_layers(len(decoder.layers), stages, stage)
        self.embed = decoder.embed_tokens if stage == 0 else None
        self.blocks = nn.ModuleList(decoder.layers[i] for i in self.layer_ids)
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm if stage == stages - 1 else None
        self._micro: list[MicroBatchRouting] = []
        self._calls = 0

    @property
    def hidden_dtype(self) -> torch.dtype:
        """dtype of the residual stream between stages: the frozen base's (not the fp32 LoRA
        factors'), as autocast leaves the residual additions in the weights' dtype."""
        for name, p in self.blocks.named_parameters():
            if not name.endswith((".A", ".Bt")):
                return p.dtype
        return torch.float32

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def feed(self, micro: Sequence[MicroBatchRouting]) -> None:
        """The step's micro-batches, in order (forwards take them one by one)."""
        self._micro, self._calls = list(micro), 0

    def consumed(self) -> int:
        """Forwards run since :meth:`feed`."""
        return self._calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        if self._calls >= len(self._micro):
            raise RuntimeError(f"stage {self.stage}: more forwards than fed micro-batches")
        mb = self._micro[self._calls]
        self._calls += 1
        if self.is_first:
            assert self.embed is not None  # stage 0 keeps the embeddings
            h = self.embed(x)
        else:
            h = x
        position_ids = mb.position_ids
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device)[None]
        mask = create_causal_mask(**_mask_kwargs(self.config, h, mb.attention_mask, position_ids))
        rope = self.rotary(h, position_ids)
        if self._checkpointing():
            # 1F1B runs micro-batch i's backward after later forwards have re-routed the
            # layers, so each block's recomputation routes itself (the routing in the closure)
            for block in self.blocks:
                h = checkpoint(_routed_block, block, h, mb, mask, position_ids, rope,
                               use_reentrant=False)  # fmt: skip
        else:
            with _route(self.model, mb):
                for block in self.blocks:
                    h = block(h, attention_mask=mask, position_ids=position_ids,
                              position_embeddings=rope)  # fmt: skip
        if self.is_last:
            assert self.norm is not None  # the last stage keeps the final norm
            return self.norm(h)
        return h

    def _checkpointing(self) -> bool:
        """Whether the base recomputes activations in backward (``gradient_checkpointing_enable``
        flags the decoder layers in newer transformers, the decoder in older ones)."""
        if not torch.is_grad_enabled() or not self._decoder.training:
            return False
        return bool(getattr(self._decoder, "gradient_checkpointing", False)) or any(
            getattr(b, "gradient_checkpointing", False) for b in self.blocks
        )


def _route(module: nn.Module, mb: MicroBatchRouting) -> contextlib.AbstractContextManager[None]:
    """``mb``'s rows through their slots in ``module``'s packed layers (none: the caller
    routes them, as evaluation does)."""
    if mb.segments is None:
        return contextlib.nullcontext()
    return packed_segments(module, mb.segments, dropout_keys=mb.dropout_keys)


def _routed_block(
    block: nn.Module,
    h: torch.Tensor,
    mb: MicroBatchRouting,
    mask: Any,
    position_ids: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """One decoder layer under ``mb``'s routing, without the layer's own checkpointing (the
    caller checkpoints it, routing included; transformers checkpoints a flagged layer's
    ``__call__`` or, since 5.2x, its ``forward``, so the flag is lowered for the call)."""
    layer: Any = block  # a transformers decoder layer: its flag is a plain attribute
    flagged = bool(getattr(layer, "gradient_checkpointing", False))
    try:
        if flagged:
            layer.gradient_checkpointing = False
        with _route(block, mb):
            out = block(h, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
    finally:
        if flagged:
            layer.gradient_checkpointing = True
    return out[0] if isinstance(out, tuple) else out


def apply_pp(model: nn.Module, *, pp_group: dist.ProcessGroup) -> PipelineStageModule:
    """Keep this rank's stage of ``model`` (in place) and return it as a pipeline stage.

    Call after ``inject``, before TP/FSDP and before the trainer is built. The stage index is
    the rank in ``pp_group``; other stages' layers become placeholders, and the embeddings,
    final norm and LM head are dropped where not needed.
    """
    stages, stage = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    decoder = getattr(model, str(model.base_model_prefix))
    module = PipelineStageModule(model, stage=stage, stages=stages)
    for i in range(len(decoder.layers)):
        if i not in module.layer_ids:
            decoder.layers[i] = _Elsewhere()
    if stage != 0:
        decoder.embed_tokens = None
    if stage != stages - 1:
        decoder.norm = None
        if hasattr(model, "lm_head"):
            model.register_module("lm_head", None)
    # The dropped layers go now, not at some later collection: a layer whose attention holds a
    # bound method of itself (plora.engine.liger's patch) is a reference cycle, and on 2 x H200
    # (2026-11-28) each pp rank of the 14B shape still held the other stage's ~14 GiB of
    # weights when it trained (peaks 14-16 GiB over the memory model's).
    gc.collect()
    return module


def run_1f1b(
    module: PipelineStageModule,
    *,
    pp_group: dist.ProcessGroup,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    micro: Sequence[MicroBatchRouting],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """Forward and backward of one step's ``M = len(micro)`` micro-batches with 1F1B.

    Args:
        input_ids, labels: ``(M · R_mb, S)``: micro-batch ``m`` is rows ``[m·R_mb, (m+1)·R_mb)``
            (``input_ids`` read on the first stage, ``labels`` on the last).
        micro: each micro-batch's routing (every stage).
        loss_fn: ``(hidden (R_mb, S, H), labels (R_mb, S)) -> scalar`` on the last stage,
            called in micro-batch order; its backward accumulates into the adapters' ``.grad``.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    n = len(micro)
    if input_ids.shape[0] % n:
        raise ValueError(f"run_1f1b: {input_ids.shape[0]} rows do not split into {n} micro-batches")
    rows, width = input_ids.shape[0] // n, input_ids.shape[1]
    # static shapes (no metadata inference): hidden states carry gradients between stages
    hidden = torch.empty(rows, width, module.config.hidden_size, dtype=module.hidden_dtype,
                         device=input_ids.device, requires_grad=True)  # fmt: skip
    first_in = input_ids[:rows]
    stage = PipelineStage(
        module,
        module.stage,
        module.stages,
        input_ids.device,
        input_args=first_in if module.is_first else hidden,
        output_args=hidden,
        group=pp_group,
    )
    schedule = Schedule1F1B(stage, n, loss_fn=loss_fn, scale_grads=False)
    module.feed(micro)
    if module.is_first:
        schedule.step(input_ids)
    elif module.is_last:
        schedule.step(target=labels, losses=[])
    else:
        schedule.step()
    if module.consumed() != n:
        raise RuntimeError(f"stage {module.stage}: ran {module.consumed()} of {n} micro-batches")


__all__ = [
    "MicroBatchRouting",
    "PipelineStageModule",
    "apply_pp",
    "run_1f1b",
    "stage_layers",
]
