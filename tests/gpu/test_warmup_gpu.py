"""The first job's kernel warm-up process compiles what the pack's first step launches: a fresh
training process sharing its Triton cache directory then compiles nothing (each process is
fresh, so no earlier test's in-process kernels can hide a miss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _engine_testlib import tiny_model

from plora.config import LoRAConfig

pytestmark = pytest.mark.gpu

UNIT = Path(__file__).resolve().parents[1] / "unit"
HIDDEN, INTERMEDIATE, SEQ = 256, 512, 40
CONFIGS = [  # mixed ranks, one with dropout
    dict(config_id=f"a{i}", rank=r, alpha=2 * r, lr=1e-3, batch_size=4, seed=i, max_steps=3,
         target_modules="all", dropout=p)
    for i, (r, p) in enumerate([(8, 0.0), (16, 0.1), (64, 0.0)])
]  # fmt: skip

STEP = f"""
import dataclasses, sys
import torch
sys.path.insert(0, {str(UNIT)!r})
from _engine_testlib import TOKENIZER, tiny_model, toy_dataset
from plora.config import LoRAConfig
from plora.engine.evaluate_packed import evaluate_adapters
from plora.engine.trainer import PackedTrainer

model = tiny_model(hidden={HIDDEN}, intermediate={INTERMEDIATE}).to("cuda", torch.bfloat16)
if sys.argv[1] != "off":  # Liger's ops, as a sweep's engine patches them
    from plora.engine.liger import apply_fused_kernels
    assert apply_fused_kernels(model, sys.argv[1], device="cuda")
data = toy_dataset(128, fixed_len={SEQ})
data = dataclasses.replace(data, eval=data.train)  # 3 x 128 rows: full eval forwards of 128
trainer = PackedTrainer(model, TOKENIZER, data, device="cuda")
for c in {CONFIGS!r}:
    trainer.add(LoRAConfig(**c))
trainer.step()
evaluate_adapters(trainer.eval_model, TOKENIZER, data, [0, 1, 2])
torch.cuda.synchronize()
"""


def _entries(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


def _run(args: list[str], cache: Path, stdin: str | None = None) -> str:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    out = subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("fused", ["off", "on"])
def test_warm_up_process_compiles_what_the_first_step_and_evaluation_launch(tmp_path, fused):
    if fused == "on":
        pytest.importorskip("liger_kernel")
    cold = tmp_path / "cold"
    _run(["-c", STEP, fused], cold)  # the control: a fresh process's first step compiles kernels
    assert _entries(cold)

    model_dir = tmp_path / "model"
    tiny_model(hidden=HIDDEN, intermediate=INTERMEDIATE).config.save_pretrained(model_dir)
    configs = [LoRAConfig(**c).to_dict() for c in CONFIGS]
    job = {"model": str(model_dir), "configs": configs, "seq_len": SEQ, "max_rows": None}
    warm = tmp_path / "warm"
    report = json.loads(_run(["-m", "plora.engine.warmup"], warm, json.dumps(job)).splitlines()[-1])
    # q, k/v, o, gate/up, down of the tiny Qwen2: 5 distinct (in, out, bias)
    assert report["skipped"] is None and len(report["shapes"]) == 5, report
    if fused == "on":  # the second child: Liger's ops on one layer (12 rows: 3 configs x 4)
        job = {"part": "fused", "model": str(model_dir), "fused_kernels": "on", "rows": 12,
               "seq_len": SEQ}  # fmt: skip
        out = _run(["-m", "plora.engine.warmup"], warm, json.dumps(job)).splitlines()[-1]
        report = json.loads(out)
        assert report["skipped"] is None and report["fused_layer_s"] > 0, report
    warmed = _entries(warm)
    assert warmed
    _run(["-c", STEP, fused], warm)
    assert _entries(warm) == warmed  # the step and the evaluation found every kernel cached
