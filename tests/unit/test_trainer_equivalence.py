"""The engine's contract: an adapter trained in a pack == the same config trained alone with PEFT.

fp32 on CPU, tiny random Qwen2/Llama. Four configs that differ in every hyperparameter the
engine handles per adapter (rank 4..32, alpha, rsLoRA, lr, batch size, target modules, seed,
schedule, warmup, weight decay, clipping) train packed; each is compared with a plain PEFT loop
(``_engine_testlib.peft_reference``) on losses at every step and on final weights. The
``static-step`` cases run the step a CUDA graph captures (:mod:`plora.engine.graphed`: rows
padded to a length bucket, no attention mask, fixed-size target buffers, the optimizer's table
from a buffer) eagerly on the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_testlib import (
    TOKENIZER,
    assert_same_adapter,
    peft_reference,
    tiny_model,
    toy_dataset,
)

from plora.config import LoRAConfig
from plora.engine.adapters import adapter_state_dict
from plora.engine.trainer import AdapterStatus, PackedTrainer

STEPS = 6

CONFIGS = [
    LoRAConfig(config_id="a", rank=4, alpha=8, lr=2e-2, batch_size=2, seed=1, max_steps=STEPS,
               target_modules=("q_proj", "v_proj"), warmup_steps=1),
    LoRAConfig(config_id="b", rank=8, alpha=16, lr=1e-2, batch_size=3, seed=2, max_steps=STEPS,
               target_modules="all", schedule="linear", warmup_steps=2, weight_decay=0.01,
               max_grad_norm=0.05),
    LoRAConfig(config_id="c", rank=16, alpha=8, lr=5e-3, batch_size=1, seed=3, max_steps=STEPS,
               target_modules="mlp", schedule="cosine", use_rslora=True, max_grad_norm=None),
    LoRAConfig(config_id="d", rank=32, alpha=64, lr=3e-3, batch_size=4, seed=4, max_steps=STEPS,
               target_modules=("k_proj", "o_proj", "down_proj"), schedule="cosine",
               warmup_steps=1, weight_decay=0.1),
]  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(base, dataset, **kw) -> PackedTrainer:
    return PackedTrainer(copy.deepcopy(base), TOKENIZER, dataset, device="cpu", **kw)


def _run(trainer: PackedTrainer, steps: int, losses: dict[str, list[float]]) -> None:
    for _ in range(steps):
        for m in trainer.step():
            losses.setdefault(m.config_id, []).append(m.loss)
    if trainer.graphs is not None:  # the static-buffer step really ran, with no fallback
        assert trainer.graphs.eager_steps >= steps and trainer.graphs.disabled is None


GRAPHS = pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-step"])


@GRAPHS
@pytest.mark.parametrize(
    ("family", "max_rows"),
    [("qwen2", None), ("llama", None), ("qwen2", 3)],
    ids=["qwen2", "llama", "qwen2-microbatch3"],
)
def test_pack_equals_peft_alone(family, max_rows, graphs):
    base = tiny_model(family)
    data = toy_dataset()
    trainer = _trainer(base, data, max_rows=max_rows, cuda_graphs=graphs)
    inits = {}
    for cfg in CONFIGS:
        slot = trainer.add(cfg)
        inits[cfg.config_id] = {
            k: v.clone() for k, v in adapter_state_dict(trainer.model, slot).items()
        }
    losses: dict[str, list[float]] = {}
    _run(trainer, STEPS, losses)
    assert trainer.active == []
    assert sorted(trainer.finished) == ["a", "b", "c", "d"]
    for cfg in CONFIGS:
        ref_losses, ref_w, _ = peft_reference(base, cfg, inits[cfg.config_id], data, STEPS)
        torch.testing.assert_close(
            torch.tensor(losses[cfg.config_id]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
        assert_same_adapter(
            adapter_state_dict(trainer.model, trainer.slot_of(cfg.config_id)), ref_w
        )
        # the adapter really trained: B moved away from its zero init
        assert any(v.abs().max() > 1e-4 for k, v in ref_w.items() if "lora_B" in k)


@GRAPHS
def test_remove_and_add_between_steps(graphs):
    """b leaves after step 2 (early stop), e joins after step 3 into b's freed slot."""
    base = tiny_model("qwen2")
    data = toy_dataset()
    trainer = _trainer(base, data, cuda_graphs=graphs)
    inits = {}
    for cfg in CONFIGS:
        slot = trainer.add(cfg)
        inits[cfg.config_id] = {
            k: v.clone() for k, v in adapter_state_dict(trainer.model, slot).items()
        }
    losses: dict[str, list[float]] = {}
    _run(trainer, 2, losses)
    trainer.remove("b")
    assert trainer.status("b") is AdapterStatus.STOPPED
    stopped_b = {
        k: v.clone() for k, v in adapter_state_dict(trainer.model, trainer.slot_of("b")).items()
    }
    trainer.release("b")
    _run(trainer, 1, losses)
    e = LoRAConfig(config_id="e", rank=12, alpha=24, lr=1e-2, batch_size=2, seed=9, max_steps=4,
                   target_modules=("q_proj", "up_proj"), schedule="linear", dropout=0.0)  # fmt: skip
    slot_e = trainer.add(e)
    assert slot_e == 1  # b's slot is reused
    inits["e"] = {k: v.clone() for k, v in adapter_state_dict(trainer.model, slot_e).items()}
    _run(trainer, STEPS, losses)
    assert trainer.active == []
    for cfg in [*CONFIGS, e]:
        cid = cfg.config_id
        steps = 2 if cid == "b" else cfg.max_steps
        ref_losses, ref_w, _ = peft_reference(base, cfg, inits[cid], data, steps)
        torch.testing.assert_close(
            torch.tensor(losses[cid]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
        got = stopped_b if cid == "b" else adapter_state_dict(trainer.model, trainer.slot_of(cid))
        assert_same_adapter(got, ref_w)


@GRAPHS
def test_dropout_with_shared_keyed_masks(graphs):
    """dropout > 0: the PEFT reference gets the engine's keyed masks (per adapter step and row).

    Rows of different lengths are padded to different widths in the pack and alone; the CPU
    mask of a shorter row is a prefix of the longer one's, so the masks still agree.
    """
    base = tiny_model("qwen2")
    data = toy_dataset()
    cfgs = [
        LoRAConfig(config_id="p", rank=8, alpha=16, lr=1e-2, batch_size=2, seed=5, dropout=0.3,
                   max_steps=4, target_modules="all"),
        LoRAConfig(config_id="q", rank=4, alpha=4, lr=1e-2, batch_size=3, seed=6, dropout=0.1,
                   max_steps=4, target_modules=("q_proj", "v_proj", "gate_proj")),
    ]  # fmt: skip
    trainer = _trainer(base, data, max_rows=4, cuda_graphs=graphs)
    inits = {}
    for cfg in cfgs:
        slot = trainer.add(cfg)
        inits[cfg.config_id] = {
            k: v.clone() for k, v in adapter_state_dict(trainer.model, slot).items()
        }
    losses: dict[str, list[float]] = {}
    _run(trainer, 4, losses)
    for cfg in cfgs:
        ref_losses, ref_w, _ = peft_reference(
            base, cfg, inits[cfg.config_id], data, 4, keyed_dropout=True
        )
        torch.testing.assert_close(
            torch.tensor(losses[cfg.config_id]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
        assert_same_adapter(
            adapter_state_dict(trainer.model, trainer.slot_of(cfg.config_id)), ref_w
        )
        # and the masks matter: without them the reference ends elsewhere
        _, plain_w, _ = peft_reference(base, cfg.__class__.from_dict({**cfg.to_dict(), "dropout": 0.0}),
                                       inits[cfg.config_id], data, 4)  # fmt: skip
        with pytest.raises(AssertionError):
            assert_same_adapter(
                adapter_state_dict(trainer.model, trainer.slot_of(cfg.config_id)), plain_w
            )


def test_epochs_length_and_step_metrics():
    base = tiny_model("qwen2")
    data = toy_dataset(n=10)
    cfg = LoRAConfig(config_id="ep", rank=4, alpha=8, lr=1e-3, batch_size=4, epochs=1.5, seed=0)
    trainer = _trainer(base, data)
    trainer.add(cfg)
    metrics = []
    while trainer.active:
        metrics += trainer.step()
    assert [m.step for m in metrics] == [1, 2, 3, 4]  # ceil(1.5 * 10 / 4)
    assert all(m.tokens > 0 and m.grad_norm > 0 and m.time_s > 0 for m in metrics)
    assert metrics[0].lr == pytest.approx(1e-3)
    prof = trainer.profile()
    assert len(prof.steps) == 4 and prof.peak_memory_bytes > 0 and prof.tokens_per_s > 0
    assert all(0 < s.host_s <= s.time_s for s in prof.steps)  # CPU: about the whole step
    assert trainer.step() == []


def test_activation_checkpointing_changes_nothing():
    """Recomputing the base in backward (HF, use_reentrant=False) must reproduce the same
    keyed dropout masks and routing: same losses and weights as without."""
    base = tiny_model("llama")
    data = toy_dataset()
    cfgs = [
        LoRAConfig(config_id="u", rank=8, alpha=16, lr=1e-2, batch_size=2, seed=5, dropout=0.2,
                   max_steps=3, target_modules="all"),
        CONFIGS[0],
    ]  # fmt: skip
    results = []
    for ckpt in (False, True):
        trainer = _trainer(base, data, gradient_checkpointing=ckpt, max_rows=3)
        for cfg in cfgs:
            trainer.add(cfg)
        losses: dict[str, list[float]] = {}
        _run(trainer, 3, losses)
        weights = {c.config_id: adapter_state_dict(trainer.model, trainer.slot_of(c.config_id))
                   for c in cfgs}  # fmt: skip
        results.append((losses, weights))
    (l0, w0), (l1, w1) = results
    assert trainer.model.is_gradient_checkpointing
    for cfg in cfgs:
        cid = cfg.config_id
        torch.testing.assert_close(torch.tensor(l0[cid]), torch.tensor(l1[cid]), rtol=1e-6, atol=0)
        assert_same_adapter(w1[cid], w0[cid], tol=1e-6)


@pytest.mark.parametrize("chunk_logits", [1 << 26, 7 * 61], ids=["one-chunk", "chunked"])
def test_packed_loss_matches_per_slot_mean_ce(monkeypatch, chunk_logits):
    """Σ_i mean CE of slot i's target tokens (empty slots, ignored labels), value and grads."""
    from plora.engine import loss as loss_mod

    monkeypatch.setattr(loss_mod, "_LOGIT_CHUNK", chunk_logits)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 61, bias=False).requires_grad_(False)
    hidden = torch.randn(5, 9, 16, requires_grad=True)
    labels = torch.randint(0, 61, (5, 9))
    labels[0, :4] = -100
    labels[3, 6:] = -100
    segments = [(0, 0, 2), (1, 2, 2), (2, 2, 5)]  # slot 1 is empty this micro-batch
    denoms = {0: 20, 1: 3, 2: 11}  # N_i of each slot's whole step batch
    loss, sums = loss_mod.packed_loss(head, hidden, labels, segments, denoms)
    # reference: per slot, plain cross_entropy(reduction="sum") over shifted targets
    ref = 0.0
    for slot, start, stop in segments:
        if stop == start:
            continue
        logits = head(hidden[start:stop, :-1]).double().reshape(-1, 61)
        ce = torch.nn.functional.cross_entropy(
            logits, labels[start:stop, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        assert float(sums[slot]) == pytest.approx(float(ce), rel=1e-6)
        ref = ref + ce / denoms[slot]
    assert set(sums) == {0, 2}
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)
    (g,) = torch.autograd.grad(loss, hidden)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(g.double(), g_ref.double(), rtol=1e-5, atol=1e-7)


def test_out_of_memory_splits_into_micro_batches(monkeypatch):
    """An OOM in forward/backward halves the rows per forward and redoes the step with the
    same batches: the run equals one configured with that micro-batch size from the start."""
    base = tiny_model("qwen2")
    data = toy_dataset()
    original = PackedTrainer._forward_loss

    def small_memory(self, pb, denoms):
        if pb.input_ids.shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(self, pb, denoms)

    reference = _trainer(base, data, max_rows=2)
    for cfg in CONFIGS:
        reference.add(cfg)
    _run(reference, 3, {})
    monkeypatch.setattr(PackedTrainer, "_forward_loss", small_memory)
    adaptive = _trainer(base, data)
    for cfg in CONFIGS:
        adaptive.add(cfg)
    _run(adaptive, 3, {})
    assert adaptive.max_rows == 2 and adaptive.oom_splits == 2  # 10 -> 5 -> 2 rows
    for cfg in CONFIGS:
        a = adapter_state_dict(reference.model, reference.slot_of(cfg.config_id))
        b = adapter_state_dict(adaptive.model, adaptive.slot_of(cfg.config_id))
        assert all(torch.equal(a[k], b[k]) for k in a)
    strict = _trainer(base, data, adapt_to_memory=False)
    strict.add(CONFIGS[3])  # batch 4 > 3 rows
    with pytest.raises(torch.OutOfMemoryError):
        strict.step()


def test_packed_loss_rejects_a_trainable_head():
    from plora.engine.loss import packed_loss

    head = torch.nn.Linear(4, 7)
    with pytest.raises(ValueError, match="frozen LM head"):
        packed_loss(
            head, torch.randn(1, 3, 4), torch.ones(1, 3, dtype=torch.long), [(0, 0, 1)], {0: 2}
        )
