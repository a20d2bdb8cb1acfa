"""run_pack end to end on the built-in tiny model: control between steps, export, eval, resume."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from plora.config import ConfigError, DatasetSpec, LoRAConfig
from plora.engine import AdapterStatus, Control, run_pack
from plora.engine.data import load_dataset
from plora.engine.evaluate import evaluate
from plora.models import load_model, resolve_model_path

pytestmark = pytest.mark.usefixtures("one_thread")


DATA = DatasetSpec(builtin="arithmetic", num_examples=48, max_seq_len=48, eval_fraction=0.1)


def _cfg(cid: str, **kw) -> LoRAConfig:
    base = dict(rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=4, seed=len(cid))
    return LoRAConfig(config_id=cid, **{**base, **kw})


class Script:
    """Hooks that replay a fixed script of controls, keyed by how many steps were reported."""

    def __init__(self, script: dict[int, Control] | None = None) -> None:
        self.script = script or {}
        self.metrics = []
        self.steps_seen = 0

    def on_step(self, report) -> None:
        assert report.profile.adapters == len(report.metrics)
        self.metrics.extend(report.metrics)
        self.steps_seen += 1

    def poll(self) -> Control:
        return self.script.pop(self.steps_seen, Control())


def test_run_pack_stop_add_export_eval(tmp_path):
    late = _cfg("late", rank=8, target_modules="all", max_steps=3)
    hooks = Script({1: Control(stop=frozenset({"short"})), 2: Control(add=(late,))})
    configs = [_cfg("keep", target_modules=("q_proj", "v_proj")), _cfg("short", rank=16)]
    res = run_pack(model="tiny-qwen2", configs=configs, dataset=DATA, out_dir=tmp_path, hooks=hooks)
    r = res.results
    assert set(r) == {"keep", "short", "late"}
    assert r["keep"].status is AdapterStatus.COMPLETED and r["keep"].steps == 4
    assert r["short"].status is AdapterStatus.STOPPED and r["short"].steps == 1
    assert r["late"].status is AdapterStatus.COMPLETED and r["late"].steps == 3
    assert r["keep"].eval_loss is not None and r["keep"].eval_loss > 0
    assert r["short"].eval_loss is not None  # stopped early: evaluated as it left
    by_cfg = {}
    for m in hooks.metrics:
        by_cfg.setdefault(m.config_id, []).append(m.step)
    assert by_cfg == {"keep": [1, 2, 3, 4], "short": [1], "late": [1, 2, 3]}
    assert res.profile is not None and len(res.profile.steps) == 5
    # every adapter reloads with PEFT on the base it names, and its eval loss (stopped ones'
    # too) is that of the reloaded PEFT model on the eval split
    base, tok = load_model("tiny-qwen2")
    data = load_dataset(DATA, tok)
    for cid in r:
        path = tmp_path / "adapters" / cid
        meta = json.loads((path / "adapter_config.json").read_text())
        assert meta["base_model_name_or_path"] == resolve_model_path("tiny-qwen2")
        model = PeftModel.from_pretrained(base, path, adapter_name=cid)
        ref = evaluate(model, tok, data.eval, metric=data.metric, labels=data.labels)
        assert r[cid].eval_loss == pytest.approx(ref.loss, rel=1e-5), cid
        weights = load_file(path / "adapter_model.safetensors")
        assert weights and all(k.startswith("base_model.model.model.layers.") for k in weights)
        base = model.unload()


def test_abort_then_resume_equals_uninterrupted(tmp_path):
    configs = [_cfg("p", max_steps=5), _cfg("q", rank=8, max_steps=3, target_modules="mlp")]
    straight = run_pack(model="tiny-llama", configs=configs, dataset=DATA, out_dir=tmp_path / "a")
    hooks = Script({2: Control(abort=True)})
    ckpt = tmp_path / "ckpt"
    first = run_pack(model="tiny-llama", configs=configs, dataset=DATA, out_dir=tmp_path / "b",
                     checkpoint_dir=ckpt, checkpoint_every=1, hooks=hooks)  # fmt: skip
    assert {c: r.status for c, r in first.results.items()} == {
        "p": AdapterStatus.ABORTED,
        "q": AdapterStatus.ABORTED,
    }
    second = run_pack(model="tiny-llama", configs=configs, dataset=DATA, out_dir=tmp_path / "b",
                      checkpoint_dir=ckpt, checkpoint_every=1)  # fmt: skip
    for cid in ("p", "q"):
        assert second.results[cid].status is AdapterStatus.COMPLETED
        assert second.results[cid].steps == straight.results[cid].steps
        a = load_file(tmp_path / "a" / "adapters" / cid / "adapter_model.safetensors")
        b = load_file(tmp_path / "b" / "adapters" / cid / "adapter_model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert second.results[cid].eval_loss == pytest.approx(straight.results[cid].eval_loss)
    # a third call finds everything done and trains nothing
    third = run_pack(model="tiny-llama", configs=configs, dataset=DATA, out_dir=tmp_path / "b",
                     checkpoint_dir=ckpt)  # fmt: skip
    assert third.results == second.results


def test_bad_inputs_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="duplicate"):
        run_pack(model="tiny-qwen2", configs=[_cfg("x"), _cfg("x")], dataset=DATA, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        run_pack(model="tiny-qwen2", configs=[_cfg("x")], dataset=DATA, out_dir=tmp_path,
                 checkpoint_every=0)  # fmt: skip


class _WatchCheckpoint(Script):
    """Records, before each step, whether a train-state checkpoint is on disk."""

    def __init__(self, ckpt) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.seen: list[bool] = []

    def poll(self) -> Control:
        from plora.engine.checkpoint import checkpoint_dirs

        self.seen.append(bool(checkpoint_dirs(self.ckpt)))
        return super().poll()


@pytest.mark.parametrize(("every_s", "expect_mid_run"), [(0.0, True), (3600.0, False)])
def test_time_based_checkpoints(tmp_path, every_s, expect_mid_run):
    ckpt = tmp_path / "ckpt"
    hooks = _WatchCheckpoint(ckpt)
    run_pack(model="tiny-qwen2", configs=[_cfg("t", max_steps=3)], dataset=DATA,
             out_dir=tmp_path / "o", checkpoint_dir=ckpt, checkpoint_every_s=every_s,
             hooks=hooks, evaluate=False)  # fmt: skip
    assert hooks.seen[0] is False  # nothing before the first step
    assert any(hooks.seen[1:]) is expect_mid_run  # 0 s: after every step; 1 h: only at the end
    with pytest.raises(ConfigError, match="checkpoint_every_s"):
        run_pack(model="tiny-qwen2", configs=[_cfg("x")], dataset=DATA, out_dir=tmp_path,
                 checkpoint_every_s=-1.0)  # fmt: skip


def test_resident_session_serves_successive_packs_with_one_load(tmp_path):
    """One PackSession (a resident worker's engine) trains two packs on one model load; the
    second pack's adapters equal the same configs trained by a fresh one-shot run_pack (the
    first pack left nothing behind on the shared base)."""
    import torch
    from safetensors.torch import load_file

    from plora.config import ModelRef
    from plora.engine import EngineSpec, PackRequest, PackSession

    session = PackSession(EngineSpec(model=ModelRef(name_or_path="tiny-qwen2"), dataset=DATA))
    first = session.run(
        PackRequest(
            job_id="j1", configs=(_cfg("a"), _cfg("bb", rank=8)), out_dir=str(tmp_path / "s")
        )
    )
    second = session.run(
        PackRequest(job_id="j2", configs=(_cfg("ccc", lr=1e-2),), out_dir=str(tmp_path / "s"))
    )
    assert session.model_loads == 1
    assert first.timings.load_s > 0 and second.timings.load_s == 0.0  # charged to the first job
    assert second.timings.model_loads == 1 and second.timings.train_s > 0
    for t in (first.timings, second.timings):  # each job's phases from its start (the timeline)
        assert t.started_at > 0 and t.first_step_s is not None and t.last_step_s is not None
        assert t.eval_end_s is not None and t.export_end_s is not None
        assert 0 < t.first_step_s < t.last_step_s < t.eval_end_s <= t.export_end_s
    assert first.timings.started_at < second.timings.started_at
    assert sorted(first.results) == ["a", "bb"] and list(second.results) == ["ccc"]
    assert all(
        r.eval_s > 0 and r.export_s > 0 for r in [*first.results.values(), *second.results.values()]
    )
    from plora.engine import adapters

    assert all(not layer.specs for layer in adapters.packed_layers(session.model).values())

    alone = run_pack(
        model="tiny-qwen2", configs=[_cfg("ccc", lr=1e-2)], dataset=DATA, out_dir=tmp_path / "alone"
    )
    got = load_file(tmp_path / "s" / "adapters" / "ccc" / "adapter_model.safetensors")
    want = load_file(tmp_path / "alone" / "adapters" / "ccc" / "adapter_model.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    assert second.results["ccc"].eval_loss == pytest.approx(
        alone.results["ccc"].eval_loss, rel=1e-6
    )
