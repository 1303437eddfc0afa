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
from typing import Optional, Sequence

import numpy as np
import torch

from lrmoe import _C  # noqa: F401  (registers the ops)
from lrmoe.sim.costs import PER_ROW, Costs
# the link files live in lrmoe.sim.links (the link benchmark reads them too)
from lrmoe.sim.links import Links
from lrmoe.planner.plan import DEFAULT_BALANCE_SLACK, MemoryModel, check_slots
from lrmoe.workload.shapes import ModelShape

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
        policy: fixed, ultraep, symi or lrmoe (:data:`lrmoe.planner.plan.POLICIES`).
        memory: byte sizes and budget (:func:`memory_model`).
        costs, links: the cost model and link costs.
        hidden: H (row bytes = H x elem_bytes).
        recalibration_rate ... min_replica_rows: the planner's settings
            (:func:`lrmoe.planner.plan.plan`).
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
    from lrmoe.planner.plan import plan
    for m in multipliers:
        per = int(round(tokens_per_rank * m)) * shape.top_k
        load = np.full((num_ranks, shape.num_experts), per // shape.num_experts, dtype=np.int64)
        load[:, : per % shape.num_experts] += 1
        if not plan(load, "fixed", memory).feasible:
            return float(m)
    return None
