"""The feed from the sweep directory's writer to the sinks, on one background thread.

:class:`~plora.sweepdir.store.SweepStore` -- the one writer of a sweep directory -- hands every
``metrics.parquet`` row (:meth:`Curves.add_metrics`) and every ``results.parquet`` row
(:meth:`Curves.add_results`) it writes to :class:`Curves`, which only turns them into events and
queues them: the driver's loop never waits for a sink. One thread drains the queue in order and
calls each :class:`CurveSink` (TensorBoard, MLflow, W&B). A sink that fails mid-sweep (a server
gone) is dropped with one warning; the sweep goes on.

A config's run starts with its first step and ends with its result (done, stopped or failed);
runs still open when the sweep closes (interrupted) are closed as such by each sink.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from plora.config import LoRAConfig
from plora.curves.runs import (
    EVAL_LOSS,
    RunInfo,
    eval_scalars,
    metric_tag,
    run_info,
    step_scalars,
)
from plora.sweepdir.schema import ConfigStatus

log = logging.getLogger(__name__)

#: Results that end a config's run (a paused config's run goes on).
ENDED = frozenset({ConfigStatus.DONE, ConfigStatus.STOPPED, ConfigStatus.FAILED})

Step = tuple[int, float, dict[str, float]]
"""``(step, wall time in epoch seconds, {tag: value})``."""


class CurveSink(Protocol):
    """Where curves go. Called from the feed's thread only, one call at a time."""

    name: str

    def start_run(self, run: RunInfo, *, metric_tags: Sequence[str]) -> None:
        """Open ``run``; ``metric_tags``: the tags that rank configs (TensorBoard's hparams)."""
        ...

    def log_steps(self, config_id: str, steps: Sequence[Step]) -> None:
        """Steps of an open run, in order."""
        ...

    def end_run(self, config_id: str, *, step: int, scalars: dict[str, float], status: str) -> None:
        """The run's eval ``scalars`` at its last ``step``, and its end (``status``: done,
        stopped or failed)."""
        ...

    def close(self) -> None:
        """Close every run still open (the sweep was interrupted) and the sink itself."""
        ...


class Curves:
    """Feeds ``sinks`` from the rows the sweep directory's writer writes (see the module doc).

    Args:
        sinks: The sinks, opened (:func:`plora.curves.open_sinks`).
        configs: Config id -> config, as the coordinator knows them (read when a config's first
            row comes, to name its run).
        varied: The hyperparameters the space varies (:func:`plora.curves.runs.varied_params`).
        metric_name: The dataset's task metric (``exact_match``; None or ``none``: no metric).
        finished: Configs that ended before this feed began (a resumed sweep): their runs
            are not opened again unless they train again.
    """

    def __init__(
        self,
        sinks: Sequence[CurveSink],
        *,
        configs: Mapping[str, LoRAConfig],
        varied: Sequence[str],
        metric_name: str | None,
        finished: Iterable[str] = (),
    ) -> None:
        self.sinks = list(sinks)
        self._configs = configs
        self._varied = tuple(varied)
        tags = [EVAL_LOSS, metric_tag(metric_name), "train/loss"]
        self._metric_tags = tuple(t for t in tags if t is not None)
        self._started: set[str] = set()
        self._ended: set[str] = set(finished)
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="plora-curves", daemon=True)
        self._thread.start()

    # -- the writer's side (the driver's thread): no I/O, only queued events --------------
    def add_metrics(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """``metrics.parquet`` rows: each config's run opens at its first."""
        steps: dict[str, list[Step]] = {}
        now = time.time()
        for row in rows:
            cid = str(row["config_id"])
            if not self._start(cid):
                continue
            self._ended.discard(cid)  # a config that trains again (retried) ends again
            steps.setdefault(cid, []).append((int(row["step"]), now, step_scalars(row)))
        for cid, batch in steps.items():
            self._queue.put(("steps", (cid, batch)))

    def add_results(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """``results.parquet`` rows (all of them, each time): a config that ended since the
        last call gets its eval scalars and its run's end."""
        for row in rows:
            cid = str(row["config_id"])
            status = str(row.get("status"))
            if status not in ENDED or cid in self._ended or not self._start(cid):
                continue
            self._ended.add(cid)
            step = int(row.get("steps") or 0)
            self._queue.put(("end", (cid, step, eval_scalars(row), status)))

    def close(self, timeout_s: float = 120.0) -> None:
        """Write what is queued, close every sink (open runs end as interrupted), and stop
        the thread (waiting at most ``timeout_s``)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("curves: the sinks did not finish within %.0f s; closed as they were",
                        timeout_s)  # fmt: skip

    def _start(self, cid: str) -> bool:
        if cid in self._started:
            return True
        config = self._configs.get(cid)
        if config is None:
            return False
        self._started.add(cid)
        self._queue.put(("start", run_info(config, self._varied)))
        return True

    # -- the feed's thread --------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                break
            for sink in list(self.sinks):
                self._call(sink, *event)
        for sink in list(self.sinks):
            self._call(sink, "close", None)

    def _call(self, sink: CurveSink, kind: str, payload: Any) -> None:
        try:
            if kind == "start":
                sink.start_run(payload, metric_tags=self._metric_tags)
            elif kind == "steps":
                sink.log_steps(*payload)
            elif kind == "end":
                cid, step, scalars, status = payload
                sink.end_run(cid, step=step, scalars=scalars, status=status)
            else:
                sink.close()
        except Exception as err:  # a sink never stops the sweep: it stops itself
            log.warning("curves: %s stopped logging (%s: %s)", sink.name, type(err).__name__,
                        str(err).splitlines()[0] if str(err) else "")  # fmt: skip
            self.sinks.remove(sink)
            if kind != "close":
                with contextlib.suppress(Exception):  # already reported above
                    sink.close()


__all__ = ["ENDED", "CurveSink", "Curves", "Step"]
