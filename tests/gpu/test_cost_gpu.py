"""The cost model against the GPU it plans for: peak memory and step time of real steps.

Random-weight Qwen2.5-0.5B shape (built from the shipped config), bf16 weights, autocast.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from plora.config import HardwareConfig, LoRAConfig
from plora.cost.memory import adapter_memory, base_memory
from plora.cost.memory_options import Loss, MemoryOptions
from plora.cost.model import SweepCostModel
from plora.cost.overheads import Overheads
from plora.cost.throughput import StepSample
from plora.model_spec import ModelSpec, shipped_config_path

pytestmark = pytest.mark.gpu

NAME = "Qwen/Qwen2.5-0.5B"
SEQ = 512
#: Steps per pack in the refit test; the median of all but the first two is the step's time
#: (a graphed trainer runs its first step eagerly and captures in its second).
STEPS = 12


def _model() -> torch.nn.Module:
    cfg = AutoConfig.for_model(**json.loads(shipped_config_path(NAME).read_text()))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


@pytest.mark.parametrize("batch", [1, 4])
def test_peft_step_peak_matches_app_a(batch: int) -> None:
    """HF + PEFT step (eager loss, all seven projections): within 5% of the measured peak."""
    from peft import LoraConfig, get_peft_model

    rank = 32
    model = get_peft_model(_model(), LoraConfig(r=rank, target_modules="all-linear"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, SEQ), device="cuda")
    for step in range(3):
        if step == 1:  # the optimizer state exists from here on
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    spec = ModelSpec.from_hf_config(NAME)
    opts = MemoryOptions(loss=Loss.EAGER, reserved_bytes=0.0)
    targets = tuple(spec.projection_shapes)
    want = (
        base_memory(spec, options=opts).total
        + adapter_memory(
            spec, rank=rank, targets=targets, batch_size=batch, seq_len=SEQ, options=opts
        ).total
    )
    assert want == pytest.approx(peak, rel=0.05)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
def test_packed_engine_refit_covers_peaks_and_times(graphs: bool) -> None:
    """Refit from the engine's own profile: step times within 10%, every peak covered. The
    graphed step (the default on CUDA) is fitted by the model's graphed form, the eager one by
    its eager form (``cuda_graphs``): each step kind is booked by its own coefficients."""
    from plora.engine.data import Example, TokenizedDataset
    from plora.engine.trainer import PackedTrainer

    rng = random.Random(0)
    vocab = 151936
    rows = [[rng.randrange(vocab) for _ in range(SEQ)] for _ in range(32)]
    data = TokenizedDataset(
        train=[Example(input_ids=r, labels=r) for r in rows], eval=[], metric="none"
    )
    tok = type("Tok", (), {"pad_token_id": 0, "eos_token_id": 0})()
    packs = [
        [
            LoRAConfig(rank=16, alpha=16, lr=1e-4, batch_size=b, max_steps=50, seed=i)
            for i in range(n)
        ]
        for n, b in ((1, 1), (4, 1), (4, 2), (8, 1))
    ]
    samples = []
    for pack in packs:
        trainer = PackedTrainer(_model(), tok, data, device="cuda", seq_len=SEQ, profile_steps=STEPS,
                                cuda_graphs=graphs)  # fmt: skip
        for k in pack:
            trainer.add(k)
        for _ in range(STEPS):
            trainer.step()
        if graphs:  # the first step ran eagerly, the second captured: the rest replayed
            assert trainer.graphs is not None and trainer.graphs.replays == STEPS - 1, (
                trainer.graphs
            )
        steps = trainer.profile().steps[2:]
        samples.append(
            StepSample.from_configs(
                pack,
                seq_len=SEQ,
                step_time_s=sorted(s.time_s for s in steps)[len(steps) // 2],
                peak_memory_bytes=max(s.peak_memory_bytes for s in steps),
            )
        )
        del trainer
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name()
    gpu = "H200" if "H200" in name else "H100" if "H100" in name else "A100-80GB"
    cm = SweepCostModel(
        ModelSpec.from_hf_config(NAME),
        SEQ,
        1000,
        HardwareConfig(gpu_type=gpu),
        memory=MemoryOptions(loss=Loss.FUSED, reserved_bytes=0.0),
        overheads=Overheads.zero(),  # measured steps only: compare step time, no overheads
        cuda_graphs=graphs,
    )
    new = cm.refit(samples)
    for pack, s in zip(packs, samples, strict=True):
        print(
            f"graphs={graphs} K={len(pack)} bs={pack[0].batch_size}: measured "
            f"{s.step_time_s * 1e3:.2f} ms, {s.peak_memory_bytes / 2**30:.2f} GiB; booked "
            f"{new.job_time(pack, 1) / 50 * 1e3:.2f} ms, {new.pack_memory(pack, 1) / 2**30:.2f} GiB"
        )
    print("refit", new.last_refit)
    assert new.last_refit.error_after < 0.1
    for pack, s in zip(packs, samples, strict=True):
        assert new.pack_memory(pack, 1) >= s.peak_memory_bytes
        assert new.job_time(pack, 1) / 50 == pytest.approx(s.step_time_s, rel=0.15)
