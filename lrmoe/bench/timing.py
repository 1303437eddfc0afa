"""Timing of ``lrmoe bench layer``: the timed loop, profiling, phase times, ceilings,
peak memory and achieved rates.

Timing (as docs/benchmarking.md, "Method", describes it): warm-up, device events around
forward and backward, the median of ``iters`` runs, inputs rotated over several sets so
caches do not flatter the result. The breakdown comes from one profiled iteration:
device time under each ``lrmoe.*`` range (router, permute, expert_gemm_fwd, combine;
router_grad, score, select, compact, expert_gemm_bwd, scatter) and, for kernels outside
any range, GEMM vs other by kernel name. Ceilings measured in the same run: device copy
bandwidth (bytes read + written) and a dense bf16 8192^3 GEMM.

The profiler's own chatter (kineto's ``STAGE:``/``USDT:`` lines, CUPTI notices, "Profiler
is not initialized" warnings) is kept off stderr by :func:`quiet_profiler`.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top_k, P = T*K pairs, R
retained pairs.
"""
from __future__ import annotations

import contextlib
import os
import re
import statistics
import sys
import tempfile
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from lrmoe.utils.phases import BWD_RANGE, FWD_RANGE
from lrmoe.bench.cases import Case, Inputs
from lrmoe.utils.clock import DeviceClock

GEMM_NAMES = ("gemm", "Gemm", "GEMM", "cutlass", "xmma", "wgmma")

#: a stderr line written by the profiler: kineto's log format
#: ``LEVEL:yyyy-mm-dd hh:mm:ss pid:tid file.cpp:line] ...`` or a line naming it or CUPTI
_PROFILER_LINE = re.compile(
    r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\]|cupti|kineto|profiler",
    re.IGNORECASE)


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Keep the profiler's messages off stderr inside the block; keep everything else.

    Python warnings that name the profiler, kineto or CUPTI are ignored. The C++ side
    (kineto, CUPTI) writes to file descriptor 2 directly, which no Python setting
    reaches, so fd 2 goes to a temporary file for the block and afterwards every line
    that is not the profiler's is written to stderr (late, but not lost). Where fd 2
    cannot be duplicated (closed), only the warnings filter applies.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?is).*(profiler|cupti|kineto)")
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):
            yield
            return
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                text = tmp.read().decode(errors="replace")
                kept = [ln for ln in text.splitlines(keepends=True)
                        if not _PROFILER_LINE.search(ln)]
                if kept:
                    sys.stderr.write("".join(kept))
                    sys.stderr.flush()


def activities(device: torch.device) -> list:
    """Profiler activities: CPU, plus CUDA on a CUDA device."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


@contextlib.contextmanager
def profiled(device: torch.device) -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile`` of the device's activities, its messages kept off
    stderr (:func:`quiet_profiler`)."""
    with quiet_profiler(), torch.profiler.profile(activities=activities(device)) as prof:
        yield prof


#: the benchmark's clock (device events on CUDA, the host clock elsewhere)
Timer = DeviceClock


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (GB/s, read + write) and dense bf16 GEMM (TFLOP/s), medians of 10
    after 3 warm-ups; both None off CUDA."""
    if device.type != "cuda":
        return {"copy_GBps": None, "gemm_TFLOPs": None}
    timer = Timer(device)
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    copy, gemm = [], []
    for i in range(13):
        t0 = timer.event(); dst.copy_(src); t1 = timer.event()
        t2 = timer.event(); torch.mm(a, b); t3 = timer.event()
        if i >= 3:
            copy.append(timer.ms(t0, t1)); gemm.append(timer.ms(t2, t3))
    bytes_moved = 2 * src.numel() * src.element_size()
    del src, dst, a, b
    return {"copy_GBps": bytes_moved / statistics.median(copy) / 1e6,
            "gemm_TFLOPs": 2 * 8192 ** 3 / statistics.median(gemm) / 1e9}


def phase_times(prof, cuda: bool) -> Dict[str, float]:
    """ms of device time (CPU time off CUDA) of the kernels launched under each
    ``lrmoe.*`` range, keyed by the name after ``lrmoe.``.

    Only the host-side range events count: the profiler also mirrors each range on the
    GPU timeline, and summing both would count every kernel twice.
    """
    out: Dict[str, float] = {}
    for evt in prof.events():
        if not evt.name.startswith("lrmoe.") or evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        t = evt.device_time_total if cuda else evt.cpu_time_total
        key = evt.name[len("lrmoe."):]
        out[key] = out.get(key, 0.0) + t / 1e3
    return out


def kernel_split(prof) -> Dict[str, float]:
    """All device kernels of a profile: ms of GEMM kernels vs other, told by name."""
    gemm = other = 0.0
    for evt in prof.events():
        if (getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA
                and evt.name not in (FWD_RANGE, BWD_RANGE)):  # whole-part mirrors
            t = evt.device_time / 1e3 if hasattr(evt, "device_time") else evt.cuda_time / 1e3
            # not our own kernels, nor the GPU-side mirrors of the lrmoe.* ranges
            # ("lrmoe.expert_gemm_fwd" spans the GEMM kernels it would count twice)
            if "lrmoe" not in evt.name and any(k in evt.name for k in GEMM_NAMES):
                gemm += t
            else:
                other += t
    return {"gemm_kernels": gemm, "other_kernels": other}


#: steps the host may queue ahead of the device in :func:`time_iterations`: enough to
#: hide its launches behind the step before, few enough that buffers allocated per step
#: (offload's pinned host rows) do not pile up
QUEUE_AHEAD = 2


def time_iterations(method, inputs: Inputs, timer: Timer, warmup: int, iters: int,
                    before_each: Optional[Callable[[], None]] = None,
                    sync_each: bool = False) -> Tuple[List[float], List[float]]:
    """Run ``warmup + iters`` forward + backward steps of a
    :class:`lrmoe.bench.method.Method` over the rotated input sets.

    ``before_each`` runs untimed before every step (EP: a barrier so ranks start
    together; ``lrmoe.bench.layer_ep``'s also waits for the device, so EP steps always
    start on an idle device). The stamps are read after the last step and the host
    queues up to :data:`QUEUE_AHEAD` steps behind the one the device runs, as in
    training, where a layer's forward is queued behind the model's earlier kernels (and
    as ``triton.testing.do_bench`` times). ``sync_each``: wait for every step, warm-up
    included, before queuing the next instead; then each forward starts on an idle
    device and its host-side launches before the first large kernel count as device time
    (up to 1 ms of the Qwen3 forward on the H200, docs/journal/performance.md session 6; the
    committed calibration, ``lrmoe calibrate``, was measured so). Returns (fwd ms list,
    bwd ms list) of the ``iters`` timed steps.
    """
    stamps = []
    rotate = len(inputs.xs)
    for i in range(warmup + iters):
        j = i % rotate
        x = inputs.xs[j].detach().requires_grad_()
        for p in method.params:
            p.grad = None
        if before_each is not None:
            before_each()
        t0 = timer.event()
        out = method.forward(x, inputs.ids[j])
        t1 = timer.event()
        out.backward(inputs.gs[j])
        t2 = timer.event()
        del out
        stamps.append((t0, t1, t2))
        if sync_each:
            timer.wait(t2)
        elif i >= QUEUE_AHEAD:
            timer.wait(stamps[i - QUEUE_AHEAD][2])
    timed = stamps[warmup:]
    return ([timer.ms(t0, t1) for t0, t1, _ in timed],
            [timer.ms(t1, t2) for _, t1, t2 in timed])


def profile_step(method, inputs: Inputs, device: torch.device, split: bool = False,
                 before_each: Optional[Callable[[], None]] = None) -> list:
    """Profile one forward + backward on input set 0 (the EP bench's byte counts are of
    this step). ``split``: forward and backward in two profiler sessions (so kernels
    found by name are told apart); ``before_each`` runs before each session starts (EP:
    a barrier). The forward runs in a ``lrmoe:forward`` range, the backward in a
    ``lrmoe:backward`` one (the parts of :func:`lrmoe.bench.profile.where_time_goes`).
    Returns the list of profiles."""
    x = inputs.xs[0].detach().requires_grad_()
    # from cleared gradients, as every timed step (time_iterations): else the step's
    # AccumulateGrad adds into the last step's weight gradients (0.82 ms of the Qwen3
    # layer's profiled backward on the H200, docs/journal/performance.md session 5)
    for p in method.params:
        p.grad = None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    if before_each is None:
        before_each = lambda: None  # noqa: E731
    # the part markers of lrmoe.bench.profile (they name neither a phase nor a kernel)
    mark_fwd = lambda: torch.profiler.record_function(FWD_RANGE)  # noqa: E731
    mark_bwd = lambda: torch.profiler.record_function(BWD_RANGE)  # noqa: E731
    if not split:
        before_each()
        with profiled(device) as prof:
            with mark_fwd():
                out = method.forward(x, inputs.ids[0])
            with mark_bwd():
                out.backward(inputs.gs[0])
                sync()
        return [prof]
    before_each()
    with profiled(device) as prof_fwd:
        with mark_fwd():
            out = method.forward(x, inputs.ids[0])
            sync()
    before_each()
    with profiled(device) as prof_bwd:
        with mark_bwd():
            out.backward(inputs.gs[0])
            sync()
    return [prof_fwd, prof_bwd]


class PeakMemory:
    """CUDA peak allocation (bytes) above the start of a ``with`` block (None on CPU).

    Args:
        device: where the block runs.
        params: the timed method's parameters; their ``.grad`` is freed before the start is
            read, so every row counts the weight gradients its backward allocates, whatever
            ran before it. Without this a row that found gradients left by an earlier step
            (the LRMoE rows share one layer, and the agreement reference steps it) did not
            count them and one that found none did: 1.13 GiB of expert weight gradients at
            the Qwen3-30B-A3B shape (docs/journal/performance.md, session 9).
    """

    def __init__(self, device: torch.device, params: Sequence[torch.Tensor] = ()) -> None:
        self.cuda, self.peak, self.params = device.type == "cuda", None, list(params)

    def __enter__(self):
        for p in self.params:
            p.grad = None
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.mem0 = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated() - self.mem0


def achieved_rates(rec: dict, case: Case) -> None:
    """Add to a record the achieved GEMM TFLOP/s (``gemm_TFLOPs``, CUDA only) and the
    GB/s of the memory-bound phases (``phase_GBps``) from its ``phases_ms``.

    FLOPs: 6 P H I for the expert forward (three GEMMs), 12 R H I for the expert backward
    (dX and dW of each), 6 T H E for the router. Bytes: the fewest each phase must move,
    every input read once and every output written once.
    """
    d, t = case.dims, case.tokens
    p = t * d["top_k"]
    r = rec.get("num_retained", p)
    h, i, e = d["hidden"], d["inter"], d["experts"]
    esize = torch.finfo(case.dtype).bits // 8
    flops = 6 * p * h * i + 12 * r * h * i + 6 * t * h * e
    if rec.get("gemm_kernels"):
        rec["gemm_TFLOPs"] = flops / rec["gemm_kernels"] / 1e9
    ph = rec["phases_ms"]
    need = {
        "permute": p * 8 + p * 8 + (t + p) * h * esize,         # ids, maps, x read once
        "combine": p * h * esize + p * 8 + t * h * esize,
        "score": t * h * esize + p * (4 + 4 + 4) + p * 4,
        "select": p * 4 * 3 + r * 4 * 3 + p * 4,
        "compact": 2 * (t + r) * h * esize,  # g and x read once, G and X written
        "scatter": r * h * esize + p * 4 + t * h * esize,
    }
    rec["phase_GBps"] = {k: v / ph[k] / 1e6 for k, v in need.items() if ph.get(k)}
