"""Evaluation on a pipeline-parallel job: the stages as one causal LM, forward only.

Evaluation (:mod:`plora.engine.evaluate_packed`) calls ``model(input_ids=…, attention_mask=…)``
and reads logits: scored rows for the eval loss and label accuracy, greedy decoding for exact
match. Under PP no rank holds the whole model, so every rank of the pipeline group runs the
same evaluation code with the same rows, and :class:`PipelinedCausalLM` stands in for the
model on each of them::

    stage 0:   h_0 = blocks_0(embed(input_ids))                    -> send to stage 1
    stage p:   h_p = blocks_p(recv from stage p-1)                  -> send to stage p+1
    stage P-1: logits = lm_head(norm(blocks_{P-1}(recv)))           -> broadcast to all stages

Shapes: ``input_ids``, ``attention_mask`` and ``position_ids`` ``(R, S)``; hidden states
``(R, S, H)`` in the base's dtype; logits ``(R, S, V)`` in the base's dtype on every stage,
so each stage takes the same decisions (greedy tokens, early stops) and the evaluation's
control flow stays in step across ranks. The rows' adapter routing is the caller's
(``packed_segments`` around the call reaches this stage's packed layers), so a slot's numbers
equal the same adapters evaluated on one process (``tests/dist``).

Costs against one device: the stages run one after the other (no micro-batching: evaluation
is a small part of a job), and logits cross from the last stage to the others once per forward.
No KV cache crosses stages: greedy decoding re-runs the prompt and the answer so far at each of
its ``max_new_tokens`` steps (:func:`plora.engine.evaluate.generate_greedy` without a cache).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plora.parallel.pp import MicroBatchRouting, PipelineStageModule


class PipelinedCausalLM(nn.Module):
    """This rank's pipeline stage behind a causal LM's ``forward`` (no gradients, no cache).

    Args:
        stage: this rank's stage (:func:`plora.parallel.pp.apply_pp`).
        head: the LM head on the last stage (``None`` elsewhere).
        pp_group: the pipeline's process group (one rank per stage).
        vocab_size: width of the logits (the head's output features).
    """

    def __init__(
        self,
        stage: PipelineStageModule,
        *,
        head: nn.Module | None,
        pp_group: dist.ProcessGroup,
        vocab_size: int,
    ) -> None:
        super().__init__()
        if stage.is_last and head is None:
            raise ValueError("PipelinedCausalLM: the last stage needs the LM head")
        self.stage = stage
        self.head = head if stage.is_last else None
        self.pp_group = pp_group
        self.vocab_size = int(vocab_size)

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.pp_group, stage)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """Logits ``(R, S, V)`` of ``input_ids`` ``(R, S)`` on every stage (a collective)."""
        stage = self.stage
        rows, width = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        dtype, device = stage.hidden_dtype, input_ids.device
        stage.feed(
            [
                MicroBatchRouting(
                    attention_mask=attention_mask, segments=None, position_ids=position_ids
                )
            ]
        )
        if stage.is_first:
            x = input_ids
        else:
            x = torch.empty(rows, width, stage.config.hidden_size, dtype=dtype, device=device)
            dist.recv(x, src=self._peer(stage.stage - 1), group=self.pp_group)
        h = stage(x)
        if not stage.is_last:
            dist.send(
                h.to(dtype).contiguous(), dst=self._peer(stage.stage + 1), group=self.pp_group
            )
            logits = torch.empty(rows, width, self.vocab_size, dtype=dtype, device=device)
        else:
            assert self.head is not None  # checked in __init__
            logits = self.head(h).to(dtype).contiguous()
            if logits.shape[-1] != self.vocab_size:
                raise RuntimeError(
                    f"PipelinedCausalLM: the head gives {logits.shape[-1]} logits, "
                    f"vocab_size={self.vocab_size}"
                )
        dist.broadcast(logits, src=self._peer(stage.stages - 1), group=self.pp_group)
        return logits


__all__ = ["PipelinedCausalLM"]
