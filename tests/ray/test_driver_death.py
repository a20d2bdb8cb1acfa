"""Fault test: no process outlives its driver. A driver that started an embedded local Ray
(``plora.runtime.actors.cluster.connect``) is SIGKILLed; every process it had started -- GCS, raylet,
workers and Ray's agents, which Ray itself leaves running -- is gone within seconds (the
watchdog alone, without Ray: ``tests/unit/test_reaper.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

DRIVER = """
import os, sys, time
import ray
from plora.runtime.actors import cluster
assert cluster.connect("local", num_gpus=1)

@ray.remote(num_cpus=0)
class A:
    def pid(self):
        return os.getpid()

a = A.remote()
print("actor", ray.get(a.pid.remote()), flush=True)
print("ready", flush=True)
time.sleep(600)
"""


def _start() -> subprocess.Popen[str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": ""}
    return subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # fmt: skip


def _read_until(proc: subprocess.Popen[str], word: str, timeout_s: float = 120) -> list[str]:
    lines: list[str] = []
    deadline = time.time() + timeout_s
    assert proc.stdout is not None
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"driver exited early: {lines}")
        lines.append(line.split())
        if line.startswith(word):
            return lines
    raise AssertionError(f"no {word!r} line in {timeout_s}s")


def test_a_killed_driver_leaves_no_process_behind() -> None:
    proc = _start()
    try:
        lines = _read_until(proc, "ready")
        actor = int(next(x for x in lines if x[0] == "actor")[1])
        tree = {p.pid: (p.create_time(), p.name()) for p in psutil.Process(proc.pid).children(True)}
        tree.update({p.pid: (p.create_time(), p.name()) for p in _late_children(tree)})
        assert actor in tree
        assert any("Agent" in name for _, name in tree.values()), tree  # the ones Ray leaves
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.time() + 30
        while time.time() < deadline and _alive(tree):
            time.sleep(0.5)
        assert not _alive(tree), f"outlived the driver: {_alive(tree)}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        for pid in _alive(tree if "tree" in locals() else {}):  # never leave our own behind
            os.kill(pid, signal.SIGKILL)


def _late_children(tree: dict[int, tuple[float, str]]) -> list[psutil.Process]:
    out = []
    for pid in list(tree):
        try:
            out += psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
    return out


def _alive(tree: dict[int, tuple[float, str]]) -> dict[int, str]:
    left = {}
    for pid, (created, name) in tree.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                left[pid] = name
        except psutil.Error:
            continue
    return left
