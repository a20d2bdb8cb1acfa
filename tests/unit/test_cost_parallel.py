"""Per-strategy communication and bubble (plora.cost.parallel), against hand-computed values."""

from __future__ import annotations

import pytest

from plora.cost.parallel import (
    fsdp_bytes,
    parallel_step_time,
    pp_bubble_fraction,
    pp_bytes,
    ring_allgather_bytes,
    ring_allreduce_bytes,
    tp_bytes,
)


def test_ring_collectives():
    assert ring_allreduce_bytes(100.0, 1) == 0.0
    assert ring_allreduce_bytes(100.0, 4) == 150.0
    assert ring_allgather_bytes(100.0, 4) == 75.0


@pytest.mark.parametrize(("p", "m", "f"), [(1, 4, 0.0), (2, 2, 1 / 3), (4, 4, 3 / 7), (4, 12, 0.2)])
def test_pp_bubble(p, m, f):
    assert pp_bubble_fraction(p, m) == pytest.approx(f)


def test_bytes_per_strategy():
    # TP, T=2: 4 all-reduces of h=8 bf16 values per layer (L=2) and token -> 4*2*8*2 = 128 B,
    # ring factor 1 -> 128 B/token; 10 tokens; replicated LoRA 5 params fp32 -> 20 B
    assert tp_bytes(tokens=10, layers=2, hidden=8, tp=2, replicated_lora_params=5) == 1280 + 20
    # FSDP, F=4, 3 micro-batches, reshard: 6 all-gathers of 3/4 of 400 B; LoRA 10 fp32 -> 60 B
    assert fsdp_bytes(base_bytes=400, lora_params=10, fsdp=4, microbatches=3) == 6 * 300 + 60
    assert fsdp_bytes(base_bytes=400, lora_params=10, fsdp=4, shard_base=False) == 60
    assert (
        fsdp_bytes(
            base_bytes=400, lora_params=10, fsdp=4, microbatches=3, reshard_after_forward=False
        )
        == 3 * 300 + 60
    )
    assert pp_bytes(tokens=10, hidden=8, stages=2) == 320
    assert pp_bytes(tokens=10, hidden=8, stages=1) == 0


def test_parallel_step_time():
    common = dict(single_gpu_s=8.0, tokens=10, layers=2, hidden=8, base_bytes=400,
                  lora_params=10, link_bytes_per_s=100.0, comm_efficiency=0.5)  # fmt: skip
    pp = parallel_step_time(strategy="pp", d=2, microbatches=2, **common)
    assert pp.compute_s == 4.0
    assert pp.bubble_s == pytest.approx(2.0)  # (P-1)/M of the compute
    assert pp.comm_s == pytest.approx(320 / 50)
    # more micro-batches (a bigger pack) fill the bubble
    assert parallel_step_time(strategy="pp", d=2, microbatches=8, **common).bubble_s == 0.5
    tp = parallel_step_time(strategy="tp", d=2, **common)
    assert tp.comm_s == pytest.approx((1280 + 20) / 50)
    fsdp = parallel_step_time(strategy="fsdp", d=4, microbatches=3, **common)
    assert fsdp.total_s == pytest.approx(2.0 + (1800 + 60) / 50)
    with pytest.raises(ValueError, match="comm_efficiency=0"):
        parallel_step_time(strategy="tp", d=2, **{**common, "comm_efficiency": 0})
