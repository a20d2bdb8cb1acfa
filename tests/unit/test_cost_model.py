"""SweepCostModel: the CostModel protocol, the affine job-time identity, refit, build from a sweep."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plora.config import PROJECTIONS, ConfigError, HardwareConfig, LoRAConfig, SweepConfig
from plora.cost import CostModel, Strategy
from plora.cost.build import build_cost_model
from plora.cost.memory import adapter_memory, base_memory
from plora.cost.memory_options import GIB, Loss, MemoryOptions
from plora.cost.model import SweepCostModel
from plora.cost.overheads import Overheads
from plora.cost.priors import DEFAULT_COEFFICIENTS, step_prior
from plora.cost.profile import ProfileStore
from plora.cost.throughput import Coefficients, StepSample, StepTimeModel
from plora.model_spec import ModelSpec

QWEN7B = ModelSpec.from_hf_config("Qwen/Qwen2.5-7B")
A100 = HardwareConfig(gpu_type="A100-80GB", num_gpus=8)


def configs(n: int = 24, seed: int = 0) -> list[LoRAConfig]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kw = (
            {"max_steps": rng.choice([50, 100, 400])}
            if rng.random() < 0.5
            else {"epochs": rng.choice([0.5, 1.0, 2.0])}
        )
        out.append(
            LoRAConfig(
                rank=rng.choice([8, 32, 128]),
                alpha=16.0,
                lr=rng.choice([1e-4, 2e-4]),
                batch_size=rng.choice([1, 4, 16]),
                dropout=rng.choice([0.0, 0.05]),
                target_modules=rng.choice([("q_proj", "v_proj"), PROJECTIONS]),
                seed=rng.randrange(1000),
                **kw,
            )
        )
    return out


def model(**kw) -> SweepCostModel:
    args = dict(strategies=(Strategy.TP, Strategy.FSDP, Strategy.PP))
    return SweepCostModel(QWEN7B, 1024, 7473, A100, **{**args, **kw})


def test_implements_the_protocol() -> None:
    assert isinstance(model(), CostModel)


def test_job_time_is_affine_in_the_pack() -> None:
    cm, rng = model(), random.Random(1)
    ks = configs(40)
    for d, strat in [
        (1, None),
        (1, Strategy.TP),
        (2, Strategy.TP),
        (4, Strategy.FSDP),
        (8, Strategy.PP),
    ]:
        for _ in range(20):
            pack = rng.sample(ks, rng.randint(1, 12))
            longest = max(cm.steps(k) for k in pack)
            want = cm.fixed_time(longest, d, strat) + sum(cm.config_time(k, d, strat) for k in pack)
            assert cm.job_time(pack, d, strat) == pytest.approx(want, rel=1e-12)
    assert cm.job_time([], 1, None) == 0.0


def test_job_time_equals_stepping_the_pack_to_completion() -> None:
    """Independent reference: simulate each step with the adapters still active (pure step
    time: no overheads; they are tested in test_cost_overheads.py)."""
    cm = model(overheads=Overheads.zero())
    timer = StepTimeModel(QWEN7B, cm.gpu, cm.coefficients)
    pack = configs(6, seed=3)
    from plora.cost.throughput import AdapterLoad

    total, steps = 0.0, {k.config_id: cm.steps(k) for k in pack}
    for step in range(max(steps.values())):
        active = [AdapterLoad.of(k) for k in pack if steps[k.config_id] > step]
        total += timer.step_time(active, 1024)
    assert cm.job_time(pack, 1, None) == pytest.approx(total, rel=1e-9)


def test_steps_from_max_steps_or_epochs() -> None:
    cm = model()
    assert cm.steps(LoRAConfig(rank=8, alpha=8, lr=1e-4, batch_size=4, max_steps=77)) == 77
    assert cm.steps(LoRAConfig(rank=8, alpha=8, lr=1e-4, batch_size=4, epochs=1.0)) == math.ceil(
        7473 / 4
    )
    assert cm.steps(LoRAConfig(rank=8, alpha=8, lr=1e-4, batch_size=16, epochs=0.5)) == math.ceil(
        7473 / 32
    )


def test_memory_matches_the_memory_module_and_capacity() -> None:
    cm = model()
    k = configs(1)[0]
    for d, s in [(1, None), (2, Strategy.TP), (4, Strategy.FSDP)]:
        assert cm.base_memory(d, s) == base_memory(QWEN7B, d=d, strategy=s, options=cm.memory).total
        want = adapter_memory(
            QWEN7B,
            rank=k.rank,
            targets=k.target_modules,
            batch_size=k.batch_size,
            seq_len=1024,
            dropout=k.dropout,
            d=d,
            strategy=s,
            options=cm.memory,
        )
        assert cm.config_memory(k, d, s) == want.total
    assert cm.capacity(1) == cm.capacity(8) == pytest.approx(0.9 * 80 * GIB)


def test_degree_and_strategy_validation() -> None:
    only_one = model(strategies=())
    k = configs(1)[0]
    assert only_one.strategies() == ()
    only_one.config_time(k, 1, None)
    with pytest.raises(ConfigError, match="not supported"):
        only_one.config_time(k, 2, Strategy.TP)
    with pytest.raises(ConfigError, match="power of two"):
        model().job_time([k], 3, Strategy.TP)
    with pytest.raises(ConfigError, match="power of two"):
        model().capacity(6)
    with pytest.raises(ConfigError, match="dataset_size"):
        SweepCostModel(QWEN7B, 1024, 0, A100)


def test_config_work_is_single_gpu_config_time() -> None:
    cm = model()
    for k in configs(5):
        assert cm.config_work(k) == cm.config_time(k, 1, None)
        assert cm.config_work(k) < cm.job_time([k], 1, None)


def test_answers_are_cached_and_fast() -> None:
    cm, ks = model(), configs(120)
    start = time.perf_counter()
    for _ in range(5):
        for k, (d, s) in itertools.product(
            ks, [(1, None), (2, Strategy.TP), (4, Strategy.TP), (8, Strategy.TP)]
        ):
            cm.config_time(k, d, s)
            cm.config_memory(k, d, s)
    assert time.perf_counter() - start < 1.0  # 4,800 calls


def _samples_from(truth: SweepCostModel, packs, *, d=1, strategy=None):
    timer, out = truth.timer, []
    for pack in packs:
        from plora.cost.throughput import AdapterLoad

        loads = [AdapterLoad.of(k) for k in pack]
        mem = truth.pack_memory(pack, 1, None) - truth.memory.reserved_bytes if d == 1 else None
        out.append(
            StepSample.from_configs(
                pack,
                seq_len=truth.seq_len,
                d=d,
                strategy=strategy,
                step_time_s=timer.step_time(loads, truth.seq_len, d, strategy),
                peak_memory_bytes=mem,
            )
        )
    return out


def test_refit_recovers_time_and_memory_and_reports_the_change() -> None:
    true_coef = Coefficients(
        base_efficiency=0.55,
        lora_efficiency=0.2,
        overhead_per_layer_s=1e-3,
        adapter_step_s=4e-3,
        comm_efficiency=0.7,
    )
    truth = model(coefficients=true_coef, memory=MemoryOptions(activation_scale=1.6))
    ks = configs(30, seed=5)
    rng = random.Random(0)
    packs = [rng.sample(ks, rng.randint(1, 8)) for _ in range(40)]
    new = model().refit(_samples_from(truth, packs), prior_weight=1e-9)
    assert new.coefficients.base_efficiency == pytest.approx(0.55, rel=1e-3)
    assert new.coefficients.adapter_step_s == pytest.approx(4e-3, rel=1e-3)
    assert new.memory.activation_scale == pytest.approx(1.6, rel=0.02)
    assert new.config_memory(ks[0], 1, None) == pytest.approx(
        truth.config_memory(ks[0], 1, None), rel=0.02
    )
    report = new.last_refit.to_dict()
    assert report["old"]["base_efficiency"] == DEFAULT_COEFFICIENTS.base_efficiency
    assert report["new"]["base_efficiency"] == pytest.approx(0.55, rel=1e-3)
    assert report["step_time_rel_error_after"] < 1e-6 < report["step_time_rel_error_before"]
    assert report["activation_scale_old"] == 1.0
    pack = packs[0]
    assert new.job_time(pack, 1, None) == pytest.approx(truth.job_time(pack, 1, None), rel=1e-6)


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
    assert cm.coefficients == step_prior("H100", False)  # the H100's measured prior
    assert cm.capacity(1) == pytest.approx(0.9 * 80 * GIB)
    assert build_cost_model(sweep, dataset_size=50, profile_dir=tmp_path).dataset_size == 50
    # A measured profile for (model, GPU) makes the next sweep plan from it.
    k = LoRAConfig(rank=8, alpha=16, lr=1e-4, batch_size=2, max_steps=10)
    samples = [
        StepSample.from_configs([k] * n, seq_len=512, step_time_s=0.05 + 0.04 * n)
        for n in (1, 2, 4, 8)
    ]
    ProfileStore(tmp_path).record("Qwen/Qwen2.5-7B", "H100", samples)
    planned = build_cost_model(sweep, profile_dir=tmp_path)
    assert planned.coefficients != step_prior("H100", False)
    # the steps of the job (its start, eval, export and checkpoints come on top)
    assert planned.job_terms([k], 1, None).train_s == pytest.approx(10 * 0.09, rel=0.05)
    assert build_cost_model(
        sweep, profile_dir=tmp_path, use_profile=False
    ).coefficients == step_prior("H100", False)


def test_build_rejects_unknown_gpu_speed(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no known peak"):
        build_cost_model(_sweep(gpu_type="MI300X", gpu_memory_gib=192), profile_dir=tmp_path)


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
    ProfileStore(tmp_path).record("Qwen/Qwen2.5-7B", "H100", samples)
    planned = build_cost_model(sweep, profile_dir=tmp_path)
    assert planned.memory.activation_scale == pytest.approx(1.5, rel=1e-6)
    assert planned.config_memory(ks[1], 1) == pytest.approx(truth.config_memory(ks[1], 1), rel=1e-9)
    assert planned.last_refit is not None and planned.last_refit.num_samples == 3


# plora's PackedTrainer on an H200 (2026-11-21, torch 2.11, bf16 autocast, fp32 LoRA state,
# random weights, seq 1024, median of steps 3-8): (model, pack, step ms, peak GiB). Packs:
# "nxb1-all" = n adapters of batch 1 on all seven projections (ranks 8/16/32/64 for n = 4,
# else rank 16); "4xb4-qv" = 4 adapters of batch 4, rank 16, on q_proj and v_proj.
ENGINE_H200 = [
    ("Qwen/Qwen2.5-1.5B", "1xb1-all", 152.3, 6.01),
    ("Qwen/Qwen2.5-1.5B", "4xb1-all", 222.3, 15.53),
    ("Qwen/Qwen2.5-1.5B", "8xb1-all", 297.1, 25.96),
    ("Qwen/Qwen2.5-1.5B", "4xb4-qv", 401.9, 36.47),
    ("Qwen/Qwen2.5-1.5B", "16xb1-all", 506.5, 48.98),
    ("Qwen/Qwen2.5-7B", "1xb1-all", 155.7, 20.79),
    ("Qwen/Qwen2.5-7B", "4xb1-all", 345.5, 41.24),
    ("Qwen/Qwen2.5-7B", "8xb1-all", 620.8, 64.26),
    ("Qwen/Qwen2.5-7B", "4xb4-qv", 1122.4, 87.14),
    ("Qwen/Qwen2.5-7B", "16xb1-all", 1216.4, 114.26),
]


def _engine_pack(label: str) -> list[LoRAConfig]:
    def k(rank: int, batch: int, targets, seed: int) -> LoRAConfig:
        return LoRAConfig(rank=rank, alpha=16.0, lr=1e-4, batch_size=batch, max_steps=100,
                          target_modules=targets, seed=seed)  # fmt: skip

    if label == "4xb4-qv":
        return [k(16, 4, ("q_proj", "v_proj"), i) for i in range(4)]
    n = int(label.split("x")[0])
    if n == 4:
        return [k(r, 1, "all", 0) for r in (8, 16, 32, 64)]
    return [k(16, 1, "all", i) for i in range(n)]


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B"])
def test_real_packed_engine_steps(name: str) -> None:
    """Physics vs the engine: all-target packs' peaks within 5% (q/v-only packs: the model
    keeps every projection's input, +20%); after a refit, step times within 5% and every
    measured peak covered."""
    hw = HardwareConfig(gpu_type="H200")
    spec = ModelSpec.from_hf_config(name)
    cm = SweepCostModel(  # measured step times: compare steps only, no overheads
        spec,
        1024,
        1000,
        hw,
        memory=MemoryOptions(loss=Loss.FUSED, reserved_bytes=0),
        overheads=Overheads.zero(),
    )
    rows = [
        (_engine_pack(label), ms / 1e3, gib * 2**30)
        for n, label, ms, gib in ENGINE_H200
        if n == name
    ]
    for pack, _, peak in rows:
        ratio = cm.pack_memory(pack, 1) / peak
        if all(k.target_modules == PROJECTIONS for k in pack):
            assert ratio == pytest.approx(1.0, abs=0.05)
        else:
            assert 1.0 < ratio < 1.25
    samples = [
        StepSample.from_configs(p, seq_len=1024, step_time_s=t, peak_memory_bytes=m)
        for p, t, m in rows
    ]
    new = cm.refit(samples)
    assert new.last_refit.error_after < 0.05 < new.last_refit.error_before
    for pack, t, peak in rows:
        assert new.pack_memory(pack, 1) >= peak
        assert new.job_time(pack, 1) / 100 == pytest.approx(t, rel=0.08)


def test_steps_agree_with_the_engine() -> None:
    optim = pytest.importorskip("plora.engine.optim")
    cm = model()
    for k in configs(40, seed=9):
        assert cm.steps(k) == optim.total_steps(k, cm.dataset_size)


_config = st.builds(
    LoRAConfig,
    rank=st.sampled_from([1, 4, 8, 16, 64, 256]),
    alpha=st.just(16.0),
    lr=st.sampled_from([1e-5, 1e-4]),
    batch_size=st.integers(1, 32),
    target_modules=st.lists(st.sampled_from(PROJECTIONS), min_size=1, max_size=7, unique=True).map(
        tuple
    ),
    dropout=st.sampled_from([0.0, 0.1]),
    max_steps=st.integers(1, 5000),
)
_degree = st.sampled_from(  # TP 8 cannot split Qwen2.5-7B's 28 heads: see the test below
    [(1, None), (2, Strategy.TP), (4, Strategy.FSDP), (8, Strategy.PP), (4, Strategy.TP)]
)

_SHARED = model()


@settings(max_examples=60, deadline=None)
@given(pack=st.lists(_config, min_size=1, max_size=10), degree=_degree)
def test_properties_of_any_pack(pack: list[LoRAConfig], degree) -> None:
    cm = _SHARED
    d, s = degree
    longest = max(cm.steps(k) for k in pack)
    total = cm.job_time(pack, d, s)
    assert total == pytest.approx(
        cm.fixed_time(longest, d, s) + sum(cm.config_time(k, d, s) for k in pack)
    )
    # adding a config never makes a job shorter or smaller
    assert cm.job_time(pack[:-1], d, s) <= total
    assert cm.pack_memory(pack[:-1], d, s) < cm.pack_memory(pack, d, s)
    # more rows cost more memory and time
    k = pack[0]
    bigger = LoRAConfig.from_dict({**k.to_dict(), "config_id": "", "batch_size": k.batch_size + 1})
    assert cm.config_memory(bigger, d, s) > cm.config_memory(k, d, s)
    assert cm.config_time(bigger, d, s) > cm.config_time(k, d, s)
    assert 0 < cm.config_work(k) <= cm.job_time([k], 1, None)


def test_tp_degrees_that_do_not_split_the_heads_never_fit() -> None:
    """plora.parallel.tp splits whole query and KV heads: Qwen2.5-7B (28 and 4) splits 2 and
    4 ways, never 8; the planner sees such a job as never fitting."""
    cm = model()
    assert math.isfinite(cm.base_memory(4, Strategy.TP))
    assert cm.base_memory(8, Strategy.TP) == math.inf
    assert math.isfinite(cm.base_memory(8, Strategy.FSDP))
