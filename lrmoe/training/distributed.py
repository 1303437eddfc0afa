"""Processes of a run: torchrun / expert-parallel join, rank-0 printing, set-up steps that
rank 0 does first, the per-step agreement on stopping.

A run joins a process group when ``parallel.ep_size * parallel.dp_size > 1`` or when
torchrun launched it (EP size 1 then runs the expert-parallel layer over a group of one).
The data-parallel group is torch.distributed's WORLD; the EP layers get the ep group of
the (dp, ep) mesh (:func:`lrmoe.parallel.group.init_dp_ep_mesh`; WORLD without
``--dp``); :mod:`lrmoe.parallel` does the collectives of the layers.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional, Tuple, TypeVar

import torch
from torch import Tensor

from lrmoe.parallel.group import under_torchrun

T = TypeVar("T")


def env_rank() -> int:
    """torchrun's RANK, 0 outside torchrun."""
    return int(os.environ.get("RANK", "0")) if under_torchrun() else 0


def log(text: str) -> None:
    """``[lrmoe] text`` on stderr, from rank 0 only (ranks > 0 of a torchrun job print
    nothing, so a run prints each line once)."""
    if env_rank() == 0:
        print(f"[lrmoe] {text}", file=sys.stderr, flush=True)


def is_expert_parallel(ep_size: int, dp_size: int = 1) -> bool:
    """True when the run joins a process group: ``ep_size * dp_size > 1``, or any
    torchrun launch (a world size other than ``dp_size * ep_size`` is then refused instead
    of N processes silently training the same model into one folder)."""
    return ep_size * dp_size > 1 or under_torchrun()


def join(ep_size: int, device: str, dp_size: int = 1) -> Optional[Any]:
    """Join the torchrun process group and build the (dp, ep) groups when
    :func:`is_expert_parallel`.

    Args:
        ep_size: ``parallel.ep_size``. dp_size: ``parallel.dp_size``; torchrun's world
            size must be ``dp_size * ep_size``.
        device: ``run.device`` (``cpu`` forces gloo).

    Returns:
        This rank's :class:`lrmoe.parallel.group.DpEpGroups` (WORLD, the ep group, the
        dp group or None, the sizes and this rank's coordinates), or None for a
        single-process run.

    Raises:
        ValueError: not launched by torchrun, a world size other than
            ``dp_size * ep_size`` (from :func:`lrmoe.parallel.init_torchrun_group`), or
            ranks started with different ``--dp`` / ``--ep``.
    """
    if not is_expert_parallel(ep_size, dp_size):
        return None
    from lrmoe.parallel import init_torchrun_group
    from lrmoe.parallel.group import init_dp_ep_mesh

    setting = (f"parallel.ep_size={ep_size}" if dp_size == 1 else
               f"parallel.dp_size={dp_size} x parallel.ep_size={ep_size}")
    backend = init_torchrun_group(ep_size, torch.cuda.is_available() and device != "cpu",
                                  setting, dp_size=dp_size)
    groups = init_dp_ep_mesh(dp_size, ep_size)
    if dp_size == 1:
        log(f"expert parallel: EP size {ep_size} over torch.distributed ({backend})")
    else:
        log(f"DP x EP: {dp_size} x {ep_size} ranks on a (dp, ep) device mesh over "
            f"torch.distributed ({backend}); experts sharded over ep, replicated over dp")
    return groups


def local_device(device: str) -> str:
    """The device of this process: ``cuda:LOCAL_RANK`` for ``auto``/``cuda`` under
    torchrun with CUDA, else ``device`` unchanged."""
    if under_torchrun() and device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def rank0_first(group: Any, rank: int, fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on rank 0 first, then on the other ranks (e.g. rank 0 fills the data
    cache that the others then read). When rank 0 fails, every other rank raises at once
    instead of waiting in a barrier until the timeout.

    Raises:
        whatever ``fn`` raises on rank 0; RuntimeError on ranks > 0 when rank 0 failed.
    """
    if group is None:
        return fn()
    if rank == 0:
        try:
            value = fn()
        except BaseException:
            _agree(group, False)
            raise
        _agree(group, True)
        return value
    if not _agree(group, True):
        raise RuntimeError(f"rank 0 failed while {what} (its message is above); rank {rank} "
                           "stops too")
    return fn()


def on_every_rank(group: Any, rank: int, fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on every rank at once; when it fails on some rank, every rank raises
    (instead of the others waiting in their next collective until the timeout).

    Raises:
        whatever ``fn`` raises on a rank where it failed; RuntimeError on the ranks where
        it succeeded while another failed.
    """
    if group is None:
        return fn()
    try:
        value = fn()
    except BaseException:
        _agree(group, False)
        raise
    if not _agree(group, True):
        raise RuntimeError(f"another rank failed while {what} (its message is above); rank "
                           f"{rank} stops too")
    return value


def _agree(group: Any, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (one all-reduce)."""
    import torch.distributed as dist

    flag = torch.tensor([0.0 if ok else 1.0], device=_comm_device())
    dist.all_reduce(flag, group=group)
    return float(flag) == 0.0


def _comm_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_step_totals(group: Any, nll_sum: Tensor, num_loss: int, stop: bool
                       ) -> Tuple[Tensor, int, bool]:
    """Sum the step's loss, loss-token count and stop flags over the ranks in one
    all-reduce. Every rank must stop after the same step (a rank that stopped alone would
    leave the others waiting in the next step's all-to-all, and the shards of the last
    checkpoint would not match); riding on the loss reduction costs no extra collective.

    Args:
        group: the process group, or None (single process: the inputs come back).
        nll_sum: () float32, this rank's summed NLL. num_loss: its loss tokens.
        stop: this rank was asked to stop (Ctrl-C).

    Returns:
        ``(nll_sum over ranks () float32, loss tokens over ranks, any rank stops)``.
    """
    if group is None:
        return nll_sum, num_loss, stop
    totals = torch.cat([nll_sum.detach().float().reshape(1), torch.tensor(
        [float(num_loss), float(stop)], device=nll_sum.device)])
    torch.distributed.all_reduce(totals, group=group)
    n, stops = (int(v) for v in totals[1:].tolist())
    return totals[0], n, bool(stops)
