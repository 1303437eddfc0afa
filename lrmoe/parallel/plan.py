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

This is where a placement of expert instances plugs in next: with replicas an expert has
several instances, the forward split of n[s][e] over them and the backward shares per
(source, instance) are the plan's to decide, and the exchanges in
:mod:`lrmoe.parallel.dispatch` only follow the splits.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import List, Sequence

import torch
from torch import Tensor
from torch.profiler import record_function as phase  # names the benchmark's breakdown

from lrmoe import ops
from lrmoe.config import LRMoEConfig


@dataclass(frozen=True)
class DispatchPlan:
    """Splits, permutations and quotas of one EP layer call (see the module docstring).

    Host lists are plain ints; tensors live on the layer's device.

    Attributes:
        world, rank, num_local_experts: W, r, El.
        tokens_per_expert_E: (E,) int32 global routed loads N_e = sum_s n[s][e].
        input_splits: W ints, rows this rank sends to each expert rank (forward dispatch).
        output_splits: W ints, rows this rank's experts receive from each source.
        num_received: N = sum(output_splits).
        arrival_to_expert_N: (N,) int32 expert-order row of each arrival row.
        expert_to_arrival_N: (N,) int32 its inverse.
        offsets_L: (El,) int32 inclusive ends of the local experts' rows (expert order).
        quota_E: (E,) int32 global quotas Q_e (the loads when selection is off).
        share_E: (E,) int32 this rank's share of each Q_e (its own rows it may keep).
        num_retained: R = sum(share_E).
        grad_input_splits: W ints, kept gradient rows this rank sends to each expert rank.
        grad_output_splits: W ints, kept rows its experts receive from each source.
        num_grad_received: M = sum(grad_output_splits).
        grad_base_M: (M,) int64: arrival row = source row position + base.
        kept_offsets_L: (El,) int32 inclusive ends of the kept rows per local expert.
    """

    world: int
    rank: int
    num_local_experts: int
    tokens_per_expert_E: Tensor
    input_splits: List[int]
    output_splits: List[int]
    num_received: int
    arrival_to_expert_N: Tensor
    expert_to_arrival_N: Tensor
    offsets_L: Tensor
    quota_E: Tensor
    share_E: Tensor
    num_retained: int
    grad_input_splits: List[int]
    grad_output_splits: List[int]
    num_grad_received: int
    grad_base_M: Tensor
    kept_offsets_L: Tensor


def build_plan(counts_host: List[List[int]], counts_WE: Tensor, rank: int,
               num_local_experts: int, config: LRMoEConfig) -> DispatchPlan:
    """The :class:`DispatchPlan` of this rank from the exchanged counts.

    Ranges: the forward part runs under ``lrmoe.permute`` (device ops, no sync), the
    backward part (quotas and shares, exact C++ on host tensors) under ``lrmoe.select``.

    Args:
        counts_host: W lists of E ints, n[s][e] (the host copy of ``counts_WE``).
        counts_WE: (W, E) integer tensor of the same counts on the layer's device.
        rank: this rank r. num_local_experts: El.
        config: the layer config (c, quota rule, ``selective_backward``).
    """
    world, el, dev = len(counts_host), num_local_experts, counts_WE.device
    mine = slice(rank * el, (rank + 1) * el)
    input_splits = [_block_sums(counts_host[rank], d * el, (d + 1) * el) for d in range(world)]
    output_splits = [_block_sums(counts_host[s], rank * el, (rank + 1) * el)
                     for s in range(world)]
    num_received = sum(output_splits)
    with phase("lrmoe.permute"):
        dest_N, offsets_L = _source_to_expert_order(counts_WE[:, mine], num_received)

    with phase("lrmoe.select"):
        counts_cpu = torch.tensor(counts_host, dtype=torch.int32).reshape(world, -1)
        loads_cpu = counts_cpu.sum(0).to(torch.int32)
        if config.selective_backward:
            # the same exact C++ as on the device, on host tensors: no device sync
            quota_cpu = ops.quota(loads_cpu, config.recalibration_rate, config.quota_rule)
            shares = source_shares(counts_cpu, quota_cpu).tolist()
        else:
            quota_cpu, shares = loads_cpu, counts_host
        grad_input_splits = [_block_sums(shares[rank], d * el, (d + 1) * el)
                             for d in range(world)]
        grad_output_splits = [_block_sums(shares[s], rank * el, (rank + 1) * el)
                              for s in range(world)]
        num_grad_received = sum(grad_output_splits)
        # source s sends positions in its own row order; its rows for this rank's experts
        # start at position segment_start[s] and arrived at arrival_start[s]
        arrival_start = [sum(output_splits[:s]) for s in range(world)]
        segment_start = [_block_sums(counts_host[s], 0, rank * el) for s in range(world)]
        base_W = h2d([a - b for a, b in zip(arrival_start, segment_start)], torch.int64, dev)
        grad_base_M = torch.repeat_interleave(
            base_W, h2d(grad_output_splits, torch.int64, dev), output_size=num_grad_received)
        kept_per_expert = [sum(shares[s][rank * el + le] for s in range(world))
                           for le in range(el)]
        return DispatchPlan(
            world=world, rank=rank, num_local_experts=el,
            tokens_per_expert_E=h2d(loads_cpu, torch.int32, dev),
            input_splits=input_splits, output_splits=output_splits, num_received=num_received,
            arrival_to_expert_N=dest_N.to(torch.int32),
            expert_to_arrival_N=inverse_permutation(dest_N).to(torch.int32),
            offsets_L=offsets_L, quota_E=h2d(quota_cpu, torch.int32, dev),
            share_E=h2d(shares[rank], torch.int32, dev), num_retained=int(sum(shares[rank])),
            grad_input_splits=grad_input_splits, grad_output_splits=grad_output_splits,
            num_grad_received=num_grad_received, grad_base_M=grad_base_M,
            kept_offsets_L=h2d(list(accumulate(kept_per_expert)), torch.int32, dev))


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


def _block_sums(row: Sequence[int], start: int, stop: int) -> int:
    return int(sum(row[start:stop]))


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
