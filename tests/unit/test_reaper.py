"""The driver's watchdog (:mod:`plora.runtime.actors.reaper`) without Ray: a fake driver starts
children and grandchildren; killed, they are all stopped; shut down cleanly, none is touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

DRIVER = """
import subprocess, sys, time
import psutil
from plora.runtime.actors.reaper import start_reaper
reaper = start_reaper(interval_s=0.1, grace_s=1.0)
# a child that starts a grandchild, as the raylet starts Ray's agents
child = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"])
deadline = time.monotonic() + 120  # the grandchild is up (two process starts on a busy box)
while not psutil.Process(child.pid).children() and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # ten of the watchdog's 0.1 s rounds: it records the whole tree
print(reaper.process.pid, flush=True)
if sys.argv[1] == "release":
    reaper.release()
    print(reaper.process.returncode, flush=True)
time.sleep(300)
"""


def _driver(mode: str):
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, mode], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    reaper = int(proc.stdout.readline())
    tree = {p.pid: p.create_time() for p in psutil.Process(proc.pid).children(recursive=True)}
    tree.pop(reaper)
    return proc, reaper, tree


def _alive(tree: dict[int, float]) -> list[int]:
    out = []
    for pid, created in tree.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def _cleanup(proc, tree) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
    for pid in _alive(tree):
        os.kill(pid, signal.SIGKILL)


def test_a_killed_driver_takes_its_descendants_along() -> None:
    proc, reaper, tree = _driver("kill")
    try:
        assert len(tree) >= 2 and _alive(tree)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        deadline = time.time() + 10
        while _alive(tree) and time.time() < deadline:
            time.sleep(0.1)
        assert _alive(tree) == []
        deadline = time.time() + 5
        while psutil.pid_exists(reaper) and time.time() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(reaper) or psutil.Process(reaper).status() == "zombie"
    finally:
        _cleanup(proc, tree)


def test_a_released_watchdog_exits_and_stops_nothing() -> None:
    proc, _, tree = _driver("release")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "0"
        os.kill(proc.pid, signal.SIGKILL)  # released first: this death is not the watchdog's
        proc.wait(5)
        time.sleep(1.0)
        assert sorted(_alive(tree)) == sorted(tree)
    finally:
        _cleanup(proc, tree)
