"""Atomic writes: readers of the target directory never see a half-written file."""

from __future__ import annotations

import json

import pytest

from plora.utils import atomic_path, atomic_write_json


def test_a_temporary_kept_elsewhere_never_shows_in_the_target_directory(tmp_path) -> None:
    watched, side = tmp_path / "watched", tmp_path / "side"
    side.mkdir()
    with atomic_path(watched / "state.json", tmp_dir=side) as tmp:
        tmp.write_text("{}")
        assert list(watched.iterdir()) == [] and tmp.parent.parent == side
    assert (watched / "state.json").read_text() == "{}" and list(side.iterdir()) == []
    atomic_write_json(watched / "state.json", {"a": 1}, tmp_dir=side)
    assert json.loads((watched / "state.json").read_text()) == {"a": 1}
    assert [p.name for p in watched.iterdir()] == ["state.json"] and list(side.iterdir()) == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    target = tmp_path / "state.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
