"""The cluster simulator's Python face (docs/simulation.md): cost and link files, routed
loads for a cluster, and :func:`simulate`, which runs the ``lrmoe.sim`` op (the C++
simulator of ``csrc/sim`` over the planner of ``csrc/planner``) and returns its fields
as numpy arrays. Every number it gives is simulated, not measured.

Legend: S steps, Lyr MoE layers, W ranks of one expert-parallel group (the simulated
cluster is ``dp`` copies of it), E experts, ``load_SLWE`` routed pairs per (step, layer,
source rank, expert), N = S x Lyr layer results.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from lrmoe import _C  # noqa: F401  (registers the ops)
from lrmoe.calibrate import load_costs, point_rest
# the link files live in lrmoe.links (the link benchmark reads them too)
from lrmoe.links import Links
from lrmoe.planner import (DEFAULT_BALANCE_SLACK, MemoryModel, ModelShape, check_slots,
                           synthetic_loads)

#: the columns of the op's fields (csrc/ops/sim.cpp kFields, same order); times in ms,
#: bytes plain; memory parts are each part's maximum over ranks, ``memory_peak`` the
#: largest rank's total; ``micro_batches``/``time_ms`` are the batch-pressure answer
#: (1 and fwd + bwd outside it; 0 and NaN when no micro-batch count fits)
FIELDS = ("feasible", "binding", "fwd_ms", "bwd_ms", "src_fwd_ms", "dispatch_ms",
          "expert_fwd_ms", "combine_ms", "src_bwd_ms", "grad_a2a_ms", "expert_bwd_ms",
          "dx_a2a_ms", "replica_ms", "offload_ms", "fwd_link_bytes", "bwd_link_bytes",
          "replica_bytes", "offload_bytes", "memory_base_experts", "memory_replicas",
          "memory_forward_tokens", "memory_backward_tokens", "memory_peak", "limit_bytes",
          "replicas", "pairs", "retained", "fwd_imbalance", "bwd_imbalance",
          "micro_batches", "time_ms")
#: the bytes each rank sends into each collective (the EP layer's ``stats.a2a_bytes``)
SENT_KEYS = ("forward_dispatch", "forward_combine", "backward_grad", "backward_index",
             "backward_dx")
#: PerRowCosts of csrc/sim/sim.h, in its order (ms per pair; compact and scatter per
#: retained row; ep_fwd / ep_bwd per forward / retained row of an expert rank, from
#: ``lrmoe calibrate --ep``, 0 in files without them)
PER_ROW = ("router", "permute", "combine", "fwd_rest", "router_grad", "score", "select",
           "bwd_rest", "compact", "scatter", "ep_fwd", "ep_bwd")


@dataclasses.dataclass(frozen=True)
class Costs:
    """The cost model of one shape from a calibration file (:mod:`lrmoe.calibrate`).

    Attributes:
        shape: the calibrated shape's name. dims: its hidden/inter/experts/top_k/shared.
        gemm_G4: (G, 4) float64 points: experts per rank, rows per expert, forward ms,
            backward ms of the grouped GEMMs (the ``expert_gemm_fwd/bwd`` phases), each
            plus its point's time outside the named phases where the file has the
            points' medians (then ``per_row``'s ``fwd_rest``/``bwd_rest`` are 0).
        per_row: ms per pair of each of :data:`PER_ROW`.
        h2d_GBps: host-to-device bandwidth (0 where the file has none: offload untimed).
        meta: the file's ``meta`` (machine, device, torch, date).
        copy_GBps: device copy bandwidth, bytes read + written (0 where not measured).
    """

    shape: str
    dims: dict
    gemm_G4: np.ndarray
    per_row: Dict[str, float]
    h2d_GBps: float
    meta: dict
    copy_GBps: float = 0.0

    @property
    def self_copy_GBps(self) -> float:
        """GB/s of a rank's all-to-all rows to itself: one read and one write per byte,
        so half the measured copy bandwidth (docs/simulation.md, "Links")."""
        return self.copy_GBps / 2

    @classmethod
    def from_file(cls, path: str, shape: str) -> "Costs":
        """Read ``shape``'s costs from a cost file.

        Raises:
            ValueError: the file holds no calibration of ``shape`` (naming those it has).
        """
        data = load_costs(path)
        if shape not in data["shapes"]:
            raise ValueError(f"{path} has no calibration of {shape!r} (it has "
                             f"{sorted(data['shapes'])}); run `lrmoe calibrate --shapes "
                             f"{shape}` or pick --costs-shape")
        s = data["shapes"][shape]
        points = s["points"]
        per_row = {k: float(s["per_row_ms"].get(k, 0.0)) for k in PER_ROW}
        # the time under no phase (launches, allocator, small kernels between the named
        # ones) is not proportional to pairs: 1.3 ms of a 1.7 ms Qwen3 forward at 2k
        # pairs, 2.0 of 6.9 ms at 262k, 0.6 of 21.7 ms at 1M (configs/costs/h200.json).
        # Where every point has its medians, each point's rest joins its GEMM time and
        # is interpolated with it; per-pair rests (the largest point's) would charge a
        # 32k-token layer 0.15 ms of the 2.0 (docs/simulation.md, "Cost model")
        absorb = all(p.get("fwd_ms") is not None and p.get("bwd_ms") is not None
                     for p in points)
        g = np.array([[p["experts"], p["rows_per_expert"],
                       p["phases_ms"].get("expert_gemm_fwd", 0.0)
                       + (point_rest(p, backward=False) if absorb else 0.0),
                       p["phases_ms"].get("expert_gemm_bwd", 0.0)
                       + (point_rest(p, backward=True) if absorb else 0.0)]
                      for p in points], dtype=np.float64)
        if absorb:
            per_row["fwd_rest"] = per_row["bwd_rest"] = 0.0
        return cls(shape, s["dims"], g, per_row,
                   float(data["bandwidth"].get("h2d_GBps") or 0.0), data["meta"],
                   float(data["bandwidth"].get("copy_GBps") or 0.0))



def cluster_loads(num_ranks: int, num_experts: int, tokens_per_rank: int, top_k: int,
                  steps: int, layers: int, max_over_mean: float = 2.0,
                  trace: Optional[str] = None, seed: int = 0) -> np.ndarray:
    """(S, Lyr, W, E) int64 routed pairs for a cluster.

    Synthetic (``trace`` None): each layer has its own Zipf popularity with the given
    max/mean (hot experts at random ids, fixed over steps), each step a fresh multinomial
    draw of ``tokens_per_rank x top_k`` pairs per source (:func:`lrmoe.planner.
    synthetic_loads`). From a routing trace (``lrmoe train --record-trace``): simulated
    layer l replays recorded layer ``l mod L_rec`` and step s recorded step
    ``s mod S_rec``; that record's tokens are re-sampled with replacement to W x
    tokens_per_rank tokens (the recorded skew at the paper's batch) and dealt to the
    sources in blocks.

    Raises:
        ValueError: non-positive sizes, or a trace of another E / top_k.
    """
    if min(num_ranks, num_experts, tokens_per_rank, steps, layers) < 1:
        raise ValueError("num_ranks, num_experts, tokens_per_rank, steps and layers must be "
                         f">= 1; got {num_ranks}, {num_experts}, {tokens_per_rank}, {steps}, "
                         f"{layers}")
    out = np.zeros((steps, layers, num_ranks, num_experts), dtype=np.int64)
    if trace is None:
        for s in range(steps):
            for l in range(layers):
                out[s, l] = synthetic_loads(num_ranks, num_experts, tokens_per_rank * top_k,
                                            max_over_mean, seed=seed + 7919 * s + l,
                                            popularity_seed=seed + 104729 * (l + 1))
        return out
    from lrmoe.trace import load_trace
    meta, arrays = load_trace(trace)
    if int(meta["num_experts"]) != num_experts or int(meta["top_k"]) != top_k:
        raise ValueError(f"trace {trace} has E={meta['num_experts']}, top_k={meta['top_k']}; "
                         f"the simulated model has E={num_experts}, top_k={top_k}")
    rec_layers = list(meta["layers"])
    rec_steps = len(arrays) // len(rec_layers)
    rng = np.random.default_rng(seed)
    n = num_ranks * tokens_per_rank
    for s in range(steps):
        for l in range(layers):
            ids = arrays[(s % rec_steps) * len(rec_layers) + l % len(rec_layers)]
            pick = ids[rng.integers(0, ids.shape[0], size=n)]
            for w, block in enumerate(pick.reshape(num_ranks, tokens_per_rank, -1)):
                out[s, l, w] = np.bincount(block.reshape(-1), minlength=num_experts)
    return out


def memory_model(shape: ModelShape, budget_bytes: int, resident_bytes: int,
                 optimizer_on_device: bool = False, offload: bool = False) -> MemoryModel:
    """The planner's memory model of ``shape`` (:meth:`MemoryModel.from_shape`); with
    ``offload`` the saved gate/up activations (4 I bytes per forward row) live on the host.
    The optimizer state is off the device by default: the paper's 64 GiB resident
    footprint already holds it (docs/simulation.md, "Memory")."""
    m = MemoryModel.from_shape(shape, budget_bytes, resident_bytes, optimizer_on_device)
    if offload:
        m = dataclasses.replace(m, forward_row_bytes=m.forward_row_bytes
                                - 4 * shape.moe_intermediate_size)
    return m


def simulate(load_SLWE: np.ndarray, policy: str, memory: MemoryModel, costs: Costs,
             links: Links, hidden: int, recalibration_rate: float = 0.0,
             replica_slots: int = 2, symi_slots: int = 0, max_expert_cut: float = 0.5,
             balance_slack: Optional[float] = DEFAULT_BALANCE_SLACK, min_replica_rows: int = 1,
             offload: bool = False, offload_row_bytes: int = 0, elem_bytes: int = 2,
             threads: int = 2, per_rank_bytes: bool = False, multiplier: float = 0.0,
             max_micro_batches: int = 64, chunk_steps: int = 16) -> dict:
    """Simulate every (step, layer) of ``load_SLWE`` under ``policy``.

    Args:
        load_SLWE: (S, Lyr, W, E) non-negative ints.
        policy: fixed, ultraep, symi or lrmoe (:data:`lrmoe.planner.POLICIES`).
        memory: byte sizes and budget (:func:`memory_model`).
        costs, links: the cost model and link costs.
        hidden: H (row bytes = H x elem_bytes).
        recalibration_rate ... min_replica_rows: the planner's settings
            (:func:`lrmoe.planner.plan`).
        offload: saved activations in host memory, ``offload_row_bytes`` per forward row
            moved (timed at ``costs.h2d_GBps``).
        threads: simulator threads. per_rank_bytes: also return ``sent_N5W``.
        multiplier: > 0: batch pressure -- every layer at ``multiplier`` x its loads, split
            into up to ``max_micro_batches`` micro-batches until one fits.
        chunk_steps: steps per op call (bounds memory at large W x E).

    Returns:
        dict: each of :data:`FIELDS` -> (N,) float64 in (step, layer) order; ``sent_N5W``
        (N, 5, W) int64 when asked; ``reason``: the first infeasible plan's reason ('').

    Raises:
        ValueError: bad input (naming the argument), from here or from the op.
    """
    load = torch.as_tensor(np.asarray(load_SLWE), dtype=torch.int64)
    if load.dim() != 4:
        raise ValueError(f"load_SLWE must be 4-D (steps, layers, W, E), got {tuple(load.shape)}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    check_slots(replica_slots, symi_slots, load.shape[3])
    gemm = torch.as_tensor(costs.gemm_G4, dtype=torch.float64)
    per_row = [costs.per_row[k] for k in PER_ROW]
    parts, sents, reason, prev = [], [], "", None
    for s0 in range(0, load.shape[0], chunk_steps):
        chunk = load[s0:s0 + chunk_steps].contiguous()
        fields, sent, why = torch.ops.lrmoe.sim(
            chunk, policy, memory.as_list(), memory.optimizer_on_device,
            float(recalibration_rate), "proportional", int(replica_slots), int(symi_slots),
            float(max_expert_cut), 0, int(min_replica_rows),
            -1.0 if balance_slack is None else float(balance_slack), gemm, per_row,
            links.as_list(costs.self_copy_GBps),
            [int(hidden), int(elem_bytes), int(offload_row_bytes), int(per_rank_bytes)],
            bool(offload), costs.h2d_GBps,
            int(threads), prev, float(multiplier), int(max_micro_batches))
        prev = chunk[-1]
        parts.append(fields.numpy())
        sents.append(sent.numpy())
        reason = reason or why
    f = np.concatenate(parts)
    out = {k: f[:, j] for j, k in enumerate(FIELDS)}
    if per_rank_bytes:
        out["sent_N5W"] = np.concatenate(sents)
    out["reason"] = reason
    return out


def summarize(res: dict, layers: int) -> dict:
    """Per-step totals and per-layer means of a :func:`simulate` result: ``feasible``
    (share of layer plans that fit), mean per-layer ms of every time field over the
    feasible ones, ``moe_ms_per_step`` (mean over steps of the sum over layers of
    fwd + bwd; NaN when any plan is infeasible), peak memory parts (max over layers)."""
    ok = res["feasible"] > 0
    out = {"feasible": float(ok.mean()), "reason": res.get("reason", "")}
    for k in FIELDS:
        if k.endswith("_ms"):
            out[k] = float(np.mean(res[k][ok])) if ok.any() else float("nan")
    for k in ("memory_base_experts", "memory_replicas", "memory_forward_tokens",
              "memory_backward_tokens", "memory_peak", "fwd_link_bytes", "bwd_link_bytes",
              "replica_bytes", "offload_bytes", "replicas", "fwd_imbalance", "bwd_imbalance"):
        out[k] = float(np.max(res[k])) if k.startswith("memory") else float(np.mean(res[k]))
    per_layer = res["fwd_ms"] + res["bwd_ms"]
    steps = per_layer.reshape(-1, layers).sum(axis=1)
    out["moe_ms_per_step"] = float(np.mean(steps)) if ok.all() else float("nan")
    out["retained_fraction"] = float(res["retained"].sum() / max(1.0, res["pairs"].sum()))
    return out


def balanced_boundary(shape: ModelShape, memory: MemoryModel, num_ranks: int,
                      tokens_per_rank: int, multipliers: Sequence[float]) -> Optional[float]:
    """The first batch multiplier at which a perfectly balanced, uncompressed backward
    (every expert n = T K W / E rows, fixed ownership, c = 0) no longer fits the budget
    (None when it fits at every multiplier given); the planner's memory model decides."""
    from lrmoe.planner import plan
    for m in multipliers:
        per = int(round(tokens_per_rank * m)) * shape.top_k
        load = np.full((num_ranks, shape.num_experts), per // shape.num_experts, dtype=np.int64)
        load[:, : per % shape.num_experts] += 1
        if not plan(load, "fixed", memory).feasible:
            return float(m)
    return None
