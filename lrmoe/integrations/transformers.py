"""Swap the sparse-MoE blocks of a transformers model for LRMoE layers (transformers 5.17.0).

Legend: T tokens, H hidden size, E experts, K top_k, I expert intermediate size.

``patch_moe_blocks(model, ...)`` replaces every sparse-MoE block of a Hugging Face
transformers model by a :class:`TransformersMoELayer` -- an LRMoE layer (the same
:class:`lrmoe.layer.MoECore` as :class:`lrmoe.LRMoELayer`) that holds the block's own
submodules (the very same ``nn.Parameter`` objects under the very same names), so ``save_pretrained`` / ``from_pretrained`` checkpoints load and save
unchanged and an optimizer built before or after patching sees the same tensors.

Mapped families (the block classes of transformers 5.17.0):

====================  ==========================  ======================================
model_type            block                       routing (the block's own router)
====================  ==========================  ======================================
``qwen3_moe``         ``Qwen3MoeSparseMoeBlock``  softmax(fp32) top-K, ``norm_topk_prob``
``qwen2_moe``         ``Qwen2MoeSparseMoeBlock``  as Qwen3 + ``shared_expert`` scaled by
                                                  sigmoid(``shared_expert_gate``)
``mixtral``           ``MixtralSparseMoeBlock``   softmax(fp32) top-K, always renormalised;
                                                  ``router_jitter_noise`` in training
``glm4_moe``          ``Glm4MoeMoE``              sigmoid + ``e_score_correction_bias``,
                                                  group-limited (``n_group``/
                                                  ``topk_group``), ``routed_scaling_factor``,
                                                  + ``shared_experts``
====================  ==========================  ======================================

How the mapping stays exact: the patched layer keeps the block's router module (e.g.
``Qwen3MoeTopKRouter``) and calls it, so routing -- logits in the model's dtype, softmax in
fp32, the cast of the weights, group-limited selection -- is the transformers code itself,
and transformers' ``OutputRecorder`` (which hooks the router *class*, output index 0, to
collect ``router_logits`` when ``output_router_logits=True``) keeps working: the model's
own ``aux_loss`` and ``loss`` are those of the unpatched model. Only the routed experts
change: they run through :class:`lrmoe.moe.experts.ExpertFunction` (or, with ``ep_group``,
:class:`lrmoe.parallel.ExpertParallelFunction`): exact forward, planned backward with
recalibration rate c. The shared expert(s) are the block's own modules.

Aux losses: with ``output_router_logits=True`` the transformers model adds
``router_aux_loss_coef * load_balancing_loss`` to ``outputs.loss`` exactly as unpatched
(GLM-4-MoE has no aux loss); it counts only the tokens of the ``attention_mask`` passed to
the model (transformers' ``load_balancing_loss_func``), so padding is excluded there. Each
patched layer also sets ``layer.aux_loss`` like any LRMoELayer (a per-layer Switch loss,
coefficient = the model's ``router_aux_loss_coef``, 0 for GLM) over all the tokens it saw
(transformers calls the block without a mask); add one of the two to the training loss,
not both.

Families that are not mapped raise ``NotImplementedError`` naming the block class and
model type (e.g. ``olmoe``, ``deepseek_v3``, ``gpt_oss``, ``qwen3_next``: other block
code); so does a mapped family whose experts are not SwiGLU (``hidden_act`` not silu).
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from lrmoe.moe.config import BACKWARD_FIELDS, BackwardConfig, LRMoEConfig
from lrmoe.moe.stats import dropped_fraction
from lrmoe.layer import MoECore, MoELayerBase
from lrmoe.moe.router import Routing, _check_finite
from lrmoe.utils.phases import phase

from lrmoe.utils.extras import require

require("hf", "lrmoe.integrations.transformers")
import transformers  # noqa: E402
from transformers.activations import SiLUActivation  # noqa: E402
from transformers.integrations.moe import _default_apply_gate  # noqa: E402

#: the transformers releases whose MoE blocks this module's mapping is tested against
#: (5.17 in CI; 5.24 tried by hand): [low, high)
TESTED_TRANSFORMERS = ((5, 17), (6, 0))
TESTED_TRANSFORMERS_VERSION = ">=5.17,<6"


def transformers_tested(version: str) -> bool:
    """Whether transformers ``version`` (e.g. ``"5.24.0"``, ``"5.17.0.dev0"``) lies in
    :data:`TESTED_TRANSFORMERS`; a version without a major.minor prefix is not."""
    m = re.match(r"(\d+)\.(\d+)", version)
    low, high = TESTED_TRANSFORMERS
    return m is not None and low <= (int(m[1]), int(m[2])) < high


if not transformers_tested(transformers.__version__):  # pragma: no cover
    warnings.warn(
        f"lrmoe.integrations.transformers maps the MoE blocks of transformers "
        f"{TESTED_TRANSFORMERS_VERSION}, but transformers {transformers.__version__} is "
        "installed; if a block's code changed, the patched model may differ from the "
        "unpatched one (pip install 'transformers>=5.17,<6')", stacklevel=2)

#: settings of the planned backward, taken from the caller (:class:`lrmoe.BackwardConfig`)
PLANNED_BACKWARD_FIELDS = BACKWARD_FIELDS
#: coefficients of ``layer.aux_loss`` (default: the model's ``router_aux_loss_coef``, 0)
LAYER_LOSS_FIELDS = ("router_aux_loss_coef", "router_z_loss_coef")
#: read from the transformers model, never from the caller
ARCHITECTURE_FIELDS = ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "router",
                       "norm_topk_prob", "routed_scaling_factor",
                       "shared_expert_intermediate_size", "shared_expert_gate")
#: layer i of a patched model draws its ``random``/``importance`` numbers from
#: ``seed + i * SEED_STRIDE``, so layers do not drop the same pair positions
SEED_STRIDE = 1 << 32


@dataclass(frozen=True)
class _Family:
    """How one transformers block class maps onto an LRMoE layer."""

    model_type: str
    router: str                       # "softmax" or "sigmoid" (LRMoEConfig.router)
    shared: Optional[str] = None      # child name of the shared expert module
    shared_gate: Optional[str] = None  # child name of the shared expert's sigmoid gate
    jitter: bool = False              # Mixtral's router_jitter_noise


#: keyed by the block class's ``module.qualname`` (no need to import every modeling file)
_FAMILIES: Dict[str, _Family] = {
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock":
        _Family("qwen3_moe", "softmax"),
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock":
        _Family("qwen2_moe", "softmax", shared="shared_expert",
                shared_gate="shared_expert_gate"),
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock":
        _Family("mixtral", "softmax", jitter=True),
    "transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeMoE":
        _Family("glm4_moe", "sigmoid", shared="shared_experts"),
}
SUPPORTED_MODEL_TYPES = tuple(f.model_type for f in _FAMILIES.values())


def _class_key(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


class TransformersMoELayer(MoELayerBase):
    """An LRMoE layer built around one transformers sparse-MoE block.

    It registers the block's own children under their own names and in their own order
    (``gate``, ``experts`` and, per family, ``shared_expert`` + ``shared_expert_gate`` or
    ``shared_experts``), so its state dict equals the block's key for key and tensor for
    tensor. The forward calls the block's router and runs the routed experts and the
    shared expert(s) through the same :class:`lrmoe.layer.MoECore` as
    :class:`lrmoe.LRMoELayer` (expert function, EP sharding and failure announcement,
    shared-expert add, stats).

    The forward is :meth:`lrmoe.layer.MoELayerBase.forward`, with these differences: the
    output has the input's dtype like the transformers block (under autocast the experts
    run in the autocast dtype and their sum is cast back); ``expert_ids`` raises
    ``NotImplementedError`` (the transformers router always chooses the experts);
    ``token_mask`` only reaches ``layer.aux_loss`` of direct calls (transformers calls the
    block without one; the model's own ``outputs.aux_loss`` takes its ``attention_mask``).
    :meth:`set_recalibration` takes the seed as given (the module function
    :func:`set_recalibration` adds the layer offset).

    Args:
        block: the transformers block (one of the mapped families); its modules are taken
            over, not copied (under EP its ``experts`` module then holds only this rank's
            shard).
        family: its :class:`_Family`.
        config: :class:`LRMoEConfig` describing the block and the planned backward.
        layer_index: position among the model's MoE blocks (0-based); offsets the seed.
        ep_group: optional ``torch.distributed`` group: keep this rank's E / W experts
            (a collective; see :mod:`lrmoe.parallel`).
        policy: placement under EP, as :class:`lrmoe.layer.LRMoELayer`'s ``policy``.

    Raises:
        ValueError: under EP, E not divisible by the EP size or ranks with different
            configurations.

    Attributes:
        gate: the block's router module (``gate.weight`` (E, H); GLM: also the buffer
            ``gate.e_score_correction_bias`` (E,) fp32).
        experts: the block's experts module (``experts.gate_up_proj`` (E, 2I, H),
            ``experts.down_proj`` (E, H, I)).
        model_type: the transformers family, e.g. ``"qwen3_moe"``.
        layer_index: see Args. jitter_noise: Mixtral's ``router_jitter_noise`` (else 0).
        aux_loss, router_logits, stats: as in :class:`lrmoe.layer.MoELayerBase`;
            ``router_logits`` is (T, E) float32.
    """

    # the transformers block returns its input's dtype (under autocast too)
    _cast_output_to_input = True

    def __init__(self, block: nn.Module, family: _Family, config: LRMoEConfig,
                 layer_index: int, ep_group: Any = None, policy: Any = None) -> None:
        super().__init__(config)
        for name, param in block._parameters.items():
            self.register_parameter(name, param)
        for name, buf in block._buffers.items():
            self.register_buffer(name, buf,
                                 persistent=name not in block._non_persistent_buffers_set)
        for name, child in block.named_children():
            self.add_module(name, child)
        self._family = family
        self.model_type = family.model_type
        self.layer_index = layer_index
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0)) if family.jitter else 0.0
        # under EP: this rank's contiguous slice of the experts; the router and everything
        # else stay whole (data parallel)
        self.core = MoECore(config, self.experts, ep_group,
                            where=f"{self.model_type} layer {layer_index}", policy=policy)

    def _route(self, x_TH: Tensor, expert_ids: Optional[Tensor]) -> Tuple[Tensor, Routing]:
        if expert_ids is not None:
            raise NotImplementedError(
                f"TransformersMoELayer ({self.model_type}): forced expert_ids are not "
                "supported; the transformers router always chooses the experts")
        if self.jitter_noise > 0 and self.training:
            # MixtralSparseMoeBlock: the same draw, applied to router and expert input
            x_TH = x_TH * torch.empty_like(x_TH).uniform_(1.0 - self.jitter_noise,
                                                          1.0 + self.jitter_noise)
        with phase("router"):
            # (T, E) logits in the router's dtype (collected by transformers' recorder),
            # (T, K) weights, (T, K) int64 ids -- the family's own routing code
            logits, weights_TK, expert_ids_TK = self.gate(x_TH)
            logits_TE = logits.float()
            _check_finite(logits_TE)
            if self.config.router == "softmax":
                probs_TE = torch.softmax(logits_TE, dim=-1)
            else:
                scores_TE = torch.sigmoid(logits_TE)
                probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        return x_TH, Routing(logits_TE, weights_TK.float(), expert_ids_TK, probs_TE)

    def _shared_modules(self) -> Tuple[Optional[nn.Module], Optional[nn.Module]]:
        family = self._family
        return (getattr(self, family.shared) if family.shared else None,
                getattr(self, family.shared_gate) if family.shared_gate else None)

    def extra_repr(self) -> str:
        c = self.config
        return (f"model_type={self.model_type}, layer_index={self.layer_index}, "
                f"E={c.num_experts}, K={c.top_k}, H={c.hidden_size}, "
                f"I={c.moe_intermediate_size}, recalibration_rate={c.backward.recalibration_rate}, "
                f"metric={c.backward.metric}, quota_rule={c.backward.quota_rule}, selection={c.backward.selection}")


# ------------------------------------------------------------------------------ settings
def _resolve_settings(settings: Any, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """Caller's LRMoE settings as LRMoEConfig keyword arguments (validated later)."""
    out: Dict[str, Any] = {}
    if settings is None:
        pass
    elif isinstance(settings, Mapping):
        out.update(settings)
    elif isinstance(settings, BackwardConfig):
        out.update({f: getattr(settings, f) for f in BACKWARD_FIELDS})
    elif isinstance(settings, LRMoEConfig):
        out.update({f: getattr(settings.backward, f) for f in BACKWARD_FIELDS})
    else:
        found = {f: getattr(settings, f) for f in PLANNED_BACKWARD_FIELDS
                 if hasattr(settings, f)}
        if not found:
            raise TypeError(
                f"patch_moe_blocks: settings must be None, a mapping or an object with "
                f"any of {PLANNED_BACKWARD_FIELDS} (e.g. an LRMoEConfig); got "
                f"{type(settings).__name__}")
        out.update(found)
    out.update(overrides)
    _check_setting_names(out, "patch_moe_blocks")
    return out


def _check_setting_names(settings: Mapping, where: str) -> None:
    for key in settings:
        if key in ARCHITECTURE_FIELDS:
            raise ValueError(
                f"{where}: {key!r} is an architecture setting and comes from the "
                "transformers model (its config and weights); only "
                f"{PLANNED_BACKWARD_FIELDS + LAYER_LOSS_FIELDS} can be set")
        if key not in PLANNED_BACKWARD_FIELDS + LAYER_LOSS_FIELDS:
            raise ValueError(f"{where}: unknown setting {key!r}; accepted: "
                             f"{PLANNED_BACKWARD_FIELDS + LAYER_LOSS_FIELDS}")


def _layer_seed(seed: int, layer_index: int) -> int:
    # modulo 2**63: the seed of every layer stays a valid LRMoEConfig.seed (int64)
    return (int(seed) + layer_index * SEED_STRIDE) % (1 << 63)


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", type(model).__name__))


# ------------------------------------------------------------------------- block mapping
def _layer_config(name: str, block: nn.Module, family: _Family, model: nn.Module,
                  settings: Dict[str, Any], layer_index: int) -> LRMoEConfig:
    """Architecture from the block (built from the transformers config), rest from the
    caller. Raises NotImplementedError / ValueError naming the block and the reason."""
    where = f"{family.model_type} block {name!r} ({type(block).__name__})"
    gate, experts = block.gate, block.experts
    w_gate_up, w_down, w_router = experts.gate_up_proj, experts.down_proj, gate.weight
    if not (w_gate_up.is_floating_point() and w_down.is_floating_point()):
        raise NotImplementedError(
            f"{where}: expert weights are {w_gate_up.dtype}/{w_down.dtype}; LRMoE needs "
            "floating-point (unquantised) expert weights")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2:
        raise ValueError(f"{where}: experts.gate_up_proj has shape {tuple(w_gate_up.shape)}, "
                         "expected (E, 2I, H)")
    num_experts, two_i, hidden = w_gate_up.shape
    inter = two_i // 2
    if tuple(w_down.shape) != (num_experts, hidden, inter) or \
            tuple(w_router.shape) != (num_experts, hidden):
        raise ValueError(
            f"{where}: inconsistent shapes gate_up_proj {tuple(w_gate_up.shape)}, "
            f"down_proj {tuple(w_down.shape)}, gate.weight {tuple(w_router.shape)}; expected "
            "(E, 2I, H), (E, H, I), (E, H)")
    if not isinstance(experts.act_fn, (SiLUActivation, nn.SiLU)):
        hidden_act = getattr(getattr(model, "config", None), "hidden_act", "?")
        raise NotImplementedError(
            f"{where}: the experts use {type(experts.act_fn).__name__} "
            f"(hidden_act={hidden_act!r}); LRMoE experts are SwiGLU, i.e. hidden_act='silu'")
    layout = (getattr(experts, "is_transposed", False), getattr(experts, "has_bias", False),
              getattr(experts, "is_concatenated", True), getattr(experts, "has_gate", True),
              getattr(type(experts), "_apply_gate", _default_apply_gate))
    if layout != (False, False, True, True, _default_apply_gate):
        raise NotImplementedError(
            f"{where}: experts layout (is_transposed, has_bias, is_concatenated, has_gate) = "
            f"{layout[:4]}, custom _apply_gate: {layout[4] is not _default_apply_gate}; LRMoE "
            "maps only the plain [gate; up] SwiGLU layout without biases")
    shared_size = 0
    if family.shared is not None:
        shared_size = int(getattr(block, family.shared).gate_proj.out_features)
    hf_config = getattr(model, "config", None)
    kwargs: Dict[str, Any] = dict(
        router_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0))
    kwargs.update(settings)
    kwargs["seed"] = _layer_seed(kwargs.get("seed") or 0, layer_index)
    return LRMoEConfig(
        hidden_size=int(hidden), moe_intermediate_size=int(inter),
        num_experts=int(num_experts), top_k=int(gate.top_k), router=family.router,
        # Mixtral's router always renormalises the top-k weights
        norm_topk_prob=bool(getattr(gate, "norm_topk_prob", True)),
        routed_scaling_factor=float(getattr(gate, "routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=shared_size,
        shared_expert_gate=family.shared_gate is not None, **kwargs)


def _find_blocks(model: nn.Module) -> Tuple[List[Tuple[str, nn.Module, _Family]],
                                             List[Tuple[str, nn.Module]], int]:
    """(mapped blocks, unmapped MoE-like modules, already patched layers) in model order.

    An unmapped MoE-like module is one with an ``experts`` child (every transformers MoE
    block has one)."""
    mapped: List[Tuple[str, nn.Module, _Family]] = []
    unmapped: List[Tuple[str, nn.Module]] = []
    patched = 0
    for name, module in model.named_modules():
        if isinstance(module, MoELayerBase):
            patched += 1
            continue
        family = _FAMILIES.get(_class_key(module))
        if family is not None:
            mapped.append((name, module, family))
        elif isinstance(getattr(module, "experts", None), nn.Module):
            unmapped.append((name, module))
    return mapped, unmapped, patched


# ------------------------------------------------------------------------------- public
def patch_moe_blocks(model: nn.Module, settings: Any = None, /, *, ep_group: Any = None,
                     policy: Any = None, **overrides: Any) -> List[Tuple[str, TransformersMoELayer]]:
    """Replace every sparse-MoE block of a transformers model by an LRMoE layer, in place.

    Each replacement holds the block's own modules and parameters (no copies) under the
    same names, so the model's state-dict keys, ``save_pretrained`` output and
    ``from_pretrained`` loading are unchanged, and ``output_router_logits`` / the model's
    aux loss work as before. At ``recalibration_rate=0`` the model computes the same
    loss and gradients as unpatched (up to summation order); at c > 0 the forward is
    still exact and only the routed experts' backward is planned.

    Args:
        model: a transformers model (e.g. ``Qwen3MoeForCausalLM``) or any module holding
            mapped blocks (families: see the module docstring), on any device/dtype.
        settings: LRMoE settings of the planned backward: None, a
            :class:`lrmoe.BackwardConfig`, an :class:`LRMoEConfig` (its ``backward`` is
            read), a mapping of BackwardConfig fields, or an object with (some of) the
            attributes of :data:`PLANNED_BACKWARD_FIELDS` (only those are read).
        **overrides: the same fields as keywords (they win over ``settings``); also
            ``router_aux_loss_coef`` / ``router_z_loss_coef`` of ``layer.aux_loss``.
            Layer i gets the seed ``(seed + i * SEED_STRIDE) mod 2**63``.
        ep_group: optional ``torch.distributed`` group for expert parallelism
            (:mod:`lrmoe.parallel`): each layer keeps only this rank's E / W experts (a
            collective over the group; every rank must patch the same model).
        policy: placement of expert instances under EP for every layer (a policy name,
            a dict of :class:`lrmoe.parallel.placement.Placement` fields or a Placement;
            see :class:`lrmoe.layer.LRMoELayer`); None: fixed ownership, no planner.

    Returns:
        ``[(module name, layer), ...]`` in model order, e.g.
        ``("model.layers.0.mlp", TransformersMoELayer)``.

    Raises:
        ValueError: no MoE block in ``model``; ``model`` already patched; ``model`` is a
            block itself; an architecture field (``top_k``, ``num_experts``, ...) or an
            unknown name among the settings; an invalid setting value (naming the field).
        NotImplementedError: an MoE block of an unmapped family (naming its class and the
            model type), or a mapped block that LRMoE cannot run (non-SiLU experts,
            quantised expert weights).
        TypeError: ``settings`` of an unusable type.

    The model is modified only when every block could be mapped.
    """
    chosen = _resolve_settings(settings, overrides)
    mapped, unmapped, patched = _find_blocks(model)
    model_type = _model_type(model)
    if unmapped:
        names = ", ".join(f"{n!r} ({type(m).__name__})" for n, m in unmapped[:3])
        raise NotImplementedError(
            f"patch_moe_blocks: model type {model_type!r} has MoE blocks that LRMoE does not "
            f"map: {names}{' ...' if len(unmapped) > 3 else ''}; mapped families: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (transformers {TESTED_TRANSFORMERS_VERSION})")
    if patched:
        raise ValueError(
            f"patch_moe_blocks: the model already holds {patched} LRMoE layer(s); patch a "
            "model once, and change settings with lrmoe.integrations.transformers."
            "set_recalibration(model, ...)")
    if not mapped:
        raise ValueError(
            f"patch_moe_blocks: model type {model_type!r} ({type(model).__name__}) has no "
            f"sparse-MoE block; mapped families: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if any(name == "" for name, _, _ in mapped):
        raise ValueError("patch_moe_blocks: got an MoE block itself; pass the model that "
                         "contains it (the block is replaced in its parent)")
    layers: List[Tuple[str, TransformersMoELayer]] = []
    for index, (name, block, family) in enumerate(mapped):
        if block._forward_hooks or block._forward_pre_hooks or hasattr(block, "_hf_hook"):
            raise ValueError(
                f"patch_moe_blocks: block {name!r} has forward hooks (e.g. from accelerate "
                "or a profiler) that would be lost; patch the model before adding them")
        config = _layer_config(name, block, family, model, chosen, index)
        layer = TransformersMoELayer(block, family, config, index, ep_group, policy)
        layer.train(block.training)
        layers.append((name, layer))
    for name, layer in layers:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    return layers


def moe_layers(model: nn.Module) -> List[Tuple[str, MoELayerBase]]:
    """All LRMoE layers of ``model`` (patched or native), ``[(name, layer)]`` in order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayerBase)]


def set_recalibration(model: nn.Module, **changes: Any) -> int:
    """Change planned-backward settings on every LRMoE layer of ``model``, e.g.
    ``set_recalibration(model, recalibration_rate=0.2, metric="lrm")``.

    Accepts the fields of :data:`PLANNED_BACKWARD_FIELDS` and :data:`LAYER_LOSS_FIELDS`.
    A ``seed`` is offset per patched layer as in :func:`patch_moe_blocks`. All values are
    validated for every layer before any layer changes.

    Returns:
        the number of layers changed.

    Raises:
        ValueError: ``model`` has no LRMoE layer (call :func:`patch_moe_blocks` first), an
            architecture or unknown field, or an invalid value (naming the field).
    """
    _check_setting_names(changes, "set_recalibration")
    layers = moe_layers(model)
    if not layers:
        raise ValueError("set_recalibration: the model has no LRMoE layer; call "
                         "lrmoe.integrations.transformers.patch_moe_blocks(model) first")
    new_configs = []
    for _, layer in layers:
        layer_changes = dict(changes)
        if "seed" in layer_changes and isinstance(layer, TransformersMoELayer):
            layer_changes["seed"] = _layer_seed(layer_changes["seed"], layer.layer_index)
        new_configs.append(layer.config.replace(**layer_changes))  # validates
    for (_, layer), config in zip(layers, new_configs):
        layer.set_recalibration(**{f: getattr(config.backward if f in BACKWARD_FIELDS
                                              else config, f) for f in changes})
    return len(layers)


def collect_diagnostics(model: nn.Module) -> Dict[str, Dict[str, object]]:
    """Diagnostics of the last step of every LRMoE layer, ``{module name: dict}``.

    Each dict is :meth:`LRMoELayer.diagnostics` (``tokens_per_expert``, ``quota``,
    ``dropped_fraction``, ``retained_mass``, ``load_max_over_mean_before/after``,
    ``num_pairs``, ``num_retained``, ``backward_buffer_bytes``; backward entries None
    before the first backward). Synchronises with the device: call it when logging.
    """
    return {name: layer.diagnostics() for name, layer in moe_layers(model)}


def summarize_diagnostics(diagnostics: Mapping[str, Mapping[str, object]]
                          ) -> Dict[str, Optional[float]]:
    """Model-level numbers from :func:`collect_diagnostics` for a progress bar.

    Returns:
        ``dropped_fraction``: 1 - (sum of retained pairs) / (sum of routed pairs) over the
        layers that ran a backward; ``retained_mass``: mean over layers of rho (layers
        with a value); ``load_max_over_mean_before`` / ``_after``: means over layers;
        ``backward_buffer_bytes``: sum. None where no layer has a value.
    """
    def mean(key: str) -> Optional[float]:
        values = [float(d[key]) for d in diagnostics.values() if d.get(key) is not None]
        return sum(values) / len(values) if values else None

    ran = [d for d in diagnostics.values() if d.get("num_retained") is not None]
    pairs = sum(int(d["num_pairs"]) for d in ran)
    buffers = [int(d["backward_buffer_bytes"]) for d in ran
               if d.get("backward_buffer_bytes") is not None]
    return {
        "dropped_fraction": dropped_fraction(sum(int(d["num_retained"]) for d in ran), pairs),
        "retained_mass": mean("retained_mass"),
        "load_max_over_mean_before": mean("load_max_over_mean_before"),
        "load_max_over_mean_after": mean("load_max_over_mean_after"),
        "backward_buffer_bytes": float(sum(buffers)) if buffers else None,
    }
