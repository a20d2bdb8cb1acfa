"""The status index (:mod:`plora.runtime.coordinator.status_index`) against a pass over the
status book: the same configs of each status in the same order, after random changes (new
configs, re-queued ones out of order, keys deleted and set again, the book replaced)."""

from __future__ import annotations

import random

from plora.runtime.coordinator.state import ConfigBook
from plora.runtime.records import ConfigStatus
from plora.sweepdir.tracked import TrackedDict


def _scan(book: ConfigBook, status: ConfigStatus) -> list[str]:
    return [c for c, s in book.status.items() if s is status]


def test_the_index_answers_as_a_pass_over_every_status() -> None:
    rng = random.Random(5)
    book = ConfigBook()
    statuses = list(ConfigStatus)
    for turn in range(400):
        for _ in range(rng.randint(1, 5)):
            cid = f"c{rng.randrange(60):02d}"
            if rng.random() < 0.05:
                book.status.pop(cid, None)  # gone; set again later, it goes last
            else:
                book.status[cid] = rng.choice(statuses)
        if turn == 200:
            book.status = TrackedDict(book.status)  # replaced (a restore): read whole again
        for s in statuses:
            assert book.ids_in(s) == _scan(book, s), (turn, s)
            assert book.count(s) == len(_scan(book, s))
        assert book.queued_ids() == _scan(book, ConfigStatus.QUEUED)
        finished = (ConfigStatus.DONE, ConfigStatus.STOPPED, ConfigStatus.FAILED)
        assert book.all_finished() == all(s in finished for s in book.status.values())


def test_a_round_reads_only_the_configs_that_changed() -> None:
    book = ConfigBook()
    for i in range(1000):
        book.status[f"c{i:04d}"] = ConfigStatus.QUEUED
    assert len(book.queued_ids()) == 1000
    book.status["c0500"] = ConfigStatus.RUNNING
    before = book.status.version
    assert book.status.changed_since(before - 1) == ["c0500"]
    assert len(book.queued_ids()) == 999 and book.index._mark == (book.status, before)


def test_a_plain_status_dict_is_read_whole() -> None:
    book = ConfigBook()
    book.status = {"a": ConfigStatus.DONE, "b": ConfigStatus.QUEUED}  # type: ignore[assignment]
    assert book.queued_ids() == ["b"] and not book.all_finished()
    book.status["b"] = ConfigStatus.DONE
    assert book.queued_ids() == [] and book.all_finished()
