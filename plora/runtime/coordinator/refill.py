"""The coordinator's small decisions as pure functions: which queued configs refill a running
job, how an out-of-memory pack is split."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plora.config import LoRAConfig
from plora.cost import within_capacity
from plora.runtime.coordinator.costs import job_memory


@dataclass(frozen=True, kw_only=True, slots=True)
class Refill:
    """One queued config chosen to join a running job, with the numbers that allowed it."""

    config_id: str
    memory_bytes: float
    """Predicted per-GPU memory of the job with it: ``M_base(d) + Σ_k M_k(d)``."""
    capacity_bytes: float
    steps: int
    steps_left: int
    """Steps the job's longest active config still has to go."""
    extends_job: bool = False
    """The refill needs more steps than that: the job runs on for it (no GPU was idle)."""


def choose_refills(
    *,
    active: Sequence[LoRAConfig],
    queued: Iterable[LoRAConfig],
    slots: int,
    progress: Mapping[str, int],
    cost: Any,
    gpus: int,
    strategy: str | None,
    may_extend: bool = False,
    rejected_keys: set[Hashable] | None = None,
) -> list[Refill]:
    """Queued configs that may join a running job now, in queue order.

    A candidate joins when the pack has a free slot (fewer than ``slots`` active configs: the
    pack size the planner chose) and the pack with it fits the GPU (``job_memory <= capacity``).
    While another GPU is idle it must also need no more steps than the job's longest active
    config has left, so the refill does not make the job end later than a job of its own would;
    with ``may_extend`` (no GPU idle: the config would only wait) the job runs on for it -- on a
    resident worker that is the same as a next job on that GPU, minus the wait.

    ``queued`` is read only as far as needed. Its configs are priced alike when the cost model's
    ``price_key`` says so: once one of a key did not fit (its memory, or its steps), the others of
    that key are not priced (the pack only grows), so a pack that nothing fits costs one pricing
    per key, not per queued config; the keys go to ``rejected_keys`` as they are found (a
    :class:`~.scheduling.RefillQueue` reading them skips their configs unread).

    Args:
        active: The job's configs still training.
        queued: Configs waiting for a job, in the order to try them.
        slots: The most configs the job may train at once (its first pack's size, and no more
            than ``planner.max_pack_size``).
        progress: Steps done per config id.
        cost: The cost model (``steps``, memory).
        gpus: The job's d.
        strategy: The job's strategy (None for d = 1).
        may_extend: Let a refill need more steps than the job has left.
        rejected_keys: Where the price keys found not to fit go (a set the caller shares with
            its queue), or None.
    """
    if not active or len(active) >= slots:
        return []
    pack = list(active)
    left = max(cost.steps(c) - progress.get(c.config_id, 0) for c in active)
    out: list[Refill] = []
    price_key = getattr(cost, "price_key", None)
    rejected = set() if rejected_keys is None else rejected_keys
    for cand in queued:
        if len(pack) >= slots:
            break
        key = price_key(cand) if price_key is not None else None
        if key is not None and key in rejected:
            continue
        steps = int(cost.steps(cand))
        if steps > left and not may_extend:
            if key is not None:
                rejected.add(key)
            continue
        used, cap = job_memory(cost, [*pack, cand], gpus, strategy)
        if not within_capacity(used, cap):
            if key is not None:
                rejected.add(key)
            continue
        pack.append(cand)
        out.append(
            Refill(
                config_id=cand.config_id,
                memory_bytes=used,
                capacity_bytes=cap,
                steps=steps,
                steps_left=left,
                extends_job=steps > left,
            )
        )
    return out


def split_halves(config_ids: Sequence[str]) -> list[list[str]]:
    """An out-of-memory pack's configs in two halves (the first gets the odd one)."""
    half = (len(config_ids) + 1) // 2
    return [list(config_ids[:half]), list(config_ids[half:])]


__all__ = ["Refill", "choose_refills", "split_halves"]
