"""No process outlives its driver: a watchdog for the embedded local Ray cluster.

``ray.init()`` without an address starts a local cluster whose GCS and raylet die with the
driver, but whose agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``, started by the
raylet) are left running, re-parented to init, when the driver is killed (``SIGKILL``, OOM
killer, a lost ``ray job`` driver) instead of calling ``ray.shutdown()``.

:func:`start_reaper` starts a small watchdog process (``python -m plora.runtime.actors.reaper``) in its
own session, joined to the driver by a pipe. While the driver lives, the watchdog records the
driver's descendants (their pids and start times) every ``interval_s``; when the pipe closes
without the driver's ``done`` -- the driver died -- it stops each recorded process that is still
the same process (SIGTERM, then SIGKILL after ``grace_s``). :meth:`Reaper.release` (after
``ray.shutdown()``) tells it to exit without stopping anything. Only the driver's own
descendants are touched, never its process group (a shell pipeline shares that).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

#: What the driver writes when it shut its cluster down itself.
DONE = b"done\n"


@dataclass(slots=True)
class Reaper:
    """The running watchdog (:func:`start_reaper`)."""

    process: subprocess.Popen[bytes]

    def release(self) -> None:
        """The driver stopped Ray itself: the watchdog exits without stopping anything."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.closed:
            try:
                stdin.write(DONE)
                stdin.close()
            except OSError:  # the watchdog is gone already
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_reaper(*, interval_s: float = 0.5, grace_s: float = 3.0) -> Reaper:
    """Start the watchdog of this (driver) process's descendants."""
    cmd = [sys.executable, "-m", "plora.runtime.actors.reaper", str(os.getpid()), str(interval_s),
           str(grace_s)]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or a killed process group of the driver spares it
        close_fds=True,
    )
    return Reaper(process=proc)


def descendants(pid: int) -> dict[int, float]:
    """``{pid: create_time}`` of every live descendant of ``pid`` (empty when it is gone)."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = p.create_time()
        except psutil.Error:
            continue
    return out


def stop(processes: dict[int, float], *, grace_s: float) -> list[int]:
    """SIGTERM each process still alive with the same start time, SIGKILL it after ``grace_s``;
    the pids stopped."""
    live = []
    for pid, created in processes.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3:  # not a reused pid
                live.append(p)
        except psutil.Error:
            continue
    for p in live:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(live, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in live]


def watch(driver: int, *, interval_s: float, grace_s: float) -> None:
    """The watchdog's loop (stdin: the pipe from the driver)."""
    fd = sys.stdin.fileno()
    known: dict[int, float] = {}
    me = os.getpid()
    while True:
        known.update({p: t for p, t in descendants(driver).items() if p != me})
        ready, _, _ = select.select([fd], [], [], interval_s)
        if not ready:
            continue
        data = os.read(fd, 64)
        if data.startswith(DONE):
            return
        if not data:  # EOF without "done": the driver died
            time.sleep(0.2)  # let Ray's own fate-sharing go first
            stop(known, grace_s=grace_s)
            return


if __name__ == "__main__":  # pragma: no cover - run as the watchdog process
    watch(int(sys.argv[1]), interval_s=float(sys.argv[2]), grace_s=float(sys.argv[3]))
