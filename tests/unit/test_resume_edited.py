"""Fault test: ``--resume`` with an edited sweep file is refused, naming what changed, unless
``--allow-changed`` -- never silently run as the old sweep (or the old as the new)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_sweep_cli import assert_one_error, run

from plora.config import ConfigError, SweepConfig
from plora.config.diff import sweep_changes
from plora.runtime import driver
from plora.runtime.driver import RunOptions, run_sweep

ROOT = Path(__file__).resolve().parents[2]


def _sweep(tmp_path: Path, name: str, **space) -> Path:
    data = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    data["space"].update(space)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def sweep_dir(tmp_path) -> Path:
    """A sweep directory as ``plora sweep`` leaves it when its driver is killed (what resume
    reads before Ray: sweep.yaml and state.json)."""
    out = tmp_path / "out"
    out.mkdir()
    SweepConfig.from_yaml(_sweep(tmp_path, "orig.yaml")).to_yaml(out / "sweep.yaml")
    (out / "state.json").write_text("{}")
    return out


class _ReachedRay(Exception):
    pass


@pytest.fixture
def stop_at_ray(monkeypatch):
    """Stop ``run_sweep`` where it would start Ray; record the sweep it would run."""
    seen = {}

    def prepare(sweep, **kw):
        seen["sweep"] = sweep
        return None, None, "exact_match", None

    def connect(*a, **kw):
        raise _ReachedRay

    monkeypatch.setattr(driver, "prepare", prepare)
    monkeypatch.setattr(driver, "connect", connect)
    return seen


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_sweep_changes_lists_each_changed_key(tmp_path) -> None:
    a = SweepConfig.from_yaml(_sweep(tmp_path, "a.yaml"))
    b = SweepConfig.from_yaml(_sweep(tmp_path, "b.yaml", lr=[1e-3, 3e-2, 1e-1], max_steps=50))
    assert sweep_changes(a, a) == []
    assert sweep_changes(a, SweepConfig.from_yaml(_sweep(tmp_path, "moved.yaml"))) == []
    changed = sweep_changes(a, b)
    assert [c.split(":")[0] for c in changed] == ["space.lr", "space.max_steps"]
    assert "-> 50" in changed[1]


def test_an_edited_sweep_file_is_refused_and_nothing_changes(tmp_path, sweep_dir, stop_at_ray):
    edited = SweepConfig.from_yaml(_sweep(tmp_path, "edited.yaml", rank=[4, 16, 64]))
    before = _files(sweep_dir)
    with pytest.raises(
        ConfigError, match=r"space\.rank: \[4, 16\] -> \[4, 16, 64\].*--allow-changed"
    ):
        run_sweep(edited, sweep_dir, resume=True)
    assert _files(sweep_dir) == before and "sweep" not in stop_at_ray


def test_the_unchanged_sweep_and_allow_changed_go_on(tmp_path, sweep_dir, stop_at_ray):
    same = SweepConfig.from_yaml(_sweep(tmp_path, "same.yaml"))
    with pytest.raises(_ReachedRay):
        run_sweep(same, sweep_dir, resume=True)
    edited = SweepConfig.from_yaml(_sweep(tmp_path, "edited.yaml", rank=[4, 16, 64]))
    with pytest.raises(_ReachedRay):
        run_sweep(edited, sweep_dir, resume=True, options=RunOptions(allow_changed=True))
    assert stop_at_ray["sweep"].space.to_dict()["rank"] == [4, 16, 64]  # the edited one runs


def test_cli_resume_with_an_edited_file_is_one_line(tmp_path, sweep_dir, stop_at_ray) -> None:
    path = _sweep(tmp_path, "edited.yaml", lr=[1e-3])
    result = run("sweep", str(path), "--out", str(sweep_dir), "--resume")
    assert_one_error(result, "space.lr", "--allow-changed", str(sweep_dir / "sweep.yaml"))
