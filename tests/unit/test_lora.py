"""PackedLoRALinear and the model-level helpers, against independent float64 math."""

from __future__ import annotations

import math

import pytest
import torch
from _engine_testlib import tiny_model
from torch import nn

from plora.config import PROJECTIONS, ConfigError, LoRAConfig
from plora.engine import fused, lora
from plora.engine.adapters import (
    adapter_parameters,
    adapter_state_dict,
    add_adapter,
    base_only,
    inject,
    packed_segments,
    remove_adapter,
    use_slot,
)
from plora.engine.lora import RANK_ALIGN, PackedLoRALinear, dropout_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(in_f=24, out_f=20, bias=True, key=3) -> PackedLoRALinear:
    torch.manual_seed(0)
    return PackedLoRALinear(nn.Linear(in_f, out_f, bias=bias), key=key)


def _randomize(layer: PackedLoRALinear) -> None:
    """Random values in every slot's factors (pad rows stay zero)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for slot in layer.slots:
            for p in layer.factors(slot):
                p.copy_(torch.randn(p.shape, generator=g))


def _expected(layer, x, table):
    """float64: base everywhere, plus s·x Aᵀ Bᵀ on each (slot, start, stop) present."""
    w = layer.base_layer.weight.double()
    b = layer.base_layer.bias.double() if layer.base_layer.bias is not None else 0.0
    y = x.double() @ w.t() + b
    for slot, start, stop in table:
        if slot in layer.specs:
            a, bb = (t.double() for t in layer.factors(slot))
            y[start:stop] += layer.specs[slot].scale * (x[start:stop].double() @ a.t()) @ bb.t()
    return y


def test_packed_forward_matches_float64_math_with_gaps():
    layer = _layer()
    for slot, rank in [(0, 4), (2, 9), (5, 32)]:
        layer.add_slot(slot, rank=rank, scale=16 / rank, seed=slot)
    _randomize(layer)
    x = torch.randn(9, 5, 24)
    # slot 3 has no factors here (its rows get the base only); rows 8.. belong to no slot
    table = [(0, 0, 2), (3, 2, 4), (2, 4, 5), (5, 5, 8)]
    with packed_segments(nn.ModuleList([layer]), table):
        y = layer(x)
    torch.testing.assert_close(y.double(), _expected(layer, x, table), rtol=1e-5, atol=1e-5)


def test_use_slot_and_base_only():
    layer = _layer()
    layer.add_slot(1, rank=6, scale=2.0, seed=0)
    _randomize(layer)
    x = torch.randn(3, 4, 24)
    holder = nn.ModuleList([layer])
    with use_slot(holder, 1):
        y1 = layer(x)
    with base_only(holder):
        y0 = layer(x)
    with use_slot(holder, 4):  # a slot this layer does not have: base only
        y4 = layer(x)
    torch.testing.assert_close(y1.double(), _expected(layer, x, [(1, 0, 3)]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y0, layer.base_layer(x))
    torch.testing.assert_close(y4, y0)
    with pytest.raises(RuntimeError, match="without routing"):
        layer(x)


def test_gradients_reach_only_own_rows():
    layer = _layer()
    layer.add_slot(0, rank=4, scale=1.0, seed=0)
    layer.add_slot(1, rank=8, scale=1.0, seed=1)
    _randomize(layer)
    x = torch.randn(4, 3, 24)
    holder = nn.ModuleList([layer])
    with packed_segments(holder, [(0, 0, 2), (1, 2, 4)]):
        loss = layer(x)[2:].pow(2).sum()  # only slot 1's rows
        loss.backward()
    # one gradient per packed parameter; slot 0's rows and every pad row get zero
    grad_a, grad_bt = layer.A.grad, layer.Bt.grad
    assert grad_a.shape == layer.A.shape and grad_bt.shape == layer.Bt.shape
    own = torch.zeros(layer.rows, dtype=torch.bool)
    own[layer.block(1)] = True
    assert float(grad_a[~own].abs().max()) == 0.0 and float(grad_bt[~own].abs().max()) == 0.0
    assert float(grad_a[own].abs().min()) > 0 and float(grad_bt[own].abs().max()) > 0
    assert layer.base_layer.weight.grad is None


def test_init_is_peft_distribution_and_pack_independent():
    layer = _layer(in_f=256, out_f=8)
    layer.add_slot(0, rank=64, scale=1.0, seed=11)
    layer.add_slot(3, rank=64, scale=1.0, seed=11)
    layer.add_slot(4, rank=64, scale=1.0, seed=12)
    a0, b0 = (t.detach() for t in layer.factors(0))
    bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)) on fan_in 256
    assert float(a0.abs().max()) <= bound and float(a0.abs().max()) > 0.95 * bound
    assert abs(float(a0.std()) - bound / math.sqrt(3)) < 0.05 * bound
    assert float(b0.abs().max()) == 0.0
    assert torch.equal(a0, layer.factors(3)[0])  # same seed, other slot
    assert not torch.equal(a0, layer.factors(4)[0])
    other_key = PackedLoRALinear(nn.Linear(256, 8), key=4)
    other_key.add_slot(0, rank=64, scale=1.0, seed=11)
    assert not torch.equal(a0, other_key.factors(0)[0])


def test_packed_layout_pads_ranks_with_zeros():
    layer = _layer()
    layer.add_slot(1, rank=16, scale=1.0)
    layer.add_slot(2, rank=20, scale=1.0)
    layer.add_slot(0, rank=4, scale=1.0)  # joins in front: rows of 1 and 2 move, values kept
    _randomize(layer)
    assert layer.slots == [0, 1, 2] and layer.offsets == {0: 0, 1: 16, 2: 32}
    assert layer.A.shape == (64, 24) and layer.Bt.shape == (64, 20)
    before = {s: [t.detach().clone() for t in layer.factors(s)] for s in (1, 2)}
    a_cat, b_cat, offsets = layer.packed([0, 1, 2])
    # the layer's own slots in order: the parameters themselves, no copy
    assert a_cat is layer.A and b_cat._base is layer.Bt
    assert offsets == [0, 16, 32, 64] and all(o % RANK_ALIGN == 0 for o in offsets)
    a_view, b_view = a_cat.detach(), b_cat.detach()
    for k, slot in enumerate([0, 1, 2]):
        a, b = layer.factors(slot)
        r = a.shape[0]
        assert torch.equal(a_view[offsets[k] : offsets[k] + r], a.detach())
        assert torch.equal(b_view[:, offsets[k] : offsets[k] + r], b.detach())
        assert float(a_view[offsets[k] + r : offsets[k + 1]].abs().sum()) == 0.0
        assert float(b_view[:, offsets[k] + r : offsets[k + 1]].abs().sum()) == 0.0
    # B is stored transposed so that the concatenation is the kernels' contiguous Bᵀ layout
    assert b_cat.t().is_contiguous() and layer.factors(1)[1].t().is_contiguous()
    layer.remove_slot(0)
    for slot in (1, 2):
        assert all(
            torch.equal(x, y) for x, y in zip(layer.factors(slot), before[slot], strict=True)
        )
    assert layer.offsets == {1: 0, 2: 16} and layer.rows == 48


def test_packed_gathers_subsets_and_fillers():
    """Slots other than the layer's own in order: one gather, gradients back to their rows."""
    layer = _layer()
    for slot, rank in [(0, 4), (1, 16), (2, 20)]:
        layer.add_slot(slot, rank=rank, scale=1.0)
    _randomize(layer)
    a_cat, b_cat, off = layer.packed([2, None, 0])
    assert off == [0, 32, 48, 64] and a_cat.shape == (64, 24) and b_cat.shape == (20, 64)
    assert torch.equal(a_cat[:32].detach(), layer.A[32:64].detach())
    assert torch.equal(b_cat[:, 48:].detach(), layer.Bt[0:16].t().detach())
    assert not a_cat[32:48].detach().any() and not b_cat[:, 32:48].detach().any()
    wa, wb = torch.randn(64, 24), torch.randn(20, 64)
    ((a_cat * wa).sum() + (b_cat * wb).sum()).backward()
    assert torch.equal(layer.A.grad[32:64], wa[:32]) and torch.equal(layer.A.grad[:16], wa[48:])
    assert torch.equal(layer.Bt.grad[:16], wb[:, 48:].t())
    assert float(layer.A.grad[16:32].abs().sum()) == 0.0  # slot 1 was not asked for


def _expected_dropout(layer, x, table, routing):
    """float64, row by row: base, plus s·(x ⊙ m) Aᵀ Bᵀ with each row's own keyed mask
    (:func:`dropout_mask` at the adapter's step and the row's index in its batch)."""
    w = layer.base_layer.weight.double()
    b = layer.base_layer.bias.double() if layer.base_layer.bias is not None else 0.0
    rows = []
    for j in range(x.shape[0]):
        y = x[j].double() @ w.t() + b
        for slot, start, stop in table:
            if slot in layer.specs and start <= j < stop:
                spec = layer.specs[slot]
                step, offset = routing.dropout_keys.get(slot, (0, start))
                xj = x[j].double()
                if spec.dropout > 0.0:
                    xj = xj * dropout_mask(
                        seed=spec.seed, step=step, row=offset + j - start, key=layer.key,
                        shape=x.shape[1:], p=spec.dropout, dtype=torch.float64,
                    )  # fmt: skip
                a, bb = (t.double() for t in layer.factors(slot))
                y = y + spec.scale * (xj @ a.t()) @ bb.t()
        rows.append(y)
    return torch.stack(rows)


def _grads(y, g, layer, x):
    return torch.autograd.grad(y, [x, layer.A, layer.Bt], g.to(y.dtype))


def test_torch_path_and_kernel_hook_match_a_row_by_row_oracle_with_keyed_dropout():
    """The layer's own forward off CUDA (the kernels' ``lora_term`` per piece) and the kernel
    hook with the kernels' table reference standing in for Triton both equal a row-by-row
    float64 oracle with each row's own keyed mask -- gaps (filler slots), absent slots, dropout
    on, and no dropout in eval."""
    from plora.kernels import packed_lora_reference

    layer = _layer()
    for slot, rank in [(0, 5), (2, 16), (4, 3)]:
        layer.add_slot(slot, rank=rank, scale=3.0 / rank, seed=slot, dropout=0.25 * (slot != 2))
    _randomize(layer)
    x = torch.randn(10, 3, 24, requires_grad=True)
    table = [(0, 1, 3), (1, 3, 5), (2, 5, 6), (4, 8, 10)]
    routing = lora.Routing(segments=tuple(table), dropout_keys={0: (4, 6), 4: (1, 0)})
    pieces = layer._pieces(routing, x.shape[0])
    y_kernel = fused.fused_forward(packed_lora_reference, layer, x, pieces, routing)
    layer.routing = routing
    y_layer = layer(x)
    want = _expected_dropout(layer, x, table, routing)
    assert (
        float((want - _expected(layer, x, table)).abs().max().detach()) > 1e-3
    )  # dropout took effect
    g = torch.randn_like(y_layer)
    grads_want = _grads(want, g, layer, x)
    for y in (y_kernel, y_layer):
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
        for got, ref in zip(_grads(y, g, layer, x), grads_want, strict=True):
            torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-5, atol=1e-5)
    layer.eval()  # no dropout in eval
    torch.testing.assert_close(layer(x).double(), _expected(layer, x, table), rtol=1e-5, atol=1e-5)


def test_kernel_hook_passes_the_packed_parameters_without_gaps():
    """Rows only of this layer's slots (some absent: empty segments): the kernel gets ``A`` and
    ``Bt`` themselves, and its weight gradients land in them."""
    from plora.kernels import packed_lora_reference

    layer = _layer()
    for slot, rank in [(0, 5), (2, 16), (4, 3)]:
        layer.add_slot(slot, rank=rank, scale=3.0 / rank, seed=slot)
    _randomize(layer)
    seen = {}

    def spy(x, w, b, a_cat, b_cat, segs, offs, ranks, scales, drops, seed):
        seen.update(a=a_cat, b=b_cat, segs=segs, offs=offs, ranks=ranks)
        return packed_lora_reference(x, w, b, a_cat, b_cat, segs, offs, ranks, scales, drops, seed)

    x = torch.randn(7, 3, 24, requires_grad=True)
    pieces = [(0, 1, 3), (4, 3, 6)]  # slot 2 has no rows; row 0 and row 6 get the base only
    routing = lora.Routing(segments=tuple(pieces))
    y_kernel = fused.fused_forward(spy, layer, x, pieces, routing)
    assert seen["a"] is layer.A and seen["b"]._base is layer.Bt
    assert seen["segs"] == (3, 9, 9, 18) and seen["offs"] == [0, 16, 32, 48]
    want = _expected(layer, x, pieces)
    torch.testing.assert_close(y_kernel.double(), want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y_kernel)
    grads = _grads(y_kernel, g, layer, x)
    for got, ref in zip(grads, _grads(want, g, layer, x), strict=True):
        torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-5, atol=1e-5)
    assert float(grads[1][16:32].abs().sum()) == 0.0  # slot 2: no rows, no gradient


def test_dropout_mask_rate_scale_determinism_and_prefix():
    m = dropout_mask(seed=1, step=2, row=3, key=4, shape=(200, 50), p=0.25)
    assert m.unique().tolist() == pytest.approx([0.0, 1 / 0.75])
    assert abs(float((m == 0).float().mean()) - 0.25) < 0.02
    again = dropout_mask(seed=1, step=2, row=3, key=4, shape=(200, 50), p=0.25)
    assert torch.equal(m, again)
    short = dropout_mask(seed=1, step=2, row=3, key=4, shape=(120, 50), p=0.25)
    assert torch.equal(short, m[:120])
    for kw in ({"seed": 2}, {"step": 3}, {"row": 4}, {"key": 5}):
        other = dropout_mask(
            **{"seed": 1, "step": 2, "row": 3, "key": 4, **kw}, shape=(200, 50), p=0.25
        )
        assert not torch.equal(other, m)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_inject_wraps_all_projections_and_keeps_base_outputs(family):
    model = tiny_model(family)
    x = torch.randint(3, 60, (2, 7))
    with torch.no_grad():
        ref = model(x).logits
    layers = inject(model)
    assert len(layers) == 2 * len(PROJECTIONS)
    assert inject(model).keys() == layers.keys()  # idempotent
    assert not any(p.requires_grad for p in model.parameters())
    cfg = LoRAConfig(
        rank=8, alpha=16, lr=1e-3, batch_size=1, max_steps=1, target_modules=("q", "down")
    )
    params = add_adapter(model, 0, cfg)
    assert len(params) == 2 * 2 * 2 and all(p.requires_grad for p in params)
    keys = adapter_state_dict(model, 0)
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    with torch.no_grad(), base_only(model):
        torch.testing.assert_close(model(x).logits, ref)
    with torch.no_grad(), use_slot(model, 0):  # B = 0 at init: no change yet
        torch.testing.assert_close(model(x).logits, ref)
    remove_adapter(model, 0)
    assert adapter_parameters(model, 0) == []


def _grown(batched: bool) -> PackedLoRALinear:
    """Slots 1 and 5 holding trained (random) values, then slots 0, 3 and 9 added."""
    layer = _layer()
    layer.add_slot(1, rank=8, scale=2.0, seed=1)
    layer.add_slot(5, rank=20, scale=0.5, seed=5, dropout=0.1)
    _randomize(layer)
    new = {9: (4, 4.0, 9), 0: (16, 1.0, 0), 3: (1, 16.0, 3)}
    if batched:
        layer.add_slots(
            {s: lora.SlotSpec(rank=r, scale=c, dropout=0.0, seed=d) for s, (r, c, d) in new.items()}
        )
    else:
        for s, (r, c, d) in new.items():
            layer.add_slot(s, rank=r, scale=c, seed=d)
    return layer


def test_add_slots_at_once_equals_one_at_a_time():
    one, many = _grown(batched=False), _grown(batched=True)
    assert many.slots == one.slots == [0, 1, 3, 5, 9]
    assert many.offsets == one.offsets and many.specs == one.specs
    assert torch.equal(many.A, one.A) and torch.equal(many.Bt, one.Bt)  # old rows kept, init same
    assert many.A.requires_grad and many.Bt.requires_grad
    version, a = many.version, many.A
    with pytest.raises(ValueError, match="slot 3 already present"):
        many.add_slots({2: lora.SlotSpec(rank=4, scale=1.0, dropout=0.0, seed=2),
                        3: lora.SlotSpec(rank=4, scale=1.0, dropout=0.0, seed=3)})  # fmt: skip
    assert many.version == version and many.A is a and 2 not in many.specs  # nothing half-added


def test_add_adapters_at_once_equals_one_at_a_time():
    from plora.engine.adapters import add_adapters

    common = dict(lr=1e-3, batch_size=1, max_steps=2)
    configs = {
        0: LoRAConfig(config_id="a", rank=8, alpha=16, target_modules=("q_proj", "v_proj"),
                      **common),
        2: LoRAConfig(config_id="b", rank=4, alpha=4, target_modules=PROJECTIONS, seed=3, **common),
        1: LoRAConfig(config_id="c", rank=16, alpha=8, target_modules=("down_proj",), seed=9,
                      **common),
    }  # fmt: skip
    one, many = tiny_model(), tiny_model()
    inject(one), inject(many)
    for slot, config in configs.items():
        add_adapter(one, slot, config)
    views = add_adapters(many, configs)
    for slot in configs:
        got, want = views[slot], adapter_parameters(one, slot)
        assert len(got) == len(want) > 0
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    inject(partial := tiny_model(), targets=("q_proj",))
    with pytest.raises(ConfigError, match=r"config c: target_modules .* match no projection"):
        add_adapters(partial, {0: configs[0], 1: configs[1]})  # c's down_proj is not wrapped
    assert adapter_parameters(partial, 0) == []  # nothing half-added
