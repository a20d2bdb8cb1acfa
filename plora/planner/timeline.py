"""The simulated timeline of a plan, shared by the job planner and the baselines: the
feasibility check, :class:`Start` records, tail repair, and :class:`Job` s.

Tail repair (:func:`rebalance`, our extension of the paper): after each simulation of Alg. 2,
configs move out of the job that ends last -- into a job that is last on its GPUs, or into a
new job on the GPUs that go idle first -- while that lowers the makespan. Only jobs without
successors change, so no start time moves and every invariant of the simulation holds. A new
job pays a worker-group start-up unless its GPUs end up as a group of its size
(:mod:`plora.planner.groups`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plora.cost import within_capacity
from plora.planner.groups import Groups
from plora.planner.ilp import ClassTable, Pack, make_pack
from plora.planner.types import GIB, Job, NoFeasibleJobError


def check_feasible(table: ClassTable, num_gpus: int) -> None:
    """Raise :class:`NoFeasibleJobError` for the first config that fits no allowed (d, s)."""
    for c, members in enumerate(table.members):
        if any(opt.fits[c] and opt.d <= num_gpus for opt in table.options):
            continue
        one = table.options[0]
        need = (one.base + one.mem[c]) / GIB
        msg = (
            f"config {members[0].config_id}: needs {need:.1f} GiB per GPU on 1 GPU "
            f"(base {one.base / GIB:.1f} + adapter {one.mem[c] / GIB:.1f}) "
            f"but capacity is {one.capacity / GIB:.1f} GiB"
        )
        # a degree the model cannot take (infinite base memory) is no option to show
        wide = [o for o in table.options if 1 < o.d <= num_gpus and math.isfinite(o.base)]
        if wide:
            o = min(wide, key=lambda o: (o.base + o.mem[c]) - o.capacity)
            msg += (
                f" ({(o.base + o.mem[c]) / GIB:.1f} vs {o.capacity / GIB:.1f} GiB "
                f"on {o.d} GPUs with {o.strategy})"
            )
            fix = "use GPUs with more memory, more GPUs, or a smaller rank/batch_size/seq_len"
        else:
            fix = (
                "use GPUs with more memory, a smaller rank/batch_size/seq_len, "
                "or allow multi-GPU jobs (planner.strategies: [tp], [fsdp] or [pp])"
            )
        raise NoFeasibleJobError(f"{msg}; {fix}")


@dataclass(frozen=True, slots=True)
class Start:
    """A simulated job start: a pack on GPU ids, its start-up wait, its end."""

    pack: Pack
    start: float
    gpu_ids: tuple[int, ...]
    startup: float = 0.0
    """Seconds the job waits for a cold worker group before its T starts."""

    @property
    def end(self) -> float:
        """``start + startup + T``."""
        return self.start + self.startup + self.pack.time


def _with(pack: Pack, c: int, delta: int, table: ClassTable) -> Pack | None:
    """``pack`` with ``delta`` (+1/-1) configs of class c; None if empty or out of memory."""
    take = list(pack.take)
    take[c] += delta
    if take[c] < 0:
        return None
    new = make_pack(table, pack.option, take)
    if new is None or not within_capacity(new.memory, new.option.capacity):
        return None
    if new.micro_batches > pack.micro_batches:
        return None  # tail repair moves configs, it does not add forwards to a job's steps
    return new


def rebalance(
    table: ClassTable,
    started: list[Start],
    num_gpus: int,
    *,
    now: float = 0.0,
    busy: Sequence[tuple[float, tuple[int, ...]]] = (),
    groups: Groups | None = None,
    max_moves: int = 10_000,
) -> list[Start]:
    """Tail repair: move configs out of the job that ends last while that lowers the makespan.

    A config of the last job moves into another job that is last on its GPUs (it grows by the
    config's time, memory permitting) or into a new one-config job on the GPUs that go idle
    first (paying a start-up unless they end as a worker group of its size; ``groups`` is
    the state before ``started``). Only jobs with no successor on their GPUs change, so no
    start time moves.
    """
    init = groups if groups is not None else Groups(num_gpus, {}, None)
    starts = list(started)
    singles: dict[tuple[int, int], Pack] = {}  # one config of class c on an option
    for _ in range(max_moves):
        if not starts:
            break
        end = [s.end for s in starts]
        a = max(range(len(starts)), key=end.__getitem__)
        span = end[a]
        last_on: dict[int, int] = {}
        for i, s in enumerate(starts):
            for g in s.gpu_ids:
                if g not in last_on or s.start >= starts[last_on[g]].start:
                    last_on[g] = i
        held = {g: e for e, ids in busy for g in ids}
        free_from = sorted(
            (max(now, held.get(g, now), end[last_on[g]] if g in last_on else now), g)
            for g in range(num_gpus)
        )
        tails = {i for i in last_on.values() if all(last_on[g] == i for g in starts[i].gpu_ids)}
        others = max((e for i, e in enumerate(end) if i != a), default=0.0)
        after, without_a = _groups_after(init, starts, last_on, a) if init.track else ({}, {})
        best: tuple[float, int, int | None, Pack | None, Start | None] | None = None
        for c, t in enumerate(starts[a].pack.take):
            if not t:
                continue
            shrunk = _with(starts[a].pack, c, -1, table)
            a_end = starts[a].start + starts[a].startup + shrunk.time if shrunk else 0.0
            # A move ends no earlier than ``floor`` (a pack grown by c takes at least c's own
            # time longer); one whose floor cannot beat the bar is not priced.
            floor = max(a_end, others)
            if _no_gain(floor, span, best[0] if best else math.inf):
                continue
            for b in tails - {a}:
                sb = starts[b]
                if _no_gain(
                    max(floor, sb.end + sb.pack.option.time[c]), span, best[0] if best else math.inf
                ):
                    continue
                grown = _with(sb.pack, c, +1, table)
                if grown is not None:
                    new = max(floor, sb.start + sb.startup + grown.time)
                    if new < span * (1 - 1e-9) and (best is None or new < best[0]):
                        best = (new, c, b, grown, None)
            for opt in table.options:
                if opt.d > num_gpus or not opt.fits[c]:
                    continue
                ids = [g for _, g in free_from[: opt.d]]
                begin = max(f for f, _ in free_from[: opt.d])
                if any(g in starts[a].gpu_ids for g in ids) and shrunk is not None:
                    continue
                if (single := singles.get((id(opt), c))) is None:
                    single = make_pack(table, opt, np.eye(len(table.members), dtype=np.int64)[c])
                    assert single is not None  # one config: never empty
                    singles[id(opt), c] = single
                if _no_gain(max(floor, begin + single.time), span, best[0] if best else math.inf):
                    continue
                block = tuple(sorted(ids))
                left = {**after, **without_a} if shrunk is None else after
                warm = init.track and not init.never_warm
                if not init.track or (warm and all(left[g] == block for g in block)):
                    wait = 0.0
                else:
                    wait = table.startup.get(len(block), 0.0)
                new = max(floor, begin + wait + single.time)
                if new < span * (1 - 1e-9) and (best is None or new < best[0]):
                    best = (new, c, None, single, Start(single, begin, block, wait))
        if best is None:
            break
        _, c, target, grown, fresh = best
        shrunk = _with(starts[a].pack, c, -1, table)
        if target is not None:
            assert grown is not None
            starts[target] = Start(
                grown, starts[target].start, starts[target].gpu_ids, starts[target].startup
            )
        else:
            assert fresh is not None
            starts.append(fresh)
        if shrunk is None:
            starts.pop(a)
        else:
            starts[a] = Start(shrunk, starts[a].start, starts[a].gpu_ids, starts[a].startup)
    return starts


def _no_gain(floor: float, span: float, best_end: float) -> bool:
    """Whether a move that ends no earlier than ``floor`` can neither lower the makespan
    ``span`` nor beat the best move so far, ending at ``best_end`` (with a 1e-12 margin for
    the floor's round-off)."""
    return floor * (1 - 1e-12) >= min(span * (1 - 1e-9), best_end)


def _groups_after(
    init: Groups, starts: Sequence[Start], last_on: dict[int, int], a: int
) -> tuple[dict[int, tuple[int, ...] | None], dict[int, tuple[int, ...] | None]]:
    """The worker group each GPU holds after every job of ``starts`` (its last job's GPUs,
    else its initial group), and for job ``a``'s GPUs the same without job ``a``."""
    after = {g: starts[last_on[g]].gpu_ids if g in last_on else init.of[g]
             for g in range(init.num_gpus)}  # fmt: skip
    before: dict[int, Start] = {}
    for i, s in enumerate(starts):
        for g in s.gpu_ids:
            if (
                i != a
                and g in starts[a].gpu_ids
                and (g not in before or s.start >= before[g].start)
            ):
                before[g] = s
    without_a = {g: before[g].gpu_ids if g in before else init.of[g] for g in starts[a].gpu_ids}
    return after, without_a


def to_jobs(table: ClassTable, started: Sequence[Start], *, prefix: str = "j") -> tuple[Job, ...]:
    """Turn simulated starts into :class:`Job` s with concrete config ids."""
    pools = [list(m) for m in table.members]
    jobs = []
    for n, s in enumerate(sorted(started, key=lambda s: (s.start, s.gpu_ids))):
        ids: list[str] = []
        for c, t in enumerate(s.pack.take):
            ids.extend(cfg.config_id for cfg in pools[c][:t])
            del pools[c][:t]
        jobs.append(
            Job(
                job_id=f"{prefix}{n:04d}",
                config_ids=tuple(ids),
                gpus=s.pack.option.d,
                strategy=s.pack.option.strategy,
                start_s=s.start,
                end_s=s.end,
                memory_gib_per_gpu=s.pack.memory / GIB,
                gpu_ids=s.gpu_ids,
                startup_s=s.startup,
                micro_batches=s.pack.micro_batches,
                max_rows=s.pack.max_rows,
            )
        )
    return tuple(jobs)


__all__ = ["Start", "check_feasible", "rebalance", "to_jobs"]
