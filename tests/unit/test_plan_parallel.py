"""Multi-GPU jobs in the plan: the planner uses the sweep's ``planner.strategies`` and only
degrees ``plora.parallel`` can run; ``plora plan`` shows each job's d and strategy; the
step-time model charges the bytes :mod:`plora.cost.parallel` counts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from plora.cli import app
from plora.config import LoRAConfig, Strategy, SweepConfig
from plora.cost.build import build_cost_model
from plora.cost.parallel import fsdp_bytes, pp_bytes, tp_bytes
from plora.cost.priors import DEFAULT_COEFFICIENTS
from plora.cost.throughput import AdapterLoad, StepTimeModel, gpu_spec
from plora.model_spec import ModelSpec

#: Qwen2.5-14B (about 28 GiB of bf16 weights) on 24 GiB GPUs: no job fits on one GPU.
BIG = {
    "name": "big",
    "model": "Qwen/Qwen2.5-14B",
    "dataset": {"path": "train.jsonl", "num_examples": 2000, "max_seq_len": 256},
    "space": {"lr": [1e-4, 2e-4], "rank": [8, 16], "alpha": 16, "batch_size": 1,
              "max_steps": 100},
    "hardware": {"gpu_type": "A100-40GB", "num_gpus": 8, "gpu_memory_gib": 24},
}  # fmt: skip


def _plan(tmp_path: Path, sweep: dict) -> tuple[object, dict]:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", str(path), "--out", str(out)])
    return result, (json.loads(out.read_text()) if out.is_file() else {})


@pytest.mark.parametrize(
    "strategies", [["tp"], ["fsdp"], ["pp"], ["tp", "fsdp"], ["tp", "fsdp", "pp"]]
)
def test_plan_uses_the_sweeps_strategies_and_shows_them(tmp_path, strategies) -> None:
    result, plan = _plan(tmp_path, {**BIG, "planner": {"strategies": strategies}})
    assert result.exit_code == 0, result.output
    jobs = plan["jobs"]
    assert jobs and all(j["gpus"] >= 2 and j["strategy"] in strategies for j in jobs)
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("j0")]
    assert len(rows) == len(jobs)
    for row, job in zip(rows, sorted(jobs, key=lambda j: j["job_id"]), strict=True):
        assert row[0] == job["job_id"] and row[2] == str(job["gpus"]) and row[3] == job["strategy"]


def test_without_strategies_every_job_is_one_gpu(tmp_path) -> None:
    result, _ = _plan(tmp_path, BIG)
    assert result.exit_code == 2
    assert "planner.strategies" in result.stderr  # the fix it names
    small = {**BIG, "model": "Qwen/Qwen2.5-0.5B"}
    result, plan = _plan(tmp_path, small)
    assert result.exit_code == 0, result.output
    assert {j["gpus"] for j in plan["jobs"]} == {1} and {j["strategy"] for j in plan["jobs"]} == {
        None
    }


def test_tp_degrees_the_heads_cannot_split_never_fit() -> None:
    """tiny-qwen2 has 4 query and 2 KV heads: ``apply_tp`` splits it 2 ways, never 4."""
    sweep = SweepConfig.from_dict(
        {**BIG, "model": "tiny-qwen2", "hardware": {"gpu_type": "cpu", "num_gpus": 4},
         "planner": {"strategies": ["tp"]}}
    )  # fmt: skip
    cost = build_cost_model(sweep, use_profile=False)
    assert math.isfinite(cost.base_memory(2, Strategy.TP))
    assert cost.base_memory(4, Strategy.TP) == math.inf
    big = build_cost_model(SweepConfig.from_dict({**BIG, "planner": {"strategies": ["tp"]}}))
    assert math.isfinite(big.base_memory(4, Strategy.TP))  # 40 heads, 8 KV heads
    assert big.base_memory(8, Strategy.TP) < big.base_memory(4, Strategy.TP)


def test_pp_degrees_beyond_the_layers_never_fit() -> None:
    """tiny-qwen2 has 2 decoder layers: ``apply_pp`` makes 2 stages of it, never 4."""
    sweep = SweepConfig.from_dict(
        {**BIG, "model": "tiny-qwen2", "hardware": {"gpu_type": "cpu", "num_gpus": 4},
         "planner": {"strategies": ["pp"]}}
    )  # fmt: skip
    cost = build_cost_model(sweep, use_profile=False)
    assert math.isfinite(cost.base_memory(2, Strategy.PP))
    assert cost.base_memory(4, Strategy.PP) == math.inf


def test_step_time_charges_the_bytes_plora_parallel_sends() -> None:
    """Each communication feature of the step-time model is :mod:`plora.cost.parallel`'s byte
    count over the link (the fitted efficiency multiplies it)."""
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-7B")
    gpu = gpu_spec("A100-40GB")
    model = StepTimeModel(spec, gpu, DEFAULT_COEFFICIENTS)
    cfg = LoRAConfig(config_id="x", rank=16, alpha=32, lr=1e-4, batch_size=4, max_steps=10,
                     target_modules="all")  # fmt: skip
    load = AdapterLoad.of(cfg)
    link, seq, d = gpu.link_gbps * 1e9, 512, 4
    tokens = 4.0 * seq
    lora = float(spec.lora_params(16, cfg.target_modules))
    comm = {s: model._adapter_terms(load, seq, d, s)[1][5] for s in Strategy}
    assert comm[Strategy.TP] == pytest.approx(
        tp_bytes(tokens=tokens, layers=spec.num_layers, hidden=spec.hidden_size, tp=d,
                 replicated_lora_params=lora / 2) / link
    )  # fmt: skip
    assert comm[Strategy.FSDP] == pytest.approx(
        fsdp_bytes(base_bytes=0, lora_params=lora, fsdp=d, shard_base=False) / link
    )
    assert comm[Strategy.PP] == pytest.approx(
        pp_bytes(tokens=tokens, hidden=spec.hidden_size, stages=d) / link
    )
    fixed = model._fixed_terms(d, Strategy.FSDP)[1][5]
    assert fixed == pytest.approx(fsdp_bytes(base_bytes=2.0 * spec.total_params, lora_params=0,
                                             fsdp=d) / link)  # fmt: skip


def test_the_runtime_runs_every_strategy_and_refuses_others_before_starting() -> None:
    from plora.config import ConfigError
    from plora.runtime.actors.group import check_strategies

    check_strategies(list(Strategy))
    with pytest.raises(
        ConfigError, match=r"planner.strategies: zero3 cannot run yet.*fsdp, fsdp_offload, pp, tp"
    ):
        check_strategies([Strategy.TP, "zero3"])


def test_apply_pp_frees_the_layers_of_other_stages_at_once(monkeypatch) -> None:
    """A dropped layer in a reference cycle (as Liger's patch makes: the attention holds a
    bound method of itself) is freed by ``apply_pp``, not at some later collection: otherwise
    each pp rank keeps the whole base on its GPU."""
    import gc
    import weakref

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config

    from plora.parallel.pp import apply_pp

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    for layer in model.model.layers:
        for m in (layer.self_attn, layer.mlp):
            m.forward = m.forward  # a bound method of m in m's __dict__: a cycle
    del layer, m
    weights = [weakref.ref(layer.mlp.gate_proj.weight) for layer in model.model.layers]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    gc.disable()  # no collection but apply_pp's own
    try:
        stage = apply_pp(model, pp_group=None)
        alive = [w() is not None for w in weights]
    finally:
        gc.enable()
    assert list(stage.layer_ids) == [0, 1]
    assert alive == [True, True, False, False]
