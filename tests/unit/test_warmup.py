"""The kernel warm-up's process protocol on a machine without CUDA (the compile itself:
tests/gpu/test_warmup_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch

from plora.config import DatasetSpec, LoRAConfig, ModelRef
from plora.engine.api import EngineSpec, PackRequest
from plora.engine.warmup import (
    WarmupReport,
    finish_warmup,
    spawn_warmup,
    start_fused_warmup,
    start_warmup,
    warm_pack_kernels,
)
from plora.model_spec import ModelSpec

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA paths")
CFG = LoRAConfig(config_id="a", rank=8, alpha=16, lr=1e-3, batch_size=4, max_steps=3)


def test_report_round_trips_through_json():
    report = WarmupReport(
        shapes=((1536, 256, True), (8960, 1536, False)), tokens=30720, seconds=4.5
    )
    assert WarmupReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


@no_cuda
def test_nothing_is_started_or_compiled_without_cuda(tmp_path):
    spec = EngineSpec(
        model=ModelRef(name_or_path="tiny-qwen2"), dataset=DatasetSpec(path="x.jsonl")
    )
    request = PackRequest(job_id="j1", configs=(CFG,), out_dir=str(tmp_path))
    assert start_warmup(spec, request) is None
    assert finish_warmup(None).skipped == "no warm-up process"
    model = ModelSpec.from_hf_config("tiny-qwen2")
    assert warm_pack_kernels(model, [CFG], seq_len=40, device="cpu").skipped == "not a CUDA pack"


@no_cuda
def test_the_child_reports_through_finish_warmup(tmp_path):
    job = {"model": "tiny-qwen2", "configs": [CFG.to_dict()], "seq_len": 40, "max_rows": None}
    report = finish_warmup(spawn_warmup(job), timeout_s=120)
    assert report.skipped == "not a CUDA pack" and report.shapes == ()
    spec = EngineSpec(
        model=ModelRef(name_or_path="tiny-qwen2"), dataset=DatasetSpec(path="x.jsonl")
    )
    request = PackRequest(job_id="j1", configs=(CFG,), out_dir=str(tmp_path))
    assert start_fused_warmup(spec, request) is None
    # the fused child: no CUDA to build its layer on, reported
    fused = {"part": "fused", "model": "tiny-qwen2", "fused_kernels": "auto", "rows": 4,
             "seq_len": 40}  # fmt: skip
    report = finish_warmup(spawn_warmup(fused), timeout_s=120)
    assert report.skipped is not None and report.fused_layer_s is None


def test_a_child_that_fails_is_reported_not_raised():
    proc = spawn_warmup({"model": "tiny-qwen2"})  # no configs: the child raises KeyError
    report = finish_warmup(proc, timeout_s=120)
    assert report.skipped is not None and "exited with 1" in report.skipped


def test_the_fused_layer_runs_the_step_and_an_evaluation_forward(monkeypatch):
    """Liger's ops (CUDA only) compile as the steps and the packed evaluation launch them: one
    decoder layer of the base's architecture, forward and backward at the step's rows, then
    gradient-free forwards at a full evaluation forward's rows."""
    from plora.engine import liger, warmup
    from plora.engine.eval_rows import rows_per_forward
    from plora.models import resolve_model_path

    path = resolve_model_path("tiny-qwen2")
    kw = dict(rows=3, seq_len=8, device="cpu", dtype=torch.float32)
    assert warmup.warm_fused_layer(path, "auto", **kw) is False  # Liger never runs on CPU
    seen: list[tuple[int, int, bool, bool]] = []

    def fuse(model, setting, *, device):  # stands in for Liger's patch: watch the layers run
        assert setting == "on" and len(model.get_decoder().layers) == 1
        model.get_decoder().register_forward_pre_hook(
            lambda m, a, k: seen.append(
                (*k["inputs_embeds"].shape[:2], k["inputs_embeds"].requires_grad,
                 torch.is_grad_enabled())
            ),
            with_kwargs=True,
        )  # fmt: skip
        return True

    monkeypatch.setattr(liger, "apply_fused_kernels", fuse)
    assert warmup.warm_fused_layer(path, "on", **kw) is True
    evals = rows_per_forward(8)  # the step at its bucket's width and one token shorter; then
    # the evaluation at widths a multiple of 16 and not (RoPE compiles per row count and so)
    assert seen == [(3, 64, True, True), (3, 63, True, True), (evals, 17, False, False),
                    (evals, 16, False, False)]  # fmt: skip


def test_the_fused_child_gets_a_micro_batchs_rows(monkeypatch):
    import dataclasses

    import plora.engine.warmup as warmup

    jobs = []
    monkeypatch.setattr(warmup.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(warmup, "spawn_warmup", lambda job: jobs.append(job) or "proc")
    spec = EngineSpec(
        model=ModelRef(name_or_path="tiny-qwen2"), dataset=DatasetSpec(path="x.jsonl"),
        device="cuda",
    )  # fmt: skip
    two = (CFG, dataclasses.replace(CFG, config_id="b"))  # 4 + 4 rows
    for max_rows in (None, 3):
        request = PackRequest(job_id="j", configs=two, out_dir=".", max_rows=max_rows)
        assert warmup.start_fused_warmup(spec, request) == "proc"
    assert [(j["part"], j["rows"], j["seq_len"]) for j in jobs] == [
        ("fused", 8, 256),
        ("fused", 3, 256),
    ]
    off = dataclasses.replace(spec, fused_kernels="off")
    assert warmup.start_fused_warmup(off, request) is None


def test_a_child_still_running_at_the_deadline_is_stopped():
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True
    )
    report = finish_warmup(proc, timeout_s=0.5)
    assert report.skipped == "still compiling when the first step began"
    assert proc.returncode is not None  # stopped, not left beside the first step
