"""A training step's numbers read one step late, so that the host never waits for the GPU
at the end of a step (issue 28: "no per-step host syncs in logging or diagnostics").

Reading a CUDA tensor on the host (``float(t)``, ``t.tolist()``) waits for every kernel
queued before it. The loop used to do that at the end of every step (the loss, the
gradient norm, the MoE layers' diagnostics), so the GPU sat idle while the host wrote the
metrics and began the next step. Now the end of step N only queues non-blocking copies
of those numbers into pinned host memory and records an event
(:meth:`StepReadout.stage`); they are read after step N + 1 has been queued
(:meth:`StepReadout.push`), when the event has long passed, or at once where the loop
must know them before going on (:meth:`StepReadout.flush`: before an evaluation, a
checkpoint and at the end of the run, so a non-finite loss is caught before it is saved).

Step time: on CUDA the time from the previous step's end event to this step's (the GPU's
period, including any idle gap the host leaves), or from this step's start event where
the previous step is not the one just before it in the loop (the run's first step, and
after an evaluation or a checkpoint, whose GPU work must not count). Elsewhere the same
stamps on the host clock (the CPU ops run synchronously).

Where the numbers cannot wait (expert parallelism's step totals all-reduce, replica
placement's statistics) they are read when staged, as before; the record still comes
out one step late.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from lrmoe.utils.clock import DeviceClock


def to_host(t: Optional[Tensor]) -> Optional[Tensor]:
    """A host copy of ``t`` that does not wait for the device: CUDA tensors are copied
    non-blocking into pinned memory (valid once an event recorded after this call has
    passed), CPU tensors are cloned (the next step may write into them). None stays None.
    """
    if t is None:
        return None
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t.detach(), non_blocking=True)
    return t.detach().clone()


def snapshot_diagnostics(model: nn.Module) -> Optional[Callable[[], Dict[str, Dict[str, Any]]]]:
    """Stage the MoE layers' diagnostics of the step just queued.

    Returns:
        a function that, once the copies are done, returns what
        ``lrmoe.integrations.transformers.collect_diagnostics(model)`` would have returned
        now, without a device sync (:meth:`lrmoe.moe.stats.BackwardStats.summary` of a copy
        whose tensors are :func:`to_host` copies); None where a layer places replicas (its
        :class:`lrmoe.parallel.replicas.ReplicaStats` is read at once: call
        ``collect_diagnostics`` then).
    """
    from lrmoe.integrations.transformers import moe_layers

    staged: List[Tuple[str, Any]] = []
    for name, layer in moe_layers(model):
        core = getattr(layer, "core", None)
        if getattr(core, "replicas", None) is not None or not hasattr(layer, "stats"):
            return None
        st = layer.stats
        staged.append((name, dataclasses.replace(
            st, tokens_per_expert_E=to_host(st.tokens_per_expert_E),
            quota_E=to_host(st.quota_E), retained_mass=to_host(st.retained_mass),
            # the pair ids are not part of the summary: not copied
            kept_pair_R=None, kept_scale_R=None, buffers=dict(st.buffers),
            a2a_bytes=dict(st.a2a_bytes),
            offload=None if st.offload is None else dataclasses.replace(st.offload))))
    return lambda: {name: st.summary() for name, st in staged}


@dataclasses.dataclass
class PendingStep:
    """One staged step (:meth:`StepReadout.stage`).

    Attributes:
        record: the host-known entries of the step's metrics record (step, tokens, lr...).
        scalars_3: (3,) float32 host copy of (summed NLL, summed aux loss or NaN, gradient
            norm), valid once ``end`` has passed.
        denom: the NLL's divisor (loss tokens). aux_div: the aux loss's (micro-batches).
        has_aux: the model has an aux loss.
        start, end: the step's stamps (:class:`lrmoe.utils.clock.DeviceClock`).
        since: the previous step's end stamp when it ran just before this one, else None.
        moe_spans: the MoE layer timer's spans (:meth:`MoELayerTimer.take`), or None.
        diagnostics: None (not a logged step), a dict (read when staged) or a function
            (:func:`snapshot_diagnostics`).
        extra: entries read when staged (placement metrics).
    """

    record: Dict[str, Any]
    scalars_3: Tensor
    denom: int
    aux_div: int
    has_aux: bool
    start: Any
    end: Any
    since: Any = None
    moe_spans: Optional[list] = None
    diagnostics: Any = None
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)


class StepReadout:
    """Stages each step's device numbers and hands back the finished record of the step
    before (see the module docstring).

    Args:
        device: the training device (CUDA: events and pinned copies; else the host clock).
        moe_timer: the loop's :class:`lrmoe.training.moe_timer.MoELayerTimer`, or None.
        means: ``diagnostics -> dict`` of the logged means (the loop's
            :func:`lrmoe.training.metrics.diagnostics_means_of`).

    Use::

        start = readout.clock.event()
        ...queue the step...
        done = readout.push(readout.stage(start, record, nll, aux, grad_norm, ...))
        if done is not None: write(done)          # the step before, finished
        ...
        done = readout.flush()                     # before an evaluation / a save / the end
    """

    def __init__(self, device: torch.device, moe_timer: Any = None,
                 means: Optional[Callable[[Dict[str, Dict[str, Any]]], Dict[str, Any]]] = None
                 ) -> None:
        self.clock = DeviceClock(device)
        self.moe_timer = moe_timer
        self.means = means
        self._pending: Optional[PendingStep] = None
        self._last_end: Any = None

    def stage(self, start: Any, record: Dict[str, Any], nll_total: Tensor,
              aux_total: Optional[Tensor], grad_norm: Any, denom: int, aux_div: int,
              diagnostics: Any = None, extra: Optional[Dict[str, Any]] = None
              ) -> PendingStep:
        """Queue the host copies of a step just queued and stamp its end.

        Args:
            start: the stamp taken before the step's first kernel (``self.clock.event()``).
            record: its host-known metrics entries. nll_total: () summed token NLL.
            aux_total: () summed aux loss or None. grad_norm: () tensor or float, the
                pre-clip gradient norm. denom: loss tokens. aux_div: micro-batches.
            diagnostics, extra: see :class:`PendingStep`.
        """
        dev = nll_total.device

        def scalar(v: Any) -> Tensor:
            # a host number becomes a fill kernel: torch.as_tensor(float, device=cuda)
            # would copy from pageable memory, which waits for the whole stream
            if isinstance(v, Tensor):
                return v.detach().float().reshape(())
            return torch.full((), float("nan") if v is None else float(v),
                              dtype=torch.float32, device=dev)

        parts = [scalar(nll_total), scalar(aux_total), scalar(grad_norm)]
        scalars_3 = to_host(torch.stack(parts))
        spans = self.moe_timer.take() if self.moe_timer is not None else None
        end = self.clock.event()
        step = PendingStep(record=record, scalars_3=scalars_3, denom=max(int(denom), 1),
                           aux_div=max(int(aux_div), 1), has_aux=aux_total is not None,
                           start=start, end=end, since=self._last_end, moe_spans=spans,
                           diagnostics=diagnostics, extra=dict(extra or {}))
        self._last_end = end
        return step

    def push(self, step: PendingStep) -> Optional[Dict[str, Any]]:
        """Keep ``step`` and return the finished record of the one kept before (None for
        the first). Waits only for that earlier step's end."""
        done, self._pending = self._pending, step
        return None if done is None else self._finish(done)

    def flush(self, gap: bool = False) -> Optional[Dict[str, Any]]:
        """The kept step's finished record now (waits for its end); None when none is kept.
        ``gap``: GPU work that is not a training step follows (an evaluation, a save), so
        the next step's time starts at its own start stamp."""
        done, self._pending = self._pending, None
        if gap:
            self._last_end = None
        return None if done is None else self._finish(done)

    def _finish(self, p: PendingStep) -> Dict[str, Any]:
        self.clock.wait(p.end)
        nll, aux, grad_norm = (float(v) for v in p.scalars_3.tolist())
        loss = nll / p.denom
        dt = self.clock.ms(p.since if p.since is not None else p.start, p.end) / 1e3
        rec = dict(p.record)
        rec.update({"loss": loss, "ppl": math.exp(min(loss, 700.0)) if math.isfinite(loss)
                    else float("nan"),
                    "aux_loss": aux / p.aux_div if p.has_aux else None,
                    "grad_norm": grad_norm, "tokens_per_s": rec["tokens"] / dt if dt > 0 else None, "time_s": dt})
        if p.moe_spans is not None:
            rec.update(self.moe_timer.spans_ms(p.moe_spans))
        if p.diagnostics is not None and self.means is not None:
            diag = p.diagnostics() if callable(p.diagnostics) else p.diagnostics
            rec.update(self.means(diag))
        rec.update(p.extra)
        return rec
