"""Early stopping inside ``plora sweep`` (``early_stop:``): Ray Tune's ASHA on the streamed losses.

:class:`AdapterEarlyStopper` drives Ray Tune's ``ASHAScheduler`` directly -- each config is a
trial, each streamed step a result with ``step`` as the time attribute and the adapter's
training ``loss`` as the metric -- and says which configs to stop. The coordinator
(:class:`plora.runtime.coordinator.Coordinator`) feeds it every step report and stops the
configs it names inside their packs (the freed slots are refilled from the queue). Its state
(the rungs) is saved with the coordinator's for ``--resume``, field by field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from plora.config.asha_options import EarlyStopConfig, EarlyStopKind
from plora.tune.asha_state import inner_state, set_inner_state

MAX_T = 1 << 20
"""ASHA's ``max_t``: configs end at their own step budget; the rungs go on up to here."""


@dataclass(frozen=True, slots=True)
class _Trial:
    """What ASHA reads of a trial: its id."""

    trial_id: str


class AdapterEarlyStopper:
    """Which configs to stop early, from their streamed per-step losses (ASHA).

    Args:
        config: The sweep's ``early_stop:`` section.
    """

    def __init__(self, config: EarlyStopConfig) -> None:
        if config.kind is not EarlyStopKind.ASHA:  # pragma: no cover - the config checks it
            raise ValueError(f"early_stop.kind={config.kind} is not supported")
        self.config = config
        self.asha = ASHAScheduler(
            time_attr="step",
            metric=config.metric,
            mode="min",
            max_t=MAX_T,
            grace_period=config.grace_steps,
            reduction_factor=config.reduction_factor,
            stop_last_trials=False,
        )
        self._known: set[str] = set()
        self._keys: dict[tuple[int, int, str], str] = {}
        self.stopped: dict[str, int] = {}
        """Config id -> the step at which it was stopped."""

    def on_step(self, config_id: str, step: int, loss: float) -> bool:
        """One streamed step of a config; True when it should stop now (said once)."""
        if config_id in self.stopped:
            return False
        trial = _Trial(config_id)
        if config_id not in self._known:
            self._known.add(config_id)
            self.asha.on_trial_add(None, trial)  # type: ignore[arg-type]
        result = {"step": step, self.config.metric: loss}
        decision = self.asha.on_trial_result(None, trial, result)  # type: ignore[arg-type]
        if decision == TrialScheduler.STOP:
            self.stopped[config_id] = step
            return True
        return False

    def get_state(self) -> dict[str, Any]:
        """Keyed by config where the state grows with the sweep (``state.json`` logs those
        sections: :mod:`plora.sweepdir.state_parts`): ASHA's rungs as one record per
        (bracket, rung, config) under ``records`` and their milestones apart."""
        asha = inner_state(self.asha)
        if "rungs" in asha:
            brackets = asha.pop("rungs")
            asha["milestones"] = [[m for m, _ in rungs] for rungs in brackets]
            asha["records"] = {
                self._record_key(b, i, t): v
                for b, rungs in enumerate(brackets)
                for i, (_, rec) in enumerate(rungs)
                for t, v in rec.items()
            }
        return {"known": dict.fromkeys(self._known, 1), "stopped": dict(self.stopped),
                "asha": asha}  # fmt: skip

    def _record_key(self, bracket: int, rung: int, trial: str) -> str:
        """A record's key in the saved state, ``[bracket, rung, trial]`` as JSON (made once:
        the state is saved at every write of the sweep directory)."""
        key = (bracket, rung, trial)
        text = self._keys.get(key)
        if text is None:
            text = self._keys[key] = json.dumps(list(key))
        return text

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._known = set(state["known"])  # a list in sweep directories before version 4
        self.stopped = {str(c): int(s) for c, s in state["stopped"].items()}
        asha = dict(state["asha"])
        if "records" in asha:
            brackets: list[list[list[Any]]] = [
                [[m, {}] for m in ms] for ms in asha.pop("milestones")
            ]
            for key, value in asha.pop("records").items():
                b, i, t = json.loads(key)
                brackets[b][i][1][t] = value
            asha["rungs"] = brackets
        set_inner_state(self.asha, asha, where="state.json: early_stop")


def make_early_stopper(config: EarlyStopConfig | None) -> AdapterEarlyStopper | None:
    """The stopper of a sweep's ``early_stop:`` section (None without one)."""
    return None if config is None else AdapterEarlyStopper(config)


__all__ = ["AdapterEarlyStopper", "make_early_stopper"]
