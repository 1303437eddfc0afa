"""The profiler's phase names, in one place: every ``lrmoe.*`` range the layer, the
expert-parallel path and the baselines open (:func:`phase`), and the ranges around a whole
forward and backward that the benchmark's profile reads (:mod:`lrmoe.bench.profile`,
:mod:`lrmoe.bench.timing`). A phase's device time is the ``phases_ms`` of ``lrmoe bench
layer`` and of the cost files ``lrmoe calibrate`` writes (:mod:`lrmoe.sim.costs`).
"""
from __future__ import annotations

from torch.profiler import record_function

#: the host ranges around one whole forward / backward of a profiled step
FWD_RANGE, BWD_RANGE = "lrmoe:forward", "lrmoe:backward"
#: the forward's phases on one device, in data-flow order
PHASES_FWD = ("router", "permute", "expert_gemm_fwd", "combine")
#: the planned backward's phases on one device (docs/algorithm.md sections 2-6)
PHASES_BWD = ("router_grad", "score", "select", "compact", "expert_gemm_bwd", "scatter")
#: the expert-parallel collectives (:mod:`lrmoe.parallel.dispatch`)
A2A_PHASES = ("a2a_counts", "a2a_dispatch", "a2a_combine", "a2a_grad", "a2a_dx")
#: planning and replica traffic of a placement policy (:mod:`lrmoe.parallel.replicas`)
PLACEMENT_PHASES = ("plan", "replica_fetch", "replica_push", "replica_grads")
PREFIX = "lrmoe."
NAMES = frozenset(PHASES_FWD + PHASES_BWD + A2A_PHASES + PLACEMENT_PHASES)


def phase(name: str) -> record_function:
    """A ``torch.profiler.record_function`` range named ``lrmoe.<name>``.

    Args:
        name: one of :data:`NAMES` (without the ``lrmoe.`` prefix).

    Raises:
        ValueError: an unknown name (a typo would silently leave its time unattributed).
    """
    if name not in NAMES:
        raise ValueError(f"unknown profiler phase {name!r}; add it to lrmoe/utils/phases.py "
                         f"(known: {sorted(NAMES)})")
    return record_function(PREFIX + name)
