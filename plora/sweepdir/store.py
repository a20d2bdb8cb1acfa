"""The atomic writer of a sweep directory (:class:`SweepStore`), and what ``--resume`` reads back.

Layout, columns and dtypes: :mod:`plora.sweepdir.schema`.

Every file except the append-only ``decisions.jsonl`` and ``state.parts/`` logs is replaced
atomically (temp + rename; a log's appended bytes count once ``state.json`` names them), so a
reader (``plora status``, a notebook) never sees a half-written file, and a driver killed at any
point leaves a directory ``--resume`` can continue from.

The directory itself is created atomically too: :func:`create_sweep_dir` builds it under a hidden
temporary name next to ``DIR`` and renames it into place once its first durable state is complete,
so a sweep that fails before that leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from plora.config import ConfigError
from plora.sweepdir import schema
from plora.sweepdir.decisions import read_records
from plora.sweepdir.lock import SweepLock, check_not_locked
from plora.sweepdir.parts import PartTable, read_table
from plora.sweepdir.schema import JOB_COLUMNS, METRIC_COLUMNS, METRIC_DTYPES
from plora.sweepdir.state_parts import StateParts, assemble_live
from plora.sweepdir.tracked import MappedView, TrackedDict, TrackedList
from plora.utils import atomic_path, atomic_write_json, atomic_write_text

if TYPE_CHECKING:  # pandas (and pyarrow) load on the first table written or read, not with the
    import pandas as pd  # driver: its prepare thread imports them beside Ray's start


class RowFeed(Protocol):
    """What :attr:`SweepStore.curves` is told (:class:`plora.curves.feed.Curves`): the rows
    the store writes, as it writes them; it must not block (it queues)."""

    def add_metrics(self, rows: Iterable[Mapping[str, Any]]) -> None: ...

    def add_results(self, rows: Iterable[Mapping[str, Any]]) -> None: ...

    def close(self) -> None: ...


class SweepStore:
    """Reads and writes one sweep directory (see the module docstring for the layout)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._parts: PartTable | None = None
        self._state_parts = StateParts(self.root)
        self._metrics_buffer: list[dict[str, Any]] = []
        self._decisions_buffer: list[str] = []
        self._next_plan: int | None = None  # the next plans/plan-NNN.json; None: not looked yet
        self._stored_rows: dict[Any, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._stored_root = self.root  # the root _stored_rows' paths are relative to
        self._results: _AmortizedTable | None = None  # None: results.parquet not written yet
        self._jobs: _AmortizedTable | None = None  # and jobs.parquet
        self.curves: RowFeed | None = None
        """The live curves (``DIR/tensorboard/``, MLflow, W&B: :mod:`plora.curves`): told every
        metric and result row given here; None: none."""

    # -- paths -------------------------------------------------------------------------------
    @property
    def sweep_yaml(self) -> Path:
        return self.root / schema.SWEEP_YAML

    @property
    def base_model_dir(self) -> Path:
        return self.root / schema.BASE_MODEL_DIR

    @property
    def base_model_json(self) -> Path:
        return self.root / schema.BASE_MODEL_JSON

    @property
    def plan_json(self) -> Path:
        return self.root / schema.PLAN_JSON

    @property
    def plans_dir(self) -> Path:
        return self.root / schema.PLANS_DIR

    @property
    def decisions_jsonl(self) -> Path:
        return self.root / schema.DECISIONS_JSONL

    @property
    def jobs_parquet(self) -> Path:
        return self.root / schema.JOBS_PARQUET

    @property
    def metrics_parquet(self) -> Path:
        return self.root / schema.METRICS_PARQUET

    @property
    def _metrics(self) -> PartTable:
        """``metrics.parquet/``'s parts (re-rooted with the store: :func:`create_sweep_dir`)."""
        if self._parts is None or self._parts.path != self.metrics_parquet:
            self._parts = PartTable(
                self.metrics_parquet, METRIC_COLUMNS, dedupe=["config_id", "step"]
            )
        return self._parts

    @property
    def results_parquet(self) -> Path:
        return self.root / schema.RESULTS_PARQUET

    @property
    def adapters_dir(self) -> Path:
        return self.root / schema.ADAPTERS_DIR

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / schema.CHECKPOINTS_DIR

    @property
    def state_json(self) -> Path:
        return self.root / schema.STATE_JSON

    @property
    def data_json(self) -> Path:
        return self.root / schema.DATA_JSON

    def exists(self) -> bool:
        """True when the directory holds a sweep (has a ``state.json``)."""
        return self.state_json.is_file()

    # -- writers -----------------------------------------------------------------------------
    def write_plan(self, plan: Mapping[str, Any]) -> int:
        """Save ``plan`` as ``plans/plan-NNN.json`` (next free NNN) and as ``plan.json``.

        The next NNN is counted here, found once from the directory (after the highest plan
        there: a resumed sweep continues the numbering): listing ``plans/`` at every re-plan
        was a listing of ~1,000 files each at 10,000 configs.

        Returns:
            The plan's index NNN (0 for the initial plan); :func:`schema.plan_file` names the file.
        """
        if self._next_plan is None:
            self.plans_dir.mkdir(parents=True, exist_ok=True)
            self._next_plan = _next_plan_index(self.plans_dir)
        index = self._next_plan
        text = json.dumps(dict(plan), indent=2, default=str) + "\n"  # one dump, two files
        atomic_write_text(self.root / schema.plan_file(index), text)
        atomic_write_text(self.plan_json, text)
        self._next_plan = index + 1
        return index

    def append_decision(self, record: Mapping[str, Any], *, flush: bool = True) -> None:
        """Append one decision as a JSON line; ``flush``: durable on return (with the ones
        buffered before it), else buffered until :meth:`flush_decisions`."""
        self._decisions_buffer.append(json.dumps(dict(record), default=str) + "\n")
        if flush:
            self.flush_decisions()

    def flush_decisions(self) -> None:
        """Make the buffered decisions durable: one write and one ``fsync`` for all of them (an
        ``fsync`` per decision cost ~2 ms a stop or refill at 256 GPUs,
        ``benchmarks/control_plane.py``)."""
        if not self._decisions_buffer:
            return
        lines, self._decisions_buffer = "".join(self._decisions_buffer), []
        with open(self.decisions_jsonl, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())

    def append_metrics(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Buffer metric rows; :meth:`flush_metrics` makes them durable (the curves get them
        now)."""
        added = [dict(r) for r in rows]
        self._metrics_buffer.extend(added)
        if self.curves is not None:
            self.curves.add_metrics(added)

    def flush_metrics(self) -> None:
        """Make the buffered metric rows durable: one new part of ``metrics.parquet/``
        (:class:`plora.sweepdir.parts.PartTable`; the rows already written are not rewritten, so
        a flush costs its own rows). One row per (config, step) is what readers see: a step
        trained again (a retry from a checkpoint older than its last metrics) keeps the row that
        came last -- the attempt the adapter went on from."""
        import pandas as pd

        if not self._metrics_buffer:
            self._metrics.create()  # an empty table from the start: readers find it
            return
        new = pd.DataFrame(self._metrics_buffer, columns=list(METRIC_COLUMNS))
        self._metrics_buffer = []
        new = new.astype({c: "float64" for c, t in METRIC_DTYPES.items() if t == "float64"})
        self._metrics.append(new.drop_duplicates(["config_id", "step"], keep="last"))  # same
        # dtypes in every part: a part of None losses is float, as pyarrow reads the directory

    def write_jobs(self, rows: Iterable[Mapping[str, Any]], *, flush: bool = False) -> None:
        """Replace ``jobs.parquet`` with ``rows`` (one per job attempt, :data:`JOB_COLUMNS`), as
        :meth:`write_results` does its table: now or later (amortized, whole at ``flush``; a
        rewrite at each changed row grew from 14 to 40 ms a write over the first 2,700 configs of
        a 10,000-config sweep, ``benchmarks/control_plane.py``). ``state.json`` holds every row
        in between. A :class:`~plora.sweepdir.tracked.TrackedList` of rows costs its changes;
        other rows are compared with the copies last given."""
        if self._jobs is None:
            self._jobs = _AmortizedTable(columns=list(JOB_COLUMNS))
        table = self._jobs
        if isinstance(rows, TrackedList):
            changed = table.take_tracked(rows, lambda: list(rows))
        else:
            changed = table.take_rows(rows, key=_job_key, convert=_changed_copy)
        if changed or flush:
            table.write_if_due(self.jobs_parquet, force=flush)

    def write_results(
        self,
        rows: Iterable[Mapping[str, Any]] | TrackedDict[str, Any],
        *,
        order: Iterable[str] | None = None,
        flush: bool = False,
    ) -> None:
        """Replace ``results.parquet`` with ``rows`` (one per config; paths inside the directory
        stored relative to it) -- now, or later: the table is rewritten whole, and a rewrite at
        each changed row made a sweep's writes quadratic in its configs (7.2 s at 2,000, the
        last ones 5.6 ms each: ``benchmarks/state_writes.py``). It is written at the first
        call; when the rows changed (or gone) since its last write are at least
        :data:`RESULTS_REWRITE_SHARE` of them (so each row costs a bounded number of rewrites:
        linear in all); when that write is older than :data:`RESULTS_STALE_S` and than
        :data:`RESULTS_STALE_FACTOR` times what it took (a reader is seconds behind, and
        rewrites take at most a 20th of the driver's time; :meth:`flush_results` checks this
        between calls); and when ``flush`` (the sweep's end). Nothing is lost in between: ``state.json`` holds every
        result, and ``--resume`` reads them there and writes the table again. The curves are
        told the rows changed.

        Args:
            rows: The rows; or the coordinator's :class:`~plora.sweepdir.tracked.TrackedDict`
                of them by config id, whose changes alone are read (each call of the other kind
                passes over every row: linear per call, 4 -> 48 ms over a 10,000-config sweep).
            order: With a tracked mapping, the config ids in the table's order (read when the
                table is written; default: the mapping's).
            flush: Write the table now if any row changed since its last write.
        """
        self._reroot()
        if self._results is None:
            self._results = _AmortizedTable()
        table = self._results
        if isinstance(rows, TrackedDict):
            tracked = rows

            def current() -> list[dict[str, Any]]:
                ids = tracked if order is None else order
                return [self._stored_row(c, tracked[c]) for c in ids if c in tracked]

            changed = table.take_tracked(tracked, current)
            fresh = [self._stored_row(c, tracked[c]) for c in changed if c in tracked]
        else:
            changed = table.take_rows(rows, key=lambda r: r.get("config_id"),
                                      convert=lambda old, r: self._stored_row(r.get("config_id"), r))  # fmt: skip
            fresh = [table.seen[k] for k in changed if k in table.seen]
        if self.curves is not None and fresh:
            self.curves.add_results(fresh)
        if changed or flush:
            table.write_if_due(self.results_parquet, force=flush)

    def flush_results(self, *, force: bool = True) -> None:
        """Write ``results.parquet`` and ``jobs.parquet`` if rows changed since their last write:
        now (the sweep's end), or not ``force`` when :meth:`write_results` would (the driver's
        metric flushes call it between its writes of the tables, so that a reader is not a job's
        time behind)."""
        for table, path in ((self._results, self.results_parquet), (self._jobs, self.jobs_parquet)):
            if table is not None:
                table.write_if_due(path, force=force)

    def close_curves(self) -> None:
        """Write the curves still queued and close their sinks (the sweep's end)."""
        if self.curves is not None:
            self.curves.close()
            self.curves = None

    def write_data_report(self, report: Mapping[str, Any]) -> None:
        """Replace ``data.json``: rows per split read, cut and left out
        (``plora.engine.data_report.DataReport.to_dict``)."""
        atomic_write_json(self.data_json, dict(report))

    def write_state(self, state: Mapping[str, Any]) -> None:
        """Replace ``state.json`` (what ``--resume`` reads), stamped with the schema version."""
        if "results" in state:  # adapter paths relative to the directory
            self._reroot()
            results = state["results"]
            stored: Mapping[str, Any]
            if isinstance(results, TrackedDict):  # converted as the log reads a changed one
                stored = MappedView(results, self._stored_row)
            else:
                stored = {c: self._stored_row(c, r) for c, r in results.items()}
            state = {**state, "results": stored}
        self._state_parts.root = self.root  # a new directory is renamed into place
        head = self._state_parts.split(state)  # the growing sections: appended to their logs
        atomic_write_json(self.state_json, {**head, "sweepdir_version": schema.SCHEMA_VERSION})
        self._state_parts.written()

    def _reroot(self) -> None:
        """Forget the rows :meth:`_stored_row` converted when the directory moved (a new one is
        renamed into place): their paths were relative to the old root."""
        if self._stored_root != self.root:
            self._stored_rows.clear()
            self._stored_root = self.root

    def _stored_row(self, key: Any, row: Mapping[str, Any]) -> dict[str, Any]:
        """``row`` with its paths stored relative (:meth:`_paths`), converted once per change
        (the same object while ``row`` stays equal): each state write holds every result, and
        converting them all again each time was most of a write at 2,000 configs."""
        hit = self._stored_rows.get(key)
        if hit is not None and hit[0] == row:
            return hit[1]
        stored = self._paths(row, stored=True)
        if key is not None:
            self._stored_rows[key] = (_row_copy(row), stored)
        return stored

    def _paths(self, row: Mapping[str, Any], *, stored: bool) -> dict[str, Any]:
        """``row`` with its paths inside the directory as stored (relative) or resolved."""
        return schema.with_paths(row, self._stored if stored else self._resolved)

    def _stored(self, path: Any) -> Any:
        return schema.stored_path(self.root, path)

    def _resolved(self, stored: Any) -> Any:
        return schema.resolved_path(self.root, stored)

    # -- readers -----------------------------------------------------------------------------
    def read_state(self) -> dict[str, Any]:
        """The saved coordinator state; ConfigError when this is not a sweep directory."""
        if not self.state_json.is_file():
            raise ConfigError(
                f"{self.root}: not a plora sweep directory (no state.json); "
                "pass the --out directory of a `plora sweep` run"
            )
        try:
            head = json.loads(self.state_json.read_text())
            state = assemble_live(self.root, head, lambda: json.loads(self.state_json.read_text()))
        except (json.JSONDecodeError, ValueError) as e:
            raise ConfigError(
                f"{self.state_json}: unreadable ({e}); the sweep dir is damaged"
            ) from None
        if int(state.get("sweepdir_version", 1)) > schema.SCHEMA_VERSION:
            raise ConfigError(
                f"{self.state_json}: sweep directory version {state['sweepdir_version']} is newer "
                f"than this plora's ({schema.SCHEMA_VERSION}); upgrade plora to read it"
            )
        if "results" in state:
            state["results"] = {
                c: self._paths(r, stored=False) for c, r in state["results"].items()
            }
        return state

    def read_metrics(self) -> pd.DataFrame:
        """Every metric row so far (empty frame with the columns when there are none): those
        written, one per (config, step) (the last), then those buffered."""
        import pandas as pd

        rows = pd.DataFrame(self._metrics_buffer, columns=list(METRIC_COLUMNS))
        on_disk = None
        if self.metrics_parquet.exists():
            on_disk = read_table(self.metrics_parquet, METRIC_COLUMNS).drop_duplicates(
                ["config_id", "step"], keep="last", ignore_index=True
            )
        frames = [f for f in (on_disk, rows) if f is not None and len(f)]
        return pd.concat(frames, ignore_index=True) if frames else rows

    def read_jobs(self) -> pd.DataFrame:
        import pandas as pd

        if not self.jobs_parquet.is_file():
            return pd.DataFrame(columns=list(JOB_COLUMNS))
        return pd.read_parquet(self.jobs_parquet)

    def read_results(self) -> pd.DataFrame:
        import pandas as pd

        if not self.results_parquet.is_file():
            return pd.DataFrame()
        return schema.resolve_paths(pd.read_parquet(self.results_parquet), self.root)

    def read_decisions(self) -> list[dict[str, Any]]:
        """Decision records in order; a torn last line (driver killed mid-write) is skipped.

        Parsed once per version of the file (:func:`plora.sweepdir.decisions.read_records`:
        the record dicts are shared, do not change them)."""
        self.flush_decisions()
        if not self.decisions_jsonl.is_file():
            return []
        return read_records(self.decisions_jsonl)

    def read_plan(self) -> dict[str, Any] | None:
        if not self.plan_json.is_file():
            return None
        return json.loads(self.plan_json.read_text())


def _next_plan_index(plans_dir: Path) -> int:
    """The index after the highest ``plan-NNN.json`` in ``plans_dir`` (0 when it holds none)."""
    indices = [
        int(p.stem.removeprefix("plan-"))
        for p in plans_dir.glob("plan-*.json")
        if p.stem.removeprefix("plan-").isdigit()
    ]
    return max(indices, default=-1) + 1


def _row_copy(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` copied so that later changes to the caller's row (nested lists too) do not
    change it; scalars are shared (a deep copy of each row was most of a write)."""
    return {k: copy.deepcopy(v) if isinstance(v, (list, dict)) else v for k, v in row.items()}


#: ``results.parquet`` is rewritten once this share of its rows changed since its last write.
RESULTS_REWRITE_SHARE = 1 / 8

#: ... or once its last write is this many seconds old ...
RESULTS_STALE_S = 2.0

#: ... and this many times as old as that write took.
RESULTS_STALE_FACTOR = 20


class _AmortizedTable:
    """A table's rows as last given (``results.parquet``: :meth:`SweepStore.write_results`;
    ``jobs.parquet``), and how many changed since they were last written."""

    def __init__(self, columns: list[str] | None = None) -> None:
        self.columns = columns  # None: those of the rows
        self.current: Callable[[], list[dict[str, Any]]] = list  # the rows to write now
        self.rows = 0  # how many there are
        self.seen: dict[Any, dict[str, Any]] = {}  # rows compared in full: key -> its copy
        self.mark: tuple[object, int] | None = None  # a tracked container: (tracker, version)
        self.unwritten = 0  # rows changed (or gone) since the last write
        self.written_at: float | None = None  # time.monotonic() of the last write
        self.took_s = 0.0  # and how long it took

    def take_tracked(
        self, rows: TrackedDict[Any, Any] | TrackedList[Any], current: Callable[[], list[Any]]
    ) -> list[Any]:
        """Take a tracked container's rows (``current()``: them, as written); returns the keys
        changed since the last call (every key when the container is not the last one)."""
        keys = None
        if self.mark is not None and self.mark[0] is rows.tracker:
            keys = rows.changed_since(self.mark[1])
        if keys is None:
            keys = list(range(len(rows))) if isinstance(rows, list) else list(rows)
            keys += self.seen.keys() - set(keys)  # rows compared in full before, gone since
        self.mark = (rows.tracker, rows.version)
        self.seen, self.current, self.rows = {}, current, len(rows)
        self.unwritten += len(keys)
        return keys

    def take_rows(
        self,
        rows: Iterable[Mapping[str, Any]],
        *,
        key: Callable[[Mapping[str, Any]], Any],
        convert: Callable[[dict[str, Any] | None, Mapping[str, Any]], dict[str, Any]],
    ) -> list[Any]:
        """Take ``rows`` compared with the copies last given (``convert(old, row)``: the copy to
        keep, ``old`` itself while equal); returns the keys changed or gone."""
        last, seen, changed = self.seen, {}, []
        for r in rows:
            k = key(r)
            old = last.get(k)
            row = convert(old, r)
            if row is not old:
                changed.append(k)
            seen[k] = row
        changed += [k for k in last.keys() - seen.keys()]  # rows gone
        stored = list(seen.values())
        self.mark, self.seen, self.rows = None, seen, len(stored)
        self.current = lambda: stored
        self.unwritten += len(changed)
        return changed

    def write_if_due(self, path: Path, *, force: bool) -> None:
        """Write the rows when due (see :meth:`SweepStore.write_results`)."""
        if self.written_at is not None:
            if not self.unwritten:
                return
            age = time.monotonic() - self.written_at
            if not (
                force
                or self.unwritten >= RESULTS_REWRITE_SHARE * self.rows
                or age >= max(RESULTS_STALE_S, RESULTS_STALE_FACTOR * self.took_s)
            ):
                return
        import pandas as pd

        start = time.monotonic()
        _write_parquet(path, pd.DataFrame(self.current(), columns=self.columns))
        self.written_at = time.monotonic()
        self.took_s = self.written_at - start
        self.unwritten = 0


def _job_key(row: Mapping[str, Any]) -> Any:
    return (row.get("job_id"), row.get("attempt"))


def _changed_copy(old: dict[str, Any] | None, row: Mapping[str, Any]) -> dict[str, Any]:
    """``old`` while ``row`` equals it, else a copy of ``row`` (rows change in place)."""
    return old if old is not None and old == row else _row_copy(row)


def _write_parquet(path: Path, df: pd.DataFrame) -> None:
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False)


def check_out_dir(
    out: str | os.PathLike[str],
    *,
    resume: bool,
    lock: SweepLock | None = None,
    force_unlock: bool = False,
) -> Path:
    """Validate ``--out`` before anything is created (``lock``: the caller's own lock of it;
    ``force_unlock``: a lock from another host does not count, ``--force-unlock``).

    Raises:
        ConfigError: ``out`` exists and is not resumed, ``--resume`` names no sweep dir, or the
            parent directory cannot be written.
        SweepLockedError: another live ``plora sweep`` holds ``out``'s lock
            (:mod:`plora.sweepdir.lock`).
    """
    out = Path(out)
    check_not_locked(out, mine=lock, force=force_unlock)
    if resume:
        if not (out / "state.json").is_file():
            raise ConfigError(
                f"--out {out}: no sweep to resume there (no state.json); drop --resume to start one"
            )
        if not os.access(out, os.W_OK):
            raise ConfigError(f"--out {out}: not writable; fix its permissions")
        return out
    if out.exists():
        raise ConfigError(
            f"--out {out}: already exists; pass --resume to continue it or choose a new directory"
        )
    parent = out.absolute().parent
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {probe} is not a writable directory; choose another --out")
    return out


@contextlib.contextmanager
def create_sweep_dir(out: str | os.PathLike[str]) -> Iterator[SweepStore]:
    """Build a new sweep directory atomically.

    Yields a :class:`SweepStore` rooted at a hidden temporary directory beside ``out``; when the
    ``with`` body succeeds the temporary is renamed to ``out`` (and the store re-rooted), when it
    raises the temporary is removed and ``out`` never appears.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    store = SweepStore(tmp)
    try:
        yield store
        os.rename(tmp, out)
        store.root = out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_base_model(
    store: SweepStore,
    ref: Any,
    *,
    save_builtin: Callable[[Any, Path], Any],
) -> None:
    """Record the base model: built-in tiny models are saved under ``base_model/``.

    Args:
        store: The sweep directory.
        ref: A :class:`plora.config.ModelRef` (``name_or_path``, ``dtype``, ``is_builtin``).
        save_builtin: ``save_base_model(ref, out_dir)`` (:func:`plora.models.save_base_model`).
    """
    local_dir = None
    if getattr(ref, "is_builtin", False):
        with atomic_path(store.base_model_dir) as tmp:
            save_builtin(ref, tmp)
        local_dir = "base_model"
    atomic_write_json(
        store.base_model_json,
        {
            "name_or_path": ref.name_or_path,
            "dtype": getattr(ref, "dtype", "auto"),
            "quantization": getattr(ref, "quantization", "none"),
            "local_dir": local_dir,
        },
    )


def write_sweep_yaml(store: SweepStore, yaml_text: str) -> None:
    """Save the resolved sweep config."""
    atomic_write_text(store.sweep_yaml, yaml_text)


__all__ = [
    "JOB_COLUMNS",
    "METRIC_COLUMNS",
    "RowFeed",
    "SweepStore",
    "check_out_dir",
    "create_sweep_dir",
    "write_base_model",
    "write_sweep_yaml",
]
