"""``lrmoe calibrate``: measure the cost model the cluster simulator replays
(docs/simulation.md, "Cost model").

On the current device, for each model shape, one LRMoE layer (:class:`lrmoe.LRMoELayer`)
holding ``E_r`` experts is run on a perfectly balanced routing that gives every expert
exactly ``r`` rows, over a small grid of (experts per rank ``E_r``, rows per expert
``r``). Each point is timed and profiled with the layer benchmark's machinery
(:mod:`lrmoe.bench.timing`: device-event medians, one profiled step, device time per
``lrmoe.*`` range), so the calibration and ``lrmoe bench layer`` measure the same way.
From each point the file keeps the forward/backward medians and every phase's ms; the
simulator interpolates the grouped-GEMM phases over the grid and charges the other
phases per row (ms per pair, from the largest point). Also measured: device copy
bandwidth and GEMM ceiling (:func:`lrmoe.bench.timing.measure_ceilings`) and
host-to-device bandwidth from pinned memory.

Output file (JSON): ``format`` ("lrmoe-costs/1"), ``meta`` (machine, device, torch,
date, command), ``bandwidth`` (``copy_GBps``, ``h2d_GBps``, ``gemm_TFLOPs``; None where
not measurable), and per shape ``shapes[name]``: ``dims``, ``points`` (list of
``{experts, rows_per_expert, tokens, pairs, fwd_ms, bwd_ms, phases_ms}``) and
``per_row_ms`` (ms per pair of each non-GEMM phase, ``fwd_rest``/``bwd_rest`` per pair:
time under no ``lrmoe.*`` range, e.g. a shared expert); with ``--ep`` also ``ep_points``
and ``per_row_ms`` ``ep_fwd``/``ep_bwd`` (the expert-parallel layer's own work per pair,
:mod:`lrmoe.bench.calibrate_ep`).

Legend: T tokens, H hidden, I expert intermediate, E_r experts on the rank, K top_k,
r rows per expert, P = T*K = E_r*r pairs.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from lrmoe.bench.method import Method
from lrmoe.bench.methods import layer_config
from lrmoe.workload.shapes import SHAPES
from lrmoe.bench.cases import Case, Inputs
from lrmoe.utils.phases import PHASES_BWD, PHASES_FWD
from lrmoe.bench.timing import (Timer, measure_ceilings, phase_times, profile_step,
                                time_iterations)
from lrmoe.bench.calibrate_ep import ep_points_of, measure_ep_point, per_row_ep
from lrmoe.layer import LRMoELayer
from lrmoe.sim.costs import FORMAT, point_rest
from lrmoe.utils.paths import check_output

#: the shapes a calibration covers by default: the paper's and the gpu-small preset's
DEFAULT_SHAPES = ("qwen3-30b-a3b", "glm-4.5-air", "gpu-small")
#: the grid (H200 default): experts per rank and rows per expert; points above
#: MAX_PAIRS pairs are skipped (the simulator extrapolates linearly in rows beyond)
EXPERTS_GRID = (1, 4, 16, 32, 128)
ROWS_GRID = (16, 64, 256, 1024, 2048, 4096, 8192)
MAX_PAIRS = 1 << 20
QUICK_EXPERTS, QUICK_ROWS = (1, 4), (8, 32)
GEMM_PHASES = ("expert_gemm_fwd", "expert_gemm_bwd")


def balanced_ids(experts: int, rows: int, top_k: int, device: torch.device) -> torch.Tensor:
    """(T, K) int64 expert ids, T = experts * rows / K, in which every expert gets
    exactly ``rows`` pairs and each token K distinct experts: token t takes experts
    ``(t K + k) mod E_r``.

    Raises:
        ValueError: ``experts * rows`` not divisible by ``top_k``, or ``top_k > experts``.
    """
    if top_k > experts or (experts * rows) % top_k:
        raise ValueError(f"balanced routing needs top_k <= experts and experts * rows "
                         f"divisible by top_k; got experts={experts}, rows={rows}, "
                         f"top_k={top_k}")
    t = experts * rows // top_k
    flat = torch.arange(t * top_k, device=device) % experts
    return flat.view(t, top_k)


def measure_h2d(device: torch.device, nbytes: int = 1 << 30) -> Optional[float]:
    """Host-to-device copy bandwidth (GB/s) from pinned memory, median of 5 after 2
    warm-ups; None off CUDA."""
    if device.type != "cuda":
        return None
    timer = Timer(device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = []
    for i in range(7):
        t0 = timer.event(); dst.copy_(src, non_blocking=True); t1 = timer.event()
        if i >= 2:
            ms.append(timer.ms(t0, t1))
    return nbytes / statistics.median(ms) / 1e6


def point_layer(shape: str, experts: int, rows: int, device: torch.device,
                dtype: torch.dtype, ep_group=None):
    """The layer and inputs of one calibration point: an LRMoE layer (c = 0; under
    ``ep_group`` the expert-parallel one) of ``experts`` experts of ``shape``, seeded,
    built on ``device`` in ``dtype``, and two input sets (x, g: (T, H) of ``dtype``) over
    :func:`balanced_ids` (T, K) routing with ``rows`` rows per expert.

    Returns:
        (:class:`lrmoe.bench.cases.Case`, :class:`lrmoe.bench.method.Method`,
        :class:`lrmoe.bench.cases.Inputs`).

    Raises:
        ValueError: as :func:`balanced_ids`.
    """
    dims = dict(SHAPES[shape].dims, experts=experts, top_k=min(SHAPES[shape].top_k, experts))
    case = _Case(shape, experts * rows // dims["top_k"], "uniform", dtype, dims)
    torch.manual_seed(0)
    # built on the device: a CPU initialisation of 128 GLM experts takes seconds per point
    with torch.device(device):
        layer = LRMoELayer(layer_config(case), ep_group=ep_group).to(dtype=dtype)
    layer.set_recalibration(recalibration_rate=0.0)
    method = Method("lrmoe", 0.0, lambda x, ids: layer(x, ids), list(layer.parameters()),
                    layer)
    gen = torch.Generator().manual_seed(1)
    ids = balanced_ids(experts, rows, dims["top_k"], device)
    xs = [torch.randn(case.tokens, dims["hidden"], generator=gen).to(device, dtype)
          for _ in range(2)]
    gs = [torch.randn(case.tokens, dims["hidden"], generator=gen).to(device, dtype)
          for _ in range(2)]
    return case, method, Inputs([ids, ids], xs, gs, [0, 0])


def measure_point(shape: str, experts: int, rows: int, device: torch.device,
                  dtype: torch.dtype, iters: int, warmup: int) -> dict:
    """Time one LRMoE layer (c = 0) of ``experts`` experts of ``shape`` with ``rows``
    rows per expert; returns the point record (see the module docstring)."""
    case, method, inputs = point_layer(shape, experts, rows, device, dtype)
    # each step from an idle device, as configs/costs/h200.json was measured: its
    # launch-bound rest (point_rest) is part of what the simulator charges
    fwd, bwd = time_iterations(method, inputs, Timer(device), warmup, iters, sync_each=True)
    (prof,) = profile_step(method, inputs, device)
    rec = dict(experts=experts, rows_per_expert=rows, tokens=case.tokens,
               pairs=experts * rows, fwd_ms=statistics.median(fwd),
               bwd_ms=statistics.median(bwd),
               phases_ms=phase_times(prof, device.type == "cuda"))
    del method, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


class _Case(Case):
    """A bench :class:`Case` with its own dims (E_r experts instead of the shape's E)."""

    def __init__(self, shape, tokens, routing, dtype, dims):
        super().__init__(shape, tokens, routing, dtype)
        self._dims = dims

    @property
    def dims(self) -> dict:
        return self._dims


def per_row_costs(points: List[dict]) -> Dict[str, float]:
    """ms per pair of each non-GEMM phase at the point with the most pairs (where
    launch overheads weigh least), plus ``fwd_rest``/``bwd_rest``: the forward/backward
    median minus the sum of its phases, per pair (never below 0)."""
    big = max(points, key=lambda p: (p["pairs"], p["experts"]))
    ph, n = big["phases_ms"], big["pairs"]
    out = {k: ph.get(k, 0.0) / n for k in PHASES_FWD + PHASES_BWD if k not in GEMM_PHASES}
    out["fwd_rest"] = point_rest(big, backward=False) / n
    out["bwd_rest"] = point_rest(big, backward=True) / n
    return out


def calibrate(out: str, device: Optional[str] = None, shapes: Sequence[str] = DEFAULT_SHAPES,
              quick: bool = False, iters: Optional[int] = None, command: str = "",
              log=print, ep: bool = False) -> dict:
    """Measure the cost model and write it to ``out`` (JSON, see the module docstring).

    Args:
        out: path of the cost file (parent folders are created).
        device: ``cuda`` or ``cpu`` (default: cuda when available).
        shapes: keys of :data:`lrmoe.workload.shapes.SHAPES`.
        quick: the tiny grid (experts 1, 4; rows 8, 32), 2 iterations: seconds on a CPU,
            for tests; not a calibration to simulate with.
        iters: timed iterations per point (default 10; 2 with ``quick``).
        command: the command line, stored in ``meta``.
        log: progress printer (one line per shape).
        ep: also time the expert-parallel layer at EP size 1 (:mod:`lrmoe.bench.calibrate_ep`)
            at the two largest points of the most experts per rank: ``shapes[name]``
            gets ``ep_points`` and ``per_row_ms`` ``ep_fwd``/``ep_bwd``. Needs one
            process under torchrun (``torchrun --nproc-per-node 1 -m lrmoe calibrate
            --ep ...``); joins its group (NCCL on CUDA, gloo on the CPU).

    Returns:
        The dict written (``out`` is rewritten whole after every shape, so a run cut
        short keeps the shapes it finished).

    Raises:
        ValueError: an unknown shape (naming the choices), a device other than cpu,
            cuda, cuda:N, ``--device cuda`` where no CUDA device exists, ``iters`` < 1,
            or an ``out`` that cannot be written (checked before measuring:
            :func:`lrmoe.utils.paths.check_output`); with ``ep``: not under torchrun, or
            more than one process.
    """
    if iters is not None and iters < 1:
        raise ValueError(f"--iters must be >= 1, got {iters}")
    check_output("--out", out, is_dir=False)
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"--shapes: unknown shape {s!r}; choose from {sorted(SHAPES)}")
    if device is not None and not (device in ("cpu", "cuda") or (
            device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if (device or "").startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device here; use --device cpu (with "
                         "--quick for a test file)")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    group, created = None, False
    if ep:
        created = not dist.is_initialized()
        group, dev = _join_ep_group(dev, device)
    try:
        return _calibrate(out, dev, shapes, quick, iters, command, log, group)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _join_ep_group(dev: torch.device, device: Optional[str]):
    """(the EP-size-1 group, the device its rank uses) for ``calibrate --ep``: joins the
    group torchrun prepared (:func:`lrmoe.parallel.init_torchrun_group`) unless one
    exists; a group this call made is destroyed again when a check fails.

    Raises:
        ValueError: no group and not under torchrun, a world of more than one rank, or
            ``--device cuda:N`` other than the rank's bound ``cuda:LOCAL_RANK``.
    """
    from lrmoe.parallel import init_torchrun_group
    from lrmoe.parallel.group import under_torchrun
    run = "torchrun --nproc-per-node 1 -m lrmoe calibrate --ep ..."
    if dist.is_initialized():
        world, where = dist.get_world_size(), "the process group has"
    elif under_torchrun():
        world, where = int(os.environ["WORLD_SIZE"]), "torchrun started"
    else:
        raise ValueError("--ep times the expert-parallel layer at EP size 1 in one "
                         f"process started by torchrun (its group); run `{run}`")
    if world != 1:
        raise ValueError(f"--ep calibrates at EP size 1, but {where} {world} processes; "
                         f"run `{run}`")
    created = not dist.is_initialized()
    init_torchrun_group(1, dev.type == "cuda", "calibrate --ep")
    if dev.type == "cuda":
        bound = torch.cuda.current_device()  # cuda:LOCAL_RANK, which NCCL uses
        if dev.index is not None and dev.index != bound:
            if created:
                dist.destroy_process_group()
            raise ValueError(f"--device {device}: under torchrun the process uses "
                             f"cuda:{bound} (LOCAL_RANK); pass --device cuda, or set "
                             f"CUDA_VISIBLE_DEVICES={dev.index}")
        dev = torch.device("cuda", bound)
    return dist.group.WORLD, dev


def _calibrate(out, dev, shapes, quick, iters, command, log, group) -> dict:
    """:func:`calibrate` after its checks; ``group``: the EP-size-1 group or None."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    iters = iters or (2 if quick else 10)
    warmup = 1 if quick else 3
    egrid, rgrid = (QUICK_EXPERTS, QUICK_ROWS) if quick else (EXPERTS_GRID, ROWS_GRID)
    t_start = time.time()
    result = dict(format=FORMAT, quick=quick, bandwidth={}, shapes={}, meta=dict(
        machine=platform.node(), platform=platform.platform(),
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
        torch=torch.__version__, cuda=torch.version.cuda,
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), command=command,
        dtype=str(dtype).replace("torch.", ""), iters=iters, warmup=warmup))
    ceil = measure_ceilings(dev)
    result["bandwidth"] = dict(copy_GBps=ceil["copy_GBps"], gemm_TFLOPs=ceil["gemm_TFLOPs"],
                               h2d_GBps=measure_h2d(dev))
    for shape in shapes:
        points = []
        k = SHAPES[shape].top_k
        for e in egrid:
            for r in rgrid:
                if e * r > MAX_PAIRS or (e * r) % min(k, e):
                    continue
                points.append(measure_point(shape, e, r, dev, dtype, iters, warmup))
        result["shapes"][shape] = dict(
            dims=SHAPES[shape].dims,
            points=points, per_row_ms=per_row_costs(points))
        if group is not None:
            ep_points = [measure_ep_point(*point_layer(shape, p["experts"],
                                                       p["rows_per_expert"], dev, dtype,
                                                       group), dev, iters, warmup, p)
                         for p in ep_points_of(points)]
            result["shapes"][shape]["ep_points"] = ep_points
            result["shapes"][shape]["per_row_ms"].update(per_row_ep(ep_points))
        n_ep = len(result["shapes"][shape].get("ep_points", []))
        log(f"calibrate: {shape}: {len(points)} points"
            + (f" + {n_ep} at EP size 1" if group is not None else "")
            + f" ({time.time() - t_start:.0f} s)")
        # after every shape: a run cut short (a time limit) keeps the shapes it finished
        _write(out, result, time.time() - t_start)
    _write(out, result, time.time() - t_start)
    return result


def _write(out: str, result: dict, seconds: float) -> None:
    result["meta"]["seconds"] = seconds
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)  # whole files only: a reader never sees half a shape


def add_calibrate_arguments(p) -> None:
    """The options of ``lrmoe calibrate``."""
    p.add_argument("--out", required=True, metavar="FILE.json", help="cost file to write")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                   choices=sorted(SHAPES), help="layer shapes to calibrate")
    p.add_argument("--quick", action="store_true",
                   help="tiny grid, 2 iterations (tests; seconds on a CPU)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per grid point (default 10, 2 with --quick)")
    p.add_argument("--ep", action="store_true",
                   help="also time the expert-parallel layer at EP size 1 (its counts "
                        "exchange, re-sorts and gathers: per_row_ms ep_fwd/ep_bwd); run "
                        "as torchrun --nproc-per-node 1 -m lrmoe calibrate --ep ...")
