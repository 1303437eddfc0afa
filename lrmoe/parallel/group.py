"""The EP process group: joining it under torchrun, the (dp, ep) device mesh, the
communication device, the MoE config check across ranks and the failure announcement
before the dispatch.

Every EP rank must build the same layers (E, K, H, I, router, planned-backward settings)
and run the same collectives; the checks here turn a mismatch or a rank that fails early
into a clear error on every rank instead of a hang or an abort.

DP x EP (:func:`init_dp_ep_mesh`): world = D x N ranks on a 2-D
``torch.distributed.device_mesh.DeviceMesh`` of shape (D, N), dims ``("dp", "ep")``,
row-major, so global rank g is dp rank ``g // N`` and ep rank ``g % N``: the ranks of one
ep group are consecutive (on one node where N fits, for the all-to-all), and the D ranks
holding the same expert shard form a dp group.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lrmoe.moe.config import BACKWARD_FIELDS, LRMoEConfig

#: what every EP rank must agree on: the architecture (the loss coefficients only scale
#: each rank's own aux loss) and the whole planned backward, read from its one schema
_HASH_ARCH_FIELDS = ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "router",
                     "norm_topk_prob", "routed_scaling_factor",
                     "shared_expert_intermediate_size", "shared_expert_gate")


def _hashed(config: LRMoEConfig) -> list:
    return ([(f, getattr(config, f)) for f in _HASH_ARCH_FIELDS]
            + [(f, getattr(config.backward, f)) for f in BACKWARD_FIELDS])
#: the hash slot of the per-forward counts exchange when a rank failed before it
FAILED = -1

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether torchrun (or another launcher setting RANK and WORLD_SIZE) started us."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ

def init_torchrun_group(ep_size: int, use_cuda: bool, setting: str, dp_size: int = 1
                        ) -> str:
    """Join the default process group that ``torchrun`` prepared for this process.

    NCCL when ``use_cuda`` (after ``torch.cuda.set_device(LOCAL_RANK)``, so each rank
    binds its own GPU before NCCL does), gloo otherwise; 300 s collective timeout. Does
    nothing but the checks when the group already exists.

    Args:
        ep_size: the expert-parallel size asked for.
        use_cuda: pick NCCL and bind ``cuda:LOCAL_RANK``.
        setting: how the user gave the sizes (``"--ep 2"``, ``"ep_size=2"``), for errors.
        dp_size: the data-parallel size of a DP x EP run (1: EP over the whole world);
            ``dp_size * ep_size`` must equal torchrun's world size.

    Returns:
        The backend name (``"nccl"`` or ``"gloo"``).

    Raises:
        ValueError: not started by torchrun (its env variables are missing), a world
            size other than ``dp_size * ep_size``, or (NCCL) more processes per node than
            GPUs; the message names ``setting``, ``--dp``/``--ep`` and ``torchrun
            --nproc-per-node``.
    """
    need = dp_size * ep_size
    flags = f"--ep {ep_size}" if dp_size == 1 else f"--dp {dp_size} --ep {ep_size}"
    launch = f"launch with torchrun --nproc-per-node {need} ... {flags}"
    missing = [v for v in _TORCHRUN_ENV if v not in os.environ]
    if missing and not dist.is_initialized():
        raise ValueError(f"{setting} needs {need} process{'es' if need != 1 else ''} "
                         "started by torchrun, but "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                         f"set (this process was not started by torchrun); {launch}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != need:
        if dp_size == 1:
            raise ValueError(f"{setting} needs {ep_size} processes, but torchrun started "
                             f"{world}; pass --ep {world} to use them all, or {launch}")
        raise ValueError(f"{setting} needs --dp x --ep = {dp_size} x {ep_size} = {need} "
                         f"processes, but torchrun started {world} (world size {world}); "
                         f"pass --dp D --ep N with D x N = {world}, or {launch}")
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if backend == "nccl":  # one GPU per rank before NCCL binds the current device
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise ValueError(f"{setting}: local rank {local} needs GPU {local}, but torch "
                                 f"sees {torch.cuda.device_count()} CUDA device(s) on this "
                                 "node; start at most that many processes per node "
                                 "(torchrun --nproc-per-node) or run on the CPU (--device cpu)")
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    return dist.get_backend()


def config_hash(config: LRMoEConfig, ep_size: int, dtype: Optional[torch.dtype] = None,
                placement: Any = None) -> int:
    """A 62-bit hash of the fields every EP rank must agree on (and the EP size, the
    compute dtype of the forward when given, and the placement settings -- policy,
    budget, resident bytes, slots -- when given: a
    :class:`lrmoe.parallel.placement.Placement`)."""
    text = repr(_hashed(config) + [("ep_size", ep_size)]
                + ([("dtype", str(dtype))] if dtype is not None else [])
                + ([("placement", placement.summary())] if placement is not None else []))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def config_summary(config: LRMoEConfig, ep_size: int, placement: Any = None) -> str:
    """The hashed fields as text, for error messages."""
    text = ", ".join(f"{f}={v!r}" for f, v in _hashed(config)) + f", ep={ep_size}"
    return text + (f", placement={placement!r}" if placement is not None else "")


def check_config_across_ranks(config: LRMoEConfig, group, placement: Any = None) -> None:
    """Fail fast (on every rank) when the ranks of ``group`` disagree on the MoE config.

    A collective: every rank of ``group`` must call it.

    Raises:
        ValueError: naming the ranks whose config differs from rank 0's and this rank's
            settings.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([config_hash(config, world, placement=placement)], dtype=torch.int64)
    dev = comm_device(group)
    mine = mine.to(dev)
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    hashes = [int(t.item()) for t in got]
    raise_on_mismatch(hashes, config, world, dist.get_rank(group), placement=placement)


def raise_on_mismatch(hashes: Sequence[int], config: LRMoEConfig, world: int,
                      rank: int, dtype: Optional[torch.dtype] = None,
                      placement: Any = None) -> None:
    """Raise on every rank when the gathered config hashes differ or one is
    :data:`FAILED`.

    Args:
        hashes: the W hashes of :func:`config_hash` (or :data:`FAILED`), in rank order.
        config, world, rank: this rank's config, EP size and rank, for the message.
        dtype: the compute dtype hashed along (per-forward check), or None.
        placement: the placement settings hashed along, or None.

    Raises:
        RuntimeError: some rank announced a failure (:func:`announce_failure`).
        ValueError: ranks disagree, naming them and this rank's settings.
    """
    failed = [i for i, h in enumerate(hashes) if h == FAILED]
    if failed:
        raise RuntimeError(
            f"expert-parallel ranks {failed} failed before the dispatch all-to-all (their own "
            f"error says why); rank {rank} stops too instead of waiting for them")
    bad = [i for i, h in enumerate(hashes) if h != hashes[0]]
    if bad:
        what = "configuration or compute dtype" if dtype is not None else "configuration"
        raise ValueError(
            f"expert-parallel ranks disagree on the LRMoE {what}: ranks {bad} differ "
            f"from rank 0 (E, K, H, I, shared expert, c, metric, quota rule, selection, "
            f"router, seed, EP size{' and the dtype of the expert inputs' if dtype else ''}"
            f"{', placement policy, memory budget, resident bytes and replica slots' if placement is not None else ''} "
            f"must match on every rank); rank {rank} has "
            f"{config_summary(config, world, placement)}"
            + (f", dtype={dtype}" if dtype is not None else ""))


def announce_failure(config: LRMoEConfig, group, extra: int = 0) -> None:
    """Join the counts exchange of the forward in place of a rank that failed before it
    (bad input, non-finite router logits), so the other ranks raise at once instead of
    waiting for the collective timeout. Call it from an ``except`` block, then re-raise.
    A collective; ``extra``: the slots the exchange carries beyond counts and hash (1 with
    a placement policy)."""
    world = dist.get_world_size(group)
    meta = torch.zeros(config.num_experts + 1 + extra, dtype=torch.int64,
                       device=comm_device(group))
    meta[-1] = FAILED
    dist.all_gather([torch.empty_like(meta) for _ in range(world)], meta, group=group)


def comm_device(group) -> torch.device:
    """Where the tensors of ``group``'s collectives live: the current GPU for NCCL, else
    the CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class DpEpGroups:
    """The process groups of one rank of a DP x EP run (:func:`init_dp_ep_mesh`).

    Attributes:
        world: torch.distributed's WORLD: data-parallel group of the non-expert
            parameters, the step totals, the stop flag.
        ep: this rank's expert-parallel group (the mesh's ``"ep"`` dim; WORLD when
            ``dp_size == 1``): the MoE layers' all-to-alls, the expert part of the
            gradient norm.
        dp: the ranks holding the same expert shard (the mesh's ``"dp"`` dim), over which
            expert gradients are averaged; None when ``dp_size == 1`` (no replicas).
        dp_size, ep_size: D and N. rank: global rank ``dp_rank * ep_size + ep_rank``.
        dp_rank, ep_rank: this rank's coordinates on the mesh.
        mesh: the ``DeviceMesh``, or None when ``dp_size == 1``.
    """

    world: Any
    ep: Any
    dp: Any
    dp_size: int
    ep_size: int
    rank: int
    dp_rank: int
    ep_rank: int
    mesh: Any = None


def mesh_hash(dp_size: int, ep_size: int) -> int:
    """A 62-bit hash of the mesh shape every rank must agree on."""
    text = repr([("dp_size", dp_size), ("ep_size", ep_size)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def check_mesh_across_ranks(dp_size: int, ep_size: int, group=None) -> None:
    """Fail fast (on every rank) when the ranks of ``group`` (default WORLD) were started
    with different ``--dp`` / ``--ep``: they would build different meshes and wait on
    different collectives. A collective (one all_gather of an int64).

    Raises:
        ValueError: naming the ranks whose (dp, ep) differ from rank 0's and this rank's.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([mesh_hash(dp_size, ep_size)], dtype=torch.int64,
                        device=comm_device(group))
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    hashes = [int(t.item()) for t in got]
    bad = [i for i, h in enumerate(hashes) if h != hashes[0]]
    if bad:
        raise ValueError(f"ranks disagree on the parallel layout: ranks {bad} were started "
                         f"with another --dp / --ep than rank 0 (parallel.dp_size and "
                         f"parallel.ep_size must match on every rank); rank "
                         f"{dist.get_rank(group)} has --dp {dp_size} --ep {ep_size}")


def init_dp_ep_mesh(dp_size: int, ep_size: int) -> DpEpGroups:
    """The (dp, ep) groups of this rank, after :func:`init_torchrun_group`.

    ``dp_size == 1`` builds no mesh: the EP group is WORLD, exactly as an ``--ep`` run
    without ``--dp``. Otherwise ``init_device_mesh(device_type, (D, N),
    mesh_dim_names=("dp", "ep"))`` on the default group's device type (``cuda`` for NCCL,
    else ``cpu``). A collective: every rank calls it, first checking
    (:func:`check_mesh_across_ranks`) that all were given the same sizes.

    Raises:
        ValueError: the ranks disagree on (dp, ep), or the world size is not D x N.
    """
    check_mesh_across_ranks(dp_size, ep_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != dp_size * ep_size:
        raise ValueError(f"--dp {dp_size} --ep {ep_size} needs {dp_size * ep_size} ranks, "
                         f"but the process group has world size {world}")
    if dp_size == 1:
        return DpEpGroups(dist.group.WORLD, dist.group.WORLD, None, 1, ep_size, rank, 0,
                          rank)
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dp_size, ep_size), mesh_dim_names=("dp", "ep"))
    return DpEpGroups(dist.group.WORLD, mesh.get_group("ep"), mesh.get_group("dp"),
                      dp_size, ep_size, rank, mesh.get_local_rank("dp"),
                      mesh.get_local_rank("ep"), mesh)
