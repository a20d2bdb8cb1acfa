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

from ray.tune.schedulers import ASHAScheduler, AsyncHyperBandScheduler, TrialScheduler

from plora.config.asha_options import EarlyStopConfig, EarlyStopKind
from plora.sweepdir.tracked import TrackedDict
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
        self._known: TrackedDict[str, int] = TrackedDict()  # config id -> 1
        self._keys: dict[tuple[int, int, str], str] = {}
        self.stopped: TrackedDict[str, int] = TrackedDict()
        """Config id -> the step at which it was stopped."""
        # ASHA's trial brackets and rung records as get_state saves them, kept as they change
        # (a config's own records change only at its own steps): live_state's sections
        self._trial_bracket: TrackedDict[str, int] = TrackedDict()
        self._records: TrackedDict[str, float] = TrackedDict()

    def on_step(self, config_id: str, step: int, loss: float) -> bool:
        """One streamed step of a config; True when it should stop now (said once)."""
        if config_id in self.stopped:
            return False
        trial = _Trial(config_id)
        if config_id not in self._known:
            self._known[config_id] = 1
            self.asha.on_trial_add(None, trial)  # type: ignore[arg-type]
        result = {"step": step, self.config.metric: loss}
        decision = self.asha.on_trial_result(None, trial, result)  # type: ignore[arg-type]
        self._note_trial(config_id)
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

    def live_state(self) -> dict[str, Any]:
        """:meth:`get_state` with its growing sections as the tracked books themselves
        (:mod:`plora.sweepdir.tracked`): the state's writer reads only the records changed
        since its last write (rebuilding them all at each write was 7.8 s of 50 at 4,000
        configs, ``benchmarks/state_writes.py``). Equal to :meth:`get_state` (tested)."""
        asha = self.asha
        if not isinstance(asha, AsyncHyperBandScheduler):  # pragma: no cover - always ASHA
            return self.get_state()
        return {
            "known": self._known,
            "stopped": self.stopped,
            "asha": {
                "kind": "asha",
                "num_stopped": asha._num_stopped,
                "trial_bracket": self._trial_bracket,
                "milestones": [[float(m) for m, _ in b._rungs] for b in asha._brackets],
                "records": self._records,
            },
        }

    def _note_trial(self, config_id: str) -> None:
        """Copy ``config_id``'s bracket and rung records from ASHA (after one of its steps)."""
        brackets = self.asha._brackets
        bracket = self.asha._trial_info.get(config_id)
        if bracket is None:
            return
        b = next(i for i, x in enumerate(brackets) if x is bracket)
        if self._trial_bracket.get(config_id) != b:
            self._trial_bracket[config_id] = b
        for i, (_, rec) in enumerate(bracket._rungs):
            if config_id in rec:
                key, value = self._record_key(b, i, config_id), float(rec[config_id])
                if self._records.get(key, None) != value:
                    self._records[key] = value

    def _record_key(self, bracket: int, rung: int, trial: str) -> str:
        """A record's key in the saved state, ``[bracket, rung, trial]`` as JSON (made once:
        the state is saved at every write of the sweep directory)."""
        key = (bracket, rung, trial)
        text = self._keys.get(key)
        if text is None:
            text = self._keys[key] = json.dumps(list(key))
        return text

    def set_state(self, state: Mapping[str, Any]) -> None:
        # known: a list in sweep directories before version 4
        self._known = TrackedDict(dict.fromkeys(state["known"], 1))
        self.stopped = TrackedDict({str(c): int(s) for c, s in state["stopped"].items()})
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
        self._trial_bracket, self._records = TrackedDict(), TrackedDict()
        for config_id in self._known:
            self._note_trial(config_id)


def make_early_stopper(config: EarlyStopConfig | None) -> AdapterEarlyStopper | None:
    """The stopper of a sweep's ``early_stop:`` section (None without one)."""
    return None if config is None else AdapterEarlyStopper(config)


__all__ = ["AdapterEarlyStopper", "make_early_stopper"]
