"""Configuration of an LRMoE layer: the MoE architecture (:class:`LRMoEConfig`) and the
planned backward (:class:`BackwardConfig`, one schema: the layer's ``config.backward``,
``lrmoe train``'s ``lrmoe`` section, the EP config hash and the ``lrmoe train`` flags
are all read from its fields).

A new planned-backward knob is one field here (with its ``metadata``: help text, and a
``flag`` where ``lrmoe train`` should have one) plus its check in
:meth:`BackwardConfig.validate`; its readers take it from ``config.backward``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from lrmoe.moe.offload import OFFLOAD_MODES
from lrmoe.ops import METRICS, QUOTA_RULES, SELECTIONS, rate_fraction

ROUTERS = ("softmax", "sigmoid")
#: seeds feed torch generators and 64-bit C++ counters
SEED_LIMIT = 1 << 63


def _knob(default: Any, help: str, flag: Optional[str] = None, short: Optional[str] = None,
          metavar: Optional[str] = None, choices: Optional[Tuple[str, ...]] = None) -> Any:
    """A BackwardConfig field; ``flag`` (and ``short``) make it an ``lrmoe train`` option
    (:func:`lrmoe.cli._add_train_parser` reads the metadata)."""
    return field(default=default, metadata={"help": help, "flag": flag, "short": short,
                                            "metavar": metavar, "choices": choices})


@dataclass
class BackwardConfig:
    """The planned backward of an MoE layer (LRMoE): which routed pairs keep their expert
    backward. ``LRMoEConfig.backward`` of a layer and the ``lrmoe`` section of
    ``lrmoe train`` (YAML ``lrmoe:``, ``--set lrmoe.<field>=...``, the flags below).

    Attributes:
        recalibration_rate: c in [0, 1), the share of routed pairs whose expert backward
            is dropped (the paper's C10/C20/C30 are 0.1/0.2/0.3). 0 is exact training.
            The quota arithmetic reads c as the nearest fraction with denominator <= 2^20
            (:func:`lrmoe.ops.rate_fraction`); a c that rounds to 1 is refused.
        metric: pair score, ``lrm`` (alpha^2 ||g||^2 ||phi||^2), ``grad_sq``, ``grad_abs``
            or ``random``.
        quota_rule: ``proportional`` or ``water_level``.
        selection: ``importance`` (default: unbiased sampling with 1/p rescaling) or
            ``topk`` (the paper's: deterministic best pairs). The default follows the
            gpu-small grid of docs/results.md, "Quality: from scratch" (3 seeds: +0.8 %
            perplexity at c = 0.3 against +16.5 % for top-k).
        seed: base seed of ``random`` and ``importance`` (each backward adds its step), an
            int in [0, 2^63); None: 0 for a layer, ``run.seed`` under ``lrmoe train``.
        selective_backward: False runs the plain exact backward without scoring or
            selection (requires c = 0); c = 0 with True is bit-identical to it.
        retained_mass_target: 0 (default) drops exactly c of the pairs. rho* in (0, 1]:
            the adaptive rate -- per layer and step, drop the largest share of the pairs,
            at most c (``recalibration_rate`` is then the cap), that keeps the retained
            score mass at or above rho* (:func:`lrmoe.moe.selection.adaptive_rate`). One
            host sync per layer backward (the kept count depends on the scores); one device
            only (under EP the quotas are fixed in the forward, before any score exists).
        offload: ``none`` (default) or ``activations``: the expert forward's saved rows
            (h, and the dispatched x under EP) wait for the backward in pinned host memory
            and only the kept rows come back (:mod:`lrmoe.moe.offload`); results unchanged.

    Not validated on construction (like the other sections of ``lrmoe train``):
    :class:`LRMoEConfig` and ``TrainConfig`` call :meth:`validate`.
    """

    recalibration_rate: float = _knob(
        0.0, "LRMoE recalibration rate c in [0, 1) (share of pairs whose expert backward is "
        "dropped)", flag="--recalibration-rate", short="-c", metavar="C")
    metric: str = _knob("lrm", "LRMoE pair score", flag="--metric", choices=METRICS)
    quota_rule: str = _knob("proportional", "LRMoE per-expert quota rule", flag="--quota-rule",
                            choices=QUOTA_RULES)
    selection: str = _knob("importance", "LRMoE pair selection", flag="--selection",
                           choices=SELECTIONS)
    seed: Optional[int] = _knob(None, "base seed of the random / importance selection "
                                "(None: run.seed)")
    selective_backward: bool = _knob(True, "False: the plain exact backward (needs c = 0)")
    retained_mass_target: float = _knob(
        0.0, "adaptive rate: per layer and step drop the most pairs (at most -c) that keep "
        "the retained score mass >= RHO", flag="--retained-mass-target", metavar="RHO")
    offload: str = _knob("none", "activations: keep the expert forward's saved rows in "
                         "pinned host memory, reload only the kept rows", flag="--offload",
                         choices=OFFLOAD_MODES)
    #: c as the exact fraction (p, q) of the quota arithmetic; derived by validate()
    rate_pq: Tuple[int, int] = field(init=False, repr=False, compare=False, default=(0, 1),
                                     metadata={"derived": True})

    @property
    def base_seed(self) -> int:
        """``seed``, with None read as 0."""
        return 0 if self.seed is None else self.seed

    def retained_pairs(self, num_pairs: int) -> int:
        """R = floor((1 - c) * num_pairs), exact (see :func:`lrmoe.ops.rate_fraction`)."""
        p, q = self.rate_pq
        return (q - p) * num_pairs // q

    def validate(self, where: str = "lrmoe") -> None:
        """Check every field (the one place each value is checked) and derive ``rate_pq``.

        Args:
            where: the prefix of the field names in the messages (``lrmoe`` for the
                ``lrmoe train`` section, ``LRMoEConfig`` for a layer's config).

        Raises:
            ValueError: ``<where>.<field>``, the value and what is accepted.
        """
        c = self.recalibration_rate
        if (isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c)
                or not 0.0 <= c < 1.0):
            raise ValueError(f"{where}.recalibration_rate must be in [0, 1), got {c!r} "
                             "(0.1, 0.2, 0.3 are the paper's C10, C20, C30)")
        p, q = rate_fraction(float(c))
        if p == q:
            raise ValueError(
                f"{where}.recalibration_rate={c!r} rounds to c = 1 (the quota arithmetic "
                "reads c as the nearest fraction with denominator <= 2**20): every pair "
                "would be dropped; choose c <= 1 - 2**-20")
        for name, allowed in (("metric", METRICS), ("quota_rule", QUOTA_RULES),
                              ("selection", SELECTIONS), ("offload", OFFLOAD_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{where}.{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.selective_backward, bool):
            raise ValueError(f"{where}.selective_backward must be true or false, got "
                             f"{self.selective_backward!r}")
        if not self.selective_backward and c != 0.0:
            raise ValueError(
                f"{where}.selective_backward=False runs the exact backward, but "
                f"{where}.recalibration_rate={c}; set recalibration_rate=0 or "
                "selective_backward=True")
        t = self.retained_mass_target
        if (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                or not 0.0 <= t <= 1.0):
            raise ValueError(f"{where}.retained_mass_target must be 0 (off) or in (0, 1], "
                             f"got {t!r}")
        if t > 0 and c == 0.0:
            raise ValueError(f"{where}.retained_mass_target > 0 needs {where}."
                             "recalibration_rate > 0 (it caps the adaptive rate); set "
                             "recalibration_rate to the most that may be dropped (e.g. -c 0.5)")
        seed = self.seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                                 or not 0 <= seed < SEED_LIMIT):
            raise ValueError(f"{where}.seed must be an int in [0, 2**63) or None, got "
                             f"{seed!r}")
        self.rate_pq = (p, q)

    def replace(self, **changes: Any) -> "BackwardConfig":
        """A validated copy with ``changes`` applied.

        Raises:
            ValueError: an unknown field (naming the accepted ones) or an invalid value.
        """
        check_backward_names(changes, "BackwardConfig.replace")
        out = dataclasses.replace(self, **changes)
        out.validate("BackwardConfig")
        return out


#: the planned-backward fields, in declaration order (``rate_pq`` is derived)
BACKWARD_FIELDS = tuple(f.name for f in dataclasses.fields(BackwardConfig) if f.init)


def check_backward_names(names: Any, where: str) -> None:
    """Raises ValueError naming ``where`` and the accepted fields on an unknown name."""
    unknown = [n for n in names if n not in BACKWARD_FIELDS]
    if unknown:
        raise ValueError(f"{where}: unknown planned-backward field(s) {unknown}; accepted: "
                         f"{', '.join(BACKWARD_FIELDS)}")


@dataclass
class LRMoEConfig:
    """Everything that defines one :class:`lrmoe.LRMoELayer`: the architecture and the
    planned backward (``backward``, a :class:`BackwardConfig`).

    ``LRMoEConfig(hidden_size=..., ..., backward=BackwardConfig(recalibration_rate=0.3))``,
    or with the backward fields as flat keywords (``LRMoEConfig(..., recalibration_rate=
    0.3)``); they are read as ``config.backward.<field>``.

    Architecture:
        hidden_size: H, model width.
        moe_intermediate_size: I, width of each SwiGLU expert.
        num_experts: E routed experts.
        top_k: K experts per token, ``1 <= K <= E``.
        router: ``softmax`` (Qwen3/Mixtral: softmax over E, top-K, optional
            renormalisation) or ``sigmoid`` (GLM-4.5/DeepSeek-V3: sigmoid scores, top-K of
            score + expert bias, weights from the unbiased scores).
        norm_topk_prob: renormalise the K selected weights to sum to 1.
        routed_scaling_factor: multiplies the routing weights (GLM-4.5 uses 1.0 to 2.5).
        shared_expert_intermediate_size: width of an always-on shared SwiGLU expert, 0 for
            none.
        shared_expert_gate: scale the shared expert by sigmoid(x w) (Qwen2-MoE style).
        router_aux_loss_coef: weight of the load-balancing loss in ``layer.aux_loss``.
        router_z_loss_coef: weight of the router z-loss in ``layer.aux_loss``.
        backward: the planned backward (:class:`BackwardConfig`; validated here, its
            messages name ``LRMoEConfig.<field>``).

    Raises:
        ValueError: naming the field and the accepted values, on any invalid setting, and
            when ``backward`` and flat backward keywords are both given.
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    router: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    router_aux_loss_coef: float = 1e-3
    router_z_loss_coef: float = 0.0
    backward: BackwardConfig = field(default_factory=BackwardConfig)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LRMoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"LRMoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                "choose 1 <= top_k <= num_experts")
        if self.router not in ROUTERS:
            raise ValueError(f"LRMoEConfig.router must be one of {', '.join(ROUTERS)}; got "
                             f"{self.router!r}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("LRMoEConfig.shared_expert_intermediate_size must be >= 0 "
                             f"(0 = no shared expert), got {self.shared_expert_intermediate_size}")
        if self.routed_scaling_factor <= 0 or not math.isfinite(self.routed_scaling_factor):
            raise ValueError("LRMoEConfig.routed_scaling_factor must be a positive finite "
                             f"float, got {self.routed_scaling_factor!r}")
        if not isinstance(self.backward, BackwardConfig):
            raise ValueError(f"LRMoEConfig.backward must be a BackwardConfig, got "
                             f"{type(self.backward).__name__}")
        # a copy: two layers built from one BackwardConfig must not share later changes
        self.backward = dataclasses.replace(self.backward)
        self.backward.validate("LRMoEConfig")

    def replace(self, **changes: Any) -> "LRMoEConfig":
        """A validated copy with ``changes`` applied: architecture fields, ``backward``, or
        backward fields as flat keywords (``config.replace(recalibration_rate=0.2)``)."""
        flat = {k: changes.pop(k) for k in list(changes) if k in BACKWARD_FIELDS}
        if flat:
            base = changes.pop("backward", self.backward)
            changes["backward"] = dataclasses.replace(base, **flat)
        return dataclasses.replace(self, **changes)


_dataclass_init = LRMoEConfig.__init__


def _init_with_flat_backward(self: LRMoEConfig, *args: Any, **kwargs: Any) -> None:
    # the flat keywords of earlier versions (LRMoEConfig(..., recalibration_rate=0.3)):
    # gathered into one BackwardConfig, so the fields stay declared once
    flat = {k: kwargs.pop(k) for k in list(kwargs) if k in BACKWARD_FIELDS}
    if flat:
        if kwargs.get("backward") is not None:
            raise ValueError(f"LRMoEConfig: got backward= and the backward field(s) "
                             f"{sorted(flat)} as keywords; put them in the BackwardConfig")
        kwargs["backward"] = BackwardConfig(**flat)
    _dataclass_init(self, *args, **kwargs)


_init_with_flat_backward.__doc__ = _dataclass_init.__doc__
LRMoEConfig.__init__ = _init_with_flat_backward  # type: ignore[method-assign]
