"""What ``benchmarks/control_plane.py`` measures in the driver: timing wrappers around the
runtime's event handlers, its plan function and the sweep directory's writers, plus a sampler
of the driver process's CPU and memory (psutil).

The wrappers replace class and module attributes while installed (:meth:`Probe.install`) and
put them back after (:meth:`Probe.uninstall`); the product code is unchanged.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections import defaultdict
from typing import Any

import psutil

from plora.runtime.coordinator import Coordinator, scheduling
from plora.sweepdir.store import SweepStore

EVENTS = {
    "on_reports": "on_reports",
    "on_job_finished": "on_job_finished",
    "on_job_failed": "on_job_failed",
    "_poll": "poll",  # one job's poll (the driver polls its jobs in a round: poll_all)
    "stop_config": "stop_config",
    "tick": "tick",
}
"""The coordinator's methods timed, one call an event, by the name the report gives them."""
WRITES = ("flush_metrics", "write_results", "write_jobs", "write_state")
BINS = 10
"""The sweep in tenths, by configs finished: per-event work is reported per tenth."""


class Probe:
    """Times the driver's events, plans and writes while a sweep runs."""

    def __init__(self, *, total: int) -> None:
        self.total = total
        self.done = threading.Event()
        self.coord: Coordinator | None = None
        self.t0 = time.perf_counter()
        self.plans: list[dict[str, float]] = []
        # (event, tenth) -> [count, seconds, rows]
        self.events: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0])
        self.writes: dict[str, list[tuple[int, float]]] = defaultdict(list)  # -> (rows, s)
        self.rows = 0
        """Metric rows handed to the sweep directory so far."""
        self._saved: list[tuple[Any, str, Any]] = []
        self._proc = psutil.Process()
        self._rss_peak = 0
        self._cpu0 = self._proc.cpu_times()

    # -- what the killer thread and the report read ---------------------------------------
    def finished(self) -> int:
        return 0 if self.coord is None else len(self.coord.results)

    def failures(self) -> int:
        return sum(int(v[0]) for (e, _), v in self.events.items() if e == "on_job_failed")

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.t0, 2)

    def _tenth(self) -> int:
        return min(BINS - 1, self.finished() * BINS // max(self.total, 1))

    # -- wrappers -------------------------------------------------------------------------
    def install(self) -> None:
        for attr, name in EVENTS.items():
            self._wrap(Coordinator, attr, self._event(name))
        self._wrap(scheduling, "plan", self._plan)
        for name in WRITES:
            self._wrap(SweepStore, name, self._write(name))
        self._wrap(SweepStore, "append_metrics", self._count)
        threading.Thread(target=self._sample, daemon=True, name="probe-sampler").start()

    def uninstall(self) -> None:
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()

    def _wrap(self, owner: Any, name: str, make: Any) -> None:
        old = getattr(owner, name)
        self._saved.append((owner, name, old))
        setattr(owner, name, functools.wraps(old)(make(old)))

    def _event(self, name: str) -> Any:
        def make(old: Any) -> Any:
            def timed(coord: Coordinator, *a: Any, **k: Any) -> Any:
                self.coord = coord
                tenth = self._tenth()
                t = time.perf_counter()
                try:
                    return old(coord, *a, **k)
                finally:
                    rec = self.events[(name, tenth)]
                    rec[0] += 1
                    rec[1] += time.perf_counter() - t
                    if name == "on_reports":
                        rec[2] += sum(len(r.metrics) for r in a[1])

            return timed

        return make

    def _plan(self, old: Any) -> Any:
        def timed(state: Any, trigger: str) -> Any:
            queued = len(state.configs.queued_ids())
            t = time.perf_counter()
            try:
                return old(state, trigger)
            finally:
                self.plans.append({"s": time.perf_counter() - t, "queued": queued,
                                   "at_s": time.perf_counter() - self.t0})  # fmt: skip

        return timed

    def _write(self, name: str) -> Any:
        def make(old: Any) -> Any:
            def timed(store: SweepStore, *a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return old(store, *a, **k)
                finally:
                    dt = time.perf_counter() - t
                    self.writes[name].append((self.rows, dt))

            return timed

        return make

    def _count(self, old: Any) -> Any:
        def counted(store: SweepStore, rows: Any) -> Any:
            rows = list(rows)
            self.rows += len(rows)
            return old(store, rows)

        return counted

    def _sample(self) -> None:
        while not self.done.is_set():
            self._rss_peak = max(self._rss_peak, self._proc.memory_info().rss)
            time.sleep(0.5)

    # -- the report -----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        cpu = self._proc.cpu_times()
        cpu_s = (cpu.user - self._cpu0.user) + (cpu.system - self._cpu0.system)
        wall = time.perf_counter() - self.t0
        handled = sum(int(v[0]) for v in self.events.values())
        event_s = sum(v[1] for v in self.events.values())
        plan_s = [p["s"] for p in self.plans]
        return {
            "replan": _stats(plan_s)
            | {"queued_first": self.plans[0]["queued"] if self.plans else 0},
            "events": {
                "handled": handled,
                "per_s": round(handled / wall, 1),
                "driver_s_in_events": round(event_s, 2),
                "us_per_event_by_tenth": self._per_tenth(),
            },
            "driver": {
                "cpu_s": round(cpu_s, 1),
                "cpu_pct_of_one_core": round(100 * cpu_s / wall, 1),
                "rss_peak_mib": round(self._rss_peak / 2**20, 1),
            },
            "writes": {"metric_rows": self.rows}
            | {name: self._write_stats(rows) for name, rows in self.writes.items()},
        }

    def _per_tenth(self) -> dict[str, list[float | None]]:
        """Mean microseconds per event (per metric row for ``on_reports``) in each tenth."""
        out: dict[str, list[float | None]] = {}
        for name in EVENTS.values():
            row: list[float | None] = []
            for b in range(BINS):
                n, s, rows = self.events.get((name, b), (0, 0.0, 0))
                per = rows if name == "on_reports" else n
                row.append(round(1e6 * s / per, 1) if per else None)
            if any(v is not None for v in row):
                out[name if name != "on_reports" else "on_reports (per row)"] = row
        return out

    def _write_stats(self, rows: list[tuple[int, float]]) -> dict[str, Any]:
        """Calls, seconds, and the mean milliseconds per call in each tenth of the metric rows
        (a write whose cost grows with the rows already written shows it here)."""
        by: dict[int, list[float]] = defaultdict(list)
        for done, s in rows:
            by[min(BINS - 1, done * BINS // max(self.rows, 1))].append(s)
        return {
            "calls": len(rows),
            "max_ms": round(1e3 * max((s for _, s in rows), default=0.0), 2),
            "total_s": round(sum(s for _, s in rows), 2),
            "ms_by_tenth": [
                round(1e3 * statistics.fmean(by[b]), 2) if by.get(b) else None for b in range(BINS)
            ],
        }


def _stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(s), "median_s": round(s[len(s) // 2], 3),
            "p95_s": round(s[min(len(s) - 1, int(0.95 * len(s)))], 3),
            "max_s": round(s[-1], 3), "total_s": round(sum(s), 2)}  # fmt: skip
