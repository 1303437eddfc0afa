"""``LRMoELayer``: a sparse MoE block whose forward is exact and whose backward is planned.

Legend: T tokens, H hidden size, E experts, K top_k, I expert intermediate size.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrmoe.config import LRMoEConfig
from lrmoe.experts import BackwardStats, ExpertFunction
from lrmoe.router import Router, load_balancing_loss, router_z_loss


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

    def __init__(self, config: LRMoEConfig, ep_size: int = 1, ep_rank: int = 0) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        if ep_size > 1:
            # initialise all E, keep this rank's shard: same RNG use (and weights) as one
            # device, so a seeded EP model equals the seeded single-device model
            el = e // ep_size
            sl = slice(ep_rank * el, (ep_rank + 1) * el)
            self.gate_up_proj = nn.Parameter(self.gate_up_proj.data[sl].clone())
            self.down_proj = nn.Parameter(self.down_proj.data[sl].clone())
            for p in (self.gate_up_proj, self.down_proj):
                p._lrmoe_expert_parallel = True


class LRMoELayer(nn.Module):
    """Sparse MoE layer: router, SwiGLU routed experts, optional shared expert.

    The forward is computed in full for every routed pair. The backward of the routed
    experts is planned (DESIGN.md section 1): with recalibration rate c it keeps
    floor((1 - c) * T * K) pairs, chosen per expert by the configured metric and quota
    rule, and runs the expert backward on those rows only (buffers sized by the retained
    count). Router gradients stay exact; aux and z losses use the full routing.

    Args:
        config: :class:`LRMoEConfig`.
        ep_group: optional ``torch.distributed`` process group for expert parallelism
            (:mod:`lrmoe.parallel`): the E experts are sharded evenly over its W ranks
            (rank d holds experts ``[d*E/W, (d+1)*E/W)``, so ``experts.*`` have E/W rows),
            tokens go to their experts by all-to-all and the backward is selected on the
            token-owner rank before the gradient all-to-all. Constructing and every
            forward/backward are collectives over the group. None: one device.

    Raises:
        ValueError: E not divisible by the EP size, or ranks of ``ep_group`` with
            different MoE configurations.

    Attributes:
        gate: :class:`Router` (``gate.weight`` (E, H)).
        experts: :class:`RoutedExperts` (``experts.gate_up_proj``, ``experts.down_proj``).
        shared_expert: :class:`SwiGLUMLP` or None; ``shared_expert_gate``: nn.Linear(H, 1)
            or None.
        aux_loss: () float32 tensor of the last forward, ``router_aux_loss_coef *
            load_balancing_loss + router_z_loss_coef * z_loss`` -- add it to the training
            loss (it is not added to the output).
        router_logits: (T, E) float32 logits of the last forward.
        stats: :class:`lrmoe.experts.BackwardStats` of the last step.
    """

    def __init__(self, config: LRMoEConfig, ep_group=None) -> None:
        super().__init__()
        self.config = config
        self.ep_group = ep_group
        ep_size, ep_rank = 1, 0
        if ep_group is not None:
            import torch.distributed as dist

            from lrmoe.parallel import check_config_across_ranks
            ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
            if config.num_experts % ep_size:
                raise ValueError(
                    f"LRMoELayer: num_experts={config.num_experts} is not divisible by the "
                    f"expert-parallel size {ep_size}; choose E a multiple of the EP size")
            check_config_across_ranks(config, ep_group)
        self.gate = Router(config)
        self.experts = (RoutedExperts(config) if ep_group is None
                        else RoutedExperts(config, ep_size, ep_rank))
        self.shared_expert: Optional[SwiGLUMLP] = None
        self.shared_expert_gate: Optional[nn.Linear] = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = SwiGLUMLP(config.hidden_size,
                                           config.shared_expert_intermediate_size)
            if config.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.stats = BackwardStats()
        #: optional :class:`lrmoe.trace.RoutingTrace` fed the expert ids of recorded steps
        self.trace = None
        self.layer_index = 0
        self.aux_loss: Optional[Tensor] = None
        self.router_logits: Optional[Tensor] = None

    def set_recalibration(self, **changes) -> None:
        """Change planned-backward settings (e.g. ``recalibration_rate=0.2``) in place.

        Raises:
            ValueError: an invalid value, naming the field.
        """
        self.config = self.config.replace(**changes)
        self.gate.config = self.config

    def forward(self, hidden_states: Tensor, expert_ids: Optional[Tensor] = None) -> Tensor:
        """Apply the layer.

        Args:
            hidden_states: (..., H) float tensor (fp32, bf16, fp16 or fp64); any strides.
                Under autocast the experts run in the autocast dtype.
            expert_ids: optional (T, K) int64 forced routing (see :meth:`Router.forward`),
                T = hidden_states.numel() // H; for benchmarks and trace replay.

        Returns:
            (..., H) tensor of the input's dtype (the autocast dtype under autocast).

        Raises:
            ValueError: last dimension not H, non-floating input, input on another device
                or (outside autocast) of another dtype than the expert weights,
                ``expert_ids`` not (T, top_k), or non-finite router logits (a device-side
                assertion on CUDA). Expert parallel: ranks whose compute dtypes differ.
            RuntimeError: expert parallel, on every other rank when one rank failed
                before the dispatch (its own error says why), instead of a hang.
        """
        cfg = self.config
        shape = hidden_states.shape
        try:
            x_TH, w_gate_up, w_down, routing = self._route(hidden_states, expert_ids)
        except Exception:
            if self.ep_group is not None:  # the other ranks raise too instead of waiting
                from lrmoe.parallel import announce_failure
                announce_failure(cfg, self.ep_group)
            raise

        if self.ep_group is None:
            out_TH = ExpertFunction.apply(x_TH, routing.weights_TK, routing.expert_ids_TK,
                                          w_gate_up, w_down, cfg, self.stats)
        else:
            from lrmoe.parallel import ExpertParallelFunction
            out_TH = ExpertParallelFunction.apply(x_TH, routing.weights_TK,
                                                  routing.expert_ids_TK, w_gate_up, w_down,
                                                  cfg, self.stats, self.ep_group)
        if self.shared_expert is not None:
            shared_TH = self.shared_expert(x_TH)
            if self.shared_expert_gate is not None:
                shared_TH = torch.sigmoid(self.shared_expert_gate(x_TH)) * shared_TH
            out_TH = out_TH + shared_TH
        return out_TH.reshape(shape)

    def _route(self, hidden_states: Tensor, expert_ids: Optional[Tensor]):
        """Checks, autocast casts and the router: everything before the experts."""
        cfg = self.config
        w_gate_up, w_down = self.experts.gate_up_proj, self.experts.down_proj
        self._check_input(hidden_states, w_gate_up)
        x_TH = hidden_states.reshape(-1, cfg.hidden_size)
        device_type = x_TH.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x_TH, w_gate_up, w_down = x_TH.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
        if expert_ids is not None and tuple(expert_ids.shape) != (x_TH.shape[0], cfg.top_k):
            raise ValueError(f"expert_ids must be (T, top_k) = ({x_TH.shape[0]}, {cfg.top_k}) "
                             f"for this input, got {tuple(expert_ids.shape)}")
        with torch.profiler.record_function("lrmoe.router"):
            routing = self.gate(x_TH, expert_ids)
        self._record_routing(routing.logits_TE, routing.probs_TE, routing.expert_ids_TK)
        return x_TH, w_gate_up, w_down, routing

    def _record_routing(self, logits_TE: Tensor, probs_TE: Tensor, expert_ids_TK: Tensor
                        ) -> None:
        """Keep the router logits, set ``aux_loss`` and feed the routing trace."""
        cfg = self.config
        self.router_logits = logits_TE
        aux = cfg.router_aux_loss_coef * load_balancing_loss(probs_TE, expert_ids_TK)
        if cfg.router_z_loss_coef:
            aux = aux + cfg.router_z_loss_coef * router_z_loss(logits_TE)
        self.aux_loss = aux
        if self.trace is not None and torch.is_grad_enabled() and self.trace.wants():
            self.trace.record(self.layer_index, expert_ids_TK)

    def _check_input(self, x: Tensor, w: Tensor) -> None:
        cfg = self.config
        if not x.is_floating_point():
            raise ValueError(f"LRMoELayer input must be floating point, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"LRMoELayer input has last dimension {tuple(x.shape)[-1:]} but "
                f"hidden_size={cfg.hidden_size}; the layer's weights are "
                f"(E, 2I, H) = {tuple(w.shape)}")
        if x.device != w.device:
            raise ValueError(f"LRMoELayer input is on {x.device} but its weights are on "
                             f"{w.device}; call layer.to({x.device}) or move the input")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"LRMoELayer input is {x.dtype} but its expert weights are "
                             f"{w.dtype}; call layer.to({x.dtype}) or use torch.autocast")

    def diagnostics(self) -> Dict[str, object]:
        """Diagnostics of the last step: routed n_e, quotas Q_e, dropped fraction,
        retained mass, max/mean load before and after recalibration, buffer bytes.

        Synchronises with the device; call it when logging, not every micro-step.
        See :meth:`lrmoe.experts.BackwardStats.summary` for the keys.
        """
        return self.stats.summary()
