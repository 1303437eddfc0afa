"""The placement settings of an expert-parallel layer: which policy plans its experts'
instances (``fixed``, ``ultraep``, ``symi``, ``lrmoe``; docs/planner.md), under which
per-GPU memory budget, with how many spare slots. One frozen :class:`Placement` per
layer, the same on every rank; :mod:`lrmoe.parallel.replicas` executes it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lrmoe.planner.plan import DEFAULT_BALANCE_SLACK, POLICIES, parse_bytes

#: the budget when none is given: no memory limit (the plan then only balances)
UNLIMITED_BUDGET = 1 << 62


@dataclass(frozen=True)
class Placement:
    """The placement settings of an EP layer (the same on every rank; hashed into the
    config check of :mod:`lrmoe.parallel.group`).

    Attributes:
        policy: ``fixed``, ``ultraep``, ``symi`` or ``lrmoe`` (docs/planner.md).
        memory_budget: B, bytes per GPU the plan must fit (None: no limit).
        resident_bytes: bytes outside this layer's experts and token buffers
            (parameters, optimizer state, attention activations): measured
            (``torch.cuda.memory_allocated``, see :func:`measured_resident_bytes`) or given.
        replica_slots: R spare expert slots per rank (``ultraep`` needs R >= 1).
        symi_slots: S slots per GPU for ``symi`` (0: ceil(E / W) + R).
        max_expert_cut: ``lrmoe`` keeps at least floor((1 - this) n_e) of each expert.
        balance_slack: ``lrmoe``'s balance target, met with replicas
            (:data:`lrmoe.planner.plan.DEFAULT_BALANCE_SLACK`, 0: at most the mean retained
            rows per rank; None: memory only).
    """

    policy: str
    memory_budget: Optional[int] = None
    resident_bytes: int = 0
    replica_slots: int = 2
    symi_slots: int = 0
    max_expert_cut: float = 0.5
    balance_slack: Optional[float] = DEFAULT_BALANCE_SLACK

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)} (or None for the "
                             f"plain fixed-ownership path); got {self.policy!r}")
        for name in ("resident_bytes", "replica_slots", "symi_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Placement.{name} must be an int >= 0, got {value!r}")
        if self.memory_budget is not None and (not isinstance(self.memory_budget, int)
                                               or self.memory_budget <= self.resident_bytes):
            raise ValueError(f"Placement.memory_budget must be an int of bytes above "
                             f"resident_bytes={self.resident_bytes} (or None: no limit), got "
                             f"{self.memory_budget!r}")
        if self.policy == "ultraep" and self.replica_slots < 1:
            raise ValueError("policy 'ultraep' needs replica_slots >= 1 (its spare slots "
                             "per rank); pass replica_slots=2 (--replica-slots 2)")

    @classmethod
    def coerce(cls, policy: Any) -> Optional["Placement"]:
        """None -> None (today's fixed-ownership path, no planner), a policy name, a
        mapping of the fields, or a :class:`Placement`.

        Raises:
            TypeError: another type. ValueError: an invalid field (naming it).
        """
        if policy is None or isinstance(policy, Placement):
            return policy
        if isinstance(policy, str):
            return cls(policy)
        if isinstance(policy, dict):
            return cls(**policy)
        raise TypeError(f"policy must be None, a policy name ({', '.join(POLICIES)}), a dict "
                        f"of Placement fields or a Placement; got {type(policy).__name__}")

    @property
    def pushes_copies(self) -> bool:
        """Whether the policy keeps replica copies pushed after each optimizer step
        (``symi``: its placement depends only on the previous steps' popularity, so the
        copies can be sent before the forward that uses them) instead of fetching them
        in the forward (``ultraep``, ``lrmoe``) or having none (``fixed``)."""
        return self.policy == "symi"

    def summary(self) -> str:
        """The fields as text (for the cross-rank config check)."""
        return repr(dataclasses.astuple(self))


def placement_from_config(parallel: Any, resident_bytes: int = 0) -> Optional[Placement]:
    """The :class:`Placement` of ``lrmoe train``'s ``parallel`` section (fields
    ``policy``, ``memory_budget`` (int or size text), ``resident_bytes`` (None:
    ``resident_bytes`` given here stands in), ``replica_slots``); None without a policy.

    Raises:
        ValueError: an invalid value, naming the ``parallel.*`` field.
    """
    if parallel.policy is None:
        return None
    if parallel.policy not in POLICIES:
        raise ValueError(f"parallel.policy must be one of {', '.join(POLICIES)}; got "
                         f"{parallel.policy!r}")
    budget = (None if parallel.memory_budget is None
              else parse_bytes(parallel.memory_budget, "parallel.memory_budget"))
    resident = parallel.resident_bytes
    try:
        return Placement(parallel.policy, budget,
                         int(resident if resident is not None else resident_bytes),
                         int(parallel.replica_slots))
    except ValueError as err:
        raise ValueError(f"parallel: {err} (--memory-budget, --resident-bytes, "
                         "--replica-slots)") from None


def measured_resident_bytes(device: torch.device, group=None) -> int:
    """``torch.cuda.memory_allocated`` on ``device``, maximised over ``group`` (a
    collective when a group is given) so every rank plans with the same number; 0 on
    the CPU (give ``resident_bytes`` there)."""
    if device.type != "cuda":
        return 0
    got = torch.tensor([torch.cuda.memory_allocated(device)], dtype=torch.int64,
                       device=device)
    if group is not None:
        dist.all_reduce(got, op=dist.ReduceOp.MAX, group=group)
    return int(got.item())
