"""FSDP2 CPU offload in the plan (``planner.cpu_offload``, strategy ``fsdp_offload``).

The sweep key and what it resolves to; the memory model (a GPU holds the LM head, the layers in
flight and the gathered root, the rest is in host memory) and the step-time model (each GPU's
shard crosses the host link forward and backward) against numbers computed here from the
model's shapes; and the planner: ``auto`` offloads exactly the configs that fit nothing else,
``off`` refuses them, ``on`` offloads every fsdp job, and ``plora plan`` shows and notes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from plora.cli import app
from plora.config import ConfigError, CpuOffload, LoRAConfig, PlannerOptions, Strategy, SweepConfig
from plora.config.sweep_options import job_strategies
from plora.cost.build import build_cost_model
from plora.cost.memory import adapter_memory, base_memory
from plora.cost.memory_options import PURE_BF16, MemoryOptions
from plora.cost.parallel import HOST_LINK_GBPS, host_copy_bytes, parallel_step_time
from plora.cost.priors import DEFAULT_COEFFICIENTS
from plora.cost.throughput import StepTimeModel, gpu_spec
from plora.model_spec import ModelSpec
from plora.parallel.dims import ParallelDims
from plora.planner import plan_sweep
from plora.planner.types import NoFeasibleJobError

FSDP, OFFLOAD, TP = Strategy.FSDP, Strategy.FSDP_OFFLOAD, Strategy.TP
QWEN14B = ModelSpec.from_hf_config("Qwen/Qwen2.5-14B")

#: Qwen2.5-14B (about 28 GiB of bf16 weights) on two 22 GiB GPUs at 512 tokens: batch 1 fits
#: sharded over both (about 18.3 GiB a GPU), batch 2 does not (about 20.6 > 19.8 GiB) but does
#: with the base offloaded (about 10 GiB).
MIXED = {
    "name": "mixed",
    "model": "Qwen/Qwen2.5-14B",
    "dataset": {"path": "train.jsonl", "num_examples": 2000, "max_seq_len": 512},
    "space": {"lr": [1e-4, 2e-4], "rank": 8, "alpha": 16, "batch_size": [1, 2],
              "max_steps": 100},
    "hardware": {"gpu_type": "A100-40GB", "num_gpus": 2, "gpu_memory_gib": 22},
    "planner": {"strategies": ["fsdp"]},
}  # fmt: skip


def _sweep(**planner) -> SweepConfig:
    return SweepConfig.from_dict({**MIXED, "planner": {**MIXED["planner"], **planner}})


def _plan(sweep: SweepConfig):
    from plora.tune.space import expand

    configs = expand(sweep)
    return configs, plan_sweep(configs, build_cost_model(sweep, use_profile=False), 2)


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("raw", "want"),
    [(None, CpuOffload.AUTO), ("auto", CpuOffload.AUTO), ("on", CpuOffload.ON),
     ("off", CpuOffload.OFF), (True, CpuOffload.ON), (False, CpuOffload.OFF)],
)  # fmt: skip
def test_the_sweep_key_reads_auto_on_off_and_yaml_booleans(raw, want) -> None:
    planner = {"strategies": ["fsdp"]} | ({} if raw is None else {"cpu_offload": raw})
    sweep = SweepConfig.from_dict({**MIXED, "planner": planner})
    assert sweep.planner.cpu_offload is want
    again = SweepConfig.from_dict(yaml.safe_load(sweep.to_yaml()))
    assert again.planner.cpu_offload is want  # written back as a string, read back the same


@pytest.mark.parametrize(
    ("planner", "hardware", "match"),
    [
        ({"strategies": ["fsdp"], "cpu_offload": "sometimes"}, {},
         r"planner.cpu_offload='sometimes': must be auto, on or off"),
        ({"strategies": ["tp"], "cpu_offload": "on"}, {},
         r"planner.cpu_offload='on': offloads the base of fsdp jobs.*add fsdp"),
        ({"strategies": ["fsdp_offload"]}, {},
         r"planner.strategies\[0\]='fsdp_offload': is not a strategy to list.*cpu_offload: on"),
        ({"strategies": ["fsdp"], "cpu_offload": "on"}, {"gpu_type": "cpu", "num_gpus": 2},
         r"planner.cpu_offload='on': CPU workers hold the base in host memory"),
    ],
)  # fmt: skip
def test_bad_offload_settings_are_one_line_errors(planner, hardware, match) -> None:
    with pytest.raises(ConfigError, match=match):
        SweepConfig.from_dict(
            {**MIXED, "planner": planner, "hardware": hardware or MIXED["hardware"]}
        )


@pytest.mark.parametrize(
    ("strategies", "mode", "cpu", "want"),
    [
        ((FSDP,), CpuOffload.AUTO, False, (FSDP, OFFLOAD)),
        ((TP, FSDP), CpuOffload.AUTO, False, (TP, FSDP, OFFLOAD)),
        ((TP, FSDP), CpuOffload.ON, False, (TP, OFFLOAD)),
        ((TP, FSDP), CpuOffload.OFF, False, (TP, FSDP)),
        ((TP,), CpuOffload.AUTO, False, (TP,)),  # offload is fsdp's: nothing to add
        ((), CpuOffload.AUTO, False, ()),  # d = 1 only stays d = 1 only
        ((FSDP,), CpuOffload.AUTO, True, (FSDP,)),  # CPU workers: the base is on the host
    ],
)  # fmt: skip
def test_job_strategies_apply_cpu_offload(strategies, mode, cpu, want) -> None:
    assert job_strategies(strategies, mode, cpu=cpu) == want


def test_the_default_is_auto_and_the_cost_model_offers_offload_beside_fsdp() -> None:
    assert PlannerOptions().cpu_offload is CpuOffload.AUTO
    assert tuple(build_cost_model(_sweep(), use_profile=False).strategies()) == (FSDP, OFFLOAD)
    on = build_cost_model(_sweep(cpu_offload="on"), use_profile=False)
    assert tuple(on.strategies()) == (OFFLOAD,)


def test_an_offloaded_job_is_an_fsdp_mesh() -> None:
    assert ParallelDims.for_job(4, "fsdp_offload") == ParallelDims(fsdp=4, world_size=4)
    assert OFFLOAD.mesh_dim == "fsdp" and FSDP.mesh_dim == "fsdp" and TP.mesh_dim == "tp"


# ------------------------------------------------------------------------------- cost model
@pytest.mark.parametrize("d", [2, 4, 8])
def test_offloaded_gpu_memory_is_the_head_the_layers_in_flight_and_the_root(d) -> None:
    """Per GPU: the LM head whole (V·h, tied or not), two layers each as its host-copied shard
    plus the gathered whole, the root unit (embeddings and final norm) gathered, the reserve."""
    spec, opts = QWEN14B, MemoryOptions(precision=PURE_BF16)
    v, h = spec.vocab_size, spec.hidden_size
    layer = 2.0 * spec.layer_params
    got = base_memory(spec, d=d, strategy=OFFLOAD, options=opts).components
    assert got["base_weights"] == 2.0 * v * h
    assert got["fsdp_gather_buffer"] == pytest.approx(2 * (layer / d + layer))
    assert got["fsdp_root_gathered"] == 2.0 * (spec.embedding_params + h)
    assert got["reserved"] == opts.reserved_bytes
    sharded = base_memory(spec, d=d, strategy=FSDP, options=opts)
    assert base_memory(spec, d=d, strategy=OFFLOAD, options=opts).total < sharded.total
    # the adapters and the rows' activations are fsdp's: replicated state, rows split over d
    one = {"rank": 16, "targets": ("q_proj", "v_proj"), "batch_size": 4, "seq_len": 512}
    assert (adapter_memory(spec, **one, d=d, strategy=OFFLOAD, options=opts).components
            == adapter_memory(spec, **one, d=d, strategy=FSDP, options=opts).components)  # fmt: skip


def test_an_offloaded_step_pays_the_shards_over_the_host_link() -> None:
    """The fixed part of a step: fsdp's, plus each GPU copying its 1/d of the base in from the
    host forward and backward at :data:`HOST_LINK_GBPS`; a config's own part is unchanged."""
    spec, gpu, d = QWEN14B, gpu_spec("H100"), 4
    model = StepTimeModel(spec, gpu, DEFAULT_COEFFICIENTS)
    weights = 2.0 * spec.total_params
    extra = model.fixed_step_time(d, OFFLOAD) - model.fixed_step_time(d, FSDP)
    assert extra == pytest.approx(2 * weights / d / (HOST_LINK_GBPS * 1e9))
    assert host_copy_bytes(base_bytes=weights, fsdp=d, microbatches=3) == 6 * weights / d
    assert host_copy_bytes(base_bytes=400, fsdp=4, reshard_after_forward=False) == 100
    cfg = LoRAConfig(config_id="x", rank=16, alpha=32, lr=1e-4, batch_size=4, max_steps=10)
    from plora.cost.throughput import AdapterLoad

    load = AdapterLoad.of(cfg)
    assert model.adapter_step_time(load, 512, d, OFFLOAD) == model.adapter_step_time(
        load, 512, d, FSDP
    )
    common = dict(d=d, single_gpu_s=1.0, tokens=2048, layers=spec.num_layers,
                  hidden=spec.hidden_size, base_bytes=weights, lora_params=1e6,
                  link_bytes_per_s=gpu.link_gbps * 1e9)  # fmt: skip
    off, on = (
        parallel_step_time(strategy="fsdp", **common),
        parallel_step_time(strategy="fsdp_offload", **common),
    )
    assert on.host_copy_s == pytest.approx(2 * weights / d / (HOST_LINK_GBPS * 1e9))
    assert on.total_s == pytest.approx(off.total_s + on.host_copy_s) and off.host_copy_s == 0


# ---------------------------------------------------------------------------------- planner
def test_auto_offloads_exactly_the_configs_that_fit_nothing_else() -> None:
    sweep = _sweep()
    cost = build_cost_model(sweep, use_profile=False)
    configs, plan = _plan(sweep)
    cap = cost.capacity(2)
    for cfg in configs:
        fits_fsdp = cost.base_memory(2, FSDP) + cost.config_memory(cfg, 2, FSDP) <= cap
        fits_one = cost.micro_batches_to_fit([cfg], 1, None) is not None
        job = next(j for j in plan.jobs if cfg.config_id in j.config_ids)
        assert (job.strategy is OFFLOAD) == (not fits_fsdp and not fits_one), cfg
    assert {j.strategy for j in plan.jobs} == {FSDP, OFFLOAD}  # the sweep has both kinds
    for job in plan.jobs:
        assert job.memory_gib_per_gpu * 2**30 <= cap * (1 + 1e-9)
    assert any("fsdp_offload" in n and "host memory" in n for n in plan.notes)


def test_off_refuses_what_only_offload_fits_and_on_offloads_every_fsdp_job() -> None:
    with pytest.raises(NoFeasibleJobError, match="on 2 GPUs with fsdp"):
        _plan(_sweep(cpu_offload="off"))
    _, plan = _plan(_sweep(cpu_offload="on"))
    assert plan.jobs and {j.strategy for j in plan.jobs} == {OFFLOAD}


def test_auto_never_offloads_a_sweep_that_fits_sharded() -> None:
    """Batch 1 only: every config fits fsdp on 2 GPUs (one per job), so no job is offloaded --
    even though one offloaded job of six of these eight configs (less GPU memory each) is
    predicted faster than fsdp alone: offload is the last resort, not a packing trick."""
    space = {**MIXED["space"], "batch_size": 1, "lr": [1e-4, 2e-4, 3e-4, 4e-4], "rank": [8, 16]}
    _, plan = _plan(SweepConfig.from_dict({**MIXED, "space": space}))
    assert plan.jobs and {j.strategy for j in plan.jobs} == {FSDP}
    assert not any("fsdp_offload" in n for n in plan.notes)


def test_plora_plan_shows_the_offloaded_jobs(tmp_path: Path) -> None:
    path, out = tmp_path / "s.yaml", tmp_path / "plan.json"
    path.write_text(yaml.safe_dump(MIXED))
    result = CliRunner().invoke(app, ["plan", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    jobs = json.loads(out.read_text())["jobs"]
    offloaded = sorted(j["job_id"] for j in jobs if j["strategy"] == "fsdp_offload")
    assert offloaded
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("j0")]
    assert sorted(r[0] for r in rows if r[3] == "fsdp_offload") == offloaded
    assert "fsdp_offload -- the frozen base in host memory" in " ".join(result.stdout.split())
