"""The plan follows the sweeps this machine ran lately: the profile store numbers its sweeps, the
cost model weighs them newest first (``plora.cost.recency``), one long sweep cannot evict the
others, and the export is charged for what is on the job's critical path."""

from __future__ import annotations

import json
import random
import statistics
import threading
from pathlib import Path

import numpy as np
import pytest

from plora.config import ConfigError, HardwareConfig, LoRAConfig, SweepConfig
from plora.cost.build import build_cost_model
from plora.cost.model import SweepCostModel
from plora.cost.overheads import OverheadKind, Overheads, OverheadSample
from plora.cost.profile import (
    MAX_SAMPLES,
    MAX_SWEEP_OVERHEADS_PER_KIND,
    MAX_SWEEP_SAMPLES,
    Profile,
    ProfileStore,
)
from plora.cost.recency import SWEEP_DECAY, sweep_weights, weighted_median
from plora.cost.throughput import AdapterLoad, Coefficients, StepSample, StepTimeModel
from plora.tune.space import expand

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = SweepConfig.from_yaml(ROOT / "sweeps" / "quickstart.yaml")
CONFIGS = expand(QUICKSTART)
MODEL, GPU = QUICKSTART.model.name_or_path, QUICKSTART.hardware.gpu_type
#: The machine as it is now: steps and overheads of a "fast" box (not the model's prior).
FAST = Coefficients(base_efficiency=0.05, lora_efficiency=0.02, overhead_per_layer_s=4e-3,
                    adapter_step_s=6e-3, module_step_s=2e-4, source="truth")  # fmt: skip
FAST_OVERHEADS = {OverheadKind.WORKER_START: 5.5, OverheadKind.MODEL_LOAD: 0.4,
                  OverheadKind.JOB_START: 0.03, OverheadKind.EVAL: 1e-3,
                  OverheadKind.EXPORT: 0.004, OverheadKind.CHECKPOINT: 0.02}  # fmt: skip
#: How much slower the polluted (loaded) history is.
SLOW = 3.0
#: The fitted step times and the overheads must be within this of the newest sweep's (its
#: samples carry 2 % noise).
TOLERANCE = 0.05


def truth() -> StepTimeModel:
    empty = build_cost_model(QUICKSTART, use_profile=False)
    return StepTimeModel(empty.spec, empty.gpu, FAST)


def packs(n: int, rng: random.Random) -> list[list[AdapterLoad]]:
    return [[AdapterLoad.of(c) for c in rng.sample(CONFIGS, rng.randint(1, 8))] for _ in range(n)]


def steps(n: int, factor: float, seed: int) -> list[StepSample]:
    """``n`` measured steps of random quickstart packs, ``factor`` x the fast truth, 2 % noise."""
    rng, timer = random.Random(seed), truth()
    seq = QUICKSTART.seq_len
    noise = [1 + rng.uniform(-0.02, 0.02) for _ in range(n)]
    return [
        StepSample(adapters=tuple(p), seq_len=seq, step_time_s=factor * timer.step_time(p, seq) * e)
        for p, e in zip(packs(n, rng), noise, strict=True)
    ]


def overheads(factor: float, seed: int, per_kind: int = 4, kinds=tuple(FAST_OVERHEADS)):
    rng = random.Random(seed)
    return [
        OverheadSample(kind=k, seconds=factor * FAST_OVERHEADS[k] * (1 + rng.uniform(-0.02, 0.02)))
        for _ in range(per_kind)
        for k in kinds
    ]


def record(tmp_path: Path, factor: float, seed: int, *, n_steps: int = 16, **kw) -> Profile:
    return ProfileStore(tmp_path).record(MODEL, GPU, steps(n_steps, factor, seed),
                                         overheads=overheads(factor, seed, **kw))  # fmt: skip


def write_legacy_store(tmp_path: Path) -> None:
    """A store as files were written before sweeps were numbered: 2000 slow steps and 500
    slow overhead samples (a box loaded by test suites), no ``sweep`` anywhere."""
    prof = Profile(model=MODEL, gpu_type=GPU, samples=tuple(steps(2000, SLOW, 1)),
                   overhead_samples=tuple(overheads(SLOW, 1, per_kind=500 // 6)))  # fmt: skip
    data = prof.to_dict()
    for s in (*data["samples"], *data["overhead_samples"]):
        del s["sweep"]
    path = ProfileStore(tmp_path).path(MODEL, GPU)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def relative_step_errors(cost: SweepCostModel, factor: float = 1.0) -> np.ndarray:
    """``(planned - factor x truth) / (factor x truth)`` over packs of quickstart configs."""
    timer, seq = truth(), QUICKSTART.seq_len
    want = [(p, factor * timer.step_time(p, seq)) for p in packs(40, random.Random(99))]
    return np.array([(cost.timer.step_time(p, seq) - w) / w for p, w in want])


def assert_overheads(cost: SweepCostModel, factor: float, kinds=tuple(FAST_OVERHEADS)) -> None:
    from plora.cost.overheads import FIELD_OF

    for k in kinds:
        got, want = getattr(cost.overheads, FIELD_OF[k]), factor * FAST_OVERHEADS[k]
        assert got == pytest.approx(want, rel=TOLERANCE), (k, got, want)


# ------------------------------------------------------------------------ the newest sweep
def test_one_new_sweep_over_an_old_format_store_sets_the_plan(tmp_path) -> None:
    """An old store (2000 slow steps, 500 slow overhead samples, no sweep numbers: a box loaded
    by test suites), then one sweep of the machine as it is now (16 steps, 4 samples of each
    overhead kind): the planned step times and overheads follow the new sweep within 5 %."""
    write_legacy_store(tmp_path)
    before = build_cost_model(QUICKSTART, profile_dir=tmp_path)
    assert np.abs(relative_step_errors(before, SLOW)).max() < TOLERANCE  # it fits the history
    assert_overheads(before, SLOW)
    record(tmp_path, 1.0, seed=7)
    after = build_cost_model(QUICKSTART, profile_dir=tmp_path)
    err = relative_step_errors(after)
    assert np.abs(err).max() < TOLERANCE, err
    assert_overheads(after, 1.0)


@pytest.mark.parametrize("history", [1, 2, 3, 6])
def test_a_machine_that_got_faster_is_followed_within_two_sweeps(tmp_path, history) -> None:
    """``history`` recorded slow sweeps, then fast ones: against one or two the first fast sweep
    sets the plan; against three or more it takes two (one sweep alone is not trusted over a
    consistent history), and then the plan is the fast sweeps' within 5 %."""
    for seed in range(history):
        record(tmp_path, SLOW, seed, n_steps=300, per_kind=20)
    record(tmp_path, 1.0, seed=10)
    one = build_cost_model(QUICKSTART, profile_dir=tmp_path)
    if history <= 2:
        assert np.abs(relative_step_errors(one)).max() < TOLERANCE
        assert_overheads(one, 1.0)
    else:
        assert np.abs(relative_step_errors(one, SLOW)).max() < TOLERANCE
        assert_overheads(one, SLOW)
    record(tmp_path, 1.0, seed=11)
    two = build_cost_model(QUICKSTART, profile_dir=tmp_path)
    assert np.abs(relative_step_errors(two)).max() < TOLERANCE
    assert_overheads(two, 1.0)


def test_a_kind_the_newest_sweep_did_not_measure_comes_from_older_sweeps(tmp_path) -> None:
    """The newest sweep measured no worker start or model load (say, warm workers): those come
    from the sweeps before it, not from the defaults; the rest from the newest sweep."""
    record(tmp_path, SLOW, seed=1)
    starts = (OverheadKind.WORKER_START, OverheadKind.MODEL_LOAD)
    rest = tuple(k for k in FAST_OVERHEADS if k not in starts)
    record(tmp_path, 1.0, seed=2, kinds=rest)
    cost = build_cost_model(QUICKSTART, profile_dir=tmp_path)
    assert_overheads(cost, SLOW, starts)
    assert_overheads(cost, 1.0, rest)
    assert np.abs(relative_step_errors(cost)).max() < TOLERANCE


# --------------------------------------------------------------------------- an odd sweep
def test_one_long_odd_sweep_neither_moves_the_plan_nor_evicts_the_history(tmp_path) -> None:
    """Five ordinary sweeps, then one odd sweep on a loaded box with 2000 steps and 100 samples
    per overhead kind: the plan stays the ordinary one, the store still holds the five sweeps
    before it, and after one more ordinary sweep the plan is still the ordinary one."""
    for seed in range(5):
        record(tmp_path, 1.0, seed, n_steps=60)
    odd = record(tmp_path, SLOW, seed=5, n_steps=2000, per_kind=100)
    assert sum(s.sweep == 6 for s in odd.samples) == MAX_SWEEP_SAMPLES
    assert all(
        sum(o.sweep == 6 and o.kind is k for o in odd.overhead_samples)
        == MAX_SWEEP_OVERHEADS_PER_KIND
        for k in FAST_OVERHEADS
    )
    assert {s.sweep for s in odd.samples} == {1, 2, 3, 4, 5, 6}  # nothing evicted
    for _ in range(2):
        cost = build_cost_model(QUICKSTART, profile_dir=tmp_path)
        assert np.abs(relative_step_errors(cost)).max() < TOLERANCE
        assert_overheads(cost, 1.0)
        record(tmp_path, 1.0, seed=6, n_steps=60)


def test_outliers_within_the_newest_sweep_do_not_move_its_median(tmp_path) -> None:
    """One cold first call among a new sweep's 8 job starts, over a slower sweep before it
    that recorded more samples of each kind (20)."""
    record(tmp_path, SLOW, seed=1, per_kind=20)
    cold = [OverheadSample(kind=OverheadKind.JOB_START, seconds=40.0)]
    ProfileStore(tmp_path).record(MODEL, GPU, steps(16, 1.0, 2),
                                  overheads=overheads(1.0, 2, per_kind=8) + cold)  # fmt: skip
    assert_overheads(build_cost_model(QUICKSTART, profile_dir=tmp_path), 1.0)


# ------------------------------------------------------------------------- the store itself
def test_an_old_format_file_loads_as_the_oldest_sweep(tmp_path) -> None:
    write_legacy_store(tmp_path)
    old = ProfileStore(tmp_path).load(MODEL, GPU)
    assert len(old.samples) == 2000 and {s.sweep for s in old.samples} == {0}
    assert {o.sweep for o in old.overhead_samples} == {0} and old.last_sweep == 0
    new = record(tmp_path, 1.0, seed=3)
    assert new.last_sweep == 1 and len(new.samples) == MAX_SAMPLES  # newest kept
    assert [s.sweep for s in new.samples[-16:]] == [1] * 16
    again = ProfileStore(tmp_path).load(MODEL, GPU)
    assert again == new  # the numbers are saved


def test_the_store_stays_bounded_and_keeps_every_kind_of_a_sweep(tmp_path) -> None:
    for seed in range(12):
        prof = ProfileStore(tmp_path).record(
            MODEL, GPU, steps(700, 1.0, seed),
            overheads=[*overheads(1.0, seed, per_kind=60, kinds=(OverheadKind.EVAL,)),
                       OverheadSample(kind=OverheadKind.WORKER_START, seconds=5.0)],
        )  # fmt: skip
    assert len(prof.samples) == MAX_SAMPLES and len(prof.overhead_samples) <= 1000
    assert {s.sweep for s in prof.samples} == {8, 9, 10, 11, 12}
    starts = [o for o in prof.overhead_samples if o.kind is OverheadKind.WORKER_START]
    assert [o.sweep for o in starts] == list(range(1, 13))  # a single sample is never thinned
    thinned = [s.step_time_s for s in prof.samples if s.sweep == 12]
    every = steps(700, 1.0, 11)
    assert thinned[0] == every[0].step_time_s and thinned[-1] == every[-1].step_time_s
    path = ProfileStore(tmp_path).path(MODEL, GPU)  # written atomically: no temp file left
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.with_suffix(".lock").name]


def test_sweeps_that_record_at_once_all_land_under_distinct_numbers(tmp_path) -> None:
    errors: list[BaseException] = []

    def one(seed: int) -> None:
        try:
            for _ in range(3):
                record(tmp_path, 1.0, seed, n_steps=50)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    prof = ProfileStore(tmp_path).load(MODEL, GPU)
    assert sorted({s.sweep for s in prof.samples}) == list(range(1, 19))
    assert len(prof.samples) == 18 * 50


# --------------------------------------------------------------------------- the numerics
def test_sweep_weights_decay_by_sweep_and_share_within_one() -> None:
    w = sweep_weights([0, 0, 0, 4, 7, 7])
    assert w == pytest.approx([SWEEP_DECAY**2 / 3] * 3 + [SWEEP_DECAY, 0.5, 0.5])
    by_kind = sweep_weights([1, 1, 2], ["eval", "export", "eval"])
    assert by_kind == pytest.approx([SWEEP_DECAY, SWEEP_DECAY, 1.0])
    # the newest sweep outweighs two before it, not three; the newest two outweigh any history
    assert SWEEP_DECAY + SWEEP_DECAY**2 < 1.0 < SWEEP_DECAY + SWEEP_DECAY**2 + SWEEP_DECAY**3
    assert sum(SWEEP_DECAY**k for k in range(2, 200)) < 1.0 + SWEEP_DECAY
    with pytest.raises(ConfigError, match="decay"):
        sweep_weights([1], decay=0.0)


def test_weighted_median() -> None:
    rng = random.Random(0)
    for n in range(1, 9):
        values = [rng.uniform(0, 10) for _ in range(n)]
        assert weighted_median(values) == pytest.approx(statistics.median(values))
        assert weighted_median(values, [0.3] * n) == pytest.approx(statistics.median(values))
    assert weighted_median([1.0, 2.0, 3.0], [1.0, 1.0, 5.0]) == 3.0
    assert weighted_median([1.0, 2.0, 3.0], [0.4, 0.1, 0.5]) == 2.5  # half: between the two
    assert weighted_median([5.0, 1.0], [0.0, 1.0]) == 1.0
    with pytest.raises(ConfigError):
        weighted_median([])


# -------------------------------------------------------------------------------- export
def test_the_plan_charges_the_exports_critical_path_not_its_overlapped_write() -> None:
    """A measured export (``export_critical_s`` per export: the snapshot and any wait for the
    write) is what the plan charges when the config's evaluation outlasts its file write; the
    write's excess comes on top only where the evaluation is shorter."""
    from plora.cost.jobterms import EXPORT_BYTES_PER_PARAM
    from plora.model_spec import ModelSpec

    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-1.5B")
    hw = HardwareConfig(gpu_type="H100", num_gpus=1)
    given = Overheads(worker_start_s=10.0, model_load_s=3.0, job_start_s=1.0,
                      eval_s_per_row=0.01, generate_s_per_row=0.0, export_s=0.2,
                      checkpoint_s=0.5, write_s_per_gb=5.0, source="given")  # fmt: skip
    critical = [OverheadSample(kind=OverheadKind.EXPORT, seconds=0.06, count=3)]  # 0.02 each
    config = LoRAConfig(config_id="big", rank=64, alpha=128.0, lr=1e-4, batch_size=4,
                        max_steps=40)  # fmt: skip
    write = EXPORT_BYTES_PER_PARAM * spec.lora_params(64, config.target_modules) * 5.0 / 1e9
    assert write > 0.1  # a write the job would notice
    for rows, want in [(200, 0.02), (0, 0.02 + write), (5, 0.02 + write - 0.05)]:
        cost = SweepCostModel(spec, 512, 1000, hw, overheads=given, eval_rows=rows,
                              eval_metric="none").refit_overheads(critical)  # fmt: skip
        assert cost.config_terms(config).export_s == pytest.approx(want), rows


# ---------------------------------------------------------------- a fit pinned at a bound
def test_a_history_fitted_to_a_bound_does_not_pin_the_next_sweep() -> None:
    """What a polluted quickstart store fitted to (2000 steps at load 15-35 on the 2-core box):
    no per-adapter overhead (a = 0, at its bound), LoRA at peak (e_l = 1, at its bound), a large
    per-projection launch cost. The next sweep's 16 steps of its 8-config pack at 7 tokens took
    0.027-0.046 s: the fit from that history must reach them (today's fit scaled a's coordinate
    by 1 s and pulled it to 1 s, then cut the negative a it found at 0, and stayed 2.2x off)."""
    from plora.cost.fit import fit, relative_errors

    empty = build_cost_model(QUICKSTART, use_profile=False)
    history = Coefficients(base_efficiency=0.68, lora_efficiency=1.0, overhead_per_layer_s=6.5e-4,
                           adapter_step_s=0.0, module_step_s=3.35e-3, source="polluted")  # fmt: skip
    timer = StepTimeModel(empty.spec, empty.gpu, history)
    rng = random.Random(5)
    new = [StepSample.from_configs(CONFIGS, seq_len=7, step_time_s=rng.uniform(0.027, 0.046))
           for _ in range(16)]  # fmt: skip
    assert np.abs(relative_errors(new, timer)).mean() > 0.3
    timer.coefficients = fit(new, timer)
    assert np.abs(relative_errors(new, timer)).mean() < 0.15  # the spread of the steps themselves
    mid = statistics.median(s.step_time_s for s in new)
    assert timer.step_time([AdapterLoad.of(c) for c in CONFIGS], 7) == pytest.approx(mid, rel=0.1)
