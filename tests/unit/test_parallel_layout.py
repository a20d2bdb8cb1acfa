"""Single-process pieces of plora.parallel: TP plan and placements, row-wise shards, PP stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from plora.config import PROJECTIONS
from plora.engine.fused import reference_deltas
from plora.engine.lora import PackedLoRALinear, Routing
from plora.parallel.pp import stage_layers
from plora.parallel.tp import TP_PLAN, TPStyle, lora_placements


def test_tp_plan_covers_the_seven_projections():
    assert set(TP_PLAN) == set(PROJECTIONS)
    assert {p for p, s in TP_PLAN.items() if s is TPStyle.ROWWISE} == {"o_proj", "down_proj"}
    assert lora_placements(TPStyle.COLWISE) == (Replicate(), Shard(0))
    assert lora_placements(TPStyle.ROWWISE) == (Shard(1), Replicate())


def _layer(in_f: int, out_f: int, cols: slice | None = None) -> PackedLoRALinear:
    torch.manual_seed(0)
    base = nn.Linear(in_f, out_f)
    layer = PackedLoRALinear(base, key=7)
    if cols is not None:
        layer.in_slice = cols
        layer._replace(layer.A.detach()[:, cols].clone(), layer.Bt.detach().clone())
    layer.add_slot(0, rank=3, scale=2.0, dropout=0.3, seed=5)
    layer.add_slot(1, rank=2, scale=0.5, dropout=0.0, seed=6)
    return layer


def test_rowwise_shards_sum_to_the_whole_layer_with_dropout():
    """Σ_t (dropout(x)_t A_tᵀ) Bᵀ over the in-column shards == the unsharded delta (same masks)."""
    full = _layer(10, 6)
    with torch.no_grad():
        full.Bt.normal_()
    x = torch.randn(4, 3, 10)
    routing = Routing(segments=((0, 0, 3), (1, 3, 4)), dropout_keys={0: (2, 5), 1: (2, 0)})
    pieces = list(routing.segments)
    want = reference_deltas(full, x, pieces, routing)
    got = None
    for cols in (slice(0, 5), slice(5, 10)):
        shard = _layer(10, 6, cols)
        torch.testing.assert_close(shard.A, full.A[:, cols], rtol=0, atol=0)  # same init
        with torch.no_grad():
            shard.Bt.copy_(full.Bt)
        part = reference_deltas(shard, x[..., cols], pieces, routing)
        got = part if got is None else [g + p for g, p in zip(got, part, strict=True)]
    for g, w in zip(got, want, strict=True):
        assert float(w.abs().max()) > 0.1
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("n", "stages", "expected"),
    [(2, 2, [range(0, 1), range(1, 2)]), (7, 3, [range(0, 3), range(3, 5), range(5, 7)])],
)
def test_stage_layers(n, stages, expected):
    assert [stage_layers(n, stages, s) for s in range(stages)] == expected


def test_stage_layers_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="stage 0 of 3 for 2 layers"):
        stage_layers(2, 3, 0)


@pytest.mark.usefixtures("one_thread")
def test_one_process_token_balanced_micro_batches_equal_the_plain_trainer():
    """d = 1: three token-balanced micro-batches (rows of an adapter split across them, keyed
    dropout offsets carried) train exactly like one packed forward."""
    import copy

    from _engine_testlib import TOKENIZER, assert_same_adapter, tiny_model, toy_dataset

    from plora.config import LoRAConfig
    from plora.engine.adapters import adapter_state_dict
    from plora.engine.trainer import PackedTrainer
    from plora.parallel import ParallelDims
    from plora.parallel.trainer import ParallelPackedTrainer

    configs = [
        LoRAConfig(config_id="a", rank=4, alpha=8, lr=2e-2, batch_size=3, seed=1, max_steps=3,
                   target_modules="all", dropout=0.2),
        LoRAConfig(config_id="b", rank=8, alpha=8, lr=1e-2, batch_size=2, seed=2, max_steps=3,
                   target_modules=("q_proj", "down_proj")),
    ]  # fmt: skip
    base, data = tiny_model("llama"), toy_dataset()
    plain = PackedTrainer(copy.deepcopy(base), TOKENIZER, data, device="cpu")
    split = ParallelPackedTrainer(
        copy.deepcopy(base), TOKENIZER, data, device="cpu", dims=ParallelDims(), mesh=None,
        microbatches=3,
    )  # fmt: skip
    for trainer in (plain, split):
        for cfg in configs:
            trainer.add(cfg)
    for _ in range(3):
        want = {m.config_id: m.loss for m in plain.step()}
        got = {m.config_id: m.loss for m in split.step()}
        assert split.last_step.micro_batches == 3
        assert got == pytest.approx(want, rel=1e-6)
    for cfg in configs:
        assert_same_adapter(
            adapter_state_dict(split.model, split.slot_of(cfg.config_id)),
            adapter_state_dict(plain.model, plain.slot_of(cfg.config_id)),
        )
