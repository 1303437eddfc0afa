"""Data-parallel side of expert parallelism: the expert sharding, the gradient sync of the
non-expert parameters (torch's DDP) and, under DP x EP, of the expert replicas, and the
global gradient-norm clip.

Expert-sharded parameters carry ``EXPERT_PARAM_ATTR``; everything else is replicated on
every rank.

DP x EP (a (dp, ep) mesh, :func:`lrmoe.parallel.group.init_dp_ep_mesh`): experts are
sharded over ep and replicated over dp, so their gradients are summed over the dp group
only; every other parameter is averaged over all ranks by DDP (:class:`DataParallel`).
Why DDP and not FSDP2 (``fully_shard``) for the dense part: FSDP2 would shard the dense
parameters into DTensors, whose all-gathers before every block's forward and backward pay
off only when the dense weights do not fit one GPU; in the MoE models this trains the
dense part is small next to the experts (which EP already shards), so replicating it
costs little memory, and DDP's one overlapped all-reduce per bucket is the cheaper sync.
A user loop can still put the dense blocks under ``fully_shard`` (docs/integrations.md).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, List

import torch
import torch.distributed as dist
from torch import Tensor, nn

#: attribute set on expert-sharded parameters (``param._lrmoe_expert_parallel = True``)
EXPERT_PARAM_ATTR = "_lrmoe_expert_parallel"


def is_expert_param(p: Tensor) -> bool:
    """True for expert-sharded parameters (their gradients stay on their rank)."""
    return bool(getattr(p, EXPERT_PARAM_ATTR, False))


class DataParallel:
    """The data-parallel gradient sync of one rank: ``torch.nn.parallel.
    DistributedDataParallel`` over the non-expert parameters, the expert shards' own
    all-reduce over the dp group.

    The loss is the MEAN of the W ranks' local losses. Non-expert parameters: DDP's
    reducer averages them over ``world`` in buckets of ``bucket_cap_mb``, launched while
    the backward still runs (overlapped); the expert parameters are excluded from it
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``), so DDP
    neither broadcasts nor reduces the shards, which differ between ep ranks. Expert
    shards already sum the contributions of every token of their EP group through the
    all-to-all; under DP x EP each shard's gradient is also summed over ``dp_group`` (the
    ranks holding the same shard) by an asynchronous all-reduce launched from the
    parameter's post-accumulate-grad hook, so it too overlaps the rest of the backward;
    :meth:`finish` waits for those and divides the expert gradients by W.

    Use::

        dp = DataParallel(model, groups.world, groups.dp)
        for i, batch in enumerate(micro):          # grad accumulation
            with dp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                loss(dp.module, batch).backward()
        dp.finish()                                  # before clipping / the step

    Args:
        model: the (patched, expert-sharded) model, on its device.
        world: all W data-parallel ranks (the step's group).
        dp_group: the ranks holding the same expert shard, or None (EP over the world:
            nothing to sum).
        bucket_cap_mb: DDP's bucket size, MiB.

    Attributes:
        module: the DDP wrapper; call it for the training forward (the model itself stays
            what ``model`` was: evaluation and checkpoints use it).
    """

    def __init__(self, model: nn.Module, world: Any, dp_group: Any = None,
                 bucket_cap_mb: float = 25.0) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.world_size = dist.get_world_size(world)
        self.dp_group = dp_group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.expert_params = [p for _, p in named if is_expert_param(p)]
        DDP._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, p in model.named_parameters() if is_expert_param(p)])
        dev = next(model.parameters()).device
        # DDP rebuilds its buckets in gradient-ready order after its first iteration, so
        # with more than 2 ranks (where the all-reduce's summation order depends on a
        # gradient's offset in its bucket) a resumed run's first step rounds differently
        # from the straight run's: resumes are equal to float32 rounding, not bitwise
        # (tests/python/parallel/test_dp_ep.py). find_unused_parameters=True would keep
        # the first layout, at the price of a walk of the autograd graph per forward and
        # a warning from every rank.
        self.module = DDP(model, process_group=world, broadcast_buffers=False,
                          bucket_cap_mb=bucket_cap_mb,
                          device_ids=[dev.index] if dev.type == "cuda" else None)
        self._sync = True
        self._works: List[Any] = []
        self._handles = []
        if dp_group is not None:
            for p in self.expert_params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._launch))

    def _launch(self, p: Tensor) -> None:
        if self._sync:
            self._works.append(dist.all_reduce(p.grad, group=self.dp_group, async_op=True))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (a micro-batch before the last one): neither
        DDP's reducer nor the expert all-reduce runs."""
        self._sync = False
        try:
            with self.module.no_sync():
                yield
        finally:
            self._sync = True

    def finish(self) -> None:
        """After the last micro-batch's backward: wait for the expert all-reduces, then
        divide the expert gradients by W (the non-expert ones DDP has averaged).

        Raises:
            RuntimeError: an expert shard got no gradient in this backward (its all-reduce
                would be missing on this rank alone).
        """
        works, self._works = self._works, []
        for w in works:
            w.wait()
        if self.dp_group is not None and len(works) != len(self.expert_params):
            raise RuntimeError(f"{len(self.expert_params) - len(works)} expert shard(s) got "
                               "no gradient in this backward; every expert parameter must "
                               "take part in the loss on every rank")
        for p in self.expert_params:
            if p.grad is not None:
                p.grad.div_(self.world_size)

    def close(self) -> None:
        """Remove the expert hooks and drop the DDP wrapper (its reducer), before the
        process group is destroyed: a reducer freed during the interpreter's exit, after
        the group, can abort a rank that finished."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.module = None
        gc.collect()


def clip_grad_norm_(module: nn.Module, max_norm: float, group=None) -> Tensor:
    """Clip by the global gradient norm over all ranks; returns the norm (fp32 tensor).

    Expert-sharded parameters' squared norms are summed over ``group``, the EP group
    (whose shards together hold every expert once; under DP x EP the mesh's ``"ep"``
    group, its dp replicas hold the same gradients after :meth:`DataParallel.finish`
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
