"""One method ``lrmoe bench layer`` times (:class:`Method`) and the agreement tolerances.

The registry of methods and their builders is :mod:`lrmoe.bench.methods`; this module
holds only what every builder needs, the torchtitan baseline's
(:mod:`lrmoe.bench.baselines.torchtitan_moe`) included.

Legend: T tokens, H hidden, K top_k.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from lrmoe.layer import LRMoELayer

#: agreement tolerances, relative Frobenius error. float32: the same function summed in
#: other orders agrees to a few float32 roundings. bf16: an 8-bit mantissa (relative
#: rounding 2^-9 per value), a few roundings accumulated through two GEMMs.
FP32_TOL = 1e-4
BF16_TOL = 3e-2


def label(method: str, rate: Optional[float], policy: Optional[str] = None) -> str:
    """Display name of a method: ``lrmoe c=0.2`` for LRMoE at rate 0.2, ``lrmoe ultraep
    c=0.2`` under a placement policy, else the name."""
    name = method if policy is None else f"{method} {policy}"
    return f"{name} c={rate:g}" if rate is not None else name


@dataclasses.dataclass(eq=False)
class Method:
    """A forward callable over (x_TH, ids_TK) with shared parameters; backward via
    autograd.

    Attributes:
        method: ``lrmoe``, ``dropless``, ``transformers`` or ``torchtitan``.
        rate: the LRMoE recalibration rate c; None for the baselines.
        forward: (x (T, H), expert ids (T, K) int64) -> (T, H) output.
        params: the parameters whose gradients one step fills (cleared between steps).
        reference: the LRMoE layer holding the shared weights (the agreement check runs
            it at c = 0); for an ``lrmoe`` method without a policy also the layer it times.
        tolerance: the agreement tolerance (relative Frobenius error): 0 for ``lrmoe``
            without a policy (it is the reference), the dtype's for a policy's layer.
        a2a_source: expert parallel dropless only: the dict its forward fills with the
            bytes sent into each all-to-all.
        module: a baseline's own module (transformers' block, torchtitan's MoE), for
            inspection; None otherwise.
        timed: the layer a policy's method times (built with that policy over the same
            seeded weights as ``reference``); None: it times ``reference``.
    """

    method: str
    rate: Optional[float]
    forward: Callable[[Tensor, Tensor], Tensor]
    params: List[Tensor]
    reference: LRMoELayer
    tolerance: float = 0.0
    a2a_source: Optional[Dict[str, int]] = None
    module: Optional[torch.nn.Module] = None
    timed: Optional[LRMoELayer] = None

    @property
    def policy(self) -> Optional[str]:
        """The placement policy of the layer this method times (``fixed``, ``ultraep``,
        ``symi``, ``lrmoe``); None: a baseline, or fixed ownership without the planner."""
        layer = self.layer
        replicas = None if layer is None else layer.core.replicas
        return None if replicas is None else replicas.placement.policy

    @property
    def label(self) -> str:
        """Display name (:func:`label`)."""
        return label(self.method, self.rate, self.policy)

    @property
    def layer(self) -> Optional[LRMoELayer]:
        """The LRMoE layer this method times (None for a baseline): ``timed`` where it is
        not the reference (a placement policy's layer), else the reference."""
        if self.method != "lrmoe":
            return None
        return self.timed if self.timed is not None else self.reference

    @property
    def a2a_bytes(self) -> Dict[str, int]:
        """Expert parallel only: all-to-all bytes of the last step (``lrmoe.parallel``
        keys), refreshed by every forward/backward; empty on one device."""
        if self.layer is not None:
            return dict(self.layer.stats.a2a_bytes or {})
        return dict(self.a2a_source or {})


def tolerance(dtype: torch.dtype) -> float:
    """Agreement tolerance of a method computing in ``dtype``."""
    return FP32_TOL if dtype in (torch.float32, torch.float64) else BF16_TOL
