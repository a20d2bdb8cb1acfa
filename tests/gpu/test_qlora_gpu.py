"""QLoRA on CUDA: packed training on a torchao NF4 base vs PEFT + bitsandbytes QLoRA.

Run on a GPU machine with ``pip install -e '.[dev,bnb]'``:
``python -m pytest -q -s tests/gpu/test_qlora_gpu.py`` (``-s`` prints the measured gaps).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _engine_testlib import (
    TOKENIZER,
    adapter_rel_err,
    peft_reference,
    tiny_model,
    toy_dataset,
)

from plora.config import LoRAConfig
from plora.engine import fused, lora
from plora.engine.adapters import adapter_state_dict
from plora.engine.trainer import PackedTrainer

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao", reason="QLoRA needs torchao: pip install -e '.[qlora]'")

from plora.models.quantize import is_quantized, quantize_model  # noqa: E402

CFG = LoRAConfig(config_id="q", rank=16, alpha=32, lr=2e-3, batch_size=2, seed=1, max_steps=6,
                 target_modules="all")  # fmt: skip
PACK = [
    CFG,
    LoRAConfig(config_id="r", rank=8, alpha=8, lr=5e-3, batch_size=3, seed=2, max_steps=6,
               target_modules=("q_proj", "v_proj")),
]  # fmt: skip


def _wide(family: str = "qwen2") -> torch.nn.Module:
    """64 wide: every projection has rows of >= 64 weights, one bitsandbytes block (its CPU
    path mis-quantizes narrower rows; the same shapes keep the CUDA comparison clean)."""
    return tiny_model(family, hidden=64, intermediate=128)


def _nf4_base(family: str = "qwen2") -> torch.nn.Module:
    model = _wide(family).to(torch.bfloat16)
    quantize_model(model, "nf4", device="cuda")
    return model.cuda()


def _train_packed(base, data, configs, backend: str = "auto"):
    lora.set_kernel_backend(backend)
    try:
        trainer = PackedTrainer(base, TOKENIZER, data, device="cuda")
        inits = {}
        for cfg in configs:
            slot = trainer.add(cfg)
            inits[cfg.config_id] = {
                k: v.detach().clone() for k, v in adapter_state_dict(trainer.model, slot).items()
            }
        losses: dict[str, list[float]] = {}
        while trainer.active:
            for m in trainer.step():
                losses.setdefault(m.config_id, []).append(m.loss)
        weights = {
            c.config_id: {
                k: v.detach().float().cpu()
                for k, v in adapter_state_dict(trainer.model, trainer.slot_of(c.config_id)).items()
            }
            for c in configs
        }
        return losses, weights, inits, trainer
    finally:
        lora.set_kernel_backend("auto")


def _bnb_base(tmp_path: Path, family: str = "qwen2") -> torch.nn.Module:
    """The same tiny model saved in bf16 and loaded the PEFT-QLoRA way (bitsandbytes NF4)."""
    bnb = pytest.importorskip("bitsandbytes", reason="pip install -e '.[bnb]'")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = tmp_path / f"tiny-{family}"
    if not path.exists():
        _wide(family).to(torch.bfloat16).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.bfloat16,
        device_map={"": 0},
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
    )
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    return model


def test_packed_qlora_matches_peft_bitsandbytes_qlora(tmp_path):
    """One config in a pack of two on the torchao NF4 base (bf16 autocast, fused kernels) vs
    that config alone with PEFT on a bitsandbytes NF4 base (bf16 compute): the same training
    within bf16 tolerance (the two libraries round the block scales differently)."""
    data = toy_dataset()
    losses, weights, inits, trainer = _train_packed(_nf4_base(), data, PACK)
    assert trainer.autocast_dtype == torch.bfloat16
    assert any(is_quantized(m) for m in trainer.model.modules())
    ref_losses, ref_w, _ = peft_reference(
        _bnb_base(tmp_path), CFG, inits["q"], data, CFG.max_steps, copy_base=False
    )
    ref_w = {k: v.float().cpu() for k, v in ref_w.items()}
    err = adapter_rel_err(weights["q"], ref_w)
    # for scale: the same config with PEFT on the dense bf16 base
    _, dense_w, _ = peft_reference(
        _wide().to(torch.bfloat16).cuda(), CFG, inits["q"], data, CFG.max_steps,
        copy_base=False,
    )  # fmt: skip
    dense_err = adapter_rel_err({k: v.float().cpu() for k, v in dense_w.items()}, ref_w)
    print("packed torchao-NF4 vs PEFT bnb-NF4: losses", losses["q"], ref_losses,
          f"weights {err:.2e}; PEFT dense bf16 vs bnb-NF4: weights {dense_err:.2e}")  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(losses["q"]), torch.tensor(ref_losses), rtol=2e-2, atol=0
    )
    assert err < 5e-2


def test_qlora_fused_kernels_match_the_torch_path():
    """bf16 on an NF4 base: the fused kernels (dequantize per layer, recompute in backward)
    vs the torch path (torchao ``linear_nf4`` + the LoRA reference)."""
    assert fused.kernel() is not None
    data = toy_dataset()
    lk, wk, _, tk = _train_packed(_nf4_base("llama"), data, PACK, "auto")
    lt, wt, _, _ = _train_packed(_nf4_base("llama"), data, PACK, "torch")
    for cfg in PACK:
        cid = cfg.config_id
        err = adapter_rel_err(wk[cid], wt[cid])
        print(cid, "NF4 bf16 kernels vs torch: losses", lk[cid], lt[cid], f"weights {err:.2e}")
        torch.testing.assert_close(torch.tensor(lk[cid]), torch.tensor(lt[cid]), rtol=2e-2, atol=0)
        assert err < 5e-2
    assert tk.profile().peak_memory_bytes > 0


def test_exported_adapter_reloads_on_the_bitsandbytes_base(tmp_path):
    """An adapter trained on the torchao NF4 base reloads with PEFT on a bitsandbytes 4-bit base
    (``BitsAndBytesConfig``) and gives the logits of plora's model within bf16 tolerance."""
    from peft import PeftModel

    from plora.engine.adapters import use_slot

    data = toy_dataset()
    _, _, _, trainer = _train_packed(_nf4_base(), data, [CFG])
    out = tmp_path / "adapter"
    trainer.export_adapter("q", out)
    ids = torch.tensor([[5, 17, 42, 33, 3, 50, 7]], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with use_slot(trainer.model, trainer.slot_of("q")):
            want = trainer.model(input_ids=ids).logits.float()
        peft_model = PeftModel.from_pretrained(_bnb_base(tmp_path), out).eval()
        got = peft_model(input_ids=ids).logits.float()
    err = float((got - want).norm() / want.norm())
    print(f"PEFT on bnb-NF4 vs plora on torchao-NF4: logits rel err {err:.2e}")
    assert err < 5e-2
