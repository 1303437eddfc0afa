"""The trainer's one door into :mod:`lrmoe.parallel`: a model's placement, driven from the
training loop through :class:`PlacementHooks`, and the data-parallel gradient work
before the optimizer step (:func:`reduce_and_clip_grads`).

:class:`PlacementHooks` gathers the placement state of a model's LRMoE layers (their
:class:`lrmoe.parallel.replicas.ReplicaState`, present under a placement policy) behind
five calls: the set-up with measured resident bytes (:meth:`~PlacementHooks.set_up`), the
replica push as an optimizer step hook (:meth:`~PlacementHooks.attach`), the checkpoint
state (:meth:`~PlacementHooks.state_dict`, :meth:`~PlacementHooks.load_state_dict`) and
the metrics (:meth:`~PlacementHooks.metrics`). Which layers push is the policy's
decision (:attr:`lrmoe.parallel.placement.Placement.pushes_copies`); the caller never
names a policy.

The push: a policy that keeps pushed replica copies (``symi``) must send the owners'
weights after every optimizer step that changed them and before the next forward, or the
next forward finds the copies stale (the owner's tensor versions moved) and fetches them
itself (exact, but it moves the weights in the forward). :meth:`PlacementHooks.attach`
registers that push with ``torch.optim.Optimizer.register_step_post_hook``, so it runs
inside every ``optimizer.step()`` -- the trainer's and that of a loop you write
yourself::

    hooks = PlacementHooks(model)      # or {name: layer} of the patched layers
    hooks.attach(optimizer)            # once, on the optimizer that updates the experts
    for batch in batches:
        loss(model, batch).backward()
        optimizer.step()               # the hook pushes here (a collective on EP ranks)
        optimizer.zero_grad()

A step that is skipped (e.g. a grad scaler's inf step) changes no weights and pushes
nothing; the copies stay valid. Every rank of an EP group must attach the same way: the
push is a collective over each layer's group, run in the same layer order on every rank.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lrmoe.parallel.data_parallel import DataParallel, clip_grad_norm_
from lrmoe.parallel.placement import measured_resident_bytes, placement_from_config
from lrmoe.parallel.replicas import ReplicaState

__all__ = ["PlacementHooks", "placement_from_config", "placement_metrics",
           "push_replica_weights", "reduce_and_clip_grads", "DataParallel"]

Layers = Union[nn.Module, Mapping[str, nn.Module]]


def _states(layers: Layers) -> Iterator[Tuple[str, nn.Module, ReplicaState]]:
    items = layers.items() if isinstance(layers, Mapping) else layers.named_modules()
    for name, module in items:
        state = getattr(getattr(module, "core", None), "replicas", None)
        if isinstance(state, ReplicaState):
            yield name, module, state


class PlacementHooks:
    """The placement state of a model's LRMoE layers, driven from the training loop.

    Args:
        layers: the model (every LRMoE layer in it, in module order) or a mapping
            ``{name: layer}`` (e.g. what ``patch_moe_blocks`` returned); the names key
            :meth:`state_dict`. Layers without a placement policy are left alone.

    Attributes:
        active: whether any layer has a placement policy (False: every call is a no-op,
            :meth:`state_dict` is empty, :meth:`metrics` too).
    """

    def __init__(self, layers: Layers) -> None:
        self._layers = list(_states(layers))
        self.active = bool(self._layers)
        self._handle: Optional[RemovableHandle] = None

    def set_up(self, parallel: Any, device: torch.device, group=None) -> None:
        """Give every layer the placement of ``lrmoe train``'s ``parallel`` section with
        resident bytes measured now (:func:`lrmoe.parallel.placement.measured_resident_bytes`,
        maximised over ``group``: a collective on CUDA) when the section leaves them to be
        measured (``parallel.resident_bytes`` None). Call it on every rank after the model
        is on ``device`` and before the optimizer exists. A no-op when not :attr:`active`.

        Raises:
            ValueError: an invalid ``parallel.*`` value, naming the field.
        """
        if not self.active or parallel.resident_bytes is not None:
            return
        placement = placement_from_config(parallel, measured_resident_bytes(device, group))
        for _, module, state in self._layers:
            state.set_placement(placement, module.config)

    # ---------------------------------------------------------------- the push
    def push(self) -> int:
        """Push replica weights now on every layer whose policy keeps pushed copies
        (:meth:`lrmoe.parallel.replicas.ReplicaState.push`: fixes the next steps'
        placement from the loads since the last push, then sends the owners' current
        weights). A collective over each such layer's EP group; :meth:`attach` calls it
        after every optimizer step.

        Returns:
            Bytes this rank sent, summed over the layers (0 when none pushes).
        """
        return sum(state.push(module.config, module.core.ep_group)
                   for _, module, state in self._layers)

    def attach(self, optimizer: torch.optim.Optimizer) -> Optional[RemovableHandle]:
        """Register :meth:`push` as a step post-hook of ``optimizer``
        (``register_step_post_hook``) when some layer's policy keeps pushed copies; call
        once, with the optimizer that updates the expert weights.

        Returns:
            The hook's handle (``handle.remove()`` or :meth:`detach` undoes it), or None
            when no layer pushes (nothing registered).

        Raises:
            RuntimeError: already attached (call :meth:`detach` first).
            ValueError: ``optimizer`` does not hold the expert weights of a pushing layer
                (its pushes would never follow their updates).
        """
        if self._handle is not None:
            raise RuntimeError("PlacementHooks.attach: already attached to an optimizer; "
                               "call detach() first (a second hook would push twice a step)")
        pushing = [(n, m) for n, m, s in self._layers if s.placement.pushes_copies]
        if not pushing:
            return None
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, module in pushing:
            if id(module.experts.gate_up_proj) not in held:
                raise ValueError(f"PlacementHooks.attach: the optimizer does not update the "
                                 f"expert weights of layer {name!r}; attach the optimizer "
                                 "built over the model's parameters (after patching and "
                                 "expert sharding)")

        def after_step(opt, args, kwargs) -> None:
            self.push()

        self._handle = optimizer.register_step_post_hook(after_step)
        return self._handle

    def detach(self) -> None:
        """Remove the hook :meth:`attach` registered (nothing when none)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # ---------------------------------------------------------- checkpoints, metrics
    def state_dict(self) -> Dict[str, Dict[str, object]]:
        """What a checkpoint keeps of each layer's placement, ``{name: {"popularity":
        list of E ints or None, "loads_since_push": list of E ints or None}}`` (the
        loads symi plans from), so a resumed run plans as the straight one; empty when
        not :attr:`active`. The pushed copies are not kept: the first forward after a
        resume fetches them."""
        return {name: {"popularity": state.popularity_E,
                       "loads_since_push": state._loads_since_push}
                for name, _, state in self._layers}

    def load_state_dict(self, saved: Mapping[str, Mapping[str, object]]) -> None:
        """Restore :meth:`state_dict`; layers missing from ``saved`` keep theirs.

        Raises:
            KeyError: an entry of ``saved`` without ``popularity`` or
                ``loads_since_push``.
        """
        for name, _, state in self._layers:
            if name in saved:
                state.popularity_E = saved[name]["popularity"]
                state._loads_since_push = saved[name]["loads_since_push"]

    def metrics(self) -> Dict[str, object]:
        """The last step's replica numbers for metrics.jsonl (empty when not
        :attr:`active`): ``placement_policy``, ``replicas`` (summed over layers), the
        three ``rank_load_max_over_mean_*`` (means over the layers that have one), the
        ``replica_bytes_*`` this rank sent (sums) and ``plan_feasible`` (all layers)."""
        rows = [state.stats.summary() for _, _, state in self._layers]
        if not rows:
            return {}

        def mean(key):
            vals = [r[key] for r in rows if r[key] is not None]
            return sum(vals) / len(vals) if vals else None

        out: Dict[str, object] = {"placement_policy": rows[0]["placement_policy"],
                                  "replicas": sum(r["replicas"] for r in rows),
                                  "plan_feasible": all(r["plan_feasible"] for r in rows)}
        for key in ("rank_load_max_over_mean_before", "rank_load_max_over_mean_forward",
                    "rank_load_max_over_mean_backward"):
            out[key] = mean(key)
        for key in ("replica_bytes_fetched", "replica_bytes_pushed", "replica_bytes_reduced"):
            out[key] = sum(r[key] for r in rows)
        return out


def push_replica_weights(model: Layers) -> int:
    """:meth:`PlacementHooks.push` for the LRMoE layers of ``model`` (a module or
    ``{name: layer}``), for a loop that pushes by hand instead of :meth:`~PlacementHooks.attach`:
    call it after ``optimizer.step()`` and before the next forward, on every rank. Returns
    the bytes this rank sent."""
    return PlacementHooks(model).push()


def placement_metrics(model: Layers) -> Dict[str, object]:
    """:meth:`PlacementHooks.metrics` of the LRMoE layers of ``model``."""
    return PlacementHooks(model).metrics()


def reduce_and_clip_grads(model: nn.Module, max_norm: float, data_parallel: DataParallel,
                          ep_group=None) -> Tensor:
    """Before the optimizer step of a multi-rank run whose loss is the mean of the ranks'
    losses: the end of the data-parallel gradient sync (:meth:`lrmoe.parallel.
    data_parallel.DataParallel.finish`: DDP has averaged the non-expert gradients during
    the backward; the experts' dp sums are waited for and scaled), then the clip to the
    global norm ``max_norm`` (expert shards' squares summed over ``ep_group``;
    :func:`lrmoe.parallel.data_parallel.clip_grad_norm_`). Collectives, every rank.

    Returns:
        () tensor: the global gradient norm before clipping.
    """
    data_parallel.finish()
    return clip_grad_norm_(model, max_norm, ep_group)
