"""The coordinator's view of resident worker groups: warm GPUs, starting groups, ready times."""

from __future__ import annotations

from plora.runtime.coordinator.residency import Residency


def test_a_group_starts_then_is_ready_then_is_lost() -> None:
    r = Residency()
    r.start([1, 0], ready_at=30.0)
    assert r.starting == {(0, 1): 30.0} and r.warm_gpus == set()
    assert r.ready_at([0, 1], now=10.0, startup_time=lambda d: 99.0) == 30.0
    assert r.ready_at([0, 1], now=40.0, startup_time=None) == 40.0  # late: ready now
    r.ready([0, 1])
    assert r.groups == {(0, 1)} and r.starting == {} and r.warm_gpus == {0, 1}
    assert r.ready_at([1, 0], now=5.0, startup_time=lambda d: 99.0) == 5.0
    r.drop([1])
    assert r.groups == set() and r.warm_gpus == set()


def test_no_group_means_a_fresh_start_up() -> None:
    r = Residency(groups={(0,)})
    assert r.ready_at([2, 3], now=1.0, startup_time=lambda d: 10.0 * d) == 21.0
    assert r.ready_at([2, 3], now=1.0, startup_time=None) == 1.0


def test_a_new_group_replaces_overlapping_ones() -> None:
    r = Residency(groups={(0,), (1,)}, starting={(2, 3): 9.0})
    r.start([1, 2], ready_at=5.0)
    assert r.groups == {(0,)} and r.starting == {(1, 2): 5.0}


def test_idle_starting_groups_hold_their_gpus_until_ready() -> None:
    r = Residency(starting={(0,): 12.0, (1,): 3.0, (2,): 50.0})
    jobs = r.idle_starting(busy={2}, now=4.0)
    assert [(j.gpu_ids, j.start_s, j.end_s, j.config_ids) for j in jobs] == [
        ((0,), 4.0, 12.0, ()),
        ((1,), 4.0, 4.0, ()),
    ]
