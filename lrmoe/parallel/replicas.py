"""Placement policies executed under expert parallelism: the plan of each layer call,
replica weights (fetched in the forward or pushed after the optimizer step), replica
gradients reduced into the owner, and the bytes all of it moves.

Legend as in :mod:`lrmoe.parallel.plan` (W ranks, E experts, El = E / W experts owned per
rank, I instances, L instances on this rank), F replica weights this rank receives (its
instances of experts owned elsewhere), H hidden, I2 = 2 x expert intermediate size.
One expert copy is one row of ``3 H I`` parameters (``gate_up_proj[e]`` then
``down_proj[e]``, flattened).

Flow of one layer call (docs/planner.md, "Executing a plan"; docs/parallel.md "Placement
policies and replicas"): after the counts exchange every rank calls :func:`lrmoe.planner.plan.plan`
with the same (W, E) counts and settings (no collective) -> :meth:`ReplicaState.layout`
turns the :class:`lrmoe.planner.plan.Plan` into an :class:`InstanceLayout` -> the dispatch plan
follows it -> replica weights: ``ultraep`` and ``lrmoe`` fetch them from their owners in
the forward (:func:`exchange_weights`, one all-to-all); ``symi`` reads the copies that
:meth:`lrmoe.parallel.hooks.PlacementHooks.push` sent after the last optimizer step
(and fetches when they are stale) -> the expert core runs every local instance ->
backward: replica gradients go back to the owner and are summed into its gradient
(:func:`reduce_grads`), so the optimizer only ever sees (and updates) owner weights.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from lrmoe.utils.phases import phase

from lrmoe import ops
from lrmoe.moe.config import LRMoEConfig
from lrmoe.parallel.dispatch import all_to_all_rows
from lrmoe.parallel.placement import UNLIMITED_BUDGET, Placement
from lrmoe.parallel.plan import (InstanceLayout, WeightRoutes, cell_shares, h2d,
                                 weight_routes)


@dataclass
class ReplicaStats:
    """What the last layer call planned and moved for replicas (this rank).

    Attributes:
        policy: the policy.
        replicas: instances beyond one per expert (the plan's count).
        remote_instances: instances on a rank other than the expert's owner (their
            weights move: for ``symi`` that can include an expert's first instance).
        feasible, reason: the plan's verdict against the budget.
        rows_before_W: (W) rows per rank under fixed ownership.
        rows_forward_W, rows_backward_W: rows each rank computes in the forward and
            keeps in the backward under the plan.
        bytes: ``weights_fetched`` (replica weights this rank sent in the forward),
            ``weights_pushed`` (sent by the last push,
            :meth:`lrmoe.parallel.hooks.PlacementHooks.push`),
            ``grads_reduced`` (replica gradients this rank sent back to owners).
        splits: collective name -> (the input splits this rank passed, bytes per row):
            ``dispatch``, ``combine``, ``grad``, ``dx`` (token rows), ``replica_fetch``,
            ``replica_push``, ``replica_grads`` (expert copies).
        memory_W4: (W, 4) int64 CPU tensor, the plan's bytes per rank (base experts,
            replicas, forward token buffers, backward token buffers;
            :class:`lrmoe.planner.plan.Plan`), the same on every rank; None before a call.
    """

    policy: str = ""
    replicas: int = 0
    remote_instances: int = 0
    feasible: bool = True
    reason: str = ""
    rows_before_W: List[int] = field(default_factory=list)
    rows_forward_W: List[int] = field(default_factory=list)
    rows_backward_W: List[int] = field(default_factory=list)
    bytes: Dict[str, int] = field(default_factory=lambda: {
        "weights_fetched": 0, "weights_pushed": 0, "grads_reduced": 0})
    splits: Dict[str, Tuple[List[int], int]] = field(default_factory=dict)
    memory_W4: Optional[Tensor] = None

    def summary(self) -> Dict[str, object]:
        """Host numbers for metrics.jsonl: ``placement_policy``, ``replicas``,
        ``rank_load_max_over_mean_before`` / ``_forward`` / ``_backward`` (max over mean of
        the rows per rank), ``replica_bytes_fetched`` / ``_pushed`` / ``_reduced``,
        ``plan_feasible``."""
        return {"placement_policy": self.policy, "replicas": self.replicas,
                "rank_load_max_over_mean_before": max_over_mean(self.rows_before_W),
                "rank_load_max_over_mean_forward": max_over_mean(self.rows_forward_W),
                "rank_load_max_over_mean_backward": max_over_mean(self.rows_backward_W),
                "replica_bytes_fetched": self.bytes["weights_fetched"],
                "replica_bytes_pushed": self.bytes["weights_pushed"],
                "replica_bytes_reduced": self.bytes["grads_reduced"],
                "plan_feasible": self.feasible}


def max_over_mean(rows: List[int]) -> Optional[float]:
    """max / mean of rows per rank (None when empty or all zero)."""
    if not rows or sum(rows) == 0:
        return None
    return max(rows) * len(rows) / sum(rows)


@dataclass
class _PushedCopies:
    key: Tuple[Tuple[int, ...], Tuple[int, ...]]   # (instance offsets, instance ranks)
    popularity: List[int]                          # the loads the placement came from
    versions: Tuple[int, int]                      # the owner shard's versions at the push
    pointers: Tuple[int, int]                      # ... its data pointers
    checksum: Tensor                               # ... its weight_checksum (device)
    weights_F: Tensor                              # (F, 3HI) rows, this rank's copies


class ReplicaState:
    """A layer's placement: settings, the memory model, the pushed ``symi`` copies and
    the :class:`ReplicaStats` of the last call. Held by :class:`lrmoe.layer.MoECore`.

    Args:
        placement: the :class:`Placement`.
        config: the layer config (H, I, E, K for the memory model).
        experts: the module holding this rank's ``gate_up_proj`` / ``down_proj`` shard.
    """

    def __init__(self, placement: Placement, config: LRMoEConfig, experts: nn.Module) -> None:
        self.experts = experts
        self.set_placement(placement, config)
        self.stats = ReplicaStats(policy=placement.policy)
        self.popularity_E: Optional[List[int]] = None  # symi: the loads its placement uses
        self._loads_since_push: Optional[List[int]] = None
        self._pushed: Optional[_PushedCopies] = None
        #: set by the layer each call: only training forwards (grad on) feed symi's
        #: popularity, so evaluation between steps does not move the placement
        self.recording = True
        self._warned = False
        self._warned_stale = False

    def set_placement(self, placement: Placement, config: LRMoEConfig) -> None:
        """Replace the settings (e.g. measured resident bytes); every rank must do the
        same (the per-call config check hashes them)."""
        from lrmoe.planner.plan import MemoryModel
        from lrmoe.workload.shapes import ModelShape

        self.placement = placement
        shape = ModelShape("layer", config.hidden_size, config.moe_intermediate_size,
                           config.num_experts, config.top_k, 1)
        self.memory = MemoryModel.from_shape(shape, placement.memory_budget or UNLIMITED_BUDGET,
                                             placement.resident_bytes)

    # ------------------------------------------------------------------ the plan
    def plan(self, counts_host: List[List[int]], config: LRMoEConfig):
        """The :class:`lrmoe.planner.plan.Plan` of these counts (pure host C++, identical on
        every rank).

        Raises:
            ValueError: from :func:`lrmoe.planner.plan.plan` (e.g. E not a multiple of W).
        """
        from lrmoe.planner.plan import plan as make_plan

        p = self.placement
        c = config.backward.recalibration_rate if config.backward.selective_backward else 0.0
        return make_plan(counts_host, p.policy, self.memory, recalibration_rate=c,
                         quota_rule=config.backward.quota_rule, replica_slots=p.replica_slots,
                         symi_slots=p.symi_slots, previous_load_E=self.popularity_E,
                         max_expert_cut=p.max_expert_cut, balance_slack=p.balance_slack)

    def layout(self, counts_host: List[List[int]], config: LRMoEConfig, rank: int,
               num_local_experts: int) -> InstanceLayout:
        """Plan these counts and return the :class:`InstanceLayout` to execute; records
        the plan's numbers in :attr:`stats`.

        Retained cells: ``lrmoe`` plans its own quotas (``plan.retained_IW``); the
        baselines keep every pair, so with c > 0 their quotas are the layer's quota rule
        split over the (instance, source) cells (:func:`lrmoe.parallel.plan.cell_shares`).
        """
        plan = self.plan(counts_host, config)
        loads = torch.tensor(counts_host, dtype=torch.int64).sum(0)
        if self.placement.policy == "symi" and self.recording:
            more = loads.tolist()
            prev = self._loads_since_push
            self._loads_since_push = more if prev is None else [a + b for a, b in zip(prev, more)]
        forward_IW = plan.forward_IW
        if not config.backward.selective_backward:
            kept_IW = forward_IW
        elif self.placement.policy == "lrmoe":
            kept_IW = plan.retained_IW
        else:
            quota_E = ops.quota(loads.to(torch.int32), config.backward.recalibration_rate,
                                config.backward.quota_rule)
            kept_IW = cell_shares(forward_IW, plan.instance_offsets, quota_E)
        layout = InstanceLayout(plan.instance_offsets, plan.instance_rank, forward_IW, kept_IW)
        world = len(counts_host)
        rank_I = plan.instance_rank
        s = self.stats
        s.replicas, s.feasible, s.reason = plan.replicas, plan.feasible, plan.reason
        if not plan.feasible and not self._warned:
            # the plan is still exact; only the memory model says it may not fit
            self._warned = True
            warnings.warn(f"placement policy {self.placement.policy!r}: the plan does not fit "
                          f"the memory budget ({plan.reason}); running it anyway (exact). Raise "
                          "--memory-budget, lower --resident-bytes or the batch size, or "
                          "add --replica-slots", RuntimeWarning, stacklevel=2)
        el = num_local_experts
        s.remote_instances = int((rank_I != layout.instance_expert() // el).sum())
        s.rows_before_W = plan.fixed_rows_W.tolist()
        s.memory_W4 = plan.memory_W4  # the planner's host tensor: no copy per call
        s.rows_forward_W = torch.zeros(world, dtype=torch.int64).index_add_(
            0, rank_I, forward_IW.sum(1)).tolist()
        s.rows_backward_W = torch.zeros(world, dtype=torch.int64).index_add_(
            0, rank_I, kept_IW.sum(1)).tolist()
        s.bytes["weights_fetched"] = s.bytes["grads_reduced"] = 0
        for name in ("replica_fetch", "replica_grads"):
            s.splits.pop(name, None)
        return layout

    # -------------------------------------------------------- weights of instances
    def copies_fresh_now(self) -> bool:
        """Before the counts exchange, on the host: whether copies pushed for the current
        popularity exist and the owner shard has not visibly changed since (the same
        tensor versions and data pointers). A write through ``.data`` moves neither:
        :meth:`fresh_flag` also compares the weights' checksum on the device."""
        got = self._pushed
        return (got is not None and got.popularity == self.popularity_E
                and got.versions == _versions(self.experts)
                and got.pointers == _pointers(self.experts))

    def fresh_flag(self) -> Union[int, Tensor]:
        """This rank's freshness flag for the counts exchange: 0 when
        :meth:`copies_fresh_now` is False, else a () int64 device tensor, 1 when the owner
        shard's :func:`weight_checksum` still equals the push's. It rides the counts
        all-gather, so the check adds no host sync: a ``.data`` write, an EMA update or a
        weight load after the push makes every rank fetch instead (issue 26: such a write
        left symi computing with the old copies, silently)."""
        if not self.copies_fresh_now():
            return 0
        return (weight_checksum(self.experts) == self._pushed.checksum).all().long()

    def note_stale_checksum(self, flag: Union[int, Tensor], flags: List[int], rank: int) -> None:
        """After the exchange: warn once when this rank's copies looked fresh on the host
        but its checksum differed (the weights changed outside the optimizer step)."""
        if isinstance(flag, Tensor) and flags and not flags[rank] \
                and not self._warned_stale:
            self._warned_stale = True
            warnings.warn(
                "symi: the owner's expert weights changed after the last push without a "
                "new one (a write through .data, an EMA or a weight load outside the "
                "optimizer step); this forward fetched the replica weights instead of using "
                "the stale copies. Push after such writes (PlacementHooks.push()) to keep "
                "the forwards free of weight traffic", RuntimeWarning, stacklevel=2)

    def copies_fresh(self, layout: InstanceLayout) -> bool:
        """Whether the copies pushed after the last optimizer step (``symi``) hold this
        layout's replica weights at the owner's current version (this rank's view; the
        ranks agree through the counts exchange before using them)."""
        got = self._pushed
        return self.copies_fresh_now() and got.key == _layout_key(layout)

    def instance_weights(self, w_gate_up_L2IH: Tensor, w_down_LHI: Tensor,
                         routes: WeightRoutes, use_pushed: bool, group
                         ) -> Tuple[Tensor, Tensor]:
        """The weights of this rank's L instances: its own shard rows and the replica
        rows, pushed (``use_pushed``) or fetched now (a collective on every rank).

        Args:
            w_gate_up_L2IH: (El, 2I, H) own shard. w_down_LHI: (El, H, I).

        Returns:
            ((L, 2I, H), (L, H, I)) in the shard's dtype.
        """
        el = w_gate_up_L2IH.shape[0]
        if use_pushed:
            got_F = self._pushed.weights_F.to(w_gate_up_L2IH.dtype)
        else:
            with phase("replica_fetch"):
                got_F, sent = exchange_weights(w_gate_up_L2IH, w_down_LHI, routes, group)
            self.stats.bytes["weights_fetched"] = sent
            self.stats.splits["replica_fetch"] = (list(routes.send_splits),
                                                  _copy_bytes(w_gate_up_L2IH, w_down_LHI))
        gu_F, d_F = _unflatten(got_F, w_gate_up_L2IH.shape[1:], w_down_LHI.shape[1:])
        if routes.local_weight_index == list(range(el)):
            return w_gate_up_L2IH, w_down_LHI
        index = h2d(routes.local_weight_index, torch.long, w_gate_up_L2IH.device)
        return (torch.cat([w_gate_up_L2IH, gu_F]).index_select(0, index),
                torch.cat([w_down_LHI, d_F]).index_select(0, index))

    def reduce_grads(self, grad_gate_up_L2IH: Tensor, grad_down_LHI: Tensor,
                     routes: WeightRoutes, num_local_experts: int, group
                     ) -> Tuple[Tensor, Tensor]:
        """Sum every instance's gradient into its owner's shard (a collective).

        The owner's own instance comes first, then the replicas' in source-rank order,
        accumulated in fp32 (fp64 for fp64 weights); so at c = 0 the owner's gradient
        equals the no-replica one up to that summation order.

        Args:
            grad_gate_up_L2IH: (L, 2I, H) and grad_down_LHI: (L, H, I) per local instance.

        Returns:
            ((El, 2I, H), (El, H, I)) gradients of this rank's own shard.
        """
        el = num_local_experts
        flat_L = _flatten(grad_gate_up_L2IH, grad_down_LHI)
        dev = flat_L.device
        with phase("replica_grads"):
            send = flat_L.index_select(0, h2d(routes.remote_local, torch.long, dev))
            got = all_to_all_rows(send, len(routes.send_local), routes.recv_splits,
                            routes.send_splits, group)
        row_bytes = flat_L.shape[1] * flat_L.element_size()
        self.stats.bytes["grads_reduced"] = send.shape[0] * row_bytes
        self.stats.splits["replica_grads"] = (list(routes.recv_splits), row_bytes)
        acc_dtype = torch.promote_types(flat_L.dtype, torch.float32)
        acc = flat_L.new_zeros((el, flat_L.shape[1]), dtype=acc_dtype)
        for pos, own in routes.owned_local:
            acc[own] = flat_L[pos].to(acc_dtype)
        start = 0
        for n in routes.send_splits:  # one source at a time: each expert once per source
            idx = h2d(routes.send_local[start:start + n], torch.long, dev)
            acc.index_add_(0, idx, got[start:start + n].to(acc_dtype))
            start += n
        return _unflatten(acc.to(flat_L.dtype), grad_gate_up_L2IH.shape[1:],
                          grad_down_LHI.shape[1:])

    # ---------------------------------------------------------------- symi push
    def push(self, config: LRMoEConfig, group) -> int:
        """``symi``: fix the next steps' placement from the loads since the last push and
        send the owners' current weights to their replica ranks (a collective). Returns
        the bytes this rank sent."""
        if not self.placement.pushes_copies:
            return 0
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if self._loads_since_push is not None:
            self.popularity_E = self._loads_since_push
        self._loads_since_push = None
        if self.popularity_E is None:  # no forward yet: the first one fetches
            return 0
        el = config.num_experts // world
        zero = [[0] * config.num_experts for _ in range(world)]
        # symi's placement is a function of the popularity alone (csrc/planner/symi.cpp)
        plan = self.plan(zero, config)
        layout = InstanceLayout(plan.instance_offsets, plan.instance_rank, plan.forward_IW,
                                plan.forward_IW)
        routes = weight_routes(layout, rank, el, world)
        gu, d = self.experts.gate_up_proj.detach(), self.experts.down_proj.detach()
        with torch.no_grad(), phase("replica_push"):
            got_F, sent = exchange_weights(gu, d, routes, group)
        self._pushed = _PushedCopies(_layout_key(layout), list(self.popularity_E),
                                     _versions(self.experts), _pointers(self.experts),
                                     weight_checksum(self.experts), got_F)
        self.stats.bytes["weights_pushed"] = sent
        self.stats.splits["replica_push"] = (list(routes.send_splits), _copy_bytes(gu, d))
        return sent


def exchange_weights(w_gate_up_L2IH: Tensor, w_down_LHI: Tensor, routes: WeightRoutes,
                     group) -> Tuple[Tensor, int]:
    """Owners send the weights of their experts to the ranks holding remote instances
    (one ``all_to_all_single`` of expert copies; a collective on every rank).

    Returns:
        ((F, 3HI) received copies in this rank's remote-instance order, bytes this rank
        sent).
    """
    flat = _flatten(w_gate_up_L2IH, w_down_LHI)
    send = flat.index_select(0, h2d(routes.send_local, torch.long, flat.device))
    got = all_to_all_rows(send, sum(routes.recv_splits), routes.send_splits, routes.recv_splits,
                    group)
    return got, send.shape[0] * flat.shape[1] * flat.element_size()


# ------------------------------------------------------------------------ helpers
def _layout_key(layout: InstanceLayout):
    return (tuple(layout.instance_offsets.tolist()), tuple(layout.instance_rank.tolist()))


def _versions(experts: nn.Module) -> Tuple[int, int]:
    # in-place updates (optimizer steps, checkpoint loads) bump a tensor's version
    return (experts.gate_up_proj._version, experts.down_proj._version)


def _pointers(experts: nn.Module) -> Tuple[int, int]:
    # ``param.data = other`` swaps the storage without a version bump
    return (experts.gate_up_proj.data_ptr(), experts.down_proj.data_ptr())


def weight_checksum(experts: nn.Module) -> Tensor:
    """(4,) float64 on the weights' device: for each of ``gate_up_proj`` and ``down_proj``
    the sum of the raw bit patterns as integers (exact) and the float32 sum of the values.

    Two reductions per tensor, no copy of the weights: cheap next to the forward's grouped
    GEMMs. Equal checksums are taken as unchanged weights; a change that keeps both sums
    (a permutation of the elements, say) would go unseen.
    """
    out = []
    for w in (experts.gate_up_proj.detach(), experts.down_proj.detach()):
        bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[w.element_size()]
        out.append(w.view(bits).sum(dtype=torch.int64).double())
        out.append(w.sum(dtype=torch.float32).double())
    return torch.stack(out)


def _copy_bytes(w_gate_up: Tensor, w_down: Tensor) -> int:
    return (w_gate_up[0].numel() + w_down[0].numel()) * w_gate_up.element_size()


def _flatten(w_gate_up_X2IH: Tensor, w_down_XHI: Tensor) -> Tensor:
    n = w_gate_up_X2IH.shape[0]
    return torch.cat([w_gate_up_X2IH.reshape(n, -1), w_down_XHI.reshape(n, -1)], 1)


def _unflatten(flat: Tensor, gate_up_shape, down_shape) -> Tuple[Tensor, Tensor]:
    k = math.prod(gate_up_shape)
    return (flat[:, :k].reshape((-1,) + tuple(gate_up_shape)),
            flat[:, k:].reshape((-1,) + tuple(down_shape)))
