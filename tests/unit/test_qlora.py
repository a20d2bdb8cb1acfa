"""QLoRA: packed training on an NF4 base equals each adapter trained alone on the same NF4 base.

fp32 compute on the CPU, NF4 storage (torchao). The reference is PEFT on a separately built
copy of the same quantized model (built the same way: quantization is deterministic, and a
deep copy would re-quantize); the packed engine shares no code with it beyond the data stream.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
from _engine_testlib import (
    TOKENIZER,
    adapter_rel_err,
    assert_same_adapter,
    peft_reference,
    tiny_model,
    toy_dataset,
)

pytest.importorskip("torchao", reason="QLoRA needs torchao: pip install -e '.[qlora]'")

from plora.kernels import packed_lora_linear

from plora.config import ConfigError, LoRAConfig, ModelRef
from plora.cost.memory_options import NF4_BYTES_PER_PARAM
from plora.engine import fused
from plora.engine.adapters import adapter_state_dict, add_adapter, inject, packed_segments
from plora.engine.trainer import PackedTrainer
from plora.models import quantize as q

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 5
# lr 1e-2, not 2e-2, for "a": at 2e-2 one A element of v_proj gets a gradient of ~1e-8 at its
# step 3 (B starts at zero, warmup 1), where Adam turns fp32 GEMM-shape noise into 9e-5 on that
# element alone -- in a pack of one as well (3.8e-5 relative), i.e. not an effect of packing.
CONFIGS = [
    LoRAConfig(config_id="a", rank=4, alpha=8, lr=1e-2, batch_size=2, seed=1, max_steps=STEPS,
               target_modules=("q_proj", "v_proj"), warmup_steps=1),
    LoRAConfig(config_id="b", rank=8, alpha=16, lr=1e-2, batch_size=3, seed=2, max_steps=STEPS,
               target_modules="all", schedule="linear", weight_decay=0.01, max_grad_norm=0.05),
    LoRAConfig(config_id="c", rank=16, alpha=8, lr=5e-3, batch_size=1, seed=3, max_steps=STEPS,
               target_modules="mlp", schedule="cosine", use_rslora=True, max_grad_norm=None),
]  # fmt: skip


def nf4_model(family: str = "qwen2") -> torch.nn.Module:
    model = tiny_model(family)
    assert q.quantize_model(model, "nf4") == 2 * 7
    return model


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_nf4_pack_equals_peft_alone_on_the_same_nf4_base(family):
    data = toy_dataset()
    trainer = PackedTrainer(nf4_model(family), TOKENIZER, data, device="cpu")
    inits = {}
    for cfg in CONFIGS:
        slot = trainer.add(cfg)
        inits[cfg.config_id] = {
            k: v.clone() for k, v in adapter_state_dict(trainer.model, slot).items()
        }
    losses: dict[str, list[float]] = {}
    for _ in range(STEPS):
        for m in trainer.step():
            losses.setdefault(m.config_id, []).append(m.loss)
    assert trainer.active == []
    for cfg in CONFIGS:
        packed = adapter_state_dict(trainer.model, trainer.slot_of(cfg.config_id))
        ref_losses, ref_w, pm = peft_reference(
            nf4_model(family), cfg, inits[cfg.config_id], data, STEPS, copy_base=False
        )
        # PEFT really ran on the 4-bit base (its LoRA layers wrap NF4 linears)
        assert any(q.is_nf4(getattr(m, "weight", None)) for m in pm.modules())
        torch.testing.assert_close(
            torch.tensor(losses[cfg.config_id]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
        assert_same_adapter(packed, ref_w, tol=1e-5)
        # and the base matters: the same config on the dense base ends far from it
        _, dense_w, _ = peft_reference(
            tiny_model(family), cfg, inits[cfg.config_id], data, STEPS, copy_base=False
        )
        assert adapter_rel_err(packed, dense_w) > 1e-3


def test_quantize_model_stores_nf4_and_is_deterministic():
    dense = tiny_model("qwen2")
    model = nf4_model("qwen2")
    again = nf4_model("qwen2")
    proj = model.model.layers[0].self_attn.k_proj  # 16 x 32: 8 blocks, one scale group of 8
    assert q.is_quantized(proj) and not proj.weight.requires_grad
    assert proj.weight.scaler_block_size == 8
    assert not q.is_quantized(model.lm_head) and not q.is_nf4(model.model.embed_tokens.weight)
    ref = dense.model.layers[0].self_attn.k_proj.weight.detach()
    deq = q.dense_weight(proj, torch.float32)
    # NF4 on Gaussian weights: ~9 % relative error; per block at most half NF4's widest gap
    # (1 - 0.723)/2 of the block absmax, plus the int8 rounding of the scale itself
    rel = float((deq - ref).norm() / ref.norm())
    assert 0.05 < rel < 0.12
    block_max = ref.flatten().view(-1, q.BLOCK_SIZE).abs().amax(1, keepdim=True)
    assert ((deq - ref).flatten().view(-1, q.BLOCK_SIZE).abs() / block_max).max() < 0.16
    for m1, m2 in zip(model.modules(), again.modules(), strict=True):
        if q.is_quantized(m1):
            assert torch.equal(m1.weight.quantized_data, m2.weight.quantized_data)
            assert torch.equal(q.dense_weight(m1, torch.float32), q.dense_weight(m2, torch.float32))
    # storage: 4-bit codes + int8 scales + one fp32 factor per group (the cost model's 0.52 B)
    params = sum(m.weight.numel() for m in model.modules() if q.is_quantized(m))
    assert q.quantized_bytes(model) / params == pytest.approx(NF4_BYTES_PER_PARAM, rel=0.02)
    model.to("cpu")
    assert q.is_quantized(proj)  # moving keeps NF4
    assert q.quantize_model(model) == 0  # already quantized
    assert q.quantize_model(tiny_model("qwen2"), "none") == 0


def test_quantize_errors_name_the_module_and_the_fix():
    odd = torch.nn.Module()
    odd.layers = torch.nn.ModuleList([torch.nn.Module()])
    odd.layers[0].q_proj = torch.nn.Linear(10, 10)
    with pytest.raises(ConfigError, match=r"layers\.0\.q_proj: \(10, 10\) has 100 weights"):
        q.quantize_model(odd)
    with pytest.raises(ConfigError, match="no Llama/Qwen2-style projection"):
        q.quantize_model(torch.nn.Sequential(torch.nn.Linear(64, 64)))
    with pytest.raises(ConfigError, match="must be one of none, nf4"):
        ModelRef(name_or_path="tiny-qwen2", quantization="int3")
    ref = ModelRef(name_or_path="tiny-qwen2", quantization="NF4")
    assert ref.quantization == "nf4" and ref.quantized and ref.profile_key == "tiny-qwen2@nf4"
    assert ModelRef(name_or_path="tiny-qwen2").profile_key == "tiny-qwen2"


def _layer(weight: torch.Tensor, nf4: bool) -> torch.nn.Module:
    """A one-layer 'model' (``layers.0.q_proj``) with two adapters, for the fused path."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    model.layers[0].q_proj = linear
    if nf4:
        q.quantize_model(model, targets=("q_proj",))
    inject(model, targets=("q_proj",))
    for slot, rank in enumerate((4, 8)):
        cfg = LoRAConfig(config_id=f"s{slot}", rank=rank, alpha=2 * rank, lr=1e-3,
                         batch_size=1, seed=slot, max_steps=1, target_modules=("q_proj",))  # fmt: skip
        add_adapter(model, slot, cfg)
    layer = model.layers[0].q_proj
    with torch.no_grad():
        layer.Bt.copy_(torch.randn(layer.Bt.shape, generator=torch.Generator().manual_seed(1)))
    return model


def test_fused_path_dequantizes_per_layer_and_recomputes_in_backward(monkeypatch):
    """The kernel bridge on an NF4 base (CPU, the kernels' torch twin as the fused op) equals it
    on the dense dequantized weight, and autograd does not keep the dense weight alive."""
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    qmodel = _layer(w, nf4=True)
    deq = q.dense_weight(qmodel.layers[0].q_proj.base_layer, torch.float32)
    dmodel = _layer(deq, nf4=False)
    fn = functools.partial(packed_lora_linear, backend="torch")
    made: list[weakref.ref] = []
    real = q.dense_weight

    def spy(module, dtype):
        out = real(module, dtype)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(fused, "dense_weight", spy)
    x = torch.randn(3, 5, 64)
    outs = []
    for model in (qmodel, dmodel):
        layer = model.layers[0].q_proj
        xi = x.clone().requires_grad_(True)
        pieces = [(0, 0, 1), (1, 1, 3)]
        with packed_segments(model, pieces):
            y = fused.fused_forward(fn, layer, xi, pieces, layer.routing)
        if model is qmodel:
            gc.collect()
            assert made and made[0]() is None  # the dense weight died after the forward
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        outs.append((y.detach(), xi.grad, layer.A.grad, layer.Bt.grad))
        if model is qmodel:
            assert len(made) == 2  # dequantized again for dX = dY·W
    for got, want in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_recompute_saved_is_what_frees_the_weight():
    """Without the hook the graph holds the dense weight; with it, a recipe (checks the check)."""
    for hooked in (False, True):
        w = torch.randn(8, 8)
        x = torch.randn(2, 8, requires_grad=True)
        ref = weakref.ref(w)
        rebuilt: list[int] = []

        def rebuild(log=rebuilt):
            log.append(1)
            return torch.ones(8, 8)

        if hooked:
            with q.recompute_saved(w, rebuild):
                y = x @ w.t()
        else:
            y = x @ w.t()
        del w
        gc.collect()
        assert (ref() is None) is hooked
        y.sum().backward()
        assert len(rebuilt) == int(hooked)
        if hooked:  # backward used the rebuilt tensor (ones), not the freed one
            torch.testing.assert_close(x.grad, torch.full((2, 8), 8.0))


def test_run_pack_on_nf4_exports_adapters_that_reload_with_peft(tmp_path):
    """A QLoRA pack through the engine's one door (``run_pack``), exported in PEFT format:
    PEFT reloads each adapter on the NF4 base (same logits as plora's packed layer with the
    adapter in a slot: two independent paths) and on the dense fp32 base it names."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from plora.config import DatasetSpec
    from plora.engine import run_pack
    from plora.engine.adapters import load_adapter_state_dict, use_slot
    from plora.models import load_model

    data = DatasetSpec(builtin="arithmetic", num_examples=32, max_seq_len=32, eval_fraction=0.1)
    configs = [
        LoRAConfig(config_id="q1", rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=3, seed=1),
        LoRAConfig(config_id="q2", rank=8, alpha=16, lr=1e-2, batch_size=3, max_steps=3, seed=2,
                   target_modules="all"),
    ]  # fmt: skip
    ref = ModelRef(name_or_path="tiny-qwen2", quantization="nf4")
    res = run_pack(model=ref, configs=configs, dataset=data, out_dir=tmp_path, device="cpu")
    assert all(r.eval_loss is not None and r.eval_loss > 0 for r in res.results.values())
    dense_res = run_pack(model="tiny-qwen2", configs=configs[:1], dataset=data,
                         out_dir=tmp_path / "dense", device="cpu")  # fmt: skip
    assert dense_res.results["q1"].eval_loss != pytest.approx(res.results["q1"].eval_loss, rel=1e-4)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    for cfg in configs:
        path = tmp_path / "adapters" / cfg.config_id
        weights = load_file(path / "adapter_model.safetensors")
        assert any("lora_B" in k and v.abs().max() > 0 for k, v in weights.items())
        # plora: NF4 base, packed layers, the exported weights in slot 0
        mine, _ = load_model(ref)
        inject(mine)
        add_adapter(mine, 0, cfg)
        load_adapter_state_dict(mine, 0, weights)
        with torch.no_grad(), use_slot(mine, 0):
            want = mine(input_ids=ids).logits
        # PEFT on the NF4 base
        base, _ = load_model(ref)
        assert any(q.is_quantized(m) for m in base.modules())
        peft_nf4 = PeftModel.from_pretrained(base, path).eval()
        with torch.no_grad():
            got = peft_nf4(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # PEFT on the dense base the adapter names: it loads and applies the same LoRA term
        dense, _ = load_model("tiny-qwen2")
        peft_dense = PeftModel.from_pretrained(dense, path).eval()
        with torch.no_grad():
            dense_logits = peft_dense(input_ids=ids).logits
            with peft_dense.disable_adapter():
                dense_base = peft_dense(input_ids=ids).logits
        assert not torch.allclose(dense_logits, dense_base)  # the adapter is applied
        assert not torch.allclose(dense_logits, got, atol=1e-4)  # and the base is not NF4
        # NF4 rounds the base, not the adapter: same outputs up to the quantization error
        assert (dense_logits - got).abs().max() < 0.1 * dense_logits.abs().max()


def test_fused_path_on_nf4_under_activation_checkpointing():
    """Non-reentrant checkpointing (the trainer's) nests its saved-tensor hooks around ours:
    forward, recomputation and backward still equal the dense path's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    qmodel = _layer(torch.randn(64, 64), nf4=True)
    dmodel = _layer(q.dense_weight(qmodel.layers[0].q_proj.base_layer, torch.float32), nf4=False)
    fn = functools.partial(packed_lora_linear, backend="torch")
    x = torch.randn(3, 5, 64)
    pieces = [(0, 0, 1), (1, 1, 3)]
    outs = []
    for model in (qmodel, dmodel):
        layer = model.layers[0].q_proj
        xi = x.clone().requires_grad_(True)
        with packed_segments(model, pieces):
            y = checkpoint(lambda t, layer=layer: fused.fused_forward(fn, layer, t, pieces, layer.routing),
                           xi, use_reentrant=False)  # fmt: skip
            (y * y).sum().backward()
        outs.append((y.detach(), xi.grad, layer.A.grad, layer.Bt.grad))
    for got, want in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
