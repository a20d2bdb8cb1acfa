"""Waiting on events in the Ray tier, each with a deadline, instead of sleeping for a time."""

from __future__ import annotations

import time


def driver_actors_gone(prefix: str, *, timeout_s: float = 120.0) -> None:
    """Wait until a killed driver's Ray objects are gone: no named actor and no placement group
    whose name starts with ``prefix`` (its sweep's ``plora-<name>-`` actors and worker groups)
    is left. Ray removes them once it sees the driver's job dead, which takes longer on a busy
    machine; a new driver of the same sweep would find them (names, GPUs) before that.

    Raises:
        AssertionError: some are still there after ``timeout_s`` (Ray did not clean up).
    """
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix)]  # fmt: skip
        groups = [g["name"] for g in ray.util.placement_group_table().values()
                  if g["name"].startswith(prefix) and g["state"] != "REMOVED"]  # fmt: skip
        if not actors and not groups:
            return
        assert time.monotonic() < deadline, f"left by the killed driver: {actors + groups}"
        time.sleep(0.1)
