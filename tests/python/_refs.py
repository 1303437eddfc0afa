"""Helpers shared by the op test modules (CPU and CUDA): per-case generators,
float64-born random data, rounding constants and a plain-torch routing.

Like conftest.py, nothing here uses lrmoe: routing is built with a stable argsort
of expert ids, never with lrmoe.ops.permute.
"""
from __future__ import annotations

import zlib
from typing import Tuple

import torch

I32 = torch.int32
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# unit roundoff of each dtype
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11,
       torch.float64: 2.0**-53}
# absolute rounding floor where results fall into the dtype's subnormal range
TINY = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24,
        torch.float64: 2.0**-1074}


def case_gen(*key) -> torch.Generator:
    """A CPU generator seeded from the test case, so each case gets its own data."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard normal drawn in float64 (times scale), then rounded to dtype."""
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def routing(expert_ids: torch.Tensor, num_experts: int
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """row_pair (P,) int32, tokens_per_expert (E,) int32, offsets (E,) int32 inclusive ends."""
    flat = expert_ids.reshape(-1).long()
    row_pair = torch.argsort(flat, stable=True).to(I32)
    counts = torch.bincount(flat, minlength=num_experts)
    return row_pair, counts.to(I32), torch.cumsum(counts, 0).to(I32)


def grouped_mm_rows_ref(a, b, offsets) -> torch.Tensor:
    """2D x 3D grouped GEMM in float64 on the CPU: rows of group e times b[e]; zeros
    past offsets[-1]."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = a[start:end].double().cpu() @ b[e].double().cpu()
        start = end
    return out


def grouped_mm_k_ref(a, b, offsets) -> torch.Tensor:
    """2D x 2D grouped GEMM (groups along K) in float64 on the CPU; empty groups give 0."""
    out = torch.zeros(offsets.numel(), a.shape[0], b.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[e] = a[:, start:end].double().cpu() @ b[start:end].double().cpu()
        start = end
    return out
