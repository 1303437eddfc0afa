"""``ExpertParallelFunction``: the autograd of the expert-parallel routed experts.

Legend as in :mod:`lrmoe.parallel.plan`; ``_L`` tensors hold this rank's El local experts
(the owner shard) or, inside, its L local instances (own experts and replicas; L = El
under fixed ownership). The steps are the exchanges of :mod:`lrmoe.parallel.dispatch`
around the one expert core of :mod:`lrmoe.moe.experts` (the same GEMMs, selection and
compaction as one device); with a placement policy the layout of each call comes from the
planner and replica weights and gradients move by :mod:`lrmoe.parallel.replicas`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from lrmoe.utils.phases import phase

from lrmoe import ops
from lrmoe.moe.config import LRMoEConfig
from lrmoe.moe.experts import expert_backward, expert_forward
from lrmoe.moe.selection import select_pairs
from lrmoe.moe.offload import offload_for
from lrmoe.parallel.dispatch import (combine, combine_dx, dispatch, dispatch_grads,
                                     exchange_counts)
from lrmoe.parallel.group import announce_failure
from lrmoe.parallel.plan import build_plan


class ExpertParallelFunction(torch.autograd.Function):
    """Autograd of the expert-parallel routed experts (see :mod:`lrmoe.parallel`).

    ``apply(x_TH, weights_TK, expert_ids_TK, w_gate_up_L2IH, w_down_LHI, config, stats,
    group, replicas=None)`` with the LOCAL expert shards (El = E / W); the other arguments
    as :class:`lrmoe.moe.experts.ExpertFunction`; ``replicas``: the layer's
    :class:`lrmoe.parallel.replicas.ReplicaState` (a placement policy) or None (fixed
    ownership, no planner). A collective: every rank of ``group`` must call forward and
    backward (a rank with T = 0 included). The returned gradient of the shard holds the
    gradients of every instance of its experts (replicas summed in).

    Returns:
        o_TH: (T, H), dtype of x.

    Raises:
        RuntimeError / ValueError: as :func:`lrmoe.parallel.dispatch.exchange_counts` (a
            rank failed before the dispatch; configs or compute dtypes differ).
    """

    @staticmethod
    def forward(ctx, x_TH, weights_TK, expert_ids_TK, w_gate_up_L2IH, w_down_LHI,
                config: LRMoEConfig, stats, group, replicas=None):
        top_k, el = expert_ids_TK.shape[1], w_gate_up_L2IH.shape[0]
        try:
            with phase("permute"):
                row_pair_P, pair_row_P, n_E, offsets_E = ops.permute(expert_ids_TK,
                                                                     config.num_experts)
                x_PH = ops.gather_rows(x_TH, row_pair_P, None, top_k)
        except Exception:
            announce_failure(config, group, 0 if replicas is None else 1)
            raise
        rank = dist.get_rank(group)
        placement = None if replicas is None else replicas.placement
        fresh = 0 if replicas is None else replicas.fresh_flag()
        counts_host, counts_WE, flags = exchange_counts(n_E, config, group, x_TH.dtype,
                                                        placement, fresh)
        if replicas is not None:
            replicas.note_stale_checksum(fresh, flags, rank)
        layout = None
        if replicas is not None:
            with phase("plan"):
                layout = replicas.layout(counts_host, config, rank, el)
        plan = build_plan(counts_host, counts_WE, rank, el, config, layout)
        w_gate_up_I2IH, w_down_IHI = w_gate_up_L2IH, w_down_LHI  # this rank's instances
        if plan.weights.moves:
            # every rank's pushed copies must match this layout, else all fetch now
            use_pushed = bool(flags) and all(flags) and replicas.copies_fresh(plan.layout)
            w_gate_up_I2IH, w_down_IHI = replicas.instance_weights(
                w_gate_up_L2IH, w_down_LHI, plan.weights, use_pushed, group)
        x_NH = dispatch(x_PH, plan, group)
        h_N2I, phi_sq_N, y_NH = expert_forward(x_NH, w_gate_up_I2IH, w_down_IHI,
                                               plan.offsets_L)
        y_PH, phi_sq_P = combine(y_NH, phi_sq_N, plan, group, x_PH.shape[0])
        with phase("combine"):
            o_TH = ops.combine(y_PH, pair_row_P, weights_TK, top_k)

        # offload (lrmoe/moe/offload.py): the received x rows and h wait in host memory
        ctx.offload = offload_for(config.backward.offload, stats)
        if ctx.offload is not None:
            ctx.x_stored, ctx.h_stored = ctx.offload.store(x_NH), ctx.offload.store(h_N2I)
            x_NH = h_N2I = None
        ctx.save_for_backward(x_NH, h_N2I, weights_TK, w_gate_up_I2IH, w_down_IHI, y_PH,
                              phi_sq_P, row_pair_P, pair_row_P, offsets_E)
        ctx.config, ctx.stats, ctx.group, ctx.plan = config, stats, group, plan
        ctx.replicas, ctx.num_local_experts = replicas, el
        ctx.x_dtype = x_TH.dtype
        row_bytes = x_TH.shape[1] * x_TH.element_size()
        stats.tokens_per_expert_E = plan.tokens_per_expert_E
        stats.num_pairs = x_PH.shape[0]
        stats.a2a_bytes = {
            "forward_dispatch": x_PH.shape[0] * row_bytes,
            "forward_combine": plan.num_received * (row_bytes + 4),
            "counts": (config.num_experts + 1 + (replicas is not None)) * 8 * plan.world,
        }
        if replicas is not None:
            replicas.stats.splits.update({
                "dispatch": (list(plan.input_splits), row_bytes),
                "combine": (list(plan.output_splits), row_bytes + 4)})
        return o_TH

    @staticmethod
    def backward(ctx, grad_TH):
        (x_NH, h_N2I, weights_TK, w_gate_up_I2IH, w_down_IHI, y_PH, phi_sq_P, row_pair_P,
         pair_row_P, offsets_E) = ctx.saved_tensors
        cfg, stats, group, plan = ctx.config, ctx.stats, ctx.group, ctx.plan
        top_k = weights_TK.shape[1]
        g_TH = grad_TH.to(ctx.x_dtype).contiguous()

        # quotas and shares come from the plan (the forward's host counts): no sync here;
        # the selection's segments are this rank's (instance, source) cells, so each
        # instance keeps exactly its planned share of the rows it ran
        kept = select_pairs(cfg, stats, g_TH, weights_TK, y_PH, phi_sq_P, row_pair_P,
                            pair_row_P, plan.cell_offsets_I,
                            lambda score_P: (plan.quota_E, plan.share_I, plan.num_retained))
        positions_R = kept.kept_rows_R
        if positions_R is None:  # selection off: every row, in row order
            positions_R = torch.arange(row_pair_P.shape[0], dtype=torch.int32,
                                       device=g_TH.device)
        with phase("compact"):
            G_RH = ops.gather_rows(g_TH, kept.kept_pair_R, kept.scale_R, top_k)
        G_MH, rows_M, order_M = dispatch_grads(G_RH, positions_R, plan, group)
        if ctx.offload is None:
            with phase("compact"):
                X_MH = ops.gather_rows(x_NH, rows_M, None, 1)
            h_rows_M = rows_M  # the kept rows of h are read in place, as on one device
        else:  # offload: reload only the kept rows of x and h, compacted
            X_MH = ctx.offload.load(ctx.x_stored, rows_M)
            h_N2I, h_rows_M = ctx.offload.load(ctx.h_stored, rows_M), None
        dx_MH, grad_w_gate_up_L2IH, grad_w_down_LHI, buffers = expert_backward(
            G_MH, X_MH, h_N2I, h_rows_M, w_gate_up_I2IH, w_down_IHI, plan.kept_offsets_L)
        dx_RH = combine_dx(dx_MH, order_M, plan, group)
        if plan.weights.moves:  # per instance -> the owner shard, replicas summed in
            grad_w_gate_up_L2IH, grad_w_down_LHI = ctx.replicas.reduce_grads(
                grad_w_gate_up_L2IH, grad_w_down_LHI, plan.weights, ctx.num_local_experts,
                group)
        with phase("scatter"):
            grad_x_TH = ops.combine(dx_RH, kept.pair_kept_P, None, top_k)

        row_bytes = g_TH.shape[1] * g_TH.element_size()
        stats.a2a_bytes = dict(stats.a2a_bytes or {})
        stats.a2a_bytes.update({"backward_grad": kept.num_retained * row_bytes,
                                "backward_index": kept.num_retained * 4,
                                "backward_dx": plan.num_grad_received * row_bytes})
        if ctx.replicas is not None:
            ctx.replicas.stats.splits.update({
                "grad": (list(plan.grad_input_splits), row_bytes),
                "dx": (list(plan.grad_output_splits), row_bytes)})
        stats.record_buffers(buffers)
        return (grad_x_TH.to(ctx.x_dtype), kept.grad_weights_TK.to(weights_TK.dtype), None,
                grad_w_gate_up_L2IH, grad_w_down_LHI, None, None, None, None)
