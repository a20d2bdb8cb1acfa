"""SweepCostModel.for_peft: the Tune baseline's cost model -- one PEFT adapter per trial at
PEFT's measured step, each adapter paying ``m`` per target module and layer, HF's memory."""

from __future__ import annotations

import pytest
from cost_testlib import A100, QWEN7B, model

from plora.config import PROJECTIONS, LoRAConfig
from plora.cost.memory import adapter_memory
from plora.cost.memory_options import Loss, MemoryOptions
from plora.cost.priors import peft_prior
from plora.cost.throughput import Coefficients, LoRALayout

#: plora's coefficients as a user might pass them: the Tune model must not use them.
GIVEN = Coefficients(base_efficiency=0.5, lora_efficiency=0.2, overhead_per_layer_s=1e-4,
                     adapter_step_s=2e-3, module_step_s=0.0, source="given")  # fmt: skip

A100_PEAK = model().gpu.peak_flops


def cfg(targets: tuple[str, ...], batch: int = 4) -> LoRAConfig:
    return LoRAConfig(rank=16, alpha=32, lr=1e-4, batch_size=batch, max_steps=100,
                      target_modules=targets)  # fmt: skip


def reference_step(c: Coefficients, config: LoRAConfig, seq: int, layout: LoRALayout) -> float:
    """One config's seconds per step on one GPU, from the step-time formula term by term."""
    peak, tokens = A100_PEAK, config.batch_size * seq
    base = tokens * QWEN7B.train_flops_per_token(seq) / (peak * c.base_efficiency)
    lora = tokens * QWEN7B.lora_flops_per_token(config.rank, config.target_modules)
    modules = len(config.target_modules) * QWEN7B.num_layers * c.module_step_s
    own = modules if layout is LoRALayout.PER_ADAPTER else 0.0
    return base + lora / (peak * c.lora_efficiency) + c.adapter_step_s + own


@pytest.mark.parametrize("graphs", [False, True])
def test_tune_steps_at_peft_prior_whatever_plora_was_given(graphs: bool) -> None:
    cm = model(coefficients=GIVEN, cuda_graphs=graphs)
    peft = cm.for_peft()
    assert peft.coefficients == peft_prior(A100.gpu_type, QWEN7B)
    assert peft.eager_coefficients is None
    assert (peft.layout, peft.cuda_graphs) == (LoRALayout.PER_ADAPTER, False)
    assert cm.coefficients == GIVEN and cm.layout is LoRALayout.PACKED  # plora's rows unchanged
    assert peft.overheads == cm.overheads and peft.step_seq_len == cm.step_seq_len
    assert peft.startup_time(1) == cm.startup_time(1)
    for targets in (PROJECTIONS, ("q_proj", "v_proj")):
        k = cfg(targets)
        want = 100 * reference_step(peft.coefficients, k, 1024, LoRALayout.PER_ADAPTER)
        assert peft.config_step_time(k, 1) == pytest.approx(want, rel=1e-9)


def test_each_dropped_target_saves_m_per_layer_under_peft_only() -> None:
    cm = model(coefficients=GIVEN)
    peft = cm.for_peft()
    m, layers = peft.coefficients.module_step_s, QWEN7B.num_layers
    assert m > 0
    full, fewer = cfg(PROJECTIONS), cfg(PROJECTIONS[:4])

    def saved(c: Coefficients, cost) -> float:  # per step, less the dropped LoRA FLOPs
        flops = QWEN7B.lora_flops_per_token(16, PROJECTIONS) - QWEN7B.lora_flops_per_token(
            16, PROJECTIONS[:4]
        )
        lora = 4 * 1024 * flops / (A100_PEAK * c.lora_efficiency)
        return (cost.config_step_time(full, 1) - cost.config_step_time(fewer, 1)) / 100 - lora

    assert saved(peft.coefficients, peft) == pytest.approx(3 * layers * m, rel=1e-9)
    assert saved(GIVEN, cm) == pytest.approx(0.0, abs=1e-12)  # packed: m is the job's


def test_peft_memory_is_hf_unfused_kernels_and_loss() -> None:
    cm = model(memory=MemoryOptions(loss=Loss.FUSED, fused_kernels=True))
    peft = cm.for_peft()
    assert (peft.memory.loss, peft.memory.fused_kernels) == (Loss.EAGER, False)
    assert (cm.memory.loss, cm.memory.fused_kernels) == (Loss.FUSED, True)
    k = cfg(PROJECTIONS, batch=8)
    want = adapter_memory(QWEN7B, rank=16, targets=PROJECTIONS, batch_size=8, seq_len=1024,
                          d=1, strategy=None, options=MemoryOptions()).total  # fmt: skip
    assert peft.config_memory(k, 1) == pytest.approx(want, rel=1e-12)
    assert peft.pack_memory([k], 1) > cm.pack_memory([k], 1)
