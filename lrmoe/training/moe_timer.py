"""Time spent in the MoE layers: forward + backward of every MoE layer, per training step.

The paper's time-to-loss metric counts MoE-layer execution only (docs/journal/experiments.md, "Protocol").
:class:`MoELayerTimer` hooks every MoE layer of a model (``lrmoe.integrations.
transformers.moe_layers``): a forward pre-hook and a forward hook bracket its forward, a
full backward pre-hook and a full backward hook bracket its backward (from the gradient at
its output to the gradients at its inputs: router, experts and shared expert). On CUDA
each bracket is a pair of ``torch.cuda.Event`` s on the current stream (no sync while the
step runs; :meth:`MoELayerTimer.step_ms` waits for the last one, and the trainer
reads them a step later through :meth:`MoELayerTimer.take`); on the CPU it is
``time.perf_counter`` (the CPU ops are synchronous). Only brackets opened while the timer
is :meth:`~MoELayerTimer.armed` count, so evaluation forwards do not.

Caveat: a layer whose inputs need no gradient has no backward bracket (its backward hook
never fires); with activation checkpointing the recomputed forward counts as forward time.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lrmoe.utils.clock import DeviceClock


class MoELayerTimer:
    """Accumulates the MoE layers' forward and backward time of each training step.

    Args:
        model: the patched model (its MoE layers are found with ``moe_layers``).
        device: the model's device (CUDA events there, host clock elsewhere).
        layers: the modules to bracket instead (any ``nn.Module`` whose forward takes
            tensors, e.g. torchtitan's ``MoE`` blocks); None finds lrmoe's MoE layers.

    Raises:
        ValueError: the model has no MoE layer (or ``layers`` is empty).

    Use::

        timer = MoELayerTimer(model, device)
        with timer.armed():
            ...forward and backward of one step...
        ms = timer.step_ms()   # {"moe_time_ms", "moe_forward_ms", "moe_backward_ms"}
    """

    def __init__(self, model: nn.Module, device: torch.device,
                 layers: Optional[Sequence[nn.Module]] = None) -> None:
        if layers is None:
            from lrmoe.integrations.transformers import moe_layers

            layers = [m for _, m in moe_layers(model)]
        layers = list(layers)
        if not layers:
            raise ValueError("run.time_moe needs a model with MoE layers; this one has none")
        self.clock = DeviceClock(device)
        self._armed = False
        self._open: dict = {}
        self._spans: List[Tuple[str, object, object]] = []
        self._handles = []
        for layer in layers:
            self._handles += [
                layer.register_forward_pre_hook(lambda m, a: self._start(m, "forward")),
                layer.register_forward_hook(lambda m, a, o: self._stop(m, "forward")),
                layer.register_full_backward_pre_hook(
                    lambda m, g: self._start(m, "backward")),
                layer.register_full_backward_hook(lambda m, gi, go: self._stop(m, "backward")),
            ]

    def _start(self, module: nn.Module, kind: str) -> None:
        if self._armed:
            self._open[(id(module), kind)] = self.clock.event()

    def _stop(self, module: nn.Module, kind: str) -> None:
        start = self._open.pop((id(module), kind), None)
        if start is not None:
            self._spans.append((kind, start, self.clock.event()))

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Count the brackets opened inside this block (one training step)."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def step_ms(self) -> dict:
        """The step's totals in milliseconds (waits for the last CUDA event) and resets:
        :meth:`spans_ms` of :meth:`take`.

        Returns:
            ``{"moe_time_ms", "moe_forward_ms", "moe_backward_ms"}`` (floats).
        """
        return self.spans_ms(self.take())

    def take(self) -> list:
        """The step's spans, without reading them (no sync), and a reset: the loop reads
        them a step later (:mod:`lrmoe.training.readout`)."""
        spans, self._spans, self._open = self._spans, [], {}
        return spans

    def spans_ms(self, spans: list) -> dict:
        """Totals of spans from :meth:`take` in milliseconds (waits for the last CUDA
        event): ``{"moe_time_ms", "moe_forward_ms", "moe_backward_ms"}``."""
        if spans and self.clock.cuda:
            spans[-1][2].synchronize()
        fwd = sum(self.clock.ms(a, b) for k, a, b in spans if k == "forward")
        bwd = sum(self.clock.ms(a, b) for k, a, b in spans if k == "backward")
        return {"moe_time_ms": fwd + bwd, "moe_forward_ms": fwd, "moe_backward_ms": bwd}

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def make_timer(enabled: bool, model: nn.Module, device: torch.device
               ) -> Optional[MoELayerTimer]:
    """A :class:`MoELayerTimer` when ``enabled`` (``run.time_moe``), else None."""
    return MoELayerTimer(model, device) if enabled else None
