"""Typed wrappers around the compiled ``torch.ops.lrmoe`` operators, with fake kernels.

Every op has a CPU (C++) and a CUDA implementation in ``csrc/ops/<op>.{cpp,cu}``; the
schemas are in ``csrc/ops/registration.cpp``. The fake kernels below give shapes and
dtypes without data, so ``torch.compile`` and activation checkpointing can trace the
layer. No op here synchronises the host with the device (``grouped_mm`` off its fused
CUDA path excepted): every output size is known from input sizes alone.

Legend: T tokens, K top_k, P = T*K routed pairs, E experts, H hidden size, I expert
intermediate size, R retained pairs. A *pair* id is ``t*K + k``; a *row* is a position
in the expert-sorted (permuted) order, where rows of expert e are
``[offsets[e-1], offsets[e])`` in increasing pair id.
"""
from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Optional, Tuple

import torch
from torch import Tensor

# ---------------------------------------------------------------- the compiled library
# A C++ extension is compiled against one torch and runs only with it: another version
# fails with an undefined-symbol ImportError (or loads and misbehaves). setup.py records
# the torch it compiled against in lrmoe/_build_info.py; load() compares it with the
# running torch BEFORE importing the library, so a mismatch is one error with the fix. A
# CPU-only build under a CUDA torch on a machine with a GPU warns: the ops would refuse
# CUDA tensors. The loader lives here, in the ops' own module, so the library has one door.
REBUILD = ("rebuild lrmoe against the torch you run: `pip install --no-build-isolation "
           "--force-reinstall --no-deps .` in the lrmoe source folder (or `bash "
           "scripts/bootstrap.sh` in a checkout)")


def _release(version: str) -> str:
    # 2.11.0+cu130 and 2.11.0+cpu share one C++ ABI; the local tag says which kernels
    return version.split("+", 1)[0]


def build_info() -> Optional[ModuleType]:
    """``lrmoe._build_info`` (TORCH_VERSION, TORCH_CUDA, WITH_CUDA), or None for a build
    made before it was recorded."""
    try:
        return importlib.import_module("lrmoe._build_info")
    except ModuleNotFoundError:
        return None


def check_torch(built: str, running: str) -> None:
    """Raise when ``running`` torch is not the release ``built`` was compiled against.

    Raises:
        ImportError: naming both versions and :data:`REBUILD`.
    """
    if _release(built) != _release(running):
        raise ImportError(f"lrmoe._C was compiled against torch {built}, but torch {running} "
                          f"is installed; a compiled extension runs only with its own torch: "
                          f"{REBUILD}, or install torch=={_release(built)}")


def load() -> ModuleType:
    """Import ``lrmoe._C`` after the torch check (:func:`check_torch`).

    Returns:
        the extension module.

    Raises:
        ImportError: a torch mismatch, or no compiled extension (naming how to build it).
    """
    info = build_info()
    if info is not None:
        check_torch(info.TORCH_VERSION, torch.__version__)
    try:
        ext = importlib.import_module("lrmoe._C")
    except ModuleNotFoundError as exc:
        if exc.name != "lrmoe._C":
            raise
        raise ImportError("lrmoe._C, the compiled extension, is missing: build it with `bash "
                          "scripts/bootstrap.sh` (a checkout) or install lrmoe with `pip "
                          "install --no-build-isolation .`") from None
    if info is not None and not info.WITH_CUDA and torch.version.cuda is not None:
        if torch.cuda.is_available():
            warnings.warn(
                f"lrmoe._C was built without CUDA kernels, but torch {torch.__version__} "
                "sees a GPU: lrmoe's ops refuse CUDA tensors. Rebuild with nvcc on the "
                f"PATH (LRMOE_CUDA=1 fails loudly when it cannot): {REBUILD}", stacklevel=3)
    return ext



# loads the library (after the torch check); its initialisers register the ops
_C = load()

METRICS = ("lrm", "grad_sq", "grad_abs", "random")
QUOTA_RULES = ("proportional", "water_level")
SELECTIONS = ("topk", "importance")

_ops = torch.ops.lrmoe


def permute(expert_ids: Tensor, num_experts: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group routed pairs by expert (stable counting sort).

    Args:
        expert_ids: ``(T, K)`` int32 or int64, values in ``[0, num_experts)``.
        num_experts: E >= 1.

    Returns:
        ``row_pair`` (P,) int32: pair id held by each expert-sorted row, increasing within
        an expert; ``pair_row`` (P,) int32: its inverse; ``tokens_per_expert`` (E,) int32;
        ``offsets`` (E,) int32 inclusive cumulative ends (the ``offs`` of ``grouped_mm``).

    Raises:
        RuntimeError: wrong rank/dtype, ``num_experts < 1``, P >= 2**31, or (CPU) an id
        outside ``[0, num_experts)``.
    """
    return _ops.permute(expert_ids, num_experts)


def gather_rows(src: Tensor, index: Tensor, scale: Optional[Tensor] = None,
                divisor: int = 1) -> Tensor:
    """Compaction gather: ``out[r] = scale[r] * src[index[r] // divisor]``.

    Args:
        src: ``(N, C)`` float (fp32, bf16, fp16, fp64), any strides.
        index: ``(R,)`` int32 with ``0 <= index // divisor < N``.
        scale: optional ``(R,)`` float32 row factors (applied in fp32, then rounded to
            ``src.dtype``).
        divisor: positive int; ``divisor = K`` turns pair ids into token ids.

    Returns:
        ``(R, C)`` contiguous tensor of ``src.dtype``.

    Raises:
        RuntimeError: wrong rank/dtype, ``divisor < 1``, device mismatch, or (CPU) an index
        out of range.
    """
    return _ops.gather_rows(src, index, scale, divisor)


def dispatch_rows(src: Tensor, slot: Tensor, scale: Optional[Tensor], num_rows: int,
                  top_k: int) -> Tensor:
    """The scatter form of :func:`gather_rows`: ``out[slot[p]] = scale[slot[p]] *
    src[p // top_k]`` for every pair ``p`` with ``slot[p] >= 0``.

    With ``slot`` the inverse of a gather index (``slot[index[r]] = r``, -1 elsewhere, e.g.
    ``pair_row`` of :func:`permute` or ``pair_kept`` of :func:`select`) it equals
    ``gather_rows(src, index, scale, top_k)`` bit for bit, but reads each source row once
    instead of once per output row (T C values read instead of R C).

    Args:
        src: ``(T, C)`` float (fp32, bf16, fp16, fp64), any strides.
        slot: ``(T * top_k,)`` int32 output row of each pair, or -1 (dropped); every row in
            ``[0, num_rows)`` named by exactly one pair.
        scale: optional ``(num_rows,)`` float32 factor per output row (applied in fp32, then
            rounded to ``src.dtype``).
        num_rows: R >= 0. top_k: K >= 1.

    Returns:
        ``(num_rows, C)`` contiguous tensor of ``src.dtype``.

    Raises:
        RuntimeError: wrong rank/dtype/size, device mismatch, or (CPU) a slot outside
        ``[-1, num_rows)``, a row named twice or by no pair (on CUDA such a row is left
        uninitialised; the inputs come from :func:`permute`/:func:`select`).
    """
    return _ops.dispatch_rows(src, slot, scale, num_rows, top_k)


def combine(y: Tensor, pair_row: Tensor, weights: Optional[Tensor], top_k: int) -> Tensor:
    """Unpermute and weighted-sum: ``out[t] = sum_k weights[t, k] * y[pair_row[t*K + k]]``.

    Summation runs over k in order with an fp32 accumulator (deterministic, no atomics).
    Rows equal to -1 are skipped (dropped pairs in the backward ``dx`` scatter).

    Args:
        y: ``(N, H)`` float rows.
        pair_row: ``(T*K,)`` int32 row of each pair, or -1.
        weights: optional ``(T, K)`` float routing weights (used in fp32); None means 1.
        top_k: K >= 1, dividing ``pair_row.numel()``.

    Returns:
        ``(T, H)`` of ``y.dtype``.

    Raises:
        RuntimeError: shape/dtype/device mismatch or (CPU) a row out of range.
    """
    return _ops.combine(y, pair_row, weights, top_k)


def routing_weight_grad(grad_out: Tensor, y: Tensor, pair_row: Tensor, top_k: int) -> Tensor:
    """Exact router-side gradient ``dL/dalpha[t, k] = <grad_out[t], y[pair_row[t*K + k]]>``.

    Args:
        grad_out: ``(T, H)`` float, gradient at the MoE layer output.
        y: ``(N, H)`` expert outputs in row order (same dtype as ``grad_out``).
        pair_row: ``(T*K,)`` int32 (-1 gives 0).
        top_k: K.

    Returns:
        ``(T, K)`` float32.
    """
    return _ops.routing_weight_grad(grad_out, y, pair_row, top_k)


def score(grad_out: Tensor, weights: Tensor, phi_sq: Tensor, row_pair: Tensor,
          metric: str = "lrm", seed: int = 0) -> Tensor:
    """Backward priority of every routed pair, in row order, fp32.

    ``lrm``: R_u = alpha_u^2 * ||g_t||^2 * ||phi_u||^2, the squared Frobenius norm of the
    pair's rank-one contribution (alpha_u g_t) phi_u^T to dW_down (docs/algorithm.md section 2).
    ``grad_sq``: ||g_t||^2. ``grad_abs``: ||g_t||_1. ``random``: uniform [0, 1) from a
    counter-based hash of (seed, pair id) -- identical on CPU and CUDA.

    Args:
        grad_out: ``(T, H)`` float, g.
        weights: ``(T, K)`` float routing weights alpha.
        phi_sq: ``(P,)`` float32, ||phi||^2 per row (from :func:`swiglu`).
        row_pair: ``(P,)`` int32 from :func:`permute`.
        metric: one of ``lrm, grad_sq, grad_abs, random``.
        seed: int, used by ``random`` only.

    Returns:
        ``(P,)`` float32.

    Raises:
        RuntimeError: unknown metric, shape/dtype/device mismatch.
    """
    return _ops.score(grad_out, weights, phi_sq, row_pair, metric, seed)


def quota(tokens_per_expert: Tensor, recalibration_rate: float,
          rule: str = "proportional") -> Tensor:
    """Per-expert retention quota Q_e, computed on the tensor's device (no host sync).

    ``proportional``: Q_e = (1 - c) n_e rounded by largest remainder (ties to the lower
    expert) so that sum Q = floor((1 - c) sum n); [4, 2, 3] at c = 1/3 gives [3, 1, 2].
    ``water_level``: Q_e = min(n_e, L) for the largest integer level L that keeps
    sum Q <= floor((1 - c) sum n), the remainder given one each to the most loaded
    experts above L. Both run the plain C++ of ``csrc/core/quota.h``.

    Args:
        tokens_per_expert: ``(E,)`` int32, n_e >= 0.
        recalibration_rate: c in [0, 1).
        rule: ``proportional`` or ``water_level``.

    Returns:
        ``(E,)`` int32 with ``0 <= Q_e <= n_e``.

    Raises:
        RuntimeError: c outside [0, 1), unknown rule, wrong dtype/rank.
    """
    return _ops.quota(tokens_per_expert, float(recalibration_rate), rule)


def source_shares(counts: Tensor, quota: Tensor) -> Tensor:
    """Split each expert's global quota over the source ranks (largest remainder).

    For expert parallelism: with n[s, e] = ``counts[s, e]`` and N_e = sum_s n[s, e],
    ``share[s, e] = floor(Q_e n[s, e] / N_e)`` plus one for the
    ``Q_e - sum_s floor(Q_e n[s, e] / N_e)`` sources with the largest remainders
    ``(Q_e n[s, e]) mod N_e``, ties to the lower source rank. Exact integer arithmetic
    (``csrc/core/quota.h``, ``source_share``), computed on the tensors' device with no
    host sync, so every rank gets identical shares. Counts [[3], [1]] with Q = [2] give
    [[2], [0]] (3*2/4 = 1.5 and 1*2/4 = 0.5: equal remainders, the tie goes to rank 0).

    Args:
        counts: ``(W, E)`` int32 routed pairs of each source rank per expert, >= 0.
        quota: ``(E,)`` int32 global quotas, ``0 <= Q_e <= N_e``.

    Returns:
        ``(W, E)`` int32 with ``sum_s share[s, e] == Q_e`` and ``0 <= share <= counts``.

    Raises:
        RuntimeError: wrong rank/dtype, ``quota`` length other than E, different devices;
            on CPU also negative counts or a quota outside ``[0, N_e]`` (the CUDA path
            cannot check values without a sync).
    """
    return _ops.source_shares(counts, quota)


def select(score: Tensor, row_pair: Tensor, offsets: Tensor, quota: Tensor, num_retained: int,
           selection: str = "topk", seed: int = 0
           ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Fill each expert's quota with its best pairs and compact the survivors.

    ``topk``: per expert the Q_e highest scores, ties to the lower row (= lower pair id).
    ``importance``: per expert, inclusion probabilities p_i = min(1, lambda_e s_i) with
    sum_i p_i = Q_e, drawn by systematic sampling (exactly Q_e rows, each with marginal
    probability p_i; Madow 1949), kept rows scaled by 1/p_i so the expert gradient is
    unbiased. If an expert has at most Q_e positive scores, those get p = 1 and the
    remaining slots are spread uniformly over its zero-score rows.

    Args:
        score: ``(P,)`` float32 in row order.
        row_pair: ``(P,)`` int32 from :func:`permute`.
        offsets: ``(E,)`` int32 inclusive ends from :func:`permute`.
        quota: ``(E,)`` int32 from :func:`quota`, ``sum(quota) == num_retained``.
        num_retained: R, host int (``floor((1 - c) P)``), so no output size needs a sync.
        selection: ``topk`` or ``importance``.
        seed: int, used by ``importance``.

    Returns:
        ``kept_rows`` (R,) int32 ascending (so experts stay contiguous and, at c = 0, the
        buffers are bit-identical copies); ``kept_pair`` (R,) int32 = ``row_pair[kept_rows]``;
        ``pair_kept`` (P,) int32 position in the kept buffer of each pair, -1 if dropped;
        ``kept_offsets`` (E,) int32 inclusive ends (cumsum of quota); ``kept_scale`` (R,)
        float32 (1 for ``topk``, 1/p for ``importance``); ``retained_mass`` () float32 =
        sum of kept scores / sum of all scores (1 when all scores are 0).

    Raises:
        RuntimeError: shape/dtype/device mismatch, unknown selection, (CPU) quota sum
        different from ``num_retained`` or a quota above its expert's load.
    """
    return _ops.select(score, row_pair, offsets, quota, num_retained, selection, seed)


def swiglu(h: Tensor, index: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """SwiGLU activation with the LRM by-product.

    Args:
        h: ``(M, 2I)`` float, ``[gate | up]`` halves (the transformers ``gate_up_proj``
            order).
        index: optional ``(N,)`` int32 rows of ``h`` to use (the backward's compaction,
            fused into the read instead of a gathered copy of ``h``); None uses all M rows.

    Returns:
        ``phi`` (N, I) of ``h.dtype`` = silu(gate) * up computed in fp32; ``phi_sq`` (N,)
        float32 = ||phi||^2 of the stored (rounded) phi.

    Raises:
        RuntimeError: odd width, wrong dtype, or (CPU) an index outside ``[0, M)``.
    """
    return _ops.swiglu(h, index)


def swiglu_backward(grad_phi: Tensor, h: Tensor, index: Optional[Tensor] = None) -> Tensor:
    """Gradient of :func:`swiglu` w.r.t. the selected rows of ``h``.

    d gate = dphi * up * sigma(gate) * (1 + gate * (1 - sigma(gate))), d up = dphi *
    silu(gate), in fp32.

    Args:
        grad_phi: ``(N, I)`` float.
        h: ``(M, 2I)`` of the same dtype.
        index: optional ``(N,)`` int32 rows of ``h`` (as in :func:`swiglu`).

    Returns:
        ``(N, 2I)`` of ``h.dtype``: row n is the gradient w.r.t. ``h[index[n]]``.
    """
    return _ops.swiglu_backward(grad_phi, h, index)


def grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """Grouped GEMM seam with ``torch._grouped_mm`` semantics.

    * ``a`` (M, K) 2-D, ``b`` (E, K, N) 3-D: rows of ``a`` in groups by ``offsets``,
      ``out[rows of e] = a[rows of e] @ b[e]`` -> (M, N).
    * ``a`` (M, Ktot) 2-D, ``b`` (Ktot, N) 2-D: groups along K (weight gradients),
      ``out[e] = a[:, K of e] @ b[K of e]`` -> (E, M, N); empty groups give zeros.

    On CUDA with bf16 inputs on sm90+ and 16-byte aligned shapes this is
    ``torch._grouped_mm`` (CUTLASS, device offsets, no host sync); elsewhere a C++ loop of
    ``at::mm`` per expert (which reads ``offsets`` on the host).

    Args:
        a, b: float tensors of one dtype and device; ``b`` may be a transposed view.
        offsets: ``(E,)`` int32 inclusive ends, last <= the grouped dimension.

    Returns:
        the product, dtype of ``a``.
    """
    return _ops.grouped_mm(a, b, offsets)


# ---------------------------------------------------------------------------------------
# Fake kernels: shapes and dtypes only, for torch.compile / FakeTensor tracing.
# ---------------------------------------------------------------------------------------
_fake = torch.library.register_fake


@_fake("lrmoe::permute")
def _(expert_ids, num_experts):
    p = expert_ids.numel()
    i32 = dict(dtype=torch.int32, device=expert_ids.device)
    return (expert_ids.new_empty(p, **i32), expert_ids.new_empty(p, **i32),
            expert_ids.new_empty(num_experts, **i32), expert_ids.new_empty(num_experts, **i32))


@_fake("lrmoe::gather_rows")
def _(src, index, scale, divisor):
    return src.new_empty(index.shape[0], src.shape[1])


@_fake("lrmoe::dispatch_rows")
def _(src, slot, scale, num_rows, top_k):
    return src.new_empty(num_rows, src.shape[1])


@_fake("lrmoe::combine")
def _(y, pair_row, weights, top_k):
    return y.new_empty(pair_row.shape[0] // top_k, y.shape[1])


@_fake("lrmoe::routing_weight_grad")
def _(grad_out, y, pair_row, top_k):
    return grad_out.new_empty(pair_row.shape[0] // top_k, top_k, dtype=torch.float32)


@_fake("lrmoe::score")
def _(grad_out, weights, phi_sq, row_pair, metric, seed):
    return phi_sq.new_empty(row_pair.shape[0], dtype=torch.float32)


@_fake("lrmoe::quota")
def _(tokens_per_expert, recalibration_rate, rule):
    return tokens_per_expert.new_empty(tokens_per_expert.shape[0], dtype=torch.int32)


@_fake("lrmoe::source_shares")
def _(counts, quota):
    return counts.new_empty(counts.shape[0], counts.shape[1], dtype=torch.int32)


@_fake("lrmoe::select")
def _(score, row_pair, offsets, quota, num_retained, selection, seed):
    i32 = dict(dtype=torch.int32)
    return (row_pair.new_empty(num_retained, **i32), row_pair.new_empty(num_retained, **i32),
            row_pair.new_empty(row_pair.shape[0], **i32), offsets.new_empty(offsets.shape[0], **i32),
            score.new_empty(num_retained, dtype=torch.float32),
            score.new_empty((), dtype=torch.float32))


@_fake("lrmoe::swiglu")
def _(h, index=None):
    n = h.shape[0] if index is None else index.shape[0]
    return h.new_empty(n, h.shape[1] // 2), h.new_empty(n, dtype=torch.float32)


@_fake("lrmoe::swiglu_backward")
def _(grad_phi, h, index=None):
    return h.new_empty(grad_phi.shape[0], h.shape[1])


@_fake("lrmoe::grouped_mm")
def _(a, b, offsets):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1])



def rate_fraction(recalibration_rate: float) -> Tuple[int, int]:
    """The recalibration rate c as the exact fraction (p, q) all quota arithmetic uses.

    The fraction nearest to c with q <= 2**20 (``csrc/core/quota.h``), i.e. in Python
    ``Fraction(round(c * 2**60), 2**60).limit_denominator(2**20)``: 0.3 and 1/3 are exact.

    Raises:
        ValueError: c outside [0, 1).
    """
    return _C.rate_fraction(float(recalibration_rate))


def retained_total(num_pairs: int, recalibration_rate: float) -> int:
    """R = floor((1 - c) * num_pairs) in exact integer arithmetic (c as :func:`rate_fraction`),
    the retained pair count that sizes every backward buffer.

    Raises:
        ValueError: c outside [0, 1).
    """
    p, q = rate_fraction(recalibration_rate)
    return (q - p) * num_pairs // q
