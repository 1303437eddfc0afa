"""CPU tests of the data-movement ops: permute, gather_rows, combine,
routing_weight_grad, swiglu, swiglu_backward.

Every op is compared with an independent plain-PyTorch float64 reference (or a
brute-force Python loop for the integer permutation), on fresh random data per
case. Legend: T tokens, K top_k, P = T*K pairs, E experts, N rows, H / C columns,
I expert intermediate size.
"""
from __future__ import annotations

import pytest
import torch

from lrmoe import ops

from _refs import EPS, FLOATS, TINY, case_gen, randn


# ----------------------------------------------------------------------------------
# permute
# ----------------------------------------------------------------------------------
def _ref_permute(ids_TK: torch.Tensor, E: int):
    """Brute force: walk pairs in order, appending each to its expert's list."""
    flat = ids_TK.reshape(-1).tolist()
    per_expert = [[] for _ in range(E)]
    for p, e in enumerate(flat):
        per_expert[e].append(p)
    row_pair = [p for lst in per_expert for p in lst]
    pair_row = [0] * len(flat)
    for r, p in enumerate(row_pair):
        pair_row[p] = r
    counts = [len(lst) for lst in per_expert]
    ends, acc = [], 0
    for c in counts:
        acc += c
        ends.append(acc)
    i32 = dict(dtype=torch.int32)
    return (torch.tensor(row_pair, **i32), torch.tensor(pair_row, **i32),
            torch.tensor(counts, **i32), torch.tensor(ends, **i32))


def _permute_case(kind: str, g: torch.Generator):
    """(expert_ids (T, K) int64, E) for a named routing pattern."""
    if kind == "random":
        T, K, E = 64, 4, 8
        return torch.randint(0, E, (T, K), generator=g), E
    if kind == "zero_token_experts":  # experts 0, 3 and E-1 receive nothing
        T, K, E = 50, 2, 9
        allowed = torch.tensor([1, 2, 4, 5, 6, 7])
        return allowed[torch.randint(0, len(allowed), (T, K), generator=g)], E
    if kind == "all_one_expert":
        T, K, E = 31, 3, 6
        return torch.full((T, K), 4, dtype=torch.int64), E
    if kind == "single_token":
        E = 7
        return torch.randperm(E, generator=g)[:3].reshape(1, 3), E
    if kind == "top_k_equals_E":
        T, E = 11, 5
        return torch.stack([torch.randperm(E, generator=g) for _ in range(T)]), E
    if kind == "odd_37x3":
        T, K, E = 37, 3, 5
        return torch.randint(0, E, (T, K), generator=g), E
    if kind == "one_expert":
        return torch.zeros(13, 2, dtype=torch.int64), 1
    if kind == "no_tokens":
        return torch.zeros(0, 4, dtype=torch.int64), 6
    if kind == "many_experts_skewed":
        T, K, E = 300, 8, 1000
        hot = torch.randint(0, 16, (T, K), generator=g)
        cold = torch.randint(0, E, (T, K), generator=g)
        pick = torch.rand((T, K), generator=g) < 0.7
        return torch.where(pick, hot, cold), E
    raise AssertionError(kind)


PERMUTE_KINDS = ["random", "zero_token_experts", "all_one_expert", "single_token",
                 "top_k_equals_E", "odd_37x3", "one_expert", "no_tokens",
                 "many_experts_skewed"]


@pytest.mark.parametrize("kind", PERMUTE_KINDS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_permute_matches_bruteforce(kind, id_dtype):
    ids, E = _permute_case(kind, case_gen("permute", kind, id_dtype))
    ids = ids.to(id_dtype)
    got = ops.permute(ids, E)
    want = _ref_permute(ids, E)
    for name, a, b in zip(("row_pair", "pair_row", "tokens_per_expert", "offsets"), got, want):
        assert a.dtype == torch.int32, name
        assert torch.equal(a, b), f"{name}: {a} != {b}"
    # consistency a user relies on: rows sorted by expert, inverse permutation
    row_pair, pair_row, n_E, offs_E = got
    flat = ids.reshape(-1).long()
    if flat.numel():
        assert torch.all(flat[row_pair.long()].diff() >= 0)
        assert torch.equal(row_pair[pair_row.long()], torch.arange(flat.numel(), dtype=torch.int32))
    assert torch.equal(n_E.long(), torch.bincount(flat, minlength=E))


def test_permute_noncontiguous_ids():
    g = case_gen("permute_nc")
    E = 6
    ids_KT = torch.randint(0, E, (3, 29), generator=g, dtype=torch.int32)
    ids_TK = ids_KT.t()  # (T, K) view with strides (1, T)
    assert not ids_TK.is_contiguous()
    got = ops.permute(ids_TK, E)
    want = _ref_permute(ids_TK.contiguous(), E)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_permute_bad_inputs():
    ids = torch.randint(0, 4, (5, 2))
    with pytest.raises(RuntimeError, match="expert_ids must be int32 or int64"):
        ops.permute(ids.float(), 4)
    with pytest.raises(RuntimeError, match="expert_ids must be 2-D"):
        ops.permute(ids.reshape(-1), 4)
    with pytest.raises(RuntimeError, match="num_experts must be >= 1"):
        ops.permute(ids, 0)
    bad = ids.clone()
    bad[3, 1] = 4
    with pytest.raises(RuntimeError, match="expert_ids holds 4 at flat position 7"):
        ops.permute(bad, 4)
    bad[3, 1] = -1
    with pytest.raises(RuntimeError, match="expert_ids holds -1"):
        ops.permute(bad, 4)


# ----------------------------------------------------------------------------------
# gather_rows
# ----------------------------------------------------------------------------------
def _ref_gather(src, index, scale, divisor):
    out = src.double()[index.long() // divisor]
    if scale is not None:
        out = out * scale.double()[:, None]
    return out


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("divisor", [1, 3])
@pytest.mark.parametrize("C", [64, 37, 1])
def test_gather_rows(dtype, with_scale, divisor, C):
    g = case_gen("gather", dtype, with_scale, divisor, C)
    N, R = 23, 41
    src = randn((N, C), dtype, g)
    index = torch.randint(0, N * divisor, (R,), generator=g, dtype=torch.int32)
    scale = (torch.rand(R, generator=g) + 0.5) if with_scale else None
    out = ops.gather_rows(src, index, scale, divisor)
    assert out.dtype == dtype and out.shape == (R, C) and out.is_contiguous()
    want = _ref_gather(src, index, scale, divisor)
    if scale is None:
        assert torch.equal(out, want.to(dtype))  # a pure copy must be exact
    else:
        # one rounding of the fp32 product, then one to dtype
        tol = 2 * (EPS[dtype] + EPS[torch.float32])
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=0)


def test_gather_rows_noncontiguous_and_empty():
    g = case_gen("gather_nc")
    big = randn((40, 30), torch.bfloat16, g)
    src = big.t()[:, ::2]  # (30, 20) with strides (1, 60)
    idx_big = torch.randint(0, 30, (50,), generator=g, dtype=torch.int32)
    index = idx_big[::2]
    scale = (torch.rand(50, generator=g) + 0.5)[::2]
    assert not (src.is_contiguous() or index.is_contiguous() or scale.is_contiguous())
    out = ops.gather_rows(src, index, scale, 1)
    torch.testing.assert_close(out.double(), _ref_gather(src, index, scale, 1),
                               rtol=2 * (EPS[torch.bfloat16] + EPS[torch.float32]), atol=0)
    empty = ops.gather_rows(src, torch.zeros(0, dtype=torch.int32), None, 1)
    assert empty.shape == (0, 20)


def test_gather_rows_bad_inputs():
    src = torch.randn(6, 4)
    idx = torch.tensor([0, 5, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="index must be int32"):
        ops.gather_rows(src, idx.float(), None, 1)
    with pytest.raises(RuntimeError, match="index must be int32"):
        ops.gather_rows(src, idx.long(), None, 1)
    with pytest.raises(RuntimeError, match="index must be 1-D"):
        ops.gather_rows(src, idx.reshape(3, 1), None, 1)
    with pytest.raises(RuntimeError, match="src must be 2-D"):
        ops.gather_rows(src.reshape(-1), idx, None, 1)
    with pytest.raises(RuntimeError, match="src must be float32, bfloat16"):
        ops.gather_rows(src.int(), idx, None, 1)
    with pytest.raises(RuntimeError, match="divisor must be >= 1"):
        ops.gather_rows(src, idx, None, 0)
    with pytest.raises(RuntimeError, match=r"index\[1\] = 6 maps to source row 6"):
        ops.gather_rows(src, torch.tensor([0, 6], dtype=torch.int32), None, 1)
    with pytest.raises(RuntimeError, match=r"index\[0\] = 12 maps to source row 6"):
        ops.gather_rows(src, torch.tensor([12], dtype=torch.int32), None, 2)
    with pytest.raises(RuntimeError, match=r"index\[0\] = -1"):
        ops.gather_rows(src, torch.tensor([-1], dtype=torch.int32), None, 1)
    with pytest.raises(RuntimeError, match="scale must be float32"):
        ops.gather_rows(src, idx, torch.ones(3, dtype=torch.float64), 1)
    with pytest.raises(RuntimeError, match="scale has 2 entries but index has 3"):
        ops.gather_rows(src, idx, torch.ones(2), 1)


# ----------------------------------------------------------------------------------
# dispatch_rows (the scatter form of gather_rows)
# ----------------------------------------------------------------------------------
def _kept_slots(g, T, K, R):
    """A random kept subset of R of the T*K pairs in random slot order: (kept_pair (R,),
    slot (P,) with slot[kept_pair[r]] = r and -1 elsewhere), both int32."""
    kept_pair = torch.randperm(T * K, generator=g)[:R]
    slot = torch.full((T * K,), -1, dtype=torch.int32)
    slot[kept_pair] = torch.arange(R, dtype=torch.int32)
    return kept_pair.to(torch.int32), slot


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("T,K,C,R", [(37, 3, 19, 80), (16, 4, 64, 64), (5, 1, 8, 0)])
def test_dispatch_rows_is_the_inverse_gather(dtype, with_scale, T, K, C, R):
    g = case_gen("dispatch", dtype, with_scale, T, K, C, R)
    src = randn((T, C), dtype, g)
    kept_pair, slot = _kept_slots(g, T, K, R)
    scale = (torch.rand(R, generator=g) + 0.5) if with_scale else None
    out = ops.dispatch_rows(src, slot, scale, R, K)
    assert out.dtype == dtype and out.shape == (R, C) and out.is_contiguous()
    want = _ref_gather(src, kept_pair, scale, K)
    if scale is None:
        assert torch.equal(out, want.to(dtype))
    else:
        tol = 2 * (EPS[dtype] + EPS[torch.float32])
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=0)
    # bit for bit the gather it replaces in lrmoe/moe/experts.py
    assert torch.equal(out, ops.gather_rows(src, kept_pair, scale, K))


def test_dispatch_rows_bad_inputs():
    src = torch.randn(3, 4)
    slot = torch.tensor([0, -1, 2, 1, -1, -1], dtype=torch.int32)  # T = 3, K = 2, R = 3
    assert ops.dispatch_rows(src, slot, None, 3, 2).shape == (3, 4)
    with pytest.raises(RuntimeError, match="slot has 6 entries but src has 3 rows and top_k = 3"):
        ops.dispatch_rows(src, slot, None, 3, 3)
    with pytest.raises(RuntimeError, match="slot must be int32"):
        ops.dispatch_rows(src, slot.long(), None, 3, 2)
    with pytest.raises(RuntimeError, match=r"slot\[2\] = 2 is outside \[-1, num_rows = 2\)"):
        ops.dispatch_rows(src, slot, None, 2, 2)
    with pytest.raises(RuntimeError, match=r"slot\[0\] and slot\[3\] both name row 0"):
        ops.dispatch_rows(src, torch.tensor([0, -1, 2, 0, -1, 1], dtype=torch.int32), None,
                          3, 2)
    with pytest.raises(RuntimeError, match="no pair names output row 3 of num_rows = 4"):
        ops.dispatch_rows(src, slot, None, 4, 2)
    with pytest.raises(RuntimeError, match="scale has 2 entries but num_rows is 3"):
        ops.dispatch_rows(src, slot, torch.ones(2), 3, 2)
    with pytest.raises(RuntimeError, match="top_k must be >= 1"):
        ops.dispatch_rows(src, slot, None, 3, 0)

# ----------------------------------------------------------------------------------
# combine
# ----------------------------------------------------------------------------------
def _ref_combine(y, pair_row, weights, K):
    T = pair_row.numel() // K
    out = torch.zeros(T, y.shape[1], dtype=torch.float64)
    rows = pair_row.reshape(T, K).long()
    w = weights.double() if weights is not None else torch.ones(T, K, dtype=torch.float64)
    for k in range(K):
        r = rows[:, k]
        keep = r >= 0
        out[keep] += w[keep, k, None] * y.double()[r[keep]]
    return out


def _combine_tol(dtype, K):
    # fp32 accumulation of K terms (each product and sum rounded) + the final rounding
    return EPS[dtype] + 2 * K * EPS[torch.float32]


def _routing(g, T, K, N, drop_frac=0.0):
    """pair_row (P,) int32 over N rows, a random subset set to -1 (dropped)."""
    pair_row = torch.randperm(N, generator=g)[: T * K].to(torch.int32)
    if drop_frac:
        pair_row[torch.rand(T * K, generator=g) < drop_frac] = -1
    return pair_row


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,K,H", [(37, 3, 64), (1, 4, 24), (16, 8, 5), (20, 1, 40)])
@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_combine(dtype, T, K, H, with_weights, drop):
    g = case_gen("combine", dtype, T, K, H, with_weights, drop)
    N = T * K + 5
    y = randn((N, H), dtype, g)
    pair_row = _routing(g, T, K, N, drop)
    weights = torch.rand(T, K, generator=g) if with_weights else None
    out = ops.combine(y, pair_row, weights, K)
    assert out.dtype == dtype and out.shape == (T, H)
    want = _ref_combine(y, pair_row, weights, K)
    scale = _ref_combine(y.abs(), pair_row, weights.abs() if weights is not None else None, K)
    err = (out.double() - want).abs()
    assert torch.all(err <= _combine_tol(dtype, K) * scale + TINY[dtype]), err.max()


def test_combine_all_dropped_token_is_zero():
    g = case_gen("combine_zero")
    y = randn((6, 8), torch.float32, g)
    pair_row = torch.tensor([0, 1, -1, -1, 2, 3], dtype=torch.int32)
    out = ops.combine(y, pair_row, torch.rand(3, 2, generator=g), 2)
    assert torch.equal(out[1], torch.zeros(8))


def test_combine_noncontiguous():
    g = case_gen("combine_nc")
    T, K, H = 37, 3, 48
    N = T * K
    y = randn((H, 2 * N), torch.bfloat16, g).t()[::2]  # (N, H), strides (2, 2N)
    pr_big = _routing(g, 2 * T, K, 2 * N)
    pair_row = pr_big[::2]
    weights = torch.rand(K, T, generator=g).t()
    assert not (y.is_contiguous() or pair_row.is_contiguous() or weights.is_contiguous())
    pair_row = pair_row.clone()
    pair_row[pair_row >= N] = -1  # the strided slice may point past N
    out = ops.combine(y, pair_row, weights, K)
    want = _ref_combine(y, pair_row, weights, K)
    scale = _ref_combine(y.abs(), pair_row, weights, K)
    assert torch.all((out.double() - want).abs() <= _combine_tol(torch.bfloat16, K) * scale)


def test_permute_gather_combine_roundtrip():
    """Dispatch x to expert order and combine back with weights 1/K: x again."""
    g = case_gen("roundtrip")
    T, K, E, H = 37, 3, 5, 16
    x = randn((T, H), torch.float64, g)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[:, 0] = 2  # make sure some expert has several
    row_pair, pair_row, n_E, offs_E = ops.permute(ids, E)
    x_sorted = ops.gather_rows(x, row_pair, None, K)
    assert torch.equal(x_sorted, x[row_pair.long() // K])
    back = ops.combine(x_sorted, pair_row, torch.full((T, K), 1.0 / K), K)
    torch.testing.assert_close(back, x, rtol=1e-7, atol=0)


def test_combine_bad_inputs():
    y = torch.randn(6, 4)
    pr = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"top_k \(4\) must divide pair_row.numel\(\) \(6\)"):
        ops.combine(y, pr, None, 4)
    with pytest.raises(RuntimeError, match="top_k must be >= 1"):
        ops.combine(y, pr, None, 0)
    with pytest.raises(RuntimeError, match="pair_row must be int32"):
        ops.combine(y, pr.float(), None, 2)
    with pytest.raises(RuntimeError, match="pair_row must be 1-D"):
        ops.combine(y, pr.reshape(3, 2), None, 2)
    with pytest.raises(RuntimeError, match="y must be 2-D"):
        ops.combine(y.reshape(-1), pr, None, 2)
    with pytest.raises(RuntimeError, match=r"pair_row\[2\] = 6 is outside \[-1, 6\)"):
        ops.combine(y, torch.tensor([0, 1, 6, 3], dtype=torch.int32), None, 2)
    with pytest.raises(RuntimeError, match=r"pair_row\[0\] = -2"):
        ops.combine(y, torch.tensor([-2, 1], dtype=torch.int32), None, 2)
    with pytest.raises(RuntimeError, match=r"weights must have shape \(T, K\) = \(3, 2\)"):
        ops.combine(y, pr, torch.ones(2, 3), 2)
    with pytest.raises(RuntimeError, match="weights must be float32, bfloat16"):
        ops.combine(y, pr, torch.ones(3, 2, dtype=torch.int32), 2)


# ----------------------------------------------------------------------------------
# routing_weight_grad
# ----------------------------------------------------------------------------------
def _ref_rwg(grad_out, y, pair_row, K):
    T = pair_row.numel() // K
    rows = pair_row.long()
    keep = rows >= 0
    out = torch.zeros(T * K, dtype=torch.float64)
    t = torch.arange(T * K) // K
    out[keep] = (grad_out.double()[t[keep]] * y.double()[rows[keep]]).sum(1)
    abs_dot = torch.zeros(T * K, dtype=torch.float64)
    abs_dot[keep] = (grad_out.double()[t[keep]] * y.double()[rows[keep]]).abs().sum(1)
    return out.reshape(T, K), abs_dot.reshape(T, K)


def _rwg_tol(dtype, H):
    # sequential fp32 (fp64) accumulation of H products, relative to sum |g*y|,
    # plus the final rounding to fp32
    acc = EPS[torch.float64] if dtype == torch.float64 else EPS[torch.float32]
    return (H + 2) * acc + EPS[torch.float32]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,K,H", [(37, 3, 64), (1, 5, 33), (12, 8, 256)])
def test_routing_weight_grad(dtype, T, K, H):
    g = case_gen("rwg", dtype, T, K, H)
    N = T * K + 3
    grad_out = randn((T, H), dtype, g)
    y = randn((N, H), dtype, g)
    pair_row = _routing(g, T, K, N, 0.25)
    out = ops.routing_weight_grad(grad_out, y, pair_row, K)
    assert out.dtype == torch.float32 and out.shape == (T, K)
    want, abs_dot = _ref_rwg(grad_out, y, pair_row, K)
    assert torch.all((out.double() - want).abs() <= _rwg_tol(dtype, H) * abs_dot + 1e-30)
    assert torch.all(out.reshape(-1)[pair_row < 0] == 0)


def test_routing_weight_grad_noncontiguous():
    g = case_gen("rwg_nc")
    T, K, H = 37, 3, 40
    N = T * K
    grad_out = randn((H, T), torch.bfloat16, g).t()
    y = randn((N, 2 * H), torch.bfloat16, g)[:, 1::2]
    pair_row = _routing(g, 2 * T, K, 2 * N)[::2].clone()
    pair_row[pair_row >= N] = -1
    out = ops.routing_weight_grad(grad_out, y, pair_row, K)
    want, abs_dot = _ref_rwg(grad_out, y, pair_row, K)
    assert torch.all((out.double() - want).abs() <= _rwg_tol(torch.bfloat16, H) * abs_dot + 1e-30)


def test_routing_weight_grad_bad_inputs():
    g = torch.randn(3, 4)
    y = torch.randn(6, 4)
    pr = torch.arange(6, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="y has dtype BFloat16 but grad_out has Float"):
        ops.routing_weight_grad(g, y.bfloat16(), pr, 2)
    with pytest.raises(RuntimeError, match="y has 5 columns but grad_out has 4"):
        ops.routing_weight_grad(g, torch.randn(6, 5), pr, 2)
    with pytest.raises(RuntimeError, match="grad_out has 3 rows but pair_row holds T = 2"):
        ops.routing_weight_grad(g, y, pr, 3)
    with pytest.raises(RuntimeError, match=r"top_k \(4\) must divide"):
        ops.routing_weight_grad(g, y, pr, 4)
    with pytest.raises(RuntimeError, match=r"pair_row\[5\] = 6 is outside"):
        ops.routing_weight_grad(g, y, torch.tensor([0, 1, 2, 3, 4, 6], dtype=torch.int32), 2)
    with pytest.raises(RuntimeError, match="pair_row must be int32"):
        ops.routing_weight_grad(g, y, pr.long(), 2)
    with pytest.raises(RuntimeError, match="grad_out must be 2-D"):
        ops.routing_weight_grad(g.reshape(-1), y, pr, 2)


# ----------------------------------------------------------------------------------
# swiglu / swiglu_backward
# ----------------------------------------------------------------------------------
def _ref_swiglu(h):
    gate, up = h.double().chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def _ref_swiglu_backward(grad_phi, h):
    """Autograd of the float64 reference: independent of the hand-written formula."""
    h64 = h.double().requires_grad_(True)
    _ref_swiglu(h64).backward(grad_phi.double())
    return h64.grad


def _swiglu_tol(dtype):
    # a few fp32 roundings (exp, divide, two products) then one to dtype
    return 2 * EPS[dtype] + 8 * EPS[torch.float32]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("N,I", [(37, 24), (1, 768), (9, 7), (0, 16)])
def test_swiglu(dtype, N, I):
    g = case_gen("swiglu", dtype, N, I)
    h = randn((N, 2 * I), dtype, g, scale=3.0)
    phi, phi_sq = ops.swiglu(h)
    assert phi.dtype == dtype and phi.shape == (N, I)
    assert phi_sq.dtype == torch.float32 and phi_sq.shape == (N,)
    want = _ref_swiglu(h)
    tol = _swiglu_tol(dtype)
    assert torch.all((phi.double() - want).abs() <= tol * want.abs() + TINY[dtype])
    # phi_sq is the norm of the stored (rounded) phi, accumulated in fp32
    sq_of_stored = (phi.double() ** 2).sum(1)
    torch.testing.assert_close(phi_sq.double(), sq_of_stored,
                               rtol=(I + 2) * EPS[torch.float32], atol=0)
    # and close to the exact norm up to phi's own rounding
    torch.testing.assert_close(phi_sq.double(), (want**2).sum(1), rtol=3 * tol, atol=0)


def test_swiglu_extreme_gate_values():
    h = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    phi, phi_sq = ops.swiglu(h)
    assert torch.isfinite(phi).all() and torch.isfinite(phi_sq).all()
    torch.testing.assert_close(phi.double(), _ref_swiglu(h), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("N,I", [(37, 24), (1, 768), (9, 7)])
def test_swiglu_backward(dtype, N, I):
    g = case_gen("swiglu_bwd", dtype, N, I)
    h = randn((N, 2 * I), dtype, g, scale=3.0)
    grad_phi = randn((N, I), dtype, g)
    grad_h = ops.swiglu_backward(grad_phi, h)
    assert grad_h.dtype == dtype and grad_h.shape == (N, 2 * I)
    want = _ref_swiglu_backward(grad_phi, h)
    # d gate = dphi*u*s*(1 + g(1-s)) can cancel when g(1-s) ~ -1: bound by the
    # magnitude of its terms, not the result
    gate, up = h.double().chunk(2, dim=1)
    s = torch.sigmoid(gate)
    mag_gate = (grad_phi.double() * up * s).abs() * (1 + (gate * (1 - s)).abs())
    mag = torch.cat([mag_gate, (grad_phi.double() * gate * s).abs()], dim=1)
    tol = _swiglu_tol(dtype) + 8 * EPS[torch.float32]
    assert torch.all((grad_h.double() - want).abs() <= tol * mag + TINY[dtype])


def test_swiglu_noncontiguous():
    g = case_gen("swiglu_nc")
    N, I = 37, 20
    h = randn((N, 2 * I + 6), torch.bfloat16, g)[:, 3 : 3 + 2 * I]
    grad_phi = randn((I, N), torch.bfloat16, g).t()
    assert not (h.is_contiguous() or grad_phi.is_contiguous())
    phi, _ = ops.swiglu(h)
    phi_c, _ = ops.swiglu(h.contiguous())
    assert torch.equal(phi, phi_c)
    torch.testing.assert_close(ops.swiglu_backward(grad_phi, h),
                               ops.swiglu_backward(grad_phi.contiguous(), h.contiguous()),
                               rtol=0, atol=0)
    want = _ref_swiglu(h)
    assert torch.all((phi.double() - want).abs() <= _swiglu_tol(torch.bfloat16) * want.abs())


def test_swiglu_bad_inputs():
    h = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="odd width 5"):
        ops.swiglu(torch.randn(4, 5))
    with pytest.raises(RuntimeError, match="h must be 2-D"):
        ops.swiglu(h.reshape(-1))
    with pytest.raises(RuntimeError, match="h must be float32, bfloat16"):
        ops.swiglu(h.int())
    with pytest.raises(RuntimeError, match=r"grad_phi must have shape \(N, I\) = \(4, 3\)"):
        ops.swiglu_backward(torch.randn(4, 6), h)
    with pytest.raises(RuntimeError, match="grad_phi has dtype BFloat16 but h has Float"):
        ops.swiglu_backward(torch.randn(4, 3).bfloat16(), h)
    with pytest.raises(RuntimeError, match="grad_phi must be 2-D"):
        ops.swiglu_backward(torch.randn(12), h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_index_reads_rows_in_place(dtype):
    """swiglu(h, index) == swiglu(h[index]) bit for bit, and its backward returns the
    gradient w.r.t. h[index] rows (repeats and any order allowed)."""
    g = case_gen("swiglu_index", dtype)
    h = randn((41, 2 * 24), dtype, g, scale=3.0)
    index = torch.tensor([40, 0, 7, 7, 13, 2, 39], dtype=torch.int32)
    phi, sq = ops.swiglu(h, index)
    phi_ref, sq_ref = ops.swiglu(h[index.long()].contiguous())
    assert torch.equal(phi, phi_ref) and torch.equal(sq, sq_ref)
    grad_phi = randn((7, 24), dtype, g)
    got = ops.swiglu_backward(grad_phi, h, index)
    assert torch.equal(got, ops.swiglu_backward(grad_phi, h[index.long()].contiguous()))
    want = _ref_swiglu_backward(grad_phi, h[index.long()])
    tol = _swiglu_tol(dtype) + 8 * EPS[torch.float32]
    rel = float((got.double() - want).norm() / want.norm())
    assert rel < tol * 10, rel
    empty = torch.zeros(0, dtype=torch.int32)
    assert ops.swiglu(h, empty)[0].shape == (0, 24)
    with pytest.raises(RuntimeError, match=r"index\[1\] = 41 is outside \[0, 41\)"):
        ops.swiglu(h, torch.tensor([0, 41], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="index must be int32"):
        ops.swiglu(h, index.long())
    with pytest.raises(RuntimeError, match=r"grad_phi must have shape \(N, I\) = \(7, 24\)"):
        ops.swiglu_backward(randn((41, 24), dtype, g), h, index)
