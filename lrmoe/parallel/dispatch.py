"""The expert-parallel exchanges, one function per step, following a
:class:`lrmoe.parallel.plan.DispatchPlan`.

Legend as in :mod:`lrmoe.parallel.plan` (W ranks, E experts, El local experts, P local
pairs, N rows received by this rank's experts, R kept local pairs, M kept rows received).

Forward:  :func:`exchange_counts` (all_gather of the (E,) counts + config hash; the one
host sync) -> :func:`dispatch` (x rows to their experts, re-sorted to expert order) ->
expert core -> :func:`combine` (y rows and the fp32 phi_sq side band back to their source).
Backward: :func:`dispatch_grads` (only the kept rows of G and their int32 row positions
go to the experts, which find the matching saved rows) -> expert core -> :func:`combine_dx`
(dX of the kept rows back). The names follow the token dispatchers of Megatron-LM
(``token_dispatch``/``token_combine``) and torchtitan.
"""
from __future__ import annotations

from typing import Any, List, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor
from lrmoe.utils.phases import phase

from lrmoe import ops
from lrmoe.moe.config import LRMoEConfig
from lrmoe.parallel.group import comm_device, config_hash, raise_on_mismatch
from lrmoe.parallel.plan import DispatchPlan, h2d, inverse_permutation


def exchange_counts(tokens_per_expert_E: Tensor, config: LRMoEConfig, group,
                    dtype: torch.dtype, placement: Any = None, flag: Union[int, Tensor] = 0
                    ) -> Tuple[List[List[int]], Tensor, List[int]]:
    """All-gather every rank's routed counts, with the config hash riding along
    (``lrmoe.a2a_counts`` range; fails fast on ``set_recalibration`` drift).

    A collective; its ``.tolist()`` is the one host sync of the dispatch.

    Args:
        tokens_per_expert_E: (E,) int32 this rank's routed pairs per expert.
        config: this rank's layer config (hashed with the EP size and ``dtype``).
        dtype: the compute dtype of the expert inputs.
        placement: the layer's :class:`lrmoe.parallel.placement.Placement` (hashed too),
            or None. With one, an int64 ``flag`` per rank rides along as well (whether
            its pushed replica copies are fresh: an int, or a () device tensor that
            joins without a host sync of its own), so every rank learns all flags
            without another collective.

    Returns:
        (counts_host: W lists of E ints n[s][e], counts_WE: (W, E) int64 on the device of
        ``tokens_per_expert_E``, flags: the W flags, [] without a placement).

    Raises:
        RuntimeError: another rank announced a failure before the dispatch.
        ValueError: ranks disagree on the config or the compute dtype.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = tokens_per_expert_E.device
    parts = [tokens_per_expert_E.long()]
    if placement is not None:  # a device flag joins without a sync of its own
        parts.append(flag.to(dev, torch.int64).view(1) if isinstance(flag, Tensor)
                     else h2d([int(flag)], torch.int64, dev))
    parts.append(h2d([config_hash(config, world, dtype, placement)], torch.int64, dev))
    with phase("a2a_counts"):
        meta = torch.cat(parts)
        meta_comm = meta.to(comm_device(group))
        got = [torch.empty_like(meta_comm) for _ in range(world)]
        dist.all_gather(got, meta_comm, group=group)
        meta_WE1 = torch.stack(got).to(dev)
        meta_host = meta_WE1.tolist()  # the one host sync of the dispatch
    raise_on_mismatch([row[-1] for row in meta_host], config, world, rank, dtype, placement)
    e = tokens_per_expert_E.shape[0]
    return ([row[:e] for row in meta_host], meta_WE1[:, :e],
            [row[e] for row in meta_host] if placement is not None else [])


def dispatch(x_PH: Tensor, plan: DispatchPlan, group) -> Tensor:
    """Send each local pair's x row to its instance's rank; (P, H) -> (N, H) in instance
    order (``lrmoe.a2a_dispatch``; the re-sorts into send order and into instance order
    under ``lrmoe.permute``)."""
    if plan.send_row_P is not None:
        with phase("permute"):
            x_PH = ops.gather_rows(x_PH, plan.send_row_P, None, 1)
    with phase("a2a_dispatch"):
        x_recv_NH = all_to_all_rows(x_PH, plan.num_received, plan.input_splits,
                                    plan.output_splits, group)
    with phase("permute"):
        return ops.gather_rows(x_recv_NH, plan.expert_to_arrival_N, None, 1)


def combine(y_NH: Tensor, phi_sq_N: Tensor, plan: DispatchPlan, group,
            num_pairs: int) -> Tuple[Tensor, Tensor]:
    """Return the expert outputs (expert order) and their fp32 ||phi||^2 to the source
    ranks: (N, H), (N,) -> (P, H), (P,) in this rank's row order (``lrmoe.permute`` for the
    un-sort, then ``lrmoe.a2a_combine``)."""
    with phase("permute"):
        y_recv_NH = ops.gather_rows(y_NH, plan.arrival_to_expert_N, None, 1)
        phi_sq_recv_N = phi_sq_N.index_select(0, plan.arrival_to_expert_N)
    with phase("a2a_combine"):
        y_PH = all_to_all_rows(y_recv_NH, num_pairs, plan.output_splits, plan.input_splits,
                               group)
        phi_sq_P = all_to_all_rows(phi_sq_recv_N, num_pairs, plan.output_splits,
                                   plan.input_splits, group)
    if plan.send_pos_P is not None:  # send order -> this rank's row order
        with phase("permute"):
            y_PH = ops.gather_rows(y_PH, plan.send_pos_P, None, 1)
            phi_sq_P = phi_sq_P.index_select(0, plan.send_pos_P)
    return y_PH, phi_sq_P


def dispatch_grads(G_RH: Tensor, positions_R: Tensor, plan: DispatchPlan, group
                   ) -> Tuple[Tensor, Tensor, Tensor]:
    """Send the kept gradient rows and their row positions to the experts' ranks.

    Args:
        G_RH: (R, H) kept pair gradients, in this rank's row order.
        positions_R: (R,) int32 row (in this rank's expert-sorted order) of each; with
            replicas the rows go in send order (``plan.grad_send_R``) and carry their
            forward send positions, so the instance finds its saved rows.

    Returns:
        (G_MH (M, H) the received rows in expert order; rows_M (M,) int32 their rows in
        the forward's expert order, i.e. of the saved x and h, ascending; order_M (M,)
        int64 the arrival position of each, for :func:`combine_dx`).
    """
    m = plan.num_grad_received
    positions_R = positions_R.to(torch.int32)
    if plan.send_pos_P is not None:
        with phase("compact"):
            positions_R = plan.send_pos_P.index_select(0, positions_R.long())
            G_RH = ops.gather_rows(G_RH, plan.grad_send_R, None, 1)
            positions_R = positions_R.index_select(0, plan.grad_send_R.long())
    with phase("a2a_grad"):
        G_recv_MH = all_to_all_rows(G_RH, m, plan.grad_input_splits, plan.grad_output_splits,
                                    group)
        pos_recv_M = all_to_all_rows(positions_R, m, plan.grad_input_splits,
                                     plan.grad_output_splits, group)
    with phase("compact"):
        # position in source s's row order -> arrival row of the forward -> expert order
        row_M = plan.arrival_to_expert_N.index_select(0, pos_recv_M.long() + plan.grad_base_M)
        rows_M, order_M = torch.sort(row_M)  # (local expert, source) order
        G_MH = ops.gather_rows(G_recv_MH, order_M.to(torch.int32), None, 1)
    return G_MH, rows_M, order_M


def combine_dx(dx_MH: Tensor, order_M: Tensor, plan: DispatchPlan, group) -> Tensor:
    """Return dX of the kept rows to their sources, in the kept order of the selection:
    (M, H) -> (R, H) (``lrmoe.scatter`` for the un-sort, then ``lrmoe.a2a_dx``)."""
    with phase("scatter"):
        dx_recv_MH = ops.gather_rows(dx_MH, inverse_permutation(order_M).to(torch.int32),
                                     None, 1)
    with phase("a2a_dx"):
        dx_RH = all_to_all_rows(dx_recv_MH, plan.num_retained, plan.grad_output_splits,
                                plan.grad_input_splits, group)
    if plan.grad_send_R is None:
        return dx_RH
    with phase("scatter"):  # send order -> the kept order of the selection
        return ops.gather_rows(dx_RH, inverse_permutation(plan.grad_send_R), None, 1)


def all_to_all_rows(x: Tensor, out_rows: int, in_splits: List[int], out_splits: List[int],
                    group) -> Tensor:
    """``all_to_all_single`` with variable row splits (x contiguous, first dim rows):
    ``in_splits[d]`` rows go to rank d, ``out_splits[s]`` arrive from rank s; a
    collective."""
    out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return out
