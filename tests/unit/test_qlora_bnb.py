"""plora's QLoRA (torchao NF4) against PEFT's QLoRA (bitsandbytes NF4) on CPU.

Both store the same 4-bit codes and differ in how the block scales are rounded (torchao: int8;
bitsandbytes: its 8-bit dynamic map), so the trained adapters agree to about that rounding --
several times closer than the same config trained on the dense base. Needs bitsandbytes (the
``bnb`` extra; not in ``dev``: 125 MB of CUDA binaries). The model is 64 wide: bitsandbytes
0.50's CPU path quantizes rows narrower than its 64-weight block badly (measured: 37 % error
on a 32x32 weight vs 9 % at 64 wide).
"""

from __future__ import annotations

import pytest
import torch
from _engine_testlib import TOKENIZER, adapter_rel_err, peft_reference, tiny_model, toy_dataset

pytest.importorskip("torchao", reason="QLoRA needs torchao: pip install -e '.[qlora]'")
pytest.importorskip("bitsandbytes", reason="PEFT's QLoRA reference: pip install -e '.[bnb]'")

from plora.config import LoRAConfig
from plora.engine.adapters import adapter_state_dict
from plora.engine.trainer import PackedTrainer
from plora.models.quantize import quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = [
    LoRAConfig(config_id="a", rank=4, alpha=8, lr=1e-2, batch_size=2, seed=1, max_steps=5,
               target_modules=("q_proj", "v_proj"), warmup_steps=1),
    LoRAConfig(config_id="b", rank=8, alpha=16, lr=1e-2, batch_size=3, seed=2, max_steps=5,
               target_modules="all", schedule="linear"),
]  # fmt: skip


def _wide():
    return tiny_model("qwen2", hidden=64, intermediate=128)


def _bnb_base(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=cfg, device_map={"": "cpu"}, dtype=torch.float32
    )


def test_packed_torchao_qlora_tracks_peft_bitsandbytes_qlora(tmp_path):
    import bitsandbytes as bnb

    _wide().save_pretrained(tmp_path / "base")
    base = _wide()
    quantize_model(base)
    data = toy_dataset()
    trainer = PackedTrainer(base, TOKENIZER, data, device="cpu")
    inits = {}
    for cfg in CONFIGS:
        slot = trainer.add(cfg)
        inits[cfg.config_id] = {
            k: v.clone() for k, v in adapter_state_dict(trainer.model, slot).items()
        }
    losses: dict[str, list[float]] = {}
    while trainer.active:
        for m in trainer.step():
            losses.setdefault(m.config_id, []).append(m.loss)
    for cfg in CONFIGS:
        packed = adapter_state_dict(trainer.model, trainer.slot_of(cfg.config_id))
        bnb_model = _bnb_base(tmp_path / "base")
        assert any(isinstance(m, bnb.nn.Linear4bit) for m in bnb_model.modules())
        ref_losses, ref_w, _ = peft_reference(
            bnb_model, cfg, inits[cfg.config_id], data, cfg.max_steps, copy_base=False
        )
        _, dense_w, _ = peft_reference(
            _wide(), cfg, inits[cfg.config_id], data, cfg.max_steps, copy_base=False
        )
        err, dense_err = adapter_rel_err(packed, ref_w), adapter_rel_err(dense_w, ref_w)
        # measured: 1.0e-2 / 2.4e-2 vs the dense base's 0.10 / 0.14
        assert err < 0.05 and err < 0.35 * dense_err, (err, dense_err)
        torch.testing.assert_close(
            torch.tensor(losses[cfg.config_id]), torch.tensor(ref_losses), rtol=2e-3, atol=0
        )


def test_exported_adapter_reloads_on_a_bitsandbytes_base(tmp_path):
    """An adapter trained packed on the torchao NF4 base, exported in PEFT format, reloads with
    ``PeftModel.from_pretrained`` on PEFT's QLoRA base (``BitsAndBytesConfig`` 4-bit)."""
    from peft import PeftModel

    from plora.engine.adapters import use_slot

    _wide().save_pretrained(tmp_path / "base")
    base = _wide()
    quantize_model(base)
    trainer = PackedTrainer(base, TOKENIZER, toy_dataset(), device="cpu")
    trainer.add(CONFIGS[1])
    while trainer.active:
        trainer.step()
    trainer.export_adapter("b", tmp_path / "adapter")
    ids = torch.tensor([[5, 17, 42, 33, 3, 50, 7]])
    with torch.no_grad(), use_slot(trainer.model, trainer.slot_of("b")):
        want = trainer.model(input_ids=ids).logits
    with torch.no_grad(), use_slot(trainer.model, None):
        plain = trainer.model(input_ids=ids).logits
    peft_model = PeftModel.from_pretrained(_bnb_base(tmp_path / "base"), tmp_path / "adapter")
    got = peft_model(input_ids=ids).logits.detach()  # (bitsandbytes' CPU no-grad path repacks)
    err = float((got - want).norm() / want.norm())
    print(f"PEFT on bnb-NF4 vs plora on torchao-NF4: logits {err:.2e}")
    assert err < 0.02, err  # the two NF4 formats' scale rounding
    assert float((want - plain).norm() / want.norm()) > 5 * err  # the adapter matters more
