"""LRMoE experts inside torchtitan's MoE models (torchtitan 0.3.0).

Legend: B batch, L sequence, D hidden (lrmoe's H), F expert intermediate (lrmoe's I),
E experts, K top_k, T = B * L tokens. torchtitan's own suffixes are kept on its tensors.

``swap_moe(model, LRMoETitanConfig(recalibration_rate=0.2))`` finds every
``torchtitan.models.common.moe.MoE`` of a built torchtitan model (Qwen3 MoE, DeepSeek-V3,
gpt-oss-style models: everything whose ``moe`` is that class) and changes the class of its
``routed_experts`` (a ``RoutedExperts``: token dispatcher + ``GroupedExperts``) to
:class:`LRMoERoutedExperts`, a subclass whose ``forward`` runs the routed pairs through
lrmoe's expert core (:class:`lrmoe.layer.MoECore`, i.e.
:class:`lrmoe.moe.experts.ExpertFunction`: exact forward, planned backward). Nothing else
changes: the router (softmax or sigmoid, expert bias, group-limited routing), the
aux-loss-free load-balancing counters, the shared experts and the combine with the routing
scores stay torchtitan's code, and the expert weights stay torchtitan's own
``nn.Parameter`` objects (``inner_experts.w1_EFD``, ``w2_EDF``, ``w3_EFD``) under the same
names, so the state-dict keys (FSDP2 / DCP checkpoints, the HF state-dict adapters) are
those of the unswapped model, and torchtitan's ``parallelize`` (FSDP2, compile, activation
checkpointing) still sees a ``RoutedExperts``.

The experts compute like torchtitan's ``GroupedExperts.forward``: in bf16 (it casts x
and the weights with ``.bfloat16()`` and the output back with ``type_as(x)``), unless
``expert_dtype="input"``. lrmoe's core takes the stacked [gate; up] layout (E, 2F, D), so
each forward concatenates ``w1_EFD`` and ``w3_EFD`` (a differentiable ``torch.cat``: one
copy of those weights per call, their gradients split back by autograd).

Expert parallelism: after torchtitan's ``RoutedExperts.parallelize`` the expert weights
are ``Shard(0)`` DTensors of the 1-D "ep" mesh (rank d holds experts ``[d*E/W,
(d+1)*E/W)``) and ``token_dispatcher.ep_mesh`` is that mesh (W ranks). The swapped forward
then takes the local shards (``to_local()``: differentiable, so the DTensor gradients and
FSDP2 are fed as by ``GroupedExperts.forward``) and runs them through lrmoe's
:class:`lrmoe.parallel.function.ExpertParallelFunction` over ``ep_mesh.get_group()``:
lrmoe's all-to-all replaces the dispatcher's (whose ``dispatch``/``combine`` are not
called), and its backward sends only the kept token-expert rows. The routes
(:class:`lrmoe.parallel.routes.EPRoutes` with ``presharded=True``: nothing re-sharded) are
made at the first EP forward, a collective config check over the group. The router, the
expert bias and ``MoE.tokens_per_expert_E`` (counted in ``MoE.forward`` from the local
routing, before the routed experts) are torchtitan's under EP too.

Not mapped (``NotImplementedError`` at the first forward, naming the module and the fix):
tensor parallelism on the experts (DTensor weights on a 2-D mesh or placed other than
``Shard(0)``), E not divisible by the EP size, an EP token dispatcher other than
torchtitan's ``AllToAllTokenDispatcher`` (DeepEP, HybridEP, MinimalAsyncEP), and
``GroupedExperts`` subclasses (e.g. the MXFP8 converter's, which replace its grouped GEMM;
refused by :func:`swap_moe`). ``retained_mass_target`` > 0 is refused under EP
(ValueError: EP fixes its quotas in the forward). FSDP2 alone is fine: it hands the
forward whole, plain tensors. :func:`swap_moe` must run before torchtitan's
``parallelize`` (which captures the forward it wraps; a parallelized module is refused).

The same from torchtitan's config, before the model is built: the override
:func:`lrmoe.integrations.torchtitan_override.lrmoe_moe` (``--override.imports``).

torchtitan is imported only when :func:`swap_moe` runs. Install it (no training
dependencies) with ``pip install --no-deps -r requirements/torchtitan.txt`` beside torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor, nn

from lrmoe.layer import MoECore
from lrmoe.moe.config import BACKWARD_FIELDS, BackwardConfig, LRMoEConfig
from lrmoe.moe.router import Routing
from lrmoe.moe.stats import BackwardStats
from lrmoe.parallel.routes import EPRoutes

#: the torchtitan release whose MoE module this mapping is tested against
TESTED_TORCHTITAN = "0.3.0"
INSTALL = "pip install --no-deps -r requirements/torchtitan.txt"
#: layer i draws its ``random``/``importance`` numbers from ``seed + i * SEED_STRIDE``
#: (as lrmoe/integrations/transformers.py does), so layers do not drop the same positions
SEED_STRIDE = 1 << 32
EXPERT_DTYPES = ("bfloat16", "input")


@dataclass
class LRMoETitanConfig:
    """LRMoE settings for a torchtitan model: a plain dataclass of plain values, so it can
    sit in a torchtitan ``Trainer.Config`` (or any tyro/dataclass config) as a section.

    The planned-backward fields are those of :class:`lrmoe.BackwardConfig`, with the same
    names, defaults and meaning (docs/integrations.md has the table).

    Attributes:
        enabled: False makes :func:`swap_moe` a no-op (a config switch).
        recalibration_rate: c in [0, 1); 0 is exact training.
        metric: ``lrm``, ``grad_sq``, ``grad_abs`` or ``random``.
        quota_rule: ``proportional`` or ``water_level``.
        selection: ``importance`` or ``topk``.
        seed: base seed (None = 0); MoE layer i uses ``seed + i * 2**32`` (mod 2**63).
        selective_backward: False runs the plain exact backward (needs c = 0).
        retained_mass_target: 0, or rho* in (0, 1] for the adaptive rate.
        offload: ``none`` or ``activations``.
        expert_dtype: ``bfloat16`` (default: what torchtitan's ``GroupedExperts`` computes
            in, whatever the weights' dtype) or ``input`` (the dtype of the MoE input).
    """

    enabled: bool = True
    recalibration_rate: float = 0.0
    metric: str = "lrm"
    quota_rule: str = "proportional"
    selection: str = "importance"
    seed: Optional[int] = None
    selective_backward: bool = True
    retained_mass_target: float = 0.0
    offload: str = "none"
    expert_dtype: str = "bfloat16"

    def backward_config(self, layer_index: int = 0) -> BackwardConfig:
        """The validated :class:`lrmoe.BackwardConfig` of MoE layer ``layer_index``.

        Raises:
            ValueError: an invalid field, named ``LRMoETitanConfig.<field>``.
        """
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"LRMoETitanConfig.expert_dtype must be one of "
                             f"{', '.join(EXPERT_DTYPES)}; got {self.expert_dtype!r}")
        fields = {f: getattr(self, f) for f in BACKWARD_FIELDS}
        seed = fields["seed"] or 0
        if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 1 << 63:
            seed = (seed + layer_index * SEED_STRIDE) % (1 << 63)
        fields["seed"] = seed  # an invalid seed is left for validate() to name
        out = BackwardConfig(**fields)
        out.validate("LRMoETitanConfig")
        return out


class LRMoERoutedExperts:
    """The forward that replaces ``RoutedExperts.forward`` (mixed into a subclass of
    torchtitan's ``RoutedExperts`` by :func:`swap_moe`; not built directly).

    Attributes (set by :func:`swap_moe`):
        lrmoe_config: the layer's :class:`lrmoe.LRMoEConfig`.
        lrmoe_core: its :class:`lrmoe.layer.MoECore` (``lrmoe_core.stats`` is the
            :class:`lrmoe.moe.stats.BackwardStats` of the last step).
        lrmoe_expert_dtype: ``bfloat16`` or ``input``.
        lrmoe_layer_index: position among the model's MoE modules.
    """

    lrmoe_config: LRMoEConfig
    lrmoe_core: MoECore
    lrmoe_expert_dtype: str
    lrmoe_layer_index: int

    def forward(self, x_BLD: Tensor, topk_scores_BLK: Tensor, topk_expert_ids_BLK: Tensor,
                num_local_tokens_per_expert_E: Tensor) -> Tensor:
        """Dispatch, experts and combine of torchtitan's ``RoutedExperts``, by lrmoe.

        On one device (or FSDP2 alone) every expert runs here
        (:class:`lrmoe.parallel.routes.LocalRoutes`). Under expert parallelism (the
        dispatcher's ``ep_mesh`` has W > 1 ranks, the weights are ``Shard(0)`` DTensors
        of that mesh) the local shards (``to_local()``, differentiable) run through
        :class:`lrmoe.parallel.function.ExpertParallelFunction` over
        ``ep_mesh.get_group()``: lrmoe's all-to-all replaces the dispatcher's, and the
        backward sends only the kept rows. The routes are made at the first EP forward
        (a collective config check over the group).

        Args:
            x_BLD: (B, L, D) float input (fp32/bf16), this rank's tokens.
            topk_scores_BLK: (B, L, K) routing scores (float32 from torchtitan's router).
            topk_expert_ids_BLK: (B, L, K) int64 global expert ids.
            num_local_tokens_per_expert_E: (E,) counts (unused: lrmoe counts itself;
                ``MoE.tokens_per_expert_E`` is fed by torchtitan's ``MoE.forward``).

        Returns:
            (B, L, D) routed output in the dtype of ``x_BLD``.

        Raises:
            NotImplementedError: a sharding lrmoe does not map (see
                :func:`local_expert_weights`).
            ValueError: a non-floating input or one whose last dimension is not D; under
                EP, ranks with different settings or ``retained_mass_target`` > 0.
        """
        del num_local_tokens_per_expert_E
        cfg = self.lrmoe_config
        w1_EFD, w2_EDF, w3_EFD, group = local_expert_weights(self)
        if group is not None and getattr(self.lrmoe_core.routes, "ep_group", None) is not group:
            self.lrmoe_core.routes = EPRoutes(cfg, None, group, where=self._lrmoe_where(),
                                              presharded=True)
        with self.lrmoe_core.before_dispatch(cfg):  # under EP: the others fail at once
            if not x_BLD.is_floating_point() or x_BLD.shape[-1] != cfg.hidden_size:
                raise ValueError(
                    f"{self._lrmoe_where()}: input must be a float (B, L, D = "
                    f"{cfg.hidden_size}) tensor, got {x_BLD.dtype} {tuple(x_BLD.shape)}")
            batch, _, dim = x_BLD.shape
            k = topk_expert_ids_BLK.shape[-1]
            dtype = torch.bfloat16 if self.lrmoe_expert_dtype == "bfloat16" else x_BLD.dtype
            x_TD = x_BLD.reshape(-1, dim)
            routing = Routing(logits_TE=None, probs_TE=None,  # only weights and ids are read
                              weights_TK=topk_scores_BLK.reshape(-1, k).float(),
                              expert_ids_TK=topk_expert_ids_BLK.reshape(-1, k).long())
            # [gate; up] rows: lrmoe's (E, 2F, D) layout (lrmoe/layer.py RoutedExperts);
            # under EP these are this rank's El experts
            w_gate_up = torch.cat([w1_EFD, w3_EFD], dim=1).to(dtype)
            w_down = w2_EDF.to(dtype)
        out_TD = self.lrmoe_core.run_experts(cfg, x_TD.to(dtype), routing, w_gate_up, w_down)
        return out_TD.to(x_BLD.dtype).view(batch, -1, dim)

    def _lrmoe_where(self) -> str:
        return f"LRMoE torchtitan layer {self.lrmoe_layer_index}"

    def set_recalibration(self, **changes: Any) -> None:
        """Change planned-backward fields (``recalibration_rate=0.1``, ...) in place.

        Raises:
            ValueError: an unknown field or an invalid value, naming it.
        """
        self.lrmoe_config = self.lrmoe_config.replace(**changes)

    def diagnostics(self) -> dict:
        """:meth:`lrmoe.moe.stats.BackwardStats.summary` of the last step (syncs)."""
        return self.lrmoe_core.stats.summary()


def local_expert_weights(module: Any) -> Tuple[Tensor, Tensor, Tensor, Any]:
    """The expert weights the forward of a swapped ``RoutedExperts`` computes with.

    Returns:
        ``(w1_EFD, w2_EDF, w3_EFD, group)``: plain tensors (local shards through the
        differentiable ``DTensor.to_local()``, so torchtitan's DTensor gradients and
        FSDP2 are fed as by ``GroupedExperts.forward``) and the EP process group (None
        without EP). Under EP the shards hold El = E / W experts, rank d's
        ``[d*El, (d+1)*El)`` (``Shard(0)``, as torchtitan's ``RoutedExperts.parallelize``
        lays them out).

    Raises:
        NotImplementedError, naming the layer and the fix: weights that are DTensors on a
            mesh of more than one dimension or placed other than ``Shard(0)`` (tensor
            parallelism on the experts, ETP), DTensor weights sharded over more ranks
            than the dispatcher's ``ep_mesh`` (none wired), an EP mesh with plain
            weights of other than E / W rows, E not divisible by W, or an EP token
            dispatcher other than torchtitan's ``AllToAllTokenDispatcher``.
    """
    from torch.distributed.tensor import DTensor, Shard
    where = module._lrmoe_where()
    experts = module.inner_experts
    weights = [experts.w1_EFD, experts.w2_EDF, experts.w3_EFD]
    mesh = getattr(module.token_dispatcher, "ep_mesh", None)
    world = 1 if mesh is None else mesh.size()
    num_experts = module.lrmoe_config.num_experts
    local = []
    for name, w in zip(("w1_EFD", "w2_EDF", "w3_EFD"), weights):
        if isinstance(w, DTensor):
            if w.device_mesh.ndim != 1 or (w.device_mesh.size() > 1 and
                                           tuple(w.placements) != (Shard(0),)):
                raise NotImplementedError(
                    f"{where}: inner_experts.{name} is a DTensor on a "
                    f"{w.device_mesh.ndim}-D mesh with placements {tuple(w.placements)}; "
                    "lrmoe maps only expert parallelism (Shard(0) on the 1-D ep mesh): "
                    "set expert_tensor_parallel_degree = tensor_parallel_degree = 1, or "
                    "do not swap")
            if w.device_mesh.size() > world:
                raise NotImplementedError(
                    f"{where}: inner_experts.{name} is sharded over "
                    f"{w.device_mesh.size()} ranks but the token dispatcher has "
                    f"{'no ep_mesh' if mesh is None else f'an ep_mesh of {world}'}; call "
                    "torchtitan's RoutedExperts.parallelize (or token_dispatcher."
                    "wire_meshes(ep_mesh=...)) on the mesh the weights are sharded over")
            w = w.to_local()
        local.append(w)
    if world == 1:
        return local[0], local[1], local[2], None
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    if not isinstance(module.token_dispatcher, AllToAllTokenDispatcher):
        raise NotImplementedError(
            f"{where}: under EP lrmoe's all-to-all replaces torchtitan's token dispatcher, "
            f"mapped (and tested) for its AllToAllTokenDispatcher only, not "
            f"{type(module.token_dispatcher).__name__}; use comm_backend='standard' "
            "(the default all-to-all) or do not swap")
    if num_experts % world:
        raise NotImplementedError(
            f"{where}: num_experts={num_experts} is not divisible by the EP size {world}; "
            "lrmoe's expert parallelism needs E / W experts on every rank: choose "
            "expert_parallel_degree dividing the number of experts")
    rows = [int(w.shape[0]) for w in local]
    if rows != [num_experts // world] * 3:
        raise NotImplementedError(
            f"{where}: the token dispatcher's ep_mesh has {world} ranks but this rank's "
            f"expert weights have {rows} rows, not E / W = {num_experts // world}; shard "
            "them with torchtitan's RoutedExperts.parallelize (Shard(0) on the ep mesh)")
    return local[0], local[1], local[2], mesh.get_group()


def require_torchtitan(what: str = "lrmoe.integrations.torchtitan") -> Any:
    """Import and return ``torchtitan.models.common.moe``.

    Raises:
        ModuleNotFoundError: torchtitan (or spmd_types/tyro/docstring_parser/typeguard,
            or triton, which it imports at module level) is missing, naming
            ``requirements/torchtitan.txt``.
    """
    try:
        from torchtitan.models.common import moe
    except ImportError as exc:
        err = ModuleNotFoundError(
            f"{what} needs torchtitan {TESTED_TORCHTITAN} ({exc}); install it beside torch "
            f"with `{INSTALL}` (its training dependencies are not needed; on a CPU-only "
            "torch also install triton, which torchtitan imports)")
        err.name = getattr(exc, "name", "torchtitan")
        raise err from exc
    return moe


_SWAPPED_CLASS: Optional[type] = None


def _swapped_class(routed_cls: type) -> type:
    """The subclass of torchtitan's ``RoutedExperts`` with lrmoe's forward (made once)."""
    global _SWAPPED_CLASS
    if _SWAPPED_CLASS is None:
        _SWAPPED_CLASS = type("LRMoETitanRoutedExperts", (LRMoERoutedExperts, routed_cls),
                              {"__module__": __name__})
        globals()["LRMoETitanRoutedExperts"] = _SWAPPED_CLASS  # pickle finds it by name
    return _SWAPPED_CLASS


def swap_moe(model: nn.Module, config: Optional[LRMoETitanConfig] = None
             ) -> nn.Module:
    """Run the routed experts of every torchtitan ``MoE`` of ``model`` through LRMoE.

    In place; call it on the built model (before or after ``init_weights``, before
    torchtitan's ``parallelize``, e.g. in a model converter or right after
    ``model_config.build()``). The same Parameter objects stay under the same names.

    Args:
        model: a torchtitan model (e.g. ``Qwen3Model``, ``DeepSeekV3Model``) or any module
            holding ``torchtitan.models.common.moe.MoE`` modules; any device and dtype.
        config: :class:`LRMoETitanConfig` (None: the defaults, c = 0).

    Returns:
        ``model`` (the same object).

    Raises:
        ModuleNotFoundError: torchtitan is not importable (naming the requirements file).
        TypeError: ``config`` is not an :class:`LRMoETitanConfig`.
        ValueError: an invalid setting (naming the field), no torchtitan MoE in
            ``model``, a model already swapped, or one already parallelized.
        NotImplementedError: an MoE whose experts are not torchtitan's plain
            ``GroupedExperts`` (naming the module and its class).
    """
    config = LRMoETitanConfig() if config is None else config
    if not isinstance(config, LRMoETitanConfig):
        raise TypeError(f"swap_moe: config must be an LRMoETitanConfig, got "
                        f"{type(config).__name__}")
    if not config.enabled:
        return model
    config.backward_config()  # validate every field before touching the model
    moe_mod = require_torchtitan("swap_moe")
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, moe_mod.MoE)]
    if not found:
        raise ValueError(f"swap_moe: {type(model).__name__} has no torchtitan MoE module "
                         "(torchtitan.models.common.moe.MoE); build an MoE flavor, e.g. "
                         "Qwen3 'debugmodel_moe' or DeepSeek-V3")
    for name, moe in found:
        routed = moe.routed_experts
        if isinstance(routed, LRMoERoutedExperts):
            raise ValueError(f"swap_moe: {name!r} is already swapped; swap a model once "
                             "and change settings with set_recalibration(model, ...)")
        if getattr(routed, "_parallelized", False) or "forward" in vars(routed):
            # Module.parallelize wraps the bound forward it found (torchtitan's
            # protocols/module.py): a class swapped afterwards would never run
            raise ValueError(f"swap_moe: {name!r} is already parallelized; call swap_moe "
                             "on the built model before torchtitan's parallelize")
        if type(routed) is not moe_mod.RoutedExperts or \
                type(routed.inner_experts) is not moe_mod.GroupedExperts:
            raise NotImplementedError(
                f"swap_moe: {name!r} has {type(routed).__name__} / "
                f"{type(routed.inner_experts).__name__}; LRMoE replaces only torchtitan's "
                "plain RoutedExperts + GroupedExperts (SwiGLU, unquantised)")
    swapped = _swapped_class(moe_mod.RoutedExperts)
    for index, (name, moe) in enumerate(found):
        moe.routed_experts.__class__ = swapped
        attach(moe.routed_experts, moe.router, config, index, f"torchtitan MoE {name!r}")
    return model


def attach(routed: nn.Module, router: Any, config: LRMoETitanConfig, index: int,
           where: str) -> None:
    """Give a (swapped) ``RoutedExperts`` its lrmoe state: the attributes listed on
    :class:`LRMoERoutedExperts`. ``router``: the MoE's ``TokenChoiceTopKRouter`` or its
    config (``top_k``, ``score_func``, ``route_norm``, ``route_scale`` are read).

    Raises:
        ValueError: an invalid setting of ``config`` (naming the field).
    """
    w1_EFD = routed.inner_experts.w1_EFD
    num_experts, inter, hidden = (int(s) for s in w1_EFD.shape)
    lrmoe_config = LRMoEConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
        top_k=int(router.top_k), router=router.score_func,
        norm_topk_prob=bool(router.route_norm),
        routed_scaling_factor=float(router.route_scale),
        backward=config.backward_config(index))
    routed.lrmoe_config = lrmoe_config
    routed.lrmoe_core = MoECore(lrmoe_config, routed.inner_experts, where=where)
    routed.lrmoe_expert_dtype = config.expert_dtype
    routed.lrmoe_layer_index = index


def swapped_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``[(name, routed experts module)]`` of every swapped MoE of ``model``, in order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LRMoERoutedExperts)]


def set_recalibration(model: nn.Module, **changes: Any) -> int:
    """Change planned-backward fields on every swapped layer (a ``seed`` is offset per
    layer as in :func:`swap_moe`); all are validated before any layer changes.

    Returns:
        the number of layers changed.

    Raises:
        ValueError: no swapped layer, an unknown field or an invalid value.
    """
    layers = swapped_layers(model)
    if not layers:
        raise ValueError("set_recalibration: no swapped MoE; call swap_moe(model, ...) first")
    unknown = [k for k in changes if k not in BACKWARD_FIELDS]
    if unknown:
        raise ValueError(f"set_recalibration: unknown field(s) {unknown}; accepted: "
                         f"{', '.join(BACKWARD_FIELDS)}")
    new = []
    for _, layer in layers:
        fields = {f: getattr(layer.lrmoe_config.backward, f) for f in BACKWARD_FIELDS}
        fields.update(changes)
        if "seed" in changes:  # the caller's base seed, offset per layer
            backward = LRMoETitanConfig(**fields).backward_config(layer.lrmoe_layer_index)
        else:  # the layer's own (already offset) seed
            backward = BackwardConfig(**fields)
            backward.validate("set_recalibration")
        new.append(backward)
    for (_, layer), backward in zip(layers, new):
        layer.lrmoe_config = layer.lrmoe_config.replace(backward=backward)
    return len(layers)


def collect_diagnostics(model: nn.Module) -> dict:
    """``{name: diagnostics}`` of every swapped layer's last step (syncs the device)."""
    return {name: layer.diagnostics() for name, layer in swapped_layers(model)}
