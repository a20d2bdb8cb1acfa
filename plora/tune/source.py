"""Where a sweep's configs come from: the :class:`ConfigSource` protocol the coordinator asks
and tells, :class:`StaticSource` over a fixed list (grid/random expansion), and
:class:`RegistrationSource`, fed by Ray Tune proxy trials (:mod:`plora.tune.trainable`).

A Ray Tune searcher in ask/tell mode is the other source (:mod:`plora.tune.search`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from plora.config import LoRAConfig


@runtime_checkable
class ConfigSource(Protocol):
    """Where configs come from: the searcher bridge (``plora.tune.search``) or a fixed list."""

    def ask(self, n: int) -> list[LoRAConfig]:
        """Up to ``n`` new configs; empty when exhausted or waiting for results."""
        ...

    def tell(self, config_id: str, metrics: dict[str, Any]) -> None:
        """Report a finished config's metrics."""
        ...

    def is_finished(self) -> bool:
        """True when no config will ever come again."""
        ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


class StaticSource:
    """A :class:`ConfigSource` over a fixed list of configs (grid-like, in order)."""

    def __init__(self, configs: Sequence[LoRAConfig]) -> None:
        ids = [c.config_id for c in configs]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate config ids: {', '.join(dup)}")
        self._configs = list(configs)
        self._next = 0

    def ask(self, n: int) -> list[LoRAConfig]:
        out = self._configs[self._next : self._next + max(n, 0)]
        self._next += len(out)
        return out

    @property
    def configs(self) -> tuple[LoRAConfig, ...]:
        """Every config this source gives, in order."""
        return tuple(self._configs)

    def tell(self, config_id: str, metrics: dict[str, Any]) -> None:
        return None

    def is_finished(self) -> bool:
        return self._next >= len(self._configs)

    def get_state(self) -> dict[str, Any]:
        return {"next": self._next}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._next = int(state["next"])


class RegistrationSource:
    """A :class:`ConfigSource` whose configs are registered from outside, one at a time (each
    Ray Tune proxy trial registers its config); thread-safe.

    The planner should see many configs before it packs them, but Tune starts trials one by one:
    registered configs are handed out (:meth:`ask`) once every config announced by
    :meth:`expect` (the trials Tune added and is starting) registered and no new one came for
    ``settle_s`` seconds. Tune starts a trial's actor seconds after it adds the trial, more on a
    busy machine, so a quiet time alone would plan whichever trials happened to be up. An
    announced config that has not registered ``expect_s`` seconds after its announcement (a
    trial Tune cannot start yet: the cluster lacks the CPUs for its proxy) is no longer waited
    for. The source is finished once every config it handed out was told (ended), none
    announced is still awaited, and nothing was registered or told for ``linger_s`` seconds; it
    then refuses registrations (:meth:`add` returns False) so whoever registers knows to start a
    new run.

    Args:
        settle_s: Quiet seconds after the last registration before configs are handed out.
        linger_s: Idle seconds, everything ended, after which the source is finished.
        expect_s: Longest wait for an announced config to register.
        clock: Seconds since an arbitrary origin (default ``time.monotonic``).
    """

    def __init__(
        self,
        *,
        settle_s: float = 1.0,
        linger_s: float = 30.0,
        expect_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(settle_s, linger_s, expect_s) < 0:
            raise ValueError(
                f"settle_s={settle_s}, linger_s={linger_s}, expect_s={expect_s} must be >= 0"
            )
        self.settle_s = settle_s
        self.linger_s = linger_s
        self.expect_s = expect_s
        self._expected: dict[str, float] = {}  # announced, not registered: id -> when announced
        self._clock = clock
        self._lock = threading.Lock()
        self._configs: dict[str, LoRAConfig] = {}
        self._asked: list[str] = []
        self._ended: set[str] = set()
        self._last = clock()
        self._closed = False
        self.closing = False
        """No more trials will come (:meth:`close`): configs left paused will not be resumed."""

    def add(self, config: LoRAConfig) -> bool:
        """Register ``config`` (a known id is a no-op); False once the source is finished."""
        with self._lock:
            if self._closed:
                return False
            if config.config_id not in self._configs:
                self._configs[config.config_id] = config
                self._last = self._clock()
            self._expected.pop(config.config_id, None)
            return True

    def expect(self, config_ids: Iterable[str]) -> None:
        """Announce configs about to register (trials Tune added and is starting): nothing is
        handed out while one of them is awaited (at most ``expect_s`` seconds each)."""
        with self._lock:
            now = self._clock()
            for cid in config_ids:
                if cid not in self._configs:
                    self._expected.setdefault(cid, now)

    def _awaited(self) -> bool:
        """Whether an announced config has yet to register (within its ``expect_s``)."""
        now = self._clock()
        return any(now - t < self.expect_s for t in self._expected.values())

    def close(self) -> None:
        """No more registrations will come (the Tune experiment ended): finished as soon as
        every config handed out ended, without lingering."""
        with self._lock:
            self.linger_s = 0.0
            self.closing = True

    def has_waiting(self) -> bool:
        """True when registered configs are ready to be handed out (settled)."""
        with self._lock:
            return self._ready()

    def _ready(self) -> bool:
        waiting = len(self._configs) > len(self._asked)
        return waiting and self._clock() - self._last >= self.settle_s and not self._awaited()

    def ask(self, n: int) -> list[LoRAConfig]:
        with self._lock:
            if not self._ready():
                return []
            asked = set(self._asked)
            out = [c for cid, c in self._configs.items() if cid not in asked][: max(n, 0)]
            self._asked += [c.config_id for c in out]
            return out

    def tell(self, config_id: str, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._ended.add(config_id)
            self._last = self._clock()

    def is_finished(self) -> bool:
        with self._lock:
            if not self._closed:
                idle = self._clock() - self._last >= self.linger_s
                every = len(self._asked) == len(self._configs) and not self._awaited()
                self._closed = idle and every and self._ended >= set(self._asked)
            return self._closed

    def get_state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "configs": [c.to_dict() for c in self._configs.values()],
                "asked": list(self._asked),
                "ended": sorted(self._ended),
            }

    def set_state(self, state: Mapping[str, Any]) -> None:
        with self._lock:
            mine = self._configs  # registered before the restore: kept, after the saved ones
            self._configs = {d["config_id"]: LoRAConfig.from_dict(d) for d in state["configs"]}
            self._configs.update({c: v for c, v in mine.items() if c not in self._configs})
            self._asked = list(state["asked"])
            self._ended = set(state["ended"])
            self._last = self._clock()
            self._closed = False


__all__ = ["ConfigSource", "RegistrationSource", "StaticSource"]
