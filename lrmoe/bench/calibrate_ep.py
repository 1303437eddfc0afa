"""``lrmoe calibrate --ep``: the expert-parallel layer's own work, for the simulator.

The one-device calibration (:mod:`lrmoe.bench.calibrate`) times :class:`lrmoe.LRMoELayer` on one
device. Under expert parallelism the layer does more than that plus its all-to-alls: the
counts exchange and its host sync, the expert side's re-sort of the received rows into
(expert, source) order and back, and the row gathers on both sides
(:mod:`lrmoe.parallel`). The simulator charged none of it, so at EP size 1 it predicted
the EP layer 12 % short on the forward and 23-26 % on the backward (docs/simulation.md,
"Validation"). This measures that work at EP size 1 (one process under torchrun, NCCL on
CUDA, gloo on the CPU), where every row is both sent and received by the one rank:

    extra_fwd = EP forward - one-device forward - (a2a_counts + a2a_dispatch + a2a_combine)
    extra_bwd = EP backward - one-device backward - (a2a_grad + a2a_dx)

(each a median of the same point, the all-to-alls from one profiled EP step; never below
0), and the cost file gets ``per_row_ms["ep_fwd"]`` / ``["ep_bwd"]`` = extra / pairs at
the largest measured point, which the simulator charges per forward / retained row on
each expert rank when W > 1 (csrc/sim/sim.h, ``PerRowCosts``). At EP size 1 the rows a
rank sends and receives are the same, so the split between the source and the expert
side is not measured; charging it to the expert side puts it on the hot rank, where the
EP layer's re-sort and gathers of received rows run.

Legend: E_r experts on the rank, r rows per expert, P = E_r r pairs.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

import torch

from lrmoe.bench.layer_ep import ep_phase_times
from lrmoe.bench.timing import Timer, profile_step, time_iterations

#: the all-to-all ranges of the EP layer's forward and backward (lrmoe/parallel)
A2A_FWD = ("a2a_counts", "a2a_dispatch", "a2a_combine")
A2A_BWD = ("a2a_grad", "a2a_dx")


def measure_ep_point(case, method, inputs, device: torch.device, iters: int, warmup: int,
                     local: dict) -> dict:
    """Time the EP layer (EP size 1) at one calibration point and return its record:
    ``experts``, ``rows_per_expert``, ``pairs``, ``fwd_ms``/``bwd_ms`` (medians, each step
    from an idle device as :func:`lrmoe.bench.calibrate.measure_point` times), ``phases_ms``
    (one profiled step, forward and backward profiled apart), ``a2a_fwd_ms`` /
    ``a2a_bwd_ms`` and ``extra_fwd_ms`` / ``extra_bwd_ms`` (module docstring) against
    ``local``, the one-device point record of the same (experts, rows).

    Args:
        case, method, inputs: the point's layer under the EP group and its inputs
            (:func:`lrmoe.bench.calibrate.point_layer` with ``ep_group``).
        device: where they live. iters, warmup: timed and untimed steps.
        local: the one-device record (``fwd_ms``, ``bwd_ms``, ``experts``,
            ``rows_per_expert``).
    """
    fwd, bwd = time_iterations(method, inputs, Timer(device), warmup, iters, sync_each=True)
    prof_fwd, prof_bwd = profile_step(method, inputs, device, split=True)
    phases = ep_phase_times(prof_fwd, prof_bwd, device.type == "cuda")
    experts, rows = local["experts"], local["rows_per_expert"]
    rec = dict(experts=experts, rows_per_expert=rows, tokens=case.tokens,
               pairs=experts * rows, fwd_ms=statistics.median(fwd),
               bwd_ms=statistics.median(bwd), phases_ms=phases,
               local_fwd_ms=local["fwd_ms"], local_bwd_ms=local["bwd_ms"])
    rec.update(ep_extra(rec))
    del method, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def ep_extra(rec: dict) -> Dict[str, float]:
    """``a2a_fwd_ms``, ``a2a_bwd_ms``, ``extra_fwd_ms``, ``extra_bwd_ms`` of an EP point
    record holding ``fwd_ms``, ``bwd_ms``, ``local_fwd_ms``, ``local_bwd_ms`` and
    ``phases_ms`` (the module docstring's formulas; the extras never below 0)."""
    ph = rec["phases_ms"]
    a2a_f = sum(ph.get(k, 0.0) for k in A2A_FWD)
    a2a_b = sum(ph.get(k, 0.0) for k in A2A_BWD)
    return dict(a2a_fwd_ms=a2a_f, a2a_bwd_ms=a2a_b,
                extra_fwd_ms=max(0.0, rec["fwd_ms"] - rec["local_fwd_ms"] - a2a_f),
                extra_bwd_ms=max(0.0, rec["bwd_ms"] - rec["local_bwd_ms"] - a2a_b))


def ep_points_of(points: Sequence[dict], count: int = 2) -> List[dict]:
    """The one-device points an EP calibration repeats: the ``count`` with the most
    pairs among those with the most experts per rank (where the simulator's EP ranks
    sit: E / W experts, thousands of rows each)."""
    most = max(p["experts"] for p in points)
    top = [p for p in points if p["experts"] == most]
    return sorted(top, key=lambda p: p["pairs"])[-count:]


def per_row_ep(ep_points: Sequence[dict]) -> Dict[str, float]:
    """``ep_fwd`` / ``ep_bwd``: ms per pair of the EP layer's own work at the EP point
    with the most pairs (as :func:`lrmoe.bench.calibrate.per_row_costs` takes its largest
    point); zeros without points."""
    if not ep_points:
        return {"ep_fwd": 0.0, "ep_bwd": 0.0}
    big = max(ep_points, key=lambda p: p["pairs"])
    return {"ep_fwd": big["extra_fwd_ms"] / big["pairs"],
            "ep_bwd": big["extra_bwd_ms"] / big["pairs"]}
