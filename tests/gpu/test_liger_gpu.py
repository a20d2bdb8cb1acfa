"""Liger-Kernel on the frozen base (``training.fused_kernels``) leaves packed training unchanged.

On CUDA with ``liger_kernel`` installed (``pip install -e ".[dev,liger]"``):

* a packed step with Liger's fused RMSNorm/SwiGLU/RoPE (:func:`plora.engine.liger.apply_fused_kernels`)
  gives the same per-adapter losses and LoRA A/B gradients as the stock step, within bf16
  noise, with and without activation checkpointing, and Liger's RoPE really ran;
* in float32, adapters trained packed on the Liger base equal each adapter trained alone with
  PEFT on the stock base (the PEFT-equivalence contract, a little looser than without Liger:
  Triton reduces in another order);
* the resident engine (``run_pack``) with ``on`` trains and evaluates (packed evaluation) like
  ``off``, and a model loaded after a patched one in the same process runs stock.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _engine_testlib import TOKENIZER, adapter_rel_err, peft_reference, tiny_model, toy_dataset

from plora.config import LoRAConfig
from plora.engine import liger
from plora.engine.adapters import adapter_state_dict
from plora.engine.trainer import PackedTrainer

pytestmark = pytest.mark.gpu
lk = pytest.importorskip("liger_kernel.transformers")

CFGS = [
    LoRAConfig(config_id="a", rank=8, alpha=16, lr=5e-3, batch_size=2, seed=1, max_steps=3,
               target_modules="all"),
    LoRAConfig(config_id="b", rank=16, alpha=16, lr=2e-3, batch_size=3, seed=2, max_steps=3,
               target_modules="mlp", schedule="cosine", warmup_steps=1),
    LoRAConfig(config_id="c", rank=32, alpha=32, lr=1e-3, batch_size=1, seed=3, max_steps=3,
               target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _stock_modeling_modules():
    """Undo the module-level RoPE switch after each test (later tests see stock modules)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    saved = {m: dict(vars(m)) for m in (modeling_llama, modeling_qwen2)}
    yield
    for module, names in saved.items():
        for name, value in names.items():
            setattr(module, name, value)


def _count_fused_rope(model, monkeypatch) -> dict[str, int]:
    """Count the calls of Liger's RoPE through the patched model's switch."""
    switch = sys.modules[type(model).__module__].apply_rotary_pos_emb
    assert isinstance(switch, liger._LayerSwitch)
    calls = {"n": 0}
    fused = switch.fused

    def counted(*args, **kwargs):
        calls["n"] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(switch, "fused", counted)
    return calls


def _train(model, data, *, dtype=None, ckpt=False, steps=3, graphs=None):
    """Train CFGS packed; the A/B gradients of the first step are captured before its update
    (the eager step's ``optimizer.step``, or the graphed step's ``optimizer.apply`` in its first,
    eager run through the static buffers). Returns the trainer too."""
    trainer = PackedTrainer(model, TOKENIZER, data, device="cuda", dtype=dtype,
                            gradient_checkpointing=ckpt, cuda_graphs=graphs)  # fmt: skip
    inits = {}
    for cfg in CFGS:
        slot = trainer.add(cfg)
        inits[cfg.config_id] = {k: v.detach().clone()
                                for k, v in adapter_state_dict(trainer.model, slot).items()}  # fmt: skip
    grads: list[torch.Tensor] = []

    def spied(update):
        def spy(*args, **kwargs):
            if not grads:
                for layer in trainer.layers.values():
                    grads.extend(p.grad.detach().float().clone() for p in (layer.A, layer.Bt)
                                 if p.grad is not None and p.numel())  # fmt: skip
            return update(*args, **kwargs)

        return spy

    trainer.optimizer.step = spied(trainer.optimizer.step)  # type: ignore[method-assign]
    trainer.optimizer.apply = spied(trainer.optimizer.apply)  # type: ignore[method-assign]
    losses: dict[str, list[float]] = {}
    for _ in range(steps):
        for m in trainer.step():
            losses.setdefault(m.config_id, []).append(m.loss)
    weights = {c.config_id: {k: v.detach().float().cpu() for k, v in adapter_state_dict(
        trainer.model, trainer.slot_of(c.config_id)).items()} for c in CFGS}  # fmt: skip
    return losses, grads, weights, inits, trainer


def _python_steps(trainer, steps: int) -> int:
    """How many of ``steps`` ran the model's Python (eager steps and graph captures; a replay
    runs none), checking that a graphed trainer really replayed."""
    if trainer.graphs is None:
        return steps
    g = trainer.graphs
    assert g.disabled is None and g.replays >= 1, (g.disabled, g.captures, g.replays)
    return g.eager_steps + g.captures


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
def test_packed_step_with_liger_equals_stock(family, ckpt, graphs, monkeypatch):
    base = tiny_model(family, hidden=128, intermediate=256).cuda().to(torch.bfloat16)
    data = toy_dataset()
    stock = copy.deepcopy(base)
    fused = copy.deepcopy(base)
    assert liger.apply_fused_kernels(fused, "on") is True
    layer = fused.model.layers[0]
    assert layer.input_layernorm.forward.__func__ is lk.LigerRMSNorm.forward
    assert layer.mlp.forward.__func__ is lk.LigerSwiGLUMLP.forward
    calls = _count_fused_rope(fused, monkeypatch)
    lf, gf, wf, _, tf = _train(fused, data, ckpt=ckpt, graphs=graphs)
    # Liger's RoPE ran in every layer of every step that ran Python (under checkpointing the
    # recomputation in backward calls it again); a replay repeats what its capture ran
    assert calls["n"] >= _python_steps(tf, 3) * len(fused.model.layers)
    before = calls["n"]
    ls, gs, ws, _, ts = _train(stock, data, ckpt=ckpt, graphs=graphs)
    _python_steps(ts, 3)
    assert calls["n"] == before  # the unpatched copy ran the stock RoPE
    for cid in lf:
        print(family, ckpt, graphs, cid, "losses liger", lf[cid], "stock", ls[cid])
        torch.testing.assert_close(torch.tensor(lf[cid]), torch.tensor(ls[cid]), rtol=2e-2, atol=0)
    assert len(gf) == len(gs) > 0
    worst = max(
        ((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(gf, gs, strict=True)
    )
    print(family, ckpt, graphs, f"first-step A/B gradients: worst relative difference {worst:.2e}")
    assert worst < 5e-2
    for cid in wf:
        assert adapter_rel_err(wf[cid], ws[cid]) < 5e-2


def test_fp32_packed_on_liger_base_equals_peft_alone():
    """PEFT equivalence with Liger on the base: each adapter as if trained alone with PEFT on the
    stock model (fp32 on CUDA; the fused LoRA kernels serve bf16, so this is the torch path)."""
    base = tiny_model("qwen2", hidden=128, intermediate=256).cuda()
    data = toy_dataset()
    fused = copy.deepcopy(base)
    assert liger.apply_fused_kernels(fused, "on") is True
    losses, _, weights, inits, _ = _train(fused, data, dtype=torch.float32)
    for cfg in CFGS:
        ref_losses, ref_w, _ = peft_reference(base, cfg, inits[cfg.config_id], data, cfg.max_steps)
        err = adapter_rel_err(weights[cfg.config_id], {k: v.cpu() for k, v in ref_w.items()})
        print(cfg.config_id, "fp32 Liger base vs PEFT: losses", losses[cfg.config_id],
              ref_losses, f"weights {err:.2e}")  # fmt: skip
        torch.testing.assert_close(
            torch.tensor(losses[cfg.config_id]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5
        )
        assert err < 1e-3


def test_session_with_liger_trains_and_evaluates_like_stock(tmp_path):
    """``run_pack`` (the resident engine) with ``on`` and then ``off``: the same losses and packed
    eval losses within bf16 noise; the second, stock session is not touched by the first."""
    from plora.config import DatasetSpec
    from plora.engine.session import PackSession, run_pack

    loaded = []
    init = PackSession.__init__

    def spy(self, spec):
        init(self, spec)
        loaded.append(self.fused_kernels)

    data = DatasetSpec(builtin="arithmetic", num_examples=64, max_seq_len=64, eval_fraction=0.25)
    cfgs = [LoRAConfig(config_id=f"c{i}", rank=8 * (i + 1), alpha=16, lr=1e-3, batch_size=4,
                       seed=i, max_steps=6, target_modules="all") for i in range(3)]  # fmt: skip
    results = {}
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PackSession, "__init__", spy)
        for mode in ("on", "off"):
            if mode == "off":  # Liger's RoPE, as the first session switched it in
                from transformers.models.qwen2 import modeling_qwen2

                switch = modeling_qwen2.apply_rotary_pos_emb
                assert isinstance(switch, liger._LayerSwitch)
                mp.setattr(switch, "fused", lambda *a, **k: calls.append(1))
            res = run_pack(model="tiny-qwen2", configs=cfgs, dataset=data, device="cuda",
                           out_dir=tmp_path / mode, fused_kernels=mode)  # fmt: skip
            results[mode] = res.results
    assert loaded == [True, False]
    assert calls == []  # the stock session never took Liger's RoPE
    for cfg in cfgs:
        on, off = results["on"][cfg.config_id], results["off"][cfg.config_id]
        print(cfg.config_id, "train", on.final_train_loss, off.final_train_loss,
              "eval", on.eval_loss, off.eval_loss)  # fmt: skip
        assert on.eval_loss is not None and off.eval_loss is not None
        assert on.final_train_loss == pytest.approx(off.final_train_loss, rel=3e-2)
        assert on.eval_loss == pytest.approx(off.eval_loss, rel=3e-2)
