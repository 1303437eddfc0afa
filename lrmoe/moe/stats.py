"""What one MoE layer's planned backward did: :class:`BackwardStats` (pairs, kept rows,
buffer bytes, all-to-all bytes, offload traffic), the dropped fraction and the one load
imbalance function (:func:`max_over_mean`) that every report of the package uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Union

import numpy as np
from torch import Tensor

from lrmoe.moe.offload import OffloadStats


def dropped_fraction(num_retained: int, num_pairs: int) -> Optional[float]:
    """The dropped fraction 1 - R / P of routed pairs (docs/algorithm.md section 7).

    The one definition used by :meth:`BackwardStats.summary` and by model-level summaries
    (sum R and P over layers first, then divide). Returns None for P = 0.
    """
    return 1.0 - num_retained / num_pairs if num_pairs else None


@dataclass
class BackwardStats:
    """Per-step diagnostics of one layer, written by the forward and the backward.

    Tensors stay on the layer's device (reading them is the only sync); all are
    refreshed every step.

    Attributes:
        tokens_per_expert_E: (E,) int32 routed pairs n_e (forward).
        quota_E: (E,) int32 retention quotas Q_e (backward).
        retained_mass: () float32, sum of kept scores / sum of all scores (backward).
        num_pairs: P. num_retained: R (host ints).
        buffers: name -> shape of the backward's expert buffers (all sized by R).
        buffer_bytes: bytes of those buffers.
        kept_pair_R: (R,) int32 pair ids (t*K + k) whose expert backward ran (backward).
        kept_scale_R: (R,) float32 the scale each kept pair's expert gradient carries
            beside its routing weight: 1 under ``topk``, 1/p (the inverse inclusion
            probability) under ``importance``; None when selection is off (every scale
            1). With ``kept_pair_R`` it lets a caller check an expert gradient at c > 0.
        backward_steps: number of backwards run so far (also offsets the seed).
        a2a_bytes: expert parallel only (``lrmoe.parallel``): bytes this rank passed to
            each all-to-all (``forward_dispatch``, ``forward_combine`` incl. the fp32
            phi_sq side band, ``backward_grad``, ``backward_index``, ``backward_dx``).
        offload: :class:`lrmoe.moe.offload.OffloadStats` of the last step with
            ``offload = "activations"``, else None.
    """

    tokens_per_expert_E: Optional[Tensor] = None
    quota_E: Optional[Tensor] = None
    retained_mass: Optional[Tensor] = None
    num_pairs: int = 0
    num_retained: int = 0
    buffer_bytes: int = 0
    backward_steps: int = 0
    kept_pair_R: Optional[Tensor] = None
    kept_scale_R: Optional[Tensor] = None
    buffers: Dict[str, tuple] = field(default_factory=dict)
    #: expert parallel only: bytes this rank handed to each all-to-all of the last step
    a2a_bytes: Dict[str, int] = field(default_factory=dict)
    offload: Optional[OffloadStats] = None

    def record_buffers(self, buffers: Dict[str, Tensor]) -> None:
        """Keep the shapes and the total bytes of the backward's expert buffers."""
        self.buffers = {k: tuple(v.shape) for k, v in buffers.items()}
        self.buffer_bytes = sum(v.numel() * v.element_size() for v in buffers.values())

    def summary(self) -> Dict[str, object]:
        """Host-side numbers of the last step (synchronises with the device).

        Returns:
            dict with ``tokens_per_expert`` and ``quota`` (lists of int), ``dropped_fraction``
            (:func:`dropped_fraction`), ``retained_mass`` (float), ``load_max_over_mean_before``
            (max n_e / mean n_e), ``load_max_over_mean_after`` (max Q_e / mean Q_e),
            ``num_pairs``, ``num_retained`` and ``backward_buffer_bytes``. Backward entries
            are None before the first backward. With offload also ``offload_d2h_bytes``
            and ``offload_h2d_bytes`` (:class:`lrmoe.moe.offload.OffloadStats`).
        """
        out: Dict[str, object] = {"num_pairs": self.num_pairs}
        n = self.tokens_per_expert_E
        out["tokens_per_expert"] = None if n is None else n.tolist()
        out["load_max_over_mean_before"] = None if n is None else max_over_mean(n)
        q = self.quota_E
        out["quota"] = None if q is None else q.tolist()
        out["load_max_over_mean_after"] = None if q is None else max_over_mean(q)
        out["num_retained"] = self.num_retained if q is not None else None
        out["dropped_fraction"] = (dropped_fraction(self.num_retained, self.num_pairs)
                                   if q is not None else None)
        out["retained_mass"] = (None if self.retained_mass is None
                                else float(self.retained_mass))
        out["backward_buffer_bytes"] = self.buffer_bytes if q is not None else None
        if self.a2a_bytes:
            out["a2a_bytes"] = dict(self.a2a_bytes)
        if self.offload is not None:
            out["offload_d2h_bytes"] = self.offload.d2h_bytes
            out["offload_h2d_bytes"] = self.offload.h2d_bytes
        return out


def max_over_mean(values: Union[Sequence[float], np.ndarray, Tensor]) -> Optional[float]:
    """The load imbalance max / mean of non-negative per-expert or per-rank counts -- the
    one definition every report uses (expert loads here, rank rows in
    :mod:`lrmoe.parallel.replicas`, plans in :mod:`lrmoe.planner.report`, benchmark
    routings in :mod:`lrmoe.workload.routing`).

    Args:
        values: a 1-D sequence, array or tensor of counts (any numeric dtype).

    Returns:
        max / mean as a float (1.0 = perfectly balanced), or None when there is nothing to
        balance: no values, or a total <= 0 (all zero; the planner's -1 "undefined" rows).
    """
    if isinstance(values, Tensor):
        values = values.detach().double().cpu().numpy()
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    total = float(v.sum()) if v.size else 0.0
    if total <= 0:
        return None
    return float(v.max()) * v.size / total
