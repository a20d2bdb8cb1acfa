"""Parallel packed training on 2 (and 4) GPUs with NCCL in bf16 == one-GPU packed training.

The ``tests/dist`` cases (three adapters differing in rank, targets, lr, batch, schedule,
clipping and dropout; a refill; a checkpoint resumed in a fresh model; FSDP2 CPU offload of the
base, whose shards must stay in pinned host memory) run one process per GPU with NCCL and bf16
autocast, as a job's workers do; each case's per-step losses and final gathered weights must
equal one GPU's packed training within the bf16 tolerance the one-GPU tests use (losses 2e-2
relative, weights 5e-2 relative over the whole adapter), and the exported adapters must reload
with PEFT. Skipped unless the machine has enough GPUs.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _dist_cases import CONFIGS, JOINER, Case, spawn, train, trained_ids
from _engine_testlib import TOKENIZER, adapter_rel_err, tiny_model, toy_dataset

from plora.engine.adapters import adapter_state_dict
from plora.engine.trainer import PackedTrainer

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TWO = [
    Case(name="tp2", tp=2),
    Case(name="fsdp2", fsdp=2, microbatches=4),
    Case(name="fsdp2-base-whole", fsdp=2, shard_base=False),
    Case(name="fsdp2-offload", fsdp=2, cpu_offload=True),
    Case(name="pp2", pp=2, microbatches=3),
    Case(name="pp2-ckpt", pp=2, microbatches=3, checkpointing=True),
    Case(name="tp2-refill", tp=2, refill=True),
]
FOUR = [
    Case(name="fsdp2xtp2", fsdp=2, tp=2),
    Case(name="pp2xtp2", pp=2, tp=2, microbatches=3),
    Case(name="pp2xfsdp2", pp=2, fsdp=2, microbatches=2),
    Case(name="pp2xtp2-resume", pp=2, tp=2, resume=True),
]
CASES = [c for c in (*TWO, *FOUR) if c.world_size <= GPUS]
LOSS_RTOL, WEIGHT_RTOL = 2e-2, 5e-2
#: Where the measured errors go (``PLORA_GPU_REPORT``, else nowhere): the benchmark log.
REPORT = os.environ.get("PLORA_GPU_REPORT")
ERRORS: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="module")
def reference():
    """One GPU, bf16 autocast: per-step losses and final weights (``{refill: result}``)."""
    base = tiny_model("qwen2")
    out = {}
    for refill in (False, True):
        trainer = PackedTrainer(copy.deepcopy(base), TOKENIZER, toy_dataset(), device="cuda:0")
        losses, _, _, _ = train(trainer, refill=refill)
        weights = {
            cid: {k: v.detach().float().cpu() for k, v in
                  adapter_state_dict(trainer.model, trainer.slot_of(cid)).items()}
            for cid in trained_ids(refill)
        }  # fmt: skip
        out[refill] = {"losses": losses, "weights": weights}
    out["base"] = base
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dist")
    for group in (TWO, FOUR):
        group = [c for c in group if c in CASES]
        if group:
            t0 = time.perf_counter()
            spawn(group, out, device_type="cuda")
            print(f"{'+'.join(c.name for c in group)}: {time.perf_counter() - t0:.1f} s")
    yield out
    if REPORT:
        Path(REPORT).write_text(json.dumps(ERRORS, indent=1))


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parallel_bf16_equals_one_gpu(case, runs, reference):
    ref = reference[case.refill]
    for rank in range(case.world_size):
        got = torch.load(runs / f"{case.name}.rank{rank}.pt")
        assert sorted(got["losses"]) == sorted(ref["losses"])
        errs = ERRORS.setdefault(case.name, {})
        for cid in ref["losses"]:
            a, b = torch.tensor(got["losses"][cid]), torch.tensor(ref["losses"][cid])
            errs[f"{cid}.loss"] = max(
                errs.get(f"{cid}.loss", 0.0), float(((a - b).abs() / b.abs()).max())
            )
            torch.testing.assert_close(a, b, rtol=LOSS_RTOL, atol=0)
        for cid in trained_ids(case.refill):
            w = {k: v.float().cpu() for k, v in got["weights"][cid].items()}
            assert set(w) == set(ref["weights"][cid])
            err = adapter_rel_err(w, ref["weights"][cid])
            errs[f"{cid}.weights"] = max(errs.get(f"{cid}.weights", 0.0), err)
            assert err <= WEIGHT_RTOL, f"{case.name} rank {rank} {cid}: weights differ by {err:.2e}"
            assert any(v.abs().max() > 1e-4 for k, v in w.items() if "lora_B" in k)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parallel_exports_reload_with_peft(case, runs, reference):
    from peft import PeftModel, get_peft_model_state_dict

    for cid in trained_ids(case.refill):
        pm = PeftModel.from_pretrained(
            copy.deepcopy(reference["base"]), str(runs / case.name / cid)
        )
        loaded = {k: v.detach().float() for k, v in get_peft_model_state_dict(pm).items()}
        assert adapter_rel_err(loaded, reference[case.refill]["weights"][cid]) <= WEIGHT_RTOL
        assert pm.peft_config["default"].r == {c.config_id: c.rank for c in [*CONFIGS, JOINER]}[cid]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_offloaded_base_stays_in_pinned_host_memory(runs):
    """fsdp2-offload, after training (the trainer moved the model to the GPU, every layer ran
    forward and backward): each rank's base shards are in pinned host memory under FSDP2's
    ``CPUOffloadPolicy`` (2 layers and the root), the adapters on the GPU, and the only base
    weights on the GPU are what the memory model books for ``fsdp_offload`` (the LM head, a
    whole copy even when tied; fp32 tiny model). fsdp2 without offload holds its shards there."""
    from plora.cost import Strategy
    from plora.cost.memory import base_memory
    from plora.cost.memory_options import FULL_FP32, MemoryOptions
    from plora.model_spec import ModelSpec

    spec = ModelSpec.from_hf_config(tiny_model("qwen2").config)
    fp32 = MemoryOptions(precision=FULL_FP32)
    head = base_memory(spec, d=2, strategy=Strategy.FSDP_OFFLOAD, options=fp32)
    for rank in range(2):
        got = torch.load(runs / f"fsdp2-offload.rank{rank}.pt")["layout"]
        assert got["offloaded_units"] == 3, got
        assert got["offloaded_on_cpu"] and got["offloaded_pinned"], got
        assert got["lora_on_device"], got
        assert 4.0 * got["base_numel_on_device"] == head.components["base_weights"], got
        plain = torch.load(runs / f"fsdp2.rank{rank}.pt")["layout"]
        assert plain["offloaded_units"] == 0
        assert 4.0 * plain["base_numel_on_device"] > head.components["base_weights"]
