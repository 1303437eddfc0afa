"""MoE layers whose forward is exact and whose backward is planned, around one core.

Legend: T tokens, H hidden size, E experts, K top_k, I expert intermediate size.

:class:`MoECore` is what every LRMoE layer shares: its routes
(:class:`lrmoe.parallel.routes.Routes`: :class:`~lrmoe.parallel.routes.LocalRoutes` runs
:class:`lrmoe.moe.experts.ExpertFunction` on one device,
:class:`~lrmoe.parallel.routes.EPRoutes` shards the experts over the EP group, checks the
config across its ranks, announces a failure before the dispatch and runs
:class:`lrmoe.parallel.ExpertParallelFunction`), the shared-expert add and the step's
statistics. :class:`MoELayerBase` is the ``nn.Module`` face built on it (the
forward's order of steps, ``aux_loss``, diagnostics); :class:`LRMoELayer` (own router
and weights) and ``lrmoe.integrations.transformers.TransformersMoELayer`` (a transformers
block's own modules) differ only in their parameters and their routing step.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrmoe.moe.config import LRMoEConfig
from lrmoe.moe.stats import BackwardStats
from lrmoe.parallel.replicas import ReplicaState
from lrmoe.parallel.routes import Routes, make_routes
from lrmoe.moe.router import Router, Routing, router_losses
from lrmoe.utils.phases import phase


class MoECore:
    """The part every LRMoE layer shares (held by composition, not an ``nn.Module``).

    Where the routed pairs run is the core's :class:`lrmoe.parallel.routes.Routes`
    (:func:`lrmoe.parallel.routes.make_routes`): one device, or expert parallelism over
    ``ep_group`` (experts sharded, config checked across ranks); the core itself never
    asks which.

    Args:
        config: the layer's :class:`LRMoEConfig` at construction.
        experts: the module holding ``gate_up_proj`` (E, 2I, H) and ``down_proj``
            (E, H, I); under EP it is sharded in place to this rank's E / W experts
            (:func:`lrmoe.parallel.shard_experts`).
        ep_group: ``torch.distributed`` group for expert parallelism, or None.
        where: the layer's name for error messages.
        policy: placement under EP (:class:`lrmoe.parallel.placement.Placement`, a policy
            name or a dict of its fields), or None: fixed ownership without the planner.

    Raises:
        ValueError: ranks of ``ep_group`` with different MoE configurations or
            placements, E not divisible by the EP size, a policy without ``ep_group``,
            or an invalid placement field.

    Attributes:
        routes: the :class:`lrmoe.parallel.routes.Routes`. stats: :class:`BackwardStats`
            of the last step. ep_group, replicas: the routes' (the group as given; the
            :class:`lrmoe.parallel.replicas.ReplicaState`, None without a policy, whose
            ``stats`` has the last call's plan and replica bytes).
    """

    def __init__(self, config: LRMoEConfig, experts: nn.Module, ep_group=None,
                 where: str = "LRMoELayer", policy=None) -> None:
        self.stats = BackwardStats()
        self.routes: Routes = make_routes(config, experts, ep_group, policy, where)

    @property
    def ep_group(self):
        """The expert-parallel process group, or None on one device."""
        return self.routes.ep_group

    @property
    def replicas(self) -> Optional[ReplicaState]:
        """The placement state under a policy, else None."""
        return self.routes.replicas

    @contextlib.contextmanager
    def before_dispatch(self, config: LRMoEConfig) -> Iterator[None]:
        """Wrap everything a rank does before the dispatch: under EP a failure there is
        announced to the other ranks (they raise at once instead of waiting in the counts
        exchange until the timeout), then re-raised."""
        try:
            yield
        except Exception:
            self.routes.announce_failure(config)
            raise

    def run_experts(self, config: LRMoEConfig, x_TH: Tensor, routing: Routing,
                    w_gate_up_E2IH: Tensor, w_down_EHI: Tensor) -> Tensor:
        """The routed experts, (T, H) -> (T, H) in the dtype of ``x_TH``; a collective
        under EP (the weights are then this rank's shard).

        Raises:
            ValueError: ``retained_mass_target`` > 0 under EP (the adaptive rate is one
                device only: EP fixes its quotas in the forward).
        """
        if config.backward.offload != "none" and not torch.is_grad_enabled():
            config = config.replace(offload="none")  # no backward follows: keep nothing
        return self.routes.run(config, x_TH, routing, w_gate_up_E2IH, w_down_EHI,
                               self.stats)

    @staticmethod
    def add_shared(out_TH: Tensor, x_TH: Tensor, shared: Optional[nn.Module],
                   shared_gate: Optional[nn.Module]) -> Tensor:
        """``out + shared(x)``, scaled by ``sigmoid(shared_gate(x))`` when there is a gate
        (Qwen2-MoE); ``out`` unchanged without a shared expert."""
        if shared is None:
            return out_TH
        shared_TH = shared(x_TH)
        if shared_gate is not None:
            shared_TH = torch.sigmoid(shared_gate(x_TH)) * shared_TH
        return out_TH + shared_TH


def check_input(x: Tensor, w_gate_up: Tensor, config: LRMoEConfig, where: str) -> None:
    """Raise ValueError (naming ``where`` and the fix) for a non-float input, a last
    dimension other than H, another device than the weights, or another dtype outside
    autocast."""
    if not x.is_floating_point():
        raise ValueError(f"{where} input must be floating point, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != config.hidden_size:
        raise ValueError(
            f"{where} input has last dimension {tuple(x.shape)[-1:]} but "
            f"hidden_size={config.hidden_size}; the layer's weights are "
            f"(E, 2I, H) = {tuple(w_gate_up.shape)}")
    if x.device != w_gate_up.device:
        raise ValueError(f"{where} input is on {x.device} but its weights are on "
                         f"{w_gate_up.device}; call layer.to({x.device}) or move the input")
    if x.dtype != w_gate_up.dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"{where} input is {x.dtype} but its expert weights are "
                         f"{w_gate_up.dtype}; call layer.to({x.dtype}) or use torch.autocast")


def check_token_mask(token_mask: Optional[Tensor], x_TH: Tensor) -> Optional[Tensor]:
    """``token_mask`` (any shape with T elements, e.g. a (B, S) attention mask; bool or
    0/1 numbers) as a (T,) bool tensor, True = a real token. Raises ValueError naming
    ``token_mask`` for another size or device."""
    if token_mask is None:
        return None
    if not isinstance(token_mask, Tensor) or token_mask.numel() != x_TH.shape[0]:
        got = tuple(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask)
        raise ValueError(f"token_mask must hold one entry per token (T = {x_TH.shape[0]}, "
                         f"e.g. the (batch, seq) attention mask), got {got}")
    if token_mask.device != x_TH.device:
        raise ValueError(f"token_mask is on {token_mask.device} but the input on "
                         f"{x_TH.device}; move it with token_mask.to({x_TH.device})")
    return token_mask.reshape(-1) != 0


def check_expert_ids(expert_ids: Tensor, x_TH: Tensor, config: LRMoEConfig) -> Tensor:
    """Forced routing ids for the (T, H) input ``x_TH``, as a (T, K) int64 tensor.

    Raises:
        ValueError: naming ``expert_ids``: not an int32/int64 tensor, not (T, top_k),
            on another device than the input (``device``), or (CPU) a value outside
            [0, E). On CUDA the range check is a device-side assertion (no host sync).
    """
    cfg, num_tokens = config, x_TH.shape[0]
    if not isinstance(expert_ids, Tensor) or expert_ids.dtype not in (torch.int64,
                                                                        torch.int32):
        got = expert_ids.dtype if isinstance(expert_ids, Tensor) else type(expert_ids)
        raise ValueError(f"expert_ids must be an int64 (or int32) tensor of expert "
                         f"indices, got {got}")
    if tuple(expert_ids.shape) != (num_tokens, cfg.top_k):
        raise ValueError(f"expert_ids must be (T, top_k) = ({num_tokens}, {cfg.top_k}) "
                         f"for this input, got {tuple(expert_ids.shape)}")
    if expert_ids.device != x_TH.device:
        raise ValueError(f"expert_ids is on {expert_ids.device} but the input on "
                         f"{x_TH.device}; move it with expert_ids.to({x_TH.device})")
    message = f"expert_ids must be in [0, num_experts) = [0, {cfg.num_experts})"
    if expert_ids.device.type == "cuda":
        torch._assert_async(((expert_ids >= 0) & (expert_ids < cfg.num_experts)).all(),
                            message)
    elif expert_ids.numel() and not (0 <= int(expert_ids.min())
                                     and int(expert_ids.max()) < cfg.num_experts):
        raise ValueError(f"{message}, got values in [{int(expert_ids.min())}, "
                         f"{int(expert_ids.max())}]")
    return expert_ids.long()


def _to_compute_dtype(*tensors: Tensor) -> Tuple[Tensor, ...]:
    """The tensors in the autocast dtype under autocast (on their device type), else
    unchanged."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


class MoELayerBase(nn.Module):
    """The common face of LRMoE layers: the forward's steps around a :class:`MoECore`.

    Subclasses register ``gate`` (router) and ``experts`` (``gate_up_proj``,
    ``down_proj``), create ``self.core`` and implement :meth:`_route` and
    :meth:`_shared_modules`.

    Attributes:
        config: :class:`LRMoEConfig`.
        core: the :class:`MoECore`. ``stats`` and ``ep_group`` are the core's.
        aux_loss: () float32 tensor of the last forward, ``router_aux_loss_coef *
            load_balancing_loss + router_z_loss_coef * z_loss`` over the tokens of
            ``token_mask`` (all tokens without one) -- add it to the training loss (it is
            not added to the output); 0 for an empty batch.
        router_logits: (T, E) float32 logits of the last forward.
        trace: optional :class:`lrmoe.workload.trace.RoutingTrace` fed the expert ids of recorded
            steps; layer_index: this layer's index in it.
    """

    #: cast the routed experts' output back to the input dtype (transformers blocks do)
    _cast_output_to_input = False

    def __init__(self, config: LRMoEConfig) -> None:
        super().__init__()
        self.config = config
        self.core: Optional[MoECore] = None
        self.trace = None
        self.layer_index = 0
        self.aux_loss: Optional[Tensor] = None
        self.router_logits: Optional[Tensor] = None
        self._warned_reentrant = False

    @property
    def stats(self) -> BackwardStats:
        """:class:`lrmoe.moe.stats.BackwardStats` of the last step."""
        return self.core.stats

    @property
    def ep_group(self):
        """The expert-parallel process group, or None on one device."""
        return self.core.ep_group

    def set_recalibration(self, **changes) -> None:
        """Change planned-backward settings (:class:`lrmoe.BackwardConfig` fields, e.g.
        ``recalibration_rate=0.2``, or the aux-loss coefficients) in place.

        Raises:
            ValueError: an invalid value, naming the field.
            TypeError: an unknown field.
        """
        self.config = self.config.replace(**changes)

    def forward(self, hidden_states: Tensor, expert_ids: Optional[Tensor] = None,
                token_mask: Optional[Tensor] = None) -> Tensor:
        """Apply the layer.

        Args:
            hidden_states: (..., H) float tensor (fp32, bf16, fp16 or fp64) of the expert
                weights' dtype, or any float dtype under ``torch.autocast``; any strides.
            expert_ids: optional (T, K) int64/int32 forced routing (see
                :meth:`Router.forward`), T = hidden_states.numel() // H; for benchmarks
                and trace replay.
            token_mask: optional tensor with T entries (e.g. the (B, S) attention mask),
                nonzero/True for real tokens: ``aux_loss`` counts only those (padding
                excluded). The experts still run every token.

        Returns:
            (..., H) tensor of the input's dtype (the autocast dtype under autocast).

        Raises:
            ValueError: last dimension not H, non-floating input, input on another device
                or (outside autocast) of another dtype than the expert weights, a bad
                ``expert_ids`` (type, shape, device, or (CPU) a value outside [0, E)) or
                ``token_mask``, or non-finite router logits (device-side assertions on
                CUDA). Expert parallel: ranks whose configs or compute dtypes differ.
            RuntimeError: expert parallel, on every other rank when one rank failed
                before the dispatch (its own error says why), instead of a hang.
        """
        cfg, core = self.config, self.core
        shape = hidden_states.shape
        with core.before_dispatch(cfg):
            check_input(hidden_states, self.experts.gate_up_proj, cfg, type(self).__name__)
            x_TH = hidden_states.reshape(-1, cfg.hidden_size)
            mask_T = check_token_mask(token_mask, x_TH)
            x_TH, routing = self._route(x_TH, expert_ids)
            self._record_routing(routing, mask_T)
            x_expert_TH, w_gate_up, w_down = _to_compute_dtype(
                x_TH, self.experts.gate_up_proj, self.experts.down_proj)
        out_TH = core.run_experts(cfg, x_expert_TH, routing, w_gate_up, w_down)
        if self._cast_output_to_input:
            out_TH = out_TH.to(hidden_states.dtype)
        out_TH = core.add_shared(out_TH, x_TH, *self._shared_modules())
        return out_TH.reshape(shape)

    def _route(self, x_TH: Tensor, expert_ids: Optional[Tensor]) -> Tuple[Tensor, Routing]:
        """(x_TH as the experts and the shared expert see it, :class:`Routing`)."""
        raise NotImplementedError

    def _shared_modules(self) -> Tuple[Optional[nn.Module], Optional[nn.Module]]:
        """(shared expert or None, its sigmoid gate or None)."""
        raise NotImplementedError

    def _record_routing(self, routing: Routing, token_mask_T: Optional[Tensor]) -> None:
        """Keep the router logits, set ``aux_loss`` and feed the routing trace."""
        # torch.utils.checkpoint(use_reentrant=True) runs the first forward under no_grad
        # and the recompute inside the backward, when the loss was already built: the
        # aux loss of the first forward has no gradient, and nothing can give it one
        recompute = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
        if (recompute and routing.probs_TE.requires_grad and self.aux_loss is not None
                and not self.aux_loss.requires_grad and not self._warned_reentrant):
            self._warned_reentrant = True
            warnings.warn(
                f"{type(self).__name__} (layer {self.layer_index}): aux_loss was computed "
                "without gradient, so the load-balancing and z losses do not train the "
                "router: reentrant activation checkpointing (torch.utils.checkpoint with "
                "use_reentrant=True) runs the forward under no_grad; use "
                "use_reentrant=False", RuntimeWarning, stacklevel=3)
        self.router_logits = routing.logits_TE
        self.aux_loss = router_losses(self.config, routing, token_mask_T)
        if self.trace is not None and torch.is_grad_enabled() and self.trace.wants():
            self.trace.record(self.layer_index, routing.expert_ids_TK)

    def diagnostics(self) -> Dict[str, object]:
        """Diagnostics of the last step: routed n_e, quotas Q_e, dropped fraction,
        retained mass, max/mean load before and after recalibration, buffer bytes.

        Synchronises with the device; call it when logging, not every micro-step.
        See :meth:`lrmoe.moe.stats.BackwardStats.summary` for the keys; with a placement
        policy also :meth:`lrmoe.parallel.replicas.ReplicaStats.summary`'s.
        """
        out = self.stats.summary()
        if self.core.replicas is not None:
            out.update(self.core.replicas.stats.summary())
        return out


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (the shared expert).

    Parameter names follow transformers (``gate_proj``, ``up_proj``, ``down_proj``).

    Args:
        hidden_size: H. intermediate_size: width of the MLP.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., H) -> (..., H)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RoutedExperts(nn.Module):
    """Stacked SwiGLU expert weights in the transformers ``Qwen3MoeExperts`` layout.

    Attributes:
        gate_up_proj: (E, 2I, H) parameter, rows ``[gate; up]``.
        down_proj: (E, H, I) parameter.
    """

    def __init__(self, config: LRMoEConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)


class LRMoELayer(MoELayerBase):
    """Sparse MoE layer: router, SwiGLU routed experts, optional shared expert.

    The forward is computed in full for every routed pair. The backward of the routed
    experts is planned (docs/algorithm.md): with recalibration rate c it keeps
    floor((1 - c) * T * K) pairs, chosen per expert by the configured metric and quota
    rule, and runs the expert backward on those rows only (buffers sized by the retained
    count). Router gradients stay exact; aux and z losses use the full routing.

    Args:
        config: :class:`LRMoEConfig`.
        ep_group: optional ``torch.distributed`` process group for expert parallelism
            (:mod:`lrmoe.parallel`): the E experts are sharded evenly over its W ranks
            (rank d holds experts ``[d*E/W, (d+1)*E/W)``, so ``experts.*`` have E/W rows;
            all E are initialised first, so a seeded EP layer holds slices of the seeded
            single-device layer), tokens go to their experts by all-to-all and the
            backward is selected on the token-owner rank before the gradient all-to-all.
            Constructing and every forward/backward are collectives over the group.
            None: one device.
        policy: placement of expert instances under EP (docs/parallel.md "Placement policies
            and replicas"): ``"fixed"``, ``"ultraep"``, ``"symi"``, ``"lrmoe"``, a dict of
            :class:`lrmoe.parallel.placement.Placement` fields (budget, resident bytes,
            slots) or a Placement. Every call plans with ``lrmoe.planner`` on the
            exchanged counts and runs each pair on the instance the plan gives it;
            outputs equal the layer without a policy. None: fixed ownership, no planner.

    Raises:
        ValueError: E not divisible by the EP size, ranks of ``ep_group`` with
            different MoE configurations or placements, a policy without ``ep_group``.

    Attributes:
        gate: :class:`Router` (``gate.weight`` (E, H)).
        experts: :class:`RoutedExperts` (``experts.gate_up_proj``, ``experts.down_proj``).
        shared_expert: :class:`SwiGLUMLP` or None; ``shared_expert_gate``: nn.Linear(H, 1)
            or None.
        aux_loss, router_logits, stats, trace: see :class:`MoELayerBase`.
    """

    def __init__(self, config: LRMoEConfig, ep_group=None, policy=None) -> None:
        super().__init__(config)
        self.gate = Router(config)
        self.experts = RoutedExperts(config)
        self.shared_expert: Optional[SwiGLUMLP] = None
        self.shared_expert_gate: Optional[nn.Linear] = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = SwiGLUMLP(config.hidden_size,
                                           config.shared_expert_intermediate_size)
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.core = MoECore(config, self.experts, ep_group, policy=policy)

    def set_recalibration(self, **changes) -> None:
        """Change planned-backward settings (e.g. ``recalibration_rate=0.2``) in place.

        Raises:
            ValueError: an invalid value, naming the field.
        """
        super().set_recalibration(**changes)
        self.gate.config = self.config

    def _route(self, x_TH: Tensor, expert_ids: Optional[Tensor]) -> Tuple[Tensor, Routing]:
        # under autocast the router, the experts and the shared expert all see x in the
        # autocast dtype (the router upcasts it to fp32 itself)
        (x_TH,) = _to_compute_dtype(x_TH)
        if expert_ids is not None:
            expert_ids = check_expert_ids(expert_ids, x_TH, self.config)
        with phase("router"):
            routing = self.gate(x_TH, expert_ids)
        return x_TH, routing

    def _shared_modules(self) -> Tuple[Optional[nn.Module], Optional[nn.Module]]:
        return self.shared_expert, self.shared_expert_gate
