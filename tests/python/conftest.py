"""Shared test fixtures and the independent float64 references.

Everything here is plain PyTorch (or plain Python), written from the definitions in
docs/algorithm.md -- never from the code under test.
"""
from __future__ import annotations

import os
import sys
from fractions import Fraction
from pathlib import Path
from typing import List, Optional

import pytest
import torch
import torch.nn.functional as F

# The test folders mirror lrmoe/'s packages. A few helpers are shared across them by
# module name -- the spawn harness of parallel/test_expert_parallel.py, the micro run of
# training/test_train.py, the layer references of moe/test_layer.py -- so every folder is
# importable from every test (and from the ranks mp.spawn starts, which inherit sys.path).
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and not _folder.name.startswith(("_", ".")):
        sys.path.insert(0, str(_folder))


# Scripts the tests start as programs (experiments/*.py, torchrun workers) import lrmoe
# from this tree, not from whatever copy is installed -- and find it where nothing is
# installed (the GPU image builds lrmoe._C in place and has no .pth for the repo).
_REPO = str(Path(__file__).resolve().parents[2])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _REPO])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------ quotas (exact rationals)
def ref_proportional_quota(loads: List[int], c: Fraction) -> List[int]:
    """Largest-remainder apportionment of floor((1-c) N), ties to the lower index."""
    keep = 1 - Fraction(c)
    total = int(keep * sum(loads)) if sum(loads) else 0
    ideal = [keep * n for n in loads]
    base = [int(v) for v in ideal]  # floor for non-negative rationals
    order = sorted(range(len(loads)), key=lambda e: (-(ideal[e] - base[e]), e))
    for e in order[: total - sum(base)]:
        base[e] += 1
    return base


def ref_water_level_quota(loads: List[int], c: Fraction) -> List[int]:
    """Largest level L with sum min(n, L) <= S; extras to the most loaded above L."""
    target = int((1 - Fraction(c)) * sum(loads))
    level = max(L for L in range(max(loads) + 1) if sum(min(n, L) for n in loads) <= target)
    q = [min(n, level) for n in loads]
    above = sorted((e for e, n in enumerate(loads) if n > level), key=lambda e: (-loads[e], e))
    for e in above[: target - sum(q)]:
        q[e] += 1
    return q


# ------------------------------------------------------------------ splitmix64 (independent)
_MASK = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def ref_uniform01(seed: int, stream: int, index: int) -> float:
    h = _splitmix64(_splitmix64((seed & _MASK) ^ (stream << 56)) ^ index)
    return (h >> 40) / float(1 << 24)


# ------------------------------------------------------------------ float64 MoE reference
def ref_routing(x, router_w, top_k, norm_topk_prob=True, router="softmax", bias=None,
                scaling=1.0):
    logits = x.double() @ router_w.double().t()
    if router == "softmax":
        probs = torch.softmax(logits, dim=-1)
        w, ids = torch.topk(probs, top_k, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + (0 if bias is None else bias.double()), top_k, dim=-1).indices
        w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w * scaling, ids


def ref_experts(x, weights, ids, w_gate_up, w_down, keep: Optional[torch.Tensor] = None):
    """o_t = sum_k alpha y; pairs with keep == False pass no gradient into the experts
    (nor into x through them) but keep the exact router gradient <g, y>.

    x (T, H), weights (T, K), ids (T, K), w_gate_up (E, 2I, H), w_down (E, H, I); keep
    (T*K,) bool in pair order. Returns (o (T, H), phi (T*K, I)).
    """
    T, K = ids.shape
    inter = w_down.shape[2]
    h = torch.einsum("tkih,th->tki", w_gate_up[ids], x)
    gate, up = h[..., :inter], h[..., inter:]
    phi = F.silu(gate) * up
    y = torch.einsum("tkhi,tki->tkh", w_down[ids], phi)
    if keep is not None:
        keep = keep.view(T, K, 1)
        y = torch.where(keep, y, y.detach())
    o = (weights.unsqueeze(-1) * y).sum(1)
    return o, phi.reshape(T * K, inter)


def ref_scores(metric, g, weights, phi, seed=0):
    """Per-pair scores in pair order, float64."""
    T, K = weights.shape
    g = g.double()
    gsq = (g * g).sum(-1).repeat_interleave(K)
    if metric == "lrm":
        return weights.double().reshape(-1) ** 2 * gsq * (phi.double() ** 2).sum(-1)
    if metric == "grad_sq":
        return gsq
    if metric == "grad_abs":
        return g.abs().sum(-1).repeat_interleave(K)
    if metric == "random":
        return torch.tensor([ref_uniform01(seed, 1, p) for p in range(T * K)],
                            dtype=torch.float64)
    raise ValueError(metric)


def ref_topk_keep(scores, ids, quota):
    """Per expert, keep the quota[e] highest scores; ties to the lower pair id."""
    ids = ids.reshape(-1).tolist()
    s = scores.tolist()
    keep = torch.zeros(len(ids), dtype=torch.bool)
    for e, q in enumerate(quota):
        pairs = sorted((p for p, ex in enumerate(ids) if ex == e), key=lambda p: (-s[p], p))
        keep[pairs[:q]] = True
    return keep


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
