"""The graphed step on CUDA (:mod:`plora.engine.graphed`) against the eager step, its reference.

bf16 with the fused kernels, adapters with dropout (keys rewritten in the captured slot tables
every step), micro-batches, and an adapter that leaves and one that joins mid-run (new layout:
new graphs). Graphed and eager training must give the same losses and adapters within bf16
tolerance, and the graphed run must really replay.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _engine_testlib import TOKENIZER, adapter_rel_err, tiny_model, toy_dataset

from plora.config import LoRAConfig
from plora.engine.adapters import adapter_state_dict
from plora.engine.trainer import PackedTrainer

pytestmark = pytest.mark.gpu

STEPS = 10
CFGS = [
    LoRAConfig(config_id="a", rank=8, alpha=16, lr=5e-3, batch_size=2, seed=1, max_steps=STEPS,
               target_modules=("q_proj", "v_proj"), dropout=0.1),
    LoRAConfig(config_id="b", rank=24, alpha=24, lr=2e-3, batch_size=3, seed=2, max_steps=STEPS,
               target_modules="all", schedule="cosine", warmup_steps=1, dropout=0.05,
               max_grad_norm=0.5),
    LoRAConfig(config_id="c", rank=64, alpha=32, lr=1e-3, batch_size=1, seed=3, max_steps=4,
               target_modules="mlp", use_rslora=True),
]  # fmt: skip
LATE = LoRAConfig(config_id="d", rank=16, alpha=16, lr=3e-3, batch_size=2, seed=4, max_steps=5,
                  target_modules="all", dropout=0.1)  # fmt: skip


def _train(base, data, graphs: bool, *, max_rows=None):
    trainer = PackedTrainer(copy.deepcopy(base), TOKENIZER, data, device="cuda",
                            dtype=torch.bfloat16, max_rows=max_rows, cuda_graphs=graphs)  # fmt: skip
    for cfg in CFGS:
        trainer.add(cfg)
    losses: dict[str, list[float]] = {}
    step = 0
    while trainer.active:
        for m in trainer.step():
            losses.setdefault(m.config_id, []).append(m.loss)
        step += 1
        if step == 6:  # c finished at 4; d joins into its released slot
            trainer.release("c")
            trainer.add(LATE)
    weights = {
        cid: {k: v.detach().float().cpu() for k, v in
              adapter_state_dict(trainer.model, trainer.slot_of(cid)).items()}
        for cid in trainer.adapters
    }  # fmt: skip
    return losses, weights, trainer


@pytest.mark.parametrize("max_rows", [None, 4], ids=["one-forward", "micro-batches"])
def test_graphed_equals_eager(max_rows):
    base = tiny_model("qwen2").cuda()
    data = toy_dataset(n=40)
    le, we, eager = _train(base, data, False, max_rows=max_rows)
    lg, wg, graphed = _train(base, data, True, max_rows=max_rows)
    assert eager.graphs is None
    g = graphed.graphs
    assert g is not None and g.disabled is None, g and g.disabled
    assert g.captures >= 2 and g.replays >= STEPS - 4, (g.captures, g.replays, g.eager_steps)
    assert set(lg) == set(le) and set(wg) == set(we) == {"a", "b", "d"}  # c was released
    _same_training(le, we, lg, wg)


def test_torch_path_with_dropout_steps_eagerly():
    """The torch LoRA path (``set_kernel_backend("torch")``) builds each dropout mask from the
    adapter's step on the host, so a captured mask would repeat at every replay: a pack with
    dropout there turns graphs off with its reason, and trains exactly as the eager step."""
    from plora.engine import lora

    lora.set_kernel_backend("torch")
    try:
        base = tiny_model("qwen2").cuda()
        data = toy_dataset(n=40)
        le, we, _ = _train(base, data, False)
        lg, wg, graphed = _train(base, data, True)
    finally:
        lora.set_kernel_backend("auto")
    g = graphed.graphs
    assert g is not None and "dropout on the torch LoRA path" in (g.disabled or ""), g.disabled
    assert g.replays == 0
    _same_training(le, we, lg, wg)


def _same_training(le, we, lg, wg) -> None:
    for cid in le:
        torch.testing.assert_close(torch.tensor(lg[cid]), torch.tensor(le[cid]), rtol=2e-2, atol=0)
    for cid in we:
        assert adapter_rel_err(wg[cid], we[cid]) < 3e-2, cid
        assert any(v.abs().max() > 1e-4 for k, v in wg[cid].items() if "lora_B" in k)


def test_a_capture_failure_falls_back_to_eager(monkeypatch):
    """Anything a capture refuses turns graphs off with one line; training goes on eagerly."""
    from plora.engine import graphed

    def refuse(self, entry, steps):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed.StepGraphs, "_capture", refuse)
    base = tiny_model("qwen2").cuda()
    data = toy_dataset(n=40)
    le, we, _ = _train(base, data, False)
    lg, wg, trainer = _train(base, data, True)
    assert trainer.graphs is not None and "not permitted" in (trainer.graphs.disabled or "")
    _same_training(le, we, lg, wg)
