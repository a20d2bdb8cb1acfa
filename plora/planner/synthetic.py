"""A synthetic affine :class:`~plora.cost.CostModel` for tests, benchmarks and examples.

Not a model of any real GPU: it has the *shape* the planner relies on (memory additive per
adapter, job time affine in the pack for a fixed longest config) with Qwen2.5-7B-on-H200-like
default magnitudes, and lets tests set random per-config memory and time.

Per config k with rank r, batch b, targets t (of 7), steps n, on d GPUs with strategy s::

    M_base(d)   = weights / d + base_act
    M_k(d)      = (r · t/7 · adapter_per_rank + b · seq · act_per_token) / d
    c_k(d, s)   = n · b · seq · (sec_per_token + r · t/7 · sec_per_token_rank) / (d · eff_s^log2 d)
    fixed(n, d) = job_start + n · step_overhead · (1 + comm · log2 d)
    work_k      = c_k(1)          (a true lower bound: d · c_k(d) >= c_k(1) since eff <= 1)
    startup(d)  = startup_s       (a cold worker group; 0 by default)

``per_config`` overrides ``(M_k(1), c_k(1))`` per config id (random instances in tests).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from plora.config import LoRAConfig
from plora.cost import Strategy

GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class AffineCostModel:
    """Synthetic cost model (see module docstring); all fields have 7B-on-H200-like defaults."""

    capacity_bytes: float = 0.9 * 141 * GIB
    """``C · M_gpu``."""
    weights_bytes: float = 15.2e9
    """Frozen base weights (bf16), sharded over d."""
    base_act_bytes: float = 2e9
    """Per-GPU base overhead that does not shard (workspace, logits buffer)."""
    adapter_bytes_per_rank: float = 2.52e6 * 16
    """Adapter params + grads + AdamW state per unit rank with all 7 projections (fp32)."""
    act_bytes_per_token: float = 3.2e6 / 8
    """Activation bytes per token an adapter's rows add (with activation checkpointing)."""
    seq_len: int = 1024
    dataset_size: int = 2000
    """Examples per epoch (configs given in epochs)."""
    sec_per_token: float = 6e-5
    """Frozen-base forward+backward seconds per token on one GPU."""
    sec_per_token_rank: float = 2e-8
    """LoRA seconds per token per unit rank (all 7 projections)."""
    step_overhead_s: float = 0.05
    """Per-step seconds a job pays regardless of its tokens (weights read, launches)."""
    comm: float = 0.1
    """Extra per-step overhead per doubling of d."""
    job_start_s: float = 0.0
    """Per-job seconds on a warm worker group (trainer set-up)."""
    startup_s: float = 0.0
    """Seconds a cold worker group needs before its first job (worker start + model load)."""
    efficiency: Mapping[Strategy, float] = field(
        default_factory=lambda: {Strategy.TP: 0.85, Strategy.FSDP: 0.9, Strategy.PP: 0.8}
    )
    """Compute efficiency per doubling of d, per strategy."""
    allowed: tuple[Strategy, ...] = (Strategy.TP, Strategy.FSDP)
    """What :meth:`strategies` returns (empty: only d = 1)."""
    per_config: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Optional ``config_id -> (M_k(1) bytes, c_k(1) seconds)`` overrides."""

    def strategies(self) -> Sequence[Strategy]:
        return self.allowed

    def steps(self, config: LoRAConfig) -> int:
        if config.max_steps is not None:
            return config.max_steps
        epochs = float(config.epochs or 0.0)  # LoRAConfig: exactly one of max_steps, epochs
        return max(1, math.ceil(epochs * self.dataset_size / config.batch_size))

    def price_key(self, config: LoRAConfig) -> Hashable:
        """Configs of equal keys are priced alike (an overridden config: on its own, None)."""
        if config.config_id in self.per_config:
            return None
        return (config.rank, len(config.target_modules), config.batch_size, self.steps(config))

    def _eff(self, d: int, strategy: Strategy) -> float:
        return self.efficiency[strategy] ** math.log2(d) if d > 1 else 1.0

    def capacity(self, d: int) -> float:
        return self.capacity_bytes

    def base_memory(self, d: int, strategy: Strategy) -> float:
        return self.weights_bytes / d + self.base_act_bytes

    def _mem1(self, config: LoRAConfig) -> float:
        if config.config_id in self.per_config:
            return self.per_config[config.config_id][0]
        frac = len(config.target_modules) / 7
        return (
            config.rank * frac * self.adapter_bytes_per_rank
            + config.batch_size * self.seq_len * self.act_bytes_per_token
        )

    def _time1(self, config: LoRAConfig) -> float:
        if config.config_id in self.per_config:
            return self.per_config[config.config_id][1]
        frac = len(config.target_modules) / 7
        tokens = self.steps(config) * config.batch_size * self.seq_len
        return tokens * (self.sec_per_token + config.rank * frac * self.sec_per_token_rank)

    def config_memory(self, config: LoRAConfig, d: int, strategy: Strategy) -> float:
        return self._mem1(config) / d

    def config_time(self, config: LoRAConfig, d: int, strategy: Strategy) -> float:
        return self._time1(config) / (d * self._eff(d, strategy))

    def fixed_time(self, steps: int, d: int, strategy: Strategy) -> float:
        return self.job_start_s + steps * self.step_overhead_s * (1 + self.comm * math.log2(d))

    def startup_time(self, d: int) -> float:
        return self.startup_s

    def job_time(self, pack: Sequence[LoRAConfig], d: int, strategy: Strategy) -> float:
        longest = max(self.steps(k) for k in pack)
        return self.fixed_time(longest, d, strategy) + sum(
            self.config_time(k, d, strategy) for k in pack
        )

    def config_work(self, config: LoRAConfig) -> float:
        return self._time1(config)


__all__ = ["AffineCostModel"]
