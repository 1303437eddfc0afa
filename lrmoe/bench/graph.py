"""CUDA-graph replay of the single-device LRMoE layer (``lrmoe bench layer --cuda-graph``).

The layer never synchronises the host with the device and every shape in it is fixed by
T alone (P = T K, R = floor((1 - c) P), grouped-GEMM offsets on the device), so one
forward and one backward can each be captured once and replayed on new inputs copied
into static buffers. What this removes is the host side: kernel launches, Python, the
autograd engine; what is left in the replay is device time and the gaps between kernels
on the device itself.

Forward and backward are two ``torch.cuda.CUDAGraph`` sharing one memory pool (the
pattern of ``torch.cuda.make_graphed_callables``), so each can be timed alone. The
parameter gradients and the input gradient are the tensors the backward capture
allocated: every replay overwrites them (no accumulation across replays).

Benchmark only, not a layer option: a replay repeats the host-side values of the capture
step -- the seed of the ``random`` metric and of ``importance`` sampling (it advances per
backward in the eager layer), ``BackwardStats.backward_steps`` and the adaptive rate (a
host decision per step) -- so :func:`check_capturable` refuses those.

Legend: T tokens, H hidden, K top_k.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lrmoe.moe.config import LRMoEConfig


def check_capturable(config: LRMoEConfig) -> None:
    """Raise ValueError when a captured step would not replay the layer's step.

    Raises:
        ValueError: ``metric="random"`` or ``selection="importance"`` (their seed advances
            every backward; a replay would reuse the capture's), or
            ``retained_mass_target > 0`` (the adaptive rate decides R on the host from
            each step's scores: one host sync, which capture forbids).
    """
    if not config.backward.selective_backward:
        return
    if config.backward.metric == "random" or config.backward.selection == "importance":
        raise ValueError("--cuda-graph: metric 'random' and selection 'importance' draw "
                         "with a seed that advances every backward, but a graph replays "
                         "the seed of its capture; use metric lrm/grad_sq/grad_abs with "
                         "selection topk, or time without --cuda-graph")
    if config.backward.retained_mass_target > 0:
        raise ValueError("--cuda-graph: retained_mass_target (the adaptive rate) chooses R "
                         "on the host every step (one sync), which a CUDA graph cannot "
                         "hold; use a fixed recalibration_rate")


class GraphedStep:
    """One forward and one backward captured as CUDA graphs.

    Args:
        forward: (x (T, H), expert ids (T, K) int64) -> (T, H) output, e.g. a
            :class:`lrmoe.bench.method.Method`'s ``forward``.
        params: the parameters whose gradients the backward fills.
        x_TH, ids_TK, g_TH: CUDA example input, routing and output gradient; copied into
            the static buffers (their values are the first replay's inputs).
        warmup: eager steps run on a side stream before the capture (lazy
            initialisation: cuBLAS handles, workspaces), as the CUDA-graph notes of
            torch ask.

    Raises:
        ValueError: ``x_TH`` not on a CUDA device.

    Attributes:
        x_TH, ids_TK, g_TH: the static inputs (copy new values in, then replay).
        out_TH: the static output. dx_TH: the static input gradient. grads: the static
            parameter gradients, one per ``params`` entry (None where none flows).
    """

    def __init__(self, forward: Callable[[Tensor, Tensor], Tensor], params: Sequence[Tensor],
                 x_TH: Tensor, ids_TK: Tensor, g_TH: Tensor, warmup: int = 3,
                 capture: bool = True) -> None:
        if x_TH.device.type != "cuda":
            raise ValueError(f"--cuda-graph needs a CUDA device, the input is on {x_TH.device}")
        self.forward, self.params = forward, list(params)
        self.x_TH = x_TH.detach().clone().requires_grad_()
        self.ids_TK, self.g_TH = ids_TK.clone(), g_TH.detach().clone()
        self.fwd_graph = self.bwd_graph = self.out_TH = self.dx_TH = None
        self.grads: List[Optional[Tensor]] = []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._clear_grads()
                forward(self.x_TH, self.ids_TK).backward(self.g_TH)
        torch.cuda.current_stream().wait_stream(side)
        if capture:
            self.capture()

    def capture(self) -> None:
        """Capture the forward and the backward graphs (the constructor does, unless
        ``capture=False``: then call this, e.g. inside a profiler session so that the
        profiler sees the kernels of later replays)."""
        # the backward capture must allocate the gradients (AccumulateGrad assigns into
        # an empty .grad); an existing .grad would be accumulated into on every replay
        self._clear_grads()
        self.fwd_graph, self.bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: in the default "global" mode an unsafe CUDA call from any other
        # thread (the profiler's, after a profiled step) invalidates the capture; on the
        # H200 the bench's captures failed that way after its profiled eager rows, while
        # a capture with no profiler before it worked (docs/journal/performance.md, session 5)
        with torch.cuda.graph(self.fwd_graph, capture_error_mode="thread_local"):
            self.out_TH = self.forward(self.x_TH, self.ids_TK)
        with torch.cuda.graph(self.bwd_graph, pool=self.fwd_graph.pool(),
                              capture_error_mode="thread_local"):
            self.out_TH.backward(self.g_TH)
        self.dx_TH = self.x_TH.grad
        self.grads = [p.grad for p in self.params]

    def _clear_grads(self) -> None:
        self.x_TH.grad = None
        for p in self.params:
            p.grad = None

    def load(self, x_TH: Tensor, ids_TK: Tensor, g_TH: Tensor) -> None:
        """Copy a step's inputs into the static buffers (shapes as at capture)."""
        with torch.no_grad():
            self.x_TH.copy_(x_TH)
            self.ids_TK.copy_(ids_TK)
            self.g_TH.copy_(g_TH)

    def restore_grads(self) -> None:
        """Point every ``param.grad`` at the static gradients again (after an eager step
        replaced them)."""
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def replay(self) -> None:
        """Forward then backward on the static inputs."""
        self.fwd_graph.replay()
        self.bwd_graph.replay()


def eager_step(forward: Callable[[Tensor, Tensor], Tensor], params: Sequence[Tensor],
               x_TH: Tensor, ids_TK: Tensor, g_TH: Tensor
               ) -> Tuple[Tensor, Tensor, List[Optional[Tensor]]]:
    """One eager forward + backward from cleared gradients: (output, input gradient,
    parameter gradients), all detached copies."""
    for p in params:
        p.grad = None
    x = x_TH.detach().clone().requires_grad_()
    out = forward(x, ids_TK)
    out.backward(g_TH)
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    return out.detach().clone(), x.grad.detach().clone(), grads


def graph_matches_eager(step: GraphedStep, forward: Callable[[Tensor, Tensor], Tensor],
                        x_TH: Tensor, ids_TK: Tensor, g_TH: Tensor) -> dict:
    """Replay ``step`` on one input and compare with an eager step, bit for bit.

    Returns:
        ``{"bitwise": bool, "mismatched": [names]}`` over ``out``, ``dx`` and every
        parameter gradient (``param<i>``). The static gradients stay the parameters'
        ``.grad`` afterwards.
    """
    out, dx, grads = eager_step(forward, step.params, x_TH, ids_TK, g_TH)
    step.restore_grads()
    step.load(x_TH, ids_TK, g_TH)
    step.replay()
    torch.cuda.synchronize()
    pairs = [("out", step.out_TH, out), ("dx", step.dx_TH, dx)] + [
        (f"param{i}", a, b) for i, (a, b) in enumerate(zip(step.grads, grads))]
    bad = [name for name, a, b in pairs
           if (a is None) != (b is None) or (a is not None and not torch.equal(a, b))]
    return {"bitwise": not bad, "mismatched": bad}


def time_graph(step: GraphedStep, inputs, timer, warmup: int, iters: int
               ) -> Tuple[List[float], List[float]]:
    """Replay ``warmup + iters`` steps over the rotated input sets (copied into the static
    buffers untimed, stream-ordered behind the replay before); returns (fwd ms list, bwd
    ms list) of the timed replays, the stamps read after the last one and the host at most
    ``QUEUE_AHEAD`` replays ahead, as
    :func:`lrmoe.bench.timing.time_iterations` does for eager steps."""
    from lrmoe.bench.timing import QUEUE_AHEAD

    stamps = []
    rotate = len(inputs.xs)
    for i in range(warmup + iters):
        j = i % rotate
        step.load(inputs.xs[j], inputs.ids[j], inputs.gs[j])
        t0 = timer.event()
        step.fwd_graph.replay()
        t1 = timer.event()
        step.bwd_graph.replay()
        t2 = timer.event()
        stamps.append((t0, t1, t2))
        if i >= QUEUE_AHEAD:
            timer.wait(stamps[i - QUEUE_AHEAD][2])
    timed = stamps[warmup:]
    return ([timer.ms(t0, t1) for t0, t1, _ in timed],
            [timer.ms(t1, t2) for _, t1, t2 in timed])


def capture_profiled(step: GraphedStep, inputs, device: torch.device):
    """Capture ``step`` (made with ``capture=False``) and replay it once on input set 0,
    all in one profiler session: the profiler must be running when a graph is captured
    to record the kernels of its replays. The replay's forward runs in ``lrmoe:forward``
    and its backward in ``lrmoe:backward`` (as :func:`lrmoe.bench.timing.profile_step`).
    Returns the profile."""
    from lrmoe.utils.phases import BWD_RANGE, FWD_RANGE
    from lrmoe.bench.timing import profiled

    with profiled(device) as prof:
        torch.cuda.synchronize()  # nothing of the profiler's start-up inside the capture
        step.capture()
        step.load(inputs.xs[0], inputs.ids[0], inputs.gs[0])
        torch.cuda.synchronize()
        with torch.profiler.record_function(FWD_RANGE):
            step.fwd_graph.replay()
        with torch.profiler.record_function(BWD_RANGE):
            step.bwd_graph.replay()
            torch.cuda.synchronize()
    return prof
