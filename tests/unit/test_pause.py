"""Pause = an adapter leaves its pack with its whole train-state; it joins a later pack exactly.

The reference is the same config trained without a pause (fp32 CPU): the same pack shape gives
bit-equal weights; another pack (other companions, another slot, joined by a refill) gives the
packing contract's tolerance.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from plora.config import DatasetSpec, LoRAConfig
from plora.engine import AdapterStatus, Control, run_pack
from plora.engine import checkpoint as ckpt
from plora.engine.pause import is_paused, paused_dir, paused_step

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = DatasetSpec(builtin="arithmetic", num_examples=48, max_seq_len=48, eval_fraction=0.1)
MODEL = "tiny-qwen2"


def _cfg(cid: str, **kw) -> LoRAConfig:
    base = dict(rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=6, seed=7, dropout=0.1)
    return LoRAConfig(config_id=cid, **{**base, **kw})


class Script:
    """Replays controls keyed by the number of steps reported so far."""

    def __init__(self, script: dict[int, Control]) -> None:
        self.script, self.steps, self.metrics = dict(script), 0, []

    def on_step(self, report) -> None:
        self.metrics.extend(report.metrics)
        self.steps += 1

    def poll(self) -> Control:
        return self.script.pop(self.steps, Control())


def _weights(out, cid: str) -> dict[str, torch.Tensor]:
    return load_file(out / "adapters" / cid / "adapter_model.safetensors")


def test_paused_then_resumed_equals_uninterrupted_bit_for_bit(tmp_path) -> None:
    x = _cfg("x", schedule="cosine", warmup_steps=2)
    straight = run_pack(model=MODEL, configs=[x], dataset=DATA, out_dir=tmp_path / "a")
    out = tmp_path / "b"
    hooks = Script({2: Control(pause=frozenset({"x"}))})
    first = run_pack(model=MODEL, configs=[x], dataset=DATA, out_dir=out, hooks=hooks)
    r = first.results["x"]
    assert r.status is AdapterStatus.PAUSED and r.steps == 2
    assert r.eval_loss is not None  # evaluated as it left, like every adapter that leaves
    assert is_paused(out, "x") and [m.step for m in hooks.metrics] == [1, 2]
    state = ckpt.load_train_state(paused_dir(out, "x"))["adapters"]["x"]
    assert state["step"] == 2 and state["optimizer"]["step"] == 2  # AdamW moments kept
    assert paused_step(out, "x") == 2 and paused_step(out, "nobody") is None
    again = Script({})
    second = run_pack(model=MODEL, configs=[x], dataset=DATA, out_dir=out, hooks=again)
    assert [m.step for m in again.metrics] == [3, 4, 5, 6]  # continued, not restarted
    assert second.results["x"].status is AdapterStatus.COMPLETED
    assert second.results["x"].steps == 6
    a, b = _weights(tmp_path / "a", "x"), _weights(out, "x")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.results["x"].eval_loss == straight.results["x"].eval_loss
    assert not is_paused(out, "x")  # its paused state is gone once it completed


def test_a_paused_adapter_rejoins_another_pack_by_refill_in_another_slot(tmp_path) -> None:
    x, y, z = _cfg("x", rank=8), _cfg("y", seed=3, max_steps=3), _cfg("z", seed=5, rank=16)
    straight = run_pack(model=MODEL, configs=[x], dataset=DATA, out_dir=tmp_path / "a")
    out = tmp_path / "b"
    hooks = Script({3: Control(pause=frozenset({"x"}))})
    first = run_pack(model=MODEL, configs=[x, y], dataset=DATA, out_dir=out, hooks=hooks)
    assert first.results["x"].status is AdapterStatus.PAUSED and first.results["x"].steps == 3
    assert first.results["y"].status is AdapterStatus.COMPLETED
    # a later pack: z in slot 0 for a step, then x joins as a refill (slot 1) and goes on
    again = Script({1: Control(add=(x,))})
    second = run_pack(model=MODEL, configs=[z], dataset=DATA, out_dir=out, hooks=again)
    steps = [m.step for m in again.metrics if m.config_id == "x"]
    assert steps == [4, 5, 6]
    assert second.results["x"].status is AdapterStatus.COMPLETED
    a, b = _weights(tmp_path / "a", "x"), _weights(out, "x")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7)
    assert second.results["x"].eval_loss == pytest.approx(straight.results["x"].eval_loss, 1e-5)


def test_a_damaged_paused_state_is_one_clear_error_not_a_silent_restart(tmp_path) -> None:
    x = _cfg("x")
    run_pack(model=MODEL, configs=[x], dataset=DATA, out_dir=tmp_path,
             hooks=Script({1: Control(pause=frozenset({"x"}))}))  # fmt: skip
    state = paused_dir(tmp_path, "x") / ckpt.TRAIN_STATE
    state.write_bytes(state.read_bytes()[:-50])
    with pytest.raises(ckpt.CheckpointError, match="checksum mismatch"):
        run_pack(model=MODEL, configs=[x], dataset=DATA, out_dir=tmp_path)
    # the same id with other hyperparameters (an edited sweep) is refused too
    run_pack(model=MODEL, configs=[_cfg("w")], dataset=DATA, out_dir=tmp_path / "c",
             hooks=Script({1: Control(pause=frozenset({"w"}))}))  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match="other hyperparameters"):
        run_pack(model=MODEL, configs=[_cfg("w", lr=1e-3)], dataset=DATA, out_dir=tmp_path / "c")
