"""The cases of ``lrmoe bench layer`` and their inputs: a layer shape
(:mod:`lrmoe.workload.shapes`), a token count, a routing kind (:mod:`lrmoe.workload.routing`).
Every method of a case sees the same forced expert ids, token states and output gradients.

Legend: T tokens, H hidden, E experts, K top_k.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional, Sequence

import torch

from lrmoe.moe.stats import max_over_mean
from lrmoe.workload.routing import ROUTING_SEED_STRIDE, make_routing
from lrmoe.workload.shapes import SHAPES


@dataclasses.dataclass
class Case:
    """One benchmark case: a layer shape (key of :data:`lrmoe.workload.shapes.SHAPES`), a token count T (per
    rank under expert parallelism), a routing kind and the activation dtype."""

    shape: str
    tokens: int
    routing: str
    dtype: torch.dtype

    @property
    def dims(self) -> dict:
        """The shape's ``hidden``/``inter``/``experts``/``top_k``/``shared``."""
        return SHAPES[self.shape].dims


def cases(shapes: Sequence[str], tokens: Sequence[int], routings: Sequence[str],
          dtype: torch.dtype, device: torch.device) -> Iterator[Case]:
    """Every (shape, tokens, routing) :class:`Case`; frees the CUDA cache after each."""
    for shape in shapes:
        for t in tokens:
            for routing in routings:
                yield Case(shape, t, routing, dtype)
                if device.type == "cuda":
                    torch.cuda.empty_cache()


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


def load_imbalance(ids: torch.Tensor, num_experts: int) -> Optional[float]:
    """max / mean of the routed loads n_e of (T, K) expert ids
    (:func:`lrmoe.moe.stats.max_over_mean`; None for no tokens)."""
    return max_over_mean(torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts))
