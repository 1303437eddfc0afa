"""The cases of ``lrmoe bench layer``: layer shapes, routing kinds and the inputs of a case.

Routing kinds: ``uniform`` (K distinct experts per token, uniformly), ``skewed`` (Zipf
popularity, hot experts at random ids) and ``trace`` (rows replayed from a routing trace
recorded by ``lrmoe train --record-trace``, :mod:`lrmoe.trace`). Every method of a case
sees the same forced expert ids, token states and output gradients.

Legend: T tokens, H hidden, E experts, K top_k.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Sequence

import torch

#: the layer shapes of docs/performance.md; ``smoke`` is the tiny CPU run of CI
SHAPES: Dict[str, dict] = {
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8, shared=0),
    "glm-4.5-air": dict(hidden=4096, inter=1408, experts=128, top_k=8, shared=1408),
    "smoke": dict(hidden=64, inter=32, experts=8, top_k=2, shared=32),
}
ROUTINGS = ("uniform", "skewed", "trace")

#: input sets a benchmark rotates over by default (``lrmoe bench layer --rotate``)
DEFAULT_ROTATE = 3

#: seed of input set s on EP rank r: ``s + ROUTING_SEED_STRIDE * r`` (rank 0 = one device)
ROUTING_SEED_STRIDE = 1000


@dataclasses.dataclass
class Case:
    """One benchmark case: a layer shape (key of :data:`SHAPES`), a token count T (per
    rank under expert parallelism), a routing kind and the activation dtype."""

    shape: str
    tokens: int
    routing: str
    dtype: torch.dtype

    @property
    def dims(self) -> dict:
        return SHAPES[self.shape]


def cases(shapes: Sequence[str], tokens: Sequence[int], routings: Sequence[str],
          dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    """Every (shape, tokens, routing) :class:`Case`; frees the CUDA cache after each."""
    for shape in shapes:
        for t in tokens:
            for routing in routings:
                yield Case(shape, t, routing, dtype)
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def make_routing(kind: str, num_tokens: int, num_experts: int, top_k: int, seed: int,
                 trace: Optional[str] = None, skew: float = 1.2) -> torch.Tensor:
    """(T, K) int64 distinct expert ids per token.

    ``uniform``: each token picks K distinct experts uniformly. ``skewed``: expert e has
    popularity proportional to 1 / (e + 1)^skew (Zipf), K distinct draws per token by the
    Gumbel top-k trick (Kool et al., "Stochastic Beams and Where to Find Them", ICML
    2019), experts shuffled so the hot ones sit anywhere. ``trace``: rows sampled from a
    recorded routing trace (:func:`lrmoe.trace.trace_routing`).

    Raises:
        ValueError: unknown kind, or ``trace`` without a path.
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "trace":
        if not trace:
            raise ValueError("routing 'trace' needs --trace PATH (a .npz from "
                             "`lrmoe train --record-trace PATH`)")
        from lrmoe.trace import trace_routing
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


def load_imbalance(ids: torch.Tensor, num_experts: int) -> float:
    """max / mean of the routed loads n_e of (T, K) expert ids."""
    n = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts).double()
    return float(n.max() / n.mean())


@dataclasses.dataclass
class Inputs:
    """``rotate`` input sets of one case on one rank: ids (T, K) int64, x and g (T, H)."""

    ids: List[torch.Tensor]
    xs: List[torch.Tensor]
    gs: List[torch.Tensor]
    routing_seeds: List[int]


def make_inputs(case: Case, device: torch.device, rotate: int, trace: Optional[str],
                rank: int = 0) -> Inputs:
    """The case's routing (seed ``s + ROUTING_SEED_STRIDE * rank`` for set s), token
    states x and output gradients g (one CPU generator seeded ``1 + ROUTING_SEED_STRIDE *
    rank``), moved to ``device`` in ``case.dtype``. Rank 0 gets the single-device inputs.
    """
    d = case.dims
    seeds = [s + ROUTING_SEED_STRIDE * rank for s in range(rotate)]
    ids = [make_routing(case.routing, case.tokens, d["experts"], d["top_k"], seed=s,
                        trace=trace).to(device) for s in seeds]
    gen = torch.Generator(device="cpu").manual_seed(1 + ROUTING_SEED_STRIDE * rank)
    xs = [torch.randn(case.tokens, d["hidden"], generator=gen).to(device, case.dtype)
          for _ in range(rotate)]
    gs = [torch.randn(case.tokens, d["hidden"], generator=gen).to(device, case.dtype)
          for _ in range(rotate)]
    return Inputs(ids, xs, gs, seeds)
