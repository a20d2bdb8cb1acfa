"""The segment/rank table of a packed LoRA call, validated once and shipped to the device once.

A :class:`PackedMeta` holds the host copy of the table (tuples, so it hashes) and hands out one
small device tensor per (table, device); every layer of a step passes the same table, so only the
first layer pays the host-to-device copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch

from .errors import PackedLoRAError

#: Ranks are padded to a multiple of this inside the rank-concatenated A and B.
RANK_ALIGN = 16
#: Largest supported true rank.
MAX_RANK = 256

# Rows of the packed int32 device table (see PackedMeta.device_table).
ROW_SEG, ROW_OFF, ROW_RANK, ROW_SCALE, ROW_P, ROW_KEY_LO, ROW_KEY_HI, ROW_ROW0 = range(8)
TABLE_ROWS = 8

_M64 = (1 << 64) - 1


def slot_key(seed: int, slot: int) -> int:
    """63-bit dropout key of slot ``slot`` for a call given one ``dropout_seed`` (splitmix64)."""
    z = (int(seed) + 0x9E3779B97F4A7C15 * (int(slot) + 1)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class DropoutKeys:
    """Where each slot's dropout bits come from (the package docstring gives the formula).

    Element ``(t, c)`` of slot ``i`` is drawn from Philox under key ``keys[i]`` at counter
    ``(s·G + g, rows[i] + t // row_len, word, 0)`` with ``s = t % row_len`` (the token's place
    in its row), ``g = (col_base + c) // 4`` and ``G = ceil(in_total / 4)``. Hence a mask
    depends on the adapter's key, its row index and the token's place in the row -- not on the
    pack around it, the padded length, or how the input columns are split (row-wise TP).

    Attributes:
        keys: one 63-bit key per slot (e.g. a hash of the adapter's seed and step).
        rows: index of each slot's first row in its adapter's batch (default 0).
        row_len: tokens per row (default: the whole call, one row; the engine gives the
            padded sequence length).
        word: the counter's third word, e.g. the module's index (< 2**32).
        col_base: first input column of ``x`` in the full input (the Triton kernels need a
            multiple of 4; the torch reference takes any).
        in_total: the full input width (default ``col_base + in_features``).
    """

    keys: tuple[int, ...]
    rows: tuple[int, ...] | None = None
    row_len: int | None = None
    word: int = 0
    col_base: int = 0
    in_total: int | None = None

    @classmethod
    def from_seed(cls, seed: int, n_slots: int) -> DropoutKeys:
        """One key per slot from a single call seed (:func:`slot_key`)."""
        return cls(keys=tuple(slot_key(seed, i) for i in range(n_slots)))

    def resolved(self, n_tokens: int, in_features: int) -> DropoutKeys:
        """With ``rows``, ``row_len`` and ``in_total`` filled in and every value checked."""
        n = len(self.keys)
        rows = (0,) * n if self.rows is None else tuple(int(r) for r in self.rows)
        row_len = max(int(n_tokens), 1) if self.row_len is None else int(self.row_len)
        in_total = self.col_base + in_features if self.in_total is None else int(self.in_total)
        if len(rows) != n:
            raise PackedLoRAError(
                f"packed_lora: dropout rows has {len(rows)} entries for {n} keys; give one per slot"
            )
        if row_len < 1 or any(r < 0 or r >= 2**31 for r in rows):
            raise PackedLoRAError(
                f"packed_lora: dropout row_len={row_len}, rows={rows[:4]}...; need row_len >= 1 "
                "and 0 <= rows < 2**31"
            )
        if self.col_base < 0 or in_total < self.col_base + in_features:
            raise PackedLoRAError(
                f"packed_lora: dropout col_base={self.col_base}, in_total={in_total} for "
                f"{in_features} columns; col_base must be >= 0 and the columns inside in_total"
            )
        if row_len * ((in_total + 3) // 4) >= 2**32 or not 0 <= self.word < 2**32:
            raise PackedLoRAError(
                f"packed_lora: dropout row_len={row_len} x {in_total} features or word="
                f"{self.word} exceed the 32-bit Philox counter; split the rows"
            )
        keys = tuple(int(k) & 0x7FFFFFFFFFFFFFFF for k in self.keys)
        return DropoutKeys(keys=keys, rows=rows, row_len=int(row_len), word=int(self.word),
                           col_base=int(self.col_base), in_total=in_total)  # fmt: skip

    def scalars(self) -> tuple[int, int, int, int]:
        """``(word, row_len, col_base, groups)``: the kernels' per-call dropout arguments."""
        assert self.row_len is not None and self.in_total is not None, "call resolved() first"
        if self.col_base % 4:
            raise PackedLoRAError(
                f"packed_lora: dropout col_base={self.col_base}; the Triton kernels need a "
                "multiple of 4 (split the input columns at multiples of 4, or use backend='torch')"
            )
        return self.word, self.row_len, self.col_base, (self.in_total + 3) // 4


def padded_rank(rank: int) -> int:
    """``rank`` rounded up to a multiple of :data:`RANK_ALIGN` (24 -> 32)."""
    return -(-rank // RANK_ALIGN) * RANK_ALIGN


def _raw(value, name: str) -> tuple | float:
    """Hashable host copy of a table argument (validated later, in :func:`_validated`)."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1:
            raise PackedLoRAError(
                f"packed_lora: {name} must be 1-d, got shape {tuple(value.shape)}"
            )
        value = value.tolist()
    if isinstance(value, int | float):
        return float(value)
    return tuple(value)


@dataclass(frozen=True, slots=True, eq=False)
class PackedMeta:
    """Validated host copy of the slot table (hashed by identity: one object per distinct table).

    Attributes:
        seg_starts: ``n_slots + 1`` token offsets.
        rank_offsets: ``n_slots + 1`` row offsets into the rank-concatenated A.
        ranks: ``n_slots`` true ranks.
        scales: ``n_slots`` LoRA scales.
        dropout_p: ``n_slots`` dropout probabilities.
        n_slots: number of slots.
        max_rank_pad: largest padded rank block (0 without slots).
        has_dropout: any ``p > 0``.
    """

    seg_starts: tuple[int, ...]
    rank_offsets: tuple[int, ...]
    ranks: tuple[int, ...]
    scales: tuple[float, ...]
    dropout_p: tuple[float, ...]
    n_slots: int
    max_rank_pad: int
    has_dropout: bool
    dropout_keys: tuple[int, ...] = ()
    """``n_slots`` 63-bit Philox keys (:class:`DropoutKeys`)."""
    dropout_rows: tuple[int, ...] = ()
    """``n_slots`` first-row indices (:class:`DropoutKeys`)."""

    def device_table(self, device: torch.device) -> torch.Tensor:
        """``(8, n_slots + 1)`` int32 table on ``device``: seg, off, rank, scale, p (as bits),
        key low and high words, first row. Inside :func:`static_tables`, the store's buffer."""
        if _STORE:
            return _STORE[-1].table(self, torch.device(device))
        return _device_table(self, torch.device(device))


def _host_table(meta: PackedMeta) -> torch.Tensor:
    n = meta.n_slots
    host = torch.zeros(TABLE_ROWS, n + 1, dtype=torch.int32)
    host[ROW_SEG] = torch.tensor(meta.seg_starts, dtype=torch.int32)
    host[ROW_OFF] = torch.tensor(meta.rank_offsets, dtype=torch.int32)
    host[ROW_RANK, :n] = torch.tensor(meta.ranks, dtype=torch.int32)
    host[ROW_SCALE, :n] = torch.tensor(meta.scales, dtype=torch.float32).view(torch.int32)
    host[ROW_P, :n] = torch.tensor(meta.dropout_p, dtype=torch.float32).view(torch.int32)
    keys = torch.tensor(meta.dropout_keys or (0,) * n, dtype=torch.int64)
    host[ROW_KEY_LO, :n] = (keys & 0xFFFFFFFF).to(torch.int32)  # wraps: the bits are what count
    host[ROW_KEY_HI, :n] = (keys >> 32).to(torch.int32)
    host[ROW_ROW0, :n] = torch.tensor(meta.dropout_rows or (0,) * n, dtype=torch.int32)
    return host


def _shipped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@lru_cache(maxsize=64)
def _device_table(meta: PackedMeta, device: torch.device) -> torch.Tensor:
    return _shipped(_host_table(meta), device)


class TableStore:
    """Device tables that outlive a step, for a step replayed as a CUDA graph.

    A captured kernel reads its table from a fixed address, so inside :func:`static_tables` every
    table with the same layout (segments, ranks, scales, dropout probabilities and rows: all but
    the dropout keys) is one buffer of this store. The keys change with every optimizer step;
    :meth:`rekey` rewrites them in place before a replay. Tables are made and filled only by an
    eager pass (:attr:`frozen` False); a frozen store (during capture) refuses a new layout with
    :class:`GraphUnsafe`, and one whose keys are stale, since a capture may not copy.

    Keys are matched to their owners (any hashable label: the engine uses slots) with
    :attr:`owners`, ``{key: label}``, set before an eager pass: an entry whose key is 0 (no
    dropout) stays 0.
    """

    def __init__(self) -> None:
        self.frozen = False
        self.owners: dict[int, object] = {}
        self._tables: dict[tuple, tuple[torch.Tensor, tuple[object, ...]]] = {}
        self._keys: dict[tuple, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def table(self, meta: PackedMeta, device: torch.device) -> torch.Tensor:
        layout = (
            meta.seg_starts, meta.rank_offsets, meta.ranks, meta.scales, meta.dropout_p,
            meta.dropout_rows, device,
        )  # fmt: skip
        keys = meta.dropout_keys or (0,) * meta.n_slots
        found = self._tables.get(layout)
        if found is not None and self._keys[layout] == keys:
            return found[0]
        if self.frozen:
            what = "a new table layout" if found is None else "stale dropout keys"
            raise GraphUnsafe(f"packed_lora: {what} while capturing; run the step eagerly first")
        unknown = [k for k in keys if k and k not in self.owners]
        if unknown:
            raise GraphUnsafe(f"packed_lora: dropout key {unknown[0]} has no owner in the store")
        labels = tuple(self.owners[k] if k else None for k in keys)
        if found is None:
            buf = _shipped(_host_table(meta), device)
        else:
            buf = found[0]
            buf.copy_(_shipped(_host_table(meta), device), non_blocking=True)
        self._tables[layout] = (buf, labels)
        self._keys[layout] = keys
        return buf

    def rekey(self, keys: dict[object, int]) -> None:
        """Give every entry owned by label ``l`` the key ``keys[l]`` (one copy per changed table)."""
        for layout, (buf, labels) in self._tables.items():
            if any(lab is not None and lab not in keys for lab in labels):
                continue  # another pack's table: an eager pass rewrites it if it is used again
            new = tuple(0 if lab is None else keys[lab] for lab in labels)
            if new == self._keys[layout]:
                continue
            k = torch.tensor(new, dtype=torch.int64)
            host = torch.stack([(k & 0xFFFFFFFF).to(torch.int32), (k >> 32).to(torch.int32)])
            buf[ROW_KEY_LO : ROW_KEY_HI + 1, : len(new)].copy_(
                _shipped(host, buf.device), non_blocking=True
            )
            self._keys[layout] = new


class GraphUnsafe(RuntimeError):
    """A step cannot be captured as it stands (it needs host work a replay would not redo)."""


_STORE: list[TableStore] = []


@contextmanager
def static_tables(store: TableStore) -> Iterator[TableStore]:
    """Route every :meth:`PackedMeta.device_table` inside through ``store``."""
    _STORE.append(store)
    try:
        yield store
    finally:
        _STORE.pop()


def make_meta(
    *,
    n_tokens: int,
    r_total: int,
    in_features: int,
    seg_starts: Sequence[int] | torch.Tensor,
    rank_offsets: Sequence[int] | torch.Tensor,
    ranks: Sequence[int] | torch.Tensor,
    scales: Sequence[float] | torch.Tensor,
    dropout_p: Sequence[float] | torch.Tensor | float,
    dropout: DropoutKeys | None = None,
) -> PackedMeta:
    """Validate the slot table against the tensor shapes; raise PackedLoRAError naming the bad value.

    Cached on the table's values: every layer of a step that passes the same table gets the same
    :class:`PackedMeta` (and so the same device copy) for a few microseconds.
    """
    return _validated(
        int(n_tokens),
        int(r_total),
        int(in_features),
        _raw(seg_starts, "seg_starts"),
        _raw(rank_offsets, "rank_offsets"),
        _raw(ranks, "ranks"),
        _raw(scales, "scales"),
        _raw(dropout_p, "dropout_p"),
        None if dropout is None else dropout.keys,
        None if dropout is None else dropout.rows,
    )


@lru_cache(maxsize=256)
def _validated(
    n_tokens, r_total, in_features, seg_starts, rank_offsets, ranks, scales, dropout_p,
    keys=None, rows=None,
):  # fmt: skip
    if not all(isinstance(v, tuple) for v in (seg_starts, rank_offsets, ranks)):
        raise PackedLoRAError(
            "packed_lora: seg_starts, rank_offsets and ranks must be sequences of ints"
        )
    segs = tuple(int(v) for v in seg_starts)
    offs = tuple(int(v) for v in rank_offsets)
    rks = tuple(int(v) for v in ranks)
    n = len(rks)
    if len(segs) != n + 1:
        raise PackedLoRAError(
            f"packed_lora: seg_starts has {len(segs)} entries for {n} slots; give n_slots + 1"
        )
    if len(offs) != n + 1:
        raise PackedLoRAError(
            f"packed_lora: rank_offsets has {len(offs)} entries for {n} slots; give n_slots + 1"
        )
    if segs and (segs[0] < 0 or segs[-1] > n_tokens):
        raise PackedLoRAError(
            f"packed_lora: seg_starts spans [{segs[0]}, {segs[-1]}) but x has {n_tokens} tokens; "
            "keep segments inside the flattened tokens"
        )
    for i in range(n):
        if segs[i + 1] < segs[i]:
            raise PackedLoRAError(
                f"packed_lora: seg_starts[{i + 1}]={segs[i + 1]} < seg_starts[{i}]={segs[i]}; "
                "segments must be contiguous and in slot order"
            )
        if not 1 <= rks[i] <= MAX_RANK:
            raise PackedLoRAError(f"packed_lora: ranks[{i}]={rks[i]}; use 1..{MAX_RANK}")
        block = offs[i + 1] - offs[i]
        if block < rks[i] or block % RANK_ALIGN:
            raise PackedLoRAError(
                f"packed_lora: slot {i} has a rank block of {block} rows for rank {rks[i]}; "
                f"use a multiple of {RANK_ALIGN} >= the rank (e.g. {padded_rank(rks[i])})"
            )
    if offs and (offs[0] != 0 or offs[-1] != r_total):
        raise PackedLoRAError(
            f"packed_lora: rank_offsets runs {offs[0]}..{offs[-1]} but lora_a has {r_total} rows; "
            "start at 0 and end at lora_a.shape[0]"
        )
    scl = _floats(scales, "scales", n)
    drop = _floats(dropout_p, "dropout_p", n)
    for i in range(n):
        if not 0.0 <= drop[i] < 1.0:
            raise PackedLoRAError(f"packed_lora: dropout_p[{i}]={drop[i]}; use a value in [0, 1)")
        if not math.isfinite(scl[i]):
            raise PackedLoRAError(f"packed_lora: scales[{i}]={scl[i]}; use a finite scale")
    keys = tuple(keys) if keys is not None else (0,) * n
    rows = tuple(rows) if rows is not None else (0,) * n
    if len(keys) != n or len(rows) != n:
        raise PackedLoRAError(
            f"packed_lora: {len(keys)} dropout keys and {len(rows)} rows for {n} slots; give one "
            "of each per slot"
        )
    return PackedMeta(
        seg_starts=segs,
        rank_offsets=offs,
        ranks=rks,
        scales=scl,
        dropout_p=drop,
        n_slots=n,
        max_rank_pad=max((offs[i + 1] - offs[i] for i in range(n)), default=0),
        has_dropout=any(p > 0.0 for p in drop),
        dropout_keys=keys,
        dropout_rows=rows,
    )


def _floats(value: tuple | float, name: str, n: int) -> tuple[float, ...]:
    if isinstance(value, float):
        return (value,) * n
    if len(value) != n:
        raise PackedLoRAError(
            f"packed_lora: {name} has {len(value)} entries; give one per slot ({n})"
        )
    return tuple(float(v) for v in value)
