"""QLoRA under activation checkpointing: what the packed trainer keeps per layer is what the
cost model books.

The GPU path (``plora.engine.fused``: dequantized weight, fused base+LoRA kernel, the weight
saved as a recipe by :func:`plora.models.quantize.recompute_saved`) runs here on the CPU with a
torch twin of the Triton op that saves for backward exactly what ``plora.kernels.autograd``'s
op saves: ``x``, ``W``, ``A``, a contiguous ``Bᵀ`` and ``S = x·Aᵀ`` (tokens x padded rank).
The bytes a forward leaves allocated (the torch profiler's CPU allocator events) are measured
for 2 and 4 decoder layers; their difference per layer and token is compared with the cost
model's (``plora.cost.memory`` with the QLoRA precision and checkpointing), and with the dense
base's, measured the same way.

Before the fix the NF4 forward kept ``a·(3h + i) + 7·a·16`` more bytes per token and layer
than the dense one (14,794 vs 2,058 B at h = 512, i = 1,536, fp32): ``recompute_saved``'s hooks
shadowed the checkpoint's, so the kernel's inputs and ``S`` of every layer stayed alive.
"""

from __future__ import annotations

import gc

import pytest
import torch
from plora.kernels.reference import packed_lora_reference
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen2ForCausalLM

pytest.importorskip("torchao", reason="QLoRA needs torchao: pip install -e '.[qlora]'")

from plora.config import LoRAConfig
from plora.cost import memory as mem
from plora.engine import lora
from plora.engine.data import Example, TokenizedDataset
from plora.engine.trainer import PackedTrainer
from plora.model_spec import ModelSpec
from plora.models import quantize as q

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN, INTER, SEQ, ADAPTERS, RANK, VOCAB = 256, 768, 64, 3, 16, 128


class _KernelTwin(torch.autograd.Function):
    """``packed_lora_linear``'s Triton op in torch: same output, same tensors saved."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, a, b, table):
        with torch.no_grad():
            y = packed_lora_reference(x2d, weight, bias, a, b, **table)
        width = -(-max(table["ranks"]) // 16) * 16  # S is (tokens, max padded rank)
        ctx.save_for_backward(x2d, weight, a, b.t().contiguous(), x2d.new_empty(len(x2d), width))
        ctx.table = table
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, a, b_t, _ = ctx.saved_tensors
        with torch.enable_grad():
            x, a, b = (t.detach().requires_grad_(True) for t in (x2d, a, b_t.t()))
            y = packed_lora_reference(x, weight, None, a, b, **ctx.table)
            gx, ga, gb = torch.autograd.grad(y, (x, a, b), dy)
        return gx, None, None, ga, gb, None


CALLS: list[int] = []


def _kernel_twin(x, weight, bias, a, b, seg_starts, rank_offsets, ranks, scales, dropout, keys):
    CALLS.append(1)
    table = dict(seg_starts=seg_starts, rank_offsets=rank_offsets, ranks=ranks, scales=scales,
                 dropout_p=dropout, dropout_seed=keys)  # fmt: skip
    y = _KernelTwin.apply(x.reshape(-1, x.shape[-1]), weight, bias, a, b, table)
    return y.reshape(*x.shape[:-1], -1)


def _config(layers: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=SEQ, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip


def _adapter(i: int) -> LoRAConfig:
    return LoRAConfig(config_id=f"a{i}", rank=RANK, alpha=2 * RANK, lr=1e-3, batch_size=1,
                      target_modules="all", max_steps=9, seed=i)  # fmt: skip


def _kept_after_forward(layers: int, nf4: bool) -> int:
    """Bytes the packed trainer's forward (checkpointed) leaves allocated for backward."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config(layers)).float()
    if nf4:
        q.quantize_model(model, "nf4")
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(3, VOCAB, (2 * ADAPTERS, SEQ), generator=g).tolist()
    train = [Example(input_ids=r, labels=r, prompt="", answer=None, label=None) for r in rows]
    data = TokenizedDataset(train=train, eval=[], metric="none", labels=None)
    trainer = PackedTrainer(model, None, data, device="cpu", gradient_checkpointing=True)
    for i in range(ADAPTERS):
        trainer.add(_adapter(i))
    trainer.step()  # the optimizer state exists from here on
    forward, kept = trainer._forward_loss, []

    def measured(pb, denoms):
        gc.collect()  # no earlier model's cycles freed inside the window
        gc.disable()
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = forward(pb, denoms)
        finally:
            gc.enable()
        events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        kept.append(sum(e.nbytes() for e in events if e.name() == "[memory]"))
        return out

    trainer._forward_loss = measured  # type: ignore[method-assign]
    CALLS.clear()
    trainer.step()
    assert len(kept) == 1 and len(CALLS) >= 7 * layers  # the fused path ran
    return kept[0]


def _booked_activations(layers: int) -> float:
    spec = ModelSpec.from_hf_config(_config(layers))
    precision = mem.quantized(mem.FULL_FP32, "nf4")
    opts = mem.MemoryOptions(precision=precision, checkpointing=True, loss=mem.Loss.FUSED)
    targets = _adapter(0).target_modules
    one = mem.adapter_memory(spec, rank=RANK, targets=targets, batch_size=1, seq_len=SEQ,
                             options=opts)  # fmt: skip
    return ADAPTERS * (one.components["base_activations"] + one.components["lora_activations"])


def test_nf4_checkpointed_layer_keeps_what_the_model_books(monkeypatch):
    monkeypatch.setattr(lora, "fused_op", lambda x: _kernel_twin)  # fused path, CPU twin
    tokens = ADAPTERS * SEQ
    per_layer = {
        nf4: (_kept_after_forward(4, nf4) - _kept_after_forward(2, nf4)) / 2 / tokens
        for nf4 in (True, False)
    }
    booked = (_booked_activations(4) - _booked_activations(2)) / 2 / tokens
    assert booked == pytest.approx(4 * HIDDEN)  # the layer input, fp32
    # measured: 1,050 B at h = 256 on both bases (the layer input and ~26 B of small tensors);
    # before the fix the NF4 base kept 7,642 B: + 4·(3h + i) + 7·4·16
    assert per_layer[False] == pytest.approx(booked, rel=0.05)
    assert per_layer[True] == pytest.approx(booked, rel=0.05), per_layer
