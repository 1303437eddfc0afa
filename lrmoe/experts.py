"""Routed SwiGLU experts: exact forward, planned (selective) backward -- the one expert core.

Legend: T tokens, K top_k, P = T*K routed pairs, E experts, H hidden size, I expert
intermediate size, R = floor((1 - c) P) retained pairs, N rows an expert core computes
(P on one device; the rows this rank's experts received under expert parallelism).
Rows are pairs in expert-sorted order (``lrmoe.ops.permute``).

Forward (every pair, exact):  x_PH = x[token of row] -> h_P2I = x_PH W_gate_up[e]^T ->
phi_PI, phi_sq_P = swiglu(h) -> y_PH = phi W_down[e]^T -> o_T = sum_k alpha y.

Backward (docs/algorithm.md sections 2-6): dalpha = <g_t, y_u> for every pair (exact
router gradient); quota Q_E from the routed loads; score every pair; keep the best Q_e of
each expert; gather only the kept rows into R-row buffers (G = alpha g, X; the kept rows of
h are read in place through their indices by the SwiGLU kernels), then grouped GEMMs
dphi = G W_down, dW_down = G^T phi, swiglu backward, dW_gate_up = dH^T X,
dX = dH W_gate_up, and dx_t = sum of the kept dX rows of token t.

The pieces shared with the expert-parallel path (:mod:`lrmoe.parallel`) live here once:
:func:`expert_forward` (grouped GEMMs + SwiGLU), :func:`select_pairs` (router gradient,
score, quota, select, scale) and :func:`expert_backward` (compacted GEMMs over the kept
rows, h read in place, buffer accounting).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.profiler import record_function as phase  # names the benchmark's breakdown

from lrmoe import ops
from lrmoe.config import LRMoEConfig
from lrmoe.offload import OffloadStats, PendingRows, offload_for, ready


def dropped_fraction(num_retained: int, num_pairs: int) -> Optional[float]:
    """The dropped fraction 1 - R / P of routed pairs (docs/algorithm.md section 7).

    The one definition used by :meth:`BackwardStats.summary` and by model-level summaries
    (sum R and P over layers first, then divide). Returns None for P = 0.
    """
    return 1.0 - num_retained / num_pairs if num_pairs else None


@dataclass
class BackwardStats:
    """Per-step diagnostics of one layer, written by the forward and the backward.

    Tensors stay on the layer's device (reading them is the only sync); all are
    refreshed every step.

    Attributes:
        tokens_per_expert_E: (E,) int32 routed pairs n_e (forward).
        quota_E: (E,) int32 retention quotas Q_e (backward).
        retained_mass: () float32, sum of kept scores / sum of all scores (backward).
        num_pairs: P. num_retained: R (host ints).
        buffers: name -> shape of the backward's expert buffers (all sized by R).
        buffer_bytes: bytes of those buffers.
        kept_pair_R: (R,) int32 pair ids (t*K + k) whose expert backward ran (backward).
        backward_steps: number of backwards run so far (also offsets the seed).
        a2a_bytes: expert parallel only (``lrmoe.parallel``): bytes this rank passed to
            each all-to-all (``forward_dispatch``, ``forward_combine`` incl. the fp32
            phi_sq side band, ``backward_grad``, ``backward_index``, ``backward_dx``).
        offload: :class:`lrmoe.offload.OffloadStats` of the last step with
            ``offload = "activations"``, else None.
    """

    tokens_per_expert_E: Optional[Tensor] = None
    quota_E: Optional[Tensor] = None
    retained_mass: Optional[Tensor] = None
    num_pairs: int = 0
    num_retained: int = 0
    buffer_bytes: int = 0
    backward_steps: int = 0
    kept_pair_R: Optional[Tensor] = None
    buffers: Dict[str, tuple] = field(default_factory=dict)
    #: expert parallel only: bytes this rank handed to each all-to-all of the last step
    a2a_bytes: Dict[str, int] = field(default_factory=dict)
    offload: Optional[OffloadStats] = None

    def record_buffers(self, buffers: Dict[str, Tensor]) -> None:
        """Keep the shapes and the total bytes of the backward's expert buffers."""
        self.buffers = {k: tuple(v.shape) for k, v in buffers.items()}
        self.buffer_bytes = sum(v.numel() * v.element_size() for v in buffers.values())

    def summary(self) -> Dict[str, object]:
        """Host-side numbers of the last step (synchronises with the device).

        Returns:
            dict with ``tokens_per_expert`` and ``quota`` (lists of int), ``dropped_fraction``
            (:func:`dropped_fraction`), ``retained_mass`` (float), ``load_max_over_mean_before``
            (max n_e / mean n_e), ``load_max_over_mean_after`` (max Q_e / mean Q_e),
            ``num_pairs``, ``num_retained`` and ``backward_buffer_bytes``. Backward entries
            are None before the first backward. With offload also ``offload_d2h_bytes``
            and ``offload_h2d_bytes`` (:class:`lrmoe.offload.OffloadStats`).
        """
        out: Dict[str, object] = {"num_pairs": self.num_pairs}
        n = self.tokens_per_expert_E
        out["tokens_per_expert"] = None if n is None else n.tolist()
        out["load_max_over_mean_before"] = None if n is None else _max_over_mean(n)
        q = self.quota_E
        out["quota"] = None if q is None else q.tolist()
        out["load_max_over_mean_after"] = None if q is None else _max_over_mean(q)
        out["num_retained"] = self.num_retained if q is not None else None
        out["dropped_fraction"] = (dropped_fraction(self.num_retained, self.num_pairs)
                                   if q is not None else None)
        out["retained_mass"] = (None if self.retained_mass is None
                                else float(self.retained_mass))
        out["backward_buffer_bytes"] = self.buffer_bytes if q is not None else None
        if self.a2a_bytes:
            out["a2a_bytes"] = dict(self.a2a_bytes)
        if self.offload is not None:
            out["offload_d2h_bytes"] = self.offload.d2h_bytes
            out["offload_h2d_bytes"] = self.offload.h2d_bytes
        return out


def _max_over_mean(n_E: Tensor) -> float:
    n = n_E.double()
    mean = n.mean()
    return float(n.max() / mean) if mean > 0 else 0.0


# ------------------------------------------------------------------------ expert core
def expert_forward(x_NH: Tensor, w_gate_up_E2IH: Tensor, w_down_EHI: Tensor,
                   offsets_E: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Grouped GEMMs + SwiGLU of every row (``lrmoe.expert_gemm_fwd`` range).

    Args:
        x_NH: (N, H) float expert inputs, rows grouped by expert.
        w_gate_up_E2IH: (E, 2I, H) and w_down_EHI: (E, H, I), dtype of x (E = the experts
            this core holds: all of them, or this rank's shard).
        offsets_E: (E,) int32 inclusive ends of each expert's rows.

    Returns:
        (h_N2I (N, 2I) pre-activations, kept for the backward; phi_sq_N (N,) float32
        ||phi||^2, the LRM by-product; y_NH (N, H) expert outputs), dtype of x.
    """
    with phase("lrmoe.expert_gemm_fwd"):
        h_N2I = ops.grouped_mm(x_NH, w_gate_up_E2IH.transpose(1, 2), offsets_E)
        phi_NI, phi_sq_N = ops.swiglu(h_N2I)
        y_NH = ops.grouped_mm(phi_NI, w_down_EHI.transpose(1, 2), offsets_E)
    return h_N2I, phi_sq_N, y_NH


def expert_backward(G_RH: Tensor, X_RH: Union[Tensor, PendingRows],
                    h_N2I: Union[Tensor, PendingRows], h_rows_R: Optional[Tensor],
                    w_gate_up_E2IH: Tensor, w_down_EHI: Tensor, kept_offsets_E: Tensor
                    ) -> Tuple[Tensor, Tensor, Tensor, Dict[str, Tensor]]:
    """Compacted expert backward over the R kept rows (``lrmoe.expert_gemm_bwd`` range).

    The kept rows of the saved h are read in place through ``h_rows_R`` by the SwiGLU
    kernels (the compaction fused into their loads; docs/algorithm.md section 6), never
    copied. With offload (:mod:`lrmoe.offload`) X and h arrive as reloads in flight;
    dphi, which reads neither, is issued first so that the reload of h runs under it.

    Args:
        G_RH: (R, H) kept pair gradients s * alpha * g, grouped by expert.
        X_RH: (R, H) the matching expert inputs (or their pending reload).
        h_N2I: (N, 2I) pre-activations saved by :func:`expert_forward` (or the pending
            reload of its kept rows, then (R, 2I) with ``h_rows_R`` None).
        h_rows_R: (R,) int32 row of h of each kept row, or None when R = N in row order.
        w_gate_up_E2IH, w_down_EHI: the expert weights, dtype of G.
        kept_offsets_E: (E,) int32 inclusive ends of each expert's kept rows.

    Returns:
        (dx_RH (R, H) input gradient of each kept row, dW_gate_up (E, 2I, H),
        dW_down (E, H, I), buffers: name -> tensor of every R-row buffer, for
        :meth:`BackwardStats.record_buffers`).
    """
    with phase("lrmoe.expert_gemm_bwd"):
        dphi_RI = ops.grouped_mm(G_RH, w_down_EHI, kept_offsets_E)
        h_N2I = ready(h_N2I)  # offload: the wait for the reloaded h rows
        phi_RI, _ = ops.swiglu(h_N2I, h_rows_R)
        grad_w_down_EHI = ops.grouped_mm(G_RH.t(), phi_RI, kept_offsets_E)
        dh_R2I = ops.swiglu_backward(dphi_RI, h_N2I, h_rows_R)
        X_RH = ready(X_RH)  # offload: the wait for the reloaded x rows (expert parallel)
        grad_w_gate_up_E2IH = ops.grouped_mm(dh_R2I.t(), X_RH, kept_offsets_E)
        dx_RH = ops.grouped_mm(dh_R2I, w_gate_up_E2IH, kept_offsets_E)
    buffers = {"G": G_RH, "X": X_RH, "phi": phi_RI, "dphi": dphi_RI, "dh": dh_R2I,
               "dx": dx_RH}
    return dx_RH, grad_w_gate_up_E2IH, grad_w_down_EHI, buffers


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


#: (score_P or None) -> (quota_E reported in the stats, share_E this caller's rows may
#: keep per expert, R = sum of the shares): the global quotas and this rank's shares
#: under EP; score_P (the pairs' scores, row order) is None when selection is off
Quotas = Callable[[Optional[Tensor]], Tuple[Tensor, Tensor, int]]


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

    Writes ``stats.quota_E``, ``retained_mass``, ``num_retained``, ``kept_pair_R`` and
    advances ``stats.backward_steps`` (whose value offsets the seed of ``random`` and
    ``importance``: seed = ``(cfg.seed + backward_steps) mod 2**63``).

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
    with phase("lrmoe.router_grad"):  # exact for every pair: needs no expert backward
        grad_weights_TK = ops.routing_weight_grad(g_TH, y_PH, pair_row_P, top_k)
    alpha_P = weights_TK.detach().reshape(-1).float()
    if cfg.selective_backward:
        # int64 on the op side: layer offsets and step counts wrap instead of overflowing
        seed = (cfg.seed + stats.backward_steps) % (1 << 63)
        with phase("lrmoe.score"):
            score_P = ops.score(g_TH, weights_TK.detach(), phi_sq_P, row_pair_P, cfg.metric,
                                seed)
        with phase("lrmoe.select"):
            quota_E, share_E, num_retained = quotas(score_P)
            kept_rows_R, kept_pair_R, pair_kept_P, kept_offsets_E, kept_scale_R, mass = (
                ops.select(score_P, row_pair_P, offsets_E, share_E, num_retained,
                           cfg.selection, seed))
        with phase("lrmoe.compact"):
            scale_R = alpha_P.index_select(0, kept_pair_R) * kept_scale_R
    else:
        quota_E, _, num_retained = quotas(None)
        kept_rows_R, kept_pair_R, pair_kept_P, kept_offsets_E = (None, row_pair_P,
                                                                 pair_row_P, offsets_E)
        mass = None
        with phase("lrmoe.compact"):
            scale_R = alpha_P.index_select(0, row_pair_P)
    stats.quota_E, stats.retained_mass = quota_E, mass
    stats.num_retained, stats.kept_pair_R = num_retained, kept_pair_R
    stats.backward_steps += 1
    return KeptPairs(grad_weights_TK, kept_rows_R, kept_pair_R, pair_kept_P, kept_offsets_E,
                     scale_R, num_retained)


# --------------------------------------------------------------- single-device autograd
class ExpertFunction(torch.autograd.Function):
    """Autograd of the routed experts on one device; see the module docstring.

    ``apply(x_TH, weights_TK, expert_ids_TK, w_gate_up_E2IH, w_down_EHI, config, stats)``

    Args:
        x_TH: (T, H) float (fp32/bf16/fp16/fp64).
        weights_TK: (T, K) float32 routing weights (their gradient is exact).
        expert_ids_TK: (T, K) int64/int32 selected experts.
        w_gate_up_E2IH: (E, 2I, H) stacked [gate; up] weights, dtype of x.
        w_down_EHI: (E, H, I) stacked down weights, dtype of x.
        config: :class:`LRMoEConfig` (recalibration rate, metric, quota rule, selection).
        stats: :class:`BackwardStats` that receives the diagnostics.

    Returns:
        o_TH: (T, H), dtype of x.
    """

    @staticmethod
    def forward(ctx, x_TH, weights_TK, expert_ids_TK, w_gate_up_E2IH, w_down_EHI,
                config: LRMoEConfig, stats: BackwardStats):
        num_experts, top_k = w_gate_up_E2IH.shape[0], expert_ids_TK.shape[1]
        with phase("lrmoe.permute"):
            row_pair_P, pair_row_P, tokens_per_expert_E, offsets_E = ops.permute(
                expert_ids_TK, num_experts)
            # each token row read once, written to its K rows (= gather by row_pair_P)
            x_PH = ops.dispatch_rows(x_TH, pair_row_P, None, row_pair_P.shape[0], top_k)
        h_P2I, phi_sq_P, y_PH = expert_forward(x_PH, w_gate_up_E2IH, w_down_EHI, offsets_E)
        with phase("lrmoe.combine"):
            o_TH = ops.combine(y_PH, pair_row_P, weights_TK, top_k)

        # offload (lrmoe/offload.py): h waits in host memory; x_TH is the layer input,
        # held by autograd for the router anyway, so it stays
        ctx.offload = offload_for(config.offload, stats)
        if ctx.offload is not None:
            ctx.h_stored, h_P2I = ctx.offload.store(h_P2I), None
        ctx.save_for_backward(x_TH, weights_TK, w_gate_up_E2IH, w_down_EHI, h_P2I, y_PH,
                              phi_sq_P, row_pair_P, pair_row_P, tokens_per_expert_E,
                              offsets_E)
        ctx.config, ctx.stats, ctx.top_k = config, stats, top_k
        stats.tokens_per_expert_E = tokens_per_expert_E
        stats.num_pairs = row_pair_P.shape[0]
        return o_TH

    @staticmethod
    def backward(ctx, grad_TH):
        (x_TH, weights_TK, w_gate_up_E2IH, w_down_EHI, h_P2I, y_PH, phi_sq_P, row_pair_P,
         pair_row_P, tokens_per_expert_E, offsets_E) = ctx.saved_tensors
        cfg, stats, top_k = ctx.config, ctx.stats, ctx.top_k
        g_TH = grad_TH.to(x_TH.dtype).contiguous()
        num_pairs = row_pair_P.shape[0]

        def quotas(score_P):
            if not cfg.selective_backward:
                return tokens_per_expert_E, tokens_per_expert_E, num_pairs
            if cfg.retained_mass_target > 0:  # the adaptive rate: this step's scores decide
                rate = adaptive_rate(score_P, offsets_E, tokens_per_expert_E,
                                     cfg.retained_mass_target, cfg.recalibration_rate,
                                     cfg.quota_rule)
                quota_E = ops.quota(tokens_per_expert_E, rate, cfg.quota_rule)
                return quota_E, quota_E, ops.retained_total(num_pairs, rate)
            quota_E = ops.quota(tokens_per_expert_E, cfg.recalibration_rate, cfg.quota_rule)
            return quota_E, quota_E, cfg.retained_pairs(num_pairs)

        kept = select_pairs(cfg, stats, g_TH, weights_TK, y_PH, phi_sq_P, row_pair_P,
                            pair_row_P, offsets_E, quotas)
        h_rows_R = kept.kept_rows_R
        if ctx.offload is not None:  # offload: reload only the kept rows of h, compacted
            h_P2I = ctx.offload.load(ctx.h_stored, kept.kept_rows_R, ascending=True)
            h_rows_R = None
        # compacted buffers: every one has R rows. The scatter form of the compaction
        # gather: each token's g and x row is read once and written to its kept slots
        # (pair_kept_P is the inverse of kept_pair_R), bit-identical to gathering them
        with phase("lrmoe.compact"):
            G_RH = ops.dispatch_rows(g_TH, kept.pair_kept_P, kept.scale_R, kept.num_retained,
                                     top_k)
            X_RH = ops.dispatch_rows(x_TH, kept.pair_kept_P, None, kept.num_retained, top_k)
        dx_RH, grad_w_gate_up_E2IH, grad_w_down_EHI, buffers = expert_backward(
            G_RH, X_RH, h_P2I, h_rows_R, w_gate_up_E2IH, w_down_EHI, kept.kept_offsets_E)
        with phase("lrmoe.scatter"):
            grad_x_TH = ops.combine(dx_RH, kept.pair_kept_P, None, top_k)
        stats.record_buffers(buffers)
        return (grad_x_TH.to(x_TH.dtype), kept.grad_weights_TK.to(weights_TK.dtype), None,
                grad_w_gate_up_E2IH, grad_w_down_EHI, None, None)
