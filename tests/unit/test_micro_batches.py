"""Micro-batched packs: the cost model's memory and step time with m forwards per step, and
the planner choosing one micro-batched job over more jobs only when that is predicted faster.

The planner cases are the e2e benchmark's shape (``benchmarks/e2e.py``: Qwen2.5-1.5B's shipped
config, 16 configs of rank 8-64 on all seven projections, batch 4, max_seq_len 640, 40 steps,
Liger on, an 80 GB H100), where 12 configs fit one job with every row live and 16 do not.
"""

from __future__ import annotations

import dataclasses

import pytest

from plora.config import PROJECTIONS, HardwareConfig, LoRAConfig
from plora.cost.memory import adapter_memory
from plora.cost.memory_options import GIB, Loss, MemoryOptions
from plora.cost.microbatch import ACTIVATION_PARTS, rows_per_micro_batch
from plora.cost.model import SweepCostModel
from plora.cost.throughput import AdapterLoad, StepSample
from plora.model_spec import ModelSpec
from plora.planner import Plan, plan_sweep
from plora.planner.ilp import build_classes

SPEC = ModelSpec.from_hf_config("Qwen/Qwen2.5-1.5B")
MEM = MemoryOptions(loss=Loss.FUSED, fused_kernels=True)  # plora's engine with Liger
SEQ = 640
RANKS = (8, 16, 32, 64)


def grid(n: int) -> list[LoRAConfig]:
    """The e2e grid (lr x rank), ``n // 4`` learning rates."""
    return [
        LoRAConfig(config_id=f"c{i:02d}", rank=RANKS[i % 4], alpha=2.0 * RANKS[i % 4],
                   lr=1e-4 * (1 + i // 4), batch_size=4, max_steps=40, target_modules=PROJECTIONS)
        for i in range(n)
    ]  # fmt: skip


def h100(gpus: int = 1) -> HardwareConfig:
    return HardwareConfig(gpu_type="H100", num_gpus=gpus)


def cost_model(gpus: int = 1, **kw) -> SweepCostModel:
    return SweepCostModel(SPEC, SEQ, 1000, h100(gpus), memory=MEM, **kw)


def h100_fitted(gpus: int = 1, **kw) -> SweepCostModel:
    """Step coefficients fitted to the H100's measured steps (benchmarks/RESULTS.md, session 8:
    the 12-config job stepped at 0.71 s, the 4-config job at 0.46 s): a large fixed per-step
    host time (~0.3 s) next to ~0.035 s per config."""
    g = grid(16)
    samples = [
        StepSample.from_configs(g[:12], seq_len=SEQ, step_time_s=0.71),
        StepSample.from_configs(g[12:], seq_len=SEQ, step_time_s=0.46),
    ]
    coef = cost_model(gpus).refit(samples).coefficients
    return cost_model(gpus, coefficients=coef, **kw)


# ----------------------------------------------------------------------------- cost model
def test_one_micro_batch_is_todays_model_bit_for_bit():
    cost, pack = cost_model(), grid(16)
    additive = cost.base_memory(1) + sum(cost.config_memory(k, 1) for k in pack)
    assert cost.pack_memory(pack, 1) == additive
    assert cost.pack_memory(pack, 1, micro_batches=1) == additive
    assert cost.job_time(pack, 1, micro_batches=1) == cost.job_time(pack, 1)
    assert cost.step_fixed_time(40, 1, micro_batches=1) == 40 * cost.timer.fixed_step_time(1)
    assert cost.micro_batches_to_fit(grid(12), 1) == 1  # 12 fit with every row live


def test_two_micro_batches_halve_the_activations_and_keep_the_states():
    cost = cost_model()
    pack = [dataclasses.replace(c, rank=16, alpha=32.0) for c in grid(16)]  # one shape
    comps = cost.config_breakdown(pack[0]).components
    act = sum(comps[k] for k in ACTIVATION_PARTS)
    state = sum(v for k, v in comps.items() if k not in ACTIVATION_PARTS)
    assert state > 0 and act > 10 * state  # activations dominate at seq 640
    base = cost.base_memory(1)
    assert cost.pack_memory(pack, 1) == pytest.approx(base + 16 * (state + act), rel=1e-12)
    assert cost.pack_memory(pack, 1, micro_batches=2) == pytest.approx(
        base + 16 * state + 16 * act / 2, rel=1e-12
    )
    # reference: 32 rows live are the activations adapter_memory books for 16 configs of 2 rows
    half = adapter_memory(SPEC, rank=16, targets=PROJECTIONS, batch_size=2, seq_len=SEQ,
                          options=MEM).components  # fmt: skip
    want = base + 16 * state + 16 * sum(half[k] for k in ACTIVATION_PARTS)
    assert cost.pack_memory(pack, 1, micro_batches=2) == pytest.approx(want, rel=1e-12)
    # 3 micro-batches of 64 rows: ⌈64/3⌉ = 22 rows live
    per_row = act / 4
    assert cost.pack_memory(pack, 1, micro_batches=3) == pytest.approx(
        base + 16 * state + 22 * per_row, rel=1e-12
    )


def test_mixed_ranks_charge_the_largest_row_for_every_live_row():
    cost, pack = cost_model(), grid(16)
    parts = [cost.config_memory_parts(k, 1) for k in pack]
    largest = max(a for _, a in parts)
    assert largest == cost.config_memory_parts(pack[3], 1)[1] > parts[0][1]  # rank 64's rows
    want = cost.base_memory(1) + sum(s for s, _ in parts) + 32 * largest
    assert cost.pack_memory(pack, 1, micro_batches=2) == pytest.approx(want, rel=1e-12)
    assert cost.pack_memory(pack, 1, micro_batches=2) >= (
        cost.base_memory(1) + sum(s + 4 * a / 2 for s, a in parts)  # never below the exact mean
    )


def test_m_forwards_pay_the_fixed_step_part_m_times_and_the_rest_once():
    cost, pack = cost_model(), grid(16)
    fixed = cost.timer.fixed_step_time(1)
    for m in (2, 3):
        extra = cost.job_time(pack, 1, micro_batches=m) - cost.job_time(pack, 1)
        assert extra == pytest.approx((m - 1) * 40 * fixed, rel=1e-12)
        terms = cost.job_terms(pack, 1, micro_batches=m)
        assert terms.total_s == pytest.approx(cost.job_time(pack, 1, micro_batches=m), rel=1e-12)
    # the per-config terms (FLOPs of the same tokens, the adapter's optimizer step) are unchanged
    loads = [AdapterLoad.of(k) for k in pack]
    step = cost.timer.step_time(loads, SEQ)
    assert cost.job_time(pack, 1, micro_batches=2) - cost.job_overhead_time(40) == pytest.approx(
        40 * (step + fixed) + sum(cost.config_overhead_time(k) for k in pack), rel=1e-12
    )


def test_the_smallest_fitting_m_and_rows_per_micro_batch():
    cost = cost_model()
    assert cost.pack_memory(grid(16), 1) > cost.capacity(1)  # 16 do not fit all live
    assert cost.micro_batches_to_fit(grid(16), 1) == 2
    assert cost.pack_memory(grid(16), 1, micro_batches=2) <= cost.capacity(1)
    assert rows_per_micro_batch(64, 2) == 32 and rows_per_micro_batch(5, 2) == 3
    off = cost_model(max_micro_batches=1)
    assert off.max_micro_batches == 1 and not build_classes(grid(16), off, 1).options[1:]


# ------------------------------------------------------------------------------ planner
def _shape(plan: Plan) -> list[tuple[int, int, int | None]]:
    return sorted((len(j.config_ids), j.micro_batches, j.max_rows) for j in plan.jobs)


def test_h100_plans_one_micro_batched_job_for_the_e2e_sweep():
    """One H100, the fixed host time of its measured steps: one 16-config job in 2 micro-batches
    (32 rows each) beats 12 + 4 configs in two jobs (what the planner did before), and the
    plan says so."""
    cost = h100_fitted()
    assert 0.2 < cost.timer.fixed_step_time(1) < 0.4  # the H100's host-bound fixed part
    plan = plan_sweep(grid(16), cost, 1)
    assert _shape(plan) == [(16, 2, 32)]
    (job,) = plan.jobs
    assert job.memory_gib_per_gpu * GIB == pytest.approx(
        cost.pack_memory(grid(16), 1, micro_batches=2), rel=1e-9
    )
    assert job.memory_gib_per_gpu * GIB <= cost.capacity(1)
    assert job.end_s == pytest.approx(
        cost.startup_time(1) + cost.job_time(grid(16), 1, micro_batches=2), rel=1e-9
    )
    live = plan_sweep(grid(16), h100_fitted(max_micro_batches=1), 1)  # every row live
    assert _shape(live) == [(4, 1, None), (12, 1, None)]
    assert plan.makespan_s < live.makespan_s
    assert any("micro-batched" in n for n in plan.notes)
    doc = plan.to_json_dict()
    assert doc["jobs"][0]["micro_batches"] == 2 and doc["jobs"][0]["max_rows"] == 32
    assert Plan.from_json_dict(doc) == plan


def test_more_jobs_when_they_are_predicted_faster():
    """Splitting wins where it is faster: on two H100s the two halves run side by side; and on
    one H100 with 24 configs one job needs 3 forwards per step (3 x the ~0.3 s fixed part)
    where two jobs pay it twice, so the plan splits -- until the fixed part is tiny, when one
    3-micro-batch job saves the second job's start."""
    two = plan_sweep(grid(16), h100_fitted(2), 2)
    assert _shape(two) == [(8, 1, None), (8, 1, None)]
    assert any(o.micro is not None for o in build_classes(grid(16), h100_fitted(2), 2).options)

    cost = h100_fitted()
    split = plan_sweep(grid(24), cost, 1)
    assert all(j.micro_batches == 1 for j in split.jobs) and len(split.jobs) == 2
    assert cost.micro_batches_to_fit(grid(24), 1) == 3
    one_job = cost.startup_time(1) + cost.job_time(grid(24), 1, micro_batches=3)
    assert split.makespan_s < one_job

    tiny = dataclasses.replace(cost.coefficients, overhead_per_layer_s=0.0, module_step_s=0.0)
    cheap = cost_model(coefficients=tiny)
    assert cheap.timer.fixed_step_time(1) < 0.01
    plan = plan_sweep(grid(24), cheap, 1)
    assert _shape(plan) == [(24, 3, 32)]
    assert plan.makespan_s < plan_sweep(grid(24), cost_model(coefficients=tiny,
                                        max_micro_batches=1), 1).makespan_s  # fmt: skip


def test_the_quickstart_fits_every_row_live():
    """The CPU quickstart is planned exactly as before: even with micro-batches allowed (a CPU
    sweep does not allow them: its memory is a packing budget) no micro-batched option is
    built, as every config fits one job with every row live."""
    from plora.config import SweepConfig
    from plora.cost.build import build_cost_model, micro_batch_limit
    from plora.cost.microbatch import MAX_MICRO_BATCHES
    from plora.tune.space import expand

    sweep = SweepConfig.from_yaml("sweeps/quickstart.yaml")
    configs = expand(sweep)
    cost = build_cost_model(sweep, use_profile=False)
    assert sweep.hardware.is_cpu and cost.max_micro_batches == 1
    assert micro_batch_limit(h100()) == MAX_MICRO_BATCHES > 1
    cost.max_micro_batches = MAX_MICRO_BATCHES
    table = build_classes(configs, cost, sweep.hardware.num_gpus)
    assert all(o.micro is None for o in table.options)
    plan = plan_sweep(configs, cost, sweep.hardware.num_gpus)
    assert all(j.micro_batches == 1 and j.max_rows is None for j in plan.jobs)
    off = build_cost_model(sweep, use_profile=False)
    off.max_micro_batches = 1
    assert plan == plan_sweep(configs, off, sweep.hardware.num_gpus)


def test_a_running_micro_batched_jobs_eta_pays_every_forward():
    from plora.runtime.coordinator.costs import job_memory, remaining_job_time

    cost, pack = h100_fitted(), grid(16)
    progress = {c.config_id: 10 for c in pack}
    one = remaining_job_time(cost, pack, progress, 1, None)
    two = remaining_job_time(cost, pack, progress, 1, None, micro_batches=2)
    assert two - one == pytest.approx(30 * cost.timer.fixed_step_time(1), rel=1e-9)
    used, cap = job_memory(cost, pack, 1, None, micro_batches=2)
    assert used == cost.pack_memory(pack, 1, micro_batches=2) <= cap


def test_plan_totals_charge_the_micro_batched_steps():
    from plora.api import time_terms

    cost = h100_fitted()
    plan = plan_sweep(grid(16), cost, 1)
    assert plan.jobs[0].micro_batches == 2
    totals = time_terms(plan, grid(16), cost)
    want = cost.job_terms(grid(16), 1, micro_batches=2)
    assert totals["train_s"] == pytest.approx(want.train_s, rel=1e-12)
    assert totals["train_s"] > cost.job_terms(grid(16), 1).train_s


def test_a_class_only_many_forwards_hold_still_starts_in_the_one_job_alternatives():
    """Batches of 2 and 16 rows of 1,024 tokens on a 14B base: the batch-16 configs fit one
    H100 only with 8 or more forwards a step. The one-job alternative built on the m = 2 option
    keeps the m >= 8 options for them (it crashed with "configs left but no job can start")."""
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-14B")
    cost = SweepCostModel(spec, 1024, 1000, h100(2), memory=MEM)
    configs = [
        LoRAConfig(config_id=f"c{i}", rank=r, alpha=2.0 * r, lr=lr, batch_size=b, max_steps=20,
                   target_modules=PROJECTIONS)
        for i, (lr, r, b) in enumerate(
            (lr, r, b) for lr in (1e-4, 3e-4) for r in (16, 64) for b in (2, 16)
        )
    ]  # fmt: skip
    table = build_classes(configs, cost, 2)
    held = {o.micro.micro_batches: bool(o.fits.all()) for o in table.options if o.micro}
    assert held[2] is False and held[8] is True  # the m = 2 option cannot hold batch 16
    plan = plan_sweep(configs, cost, 2)
    placed = sorted(c for j in plan.jobs for c in j.config_ids)
    assert placed == sorted(c.config_id for c in configs)
    assert all(j.memory_gib_per_gpu * GIB <= cost.capacity(j.gpus) * 1.0001 for j in plan.jobs)
