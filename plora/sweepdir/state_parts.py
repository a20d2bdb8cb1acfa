"""``state.json`` in parts: the sections that grow with the sweep as append-only logs.

``state.json`` (the *head*) is replaced atomically at every write, as before, but the sections
that grow with the sweep -- :data:`SECTIONS`: the configs, their status, progress and results,
the job attempts' rows, the step measurements and the early stopper's records -- live in ``DIR/state.parts/<section>.<token>.jsonl``, one JSON
line per record (``[key, value]``, or ``[key]`` for a deleted key; the last line of a key wins),
appended with only the records that changed since the last write. Rewriting the whole state at
every driver-loop turn made a sweep's state writes quadratic in its size (99 -> 244 ms a write at
2,000 configs, 6.3 MB: ``benchmarks/control_plane.py``).

The head names each section's log and how many of its bytes count (``"parts"``); a reader takes
the head, then that many bytes of each log, so lines appended after the last head (a driver
killed between the two) are not seen, and a half-written line never is. A writer starts a new
log (its records once each, under a new token, written atomically) at its first write and when
a log holds more than :data:`COMPACT_FACTOR` times its live bytes; the head switches to it
atomically and the logs it replaced are deleted after. A head without ``"parts"`` (a sweep
directory written before) is the whole state.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from plora.utils import atomic_write_text

#: The sections kept as logs: a top-level key, or a key inside a top-level mapping.
SECTIONS: tuple[tuple[str, ...], ...] = (
    ("configs",),
    ("results",),
    ("job_rows",),
    ("measurements", "steps"),
    ("status",),
    ("progress",),
    ("early_stop", "known"),
    ("early_stop", "stopped"),
    ("early_stop", "asha", "trial_bracket"),
    ("early_stop", "asha", "records"),
)

PARTS_DIR = "state.parts"

#: A log is written anew once it holds this many times the bytes of its live records.
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


def _line(key: Any, *value: Any) -> str:
    return json.dumps([key, *value], separators=(",", ":"), default=str) + "\n"


class _Log:
    """One section's log as this writer last wrote it."""

    def __init__(self, file: str, kind: str) -> None:
        self.file = file  # its name in PARTS_DIR (the directory may be renamed: see root)
        self.kind = kind  # "list" (keys are indices) or "dict"
        self.size = 0
        self.live: dict[Any, int] = {}  # bytes of each key's last line
        self.seen: dict[Any, Any] = {}  # a copy of each key's value as written


class StateParts:
    """Splits the state into the head and the section logs of one sweep directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        """The sweep directory now (the store sets it: a new directory is renamed into place)."""
        self._logs: dict[str, _Log] = {}
        self._stale: set[str] = set()

    @property
    def dir(self) -> Path:
        return self.root / PARTS_DIR

    def split(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Append each section's changes to its log (durable on return) and return the head
        to write: ``state`` without the sections, with ``"parts"`` naming the logs."""
        head = dict(state)
        parts: dict[str, Any] = {}
        for path in SECTIONS:
            holder = _holder(head, path[:-1])
            if holder is None or not isinstance(holder.get(path[-1]), (list, Mapping)):
                continue
            name = ".".join(path)
            parts[name] = self._write(name, holder.pop(path[-1]))
        if parts:
            head["parts"] = parts
        return head

    def written(self) -> None:
        """The head naming the current logs is on disk: delete the logs it replaced."""
        for file in self._stale:
            (self.dir / file).unlink(missing_ok=True)
        self._stale.clear()

    def _write(self, name: str, value: list[Any] | Mapping[str, Any]) -> dict[str, Any]:
        kind = "list" if isinstance(value, list) else "dict"
        items = list(enumerate(value)) if isinstance(value, list) else list(value.items())
        log = self._logs.get(name)
        if (
            log is None
            or log.kind != kind
            or log.size > COMPACT_FACTOR * sum(log.live.values()) + (1 << 16)
        ):
            log = self._fresh(name, kind, items)
        else:
            lines = []
            for key, v in items:
                if log.seen.get(key, _MISSING) != v:
                    text = _line(key, v)
                    lines.append(text)
                    log.live[key] = len(text.encode())
                    log.seen[key] = copy.deepcopy(v)
            keep = {k for k, _ in items}
            for key in [k for k in log.seen if k not in keep]:
                del log.seen[key], log.live[key]
                if kind == "dict":
                    lines.append(_line(key))
            if lines:
                data = "".join(lines).encode()
                with open(self.dir / log.file, "ab") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                log.size += len(data)
        out: dict[str, Any] = {"file": f"{PARTS_DIR}/{log.file}", "bytes": log.size}
        if kind == "list":
            out["count"] = len(items)
        return out

    def _fresh(self, name: str, kind: str, items: list[tuple[Any, Any]]) -> _Log:
        """A new log holding ``items`` once each (written atomically)."""
        self.dir.mkdir(exist_ok=True)
        old = self._logs.get(name)
        if old is not None:
            self._stale.add(old.file)
        else:  # this writer's first: every log of the section left by an earlier writer goes
            self._stale.update(p.name for p in self.dir.glob(f"{name}.*.jsonl"))
        log = _Log(f"{name}.{secrets.token_hex(4)}.jsonl", kind)
        lines = []
        for key, v in items:
            text = _line(key, v)
            lines.append(text)
            log.live[key] = len(text.encode())
            log.seen[key] = copy.deepcopy(v)
        text = "".join(lines)
        atomic_write_text(self.dir / log.file, text)
        log.size = len(text.encode())
        self._stale.discard(log.file)
        self._logs[name] = log
        return log


def assemble(root: Path, head: Mapping[str, Any]) -> dict[str, Any]:
    """The whole state from its head and the logs it names (a head without ``"parts"`` is
    the whole state). ValueError when a log is missing or shorter than the head says."""
    state = dict(head)
    parts = state.pop("parts", None)
    if not parts:
        return state
    for name, ref in parts.items():
        path = Path(root) / ref["file"]
        try:
            with open(path, "rb") as f:
                data = f.read(int(ref["bytes"]))
        except OSError as e:
            raise ValueError(f"{path}: state log unreadable ({e})") from None
        if len(data) != int(ref["bytes"]):
            raise ValueError(
                f"{path}: state log holds {len(data)} bytes, state.json names {ref['bytes']}"
            )
        records: dict[Any, Any] = {}
        for line in data.decode().splitlines():
            rec = json.loads(line)
            if len(rec) == 1:
                records.pop(rec[0], None)
            else:
                records[rec[0]] = rec[1]
        value: Any
        value = [records[i] for i in range(int(ref["count"]))] if "count" in ref else records
        *outer, last = name.split(".")
        holder = state
        for key in outer:
            holder[key] = holder = dict(holder.get(key) or {})
        holder[last] = value
    return state


def assemble_live(
    root: Path, head: Mapping[str, Any], read_head: Callable[[], Mapping[str, Any]]
) -> dict[str, Any]:
    """:func:`assemble` of ``head``, with the head read again (``read_head``) while it changes
    under the reader: a live writer that compacts a log deletes the one an older head named, so a
    reader (``plora status``, a test polling a running sweep) that read the head just before
    finds it gone. ValueError as :func:`assemble` when the head stays the same."""
    for _ in range(5):
        try:
            return assemble(root, head)
        except ValueError:
            again = read_head()
            if again == head:
                raise
            head = again
    return assemble(root, head)


__all__ = ["PARTS_DIR", "SECTIONS", "StateParts", "assemble", "assemble_live"]
