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

from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor
from lrmoe.utils.phases import phase

from lrmoe import ops
from lrmoe.moe.config import LRMoEConfig
from lrmoe.moe.offload import PendingRows, offload_for, ready
from lrmoe.moe.selection import adaptive_rate, select_pairs
from lrmoe.moe.stats import BackwardStats


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
    with phase("expert_gemm_fwd"):
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
    with phase("expert_gemm_bwd"):
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
        with phase("permute"):
            row_pair_P, pair_row_P, tokens_per_expert_E, offsets_E = ops.permute(
                expert_ids_TK, num_experts)
            # each token row read once, written to its K rows (= gather by row_pair_P)
            x_PH = ops.dispatch_rows(x_TH, pair_row_P, None, row_pair_P.shape[0], top_k)
        h_P2I, phi_sq_P, y_PH = expert_forward(x_PH, w_gate_up_E2IH, w_down_EHI, offsets_E)
        with phase("combine"):
            o_TH = ops.combine(y_PH, pair_row_P, weights_TK, top_k)

        # offload (lrmoe/moe/offload.py): h waits in host memory; x_TH is the layer input,
        # held by autograd for the router anyway, so it stays
        ctx.offload = offload_for(config.backward.offload, stats)
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
            if not cfg.backward.selective_backward:
                return tokens_per_expert_E, tokens_per_expert_E, num_pairs
            if cfg.backward.retained_mass_target > 0:  # the adaptive rate: this step's scores decide
                rate = adaptive_rate(score_P, offsets_E, tokens_per_expert_E,
                                     cfg.backward.retained_mass_target, cfg.backward.recalibration_rate,
                                     cfg.backward.quota_rule)
                quota_E = ops.quota(tokens_per_expert_E, rate, cfg.backward.quota_rule)
                return quota_E, quota_E, ops.retained_total(num_pairs, rate)
            quota_E = ops.quota(tokens_per_expert_E, cfg.backward.recalibration_rate, cfg.backward.quota_rule)
            return quota_E, quota_E, cfg.backward.retained_pairs(num_pairs)

        kept = select_pairs(cfg, stats, g_TH, weights_TK, y_PH, phi_sq_P, row_pair_P,
                            pair_row_P, offsets_E, quotas)
        h_rows_R = kept.kept_rows_R
        if ctx.offload is not None:  # offload: reload only the kept rows of h, compacted
            h_P2I = ctx.offload.load(ctx.h_stored, kept.kept_rows_R, ascending=True)
            h_rows_R = None
        # compacted buffers: every one has R rows. The scatter form of the compaction
        # gather: each token's g and x row is read once and written to its kept slots
        # (pair_kept_P is the inverse of kept_pair_R), bit-identical to gathering them
        with phase("compact"):
            G_RH = ops.dispatch_rows(g_TH, kept.pair_kept_P, kept.scale_R, kept.num_retained,
                                     top_k)
            X_RH = ops.dispatch_rows(x_TH, kept.pair_kept_P, None, kept.num_retained, top_k)
        dx_RH, grad_w_gate_up_E2IH, grad_w_down_EHI, buffers = expert_backward(
            G_RH, X_RH, h_P2I, h_rows_R, w_gate_up_E2IH, w_down_EHI, kept.kept_offsets_E)
        with phase("scatter"):
            grad_x_TH = ops.combine(dx_RH, kept.pair_kept_P, None, top_k)
        stats.record_buffers(buffers)
        return (grad_x_TH.to(x_TH.dtype), kept.grad_weights_TK.to(weights_TK.dtype), None,
                grad_w_gate_up_E2IH, grad_w_down_EHI, None, None)
