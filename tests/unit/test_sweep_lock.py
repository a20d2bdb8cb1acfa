"""One writer per sweep directory (issue 14, item 1): the lock beside ``--out``.

A live owner (this test process, or a child process) is honoured with one ``error:`` line and the
directory unchanged; a dead owner on this host is taken over; the lock is released on every exit
path of ``run_sweep`` (the real sweep's release is checked in ``tests/ray/test_quickstart.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sweep_cli import assert_one_error, no_sweep_dir, run, sweep_file

from plora.config import ConfigError
from plora.runtime import driver
from plora.sweepdir.lock import (
    LockOwner,
    SweepLock,
    SweepLockedError,
    lock_path,
    read_owner,
)


def write_lock(out: Path, *, pid: int, host: str | None = None) -> LockOwner:
    owner = dataclasses.replace(
        LockOwner.me(), pid=pid, host=host or socket.gethostname(), command="plora sweep x.yaml"
    )
    lock_path(out).write_text(json.dumps(dataclasses.asdict(owner)))
    return owner


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def fake_sweep_dir(out: Path) -> dict[str, tuple[bytes, int]]:
    """A directory that looks like a sweep (state.json, sweep.yaml, a table); its snapshot."""
    out.mkdir()
    (out / "state.json").write_text('{"configs": {}}')
    (out / "sweep.yaml").write_text("name: x\n")
    (out / "decisions.jsonl").write_text('{"kind": "plan"}\n')
    return snapshot(out.parent)


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("resume", [False, True])
def test_second_writer_is_refused_with_one_line_and_nothing_changes(tmp_path, resume) -> None:
    path = sweep_file(tmp_path)
    out = tmp_path / "out"
    if resume:
        fake_sweep_dir(out)
    write_lock(out, pid=os.getpid())  # a live owner: this very process
    before = snapshot(tmp_path)
    args = ["sweep", str(path), "--out", str(out)] + (["--resume"] if resume else [])
    result = run(*args)
    assert_one_error(
        result, "another plora sweep is writing", f"pid {os.getpid()}", socket.gethostname(),
        "since", "kill",
    )  # fmt: skip
    assert snapshot(tmp_path) == before
    if not resume:
        assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_lock_from_another_host_is_honoured_unless_forced(tmp_path) -> None:
    out = tmp_path / "out"
    owner = write_lock(out, pid=os.getpid(), host="elsewhere.invalid")
    with pytest.raises(SweepLockedError, match=r"host elsewhere\.invalid.*--force-unlock"):
        SweepLock.acquire(out)
    assert read_owner(out) == owner
    with SweepLock.acquire(out, force=True) as lock:
        assert lock.note and "elsewhere.invalid" in lock.note
        assert read_owner(out) == lock.owner
    assert not lock_path(out).exists()


def test_force_unlock_reaches_the_driver(tmp_path, monkeypatch) -> None:
    out = tmp_path / "out"
    write_lock(out, pid=os.getpid(), host="elsewhere.invalid")
    monkeypatch.setattr(driver, "_drive", lambda sweep, out_, **kw: read_owner(out_))
    monkeypatch.setattr(driver, "check_address", lambda address: None)
    with pytest.raises(SweepLockedError, match="--force-unlock"):
        driver.run_sweep(None, out)
    owner = driver.run_sweep(None, out, options=driver.RunOptions(force_unlock=True))
    assert owner.pid == os.getpid() and owner.host == socket.gethostname()
    assert not lock_path(out).exists()


def test_force_never_breaks_a_live_owner_on_this_host(tmp_path) -> None:
    out = tmp_path / "out"
    write_lock(out, pid=os.getpid())
    with pytest.raises(SweepLockedError, match=f"pid {os.getpid()}"):
        SweepLock.acquire(out, force=True)


def test_a_stale_lock_is_taken_over_and_the_lock_released_on_every_exit(
    tmp_path, monkeypatch, caplog
) -> None:
    out = tmp_path / "out"
    seen: list[LockOwner | None] = []

    def fake_run(sweep, out_, **kw):
        seen.append(read_owner(out_))
        if kw["options"].checkpoint_every == 7:
            raise KeyboardInterrupt
        if kw["options"].checkpoint_every == 8:
            raise RuntimeError("boom")
        return "summary"

    monkeypatch.setattr(driver, "_drive", fake_run)
    monkeypatch.setattr(driver, "check_address", lambda address: None)
    stale = write_lock(out, pid=dead_pid())
    with caplog.at_level(logging.WARNING, logger="plora.runtime.driver"):
        assert driver.run_sweep(None, out) == "summary"
    assert seen[-1] is not None and seen[-1].pid == os.getpid() and seen[-1] != stale
    assert f"pid {stale.pid}" in caplog.text and "took over" in caplog.text
    assert not lock_path(out).exists()  # released after success
    for every, exc in ((7, KeyboardInterrupt), (8, RuntimeError)):
        with pytest.raises(exc):
            driver.run_sweep(None, out, options=driver.RunOptions(checkpoint_every=every))
        assert seen[-1] is not None and seen[-1].pid == os.getpid()
        assert not lock_path(out).exists()  # released after Ctrl-C and after a failure


def test_two_processes_one_lock(tmp_path) -> None:
    """A real second process holds the lock: refused while it lives, taken over once it is gone."""
    out = tmp_path / "out"
    code = (
        "import sys, time; from plora.sweepdir.lock import SweepLock; "
        f"SweepLock.acquire({str(out)!r}); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(SweepLockedError, match=f"pid {proc.pid}"):
            SweepLock.acquire(out)
    finally:
        proc.kill()
        proc.wait()
    with SweepLock.acquire(out) as lock:  # killed without releasing: stale, taken over
        assert lock.note and f"pid {proc.pid}" in lock.note
    assert not lock_path(out).exists()


def test_a_lock_held_elsewhere_is_never_removed_by_release(tmp_path) -> None:
    out = tmp_path / "out"
    lock = SweepLock.acquire(out)
    other = write_lock(out, pid=os.getpid())  # replaced behind our back (e.g. --force-unlock)
    lock.release()
    assert read_owner(out) == other


def test_unwritable_parent_is_one_line(tmp_path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"--out .*choose a writable --out") as info:
        SweepLock.acquire(blocker / "out")
    assert "\n" not in str(info.value)


def test_acquire_is_fast(tmp_path) -> None:
    t0 = time.monotonic()
    for i in range(20):
        with SweepLock.acquire(tmp_path / f"o{i}"):
            pass
    assert time.monotonic() - t0 < 2.0
    no_sweep_dir(tmp_path / "o0")


def test_without_hard_links_o_excl_still_gives_one_owner(tmp_path, monkeypatch) -> None:
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "out"
    with SweepLock.acquire(out) as lock:
        assert read_owner(out) == lock.owner
        with pytest.raises(SweepLockedError, match=f"pid {os.getpid()}"):
            SweepLock.acquire(out)
    assert not lock_path(out).exists()


def test_cli_passes_force_unlock(tmp_path, monkeypatch) -> None:
    import plora.api

    seen = {}

    def fake_run(spec, out, **kwargs):
        seen["force"] = kwargs["options"].force_unlock
        raise KeyboardInterrupt  # end the command without a summary

    monkeypatch.setattr(plora.api, "run", fake_run)
    path = str(sweep_file(tmp_path))
    run("sweep", path, "--out", str(tmp_path / "out"), "--force-unlock")
    assert seen == {"force": True}
    run("sweep", path, "--out", str(tmp_path / "out"))
    assert seen == {"force": False}
