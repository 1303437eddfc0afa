"""Which routed pairs keep their expert backward: the exact router gradient, the pair
scores (the LRM R = alpha^2 ||g||^2 ||phi||^2 or another metric), the retention quotas, the
selection (top-k or importance sampling) and the compaction indices (docs/algorithm.md
sections 2-5), plus the adaptive rate of ``retained_mass_target``. Shared by the
one-device core (:mod:`lrmoe.moe.experts`) and the expert-parallel path
(:mod:`lrmoe.parallel.function`).

Legend: T tokens, K top_k, P = T*K routed pairs, E experts, H hidden size, R kept pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from lrmoe import ops
from lrmoe.moe.config import LRMoEConfig
from lrmoe.moe.stats import BackwardStats
from lrmoe.utils.phases import phase

#: (score_P or None) -> (quota_E reported in the stats, share_E this caller's rows may
#: keep per expert, R = sum of the shares): the global quotas and this rank's shares
#: under EP; score_P (the pairs' scores, row order) is None when selection is off
Quotas = Callable[[Optional[Tensor]], Tuple[Tensor, Tensor, int]]


@dataclass(frozen=True)
class KeptPairs:
    """The pairs whose expert backward runs, from :func:`select_pairs`.

    Attributes:
        grad_weights_TK: (T, K) float32 exact router-side gradient <g_t, y_u>.
        kept_rows_R: (R,) int32 kept rows (ascending, in row order), or None when
            selection is off (every row kept, R = P).
        kept_pair_R: (R,) int32 pair id of each kept row.
        pair_kept_P: (P,) int32 buffer position of each pair, -1 if dropped.
        kept_offsets_E: (E,) int32 inclusive ends of the kept rows per expert.
        scale_R: (R,) float32 alpha * kept scale (1, or 1/p under ``importance``).
        num_retained: R (host int).
    """

    grad_weights_TK: Tensor
    kept_rows_R: Optional[Tensor]
    kept_pair_R: Tensor
    pair_kept_P: Tensor
    kept_offsets_E: Tensor
    scale_R: Tensor
    num_retained: int


def adaptive_rate(score_P: Tensor, offsets_E: Tensor, tokens_per_expert_E: Tensor,
                  target: float, max_rate: float, rule: str) -> float:
    """The recalibration rate of ``retained_mass_target`` (the adaptive rate).

    The largest share of the pairs that can be dropped while the kept pairs hold at least
    ``target`` of the total score, with the pairs kept the way the layer keeps them: at
    rate c the quota rule gives Q_e(c) and expert e keeps its Q_e best pairs, so the
    retained mass is rho(R) = sum_e (sum of the Q_e largest scores of e) / sum of all
    scores. Returns c = 1 - R / P for the smallest R in [R_min, P] with rho(R) >= target
    (R_min = floor((1 - max_rate) P): the cap), found by bisection on R (rho grows with R;
    a step where largest-remainder rounding makes it dip is walked up). Exact for
    ``topk``; with ``importance`` the rate is set by the same top-Q mass.

    Args:
        score_P: (P,) float32 pair scores (>= 0) in row order (experts contiguous).
        offsets_E: (E,) int32 inclusive ends of the experts' rows.
        tokens_per_expert_E: (E,) int32 routed pairs n_e.
        target: rho* in (0, 1].
        max_rate: the cap c_max in [0, 1).
        rule: the quota rule (``proportional`` or ``water_level``).

    Returns:
        The rate as a float in [0, max_rate] (0 for P = 0). One host sync (the per-expert
        sorted prefix sums come to the host once; the bisection runs there).
    """
    num_pairs = score_P.shape[0]
    if num_pairs == 0:
        return 0.0
    n_E = tokens_per_expert_E.long()
    expert_P = torch.repeat_interleave(torch.arange(n_E.shape[0], device=n_E.device), n_E,
                                       output_size=num_pairs)
    # descending scores within each expert: by score, then (stably) by expert
    by_score = torch.sort(score_P.double(), descending=True, stable=True)
    by_expert = torch.sort(expert_P[by_score.indices], stable=True).indices
    cum_P = by_score.values[by_expert].cumsum(0)
    cum = torch.cat([cum_P.new_zeros(1), cum_P]).cpu()  # the one sync
    n_cpu = tokens_per_expert_E.cpu()
    start_E = (offsets_E.long().cpu() - n_cpu.long())
    total = float(cum[-1])

    def kept(r: int):
        rate = min(max_rate, 1.0 - r / num_pairs)
        q_E = ops.quota(n_cpu, rate, rule).long()
        mass = float((cum[start_E + q_E] - cum[start_E]).sum())
        return rate, mass >= target * total

    lo = ops.retained_total(num_pairs, max_rate)
    rate, ok = kept(lo)
    if ok:
        return rate
    hi = num_pairs  # kept(P) holds: every pair is kept
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kept(mid)[1]:
            hi = mid
        else:
            lo = mid
    while hi < num_pairs and not kept(hi)[1]:  # a rounding dip: walk up
        hi += 1
    return kept(hi)[0]


def select_pairs(cfg: LRMoEConfig, stats: BackwardStats, g_TH: Tensor, weights_TK: Tensor,
                 y_PH: Tensor, phi_sq_P: Tensor, row_pair_P: Tensor, pair_row_P: Tensor,
                 offsets_E: Tensor, quotas: Quotas) -> KeptPairs:
    """The backward's selection preamble: router gradient, score, quota, select, scale.

    Writes ``stats.quota_E``, ``retained_mass``, ``num_retained``, ``kept_pair_R``,
    ``kept_scale_R`` and
    advances ``stats.backward_steps`` (whose value offsets the seed of ``random`` and
    ``importance``: seed = ``(cfg.backward.seed + backward_steps) mod 2**63``).

    Args:
        cfg: the layer config (metric, selection, ``selective_backward``).
        stats: receives the diagnostics.
        g_TH: (T, H) gradient at the layer output, dtype of the experts.
        weights_TK: (T, K) float32 routing weights alpha.
        y_PH: (P, H) expert outputs in row order; phi_sq_P: (P,) float32 ||phi||^2.
        row_pair_P, pair_row_P, offsets_E: this caller's permutation (``ops.permute``).
        quotas: see :data:`Quotas`; called inside the ``lrmoe.select`` range.

    Returns:
        :class:`KeptPairs`.
    """
    top_k = weights_TK.shape[1]
    with phase("router_grad"):  # exact for every pair: needs no expert backward
        grad_weights_TK = ops.routing_weight_grad(g_TH, y_PH, pair_row_P, top_k)
    alpha_P = weights_TK.detach().reshape(-1).float()
    if cfg.backward.selective_backward:
        # int64 on the op side: layer offsets and step counts wrap instead of overflowing
        seed = (cfg.backward.base_seed + stats.backward_steps) % (1 << 63)
        with phase("score"):
            score_P = ops.score(g_TH, weights_TK.detach(), phi_sq_P, row_pair_P, cfg.backward.metric,
                                seed)
        with phase("select"):
            quota_E, share_E, num_retained = quotas(score_P)
            kept_rows_R, kept_pair_R, pair_kept_P, kept_offsets_E, kept_scale_R, mass = (
                ops.select(score_P, row_pair_P, offsets_E, share_E, num_retained,
                           cfg.backward.selection, seed))
        with phase("compact"):
            scale_R = alpha_P.index_select(0, kept_pair_R) * kept_scale_R
    else:
        quota_E, _, num_retained = quotas(None)
        kept_rows_R, kept_pair_R, pair_kept_P, kept_offsets_E = (None, row_pair_P,
                                                                 pair_row_P, offsets_E)
        mass = kept_scale_R = None
        with phase("compact"):
            scale_R = alpha_P.index_select(0, row_pair_P)
    stats.quota_E, stats.retained_mass = quota_E, mass
    stats.num_retained, stats.kept_pair_R = num_retained, kept_pair_R
    stats.kept_scale_R = kept_scale_R
    stats.backward_steps += 1
    return KeptPairs(grad_weights_TK, kept_rows_R, kept_pair_R, pair_kept_P, kept_offsets_E,
                     scale_R, num_retained)
