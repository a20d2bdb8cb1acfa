"""The memory side of :class:`plora.cost.model.SweepCostModel`: what fits on a GPU.

:class:`SweepMemory` answers, per GPU and cached by the config's shape, the planner's memory
questions from the App. A formulas of :mod:`plora.cost.memory`::

    pack_memory(pack, d, s) = base_memory(d, s) + Σ_k config_memory(k, d, s) <= capacity(d)

and, for a pack that does not fit with every row live, the micro-batched memory of
:mod:`plora.cost.microbatch` (``config_memory_parts``, ``micro_batches_to_fit``). It also
validates ``(d, strategy)`` for every answer of the model (:meth:`SweepMemory._key`).

A mixin: :class:`~plora.cost.model.SweepCostModel` sets the attributes declared below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

from plora.config import ConfigError, LoRAConfig
from plora.cost import Strategy, memory_limit
from plora.cost.memory import adapter_memory, base_memory, check_parallel
from plora.cost.memory_options import MemoryBreakdown, MemoryOptions
from plora.cost.microbatch import (
    check_micro_batches,
    micro_batched_memory,
    smallest_micro_batches,
    state_and_row_activation,
)
from plora.model_spec import ModelSpec


class SweepMemory:
    """Per-GPU memory answers of a sweep's cost model (mixed into ``SweepCostModel``)."""

    spec: ModelSpec
    seq_len: int
    memory: MemoryOptions
    _strategies: tuple[Strategy, ...]
    _capacity: float
    """``C·M_gpu`` bytes."""
    _cache: dict[tuple[object, ...], Any]
    """Answers by shape and ``(d, strategy)``; emptied whenever what they depend on changes."""

    # ------------------------------------------------------------ validation
    def _key(self, d: int, strategy: Strategy | None) -> Strategy | None:
        strat = check_parallel(d, strategy)
        if strat is not None and strat not in self._strategies:
            supported = ", ".join(self._strategies) or "none (only d = 1)"
            raise ConfigError(
                f"d={d} with strategy {strat}: not supported; strategies: {supported}"
            )
        return strat

    # --------------------------------------------------------------- memory
    def base_memory(self, d: int, strategy: Strategy | None = None) -> float:
        """Frozen weights + fixed buffers per GPU, bytes."""
        strat = self._key(d, strategy)
        key = ("base_mem", d, strat)
        if key not in self._cache:
            if strat is not None and self.spec.parallel_problem(strat, d):
                # plora.parallel cannot split this model so (e.g. tp=4 over 2 KV heads, more pp
                # stages than layers): the degree never fits, so the planner never picks it
                self._cache[key] = math.inf
            else:
                self._cache[key] = base_memory(
                    self.spec, d=d, strategy=strat, options=self.memory
                ).total
        return cast(float, self._cache[key])

    def config_memory(self, config: LoRAConfig, d: int, strategy: Strategy | None = None) -> float:
        """Adapter state and the activations of the config's rows per GPU, bytes."""
        strat = self._key(d, strategy)
        # Memory depends on the shape of the config only: configs differing in lr, alpha,
        # schedule or seed share one entry.
        key = (
            "mem",
            config.rank,
            config.target_modules,
            config.batch_size,
            config.dropout > 0,
            d,
            strat,
        )
        if key not in self._cache:
            self._cache[key] = self.config_breakdown(config, d, strat).total
        return cast(float, self._cache[key])

    def config_breakdown(
        self, config: LoRAConfig, d: int = 1, strategy: Strategy | None = None
    ) -> MemoryBreakdown:
        """Per-component :class:`~plora.cost.memory_options.MemoryBreakdown` of one config."""
        return adapter_memory(
            self.spec,
            rank=config.rank,
            targets=config.target_modules,
            batch_size=config.batch_size,
            seq_len=self.seq_len,
            dropout=config.dropout,
            d=d,
            strategy=self._key(d, strategy),
            options=self.memory,
        )

    def capacity(self, d: int) -> float:
        """``C·M_gpu`` bytes usable per GPU."""
        if not isinstance(d, int) or d < 1 or d & (d - 1):
            raise ConfigError(f"parallel degree d={d!r} must be a power of two >= 1")
        return self._capacity

    def config_memory_parts(
        self, config: LoRAConfig, d: int, strategy: Strategy | None = None
    ) -> tuple[float, float]:
        """``(S_k, a_k)``: the config's state bytes (LoRA params, grads, optimizer) and its
        activation bytes per row (:mod:`plora.cost.microbatch`), per GPU."""
        strat = self._key(d, strategy)
        key = ("parts", config.rank, config.target_modules, config.batch_size,
               config.dropout > 0, d, strat)  # fmt: skip
        if key not in self._cache:
            comps = self.config_breakdown(config, d, strat).components
            self._cache[key] = state_and_row_activation(comps, config.batch_size)
        return cast(tuple[float, float], self._cache[key])

    def pack_memory(
        self,
        pack: Sequence[LoRAConfig],
        d: int,
        strategy: Strategy | None = None,
        *,
        micro_batches: int = 1,
    ) -> float:
        """Per-GPU bytes of a job: base + Σ configs; with ``micro_batches`` m > 1 the states
        of every config plus the activations of ``⌈rows/m⌉`` rows (:mod:`plora.cost.microbatch`)."""
        if check_micro_batches(micro_batches) == 1 or not pack:
            return self.base_memory(d, strategy) + sum(
                self.config_memory(k, d, strategy) for k in pack
            )
        parts = [self.config_memory_parts(k, d, strategy) for k in pack]
        rows = [k.batch_size for k in pack]
        return micro_batched_memory(self.base_memory(d, strategy), parts, rows, micro_batches)

    def micro_batches_to_fit(
        self, pack: Sequence[LoRAConfig], d: int, strategy: Strategy | None = None
    ) -> int | None:
        """The smallest m whose :meth:`pack_memory` fits :meth:`capacity` (1 when the pack fits
        with every row live); None when not even one row per micro-batch fits."""
        cap = memory_limit(self.capacity(d))
        if self.pack_memory(pack, d, strategy) <= cap:
            return 1
        parts = [self.config_memory_parts(k, d, strategy) for k in pack]
        rows = [k.batch_size for k in pack]
        return smallest_micro_batches(self.base_memory(d, strategy), parts, rows, cap)


__all__ = ["SweepMemory"]
