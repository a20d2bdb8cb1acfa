"""A Tune scheduler's decision state as JSON, field by field (never a pickled ``__dict__``).

Ray does not save a scheduler's state on ``Tuner.restore`` (ray#30838) and its schedulers'
``save`` pickles ``__dict__``. plora saves what ASHA decides from -- each bracket's rungs (the
metric every trial had at each milestone) and which bracket each trial is in -- and puts it
back before the first restored trial is added. Other schedulers are marked unsaved.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ray.tune.schedulers import FIFOScheduler, TrialScheduler
from ray.tune.schedulers.async_hyperband import AsyncHyperBandScheduler

from plora.config import ConfigError


def inner_state(inner: TrialScheduler) -> dict[str, Any]:
    """The wrapped scheduler's decision state, field by field (ASHA: rungs and trial brackets)."""
    if isinstance(inner, AsyncHyperBandScheduler):
        brackets = list(inner._brackets)
        return {
            "kind": "asha",
            "num_stopped": inner._num_stopped,
            "trial_bracket": {t: brackets.index(b) for t, b in inner._trial_info.items()},
            "rungs": [
                [[float(m), {t: float(v) for t, v in rec.items()}] for m, rec in b._rungs]
                for b in brackets
            ],
        }
    if type(inner) is FIFOScheduler:
        return {"kind": "fifo"}
    return {"kind": type(inner).__name__, "saved": False}


def set_inner_state(inner: TrialScheduler, state: Mapping[str, Any], *, where: str) -> None:
    """Restore :func:`inner_state` into ``inner`` (``where`` names the file in errors)."""
    if state.get("kind") == "asha":
        if not isinstance(inner, AsyncHyperBandScheduler) or len(inner._brackets) != len(
            state["rungs"]
        ):
            raise ConfigError(
                f"{where}: saved for ASHA with {len(state['rungs'])} brackets, restored "
                f"with {type(inner).__name__}; restore with the scheduler the Tuner started with"
            )
        for bracket, rungs in zip(inner._brackets, state["rungs"], strict=True):
            bracket._rungs = [(m, dict(rec)) for m, rec in rungs]
        inner._num_stopped = int(state["num_stopped"])
        inner._trial_info = {t: inner._brackets[i] for t, i in state["trial_bracket"].items()}
    elif state.get("saved") is False:
        logging.getLogger(__name__).warning(
            "%s's state is not saved by plora: it restarts empty after Tuner.restore",
            state.get("kind"),
        )


__all__ = ["inner_state", "set_inner_state"]
