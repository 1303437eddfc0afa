"""The cluster simulator's Python face (docs/simulation.md): cost and link files, routed
loads for a cluster, and :func:`simulate`, which runs the C++ simulator of ``csrc/sim``
(over the planner of ``csrc/planner``), bound as the program ``lrmoe._C.sim``
(csrc/python/sim_bindings.cpp): it fills a ``SimConfig`` and a ``PlanInput`` by field
name and turns the named fields of the ``LayerResult`` it gets back into numpy arrays.
Every number it gives is simulated, not measured.

Legend: S steps, Lyr MoE layers, W ranks of one expert-parallel group (the simulated
cluster is ``dp`` copies of it), E experts, ``load_SLWE`` routed pairs per (step, layer,
source rank, expert), N = S x Lyr layer results.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Sequence

import numpy as np

from lrmoe.ops import _C
from lrmoe.sim.costs import PER_ROW, Costs
# the link files live in lrmoe.sim.links (the link benchmark reads them too)
from lrmoe.sim.links import Links
from lrmoe.planner.plan import (DEFAULT_BALANCE_SLACK, MemoryModel, check_slots, plan_input,
                               set_options)
from lrmoe.workload.shapes import ModelShape


def _fields() -> tuple:
    """The scalar fields of the binding's LayerResult in its order (the per-layer
    ``reason`` and ``sent_bytes_5W`` apart), ``memory_max`` spread into ``memory_<part>``,
    then PressureResult's ``micro_batches`` and ``time_ms``."""
    out = []
    for f in _C.sim.LayerResult._fields:
        if f == "memory_max":
            out += ["memory_" + p for p in _C.planner.MemoryBreakdown._fields]
        elif f not in ("reason", "sent_bytes_5W"):
            out.append(f)
    return tuple(out) + tuple(f for f in _C.sim.PressureResult._fields if f != "layer")


#: the per-layer result keys of :func:`simulate`, derived from the binding's LayerResult
#: (csrc/sim/sim.h): feasible, binding (its number: 0 none, 1 memory, 2
#: backward_row_capacity, 3 replica_slots), the phase times fwd_ms ... offload_ms, what the
#: all-to-all / GEMM overlap saves (overlap_fwd_ms, overlap_bwd_ms; 0 with one chunk), the link
#: bytes fwd_link_bytes ... offload_bytes, memory_base_experts, memory_replicas,
#: memory_forward_tokens, memory_backward_tokens (each part's maximum over ranks),
#: memory_peak (the largest rank's total), limit_bytes, replicas, pairs, retained,
#: fwd_imbalance, bwd_imbalance, owned_experts_max and broadcast_ms (the step terms'
#: inputs: the most experts a rank owns, symi's per-step weight broadcast of the layer's
#: copies; csrc/sim/step.h), kept_previous, moved_replicas, move_ms and move_bytes
#: (hysteresis and the resident replicas' fetch of the moved ones), and micro_batches/time_ms, the batch-pressure answer (1
#: and fwd + bwd outside it; 0 and NaN when no micro-batch count fits), with its
#: micro-batch's activation_bytes (the whole model's, added to the resident;
#: csrc/sim/activations.h) and recompute_ms (0 outside them); times in ms, bytes plain
FIELDS = _fields()


def _getter(key: str):
    """LayerResult -> the number of result key ``key`` (one of FIELDS it holds)."""
    part = key[len("memory_"):]
    if key.startswith("memory_") and part in _C.planner.MemoryBreakdown._fields:
        return operator.attrgetter("memory_max." + part)
    if key == "binding":  # the enum member's number
        return lambda r: int(r.binding)
    return operator.attrgetter(key)


_LAYER_GETTERS = tuple((k, _getter(k)) for k in FIELDS
                       if k not in _C.sim.PressureResult._fields)
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


#: what each layer keeps between its forward and backward under batch pressure
#: (csrc/sim/activations.h): ``layer`` is the model before issue 30 (one MoE layer's
#: buffers against a fixed resident)
ACTIVATION_MODES = ("layer", "keep", "recompute", "offload")


def dense_token_bytes(shape: ModelShape, elem_bytes: int = 2) -> int:
    """Bytes one token saves for backward per layer outside the routed experts:
    ``15 H x elem_bytes / 2 + 4 E``.

    Source: the per-layer activation estimate of Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models" (2022), s b h (34 + 5 a s / h) bytes for
    16-bit activations, of which the attention block is 11 s b h + 5 a s^2 b, the MLP
    19 s b h and the two layer norms 4 s b h. Kept here: attention 11 H + norms 4 H per
    token. Dropped: the 5 a s^2 b score/softmax/dropout term (flash attention saves no
    s x s matrix, only its output and an fp32 log-sum-exp per row and head) and the MLP's
    19 H (the MoE layer replaces it; its saved rows are counted per routed row from
    :meth:`MemoryModel.from_shape`'s ``forward_row_bytes``). Added: the router's fp32
    probabilities, 4 E bytes. An estimate: it ignores GQA's narrower K/V and wider Q
    (Qwen3-30B-A3B: Q 2 H, K and V H / 4 each) and the attention dropout mask it counts
    (1 H) is absent from Qwen3's training; ``lrmoe sim --dense-token-bytes`` overrides it.

    Args:
        shape: H (``hidden_size``) and E (``num_experts``).
        elem_bytes: bytes per activation element (bf16: 2); the H terms scale with it.

    Returns:
        int bytes per token per layer (Qwen3-30B-A3B, bf16: 15 x 2048 + 4 x 128 = 31232).

    Raises:
        ValueError: elem_bytes < 1.
    """
    if elem_bytes < 1:
        raise ValueError(f"elem_bytes must be >= 1 (bf16: 2), got {elem_bytes}")
    return 15 * shape.hidden_size * elem_bytes // 2 + 4 * shape.num_experts


def activation_model(shape: ModelShape, mode: str = "keep", layers: Optional[int] = None,
                     elem_bytes: int = 2,
                     dense_bytes: Optional[int] = None) -> "_C.sim.ActivationModel":
    """The whole model's activations under batch pressure (csrc/sim/activations.h) as a
    ``lrmoe._C.sim.ActivationModel``: per token per layer ``dense_bytes`` (default
    :func:`dense_token_bytes`) and a ``H x elem_bytes`` input; per routed row the
    planner's forward row ``4 H + 4 I`` bytes (:meth:`MemoryModel.from_shape`), of which
    offload moves the gate/up ``4 I`` to the host (as ``--offload``); ``layers`` held on a
    GPU (default ``shape.moe_layers``), ``shape.top_k`` rows per token.

    Args:
        mode: one of :data:`ACTIVATION_MODES`.

    Raises:
        ValueError: an unknown mode, layers < 1 or dense_bytes < 0 (naming the flag).
    """
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"--activations must be one of {', '.join(ACTIVATION_MODES)}, got "
                         f"{mode!r}")
    n = shape.moe_layers if layers is None else layers
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"--layers-resident must be an integer >= 1 (the layers whose "
                         f"activations one GPU holds; {shape.name} has {shape.moe_layers}), "
                         f"got {n!r}")
    d = dense_token_bytes(shape, elem_bytes) if dense_bytes is None else dense_bytes
    if not d >= 0:
        raise ValueError(f"--dense-token-bytes must be >= 0, got {d}")
    h, i = shape.hidden_size, shape.moe_intermediate_size
    row = MemoryModel.from_shape(shape, 0, 0).forward_row_bytes
    return _C.sim.ActivationModel(mode=getattr(_C.sim.ActivationMode, mode), layers=int(n),
                                  top_k=int(shape.top_k), dense_token_bytes=int(d),
                                  moe_row_bytes=int(row),
                                  offload_row_bytes=int(2 * 2 * i * elem_bytes // 2),
                                  input_token_bytes=int(h * elem_bytes))


def simulate(load_SLWE: np.ndarray, policy: str, memory: MemoryModel, costs: Costs,
             links: Links, hidden: int, recalibration_rate: float = 0.0,
             replica_slots: int = 2, symi_slots: int = 0, max_expert_cut: float = 0.5,
             balance_slack: Optional[float] = DEFAULT_BALANCE_SLACK, min_replica_rows: int = 1,
             offload: bool = False, offload_row_bytes: int = 0, elem_bytes: int = 2,
             threads: int = 2, per_rank_bytes: bool = False, multiplier: float = 0.0,
             max_micro_batches: int = 64, chunk_steps: int = 16, top_k: int = 1,
             activations: Optional["_C.sim.ActivationModel"] = None, *, joint: bool = False,
             replica_cost_rows: int = 0, gpus_per_node: Optional[int] = None,
             ultraep_refine: bool = False, spare_capacity_split: bool = False,
             replan_threshold: Optional[float] = None,
             resident_replicas: bool = False) -> dict:
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
        chunk_steps: steps per simulator call (bounds memory at large W x E).
        top_k: experts per token the all-to-alls deduplicate over (:func:`sim_config`;
            1: lrmoe's own EP layer, one row per pair).
        activations: batch pressure only: the whole model's activations added to the
            resident of every micro-batch (:func:`activation_model`); None: the old
            model, one MoE layer's buffers against a fixed resident.
        joint, replica_cost_rows, gpus_per_node, ultraep_refine, spare_capacity_split:
            the planner's options, exactly as :func:`lrmoe.planner.plan.plan` takes them
            (checked by :func:`lrmoe.planner.plan.set_options`; joint lrmoe only,
            ultraep_refine ultraep only, gpus_per_node in [1, W]).
        replan_threshold: None: every (step, layer) planned afresh. A number in [0, 1):
            hysteresis across steps (csrc/planner/hysteresis.h), run inside the C++
            simulator (csrc/sim/sim.h ``SimConfig.replan_threshold``): each layer's plan
            keeps the placement of the same layer's plan one step earlier unless a fresh
            plan is better by more than this fraction of its max rank time; the threads
            then take whole layers. fixed, ultraep, lrmoe only; with ``multiplier`` too
            (each step's micro-batch plan against the previous step's).
        resident_replicas: False (the figures' model): replica weights stream per layer,
            so moving a replica costs nothing extra. True: replicas keep their slot from
            step to step; one placed anew fetches its weights inside the layer
            (``move_ms``, in ``fwd_ms``), every replica is refreshed after the optimizer
            step (``broadcast_ms``); csrc/sim/sim.h ``SimConfig.resident_replicas``.

    Returns:
        dict: each of :data:`FIELDS` -> (N,) float64 in (step, layer) order
        (``activation_bytes`` and ``recompute_ms`` 0 outside batch pressure);
        among them ``kept_previous`` (1.0 where hysteresis kept the previous placement),
        ``moved_replicas`` (replicas absent from the layer's previous-step placement, every
        replica on its first step; 0 unless ``replan_threshold`` or
        ``resident_replicas``) and ``move_ms`` / ``move_bytes`` (their weight fetch);
        ``sent_N5W`` (N, 5, W) int64 when asked; ``reason``: the first infeasible plan's
        reason ('').

    Raises:
        ValueError: bad input (naming the argument or the C++ field), from here or from
            the simulator.
    """
    load = np.asarray(load_SLWE).astype(np.int64, copy=False)
    if load.ndim != 4:
        raise ValueError(f"load_SLWE must be 4-D (steps, layers, W, E), got {tuple(load.shape)}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    check_slots(replica_slots, symi_slots, load.shape[3])
    cfg = sim_config(costs, links, hidden, offload=offload, offload_row_bytes=offload_row_bytes,
                     elem_bytes=elem_bytes, per_rank_bytes=per_rank_bytes, top_k=top_k)
    if activations is not None:
        cfg.activations = activations
    W = load.shape[2]
    inp = plan_input(W, load.shape[3], memory, recalibration_rate, "proportional",
                     replica_slots, symi_slots, max_expert_cut, 0, min_replica_rows,
                     balance_slack)
    set_options(inp, policy, joint=joint, replica_cost_rows=replica_cost_rows,
                gpus_per_node=gpus_per_node, ultraep_refine=ultraep_refine,
                spare_capacity_split=spare_capacity_split,
                replan_threshold=0.0 if replan_threshold is None else replan_threshold)
    if replan_threshold is not None and policy == "symi":
        raise ValueError("replan_threshold (hysteresis, --replan-threshold) applies to the "
                         "per-layer plans of fixed, ultraep and lrmoe; symi's slots move "
                         "every step by design: pass None for symi")
    cfg.replan_threshold = -1.0 if replan_threshold is None else float(replan_threshold)
    cfg.resident_replicas = bool(resident_replicas)
    # hysteresis and resident replicas chain each layer's steps (csrc/sim/sim.h
    # simulate_trace): the whole trace in one call, since a chunk's first step would
    # have no previous placement
    chained = replan_threshold is not None or (resident_replicas and policy != "symi")
    step_chunk = load.shape[0] if chained else chunk_steps
    # (layer, micro_batches, time_ms, activation_bytes, recompute_ms) per (step, layer)
    rows, prev = [], None
    for s0 in range(0, load.shape[0], step_chunk):
        chunk = np.ascontiguousarray(load[s0:s0 + step_chunk])
        if multiplier > 0:  # batch pressure: every (step, layer) at m x its loads
            for p in _C.sim.simulate_pressure_trace(policy, inp, chunk, float(multiplier),
                                                    int(max_micro_batches), cfg, int(threads)):
                rows.append((p.layer, p.micro_batches, p.time_ms, p.activation_bytes,
                             p.recompute_ms))
        else:
            for r in _C.sim.simulate_trace(policy, inp, chunk, cfg, int(threads), prev):
                rows.append((r, 1, r.fwd_ms + r.bwd_ms, 0, 0.0))
        prev = chunk[-1]
    layers = [r[0] for r in rows]
    out = {k: np.fromiter(map(get, layers), np.float64, len(layers)) for k, get in _LAYER_GETTERS}
    for j, k in enumerate(("micro_batches", "time_ms", "activation_bytes", "recompute_ms"), 1):
        out[k] = np.array([r[j] for r in rows], dtype=np.float64)
    if per_rank_bytes:
        # infeasible layers send nothing: zeros, as their fields say no time either
        out["sent_N5W"] = np.stack([r.sent_bytes_5W.reshape(len(SENT_KEYS), W)
                                    if r.sent_bytes_5W.size else
                                    np.zeros((len(SENT_KEYS), W), dtype=np.int64)
                                    for r in layers]).reshape(-1, len(SENT_KEYS), W)
    out["reason"] = next((r.reason for r in layers if not r.feasible), "")
    return out


def derived_replica_cost_rows(shape: ModelShape, costs: Costs, links: Links,
                              load: np.ndarray, elem_bytes: int = 2) -> int:
    """The replica cost kappa of lrmoe's joint objective (``replica_cost_rows``, rows)
    derived from the links and the calibrated cost curve (csrc/sim/sim.h
    ``derived_replica_cost_rows``)::

        t_w   = 3 H I elem_bytes / (intra_GBps 1e6) + intra_latency_us / 1e3     (ms)
        t_row = (gemm_fwd(k, k r) + gemm_bwd(k, k r)) / (2 k r)                  (ms / row)
        kappa = round(t_w / t_row),   k = E / W,  r = mean routed rows per expert

    t_w: one expert's weights (gate, up, down: 3 matrices of hidden x moe_intermediate)
    over NVLink, where replicas go first (docs/planner.md, "Topology"); t_row: one row of
    the expert GEMMs on a balanced rank at the calibrated curve
    (:func:`sim_config`'s GemmTable, roofline included), a forward and a retained row
    averaged since the joint objective counts each as one row (csrc/planner/joint.h).

    Args:
        load: (..., W, E) routed pairs; r is their mean per (step, layer) cell over E.

    Raises:
        ValueError: ``load`` not at least 2-D or with no routed pair (naming it), or
            the simulator's (an empty cost grid, intra_GBps <= 0).
    """
    a = np.asarray(load)
    if a.ndim < 2 or a.shape[-1] < 1 or a.shape[-2] < 1:
        raise ValueError(f"load must be (..., W, E), got shape {tuple(a.shape)}")
    W, E = a.shape[-2:]
    cells = max(1, a.size // (W * E))
    r = float(a.sum()) / cells / E
    if not r > 0:
        raise ValueError("load has no routed pair: the replica cost per row is undefined; "
                         "give --replica-cost-rows explicitly")
    cfg = sim_config(costs, links, shape.hidden_size, elem_bytes=elem_bytes)
    w = 3 * shape.hidden_size * shape.moe_intermediate_size * elem_bytes
    return int(_C.sim.derived_replica_cost_rows(cfg, int(w), E / W, r))


#: per-step result keys of :func:`simulate_cluster` with a ``step`` model: the MoE layers
#: (slowest group, and the mean group's) and the terms of csrc/sim/step.h, ms
STEP_KEYS = ("moe_ms", "mean_group_moe_ms", "expert_allreduce_ms", "dense_allreduce_ms",
             "optimizer_ms", "broadcast_ms", "total_ms")


def step_model(shape: ModelShape, groups: int, hbm_GBps: float,
               dense_params: Optional[float] = None,
               moe_layers: Optional[int] = None) -> "_C.sim.StepModel":
    """The step outside the MoE layers (csrc/sim/step.h) of ``groups`` data-parallel
    copies of an EP group of ``shape``: every GPU holds the dense parameters whole (no
    tensor parallelism) and all-reduces their fp32 gradients (4 B each, as
    :meth:`MemoryModel.from_shape`'s expert gradients); one expert has 3 H I parameters;
    Adam at ``hbm_GBps``.

    Args:
        dense_params: parameters outside the routed experts (default
            ``shape.dense_params``).
        moe_layers: the model's MoE layers the simulated ones stand for (default
            ``shape.moe_layers``).

    Raises:
        ValueError: groups < 1, hbm_GBps <= 0, or no dense parameter count (naming
            ``--dense-params``, the flag that gives one).
    """
    dense = shape.dense_params if dense_params is None else dense_params
    if not dense or not dense > 0:
        raise ValueError(f"--dense-params: the dense (non-expert) parameters of {shape.name} "
                         "are not in lrmoe/workload/shapes.py; give them, e.g. "
                         "--dense-params 1.54e9 for qwen3-30b-a3b (attention, norms, routers, "
                         "embeddings)")
    if not hbm_GBps > 0:
        raise ValueError(f"--hbm-gbps must be > 0 (device memory GB/s for the optimizer), "
                         f"got {hbm_GBps}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    return _C.sim.StepModel(dp_size=int(groups), dense_grad_bytes=4.0 * dense,
                            dense_params=float(dense),
                            expert_params=3.0 * shape.hidden_size * shape.moe_intermediate_size,
                            hbm_GBps=float(hbm_GBps),
                            moe_layers=int(shape.moe_layers if moe_layers is None else moe_layers))


def simulate_cluster(load_SGLWE: np.ndarray, policy: str, memory: MemoryModel, costs: Costs,
                     links: Links, hidden: int, recalibration_rate: float = 0.0,
                     replica_slots: int = 2, balance_slack: Optional[float] = DEFAULT_BALANCE_SLACK,
                     threads: int = 2, top_k: int = 1,
                     step: Optional["_C.sim.StepModel"] = None, *, joint: bool = False,
                     replica_cost_rows: int = 0, gpus_per_node: Optional[int] = None,
                     ultraep_refine: bool = False, spare_capacity_split: bool = False,
                     replan_threshold: Optional[float] = None,
                     resident_replicas: bool = False) -> dict:
    """Every expert-parallel group of a cluster (its data-parallel copies), each on its
    own loads: a (step, layer) takes as long as its slowest group, whose gradient
    reduction the others wait for (csrc/sim/cluster.h; docs/simulation.md, "64-1024
    GPUs").

    Args:
        load_SGLWE: (S, Gr, Lyr, W, E) non-negative ints, Gr groups of W ranks.
        policy ... top_k: as :func:`simulate` (offload and batch pressure are not
            modelled here).
        step: the model outside the MoE layers (:func:`step_model`; its ``dp_size`` must
            be Gr), for the per-step results.
        joint ... spare_capacity_split: the planner's options, as :func:`simulate`
        replan_threshold, resident_replicas: as :func:`simulate`; every group's layers
            walk their own steps (csrc/sim/cluster.cpp flattens (group, layer) into
            simulate_trace's layer axis).

    Returns:
        dict of (S x Lyr,) float64 in (step, layer) order: ``feasible`` (1: every group's
        plan fits), ``time_ms`` (the slowest group's fwd + bwd, NaN when infeasible),
        ``slowest_group``, ``mean_group_ms`` (mean over the feasible groups),
        ``owned_experts_max``, ``broadcast_ms`` (symi's, the slowest group's); with
        ``step`` also ``steps``: each of :data:`STEP_KEYS` -> (S,) float64 (csrc/sim/cluster.h
        cluster_steps: the layers summed and scaled to ``step.moe_layers``, plus the
        gradient all-reduces, Adam and symi's broadcast; NaN for a step that does not fit).

    Raises:
        ValueError: not 5-D, threads < 1, ``step.dp_size`` not Gr, or what the simulator
            refuses (naming it).
    """
    load = np.asarray(load_SGLWE).astype(np.int64, copy=False)
    if load.ndim != 5:
        raise ValueError(f"load_SGLWE must be 5-D (steps, groups, layers, W, E), got "
                         f"{tuple(load.shape)}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    check_slots(replica_slots, 0, load.shape[4])
    cfg = sim_config(costs, links, hidden, top_k=top_k)
    if replan_threshold is not None and policy == "symi":
        raise ValueError("replan_threshold (--replan-threshold) applies to fixed, ultraep and "
                         "lrmoe; symi's slots move every step by design: pass None for symi")
    cfg.replan_threshold = -1.0 if replan_threshold is None else float(replan_threshold)
    cfg.resident_replicas = bool(resident_replicas)
    inp = plan_input(load.shape[3], load.shape[4], memory, recalibration_rate, "proportional",
                     replica_slots, 0, 0.5, 0, 1, balance_slack)
    set_options(inp, policy, joint=joint, replica_cost_rows=replica_cost_rows,
                gpus_per_node=gpus_per_node, ultraep_refine=ultraep_refine,
                spare_capacity_split=spare_capacity_split)
    if step is not None and step.dp_size != load.shape[1]:
        raise ValueError(f"step.dp_size must be the loads' {load.shape[1]} groups, got "
                         f"{step.dp_size}; build it with step_model(shape, groups, ...)")
    res = _C.sim.simulate_cluster(policy, inp, np.ascontiguousarray(load), cfg, int(threads))
    out = {k: np.array([getattr(r, k) for r in res], dtype=np.float64)
           for k in ("feasible", "time_ms", "slowest_group", "mean_group_ms",
                     "owned_experts_max", "broadcast_ms")}
    if step is not None:
        st = _C.sim.cluster_steps(res, load.shape[0], load.shape[2], load.shape[3],
                                  float(memory.expert_grad_bytes), cfg.link, step)
        t = [s.terms for s in st]
        out["steps"] = {
            "moe_ms": np.array([s.moe_ms for s in st]),
            "mean_group_moe_ms": np.array([s.mean_group_moe_ms for s in st]),
            **{k: np.array([getattr(x, k) for x in t]) for k in STEP_KEYS[2:6]}}
        out["steps"]["total_ms"] = out["steps"]["moe_ms"] + sum(
            out["steps"][k] for k in STEP_KEYS[2:6])
    return out

#: the expert GEMMs' roofline on an H200 (docs/simulation.md, "Cost model", gives the
#: sources): dense bf16 TFLOP/s, HBM GB/s, and an assumed launch floor per grouped-GEMM
#: pass of one rank in us
H200_PEAK_TFLOPS = 989.0
H200_HBM_GBPS = 4800.0
GEMM_LAUNCH_US = 10.0


def _roofline(costs: Costs, elem_bytes: int) -> "_C.sim.Roofline":
    """The H200 roofline of ``costs.dims``' expert (hidden, inter) for a cost file measured
    on an H200 (``meta.device`` names one); off (peak 0) for another device, whose
    constants are not known here, or dims without hidden or inter."""
    h, i = costs.dims.get("hidden"), costs.dims.get("inter")
    if not h or not i or "H200" not in str(costs.meta.get("device", "")):
        return _C.sim.Roofline()
    return _C.sim.Roofline(peak_TFLOPs=H200_PEAK_TFLOPS, hbm_GBps=H200_HBM_GBPS,
                           launch_us=GEMM_LAUNCH_US, hidden=int(h), inter=int(i),
                           elem_bytes=int(elem_bytes))


def sim_config(costs: Costs, links: Links, hidden: int, offload: bool = False,
               offload_row_bytes: int = 0, elem_bytes: int = 2,
               per_rank_bytes: bool = False, top_k: int = 1) -> "_C.sim.SimConfig":
    """The simulator's settings as a ``lrmoe._C.sim.SimConfig``, every field set by name
    (arguments as in :func:`simulate`; the device copy of a rank's own rows runs at
    :attr:`Costs.self_copy_GBps`). The expert GEMMs are floored at the H200 roofline
    (:data:`H200_PEAK_TFLOPS`, :data:`H200_HBM_GBPS`, :data:`GEMM_LAUNCH_US`) of the cost
    file's ``dims`` (hidden, inter), and beyond the calibrated rows extrapolated along it
    (only for a cost file measured on an H200: :func:`_roofline`). The all-to-alls follow
    csrc/sim/a2a.h: hierarchical over nodes, ``links.per_peer_us`` per distinct peer,
    ``links.chunks`` pipelined chunks, and a token's rows deduplicated per rank and node
    over its ``top_k`` experts (1: one row per (token, expert) pair, as lrmoe's own EP
    layer sends; the model's top_k: a deduplicating, DeepEP-style dispatcher).

    Raises:
        ValueError: ``costs.gemm_G4`` not (points, 4) with at least one point; ``top_k``
            not an integer >= 1; a value a
            field cannot hold (TypeError for a wrong type), naming the field.
    """
    g = np.asarray(costs.gemm_G4, dtype=np.float64)
    if g.ndim != 2 or g.shape[1] != 4 or g.shape[0] < 1:
        raise ValueError(f"costs.gemm_G4 must be (points, 4): experts, rows, forward ms, "
                         f"backward ms, got shape {g.shape}; run `lrmoe calibrate` for a "
                         "cost file")
    cost = _C.sim.CostModel(
        gemm=[_C.sim.GemmPoint(experts=e, rows=r, fwd_ms=f, bwd_ms=b) for e, r, f, b in g],
        per_row=_C.sim.PerRowCosts(**{k: float(costs.per_row[k]) for k in PER_ROW}),
        h2d_GBps=float(costs.h2d_GBps), roofline=_roofline(costs, elem_bytes))
    link = _C.sim.LinkModel(gpus_per_node=int(links.gpus_per_node),
                            intra_GBps=float(links.intra_GBps),
                            intra_latency_us=float(links.intra_latency_us),
                            inter_GBps=float(links.inter_GBps),
                            inter_latency_us=float(links.inter_latency_us),
                            self_GBps=float(costs.self_copy_GBps),
                            per_peer_us=float(links.per_peer_us), chunks=int(links.chunks),
                            overlap_chunks=int(links.overlap_chunks),
                            overlap_tile_rows=int(links.overlap_tile_rows),
                            overlap_comm_share=float(links.overlap_comm_share))
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k (experts per token the all-to-all deduplicates over) must "
                         f"be an integer >= 1, got {top_k!r}; 1 is lrmoe's own EP layer")
    return _C.sim.SimConfig(cost=cost, link=link, hidden=int(hidden), elem_bytes=int(elem_bytes),
                            offload=bool(offload), offload_row_bytes=int(offload_row_bytes),
                            top_k=int(top_k),
                            per_rank_bytes=bool(per_rank_bytes))


def summarize(res: dict, layers: int) -> dict:
    """Per-step totals and per-layer means of a :func:`simulate` result: ``feasible``
    (share of layer plans that fit), mean per-layer ms of every time field over the
    feasible ones, ``moe_ms_per_step`` (mean over steps of the sum over layers of
    fwd + bwd; NaN when any plan is infeasible), peak memory parts (max over layers),
    with hysteresis the share of plans that kept their placement (``kept_previous``) and
    the mean replicas placed anew per plan (``moved_replicas``)."""
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
    # hysteresis: the share of plans that kept the previous placement, replicas moved
    for k in ("kept_previous", "moved_replicas"):
        if k in res:
            out[k] = float(np.mean(res[k]))
    return out


def balanced_boundary(shape: ModelShape, memory: MemoryModel, num_ranks: int,
                      tokens_per_rank: int, multipliers: Sequence[float],
                      activations: Optional["_C.sim.ActivationModel"] = None) -> Optional[float]:
    """The first batch multiplier at which a perfectly balanced, uncompressed backward
    (every expert n = T K W / E rows, fixed ownership, c = 0) no longer fits the budget
    in one pass (None when it fits at every multiplier given); the planner's memory model
    decides, with ``activations`` (:func:`activation_model`) of the T = m x
    ``tokens_per_rank`` tokens added to the resident."""
    from lrmoe.planner.plan import plan
    for m in multipliers:
        tokens = int(round(tokens_per_rank * m))
        per = tokens * shape.top_k
        load = np.full((num_ranks, shape.num_experts), per // shape.num_experts, dtype=np.int64)
        load[:, : per % shape.num_experts] += 1
        mem = memory
        if activations is not None:
            act = _C.sim.activation_bytes(activations, tokens)
            extra = act.dense + act.moe + act.inputs
            if memory.resident_bytes + extra > memory.budget_bytes:
                return float(m)
            mem = dataclasses.replace(memory, resident_bytes=memory.resident_bytes + extra)
        if not plan(load, "fixed", mem).feasible:
            return float(m)
    return None
