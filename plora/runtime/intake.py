"""The coordinator's side of the searcher: configs in (:func:`ask`), endings out (:func:`tell`).

Functions of a :class:`~plora.runtime.coordinator_state.CoordinatorState` (the coordinator
itself). A config whose hyperparameters equal a known config's -- a searcher's repeated
suggestion, a random draw, an edited space's config -- is not trained again: its id is an
*alias* of the known config, and the source is told the known config's result under the alias
once there is one.
"""

from __future__ import annotations

from typing import Any

from plora.runtime.coordinator_state import FINISHED, CoordinatorState
from plora.runtime.ledger import tell_metrics
from plora.runtime.records import ConfigStatus, Decision


def ask(coord: CoordinatorState) -> None:
    """New configs from the source, up to ``ask_batch`` queued; sets ``_need_plan`` when some
    came. A known id given again (a restarted source) is told what is known of it."""
    while not coord.source.is_finished():
        want = coord.ask_batch - len(coord.queued_ids())
        if want <= 0:
            return
        given = coord.source.ask(want)
        for c in given:  # a known id again (a restarted source): told what it knows
            if c.config_id in coord.configs and coord.status[c.config_id] in FINISHED:
                r = coord.results.get(c.config_id, {})
                st = coord.status[c.config_id]
                coord.source.tell(c.config_id, tell_metrics(r, coord.metric_name, status=st))
        got = [c for c in given if c.config_id not in coord.configs]
        if not got:
            return
        new, dups = [], {}
        for c in got:
            first = coord._by_hparams.get(c.fingerprint())
            if first is not None and first != c.config_id:
                dups[c.config_id] = first
                coord._aliases.setdefault(first, []).append(c.config_id)
                continue
            coord._by_hparams[c.fingerprint()] = c.config_id
            coord.configs[c.config_id] = c
            coord.status[c.config_id] = ConfigStatus.QUEUED
            new.append(c)
        coord._decide(Decision.ASK, config_ids=[c.config_id for c in new], requested=want,
                      duplicates=dups)  # fmt: skip
        for first in set(dups.values()):
            if coord.status[first] in FINISHED:  # a known result: the new ids are told it now
                r = coord.results.get(first, {})
                metrics = tell_metrics(r, coord.metric_name, status=coord.status[first])
                for alias in coord._aliases.pop(first, []):
                    coord.source.tell(alias, metrics)
        if new:
            coord._need_plan = True
            return


def tell(coord: CoordinatorState, config_id: str, metrics: dict[str, Any]) -> None:
    """Tell the source how ``config_id`` ended, and under each id it was suggested again."""
    coord.source.tell(config_id, metrics)
    for alias in coord._aliases.pop(config_id, []):
        coord.source.tell(alias, metrics)


__all__ = ["ask", "tell"]
