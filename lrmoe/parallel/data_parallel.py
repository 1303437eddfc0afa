"""Data-parallel side of expert parallelism: gradient sync of the non-expert parameters
(and, under DP x EP, of the expert replicas), the global gradient-norm clip and per-rank
checkpoints of expert-sharded modules.

Expert-sharded parameters carry ``EXPERT_PARAM_ATTR``; everything else is replicated on
every rank.

DP x EP (a (dp, ep) mesh, :func:`lrmoe.parallel.init_dp_ep_mesh`): experts are sharded
over ep and replicated over dp, so their gradients are averaged over the dp group only;
every other parameter is averaged over all ranks. Both use the same bucketed all-reduce
(:func:`allreduce_non_expert_grads`). Why not FSDP2 (``fully_shard``): it would shard the
dense parameters into DTensors, which changes the optimizer state, the checkpoint format
and the exact single-process equality of the dense update, and the expert weights, already
sharded by the EP layer's own all-to-all autograd, would have to be excluded from it; the
dense part of the models this trains is small next to the experts, so replicating it costs
little memory and keeps one code path for ``--dp 1`` and ``--dp D``.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

#: attribute set on expert-sharded parameters (``param._lrmoe_expert_parallel = True``)
EXPERT_PARAM_ATTR = "_lrmoe_expert_parallel"


def is_expert_param(p: Tensor) -> bool:
    """True for expert-sharded parameters (their gradients stay on their rank)."""
    return bool(getattr(p, EXPERT_PARAM_ATTR, False))


def _sum_in_buckets(grads: List[Tensor], group, bucket_bytes: int) -> None:
    """Sum ``grads`` over ``group`` in place: flattened into buckets of at most
    ``bucket_bytes`` per dtype (one all-reduce per bucket, as DDP's reducer does, instead
    of one per parameter), in list order. A collective."""
    open_bucket: Dict[torch.dtype, List[Tensor]] = {}
    open_bytes: Dict[torch.dtype, int] = {}
    full: List[List[Tensor]] = []
    for g in grads:
        dt = g.dtype
        open_bucket.setdefault(dt, []).append(g)
        open_bytes[dt] = open_bytes.get(dt, 0) + g.numel() * g.element_size()
        if open_bytes[dt] >= bucket_bytes:
            full.append(open_bucket.pop(dt))
            open_bytes[dt] = 0
    for bucket in full + list(open_bucket.values()):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def allreduce_non_expert_grads(module: nn.Module, group=None,
                               bucket_bytes: int = 64 << 20, dp_group: Optional[
                                   dist.ProcessGroup] = None) -> None:
    """Data-parallel gradient sync for a loss that is the MEAN of the ranks' local losses.

    Non-expert gradients are averaged over ``group`` (W ranks): summed in buckets of at
    most ``bucket_bytes`` per dtype, divided by W. Expert-sharded gradients already sum the
    contributions of every token of their EP group through the all-to-all; without
    ``dp_group`` (EP over the whole world) they are only divided by W; with ``dp_group``
    (DP x EP: the ranks holding the same expert shard) they are first summed over it (same
    buckets), then divided by W. Parameters without a gradient contribute zeros (every
    rank joins the same collectives, in parameter order). A collective.

    Args:
        module: the model (parameters in the same order on every rank).
        group: all W data-parallel ranks (None: WORLD).
        bucket_bytes: largest bucket, bytes.
        dp_group: the expert replicas' group of a (dp, ep) mesh, or None.
    """
    world = dist.get_world_size(group)
    dense: List[Tensor] = []
    expert: List[Tensor] = []
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if is_expert_param(p):
            if dp_group is not None and p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad is not None:
                expert.append(p.grad)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dense.append(p.grad)
    _sum_in_buckets(dense, group, bucket_bytes)
    if dp_group is not None:
        _sum_in_buckets(expert, dp_group, bucket_bytes)
    for g in dense + expert:
        g.div_(world)


def clip_grad_norm_(module: nn.Module, max_norm: float, group=None) -> Tensor:
    """Clip by the global gradient norm over all ranks; returns the norm (fp32 tensor).

    Expert-sharded parameters' squared norms are summed over ``group``, the EP group
    (whose shards together hold every expert once; under DP x EP the mesh's ``"ep"``
    group, its dp replicas hold the same gradients after :func:`allreduce_non_expert_grads`
    and so the same norm); non-expert parameters (already identical on every rank) count
    once. A collective.
    """
    params = [p for p in module.parameters() if p.grad is not None]
    dev = params[0].grad.device if params else torch.device("cpu")
    expert_sq = torch.zeros((), dtype=torch.float64, device=dev)
    dense_sq = torch.zeros((), dtype=torch.float64, device=dev)
    for p in params:
        sq = p.grad.detach().double().pow(2).sum()
        if is_expert_param(p):
            expert_sq = expert_sq + sq
        else:
            dense_sq = dense_sq + sq
    dist.all_reduce(expert_sq, group=group)
    norm = (expert_sq + dense_sq).sqrt()
    if max_norm < float("inf"):
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(factor.to(p.grad.dtype))
    return norm.float()


def expert_state_dict(module: nn.Module, group=None) -> Dict[str, object]:
    """This rank's checkpoint: its expert shards (all ranks) + everything else (kept by
    every rank; rank 0's copy is the one to write), tagged with the EP size and rank."""
    return {"ep_size": dist.get_world_size(group), "ep_rank": dist.get_rank(group),
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def load_expert_state_dict(module: nn.Module, checkpoint: Dict[str, object],
                           group=None) -> None:
    """Load :func:`expert_state_dict` output saved on the same EP size and rank.

    Raises:
        ValueError: the checkpoint was written with another EP size or rank.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if checkpoint.get("ep_size") != world:
        raise ValueError(f"checkpoint was saved with expert-parallel size "
                         f"{checkpoint.get('ep_size')} but this run has EP size {world}; "
                         "resume with the same --ep (resharding is not supported)")
    if checkpoint.get("ep_rank") != rank:
        raise ValueError(f"checkpoint shard is for EP rank {checkpoint.get('ep_rank')} but "
                         f"this is rank {rank}; load each rank's own shard file")
    module.load_state_dict(checkpoint["state"])


def shard_experts(experts: nn.Module, num_experts: int, group, where: str) -> None:
    """Keep this rank's contiguous slice of the stacked expert weights, in place.

    Rank d keeps experts ``[d*E/W, (d+1)*E/W)`` of ``experts.gate_up_proj`` (E, 2I, H) and
    ``experts.down_proj`` (E, H, I): new parameters (same dtype, device and
    ``requires_grad``) tagged with :data:`EXPERT_PARAM_ATTR`. The full tensors are built
    first on every rank, so a seeded EP model holds the slices of the seeded single-device
    model.

    Args:
        experts: a module with ``gate_up_proj`` and ``down_proj`` parameters of E rows.
        num_experts: E. group: the EP process group. where: the layer, for the message.

    Raises:
        ValueError: E not divisible by the EP size.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise ValueError(f"{where}: num_experts={num_experts} is not divisible by the "
                         f"expert-parallel size {world}; choose E a multiple of the EP size")
    el = num_experts // world
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        shard = nn.Parameter(full.detach()[rank * el:(rank + 1) * el].clone(),
                             requires_grad=full.requires_grad)
        setattr(shard, EXPERT_PARAM_ATTR, True)
        setattr(experts, name, shard)
