"""Adapter snapshots on CUDA: a Qwen2.5-1.5B-shaped rank-64 adapter (all seven projections, 392
bf16 tensors) crosses to the host in one transfer per chunk and exports the per-tensor bytes."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from safetensors.torch import save_file
from torch.profiler import ProfilerActivity, profile

from plora.config import LoRAConfig
from plora.engine import export as ckpt

pytestmark = pytest.mark.gpu

HIDDEN, INTERMEDIATE, KV, LAYERS, RANK = 1536, 8960, 256, 28, 64
SHAPES = {  # (in, out) of Qwen2.5-1.5B's projections
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV),
    "self_attn.v_proj": (HIDDEN, KV), "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE), "mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}  # fmt: skip


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        for name, (fan_in, fan_out) in SHAPES.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            a = torch.randn(RANK, fan_in, device="cuda", generator=g, dtype=torch.bfloat16)
            b = torch.randn(fan_out, RANK, device="cuda", generator=g, dtype=torch.bfloat16)
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = a, b
    return out


def _dtoh_copies(fn) -> int:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "Memcpy DtoH" in e.name)


def test_snapshot_is_a_few_transfers_with_the_per_tensor_bytes(tmp_path) -> None:
    weights = _weights()
    nbytes = 4 * sum(v.numel() for v in weights.values())
    chunks = math.ceil(nbytes / ckpt.SNAPSHOT_CHUNK_BYTES)
    ckpt.snapshot_weights(weights)  # warm: pinned allocator, kernels

    def per_tensor():
        return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()}

    assert _dtoh_copies(lambda: ckpt.snapshot_weights(weights)) <= chunks
    assert _dtoh_copies(per_tensor) >= len(weights)  # the checker sees per-tensor copies
    timings = {}
    for name, fn in (
        ("snapshot", lambda: ckpt.snapshot_weights(weights)),
        ("per-tensor", per_tensor),
    ):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = fn()
        timings[name] = time.perf_counter() - t0
    print(f"\n{len(weights)} tensors, {nbytes / 1e6:.0f} MB fp32: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()))  # fmt: skip
    cfg = LoRAConfig(
        config_id="g",
        rank=RANK,
        alpha=2 * RANK,
        target_modules="all",
        lr=1e-4,
        batch_size=1,
        max_steps=1,
    )
    new = ckpt.export_peft_adapter(tmp_path / "new", config=cfg, weights=weights)
    ref = tmp_path / "ref"
    ref.mkdir()
    ckpt.peft_lora_config(cfg).save_pretrained(str(ref))
    save_file(got, str(ref / ckpt.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (ref / "plora_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    for name in (ckpt.ADAPTER_CONFIG, ckpt.ADAPTER_WEIGHTS, "plora_config.json"):
        assert (new / name).read_bytes() == (ref / name).read_bytes(), name
