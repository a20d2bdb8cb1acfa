"""Shared pieces of the kernel benchmarks: timing, random packed problems, kernel launches.

Imported by ``kernels.py`` (which sets ``TRITON_INTERPRET`` for ``--dry-run`` before this module
imports triton) and ``kernels_tune.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
from plora.kernels import ops, packed_lora_delta, packed_lora_linear
from plora.kernels.meta import DropoutKeys, make_meta, padded_rank

DRY = "--dry-run" in sys.argv


def bench(fn, grad_to_none=None) -> float:
    """Median milliseconds of ``fn``."""
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(
        fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"
    )


def cycler(items):
    """Zero-argument function returning the next item, round-robin."""
    it = itertools.cycle(items)
    return lambda: next(it)


def rotate_calls(fns):
    """Zero-argument function calling the next of ``fns``, round-robin (rotating inputs)."""
    nxt = cycler(fns)
    return lambda: nxt()()


class Pack:
    """Random packed-LoRA problem: tokens, frozen weight, K adapters, segment table."""

    def __init__(
        self, *, seg_lens, ranks, in_f, out_f, dtype, device, dropout=0.0, n_rot=3, seed=0
    ):
        g = torch.Generator().manual_seed(seed)
        self.n = sum(seg_lens)
        self.in_f, self.out_f = in_f, out_f
        self.seg = [0, *itertools.accumulate(seg_lens)]
        self.ranks = list(ranks)
        self.offs = [0, *itertools.accumulate(padded_rank(r) for r in ranks)]
        self.scales = [16.0 / r for r in ranks]
        self.dropout = [dropout] * len(ranks)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

        self.xs = [rnd(self.n, in_f).requires_grad_() for _ in range(n_rot)]
        self.dys = [rnd(self.n, out_f) for _ in range(n_rot)]
        self.w = rnd(out_f, in_f, scale=in_f**-0.5)
        self.a = rnd(self.offs[-1], in_f, scale=in_f**-0.5).requires_grad_()
        # B as the engine stores it (plora.engine.lora): Bᵀ contiguous, (out, R_tot) strides (1, out).
        self.b = rnd(self.offs[-1], out_f, scale=0.1).t().requires_grad_()
        # The same adapters as separate leaf tensors in PEFT's layout, for the torch baselines.
        self.a_list = [
            self.a[o : o + r].detach().clone().requires_grad_()
            for o, r in zip(self.offs, ranks, strict=False)
        ]
        self.b_list = [
            self.b[:, o : o + r].detach().contiguous().requires_grad_()
            for o, r in zip(self.offs, ranks, strict=False)
        ]
        self._parts: dict[int, list[torch.Tensor]] = {}

    @property
    def table(self):
        return dict(
            seg_starts=self.seg,
            rank_offsets=self.offs,
            ranks=self.ranks,
            scales=self.scales,
            dropout_p=self.dropout,
        )

    def dropout_keys(self) -> DropoutKeys:
        """The keys :meth:`packed` draws from (``dropout_seed=1``), resolved for this pack."""
        return DropoutKeys.from_seed(1, len(self.ranks)).resolved(self.n, self.in_f)

    def meta(self):
        return make_meta(
            n_tokens=self.n, r_total=self.offs[-1], in_features=self.in_f, **self.table,
            dropout=self.dropout_keys(),
        )  # fmt: skip

    def packed(self, x, fused):
        return packed_lora_linear(
            x,
            self.w,
            None,
            self.a,
            self.b,
            **self.table,
            dropout_seed=1,
            fused=fused,
            backend="triton",
        )

    def delta(self, x):
        return packed_lora_delta(x, self.a, self.b, **self.table, dropout_seed=1, backend="triton")

    def parts(self, x):
        """``x``'s token blocks as separate leaves, one per adapter (cached per buffer)."""
        if id(x) not in self._parts:
            self._parts[id(x)] = [
                x[s:e].detach().requires_grad_()
                for s, e in zip(self.seg, self.seg[1:], strict=False)
            ]
        return self._parts[id(x)]

    def seq_delta(self, x):
        """Sequential per-adapter torch LoRA (PEFT-style): adapter i on its own input block."""
        return self._loop(self.parts(x))

    def naive(self, x):
        """mLoRA BatchLoRA style: the base GEMM once, then a torch loop over adapters."""
        blocks = [x[s:e] for s, e in zip(self.seg, self.seg[1:], strict=False)]
        return F.linear(x, self.w) + torch.cat(self._loop(blocks))

    def _loop(self, blocks):
        return [
            ((xi @ a.t()) @ b.t()) * sc
            for xi, a, b, sc in zip(blocks, self.a_list, self.b_list, self.scales, strict=True)
        ]

    def adapters(self):
        """The per-adapter leaves of the torch baselines."""
        return [*self.a_list, *self.b_list]


def ragged_lens(n: int, n_slots: int, seed: int = 1) -> list[int]:
    """``n_slots`` segment lengths summing to ``n``, each within 0.5-1.5x of the mean."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n_slots, generator=g) + 0.5
    lens = (w / w.sum() * n).floor().long().tolist()
    lens[-1] += n - sum(lens)
    return lens


class Timing(NamedTuple):
    """Milliseconds of one forward and one backward: eager, and replayed as a CUDA graph."""

    fwd: float
    bwd: float
    fwd_graph: float | None = None
    bwd_graph: float | None = None

    @classmethod
    def median(cls, samples) -> Timing:
        """Field-wise median of several timings of the same calls (rounds)."""
        samples = list(samples)
        return cls(*(statistics.median(t[i] for t in samples) for i in range(len(cls._fields))))


def graph_ms(fn) -> float:
    """Median ms of ``fn`` captured once as a CUDA graph and replayed: GPU time, no host cost."""
    if DRY:
        return bench(fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile, allocate, fill the caches outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = bench(graph.replay)
    del graph
    return ms


def time_fwd_bwd(pk: Pack, fwd, params, *, graph: bool = False, inputs=lambda x: [x]) -> Timing:
    """Forward and backward ms of ``fwd(x) -> tensor | list``.

    Eager: inputs rotate over ``pk.xs``; the backward is ``torch.autograd.grad`` of the graph
    (retained) with respect to ``inputs(x)`` and ``params`` (no accumulation into ``.grad``).
    With ``graph``, also the CUDA-graph replay of the forward, and of forward + backward minus it.
    """

    def grads(x, y, dy):
        ys, gs = (
            (y, list(dy.split([t.shape[0] for t in y]))) if isinstance(y, list) else ([y], [dy])
        )
        return torch.autograd.grad(ys, [*inputs(x), *params], gs, retain_graph=True)

    t_f = bench(rotate_calls([lambda x=x: fwd(x) for x in pk.xs]))
    steps = [
        lambda x=x, y=fwd(x), dy=dy: grads(x, y, dy) for x, dy in zip(pk.xs, pk.dys, strict=True)
    ]
    t_b = bench(rotate_calls(steps))
    # Free the retained eager graphs: a leaf's AccumulateGrad node made on the default stream
    # and kept alive would make the capture below sync with the default stream (illegal).
    del steps
    if not graph:
        return Timing(t_f, t_b)
    x, dy = pk.xs[0], pk.dys[0]
    g_f = graph_ms(lambda: fwd(x))
    g_fb = graph_ms(lambda: grads(x, fwd(x), dy))
    return Timing(t_f, t_b, g_f, g_fb - g_f)


def frozen_times(pk: Pack, *, graph: bool = False) -> Timing:
    """The frozen linear: ``x·Wᵀ`` forward, ``dY·W`` backward (no weight gradient)."""
    x_it = cycler(pk.xs)
    dy_it = cycler(pk.dys)
    t_f = bench(lambda: F.linear(x_it(), pk.w))
    t_b = bench(lambda: dy_it() @ pk.w)
    if not graph:
        return Timing(t_f, t_b)
    x, dy = pk.xs[0].detach(), pk.dys[0]
    return Timing(t_f, t_b, graph_ms(lambda: F.linear(x, pk.w)), graph_ms(lambda: dy @ pk.w))


class KernelLaunches:
    """One launch per kernel kind on ``pk``'s first input (as autograd.py calls them), into
    output buffers kept between launches, and each kind's error against a torch reference.

    The tuner times :meth:`calls` and rejects a candidate config whose :meth:`error` is above
    its tolerance: a fast tile config must also be a right one. References are float32 from
    the same bf16 inputs, so the error is the kernels' own rounding (~1e-3 in bf16).
    """

    def __init__(self, pk: Pack):
        self.pk, self.meta, self.drop = pk, pk.meta(), pk.dropout_keys().scalars()
        self.x, self.dy, self.w = pk.xs[0].detach(), pk.dys[0], pk.w
        self.a, self.b_t = pk.a.detach(), pk.b.detach().t().contiguous()
        self.table = self.meta.device_table(self.x.device)
        self.s_buf = self._shrink()
        self.y = torch.empty(self.x.shape[0], pk.out_f, device=self.x.device, dtype=self.x.dtype)
        self.dx = torch.empty_like(self.x)
        self.da, self.db = torch.empty_like(pk.a), torch.empty_like(pk.b)

    def calls(self) -> dict:
        return {
            "shrink": self._shrink,
            "lora": self._lora,
            "gemm": lambda: self._gemms(tma=False, backward=False),  # pointer GEMM, forward
            "tma": lambda: self._gemms(tma=True, backward=True),  # TMA GEMM, both orientations
            "wgrad": self._wgrad,
            "addmm": lambda: self.y.addmm_(self.x, self.w.t()),
        }

    def _shrink(self) -> torch.Tensor:
        a = self.a
        return ops.shrink(
            self.x, a, (a.stride(0), a.stride(1)), self.table, self.meta, self.drop, dropout=True
        )

    def _lora(self) -> None:
        b_t = self.b_t
        ops.lora_gemm(self.y, self.s_buf, b_t, (b_t.stride(1), b_t.stride(0)), self.table,
                      self.meta, self.drop)  # fmt: skip

    def _gemms(self, *, tma: bool, backward: bool) -> None:
        w, b_t, a, lora = self.w, self.b_t, self.a, (self.table, self.meta, self.drop)
        ops.USE_TMA = tma
        try:
            bt_str, a_str = (b_t.stride(1), b_t.stride(0)), (a.stride(1), a.stride(0))
            ops.lora_gemm(self.y, self.s_buf, b_t, bt_str, *lora, base=(self.x, w, w.stride()))
            if backward:  # dX = dY·W: Q[n, k] = W[k, n]
                w_t = (w.stride(1), w.stride(0))
                ops.lora_gemm(self.dx, self.s_buf, a, a_str, *lora, base=(self.dy, w, w_t))
        finally:
            ops.USE_TMA = True

    def _wgrad(self) -> None:
        a, db = self.a, self.db
        jobs = [
            ops.WgradJob(self.x, self.s_buf, self.da, (a.stride(1), a.stride(0))),
            ops.WgradJob(self.dy, self.s_buf, db, (db.stride(0), db.stride(1))),
        ]
        ops.wgrad(jobs, self.table, self.meta, self.drop, dropout=True)

    def error(self, kind: str) -> float:
        """Largest ``‖got − ref‖ / ‖ref‖`` of one launch of ``kind`` (configs as set now)."""
        pk, x, dy, s_buf, f32 = self.pk, self.x, self.dy, self.s_buf, torch.float32
        segs = [
            (st, en, o, r, sc)
            for st, en, o, r, sc in zip(pk.seg, pk.seg[1:], pk.offs, pk.ranks, pk.scales, strict=False)
            if en > st
        ]  # fmt: skip

        def route(rows_of_r):  # Σ_i S_i·R_iᵀ on each slot's rows; R stored (R_tot, N)
            out = torch.zeros(x.shape[0], rows_of_r.shape[1], device=x.device, dtype=f32)
            for st, en, o, r, _ in segs:
                out[st:en] = s_buf[st:en, :r].to(f32) @ rows_of_r[o : o + r].to(f32)
            return out

        def err(got, ref):
            return float((got.to(f32) - ref).norm() / ref.norm().clamp_min(1e-30))

        if kind == "shrink":
            got = self._shrink()
            pieces = [(got[st:en, :r], sc * x[st:en].to(f32) @ self.a[o : o + r].to(f32).t())
                      for st, en, o, r, sc in segs]  # fmt: skip
            return err(torch.cat([g.flatten() for g, _ in pieces]),
                       torch.cat([r.flatten() for _, r in pieces]))  # fmt: skip
        if kind == "lora":
            self._lora()
            return err(self.y, route(self.b_t))
        if kind in ("gemm", "tma"):  # both orientations checked, also for the pointer GEMM
            self._gemms(tma=kind == "tma", backward=True)
            w = self.w.to(f32)
            ref_y = x.to(f32) @ w.t() + route(self.b_t)
            ref_dx = dy.to(f32) @ w + route(self.a)
            return max(err(self.y, ref_y), err(self.dx, ref_dx))
        if kind == "wgrad":
            self._wgrad()
            ref_da = torch.zeros(self.a.shape, device=x.device, dtype=f32)
            ref_db = torch.zeros(pk.b.shape, device=x.device, dtype=f32)
            for st, en, o, r, _ in segs:
                ref_da[o : o + r] = s_buf[st:en, :r].to(f32).t() @ x[st:en].to(f32)
                ref_db[:, o : o + r] = dy[st:en].to(f32).t() @ s_buf[st:en, :r].to(f32)
            return max(err(self.da, ref_da), err(self.db, ref_db))
        raise ValueError(f"KernelLaunches.error: no reference for kind {kind!r}")


def kernel_calls(pk: Pack) -> dict:
    """One zero-argument launch per kernel kind (see :class:`KernelLaunches`)."""
    return KernelLaunches(pk).calls()


@contextlib.contextmanager
def forced_mode(mode: str | None):
    """Run packed_lora_linear in ``mode`` (an ops.Mode value), or as dispatched if None."""
    if mode is None:
        yield
        return
    original = ops.choose_mode
    ops.choose_mode = lambda *a, **k: ops.Mode(mode)
    try:
        yield
    finally:
        ops.choose_mode = original


def time_modes(pk: Pack, modes, *, graph: bool = False) -> dict:
    """:class:`Timing` of the whole packed linear per mode (None = the dispatched choice)."""
    out = {}
    for mode in modes:
        with forced_mode(mode):
            out[mode] = time_fwd_bwd(
                pk, lambda x, pk=pk: pk.packed(x, None), [pk.a, pk.b], graph=graph
            )
    return out
