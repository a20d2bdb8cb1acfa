"""``logging:`` of a sweep: where its live curves go (:class:`LoggingOptions`).

```yaml
logging:
  tensorboard: true              # the default: event files under DIR/tensorboard/, one run per config
  mlflow:                        # or `mlflow: true` for MLflow's own defaults
    tracking_uri: http://mlflow:5000   # default: MLFLOW_TRACKING_URI, else MLflow's default
    experiment: lora-sweeps      # default: the sweep's name
  wandb:                         # or `wandb: true`
    project: lora-sweeps         # default: the sweep's name
    entity: my-team              # default: the W&B account's
    mode: offline                # online | offline; default: WANDB_MODE, else online
    dir: wandb-runs              # where W&B keeps its files; default: the sweep directory
```

``plora sweep --log-to mlflow`` (or ``wandb``) turns a sink on with its defaults when the file
does not. Each sink makes one run per config, named by its config id and the hyperparameters the
space varies, grouped by sweep (MLflow: child runs of a run named after the sweep directory; W&B:
the group of that name). :mod:`plora.curves` writes them; it checks that each sink can start
before any training.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from plora.config.errors import ConfigError
from plora.config.validate import as_bool, as_choice, as_str, check_keys, expect_mapping

#: The sinks a sweep can log to, in the order they are opened.
SINKS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb")
#: The sinks ``--log-to`` turns on (TensorBoard is on unless the file turns it off).
OPTIONAL_SINKS: tuple[str, ...] = ("mlflow", "wandb")
WANDB_MODES: tuple[str, ...] = ("online", "offline")


def _optional_str(value: Any, key: str) -> str | None:
    return None if value is None else as_str(value, key)


@dataclass(frozen=True, kw_only=True, slots=True)
class MlflowOptions:
    """Where MLflow runs go (``logging.mlflow``)."""

    tracking_uri: str | None = None
    """MLflow's tracking URI (``http://host:5000``, ``sqlite:///mlflow.db``, ``file:/path``);
    None: ``MLFLOW_TRACKING_URI``, else MLflow's default."""
    experiment: str | None = None
    """The MLflow experiment; None: the sweep's name."""

    def __post_init__(self) -> None:
        _optional_str(self.tracking_uri, "tracking_uri")
        _optional_str(self.experiment, "experiment")


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbOptions:
    """Where W&B runs go (``logging.wandb``)."""

    project: str | None = None
    """The W&B project; None: the sweep's name."""
    entity: str | None = None
    """The W&B entity (user or team); None: the account's default."""
    mode: str | None = None
    """online | offline (runs kept on disk, ``wandb sync`` uploads them later); None:
    ``WANDB_MODE``, else online."""
    dir: str | None = None
    """The folder W&B writes its run files under; None: the sweep directory."""

    def __post_init__(self) -> None:
        for key in ("project", "entity", "dir"):
            _optional_str(getattr(self, key), key)
        if self.mode is not None:
            as_choice(self.mode, "mode", WANDB_MODES)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingOptions:
    """Where a sweep's live curves go (see the module docstring)."""

    tensorboard: bool = True
    """TensorBoard event files under the sweep directory (``tensorboard --logdir DIR``)."""
    mlflow: MlflowOptions | None = None
    """MLflow runs, one per config; None: off."""
    wandb: WandbOptions | None = None
    """Weights & Biases runs, one per config; None: off."""

    def __post_init__(self) -> None:
        as_bool(self.tensorboard, "tensorboard")
        for key, cls in (("mlflow", MlflowOptions), ("wandb", WandbOptions)):
            value = getattr(self, key)
            if value is not None and not isinstance(value, cls):
                raise ConfigError(f"must be a {cls.__name__}", key=key, value=value)

    @property
    def sinks(self) -> tuple[str, ...]:
        """The sinks turned on, in :data:`SINKS` order."""
        on = {"tensorboard": self.tensorboard, "mlflow": self.mlflow, "wandb": self.wandb}
        return tuple(name for name in SINKS if on[name])

    def with_sinks(self, names: Iterable[str]) -> LoggingOptions:
        """These options with the sinks ``names`` (``--log-to``) on: with their defaults unless
        already configured."""
        out = self
        for name in names:
            as_choice(name, "--log-to", OPTIONAL_SINKS)
            if name == "mlflow" and out.mlflow is None:
                out = replace(out, mlflow=MlflowOptions())
            elif name == "wandb" and out.wandb is None:
                out = replace(out, wandb=WandbOptions())
        return out

    @classmethod
    def from_dict(
        cls, raw: Any, *, base_dir: str | os.PathLike[str] | None = None
    ) -> LoggingOptions:
        """Parse the ``logging:`` section (errors keyed relative to it, e.g. ``wandb.mode``); a
        sink given as ``true`` takes its defaults, ``false`` or absent is off. A relative
        ``wandb.dir`` is resolved against ``base_dir`` (the sweep file's folder)."""
        raw = expect_mapping(raw, None, what="tensorboard, mlflow, wandb")
        check_keys(raw, SINKS, where=None)
        kwargs: dict[str, Any] = {}
        if "tensorboard" in raw:
            kwargs["tensorboard"] = raw["tensorboard"]
        for key, sink in (("mlflow", MlflowOptions), ("wandb", WandbOptions)):
            value = raw.get(key)
            if value is None or value is False:
                continue
            if value is True:
                value = {}
            fields = list(sink.__dataclass_fields__)
            value = dict(expect_mapping(value, key, what=f"true, or {', '.join(fields)}"))
            check_keys(value, fields, where=key)
            if key == "wandb" and isinstance(value.get("dir"), str) and base_dir is not None:
                value["dir"] = str((Path(base_dir) / Path(value["dir"]).expanduser()).resolve())
            try:
                kwargs[key] = sink(**value)
            except ConfigError as err:
                raise err.located(prefix=key) from None
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (inverse of :meth:`from_dict`; unset fields left out)."""
        out: dict[str, Any] = {"tensorboard": self.tensorboard}
        for key in ("mlflow", "wandb"):
            sink = getattr(self, key)
            if sink is not None:
                fields = sink.__dataclass_fields__
                out[key] = {f: getattr(sink, f) for f in fields if getattr(sink, f) is not None}
        return out


__all__ = [
    "OPTIONAL_SINKS",
    "SINKS",
    "WANDB_MODES",
    "LoggingOptions",
    "MlflowOptions",
    "WandbOptions",
]
