"""The cost model and the planner on a QLoRA base (``model.quantization: nf4``); no torch."""

from __future__ import annotations

import pytest

from plora.api import make_plan
from plora.config import ConfigError, LoRAConfig, SweepConfig
from plora.cost.build import build_cost_model
from plora.cost.memory import base_memory, projection_params
from plora.cost.memory_options import (
    FULL_FP32,
    NF4_BYTES_PER_PARAM,
    PEFT_AMP,
    QLORA_NF4,
    QLORA_NF4_FP32,
    MemoryOptions,
    quantized,
)
from plora.cost.profile import ProfileStore
from plora.cost.throughput import StepSample
from plora.model_spec import ModelSpec


def _sweep(model: str = "Qwen/Qwen2.5-14B", quantization: str = "none", **hw) -> SweepConfig:
    return SweepConfig.from_dict(
        {
            "name": "qlora-cost",
            "model": {"name_or_path": model, "quantization": quantization},
            "dataset": {"builtin": "arithmetic", "num_examples": 1000, "max_seq_len": 256},
            "space": {"lr": [1.0e-4, 3.0e-4], "rank": [8, 16], "alpha": 16, "batch_size": 1,
                      "max_steps": 20},
            "hardware": {"gpu_type": "L4", "num_gpus": 1, **hw},
        }
    )  # fmt: skip


def test_quantized_precision_books_nf4_projections_and_a_dequant_buffer() -> None:
    assert quantized(PEFT_AMP, "nf4") == QLORA_NF4
    assert quantized(FULL_FP32, "nf4") == QLORA_NF4_FP32
    assert quantized(PEFT_AMP, "none") is PEFT_AMP
    with pytest.raises(ConfigError, match="int4"):
        quantized(PEFT_AMP, "int4")
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-14B")
    dense = base_memory(spec).components
    nf4 = base_memory(spec, options=MemoryOptions(precision=QLORA_NF4)).components
    proj = projection_params(spec)
    # only the projections shrink: 2 B -> 0.516 B each; embeddings and head stay bf16
    saved = dense["base_weights"] - nf4["base_weights"]
    assert saved == pytest.approx(proj * (2.0 - NF4_BYTES_PER_PARAM), rel=1e-9)
    assert nf4["base_weights"] / spec.total_params < 0.7  # 14.8 B params: 29.5 GB -> ~9.3 GB
    # one dense bf16 projection (the largest: 13824 x 5120) alive while it computes
    assert nf4["dequant_buffer"] == pytest.approx(13824 * 5120 * 2.0)
    assert "dequant_buffer" not in dense


def test_build_cost_model_plans_qlora_from_its_own_profile(tmp_path) -> None:
    plain = build_cost_model(_sweep(), profile_dir=tmp_path)
    qlora = build_cost_model(_sweep(quantization="nf4"), profile_dir=tmp_path)
    assert qlora.memory.precision == QLORA_NF4 and plain.memory.precision == PEFT_AMP
    assert qlora.base_memory(1) < 0.5 * plain.base_memory(1)
    # the dequantization traffic makes the fixed part of a step slower, not faster
    assert qlora.step_fixed_time(1, 1) > plain.step_fixed_time(1, 1)
    cpu = build_cost_model(_sweep("tiny-qwen2", "nf4", gpu_type="cpu"), profile_dir=tmp_path)
    assert cpu.memory.precision == QLORA_NF4_FP32
    # measured steps of the bf16 model are not the QLoRA model's
    k = LoRAConfig(rank=8, alpha=16, lr=1e-4, batch_size=1, max_steps=20)
    samples = [StepSample.from_configs([k] * n, seq_len=256, step_time_s=1.0 + n) for n in (1, 2)]
    # (an L4 sweep graphs its one-GPU steps: training.cuda_graphs auto, profiled as +graphs)
    ProfileStore(tmp_path).record("Qwen/Qwen2.5-14B+graphs", "L4", samples)
    assert build_cost_model(_sweep(), profile_dir=tmp_path).profile.samples
    assert not build_cost_model(_sweep(quantization="nf4"), profile_dir=tmp_path).profile.samples
    ProfileStore(tmp_path).record("Qwen/Qwen2.5-14B@nf4+graphs", "L4", samples)
    assert build_cost_model(_sweep(quantization="nf4"), profile_dir=tmp_path).profile.samples


def test_planner_packs_a_14b_qlora_sweep_on_a_24gb_gpu(tmp_path, monkeypatch) -> None:
    """bf16 Qwen2.5-14B (29.5 GB of weights) fits no 24 GB L4; in NF4 the configs pack."""
    monkeypatch.setenv("PLORA_PROFILE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="gpu_memory_gib"):
        make_plan(_sweep())
    report = make_plan(_sweep(quantization="nf4"))
    jobs = report.plan.jobs
    assert sum(len(j.config_ids) for j in jobs) == 4
    assert max(len(j.config_ids) for j in jobs) > 1  # packed on one base copy
    assert all(j.memory_gib_per_gpu <= 0.9 * 24 for j in jobs)


def test_qlora_jobs_run_on_one_gpu(tmp_path) -> None:
    """tp/fsdp/pp are not built for a 4-bit base: a QLoRA sweep plans d = 1 jobs only, and
    asking for a strategy is a one-line error."""
    sweep = _sweep("Qwen/Qwen2.5-7B", "nf4", gpu_type="H100", num_gpus=4)
    assert build_cost_model(sweep, profile_dir=tmp_path).strategies() == ()
    data = sweep.to_dict()
    data["planner"] = {**data.get("planner", {}), "strategies": ["fsdp"]}
    dense = {**data, "model": {**data["model"], "quantization": "none"}}
    assert build_cost_model(SweepConfig.from_dict(dense), profile_dir=tmp_path).strategies()
    with pytest.raises(ConfigError, match=r"planner\.strategies.*remove planner\.strategies"):
        build_cost_model(SweepConfig.from_dict(data), profile_dir=tmp_path)
