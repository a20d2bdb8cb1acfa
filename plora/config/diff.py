"""What changed between two sweeps: ``--resume`` compares the sweep file it is given with the
sweep saved in the sweep directory (:func:`sweep_changes`), so an edited file is never run as the
old one, nor the old one as the edited file, without the user saying which.
"""

from __future__ import annotations

from typing import Any

from plora.config.sweep import SweepConfig


def sweep_changes(saved: SweepConfig, given: SweepConfig) -> list[str]:
    """Every key whose value differs, as ``key.path: OLD -> NEW`` (empty: the same sweep).

    Both sweeps are compared in their resolved form (``to_dict``: defaults filled in, relative
    paths resolved), so a file that only moved or was reformatted is unchanged. ``logging:``
    is left out: where the curves go changes nothing the sweep trains (``--resume`` logs where
    the given file says).
    """
    out: list[str] = []
    old, new = saved.to_dict(), given.to_dict()
    for d in (old, new):  # where the curves go is not what the sweep runs: the given one holds
        d.pop("logging", None)
    _diff(old, new, "", out)
    return out


#: Top-level keys of a sweep that decide which configs it has (the config source's inputs).
SPACE_KEYS: tuple[str, ...] = ("space", "search", "num_samples", "seed", "metric", "mode")


def changes_space(changes: list[str]) -> bool:
    """Whether ``changes`` (:func:`sweep_changes`) touch which configs the sweep has, not only
    how it runs them (hardware, planner, dataset file paths)."""
    return any(c.split(":", 1)[0].split(".", 1)[0] in SPACE_KEYS for c in changes)


def _diff(old: Any, new: Any, where: str, out: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            path = f"{where}.{key}" if where else str(key)
            _diff(old.get(key, _MISSING), new.get(key, _MISSING), path, out)
        return
    if old != new:
        out.append(f"{where}: {_show(old)} -> {_show(new)}")


class _Missing:
    def __repr__(self) -> str:
        return "(absent)"


_MISSING = _Missing()


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["SPACE_KEYS", "changes_space", "sweep_changes"]
