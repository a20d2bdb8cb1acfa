"""One writer per sweep directory: the lock ``plora sweep`` (and ``--resume``) holds while it runs.

The lock is a small JSON file *beside* the directory, ``PARENT/.DIR.lock`` (beside, not inside,
so that it also guards a sweep directory that is still being built under its hidden temporary
name and has not been renamed into place yet)::

    {"host": "node-3", "pid": 4711, "since": "2026-11-24T21:40:00+00:00", "token": "...", ...}

Rules:

* **Taking it** is atomic and exclusive: the owner's record is written to a temporary file and
  hard-linked to the lock's name (``os.link`` fails when the name exists, also on NFS), so a reader
  never sees a half-written lock and of two writers exactly one wins (on a file system without
  hard links: ``O_CREAT | O_EXCL``).
* **A live owner** (same host, its pid alive and started before the lock was taken) is honoured:
  the second writer gets a :class:`SweepLockedError`, one line naming the owner, and changes nothing.
* **A stale lock** (same host, the pid gone, or reused by a process started after the lock) is
  taken over, and the takeover is returned as a note.
* **A lock from another host** cannot be checked from here and is honoured unless the caller
  passes ``force=True`` (``plora sweep --force-unlock``); ``force`` never breaks a lock whose owner
  is alive on this host.
* **Releasing** removes the file only while it still holds this owner's token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from plora.config import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LockOwner:
    """Who holds a sweep directory's lock (the lock file's contents)."""

    host: str
    """``socket.gethostname()`` of the owning process."""
    pid: int
    """Its process id on ``host``."""
    since: str
    """When it took the lock (ISO 8601, UTC)."""
    token: str
    """A random id of this taking, so that a release never removes somebody else's lock."""
    command: str = ""
    """The owner's command line, for the error message."""

    @classmethod
    def me(cls) -> LockOwner:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            since=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            token=uuid.uuid4().hex,
            command=" ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv)),
        )

    def describe(self) -> str:
        """``host node-3 pid 4711 since 2026-11-24T21:40:00+00:00``."""
        return f"host {self.host} pid {self.pid} since {self.since}"


class SweepLockedError(ConfigError):
    """Another live writer holds the sweep directory (``owner``)."""

    def __init__(self, problem: str, *, owner: LockOwner | None = None, **kwargs: Any) -> None:
        # keyword defaults: ConfigError.located copies the error through its one argument
        self.owner = owner
        super().__init__(problem, **kwargs)


def lock_path(sweep_dir: str | os.PathLike[str]) -> Path:
    """Where the lock of ``sweep_dir`` lives: ``PARENT/.NAME.lock``."""
    d = Path(sweep_dir).absolute()
    return d.with_name(f".{d.name}.lock")


def read_owner(sweep_dir: str | os.PathLike[str]) -> LockOwner | None:
    """The current owner of ``sweep_dir``'s lock, or None when it is free (or unreadable)."""
    return _read(lock_path(sweep_dir))


def owner_alive(owner: LockOwner) -> bool | None:
    """True/False for an owner on this host; None when it is on another host (cannot check)."""
    if owner.host != socket.gethostname():
        return None
    if owner.pid == os.getpid():
        return True
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    started = _process_start(owner.pid)
    taken = _parse_time(owner.since)
    # a pid reused by a process started after the lock was taken: the owner is gone
    return not (started is not None and taken is not None and started > taken + 2.0)


def check_not_locked(
    sweep_dir: str | os.PathLike[str], *, mine: SweepLock | None = None, force: bool = False
) -> None:
    """Raise :class:`SweepLockedError` when a live owner other than ``mine`` holds ``sweep_dir``
    (or one on another host, unless ``force``)."""
    owner = read_owner(sweep_dir)
    if owner is None or (mine is not None and owner.token == mine.owner.token):
        return
    alive = owner_alive(owner)
    if alive or (alive is None and not force):
        raise _locked(Path(sweep_dir), owner)


class SweepLock:
    """The held lock of one sweep directory; :meth:`release` gives it back (idempotent).

    ``with SweepLock.acquire(out) as lock:`` releases it on every exit of the block.
    """

    def __init__(self, sweep_dir: Path, owner: LockOwner, note: str | None) -> None:
        self.sweep_dir = sweep_dir
        self.path = lock_path(sweep_dir)
        self.owner = owner
        self.note = note
        """What the taking did beyond taking a free lock (a stale owner taken over), or None."""

    @classmethod
    def acquire(cls, sweep_dir: str | os.PathLike[str], *, force: bool = False) -> SweepLock:
        """Take the lock of ``sweep_dir`` or raise :class:`SweepLockedError` (one line).

        Args:
            sweep_dir: The sweep directory (need not exist yet; its parent is created).
            force: Also take over a lock held from another host (``--force-unlock``).

        Raises:
            SweepLockedError: A live owner holds it (or one on another host, without ``force``).
            ConfigError: The lock file cannot be written beside ``sweep_dir``.
        """
        sweep_dir = Path(sweep_dir).absolute()
        path = lock_path(sweep_dir)
        me = LockOwner.me()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            record = _write_temp(path, me)
        except OSError as e:
            raise ConfigError(
                f"--out {sweep_dir}: cannot write its lock file {path} ({e.strerror or e}); "
                "choose a writable --out"
            ) from None
        note = None
        try:
            for _ in range(5):
                try:
                    _link_or_create(record, path)
                    return cls(sweep_dir, me, note)
                except FileExistsError:
                    pass
                held = _read(path)
                if held is None:  # released meanwhile, or unreadable: retry, then give up
                    if not path.exists():
                        continue
                    raise SweepLockedError(
                        f"--out {sweep_dir}: its lock file {path} is unreadable",
                        owner=None,
                        fix="if no sweep is writing there, delete that file and rerun",
                    )
                alive = owner_alive(held)
                if alive or (alive is None and not force):
                    raise _locked(sweep_dir, held)
                why = "its process is gone" if alive is False else "--force-unlock"
                if _take_over(path, held):
                    note = f"took over the lock of {sweep_dir} from {held.describe()} ({why})"
            raise SweepLockedError(
                f"--out {sweep_dir}: could not take its lock {path} (other writers keep taking it)",
                owner=None,
                fix="make sure a single `plora sweep` writes there and rerun",
            )
        finally:
            with contextlib.suppress(OSError):
                record.unlink()
            with contextlib.suppress(OSError):
                record.parent.rmdir()

    def release(self) -> None:
        """Remove the lock file if it is still this owner's."""
        held = _read(self.path)
        if held is not None and held.token == self.owner.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __enter__(self) -> SweepLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _locked(sweep_dir: Path, owner: LockOwner) -> SweepLockedError:
    if owner_alive(owner) is None:
        fix = (
            "wait for that sweep to end, or, if it is no longer running (its host died), "
            "rerun with --force-unlock"
        )
    else:
        fix = f"wait for it to end, or stop it (kill {owner.pid}) and continue with --resume"
    cmd = f" ({owner.command})" if owner.command else ""
    return SweepLockedError(
        f"another plora sweep is writing this sweep directory: {owner.describe()}{cmd}",
        owner=owner,
        fix=fix,
        file=sweep_dir,
    )


def _write_temp(path: Path, owner: LockOwner) -> Path:
    """The owner's record, complete and fsynced, in a private temp dir beside ``path``."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{path.name}.", dir=path.parent)) / "owner.json"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(owner), f)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _link_or_create(record: Path, path: Path) -> None:
    """Put ``record`` at ``path`` unless ``path`` exists (FileExistsError): a hard link, or, on a
    file system without hard links, an ``O_CREAT | O_EXCL`` copy."""
    try:
        os.link(record, path)
        return
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some FUSE / object-store mounts)
        pass
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(record.read_bytes())
        f.flush()
        os.fsync(f.fileno())


def _read(path: Path) -> LockOwner | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return LockOwner(
            host=str(data["host"]),
            pid=int(data["pid"]),
            since=str(data["since"]),
            token=str(data["token"]),
            command=str(data.get("command", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _take_over(path: Path, stale: LockOwner) -> bool:
    """Move the stale lock aside; True when what was moved was ``stale`` (else it is put back)."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another writer took it over first
        return False
    moved = _read(aside)
    if moved is not None and moved.token != stale.token:  # a fresh owner got in between
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink()
        return False
    aside.unlink()
    return True


def _process_start(pid: int) -> float | None:
    """Start time (epoch seconds) of ``pid`` from /proc (Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _parse_time(text: str) -> float | None:
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


__all__ = [
    "LockOwner",
    "SweepLock",
    "SweepLockedError",
    "check_not_locked",
    "lock_path",
    "owner_alive",
    "read_owner",
]
