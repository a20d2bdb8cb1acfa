"""Weights & Biases runs of a sweep (``logging.wandb``): one run per config, grouped by sweep.

Each config's run is a ``wandb.init(..., reinit="create_new")`` of its own (W&B >= 0.19.10 keeps
several runs open in one process), named as in :mod:`plora.curves.runs`, in the group named
after the sweep directory, with the config's hyperparameters as its config and the scalars as
its history at the adapter's step (the eval scalars also in its summary). ``mode: offline``
keeps the runs under ``dir`` for ``wandb sync``.

:class:`WandbSink` is made before any training: W&B missing, or online without credentials,
is one :class:`~plora.config.ConfigError` line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plora.config import ConfigError, WandbOptions
from plora.curves.feed import Step
from plora.curves.runs import RunInfo

KEY = "logging.wandb"


class WandbSink:
    """One W&B run per config (see the module docstring).

    Args:
        options: ``logging.wandb``.
        project: The project when ``options`` names none (the sweep's name).
        sweep_dir: The sweep directory: the runs' group (its name) and, unless ``options.dir``,
            where W&B writes its files.

    Raises:
        ConfigError: W&B is not installed, or is online and cannot log in.
    """

    name = "wandb"

    def __init__(self, options: WandbOptions, *, project: str, sweep_dir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "Weights & Biases is not installed", key=KEY,
                fix="pip install 'plora[wandb]', or drop logging.wandb (--log-to wandb)",
            ) from None  # fmt: skip
        self.mode: Any = options.mode or os.environ.get("WANDB_MODE") or "online"
        if self.mode == "online":
            try:  # an API key from WANDB_API_KEY or `wandb login`'s netrc; no prompt without a tty
                wandb.login(verify=False)
            except Exception as err:
                raise ConfigError(
                    f"W&B cannot log in: {type(err).__name__}: {str(err).strip().splitlines()[0]}",
                    key=KEY, fix="run `wandb login` or set WANDB_API_KEY, or use mode: offline",
                ) from None  # fmt: skip
        self.project = options.project or project
        self.entity = options.entity
        self.group = sweep_dir.name
        self.dir = Path(options.dir) if options.dir else sweep_dir
        self._runs: dict[str, Any] = {}

    def start_run(self, run: RunInfo, *, metric_tags: Sequence[str]) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        self._runs[run.config_id] = wandb.init(
            project=self.project, entity=self.entity, group=self.group, name=run.name,
            job_type="lora", config={"config_id": run.config_id, **run.hparams},
            mode=self.mode, dir=str(self.dir), reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip

    def log_steps(self, config_id: str, steps: Sequence[Step]) -> None:
        run = self._runs[config_id]
        for step, _wall, scalars in steps:
            run.log(scalars, step=step)

    def end_run(self, config_id: str, *, step: int, scalars: dict[str, float], status: str) -> None:
        run = self._runs.pop(config_id)
        if scalars:
            run.log(scalars, step=step)
        run.summary.update({**scalars, "status": status})
        run.finish(exit_code=1 if status == "failed" else 0)

    def close(self) -> None:
        for run in self._runs.values():  # still training when the sweep stopped
            run.finish(exit_code=1)
        self._runs.clear()


__all__ = ["WandbSink"]
