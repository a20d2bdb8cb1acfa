"""Where a sweep's configs come from: the :class:`ConfigSource` protocol the coordinator asks
and tells, and :class:`StaticSource` over a fixed list (grid/random expansion).

A Ray Tune searcher in ask/tell mode is the other source (:mod:`plora.tune.search`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


__all__ = ["ConfigSource", "StaticSource"]
