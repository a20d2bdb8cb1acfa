"""Fault test: a damaged train-state checkpoint costs one checkpoint interval, never a config.

A pack is interrupted (abort after 5 steps, checkpoints every 2), its newest checkpoint is
damaged in one of the ways a crash or a bad disk leaves it, and the pack is run again with
``resume``: it must end with adapters bitwise equal to an uninterrupted run (the reference),
having resumed from the checkpoint before the damaged one -- or, with every checkpoint damaged,
from scratch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from plora.config import DatasetSpec, LoRAConfig
from plora.engine import Control, run_pack
from plora.engine.checkpoint import (
    CheckpointError,
    checkpoint_dirs,
    latest_good_checkpoint,
    verify_train_state,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = DatasetSpec(builtin="arithmetic", num_examples=48, max_seq_len=48, eval_fraction=0.1)
CONFIGS = [
    LoRAConfig(config_id="aa", rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=7, seed=1),
    LoRAConfig(config_id="bb", rank=8, alpha=8, lr=1e-2, batch_size=3, max_steps=7, seed=2),
]


class Hooks:
    """Records the steps reported; aborts the pack when ``abort_at`` steps were reported."""

    def __init__(self, abort_at: int | None = None) -> None:
        self.abort_at = abort_at
        self.steps: list[int] = []

    def on_step(self, report) -> None:
        self.steps.append(max(m.step for m in report.metrics))

    def poll(self) -> Control:
        return Control(abort=len(self.steps) == self.abort_at)


def _run(out: Path, ckpt: Path, hooks: Hooks):
    return run_pack(model="tiny-qwen2", configs=CONFIGS, dataset=DATA, out_dir=out,
                    checkpoint_dir=ckpt, checkpoint_every=2, hooks=hooks, evaluate=False)  # fmt: skip


def _damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "flip":  # one byte in the middle: a bad disk, a torn copy
        mid = len(data) // 2
        file.write_bytes(data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :])
    elif how == "truncate":  # a write cut short
        file.write_bytes(data[: len(data) // 3])
    elif how == "delete":
        file.unlink()
    else:
        raise AssertionError(how)


def _newest_train_states(ckpt: Path) -> list[Path]:
    return sorted(ckpt.rglob("train_state.pt"), key=lambda p: p.stat().st_mtime, reverse=True)


def _weights(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {c.config_id: load_file(out / "adapters" / c.config_id / "adapter_model.safetensors")
            for c in CONFIGS}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("straight")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests (one_thread): the same float reductions
    try:
        _run(out, out / "ckpt", Hooks())
    finally:
        torch.set_num_threads(n)
    return _weights(out)


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, reference, how) -> None:
    ckpt = tmp_path / "ckpt"
    first = _run(tmp_path / "o", ckpt, Hooks(abort_at=5))
    assert all(str(r.status) == "aborted" for r in first.results.values())
    files = _newest_train_states(ckpt)
    assert len(files) >= 2, "the checkpoint before the newest one must be kept"
    _damage(files[0], how)

    state, _, notes = latest_good_checkpoint(ckpt)
    assert state is not None and state["global_step"] == 4
    assert any("skipped" in n for n in notes), notes

    hooks = Hooks()
    again = _run(tmp_path / "o", ckpt, hooks)
    assert hooks.steps[0] == 5  # one interval (step 5) repeated, not the whole job
    assert any("state-000000005" in n and "skipped" in n for n in again.notes), again.notes
    assert {c: str(r.status) for c, r in again.results.items()} == {
        "aa": "completed",
        "bb": "completed",
    }
    got = _weights(tmp_path / "o")
    for cid, want in reference.items():
        assert got[cid].keys() == want.keys()
        for key in want:
            assert torch.equal(got[cid][key], want[key]), (cid, key)


def test_every_checkpoint_damaged_restarts_the_configs_from_scratch(tmp_path, reference) -> None:
    ckpt = tmp_path / "ckpt"
    _run(tmp_path / "o", ckpt, Hooks(abort_at=5))
    for file in _newest_train_states(ckpt):
        _damage(file, "flip")
    hooks = Hooks()
    again = _run(tmp_path / "o", ckpt, hooks)
    assert hooks.steps[0] == 1
    assert again.notes[-1] == "no checkpoint verifies: the job's configs start from scratch"
    assert sorted(again.results) == ["aa", "bb"]
    got = _weights(tmp_path / "o")
    assert all(torch.equal(got[c][k], reference[c][k]) for c in reference for k in reference[c])


def test_verify_names_the_problem(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(tmp_path / "o", ckpt, Hooks(abort_at=3))
    newest = checkpoint_dirs(ckpt)[0]
    state, results = verify_train_state(newest)
    assert state["global_step"] == 3 and results == {}
    meta = json.loads((newest / "meta.json").read_text())
    assert set(meta["sha256"]) == {"train_state.pt", "results.json"}
    (newest / "results.json").write_text('{"aa": 1}')  # edited after the fact
    with pytest.raises(CheckpointError, match=r"results\.json: checksum mismatch"):
        verify_train_state(newest)
    (newest / "meta.json").unlink()  # a numbered train-state without checksums is not trusted
    with pytest.raises(CheckpointError, match=r"meta\.json"):
        verify_train_state(newest)
