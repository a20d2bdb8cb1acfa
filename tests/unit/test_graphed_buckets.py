"""The graphed step's shapes repeat: lengths and target counts round up to buckets, and one set of
buffers (one graph on CUDA) serves every step of a pack until adapters join or leave."""

from __future__ import annotations

import copy

import pytest
from _engine_testlib import TOKENIZER, tiny_model, toy_dataset

from plora.config import LoRAConfig
from plora.engine.graphed import LENGTH_BUCKET, bucket_length, bucket_targets, graphs_wanted
from plora.engine.trainer import PackedTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("n", "want"), [(1, 64), (63, 64), (64, 64), (65, 128), (1000, 1024), (1024, 1024)]
)
def test_lengths_round_up_to_the_bucket(n, want):
    assert LENGTH_BUCKET == 64
    assert bucket_length(n) == want


def test_targets_round_up_to_a_quarter_of_the_capacity():
    cap = 4 * 63  # 4 rows of 64 tokens
    assert [bucket_targets(n, cap) for n in (1, 63, 64, 126, 127, 252)] == [
        63,
        63,
        126,
        126,
        189,
        252,
    ]
    for n in range(1, cap + 1):
        got = bucket_targets(n, cap)
        assert n <= got <= cap and got - n < cap / 4
    assert len({bucket_targets(n, cap) for n in range(1, cap + 1)}) == 4


def test_graphs_wanted(monkeypatch):
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not graphs_wanted(None, cpu) and graphs_wanted(True, cpu)
    assert graphs_wanted(None, cuda) and not graphs_wanted(False, cuda)
    monkeypatch.setenv("PLORA_CUDA_GRAPHS", "0")
    assert not graphs_wanted(None, cuda)


def test_one_entry_per_pack_layout_and_bucket():
    data = toy_dataset()  # rows of 5..14 tokens: every step in the 64-token bucket
    trainer = PackedTrainer(copy.deepcopy(tiny_model()), TOKENIZER, data, device="cpu",
                            cuda_graphs=True)  # fmt: skip
    for i, bs in enumerate((2, 3)):
        trainer.add(LoRAConfig(config_id=f"c{i}", rank=4, alpha=8, lr=1e-2, batch_size=bs,
                               seed=i, max_steps=6, target_modules="all"))  # fmt: skip
    graphs = trainer.graphs
    assert graphs is not None
    for _ in range(3):
        trainer.step()
    assert len(graphs.entries) == 1 and graphs.eager_steps == 3
    (entry,) = graphs.entries.values()
    assert entry.runs == 3 and entry.micros[0].input_ids.shape == (5, 64)
    assert trainer.last_step is not None and trainer.last_step.seq_len == 64
    trainer.remove("c1")  # the layout changed: the old buffers go
    trainer.step()
    assert len(graphs.entries) == 1
    (entry,) = graphs.entries.values()
    assert entry.runs == 1 and entry.micros[0].input_ids.shape == (2, 64)


def test_causal_only_builds_no_mask_and_keeps_real_positions(monkeypatch):
    """The graphed step's attention: no padding mask, no materialized causal mask (HF builds one
    whenever a CUDA stream captures), SDPA ``is_causal``; right-padded rows' real positions come
    out as with the padding mask."""
    import torch
    import torch.nn.functional as F

    from plora.engine.attention import causal_only

    model = tiny_model()
    ids = torch.randint(3, 60, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # row 1 is right-padded after 7 tokens
    ref = model(input_ids=ids, attention_mask=mask).logits
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with causal_only(model):
        assert model.config._attn_implementation == "plora_causal_sdpa"
        out = model(input_ids=ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert seen and all(m is None and causal for m, causal in seen)
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]])
    torch.testing.assert_close(out[1, :7], ref[1, :7])


def test_a_graphed_trainer_is_freed_with_its_last_reference():
    """No cycle between a trainer and its graphs: the next pack on the same GPU must not find the
    last one's memory still held until Python's cycle collector runs."""
    import gc
    import weakref

    trainer = PackedTrainer(tiny_model(), TOKENIZER, toy_dataset(), cuda_graphs=True)
    assert trainer.graphs is not None
    trainer.add(LoRAConfig(config_id="a", rank=4, alpha=8, lr=1e-3, batch_size=2, max_steps=2))
    trainer.step()
    ref = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert ref() is None
    finally:
        gc.enable()


def test_causal_only_keeps_the_mask_where_a_sliding_window_is_shorter():
    """The graphed step's mask-free attention only where it is exact: rows no longer than the
    model's sliding window (beyond it only the mask applies the window)."""
    from types import SimpleNamespace

    from plora.engine.attention import CAUSAL_SDPA, causal_only

    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa", sliding_window=8))
    with causal_only(model, width=16):
        assert model.config._attn_implementation == "sdpa"
    with causal_only(model, width=8):
        assert model.config._attn_implementation == CAUSAL_SDPA
    assert model.config._attn_implementation == "sdpa"
