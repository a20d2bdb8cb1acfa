"""build_cost_model: the SweepCostModel of a sweep definition, planned from a stored profile
(its step times and measured peaks) when there is one."""

from __future__ import annotations

import pytest

from plora.config import ConfigError, LoRAConfig, SweepConfig
from plora.cost import Strategy
from plora.cost.build import build_cost_model
from plora.cost.memory_options import GIB, Loss, MemoryOptions
from plora.cost.priors import step_prior
from plora.cost.profile import ProfileStore
from plora.cost.throughput import StepSample


def _sweep(**hardware) -> SweepConfig:
    return SweepConfig.from_dict(
        {
            "name": "cost-test",
            "model": "Qwen/Qwen2.5-7B",
            "dataset": {"builtin": "arithmetic", "num_examples": 1000, "max_seq_len": 512},
            "space": {"lr": 1.0e-4, "rank": [8, 64], "alpha": 16, "batch_size": 2, "max_steps": 10},
            "hardware": {"gpu_type": "H100", "num_gpus": 4, **hardware},
            "planner": {"strategies": ["tp"]},
        }
    )


def test_build_from_a_sweep_and_plan_from_a_stored_profile(tmp_path) -> None:
    sweep = _sweep()
    cm = build_cost_model(sweep, profile_dir=tmp_path)
    assert cm.seq_len == 512 and cm.dataset_size == 1000 and cm.gpu.name == "H100"
    assert cm.strategies() == (Strategy.TP,)
    assert cm.cuda_graphs  # auto: one-GPU jobs replay their steps as CUDA graphs
    assert cm.coefficients == step_prior("H100", False, True)  # the H100's measured prior
    assert cm.capacity(1) == pytest.approx(0.9 * 80 * GIB)
    assert build_cost_model(sweep, dataset_size=50, profile_dir=tmp_path).dataset_size == 50
    # A measured profile for (model, GPU) makes the next sweep plan from it.
    k = LoRAConfig(rank=8, alpha=16, lr=1e-4, batch_size=2, max_steps=10)
    samples = [
        StepSample.from_configs([k] * n, seq_len=512, step_time_s=0.05 + 0.04 * n)
        for n in (1, 2, 4, 8)
    ]
    ProfileStore(tmp_path).record("Qwen/Qwen2.5-7B+graphs", "H100", samples)
    planned = build_cost_model(sweep, profile_dir=tmp_path)
    assert planned.coefficients != step_prior("H100", False, True)
    # the steps of the job (its start, eval, export and checkpoints come on top)
    assert planned.job_terms([k], 1, None).train_s == pytest.approx(10 * 0.09, rel=0.05)
    assert build_cost_model(
        sweep, profile_dir=tmp_path, use_profile=False
    ).coefficients == step_prior("H100", False, True)


def test_unknown_gpu_speed_is_refused_when_the_sweep_is_read() -> None:
    with pytest.raises(ConfigError, match="gpu_type='MI300X': unknown gpu_type and no peak_tflops"):
        _sweep(gpu_type="MI300X", gpu_memory_gib=192)


def test_checkpointing_trades_memory_for_time(tmp_path) -> None:
    import plora.config as config

    if not hasattr(config, "TrainingOptions"):
        pytest.skip("training options not in plora.config yet")
    data = {
        "name": "ckpt",
        "model": "Qwen/Qwen2.5-7B",
        "dataset": {"builtin": "arithmetic", "num_examples": 1000, "max_seq_len": 1024},
        "space": {"lr": 1.0e-4, "rank": 8, "alpha": 16, "batch_size": 8, "max_steps": 10},
        "hardware": {"gpu_type": "A100-40GB"},
    }
    plain = build_cost_model(SweepConfig.from_dict(data), use_profile=False)
    ckpt = build_cost_model(
        SweepConfig.from_dict({**data, "training": {"gradient_checkpointing": True}}),
        use_profile=False,
    )
    k = LoRAConfig(rank=8, alpha=16, lr=1e-4, batch_size=8, max_steps=10)
    assert ckpt.memory.checkpointing and not plain.memory.checkpointing
    assert ckpt.config_memory(k, 1) < 0.25 * plain.config_memory(k, 1)
    # one more forward of the base: about 4/3 of the frozen-base training FLOPs
    assert 1.2 < ckpt.config_step_time(k, 1) / plain.config_step_time(k, 1) < 1.5
    # the paper's batch-8, seq-1024 config of a 7B model fits a 40 GB A100 only with it
    assert plain.base_memory(1) + plain.config_memory(k, 1) > plain.capacity(1)
    assert ckpt.base_memory(1) + ckpt.config_memory(k, 1) < ckpt.capacity(1)


def test_stored_peaks_rescale_activation_memory(tmp_path) -> None:
    sweep = _sweep()
    # what the engine really uses: 1.5x the activations the model predicts
    memory = MemoryOptions(loss=Loss.FUSED, activation_scale=1.5)
    truth = build_cost_model(sweep, use_profile=False, memory=memory)
    ks = [
        LoRAConfig(rank=r, alpha=16, lr=1e-4, batch_size=b, max_steps=10)
        for r in (8, 64)
        for b in (1, 4)
    ]
    samples = []
    for n in (1, 2, 3):
        pack = ks[:n] + ks[-n:]
        peak = truth.pack_memory(pack, 1) - truth.memory.reserved_bytes
        samples.append(
            StepSample.from_configs(pack, seq_len=512, step_time_s=0.1 * n, peak_memory_bytes=peak)
        )
    ProfileStore(tmp_path).record("Qwen/Qwen2.5-7B+graphs", "H100", samples)
    planned = build_cost_model(sweep, profile_dir=tmp_path)
    assert planned.memory.activation_scale == pytest.approx(1.5, rel=1e-6)
    assert planned.config_memory(ks[1], 1) == pytest.approx(truth.config_memory(ks[1], 1), rel=1e-9)
    assert planned.last_refit is not None and planned.last_refit.num_samples == 3
