"""Configuration of an LRMoE layer: the MoE architecture and the planned backward."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Tuple

from lrmoe.moe.offload import OFFLOAD_MODES
from lrmoe.ops import METRICS, QUOTA_RULES, SELECTIONS, rate_fraction

ROUTERS = ("softmax", "sigmoid")


@dataclass
class LRMoEConfig:
    """Everything that defines one :class:`lrmoe.LRMoELayer`.

    Architecture:
        hidden_size: H, model width.
        moe_intermediate_size: I, width of each SwiGLU expert.
        num_experts: E routed experts.
        top_k: K experts per token, ``1 <= K <= E``.
        router: ``softmax`` (Qwen3/Mixtral: softmax over E, top-K, optional
            renormalisation) or ``sigmoid`` (GLM-4.5/DeepSeek-V3: sigmoid scores, top-K of
            score + expert bias, weights from the unbiased scores).
        norm_topk_prob: renormalise the K selected weights to sum to 1.
        routed_scaling_factor: multiplies the routing weights (GLM-4.5 uses 1.0 to 2.5).
        shared_expert_intermediate_size: width of an always-on shared SwiGLU expert, 0 for
            none.
        shared_expert_gate: scale the shared expert by sigmoid(x w) (Qwen2-MoE style).
        router_aux_loss_coef: weight of the load-balancing loss in ``layer.aux_loss``.
        router_z_loss_coef: weight of the router z-loss in ``layer.aux_loss``.

    Planned backward (LRMoE):
        recalibration_rate: c in [0, 1), the share of routed pairs whose expert backward
            is dropped (the paper's C10/C20/C30 are 0.1/0.2/0.3). 0 is exact training.
        metric: pair score, ``lrm`` (alpha^2 ||g||^2 ||phi||^2), ``grad_sq``, ``grad_abs``
            or ``random``.
        quota_rule: ``proportional`` or ``water_level``.
        selection: ``importance`` (default: unbiased sampling with 1/p rescaling) or
            ``topk`` (the paper's: deterministic best pairs). The default follows the
            gpu-small grid of docs/results.md, "Quality: from scratch" (3 seeds: +0.8 %
            perplexity at c = 0.3 against +16.5 % for top-k).
        seed: base seed of ``random`` and ``importance``; each backward adds its step.
        selective_backward: False runs the plain exact backward without scoring or
            selection (requires c = 0); c = 0 with True is bit-identical to it.
        retained_mass_target: 0 (default) drops exactly c of the pairs. rho* in (0, 1]:
            the adaptive rate -- per layer and step, drop the largest share of the pairs,
            at most c (``recalibration_rate`` is then the cap), that keeps the retained
            score mass at or above rho* (:func:`lrmoe.moe.selection.adaptive_rate`). One host
            sync per layer backward (the kept count depends on the scores); one device
            only (under EP the quotas are fixed in the forward, before any score exists).

    Memory:
        offload: ``none`` (default) or ``activations``: the expert forward's saved rows
            (h, and the dispatched x under EP) wait for the backward in pinned host memory
            and only the kept rows come back (:mod:`lrmoe.moe.offload`); results unchanged.

    Raises:
        ValueError: naming the field and the accepted values, on any invalid setting.
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    router: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_aux_loss_coef: float = 1e-3
    router_z_loss_coef: float = 0.0
    recalibration_rate: float = 0.0
    metric: str = "lrm"
    quota_rule: str = "proportional"
    selection: str = "importance"
    seed: int = 0
    selective_backward: bool = True
    retained_mass_target: float = 0.0
    offload: str = "none"
    #: c as the exact fraction (p, q) of the quota arithmetic; derived, not an input.
    rate_pq: Tuple[int, int] = field(init=False, repr=False, compare=False, default=(0, 1))

    def retained_pairs(self, num_pairs: int) -> int:
        """R = floor((1 - c) * num_pairs), exact (see :func:`lrmoe.ops.rate_fraction`)."""
        p, q = self.rate_pq
        return (q - p) * num_pairs // q

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LRMoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"LRMoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                "choose 1 <= top_k <= num_experts")
        c = self.recalibration_rate
        if not isinstance(c, (int, float)) or not math.isfinite(c) or not 0.0 <= c < 1.0:
            raise ValueError(
                f"LRMoEConfig.recalibration_rate must be in [0, 1), got {c!r} "
                "(0.1, 0.2, 0.3 are the paper's C10, C20, C30)")
        for name, allowed in (("metric", METRICS), ("quota_rule", QUOTA_RULES),
                              ("selection", SELECTIONS), ("router", ROUTERS),
                              ("offload", OFFLOAD_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LRMoEConfig.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("LRMoEConfig.shared_expert_intermediate_size must be >= 0 "
                             f"(0 = no shared expert), got {self.shared_expert_intermediate_size}")
        if not self.selective_backward and c != 0.0:
            raise ValueError(
                f"LRMoEConfig.selective_backward=False runs the exact backward, but "
                f"recalibration_rate={c}; set recalibration_rate=0 or selective_backward=True")
        self.rate_pq = rate_fraction(c)
        t = self.retained_mass_target
        if (not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t)
                or not 0.0 <= t <= 1.0):
            raise ValueError(f"LRMoEConfig.retained_mass_target must be 0 (off) or in (0, 1], "
                             f"got {t!r}")
        if t > 0 and c == 0.0:
            raise ValueError("LRMoEConfig.retained_mass_target > 0 picks the rate per step up "
                             "to recalibration_rate, which is 0; set recalibration_rate to the "
                             "most that may be dropped (e.g. 0.5)")
        if self.rate_pq[0] == self.rate_pq[1]:
            raise ValueError(
                f"LRMoEConfig.recalibration_rate={c!r} rounds to c = 1 (the quota arithmetic "
                "reads c as the nearest fraction with denominator <= 2**20): every pair "
                "would be dropped; choose c <= 1 - 2**-20")
        seed = self.seed
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
            raise ValueError(f"LRMoEConfig.seed must be an int in [0, 2**63), got {seed!r}")
        if self.routed_scaling_factor <= 0 or not math.isfinite(self.routed_scaling_factor):
            raise ValueError("LRMoEConfig.routed_scaling_factor must be a positive finite "
                             f"float, got {self.routed_scaling_factor!r}")

    def replace(self, **changes) -> "LRMoEConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
