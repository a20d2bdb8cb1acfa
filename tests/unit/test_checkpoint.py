"""PEFT-format export (reload with PeftModel.from_pretrained) and exact resume from train-state."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _engine_testlib import TOKENIZER, tiny_model, toy_dataset
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file

from plora.config import LoRAConfig
from plora.engine.adapters import adapter_state_dict, use_slot
from plora.engine.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    export_peft_adapter,
    has_train_state,
    load_train_state,
    save_train_state,
)
from plora.engine.trainer import AdapterStatus, PackedTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


CFGS = [
    LoRAConfig(config_id="x", rank=6, alpha=12, lr=1e-2, batch_size=2, seed=1, max_steps=5,
               target_modules=("q_proj", "v_proj", "up_proj"), dropout=0.2),
    LoRAConfig(config_id="y", rank=16, alpha=8, lr=5e-3, batch_size=3, seed=2, max_steps=8,
               target_modules="all", schedule="cosine", warmup_steps=2, use_rslora=True,
               weight_decay=0.05),
]  # fmt: skip


def _trained(base, data, steps=6, **kw):
    trainer = PackedTrainer(copy.deepcopy(base), TOKENIZER, data, device="cpu", **kw)
    for cfg in CFGS:
        trainer.add(cfg)
    for _ in range(steps):
        trainer.step()
    return trainer


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_export_reloads_with_peft_and_gives_same_logits(tmp_path, family):
    base = tiny_model(family)
    data = toy_dataset()
    trainer = _trained(base, data)
    x = torch.randint(3, 60, (3, 9))
    for cfg in CFGS:
        out = tmp_path / cfg.config_id
        trainer.export_adapter(cfg.config_id, out)
        assert sorted(p.name for p in out.iterdir()) == [
            ADAPTER_CONFIG,
            ADAPTER_WEIGHTS,
            "plora_config.json",
        ]
        meta = json.loads((out / ADAPTER_CONFIG).read_text())
        assert meta["r"] == cfg.rank and meta["lora_alpha"] == cfg.alpha
        assert sorted(meta["target_modules"]) == sorted(cfg.target_modules)
        assert meta["lora_dropout"] == cfg.dropout and meta["use_rslora"] == cfg.use_rslora
        # PEFT's own key names for this config
        ref = get_peft_model(
            copy.deepcopy(base),
            LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules)),
        )
        assert set(load_file(out / ADAPTER_WEIGHTS)) == set(get_peft_model_state_dict(ref))
        reloaded = PeftModel.from_pretrained(copy.deepcopy(base), out).eval()
        trainer.model.eval()
        with torch.no_grad(), use_slot(trainer.model, trainer.slot_of(cfg.config_id)):
            ours = trainer.model(x).logits
        with torch.no_grad():
            theirs = reloaded(x).logits
            plain = base(x).logits
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert float((theirs - plain).abs().max()) > 1e-3  # the adapter changes the output
        trainer.model.train()


def test_export_is_atomic_and_rejects_foreign_keys(tmp_path):
    cfg = CFGS[0]
    with pytest.raises(ValueError, match="PEFT-keyed"):
        export_peft_adapter(tmp_path / "bad", config=cfg, weights={"q.weight": torch.zeros(2)})
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporaries left behind


def test_resume_is_bitwise_identical(tmp_path):
    base = tiny_model("qwen2")
    data = toy_dataset()
    straight = _trained(base, data, steps=9, max_rows=3)
    # stop after 4 steps, checkpoint, resume into a fresh trainer on a fresh model copy
    first = _trained(base, data, steps=4, max_rows=3)
    save_train_state(tmp_path / "ckpt", first.state_dict())
    assert has_train_state(tmp_path / "ckpt")
    resumed = PackedTrainer(copy.deepcopy(base), TOKENIZER, data, device="cpu", max_rows=3)
    resumed.load_state_dict(load_train_state(tmp_path / "ckpt"))
    assert resumed.active == first.active and resumed.global_step == 4
    for _ in range(5):
        resumed.step()
    assert resumed.status("x") is AdapterStatus.COMPLETED  # x finished at step 5
    for cfg in CFGS:
        a = adapter_state_dict(straight.model, straight.slot_of(cfg.config_id))
        b = adapter_state_dict(resumed.model, resumed.slot_of(cfg.config_id))
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert straight.adapter(cfg.config_id).losses == resumed.adapter(cfg.config_id).losses


def test_resume_after_an_adapter_completed(tmp_path):
    base = tiny_model("llama")
    data = toy_dataset()
    first = _trained(base, data, steps=6)  # x (5 steps) is done, y is not
    assert first.finished == ["x"]
    save_train_state(tmp_path / "c", first.state_dict())
    resumed = PackedTrainer(copy.deepcopy(base), TOKENIZER, data, device="cpu")
    resumed.load_state_dict(load_train_state(tmp_path / "c"))
    assert resumed.finished == ["x"] and resumed.active == ["y"]
    done = adapter_state_dict(first.model, first.slot_of("x"))
    again = adapter_state_dict(resumed.model, resumed.slot_of("x"))
    assert all(torch.equal(done[k], again[k]) for k in done)
    assert [m.step for m in resumed.step()] == [7]


def test_resume_from_a_version_1_train_state(tmp_path):
    """Train-states written before the packed optimizer (one torch AdamW state dict per
    adapter, version 1) still resume exactly."""
    base = tiny_model("qwen2")
    data = toy_dataset()
    straight = _trained(base, data, steps=7)
    state = _trained(base, data, steps=4).state_dict()
    assert state["version"] == 2
    for st in state["adapters"].values():  # rewrite as version 1 would have stored it
        opt = st.pop("optimizer")
        per = {
            i: {"step": torch.tensor(float(opt["step"])), "exp_avg": opt["exp_avg"][k],
                "exp_avg_sq": opt["exp_avg_sq"][k]}
            for i, k in enumerate(st["weights"])
        }  # fmt: skip
        st["optimizer"] = {"state": per, "param_groups": [{"params": list(per)}]}
        st["scheduler"] = {"last_epoch": st["step"]}
    state["version"] = 1
    save_train_state(tmp_path / "v1", state)
    resumed = PackedTrainer(copy.deepcopy(base), TOKENIZER, data, device="cpu")
    resumed.load_state_dict(load_train_state(tmp_path / "v1"))
    for _ in range(3):
        resumed.step()
    for cfg in CFGS:
        a = adapter_state_dict(straight.model, straight.slot_of(cfg.config_id))
        b = adapter_state_dict(resumed.model, resumed.slot_of(cfg.config_id))
        assert all(torch.equal(a[k], b[k]) for k in a)
    fresh = PackedTrainer(copy.deepcopy(base), TOKENIZER, data, device="cpu")
    with pytest.raises(ValueError, match="train-state version"):
        fresh.load_state_dict({"version": 3})
