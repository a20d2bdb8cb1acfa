"""The Tune services this driver started, by name, and what Tune's side tells them.

:func:`plora.tune.trainable.plora_trainable` starts a sweep service (a Ray actor of the runtime)
per call and keeps its handle here; :class:`plora.tune.scheduler.PLoRAScheduler` reaches the
services through this module. It sits below the runtime, as the scheduler does: the trainable,
the one module of :mod:`plora.tune` above the runtime, imports it, never the other way round.
"""

from __future__ import annotations

from typing import Any

SERVICES: dict[str, Any] = {}
"""The services this driver created, by name: a Ray actor lives while a handle to it does."""


def announce_trials(trial_ids: list[str], experiment_dir: str) -> None:
    """Tell this driver's sweeps that Tune added these trials to ``experiment_dir`` and is
    starting them (:class:`~plora.tune.scheduler.PLoRAScheduler` calls it from
    ``on_trial_add``): their configs are planned together with the first ones to register, not
    after a quiet time that a busy machine outlasts. The sweep of another experiment ignores
    them."""
    for service in SERVICES.values():
        service.expect.remote(list(trial_ids), experiment_dir)


__all__ = ["SERVICES", "announce_trials"]
