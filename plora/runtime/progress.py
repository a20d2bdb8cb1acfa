"""Progress of a running sweep: a live rich table on a TTY, plain lines otherwise; and the
``plora status DIR`` summary, read from the sweep directory alone."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from plora.sweepdir.reader import objective, read_sweep
from plora.sweepdir.store import SweepStore


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def summary_line(snap: Mapping[str, Any]) -> str:
    """One line: elapsed, configs done/running/queued/failed, jobs, GPUs busy, ETA."""
    c = snap["counts"]
    return (
        f"[{_fmt_s(snap['now_s'])}] configs done {c['done'] + c['stopped']}"
        f" running {c['running']} queued {c['queued']} failed {c['failed']}"
        f" | jobs {c['jobs_running']} | GPUs busy {c['gpus_busy']}/{snap['num_gpus']}"
        f" | ETA {_fmt_s(snap.get('eta_s'))}"
    )


class Progress:
    """Receives coordinator snapshots (``on_update``) and shows them.

    Args:
        stream: Where to write (default stderr).
        live: Rich live view; default: when ``stream`` is a TTY.
        every_s: Plain mode prints at most this often (and on every count change).
    """

    def __init__(
        self, *, stream: TextIO | None = None, live: bool | None = None, every_s: float = 10.0
    ) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.every_s = every_s
        self._last = ""
        self._last_t = -1e9
        self._live: Any = None

    def __enter__(self) -> Progress:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                console=Console(file=self.stream), refresh_per_second=4, transient=False
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def __call__(self, snap: Mapping[str, Any]) -> None:
        if self._live is not None:
            self._live.update(self._table(snap))
            return
        line = summary_line(snap)
        key = line.split("]", 1)[1].rsplit("| ETA", 1)[0]
        now = time.monotonic()
        if key != self._last or now - self._last_t >= self.every_s:
            print(line, file=self.stream, flush=True)
            self._last, self._last_t = key, now

    def _table(self, snap: Mapping[str, Any]) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=None, expand=False)
        for col in ("job", "GPUs", "configs", "running for"):
            table.add_column(col)
        for jid, j in sorted(snap["running"].items()):
            ids = j["config_ids"]
            shown = ", ".join(ids[:4]) + (f" +{len(ids) - 4}" if len(ids) > 4 else "")
            table.add_row(jid, str(j["gpus"]), shown, _fmt_s(snap["now_s"] - j["started_s"]))
        return Group(Text(summary_line(snap)), table)


def status_text(root: str) -> str:
    """The ``plora status DIR`` report: counts, jobs, best configs, failures."""
    store = SweepStore(root)
    state = store.read_state()
    status = state["status"]
    counts: dict[str, int] = {}
    for s in status.values():
        counts[s] = counts.get(s, 0) + 1
    jobs = store.read_jobs()
    results = store.read_results()
    decisions = store.read_decisions()
    done = bool(decisions) and decisions[-1]["kind"] == "sweep_done"
    lines = [
        f"sweep {root}: {'finished' if done else 'not finished'} after {_fmt_s(state['elapsed_s'])}",
        "configs: "
        + ", ".join(
            f"{k} {counts.get(k, 0)}" for k in ("done", "stopped", "running", "queued", "failed")
        ),
    ]
    if len(jobs):
        by = jobs["status"].value_counts().to_dict()
        lines.append(
            f"jobs: {len(jobs)} attempts ("
            + ", ".join(f"{k} {v}" for k, v in sorted(by.items()))
            + ")"
        )
    data = store.read_data_report()
    if data is not None:
        for split in ("train", "eval"):
            s = data.get(split) or {}
            if s.get("truncated") or s.get("dropped"):
                lines.append(
                    f"data: {split} {s.get('truncated', 0)} of {s.get('rows', 0)} rows cut to "
                    f"max_seq_len {data.get('max_seq_len')}, {s.get('dropped', 0)} left out "
                    "(no target token left)"
                )
    plan = store.read_plan()
    if plan is not None:
        lines.append(
            f"latest plan: {len(plan['jobs'])} jobs, makespan {_fmt_s(plan['makespan_s'])} "
            f"(lower bound {_fmt_s(plan['lower_bound_s'])})"
        )
    if len(results) and "status" in results:
        ok = results[results["status"] == "done"]
        lines.extend(_best(ok, *objective(read_sweep(Path(root)))))
        failed = results[results["status"] == "failed"]
        for _, r in failed.head(5).iterrows():
            lines.append(f"failed {r['config_id']}: {r.get('error')}")
    return "\n".join(lines)


def _g(x: Any) -> str:
    try:
        return f"{float(x):.4g}"
    except (TypeError, ValueError):
        return "-"


def _best(ok: Any, key: str, mode: str) -> list[str]:
    """The three best finished configs by the sweep's own metric and mode."""
    if not len(ok) or key not in ok or not ok[key].notna().any():
        return [f"best: no finished config has {key} yet"] if len(ok) else []
    top = ok[ok[key].notna()].sort_values(key, ascending=mode == "min", kind="stable").head(3)
    out = [f"best by {key} ({mode}):"]
    also = "eval_loss" if key != "eval_loss" else "eval_metric"
    for _, r in top.iterrows():
        out.append(
            f"  {r['config_id']}  {key}={_g(r[key])}  {also}={_g(r.get(also))}  rank={r['rank']} "
            f"alpha={r['alpha']:g} lr={r['lr']:.2g} bs={r['batch_size']}  {r['adapter_path']}"
        )
    return out


__all__ = ["Progress", "status_text", "summary_line"]
