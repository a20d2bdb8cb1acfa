"""The steady packed step replayed as a CUDA graph: the host out of the GPU's way.

An eager packed step launches about 4,900 kernels (Triton and cuBLAS for every projection,
forward and backward); on the lent H100 hosts its host side took 430-520 ms of a 540-590 ms 3B
step, and a smaller step (the 1.5B sweep of ``benchmarks/e2e.py``) waited on it. Once a step's
shapes repeat, the same work replays as a CUDA graph: one launch, no Python (10-30 ms of host
time for that 3B step; the 1.5B sweep's step went from 0.84-1.05 s to 0.72 s:
``benchmarks/RESULTS.md``).

What makes a step repeat. Within a pack whose adapters neither join nor leave, every step has
the same rows per adapter (its batch size) and the same micro-batches; what varies is

* the padded length: rows pad to the step's longest row, rounded up here to a *bucket*
  (:func:`bucket_length`, a multiple of :data:`LENGTH_BUCKET` tokens);
* the number of target tokens: the loss reads hidden states at target positions only; the
  buffers hold a quarter-of-capacity bucket (:func:`bucket_targets`) of the largest count seen,
  and the rest are weight-0 targets;
* the data, the dropout keys (each adapter's seed and step) and the optimizer's per-slot
  factors (learning rate, bias corrections).

A graph is keyed by the pack's layout (the layers' versions, the adapters, the micro-batches)
and the length bucket; its target buffers only grow, so a pack settles on one graph per length
bucket. Its inputs are buffers of fixed address, refilled before each replay: token ids, target
positions / labels / weights / owners, the optimizer's factor table, and the packed kernels'
slot tables (:class:`plora.kernels.meta.TableStore`, whose dropout keys are rewritten in place).
Its outputs -- each slot's gradient norm and CE sums -- land in one buffer read after the step.
Rows are right-padded and attention is causal, so the graphed step passes no attention mask
(padding sits after every real token; it is never attended to and is never a target) and runs
HF's SDPA without one (:func:`plora.engine.attention.causal_only`): flash attention.

When. The first step of a key runs eagerly through the same static buffers (it compiles the
kernels and fills the slot tables); the second captures and replays; later ones replay. Adapters
that join or leave change the layout: the pack's graphs and their memory are dropped at once
(evaluation needs it) and the next steps capture again. Graphs share one memory pool (no graph
output lives in it: every buffer a replay reads or writes is allocated outside), so a few length
buckets cost about one step's activations; an eager step that does not fit beside the pool
frees it and runs again. Anything else a capture refuses (an operation that needs the host)
turns graphs off for the trainer with one log line, and the step runs eagerly: the eager step is
the reference the graphed one is tested against (``tests/gpu/test_graphs_gpu.py``).

On the CPU (``cuda_graphs=True``) the static-buffer step runs eagerly every time: what the CPU
tests compare with the eager step.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from plora.kernels.meta import TableStore, static_tables

from plora.config.sweep_options import cuda_graphs_resolved
from plora.engine import adapters
from plora.engine.attention import causal_only
from plora.engine.batch import pack_micro_batch, plan_micro_batches
from plora.engine.device import to_device
from plora.engine.fused import dropout_key, kernel
from plora.engine.loss import loss_targets, targets_loss
from plora.engine.step_record import StepReadback, StepShape

log = logging.getLogger(__name__)

#: Padded lengths round up to a multiple of this.
LENGTH_BUCKET = 64
#: Target tokens round up to this fraction of the bucket's capacity (rows × (length - 1)).
TARGET_STEPS = 4
#: Graphs kept per trainer (least recently used dropped first).
MAX_GRAPHS = 8


def graphs_wanted(requested: bool | None, device: torch.device) -> bool:
    """Whether a trainer on ``device`` runs the static-buffer step (``requested`` None: on for
    CUDA unless ``PLORA_CUDA_GRAPHS=0``; :func:`plora.config.sweep_options.cuda_graphs_resolved`,
    the planner's resolution too)."""
    return cuda_graphs_resolved(requested, cuda=device.type == "cuda")


def bucket_length(n: int, multiple: int = LENGTH_BUCKET) -> int:
    """``n`` tokens rounded up to a multiple of ``multiple``."""
    return -(-max(n, 1) // multiple) * multiple


def bucket_targets(n: int, capacity: int, steps: int = TARGET_STEPS) -> int:
    """``n`` targets rounded up to a ``1 / steps`` fraction of ``capacity`` (at most it)."""
    quantum = max(1, -(-capacity // steps))
    return min(capacity, -(-max(n, 1) // quantum) * quantum)


_HostMicro = tuple[
    tuple[tuple[int, int, int], ...],
    dict[int, int],
    list[int],
    torch.Tensor,
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
]
"""One micro-batch on the host: its segments, each slot's first row in its batch, the slots of
its CE sums, its input ids and its loss targets (positions, labels, weights, owners)."""


@dataclass
class _Micro:
    """One micro-batch's buffers (fixed addresses) and routing."""

    segments: tuple[tuple[int, int, int], ...]
    offsets: dict[int, int]
    slots: list[int]
    input_ids: torch.Tensor
    where: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    owner: torch.Tensor


@dataclass
class _Entry:
    micros: list[_Micro]
    table: torch.Tensor
    out: torch.Tensor
    graph: Any = None
    runs: int = 0


class StepGraphs:
    """The graphed step of one :class:`~plora.engine.trainer.PackedTrainer` (see the module).

    Attributes:
        captures, replays, eager_steps: counts, for tests and benchmarks.
        disabled: why graphs were turned off (None while on).
    """

    def __init__(self, trainer: Any) -> None:
        # a proxy, not a reference: a trainer and its graphs in a cycle outlived the trainer's
        # job until Python's cycle collector ran, with its pool's memory (the next pack's
        # capture on the same GPU then ran out of memory: seen on an H100)
        self.trainer = weakref.proxy(trainer)
        self.capture = trainer.device.type == "cuda"
        self.store = TableStore()
        self.entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._layout: tuple[Any, ...] | None = None
        self.captures = self.replays = self.eager_steps = 0
        self.disabled: str | None = None

    # ------------------------------------------------------------------ step
    def step(
        self,
        active: Sequence[Any],
        batches: dict[int, list[Any]],
        denoms: dict[int, int],
        lrs: dict[int, float],
    ) -> StepReadback:
        """Forward, backward and optimizer of one step through the buffers of its key.

        Returns the step's :class:`~plora.engine.step_record.StepReadback`: its values are
        this key's float64 output buffer (read it after the step's synchronize).
        """
        tr = self.trainer
        layout = (
            tuple(layer.version for layer in tr.layers.values()),
            tuple(sorted(lrs)),
            tr.max_rows,
        )
        if layout != self._layout:  # adapters joined or left: the old graphs are of no use
            self.drop()
            self._layout = layout
        micros = plan_micro_batches(batches, tr.max_rows)
        length = bucket_length(max(len(ex.input_ids) for exs in batches.values() for ex in exs))
        packed = [self._host_micro(m, length, denoms) for m in micros]
        key = (layout, length, tuple((segs, len(ids)) for segs, _, _, ids, _ in packed))
        entry = self._entry(key, packed, length)
        self._fill(entry, packed)
        steps = {ad.slot: (ad.config.seed, ad.step) for ad in active}
        self.store.owners = {dropout_key(seed, st): s for s, (seed, st) in steps.items()}
        self.store.rekey({s: dropout_key(seed, st) for s, (seed, st) in steps.items()})
        keys = {s: st for s, (_, st) in steps.items()}
        if self.capture and entry.runs and entry.graph is None:
            if kernel() is None and any(ad.config.dropout > 0 for ad in active):
                # the torch path builds each mask from the adapter's step on the host: a
                # captured mask would repeat at every replay
                raise RuntimeError(
                    "dropout on the torch LoRA path (its masks are keyed on the host, so a "
                    "replay would repeat one step's mask): graphs need plora.kernels"
                )
            self._capture(entry, keys)
        entry.table.copy_(to_device(tr.optimizer.slot_table(lrs), tr.device), non_blocking=True)
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
        else:
            try:
                with static_tables(self.store):
                    self._body(entry, keys)
            except torch.OutOfMemoryError:
                if not self._holds_graphs():
                    raise
                # the graphs' pool and this eager step did not fit together: free the graphs and
                # redo the step from the start (nothing was applied: the optimizer runs last)
                tr.optimizer.zero_grad()
                self.drop()
                return self.step(active, batches, denoms, lrs)
            self.eager_steps += 1
        entry.runs += 1
        rows = sum(len(ids) for _, _, _, ids, _ in packed)
        ce_slots = [list(m.slots) for m in entry.micros]
        shape = StepShape(
            rows=rows, padded_tokens=rows * length, seq_len=length, micro_batches=len(ce_slots)
        )
        return StepReadback(
            values=entry.out, num_norms=entry.table.shape[0], ce_slots=ce_slots, shape=shape
        )

    def drop(self) -> None:
        """Forget every graph, buffer and slot table (adapters changed, or memory is needed);
        the graphs' memory goes back to the device."""
        had_graphs = self._holds_graphs()
        self.entries.clear()
        self.store = TableStore()
        self._layout = None
        if had_graphs:
            torch.cuda.empty_cache()

    def disable(self, why: str) -> None:
        """Turn graphs off for this trainer (one log line) and free their memory."""
        if self.disabled is None:
            log.warning("CUDA graphs off for this pack: %s; the step runs eagerly", why)
        self.disabled = why
        self.drop()
        self.pool = None
        if self.capture:
            torch.cuda.empty_cache()

    # ------------------------------------------------------------- internals
    def _holds_graphs(self) -> bool:
        return any(e.graph is not None for e in self.entries.values())

    def _entry(self, key: tuple[Any, ...], packed: list[_HostMicro], length: int) -> _Entry:
        """The entry of ``key`` whose target buffers hold this step's targets. Target counts
        vary from step to step: an entry's buffers only grow (to the bucket of the largest count
        seen), so a pack settles on one entry -- one graph -- per length bucket."""
        entry = self.entries.get(key)
        need = [len(where) for *_, (where, *_) in packed]
        held = [0] * len(need) if entry is None else [len(m.where) for m in entry.micros]
        if entry is None or any(n > h for n, h in zip(need, held, strict=True)):
            sizes = [
                max(bucket_targets(n, len(ids) * (length - 1)), h)
                for n, h, (*_, ids, _) in zip(need, held, packed, strict=True)
            ]
            entry = self.entries[key] = self._new_entry(packed, sizes)
            while len(self.entries) > MAX_GRAPHS:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return entry

    def _host_micro(
        self, micro: dict[int, tuple[int, list[Any]]], length: int, denoms: dict[int, int]
    ) -> _HostMicro:
        """Host tensors of one micro-batch at the bucket's length (targets not yet padded)."""
        # every row is at most ``length`` tokens long: rounded up to a multiple of it, the
        # micro-batch's width is exactly ``length`` (the step's bucket, shared by its micros)
        pb = pack_micro_batch(micro, self.trainer.pad_id, pad_to_multiple_of=length)
        segs = tuple((s.slot, s.start, s.stop) for s in pb.segments if s.stop > s.start)
        where, t, w, owner, slots = loss_targets(pb.labels, segs, denoms)
        offsets = {s: micro[s][0] for s in micro}
        return segs, offsets, slots, pb.input_ids, (where, t, w, owner)

    def _new_entry(self, packed: list[_HostMicro], sizes: Sequence[int]) -> _Entry:
        dev = self.trainer.device
        micros = []
        for (segs, offsets, slots, ids, _), size in zip(packed, sizes, strict=True):
            targets = [torch.zeros(size, dtype=dt, device=dev)
                       for dt in (torch.long, torch.long, torch.float32, torch.long)]  # fmt: skip
            micros.append(_Micro(segs, offsets, slots, torch.empty_like(ids, device=dev), *targets))
        n_ids = self.trainer.optimizer.slot_table({}).shape[0]
        out = torch.zeros(
            n_ids + sum(len(m.slots) for m in micros), dtype=torch.float64, device=dev
        )
        return _Entry(micros, torch.zeros(n_ids, 8, device=dev), out)

    def _fill(self, entry: _Entry, packed: list[_HostMicro]) -> None:
        """Copy a step's rows and targets into the entry's buffers; targets past the step's own
        are padding: position 0, label 0, weight 0, owner past the last slot (counted nowhere)."""
        for m, (_, offsets, slots, ids, (where, t, w, owner)) in zip(
            entry.micros, packed, strict=True
        ):
            m.offsets = offsets
            pad = len(m.where) - len(where)
            host = (
                ids,
                torch.cat([where, where.new_zeros(pad)]),
                torch.cat([t, t.new_zeros(pad)]),
                torch.cat([w, w.new_zeros(pad)]),
                torch.cat([owner, owner.new_full((pad,), len(slots))]),
            )
            for buf, x in zip((m.input_ids, m.where, m.targets, m.weights, m.owner), host,
                              strict=True):  # fmt: skip
                buf.copy_(to_device(x, buf.device), non_blocking=True)

    def _body(self, entry: _Entry, steps: dict[int, int]) -> None:
        """Every micro-batch's forward and backward, the optimizer, the outputs: all device work
        reading the entry's buffers (what a graph captures). Attention is causal with no mask
        (:func:`~plora.engine.attention.causal_only`)."""
        width = entry.micros[0].input_ids.shape[-1]
        with causal_only(self.trainer.model, width=width):
            self._micro_batches(entry, steps)

    def _micro_batches(self, entry: _Entry, steps: dict[int, int]) -> None:
        tr = self.trainer
        sums = []
        for m in entry.micros:
            keys = {s: (steps[s], m.offsets[s]) for s in m.offsets}
            with adapters.packed_segments(tr.model, m.segments, dropout_keys=keys):
                with tr.autocast(cache=False):
                    hidden = tr._decoder(input_ids=m.input_ids, use_cache=False).last_hidden_state
                    loss, per_slot = targets_loss(
                        tr._head, hidden, m.where, m.targets, m.weights, m.owner, len(m.slots)
                    )
                loss.backward()
            del hidden, loss
            sums.append(per_slot)
        norms = tr.optimizer.apply(entry.table)
        entry.out.copy_(torch.cat([norms.double(), *sums]))

    def _capture(self, entry: _Entry, steps: dict[int, int]) -> None:
        if not self.captures:  # the eager steps' cached blocks: let the graphs' pool have them
            torch.cuda.empty_cache()
        if not any(e.graph is not None for e in self.entries.values()):
            # the allocator releases a pool with its last graph: a new capture needs a new one
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.trainer.device)
        self.store.frozen = True
        try:
            capture = torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local")
            with static_tables(self.store), capture:
                self._body(entry, steps)
        finally:
            self.store.frozen = False
        entry.graph = graph
        self.captures += 1


__all__ = [
    "LENGTH_BUCKET",
    "StepGraphs",
    "bucket_length",
    "bucket_targets",
    "graphs_wanted",
]
