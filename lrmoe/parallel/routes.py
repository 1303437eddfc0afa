"""Routes: how a layer's routed tokens reach their experts and come back, behind one
interface.

Legend: T tokens on this rank, H hidden, E experts (global), K top_k, I expert
intermediate size, W ranks of the EP group, El = E / W experts this rank owns.

:class:`lrmoe.layer.MoECore` holds one :class:`Routes` and calls :meth:`Routes.run` with
the routing and the expert weights it has; the routes object decides where the pairs run.
The shape is that of a token dispatcher in other MoE systems (dispatch, the expert GEMMs,
combine), with one difference: here the three steps are ONE call, because the planned
backward (docs/algorithm.md section 8) selects the kept pairs on the token owner from
tensors that dispatch, experts and combine all saved, so they live in one autograd
function per backend.

* :class:`LocalRoutes` -- one device: every expert is here
  (:class:`lrmoe.moe.experts.ExpertFunction`).
* :class:`EPRoutes` -- expert parallelism over a ``torch.distributed`` group: the experts
  are sharded over its W ranks and the pairs travel by all-to-all
  (:class:`lrmoe.parallel.function.ExpertParallelFunction`), optionally with a placement
  policy's plan and replicas (:class:`lrmoe.parallel.replicas.ReplicaState`).

Another backend (DeepEP's kernels) plugs in here: a subclass of :class:`Routes` with its
own :meth:`~Routes.run`, chosen in :func:`make_routes`; the layers (``lrmoe/layer.py``,
``lrmoe/integrations/transformers.py``) do not change. Experts sharded by someone else
(torchtitan's EP mesh: lrmoe/integrations/torchtitan.py) use :class:`EPRoutes` with
``presharded=True``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lrmoe.moe.config import LRMoEConfig
from lrmoe.moe.experts import ExpertFunction
from lrmoe.moe.router import Routing
from lrmoe.moe.stats import BackwardStats
from lrmoe.parallel.data_parallel import shard_experts
from lrmoe.parallel.function import ExpertParallelFunction
from lrmoe.parallel.group import announce_failure, check_config_across_ranks
from lrmoe.parallel.placement import Placement
from lrmoe.parallel.replicas import ReplicaState


def refuse_adaptive_rate(config: LRMoEConfig, where: str) -> None:
    """Raise ValueError (naming ``where``) when ``config`` asks for the adaptive rate
    (``retained_mass_target`` > 0) under expert parallelism: the EP plan fixes the quotas
    in the forward, before any score exists."""
    if config.backward.retained_mass_target > 0:
        raise ValueError(f"{where}: retained_mass_target (the adaptive rate) runs on one "
                         "device only: under expert parallelism the quotas are fixed in the "
                         "forward, before any score exists; use a fixed recalibration_rate "
                         "with --ep")


class Routes:
    """The interface :class:`lrmoe.layer.MoECore` calls (the base of every backend).

    Attributes:
        ep_group: the ``torch.distributed`` group the experts are sharded over, or None
            (one device).
        world_size: W, ranks holding experts (1 on one device).
        rank: this rank in ``ep_group`` (0 on one device).
        replicas: the placement state (:class:`lrmoe.parallel.replicas.ReplicaState`) or
            None (no placement policy).
    """

    ep_group: Any = None
    world_size: int = 1
    rank: int = 0
    replicas: Optional[ReplicaState] = None

    def run(self, config: LRMoEConfig, x_TH: Tensor, routing: Routing, w_gate_up_X2IH: Tensor,
            w_down_XHI: Tensor, stats: BackwardStats) -> Tensor:
        """The routed experts of one layer call, with autograd (exact forward, planned
        backward).

        Args:
            config: the layer's :class:`LRMoEConfig` for this call.
            x_TH: (T, H) float input (fp32/bf16/fp16/fp64), the weights' dtype.
            routing: :class:`lrmoe.moe.router.Routing`; ``weights_TK`` (T, K) float32 and
                ``expert_ids_TK`` (T, K) int64 global expert ids are used.
            w_gate_up_X2IH: (X, 2I, H), w_down_XHI: (X, H, I): the experts this rank holds
                (X = E on one device, El under EP).
            stats: :class:`lrmoe.moe.stats.BackwardStats` that receives the diagnostics.

        Returns:
            (T, H) routed output in the dtype of ``x_TH``.
        """
        raise NotImplementedError

    def announce_failure(self, config: LRMoEConfig) -> None:
        """Called when this rank failed before the dispatch (then the error is
        re-raised): lets the other ranks of the group fail at once instead of waiting in
        a collective. Nothing to do on one device."""


class LocalRoutes(Routes):
    """One device: every expert is local; :class:`lrmoe.moe.experts.ExpertFunction`."""

    def run(self, config: LRMoEConfig, x_TH: Tensor, routing: Routing, w_gate_up_X2IH: Tensor,
            w_down_XHI: Tensor, stats: BackwardStats) -> Tensor:
        """See :meth:`Routes.run` (X = E)."""
        return ExpertFunction.apply(x_TH, routing.weights_TK, routing.expert_ids_TK,
                                    w_gate_up_X2IH, w_down_XHI, config, stats)


class EPRoutes(Routes):
    """Expert parallelism over ``ep_group``
    (:class:`lrmoe.parallel.function.ExpertParallelFunction`).

    Constructing it is a collective over the group: the config (and placement) check
    across ranks, then ``experts`` is sharded in place to this rank's El = E / W experts
    (:func:`lrmoe.parallel.data_parallel.shard_experts`), unless ``presharded``. Every
    :meth:`run` (forward and backward) is a collective too.

    Args:
        config: the layer's :class:`LRMoEConfig`.
        experts: the module with ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I);
            unused (may be None) when ``presharded`` without a placement.
        ep_group: the ``torch.distributed`` group.
        placement: a :class:`lrmoe.parallel.placement.Placement` or None (fixed ownership
            without the planner).
        where: the layer's name for error messages.
        presharded: True when the caller already holds rank d's experts
            ``[d*El, (d+1)*El)`` and passes them to :meth:`run` itself (torchtitan's
            ``Shard(0)`` DTensor experts, lrmoe/integrations/torchtitan.py): nothing is
            re-sharded; only E divisible by W is checked.

    Raises:
        ValueError: ranks with different MoE configs or placements, E not divisible by
            W, a placement with ``presharded`` (replicas need lrmoe's own expert module),
            or ``retained_mass_target`` > 0 (the adaptive rate is one device only).
    """

    def __init__(self, config: LRMoEConfig, experts: Optional[nn.Module], ep_group,
                 placement: Optional[Placement] = None, where: str = "LRMoELayer",
                 presharded: bool = False) -> None:
        if presharded and placement is not None:
            raise ValueError(f"{where}: a placement policy ({placement.policy!r}) moves "
                             "lrmoe's own expert weights; with presharded experts use "
                             "policy=None")
        self.ep_group = ep_group
        self.replicas = (None if placement is None
                         else ReplicaState(placement, config, experts))
        check_config_across_ranks(config, ep_group, placement)
        refuse_adaptive_rate(config, where)
        self.world_size = dist.get_world_size(ep_group)
        self.rank = dist.get_rank(ep_group)
        if not presharded:
            shard_experts(experts, config.num_experts, ep_group, where)
        elif config.num_experts % self.world_size:
            raise ValueError(f"{where}: num_experts={config.num_experts} is not divisible "
                             f"by the expert-parallel size {self.world_size}; choose E a "
                             "multiple of the EP size")

    def run(self, config: LRMoEConfig, x_TH: Tensor, routing: Routing, w_gate_up_X2IH: Tensor,
            w_down_XHI: Tensor, stats: BackwardStats) -> Tensor:
        """See :meth:`Routes.run` (X = El, this rank's shard). A collective.

        Raises:
            ValueError: ``retained_mass_target`` > 0 (``set_recalibration`` may have
                turned it on after construction).
        """
        refuse_adaptive_rate(config, "LRMoE layer")
        if self.replicas is not None:
            # only training forwards (grad on) feed symi's popularity
            self.replicas.recording = torch.is_grad_enabled()
        return ExpertParallelFunction.apply(x_TH, routing.weights_TK, routing.expert_ids_TK,
                                            w_gate_up_X2IH, w_down_XHI, config, stats,
                                            self.ep_group, self.replicas)

    def announce_failure(self, config: LRMoEConfig) -> None:
        """Join the forward's counts exchange as a failed rank
        (:func:`lrmoe.parallel.group.announce_failure`). A collective."""
        announce_failure(config, self.ep_group, 0 if self.replicas is None else 1)


def make_routes(config: LRMoEConfig, experts: nn.Module, ep_group=None, policy: Any = None,
                where: str = "LRMoELayer") -> Routes:
    """The routes of a layer: :class:`LocalRoutes` without ``ep_group``, else
    :class:`EPRoutes` (a collective, see there).

    Args:
        config, experts, where: as :class:`EPRoutes`.
        ep_group: ``torch.distributed`` group or None (one device).
        policy: None, a policy name, a dict of Placement fields or a
            :class:`lrmoe.parallel.placement.Placement` (:meth:`Placement.coerce`).

    Raises:
        ValueError: a policy without ``ep_group``, an invalid placement field, or as
            :class:`EPRoutes`. TypeError: ``policy`` of another type.
    """
    placement = Placement.coerce(policy)
    if placement is not None and ep_group is None:
        raise ValueError(f"{where}: policy={placement.policy!r} places expert instances "
                         "over an expert-parallel group; pass ep_group too (or "
                         "policy=None on one device)")
    if ep_group is None:
        return LocalRoutes()
    return EPRoutes(config, experts, ep_group, placement, where)
