"""Containers that say which of their keys changed, so that a write of the sweep directory costs
what changed since the last one, not the size of the sweep.

The coordinator keeps its growing books (each config's status, progress and result, the job
attempts' rows, the step measurements, the early stopper's records) in these containers, and the
store's writers (:class:`plora.sweepdir.state_parts.StateParts`, ``results.parquet`` and
``jobs.parquet``) ask each one what changed since their last write instead of comparing every
record with its last copy. That comparison was linear in the records at every write, so a sweep's
writes were quadratic in its size: at 10,000 configs on 32 logical GPUs a ``state.json`` write
grew from 30 to 133 ms and a ``results.parquet`` call from 4 to 48 ms over the sweep, 405 s of its
1,914 s (``benchmarks/control_plane.py``, RESULTS.md).

A writer keeps a *mark* -- the container (:attr:`Tracked.tracker`) and its :attr:`version` at
the last write -- and asks :meth:`Tracked.changed_since`: the keys set, deleted or
:meth:`touched <TrackedDict.touch>` since (in the order of their last change), or None when the
container cannot tell (a list shortened or reordered), and then the writer compares every record,
as it does with a plain container. A value changed in place must be touched by its owner; the
tests compare what the writers wrote with a full comparison of the same state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, SupportsIndex, TypeVar, runtime_checkable

K = TypeVar("K")
V = TypeVar("V")


@runtime_checkable
class Tracked(Protocol):
    """A container (or a view of one) that says which of its keys changed."""

    @property
    def tracker(self) -> object:
        """The container whose changes these are (a view's is its source's)."""
        ...

    @property
    def version(self) -> int:
        """Grows by one at each change."""
        ...

    def changed_since(self, version: int) -> list[Any] | None:
        """Keys changed after ``version`` (each once, latest change last); None: unknown."""
        ...


class _Changes:
    """Each key's last change, in order of change (re-changed keys move to the end)."""

    __slots__ = ("last", "unknown_after", "version")

    def __init__(self) -> None:
        self.version = 0
        self.last: dict[Any, int] = {}
        self.unknown_after = -1  # changes up to this version cannot be told by key

    def note(self, key: Any) -> None:
        self.version += 1
        self.last.pop(key, None)
        self.last[key] = self.version

    def lost(self) -> None:
        self.version += 1
        self.unknown_after = self.version

    def since(self, version: int) -> list[Any] | None:
        if version < self.unknown_after or version > self.version:
            return None
        out = []
        for key, at in reversed(self.last.items()):
            if at <= version:
                break
            out.append(key)
        out.reverse()
        return out


class _Tracks:
    """What :class:`TrackedDict` and :class:`TrackedList` share: :class:`Tracked` from their
    ``_changes``."""

    _changes: _Changes

    @property
    def tracker(self) -> object:
        return self

    @property
    def version(self) -> int:
        return self._changes.version

    def changed_since(self, version: int) -> list[Any] | None:
        return self._changes.since(version)


class TrackedDict(_Tracks, dict[K, V]):
    """A ``dict`` that records the keys set or deleted through it (its values' own changes in
    place need :meth:`touch`). Copies (``copy``, pickling) are plain containers of the same
    items with no history: a writer that meets one compares every record once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._changes = _Changes()
        self._placed = dict(zip(self, range(-len(self), 0), strict=True))  # see position

    def touch(self, key: K) -> None:
        """Record that ``key``'s value changed in place."""
        self._changes.note(key)

    def position(self, key: Any) -> int:
        """``key``'s place in the dict's order, as a number that grows with each key inserted (a
        key deleted and set again goes last, as in the dict)."""
        return self._placed[key]

    def _gone(self, key: Any) -> None:
        self._changes.note(key)
        self._placed.pop(key, None)

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self._changes.note(key)
        if key not in self._placed:
            self._placed[key] = self._changes.version

    def __delitem__(self, key: K) -> None:
        super().__delitem__(key)
        self._gone(key)

    def pop(self, key: K, *default: Any) -> Any:
        if key in self:
            self._gone(key)
        return super().pop(key, *default)

    def popitem(self) -> tuple[K, V]:
        key, value = super().popitem()
        self._gone(key)
        return key, value

    def setdefault(self, key: K, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> TrackedDict[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def clear(self) -> None:
        for key in list(self):
            self._gone(key)
        super().clear()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))


class TrackedList(_Tracks, list[V]):
    """A ``list`` whose keys are its indices: ``append``, ``extend``, item assignment and
    :meth:`touch` are recorded by index; any other change (insert, delete, sort, ...) makes the
    changes since unknown (a writer compares every record once)."""

    def __init__(self, items: Iterable[V] = ()) -> None:
        super().__init__(items)
        self._changes = _Changes()

    def touch(self, index: int) -> None:
        """Record that the item at ``index`` changed in place."""
        self._changes.note(index % len(self))

    def append(self, item: V) -> None:
        super().append(item)
        self._changes.note(len(self) - 1)

    def extend(self, items: Iterable[V]) -> None:
        for item in items:
            self.append(item)

    def __iadd__(self, items: Iterable[V]) -> TrackedList[V]:  # type: ignore[override,misc]
        self.extend(items)
        return self

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        if isinstance(index, int):
            self._changes.note(index % len(self))
        else:
            self._changes.lost()

    # the changes below move or drop items: what changed is not told by index any more
    def insert(self, index: SupportsIndex, item: V) -> None:
        super().insert(index, item)
        self._changes.lost()

    def pop(self, index: SupportsIndex = -1) -> V:
        item = super().pop(index)
        self._changes.lost()
        return item

    def remove(self, item: V) -> None:
        super().remove(item)
        self._changes.lost()

    def clear(self) -> None:
        super().clear()
        self._changes.lost()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        super().sort(*args, **kwargs)
        self._changes.lost()

    def reverse(self) -> None:
        super().reverse()
        self._changes.lost()

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        self._changes.lost()

    def __imul__(self, n: SupportsIndex) -> TrackedList[V]:
        super().__imul__(n)
        self._changes.lost()
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (list(self),))


class MappedView(Mapping[K, Any]):
    """A read-only view of a :class:`TrackedDict` with each value passed through
    ``convert(key, value)`` as it is read, tracked as its source (``state.json``'s statuses as
    text, results with their paths made relative) -- so a writer converts only what changed."""

    __slots__ = ("_convert", "_source")

    def __init__(self, source: TrackedDict[K, V], convert: Callable[[K, V], Any]) -> None:
        self._source = source
        self._convert = convert

    @property
    def tracker(self) -> object:
        return self._source

    @property
    def version(self) -> int:
        return self._source.version

    def changed_since(self, version: int) -> list[Any] | None:
        return self._source.changed_since(version)

    def __getitem__(self, key: K) -> Any:
        return self._convert(key, self._source[key])

    def __iter__(self) -> Iterator[K]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)

    def __contains__(self, key: object) -> bool:
        return key in self._source


def tracked_dict(value: Mapping[K, V] | None) -> TrackedDict[K, V]:
    """``value`` itself when it is a :class:`TrackedDict`, else a new one with its items."""
    if isinstance(value, TrackedDict):
        return value
    return TrackedDict(value or {})


def tracked_list(value: Iterable[V] | None) -> TrackedList[V]:
    """``value`` itself when it is a :class:`TrackedList`, else a new one with its items."""
    if isinstance(value, TrackedList):
        return value
    return TrackedList(value or ())


__all__ = ["MappedView", "Tracked", "TrackedDict", "TrackedList", "tracked_dict", "tracked_list"]
