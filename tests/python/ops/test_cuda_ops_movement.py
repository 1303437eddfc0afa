"""CUDA tests of the data-movement ops against the CPU kernels and float64 references.

Tolerances, and why:
* permute (integer outputs) and gather_rows (a copy, or one fp32 multiply then one
  rounding): exact, ``torch.equal``.
* combine: exact as well -- the CUDA kernel adds ``w * y`` over k in the same order
  as the CPU loop with explicitly rounded multiply and add (no FMA contraction), so
  both produce the same bits.
* routing_weight_grad and swiglu's ``phi_sq``: fp32 reductions whose summation order
  differs (warp butterfly vs sequential loop). Each result may carry ~H * u32
  relative error with respect to sum |terms| (u32 = 2**-24), so GPU and CPU are
  compared with 2 * (H + 2) * u32 * sum |terms|.
* swiglu ``phi`` and swiglu_backward: elementwise, but CUDA ``expf`` and glibc
  ``expf`` may differ by an ulp or two in fp32, which can flip the final rounding
  to bf16/fp16 by one ulp. Both are compared with a float64 reference at a few
  fp32 roundings plus the dtype's own rounding.
Legend: T tokens, K top_k, P = T*K pairs, E experts, N rows, H hidden, I intermediate.
"""
from __future__ import annotations

import pytest
import torch

from lrmoe import ops

from _refs import EPS, FLOATS, TINY, case_gen, randn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
U32 = EPS[torch.float32]


def _both(x):
    """(cpu tensor, cuda copy)."""
    return x, x.to(DEV)


def _skewed_ids(g, T, K, E, hot=8, hot_frac=0.6, empty=()):
    """Expert ids with a few hot experts and some experts guaranteed empty."""
    allowed = torch.tensor([e for e in range(E) if e not in set(empty)])
    cold = allowed[torch.randint(0, len(allowed), (T, K), generator=g)]
    hot_ids = allowed[torch.randint(0, min(hot, len(allowed)), (T, K), generator=g)]
    return torch.where(torch.rand((T, K), generator=g) < hot_frac, hot_ids, cold)


# ----------------------------------------------------------------------------------
# permute
# ----------------------------------------------------------------------------------
PERMUTE_CASES = {
    # name: (T, K, E)
    "tiny": (5, 2, 3),
    "odd_37x3": (37, 3, 5),
    "single_token": (1, 4, 9),
    "one_tile_exact": (256, 8, 16),      # P = 2048 = one tile
    "tile_plus_one": (683, 3, 7),        # P = 2049
    "qwen_like": (4096, 8, 128),
    "many_experts": (8191, 4, 3000),
    "big": (131072, 8, 256),             # P ~ 1M
}


@pytest.mark.parametrize("name", list(PERMUTE_CASES))
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_permute_cuda_matches_cpu(name, id_dtype):
    T, K, E = PERMUTE_CASES[name]
    g = case_gen("permute", name, id_dtype)
    ids = _skewed_ids(g, T, K, E, empty=(0, E // 2) if E > 2 else ()).to(id_dtype)
    cpu = ops.permute(ids, E)
    gpu = ops.permute(ids.to(DEV), E)
    for label, a, b in zip(("row_pair", "pair_row", "tokens_per_expert", "offsets"), cpu, gpu):
        assert b.device.type == "cuda" and b.dtype == torch.int32, label
        assert torch.equal(a, b.cpu()), label
    # independent checks of stability: sorted by (expert, pair id)
    row_pair = gpu[0].long()
    flat = ids.reshape(-1).to(DEV).long()
    key = flat[row_pair] * (T * K) + row_pair
    assert torch.all(key.diff() > 0)
    assert torch.equal(gpu[2].long(), torch.bincount(flat, minlength=E))
    if E > 2:
        assert gpu[2][0].item() == 0 and gpu[2][E // 2].item() == 0


@pytest.mark.parametrize("pattern", ["all_one_expert", "top_k_equals_E", "one_expert"])
def test_permute_cuda_patterns(pattern):
    g = case_gen("permute_pat", pattern)
    if pattern == "all_one_expert":
        ids, E = torch.full((3000, 2), 5, dtype=torch.int64), 8
    elif pattern == "top_k_equals_E":
        E = 6
        ids = torch.stack([torch.randperm(E, generator=g) for _ in range(1001)])
    else:
        ids, E = torch.zeros(777, 3, dtype=torch.int32), 1
    cpu = ops.permute(ids, E)
    gpu = ops.permute(ids.to(DEV), E)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


def test_permute_cuda_empty_and_noncontiguous():
    out = ops.permute(torch.zeros(0, 8, dtype=torch.int64, device=DEV), 4)
    assert [t.shape[0] for t in out] == [0, 0, 4, 4]
    assert torch.equal(out[2].cpu(), torch.zeros(4, dtype=torch.int32))
    assert torch.equal(out[3].cpu(), torch.zeros(4, dtype=torch.int32))
    g = case_gen("permute_nc")
    ids_KT = torch.randint(0, 11, (3, 2999), generator=g, dtype=torch.int32)
    cpu = ops.permute(ids_KT.t(), 11)
    gpu = ops.permute(ids_KT.to(DEV).t(), 11)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


def test_permute_cuda_deterministic():
    g = case_gen("permute_det")
    ids = _skewed_ids(g, 50000, 8, 512).to(DEV)
    first = ops.permute(ids, 512)
    for _ in range(3):
        again = ops.permute(ids, 512)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------
# gather_rows
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("N,C,R,divisor", [(4096, 2048, 32768, 8), (37, 5, 111, 3),
                                          (100, 24, 1, 1), (64, 130, 500, 1)])
@pytest.mark.parametrize("with_scale", [False, True])
def test_gather_rows_cuda_matches_cpu(dtype, N, C, R, divisor, with_scale):
    g = case_gen("gather", dtype, N, C, R, divisor, with_scale)
    src, src_d = _both(randn((N, C), dtype, g))
    index, index_d = _both(torch.randint(0, N * divisor, (R,), generator=g, dtype=torch.int32))
    scale = torch.rand(R, generator=g) + 0.5 if with_scale else None
    scale_d = scale.to(DEV) if with_scale else None
    cpu = ops.gather_rows(src, index, scale, divisor)
    gpu = ops.gather_rows(src_d, index_d, scale_d, divisor)
    assert gpu.dtype == dtype and gpu.shape == (R, C)
    assert torch.equal(cpu, gpu.cpu())
    if not with_scale:
        assert torch.equal(gpu, src_d[index_d.long() // divisor])


def test_gather_rows_cuda_misaligned_and_strided():
    g = case_gen("gather_misaligned")
    N, C = 300, 64
    # contiguous but 2 bytes off a 16-byte boundary: the scalar path
    flat = randn((N * C + 1,), torch.bfloat16, g).to(DEV)
    src_d = flat[1:].view(N, C)
    assert src_d.is_contiguous() and src_d.data_ptr() % 16 != 0
    index_d = torch.randint(0, N, (1000,), generator=g, dtype=torch.int32).to(DEV)
    assert torch.equal(ops.gather_rows(src_d, index_d, None, 1), src_d[index_d.long()])
    # strided views: transposed source, every other index, strided scale
    big = randn((C, 2 * N), torch.float32, g)
    src = big.t()[::2]
    idx_big = torch.randint(0, N, (2000,), generator=g, dtype=torch.int32)
    sc_big = torch.rand(2000, generator=g) + 0.5
    cpu = ops.gather_rows(src, idx_big[::2], sc_big[::2], 1)
    gpu = ops.gather_rows(src.to(DEV), idx_big.to(DEV)[::2], sc_big.to(DEV)[::2], 1)
    assert torch.equal(cpu, gpu.cpu())


def test_gather_rows_cuda_empty():
    src = torch.randn(10, 8, device=DEV)
    assert ops.gather_rows(src, torch.zeros(0, dtype=torch.int32, device=DEV), None, 1).shape == (0, 8)


def test_gather_rows_cuda_device_mismatch():
    src = torch.randn(10, 8, device=DEV)
    with pytest.raises(RuntimeError, match="is on"):
        ops.gather_rows(src, torch.zeros(3, dtype=torch.int32), None, 1)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,K,C,R", [(8192, 8, 2048, 45875), (37, 3, 5, 100),
                                     (64, 4, 130, 256), (100, 1, 24, 0), (9, 16, 24, 1)])
@pytest.mark.parametrize("with_scale", [False, True])
def test_dispatch_rows_cuda_matches_cpu_and_gather(dtype, T, K, C, R, with_scale):
    """The scatter form against the CPU op and the CUDA gather it replaces, bit for bit;
    Qwen3 width H at c = 0.3, unaligned widths (scalar path), nothing kept."""
    if dtype == torch.float64 and T * C > 1 << 20:
        pytest.skip("the production size in bf16/fp16/fp32 is enough")
    g = case_gen("dispatch", dtype, T, K, C, R, with_scale)
    src, src_d = _both(randn((T, C), dtype, g))
    kept_pair = torch.randperm(T * K, generator=g)[:R]
    slot = torch.full((T * K,), -1, dtype=torch.int32)
    slot[kept_pair] = torch.arange(R, dtype=torch.int32)
    kept_pair = kept_pair.to(torch.int32)
    scale = torch.rand(R, generator=g) + 0.5 if with_scale else None
    scale_d = scale.to(DEV) if with_scale else None
    cpu = ops.dispatch_rows(src, slot, scale, R, K)
    gpu = ops.dispatch_rows(src_d, slot.to(DEV), scale_d, R, K)
    assert gpu.dtype == dtype and gpu.shape == (R, C)
    assert torch.equal(cpu, gpu.cpu())
    assert torch.equal(gpu, ops.gather_rows(src_d, kept_pair.to(DEV), scale_d, K))


def test_dispatch_rows_cuda_misaligned_and_strided():
    g = case_gen("dispatch_misaligned")
    T, K, C = 300, 2, 64
    flat = randn((T * C + 1,), torch.bfloat16, g).to(DEV)
    src_d = flat[1:].view(T, C)  # contiguous, 2 bytes off 16: the scalar path
    perm = torch.randperm(T * K, generator=g).to(torch.int32)
    slot = torch.empty_like(perm)
    slot[perm.long()] = torch.arange(T * K, dtype=torch.int32)
    got = ops.dispatch_rows(src_d, slot.to(DEV), None, T * K, K)
    assert torch.equal(got, src_d[perm.to(DEV).long() // K])
    src = randn((C, 2 * T), torch.float32, g).t()[::2]  # strided view (T, C)
    sc = torch.rand(T * K, generator=g) + 0.5
    assert torch.equal(ops.dispatch_rows(src, slot, sc, T * K, K),
                       ops.dispatch_rows(src.to(DEV), slot.to(DEV), sc.to(DEV), T * K, K).cpu())

# ----------------------------------------------------------------------------------
# combine
# ----------------------------------------------------------------------------------
def _routed(g, T, K, E, drop_frac):
    """pair_row (P,) int32 from a real permute, a fraction dropped to -1."""
    ids = _skewed_ids(g, T, K, E, empty=(1,))
    _, pair_row, _, _ = ops.permute(ids, E)
    if drop_frac:
        pair_row[torch.rand(T * K, generator=g) < drop_frac] = -1
    return pair_row


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,K,E,H", [(4096, 8, 128, 2048), (37, 3, 5, 67), (1, 6, 6, 128),
                                     (500, 2, 16, 8)])
@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("drop", [0.0, 0.25])
def test_combine_cuda_matches_cpu_exactly(dtype, T, K, E, H, with_weights, drop):
    if dtype == torch.float64 and H == 2048 and not with_weights:
        pytest.skip("covered by the weighted float64 case")
    g = case_gen("combine", dtype, T, K, E, H, with_weights, drop)
    y, y_d = _both(randn((T * K, H), dtype, g))
    pair_row = _routed(g, T, K, E, drop)
    w = torch.rand(T, K, generator=g) if with_weights else None
    cpu = ops.combine(y, pair_row, w, K)
    gpu = ops.combine(y_d, pair_row.to(DEV), w.to(DEV) if with_weights else None, K)
    assert gpu.dtype == dtype and gpu.shape == (T, H)
    assert torch.equal(cpu, gpu.cpu())
    # and an independent float64 check on the device
    rows = pair_row.to(DEV).long().reshape(T, K)
    w64 = (w.to(DEV).double() if with_weights else torch.ones(T, K, device=DEV, dtype=torch.float64))
    w64 = torch.where(rows >= 0, w64, torch.zeros_like(w64))
    terms = w64[..., None] * y_d.double()[rows.clamp(min=0)]
    want, mag = terms.sum(1), terms.abs().sum(1)
    err = (gpu.double() - want).abs()
    assert torch.all(err <= (EPS[dtype] + 2 * K * U32) * mag + TINY[dtype])


def test_combine_cuda_noncontiguous_weights_and_y():
    g = case_gen("combine_nc")
    T, K, E, H = 37, 3, 5, 64
    y = randn((H, T * K), torch.bfloat16, g).t()  # (N, H) transposed view
    pair_row = _routed(g, T, K, E, 0.2)
    w = torch.rand(K, T, generator=g).t()
    cpu = ops.combine(y, pair_row, w, K)
    gpu = ops.combine(y.to(DEV), pair_row.to(DEV), w.to(DEV), K)
    assert torch.equal(cpu, gpu.cpu())


# ----------------------------------------------------------------------------------
# routing_weight_grad
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T,K,E,H", [(4096, 8, 128, 2048), (37, 3, 5, 67), (1, 6, 6, 128),
                                     (300, 2, 16, 9)])
def test_routing_weight_grad_cuda(dtype, T, K, E, H):
    g = case_gen("rwg", dtype, T, K, E, H)
    grad_out, grad_out_d = _both(randn((T, H), dtype, g))
    y, y_d = _both(randn((T * K, H), dtype, g))
    pair_row = _routed(g, T, K, E, 0.2)
    cpu = ops.routing_weight_grad(grad_out, y, pair_row, K)
    gpu = ops.routing_weight_grad(grad_out_d, y_d, pair_row.to(DEV), K)
    assert gpu.dtype == torch.float32 and gpu.shape == (T, K)
    rows = pair_row.to(DEV).long()
    keep = rows >= 0
    prod = grad_out_d.double().repeat_interleave(K, 0) * y_d.double()[rows.clamp(min=0)]
    want = torch.where(keep, prod.sum(1), 0.0).reshape(T, K)
    mag = torch.where(keep, prod.abs().sum(1), 0.0).reshape(T, K)
    acc = EPS[torch.float64] if dtype == torch.float64 else U32
    tol = (H + 2) * acc + U32
    assert torch.all((gpu.double() - want).abs() <= tol * mag + 1e-38)
    assert torch.all((gpu.double() - cpu.to(DEV).double()).abs() <= 2 * tol * mag + 1e-38)
    assert torch.all(gpu.reshape(-1)[~keep] == 0)


# ----------------------------------------------------------------------------------
# swiglu / swiglu_backward
# ----------------------------------------------------------------------------------
def _swiglu_tol(dtype):
    return 2 * EPS[dtype] + 8 * U32


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("N,I", [(32768, 768), (37, 24), (5, 7), (1, 1408)])
def test_swiglu_cuda(dtype, N, I):
    g = case_gen("swiglu", dtype, N, I)
    h, h_d = _both(randn((N, 2 * I), dtype, g, scale=3.0))
    phi_c, sq_c = ops.swiglu(h)
    phi, sq = ops.swiglu(h_d)
    assert phi.dtype == dtype and phi.shape == (N, I) and sq.dtype == torch.float32
    gate, up = h_d.double().chunk(2, dim=1)
    want = torch.nn.functional.silu(gate) * up
    tol = _swiglu_tol(dtype)
    assert torch.all((phi.double() - want).abs() <= tol * want.abs() + TINY[dtype])
    assert torch.all((phi.double() - phi_c.to(DEV).double()).abs()
                     <= 2 * tol * want.abs() + 2 * TINY[dtype])
    # phi_sq: the fp32 norm of the stored phi; a reduction in a different order
    stored = (phi.double() ** 2).sum(1)
    assert torch.all((sq.double() - stored).abs() <= (I + 2) * U32 * stored + 1e-38)
    assert torch.all((sq.double() - sq_c.to(DEV).double()).abs()
                     <= (2 * (I + 2) * U32 + 4 * tol) * stored + 1e-38)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("N,I", [(32768, 768), (37, 24), (5, 7)])
def test_swiglu_backward_cuda(dtype, N, I):
    g = case_gen("swiglu_bwd", dtype, N, I)
    h, h_d = _both(randn((N, 2 * I), dtype, g, scale=3.0))
    dphi, dphi_d = _both(randn((N, I), dtype, g))
    gpu = ops.swiglu_backward(dphi_d, h_d)
    cpu = ops.swiglu_backward(dphi, h)
    assert gpu.dtype == dtype and gpu.shape == (N, 2 * I)
    h64 = h_d.double().requires_grad_(True)
    gate, up = h64.chunk(2, dim=1)
    (torch.nn.functional.silu(gate) * up).backward(dphi_d.double())
    want = h64.grad
    gate, up = h_d.double().chunk(2, dim=1)
    s = torch.sigmoid(gate)
    d64 = dphi_d.double()
    mag = torch.cat([(d64 * up * s).abs() * (1 + (gate * (1 - s)).abs()),
                     (d64 * gate * s).abs()], dim=1)
    tol = _swiglu_tol(dtype) + 8 * U32
    assert torch.all((gpu.double() - want).abs() <= tol * mag + TINY[dtype])
    assert torch.all((gpu.double() - cpu.to(DEV).double()).abs() <= 2 * tol * mag + 2 * TINY[dtype])


def test_swiglu_cuda_noncontiguous_and_misaligned():
    g = case_gen("swiglu_nc")
    N, I = 301, 64
    h = randn((N, 2 * I + 2), torch.bfloat16, g)[:, 1 : 1 + 2 * I]
    phi_c, _ = ops.swiglu(h)
    phi, _ = ops.swiglu(h.to(DEV))
    gate, up = h.to(DEV).double().chunk(2, dim=1)
    want = torch.nn.functional.silu(gate) * up
    tol = _swiglu_tol(torch.bfloat16)
    assert torch.all((phi.double() - want).abs() <= tol * want.abs() + TINY[torch.bfloat16])
    assert torch.all((phi.cpu().double() - phi_c.double()).abs() <= 2 * tol * want.abs().cpu()
                     + 2 * TINY[torch.bfloat16])
    # a contiguous but misaligned h takes the scalar path
    flat = randn((N * 2 * I + 1,), torch.bfloat16, g).to(DEV)
    h_mis = flat[1:].view(N, 2 * I)
    phi_mis, sq_mis = ops.swiglu(h_mis)
    phi_ref, sq_ref = ops.swiglu(h_mis.clone())  # aligned copy: the vector path
    assert torch.equal(phi_mis, phi_ref)  # elementwise: same bits on either path
    # the two paths sum phi^2 in different lane orders
    torch.testing.assert_close(sq_mis, sq_ref, rtol=2 * (I + 2) * U32, atol=0)


@pytest.mark.parametrize("dtype", FLOATS)
def test_swiglu_index_cuda(dtype):
    """The fused-index read on CUDA equals the CPU op on gathered rows."""
    g = case_gen("swiglu_index", dtype)
    h, h_d = _both(randn((5000, 2 * 768), dtype, g, scale=3.0))
    idx = torch.randperm(5000, generator=g)[:3500].sort().values.to(torch.int32)
    phi, sq = ops.swiglu(h_d, idx.to(DEV))
    phi_g, sq_g = ops.swiglu(h_d[idx.to(DEV).long()].contiguous())
    assert torch.equal(phi, phi_g) and torch.equal(sq, sq_g)
    dphi = randn((3500, 768), dtype, g).to(DEV)
    got = ops.swiglu_backward(dphi, h_d, idx.to(DEV))
    assert torch.equal(got, ops.swiglu_backward(dphi, h_d[idx.to(DEV).long()].contiguous()))
