"""Tests of ``lrmoe.ops.source_shares`` (expert parallelism: each expert's global quota
split over the source ranks by largest remainder) and of its use in
``lrmoe.parallel.source_shares``.

The reference is plain Python with exact rationals (``fractions.Fraction``) and a sort,
written from the docstring's definition, never from the C++.
"""
from __future__ import annotations

import random
from fractions import Fraction
from typing import List

import pytest
import torch

from lrmoe import ops
from lrmoe.parallel import source_shares as parallel_source_shares


def ref_split(n_W: List[int], quota: int) -> List[int]:
    """floor(Q n_s / N) plus one for the largest fractional parts, ties to the lower rank."""
    total = sum(n_W)
    if total == 0:
        assert quota == 0
        return [0] * len(n_W)
    ideal = [Fraction(quota * n, total) for n in n_W]
    base = [int(v) for v in ideal]
    order = sorted(range(len(n_W)), key=lambda s: (-(ideal[s] - base[s]), s))
    for s in order[: quota - sum(base)]:
        base[s] += 1
    return base


def ref_shares(counts: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    w, e = counts.shape
    out = torch.zeros(w, e, dtype=torch.int32)
    for j in range(e):
        col = ref_split([int(v) for v in counts[:, j]], int(quota[j]))
        out[:, j] = torch.tensor(col, dtype=torch.int32)
    return out


def random_case(rng: random.Random, w: int, e: int):
    hi = rng.choice([3, 40, 2_000_000])
    counts = torch.tensor([[0 if rng.random() < 0.3 else rng.randint(0, hi) for _ in range(e)]
                           for _ in range(w)], dtype=torch.int32).view(w, e)
    if e > 1:
        counts[:, rng.randrange(e)] = 0  # an expert with no pairs at all
    totals = counts.long().sum(0).tolist()
    quota = []
    for n in totals:
        pick = rng.randrange(4)
        quota.append(0 if pick == 0 else n if pick == 1 else rng.randint(0, n))
    return counts, torch.tensor(quota, dtype=torch.int32)


def test_hand_examples():
    got = ops.source_shares(torch.tensor([[3, 2], [1, 2]], dtype=torch.int32),
                            torch.tensor([2, 1], dtype=torch.int32))
    # expert 0: ideal 1.5, 0.5 (tie -> rank 0); expert 1: 0.5, 0.5 (tie -> rank 0)
    assert got.tolist() == [[2, 1], [0, 0]]
    got = ops.source_shares(torch.tensor([[5], [3], [2]], dtype=torch.int32),
                            torch.tensor([7], dtype=torch.int32))
    assert got.tolist() == [[4], [2], [1]]  # 3.5, 2.1, 1.4


@pytest.mark.parametrize("seed", range(12))
def test_matches_reference(seed):
    rng = random.Random(seed)
    w, e = rng.choice([(1, 1), (1, 7), (2, 3), (4, 8), (5, 13), (8, 1), (16, 5)])
    counts, quota = random_case(rng, w, e)
    got = ops.source_shares(counts, quota)
    assert got.dtype == torch.int32 and got.shape == (w, e)
    torch.testing.assert_close(got, ref_shares(counts, quota), rtol=0, atol=0)
    assert got.long().sum(0).tolist() == quota.tolist()
    assert bool((got >= 0).all()) and bool((got <= counts).all())


def test_quota_zero_and_total():
    counts = torch.randint(0, 50, (6, 4), dtype=torch.int32)
    zero = ops.source_shares(counts, torch.zeros(4, dtype=torch.int32))
    assert zero.tolist() == [[0] * 4] * 6
    full = ops.source_shares(counts, counts.sum(0).to(torch.int32))
    torch.testing.assert_close(full, counts, rtol=0, atol=0)


def test_non_contiguous_and_empty():
    rng = random.Random(5)
    counts, quota = random_case(rng, 6, 5)
    wide = torch.zeros(5, 12, dtype=torch.int32)
    wide[:, ::2] = counts.t()
    counts_nc = wide[:, ::2].t()  # (6, 5), not contiguous
    assert not counts_nc.is_contiguous()
    torch.testing.assert_close(ops.source_shares(counts_nc, quota), ref_shares(counts, quota),
                               rtol=0, atol=0)
    assert ops.source_shares(torch.zeros(3, 0, dtype=torch.int32),
                             torch.zeros(0, dtype=torch.int32)).shape == (3, 0)


def test_parallel_wrapper_keeps_int64():
    rng = random.Random(9)
    counts, quota = random_case(rng, 4, 6)
    got = parallel_source_shares(counts.long(), quota)
    assert got.dtype == torch.int64
    torch.testing.assert_close(got, ref_shares(counts, quota).long(), rtol=0, atol=0)


def test_fake_kernel_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        out = ops.source_shares(torch.empty(3, 5, dtype=torch.int32),
                                torch.empty(5, dtype=torch.int32))
    assert out.shape == (3, 5) and out.dtype == torch.int32


@pytest.mark.parametrize("counts, quota, match", [
    (torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), "counts must be 2-D"),
    (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32),
     "quota must be 1-D"),
    (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
     "counts must be int32"),
    (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(3, dtype=torch.float32),
     "quota must be int32"),
    (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
     "quota must have one entry per expert"),
    (torch.tensor([[1, -1], [2, 3]], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
     r"counts must be >= 0, got -1 at \[0, 1\]"),
    (torch.tensor([[1, 1], [2, 3]], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32),
     r"quota\[1\] must be in \[0, 4\]"),
    (torch.tensor([[1, 1], [2, 3]], dtype=torch.int32), torch.tensor([-1, 0], dtype=torch.int32),
     r"quota\[0\] must be in \[0, 3\]"),
])
def test_bad_inputs(counts, quota, match):
    with pytest.raises(RuntimeError, match=match):
        ops.source_shares(counts, quota)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(6))
def test_cuda_matches_cpu(seed):
    rng = random.Random(100 + seed)
    w, e = rng.choice([(1, 1), (2, 33), (8, 64), (7, 5), (16, 257)])
    counts, quota = random_case(rng, w, e)
    want = ops.source_shares(counts, quota)
    got = ops.source_shares(counts.cuda(), quota.cuda())
    assert got.device.type == "cuda" and got.dtype == torch.int32
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(want, ref_shares(counts, quota), rtol=0, atol=0)
    nc = counts.cuda().t().contiguous().t()  # non-contiguous on the device
    torch.testing.assert_close(ops.source_shares(nc, quota.cuda()).cpu(), want, rtol=0, atol=0)
