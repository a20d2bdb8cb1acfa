"""Export off the critical path: one-transfer snapshots with the old bytes, background writes
that a job's outcome and checkpoints wait for, and what the cost model is charged."""

from __future__ import annotations

import copy
import json
import threading
import time

import pytest
import torch
from _engine_testlib import TOKENIZER, tiny_model, toy_dataset
from safetensors.torch import save_file

from plora.config import DatasetSpec, LoRAConfig
from plora.engine import checkpoint as ckpt
from plora.engine import export as export_mod
from plora.engine import job as run_mod
from plora.engine import run_pack
from plora.engine.adapters import adapter_state_dict
from plora.engine.trainer import PackedTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = DatasetSpec(builtin="arithmetic", num_examples=48, max_seq_len=48, eval_fraction=0.1)
CFGS = [
    LoRAConfig(config_id="x", rank=6, alpha=12, lr=1e-2, batch_size=2, seed=1, max_steps=5,
               target_modules=("q_proj", "v_proj", "up_proj"), dropout=0.2),
    LoRAConfig(config_id="y", rank=16, alpha=8, lr=5e-3, batch_size=3, seed=2, max_steps=8,
               target_modules="all", use_rslora=True),
]  # fmt: skip


def _cfg(cid: str, **kw) -> LoRAConfig:
    base = dict(rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=3, seed=len(cid))
    return LoRAConfig(config_id=cid, **{**base, **kw})


def _reference_export(path, *, config, weights, base=None) -> None:
    """The export as it was written before snapshots: one host copy per tensor."""
    path.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()}
    export_mod.peft_lora_config(config, base_model_name_or_path=base).save_pretrained(str(path))
    save_file(tensors, str(path / export_mod.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / "plora_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def _same_files(a, b) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def trained():
    trainer = PackedTrainer(copy.deepcopy(tiny_model("qwen2")), TOKENIZER, toy_dataset(),
                            device="cpu")  # fmt: skip
    for cfg in CFGS:
        trainer.add(cfg)
    for _ in range(3):
        trainer.step()
    return trainer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "mixed"])
@pytest.mark.parametrize("chunk_bytes", [export_mod.SNAPSHOT_CHUNK_BYTES, 2048, 1])
def test_snapshot_export_writes_the_reference_bytes(tmp_path, trained, dtype, chunk_bytes):
    """Snapshot (one transfer per chunk, views of one host buffer) + write gives byte for byte
    the files of the per-tensor export, in one chunk, several, or one per tensor."""
    for cfg in CFGS:
        live = adapter_state_dict(trained.model, trained.slot_of(cfg.config_id))
        kinds = [torch.bfloat16, torch.float32, torch.float16]
        weights = {k: v.to(kinds[i % 3] if dtype == "mixed" else dtype)
                   for i, (k, v) in enumerate(live.items())}  # fmt: skip
        snap = export_mod.snapshot_weights(weights, chunk_bytes=chunk_bytes)
        assert list(snap) == list(weights)  # same keys, same order
        new, ref = tmp_path / f"new-{cfg.config_id}", tmp_path / f"ref-{cfg.config_id}"
        export_mod.write_peft_adapter(new, config=cfg, tensors=snap, base_model_name_or_path="m")
        _reference_export(ref, config=cfg, weights=weights, base="m")
        _same_files(new, ref)
        # the one-call export is the same two halves
        one = tmp_path / f"one-{cfg.config_id}"
        export_mod.export_peft_adapter(
            one, config=cfg, weights=weights, base_model_name_or_path="m"
        )
        _same_files(one, ref)


def test_snapshot_is_independent_of_the_slot(trained):
    """The snapshot is taken at once: the slot changing afterwards (a step, a reuse) does not
    reach it -- even for float32 CPU weights, which the per-tensor path did not copy."""
    live = adapter_state_dict(trained.model, trained.slot_of("x"))
    snap = export_mod.snapshot_weights(live)
    before = {k: v.clone() for k, v in snap.items()}
    with torch.no_grad():
        for v in live.values():
            v.add_(1.0)
    try:
        for k in snap:
            torch.testing.assert_close(snap[k], before[k], rtol=0, atol=0)
            assert snap[k].dtype == torch.float32 and snap[k].device.type == "cpu"
    finally:
        with torch.no_grad():
            for v in live.values():
                v.sub_(1.0)
    with pytest.raises(ValueError, match="not PEFT-keyed"):
        export_mod.snapshot_weights({"q.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="empty"):
        export_mod.snapshot_weights({})


def test_outcome_waits_for_writes_that_overlap_the_evaluation(tmp_path, monkeypatch):
    """The files are written while the same adapters are evaluated (a write here blocks until
    the evaluation has started: a serial export would wait in vain), and the outcome comes only
    after every directory exists; the timings say what was exported and waited for."""
    eval_started = threading.Event()
    overlapped: list[bool] = []
    write, evaluate = export_mod.write_peft_adapter, run_mod._evaluate

    def slow_write(path, **kw):
        overlapped.append(eval_started.wait(timeout=10))
        time.sleep(0.2)
        return write(path, **kw)

    def watched_evaluate(trainer, tokenizer, data, ids):
        eval_started.set()
        assert not any((tmp_path / "adapters" / c).exists() for c in ids)  # still writing
        return evaluate(trainer, tokenizer, data, ids)

    monkeypatch.setattr(export_mod, "write_peft_adapter", slow_write)
    monkeypatch.setattr(run_mod, "_evaluate", watched_evaluate)
    from plora.config import ModelRef
    from plora.engine import EngineSpec, PackRequest, PackSession

    session = PackSession(EngineSpec(model=ModelRef(name_or_path="tiny-qwen2"), dataset=DATA))
    out = session.run(PackRequest(job_id="j", configs=(_cfg("a"), _cfg("bb", rank=8)),
                                  out_dir=str(tmp_path)))  # fmt: skip
    assert overlapped == [True, True]
    for cid, r in out.results.items():
        assert (tmp_path / "adapters" / cid / export_mod.ADAPTER_WEIGHTS).is_file()
        assert r.export_s >= 0.2  # its snapshot and its write
    t = out.timings
    assert t.exports == 2
    assert t.export_s == pytest.approx(sum(r.export_s for r in out.results.values()), abs=1e-3)
    assert t.export_critical_s > 0  # the snapshots at least
    assert t.export_critical_s < t.export_s  # the writes' seconds during the evaluation are not


def test_checkpoint_results_name_written_adapters(tmp_path, monkeypatch):
    """A checkpoint records a finished config only once its adapter directory is written (a
    resume trusts the results it saves)."""
    write, save = export_mod.write_peft_adapter, ckpt.write_checkpoint
    seen: list[set[str]] = []

    def slow_write(path, **kw):
        time.sleep(0.3)
        return write(path, **kw)

    def checked_save(job_dir, state, *, results, **kw):
        done = {c for c, r in results.items() if r["adapter_path"]}
        for c in done:
            assert (tmp_path / "o" / "adapters" / c / export_mod.ADAPTER_WEIGHTS).is_file(), c
        seen.append(done)
        return save(job_dir, state, results=results, **kw)

    monkeypatch.setattr(export_mod, "write_peft_adapter", slow_write)
    monkeypatch.setattr(ckpt, "write_checkpoint", checked_save)
    run_pack(model="tiny-qwen2", configs=[_cfg("s", max_steps=1), _cfg("long", max_steps=3)],
             dataset=DATA, out_dir=tmp_path / "o", checkpoint_dir=tmp_path / "c",
             checkpoint_every=1, evaluate=False)  # fmt: skip
    assert seen[0] == {"s"} and seen[-1] == {"s", "long"}


@pytest.mark.parametrize("checkpoints", [False, True])
def test_failed_write_fails_the_job_and_leaves_nothing(tmp_path, monkeypatch, checkpoints):
    """A write that fails in the background fails the job with its own error, as a failed export
    did in line; no adapter directory (or temporary) is left, and no checkpoint records it."""

    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_mod, "save_file", full_disk)  # after adapter_config.json was written
    kw = dict(checkpoint_dir=tmp_path / "c", checkpoint_every=1) if checkpoints else {}
    with pytest.raises(OSError, match="No space left on device"):
        run_pack(model="tiny-qwen2", configs=[_cfg("s", max_steps=1), _cfg("long")],
                 dataset=DATA, out_dir=tmp_path / "o", **kw)  # fmt: skip
    left = tmp_path / "o" / "adapters"
    assert not left.exists() or list(left.iterdir()) == []
    for state in ckpt.checkpoint_dirs(tmp_path / "c"):
        results = json.loads((state / ckpt.RESULTS_FILE).read_text())
        assert not any(r["adapter_path"] for r in results.values())


def test_measurements_charge_only_the_critical_export_seconds():
    """The cost model is refitted from what the job waited for, not from the background
    writes' seconds."""
    from plora.cost.overheads import OverheadKind, Overheads
    from plora.engine.api import ConfigResult, JobTimings, PackOutcome
    from plora.engine.trainer import AdapterStatus
    from plora.runtime.coordinator.measure import Measurements

    results = {c: ConfigResult(config_id=c, status=AdapterStatus.COMPLETED, steps=3, tokens=9,
                               final_train_loss=1.0, export_s=1.5) for c in ("a", "b")}  # fmt: skip
    timings = JobTimings(export_s=3.0, export_critical_s=0.4, exports=2)
    m = Measurements()
    m.add_outcome(PackOutcome(job_id="j", results=results, timings=timings), eval_rows=0)
    exports = [s for s in m.overheads if s.kind is OverheadKind.EXPORT]
    assert [(s.seconds, s.count) for s in exports] == [(0.4, 2)]
    fitted = Overheads.zero().refit(m.overheads)
    assert fitted.export_s == pytest.approx(0.2) and "export_s" in fitted.measured
