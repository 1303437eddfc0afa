"""The dispatch plan of one expert-parallel MoE layer call, computed once from the counts.

Legend: W ranks in the EP group, r this rank, E experts (global), El = E / W local experts
(rank d owns experts ``[d*El, (d+1)*El)``), P local pairs, N rows this rank's experts
receive in the forward, R pairs this rank keeps in the backward, M kept rows its experts
receive in the backward. *Source* rank: the token owner; *expert* rank: the expert's owner.

After the counts exchange every rank holds the same (W, E) matrix n[s][e] of routed pairs
(on the host: the dispatch's one host sync). Everything the layer moves in the forward and
the backward follows from it, so it is derived here, once, identically on every rank and
with no further collective or host sync (docs/algorithm.md section 8):

* forward: the all-to-all splits (Megatron-LM's ``input_splits``/``output_splits``), the
  permutation from arrival order ((source, local expert) blocks) to expert order ((local
  expert, source): what the grouped GEMMs want) and the per-local-expert offsets;
* backward: the global quotas Q_e (``ops.quota`` of the summed loads), each source's share
  of them (:func:`source_shares`), the splits of the gradient and dx all-to-alls, the base
  that turns a source's row position into an arrival row, and the kept offsets.

With a placement policy (:mod:`lrmoe.parallel.replicas`) an expert has several
*instances* (owner copy and replicas, :class:`InstanceLayout` from the planner): the
forward split of n[s][e] over them and the retained rows per (instance, source) cell are
the planner's, sources send in (destination rank, instance) order, each rank's expert
core runs its L local instances, and the selection fills each cell's share; the
exchanges in :mod:`lrmoe.parallel.dispatch` only follow the splits. Without a policy the
layout is fixed ownership (one instance per expert, every extra permutation the identity).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from lrmoe.utils.phases import phase

from lrmoe import ops
from lrmoe.moe.config import LRMoEConfig


@dataclass(frozen=True)
class InstanceLayout:
    """Where each expert runs: the part of a :class:`lrmoe.planner.plan.Plan` the exchanges
    follow (docs/planner.md, "Executing a plan"). Host int64 CPU tensors.

    Instances are numbered expert-major (expert e's instances are
    ``[instance_offsets[e], instance_offsets[e + 1])``), so a source's expert-sorted rows
    are also instance-sorted: of its n[s][e] rows of expert e, the first
    ``forward_IW[i0, s]`` run on the first instance, the next on the second, and so on.

    Attributes:
        instance_offsets: (E + 1,) int64.
        instance_rank: (I,) int64 rank of each instance (one instance of an expert per
            rank at most).
        forward_IW: (I, W) int64 forward rows of each (instance, source) cell; an expert's
            cells sum to ``n[:, e]``.
        retained_IW: (I, W) int64 rows of each cell that keep their backward
            (``<= forward_IW``); an expert's cells sum to its quota.
    """

    instance_offsets: Tensor
    instance_rank: Tensor
    forward_IW: Tensor
    retained_IW: Tensor

    @classmethod
    def fixed(cls, counts_WE: Tensor, shares_WE: Tensor, num_local_experts: int
              ) -> "InstanceLayout":
        """Fixed ownership: one instance per expert at rank e // El (host (W, E) counts
        and backward shares)."""
        num_experts = counts_WE.shape[1]
        return cls(torch.arange(num_experts + 1, dtype=torch.int64),
                   torch.arange(num_experts, dtype=torch.int64) // num_local_experts,
                   counts_WE.t().long().contiguous(), shares_WE.t().long().contiguous())

    def instance_expert(self) -> Tensor:
        """(I,) int64 expert of each instance."""
        sizes = self.instance_offsets[1:] - self.instance_offsets[:-1]
        return torch.repeat_interleave(torch.arange(sizes.numel()), sizes)


@dataclass(frozen=True)
class WeightRoutes:
    """How replica weights reach their instances and their gradients return to the
    owner (rank e // El holds the parameters of expert e); executed by
    :mod:`lrmoe.parallel.replicas`. Host ints only; "remote" instances are those on a rank
    other than the expert's owner.

    Attributes:
        local_weight_index: L ints: row of ``cat([own shard (El), fetched (F)])`` that
            holds each local instance's weights.
        send_local: local expert indices this rank (as owner) sends, grouped by
            destination rank (rank order), instance order within.
        send_splits: W ints, experts sent to each rank.
        recv_splits: W ints, experts received from each owner (F = their sum), in the
            order of this rank's remote instances (instance order is owner order).
        remote_local: the F local-instance positions of the fetched rows.
        owned_local: (local instance, own shard index) pairs of this rank's own experts
            that have an instance here.
        moves: whether any expert's weights move anywhere (identical on every rank, so
            the exchanges of :mod:`lrmoe.parallel.replicas` run on all ranks or none).
    """

    local_weight_index: List[int]
    send_local: List[int]
    send_splits: List[int]
    recv_splits: List[int]
    remote_local: List[int]
    owned_local: List[Tuple[int, int]]
    moves: bool


@dataclass(frozen=True)
class DispatchPlan:
    """Splits, permutations and quotas of one EP layer call (see the module docstring).

    Host lists are plain ints; tensors live on the layer's device. "Cells" are the
    (instance, source) blocks of :class:`InstanceLayout`; under fixed ownership an
    instance is its expert (I = E, L = El) and every permutation is the identity (None).

    Attributes:
        world, rank, num_local_experts: W, r, El.
        num_local_instances: L, instances on this rank (El under fixed ownership).
        tokens_per_expert_E: (E,) int32 global routed loads N_e = sum_s n[s][e].
        input_splits: W ints, rows this rank sends to each rank (forward dispatch).
        output_splits: W ints, rows this rank's instances receive from each source.
        num_received: N = sum(output_splits).
        send_row_P: (P,) int32 row (expert-sorted order) sent at each send position, or
            None (identity: the rows of each destination are contiguous already).
        send_pos_P: (P,) int32 its inverse (None with it).
        arrival_to_expert_N: (N,) int32 instance-order row of each arrival row.
        expert_to_arrival_N: (N,) int32 its inverse.
        offsets_L: (L,) int32 inclusive ends of the local instances' rows.
        cell_offsets_I: (I,) int32 inclusive ends of this rank's rows per instance cell
            (row order): the selection's segments.
        quota_E: (E,) int32 global quotas Q_e (the loads when selection is off).
        share_E: (E,) int32 this rank's share of each Q_e (its own rows it may keep).
        share_I: (I,) int32 this rank's retained rows per cell (sum over an expert's
            cells = ``share_E``).
        num_retained: R = sum(share_E).
        grad_send_R: (R,) int32 kept-buffer index sent at each gradient send position,
            or None (identity).
        grad_input_splits: W ints, kept gradient rows this rank sends to each rank.
        grad_output_splits: W ints, kept rows its instances receive from each source.
        num_grad_received: M = sum(grad_output_splits).
        grad_base_M: (M,) int64: arrival row = source send position + base.
        kept_offsets_L: (L,) int32 inclusive ends of the kept rows per local instance.
        layout: the :class:`InstanceLayout` executed.
        weights: :class:`WeightRoutes` (``moves`` False under fixed ownership).
    """

    world: int
    rank: int
    num_local_experts: int
    num_local_instances: int
    tokens_per_expert_E: Tensor
    input_splits: List[int]
    output_splits: List[int]
    num_received: int
    send_row_P: Optional[Tensor]
    send_pos_P: Optional[Tensor]
    arrival_to_expert_N: Tensor
    expert_to_arrival_N: Tensor
    offsets_L: Tensor
    cell_offsets_I: Tensor
    quota_E: Tensor
    share_E: Tensor
    share_I: Tensor
    num_retained: int
    grad_send_R: Optional[Tensor]
    grad_input_splits: List[int]
    grad_output_splits: List[int]
    num_grad_received: int
    grad_base_M: Tensor
    kept_offsets_L: Tensor
    layout: InstanceLayout
    weights: WeightRoutes


def build_plan(counts_host: List[List[int]], counts_WE: Tensor, rank: int,
               num_local_experts: int, config: LRMoEConfig,
               layout: Optional[InstanceLayout] = None) -> DispatchPlan:
    """The :class:`DispatchPlan` of this rank from the exchanged counts.

    Ranges: the forward part runs under ``lrmoe.permute`` (device ops, no sync), the
    backward part (quotas and shares, exact C++ on host tensors) under ``lrmoe.select``.

    Args:
        counts_host: W lists of E ints, n[s][e] (the host copy of ``counts_WE``).
        counts_WE: (W, E) integer tensor of the same counts on the layer's device.
        rank: this rank r. num_local_experts: El.
        config: the layer config (c, quota rule, ``selective_backward``).
        layout: where each pair runs and keeps its backward (from a placement policy,
            :func:`lrmoe.parallel.replicas.plan_layout`); None: fixed ownership with the
            quotas of ``config`` split over the sources (:func:`source_shares`).
    """
    world, el, dev = len(counts_host), num_local_experts, counts_WE.device
    counts_cpu = torch.tensor(counts_host, dtype=torch.int32).reshape(world, -1)
    loads_cpu = counts_cpu.sum(0).to(torch.int32)
    if layout is None:
        with phase("select"):
            if config.backward.selective_backward:
                # the same exact C++ as on the device, on host tensors: no device sync
                quota_cpu = ops.quota(loads_cpu, config.backward.recalibration_rate, config.backward.quota_rule)
                shares_cpu = source_shares(counts_cpu, quota_cpu)
            else:
                shares_cpu = counts_cpu
        layout = InstanceLayout.fixed(counts_cpu, shares_cpu, el)
    expert_I = layout.instance_expert()
    rank_I = layout.instance_rank
    fwd_IW, kept_IW = layout.forward_IW, layout.retained_IW
    local_I = (rank_I == rank).nonzero().flatten()
    fwd_LW, kept_LW = fwd_IW[local_I], kept_IW[local_I]
    # sources send in (destination rank, instance) order; rows of one destination are
    # contiguous in row order already when the instance ranks do not decrease
    identity = bool((rank_I[1:] >= rank_I[:-1]).all())
    by_dest_I = torch.sort(rank_I, stable=True).indices
    input_splits = _rank_sums(fwd_IW[:, rank], rank_I, world)
    output_splits = fwd_LW.sum(0).tolist()
    num_received = sum(output_splits)
    with phase("permute"):
        send_row_P = send_pos_P = None
        if not identity:
            send_row = _cell_permutation(fwd_IW[:, rank], by_dest_I)
            send_row_P = h2d(send_row, torch.int32, dev)
            send_pos_P = h2d(inverse_permutation(send_row), torch.int32, dev)
        dest_N, offsets_L = _source_to_expert_order(h2d(fwd_LW.t(), torch.int64, dev),
                                                    num_received)

    with phase("select"):
        share_I = kept_IW[:, rank]
        share_E = torch.zeros(loads_cpu.numel(), dtype=torch.int64).index_add_(
            0, expert_I, share_I)
        quota_cpu = torch.zeros_like(share_E).index_add_(0, expert_I, kept_IW.sum(1))
        num_retained = int(share_I.sum())
        grad_send_R = None
        if not identity:
            grad_send_R = h2d(_cell_permutation(share_I, by_dest_I), torch.int32, dev)
        grad_input_splits = _rank_sums(share_I, rank_I, world)
        grad_output_splits = kept_LW.sum(0).tolist()
        num_grad_received = sum(grad_output_splits)
        # source s sends forward send positions; its rows for this rank start at send
        # position send_start[s] and arrived at arrival_start[s]
        arrival_start = [sum(output_splits[:s]) for s in range(world)]
        before_I = rank_I < rank
        send_start = fwd_IW[before_I].sum(0).tolist() if world else []
        base_W = h2d([a - b for a, b in zip(arrival_start, send_start)], torch.int64, dev)
        grad_base_M = torch.repeat_interleave(
            base_W, h2d(grad_output_splits, torch.int64, dev), output_size=num_grad_received)
        return DispatchPlan(
            world=world, rank=rank, num_local_experts=el, num_local_instances=local_I.numel(),
            tokens_per_expert_E=h2d(loads_cpu, torch.int32, dev),
            input_splits=input_splits, output_splits=output_splits, num_received=num_received,
            send_row_P=send_row_P, send_pos_P=send_pos_P,
            arrival_to_expert_N=dest_N.to(torch.int32),
            expert_to_arrival_N=inverse_permutation(dest_N).to(torch.int32),
            offsets_L=offsets_L,
            cell_offsets_I=h2d(torch.cumsum(fwd_IW[:, rank], 0), torch.int32, dev),
            quota_E=h2d(quota_cpu, torch.int32, dev), share_E=h2d(share_E, torch.int32, dev),
            share_I=h2d(share_I, torch.int32, dev), num_retained=num_retained,
            grad_send_R=grad_send_R, grad_input_splits=grad_input_splits,
            grad_output_splits=grad_output_splits, num_grad_received=num_grad_received,
            grad_base_M=grad_base_M,
            kept_offsets_L=h2d(torch.cumsum(kept_LW.sum(1), 0), torch.int32, dev),
            layout=layout, weights=weight_routes(layout, rank, el, world, expert_I))


def weight_routes(layout: InstanceLayout, rank: int, num_local_experts: int, world: int,
                  expert_I: Optional[Tensor] = None) -> WeightRoutes:
    """The :class:`WeightRoutes` of this rank for ``layout`` (pure host arithmetic,
    identical on every rank; ``expert_I``: ``layout.instance_expert()`` if known)."""
    el = num_local_experts
    expert_I = layout.instance_expert() if expert_I is None else expert_I
    if bool((layout.instance_rank == expert_I // el).all()):  # fixed ownership: no moves
        own = list(range(el))
        return WeightRoutes(own, [], [0] * world, [0] * world, [], list(zip(own, own)),
                            False)
    expert_I = expert_I.tolist()
    rank_I = layout.instance_rank.tolist()
    owner_I = [e // el for e in expert_I]
    local = [i for i, r in enumerate(rank_I) if r == rank]
    send_local, send_splits = [], [0] * world
    for d in range(world):
        for i, (r, o) in enumerate(zip(rank_I, owner_I)):
            if r == d and o == rank and d != rank:
                send_local.append(expert_I[i] - rank * el)
                send_splits[d] += 1
    recv_splits, remote_local, owned_local, index = [0] * world, [], [], []
    for pos, i in enumerate(local):
        if owner_I[i] == rank:
            owned_local.append((pos, expert_I[i] - rank * el))
            index.append(expert_I[i] - rank * el)
        else:
            recv_splits[owner_I[i]] += 1
            index.append(el + len(remote_local))
            remote_local.append(pos)
    return WeightRoutes(index, send_local, send_splits, recv_splits, remote_local,
                        owned_local, any(r != o for r, o in zip(rank_I, owner_I)))


def cell_shares(forward_IW: Tensor, instance_offsets: Tensor, quota_E: Tensor) -> Tensor:
    """Split each expert's quota over its (instance, source) cells by largest remainder
    in proportion to their forward rows (ties to the lower instance, then the lower
    source): the per-source split of :func:`source_shares` over cells, so with one
    instance per expert it equals that split. Exact integer C++ on the host.

    Args:
        forward_IW: (I, W) int64 forward rows of each cell (host).
        instance_offsets: (E + 1,) int64 instance ranges (host).
        quota_E: (E,) integer quotas, ``Q_e <= sum of e's cells``.

    Returns:
        (I, W) int64 retained rows, ``<= forward_IW``, summing to Q_e over e's cells.
    """
    num_experts = quota_E.numel()
    sizes = (instance_offsets[1:] - instance_offsets[:-1]).tolist()
    world = forward_IW.shape[1]
    depth = max(sizes) if sizes else 0
    # rows (k, s): the k-th instance of each expert from source s; a column per expert
    counts = torch.zeros(depth * world, num_experts, dtype=torch.int32)
    for e, (start, size) in enumerate(zip(instance_offsets[:-1].tolist(), sizes)):
        counts[: size * world, e] = forward_IW[start:start + size].reshape(-1).to(torch.int32)
    shares = ops.source_shares(counts, quota_E.to(torch.int32)).long()
    out = torch.zeros_like(forward_IW)
    for e, (start, size) in enumerate(zip(instance_offsets[:-1].tolist(), sizes)):
        out[start:start + size] = shares[: size * world, e].view(size, world)
    return out


def source_shares(counts_WE: Tensor, quota_E: Tensor) -> Tensor:
    """Split each expert's global quota over source ranks (largest remainder).

    share[s, e] = floor(Q_e n[s, e] / N_e) plus one for the ``Q_e - sum_s floor(...)``
    sources with the largest remainders ``Q_e n[s, e] mod N_e`` (ties to the lower rank).
    Runs :func:`lrmoe.ops.source_shares` (exact integer C++) on the counts' device, no
    host sync; identical on every rank.

    Args:
        counts_WE: (W, E) integer routed pairs of each source rank per expert.
        quota_E: (E,) global quotas, ``Q_e <= N_e = sum_s n[s, e]``.

    Returns:
        (W, E) int64 with ``sum_s share[s, e] == Q_e`` and ``share <= counts``.
    """
    return ops.source_shares(counts_WE.to(torch.int32), quota_E.to(torch.int32)).long()


def h2d(values, dtype: torch.dtype, dev: torch.device) -> Tensor:
    """A host list (or CPU tensor) as a tensor on ``dev`` without a host sync.

    A plain ``torch.tensor(..., device=cuda)`` copies from pageable memory and
    synchronises the stream; a pinned staging tensor copied with ``non_blocking`` does not
    (the caching host allocator keeps it alive until the copy has run).
    """
    t = torch.as_tensor(values, dtype=dtype)
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)


def inverse_permutation(perm: Tensor) -> Tensor:
    """inv with ``inv[perm[i]] = i`` (same dtype and device as ``perm``)."""
    inv = torch.empty_like(perm)
    inv[perm.long()] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def _rank_sums(rows_I: Tensor, rank_I: Tensor, world: int) -> List[int]:
    """Rows per rank: sum of ``rows_I`` over the instances on each rank (W ints)."""
    return torch.zeros(world, dtype=torch.int64).index_add_(0, rank_I, rows_I.long()).tolist()


def _cell_permutation(sizes_I: Tensor, order_I: Tensor) -> Tensor:
    """Rows laid out as cells of ``sizes_I`` (instance order), re-laid in the cell order
    ``order_I``: (sum,) int64 original row of each new position (host)."""
    sizes = sizes_I.long()
    starts = torch.cumsum(sizes, 0) - sizes
    sizes_o, starts_o = sizes[order_I], starts[order_I]
    total = int(sizes.sum())
    cell = torch.repeat_interleave(torch.arange(order_I.numel()), sizes_o, output_size=total)
    j = torch.arange(total) - (torch.cumsum(sizes_o, 0) - sizes_o)[cell]
    return starts_o[cell] + j


def _source_to_expert_order(blocks_WL: Tensor, num_rows: int):
    """Rows arrive as (source, local expert) blocks; experts want (local expert, source).

    Returns ``dest_N`` (int64, arrival row -> expert-order row) and the int32 inclusive
    per-local-expert offsets of the expert order.
    """
    w, el = blocks_WL.shape
    dev = blocks_WL.device
    flat = blocks_WL.reshape(-1)
    start_arrival = torch.cumsum(flat, 0) - flat
    flat_t = blocks_WL.t().reshape(-1)
    start_expert = (torch.cumsum(flat_t, 0) - flat_t).view(el, w).t().reshape(-1)
    block = torch.repeat_interleave(torch.arange(w * el, device=dev), flat,
                                    output_size=num_rows)
    j = torch.arange(num_rows, device=dev) - start_arrival[block]
    dest = start_expert[block] + j
    offsets = torch.cumsum(blocks_WL.sum(0), 0).to(torch.int32)
    return dest, offsets
