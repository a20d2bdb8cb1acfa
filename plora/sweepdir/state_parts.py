"""``state.json`` in parts: the sections that grow with the sweep in one append-only log.

``state.json`` (the *head*) is replaced atomically at every write, as before, but the sections
that grow with the sweep -- :data:`SECTIONS`: the configs, their status, progress and results,
the job attempts' rows, the step measurements and the early stopper's records -- live in one
log, ``DIR/state.parts/state.<token>.jsonl``: one JSON line per record (``[section, key,
value]``, or ``[section, key]`` for a deleted key; the last line of a key wins), appended with
only the records that changed since the last write and made durable with one ``fsync``.
Rewriting the whole state at every driver-loop turn made a sweep's state writes quadratic in its
size (99 -> 244 ms a write at 2,000 configs, 6.3 MB: ``benchmarks/control_plane.py``); a log
per section paid an ``fsync`` per changed section.

The head names the log, how many of its bytes count and which sections it holds (``"parts"``); a
reader takes the head, then that many bytes of the log, so lines appended after the last head (a
driver killed between the two) are not seen, and a half-written line never is. A writer starts a
new log (its records once each, under a new token, written atomically) at its first write and
when the log holds more than :data:`COMPACT_FACTOR` times its live bytes; the head switches to
it atomically and the log it replaced is deleted after. A head without ``"parts"`` (a sweep
directory written before) is the whole state; one whose parts name a log per section (layout
version 3) is read as such.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
from collections.abc import Callable, Collection, Mapping
from itertools import compress, repeat
from operator import ne
from pathlib import Path
from typing import Any

from plora.sweepdir.tracked import Tracked
from plora.utils import atomic_write_text

#: The sections kept in the log: a top-level key, or a key inside top-level mappings.
SECTIONS: tuple[tuple[str, ...], ...] = (
    ("configs",),
    ("results",),
    ("job_rows",),
    ("measurements", "steps"),
    ("measurements", "overheads"),
    ("status",),
    ("progress",),
    ("early_stop", "known"),
    ("early_stop", "stopped"),
    ("early_stop", "asha", "trial_bracket"),
    ("early_stop", "asha", "records"),
)

PARTS_DIR = "state.parts"

#: The log is written anew once it holds this many times the bytes of its live records.
COMPACT_FACTOR = 3

_MISSING = object()


def _holder(head: dict[str, Any], outer: tuple[str, ...]) -> dict[str, Any] | None:
    """The mapping of ``head`` at ``outer`` (copied on the way, so the caller's state is not
    changed), or None where there is none."""
    holder = head
    for key in outer:
        inner = holder.get(key)
        if not isinstance(inner, Mapping):
            return None
        copied = dict(inner)
        holder[key] = copied
        holder = copied
    return holder


def _line(*record: Any) -> str:
    return json.dumps(list(record), separators=(",", ":"), default=str) + "\n"


def _items(value: list[Any] | Mapping[str, Any]) -> list[tuple[Any, Any]]:
    return list(enumerate(value)) if isinstance(value, list) else list(value.items())


def _changes(seen: Mapping[Any, Any], value: list[Any] | Mapping[str, Any]) -> list[Any]:
    """The keys of ``value`` whose value is not ``seen``'s (new ones too). Each write compares
    every record with its last copy, so that no change is missed (the caller's records change in
    place); iterated in C (``map``, ``compress``) instead of a Python loop, it costs a third
    (4.4 -> 1.4 s over the writes of 2,000 configs, profiled: ``benchmarks/state_writes.py``)."""
    keys: range | Any = range(len(value)) if isinstance(value, list) else value.keys()
    values = value if isinstance(value, list) else value.values()
    return list(compress(keys, map(ne, values, map(seen.get, keys, repeat(_MISSING)))))


class _Log:
    """The log as this writer last wrote it."""

    def __init__(self, file: str) -> None:
        self.file = file  # its name in PARTS_DIR (the directory may be renamed: see root)
        self.size = 0
        self.kinds: dict[str, str] = {}  # section -> "list" (keys are indices) or "dict"
        self.live: dict[str, dict[Any, int]] = {}  # section -> bytes of each key's last line
        self.live_bytes = 0  # their sum
        self.seen: dict[str, dict[Any, Any]] = {}  # section -> a copy of each key's value
        self.marks: dict[str, tuple[object, int]] = {}  # section -> (tracker, version) written

    def record(self, name: str, key: Any, value: Any) -> str:
        text = _line(name, key, value)
        live, size = self.live.setdefault(name, {}), len(text.encode())
        self.live_bytes += size - live.get(key, 0)
        live[key] = size
        self.seen.setdefault(name, {})[key] = copy.deepcopy(value)
        return text

    def delete(self, name: str, key: Any) -> str:
        del self.seen[name][key]
        self.live_bytes -= self.live[name].pop(key)
        return _line(name, key)


class StateParts:
    """Splits the state into the head and the log of one sweep directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        """The sweep directory now (the store sets it: a new directory is renamed into place)."""
        self._log: _Log | None = None
        self._stale: set[str] = set()

    @property
    def dir(self) -> Path:
        return self.root / PARTS_DIR

    def split(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Append the sections' changes to the log (durable on return) and return the head to
        write: ``state`` without the sections, with ``"parts"`` naming the log."""
        head = dict(state)
        sections: dict[str, list[Any] | Mapping[str, Any]] = {}
        for path in SECTIONS:
            holder = _holder(head, path[:-1])
            if holder is not None and isinstance(holder.get(path[-1]), (list, Mapping)):
                sections[".".join(path)] = holder.pop(path[-1])
        if sections:
            head["parts"] = self._write(sections)
        return head

    def written(self) -> None:
        """The head naming the current log is on disk: delete the logs it replaced."""
        for file in self._stale:
            (self.dir / file).unlink(missing_ok=True)
        self._stale.clear()

    def _write(self, sections: Mapping[str, list[Any] | Mapping[str, Any]]) -> dict[str, Any]:
        kinds = {n: "list" if isinstance(v, list) else "dict" for n, v in sections.items()}
        log = self._log
        if (
            log is None
            or any(log.kinds.get(n, k) != k for n, k in kinds.items())
            or log.size > COMPACT_FACTOR * log.live_bytes + (1 << 16)
        ):
            log = self._fresh(sections, kinds)
        else:
            lines = []
            for name, value in sections.items():
                lines += self._section_lines(log, name, value)
            log.kinds.update(kinds)
            if lines:
                data = "".join(lines).encode()
                with open(self.dir / log.file, "ab") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                log.size += len(data)
        log.marks = {
            n: (v.tracker, v.version) for n, v in sections.items() if isinstance(v, Tracked)
        }
        held = {n: {"count": len(v)} if isinstance(v, list) else {} for n, v in sections.items()}
        return {"file": f"{PARTS_DIR}/{log.file}", "bytes": log.size, "sections": held}

    @staticmethod
    def _section_lines(log: _Log, name: str, value: list[Any] | Mapping[str, Any]) -> list[str]:
        """The log lines of ``value``'s records changed since ``log`` last wrote the section:
        those its tracker names (:mod:`plora.sweepdir.tracked`) when it is the one last written,
        else every record compared with its last copy."""
        seen = log.seen.setdefault(name, {})
        keys = None
        mark = log.marks.get(name)
        if mark is not None and isinstance(value, Tracked) and value.tracker is mark[0]:
            keys = value.changed_since(mark[1])
        if keys is None:
            changed = _changes(seen, value)
            lines = [log.record(name, k, value[k]) for k in changed]
            if len(seen) > len(value):  # every key of value is in seen now: some went
                if isinstance(value, list):
                    gone: list[Any] = list(range(len(value), len(seen)))
                else:
                    gone = [k for k in seen if k not in value]
                lines += [log.delete(name, k) for k in gone]
            return lines
        lines = []
        size = len(value)
        for k in keys:
            present = k < size if isinstance(value, list) else k in value
            if present:
                v = value[k]
                if seen.get(k, _MISSING) != v:
                    lines.append(log.record(name, k, v))
            elif k in seen:  # a list cut short tells no keys (None): only a dict's keys go
                lines.append(log.delete(name, k))
        return lines

    def _fresh(
        self, sections: Mapping[str, list[Any] | Mapping[str, Any]], kinds: dict[str, str]
    ) -> _Log:
        """A new log holding the sections' records once each (written atomically); ``kinds``:
        each section's, as :meth:`_write` found them."""
        self.dir.mkdir(exist_ok=True)
        if self._log is not None:
            self._stale.add(self._log.file)
        else:  # this writer's first: every log left by an earlier writer goes
            self._stale.update(p.name for p in self.dir.glob("*.jsonl"))
        log = _Log(f"state.{secrets.token_hex(4)}.jsonl")
        text = "".join(
            log.record(name, k, v) for name, value in sections.items() for k, v in _items(value)
        )
        log.kinds = kinds
        atomic_write_text(self.dir / log.file, text)
        log.size = len(text.encode())
        self._stale.discard(log.file)
        self._log = log
        return log


def assemble(
    root: Path, head: Mapping[str, Any], *, sections: Collection[str] | None = None
) -> dict[str, Any]:
    """The whole state from its head and the log it names (a head without ``"parts"`` is the
    whole state; layout version 3 named a log per section). ValueError when a log is missing
    or shorter than the head says.

    ``sections`` (names as :data:`SECTIONS` gives them) keeps only those of the logged sections
    and leaves the others out: only their lines are decoded (``plora status`` needs ``status``,
    87 KB of a 4 MB log at 1,000 configs)."""
    state = dict(head)
    parts = state.pop("parts", None)
    if not parts:
        return state
    if "file" in parts:  # one log, its lines [section, key, value?]
        refs = parts["sections"]
        wanted = None if sections is None else [n for n in refs if n in sections]
        found = _read_log(Path(root) / parts["file"], int(parts["bytes"]), only=wanted)
    else:  # layout version 3: a log per section, its lines [key, value?]
        refs, found = parts, {}
        for name, ref in parts.items():
            if sections is None or name in sections:
                log = _read_log(Path(root) / ref["file"], int(ref["bytes"]), tagged=False)
                found[name] = log.get("", {})
    for name, ref in refs.items():
        if sections is not None and name not in sections:
            continue
        records = found.get(name, {})
        count = ref.get("count")
        value = [records[i] for i in range(int(count))] if count is not None else records
        *outer, last = name.split(".")
        holder = state
        for key in outer:
            holder[key] = holder = dict(holder.get(key) or {})
        holder[last] = value
    return state


def _read_log(
    path: Path, size: int, *, tagged: bool = True, only: list[str] | None = None
) -> dict[str, dict[Any, Any]]:
    """The first ``size`` bytes of a log as records by section (untagged lines: section "");
    ``only``: just the lines of these sections of a tagged log (the others are not decoded)."""
    try:
        with open(path, "rb") as f:
            data = f.read(size)
    except OSError as e:
        raise ValueError(f"{path}: state log unreadable ({e})") from None
    if len(data) != size:
        raise ValueError(f"{path}: state log holds {len(data)} bytes, state.json names {size}")
    prefixes = None if only is None else tuple(_line(name).encode()[:-2] + b"," for name in only)
    out: dict[str, dict[Any, Any]] = {}
    for line in data.splitlines():
        if prefixes is not None and not line.startswith(prefixes):
            continue
        rec = json.loads(line)
        name, rec = (rec[0], rec[1:]) if tagged else ("", rec)
        records = out.setdefault(name, {})
        if len(rec) == 1:
            records.pop(rec[0], None)
        else:
            records[rec[0]] = rec[1]
    return out


def assemble_live(
    root: Path,
    head: Mapping[str, Any],
    read_head: Callable[[], Mapping[str, Any]],
    *,
    sections: Collection[str] | None = None,
) -> dict[str, Any]:
    """:func:`assemble` of ``head``, with the head read again (``read_head``) while it changes
    under the reader: a live writer that compacts a log deletes the one an older head named, so a
    reader (``plora status``, a test polling a running sweep) that read the head just before
    finds it gone. ValueError as :func:`assemble` when the head stays the same; ``sections``
    as there."""
    for _ in range(5):
        try:
            return assemble(root, head, sections=sections)
        except ValueError:
            again = read_head()
            if again == head:
                raise
            head = again
    return assemble(root, head, sections=sections)


__all__ = ["PARTS_DIR", "SECTIONS", "StateParts", "assemble", "assemble_live"]
