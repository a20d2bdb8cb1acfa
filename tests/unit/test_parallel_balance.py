"""Token-balanced micro-batches (plora.parallel.balance) and ParallelDims validation."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plora.parallel.balance import balanced_micro_batches, bin_tokens, linear_partition
from plora.parallel.dims import ParallelDims


def _brute_force(w: list[int], k: int) -> int:
    """Least heaviest bin over all ways to cut ``w`` into ``k`` contiguous non-empty bins."""
    n, best = len(w), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = [0, *cuts, n]
        heaviest = max(sum(w[b[j] : b[j + 1]]) for j in range(k))
        best = heaviest if best is None else min(best, heaviest)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=9), st.integers(1, 5))
def test_linear_partition_is_optimal_and_covers(w, k):
    b = linear_partition(w, k)
    assert len(b) == k + 1 and b[0] == 0 and b[-1] == len(w)
    assert all(x <= y for x, y in itertools.pairwise(b))
    sizes = [y - x for x, y in itertools.pairwise(b)]
    if len(w) >= k:
        assert min(sizes) >= 1, (w, k, b)
        heaviest = max(sum(w[b[j] : b[j + 1]]) for j in range(k))
        assert heaviest == _brute_force(w, k)
        assert heaviest <= sum(w) / k + max(w)
    else:
        assert sizes == [1] * len(w) + [0] * (k - len(w))


@pytest.mark.parametrize(
    ("w", "k", "bounds"),
    [
        ([5, 5, 5, 5], 2, [0, 2, 4]),
        ([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, [0, 1, 11]),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [0, 5, 7, 9]),  # 15, 13, 17: the optimum is 17
        ([], 2, [0, 0, 0]),
        ([3], 1, [0, 1]),
    ],
)
def test_linear_partition_table(w, k, bounds):
    assert linear_partition(w, k) == bounds


def test_linear_partition_rejects_bad_input():
    with pytest.raises(ValueError, match="k=0"):
        linear_partition([1], 0)
    with pytest.raises(ValueError, match=">= 0"):
        linear_partition([1, -1], 1)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.integers(0, 5), st.lists(st.integers(1, 30), min_size=1, max_size=5),
                    min_size=1, max_size=4),
    st.integers(1, 6),
)  # fmt: skip
def test_balanced_micro_batches_partition_every_row_once(rows, k):
    bins = balanced_micro_batches(rows, k)
    assert len(bins) == k
    seen = {s: [] for s in rows}
    for part in bins:
        assert list(part) == sorted(part)
        for slot, (offset, count) in part.items():
            assert count >= 1
            seen[slot].extend(range(offset, offset + count))
    assert seen == {s: list(range(len(r))) for s, r in rows.items()}
    total = sum(map(sum, rows.values()))
    assert sum(bin_tokens(rows, p) for p in bins) == total
    longest = max(max(r) for r in rows.values())
    assert max(bin_tokens(rows, p) for p in bins) <= total / k + longest


def test_balanced_micro_batches_mix_adapters():
    rows = {0: [4, 4, 4], 2: [2, 2, 2, 2, 2, 2]}  # 12 + 12 tokens in 2 bins
    assert balanced_micro_batches(rows, 2) == [{0: (0, 3)}, {2: (0, 6)}]
    assert balanced_micro_batches(rows, 3) == [{0: (0, 2)}, {0: (2, 1), 2: (0, 2)}, {2: (2, 4)}]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=3, world_size=3), "tp=3 must be a power of two"),
        (dict(fsdp=0), "fsdp=0 must be a positive integer"),
        (dict(tp=2, fsdp=2, world_size=2), "!= world_size=2"),
        (dict(pp=True), "pp=True"),
    ],
)
def test_parallel_dims_names_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_parallel_dims_layout():
    dims = ParallelDims(pp=2, fsdp=2, tp=2, world_size=8)
    assert dims.enabled == ("pp", "fsdp", "tp")
    assert dims.coords(5) == {"pp": 1, "fsdp": 0, "tp": 1}
    assert ParallelDims.for_job(4, "fsdp") == ParallelDims(fsdp=4, world_size=4)
    assert ParallelDims.for_job(1, None).enabled == ()
    assert ParallelDims().build_mesh("cpu") is None
    with pytest.raises(ValueError, match="d=2 needs a strategy"):
        ParallelDims.for_job(2, None)


@pytest.mark.parametrize(
    ("rows", "pp", "fsdp", "max_rows", "expected"),
    [
        (16, 2, 1, None, 4),  # 2·pp: the bubble the cost model books, 4 rows each
        (16, 4, 1, None, 8),
        (3, 2, 1, None, 3),  # fewer rows than 2·pp: one each
        (1, 2, 1, None, 2),  # fewer than pp: 1F1B still needs pp (the empty one idles)
        (16, 2, 2, None, 4),  # each FSDP rank's 8 rows
        (16, 2, 1, 2, 8),  # max_rows caps the rows per micro-batch
    ],
)
def test_pipeline_micro_batches(rows, pp, fsdp, max_rows, expected) -> None:
    from plora.parallel.trainer import pipeline_micro_batches

    assert pipeline_micro_batches(rows, pp=pp, fsdp=fsdp, max_rows=max_rows) == expected
