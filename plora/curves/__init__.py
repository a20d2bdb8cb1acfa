"""Live curves of a sweep: TensorBoard under the sweep directory, MLflow and W&B when asked.

The sweep file's ``logging:`` section (:class:`plora.config.LoggingOptions`; ``plora sweep
--log-to``) says where curves go. The driver opens the asked sinks before any training
(:func:`open_sinks`: a sink that cannot start is one :class:`~plora.config.ConfigError` line),
and, once the sweep directory exists, attaches a :class:`~plora.curves.feed.Curves` feed to its
one writer (:attr:`plora.sweepdir.store.SweepStore.curves`): every metric and result row the
store writes reaches the sinks from a background thread.

* :mod:`plora.curves.runs` -- run names, hyperparameters, the tags every sink logs;
* :mod:`plora.curves.feed` -- :class:`~plora.curves.feed.Curves` (the queue and its thread) and
  the :class:`~plora.curves.feed.CurveSink` protocol;
* :mod:`plora.curves.tensorboard`, :mod:`plora.curves.mlflow_runs`,
  :mod:`plora.curves.wandb_runs` -- the sinks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from plora.config import LoRAConfig, SweepConfig
from plora.curves.feed import Curves, CurveSink
from plora.curves.runs import varied_params


def open_sinks(sweep: SweepConfig, out: str | Path) -> list[CurveSink]:
    """The sinks ``sweep.logging`` asks for, started (a sweep directory ``out`` need not exist
    yet: TensorBoard opens its runs there as configs train).

    Raises:
        ConfigError: an asked sink cannot start (not installed, no server, no credentials),
            located in the sweep file.
    """
    out = Path(out)
    opts = sweep.logging
    sinks: list[CurveSink] = []
    with sweep.located():
        if opts.tensorboard:
            from plora.curves.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(out))
        if opts.mlflow is not None:
            from plora.curves.mlflow_runs import MlflowSink

            sinks.append(MlflowSink(opts.mlflow, experiment=sweep.name, sweep_dir=out))
        if opts.wandb is not None:
            from plora.curves.wandb_runs import WandbSink

            sinks.append(WandbSink(opts.wandb, project=sweep.name, sweep_dir=out))
    return sinks


def open_curves(
    sinks: list[CurveSink],
    sweep: SweepConfig,
    *,
    configs: Mapping[str, LoRAConfig],
    metric_name: str | None,
    finished: Iterable[str] = (),
) -> Curves | None:
    """The feed of ``sinks`` for ``sweep`` (None when there are none); see :class:`Curves`."""
    if not sinks:
        return None
    return Curves(
        sinks,
        configs=configs,
        varied=varied_params(sweep.space),
        metric_name=metric_name,
        finished=finished,
    )


__all__ = ["CurveSink", "Curves", "open_curves", "open_sinks"]
