"""CPU offload in the plan: ``fsdp_offload`` as the last resort of ``planner.cpu_offload: auto``.

An ``fsdp_offload`` job keeps the frozen base's shards in host memory (FSDP2's
``CPUOffloadPolicy``): its GPUs hold a fraction of what an ``fsdp`` job's do, and every step pays
the copies of the shards over PCIe (:mod:`plora.cost.parallel`). The cost model's strategies say
which the planner may use (:func:`plora.config.sweep_options.job_strategies`):

* ``auto``: both ``fsdp`` and ``fsdp_offload``. An offloaded option is then kept only for the
  configs that fit no other option of the plan (any d, strategy or micro-batching):
  :func:`last_resort` clears its ``fits`` for the others. A base that fits its GPUs sharded is
  never offloaded, even where a bigger offloaded pack would be predicted faster.
* ``on``: ``fsdp_offload`` in place of ``fsdp``; it competes by predicted throughput as any
  strategy does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from plora.cost import Strategy
from plora.cost.parallel import HOST_LINK_GBPS
from plora.planner.types import Job


def last_resort(options: Sequence[Any]) -> list[Any]:
    """``options`` (``DegreeCosts``) with the ``fsdp_offload`` ones kept for the configs that fit
    no other option, when plain ``fsdp`` is offered too (``cpu_offload: auto``); an offloaded
    option that no config needs is dropped. Unchanged without both strategies."""
    strategies = {o.strategy for o in options}
    if not {Strategy.FSDP, Strategy.FSDP_OFFLOAD} <= strategies:
        return list(options)
    fits_elsewhere = np.zeros_like(options[0].fits)
    for o in options:
        if o.strategy is not Strategy.FSDP_OFFLOAD:
            fits_elsewhere |= o.fits
    out = []
    for o in options:
        if o.strategy is Strategy.FSDP_OFFLOAD:
            o = replace(o, fits=o.fits & ~fits_elsewhere)
            if not o.fits.any():
                continue
        out.append(o)
    return out


def offload_note(jobs: Sequence[Job]) -> str | None:
    """The plan's note on its ``fsdp_offload`` jobs (None when it has none)."""
    ids = [j.job_id for j in jobs if j.strategy is Strategy.FSDP_OFFLOAD]
    if not ids:
        return None
    shown = ", ".join(ids[:6]) + (f" and {len(ids) - 6} more" if len(ids) > 6 else "")
    return (
        f"{shown}: fsdp_offload -- the frozen base in host memory (FSDP2 CPU offload), each "
        f"layer's shard copied to its GPU every forward and backward at an assumed "
        f"{HOST_LINK_GBPS:g} GB/s"
    )


__all__ = ["last_resort", "offload_note"]
