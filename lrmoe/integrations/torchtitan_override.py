"""LRMoE experts through torchtitan's own override mechanism (torchtitan 0.3.0).

Importing this module imports torchtitan (it registers an ``@override`` with
``torchtitan.config``); :mod:`lrmoe.integrations.torchtitan` is the torchtitan-free entry.

Activate it from a torchtitan run, with the :class:`LRMoETitanConfig` fields as kwargs::

    --override.imports 'lrmoe.integrations.torchtitan_override.lrmoe_moe={"recalibration_rate": 0.2}'

or ``OverrideConfig(imports=[("lrmoe.integrations.torchtitan_override.lrmoe_moe",
{"recalibration_rate": 0.2})])`` in a ``Trainer.Config``. Every ``MoE.Config`` of the model
config tree then builds its routed experts as :class:`LRMoETitanRoutedExperts` (a
``RoutedExperts`` subclass with lrmoe's forward, the same parameters and names), before the
model is built, so torchtitan's meta-device build, ``parallelize`` and checkpoints run as
usual. The k-th MoE config this process overrides gets the seed ``seed + k * 2**32``
(config traversal order = layer order; a second model built in the same process
continues the count).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from lrmoe.integrations.torchtitan import (LRMoERoutedExperts, LRMoETitanConfig, attach,
                                           require_torchtitan)

_moe = require_torchtitan("lrmoe.integrations.torchtitan_override")
from torchtitan.config import override  # noqa: E402

_LAYER_COUNT = itertools.count()


class LRMoETitanRoutedExperts(LRMoERoutedExperts, _moe.RoutedExperts):
    """torchtitan's ``RoutedExperts`` whose forward is lrmoe's
    (:class:`lrmoe.integrations.torchtitan.LRMoERoutedExperts`), built from its Config.

    Args:
        config: :class:`LRMoETitanRoutedExperts.Config`: ``RoutedExperts.Config`` plus
            ``lrmoe`` (:class:`LRMoETitanConfig`), ``layer_index`` and the router's
            ``top_k``, ``score_func``, ``route_norm``, ``route_scale``.

    Raises:
        ValueError: an invalid lrmoe setting (naming the field).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_moe.RoutedExperts.Config):
        lrmoe: LRMoETitanConfig = field(default_factory=LRMoETitanConfig)
        layer_index: int = 0
        top_k: int = 1
        score_func: str = "softmax"
        route_norm: bool = False
        route_scale: float = 1.0

    def __init__(self, config: "LRMoETitanRoutedExperts.Config"):
        super().__init__(config)
        attach(self, config, config.lrmoe, config.layer_index,
               f"torchtitan MoE layer {config.layer_index}")


@override(target=_moe.MoE.Config, exact=True,
          description="LRMoE routed experts: exact forward, planned backward")
def lrmoe_moe(cfg: "_moe.MoE.Config", **settings) -> "_moe.MoE.Config":
    """The ``MoE.Config`` with its routed experts built by LRMoE.

    Args:
        cfg: torchtitan's ``MoE.Config``.
        **settings: :class:`LRMoETitanConfig` fields (``recalibration_rate``, ...).

    Returns:
        A copy of ``cfg`` whose ``routed_experts`` is an
        :class:`LRMoETitanRoutedExperts.Config`; ``cfg`` itself when ``enabled`` is False.

    Raises:
        TypeError: an unknown setting. ValueError: an invalid value (naming the field).
        NotImplementedError: routed experts other than torchtitan's plain
            ``RoutedExperts`` + ``GroupedExperts`` configs.
    """
    titan = LRMoETitanConfig(**settings)
    index = next(_LAYER_COUNT)
    titan.backward_config(index)  # validate now, not at build time
    if not titan.enabled:
        return cfg
    routed = cfg.routed_experts
    if type(routed) is not _moe.RoutedExperts.Config or \
            type(routed.inner_experts) is not _moe.GroupedExperts.Config:
        raise NotImplementedError(
            f"lrmoe_moe: routed experts {type(routed).__qualname__} / "
            f"{type(routed.inner_experts).__qualname__}; LRMoE replaces only torchtitan's "
            "plain RoutedExperts + GroupedExperts")
    router = cfg.router
    base = {f.name: getattr(routed, f.name) for f in dataclasses.fields(routed) if f.init}
    new = LRMoETitanRoutedExperts.Config(
        **base, lrmoe=titan, layer_index=index, top_k=router.top_k, score_func=router.score_func,
        route_norm=router.route_norm, route_scale=router.route_scale)
    return dataclasses.replace(cfg, routed_experts=new)
