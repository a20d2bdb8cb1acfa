"""The step-time coefficients a sweep plans with before it has measured anything, per GPU type.

Each prior comes from packed-engine measurements on one lent machine of that GPU type (the
commands and dates are beside the numbers). A sweep replaces it with the (model, GPU type)
profile store's fit after its first sweep, and with its own job's first steps while it runs
(:mod:`plora.cost.fit`); the prior is what the *first* plan on a new machine rests on.

* **H200** (and every GPU type without measurements of its own): derived from PEFT one
  adapter and the bare frozen base ×16 (stock HF and with Liger-Kernel), which fix the base's
  FLOP efficiency ``e_b`` and the per-layer overhead ``o``; ``m`` measured by removing targets
  from a PEFT adapter; ``a``, ``e_l`` and the communication efficiency assumed.
* **H200, from the step table** (issue 42; also every other non-H100 GPU type): plora's
  packed steps with Liger-Kernel, eager and graphed, and one PEFT adapter per trial, measured
  on one H200 at packs of 1-32 and batches of 1-32 with GSM8K-like and 1,024-token rows
  (``benchmarks/step_table.py``; the cells are ``plora/cost/measured/h200-steps.json``) and fitted
  here, at first use (:func:`measured_prior`): one set per base shape measured (Qwen2.5-7B and
  -3B), and one over both for every other shape. Eager steps overlap the host's launches with
  the GPU's work, which the additive model cannot say: its eager fit is the least-squares
  compromise (misses of 30-45 % on small eager packs, ``benchmarks/RESULTS.md``); one-GPU jobs
  plan with the graphed fit. Without Liger, the derivation below stands.
* **H100**: the lent H100's GPU is the H200's (same SMs and clocks; less HBM bandwidth, which
  the model charges separately), its host CPU is markedly slower: a packed step of a 3B base
  takes ~0.45 s up to 8 adapters (the launches of 36 layers' kernels, not the GPU, set it).
  So ``e_b``, ``e_l`` and the communication efficiency are the H200's and the overheads
  ``(o, a, m)`` are fitted, non-negative, to packed steps measured there.
* **H100 with CUDA graphs** (``training.cuda_graphs`` resolved on): replaying the steady step
  as a CUDA graph (:mod:`plora.engine.graphed`) takes most of the host's launches out of it.
  One graphed measurement (packed-16 with Liger) cannot fix three overheads, so the eager fit's
  ``(o, a, m)`` are scaled by one factor ``g`` that makes its step the measured graphed one
  (:func:`_graphed`); the end-to-end sweep's graphed step is the check (within 3 %). Without
  Liger the same ``g`` is an assumption (nothing graphed was measured without it).
  Other GPU types have no graphed measurement (the H200 host idled the GPU only ~5 % of an
  eager step): their prior is the same with graphs or without.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from importlib import resources
from typing import Any

import numpy as np

from plora.config import PROJECTIONS
from plora.config.hardware import GPU_TYPES
from plora.cost.leastsq import fit_pairs
from plora.cost.throughput import (
    AdapterLoad,
    Coefficients,
    LoRALayout,
    StepSample,
    StepTimeModel,
)
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


# --- H100 with CUDA graphs: the same pack eager and graphed -------------------------------
# `python3 benchmarks/engine_throughput.py --models Qwen/Qwen2.5-3B --packs 16 --steps 6
# --graphs both --liger on`, 2026-11-27, four runs on three lent H100 hosts (NVIDIA H100 80GB
# HBM3): 16 rank-16 adapters on all seven projections, batch 1, seq 1024, Liger on, bf16,
# tokens/s (the last pair on a host whose eager step was already GPU-bound).
H100_GRAPHED_TOK_S: dict[str, tuple[float, ...]] = {
    "eager": (27974.0, 28700.0, 27345.0, 30173.0),
    "graphed": (29965.0, 30021.0, 29662.0, 30617.0),
}
H100_GRAPHED_PACK = 16
# The check, not fitted: `benchmarks/e2e.py` default case, same day, two runs per mode: a
# Qwen2.5-1.5B shape, one job of 16 configs lr{1e-4,3e-4,1e-3,3e-3} x rank{8,16,32,64}, batch
# 4, rows ~600 tokens padded to 640 (max_seq_len 640), 2 micro-batches, all seven projections,
# dropout 0, Liger on: the steady step took 0.84-1.05 s eager (median ~0.95 s), 0.71-0.73 s
# graphed.
H100_E2E_STEP_S = {"eager": 0.95, "graphed": 0.72}


def _graphed(gpu_type: str, eager: Coefficients, liger: Coefficients, label: str) -> Coefficients:
    """``eager`` with its overheads ``(o, a, m)`` times the factor ``g`` that takes ``liger``
    (the eager Liger prior of ``gpu_type``) to the graphed packed-16 mean of
    :data:`H100_GRAPHED_TOK_S`: ``g = (t_graphed - t_gpu) / t_host``, with ``t_gpu`` the step's
    FLOP and weight-read time and ``t_host = L·o + 7·L·m + K·a`` as the Liger prior books them."""
    factor = graph_factor(gpu_type, liger)
    return dataclasses.replace(
        eager,
        overhead_per_layer_s=eager.overhead_per_layer_s * factor,
        adapter_step_s=eager.adapter_step_s * factor,
        module_step_s=eager.module_step_s * factor,
        source=f"{eager.source}, CUDA graphs: host overheads x{factor:.3f} ({label})",
    )


def graph_factor(gpu_type: str, liger: Coefficients) -> float:
    """The factor ``g`` on the host overheads of ``liger`` (see :func:`_graphed`)."""
    spec = ModelSpec.from_hf_config("Qwen/Qwen2.5-3B")
    s, k = H100_SEQ_LEN, H100_GRAPHED_PACK
    load = AdapterLoad(rank=H100_RANK, targets=tuple(PROJECTIONS), sequences=1)
    tok_s = float(np.mean(H100_GRAPHED_TOK_S["graphed"]))
    step_s = k * s / tok_s
    known, feats = StepTimeModel(spec, GPU_TYPES[gpu_type], liger).sample_terms(
        StepSample(adapters=(load,) * k, seq_len=s, step_time_s=step_s)
    )
    theta = liger._theta()
    host = float(feats[[0, 3, 4]] @ theta[[0, 3, 4]])
    gpu = known + float(feats[[1, 2, 5]] @ theta[[1, 2, 5]])
    return max(0.0, step_s - gpu) / host


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


# --- H200: the step table -------------------------------------------------------------------
#: The step table's cells, relative to this package: one row per (base, system, graphs, pack,
#: batch, rows) with its mean padded width and mean steady step time.
MEASURED_STEPS = "measured/h200-steps.json"


@functools.cache
def step_table() -> dict[str, Any]:
    """The committed step table (:data:`MEASURED_STEPS`): ``source``, ``rank``, ``cells``."""
    text = resources.files("plora.cost").joinpath(MEASURED_STEPS).read_text(encoding="utf-8")
    table: dict[str, Any] = json.loads(text)
    return table


def _shape(spec: ModelSpec) -> tuple[int, ...]:
    return (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads,
            spec.num_kv_heads, spec.head_dim, spec.vocab_size)  # fmt: skip


def table_samples(
    system: str, graphs: bool, spec: ModelSpec | None = None
) -> list[tuple[StepSample, ModelSpec]]:
    """The step table's cells of ``system`` (``plora`` | ``peft``) eager or graphed, as step
    samples with their base's shapes; only the cells of ``spec``'s shape when given."""
    table = step_table()
    out = []
    for c in table["cells"]:
        if c["system"] != system or c["graphs"] != graphs:
            continue
        cell = ModelSpec.from_hf_config(c["model"])
        if spec is not None and _shape(cell) != _shape(spec):
            continue
        load = AdapterLoad(rank=int(table["rank"]), targets=tuple(PROJECTIONS),
                           sequences=int(c["batch"]))  # fmt: skip
        sample = StepSample(adapters=(load,) * int(c["adapters"]), seq_len=int(c["width"]),
                            step_time_s=float(c["step_s"]))  # fmt: skip
        out.append((sample, cell))
    return out


#: Indices into the fitted ``θ = (o, 1/e_b, 1/e_l, a, m, 1/e_c)``.
_O, _EB, _EL, _A, _M = 0, 1, 2, 3, 4


@functools.cache
def measured_prior(system: str, graphs: bool, spec: ModelSpec | None = None) -> Coefficients:
    """The coefficients fitted to the step table's ``system`` cells (eager or graphed): those of
    ``spec``'s shape where it was measured, else every shape's.

    * ``plora``, graphed (Liger on the base, packed layout): ``o``, ``e_b`` and ``a``; ``m`` is
      0 (its ``7·L·m`` is ``L·o`` again in the packed layout) and ``e_l`` the assumed 0.3
      (rank-16 LoRA FLOPs are ~1 % of a step's: the table cannot tell ``e_l``).
    * ``plora``, eager: the graphed fit's GPU part (``e_b``, ``e_l``) with the host overheads
      ``(o, a, m)`` refitted: an eager step is the graphed step's GPU work plus the host's
      launches that it does not hide.
    * ``peft`` (the stock HF base, one adapter's own modules, ``m`` per target and layer at the
      measured :data:`H200_MEASURED` value): ``o``, ``e_b`` and ``a``.
    """
    pairs = table_samples(system, graphs, spec)
    shapes = f"{spec.name}'s shape" if spec is not None and pairs else "every measured shape"
    if not pairs:
        pairs = table_samples(system, graphs)
    peft = system == "peft"
    layout = LoRALayout.PER_ADAPTER if peft else LoRALayout.PACKED
    if peft:
        start, free = DEFAULT_COEFFICIENTS, (_O, _EB, _A)
    elif graphs:
        start, free = dataclasses.replace(LIGER_COEFFICIENTS, module_step_s=0.0), (_O, _EB, _A)
    else:
        start, free = measured_prior("plora", True, spec), (_O, _A, _M)
    gpu = GPU_TYPES["H200"]
    label = "PEFT, stock HF" if peft else f"plora with Liger, {'graphed' if graphs else 'eager'}"
    return fit_pairs(
        [(s, StepTimeModel(sp, gpu, start, layout=layout)) for s, sp in pairs],
        start,
        fallback=DEFAULT_COEFFICIENTS,
        free=free,
        source=f"H200 step table, {label}: fit of {len(pairs)} cells of {shapes}",
    )


def peft_prior(gpu_type: str, spec: ModelSpec | None = None) -> Coefficients:
    """What one PEFT adapter's step costs (a Ray Tune trial as users run it: stock HF base,
    eager), with :attr:`~plora.cost.throughput.LoRALayout.PER_ADAPTER`: the step table's fit on
    every GPU type (no PEFT step was measured elsewhere; the efficiencies are fractions of each
    type's own peak)."""
    del gpu_type  # one measured type
    return measured_prior("peft", False, spec)


@functools.cache
def step_prior(
    gpu_type: str, fused_kernels: bool, cuda_graphs: bool = False, spec: ModelSpec | None = None
) -> Coefficients:
    """The step-time coefficients to plan ``gpu_type`` with before any measurement.

    Args:
        gpu_type: H100 types (``H100``, ``H100-80GB``) have their own; every other type, the
            CPU included, starts from the H200's.
        fused_kernels: Liger-Kernel's ops on the base.
        cuda_graphs: the steady step is replayed as a CUDA graph (one-GPU jobs,
            :func:`plora.cost.build.plan_cuda_graphs`). H100 types: the eager prior's host
            overheads scaled by :func:`graph_factor` (measured with Liger; without Liger the
            same factor, assumed). Other types with Liger: the step table's graphed fit
            (:func:`measured_prior`); without Liger: unchanged (nothing measured).
        spec: the base's shapes: with Liger on a non-H100 type, the step table's fit of that
            shape when it was measured (else of every measured shape).
    """
    base = LIGER_COEFFICIENTS if fused_kernels else DEFAULT_COEFFICIENTS
    if not str(gpu_type).upper().startswith("H100"):
        return measured_prior("plora", cuda_graphs, spec) if fused_kernels else base
    label = "liger" if fused_kernels else "hf"
    eager = _host_overheads("H100", base, H100_PACKED_TOK_S[label], label)
    if not cuda_graphs:
        return eager
    if fused_kernels:
        return _graphed("H100", eager, eager, "measured with Liger")
    liger = step_prior(gpu_type, True)
    return _graphed("H100", eager, liger, "Liger's factor, assumed without Liger")


__all__ = [
    "DEFAULT_COEFFICIENTS",
    "H100_E2E_STEP_S",
    "H100_GRAPHED_PACK",
    "H100_GRAPHED_TOK_S",
    "H100_PACKED_TOK_S",
    "H200_MEASURED",
    "LIGER_COEFFICIENTS",
    "MEASURED_STEPS",
    "graph_factor",
    "measured_prior",
    "peft_prior",
    "step_prior",
    "step_table",
    "table_samples",
]
