"""``PLoRAScheduler``: any Ray Tune scheduler, its STOP turned into stopping one adapter in its pack.

Tune's schedulers decide per trial (CONTINUE / STOP). Under plora a trial is a proxy
(:mod:`plora.tune.trainable`) whose adapter trains inside a shared pack, so killing the proxy
would neither stop the adapter nor free its slot. The wrapper forwards every hook to the wrapped
scheduler (ASHA by default; MedianStoppingRule works the same) and, when it says STOP before
the adapter's last step, asks the sweep's coordinator (through its relay) to stop that adapter
at the next step boundary; the coordinator then refills the freed slot from the queue. Tune is
told CONTINUE, so the proxy stays to report the stopped adapter's last metrics and its PEFT
checkpoint (``early_stopped`` in its last result); later results of a stopped trial are not
forwarded. A PAUSE that means "stop for now, resume later" (synchronous ``HyperBandScheduler``,
``MedianStoppingRule(hard_stop=False)``) pauses the adapter: the wrapper asks the coordinator to
let it leave its pack at the next step with its whole train-state (:mod:`plora.runtime.coordinator.pause`;
its slot is refilled) and tells Tune PAUSE, so Tune stops the proxy. When the scheduler later
resumes the trial, Tune starts its proxy again, which asks the coordinator to queue the config
again: the next pack it joins continues it exactly where it left. A paused trial the scheduler
stops (HyperBand's losers of a bracket) ends stopped at its pause step, with the adapter and
eval loss it left with. MedianStoppingRule's other PAUSE -- yielding time to pending trials
while it has too few samples -- is a CONTINUE: a proxy holds no GPU to yield.
``PopulationBasedTraining`` is refused: its exploit changes a paused trial's config.

State. Ray does not save a scheduler's state for ``Tuner.restore`` (ray#30838), so the wrapper
saves its own after each decision, explicitly (:meth:`PLoRAScheduler.get_state`: the wrapped
ASHA's rungs, the trials it stopped) -- never by pickling ``__dict__`` -- as JSON in Tune's
driver staging directory, which Tune syncs to ``<experiment dir>/plora-scheduler.json`` with its
own experiment state; the restored wrapper reads it back before its first trial is added. ASHA
decides the same after a restore as without one.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from ray.tune.schedulers import ASHAScheduler, TrialScheduler
from ray.tune.schedulers.async_hyperband import AsyncHyperBandScheduler

from plora.config import ConfigError
from plora.tune.asha_state import inner_state, set_inner_state
from plora.utils import atomic_write_json

STATE_FILE = "plora-scheduler.json"
"""The wrapper's state, in the Tune experiment directory."""
TIME_ATTR = "adapter_step"
STATE_VERSION = 1


class StopKind(StrEnum):
    """Why the wrapper stopped a trial's adapter (logged with the coordinator's stop)."""

    EARLY = "early_stop"
    """The wrapped scheduler said STOP before the adapter's last step."""
    PAUSE = "pause"
    """The wrapped scheduler said PAUSE (to resume the trial later)."""
    STOPPED_PAUSED = "stopped_while_paused"
    """The wrapped scheduler stopped a paused trial (e.g. HyperBand's bracket losers)."""


class PLoRAScheduler(TrialScheduler):
    """Wrap a Tune ``TrialScheduler`` so its STOP stops one adapter inside its pack.

    Args:
        scheduler: The scheduler to wrap (default ``ASHAScheduler(time_attr="adapter_step")``;
            give yours ``time_attr="adapter_step"`` and ``max_t`` = the configs' ``max_steps``).
    """

    def __init__(self, scheduler: TrialScheduler | None = None) -> None:
        super().__init__()
        self.inner: TrialScheduler = scheduler or ASHAScheduler(time_attr=TIME_ATTR)
        if isinstance(self.inner, PLoRAScheduler):
            raise ConfigError("PLoRAScheduler(PLoRAScheduler(...)): wrap a Tune scheduler once")
        _refuse_pausing(self.inner)
        self.stopped: dict[str, int] = {}
        """Trial id -> the adapter step at which the wrapped scheduler stopped it."""
        self.paused: dict[str, int] = {}
        """Trial id -> the adapter step at which the wrapped scheduler paused it (until it
        reports again)."""
        self.pauses = 0
        """How many times an adapter was paused."""
        self._config_ids: dict[str, str] = {}
        self._relays: dict[str, str] = {}
        self._state_path: Path | None = None
        self._restored = False
        self._saved_brackets: dict[str, int] = {}
        self.restores = 0
        """How many times this experiment's scheduler state was restored (``Tuner.restore``)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled (Tune writes ``tuner.pkl``, also mid-run) as a fresh wrapper of the wrapped
        scheduler: what it decided is restored from the state file, never from a pickle."""
        return (type(self), (self.inner,))

    # -- Tune's hooks -------------------------------------------------------------------
    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        ok = bool(self.inner.set_search_properties(metric, mode, **spec))
        self._metric = self.inner.metric
        return ok

    @property
    def supports_buffered_results(self) -> bool:
        return bool(self.inner.supports_buffered_results)

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        self._load_once(trial)
        self._announce(trial)
        self.inner.on_trial_add(tune_controller, trial)
        bracket = self._saved_brackets.get(trial.trial_id)
        if bracket is not None and isinstance(self.inner, AsyncHyperBandScheduler):
            self.inner._trial_info[trial.trial_id] = self.inner._brackets[bracket]

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        self.inner.on_trial_error(tune_controller, trial)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        relay = result.get("plora_relay")
        if relay:
            self._relays[trial.trial_id] = str(relay)
        if result.get("config_id"):
            self._config_ids[trial.trial_id] = str(result["config_id"])
        if trial.trial_id in self.stopped:
            return TrialScheduler.CONTINUE  # its adapter is stopping: the proxy ends by itself
        self.paused.pop(trial.trial_id, None)  # reporting again: it was resumed
        decision = self.inner.on_trial_result(tune_controller, trial, result)
        step = int(result.get(TIME_ATTR, 0))
        if decision == TrialScheduler.PAUSE:
            last = result.get("status") is not None or step >= _max_steps(trial, result)
            if last or not _pauses_to_resume(self.inner, trial):
                decision = TrialScheduler.CONTINUE  # yield time: a proxy holds no GPU to yield
            else:
                self.paused[trial.trial_id] = step
                self.pauses += 1
                self._request(trial, "pause_config", StopKind.PAUSE)
                self._save()
                return TrialScheduler.PAUSE  # Tune stops the proxy; a resume starts it again
        if decision == TrialScheduler.STOP:
            if result.get("status") is None and step < _max_steps(trial, result):
                self._stop_adapter(trial, result, step)
            self._save()
            return TrialScheduler.CONTINUE
        self._save()
        return decision

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        # Tune's stop_trial calls this, not on_trial_remove, for a paused trial still saving
        # its pause (status RUNNING): HyperBand stops such bracket losers too
        self._stop_if_paused(trial)
        if result and trial.trial_id not in self.stopped:
            self.inner.on_trial_complete(tune_controller, trial, result)
        else:  # a stopped trial's last result must not enter the rungs a second time
            self.inner.on_trial_remove(tune_controller, trial)
        self._save()

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        self._stop_if_paused(trial)
        self.inner.on_trial_remove(tune_controller, trial)
        self._save()

    def choose_trial_to_run(self, tune_controller: Any) -> Any:
        return self.inner.choose_trial_to_run(tune_controller)

    def debug_string(self) -> str:
        return (
            f"PLoRAScheduler: {len(self.stopped)} adapters stopped, {len(self.paused)} paused\n"
            f"{self.inner.debug_string()}"
        )

    def _announce(self, trial: Any) -> None:
        """A trial Tune will start (not one restored finished or paused): its sweep plans it
        with the trials that start before it (:func:`plora.tune.services.announce_trials`)."""
        from plora.tune.services import announce_trials

        storage = getattr(trial, "storage", None)
        if storage is not None and getattr(trial, "status", None) == "PENDING":
            announce_trials([trial.trial_id], str(Path(storage.experiment_fs_path).absolute()))

    # -- stopping -------------------------------------------------------------------------
    def _stop_adapter(self, trial: Any, result: Mapping[str, Any], step: int) -> None:
        self.stopped[trial.trial_id] = step
        self._request(trial, "stop_config", StopKind.EARLY)

    def _stop_if_paused(self, trial: Any) -> None:
        """A paused trial that ends without reporting again ends stopped at its pause step."""
        if trial.trial_id in self.paused:
            self.stopped[trial.trial_id] = self.paused.pop(trial.trial_id)
            self._request(trial, "stop_config", StopKind.STOPPED_PAUSED)

    def _request(self, trial: Any, method: str, kind: StopKind) -> None:
        """Ask the trial's sweep (its relay) to stop or pause the trial's adapter."""
        import ray

        config_id, relay = self._config_ids.get(trial.trial_id), self._relays.get(trial.trial_id)
        if not config_id or not relay:
            logging.getLogger(__name__).warning(
                "trial %s has no plora config (not a plora_trainable trial?): no %s",
                trial.trial_id, kind,
            )  # fmt: skip
            return
        with contextlib.suppress(ValueError):  # the sweep run ended meanwhile: nothing to do
            getattr(ray.get_actor(relay), method).remote(config_id, str(kind))

    # -- state ----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """JSON-able state: the trials stopped and the wrapped scheduler's own state."""
        return {
            "version": STATE_VERSION,
            "stopped": dict(self.stopped),
            "paused": dict(self.paused),
            "pauses": self.pauses,
            "restores": self.restores,
            "inner": inner_state(self.inner),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`get_state` (before the restored trials are added)."""
        if int(state.get("version", 0)) != STATE_VERSION:
            raise ConfigError(
                f"{STATE_FILE}: version={state.get('version')} is not {STATE_VERSION}; "
                "restore with the plora version that wrote it"
            )
        self.stopped = {str(k): int(v) for k, v in state["stopped"].items()}
        self.paused = {str(k): int(v) for k, v in state.get("paused", {}).items()}
        self.pauses = int(state.get("pauses", 0))
        self.restores = int(state.get("restores", 0))
        set_inner_state(self.inner, state["inner"], where=STATE_FILE)
        self._saved_brackets = {
            str(t): int(i) for t, i in state["inner"].get("trial_bracket", {}).items()
        }

    def _load_once(self, trial: Any) -> None:
        if self._restored:
            return
        self._restored = True
        storage = getattr(trial, "storage", None)
        if storage is None:
            return
        # Tune's driver staging directory: synced to the experiment directory with Tune's own
        # experiment state (so the two match after a kill) and back down on Tuner.restore; a file
        # written straight into the experiment directory is overwritten by that sync
        self._state_path = Path(storage.experiment_driver_staging_path) / STATE_FILE
        if self._state_path.is_file():
            try:
                state = json.loads(self._state_path.read_text())
            except json.JSONDecodeError:  # a driver killed while Tune synced it: cut short
                logging.getLogger(__name__).warning(
                    "%s is not valid JSON (cut short by a kill?): %s restarts empty",
                    self._state_path, type(self.inner).__name__,
                )  # fmt: skip
                return
            self.set_state(state)
            self.restores += 1
            self._save()  # the restored state is durable before any new decision

    def _save(self) -> None:
        if self._state_path is not None:
            # the temporary goes beside the staging directory, not in it: Tune's sync of that
            # directory would list it and fail to copy it once renamed ("Last sync command
            # failed ... FileNotFoundError"), and that round's experiment state not synced
            atomic_write_json(self._state_path, self.get_state(),
                              tmp_dir=self._state_path.parent.parent)  # fmt: skip


def _refuse_pausing(inner: TrialScheduler) -> None:
    """One line for a scheduler whose pauses plora cannot carry out."""
    from ray.tune.schedulers import PopulationBasedTraining

    if isinstance(inner, PopulationBasedTraining):
        raise ConfigError(
            f"PLoRAScheduler({type(inner).__name__}): its exploit step changes a paused trial's "
            "config and weights, which a packed adapter cannot take; use ASHAScheduler, "
            "HyperBandScheduler or MedianStoppingRule"
        )


def _pauses_to_resume(inner: TrialScheduler, trial: Any) -> bool:
    """Whether ``inner``'s PAUSE just given for ``trial`` means "stop now, resume later" (a
    MedianStoppingRule that yields time to pending trials pauses nothing that needs saving)."""
    from ray.tune.schedulers import MedianStoppingRule

    if isinstance(inner, MedianStoppingRule):
        return trial in inner._stopped_trials
    return True


def _max_steps(trial: Any, result: Mapping[str, Any]) -> int:
    """The adapter's step budget, when the result or the trial config says it (else no limit)."""
    for source in (result, getattr(trial, "config", {}) or {}):
        if source.get("max_steps"):
            return int(source["max_steps"])
    return 1 << 62


__all__ = ["STATE_FILE", "TIME_ATTR", "PLoRAScheduler", "StopKind"]
