"""The coordinator's side of the searcher: configs in (:func:`ask`).

A config whose hyperparameters equal a known config's -- a searcher's repeated suggestion, a
random draw, an edited space's config -- is not trained again: its id is an *alias* of the known
config (:meth:`~.state.ConfigBook.admit`), and the source is told the known config's result
under the alias once there is one (:meth:`~.state.CoordinatorState.tell`).
"""

from __future__ import annotations

from plora.runtime.coordinator.ledger import tell_metrics
from plora.runtime.coordinator.state import CoordinatorState
from plora.runtime.records import Decision


def ask(state: CoordinatorState) -> None:
    """New configs from the source, up to ``ask_batch`` queued; a plan is due when some came.
    A known id given again (a restarted source) is told what is known of it."""
    book, source = state.configs, state.source
    while not source.is_finished():
        want = state.ask_batch - len(book.queued_ids())
        if want <= 0:
            return
        given = source.ask(want)
        for c in given:  # a known id again (a restarted source): told what it knows
            if book.is_finished(c.config_id):
                r = book.results.get(c.config_id, {})
                st = book.status[c.config_id]
                source.tell(c.config_id, tell_metrics(r, state.metric_name, status=st))
        got = [c for c in given if c.config_id not in book.by_id]
        if not got:
            return
        new, dups = [], {}
        for c in got:
            first = book.admit(c)
            if first is not None:
                dups[c.config_id] = first
            else:
                new.append(c)
        state.decide(Decision.ASK, config_ids=[c.config_id for c in new], requested=want,
                     duplicates=dups)  # fmt: skip
        for first in set(dups.values()):
            if book.is_finished(first):  # a known result: the new ids are told it now
                r = book.results.get(first, {})
                metrics = tell_metrics(r, state.metric_name, status=book.status[first])
                for alias in book.pop_aliases(first):
                    source.tell(alias, metrics)
        if new:
            state.plans.due = True
            return


__all__ = ["ask"]
