"""Random packed-LoRA cases and an fp64 oracle, shared by the CPU/GPU kernel tests and benchmarks."""

from __future__ import annotations

import dataclasses

import torch

from .meta import padded_rank
from .reference import packed_lora_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One packed call: slot table plus tensor shapes."""

    n_tokens: int
    in_f: int
    out_f: int
    seg_lens: tuple[int, ...]
    ranks: tuple[int, ...]
    dropout: tuple[float, ...]
    bias: bool = True
    lead: int = 0  # tokens before the first segment (no adapter)

    @property
    def seg_starts(self) -> list[int]:
        out = [self.lead]
        for n in self.seg_lens:
            out.append(out[-1] + n)
        return out

    @property
    def rank_offsets(self) -> list[int]:
        out = [0]
        for r in self.ranks:
            out.append(out[-1] + padded_rank(r))
        return out

    @property
    def scales(self) -> list[float]:
        return [16.0 / r if i % 2 else 2.0 / r**0.5 for i, r in enumerate(self.ranks)]


def random_case(gen: torch.Generator, *, n_slots: int, in_f: int, out_f: int, max_seg: int,
                ranks=(8, 16, 24, 64, 128), dropout: bool = True) -> Case:  # fmt: skip
    """Ragged segments (0 and 1 token included when there are >= 3 slots), mixed ranks."""
    lens = torch.randint(0, max_seg + 1, (n_slots,), generator=gen).tolist()
    if n_slots >= 3:
        lens[0], lens[n_slots // 2] = 0, 1
    rk = [ranks[int(i)] for i in torch.randint(0, len(ranks), (n_slots,), generator=gen)]
    ps = [0.0 if not dropout or i % 3 == 0 else 0.1 + 0.2 * (i % 2) for i in range(n_slots)]
    lead = int(torch.randint(0, 3, (1,), generator=gen))
    tail = int(torch.randint(0, 3, (1,), generator=gen))
    return Case(
        n_tokens=lead + sum(lens) + tail,
        in_f=in_f,
        out_f=out_f,
        seg_lens=tuple(lens),
        ranks=tuple(rk),
        dropout=tuple(ps),
        lead=lead,
    )


def make_tensors(case: Case, *, dtype: torch.dtype, device: str, seed: int = 0):
    """x, W, bias, A, B with LoRA-sized values (B non-zero so every gradient is exercised)."""
    g = torch.Generator().manual_seed(seed)
    r_tot = case.rank_offsets[-1]
    x = torch.randn(case.n_tokens, case.in_f, generator=g)
    w = torch.randn(case.out_f, case.in_f, generator=g) / case.in_f**0.5
    b = torch.randn(case.out_f, generator=g) if case.bias else None
    a = torch.randn(r_tot, case.in_f, generator=g) / case.in_f**0.5
    bb = torch.randn(case.out_f, r_tot, generator=g) / 8.0
    conv = [t if t is None else t.to(device=device, dtype=dtype) for t in (x, w, b, a, bb)]
    return tuple(conv)


def table(case: Case) -> dict:
    return {
        "seg_starts": case.seg_starts,
        "rank_offsets": case.rank_offsets,
        "ranks": list(case.ranks),
        "scales": case.scales,
        "dropout_p": list(case.dropout),
    }


def oracle(case: Case, tensors, dy: torch.Tensor, seed: int):
    """fp64 ``y`` and grads ``(dx, dA, dB)`` by the torch reference and torch autograd."""
    x, w, b, a, bb = (t if t is None else t.detach().double() for t in tensors)
    x.requires_grad_(True)
    a.requires_grad_(True)
    bb.requires_grad_(True)
    y = packed_lora_reference(x, w, b, a, bb, **table(case), dropout_seed=seed)
    dx, da, db = torch.autograd.grad(y, (x, a, bb), dy.double())
    return y.detach(), dx, da, db


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    got = got.double()
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))
