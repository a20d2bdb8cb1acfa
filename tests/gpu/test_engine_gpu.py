"""PackedTrainer on CUDA: the fused-kernel path against the torch path and against PEFT."""

from __future__ import annotations

import copy
import dataclasses
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

CFGS = [
    LoRAConfig(config_id="a", rank=8, alpha=16, lr=5e-3, batch_size=2, seed=1, max_steps=4,
               target_modules=("q_proj", "v_proj")),
    LoRAConfig(config_id="b", rank=24, alpha=24, lr=2e-3, batch_size=3, seed=2, max_steps=4,
               target_modules="all", schedule="cosine", warmup_steps=1),
    LoRAConfig(config_id="c", rank=64, alpha=32, lr=1e-3, batch_size=1, seed=3, max_steps=4,
               target_modules="mlp", use_rslora=True),
]  # fmt: skip


def _train(base, data, backend: str, *, dtype=None, ckpt=False, cfgs=CFGS):
    lora.set_kernel_backend(backend)
    try:
        trainer = PackedTrainer(copy.deepcopy(base), TOKENIZER, data, device="cuda", dtype=dtype,
                                gradient_checkpointing=ckpt)  # fmt: skip
        inits = {}
        for cfg in cfgs:
            slot = trainer.add(cfg)
            inits[cfg.config_id] = {k: v.detach().cpu().clone()
                                    for k, v in adapter_state_dict(trainer.model, slot).items()}  # fmt: skip
        losses: dict[str, list[float]] = {}
        while trainer.active:
            for m in trainer.step():
                losses.setdefault(m.config_id, []).append(m.loss)
        weights = {
            c.config_id: {k: v.detach().cpu() for k, v in
                          adapter_state_dict(trainer.model, trainer.slot_of(c.config_id)).items()}
            for c in cfgs
        }  # fmt: skip
        return losses, weights, inits, trainer
    finally:
        lora.set_kernel_backend("auto")


def test_fp32_on_cuda_equals_peft_alone():
    """float32 on CUDA takes the exact torch path (the fused kernels serve bf16/fp16)."""
    base = tiny_model("qwen2").cuda()
    data = toy_dataset()
    losses, weights, inits, trainer = _train(base, data, "auto", dtype=torch.float32)
    assert trainer.profile().device.startswith("cuda")
    for cfg in CFGS:
        init = {k: v.cuda() for k, v in inits[cfg.config_id].items()}
        ref_losses, ref_w, _ = peft_reference(base, cfg, init, data, cfg.max_steps)
        ref_w = {k: v.cpu() for k, v in ref_w.items()}
        err = adapter_rel_err(weights[cfg.config_id], ref_w)
        print(cfg.config_id, "fp32 cuda vs PEFT: weights", f"{err:.2e}")
        torch.testing.assert_close(
            torch.tensor(losses[cfg.config_id]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
        assert err < 1e-4


def _kernels_agree_with_torch(cfgs, label: str) -> None:
    """bf16: the fused-kernel path trains ``cfgs`` as the torch path does (losses 2e-2,
    weights 5e-2 relative)."""
    base = tiny_model("llama").cuda().to(torch.bfloat16)
    data = toy_dataset()
    assert fused.kernel() is not None  # plora.kernels is importable: the fused path runs
    lk, wk, _, tk = _train(base, data, "auto", cfgs=cfgs)
    lt, wt, _, _ = _train(base, data, "torch", cfgs=cfgs)
    assert tk.autocast_dtype == torch.bfloat16
    for cfg in cfgs:
        cid = cfg.config_id
        err = adapter_rel_err(wk[cid], wt[cid])
        print(cid, f"bf16 kernels vs torch{label}: losses", lk[cid], lt[cid], f"weights {err:.2e}")
        torch.testing.assert_close(torch.tensor(lk[cid]), torch.tensor(lt[cid]), rtol=2e-2, atol=0)
        assert err < 5e-2


def test_bf16_kernel_path_matches_torch_path():
    _kernels_agree_with_torch(CFGS, "")


def test_bf16_kernel_dropout_matches_torch_path():
    """With dropout the fused kernels regenerate the torch path's masks (one keyed Philox
    mask), so the two paths train alike within bf16 noise; different masks would not."""
    cfgs = [dataclasses.replace(c, dropout=0.1 + 0.1 * i) for i, c in enumerate(CFGS)]
    _kernels_agree_with_torch(cfgs, ", dropout")


def test_bf16_checkpointing_dropout_runs_and_repeats():
    base = tiny_model("qwen2").cuda().to(torch.bfloat16)
    data = toy_dataset()
    cfgs = [dataclasses.replace(c, dropout=0.1) for c in CFGS]
    l1, w1, _, t1 = _train(base, data, "auto", ckpt=True, cfgs=cfgs)
    l2, w2, _, _ = _train(base, data, "auto", ckpt=True, cfgs=cfgs)
    prof = t1.profile()
    assert prof.peak_memory_bytes > 0 and len(prof.steps) == 4
    for cid in l1:
        assert all(torch.isfinite(torch.tensor(l1[cid])))
        assert l1[cid] == l2[cid]
        assert adapter_rel_err(w1[cid], w2[cid]) < 1e-6


def test_ray_finds_the_gpus_torch_sees():
    """``plora.runtime.actors.cluster.ray_finds_gpus`` (asked before ``ray.init``, without torch) agrees
    with torch on a GPU machine, so a local cluster gets the real GPUs, never logical ones."""
    pytest.importorskip("ray")
    from plora.runtime.actors.cluster import ray_finds_gpus

    assert ray_finds_gpus() is torch.cuda.is_available()
