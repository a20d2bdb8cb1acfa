"""The per-GPU-type step-time priors (:mod:`plora.cost.priors`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import nnls

from plora.config import PROJECTIONS, HardwareConfig, LoRAConfig, Strategy
from plora.config.hardware import GPU_TYPES
from plora.cost.memory_options import Loss, MemoryOptions
from plora.cost.model import SweepCostModel
from plora.cost.priors import (
    DEFAULT_COEFFICIENTS,
    H100_E2E_STEP_S,
    H100_GRAPHED_PACK,
    H100_GRAPHED_TOK_S,
    H100_PACKED_TOK_S,
    H100_RANK,
    H100_SEQ_LEN,
    LIGER_COEFFICIENTS,
    _nonnegative_lstsq,
    graph_factor,
    measured_prior,
    peft_prior,
    step_prior,
    step_table,
    table_samples,
)
from plora.cost.throughput import AdapterLoad, LoRALayout, StepTimeModel
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
        assert step_prior(gpu, True) == measured_prior("plora", False)  # the step table's
        assert step_prior(gpu, False) == DEFAULT_COEFFICIENTS  # nothing measured without Liger
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


# --------------------------------------------------------------- the graphed H100 prior
def _packed_16_step(prior) -> float:
    load = AdapterLoad(rank=H100_RANK, targets=tuple(PROJECTIONS), sequences=1)
    timer = StepTimeModel(QWEN3B, GPU_TYPES["H100"], prior)
    return timer.step_time([load] * H100_GRAPHED_PACK, H100_SEQ_LEN)


def _mean_step_s(mode: str) -> float:
    return H100_GRAPHED_PACK * H100_SEQ_LEN / float(np.mean(H100_GRAPHED_TOK_S[mode]))


def test_the_graphed_h100_prior_predicts_the_graphed_packed_step() -> None:
    graphed, eager = step_prior("H100", True, cuda_graphs=True), step_prior("H100", True)
    assert _packed_16_step(graphed) == pytest.approx(_mean_step_s("graphed"), rel=0.02)
    assert _packed_16_step(graphed) < _packed_16_step(eager)
    # the GPU's part is the eager prior's; only the host overheads shrink, by one factor
    factor = graphed.overhead_per_layer_s / eager.overhead_per_layer_s
    assert 0 < factor < 1 and factor == pytest.approx(graph_factor("H100", eager))
    for name in ("base_efficiency", "lora_efficiency", "comm_efficiency"):
        assert getattr(graphed, name) == getattr(eager, name)
    for name in ("adapter_step_s", "module_step_s"):
        assert getattr(graphed, name) == pytest.approx(getattr(eager, name) * factor)
    assert "CUDA graphs" in graphed.source


def _e2e_step_s(cuda_graphs: bool, d: int = 1) -> float:
    """The planner's step of `benchmarks/e2e.py`'s default job (:data:`H100_E2E_STEP_S`): one
    job of 16 configs (ranks 8..64, four learning rates each), batch 4, rows padded to 640,
    2 micro-batches, Liger on: its train seconds over its 40 steps."""
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-1.5B")
    memory = MemoryOptions(loss=Loss.FUSED, fused_kernels=True)
    cost = SweepCostModel(spec, 640, 10_000, HardwareConfig(gpu_type="H100", num_gpus=2),
                          memory=memory, cuda_graphs=cuda_graphs, strategies=[Strategy.TP])  # fmt: skip
    pack = [
        LoRAConfig(rank=r, alpha=2 * r, lr=lr, batch_size=4, max_steps=40, dropout=0.0)
        for lr in (1e-4, 3e-4, 1e-3, 3e-3)
        for r in (8, 16, 32, 64)
    ]
    strategy = None if d == 1 else Strategy.TP
    return cost.job_terms(pack, d, strategy, micro_batches=2).train_s / 40


def test_the_priors_predict_the_e2e_sweeps_step() -> None:
    graphed, eager = _e2e_step_s(True), _e2e_step_s(False)
    assert graphed == pytest.approx(H100_E2E_STEP_S["graphed"], rel=0.15)
    assert eager == pytest.approx(H100_E2E_STEP_S["eager"], rel=0.15)
    assert graphed < eager


def test_jobs_of_several_gpus_keep_the_eager_prior() -> None:
    """A graphed sweep's d > 1 jobs run eagerly: planned with the eager prior."""
    assert _e2e_step_s(True, d=2) == pytest.approx(_e2e_step_s(False, d=2))


def test_the_graphed_prior_without_liger_takes_ligers_factor() -> None:
    eager, graphed = step_prior("H100", False), step_prior("H100", False, cuda_graphs=True)
    factor = graph_factor("H100", step_prior("H100", True))
    assert graphed.module_step_s == pytest.approx(eager.module_step_s * factor)
    assert graphed.overhead_per_layer_s == pytest.approx(eager.overhead_per_layer_s * factor)
    assert graphed.base_efficiency == eager.base_efficiency
    assert "assumed" in graphed.source


def test_other_gpu_types_plan_graphed_steps_with_the_step_tables_fit() -> None:
    for gpu in ("H200", "A100-80GB", "cpu", "L4"):
        graphed = step_prior(gpu, True, cuda_graphs=True)
        assert graphed == measured_prior("plora", True) != step_prior(gpu, True)
        assert step_prior(gpu, False, cuda_graphs=True) == step_prior(gpu, False)
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-7B")
    assert step_prior("H200", True, True, spec) == measured_prior("plora", True, spec)
    assert "Qwen2.5-7B" in measured_prior("plora", True, spec).source


# --- the step table (plora/cost/measured/h200-steps.json) ------------------------------------
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _booked(system: str, graphs: bool, per_shape: bool) -> list[tuple[float, float]]:
    """(booked, measured) seconds of every cell, by the fit of its shape or of all shapes."""
    layout = LoRALayout.PER_ADAPTER if system == "peft" else LoRALayout.PACKED
    out = []
    for sample, spec in table_samples(system, graphs):
        coef = measured_prior(system, graphs, spec if per_shape else None)
        timer = StepTimeModel(spec, GPU_TYPES["H200"], coef, layout=layout)
        out.append((timer.step_time(sample.adapters, sample.seq_len), sample.step_time_s))
    return out


def test_the_step_tables_cells_are_the_committed_benchmarks() -> None:
    """Every cell the priors fit is a row of benchmarks/results' step table: same step."""
    rows = json.loads((RESULTS / "step-table-nvidia-h200-2026-11-28.json").read_text())["rows"]
    cells = step_table()["cells"]
    assert len(cells) >= 50
    for c in cells:
        match = [r for r in rows if "step_s" in r and r["model"] == c["model"]
                 and r["system"] == c["system"] and r["graphs"] == c["graphs"]
                 and r["adapters"] == c["adapters"] and r["batch"] == c["batch"]
                 and round(r["mean_width"]) == c["width"]]  # fmt: skip
        assert len(match) == 1, c
        assert match[0]["step_s"] == pytest.approx(c["step_s"], rel=1e-4)


def test_the_graphed_fit_books_every_measured_cell() -> None:
    """One-GPU jobs plan with the graphed fit: per base shape it books every graphed cell,
    one adapter at batch 1 to packs of 32, within 12 % (measured worst 11.6 %: the smallest
    steps, whose kernels' floor the additive model does not have)."""
    errors = [abs(b / m - 1) for b, m in _booked("plora", True, per_shape=True)]
    assert len(errors) == 26 and max(errors) < 0.12, sorted(errors)[-3:]
    # one fit over both shapes: what an unmeasured shape plans with
    assert max(abs(b / m - 1) for b, m in _booked("plora", True, per_shape=False)) < 0.2


def test_the_eager_fit_keeps_the_graphed_gpu_work() -> None:
    """An eager step is the graphed one's GPU work plus host launches: same efficiencies, more
    overhead, and at least the graphed step on every cell."""
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-7B")
    graphed, eager = measured_prior("plora", True, spec), measured_prior("plora", False, spec)
    assert eager.base_efficiency == graphed.base_efficiency
    assert eager.lora_efficiency == graphed.lora_efficiency
    g = StepTimeModel(spec, GPU_TYPES["H200"], graphed)
    e = StepTimeModel(spec, GPU_TYPES["H200"], eager)
    load = AdapterLoad(rank=16, targets=tuple(PROJECTIONS), sequences=1)
    for k in (1, 4, 16):
        assert e.step_time([load] * k, 1024) > g.step_time([load] * k, 1024)


def test_the_peft_prior_books_one_adapters_modules() -> None:
    """PEFT pays ``m`` per target and layer, so a PEFT step of all seven projections costs more
    host time than plora's one-adapter step; its fit books its 7B cells within 15 %."""
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-7B")
    peft = peft_prior("H200", spec)
    assert peft.module_step_s > 0 and "PEFT" in peft.source
    booked = [(b, m) for (b, m), (_, sp) in
              zip(_booked("peft", False, True), table_samples("peft", False), strict=True)
              if sp.name == spec.name]  # fmt: skip
    assert len(booked) == 2 and all(abs(b / m - 1) < 0.15 for b, m in booked)


def _graphed_cost() -> SweepCostModel:
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-1.5B")
    memory = MemoryOptions(loss=Loss.FUSED, fused_kernels=True)
    return SweepCostModel(spec, 640, 10_000, HardwareConfig(gpu_type="H100", num_gpus=2),
                          memory=memory, cuda_graphs=True, strategies=[Strategy.TP])  # fmt: skip


def _measured(truth: StepTimeModel, d: int) -> list:
    """Steps of packs of 1..12 configs (ranks 8..64) as ``truth`` times them, on ``d`` GPUs."""
    from plora.cost.throughput import StepSample

    strategy = None if d == 1 else Strategy.TP
    out = []
    for k in (1, 2, 4, 8, 12):
        pack = [
            LoRAConfig(rank=8 << (i % 4), alpha=16, lr=1e-4, batch_size=2 + i % 3, max_steps=10)
            for i in range(k)
        ]
        loads = [AdapterLoad.of(c) for c in pack]
        for seq in (512, 640):
            t = truth.step_time(loads, seq, d, strategy)
            out.append(StepSample.from_configs(pack, seq_len=seq, step_time_s=t, d=d,
                                               strategy=strategy))  # fmt: skip
    return out


def test_a_graphed_sweeps_refit_keeps_graphed_and_eager_steps_apart() -> None:
    """A graphed sweep measures graphed d = 1 steps and eager d > 1 steps: each refits its own
    set (one fit of both would split the host overhead between them); a set no sample
    measured keeps what it had (d = 1 samples alone leave d > 1 jobs on the eager prior)."""
    cost = _graphed_cost()
    graphed_prior, eager_prior = cost.coefficients, cost.eager_coefficients
    assert eager_prior is not None and eager_prior != graphed_prior
    # the "true" steps: a slower GPU part than either prior, the graphed host part smaller still
    slow = dict(base_efficiency=eager_prior.base_efficiency * 0.8)
    graphed_truth = cost._timer_with(dataclasses.replace(graphed_prior, **slow))
    eager_truth = cost._timer_with(dataclasses.replace(eager_prior, **slow))
    one, two = _measured(graphed_truth, 1), _measured(eager_truth, 2)

    both = cost.refit(one + two)
    for samples in (one, two):
        assert both._mean_error(samples) < 0.02
    assert both.coefficients != both.eager_coefficients
    assert both.last_refit is not None and both.last_refit.error_after < 0.02

    graphed_only = cost.refit(one)
    assert graphed_only._mean_error(one) < 0.02
    assert graphed_only.eager_coefficients == eager_prior  # d > 1 untouched
    eager_only = cost.refit(two)
    assert eager_only._mean_error(two) < 0.02
    assert eager_only.coefficients == graphed_prior  # d = 1 untouched
    # a copy (new overheads, ...) keeps both sets
    again = both.with_overheads()
    assert (again.coefficients, again.eager_coefficients) == (
        both.coefficients,
        both.eager_coefficients,
    )
