"""Which configs stand where, kept from the status book's changes.

:class:`StatusIndex` holds each status's configs in arrival order (the order of the status book,
a :class:`~plora.sweepdir.tracked.TrackedDict`), and brings itself up to date from the keys the
book says changed since it last looked. Finding the queued configs by a pass over every config's
status was linear in the sweep at each round of polls that refilled a pack: at 10,000 configs on
256 logical GPUs a poll grew from 96 to 395 µs over the sweep as more rounds refilled
(``benchmarks/control_plane.py``, RESULTS.md). Now a round costs the configs that changed status
since the last one, plus the queue it reads.
"""

from __future__ import annotations

from plora.runtime.records import ConfigStatus
from plora.sweepdir.tracked import TrackedDict


class StatusIndex:
    """Each status's config ids in arrival order, from a status book's changes."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._mark: tuple[object, int] | None = None  # (tracker, version) last read
        self._status: dict[str, ConfigStatus] = {}
        self._arrival: dict[str, int] = {}  # config id -> its place in the book
        self._by: dict[ConfigStatus, dict[str, None]] = {s: {} for s in ConfigStatus}
        self._sorted: dict[ConfigStatus, bool] = dict.fromkeys(ConfigStatus, True)

    def ids(self, book: TrackedDict[str, ConfigStatus], status: ConfigStatus) -> list[str]:
        """The configs of ``book`` in ``status``, in arrival order."""
        self._sync(book)
        group = self._by[status]
        if not self._sorted[status]:  # one came back out of order (a retry, a resume)
            self._by[status] = group = dict.fromkeys(sorted(group, key=self._arrival.__getitem__))
            self._sorted[status] = True
        return list(group)

    def count(self, book: TrackedDict[str, ConfigStatus], status: ConfigStatus) -> int:
        """How many configs of ``book`` are in ``status``."""
        self._sync(book)
        return len(self._by[status])

    def _sync(self, book: TrackedDict[str, ConfigStatus]) -> None:
        if not isinstance(book, TrackedDict):  # a plain dict: read whole at every call
            book = TrackedDict(book)
        keys = None
        if self._mark is not None and self._mark[0] is book.tracker:
            keys = book.changed_since(self._mark[1])
        if keys is None:  # another book (a restore) or history unknown: read it whole
            self._reset()
            keys = list(book)
        for cid in keys:
            old = self._status.pop(cid, None)
            if old is not None:
                del self._by[old][cid]
            if cid not in book:
                self._arrival.pop(cid, None)
                continue
            self._arrival[cid] = book.position(cid)
            new = self._status[cid] = book[cid]
            group = self._by[new]
            if group and self._sorted[new]:
                last = self._arrival[next(reversed(group))]
                self._sorted[new] = last < self._arrival[cid]
            group[cid] = None
        self._mark = (book.tracker, book.version)


__all__ = ["StatusIndex"]
