"""The EP process group: joining it under torchrun, the communication device, the MoE
config check across ranks and the failure announcement before the dispatch.

Every EP rank must build the same layers (E, K, H, I, router, planned-backward settings)
and run the same collectives; the checks here turn a mismatch or a rank that fails early
into a clear error on every rank instead of a hang or an abort.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lrmoe.config import LRMoEConfig

_HASH_FIELDS = ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "router",
                "norm_topk_prob", "routed_scaling_factor", "shared_expert_intermediate_size",
                "shared_expert_gate", "recalibration_rate", "metric", "quota_rule",
                "selection", "selective_backward", "seed", "retained_mass_target")
#: the hash slot of the per-forward counts exchange when a rank failed before it
FAILED = -1

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

def init_torchrun_group(ep_size: int, use_cuda: bool, setting: str) -> str:
    """Join the default process group that ``torchrun`` prepared for this process.

    NCCL when ``use_cuda`` (after ``torch.cuda.set_device(LOCAL_RANK)``, so each rank
    binds its own GPU before NCCL does), gloo otherwise; 300 s collective timeout. Does
    nothing but the checks when the group already exists.

    Args:
        ep_size: the expert-parallel size asked for; must equal torchrun's world size.
        use_cuda: pick NCCL and bind ``cuda:LOCAL_RANK``.
        setting: how the user gave ``ep_size`` (``"--ep 2"``, ``"ep_size=2"``), for errors.

    Returns:
        The backend name (``"nccl"`` or ``"gloo"``).

    Raises:
        ValueError: not started by torchrun (its env variables are missing), a world
            size other than ``ep_size``, or (NCCL) more processes per node than GPUs; the
            message names ``setting`` and ``torchrun --nproc-per-node``.
    """
    launch = f"launch with torchrun --nproc-per-node {ep_size} ... --ep {ep_size}"
    missing = [v for v in _TORCHRUN_ENV if v not in os.environ]
    if missing and not dist.is_initialized():
        raise ValueError(f"{setting} needs {ep_size} processes started by torchrun, but "
                         f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                         f"set (this process was not started by torchrun); {launch}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != ep_size:
        raise ValueError(f"{setting} needs {ep_size} processes, but torchrun started "
                         f"{world}; pass --ep {world} to use them all, or {launch}")
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
    :class:`lrmoe.parallel.replicas.Placement`)."""
    text = repr([(f, getattr(config, f)) for f in _HASH_FIELDS] + [("ep_size", ep_size)]
                + ([("dtype", str(dtype))] if dtype is not None else [])
                + ([("placement", placement.summary())] if placement is not None else []))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def config_summary(config: LRMoEConfig, ep_size: int, placement: Any = None) -> str:
    """The hashed fields as text, for error messages."""
    text = ", ".join(f"{f}={getattr(config, f)!r}" for f in _HASH_FIELDS) + f", ep={ep_size}"
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
