"""The step-time coefficients a sweep plans with before it has measured anything, per GPU type.

Each prior comes from packed-engine measurements on one lent machine of that GPU type (the
commands and dates are beside the numbers). A sweep replaces it with the (model, GPU type)
profile store's fit after its first sweep, and with its own job's first steps while it runs
(:mod:`plora.cost.fit`); the prior is what the *first* plan on a new machine rests on.

* **H200** (and every GPU type without measurements of its own): derived from PEFT one
  adapter and the bare frozen base ×16 (stock HF and with Liger-Kernel), which fix the base's
  FLOP efficiency ``e_b`` and the per-layer overhead ``o``; ``m`` measured by removing targets
  from a PEFT adapter; ``a``, ``e_l`` and the communication efficiency assumed.
* **H100**: the lent H100's GPU is the H200's (same SMs and clocks; less HBM bandwidth, which
  the model charges separately), its host CPU is markedly slower: a packed step of a 3B base
  takes ~0.45 s up to 8 adapters (the launches of 36 layers' kernels, not the GPU, set it).
  So ``e_b``, ``e_l`` and the communication efficiency are the H200's and the overheads
  ``(o, a, m)`` are fitted, non-negative, to packed steps measured there.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from plora.config import PROJECTIONS
from plora.config.hardware import GPU_TYPES
from plora.cost.throughput import AdapterLoad, Coefficients, StepSample, StepTimeModel
from plora.model_spec import ModelSpec

# --- Defaults from H200 measurements -------------------------------------------------------
# Measured on an H200, bf16, seq 1024, Qwen2.5-3B shape (random weights):
#   PEFT, one adapter (all 7 projections), batch 1 .... 8.3k tok/s
#   HF frozen base, 16 sequences, no adapter .......... 30.7k tok/s
#   the same with Liger-Kernel ........................ 42.0k tok/s
#   FLOP ceiling: measured peak bf16 GEMM (~780 TFLOP/s) / (4·P_mm + 6·s·h·L) = 61k tok/s.
# The PEFT and HF points fix e_b and the per-layer overhead o, given m and a. m was measured
# on an H200 too (PEFT 0.17 / transformers 5.17 / torch 2.11, random weights, see
# tests/unit/test_cost_throughput.py): removing targeted projections from one PEFT adapter saves
# 0.29 ms (1.5B, bs 4), 0.32 ms (3B, bs 4) and 0.29 ms (3B, bs 1) per projection and layer per
# step. a, e_l and the communication efficiency are assumptions, refit from a job's first steps.
H200_MEASURED = {
    "seq_len": 1024,
    "peft_one_adapter_tok_s": 8.3e3,
    "hf_base_x16_tok_s": 30.7e3,
    "liger_base_x16_tok_s": 42.0e3,
    "peft_module_step_s": 3.0e-4,
}
_ASSUMED_ADAPTER_STEP_S = 2e-3
_ASSUMED_LORA_EFFICIENCY = 0.3


def _derive_h200(base_x16_tok_s: float, label: str) -> Coefficients:
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-3B")
    gpu, s = GPU_TYPES["H200"], H200_MEASURED["seq_len"]
    m = H200_MEASURED["peft_module_step_s"]
    per_tok = spec.train_flops_per_token(int(s)) / gpu.peak_flops  # seconds/token at 100% of peak
    lora = (
        s * spec.lora_flops_per_token(16, PROJECTIONS) / (gpu.peak_flops * _ASSUMED_LORA_EFFICIENCY)
    )
    weights = 2.0 * 2.0 * spec.total_params / (gpu.hbm_gbps * 1e9)  # bf16, read fwd + bwd
    adapter = _ASSUMED_ADAPTER_STEP_S + m * len(PROJECTIONS) * spec.num_layers + lora
    t_one = s / H200_MEASURED["peft_one_adapter_tok_s"]  # 1 adapter (rank 16 assumed), 1 sequence
    t_hf = 16 * s / H200_MEASURED["hf_base_x16_tok_s"]  # 0 adapters, 16 sequences
    eff = 15 * s * per_tok / (t_hf - t_one + adapter)
    overhead = t_hf - 16 * s * per_tok / eff - weights
    if label != "hf":  # same overhead, faster kernels
        eff = 16 * s * per_tok / (16 * s / base_x16_tok_s - overhead - weights)
    return Coefficients(
        base_efficiency=eff,
        lora_efficiency=_ASSUMED_LORA_EFFICIENCY,
        overhead_per_layer_s=overhead / spec.num_layers,
        adapter_step_s=_ASSUMED_ADAPTER_STEP_S,
        module_step_s=m,
        comm_efficiency=0.7,
        source=f"H200 measurements, Qwen2.5-3B shape, seq 1024 ({label})",
    )


#: Defaults: HF eager kernels (the PEFT and bare-HF H200 measurements above).
DEFAULT_COEFFICIENTS = _derive_h200(H200_MEASURED["hf_base_x16_tok_s"], "hf")
#: With Liger-Kernel's fused RMSNorm/SwiGLU/RoPE on the base (plora's own loss): the prior of a
#: sweep whose ``training.fused_kernels`` resolves on (:func:`plora.cost.build.plan_fused_kernels`).
LIGER_COEFFICIENTS = _derive_h200(H200_MEASURED["liger_base_x16_tok_s"], "liger")


# --- H100: packed steps on the lent H100 (slow host) ---------------------------------------
# `python3 benchmarks/engine_throughput.py --models Qwen/Qwen2.5-3B --packs 1 8 16 32 --steps 4`,
# NVIDIA H100 80GB HBM3, 2026-11-25 10:47 UTC: packed-K = K rank-16 adapters on all seven
# projections, batch 1, seq 1024, bf16, tokens/s without activation checkpointing (the
# 32-adapter rows needed it and are left out).
H100_SEQ_LEN, H100_RANK = 1024, 16
H100_PACKED_TOK_S: dict[str, dict[int, float]] = {
    "liger": {1: 2269.0, 8: 17950.0, 16: 28648.0},
    "hf": {1: 2491.0, 8: 16069.0},
}


def _host_overheads(
    gpu_type: str, base: Coefficients, packed_tok_s: dict[int, float], label: str
) -> Coefficients:
    """``base`` with the overheads ``(o, a, m)`` refitted to packed steps measured on
    ``gpu_type`` (least squares on relative error, every overhead >= 0)."""
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-3B")
    s = H100_SEQ_LEN
    load = AdapterLoad(rank=H100_RANK, targets=tuple(PROJECTIONS), sequences=1)
    timer = StepTimeModel(spec, GPU_TYPES[gpu_type], base)
    theta = base._theta()
    rows, rhs = [], []
    for k, tok_s in sorted(packed_tok_s.items()):
        step_s = k * s / tok_s
        known, feats = timer.sample_terms(
            StepSample(adapters=(load,) * k, seq_len=s, step_time_s=step_s)
        )
        given = known + feats[[1, 2, 5]] @ theta[[1, 2, 5]]  # the GPU's part, kept
        rows.append(feats[[0, 3, 4]] / step_s)
        rhs.append((step_s - given) / step_s)
    o, a, m = _nonnegative_lstsq(np.array(rows), np.array(rhs))
    return Coefficients(
        base_efficiency=base.base_efficiency,
        lora_efficiency=base.lora_efficiency,
        overhead_per_layer_s=o,
        adapter_step_s=a,
        module_step_s=m,
        comm_efficiency=base.comm_efficiency,
        source=f"{gpu_type} measurements, Qwen2.5-3B shape, seq 1024 ({label})",
    )


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> tuple[float, ...]:
    """``argmin |a·x - b|`` over ``x >= 0`` for a few unknowns (every active set tried)."""
    n = a.shape[1]
    best, best_x = np.inf, np.zeros(n)
    for free in itertools.chain.from_iterable(
        itertools.combinations(range(n), r) for r in range(1, n + 1)
    ):
        cols = list(free)
        sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (sol < 0).any():
            continue
        x = np.zeros(n)
        x[cols] = sol
        err = float(np.sum((a @ x - b) ** 2))
        if err < best:
            best, best_x = err, x
    return tuple(float(v) for v in best_x)


@functools.cache
def step_prior(gpu_type: str, fused_kernels: bool) -> Coefficients:
    """The step-time coefficients to plan ``gpu_type`` with before any measurement
    (``fused_kernels``: Liger-Kernel's ops on the base). H100 types (``H100``, ``H100-80GB``)
    have their own; every other type, the CPU included, starts from the H200's."""
    base = LIGER_COEFFICIENTS if fused_kernels else DEFAULT_COEFFICIENTS
    if str(gpu_type).upper().startswith("H100"):
        label = "liger" if fused_kernels else "hf"
        return _host_overheads("H100", base, H100_PACKED_TOK_S[label], label)
    return base


__all__ = [
    "DEFAULT_COEFFICIENTS",
    "H100_PACKED_TOK_S",
    "H200_MEASURED",
    "LIGER_COEFFICIENTS",
    "step_prior",
]
