"""plora.kernels without Triton: Philox port, dropout masks, slot-table validation, torch reference."""

from __future__ import annotations

import pytest
import torch
from plora.kernels import (
    DropoutKeys,
    PackedLoRAError,
    dropout_mask,
    packed_lora_delta,
    packed_lora_linear,
    packed_lora_reference,
    slot_key,
)
from plora.kernels.meta import make_meta, padded_rank
from plora.kernels.reference import philox4x32, uniform_from_uint32
from plora.kernels.testing import Case, make_tensors, random_case, table

# Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
PHILOX_KAT = [
    ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0xA4093822, 0x299F31D0),
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("key", "ctr", "expect"), PHILOX_KAT)
def test_philox_known_answers(key, ctr, expect):
    words = philox4x32(key, *(torch.tensor(c, dtype=torch.int64) for c in ctr))
    assert tuple(int(w) for w in words) == expect


def test_uniform_conversion_matches_triton_rules():
    bits = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    u = uniform_from_uint32(bits)
    assert u.dtype == torch.float32
    assert u[0] == 0.0 and u[4] == 0.0  # -1 as int32 maps to ~(-1) = 0
    assert u[2] == u[3] and 0.99 < float(u[2]) < 1.0  # the largest value stays below 1
    assert float(u[1]) == pytest.approx(4.6566127342e-10, rel=1e-6)


def test_dropout_mask_statistics_and_independence():
    m = dropout_mask(7, (256, 300), 0.3)
    assert m.dtype == torch.bool and m.shape == (256, 300)
    assert abs(m.float().mean().item() - 0.7) < 0.01
    assert torch.equal(m, dropout_mask(7, (256, 300), 0.3))  # deterministic
    others = (
        dropout_mask(8, (256, 300), 0.3),  # another key
        dropout_mask(7, (256, 300), 0.3, word=1),  # another module
        dropout_mask(7, (256, 300), 0.3, row0=1),  # another row
    )
    for other in others:
        agree = (m == other).float().mean().item()
        assert abs(agree - (0.7**2 + 0.3**2)) < 0.01  # independent streams
    # Tokens of a longer row extend the shorter one (the counter depends on s, row and c only).
    assert torch.equal(dropout_mask(7, (100, 300), 0.3), m[:100])
    assert dropout_mask(7, (4, 5), 0.0).all()


def test_dropout_mask_belongs_to_the_adapters_rows_not_the_call():
    """Rows cut by row_len, a longer padded length and a column split (row-wise TP) all give
    the same bits for the same (row, token, column): the mask does not depend on the pack."""
    key, p = 12345, 0.4
    three = dropout_mask(key, (3 * 6, 40), p, row0=5, row_len=6, word=9)
    for j in range(3):  # row j of a 3-row segment == that row alone
        alone = dropout_mask(key, (6, 40), p, row0=5 + j, row_len=6, word=9)
        assert torch.equal(three[6 * j : 6 * (j + 1)], alone)
    padded = dropout_mask(key, (2 * 10, 40), p, row0=5, row_len=10, word=9)  # padded to 10
    assert torch.equal(padded[:6], three[:6]) and torch.equal(padded[10:16], three[6:12])
    half = dropout_mask(key, (18, 20), p, row0=5, row_len=6, word=9, col_base=20, in_total=40)
    assert torch.equal(half, three[:, 20:])
    odd = dropout_mask(key, (18, 15), p, row0=5, row_len=6, word=9, col_base=23, in_total=40)
    assert torch.equal(odd, three[:, 23:38])  # any column split (the torch reference's TP)
    # The Triton kernels read whole groups of 4 columns: they refuse a split inside one.
    with pytest.raises(PackedLoRAError, match="multiple of 4"):
        DropoutKeys(keys=(1, 2), col_base=2).resolved(6, 8).scalars()


def test_seeds_above_32_bits_use_the_high_key_word():
    lo = dropout_mask(5, (64, 64), 0.5)
    hi = dropout_mask(5 + 2**32, (64, 64), 0.5)
    assert not torch.equal(lo, hi)
    # Keys are taken mod 2^63 (what a Triton int64 argument carries); negatives wrap.
    assert torch.equal(dropout_mask(5 + 2**63, (64, 64), 0.5), lo)
    assert torch.equal(dropout_mask(-1, (8, 8), 0.5), dropout_mask(2**63 - 1, (8, 8), 0.5))


def _naive_oracle(case: Case, x, w, b, a, bb, seed):
    """Per-token formula, independent of the reference's slicing: gather each token's adapter."""
    y = x @ w.t() + b
    slot_of = torch.full((case.n_tokens,), -1, dtype=torch.long)
    for i in range(len(case.ranks)):
        slot_of[case.seg_starts[i] : case.seg_starts[i + 1]] = i
    for t in range(case.n_tokens):
        i = int(slot_of[t])
        if i < 0:
            continue
        r, off, p = case.ranks[i], case.rank_offsets[i], case.dropout[i]
        xt = x[t]
        if p > 0:
            local = t - case.seg_starts[i]
            keep = dropout_mask(slot_key(seed, i), (local + 1, case.in_f), p)[local]
            xt = xt * keep / (1 - p)
        y[t] += case.scales[i] * bb[:, off : off + r] @ (a[off : off + r] @ xt)
    return y


def test_reference_matches_per_token_oracle():
    gen = torch.Generator().manual_seed(0)
    case = random_case(gen, n_slots=6, in_f=19, out_f=13, max_seg=7, ranks=(8, 24, 16))
    x, w, b, a, bb = make_tensors(case, dtype=torch.float64, device="cpu")
    got = packed_lora_reference(x, w, b, a, bb, **table(case), dropout_seed=3)
    torch.testing.assert_close(got, _naive_oracle(case, x, w, b, a, bb, 3))


def test_public_api_on_cpu_uses_the_reference_and_flattens_leading_dims():
    case = Case(
        n_tokens=12, in_f=10, out_f=6, seg_lens=(4, 0, 8), ranks=(8, 16, 24), dropout=(0, 0.2, 0.5)
    )
    x, w, b, a, bb = make_tensors(case, dtype=torch.float64, device="cpu")
    y = packed_lora_linear(x.view(3, 4, 10), w, b, a, bb, **table(case), dropout_seed=9)
    assert y.shape == (3, 4, 6)
    ref = packed_lora_reference(x, w, b, a, bb, **table(case), dropout_seed=9)
    torch.testing.assert_close(y.reshape(12, 6), ref)
    delta = packed_lora_delta(x, a, bb, **table(case), dropout_seed=9)
    torch.testing.assert_close(delta, ref - torch.nn.functional.linear(x, w, b))
    # Tensors as table arguments give the same result as lists.
    tab = {k: torch.tensor(v) for k, v in table(case).items()}
    torch.testing.assert_close(packed_lora_linear(x, w, b, a, bb, **tab, dropout_seed=9), ref)


def test_padded_rank():
    assert [padded_rank(r) for r in (1, 8, 16, 24, 64, 100, 128)] == [16, 16, 16, 32, 64, 112, 128]


GOOD = dict(
    seg_starts=[0, 3, 5], rank_offsets=[0, 16, 48], ranks=[8, 24], scales=[1.0, 2.0], dropout_p=0.1
)
BAD = [
    (dict(seg_starts=[0, 3]), "seg_starts has 2 entries"),
    (dict(seg_starts=[0, 4, 3]), "seg_starts[2]=3 < seg_starts[1]=4"),
    (dict(seg_starts=[0, 3, 9]), "x has 6 tokens"),
    (dict(rank_offsets=[0, 16, 40]), "rank block of 24 rows"),
    (dict(rank_offsets=[0, 32, 64]), "lora_a has 48 rows"),
    (dict(ranks=[0, 24]), "ranks[0]=0"),
    (dict(dropout_p=[0.1, 1.0]), "dropout_p[1]=1.0"),
    (dict(scales=[1.0]), "scales has 1 entries"),
    (dict(scales=[1.0, float("nan")]), "scales[1]=nan"),
]


def test_valid_table_summaries():
    meta = make_meta(n_tokens=6, r_total=48, in_features=4, **GOOD)
    assert (meta.n_slots, meta.max_rank_pad, meta.has_dropout) == (2, 32, True)
    assert make_meta(n_tokens=6, r_total=48, in_features=4, **GOOD) is meta  # cached


@pytest.mark.parametrize(("patch", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_tables_raise_one_line_config_errors(patch, message):
    with pytest.raises(
        PackedLoRAError, match=message.replace("[", r"\[").replace("]", r"\]")
    ) as err:
        make_meta(n_tokens=6, r_total=48, in_features=4, **{**GOOD, **patch})
    assert "\n" not in str(err.value)


def test_bad_tensor_shapes_raise_config_errors():
    x = torch.randn(6, 4)
    w = torch.randn(5, 4)
    a = torch.randn(48, 4)
    with pytest.raises(PackedLoRAError, match="lora_b has shape"):
        packed_lora_linear(x, w, None, a, torch.randn(5, 40), **GOOD, dropout_seed=0)
    with pytest.raises(PackedLoRAError, match="lora_a has shape"):
        packed_lora_linear(
            x, w, None, torch.randn(48, 3), torch.randn(5, 48), **GOOD, dropout_seed=0
        )
    with pytest.raises(PackedLoRAError, match="backend="):
        packed_lora_linear(
            x, w, None, a, torch.randn(5, 48), **GOOD, dropout_seed=0, backend="cuda"
        )
    with pytest.raises(PackedLoRAError, match=r"lora_b is torch.float64 but x is torch.float32"):
        packed_lora_linear(x, w, None, a, torch.randn(5, 48).double(), **GOOD, dropout_seed=0)


def test_mode_choice_from_the_measured_table(monkeypatch):
    from plora.kernels import configs, ops

    def row(phase, tokens, fused, epilogue, accumulate):
        ms = {"fused": fused, "epilogue": epilogue, "accumulate": accumulate}
        return {"phase": phase, "tokens": tokens, "in": 4096, "out": 4096, "ms": ms}

    table = {
        "dispatch": [
            row("fwd", 2048, 0.30, 0.20, 0.25),
            row("fwd", 8192, 0.40, 0.50, 0.45),
            row("bwd", 8192, 0.40, 0.50, 0.45),
        ]
    }
    monkeypatch.setattr(configs, "_gpu_entry", lambda index: table)
    monkeypatch.setattr(configs, "_interpreting", lambda: False)
    configs._measured_mode.cache_clear()
    cuda = torch.device("cuda", 0)  # never touched: the table lookup is mocked
    try:
        pick = ops.choose_mode
        assert pick("fwd", 2500, 4096, 4096, cuda, fused=None) == ops.Mode.EPILOGUE  # nearest 2048
        assert pick("fwd", 7000, 4096, 4096, cuda, fused=None) == ops.Mode.FUSED  # nearest 8192
        assert pick("fwd", 7000, 4096, 4096, cuda, fused=False) == ops.Mode.ACCUMULATE
        assert pick("fwd", 7000, 4096, 4096, cuda, fused=True) == ops.Mode.FUSED
        assert pick("bwd", 8192, 4096, 4096, cuda, fused=None) == ops.Mode.FUSED
        # No dropout rows: the backward with dropout never takes the fused kernel.
        assert pick("bwd-dropout", 8192, 4096, 4096, cuda, fused=None) == ops.Mode.ACCUMULATE
        table["dispatch"].append(row("bwd-dropout", 8192, 0.40, 0.60, 0.70))
        configs._measured_mode.cache_clear()
        assert pick("bwd-dropout", 8192, 4096, 4096, cuda, fused=None) == ops.Mode.FUSED
        assert pick("fwd", 8192, 4096, 4096, torch.device("cpu"), fused=None) == ops.Mode.ACCUMULATE
    finally:
        configs._measured_mode.cache_clear()
