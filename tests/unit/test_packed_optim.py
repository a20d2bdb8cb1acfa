"""PackedAdamW against one ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) per slot, on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plora.engine.adapters import peft_key, use_slot
from plora.engine.lora import PackedLoRALinear
from plora.engine.packed_optim import PackedAdamW

pytestmark = pytest.mark.usefixtures("one_thread")

#: slot -> (lr, weight decay, max_grad_norm); slot 3 has factors but takes no step (frozen).
HPARAMS = {
    0: (1e-2, 0.1, None),
    2: (3e-3, 0.0, 1e3),  # clipping on, never active: multiplies by exactly 1
    5: (5e-3, 0.05, 0.5),  # clipping active every step
}
RANKS = {0: 5, 2: 16, 3: 3, 5: 24}


def _layers() -> dict[str, PackedLoRALinear]:
    """Two layers of different widths (two groups) with the slots of ``RANKS``."""
    torch.manual_seed(0)
    layers = {
        "q": PackedLoRALinear(nn.Linear(40, 24), key=1),
        "down": PackedLoRALinear(nn.Linear(56, 40), key=2),
    }
    g = torch.Generator().manual_seed(3)
    for layer in layers.values():
        for slot, rank in RANKS.items():
            layer.add_slot(slot, rank=rank, scale=1.0, seed=slot)
            with torch.no_grad():
                layer.factors(slot)[1].copy_(torch.randn(layer.out_features, rank, generator=g))
    return layers


def _random_grads(layers, gen) -> None:
    """Random gradients on every slot's true-rank rows; pad rows get none (as in training)."""
    for layer in layers.values():
        for p in (layer.A, layer.Bt):
            grad = torch.zeros_like(p)
            for slot in layer.slots:
                rows = layer.block(slot)
                grad[rows] = torch.randn(grad[rows].shape, generator=gen)
            p.grad.copy_(grad)


def _reference(layers):
    """One AdamW per slot over copies of its factors (PEFT's layout: A (r, in), B (out, r))."""
    ref = {}
    for slot, (lr, wd, _) in HPARAMS.items():
        params = [
            t.detach().clone().requires_grad_()
            for layer in layers.values()
            for t in layer.factors(slot)
        ]
        ref[slot] = (params, torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                               weight_decay=wd))  # fmt: skip
    return ref


def _reference_step(layers, ref, lrs) -> dict[int, float]:
    norms = {}
    for slot, (params, opt) in ref.items():
        grads = [g for layer in layers.values() for g in _factor_grads(layer, slot)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        clip = HPARAMS[slot][2]
        if clip is None:
            norms[slot] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        else:
            norms[slot] = float(torch.nn.utils.clip_grad_norm_(params, clip))
        opt.param_groups[0]["lr"] = lrs[slot]
        opt.step()
    return norms


def _factor_grads(layer, slot):
    rows = layer.block(slot)
    return layer.A.grad[rows], layer.Bt.grad[rows].t()


def test_step_is_torch_adamw_per_slot_and_freezes_the_rest():
    layers = _layers()
    opt = PackedAdamW(layers)
    for slot, (_, wd, clip) in HPARAMS.items():
        opt.add_slot(slot, weight_decay=wd, max_grad_norm=clip)
    opt.sync()
    ref = _reference(layers)
    frozen = [t.detach().clone() for layer in layers.values() for t in layer.factors(3)]
    gen = torch.Generator().manual_seed(11)
    for it in range(6):
        _random_grads(layers, gen)
        lrs = {slot: lr * (it + 1) / 6 for slot, (lr, _, _) in HPARAMS.items()}  # a schedule
        expected = _reference_step(layers, ref, lrs)
        norms = opt.step(lrs)
        for slot, value in expected.items():
            assert float(norms[slot]) == pytest.approx(value, rel=1e-6)
        assert all(not layer.A.grad.any() for layer in layers.values())  # consumed
    keys = [peft_key(name, f) for name in layers for f in ("A", "B")]  # the params' order
    for slot, (params, torch_opt) in ref.items():
        ours = [t.detach() for layer in layers.values() for t in layer.factors(slot)]
        state = opt.slot_state(slot)
        if HPARAMS[slot][2] == 0.5:  # clipped: the norm may differ in the last bit
            for a, b in zip(ours, params, strict=True):
                torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-9)
        else:  # bitwise: the same float32 operations in the same order
            assert all(torch.equal(a, b.detach()) for a, b in zip(ours, params, strict=True))
            for key, p in zip(keys, params, strict=True):
                for name in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(state[name][key], torch_opt.state[p][name]), (key, name)
        assert state["step"] == 6 == int(torch_opt.state[params[0]]["step"])
    again = [t.detach() for layer in layers.values() for t in layer.factors(3)]
    assert all(torch.equal(a, b) for a, b in zip(frozen, again, strict=True))


def test_pad_rows_stay_zero():
    layers = _layers()
    opt = PackedAdamW(layers)
    for slot in RANKS:
        opt.add_slot(slot, weight_decay=0.1, max_grad_norm=1.0)
    opt.sync()
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        _random_grads(layers, gen)
        opt.step(dict.fromkeys(RANKS, 1e-2))
    for layer in layers.values():
        pad = torch.ones(layer.rows, dtype=torch.bool)
        for slot in layer.slots:
            pad[layer.block(slot)] = False
        assert int(pad.sum()) == (16 - 5) + (16 - 3) + (32 - 24)  # ranks 5, 16, 3, 24
        for p in (layer.A, layer.Bt):
            assert not p.detach()[pad].any()
    for g in opt._groups:  # and so do their moments
        for m in g.members:
            for slot, _, off, size in m.blocks:
                pad = slice(m.start + off + m.layer.specs[slot].rank, m.start + off + size)
                assert not g.exp_avg[pad].any() and not g.exp_avg_sq[pad].any()


def test_moments_follow_their_slot_when_slots_come_and_go():
    layers = _layers()
    opt = PackedAdamW(layers)
    for slot, (_, wd, clip) in HPARAMS.items():
        opt.add_slot(slot, weight_decay=wd, max_grad_norm=clip)
    gen = torch.Generator().manual_seed(2)
    opt.sync()
    _random_grads(layers, gen)
    opt.step({s: hp[0] for s, hp in HPARAMS.items()})
    kept = {s: _clone(opt.slot_state(s)) for s in (2, 5)}
    weights = {s: [t.detach().clone() for t in layers["q"].factors(s)] for s in (2, 5)}
    # slot 1 joins (rows in front of 2 and 5 move), slot 0 leaves
    opt.remove_slot(0)
    for layer in layers.values():
        layer.remove_slot(0)
        layer.add_slot(1, rank=8, scale=1.0)
    opt.add_slot(1, weight_decay=0.0, max_grad_norm=None)
    opt.sync()
    for s in (2, 5):
        assert _equal(opt.slot_state(s), kept[s])
        views = layers["q"].factors(s)
        assert all(torch.equal(a, b) for a, b in zip(views, weights[s], strict=True))
    fresh = opt.slot_state(1)
    assert fresh["step"] == 0 and not any(v.any() for v in fresh["exp_avg"].values())
    # a released slot id reused by a new adapter starts from zero moments too
    opt.remove_slot(5)
    opt.add_slot(5, weight_decay=0.0, max_grad_norm=None)
    assert not any(v.any() for v in opt.slot_state(5)["exp_avg_sq"].values())


def test_slot_state_round_trip_continues_bitwise():
    gen_a, gen_b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    runs = []
    for resume in (False, True):
        layers = _layers()
        opt = PackedAdamW(layers)
        for slot, (_, wd, clip) in HPARAMS.items():
            opt.add_slot(slot, weight_decay=wd, max_grad_norm=clip)
        opt.sync()
        gen = gen_b if resume else gen_a
        _random_grads(layers, gen)
        opt.step({s: hp[0] for s, hp in HPARAMS.items()})
        if resume:
            saved = {s: _clone(opt.slot_state(s)) for s in HPARAMS}
            weights = {s: [t.detach().clone() for l_ in layers.values() for t in l_.factors(s)]
                       for s in HPARAMS}  # fmt: skip
            layers = _layers()
            opt = PackedAdamW(layers)
            for slot, (_, wd, clip) in HPARAMS.items():
                opt.add_slot(slot, weight_decay=wd, max_grad_norm=clip)
                opt.load_slot_state(slot, saved[slot])
                with torch.no_grad():
                    views = [t for l_ in layers.values() for t in l_.factors(slot)]
                    for view, w in zip(views, weights[slot], strict=True):
                        view.copy_(w)
        for _ in range(2):
            _random_grads(layers, gen)
            opt.step({s: hp[0] for s, hp in HPARAMS.items()})
        runs.append([t.detach().clone() for l_ in layers.values() for t in (l_.A, l_.Bt)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    with pytest.raises(ValueError, match="does not match slot"):
        opt.load_slot_state(0, {"step": 1, "exp_avg": {}, "exp_avg_sq": {}})


def test_gradients_accumulate_in_place_into_the_buffers():
    layers = _layers()
    opt = PackedAdamW(layers)
    opt.add_slot(0, weight_decay=0.0, max_grad_norm=None)
    opt.sync()
    layer = layers["q"]
    group = next(g for g in opt._groups if g.param.shape[1] == layer.in_features)
    storage = group.param.untyped_storage().data_ptr()
    assert layer.A.untyped_storage().data_ptr() == storage
    assert layer.A.grad.untyped_storage().data_ptr() == group.grad.untyped_storage().data_ptr()
    grad_view = layer.A.grad
    x = torch.randn(2, 3, 40)
    holder = nn.ModuleList([layer])
    for _ in range(2):
        with use_slot(holder, 0):
            layer(x).sum().backward()
    assert layer.A.grad is grad_view and layer.A.grad.any()
    a, b = (t.detach().clone().requires_grad_() for t in layer.factors(0))
    ((x @ a.t()) @ b.t()).sum().mul(2).backward()
    torch.testing.assert_close(layer.A.grad[layer.block(0)], a.grad)
    layer.A.grad = None  # someone resets it: the next step rebinds the buffer view
    opt.zero_grad()
    assert layer.A.grad is grad_view and not grad_view.any()


def _clone(state: dict) -> dict:
    return {
        "step": state["step"],
        **{k: {n: t.clone() for n, t in state[k].items()} for k in ("exp_avg", "exp_avg_sq")},
    }


def _equal(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(
        torch.equal(a[k][n], b[k][n]) for k in ("exp_avg", "exp_avg_sq") for n in a[k]
    )
