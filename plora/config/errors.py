"""The one error type of bad user input: :class:`ConfigError`.

Every bad user value becomes a :class:`ConfigError` whose message is one line::

    sweeps/x.yaml:12: space.lr.low=-0.001: must be > 0; use a positive learning rate

i.e. ``FILE[:LINE]: KEY=VALUE: PROBLEM; FIX``. Dataclasses raise errors carrying only the
field-local key (``low``); the YAML loader adds the file, the key prefix (``space.lr``) and the
line with :meth:`ConfigError.located`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

NO_VALUE: Any = object()


def _show(value: Any) -> str:
    """A short one-line rendering of a user value (strings quoted, long values cut)."""
    text = repr(value) if isinstance(value, str) else str(value)
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:77] + "..."


def join_key(prefix: str | None, key: str | int | None) -> str:
    """``join_key("space", "lr") == "space.lr"``; integers index lists: ``"space.lr[2]"``."""
    if key is None or key == "":
        return prefix or ""
    if isinstance(key, int):
        return f"{prefix or ''}[{key}]"
    if not prefix:
        return str(key)
    if str(key).startswith("["):
        return f"{prefix}{key}"
    return f"{prefix}.{key}"


class ConfigError(ValueError):
    """A bad sweep/config value. ``str(err)`` is one line: where, what, and what to do.

    Args:
        problem: what is wrong (``"must be > 0"``); a plain message when nothing else is given.
        key: dotted key path of the bad value (``"space.lr.low"``), if known.
        value: the bad value itself, if any.
        fix: what the user should do about it.
        file: the file the value came from.
        line: 1-based line of ``key`` in ``file``.
    """

    def __init__(
        self,
        problem: str,
        *,
        key: str | None = None,
        value: Any = NO_VALUE,
        fix: str | None = None,
        file: str | os.PathLike[str] | None = None,
        line: int | None = None,
    ) -> None:
        self.problem = problem
        self.key = key
        self.value = value
        self.fix = fix
        self.file = None if file is None else str(file)
        self.line = line
        super().__init__(self._render())

    @property
    def has_value(self) -> bool:
        """Whether the error names a concrete bad value."""
        return self.value is not NO_VALUE

    def _render(self) -> str:
        head = ""
        if self.file:
            head = f"{self.file}:{self.line}: " if self.line else f"{self.file}: "
        if self.key:
            head += self.key + (f"={_show(self.value)}" if self.has_value else "") + ": "
        elif self.has_value:
            head += f"{_show(self.value)}: "
        text = head + self.problem + (f"; {self.fix}" if self.fix else "")
        return " ".join(text.split())

    def located(
        self,
        *,
        file: str | os.PathLike[str] | None = None,
        prefix: str | None = None,
        lines: Mapping[str, int] | None = None,
    ) -> ConfigError:
        """A copy (same class) with ``prefix`` prepended to the key and ``file``/line filled in.

        A file or line already present is kept. ``lines`` maps key paths to line numbers;
        the line of the closest ancestor key is used when the key itself has none.
        """
        err = copy.copy(self)
        if prefix:
            err.key = join_key(prefix, self.key) if self.key else prefix
        if err.file is None and file is not None:
            err.file = str(file)
        if err.line is None and lines:
            err.line = line_of(err.key or "", lines)
        err.args = (err._render(),)
        return err


def line_of(key: str, lines: Mapping[str, int]) -> int | None:
    """The line of ``key`` or of its closest ancestor in ``lines`` (None if unknown)."""
    while key:
        if key in lines:
            return lines[key]
        cut = max(key.rfind("."), key.rfind("["))
        key = key[:cut] if cut > 0 else ""
    return None


__all__ = ["ConfigError", "join_key", "line_of"]
