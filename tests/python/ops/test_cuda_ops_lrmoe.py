"""CUDA tests of score, quota, select and grouped_mm.

Each CUDA op is compared with the CPU op (itself tested against independent
references in test_ops_lrmoe.py) on fresh random inputs, including empty experts,
ties and production sizes (E = 128, P = 262144); select and quota must match the
CPU bit for bit (same ordering, integer scans and canonical float sums). score,
quota and select run under torch.cuda.set_sync_debug_mode("error") to prove they
never synchronise the host. grouped_mm (bf16) is checked against a float64
per-group reference, including empty groups and group sizes that are not
multiples of 8.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from lrmoe import ops

from _refs import I32, grouped_mm_k_ref, grouped_mm_rows_ref, routing

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"


@contextlib.contextmanager
def no_sync():
    """Any host<->device synchronisation inside raises."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def random_expert_ids(gen, T, K, E, empty=(), skew=False):
    """(T, K) distinct experts per token, none from `empty`, optionally skewed."""
    w = torch.ones(E, dtype=torch.float64)
    if skew:
        w = torch.rand(E, generator=gen, dtype=torch.float64) ** 4 + 1e-3
    w[list(empty)] = 0
    return torch.multinomial(w.expand(T, E), K, replacement=False, generator=gen)


# --------------------------------------------------------------------------- score
@pytest.mark.parametrize("metric", ["lrm", "grad_sq", "grad_abs", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K,H,E", [(4099, 8, 2048, 128), (37, 3, 67, 8), (1, 1, 5, 1)])
def test_score_cuda_matches_cpu(metric, dtype, T, K, H, E):
    gen = torch.Generator().manual_seed(T + K + H + E + len(metric))
    grad_out = torch.randn(T, H, generator=gen).to(dtype)
    weights = torch.rand(T, K, generator=gen).to(dtype)
    phi_sq = torch.rand(T * K, generator=gen) * 10
    row_pair, _, _ = routing(random_expert_ids(gen, T, K, E, skew=True), E)
    cpu = ops.score(grad_out, weights, phi_sq, row_pair, metric, 17)
    args = [x.to(DEV) for x in (grad_out, weights, phi_sq, row_pair)]
    with no_sync():
        out = ops.score(*args, metric, 17)
    if metric == "random":
        assert torch.equal(out.cpu(), cpu)
    else:
        torch.testing.assert_close(out.cpu(), cpu, rtol=1e-5, atol=0)


def test_score_cuda_non_contiguous_and_unaligned():
    gen = torch.Generator().manual_seed(9)
    T, K, H, E = 300, 4, 96, 16
    base = torch.randn(T, H + 1, generator=gen).to(DEV)
    grad_out = base[:, 1:]  # rows not 16-byte aligned: the scalar-load path after .contiguous()
    weights = torch.rand(K, T, generator=gen).to(DEV).t()
    phi_sq = torch.rand(T * K, generator=gen).to(DEV)
    row_pair, _, _ = routing(random_expert_ids(gen, T, K, E), E)
    out = ops.score(grad_out, weights, phi_sq, row_pair.to(DEV), "lrm")
    cpu = ops.score(grad_out.cpu(), weights.cpu(), phi_sq.cpu(), row_pair, "lrm")
    torch.testing.assert_close(out.cpu(), cpu, rtol=1e-5, atol=0)



@pytest.mark.parametrize("metric", ["lrm", "grad_abs"])
def test_score_cuda_contiguous_but_misaligned_grad_out(metric):
    # .contiguous() keeps a contiguous view whose base is off 16 bytes: the token-norm
    # kernel must take its scalar path (an 8-element bf16 vector load would fault).
    gen = torch.Generator().manual_seed(10)
    T, K, H, E = 129, 3, 64, 8
    flat = torch.randn(T * H + 1, generator=gen).to(torch.bfloat16).to(DEV)
    grad_out = flat[1:].view(T, H)
    assert grad_out.is_contiguous() and grad_out.data_ptr() % 16 != 0
    weights = torch.rand(T, K, generator=gen).to(DEV)
    phi_sq = torch.rand(T * K, generator=gen).to(DEV)
    row_pair, _, _ = routing(random_expert_ids(gen, T, K, E), E)
    out = ops.score(grad_out, weights, phi_sq, row_pair.to(DEV), metric)
    cpu = ops.score(grad_out.cpu(), weights.cpu(), phi_sq.cpu(), row_pair, metric)
    torch.testing.assert_close(out.cpu(), cpu, rtol=1e-5, atol=0)


def test_score_cuda_float8_grad_out_names_the_argument():
    gen = torch.Generator().manual_seed(43)
    T, K, H = 5, 2, 16
    g8 = torch.randn(T, H, generator=gen).to(torch.float8_e4m3fn).to(DEV)
    w, phi = torch.rand(T, K, generator=gen).to(DEV), torch.rand(T * K, generator=gen).to(DEV)
    rp = torch.randperm(T * K, generator=gen).to(I32).to(DEV)
    with pytest.raises(RuntimeError, match="grad_out must be float32, bfloat16, float16 or float64"):
        ops.score(g8, w, phi, rp, "lrm")

# --------------------------------------------------------------------------- quota
@pytest.mark.parametrize("rule", ["proportional", "water_level"])
def test_quota_cuda_matches_cpu(rule):
    gen = torch.Generator().manual_seed(3)
    for E in (1, 3, 64, 128, 1000):
        for c in (0.0, 0.1, 0.25, 0.3, 1 / 3, 0.5, 0.9, 0.999):
            n = torch.randint(0, 5000, (E,), generator=gen, dtype=I32)
            n[torch.rand(E, generator=gen) < 0.2] = 0
            n_dev = n.to(DEV)
            with no_sync():
                q = ops.quota(n_dev, c, rule)
            assert q.device.type == "cuda" and q.dtype == I32
            assert torch.equal(q.cpu(), ops.quota(n, c, rule)), (E, c)


def test_quota_cuda_bad_inputs():
    n = torch.tensor([4, 2, 3], dtype=I32, device=DEV)
    with pytest.raises(RuntimeError, match="recalibration_rate"):
        ops.quota(n, 1.0)
    with pytest.raises(RuntimeError, match="recalibration_rate"):
        ops.quota(n, -0.1)
    with pytest.raises(RuntimeError, match="rule"):
        ops.quota(n, 0.1, "flat")
    with pytest.raises(RuntimeError, match="tokens_per_expert"):
        ops.quota(n.long(), 0.1)


# --------------------------------------------------------------------------- select
def select_case(gen, T, K, E, c, ties, empty=(), skew=False, rule="proportional"):
    row_pair, counts, offsets = routing(random_expert_ids(gen, T, K, E, empty, skew), E)
    P = T * K
    if ties == "int":
        score = torch.randint(0, 6, (P,), generator=gen).float()
    elif ties == "nan":
        score = torch.rand(P, generator=gen)
        score[torch.rand(P, generator=gen) < 0.01] = float("nan")
        score[torch.rand(P, generator=gen) < 0.05] = 0.0
    else:
        score = torch.rand(P, generator=gen) * torch.rand(P, generator=gen)
    quota = ops.quota(counts, c, rule)
    return score, row_pair, offsets, quota, int(quota.sum())


CASES = [
    # T, K, E, c, ties, empty, skew
    (32768, 8, 128, 0.3, None, (3, 77), True),     # P = 262144, the paper's per-GPU size
    (32768, 8, 128, 0.2, "int", (0,), True),
    (32768, 8, 128, 0.1, "nan", (), False),
    (37, 3, 8, 0.3, "int", (2,), False),
    (1, 1, 1, 0.5, None, (), False),
    (1000, 4, 4, 0.9, None, (), True),
    (513, 16, 16, 1 / 3, "int", (), False),        # top_k = E
    (5000, 1, 1, 0.25, "int", (), False),           # everything on one expert
    (32768, 8, 128, 0.0, "nan", (3, 77), True),     # c = 0: R = P, the keep-all pass
    (37, 3, 8, 0.0, "int", (2,), False),
]


@pytest.mark.parametrize("selection", ["topk", "importance"])
@pytest.mark.parametrize("T,K,E,c,ties,empty,skew", CASES)
def test_select_cuda_matches_cpu(selection, T, K, E, c, ties, empty, skew):
    gen = torch.Generator().manual_seed(T + 7 * K + E + int(100 * c))
    score, row_pair, offsets, quota, R = select_case(gen, T, K, E, c, ties, empty, skew)
    cpu = ops.select(score, row_pair, offsets, quota, R, selection, 42)
    args = [x.to(DEV) for x in (score, row_pair, offsets, quota)]
    with no_sync():
        out = ops.select(*args, R, selection, 42)
    names = ["kept_rows", "kept_pair", "pair_kept", "kept_offsets", "kept_scale"]
    for name, a, b in zip(names, out[:5], cpu[:5]):
        assert a.device.type == "cuda"
        assert torch.equal(a.cpu(), b), name
    torch.testing.assert_close(out[5].cpu(), cpu[5], rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("selection", ["topk", "importance"])
def test_select_cuda_c0_identity_and_seeds(selection):
    gen = torch.Generator().manual_seed(21)
    score, row_pair, offsets, quota, R = select_case(gen, 4096, 8, 128, 0.0, None, (5,), True)
    args = [x.to(DEV) for x in (score, row_pair, offsets, quota)]
    out = ops.select(*args, R, selection, 3)
    assert torch.equal(out[0].cpu(), torch.arange(R, dtype=I32))
    assert torch.equal(out[4].cpu(), torch.ones(R))
    if selection == "importance":
        score, row_pair, offsets, quota, R = select_case(gen, 4096, 8, 128, 0.5, None, (), True)
        args = [x.to(DEV) for x in (score, row_pair, offsets, quota)]
        for seed in (0, 1, 2**40 + 5):
            out = ops.select(*args, R, selection, seed)
            cpu = ops.select(score, row_pair, offsets, quota, R, selection, seed)
            assert torch.equal(out[0].cpu(), cpu[0]) and torch.equal(out[4].cpu(), cpu[4])


@pytest.mark.parametrize("selection", ["topk", "importance"])
@pytest.mark.parametrize("ties", [None, "nan"])
def test_select_cuda_keep_all_and_retained_mass_against_float64(selection, ties):
    """R = P (c = 0) keeps every row in row order with scale 1 (hand-derived: the inverse
    permutation by argsort), and the retained mass at c = 0 and c = 0.3 is the float64
    ratio sum(kept scores) / sum(scores) -- P = 262144 with empty experts, and tiny P."""
    for T, K, E, empty in ((32768, 8, 128, (3, 77)), (5, 2, 4, (1,))):
        gen = torch.Generator().manual_seed(T + E)
        for c in (0.0, 0.3):
            score, row_pair, offsets, quota, R = select_case(gen, T, K, E, c, ties, empty,
                                                             True)
            args = [x.to(DEV) for x in (score, row_pair, offsets, quota)]
            with no_sync():  # the op itself; the copies to the host below do sync
                out = ops.select(*args, R, selection, 5)
            out = [t.cpu() for t in out]
            kept_rows, kept_pair, pair_kept, kept_offsets, kept_scale, mass = out
            if c == 0.0:
                assert R == T * K
                assert torch.equal(kept_rows, torch.arange(R, dtype=I32))
                assert torch.equal(kept_pair, row_pair)
                assert torch.equal(pair_kept, torch.argsort(row_pair.long()).to(I32))
                assert torch.equal(kept_offsets, offsets)
                assert torch.equal(kept_scale, torch.ones(R))
            s64 = score.double()
            ref = s64[kept_rows.long()].sum() / s64.sum()
            if torch.isnan(score).any():  # NaN propagates
                assert torch.isnan(mass), (T, c)
            else:
                assert abs(float(mass) - float(ref)) <= 2e-7 * float(ref), (T, c)


def test_select_cuda_deterministic():
    gen = torch.Generator().manual_seed(22)
    score, row_pair, offsets, quota, R = select_case(gen, 32768, 8, 128, 0.3, "int", (), True)
    args = [x.to(DEV) for x in (score, row_pair, offsets, quota)]
    for selection in ("topk", "importance"):
        a = ops.select(*args, R, selection, 9)
        b = ops.select(*args, R, selection, 9)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# --------------------------------------------------------------------------- grouped_mm
def bf16_close(out, ref):
    # bf16 inputs are exact in the reference; the error is the bf16 rounding of the output
    # (2^-9 relative) plus fp32 accumulation, tiny next to the largest entry
    atol = 1e-3 * (ref.abs().max().item() + 1.0)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-2, atol=atol)


@pytest.mark.parametrize("sizes", [[5, 0, 17, 0, 15], [128] * 8, [0, 0, 300, 1, 7, 0, 33, 100]])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_grouped_mm_rows_cuda_bf16(sizes, transpose_b):
    gen = torch.Generator().manual_seed(sum(sizes) + int(transpose_b))
    K, N = 256, 384
    M = sum(sizes)
    E = len(sizes)
    offsets = torch.tensor(sizes).cumsum(0).to(I32).to(DEV)
    a = torch.randn(M, K, generator=gen).bfloat16().to(DEV)
    if transpose_b:
        b = torch.randn(E, N, K, generator=gen).bfloat16().to(DEV).transpose(1, 2)
    else:
        b = torch.randn(E, K, N, generator=gen).bfloat16().to(DEV)
    with no_sync():  # aligned bf16 on sm90: the fused kernel, no host sync
        out = ops.grouped_mm(a, b, offsets)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    bf16_close(out, grouped_mm_rows_ref(a, b, offsets.cpu()))


@pytest.mark.parametrize("sizes", [[5, 0, 17, 0, 15], [64] * 4, [0, 300, 1, 7, 0, 33]])
def test_grouped_mm_k_groups_cuda_bf16(sizes):
    gen = torch.Generator().manual_seed(sum(sizes) + 1)
    M, N = 256, 128
    Ktot = sum(sizes)
    offsets = torch.tensor(sizes).cumsum(0).to(I32).to(DEV)
    a = torch.randn(Ktot, M, generator=gen).bfloat16().to(DEV).t()  # x^T: dW = x^T g
    b = torch.randn(Ktot, N, generator=gen).bfloat16().to(DEV)
    with no_sync():
        out = ops.grouped_mm(a, b, offsets)
    assert out.shape == (len(sizes), M, N)
    ref = grouped_mm_k_ref(a, b, offsets.cpu())
    bf16_close(out, ref)
    for e, s in enumerate(sizes):
        if s == 0:
            assert bool((out[e] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_cuda_loop_path(dtype):
    # unaligned shapes (K, N not multiples of 8) and fp32 take the per-group loop
    gen = torch.Generator().manual_seed(8)
    sizes = [3, 0, 10, 4]
    M, K, N = sum(sizes), 13, 7
    offsets = torch.tensor(sizes).cumsum(0).to(I32).to(DEV)
    a = torch.randn(M, K, generator=gen).to(dtype).to(DEV)
    b = torch.randn(len(sizes), K, N, generator=gen).to(dtype).to(DEV)
    out = ops.grouped_mm(a, b, offsets)
    ref = grouped_mm_rows_ref(a, b, offsets.cpu())
    if dtype == torch.float32:
        torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-4, atol=1e-4)
    else:
        bf16_close(out, ref)
    cpu = ops.grouped_mm(a.cpu(), b.cpu(), offsets.cpu())
    assert out.stride() == cpu.stride()
