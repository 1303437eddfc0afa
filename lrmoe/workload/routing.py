"""Routing kinds of the benchmarks and of their simulated replays: ``uniform`` (K distinct
experts per token, uniformly), ``skewed`` (Zipf popularity, hot experts at random ids) and
``trace`` (rows replayed from a routing trace, :mod:`lrmoe.workload.trace`).

Legend: T tokens, E experts, K top_k.
"""
from __future__ import annotations

from typing import Optional

import torch

from lrmoe.workload.trace import trace_routing


ROUTINGS = ("uniform", "skewed", "trace")


#: input sets a benchmark rotates over by default (``lrmoe bench layer --rotate``)
DEFAULT_ROTATE = 3


#: seed of input set s on EP rank r: ``s + ROUTING_SEED_STRIDE * r`` (rank 0 = one device)
ROUTING_SEED_STRIDE = 1000


def make_routing(kind: str, num_tokens: int, num_experts: int, top_k: int, seed: int,
                 trace: Optional[str] = None, skew: float = 1.2) -> torch.Tensor:
    """(T, K) int64 distinct expert ids per token.

    ``uniform``: each token picks K distinct experts uniformly. ``skewed``: expert e has
    popularity proportional to 1 / (e + 1)^skew (Zipf), K distinct draws per token by the
    Gumbel top-k trick (Kool et al., "Stochastic Beams and Where to Find Them", ICML
    2019), experts shuffled so the hot ones sit anywhere. ``trace``: rows sampled from a
    recorded routing trace (:func:`lrmoe.workload.trace.trace_routing`).

    Raises:
        ValueError: unknown kind, or ``trace`` without a path.
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "trace":
        if not trace:
            raise ValueError("routing 'trace' needs --trace PATH (a .npz from "
                             "`lrmoe train --record-trace PATH`)")
        return trace_routing(trace, num_tokens, num_experts, top_k, seed)
    if kind == "uniform":
        logp = torch.zeros(num_experts)
    elif kind == "skewed":
        logp = -skew * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64)).float()
        logp = logp[torch.randperm(num_experts, generator=gen)]
    else:
        raise ValueError(f"routing must be uniform, skewed or trace, got {kind!r}")
    gumbel = -torch.log(-torch.log(torch.rand(num_tokens, num_experts, generator=gen)
                                   .clamp_min(1e-20)))
    return torch.topk(logp + gumbel, top_k, dim=-1).indices


