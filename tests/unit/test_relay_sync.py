"""The checkpoint barrier without Ray: a worker's ``RelayHooks.sync`` returns only after the
driver drained and acknowledged its reports (so they are on disk before the checkpoint), and a
sync with nothing new to make durable returns at once."""

from __future__ import annotations

import threading
import time

from runtime_fakes import report

from plora.runtime.actors import worker
from plora.runtime.actors.relay import CoordinatorActor


class _Handle:
    """A relay actor handle whose ``.remote`` calls run in place (``ray.get`` is identity)."""

    def __init__(self, actor: CoordinatorActor) -> None:
        self.actor = actor
        self.lock = threading.Lock()

    def __getattr__(self, name: str):
        method = getattr(self.actor, name)
        handle = self

        class _M:
            @staticmethod
            def remote(*args, **kwargs):
                with handle.lock:  # one call at a time, as the actor (max_concurrency=1)
                    return method(*args, **kwargs)

        return _M


def test_sync_waits_for_the_drivers_acknowledgement(monkeypatch) -> None:
    monkeypatch.setattr(worker.ray, "get", lambda x: x)
    relay = CoordinatorActor()
    hooks = worker.RelayHooks(_Handle(relay), "j1", flush_every_s=60.0)
    hooks.on_step(report({"config_id": "a", "step": 1}))
    hooks.on_step(report({"config_id": "a", "step": 2}))
    done = threading.Event()
    t = threading.Thread(target=lambda: (hooks.sync(timeout_s=10), done.set()))
    t.start()
    time.sleep(0.2)
    assert not done.is_set()  # nothing acknowledged yet: the checkpoint must wait
    reports, _, syncs = relay.drain()  # the driver: drain, write to disk, acknowledge
    assert [r.metrics[0].step for r in reports["j1"]] == [1, 2] and "j1" in syncs
    relay.ack_sync(syncs)
    t.join(5)
    assert done.is_set()
    seq = relay._sync_seq
    hooks.sync(timeout_s=0.1)  # no step since: returns at once, asks nothing
    assert relay._sync_seq == seq
