"""Packed LoRA Triton kernels on a CUDA GPU: bf16/fp16/fp32 against the fp64 torch oracle."""

from __future__ import annotations

import pytest
import torch
from plora.kernels import dropout_mask, packed_lora_delta, packed_lora_linear, slot_key
from plora.kernels.testing import Case, make_tensors, oracle, random_case, rel_err, table

pytestmark = pytest.mark.gpu

#: ‖got − ref‖/‖ref‖ bounds: bf16 operands land between 1e-3 and 1e-2, tf32 near 3e-4.
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 2e-3}


def run(case: Case, tensors, dy, seed: int, *, fused: bool | None):
    x, w, b, a, bb = (t if t is None else t.detach().clone() for t in tensors)
    for t in (x, a, bb):
        t.requires_grad_(True)
    y = packed_lora_linear(x, w, b, a, bb, **table(case), dropout_seed=seed, fused=fused)
    dx, da, db = torch.autograd.grad(y, (x, a, bb), dy)
    return y.detach(), dx, da, db


SPECS = [
    # (n_slots, in, out, max tokens per slot)
    (1, 2049, 1536, 700),
    (2, 1024, 2049, 300),
    (8, 4096, 1024, 257),
    (17, 768, 3000, 100),
    (32, 2048, 2048, 129),
]


@pytest.mark.parametrize("mode", ["accumulate", "epilogue", "fused", "fused-pointer"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"slots{s[0]}-in{s[1]}-out{s[2]}")
def test_bf16_matches_fp64_oracle(spec, mode, monkeypatch):
    """Every mode; "fused" is the persistent TMA kernel on Hopper where strides allow (dims not
    a multiple of 8 fall back to the pointer GEMM), "fused-pointer" forces the pointer GEMM."""
    from plora.kernels import ops

    monkeypatch.setattr(ops, "choose_mode", lambda *a, **k: ops.Mode(mode.split("-")[0]))
    monkeypatch.setattr(ops, "USE_TMA", mode == "fused")
    n_slots, in_f, out_f, max_seg = spec
    gen = torch.Generator().manual_seed(n_slots + in_f)
    case = random_case(gen, n_slots=n_slots, in_f=in_f, out_f=out_f, max_seg=max_seg)
    tensors = make_tensors(case, dtype=torch.bfloat16, device="cuda", seed=n_slots)
    dy = torch.randn(case.n_tokens, out_f, generator=gen).to("cuda", torch.bfloat16)
    seed = 2**35 + n_slots
    got = run(case, tensors, dy, seed, fused=None)
    ref = oracle(case, tensors, dy, seed)
    for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref, strict=True):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, r) < TOL[torch.bfloat16], (name, rel_err(g, r), case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_dtypes(dtype):
    gen = torch.Generator().manual_seed(7)
    case = random_case(gen, n_slots=6, in_f=1000, out_f=1100, max_seg=200)
    tensors = make_tensors(case, dtype=dtype, device="cuda", seed=7)
    dy = torch.randn(case.n_tokens, case.out_f, generator=gen).to("cuda", dtype)
    for fused in (False, True):
        got = run(case, tensors, dy, 5, fused=fused)
        ref = oracle(case, tensors, dy, 5)
        for name, g, r in zip(("y", "dx", "dA", "dB"), got, ref, strict=True):
            assert rel_err(g, r) < TOL[dtype], (name, fused, rel_err(g, r))


@pytest.mark.parametrize("fused", [False, True, None], ids=["unfused", "fused", "auto"])
def test_bitwise_repeatable(fused):
    gen = torch.Generator().manual_seed(3)
    case = random_case(gen, n_slots=12, in_f=2048, out_f=2048, max_seg=400)
    tensors = make_tensors(case, dtype=torch.bfloat16, device="cuda", seed=3)
    dy = torch.randn(case.n_tokens, case.out_f, generator=gen).to("cuda", torch.bfloat16)
    first = run(case, tensors, dy, 11, fused=fused)
    again = run(case, tensors, dy, 11, fused=fused)
    for g1, g2 in zip(first, again, strict=True):
        assert torch.equal(g1.view(torch.int16), g2.view(torch.int16))


@pytest.mark.parametrize("spec", SPECS[1:], ids=lambda s: f"slots{s[0]}-in{s[1]}-out{s[2]}")
def test_side_kernels_by_tma(spec, monkeypatch):
    """Shrinks and weight gradients with TMA operand tiles (Hopper): bf16 against the oracle,
    and bitwise repeatable."""
    from plora.kernels import ops

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need Hopper or newer")
    for kind in ("shrink", "wgrad"):
        cfg = {**ops.kernel_config(kind, torch.device("cuda")), "TMA": 1}
        monkeypatch.setitem(ops.CONFIG_OVERRIDES, kind, cfg)
    n_slots, in_f, out_f, max_seg = spec
    gen = torch.Generator().manual_seed(n_slots + out_f)
    case = random_case(gen, n_slots=n_slots, in_f=in_f, out_f=out_f, max_seg=max_seg)
    tensors = make_tensors(case, dtype=torch.bfloat16, device="cuda", seed=n_slots)
    dy = torch.randn(case.n_tokens, out_f, generator=gen).to("cuda", torch.bfloat16)
    ref = oracle(case, tensors, dy, 29)
    for fused in (False, True):
        got = run(case, tensors, dy, 29, fused=fused)
        again = run(case, tensors, dy, 29, fused=fused)
        for name, g, g2, r in zip(("y", "dx", "dA", "dB"), got, again, ref, strict=True):
            assert rel_err(g, r) < TOL[torch.bfloat16], (name, fused, rel_err(g, r))
            assert torch.equal(g.view(torch.int16), g2.view(torch.int16)), (name, fused)


#: A fresh process whose autograd backward thread starts with a TMA-descriptor launch.
FRESH_BACKWARD = """
import sys, torch
from plora.kernels import ops, packed_lora_linear
from plora.kernels.testing import Case, make_tensors, table
if sys.argv[1] == "unbound":  # Triton's own descriptor class, no context binding
    from triton.tools.tensor_descriptor import TensorDescriptor
    ops._descriptor_class = lambda device: TensorDescriptor
for kind in ("shrink", "wgrad"):
    ops.CONFIG_OVERRIDES[kind] = {**ops.kernel_config(kind, torch.device("cuda")), "TMA": 1}
case = Case(n_tokens=2048, in_f=3584, out_f=3584, seg_lens=(128,) * 16,
            ranks=(8, 16, 32, 64, 128, 24, 48, 96) * 2, dropout=(0.0,) * 16)
x, w, b, a, bb = (t if t is None else t.detach().requires_grad_()
                  for t in make_tensors(case, dtype=torch.bfloat16, device="cuda", seed=8))
y = packed_lora_linear(x, w, b, a, bb, **table(case), dropout_seed=3, fused=True)
torch.autograd.grad(y, (x, a, bb), torch.ones_like(y))
torch.cuda.synchronize()
print("backward ok")
"""


def test_tma_descriptors_on_autograds_fresh_thread():
    """The backward runs on autograd's own thread; in a fresh process its first CUDA work can
    be building a TMA descriptor, which needs a context bound to that thread first."""
    import subprocess
    import sys

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need Hopper or newer")
    run_it = [sys.executable, "-c", FRESH_BACKWARD, "bound"]
    proc = subprocess.run(run_it, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "backward ok" in proc.stdout, proc.stderr[-3000:]


def test_dropout_mask_on_gpu_matches_cpu_and_kernel():
    for key, row0, p in ((1, 0, 0.1), (2**40 + 3, 9, 0.5)):
        kw = dict(row0=row0, row_len=100, word=5, col_base=4, in_total=300)
        cpu = dropout_mask(key, (300, 257), p, **kw)
        gpu = dropout_mask(key, (300, 257), p, device="cuda", **kw)
        assert torch.equal(cpu, gpu.cpu())
    # The kernel's forward drops exactly the masked inputs: with A = I (rank 16 on 16 features),
    # S = x ⊙ m/(1-p) and delta = S·Bᵀ with B = I.
    x = torch.randn(40, 16, device="cuda", dtype=torch.float32) + 3.0
    eye = torch.eye(16, device="cuda")
    delta = packed_lora_delta(x, eye, eye, [0, 40], [0, 16], [16], [1.0], [0.25], 77)
    keep = dropout_mask(slot_key(77, 0), (40, 16), 0.25, device="cuda")
    torch.testing.assert_close(delta, torch.where(keep, x / 0.75, 0.0), rtol=3e-3, atol=3e-3)


def _compiled_variants() -> int:
    """How many binaries the four packed-LoRA kernels hold on the current device."""
    from plora.kernels import triton_kernels as tk
    from plora.kernels import triton_wgrad

    dev = torch.cuda.current_device()
    total = 0
    for k in (
        tk._shrink_kernel,
        tk._lora_gemm_kernel,
        tk._fused_tma_kernel,
        triton_wgrad._wgrad_kernel,
    ):
        caches = k.device_caches.get(dev) if hasattr(k, "device_caches") else None
        if caches is None:
            continue
        total += len(caches[0])  # (kernel cache, target, backend, binder)
    return total


@pytest.mark.parametrize("fused", [True, False])
def test_new_seeds_and_token_counts_compile_nothing(fused):
    """A sweep's steps differ only in the dropout seed and the token count: after the first step
    no call may compile again (a seed or a token count divisible by 16 used to add a variant
    and stall the step that first met it for seconds)."""
    import dataclasses

    gen = torch.Generator().manual_seed(3)
    base = random_case(gen, n_slots=5, in_f=1536, out_f=1536, max_seg=90)
    tensors = make_tensors(base, dtype=torch.bfloat16, device="cuda", seed=1)
    used = base.lead + sum(base.seg_lens)  # rows past this belong to no adapter

    def step(n_tokens: int, seed: int) -> None:
        case = dataclasses.replace(base, n_tokens=n_tokens)
        x = torch.randn(n_tokens, base.in_f, generator=gen).to("cuda", torch.bfloat16)
        dy = torch.randn(n_tokens, base.out_f, generator=gen).to("cuda", torch.bfloat16)
        run(case, (x, *tensors[1:]), dy, seed, fused=fused)

    first = used + 1 if (used + 1) % 16 else used + 2  # M % 16 != 0, odd seed
    step(first, 2**40 + 3)
    torch.cuda.synchronize()
    before = _compiled_variants()
    assert before > 0
    aligned = used + (-used) % 16 + 16  # M % 16 == 0
    for n_tokens, seed in [(aligned, 2**40 + 16), (aligned + 16, 2**41), (first + 2, 2**40 + 1)]:
        step(n_tokens, seed)
    torch.cuda.synchronize()
    assert _compiled_variants() == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cross_entropy_kernel_on_gpu(dtype):
    """The packed loss's in-place cross-entropy at a real vocabulary's width against torch's
    float32 log_softmax: CE within float32 rounding, the gradient within one rounding of ``dtype``."""
    from plora.kernels.cross_entropy import cross_entropy_
    from plora.kernels.reference import cross_entropy_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(700, 151_936, generator=gen, device="cuda") * 4).to(dtype)
    t = torch.randint(0, 151_936, (700,), generator=gen, device="cuda")
    w = torch.rand(700, generator=gen, device="cuda")
    want_ce, want_g = cross_entropy_reference(z, t, w)
    got = z.clone()
    ce = cross_entropy_(got, t, w)
    assert torch.allclose(ce, want_ce, rtol=1e-5, atol=1e-4)
    assert rel_err(got.float(), want_g.float()) < {torch.float32: 1e-5}.get(dtype, 1e-2)
    assert torch.allclose(cross_entropy_(z, t), want_ce, rtol=1e-5, atol=1e-4)
