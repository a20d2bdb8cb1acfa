"""Progress of a running sweep: a live rich table on a TTY, plain lines otherwise; and the
``plora status DIR`` summary, read from the sweep directory alone."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from plora.config import ConfigError, SweepConfig
from plora.sweepdir.reader import objective, read_sweep


def _fmt_s(s: float | None) -> str:
    if s is None or not math.isfinite(s):  # e.g. a plan with an infinite lower bound
        return "?"
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def summary_line(snap: Mapping[str, Any], *, workers: str = "GPUs", eta: str | None = None) -> str:
    """One line: elapsed, configs done/running/queued/failed, jobs, busy workers, ETA.

    ``workers`` names what runs jobs (``GPUs``, or ``workers`` for a ``gpu_type: cpu`` sweep);
    ``eta`` is the ETA text (default: the snapshot's ``eta_s``, see :class:`EtaTracker`)."""
    c = snap["counts"]
    eta_text = eta if eta is not None else _fmt_s(snap.get("eta_s"))
    return (
        f"[{_fmt_s(snap['now_s'])}] configs done {c['done'] + c['stopped']}"
        f" running {c['running']} queued {c['queued']} failed {c['failed']}"
        + (f" paused {c['paused']}" if c.get("paused") else "")
        + f" | jobs {c['jobs_running']} | {workers} busy {c['gpus_busy']}/{snap['num_gpus']}"
        f" | ETA {eta_text}"
    )


def samples_line(
    decisions: Iterable[Mapping[str, Any]], *, search: str, asked: int, finished: bool
) -> str | None:
    """One line when a sweep trained fewer distinct configs than it asked its searcher for:
    how many, and why -- suggestions that repeated an earlier config's hyperparameters (trained
    once: the ``ask`` decisions' ``duplicates``) or, once the sweep ``finished``, a searcher that
    stopped early. None when it got what it asked (and for a grid, which has no draws).

    Args:
        decisions: the coordinator's decisions (``decisions.jsonl`` records).
        search: the sweep's ``search`` (grid, random, optuna, hyperopt).
        asked: configs the sweep asks for (``SweepConfig.num_configs``).
        finished: the sweep ended (no config will come any more).
    """
    if search == "grid":
        return None
    asks = [d for d in decisions if d.get("kind") == "ask"]
    distinct = sum(len(d.get("config_ids") or ()) for d in asks)
    dups = {
        k: v for d in asks for k, v in ((d.get("inputs") or {}).get("duplicates") or {}).items()
    }
    missing = asked - distinct - len(dups) if finished else 0
    if not dups and missing <= 0:
        return None
    why = []
    if dups:
        same = ", ".join(f"{a} = {b}" for a, b in list(dups.items())[:3])
        more = f", +{len(dups) - 3} more" if len(dups) > 3 else ""
        why.append(f"{len(dups)} repeated a config already asked ({same}{more}), trained once")
    if missing > 0:
        why.append(f"{missing} never came: the searcher finished early")
    return f"search: {distinct} distinct configs of the {asked} asked of {search}; " + "; ".join(
        why
    )


class EtaTracker:
    """A sweep's ETA from the cost model's plan that moves only for a reason it states.

    The projected finish (sweep clock) is the latest of: each running job's planned duration
    counted from its actual start (at least now, once it overruns), and the plan's pending jobs'
    planned ends pushed back by the worst running job's lateness. The ETA shown is that finish
    minus now, so it counts down with the clock; the finish itself changes only

    * when the coordinator makes a new plan (``plan N: <trigger>``, e.g. ``calibrated on j0000``,
      ``job j0003 done``), or
    * when a running job falls behind its plan by more than ``slack`` of the time left (``j0001
      Ns behind plan``), or the plan's times move that much with no job late (a refit of the
      cost model from measured steps: ``re-estimated from measured steps``) -- never downward
      between plans.
    """

    def __init__(self, *, slack: float = 0.05, min_move_s: float = 1.0) -> None:
        self.slack = slack
        self.min_move_s = min_move_s
        self.finish_s: float | None = None
        self.reason = ""
        self._plan: Any = None

    def projected_finish(self, snap: Mapping[str, Any]) -> tuple[float | None, float, str | None]:
        """``(finish_s, lateness_s, latest job)`` from a coordinator snapshot."""
        now = float(snap["now_s"])
        ends: list[float] = []
        slip, behind = 0.0, None
        for jid, j in sorted(snap.get("running", {}).items()):
            start, end = j.get("planned_start_s"), j.get("planned_end_s")
            if end is None:
                continue
            expected = j["started_s"] + (end - start) if start is not None else end
            expected = max(expected, now)
            if expected - end > slip:
                slip, behind = expected - end, jid
            ends.append(expected)
        pending = snap.get("pending_end_s")
        if pending is not None:
            ends.append(float(pending) + slip)
        return (max(ends) if ends else None), slip, behind

    def update(self, snap: Mapping[str, Any]) -> str:
        """The ETA text for ``snap``: ``3m10s (plan 2: calibrated on j0000)``, ``done``."""
        if snap.get("done"):
            self.finish_s, self.reason = float(snap["now_s"]), "done"
            return "done"
        now = float(snap["now_s"])
        finish, slip, behind = self.projected_finish(snap)
        plan = snap.get("plan_index")
        if plan != self._plan:
            self._plan = plan
            trigger = snap.get("plan_trigger") or "resumed"
            self.finish_s, self.reason = finish, f"plan {plan}: {trigger}"
        elif finish is not None and self.finish_s is not None:
            left = max(self.finish_s - now, 0.0)
            if finish - self.finish_s > max(self.min_move_s, self.slack * left):
                self.finish_s = finish
                # no job late: the plan's own times moved (a refit from measured steps)
                self.reason = (
                    f"{behind} {_fmt_s(slip)} behind plan"
                    if behind
                    else "re-estimated from measured steps"
                )
        elif finish is not None:
            self.finish_s, self.reason = finish, self.reason or "plan"
        if self.finish_s is None:
            return "?"
        return f"{_fmt_s(max(self.finish_s - now, 0.0))} ({self.reason})"


class Progress:
    """Receives coordinator snapshots (``on_update``) and shows them.

    Args:
        stream: Where to write (default stderr).
        live: Rich live view; default: when ``stream`` is a TTY.
        every_s: Plain mode prints at most this often (and on every count or ETA-reason change).
        workers: What runs jobs: ``GPUs``, or ``workers`` on CPU (``gpu_type: cpu``).
    """

    def __init__(
        self,
        *,
        stream: TextIO | None = None,
        live: bool | None = None,
        every_s: float = 10.0,
        workers: str = "GPUs",
    ) -> None:
        self.workers = workers
        self.eta = EtaTracker()
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
        eta = self.eta.update(snap)
        if self._live is not None:
            self._live.update(self._table(snap, eta))
            return
        line = summary_line(snap, workers=self.workers, eta=eta)
        key = line.split("]", 1)[1].rsplit("| ETA", 1)[0] + self.eta.reason
        now = time.monotonic()
        if key != self._last or now - self._last_t >= self.every_s:
            print(line, file=self.stream, flush=True)
            self._last, self._last_t = key, now

    def _table(self, snap: Mapping[str, Any], eta: str) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=None, expand=False)
        for col in ("job", self.workers, "configs", "running for"):
            table.add_column(col)
        for jid, j in sorted(snap["running"].items()):
            ids = j["config_ids"]
            shown = ", ".join(ids[:4]) + (f" +{len(ids) - 4}" if len(ids) > 4 else "")
            table.add_row(jid, str(j["gpus"]), shown, _fmt_s(snap["now_s"] - j["started_s"]))
        return Group(Text(summary_line(snap, workers=self.workers, eta=eta)), table)


def status_text(root: str) -> str:
    """The ``plora status DIR`` report: counts, jobs, best configs, failures.

    An interrupted or partial directory is shown as far as it goes, ending with a ``missing:``
    line (file, what it holds, absent or damaged); counts come from ``results.parquet`` when
    ``state.json`` is gone. ConfigError when ``root`` holds no sweep file at all."""
    from plora.sweepdir import reader, schema

    path = reader.check_sweep_dir(root)
    missing: dict[str, str] = {}
    state = reader.read_state(path, missing, sections=("status",))  # not the other sections
    if int(state.get("sweepdir_version", 1)) > schema.SCHEMA_VERSION:
        raise ConfigError(
            f"{path}: sweep directory version {state['sweepdir_version']} is newer than this "
            f"plora's ({schema.SCHEMA_VERSION}); upgrade plora to read it"
        )
    jobs = reader.read_jobs(path, missing)
    results = reader.read_results(path, missing)
    decisions = reader.read_decision_records(path, missing)  # parsed once: the plan check too
    counts: dict[str, int] = {}
    statuses = state.get("status")
    if not isinstance(statuses, dict):  # no state.json: the results table knows the ended ones
        statuses = dict(zip(results.get("config_id", []), results.get("status", []), strict=True))
    for s in statuses.values():
        counts[str(s)] = counts.get(str(s), 0) + 1
    kinds = [d.get("kind") for d in decisions]
    kinds = [k for k in kinds if k != "timeline"]  # the driver's last record, after sweep_done
    done = len(kinds) > 0 and kinds[-1] == "sweep_done"
    elapsed = state.get("elapsed_s")
    lines = [
        f"sweep {root}: {'finished' if done else 'not finished'}"
        + (f" after {_fmt_s(float(elapsed))}" if isinstance(elapsed, int | float) else ""),
        "configs: "
        + ", ".join(
            f"{k} {counts.get(k, 0)}" for k in ("done", "stopped", "running", "queued", "failed")
        )
        + (f", paused {counts['paused']}" if counts.get("paused") else ""),
    ]
    if len(jobs):
        by = jobs["status"].value_counts().to_dict()
        lines.append(
            f"jobs: {len(jobs)} attempts ("
            + ", ".join(f"{k} {v}" for k, v in sorted(by.items()))
            + ")"
        )
    data = reader.read_data_report(path, missing)
    if data is not None:
        for split in ("train", "eval"):
            s = data.get(split) or {}
            if s.get("truncated") or s.get("dropped"):
                lines.append(
                    f"data: {split} {s.get('truncated', 0)} of {s.get('rows', 0)} rows cut to "
                    f"max_seq_len {data.get('max_seq_len')}, {s.get('dropped', 0)} left out "
                    "(no target token left)"
                )
    sweep = read_sweep(path)
    with contextlib.suppress(ConfigError, TypeError, ValueError):  # a partial or odd sweep.yaml
        note = samples_line(decisions, search=str(sweep.get("search", "grid")),
                            asked=SweepConfig.from_dict(sweep).num_configs, finished=done)  # fmt: skip
        if note:
            lines.append(note)
    plan = reader.read_plan(path, missing) or None
    if plan is not None:
        lines.append(
            f"latest plan: {len(plan['jobs'])} jobs, makespan {_fmt_s(plan['makespan_s'])} "
            f"(lower bound {_fmt_s(plan['lower_bound_s'])})"
        )
    if len(results) and "status" in results:
        ok = results[results["status"] == "done"]
        lines.extend(_best(ok, *objective(sweep)))
        failed = results[results["status"] == "failed"]
        for _, r in failed.head(5).iterrows():
            lines.append(f"failed {r['config_id']}: {r.get('error')}")
    if missing:
        lines.append(reader.missing_note(missing))
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


__all__ = ["EtaTracker", "Progress", "samples_line", "status_text", "summary_line"]
