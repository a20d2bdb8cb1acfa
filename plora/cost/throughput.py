"""Step time of a packed job from FLOPs and bytes, with coefficients fitted from measured steps.

One optimizer step of a job ``(pack, d, strategy)`` costs (all terms per GPU):

``t_step = L·o + 7·L·m + 2·W/(d·B_hbm) + c_fixed(d) + Σ_k [a + n_k·(F_base/(e_b·P·d) + F_lora,k/(e_l·P·d) + c_tok(d))]``

* ``n_k = b_k·s`` tokens of config k, ``F_base`` = frozen-base training FLOPs per token
  (:meth:`ModelSpec.train_flops_per_token`), ``F_lora,k`` its LoRA FLOPs per token;
* ``P`` the GPU's datasheet dense bf16 peak, ``e_b``/``e_l`` the fitted fractions of it;
* ``L·o`` the per-step launch/framework overhead (``o`` per layer), ``a`` per adapter and step
  (its optimizer step, its segment bookkeeping), ``m`` per LoRA-wrapped projection and layer
  (launches): plora's packed layers pay it once per job for all seven projections
  (``7·L·m`` in ``c_fixed``), PEFT per adapter for its ``T_k`` targets (:class:`LoRALayout`),
  ``2·W/(d·B_hbm)`` reading the frozen weights in forward and backward;
* communication, in bytes from :mod:`plora.cost.parallel` (what ``plora.parallel`` sends):
  tensor parallel all-reduces ``4·L·h`` activations per token (2 forward, 2 backward) with
  ring factor ``2(d-1)/d``, and each adapter's partial factor gradients (fp32, half its
  parameters) once per step; FSDP all-gathers the base weights twice per step (fixed) and
  all-reduces each adapter's fp32 gradients (adapters are replicated); pipeline parallel sends
  ``2·h`` values per token forward and back from a middle stage and idles the 1F1B bubble
  ``(P-1)/(M+P-1)`` of 2 micro-batches per stage (``M = 2P``: ``(d-1)/(2d)`` more time).
  Bandwidth is the GPU link's, times the fitted ``comm_efficiency``.
* ``fsdp_offload`` adds, as known seconds in ``c_fixed``, each GPU's copies of its shard of the
  base in from host memory, forward and backward: ``2·W/(d·B_host)`` with ``B_host`` the
  assumed :data:`~plora.cost.parallel.HOST_LINK_GBPS` (:func:`~plora.cost.parallel.host_copy_bytes`).

The sum over configs makes the step affine in the pack, so a job's time is
``steps_max·t_fixed + Σ_k steps_k·t_k``: exactly what the planner's ILP assumes.

:func:`plora.cost.fit.fit` refits ``(o, 1/e_b, 1/e_l, a, m, 1/comm_efficiency)`` from measured
steps; the coefficients a sweep starts from before anything is measured are
:func:`plora.cost.priors.step_prior`'s (measured per GPU type).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from plora.config import FSDP_STRATEGIES, PROJECTIONS, ConfigError, LoRAConfig
from plora.config.hardware import GPU_TYPES, GPUSpec, gpu_spec
from plora.cost import Strategy
from plora.cost.memory import check_parallel
from plora.cost.parallel import (
    HOST_LINK_GBPS,
    fsdp_bytes,
    host_copy_bytes,
    pp_bubble_fraction,
    pp_bytes,
    tp_bytes,
)
from plora.model_spec import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Coefficients:
    """Fitted constants of the step-time model (see the module docstring)."""

    base_efficiency: float
    """e_b: fraction of peak FLOP/s the frozen base's FLOPs run at."""
    lora_efficiency: float
    """e_l: fraction of peak the LoRA FLOPs run at (small GEMMs: lower)."""
    overhead_per_layer_s: float
    """o: per-step overhead per decoder layer (launches, framework), seconds."""
    adapter_step_s: float
    """a: per-adapter per-step overhead (its optimizer step, bookkeeping), seconds."""
    module_step_s: float = 3e-4
    """m: per-adapter per-step overhead of each targeted projection in each layer (launches of
    unfused LoRA matmuls, dropout, per-tensor optimizer work), seconds."""
    comm_efficiency: float = 0.7
    """Fraction of link bandwidth collectives reach."""
    source: str = ""
    """Where the numbers come from (measurement label or 'fit of N samples')."""

    def __post_init__(self) -> None:
        for name in ("base_efficiency", "lora_efficiency", "comm_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ConfigError(f"coefficients: {name}={v!r} must be in (0, 1]")
        if min(self.overhead_per_layer_s, self.adapter_step_s, self.module_step_s) < 0:
            raise ConfigError("coefficients: overheads must be >= 0")

    def to_dict(self) -> dict[str, float | str]:
        """JSON-able dict (inverse: ``Coefficients(**d)``)."""
        return asdict(self)

    def _theta(self) -> np.ndarray:
        return np.array(
            [
                self.overhead_per_layer_s,
                1.0 / self.base_efficiency,
                1.0 / self.lora_efficiency,
                self.adapter_step_s,
                self.module_step_s,
                1.0 / self.comm_efficiency,
            ]
        )

    @classmethod
    def _from_theta(cls, theta: np.ndarray, source: str) -> Coefficients:
        o, ib, il, a, m, ic = (float(x) for x in theta)
        return cls(
            overhead_per_layer_s=max(o, 0.0),
            base_efficiency=1.0 / max(ib, 1.0),
            lora_efficiency=1.0 / max(il, 1.0),
            adapter_step_s=max(a, 0.0),
            module_step_s=max(m, 0.0),
            comm_efficiency=1.0 / max(ic, 1.0),
            source=source,
        )


# --- The model -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class AdapterLoad:
    """What one config brings to each step: its rank, targets and sequences."""

    rank: int
    targets: tuple[str, ...]
    sequences: int
    """Sequences per step (the config's batch size)."""
    dropout: float = 0.0
    """LoRA dropout (memory only: its input copy)."""

    @classmethod
    def of(cls, config: LoRAConfig) -> AdapterLoad:
        """The load of a :class:`LoRAConfig`."""
        return cls(
            rank=config.rank,
            targets=config.target_modules,
            sequences=config.batch_size,
            dropout=config.dropout,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSample:
    """One measured optimizer step of a job (what profiles store and :func:`fit` consumes)."""

    adapters: tuple[AdapterLoad, ...]
    seq_len: int
    """Padded sequence length of the step's rows."""
    d: int = 1
    strategy: Strategy | None = None
    step_time_s: float
    peak_memory_bytes: float | None = None
    """``torch.cuda.max_memory_allocated`` over the step, if measured."""
    sweep: int = 0
    """The profile store's number of the sweep that measured it (1, 2, ... in the order they
    were recorded; 0: not recorded yet, or from a file written before sweeps were numbered)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", check_parallel(self.d, self.strategy))
        object.__setattr__(self, "adapters", tuple(self.adapters))
        if not self.step_time_s > 0:
            raise ConfigError(f"step sample: step_time_s={self.step_time_s!r} must be > 0")
        if not (isinstance(self.sweep, int) and self.sweep >= 0):
            raise ConfigError(f"step sample: sweep={self.sweep!r} must be an integer >= 0")

    @classmethod
    def from_configs(
        cls,
        configs: Sequence[LoRAConfig],
        *,
        seq_len: int,
        step_time_s: float,
        d: int = 1,
        strategy: Strategy | None = None,
        peak_memory_bytes: float | None = None,
    ) -> StepSample:
        """A sample for a step in which ``configs`` were active."""
        return cls(
            adapters=tuple(AdapterLoad.of(c) for c in configs),
            seq_len=seq_len,
            d=d,
            strategy=strategy,
            step_time_s=step_time_s,
            peak_memory_bytes=peak_memory_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (inverse: :meth:`from_dict`)."""
        return {
            "adapters": [
                {
                    "rank": a.rank,
                    "targets": list(a.targets),
                    "sequences": a.sequences,
                    "dropout": a.dropout,
                }
                for a in self.adapters
            ],
            "seq_len": self.seq_len,
            "d": self.d,
            "strategy": None if self.strategy is None else str(self.strategy),
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "sweep": self.sweep,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepSample:
        """Inverse of :meth:`to_dict`."""
        adapters = tuple(
            AdapterLoad(
                rank=int(a["rank"]), targets=tuple(a["targets"]), sequences=int(a["sequences"])
            )
            for a in data["adapters"]
        )
        strat = data.get("strategy")
        return cls(
            adapters=adapters,
            seq_len=int(data["seq_len"]),
            d=int(data.get("d", 1)),
            strategy=None if strat is None else Strategy(strat),
            step_time_s=float(data["step_time_s"]),
            peak_memory_bytes=data.get("peak_memory_bytes"),
            sweep=int(data.get("sweep", 0)),
        )


class LoRALayout(StrEnum):
    """Who pays the per-projection launch cost ``m``."""

    PACKED = "packed"
    """plora's engine: one packed LoRA layer per wrapped projection (all seven, every layer)
    serves every adapter: ``7·L·m`` per step, in the job's fixed part."""
    PER_ADAPTER = "per_adapter"
    """PEFT: each adapter has its own LoRA modules: ``T_k·L·m`` per adapter per step."""


class StepTimeModel:
    """``t_step`` split into the job's fixed part and each config's part (see module doc).

    Args:
        spec: model shapes.
        gpu: GPU speeds.
        coefficients: the fitted constants.
        weight_bytes: bytes of the frozen weights (default bf16: 2·params).
        layout: where the per-projection cost ``m`` is paid (:class:`LoRALayout`).
        recompute: activation checkpointing: every token pays one more forward of the base
            (``2·P_mm + A_fwd``) and of its LoRA (``2r(in+out)``).
        dequant_bytes: a quantized base (QLoRA): bytes of dense weights each pass writes and
            reads to dequantize (``projection params · Precision.dequant_bytes``), paid forward
            and backward like the weight reads, in the job's fixed part.
    """

    def __init__(
        self,
        spec: ModelSpec,
        gpu: GPUSpec,
        coefficients: Coefficients,
        *,
        weight_bytes: float | None = None,
        layout: LoRALayout = LoRALayout.PACKED,
        recompute: bool = False,
        dequant_bytes: float = 0.0,
    ) -> None:
        self.spec, self.gpu, self.coefficients = spec, gpu, coefficients
        self.layout = LoRALayout(layout)
        self.recompute = recompute
        self._weight_bytes = 2.0 * spec.total_params if weight_bytes is None else weight_bytes
        self._dequant_bytes = float(dequant_bytes)

    # Each part returns its terms as a feature vector over theta (o, 1/e_b, 1/e_l, a, m, 1/e_c)
    # plus a known time; time = known + features · theta.
    def _fixed_terms(self, d: int, strategy: Strategy | None) -> tuple[float, np.ndarray]:
        strat = check_parallel(d, strategy)
        link = self.gpu.link_gbps * 1e9
        reads = self._weight_bytes / (1 if strat in FSDP_STRATEGIES else d)
        reads += self._dequant_bytes / d  # FSDP: each GPU dequantizes its 1/d after the gather
        known = 2.0 * reads / (self.gpu.hbm_gbps * 1e9)
        comm = 0.0
        if strat in FSDP_STRATEGIES:  # the base's all-gathers: forward and again in backward
            comm = fsdp_bytes(base_bytes=self._weight_bytes, lora_params=0.0, fsdp=d) / link
        if strat is Strategy.FSDP_OFFLOAD:  # each GPU's shard in from the host before them
            copied = host_copy_bytes(base_bytes=self._weight_bytes, fsdp=d)
            known += copied / (HOST_LINK_GBPS * 1e9)
        modules = len(PROJECTIONS) * self.spec.num_layers if self.layout is LoRALayout.PACKED else 0
        return known, np.array([self.spec.num_layers, 0.0, 0.0, 0.0, modules, comm])

    def _adapter_terms(
        self, load: AdapterLoad, seq_len: int, d: int, strategy: Strategy | None
    ) -> tuple[float, np.ndarray]:
        known, feats = _adapter_terms(
            self.spec, self.gpu, self.recompute, self.layout, load, seq_len, d, strategy
        )
        return known, np.array(feats)

    def fixed_step_time(self, d: int = 1, strategy: Strategy | None = None) -> float:
        """Seconds per step that do not depend on the pack."""
        known, feats = self._fixed_terms(d, strategy)
        return known + float(feats @ self.coefficients._theta())

    def adapter_step_time(
        self, load: AdapterLoad, seq_len: int, d: int = 1, strategy: Strategy | None = None
    ) -> float:
        """Seconds one config adds to each step it is active in."""
        known, feats = self._adapter_terms(load, seq_len, d, strategy)
        return known + float(feats @ self.coefficients._theta())

    def step_time(
        self,
        loads: Sequence[AdapterLoad],
        seq_len: int,
        d: int = 1,
        strategy: Strategy | None = None,
    ) -> float:
        """Seconds of one step with ``loads`` active."""
        return self.fixed_step_time(d, strategy) + sum(
            self.adapter_step_time(x, seq_len, d, strategy) for x in loads
        )

    def sample_terms(self, sample: StepSample) -> tuple[float, np.ndarray]:
        """(known seconds, feature row) of a measured step."""
        known, feats = self._fixed_terms(sample.d, sample.strategy)
        for load in sample.adapters:
            k, f = self._adapter_terms(load, sample.seq_len, sample.d, sample.strategy)
            known, feats = known + k, feats + f
        return known, feats


@functools.lru_cache(maxsize=4096)
def _adapter_terms(
    spec: ModelSpec,
    gpu: GPUSpec,
    recompute: bool,
    layout: LoRALayout,
    load: AdapterLoad,
    seq_len: int,
    d: int,
    strategy: Strategy | None,
) -> tuple[float, tuple[float, ...]]:
    """What one config adds to a step, as (known seconds, features over theta): a function of
    the model, the GPU and the load alone, so it is computed once per distinct load. A refit
    evaluates every measured step's terms many times (10,000-config sweeps measure thousands
    of steps and refit at each job's end: ``benchmarks/control_plane.py``)."""
    strat = check_parallel(d, strategy)
    peak, link = gpu.peak_flops, gpu.link_gbps * 1e9
    tokens = float(load.sequences * seq_len)
    # 1F1B over d stages with 2 micro-batches per stage: the bubble stretches the step
    slow = 1.0 / (1.0 - pp_bubble_fraction(d, 2 * d)) if strat is Strategy.PP else 1.0
    base_flops = spec.train_flops_per_token(seq_len)
    lora_flops = spec.lora_flops_per_token(load.rank, load.targets)
    if recompute:
        base_flops += spec.forward_flops_per_token(seq_len)
        lora_flops *= 8.0 / 6.0
    base = tokens * base_flops / (peak * d) * slow
    lora = tokens * lora_flops / (peak * d) * slow
    comm = 0.0
    lora_params = float(spec.lora_params(load.rank, load.targets))
    if strat is Strategy.TP:  # colwise A and rowwise B are replicated: half the factors
        sent = tp_bytes(tokens=tokens, layers=spec.num_layers, hidden=spec.hidden_size,
                        tp=d, replicated_lora_params=lora_params / 2)  # fmt: skip
        comm = sent / link
    elif strat in FSDP_STRATEGIES:
        sent = fsdp_bytes(base_bytes=0.0, lora_params=lora_params, fsdp=d, shard_base=False)
        comm = sent / link
    elif strat is Strategy.PP:
        comm = pp_bytes(tokens=tokens, hidden=spec.hidden_size, stages=d) / link
    modules = 0.0
    if layout is LoRALayout.PER_ADAPTER:
        modules = len(load.targets) * spec.num_layers
    return 0.0, (0.0, base, lora, 1.0, float(modules), comm)


__all__ = [
    "GPU_TYPES",
    "AdapterLoad",
    "Coefficients",
    "GPUSpec",
    "LoRALayout",
    "StepSample",
    "StepTimeModel",
    "gpu_spec",
]
