"""Validation primitives of the config dataclasses and the YAML loader.

Each ``as_*`` checks one user value and raises :class:`~plora.config.errors.ConfigError`
(``FILE[:LINE]: KEY=VALUE: PROBLEM; FIX``) naming the field-local key; :func:`load_yaml` reads a
sweep file and remembers the line of every key so errors can point at it.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from plora.config.errors import NO_VALUE, ConfigError, join_key


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """``" (did you mean 'lr'?)"`` when ``name`` is close to one of ``options``, else ``""``."""
    match = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def check_keys(data: Mapping[str, Any], allowed: Iterable[str], *, where: str | None) -> None:
    """Raise for the first key of ``data`` not in ``allowed`` (with a did-you-mean)."""
    allowed = list(allowed)
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(
                "keys must be strings", key=join_key(where, str(key)), value=value,
                fix=f"use one of: {', '.join(allowed)}",
            )  # fmt: skip
        if key not in allowed:
            raise ConfigError(
                "unknown key" + did_you_mean(key, allowed),
                key=join_key(where, key),
                value=value,
                fix=f"allowed keys here: {', '.join(allowed)}",
            )


def expect_mapping(value: Any, key: str | None, *, what: str) -> Mapping[str, Any]:
    """Return ``value`` if it is a mapping (a YAML section), else raise."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"must be a mapping ({what})",
            key=key,
            value=value,
            fix="write it as 'key: value' lines",
        )
    return value


def as_int(value: Any, key: str | None, *, ge: int | None = None, fix: str | None = None) -> int:
    """``value`` as an int (bools and non-integral floats rejected), optionally ``>= ge``."""
    if isinstance(value, float) and value.is_integer() and not isinstance(value, bool):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            "must be an integer", key=key, value=value, fix=fix or "write a whole number"
        )
    if ge is not None and value < ge:
        raise ConfigError(f"must be >= {ge}", key=key, value=value, fix=fix)
    return value


def as_float(
    value: Any,
    key: str | None,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    fix: str | None = None,
) -> float:
    """``value`` as a finite float, with optional bounds.

    Strings such as ``"2e-5"`` are accepted: YAML 1.1 (PyYAML) reads ``2e-5`` as a string and
    only ``2.0e-5`` as a float, a trap every YAML user falls into once.
    """
    raw = value
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(
                "must be a number", key=key, value=raw, fix=fix or "write e.g. 1.0e-4"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError("must be a number", key=key, value=raw, fix=fix or "write e.g. 1.0e-4")
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError("must be a finite number", key=key, value=raw, fix=fix)
    for ok, text, bound in (
        (gt is None or number > gt, "must be >", gt),
        (ge is None or number >= ge, "must be >=", ge),
        (lt is None or number < lt, "must be <", lt),
        (le is None or number <= le, "must be <=", le),
    ):
        if not ok:
            raise ConfigError(f"{text} {bound:g}", key=key, value=raw, fix=fix)
    return number


def as_bool(value: Any, key: str | None) -> bool:
    """``value`` as a bool (YAML ``true``/``false`` only)."""
    if not isinstance(value, bool):
        raise ConfigError("must be true or false", key=key, value=value, fix="write true or false")
    return value


def as_choice(
    value: Any, key: str | None, choices: Iterable[str], *, fix: str | None = None
) -> str:
    """``value`` as one of ``choices`` (a string)."""
    choices = list(choices)
    if not isinstance(value, str) or value not in choices:
        hint = did_you_mean(str(value), choices) if isinstance(value, str) else ""
        raise ConfigError(
            f"must be one of {', '.join(choices)}{hint}", key=key, value=value, fix=fix
        )
    return value


def as_switch(value: Any, key: str | None, *, fix: str | None = None) -> str:
    """``value`` as ``"auto"``, ``"on"`` or ``"off"`` (YAML 1.1 reads a bare on / off as a
    boolean: ``True``/``False`` are on/off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in ("auto", "on", "off"):
        raise ConfigError("must be auto, on or off", key=key, value=value, fix=fix)
    return str(value)


def as_str(value: Any, key: str | None, *, fix: str | None = None) -> str:
    """``value`` as a non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("must be a non-empty string", key=key, value=value, fix=fix)
    return value


# ----------------------------------------------------------------------------------------- YAML


def load_yaml(path: str | os.PathLike[str]) -> tuple[Any, dict[str, int]]:
    """Read a YAML file: ``(data, lines)`` with ``lines[key_path] = 1-based line``.

    Raises :class:`ConfigError` for a missing/unreadable file, bad syntax (with line and the
    offending text) and duplicate keys (which PyYAML would silently overwrite).
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            "file not found", fix="check the path to the sweep file", file=path
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"cannot read ({err.__class__.__name__})",
            file=path,
            fix="pass a readable UTF-8 YAML file",
        ) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark else None
        src = (
            text.splitlines()[mark.line].strip()
            if mark and mark.line < len(text.splitlines())
            else ""
        )
        problem = " ".join(str(err.problem or err.context or "syntax error").split())
        if err.context and err.context_mark and err.problem:
            problem = f"{err.context} (line {err.context_mark.line + 1}): {problem}"
        raise ConfigError(
            f"invalid YAML: {problem}", value=src or NO_VALUE, file=path, line=line,
            fix="fix the YAML syntax (check brackets, quotes, colons and indentation)",
        ) from None  # fmt: skip
    except yaml.YAMLError as err:
        raise ConfigError(
            f"invalid YAML: {' '.join(str(err).split())}", file=path, fix="fix the YAML syntax"
        ) from None
    lines: dict[str, int] = {}
    if node is not None:
        _index_lines(node, "", lines, path)
    return data, lines


def _index_lines(node: Any, prefix: str, lines: dict[str, int], path: Path) -> None:
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            full = join_key(prefix, key)
            if key in seen:
                raise ConfigError(
                    "duplicate key", key=full, file=path, line=key_node.start_mark.line + 1,
                    fix="remove one of the two entries",
                )  # fmt: skip
            seen.add(key)
            lines[full] = key_node.start_mark.line + 1
            _index_lines(value_node, full, lines, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            full = join_key(prefix, i)
            lines[full] = item.start_mark.line + 1
            _index_lines(item, full, lines, path)
