"""The QLoRA benchmarks run end to end at toy sizes on CPU (the GPU numbers come from the lead)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchao", reason="QLoRA needs torchao: pip install -e '.[qlora]'")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def test_engine_throughput_smoke_with_nf4(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(BENCH)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "engine_throughput.py"), "--smoke", "--quantization", "nf4",
         "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "engine_throughput_nf4.json").read_text())
    assert out["quantization"] == "nf4"
    rows = out["rows"]
    # --graphs both (the default): each pack with the eager step, then graphed
    cases = ["peft", "packed-1", "packed-1+graphs", "packed-4", "packed-4+graphs"]
    assert [r["case"] for r in rows] == cases
    assert all(r["quantization"] == "nf4" and r["tokens_per_s"] > 0 for r in rows)
    # the prediction is the cost model's QLoRA one: below the dense base's for the same pack
    sys.path.insert(0, str(BENCH))
    try:
        import engine_throughput as et
        from transformers import Qwen2Config

        from plora.model_spec import ModelSpec

        cfg = Qwen2Config(**{k: v for k, v in et.SMOKE_CONFIG.items() if k != "model_type"})
        spec = ModelSpec.from_hf_config(cfg)
        cfgs = et.adapter_configs(4, 16)
        nf4 = et.predicted_bytes(spec, cfgs, 32, liger=False, ckpt=False, quantization="nf4")
        dense = et.predicted_bytes(spec, cfgs, 32, liger=False, ckpt=False)
        assert nf4 < dense
        assert rows[-1]["predicted_gib"] * 2**30 == pytest.approx(nf4)
    finally:
        sys.path.remove(str(BENCH))


def test_qlora_gemm_shape_checks_every_path_against_its_twin():
    sys.path.insert(0, str(BENCH))
    try:
        import qlora_gemm
        import torch

        row = qlora_gemm.bench_shape("q_proj", 128, 256, 16, torch.device("cpu"), torch.float32, 1)
    finally:
        sys.path.remove(str(BENCH))
    assert row["nf4_err"] < 1e-5  # F.linear on NF4 == x · dequantized weight
    assert row["int4_err"] < 2e-2  # torch's int4 GEMM == x · its dequantized twin (bf16)
    assert all(row[k] > 0 for k in ("dense_ms", "dequant_ms", "nf4_ms", "int4_ms", "nf4_dx_ms"))
