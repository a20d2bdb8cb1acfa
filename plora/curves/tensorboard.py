"""TensorBoard event files of a sweep: ``DIR/tensorboard/<run>/events.out.tfevents.*``.

One run (folder) per config, written with tensorboardX (a dependency of Ray Tune): the scalars
of :mod:`plora.curves.runs` and, for TensorBoard's HParams view, the config's hyperparameters
(the session start when its run opens, the session end with its status when it ends). Event
files are append-only logs, like ``decisions.jsonl``: TensorBoard reads them while they grow
(each writer flushes from its own thread every ``flush_s``), and a resumed sweep adds a file to
the same run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plora.curves.feed import Step
from plora.curves.runs import RunInfo
from plora.sweepdir.schema import TENSORBOARD_DIR


class TensorBoardSink:
    """Writes each config's run under ``root/tensorboard/<run name>/``.

    Args:
        root: The sweep directory.
        flush_s: How often each run's writer thread flushes its events to disk.
    """

    name = "tensorboard"

    def __init__(self, root: str | Path, *, flush_s: float = 5.0) -> None:
        self.root = Path(root) / TENSORBOARD_DIR
        self.flush_s = flush_s
        self._writers: dict[str, Any] = {}

    def start_run(self, run: RunInfo, *, metric_tags: Sequence[str]) -> None:
        from tensorboardX import SummaryWriter
        from tensorboardX.summary import hparams

        writer = SummaryWriter(logdir=str(self.root / run.name), flush_secs=self.flush_s)
        experiment, session_start, _ = hparams(
            {"config_id": run.config_id, **run.hparams}, dict.fromkeys(metric_tags, 0.0)
        )
        writer.file_writer.add_summary(experiment)
        writer.file_writer.add_summary(session_start)
        self._writers[run.config_id] = writer

    def log_steps(self, config_id: str, steps: Sequence[Step]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        writer = self._writers[config_id]
        for step, wall, scalars in steps:  # one event per step holds all its scalars
            values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars.items()]
            writer.file_writer.add_summary(Summary(value=values), step, wall)

    def end_run(self, config_id: str, *, step: int, scalars: dict[str, float], status: str) -> None:
        writer = self._writers.pop(config_id)
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
        writer.file_writer.add_summary(_session_end(failed=status == "failed"))
        writer.close()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def _session_end(*, failed: bool) -> Any:
    """The HParams plugin's session-end summary (tensorboardX's ``hparams`` writes only success)."""
    from tensorboardX.proto.api_pb2 import Status
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

    status = Status.Value("STATUS_FAILURE" if failed else "STATUS_SUCCESS")
    content = HParamsPluginData(session_end_info=SessionEndInfo(status=status), version=0)
    plugin = SummaryMetadata.PluginData(plugin_name="hparams", content=content.SerializeToString())
    value = Summary.Value(
        tag="_hparams_/session_end_info", metadata=SummaryMetadata(plugin_data=plugin)
    )
    return Summary(value=[value])


__all__ = ["TensorBoardSink"]
