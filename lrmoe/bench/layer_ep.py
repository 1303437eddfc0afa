"""``lrmoe bench layer --ep N``: one MoE layer under expert parallelism, N processes.

Launch: ``torchrun --nproc-per-node N -m lrmoe bench layer --ep N [options]``. Each rank
holds E / N experts and its OWN ``--tokens`` tokens (tokens per rank), routing and inputs
(input set s of rank r uses seed ``s + 1000 r``: :func:`lrmoe.bench.cases.make_inputs`).
Methods, all on one seeded set of weights (each rank's expert shard is the same slice):
  * LRMoE at each recalibration rate (``LRMoELayer(cfg, ep_group=WORLD)``,
    :mod:`lrmoe.parallel`: only kept gradient rows cross the backward all-to-all);
  * ``dropless``: ``dropless_moe_ep`` of :mod:`lrmoe.bench.baselines.dropless` (torchtitan-style
    all-to-all dispatch and combine, autograd's backward moves every pair both ways),
    first checked against LRMoE at c = 0 (output and input gradient, the maximum error
    over ranks; every rank then skips it alike when it disagrees).

Per method and rank: warm-up, then ``iters`` steps each preceded by an untimed barrier,
device events around forward and backward, the median. Reported: max over ranks (the
step waits for the slowest rank) and mean. One extra profiled step (input set 0; forward
and backward in separate profiler sessions) gives device ms (CPU ms on gloo) under each
``lrmoe.*`` range -- the five all-to-alls ``a2a_counts``, ``a2a_dispatch``,
``a2a_combine``, ``a2a_grad``, ``a2a_dx``, the expert GEMMs and the single-device phases
-- max and mean over ranks. The dropless backward all-to-alls run in autograd nodes
(``_AlltoAllSingleBackward``) outside any range: the first is ``a2a_grad``, the second
``a2a_dx``. On CUDA, NCCL all-to-all kernels found by name (``SendRecv``/``AllToAll``)
are listed too, as a check that does not rely on kernels being linked to ranges.
An all-to-all's time includes waiting for the slowest peer to join (ranks carry
different loads), which is why ranks are lined up by a barrier before each timed and
profiled step (and the profiler is started once up front: its first start is slow).
Bytes: the per-rank ``a2a_bytes`` of that step (bytes each rank SENDS into each
all-to-all, rows to itself included; see :mod:`lrmoe.parallel`), summed over ranks.

Legend: W ranks, T tokens per rank, E experts, K top_k, H hidden, P = T K pairs per rank.
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from lrmoe.bench.methods import (EP_METHODS, build_methods, check_agreement, check_choices,
                                 reference_outputs)
from lrmoe.bench.report import BYTES_BWD, BYTES_FWD, FAILED, markdown_ep, write_reports
from lrmoe.workload.routing import DEFAULT_ROTATE, ROUTING_SEED_STRIDE
from lrmoe.workload.shapes import SHAPES
from lrmoe.bench.cases import Case, cases, make_inputs
from lrmoe.bench.timing import (PeakMemory, Timer, kernel_split, phase_times, profile_step,
                                profiled, time_iterations)

EP_PHASES = ("router", "permute", "a2a_counts", "a2a_dispatch", "expert_gemm_fwd",
             "a2a_combine", "combine", "router_grad", "score", "select", "compact",
             "a2a_grad", "expert_gemm_bwd", "a2a_dx", "scatter")
#: substrings of NCCL all-to-all kernel names (NCCL runs all_to_all as grouped send/recv)
A2A_KERNEL_NAMES = ("SendRecv", "AllToAll", "AlltoAll", "all_to_all", "alltoall")
#: autograd node of torch.distributed.nn.functional.all_to_all_single's backward
AUTOGRAD_A2A_NODE = "_AlltoAllSingleBackward"


# ----------------------------------------------------------------------- measurements
def ep_phase_times(prof_fwd, prof_bwd, cuda: bool) -> Dict[str, float]:
    """ms under each ``lrmoe.*`` range of a forward and a backward profile (device time
    on CUDA, CPU time on gloo), plus, where the backward has no ``lrmoe.a2a_grad`` range
    (the dropless baseline), its two autograd all-to-all nodes in time order as
    ``a2a_grad`` and ``a2a_dx``."""
    out = phase_times(prof_fwd, cuda)
    for k, v in phase_times(prof_bwd, cuda).items():
        out[k] = out.get(k, 0.0) + v
    if "a2a_grad" not in out:
        nodes = sorted((e for e in prof_bwd.events() if e.name == AUTOGRAD_A2A_NODE
                        and e.device_type == torch.autograd.DeviceType.CPU),
                       key=lambda e: e.time_range.start)
        for key, evt in zip(("a2a_grad", "a2a_dx"), nodes):
            out[key] = (evt.device_time_total if cuda else evt.cpu_time_total) / 1e3
    return out


def a2a_kernel_ms(prof) -> List[float]:
    """ms of each NCCL all-to-all kernel of a profile, in launch order (empty on CPU).

    NCCL kernels are named ``ncclDevKernel_SendRecv...``/``ncclKernel_...``; the
    profiler's GPU-side mirrors of ranges (``nccl:all_to_all``, ``lrmoe.*``) are skipped.
    """
    kernels = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name
        if (name.startswith("nccl") and not name.startswith("nccl:")
                and any(k in name for k in A2A_KERNEL_NAMES)):
            t = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
            kernels.append((evt.time_range.start, t / 1e3))
    return [t for _, t in sorted(kernels)]


def _barrier(device: torch.device) -> None:
    """All ranks here, and (CUDA) this rank's device idle, before a timed step."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(values: List[float]) -> List[float]:
    """Element-wise maximum over the ranks of the default group (a collective)."""
    every: List[Optional[List[float]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(values))
    return [max(col) for col in zip(*every)]


def _summary(values: Sequence[float]) -> Dict[str, float]:
    return {"max": max(values), "mean": statistics.mean(values)}


def _merge_ranks(per_rank: List[dict]) -> dict:
    """One method's record from every rank's own (rank order)."""
    first = per_rank[0]
    rec = {k: first[k] for k in ("method", "rate", "label", "agreement")}
    for key in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"):
        s = _summary([r[key] for r in per_rank])
        rec[key], rec[key + "_mean"] = s["max"], s["mean"]
    rec["fwd_bwd_ms_per_rank"] = [r["fwd_bwd_ms"] for r in per_rank]
    phases = sorted({k for r in per_rank for k in r["phases_ms"]})
    rec["phases_ms"] = {k: max(r["phases_ms"].get(k, 0.0) for r in per_rank) for k in phases}
    rec["phases_ms_mean"] = {k: statistics.mean(r["phases_ms"].get(k, 0.0) for r in per_rank)
                             for k in phases}
    keys = BYTES_FWD + BYTES_BWD
    rec["a2a_bytes_per_rank"] = [r["a2a_bytes"] for r in per_rank]
    rec["a2a_bytes"] = {k: sum(r["a2a_bytes"].get(k, 0) for r in per_rank) for k in keys}
    rec["a2a_bytes_fwd"] = sum(rec["a2a_bytes"][k] for k in BYTES_FWD)
    rec["a2a_bytes_bwd"] = sum(rec["a2a_bytes"][k] for k in BYTES_BWD)
    rec["a2a_kernels_ms"] = {
        part: _summary([sum(r["a2a_kernels_ms"][part]) for r in per_rank])
        for part in ("fwd", "bwd")}
    rec["a2a_kernels_ms_per_rank"] = [r["a2a_kernels_ms"] for r in per_rank]
    if "kernels_ms" in first:
        rec["kernels_ms"] = {part: {k: max(r["kernels_ms"][part][k] for r in per_rank)
                                    for k in first["kernels_ms"][part]}
                             for part in ("fwd", "bwd")}
    peaks = [r["peak_bytes"] for r in per_rank if r["peak_bytes"] is not None]
    rec["peak_bytes"] = max(peaks) if peaks else None
    rec["peak_bytes_per_rank"] = [r["peak_bytes"] for r in per_rank]
    if first.get("placement") is not None:
        # the plan is the same on every rank; the replica bytes are each rank's own
        rec["placement"] = dict(first["placement"])
        for k in ("weights_fetched", "grads_reduced"):
            rec["placement"][k] = sum(r["placement"][k] for r in per_rank)
    for key in ("num_pairs", "num_retained"):
        if first.get(key) is not None:
            rec[key] = sum(r[key] for r in per_rank)
    return rec


def _placement(stats) -> Dict[str, object]:
    """What the record keeps of a policy's last call
    (:class:`lrmoe.parallel.replicas.ReplicaStats`): replicas, remote instances, the
    verdict, rows per rank under fixed ownership / forward / backward, this rank's replica
    bytes, and the plan's memory per rank (max over ranks of each part and of the total,
    bytes)."""
    mem = [] if stats.memory_W4 is None else stats.memory_W4.tolist()
    parts = ("base_experts", "replicas", "forward_tokens", "backward_tokens")
    return {"replicas": stats.replicas, "remote_instances": stats.remote_instances,
            "feasible": stats.feasible, "reason": stats.reason,
            "rows_before_W": list(stats.rows_before_W),
            "rows_forward_W": list(stats.rows_forward_W),
            "rows_backward_W": list(stats.rows_backward_W),
            "weights_fetched": stats.bytes["weights_fetched"],
            "grads_reduced": stats.bytes["grads_reduced"],
            "memory_max_bytes": {p: max(row[i] for row in mem) for i, p in enumerate(parts)}
            if mem else {},
            "memory_total_max_bytes": max(sum(row) for row in mem) if mem else None}


def _routing_loads(ids: torch.Tensor, num_experts: int, world: int) -> Dict[str, object]:
    """Global expert loads of input set 0 over all ranks, and per-rank received rows."""
    mine = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts).tolist()
    every: List[Optional[List[int]]] = [None] * world
    dist.all_gather_object(every, mine)
    n_e = [sum(col) for col in zip(*every)]
    el = num_experts // world
    rank_rows = [sum(n_e[d * el:(d + 1) * el]) for d in range(world)]
    mean_e = sum(n_e) / num_experts
    return {"tokens_per_expert": n_e, "rows_per_rank": rank_rows,
            "load_max_over_mean": max(n_e) / mean_e if mean_e else 0.0,
            "rank_load_max_over_mean": (max(rank_rows) / (sum(rank_rows) / world)
                                        if sum(rank_rows) else 0.0)}


def run_case_ep(case: Case, rates: Sequence[float], methods: Sequence[str],
                device: torch.device, iters: int, warmup: int, rotate: int,
                trace: Optional[str], policies: Sequence[Optional[str]] = (None,),
                replica_slots: int = 2) -> Optional[List[dict]]:
    """Time every method of one case on every rank of the default group (a collective).

    ``case.tokens`` is per rank; LRMoE runs under each of ``policies``
    (:func:`lrmoe.bench.methods.build_methods`). Returns one merged record per method on
    rank 0, None on the other ranks.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    d = case.dims
    timer = Timer(device)
    inputs = make_inputs(case, device, rotate, trace, rank=rank)
    loads = _routing_loads(inputs.ids[0], d["experts"], world)
    cuda = device.type == "cuda"
    built = build_methods(case, rates, methods, device, ep_group=dist.group.WORLD,
                          policies=policies, replica_slots=replica_slots)
    reference = (reference_outputs(built[0].reference, inputs)
                 if any(m.method != "lrmoe" or m.policy is not None for m in built) else None)
    records = []
    for method in built:
        head = dict(method=method.method, rate=method.rate, label=method.label,
                    policy=method.policy, shape=case.shape, tokens_per_rank=case.tokens,
                    routing=case.routing, world_size=world)
        agreement = (check_agreement(method, inputs, reference, combine=_max_over_ranks)
                     if reference is not None else None)
        if agreement is not None and not agreement["passed"]:  # the same on every rank
            records.append(dict(head, agreement=agreement, status=FAILED, iters=0, **loads))
            continue
        with PeakMemory(device, method.params) as mem:
            fwd, bwd = time_iterations(method, inputs, timer, warmup, iters,
                                       before_each=lambda: _barrier(device))
        prof_fwd, prof_bwd = profile_step(method, inputs, device, split=True,
                                          before_each=lambda: _barrier(device))
        mine = dict(method=method.method, rate=method.rate, label=method.label,
                    agreement=agreement, fwd_ms=statistics.median(fwd),
                    bwd_ms=statistics.median(bwd), peak_bytes=mem.peak,
                    phases_ms=ep_phase_times(prof_fwd, prof_bwd, cuda),
                    a2a_kernels_ms={"fwd": a2a_kernel_ms(prof_fwd),
                                    "bwd": a2a_kernel_ms(prof_bwd)},
                    a2a_bytes=method.a2a_bytes)
        mine["fwd_bwd_ms"] = mine["fwd_ms"] + mine["bwd_ms"]
        if cuda:  # GEMM vs other kernels by name: the dropless backward has no GEMM range
            mine["kernels_ms"] = {"fwd": kernel_split(prof_fwd),
                                  "bwd": kernel_split(prof_bwd)}
        if method.layer is not None:
            st = method.layer.stats
            mine.update(num_pairs=st.num_pairs, num_retained=st.num_retained)
            if method.layer.core.replicas is not None:
                mine["placement"] = _placement(method.layer.core.replicas.stats)
        every: List[Optional[dict]] = [None] * world
        dist.all_gather_object(every, mine)
        rec = _merge_ranks(every)
        rec.update(head, iters=iters, **loads)
        records.append(rec)
    del built
    _add_ratios(records)
    return records if rank == 0 else None


def _add_ratios(records: List[dict]) -> None:
    """fwd+bwd / dropless and backward a2a bytes / LRMoE c = 0, within one case."""
    by_kind = {(r["method"], r.get("policy"), r["rate"]): r for r in records
               if r.get("status") != FAILED}
    base = by_kind.get(("dropless", None, None))
    for r in records:
        if r.get("status") == FAILED:
            continue
        c0 = by_kind.get(("lrmoe", r.get("policy"), 0.0))  # the same policy at c = 0
        r["vs_dropless"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"] if base else None
        r["bwd_bytes_vs_c0"] = (r["a2a_bytes_bwd"] / c0["a2a_bytes_bwd"]
                                if c0 and c0["a2a_bytes_bwd"] else None)


def _meta(command: str, device: torch.device, iters: int, warmup: int, rotate: int,
          dtype: str) -> dict:
    """Run facts, gathered from every rank (a collective); ``dtype`` as given
    (``bfloat16``), which ``lrmoe sim --validate`` compares with the cost file's."""
    mine = {"host": socket.gethostname(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}
    every: List[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    devices = sorted({m["device"] for m in every})
    nccl = (".".join(str(v) for v in torch.cuda.nccl.version())
            if dist.get_backend() == "nccl" else None)
    return dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), torch=torch.__version__,
                cuda=torch.version.cuda, nccl=nccl, world_size=dist.get_world_size(),
                backend=str(dist.get_backend()), device=" + ".join(devices),
                hosts=sorted({m["host"] for m in every}), command=command, iters=iters,
                warmup=warmup, rotate=rotate, dtype=dtype, tokens="per rank",
                routing_seed=f"set s of rank r: s + {ROUTING_SEED_STRIDE} r")


def bench_layer_ep(ep: int, shapes: Sequence[str], tokens: Sequence[int],
                   routings: Sequence[str], rates: Sequence[float] = (0.0, 0.1, 0.2, 0.3),
                   methods: Sequence[str] = EP_METHODS, device: Optional[str] = None,
                   dtype: str = "bfloat16", iters: int = 20, warmup: int = 5,
                   rotate: int = DEFAULT_ROTATE, trace: Optional[str] = None,
                   out_dir: str = "bench-out",
                   append_md: Optional[str] = None, command: str = "",
                   policies: Sequence[Optional[str]] = (None,), replica_slots: int = 2
                   ) -> Optional[dict]:
    """Run the expert-parallel benchmark in a torchrun process; rank 0 writes
    ``layer_bench_ep.json`` and ``layer_bench_ep.md`` under ``out_dir`` (and appends the
    markdown to ``append_md``).

    Joins the process group torchrun prepared (NCCL with ``cuda:LOCAL_RANK`` on CUDA,
    gloo on CPU) unless one exists, and destroys the group it created at the end.

    Args:
        ep: expert-parallel size; must equal torchrun's world size (``--nproc-per-node``).
        shapes, routings, rates, device, dtype, iters, warmup, rotate, trace: as
            :func:`lrmoe.bench.layer.bench_layer`; ``tokens``: tokens PER RANK.
        methods: ``lrmoe`` and/or ``dropless`` (``transformers`` and ``torchtitan`` have
            no EP mode here).
        policies: placement policies LRMoE runs under (None: fixed ownership without the
            planner); each policy's c = 0 is checked against that layer.
        replica_slots: spare expert slots per rank for the policies.

    Returns:
        On rank 0 a dict with ``records`` (one per case and method; times in ms, max over
        ranks, ``*_mean`` the mean; ``phases_ms`` per range; ``a2a_bytes`` summed over
        ranks) and ``meta``; None on the other ranks.

    Raises:
        ValueError: not under torchrun or a world size other than ``ep``; ``transformers``
            or ``torchtitan`` in ``methods``; E of a shape not divisible by ``ep``; unknown
            shape/method/dtype; a placement the policy refuses
            (:class:`lrmoe.parallel.placement.Placement`, e.g. ``ultraep`` without replica
            slots).
    """
    from lrmoe.parallel import init_torchrun_group

    if ep < 1:
        raise ValueError(f"--ep must be >= 1, got {ep}")
    no_ep = [m for m in methods if m not in EP_METHODS]
    if no_ep:
        raise ValueError(f"--methods {' '.join(no_ep)} has no expert-parallel mode; drop it "
                         "from --methods when running with --ep")
    torch_dtype = check_choices(shapes, methods, dtype)
    for s in shapes:
        if SHAPES[s].num_experts % ep:
            raise ValueError(f"--shapes {s} has {SHAPES[s].num_experts} experts, not "
                             f"divisible by --ep {ep}; pick an --ep that divides it")
    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    created = not dist.is_initialized()
    init_torchrun_group(ep, use_cuda, f"--ep {ep}")
    try:
        dev = (torch.device("cuda", torch.cuda.current_device()) if use_cuda
               else torch.device("cpu"))
        meta = _meta(command, dev, iters, warmup, rotate, dtype)
        meta["replica_slots"] = replica_slots  # what lrmoe sim --validate plans with
        # the profiler's first start takes long (hundreds of ms on some ranks): pay it
        # here, so the barrier before each profiled step lines the ranks up
        with profiled(dev):
            pass
        records: List[dict] = []
        for case in cases(shapes, tokens, routings, torch_dtype, dev):
            records += run_case_ep(case, rates, methods, dev, iters, warmup, rotate,
                                   trace, policies, replica_slots) or []
        result = None
        if dist.get_rank() == 0:
            result = dict(records=records, meta=meta)
            write_reports(result, markdown_ep(records, meta), out_dir, "layer_bench_ep",
                          append_md)
        _barrier(dev)  # leave together: no rank tears the group down under another's feet
        return result
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def torchrun_command(args: Sequence[str], script: Optional[str] = None) -> str:
    """How this process was launched, for the report: ``torchrun --nproc-per-node N
    [--nnodes M] -m lrmoe bench layer ARGS`` (or ``SCRIPT ARGS``)."""
    import shlex
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // max(1, int(nproc))
    head = f"torchrun --nproc-per-node {nproc}" + (f" --nnodes {nodes}" if nodes > 1 else "")
    body = script if script else "-m lrmoe bench layer"
    return f"{head} {body} " + " ".join(shlex.quote(a) for a in args)
