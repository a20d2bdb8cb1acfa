"""Triton packed-LoRA kernels under the CPU interpreter, against the fp64 torch oracle.

``TRITON_INTERPRET=1`` must be set before triton is first imported (triton's own ``tl.cumsum`` and
``tl.rand`` are jit functions decorated at import), and it must not leak into other tests (a GPU
test in the same process would run interpreted). So the outer test re-runs this file in a child
pytest with the variable set; the child runs the real tests. Shapes are small: the interpreter
runs each program in numpy. fp32 and fp16 only (bf16 is not exact there).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from plora.kernels import dropout_mask, packed_lora_delta, packed_lora_linear
from plora.kernels.testing import Case, make_tensors, oracle, random_case, rel_err, table

CHILD = os.environ.get("PLORA_KERNELS_INTERPRETER_CHILD") == "1"
pytestmark = pytest.mark.skipif(
    CHILD and os.environ.get("TRITON_INTERPRET") != "1", reason="child run needs TRITON_INTERPRET=1"
)


@pytest.mark.skipif(CHILD, reason="this is the child run")
def test_interpreter_suite_in_child_process():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PLORA_KERNELS_INTERPRETER_CHILD": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout, proc.stdout


child = pytest.mark.skipif(not CHILD, reason="runs in the interpreter child process")


if CHILD:
    from plora.kernels import triton_kernels as TK


def run_triton(case: Case, tensors, dy, seed: int, *, fused: bool):
    x, w, b, a, bb = (t if t is None else t.detach().clone() for t in tensors)
    for t in (x, a, bb):
        t.requires_grad_(True)
    y = packed_lora_linear(
        x, w, b, a, bb, **table(case), dropout_seed=seed, fused=fused, backend="triton"
    )
    dx, da, db = torch.autograd.grad(y, (x, a, bb), dy)
    return y.detach(), dx, da, db


CASES = [
    # (n_slots, in, out, max tokens per slot, dropout)
    (1, 40, 24, 37, False),
    (3, 33, 37, 20, True),
    (7, 48, 20, 9, False),
    (32, 24, 40, 4, True),
]


@child
@pytest.mark.parametrize("mode", ["accumulate", "epilogue", "fused", "fused-pointer"])
@pytest.mark.parametrize("spec", CASES, ids=lambda s: f"slots{s[0]}-in{s[1]}-out{s[2]}")
def test_fp32_matches_fp64_oracle(spec, mode, monkeypatch):
    """Every mode; "fused" takes the persistent TMA kernel where strides allow (in, out % 4 == 0
    in fp32), "fused-pointer" the pointer-based GEMM kernel."""
    from plora.kernels import ops

    monkeypatch.setattr(ops, "choose_mode", lambda *a, **k: ops.Mode(mode.split("-")[0]))
    monkeypatch.setattr(ops, "USE_TMA", mode == "fused")
    n_slots, in_f, out_f, max_seg, drop = spec
    gen = torch.Generator().manual_seed(n_slots * 100 + in_f)
    case = random_case(gen, n_slots=n_slots, in_f=in_f, out_f=out_f, max_seg=max_seg, dropout=drop)
    tensors = make_tensors(case, dtype=torch.float32, device="cpu", seed=n_slots)
    dy = torch.randn(case.n_tokens, out_f, generator=gen)
    seed = 2**40 + 17 * n_slots  # > 2^32: the key's high word matters
    got = run_triton(case, tensors, dy, seed, fused=None)
    ref = oracle(case, tensors, dy, seed)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref, strict=True):
        assert rel_err(g, r) < 2e-6, (name, rel_err(g, r), case)


@child
@pytest.mark.parametrize(
    "lora_tma,side_tma",
    [(1, 0), (0, 0), (1, 1)],
    ids=["lora-by-tma", "lora-by-pointers", "all-by-tma"],
)
def test_tma_gemm_with_bias_dropout_and_tiny_segments(lora_tma, side_tma, monkeypatch):
    """The persistent TMA fused GEMM (fwd: Q stored (N, K); bwd: (K, N)) with bias, dropout,
    empty and one-token segments, in fp32 and fp16; LoRA operands by TMA or by pointers; the
    shrinks and weight gradients by pointers or by TMA (rows of the next segment zeroed)."""
    from plora.kernels import ops

    cfg = {**ops._INTERPRETER_CONFIGS["tma"], "LORA_TMA": lora_tma}
    monkeypatch.setitem(ops.CONFIG_OVERRIDES, "tma", cfg)
    for kind in ("shrink", "wgrad"):
        monkeypatch.setitem(
            ops.CONFIG_OVERRIDES, kind, {**ops._INTERPRETER_CONFIGS[kind], "TMA": side_tma}
        )

    case = Case(n_tokens=41, in_f=256, out_f=288, seg_lens=(9, 0, 1, 30), ranks=(8, 24, 16, 64),
                dropout=(0.0, 0.5, 0.25, 0.1), lead=1)  # fmt: skip
    for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 3e-3)):
        tensors = make_tensors(case, dtype=dtype, device="cpu", seed=4)
        assert ops._tma_ready(tensors[0], (tensors[0], tensors[1], tensors[1].stride()))
        dy = torch.randn(case.n_tokens, case.out_f).to(dtype)
        got = run_triton(case, tensors, dy, 21, fused=True)
        ref = oracle(case, tensors, dy, 21)
        for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref, strict=True):
            assert rel_err(g, r) < tol, (dtype, name, rel_err(g, r))


@child
@pytest.mark.parametrize("spec", CASES, ids=lambda s: f"slots{s[0]}-in{s[1]}-out{s[2]}")
def test_side_kernels_by_tma_match_fp64_oracle(spec, monkeypatch):
    """Shrinks and weight gradients with TMA operand tiles, in the unfused (accumulate) mode."""
    from plora.kernels import ops

    monkeypatch.setattr(ops, "choose_mode", lambda *a, **k: ops.Mode.ACCUMULATE)
    for kind, extra in (("shrink", {}), ("wgrad", {"SPLIT_R": 1})):
        cfg = {**ops._INTERPRETER_CONFIGS[kind], "TMA": 1, **extra}
        monkeypatch.setitem(ops.CONFIG_OVERRIDES, kind, cfg)
    n_slots, in_f, out_f, max_seg, drop = spec
    gen = torch.Generator().manual_seed(n_slots * 7 + out_f)
    case = random_case(gen, n_slots=n_slots, in_f=in_f, out_f=out_f, max_seg=max_seg, dropout=drop)
    tensors = make_tensors(case, dtype=torch.float32, device="cpu", seed=n_slots + 1)
    dy = torch.randn(case.n_tokens, out_f, generator=gen)
    got = run_triton(case, tensors, dy, 77, fused=None)
    ref = oracle(case, tensors, dy, 77)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref, strict=True):
        assert rel_err(g, r) < 2e-6, (name, rel_err(g, r), case)


@child
def test_weight_gradients_split_over_rank_chunks(monkeypatch):
    """SPLIT_R: one program per (slot, columns, rank chunk); pad rows still get zero gradient."""
    from plora.kernels import ops

    cfg = {**ops._INTERPRETER_CONFIGS["wgrad"], "BR": 16, "SPLIT_R": 1}
    monkeypatch.setitem(ops.CONFIG_OVERRIDES, "wgrad", cfg)
    case = Case(n_tokens=30, in_f=40, out_f=36, seg_lens=(9, 0, 1, 17), ranks=(8, 24, 40, 64),
                dropout=(0.0, 0.0, 0.0, 0.0), lead=2)  # fmt: skip
    tensors = make_tensors(case, dtype=torch.float32, device="cpu", seed=8)
    dy = torch.randn(case.n_tokens, case.out_f)
    got = run_triton(case, tensors, dy, 3, fused=False)
    ref = oracle(case, tensors, dy, 3)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref, strict=True):
        assert rel_err(g, r) < 2e-6, (name, rel_err(g, r))
    for i, r in enumerate(case.ranks):
        lo, hi = case.rank_offsets[i] + r, case.rank_offsets[i + 1]
        assert torch.count_nonzero(got[2][lo:hi]) == 0
        assert torch.count_nonzero(got[3][:, lo:hi]) == 0


@child
@pytest.mark.parametrize("trainable", ["a", "b"])
def test_weight_gradients_of_one_trainable(trainable):
    """dA and dB share one launch; with only one of them trainable the launch has one job and
    still matches the oracle (dropout applied to dA only)."""
    gen = torch.Generator().manual_seed(14)
    case = random_case(gen, n_slots=5, in_f=24, out_f=40, max_seg=9, dropout=True)
    tensors = make_tensors(case, dtype=torch.float32, device="cpu", seed=14)
    ref = oracle(case, tensors, dy := torch.randn(case.n_tokens, case.out_f), 9)
    x, w, b, a, bb = (t.detach().clone() for t in tensors)
    leaf, want = (a, ref[2]) if trainable == "a" else (bb, ref[3])
    leaf.requires_grad_(True)
    y = packed_lora_linear(x, w, b, a, bb, **table(case), dropout_seed=9, backend="triton")
    (got,) = torch.autograd.grad(y, [leaf], dy)
    assert rel_err(got, want) < 2e-6, (trainable, rel_err(got, want))


@child
def test_b_gradient_keeps_the_transposed_storage_of_b():
    """B stored as a contiguous Bᵀ (the engine's layout) gets its gradient in that layout."""
    gen = torch.Generator().manual_seed(12)
    case = random_case(gen, n_slots=4, in_f=32, out_f=48, max_seg=10)
    x, w, b, a, bb = make_tensors(case, dtype=torch.float32, device="cpu", seed=12)
    bb_t = bb.t().contiguous().t()  # same values, strides (1, out)
    dy = torch.randn(case.n_tokens, case.out_f, generator=gen)
    for lora_b in (bb, bb_t):
        leaf = lora_b.detach().requires_grad_(True)
        y = packed_lora_linear(x, w, b, a, leaf, **table(case), dropout_seed=1, backend="triton")
        (grad,) = torch.autograd.grad(y, leaf, dy)
        assert grad.stride() == lora_b.stride()
        ref = oracle(case, (x, w, b, a, bb), dy, 1)[3]
        assert rel_err(grad, ref) < 2e-6


@child
def test_fp16_odd_dim_2049():
    case = Case(n_tokens=7, in_f=2049, out_f=24, seg_lens=(1, 0, 5), ranks=(24, 8, 16),
                dropout=(0.0, 0.5, 0.25), lead=1)  # fmt: skip
    tensors = make_tensors(case, dtype=torch.float16, device="cpu", seed=3)
    dy = torch.randn(case.n_tokens, case.out_f).half()
    got = run_triton(case, tensors, dy, 99, fused=True)
    ref = oracle(case, tensors, dy, 99)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref, strict=True):
        assert g.dtype == torch.float16
        assert rel_err(g, r) < 3e-3, (name, rel_err(g, r))


@child
def test_bitwise_repeatable_and_pad_rows():
    gen = torch.Generator().manual_seed(5)
    case = random_case(gen, n_slots=5, in_f=40, out_f=36, max_seg=12)
    x, w, b, a, bb = make_tensors(case, dtype=torch.float32, device="cpu", seed=5)
    dy = torch.randn(case.n_tokens, case.out_f, generator=gen)
    first = run_triton(case, (x, w, b, a, bb), dy, 7, fused=False)
    again = run_triton(case, (x, w, b, a, bb), dy, 7, fused=False)
    for g1, g2 in zip(first, again, strict=True):
        assert torch.equal(g1, g2)
    # Garbage in the pad rows/columns of the rank blocks changes nothing; their grads are zero.
    a2, b2 = a.clone(), bb.clone()
    for i, r in enumerate(case.ranks):
        lo, hi = case.rank_offsets[i] + r, case.rank_offsets[i + 1]
        a2[lo:hi] = 1e3
        b2[:, lo:hi] = -1e3
        assert torch.count_nonzero(first[2][lo:hi]) == 0
        assert torch.count_nonzero(first[3][:, lo:hi]) == 0
    padded = run_triton(case, (x, w, b, a2, b2), dy, 7, fused=True)
    assert rel_err(padded[0], first[0]) < 1e-6


@child
def test_kernel_keep_mask_equals_torch_philox():
    import triton
    import triton.language as tl
    from plora.kernels.meta import DropoutKeys, make_meta

    @triton.jit
    def keep_kernel(out_ptr, table_ptr, ts, slot, rows, cols, p, word, row_len, col_base, groups,
                    BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
        col0 = tl.program_id(0) * BC  # column tiles: the word-interleave must line up across them
        t = tl.arange(0, BT)
        c = col0 + tl.arange(0, BC)
        key, first_row = TK._drop_key(table_ptr, ts, slot)
        keep = TK._keep(key, first_row, t, col0, p, word, row_len, col_base, groups, BC)
        tl.store(out_ptr + t[:, None] * cols + c[None, :], keep.to(tl.int8),
                 mask=(t[:, None] < rows) & (c[None, :] < cols))  # fmt: skip

    keys = (3, 2**33 + 5, 2**62 + 123456789)  # high key words in use
    drop = DropoutKeys(keys=keys, rows=(0, 7, 2**20), row_len=5, word=11, col_base=8, in_total=64)
    drop = drop.resolved(39, 29)
    meta = make_meta(n_tokens=39, r_total=48, in_features=29, seg_starts=(0, 13, 26, 39),
                     rank_offsets=(0, 16, 32, 48), ranks=(8, 8, 8), scales=(1.0,) * 3,
                     dropout_p=(0.5, 0.1, 0.9), dropout=drop)  # fmt: skip
    tab = meta.device_table(torch.device("cpu"))
    word, row_len, col_base, groups = drop.scalars()
    for slot, p in enumerate(meta.dropout_p):
        out = torch.empty(13, 29, dtype=torch.int8)
        keep_kernel[(4,)](out, tab, tab.stride(0), slot, 13, 29, p, word, row_len, col_base, groups,
                          BT=16, BC=8)  # fmt: skip
        ref = dropout_mask(keys[slot], (13, 29), p, row0=drop.rows[slot], row_len=5, word=11,
                           col_base=8, in_total=64)  # fmt: skip
        assert torch.equal(out.bool(), ref), slot


@child
def test_delta_and_degenerate_tables():
    gen = torch.Generator().manual_seed(11)
    case = random_case(gen, n_slots=4, in_f=20, out_f=18, max_seg=6, dropout=True)
    x, w, b, a, bb = make_tensors(case, dtype=torch.float32, device="cpu", seed=11)
    y = packed_lora_linear(x, w, b, a, bb, **table(case), dropout_seed=4, backend="triton")
    delta = packed_lora_delta(x, a, bb, **table(case), dropout_seed=4, backend="triton")
    torch.testing.assert_close(delta, y - torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # All segments empty: the frozen linear alone, and zero LoRA grads.
    empty = Case(n_tokens=6, in_f=20, out_f=18, seg_lens=(0, 0), ranks=(8, 16), dropout=(0.1, 0.0))
    xe, we, be, ae, bbe = make_tensors(empty, dtype=torch.float32, device="cpu")
    ae.requires_grad_(True)
    ye = packed_lora_linear(xe, we, be, ae, bbe, **table(empty), dropout_seed=1, backend="triton")
    torch.testing.assert_close(ye, torch.nn.functional.linear(xe, we, be))
    (ga,) = torch.autograd.grad(ye.sum(), (ae,))
    assert torch.count_nonzero(ga) == 0


@child
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_engine_layer_gradients_land_in_the_packed_parameters(dtype):
    """The engine's call (``fused_forward``) with the Triton kernels: the layer's ``A``/``Bt`` go
    in as they are (slots without rows as empty segments) or gathered once (rows between
    pieces need a filler), and dA/dBᵀ accumulate into the optimizer's gradient buffers. Dropout
    included: the kernels regenerate the torch path's masks (keyed by adapter seed, step, row
    in the adapter's batch, token and module), so outputs and gradients agree."""
    import functools

    from plora.engine import fused, lora
    from plora.engine.packed_optim import PackedAdamW

    torch.manual_seed(0)
    layer = lora.PackedLoRALinear(torch.nn.Linear(24, 20), key=3)
    for slot, rank in [(0, 5), (2, 16), (4, 3)]:
        layer.add_slot(slot, rank=rank, scale=2.0 / rank, seed=slot, dropout=0.3 * (slot != 2))
        with torch.no_grad():
            layer.factors(slot)[1].normal_()
    opt = PackedAdamW({"m": layer})
    opt.sync()
    grads = (layer.A.grad, layer.Bt.grad)  # views of the optimizer's buffers
    fn = functools.partial(packed_lora_linear, backend="triton")
    layer.base_layer.to(dtype)
    for pieces in ([(0, 1, 3), (4, 3, 6)], [(0, 0, 2), (4, 4, 7)]):  # no gap / a gap (rows 2..4)
        x = torch.randn(8, 3, 24).to(dtype)
        dy = torch.randn(8, 3, 20).to(dtype)
        keys = {0: (3, 7), 4: (5, 2)}  # (adapter step, first row in its batch)
        routing = lora.Routing(segments=tuple(pieces), dropout_keys=keys)
        y = fused.fused_forward(fn, layer, x, pieces, routing)
        y.backward(dy)
        got = [g.clone() for g in grads]
        opt.zero_grad()
        xr = x.float()
        layer.base_layer.float()
        ref = fused.reference_forward(layer, xr, pieces, routing)
        ref.backward(dy.float())
        layer.base_layer.to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        assert rel_err(y.detach().float(), ref.detach()) < tol
        assert layer.A.grad is grads[0] and layer.Bt.grad is grads[1]
        for g, r in zip(got, grads, strict=True):
            assert rel_err(g, r) < tol
        assert torch.count_nonzero(got[0][16:32]) == 0  # slot 2 has no rows
        opt.zero_grad()


@child
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [37, 4096, 9000])  # under, at and across the column block
def test_cross_entropy_kernel_matches_torch(dtype, vocab):
    """The in-place cross-entropy: per-row CE and ``w ⊙ (softmax - onehot)`` written over the
    logits equal torch's float32 log_softmax; without weights the logits are only read; a weight
    of 0 writes a zero row."""
    from plora.kernels.cross_entropy import cross_entropy_
    from plora.kernels.reference import cross_entropy_reference

    gen = torch.Generator().manual_seed(vocab)
    z = (torch.randn(6, vocab, generator=gen) * 4).to(dtype)
    t = torch.randint(0, vocab, (6,), generator=gen)
    t[1] = vocab - 1  # the last column, in the last (partial) block
    w = torch.rand(6, generator=gen)
    w[2] = 0.0
    want_ce, want_g = cross_entropy_reference(z, t, w)
    read = z.clone()
    assert torch.allclose(cross_entropy_(read, t), want_ce, rtol=1e-5, atol=1e-5)
    assert torch.equal(read, z)
    got = z.clone()
    assert torch.allclose(cross_entropy_(got, t, w), want_ce, rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert torch.allclose(got.float(), want_g.float(), rtol=tol, atol=tol)
    assert torch.count_nonzero(got[2]) == 0
    # the target's gradient is the negative one
    assert got[0, t[0]] < 0 < got[0, (t[0] + 1) % vocab]


@child
def test_packed_loss_on_the_kernel_matches_torch(monkeypatch):
    """The packed loss through the kernel (what CUDA runs) and through torch: same loss, the same
    per-slot sums, the same ∂L/∂hidden, with chunks smaller than the targets."""
    from plora.engine import loss as L

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False).requires_grad_(False)
    labels = torch.randint(0, 300, (4, 9))
    labels[:, :3] = -100
    labels[3, 5:] = -100
    segments = [(0, 0, 2), (5, 2, 4)]
    denoms = {0: 11, 5: 7}
    monkeypatch.setattr(L, "_LOGIT_CHUNK", 300 * 3)  # three targets per chunk
    runs = []
    for kernel in (False, True):
        monkeypatch.setattr(L, "_kernel_ce", lambda _x, kernel=kernel: kernel)
        hidden = torch.randn(4, 9, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        loss, per_slot = L.packed_loss(head, hidden, labels, segments, denoms)
        loss.backward()
        runs.append((loss.detach(), {k: v.item() for k, v in per_slot.items()}, hidden.grad))
    (l0, s0, g0), (l1, s1, g1) = runs
    assert torch.allclose(l0, l1, rtol=1e-6) and s0.keys() == s1.keys()
    assert all(abs(s0[k] - s1[k]) < 1e-4 for k in s0)
    assert torch.allclose(g0, g1, rtol=1e-5, atol=1e-7)
