"""What one packed step reports (plora.engine.step_record), against hand-computed values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from plora.config import LoRAConfig
from plora.engine.reports import AdapterStatus, StepProfile
from plora.engine.step_record import TrainingAdapter, pack_profile, record_step


def _adapter(cid: str, slot: int, rank: int, batch_size: int) -> TrainingAdapter:
    config = LoRAConfig(
        config_id=cid, rank=rank, alpha=16, lr=1e-3, batch_size=batch_size, max_steps=5
    )
    return TrainingAdapter(config=config, slot=slot, total_steps=5, stream=None,
                           lr_lambda=lambda step: 1.0)  # fmt: skip


def _examples(*lengths: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(input_ids=[1] * n) for n in lengths]


def test_record_step_reads_norms_by_slot_and_sums_ce_over_micro_batches() -> None:
    a, b = _adapter("a", 0, 4, 2), _adapter("b", 2, 8, 1)
    batches = {0: _examples(3, 5), 2: _examples(7)}
    # three gradient norms (slots 0..2), then micro-batch 1: slots 0 and 2, micro-batch 2: slot 2
    values = [0.5, 9.0, 1.5, 6.0, 4.0, 2.0]
    metrics, tokens = record_step(
        [a, b], batches=batches, denoms={0: 3, 2: 4}, lrs={0: 1e-3, 2: 2e-3}, values=values,
        num_norms=3, ce_slots=[[0, 2], [2]], elapsed=0.25,
    )  # fmt: skip
    assert tokens == 3 + 5 + 7
    assert [(m.config_id, m.step, m.tokens, m.grad_norm, m.lr, m.time_s) for m in metrics] == [
        ("a", 1, 8, 0.5, 1e-3, 0.25),
        ("b", 1, 7, 1.5, 2e-3, 0.25),
    ]
    assert metrics[0].loss == pytest.approx(6.0 / 3)
    assert metrics[1].loss == pytest.approx((4.0 + 2.0) / 4)
    assert (a.step, a.tokens, a.losses, b.losses) == (1, 8, [2.0], [1.5])
    assert a.status is AdapterStatus.ACTIVE  # retiring is the trainer's decision


def test_pack_profile_lists_adapters_in_slot_order() -> None:
    ads = [_adapter("late", 3, 16, 4), _adapter("early", 1, 4, 2)]
    step = StepProfile(step=1, time_s=0.1, host_s=0.05, adapters=2, rows=6, seq_len=8,
                       tokens=40, padded_tokens=48, micro_batches=1, peak_memory_bytes=0)  # fmt: skip
    prof = pack_profile(torch.device("cpu"), None, ads, [step])
    assert (prof.device, prof.device_name, prof.dtype) == ("cpu", "cpu", "float32")
    assert (prof.ranks, prof.batch_sizes, prof.steps) == ((4, 16), (2, 4), (step,))
    assert pack_profile(torch.device("cpu"), torch.bfloat16, ads, []).dtype == "bfloat16"
