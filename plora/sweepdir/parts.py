"""An append-only parquet table kept as a directory of parts (``DIR/metrics.parquet/``).

A sweep appends its metric rows every few seconds for hours: 10,000 configs x 100 steps is a
million rows. Rewriting one file with every row at each flush costs time proportional to the
rows so far, so the whole sweep pays quadratically (``benchmarks/control_plane.py``). Here each
flush writes only its new rows, as one part file ``part-FFFFFFFF-LLLLLLLL.parquet`` (F, L: the
first and last flush it holds), atomically (:func:`plora.utils.atomic_path`; the temporary is a
hidden directory, which pyarrow's dataset discovery skips).

Parts are merged size-tiered, as an LSM tree does: a part's tier is ``floor(log_F(rows))``
(F = :data:`FANOUT`); when the last F parts share a tier they become one part of a higher tier
(and past :data:`MAX_PARTS` parts the last F are merged whatever their tiers).
A row is so rewritten about ``log_F(total / flush)`` times (3 for a million rows in flushes of a
thousand): the write cost is O(rows · log rows) where a single file costs O(rows²), and a
directory holds at most :data:`MAX_PARTS` parts. A merged part is written before its sources are removed, so a reader sees
every row at every moment (a row may show twice in between: readers keep the last of a
``(config_id, step)`` by time, :func:`plora.sweepdir.reader.read_metrics`).

``pandas.read_parquet(DIR/metrics.parquet)`` reads the directory as one table; a sweep
directory written before parts (a single ``metrics.parquet`` file) is read as it is and turned
into a directory of one part when a resumed sweep appends to it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from plora.utils import atomic_path

if TYPE_CHECKING:
    import pandas as pd

FANOUT = 8
"""Parts of one tier merged into one."""
MAX_PARTS = 4 * FANOUT
"""More parts than this (flushes of uneven sizes left lower tiers behind a higher one): the
last :data:`FANOUT` are merged whatever their tiers."""
_PART = re.compile(r"^part-(\d{8})-(\d{8})\.parquet$")
_READ_TRIES = 5


class PartTable:
    """The parts of one append-only table at ``path`` (a directory).

    Args:
        path: The table (``DIR/metrics.parquet``).
        columns: Its columns, for an empty table.
        dedupe: Columns a merge keeps the last row of (a step trained again), or None.
    """

    def __init__(
        self, path: str | os.PathLike[str], columns: tuple[str, ...], *, dedupe: list[str] | None
    ) -> None:
        self.path = Path(path)
        self.columns = columns
        self.dedupe = dedupe
        self._parts: list[tuple[int, int, int]] | None = None  # (first, last, rows), in order

    # -- writing -----------------------------------------------------------------------------
    def create(self) -> None:
        """The table with no rows yet (an empty directory), unless it exists."""
        self._load()

    def append(self, df: pd.DataFrame) -> None:
        """Write ``df`` as a new part, then merge the tail parts whose tier is full."""
        if not len(df):
            return
        parts = self._load()
        n = parts[-1][1] + 1 if parts else 0
        self._write(df, n, n)
        parts.append((n, n, len(df)))
        while len(parts) >= FANOUT and (
            len({_tier(r) for _, _, r in parts[-FANOUT:]}) == 1 or len(parts) > MAX_PARTS
        ):
            self._merge(FANOUT)

    def _merge(self, k: int) -> None:
        import pandas as pd

        parts = self._load()
        tail = parts[-k:]
        df = pd.concat([self._read_part(f, last) for f, last, _ in tail], ignore_index=True)
        if self.dedupe:
            df = df.drop_duplicates(self.dedupe, keep="last", ignore_index=True)
        first, last = tail[0][0], tail[-1][1]
        self._write(df, first, last)  # the merged part first: a reader never misses a row
        del parts[-k:]
        parts.append((first, last, len(df)))
        for f, la, _ in tail:
            (self.path / _name(f, la)).unlink(missing_ok=True)

    def _write(self, df: pd.DataFrame, first: int, last: int) -> None:
        with atomic_path(self.path / _name(first, last)) as tmp:
            df.to_parquet(tmp, index=False)

    def _load(self) -> list[tuple[int, int, int]]:
        """The parts on disk (a single-file table of an older sweep becomes part 0 first)."""
        if self._parts is None:
            if self.path.is_file():
                _to_directory(self.path)
            self.path.mkdir(parents=True, exist_ok=True)
            import pyarrow.parquet as pq

            self._parts = [
                (f, last, pq.ParquetFile(self.path / _name(f, last)).metadata.num_rows)
                for f, last in _listed(self.path)
            ]
        return self._parts

    def _read_part(self, first: int, last: int) -> pd.DataFrame:
        import pandas as pd

        return pd.read_parquet(self.path / _name(first, last))

    # -- reading -----------------------------------------------------------------------------
    def read(self) -> pd.DataFrame:
        """Every row, parts in order (a single-file table as it is); empty with the columns."""
        return read_table(self.path, self.columns)


def read_table(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    """The rows of a part directory in order, or of a single parquet file; a part merged away
    while it was listed is listed again."""
    import pandas as pd

    if path.is_file():
        return pd.read_parquet(path)
    for attempt in range(_READ_TRIES):
        try:
            frames = [pd.read_parquet(path / _name(f, last)) for f, last in _listed(path)]
            break
        except FileNotFoundError:
            if attempt == _READ_TRIES - 1:
                raise
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]


def _listed(path: Path) -> list[tuple[int, int]]:
    if not path.is_dir():
        return []
    found = (_PART.match(p.name) for p in path.iterdir())
    return sorted((int(m.group(1)), int(m.group(2))) for m in found if m)


def _name(first: int, last: int) -> str:
    return f"part-{first:08d}-{last:08d}.parquet"


def _tier(rows: int) -> int:
    """``floor(log_F(rows))`` in integers."""
    tier = 0
    while rows >= FANOUT:
        rows //= FANOUT
        tier += 1
    return tier


def _to_directory(path: Path) -> None:
    """Turn a single-file table into a directory holding it as part 0 (two renames)."""
    with atomic_path(path.with_name(f".{path.name}.dir")) as tmp:
        tmp.mkdir()
        shutil.copyfile(path, tmp / _name(0, 0))
    old = path.with_name(f".{path.name}.file")
    os.replace(path, old)
    os.replace(path.with_name(f".{path.name}.dir"), path)
    old.unlink()


__all__ = ["FANOUT", "PartTable", "read_table"]
