"""Overheads outside packed steps: the terms of job_time, defaults, refit, JSON, profile store."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics

import pytest

from plora.config import PROJECTIONS, ConfigError, HardwareConfig, LoRAConfig, SweepConfig
from plora.cost import CostModel, Strategy
from plora.cost.build import build_cost_model
from plora.cost.defaults import COLD_START_MEASURED, CPU, GPU, LOAD_MEASURED
from plora.cost.jobterms import (
    BUILTIN_METRICS,
    active_checkpoints,
    checkpoint_writes,
    eval_defaults,
)
from plora.cost.model import SweepCostModel
from plora.cost.overheads import EvalMetric, OverheadKind, Overheads, OverheadSample
from plora.cost.profile import Profile, ProfileStore
from plora.cost.throughput import StepSample
from plora.model_spec import ModelSpec

QWEN1_5B = ModelSpec.from_hf_config("Qwen/Qwen2.5-1.5B")
H100 = HardwareConfig(gpu_type="H100", num_gpus=4)

#: Round numbers, so each term is easy to tell apart in a sum.
GIVEN = Overheads(
    worker_start_s=20.0,
    model_load_s=7.0,
    job_start_s=3.0,
    eval_s_per_row=0.01,
    generate_s_per_row=0.05,
    export_s=0.25,
    checkpoint_s=0.5,
    write_s_per_gb=2.0,
    source="given",
)


def lora(cid: str, *, rank: int = 16, steps: int = 100, targets=PROJECTIONS) -> LoRAConfig:
    return LoRAConfig(config_id=cid, rank=rank, alpha=2.0 * rank, lr=1e-4, batch_size=2,
                      max_steps=steps, target_modules=targets)  # fmt: skip


def model(overheads: Overheads = GIVEN, **kw) -> SweepCostModel:
    return SweepCostModel(QWEN1_5B, 512, 1000, H100, overheads=overheads,
                          strategies=(Strategy.TP,), **kw)  # fmt: skip


# ------------------------------------------------------------------------- job_time terms
@pytest.mark.parametrize(
    ("eval_rows", "metric", "every", "steps"),
    [
        (0, "none", None, (100,)),
        (200, "none", None, (100, 40)),
        (200, "exact_match", None, (100, 40)),
        (50, "accuracy", 30, (100, 40, 7)),
        (0, "exact_match", 50, (100, 50, 49, 51)),
        (1000, "exact_match", 1, (3, 1)),
    ],
)
def test_overhead_terms_are_in_job_time_as_documented(eval_rows, metric, every, steps) -> None:
    """job_time = job_start + steps + Σ_k (eval + export's critical path + checkpoint bytes) +
    job checkpoints, each term recomputed here from the documented formulas."""
    cm = model(eval_rows=eval_rows, eval_metric=metric, checkpoint_every=every)
    bare = model(Overheads.zero(), eval_rows=eval_rows, eval_metric=metric, checkpoint_every=every)
    pack = [lora(f"k{i}", rank=8 * (i + 1), steps=n) for i, n in enumerate(steps)]
    n_max = max(steps)
    writes = (n_max // every + 1) if every else 1  # every N steps, and once at the end
    per_byte = GIVEN.write_s_per_gb / 1e9
    want = GIVEN.job_start_s + writes * GIVEN.checkpoint_s
    for k, n in zip(pack, steps, strict=True):
        params = QWEN1_5B.lora_params(k.rank, k.target_modules)
        row = GIVEN.eval_s_per_row + (GIVEN.generate_s_per_row if metric != "none" else 0.0)
        in_ckpts = (math.ceil(n / every) - 1) if every else 0  # exported at its last step
        # the export's file write runs in the background during the config's evaluation
        export = GIVEN.export_s + max(0.0, 4 * params * per_byte - eval_rows * row)
        want += eval_rows * row + export
        want += in_ckpts * 12 * params * per_byte
    for d, s in [(1, None), (2, Strategy.TP), (4, Strategy.TP)]:
        assert cm.job_time(pack, d, s) - bare.job_time(pack, d, s) == pytest.approx(want)
        terms = cm.job_terms(pack, d, s)
        assert terms.total_s == pytest.approx(cm.job_time(pack, d, s), rel=1e-12)
        assert terms.train_s == pytest.approx(bare.job_time(pack, d, s), rel=1e-12)
        assert terms.job_start_s == GIVEN.job_start_s
        # still affine: the per-job part in fixed_time, the per-config part in config_time
        fixed = cm.fixed_time(n_max, d, s) + sum(cm.config_time(k, d, s) for k in pack)
        assert cm.job_time(pack, d, s) == pytest.approx(fixed, rel=1e-12)


def test_checkpoint_counts() -> None:
    assert [checkpoint_writes(n, None) for n in (1, 50, 1000)] == [1, 1, 1]
    assert [checkpoint_writes(n, 50) for n in (1, 49, 50, 51, 100)] == [1, 1, 2, 2, 3]
    assert [active_checkpoints(n, None) for n in (1, 50)] == [0, 0]
    assert [active_checkpoints(n, 50) for n in (1, 50, 51, 100, 101)] == [0, 0, 1, 1, 2]


def test_fixed_time_is_non_decreasing_in_steps() -> None:
    """What the ILP's threshold enumeration relies on, with checkpoints in the fixed part."""
    cm = model(checkpoint_every=7)
    times = [cm.fixed_time(n, 2, Strategy.TP) for n in range(1, 200)]
    assert all(b >= a for a, b in itertools.pairwise(times))


def test_startup_is_worker_start_plus_model_load_and_not_in_job_time() -> None:
    cm = model()
    assert isinstance(cm, CostModel)
    assert cm.startup_time(1) == cm.startup_time(4) == 27.0
    with pytest.raises(ConfigError, match="power of two"):
        cm.startup_time(3)
    k = lora("a")
    no_start = model(Overheads(**{**GIVEN.to_dict(), "worker_start_s": 0.0, "model_load_s": 0.0}))
    assert cm.job_time([k], 1) == no_start.job_time([k], 1)


def test_config_work_includes_what_every_schedule_pays_for_a_config() -> None:
    cm = model(eval_rows=100, eval_metric="exact_match")
    k = lora("a")
    assert cm.config_work(k) == cm.config_time(k, 1, None)
    assert cm.config_work(k) == pytest.approx(
        cm.config_step_time(k, 1, None) + cm.config_overhead_time(k)
    )
    assert cm.config_work(k) < cm.job_time([k], 1, None)  # the job's own start is extra


def test_with_overheads_and_refits_return_new_models() -> None:
    cm = model(eval_rows=10)
    other = cm.with_overheads(Overheads.zero(), checkpoint_every=5)
    assert other is not cm and other.overheads.source == "zero" and other.checkpoint_every == 5
    assert cm.overheads is GIVEN and cm.checkpoint_every is None and other.eval_rows == 10
    with pytest.raises(TypeError, match="unexpected"):
        cm.with_overheads(seq_len=3)
    fitted = cm.refit_overheads([OverheadSample(kind="job_start", seconds=8.0, count=2)])
    assert fitted.overheads.job_start_s == 4.0 and cm.overheads.job_start_s == 3.0
    k = lora("a")
    assert fitted.job_time([k], 1) == pytest.approx(cm.job_time([k], 1) + 1.0)
    # a step-time refit keeps the overheads and eval settings
    steps = [StepSample.from_configs([k], seq_len=512, step_time_s=0.2)] * 3
    stepped = fitted.refit(steps)
    assert stepped.overheads == fitted.overheads and stepped.eval_rows == 10


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eval_rows": -1}, "eval_rows"),
        ({"eval_rows": 1.5}, "eval_rows"),
        ({"eval_metric": "bleu"}, "eval_metric"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
    ],
)
def test_bad_sweep_overhead_options(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        model(**kwargs)


# ------------------------------------------------------------------------------ defaults
def test_gpu_default_cold_start_reproduces_the_measurement() -> None:
    """Worker start + a job start of the measured 1.5B bf16 model = what the resident worker
    measured outside its load (request to ready, first-step compilation, job set-up); its model
    load = the measured one, at the bandwidth between the loads measured of a 7B and a 32B
    base."""
    cm = SweepCostModel(QWEN1_5B, 512, 1000, H100)
    o = cm.overheads
    assert o.source == "default" and o.measured == ()
    assert 2.0 * QWEN1_5B.total_params == pytest.approx(COLD_START_MEASURED["weight_bytes"])
    m = COLD_START_MEASURED
    measured = m["ready_s"] - m["load_s"] + m["compile_s"] + m["job_start_s"]
    assert o.worker_start_s + o.job_start_s == pytest.approx(measured, rel=0.01)
    assert o.model_load_s == pytest.approx(m["load_s"], rel=0.01)
    small, large = LOAD_MEASURED
    for point in LOAD_MEASURED:
        spec = ModelSpec.from_hf_config(point["model"])
        assert 2.0 * spec.total_params == pytest.approx(point["weight_bytes"])
    loads = [
        SweepCostModel(ModelSpec.from_hf_config(p["model"]), 512, 1000, H100).overheads.model_load_s
        for p in LOAD_MEASURED
    ]
    assert loads[1] - loads[0] == pytest.approx(large["load_s"] - small["load_s"], rel=0.01)
    assert 3e9 < GPU.load_bytes_per_s < 2e10 and 0.0 < GPU.model_load_fixed_s < 30.0
    qwen7b = ModelSpec.from_hf_config("Qwen/Qwen2.5-7B")
    bigger = SweepCostModel(qwen7b, 512, 1000, H100).overheads
    ratio = (bigger.model_load_s - GPU.model_load_fixed_s) / (
        o.model_load_s - GPU.model_load_fixed_s
    )
    assert ratio == pytest.approx(qwen7b.total_params / QWEN1_5B.total_params, rel=0.02)
    assert bigger.worker_start_s == o.worker_start_s


def test_cpu_defaults_for_the_quickstart() -> None:
    sweep = SweepConfig.from_yaml("sweeps/quickstart.yaml")
    cm = build_cost_model(sweep, use_profile=False)
    o = cm.overheads
    assert o.source == "cpu-default" and 1.0 <= o.worker_start_s <= 8.0
    assert o.worker_start_s == CPU.worker_start_s and o.job_start_s == CPU.job_start_s
    assert cm.eval_metric is EvalMetric.EXACT_MATCH and cm.eval_rows == 200
    assert cm.checkpoint_every == 50


def test_eval_defaults_follow_the_physics() -> None:
    # an H200: compute, not the host's launches, sets its eval rows (the H100 prior's host
    # overheads make short rows launch-bound there: test_h100_eval_rows_pay_the_slow_host)
    spec, hw = QWEN1_5B, HardwareConfig(gpu_type="H200", num_gpus=4)
    short = SweepCostModel(spec, 128, 1000, hw, eval_metric="exact_match").overheads
    long = SweepCostModel(spec, 1024, 1000, hw, eval_metric="exact_match").overheads
    assert long.eval_s_per_row > 4 * short.eval_s_per_row  # forward FLOPs grow with length
    none = SweepCostModel(spec, 512, 1000, hw, eval_metric="none").overheads
    acc = SweepCostModel(spec, 512, 1000, hw, eval_metric="accuracy").overheads
    em = SweepCostModel(spec, 512, 1000, hw, eval_metric="exact_match").overheads
    assert none.generate_s_per_row == 0.0
    assert acc.generate_s_per_row == pytest.approx(2 * acc.eval_s_per_row)  # two label options
    assert em.generate_s_per_row > em.eval_s_per_row  # prompt forward + 8 decode steps
    # a forward of a row costs less than the same row's training step
    train_row = SweepCostModel(spec, 512, 1000, hw, overheads=Overheads.zero())
    k = LoRAConfig(rank=16, alpha=32, lr=1e-4, batch_size=1, max_steps=1)
    assert em.eval_s_per_row < train_row.job_time([k], 1)


@pytest.mark.parametrize(
    ("dataset", "rows", "metric"),
    [
        ({"builtin": "arithmetic", "num_examples": 2000}, 200, "exact_match"),
        ({"builtin": "sentiment", "num_examples": 999, "eval_fraction": 0.1}, 100, "accuracy"),
        ({"builtin": "reverse", "num_examples": 100, "metric": "none"}, 10, "none"),
        ({"path": "x.jsonl", "num_examples": 1000, "eval_fraction": 0.05}, 50, "exact_match"),
        ({"path": "x.jsonl", "num_examples": 1000, "metric": "accuracy"}, 100, "accuracy"),
        ({"path": "x.jsonl", "num_examples": 1000, "eval_fraction": 0.0}, 0, "exact_match"),
    ],
)
def test_eval_defaults_from_the_dataset_spec(dataset, rows, metric) -> None:
    from plora.config import DatasetSpec

    assert eval_defaults(DatasetSpec(**dataset)) == (rows, EvalMetric(metric))


def test_builtin_metrics_match_the_tasks() -> None:
    from plora.tasks import get_task

    for name, metric in BUILTIN_METRICS.items():
        assert get_task(name).metric == metric


def test_build_cost_model_takes_the_eval_split_from_the_caller(tmp_path) -> None:
    sweep = SweepConfig.from_yaml("sweeps/quickstart.yaml")
    cm = build_cost_model(sweep, profile_dir=tmp_path, eval_rows=7, eval_metric="none",
                          checkpoint_every=None)  # fmt: skip
    assert (cm.eval_rows, cm.eval_metric, cm.checkpoint_every) == (7, EvalMetric.NONE, None)


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("field", "value"),
    [("job_start_s", -1.0), ("eval_s_per_row", math.nan), ("export_s", math.inf),
     ("write_s_per_gb", -0.5), ("model_load_s", "3")],
)  # fmt: skip
def test_overheads_validate_themselves(field, value) -> None:
    with pytest.raises(ConfigError, match=field):
        Overheads(**{**GIVEN.to_dict(), field: value})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "warmup", "seconds": 1.0}, "kind"),
        ({"kind": "eval", "seconds": -1.0}, "seconds"),
        ({"kind": "eval", "seconds": 1.0, "count": 0}, "count"),
        ({"kind": "export", "seconds": 1.0, "bytes": -5}, "bytes"),
    ],
)
def test_overhead_samples_validate_themselves(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        OverheadSample(**kwargs)


def test_json_round_trips() -> None:
    for o in (GIVEN, Overheads.zero(), model(eval_rows=3).overheads, SweepCostModel(
            QWEN1_5B, 512, 1000, H100).overheads.refit([OverheadSample(kind="eval", seconds=1.0)])):  # fmt: skip
        assert Overheads.from_dict(json.loads(json.dumps(o.to_dict()))) == o
    s = OverheadSample(kind=OverheadKind.EXPORT, seconds=2.0, count=3, bytes=1e9)
    assert OverheadSample.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    with pytest.raises(ConfigError, match="unknown keys"):
        Overheads.from_dict({**GIVEN.to_dict(), "warmup_s": 1.0})


# ---------------------------------------------------------------------------------- refit
def test_refit_takes_the_median_per_unit_and_keeps_the_prior_elsewhere() -> None:
    samples = [
        OverheadSample(kind="worker_start", seconds=30.0),
        OverheadSample(kind="worker_start", seconds=12.0, count=1),
        OverheadSample(kind="worker_start", seconds=26.0, count=2),  # 13 per group
        OverheadSample(kind="eval", seconds=4.0, count=400),  # 0.01 per config-row
        OverheadSample(kind="eval", seconds=12.0, count=400),
        OverheadSample(kind="eval", seconds=500.0, count=400),  # an outlier: cold caches
        OverheadSample(kind="export", seconds=3.0, count=2, bytes=1e9),  # 1 GB at 2 s/GB
    ]
    fitted = GIVEN.refit(samples)
    assert fitted.worker_start_s == statistics.median([30.0, 12.0, 13.0]) == 13.0
    assert fitted.eval_s_per_row == pytest.approx(0.03)  # median of 0.01, 0.03, 1.25
    assert fitted.export_s == pytest.approx((3.0 - 2.0) / 2)
    for name in ("model_load_s", "job_start_s", "generate_s_per_row", "checkpoint_s"):
        assert getattr(fitted, name) == getattr(GIVEN, name)
    assert fitted.source == "measured"
    assert fitted.measured == ("eval_s_per_row", "export_s", "worker_start_s")
    assert GIVEN.refit([]) is GIVEN
    # bytes that take longer than measured: clipped at 0, never negative
    assert GIVEN.refit([OverheadSample(kind="export", seconds=0.1, bytes=1e9)]).export_s == 0.0
    again = fitted.refit([OverheadSample(kind="job_start", seconds=1.0)])
    assert again.measured == ("eval_s_per_row", "export_s", "job_start_s", "worker_start_s")


# -------------------------------------------------------------------------- profile store
def test_profile_round_trip_with_overheads(tmp_path) -> None:
    store = ProfileStore(tmp_path)
    k = lora("a")
    steps = (StepSample.from_configs([k], seq_len=512, step_time_s=0.1),)
    over = (OverheadSample(kind="model_load", seconds=9.0),
            OverheadSample(kind="checkpoint", seconds=4.0, count=2, bytes=1e9))  # fmt: skip
    prof = Profile(model="Qwen/Qwen2.5-1.5B", gpu_type="H100", samples=steps,
                   overhead_samples=over)  # fmt: skip
    store.save(prof)
    assert store.load("Qwen/Qwen2.5-1.5B", "H100") == prof
    recorded = store.record("Qwen/Qwen2.5-1.5B", "H100", overheads=over)
    assert recorded.samples == steps  # a recorded sweep is numbered after the newest stored
    assert recorded.overhead_samples == over + tuple(dataclasses.replace(o, sweep=1) for o in over)


def test_profile_files_without_overheads_still_load(tmp_path) -> None:
    store = ProfileStore(tmp_path)
    old = {  # a profile written before overheads were recorded
        "format": 1, "model": "m", "gpu_type": "H100", "coefficients": None, "memory_fit": None,
        "samples": [StepSample.from_configs([lora("a")], seq_len=512, step_time_s=0.1).to_dict()],
    }  # fmt: skip
    store.path("m", "H100").write_text(json.dumps(old))
    prof = store.load("m", "H100")
    assert prof.overhead_samples == () and len(prof.samples) == 1
    bad = {**old, "overhead_samples": [{"kind": "nap", "seconds": 1.0}]}
    store.path("m", "H100").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="malformed"):
        store.load("m", "H100")


def test_second_sweep_plans_with_measured_overheads(tmp_path) -> None:
    sweep = SweepConfig.from_yaml("sweeps/quickstart.yaml")
    first = build_cost_model(sweep, profile_dir=tmp_path)
    assert first.overheads.source == "cpu-default"
    measured = [OverheadSample(kind="worker_start", seconds=6.0),
                OverheadSample(kind="job_start", seconds=2.0, count=2),
                OverheadSample(kind="eval", seconds=2.0, count=1000)]  # fmt: skip
    ProfileStore(tmp_path).record(sweep.model.name_or_path, sweep.hardware.gpu_type,
                                  overheads=measured)  # fmt: skip
    second = build_cost_model(sweep, profile_dir=tmp_path)
    o = second.overheads
    assert (o.worker_start_s, o.job_start_s, o.eval_s_per_row) == (6.0, 1.0, 0.002)
    assert o.model_load_s == first.overheads.model_load_s  # not measured: the default
    assert second.startup_time(1) == pytest.approx(6.0 + o.model_load_s)
    assert build_cost_model(sweep, profile_dir=tmp_path, use_profile=False).overheads == (
        first.overheads
    )
    # an explicit overheads argument wins over the profile
    assert build_cost_model(sweep, profile_dir=tmp_path, overheads=GIVEN).overheads is GIVEN


def test_h100_eval_rows_pay_the_slow_host() -> None:
    """The H100's prior charges its slower host in evaluation's forwards too."""
    h100 = SweepCostModel(QWEN1_5B, 640, 1000, H100, eval_metric="none").overheads
    h200 = SweepCostModel(
        QWEN1_5B, 640, 1000, HardwareConfig(gpu_type="H200", num_gpus=4), eval_metric="none"
    ).overheads
    assert h100.eval_s_per_row > 1.1 * h200.eval_s_per_row  # 1.12x with 102-row forwards
