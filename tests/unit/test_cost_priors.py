"""The per-GPU-type step-time priors (:mod:`plora.cost.priors`)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import nnls

from plora.config import PROJECTIONS, HardwareConfig
from plora.config.hardware import GPU_TYPES
from plora.cost.model import SweepCostModel
from plora.cost.priors import (
    DEFAULT_COEFFICIENTS,
    H100_PACKED_TOK_S,
    H100_RANK,
    H100_SEQ_LEN,
    LIGER_COEFFICIENTS,
    _nonnegative_lstsq,
    step_prior,
)
from plora.cost.throughput import AdapterLoad, StepTimeModel
from plora.model_spec import ModelSpec

QWEN3B = ModelSpec.from_hf_config("Qwen/Qwen2.5-3B")


@pytest.mark.parametrize("fused", [True, False])
def test_h100_prior_reproduces_the_h100_packed_steps(fused) -> None:
    label = "liger" if fused else "hf"
    prior = step_prior("H100", fused)
    timer = StepTimeModel(QWEN3B, GPU_TYPES["H100"], prior)
    load = AdapterLoad(rank=H100_RANK, targets=tuple(PROJECTIONS), sequences=1)
    for k, tok_s in H100_PACKED_TOK_S[label].items():
        measured = k * H100_SEQ_LEN / tok_s
        assert timer.step_time([load] * k, H100_SEQ_LEN) == pytest.approx(measured, rel=0.3)
    # the GPU is the H200's: its FLOP efficiencies are kept, only the host overheads move
    h200 = LIGER_COEFFICIENTS if fused else DEFAULT_COEFFICIENTS
    assert prior.base_efficiency == h200.base_efficiency
    assert prior.lora_efficiency == h200.lora_efficiency
    h200_step = StepTimeModel(QWEN3B, GPU_TYPES["H100"], h200).step_time([load], H100_SEQ_LEN)
    assert timer.step_time([load], H100_SEQ_LEN) > 2 * h200_step  # the slow host's floor
    assert prior.source.startswith("H100 measurements")


def test_other_gpu_types_start_from_the_h200_prior() -> None:
    for gpu in ("H200", "A100-80GB", "cpu", "L4"):
        assert step_prior(gpu, True) == LIGER_COEFFICIENTS
        assert step_prior(gpu, False) == DEFAULT_COEFFICIENTS
    assert step_prior("H100-80GB", True) == step_prior("H100", True)


def test_the_sweep_cost_model_plans_an_h100_with_its_prior() -> None:
    h100 = SweepCostModel(QWEN3B, 1024, 1000, HardwareConfig(gpu_type="H100", num_gpus=1))
    h200 = SweepCostModel(QWEN3B, 1024, 1000, HardwareConfig(gpu_type="H200", num_gpus=1))
    assert h100.coefficients == step_prior("H100", False)
    assert h200.coefficients == DEFAULT_COEFFICIENTS


def test_nonnegative_least_squares_matches_scipy() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.normal(size=(int(rng.integers(2, 6)), 3))
        b = rng.normal(size=a.shape[0])
        ours = np.array(_nonnegative_lstsq(a, b))
        ref, _ = nnls(a, b)
        assert (ours >= 0).all()
        assert np.linalg.norm(a @ ours - b) == pytest.approx(np.linalg.norm(a @ ref - b), abs=1e-9)
