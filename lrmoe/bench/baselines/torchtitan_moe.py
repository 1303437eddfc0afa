"""The ``torchtitan`` method of ``lrmoe bench layer``: torchtitan's own MoE module.

torchtitan 0.3.0 (``torchtitan.models.common.moe``): ``MoE`` = ``TokenChoiceTopKRouter``
(its gate ``Linear`` (E, H), softmax scores, top-K, optional renormalisation) ->
``RoutedExperts`` (``LocalTokenDispatcher``: stable argsort of the expert ids, gathered
rows; ``GroupedExperts``: ``torch._grouped_mm`` in bf16 for w1 and w3, SwiGLU, w2; the
dispatcher's deterministic ``scatter_add`` with the routing scores) + an optional shared
``FeedForward``. Its backward is autograd's, every routed pair both ways.

Built at the case shape on the LRMoE layer's weights (copied): router ``gate.weight`` =
our ``gate.weight``; ``w1_EFD`` (E, I, H) = the gate rows ``gate_up_proj[:, :I]``,
``w3_EFD`` = the up rows ``gate_up_proj[:, I:]`` (ours is (E, 2I, H), rows [gate; up]);
``w2_EDF`` (E, H, I) = ``down_proj``; shared expert ``w1, w3, w2`` = ``gate_proj,
up_proj, down_proj``. Routing is forced to the case's expert ids the way the
transformers method forces the Qwen3 gate: the router's ``forward`` is replaced by the
same computation with the given ids instead of its top-K (gate in float32 -- what its
``torch.autocast(dtype=float32)`` gives on CUDA, written out so the CPU, where autocast
has no float32, computes the same -- softmax, gather, renormalise, scale).

Install beside torch 2.11 (its other requirements are for training, not this module):
``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17
docstring_parser==0.18.0 typeguard==4.6.1`` (and ``triton``, which CUDA builds of torch
bring). Its experts always compute in bf16, so its agreement tolerance is bf16-level
even in a float32 run.

Legend: T tokens, H hidden (torchtitan's D), I expert intermediate (its F), E experts,
K top_k; B = 1, L = T (torchtitan takes (B, L, D) inputs).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from lrmoe.bench.method import BF16_TOL, Method
from lrmoe.bench.cases import Case
from lrmoe.layer import LRMoELayer
from lrmoe.utils.phases import phase

INSTALL = ("pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 "
           "docstring_parser==0.18.0 typeguard==4.6.1")


@functools.lru_cache(maxsize=1)
def torchtitan_missing() -> Optional[str]:
    """None where torchtitan's MoE module imports, else why not and how to install it."""
    try:
        from torchtitan.models.common import moe  # noqa: F401
    except Exception as exc:  # a missing dependency, or a torchtitan built for another torch
        return (f"torchtitan's MoE module cannot be imported ({exc}); install it with "
                f"`{INSTALL}`")
    return None


def torchtitan_method(base: LRMoELayer, case: Case, device: torch.device) -> Method:
    """torchtitan's ``MoE`` at the case shape on ``base``'s weights, routing forced.

    Args:
        base: the LRMoE layer whose router, experts and shared expert are copied.
        case: shape and dtype. device: where the module lives.

    Returns:
        A :class:`lrmoe.bench.method.Method` named ``torchtitan``.

    Raises:
        ValueError: torchtitan not importable (with the install line), or a layer config
            torchtitan's module cannot express (sigmoid router, gated shared expert).
    """
    missing = torchtitan_missing()
    if missing is not None:
        raise ValueError(f"--methods torchtitan: {missing}")
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (MoE, GroupedExperts, RoutedExperts,
                                              TokenChoiceTopKRouter)
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    cfg = base.config
    if cfg.router != "softmax" or base.shared_expert_gate is not None:
        raise ValueError("the torchtitan method needs a softmax router and an ungated "
                         f"shared expert; this layer has router={cfg.router!r}, "
                         f"shared_expert_gate={cfg.shared_expert_gate}")
    d = case.dims
    h, i, e, k, s = d["hidden"], d["inter"], d["experts"], d["top_k"], d["shared"]

    def linear(n_in, n_out):
        return Linear.Config(in_features=n_in, out_features=n_out)
    shared = (FeedForward.Config(w1=linear(h, s), w2=linear(s, h), w3=linear(h, s))
              if s else None)
    block = MoE.Config(
        num_experts=e,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=h, hidden_dim=i, num_experts=e),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=e, gate=linear(h, e), top_k=k, score_func="softmax",
            route_norm=cfg.norm_topk_prob, route_scale=cfg.routed_scaling_factor),
        load_balance_coeff=None,  # its bias only steers the top-K, which is forced here
        shared_experts=shared).build()
    block.to(device=device, dtype=case.dtype)
    block.tokens_per_expert_E = block.tokens_per_expert_E.float()  # a counter, fp32 there
    experts = block.routed_experts.inner_experts
    with torch.no_grad():
        block.router.gate.weight.copy_(base.gate.weight)
        experts.w1_EFD.copy_(base.experts.gate_up_proj[:, :i])
        experts.w3_EFD.copy_(base.experts.gate_up_proj[:, i:])
        experts.w2_EDF.copy_(base.experts.down_proj)
        if shared is not None:
            block.shared_experts.w1.weight.copy_(base.shared_expert.gate_proj.weight)
            block.shared_experts.w3.weight.copy_(base.shared_expert.up_proj.weight)
            block.shared_experts.w2.weight.copy_(base.shared_expert.down_proj.weight)
    router = block.router
    forced = {}

    def router_forward(x_BLD, expert_bias_E=None):
        with phase("router"):
            scores_BLE = torch.softmax(F.linear(x_BLD.float(), router.gate.weight.float()),
                                       dim=-1)
            ids_BLK = forced["ids"].view(*x_BLD.shape[:2], k)
            top_BLK = scores_BLE.gather(-1, ids_BLK)
            if router.route_norm:
                top_BLK = top_BLK / (top_BLK.sum(dim=-1, keepdim=True) + 1e-20)
            return top_BLK * router.route_scale, ids_BLK, scores_BLE
    router.forward = router_forward

    def run(x_TH, ids_TK):
        forced["ids"] = ids_TK
        return block(x_TH.unsqueeze(0)).squeeze(0)
    return Method("torchtitan", None, run, list(block.parameters()), base, BF16_TOL,
                  module=block)
