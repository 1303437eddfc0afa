"""Placement planning: which ranks hold each expert, where every routed pair runs, how
many pairs keep their backward, and what it costs in memory (docs/planner.md).

The planner itself is plain C++ (``csrc/planner``), bound as the program
``lrmoe._C.planner`` (csrc/python/planner_bindings.cpp: its ``PlanInput`` and ``Plan``
structs with named fields, and ``plan(policy, input)``); this module is its Python face:
the model shapes and byte sizes, routed loads (synthetic or from a routing trace), and
:func:`plan`, which fills a ``PlanInput`` by field name and returns a frozen
:class:`Plan` read from the C++ plan's fields. Every rank computes the same plan from
the same all-gathered counts.

Legend: W ranks of the expert-parallel group (= source ranks), E experts, K top_k,
I expert instances (owner copies + replicas; not the intermediate size), H hidden size,
``load_WE`` routed pairs from source s to expert e, ``forward_IW`` / ``retained_IW``
rows of the (instance, source) cells, ``memory_W4`` bytes per rank (base experts,
replicas, forward tokens, backward tokens).
"""
from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Tuple

import numpy as np
import torch

from lrmoe.ops import _C
from lrmoe.ops import QUOTA_RULES
from lrmoe.workload.shapes import ModelShape

#: the policies, by the names of the binding's PolicyKind (planner/plan.h):
#: fixed, ultraep, symi, lrmoe
POLICIES = tuple(_C.planner.PolicyKind.__members__)
#: :attr:`Plan.binding`'s values, the binding's Binding names: none, memory,
#: backward_row_capacity, replica_slots
BINDINGS = tuple(_C.planner.Binding.__members__)
#: the columns of :attr:`Plan.memory_W4`, fields of the C++ MemoryBreakdown
MEMORY_PARTS = ("base_experts", "replicas", "forward_tokens", "backward_tokens")
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Bytes of one expert copy and of one token row on a rank (docs/planner.md,
    "Memory model"); all plain bytes.

    Attributes:
        expert_weight_bytes: one copy's weights (bf16: 3 H I x 2).
        expert_grad_bytes: one copy's fp32 gradient buffer (3 H I x 4).
        expert_optimizer_bytes: fp32 master weights + Adam m, v (3 H I x 12).
        optimizer_on_device: False when the optimizer state lives on the host.
        forward_row_bytes: per routed row computed on a rank: dispatched x (2H), saved
            gate/up activations (2 x 2I), expert output (2H), in bf16.
        backward_row_bytes: per retained row: gradient row (2H), gathered x (2H),
            gathered gate/up (4I), phi (2I), grad phi (2I), grad gate/up (4I), dx (2H).
        budget_bytes: B, device memory per GPU.
        resident_bytes: what lives outside this layer's experts and token buffers
            (parameters, optimizer state, attention activations), measured or configured;
            ``lrmoe sim``'s batch pressure adds the whole model's activations of each
            micro-batch to it (csrc/sim/activations.h).
    """

    expert_weight_bytes: int
    expert_grad_bytes: int
    expert_optimizer_bytes: int
    forward_row_bytes: int
    backward_row_bytes: int
    budget_bytes: int
    resident_bytes: int
    optimizer_on_device: bool = True

    @classmethod
    def from_shape(cls, shape: ModelShape, budget_bytes: int, resident_bytes: int,
                   optimizer_on_device: bool = True) -> "MemoryModel":
        """The byte sizes of ``shape`` (formulas in the attribute docs above)."""
        h, i = shape.hidden_size, shape.moe_intermediate_size
        params = 3 * h * i
        return cls(expert_weight_bytes=2 * params, expert_grad_bytes=4 * params,
                   expert_optimizer_bytes=12 * params,
                   forward_row_bytes=2 * h + 2 * 2 * i + 2 * h,
                   backward_row_bytes=2 * h + 2 * h + 4 * i + 2 * i + 2 * i + 4 * i + 2 * h,
                   budget_bytes=budget_bytes, resident_bytes=resident_bytes,
                   optimizer_on_device=optimizer_on_device)

    def to_cpp(self) -> "_C.planner.MemoryModel":
        """The C++ planner's MemoryModel, filled field by field (the names are the same)."""
        return _C.planner.MemoryModel(**{f.name: getattr(self, f.name)
                                         for f in dataclasses.fields(self)})


#: the largest byte count the planner takes (its int64 sums of per-rank bytes must not
#: overflow); 4 EiB, far above any device
MAX_BYTES = 1 << 62


def parse_bytes(text: str, name: str = "size") -> int:
    """``"80GiB"``, ``"512MiB"``, ``"1.5e9"`` -> bytes (int).

    Args:
        text: a number with an optional B/KiB/MiB/GiB/TiB (or KB/MB/GB/TB) unit.
        name: what the value is (a flag such as ``--budget``), for the messages.

    Raises:
        ValueError: not such a number, or more than :data:`MAX_BYTES` (``1e30``,
            ``1e400``), naming ``name``.
    """
    m = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[0-9]+)?)\s*([KMGT]i?B|B)?\s*",
                     str(text), re.I)
    if not m:
        raise ValueError(f"{name}: cannot read {text!r} as a size; write e.g. 80GiB, 512MiB "
                         "or 1e9")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1}
    for k, p in zip("KMGT", range(1, 5)):
        scale[f"{k}IB"] = 1024 ** p
        scale[f"{k}B"] = 1000 ** p
    value = float(m.group(1)) * scale[unit]
    if not value <= MAX_BYTES:  # also inf (1e400)
        raise ValueError(f"{name}: {text!r} is more than 2^62 bytes (4 EiB), the largest size "
                         "the planner takes; write e.g. 80GiB")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One layer's plan for one micro-batch (docs/planner.md, "The plan").

    Attributes:
        policy: the policy that made it.
        instance_offsets: (E + 1,) int64; instances of expert e are
            ``[instance_offsets[e], instance_offsets[e + 1])``, the owner first.
        instance_rank: (I,) int64 rank of each instance (one per rank per expert at most).
        forward_IW: (I, W) int64 forward rows of (instance, source); summed over an
            expert's instances it is ``load_WE[:, e]``: every routed pair runs once.
        retained_IW: (I, W) int64 retained rows (backward shares), ``<= forward_IW``;
            an expert's cells sum to ``quota_E[e]``.
        quota_E: (E,) int64 retention quotas (the baselines keep every pair).
        fixed_rows_W: (W,) rows per rank under fixed ownership (-1 where E % W != 0).
        forward_rows_W, backward_rows_W: (W,) rows each rank computes forward / backward.
        memory_W4: (W, 4) int64 bytes: base experts, replicas, forward tokens, backward tokens.
        limit_bytes: budget - resident, every rank's limit.
        replicas: instances beyond the owners.
        feasible: every rank within its limit (and row capacity).
        binding: which constraint binds (one of :data:`BINDINGS`).
        binding_rank: the rank furthest over (-1 when feasible).
        shortfall: bytes (memory) or rows (row capacity) over the limit.
        reason: why it does not fit, naming the constraint and by how much ('' if it fits).
        forward_bound: rows, a lower bound on the max forward rows per rank of every plan
            of this instance, feasible or not (the routed demand n_E; the same for every
            policy; csrc/planner/bound.h).
        backward_bound: rows, a lower bound on the max retained rows per rank of every
            plan that keeps this plan's quotas (``quota_E``; = ``forward_bound`` for the
            baselines, which keep every pair).
        kept_previous: with ``previous_plan``: the previous placement was kept
            (hysteresis; csrc/planner/hysteresis.h).
        moved_replicas: with ``previous_plan``: replicas of this plan absent from it.
        moved_bytes: ``moved_replicas`` x expert_weight_bytes, the weights copied.
    """

    policy: str
    instance_offsets: torch.Tensor
    instance_rank: torch.Tensor
    forward_IW: torch.Tensor
    retained_IW: torch.Tensor
    quota_E: torch.Tensor
    fixed_rows_W: torch.Tensor
    forward_rows_W: torch.Tensor
    backward_rows_W: torch.Tensor
    memory_W4: torch.Tensor
    limit_bytes: int
    replicas: int
    feasible: bool
    binding: str
    binding_rank: int
    shortfall: int
    reason: str
    forward_bound: int = 0
    backward_bound: int = 0
    kept_previous: bool = False
    moved_replicas: int = 0
    moved_bytes: int = 0

    def max_forward_rows(self) -> int:
        """The objective the forward bound bounds: max rows a rank computes forward."""
        return int(self.forward_rows_W.max().item()) if self.forward_rows_W.numel() else 0

    def max_backward_rows(self) -> int:
        """Max retained rows a rank computes in the backward."""
        return int(self.backward_rows_W.max().item()) if self.backward_rows_W.numel() else 0

    def instances(self, expert: int) -> List[int]:
        """Ranks holding ``expert``, owner first."""
        a, b = self.instance_offsets[expert].item(), self.instance_offsets[expert + 1].item()
        return self.instance_rank[a:b].tolist()

    def peak_bytes(self) -> int:
        """The largest per-rank total of the four memory parts."""
        return int(self.memory_W4.sum(dim=1).max().item())


#: ``lrmoe``'s balance target by default: at most the mean retained rows per rank, met
#: with replicas only (it never cuts demand: c alone decides what the backward drops).
#: Simulated on the H200 costs it is what makes lrmoe the fastest policy from EP8 to
#: EP128 at the same kept pairs (experiments/sim_balance.py, docs/simulation.md "The
#: balance target"); None turns it off (memory and row capacity only).
DEFAULT_BALANCE_SLACK: Optional[float] = 0.0


def check_slots(replica_slots: int, symi_slots: int, num_experts: int) -> None:
    """Refuse slot counts outside [0, E] before they reach the C++ planner, which holds
    them as int32 (a larger one would wrap around or not convert at all); no policy can use
    more than E slots, since a rank holds at most one instance of each expert.

    Raises:
        ValueError: naming ``replica_slots`` or ``symi_slots`` (and the CLI flag).
    """
    for name, value in (("replica_slots", replica_slots), ("symi_slots", symi_slots)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or not 0 <= value <= num_experts:
            raise ValueError(f"{name} must be an int in [0, E={num_experts}] (a rank holds "
                             f"at most one instance of each expert; --{name.replace('_', '-')}"
                             f"), got {value!r}")


def plan(load_WE, policy: str, memory: MemoryModel, recalibration_rate: float = 0.0,
         quota_rule: str = "proportional", replica_slots: int = 2, symi_slots: int = 0,
         previous_load_E=None, max_expert_cut: float = 0.5, backward_row_capacity: int = 0,
         min_replica_rows: int = 1,
         balance_slack: Optional[float] = DEFAULT_BALANCE_SLACK, *, joint: bool = False,
         replica_cost_rows: int = 0, gpus_per_node: Optional[int] = None,
         previous_plan: Optional["Plan"] = None, replan_threshold: float = 0.0,
         ultraep_refine: bool = False, spare_capacity_split: bool = False) -> Plan:
    """Plan one layer's placement with ``policy`` (csrc/planner; docs/planner.md).

    Args:
        load_WE: (W, E) non-negative ints (tensor, array or nested lists): routed pairs
            from source rank s to expert e, as all-gathered after the counts exchange.
        policy: one of :data:`POLICIES`.
        memory: byte sizes and budget (:class:`MemoryModel`).
        recalibration_rate: c in [0, 1); only ``lrmoe`` cuts demand (the baselines are
            exact in the backward).
        quota_rule: ``proportional`` or ``water_level`` (docs/algorithm.md).
        replica_slots: R spare expert slots per rank (ultraep, symi, lrmoe's most replicas
            per rank); ultraep needs R >= 1.
        symi_slots: S slots per GPU for symi (0: ceil(E / W) + R).
        previous_load_E: (E,) the previous step's popularity for symi (None: this step's).
        max_expert_cut: lrmoe keeps at least floor((1 - this) n_e) of an expert's pairs.
        backward_row_capacity: most retained rows per rank (0: memory only).
        min_replica_rows: ultraep's u_min, the fewest rows a replica carries.
        balance_slack: lrmoe also aims at most (1 + this) x the mean retained rows per
            rank, with replicas (the target never cuts demand); a target, never a reason
            to be infeasible. Default :data:`DEFAULT_BALANCE_SLACK` (0); None: memory
            (and row capacity) only.
        joint: lrmoe only: refine the plan by local search on one objective, the max rank
            time t_r = forward rows + retained rows + ``replica_cost_rows`` x replicas on
            r, with c as a budget on the rows dropped in total (csrc/planner/joint.h).
        replica_cost_rows: kappa >= 0, one replica's weight and grad traffic expressed in
            the time of computing one row (used by ``joint``).
        gpus_per_node: G ranks per node (NVLink domain), node(r) = r // G; None: W (one
            node, the flat plans exactly). ultraep and lrmoe place replicas on the owner's
            node first and every forward split fills a source's own-node instances before
            remote ones (docs/planner.md, "Topology"). Must be in [1, W].
        previous_plan: the previous micro-batch's (or layer's) :class:`Plan` of the same
            policy and W, E: its placement is kept, its rows re-split in proportion to its
            instances' forward rows, unless this plan's max rank time is lower by more
            than ``replan_threshold`` x the kept one's (docs/planner.md, "Hysteresis").
            fixed, ultraep and lrmoe only.
        replan_threshold: in [0, 1), used with ``previous_plan``.
        ultraep_refine: ultraep only: refinement passes after the bisection, local moves
            of rows that lower the max rank load (csrc/planner/ultraep_refine.h).
        spare_capacity_split: the forward rows beyond a source's own rank (and node) are
            dealt in proportion to the instances' remaining capacity (UltraEP's split)
            instead of north-west; the rows per instance are unchanged.

    Returns:
        A :class:`Plan`; ``plan.feasible`` is False (with ``plan.reason``) when it cannot fit.

    Raises:
        ValueError: bad input, naming the argument (negative loads, E not a multiple of W
            where the policy needs fixed ownership, budget below resident, zero slots...).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if quota_rule not in QUOTA_RULES:
        raise ValueError(f"quota_rule must be one of {', '.join(QUOTA_RULES)}; got {quota_rule!r}")
    if balance_slack is not None and not balance_slack >= 0:
        raise ValueError(f"balance_slack must be >= 0 (or None: off), got {balance_slack}")
    load = np.asarray(load_WE)
    if load.ndim != 2:
        raise ValueError(f"load_WE must be 2-D (W ranks, E experts), got shape {tuple(load.shape)}")
    check_slots(replica_slots, symi_slots, load.shape[1])
    inp = plan_input(load.shape[0], load.shape[1], memory, recalibration_rate, quota_rule,
                     replica_slots, symi_slots, max_expert_cut, backward_row_capacity,
                     min_replica_rows, balance_slack)
    set_options(inp, policy, joint=joint, replica_cost_rows=replica_cost_rows,
                gpus_per_node=gpus_per_node, ultraep_refine=ultraep_refine,
                spare_capacity_split=spare_capacity_split, replan_threshold=replan_threshold)
    if previous_plan is not None:
        if not isinstance(previous_plan, Plan) or previous_plan.policy != policy:
            raise ValueError(f"previous_plan must be a Plan of policy {policy!r} (from "
                             f"lrmoe.planner.plan.plan), got {type(previous_plan).__name__}"
                             f" {getattr(previous_plan, 'policy', '')!r}")
        inp.previous_instance_offsets = previous_plan.instance_offsets.numpy().astype(np.int32)
        inp.previous_instance_rank = previous_plan.instance_rank.numpy().astype(np.int32)
        inp.previous_instance_rows = previous_plan.forward_IW.sum(dim=1).numpy().astype(np.int64)
    inp.load_WE = _as_int64(load)
    if previous_load_E is not None:
        inp.previous_load_E = _as_int64(previous_load_E)
    p = _C.planner.plan(policy, inp)
    W, I = p.num_ranks, p.num_instances()

    def tensor(a, *shape):
        return torch.from_numpy(np.asarray(a, dtype=np.int64).reshape(shape))

    # fixed_rows_W is empty where E % W != 0 (symi): -1 then, as documented on Plan
    fixed = p.fixed_rows_W if p.fixed_rows_W.size else np.full(W, -1, dtype=np.int64)
    memory_W4 = [[m.base_experts, m.replicas, m.forward_tokens, m.backward_tokens]
                 for m in p.memory_W]  # MEMORY_PARTS, by name
    return Plan(policy=policy, instance_offsets=tensor(p.instance_offsets, -1),
                instance_rank=tensor(p.instance_rank, -1), forward_IW=tensor(p.forward_IW, I, W),
                retained_IW=tensor(p.retained_IW, I, W), quota_E=tensor(p.quota_E, -1),
                fixed_rows_W=tensor(fixed, W), forward_rows_W=tensor(p.forward_rows_W, W),
                backward_rows_W=tensor(p.backward_rows_W, W),
                memory_W4=tensor(memory_W4, W, len(MEMORY_PARTS)), limit_bytes=p.limit_bytes,
                replicas=p.replicas, feasible=p.feasible, binding=p.binding.name,
                binding_rank=p.binding_rank, shortfall=p.shortfall, reason=p.reason,
                forward_bound=p.forward_bound, backward_bound=p.backward_bound,
                kept_previous=p.kept_previous, moved_replicas=p.moved_replicas,
                moved_bytes=p.moved_bytes)


#: placement models of :func:`exact_optimum` (the binding's PlacementModel): ``owners``
#: (fixed ownership + R replicas per rank: fixed, ultraep, lrmoe) and ``free`` (any S
#: experts per rank: symi)
PLACEMENT_MODELS = tuple(_C.planner.PlacementModel.__members__)


@dataclasses.dataclass(frozen=True)
class ExactOptimum:
    """The exact optimum of the max rows per rank (csrc/planner/exact.h).

    Attributes:
        model: the placement model searched (one of :data:`PLACEMENT_MODELS`).
        feasible: some placement fits the memory (always without memory).
        proven: the search finished within ``max_nodes``; False: ``optimum`` is the best
            placement found, an upper bound on the optimum.
        optimum: rows, the smallest max rows per rank over placements and integer splits.
        lower_bound: rows, the counting bound of csrc/planner/bound.h for this model.
        nodes: placements visited.
        holds_EW: (E, W) bool, an optimal placement.
        rows_EW: (E, W) int64 rows of (expert, rank) of a split reaching ``optimum``.
    """

    model: str
    feasible: bool
    proven: bool
    optimum: int
    lower_bound: int
    nodes: int
    holds_EW: np.ndarray
    rows_EW: np.ndarray


def exact_optimum(load_WE, memory: Optional[MemoryModel] = None, replica_slots: int = 2,
                  model: str = "owners", demand_E=None, symi_slots: int = 0,
                  max_nodes: int = 2_000_000) -> ExactOptimum:
    """The exact optimum of the max rows per rank of one layer, offline (small instances:
    W <= 8, E <= 16, at most 2 spare slots per rank; docs/planner.md, "Lower bound and
    exact optimum").

    Args:
        load_WE: (W, E) routed pairs, as for :func:`plan`.
        memory: a :class:`MemoryModel` whose budget every rank must fit (each row charged
            forward and backward bytes: the exact backward), or None: no memory limit.
        replica_slots: R, replica slots per rank (``owners``), and S = ceil(E/W) + R for
            ``free`` unless ``symi_slots`` is given.
        model: ``owners`` (the placements of fixed, ultraep, lrmoe) or ``free`` (symi's).
        demand_E: (E,) rows per expert to place (None: the routed demand, load_WE summed
            over sources); e.g. lrmoe's ``plan.quota_E`` for its backward.
        symi_slots: S for ``free`` (0: ceil(E/W) + R).
        max_nodes: placements the search may visit before it stops (``proven`` False).

    Returns:
        An :class:`ExactOptimum`, rows per rank.

    Raises:
        ValueError: an instance beyond the limits above, E not a multiple of W for
            ``owners``, bad sizes (naming the field).
    """
    if model not in PLACEMENT_MODELS:
        raise ValueError(f"model must be one of {', '.join(PLACEMENT_MODELS)}; got {model!r}")
    load = np.asarray(load_WE)
    if load.ndim != 2:
        raise ValueError(f"load_WE must be 2-D (W ranks, E experts), got shape {tuple(load.shape)}")
    check_slots(replica_slots, symi_slots, load.shape[1])
    W, E = load.shape
    mem = memory if memory is not None else MemoryModel(0, 0, 0, 0, 0, 1, 0)
    inp = plan_input(W, E, mem, replica_slots=replica_slots, symi_slots=symi_slots)
    inp.load_WE = _as_int64(load)
    x = _C.planner.exact_input(inp, _C.planner.PlacementModel.__members__[model],
                               None if demand_E is None else _as_int64(demand_E),
                               memory is not None)
    x.max_nodes = int(max_nodes)
    r = _C.planner.exact_optimum(x)
    return ExactOptimum(model=model, feasible=r.feasible, proven=r.proven, optimum=r.optimum,
                        lower_bound=r.lower_bound, nodes=r.nodes,
                        holds_EW=np.asarray(r.holds_EW).reshape(E, W).astype(bool),
                        rows_EW=np.asarray(r.rows_EW, dtype=np.int64).reshape(E, W))


def instance_optimum(load_WE, replica_slots: int = 2, demand_E=None,
                     max_nodes: int = 2_000_000) -> Tuple[ExactOptimum, ExactOptimum]:
    """Both models' optima without memory: (owners, free). The smaller, when proven, is
    at most every policy's max rows per rank (free holds symi's placements, owners the
    others'); a gap is measured against ``min(owners.optimum, free.optimum)``."""
    return (exact_optimum(load_WE, None, replica_slots, "owners", demand_E, max_nodes=max_nodes),
            exact_optimum(load_WE, None, replica_slots, "free", demand_E, max_nodes=max_nodes))


def _as_int64(a) -> np.ndarray:
    """``a`` (tensor, array or nested lists of ints) as an int64 numpy array; a float
    array is converted as the old op's ``torch.as_tensor(..., dtype=torch.int64)`` did
    (truncating), so every caller keeps its behaviour."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.asarray(a).astype(np.int64, copy=False)


def plan_input(num_ranks: int, num_experts: int, memory: MemoryModel,
               recalibration_rate: float = 0.0, quota_rule: str = "proportional",
               replica_slots: int = 2, symi_slots: int = 0, max_expert_cut: float = 0.5,
               backward_row_capacity: int = 0, min_replica_rows: int = 1,
               balance_slack: Optional[float] = DEFAULT_BALANCE_SLACK) -> "_C.planner.PlanInput":
    """The C++ planner's settings as a ``lrmoe._C.planner.PlanInput``, every field set by
    name (arguments as in :func:`plan`; ``balance_slack`` None is the C++ "off", -1); its
    loads (``load_WE``, ``previous_load_E``) are left empty for the caller.

    Raises:
        TypeError, ValueError: a value a field cannot hold, naming the field.
    """
    return _C.planner.PlanInput(
        num_ranks=num_ranks, num_experts=num_experts, memory=memory.to_cpp(),
        recalibration_rate=float(recalibration_rate), quota_rule=quota_rule,
        replica_slots=int(replica_slots), symi_slots=int(symi_slots),
        max_expert_cut=float(max_expert_cut), backward_row_capacity=int(backward_row_capacity),
        min_replica_rows=int(min_replica_rows),
        balance_slack=-1.0 if balance_slack is None else float(balance_slack))


def set_options(inp: "_C.planner.PlanInput", policy: str, *, joint: bool = False,
                replica_cost_rows: int = 0, gpus_per_node: Optional[int] = None,
                ultraep_refine: bool = False, spare_capacity_split: bool = False,
                replan_threshold: float = 0.0) -> "_C.planner.PlanInput":
    """Check the planner's optional features for ``policy`` and set them on ``inp`` (a
    ``PlanInput`` of :func:`plan_input`, whose ``num_ranks`` W bounds ``gpus_per_node``);
    shared by :func:`plan` and ``lrmoe.sim.simulate``, so that the simulator passes exactly
    the options :func:`plan` takes. Arguments as in :func:`plan`.

    Returns:
        ``inp``, modified in place.

    Raises:
        ValueError: naming the argument (and its ``lrmoe sim`` flag) and the fix: joint or
            replica_cost_rows > 0 for a policy other than lrmoe (or replica_cost_rows
            without joint), ultraep_refine for a policy other than ultraep, a non-bool
            switch, replica_cost_rows < 0, gpus_per_node outside [1, W], replan_threshold
            outside [0, 1).
    """
    for name, v in (("joint", joint), ("ultraep_refine", ultraep_refine),
                    ("spare_capacity_split", spare_capacity_split)):
        if not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False (--{name.replace('_', '-')}), "
                             f"got {v!r}")
    if isinstance(replica_cost_rows, bool) or not isinstance(replica_cost_rows, (int, np.integer)) \
            or replica_cost_rows < 0:
        raise ValueError(f"replica_cost_rows must be an int >= 0 (one replica's traffic in "
                         f"row-times; --replica-cost-rows), got {replica_cost_rows!r}")
    if joint and policy != "lrmoe":
        raise ValueError(f"joint applies to policy lrmoe only, got policy {policy!r}; drop "
                         f"joint or use policy lrmoe")
    # kappa is read by the joint objective only: without it the user's number would be
    # silently ignored
    if replica_cost_rows and not joint:
        raise ValueError(f"replica_cost_rows ({replica_cost_rows}) is a term of the joint "
                         f"objective and does nothing without it; set joint (--joint, lrmoe "
                         f"only) or drop --replica-cost-rows")
    if ultraep_refine and policy != "ultraep":
        raise ValueError(f"ultraep_refine applies to policy ultraep only, got policy "
                         f"{policy!r}; drop ultraep_refine or use policy ultraep")
    W = int(inp.num_ranks)
    if gpus_per_node is not None and (
            isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, (int, np.integer))
            or not 1 <= gpus_per_node <= W):
        raise ValueError(f"gpus_per_node must be an int in [1, W={W}] (ranks per "
                         f"node; None: one node; --gpus-per-node), got {gpus_per_node!r}")
    if isinstance(replan_threshold, bool) or not isinstance(replan_threshold, (int, float)) \
            or not 0.0 <= replan_threshold < 1.0:
        raise ValueError(f"replan_threshold must be in [0, 1) (the fraction of the kept "
                         f"plan's max rank time a new plan must save; --replan-threshold), "
                         f"got {replan_threshold!r}")
    inp.joint = bool(joint)
    inp.replica_cost_rows = int(replica_cost_rows)
    inp.gpus_per_node = 0 if gpus_per_node is None else int(gpus_per_node)
    inp.replan_threshold = float(replan_threshold)
    inp.ultraep_refine = bool(ultraep_refine)
    inp.spare_capacity_split = bool(spare_capacity_split)
    return inp
