"""MLflow runs of a sweep (``logging.mlflow``): one parent run per sweep, one child per config.

Through ``mlflow.tracking.MlflowClient`` (explicit run ids, no global active run, so the feed's
thread logs for every config at once): the parent run is named after the sweep directory and
tagged ``plora.sweep_dir``; each config's run is its child (``mlflow.parentRunId``), with the
config's hyperparameters as params, ``plora.config_id`` and ``plora.status`` tags, and the
scalars of :mod:`plora.curves.runs` as metrics (batched, one ``log_batch`` per drained batch).

:class:`MlflowSink` is made before any training: MLflow missing, or a tracking server that does
not answer (tried once, 10 s), is one :class:`~plora.config.ConfigError` line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from plora.config import ConfigError, MlflowOptions
from plora.curves.feed import Step
from plora.curves.runs import RunInfo

KEY = "logging.mlflow"
_BATCH = 1000  # MLflow's most metrics per log_batch


class MlflowSink:
    """One MLflow run per config, children of the sweep's run (see the module docstring).

    Args:
        options: ``logging.mlflow``.
        experiment: The experiment when ``options`` names none (the sweep's name).
        sweep_dir: The sweep directory (the parent run's name and tag).

    Raises:
        ConfigError: MLflow is not installed, or its tracking store cannot be reached.
    """

    name = "mlflow"

    def __init__(self, options: MlflowOptions, *, experiment: str, sweep_dir: Path) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(
                "MLflow is not installed", key=KEY,
                fix="pip install 'plora[mlflow]', or drop logging.mlflow (--log-to mlflow)",
            ) from None  # fmt: skip
        self.sweep_dir = sweep_dir
        experiment = options.experiment or experiment
        with _answer_once():
            try:
                self.client = MlflowClient(tracking_uri=options.tracking_uri)
                found = self.client.get_experiment_by_name(experiment)
                self.experiment_id = (
                    found.experiment_id if found else self.client.create_experiment(experiment)
                )
            except Exception as err:
                uri = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "default"
                fix = ("start the tracking server or fix logging.mlflow.tracking_uri (a local "
                       "store: sqlite:///mlflow.db)")  # fmt: skip
                why = f"{type(err).__name__}: {_first_line(err)}"
                if "MLFLOW_ALLOW_FILE_STORE" in str(err):  # MLflow 3 keeps its file store off
                    why = "this MLflow refuses its file store"
                    fix = "set MLFLOW_ALLOW_FILE_STORE=true, or use sqlite:///mlflow.db"
                raise ConfigError(
                    f"MLflow cannot start (tracking URI {uri}): {why}", key=KEY, fix=fix
                ) from None
        self._parent: str | None = None
        self._runs: dict[str, str] = {}  # config id -> open run id

    def start_run(self, run: RunInfo, *, metric_tags: Sequence[str]) -> None:
        from mlflow.entities import Param

        if self._parent is None:
            parent = self.client.create_run(
                self.experiment_id, run_name=self.sweep_dir.name,
                tags={"plora.sweep_dir": str(self.sweep_dir)},
            )  # fmt: skip
            self._parent = parent.info.run_id
        child = self.client.create_run(
            self.experiment_id, run_name=run.name,
            tags={"mlflow.parentRunId": self._parent, "plora.config_id": run.config_id,
                  "plora.sweep_dir": str(self.sweep_dir)},
        )  # fmt: skip
        run_id = child.info.run_id
        self._runs[run.config_id] = run_id
        params = [Param(k, str(v)) for k, v in run.hparams.items()]
        self.client.log_batch(run_id, params=params)

    def log_steps(self, config_id: str, steps: Sequence[Step]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(tag, value, int(wall * 1000), step)
            for step, wall, scalars in steps
            for tag, value in scalars.items()
        ]
        run_id = self._runs[config_id]
        for i in range(0, len(metrics), _BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + _BATCH])

    def end_run(self, config_id: str, *, step: int, scalars: dict[str, float], status: str) -> None:
        import time

        from mlflow.entities import Metric, RunTag

        run_id = self._runs.pop(config_id)
        now = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(tag, value, now, step) for tag, value in scalars.items()],
            tags=[RunTag("plora.status", status)],
        )
        self.client.set_terminated(run_id, "FAILED" if status == "failed" else "FINISHED")

    def close(self) -> None:
        for run_id in self._runs.values():  # still training when the sweep stopped
            self.client.set_terminated(run_id, "KILLED")
        if self._parent is not None:
            self.client.set_terminated(self._parent, "KILLED" if self._runs else "FINISHED")
        self._runs.clear()


@contextlib.contextmanager
def _answer_once() -> Iterator[None]:
    """MLflow's HTTP client retries a server that does not answer for minutes (7 retries with
    backoff): while the sink starts, once and 10 s (unless the user set these)."""
    limits = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    added = [k for k in limits if k not in os.environ]
    os.environ.update({k: limits[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= 240 else line[:237] + "..."


__all__ = ["MlflowSink"]
