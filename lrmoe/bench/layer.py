"""``lrmoe bench layer``: one MoE layer, forward + backward, LRMoE against its baselines.

In one run, on one device, for every (shape, token count, routing):
  * LRMoE at each recalibration rate (metric ``lrm``);
  * ``dropless``: the torchtitan-style grouped-GEMM MoE of ``benchmarks/dropless_moe.py``
    (autograd's own backward);
  * ``transformers``: transformers' ``Qwen3MoeSparseMoeBlock`` as shipped.
All methods share the weights, the inputs and the routing (forced expert ids; each
method's router still runs so its cost and gradient are real).

Timing (METHOD.md): warm-up, device events around forward and backward, the median of
``iters`` runs, inputs rotated over several sets so caches do not flatter the result.
The breakdown comes from one profiled iteration: device time under each
``lrmoe.*`` range (router, permute, expert_gemm_fwd, combine; router_grad, score, select,
compact, expert_gemm_bwd, scatter) and, for kernels outside any range, GEMM vs other by
kernel name. Ceilings measured in the same run: device copy bandwidth (bytes read +
written) and a dense bf16 8192^3 GEMM.

Expert parallelism (``--ep N`` under torchrun) is :mod:`lrmoe.bench.layer_ep`; it reuses
the pieces here (methods, inputs, timing loop, profiling, phase times, reports).

Legend: T tokens, H hidden, I expert intermediate, E experts, K top_k, P = T*K, R
retained pairs.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from lrmoe.config import LRMoEConfig
from lrmoe.layer import LRMoELayer

REPO = Path(__file__).resolve().parents[2]

SHAPES: Dict[str, dict] = {
    # DESIGN.md section 6
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8, shared=0),
    "glm-4.5-air": dict(hidden=4096, inter=1408, experts=128, top_k=8, shared=1408),
    # CPU smoke test (CI): tiny, not timed for the record
    "smoke": dict(hidden=64, inter=32, experts=8, top_k=2, shared=32),
}
PHASES_FWD = ("router", "permute", "expert_gemm_fwd", "combine")
PHASES_BWD = ("router_grad", "score", "select", "compact", "expert_gemm_bwd", "scatter")
GEMM_NAMES = ("gemm", "Gemm", "GEMM", "cutlass", "xmma", "wgmma")


@dataclasses.dataclass
class Case:
    """One benchmark case: a layer shape, a token count and a routing kind."""

    shape: str
    tokens: int
    routing: str
    dtype: torch.dtype

    @property
    def dims(self) -> dict:
        return SHAPES[self.shape]


# --------------------------------------------------------------------------- routing
def make_routing(kind: str, num_tokens: int, num_experts: int, top_k: int, seed: int,
                 trace: Optional[str] = None, skew: float = 1.2) -> torch.Tensor:
    """(T, K) int64 distinct expert ids per token.

    ``uniform``: each token picks K distinct experts uniformly. ``skewed``: expert e has
    popularity proportional to 1 / (e + 1)^skew (Zipf), K distinct draws per token by the
    Gumbel top-k trick. ``trace``: rows sampled from a recorded routing trace.

    Raises:
        ValueError: unknown kind, or ``trace`` without a path.
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "trace":
        if not trace:
            raise ValueError("routing 'trace' needs --trace PATH (a .npz from "
                             "`lrmoe train --record-trace PATH`)")
        from lrmoe.trace import trace_routing
        return trace_routing(trace, num_tokens, num_experts, top_k, seed)
    if kind == "uniform":
        logp = torch.zeros(num_experts)
    elif kind == "skewed":
        logp = -skew * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64)).float()
        logp = logp[torch.randperm(num_experts, generator=gen)]  # hot experts anywhere
    else:
        raise ValueError(f"routing must be uniform, skewed or trace, got {kind!r}")
    gumbel = -torch.log(-torch.log(torch.rand(num_tokens, num_experts, generator=gen)
                                   .clamp_min(1e-20)))
    return torch.topk(logp + gumbel, top_k, dim=-1).indices


def load_imbalance(ids: torch.Tensor, num_experts: int) -> float:
    """max / mean of the routed loads n_e."""
    n = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts).double()
    return float(n.max() / n.mean())


# --------------------------------------------------------------------------- methods
def _load_baseline(name: str = "dropless_moe") -> Callable:
    """``benchmarks/dropless_moe.py``'s function ``name`` (the file is not a package)."""
    path = REPO / "benchmarks" / "dropless_moe.py"
    if not path.is_file():
        raise FileNotFoundError(f"the dropless baseline {path} is missing: run the bench "
                                "from a checkout of the lrmoe repository")
    spec = importlib.util.spec_from_file_location("lrmoe_bench_dropless", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


class _Method:
    """A forward callable over (x, ids) with shared parameters; backward via autograd.

    ``a2a_bytes``: expert parallel only, the dict of all-to-all bytes of the last step
    (``lrmoe.parallel`` keys), refreshed by every forward/backward.
    """

    def __init__(self, name: str, forward: Callable, params: List[torch.Tensor],
                 layer: Optional[LRMoELayer] = None,
                 a2a_bytes: Optional[Dict[str, int]] = None) -> None:
        self.name, self.forward, self.params, self.layer = name, forward, params, layer
        self._a2a_bytes = a2a_bytes

    @property
    def a2a_bytes(self) -> Dict[str, int]:
        if self.layer is not None:
            return dict(self.layer.stats.a2a_bytes or {})
        return dict(self._a2a_bytes or {})


def layer_config(case: Case) -> LRMoEConfig:
    """The LRMoE config of a case (metric ``lrm``, c set per method)."""
    d = case.dims
    return LRMoEConfig(hidden_size=d["hidden"], moe_intermediate_size=d["inter"],
                       num_experts=d["experts"], top_k=d["top_k"],
                       shared_expert_intermediate_size=d["shared"], metric="lrm")


def build_methods(case: Case, rates: Sequence[float], methods: Sequence[str],
                  device: torch.device, ep_group=None) -> List[_Method]:
    """All methods of one case over ONE set of weights (bf16 on GPU).

    Args:
        case: the shape, tokens and dtype. rates: LRMoE recalibration rates.
        methods: any of ``lrmoe``, ``dropless``, ``transformers``.
        device: where weights and inputs live.
        ep_group: a process group for expert parallelism: the LRMoE layer shards its
            experts over it (E / W per rank, the same slice of one seeded initialisation
            on every method) and ``dropless`` becomes ``dropless_moe_ep``. A collective.

    Returns:
        One :class:`_Method` per LRMoE rate, then dropless, then transformers.

    Raises:
        ValueError: ``transformers`` together with ``ep_group`` (it has no EP mode).
    """
    if ep_group is not None and "transformers" in methods:
        raise ValueError("--methods transformers has no expert-parallel mode; drop it from "
                         "--methods when running with --ep")
    torch.manual_seed(0)
    base = LRMoELayer(layer_config(case), ep_group=ep_group).to(device=device,
                                                                  dtype=case.dtype)
    out: List[_Method] = []
    if "lrmoe" in methods:
        for c in rates:
            def run_lrmoe(x, ids, c=c):
                base.set_recalibration(recalibration_rate=c)
                return base(x, ids)
            out.append(_Method(f"lrmoe c={c:g}", run_lrmoe, list(base.parameters()), base))
    if "dropless" in methods:
        out.append(_dropless_method(base, ep_group))
    if "transformers" in methods:
        out.append(_transformers_method(base, case, device))
    return out


def _dropless_method(layer: LRMoELayer, ep_group) -> _Method:
    """The dropless baseline on ``layer``'s router, experts and shared expert."""
    a2a_bytes: Dict[str, int] = {}
    if ep_group is None:
        dropless = _load_baseline()
    else:
        dropless_ep = _load_baseline("dropless_moe_ep")

        def dropless(*args):
            return dropless_ep(*args, group=ep_group, a2a_bytes=a2a_bytes)

    def run_dropless(x, ids):
        with torch.profiler.record_function("lrmoe.router"):
            routing = layer.gate(x, ids)
        o = dropless(x, routing.weights_TK, routing.expert_ids_TK,
                     layer.experts.gate_up_proj, layer.experts.down_proj)
        if layer.shared_expert is not None:
            o = o + layer.shared_expert(x)
        return o
    return _Method("dropless", run_dropless, list(layer.parameters()),
                   a2a_bytes=a2a_bytes if ep_group is not None else None)


def _transformers_method(base: LRMoELayer, case: Case, device: torch.device) -> _Method:
    """transformers' Qwen3MoeSparseMoeBlock as shipped, its gate forced to the case ids."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    d = case.dims
    tcfg = Qwen3MoeConfig(hidden_size=d["hidden"], moe_intermediate_size=d["inter"],
                          num_experts=d["experts"], num_experts_per_tok=d["top_k"],
                          norm_topk_prob=True)
    # what a Qwen3MoeForCausalLM picks by default (PreTrainedModel.
    # get_correct_experts_implementation); a bare block would fall back to the eager loop
    tcfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(tcfg).to(device=device, dtype=case.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(base.gate.weight)
        block.experts.gate_up_proj.copy_(base.experts.gate_up_proj)
        block.experts.down_proj.copy_(base.experts.down_proj)
    forced = {}

    def gate_forward(hidden):
        with torch.profiler.record_function("lrmoe.router"):
            logits = F.linear(hidden, block.gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            w = probs.gather(1, forced["ids"])
            w = (w / w.sum(-1, keepdim=True)).to(logits.dtype)
        return logits, w, forced["ids"]
    block.gate.forward = gate_forward
    shared = base.shared_expert

    def run(x, ids):
        forced["ids"] = ids
        o = block(x.unsqueeze(0)).squeeze(0)
        return o + shared(x) if shared is not None else o
    params = list(block.parameters()) + (list(shared.parameters()) if shared else [])
    return _Method("transformers", run, params)


# --------------------------------------------------------------------------- timing
class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def event(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (GB/s, read + write) and dense bf16 GEMM (TFLOP/s), medians."""
    if device.type != "cuda":
        return {"copy_GBps": None, "gemm_TFLOPs": None}
    timer = _Timer(device)
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


def _phase_times(prof, cuda: bool) -> Dict[str, float]:
    """ms of device time of the kernels launched under each ``lrmoe.*`` range.

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


def _kernel_split(prof) -> Dict[str, float]:
    """All device kernels: GEMM ms vs other ms (by kernel name)."""
    gemm = other = 0.0
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            t = evt.device_time / 1e3 if hasattr(evt, "device_time") else evt.cuda_time / 1e3
            # not our own kernels, nor the GPU-side mirrors of the lrmoe.* ranges
            # ("lrmoe.expert_gemm_fwd" spans the GEMM kernels it would count twice)
            if "lrmoe" not in evt.name and any(k in evt.name for k in GEMM_NAMES):
                gemm += t
            else:
                other += t
    return {"gemm_kernels": gemm, "other_kernels": other}


#: seed of input set s on EP rank r: ``s + ROUTING_SEED_STRIDE * r`` (rank 0 = one device)
ROUTING_SEED_STRIDE = 1000


@dataclasses.dataclass
class Inputs:
    """``rotate`` input sets of one case on one rank: ids (T, K) int64, x and g (T, H)."""

    ids: List[torch.Tensor]
    xs: List[torch.Tensor]
    gs: List[torch.Tensor]
    routing_seeds: List[int]


def make_inputs(case: Case, device: torch.device, rotate: int, trace: Optional[str],
                rank: int = 0) -> Inputs:
    """The case's routing (seed ``s + ROUTING_SEED_STRIDE * rank`` for set s), token
    states x and output gradients g (one CPU generator seeded ``1 + ROUTING_SEED_STRIDE *
    rank``), moved to ``device`` in ``case.dtype``. Rank 0 gets the single-device inputs.
    """
    d = case.dims
    seeds = [s + ROUTING_SEED_STRIDE * rank for s in range(rotate)]
    ids = [make_routing(case.routing, case.tokens, d["experts"], d["top_k"], seed=s,
                        trace=trace).to(device) for s in seeds]
    gen = torch.Generator(device="cpu").manual_seed(1 + ROUTING_SEED_STRIDE * rank)
    xs = [torch.randn(case.tokens, d["hidden"], generator=gen).to(device, case.dtype)
          for _ in range(rotate)]
    gs = [torch.randn(case.tokens, d["hidden"], generator=gen).to(device, case.dtype)
          for _ in range(rotate)]
    return Inputs(ids, xs, gs, seeds)


def time_iterations(method: _Method, inputs: Inputs, timer: _Timer, warmup: int,
                    iters: int, before_each: Optional[Callable[[], None]] = None):
    """Run ``warmup + iters`` forward + backward steps over the rotated input sets.

    ``before_each`` runs untimed before every step (EP: a barrier so ranks start
    together). Returns (fwd ms list, bwd ms list) of the ``iters`` timed steps.
    """
    fwd, bwd = [], []
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
        if i >= warmup:
            fwd.append(timer.ms(t0, t1)); bwd.append(timer.ms(t1, t2))
    return fwd, bwd


def profile_step(method: _Method, inputs: Inputs, device: torch.device,
                 split: bool = False, before_each: Optional[Callable[[], None]] = None
                 ) -> list:
    """Profile one forward + backward on input set 0 (the EP bench's byte counts are of
    this step). ``split``: forward and backward in two profiler sessions (so kernels
    found by name are told apart); ``before_each`` runs before each session starts (EP:
    a barrier). Returns the list of profiles."""
    x = inputs.xs[0].detach().requires_grad_()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    if before_each is None:
        before_each = lambda: None  # noqa: E731
    if not split:
        before_each()
        with torch.profiler.profile(activities=activities) as prof:
            method.forward(x, inputs.ids[0]).backward(inputs.gs[0])
            sync()
        return [prof]
    before_each()
    with torch.profiler.profile(activities=activities) as prof_fwd:
        out = method.forward(x, inputs.ids[0])
        sync()
    before_each()
    with torch.profiler.profile(activities=activities) as prof_bwd:
        out.backward(inputs.gs[0])
        sync()
    return [prof_fwd, prof_bwd]


class PeakMemory:
    """CUDA peak allocation above the start of a ``with`` block (None on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.peak = device.type == "cuda", None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.mem0 = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated() - self.mem0


def run_case(case: Case, rates: Sequence[float], methods: Sequence[str], device: torch.device,
             iters: int, warmup: int, rotate: int, trace: Optional[str],
             transformers_iters: int) -> List[dict]:
    """Time every method of one case; returns one record per method."""
    d = case.dims
    timer = _Timer(device)
    inputs = make_inputs(case, device, rotate, trace)
    imbalance = statistics.mean(load_imbalance(i, d["experts"]) for i in inputs.ids)
    records = []
    for method in build_methods(case, rates, methods, device):
        n_iter = transformers_iters if method.name == "transformers" else iters
        n_warm = min(warmup, 1) if method.name == "transformers" else warmup
        with PeakMemory(device) as mem:
            fwd, bwd = time_iterations(method, inputs, timer, n_warm, n_iter)
        (prof,) = profile_step(method, inputs, device)
        rec = dict(shape=case.shape, tokens=case.tokens, routing=case.routing,
                   load_max_over_mean=imbalance, method=method.name,
                   fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd),
                   iters=n_iter, peak_bytes=mem.peak,
                   phases_ms=_phase_times(prof, device.type == "cuda"))
        if device.type == "cuda":
            rec.update(_kernel_split(prof))
        if method.layer is not None:
            st = method.layer.stats
            rec.update(recalibration_rate=float(method.name.split("=")[1]),
                       backward_buffer_bytes=st.buffer_bytes, num_retained=st.num_retained,
                       num_pairs=st.num_pairs)
        rec["fwd_bwd_ms"] = rec["fwd_ms"] + rec["bwd_ms"]
        _add_rates(rec, case)
        records.append(rec)
        del method
    return records


def _add_rates(rec: dict, case: Case) -> None:
    """Achieved GEMM TFLOP/s and GB/s of the memory-bound phases."""
    d, t = case.dims, case.tokens
    p = t * d["top_k"]
    r = rec.get("num_retained", p)
    h, i, e = d["hidden"], d["inter"], d["experts"]
    esize = torch.finfo(case.dtype).bits // 8
    flops = 6 * p * h * i + 12 * r * h * i + 6 * t * h * e  # experts fwd, bwd, router
    if rec.get("gemm_kernels"):
        rec["gemm_TFLOPs"] = flops / rec["gemm_kernels"] / 1e9
    ph = rec["phases_ms"]
    # fewest bytes each phase must move (each input read once, each output written once)
    need = {
        "permute": p * 8 + p * 8 + 2 * p * h * esize,           # ids, maps, x rows
        "combine": p * h * esize + p * 8 + t * h * esize,
        "score": t * h * esize + p * (4 + 4 + 4) + p * 4,
        "select": p * 4 * 3 + r * 4 * 3 + p * 4,
        "compact": 2 * (2 * r * h * esize),  # G and X rows (h is read in place)
        "scatter": r * h * esize + p * 4 + t * h * esize,
    }
    rec["phase_GBps"] = {k: v / ph[k] / 1e6 for k, v in need.items() if ph.get(k)}


# --------------------------------------------------------------------------- reports
def check_targets(records: List[dict], ceilings: dict) -> List[dict]:
    """The issue-4 targets on the Qwen3-30B-A3B layer, 32k tokens, skewed routing."""
    sel = {r["method"]: r for r in records if r["shape"] == "qwen3-30b-a3b"
           and r["tokens"] == 32768 and r["routing"] == "skewed"}
    out = []
    if "lrmoe c=0" not in sel:
        return out
    c0 = sel["lrmoe c=0"]

    def add(name, value, limit, ok):
        out.append(dict(target=name, value=value, limit=limit, met=bool(ok)))
    if "dropless" in sel:
        v = c0["fwd_bwd_ms"] / sel["dropless"]["fwd_bwd_ms"]
        add("c=0 fwd+bwd / dropless", v, "<= 1.05", v <= 1.05)
    overhead = sum(c0["phases_ms"].get(k, 0.0) for k in ("score", "select", "compact"))
    v = overhead / c0["bwd_ms"]
    add("score+select+compact / c=0 backward", v, "<= 0.05", v <= 0.05)
    for c, lim in (("0.2", 0.85), ("0.3", 0.77)):
        if f"lrmoe c={c}" in sel:
            v = sel[f"lrmoe c={c}"]["bwd_ms"] / c0["bwd_ms"]
            add(f"backward c={c} / c=0", v, f"<= {lim}", v <= lim)
    if "lrmoe c=0.2" in sel and "dropless" in sel:
        v = sel["dropless"]["fwd_bwd_ms"] / sel["lrmoe c=0.2"]["fwd_bwd_ms"]
        add("dropless / c=0.2 fwd+bwd (speed-up)", v, ">= 1.12", v >= 1.12)
    if ceilings.get("copy_GBps"):
        for k, gbps in c0["phase_GBps"].items():
            v = gbps / ceilings["copy_GBps"]
            add(f"{k} bandwidth / copy ceiling", v, ">= 0.60", v >= 0.60)
    for c in ("0.1", "0.2", "0.3"):
        if f"lrmoe c={c}" in sel and c0.get("backward_buffer_bytes"):
            v = sel[f"lrmoe c={c}"]["backward_buffer_bytes"] / c0["backward_buffer_bytes"]
            add(f"buffer bytes c={c} / c=0", v, f"<= {1 - float(c):.2f} + 0.02",
                v <= 1 - float(c) + 0.02)
    if "transformers" in sel:
        out.append(dict(target="transformers fwd+bwd / c=0.2 fwd+bwd (info)",
                        value=sel["transformers"]["fwd_bwd_ms"]
                        / sel["lrmoe c=0.2"]["fwd_bwd_ms"] if "lrmoe c=0.2" in sel else None,
                        limit="report", met=True))
    return out


def markdown(records: List[dict], ceilings: dict, targets: List[dict], meta: dict) -> str:
    """The run as a markdown section for docs/performance.md."""
    lines = [f"### Layer benchmark, {meta['date']} ({meta['device']})", "",
             f"Command: `{meta['command']}`  ", f"torch {meta['torch']}; ceilings measured "
             f"in this run: copy {_f(ceilings.get('copy_GBps'))} GB/s, dense bf16 GEMM "
             f"{_f(ceilings.get('gemm_TFLOPs'))} TFLOP/s. Median of {meta['iters']} "
             "iterations, times in ms.", "",
             "| shape | tokens | routing (max/mean) | method | fwd | bwd | fwd+bwd | "
             "vs dropless | GEMM TFLOP/s | peak GiB | bwd buffers GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["shape"], r["tokens"], r["routing"]): r["fwd_bwd_ms"] for r in records
            if r["method"] == "dropless"}
    for r in records:
        key = (r["shape"], r["tokens"], r["routing"])
        ratio = r["fwd_bwd_ms"] / base[key] if key in base else None
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['routing']} ({r['load_max_over_mean']:.2f}) "
            f"| {r['method']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} "
            f"| {_f(ratio, 3)} | {_f(r.get('gemm_TFLOPs'), 0)} | "
            f"{_f(r['peak_bytes'] / 2**30 if r.get('peak_bytes') else None, 2)} | "
            f"{_f(r['backward_buffer_bytes'] / 2**30 if r.get('backward_buffer_bytes') else None, 2)} |")
    lines += ["", "Breakdown (ms of device time per phase, one profiled iteration):", "",
              "| shape | tokens | routing | method | " + " | ".join(PHASES_FWD + PHASES_BWD)
              + " |", "|---|---|---|---|" + "---|" * len(PHASES_FWD + PHASES_BWD)]
    for r in records:
        ph = r["phases_ms"]
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['routing']} | {r['method']} | "
                     + " | ".join(_f(ph.get(k), 3) for k in PHASES_FWD + PHASES_BWD) + " |")
    if targets:
        lines += ["", "Targets (Qwen3-30B-A3B layer, 32k tokens, skewed routing):", "",
                  "| target | value | limit | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {_f(t['value'], 3)} | {t['limit']} | "
                  f"{'yes' if t['met'] else 'NO'} |" for t in targets]
    return "\n".join(lines) + "\n"


def _f(v, nd: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def plot(records: List[dict], path: Path) -> None:
    """Stacked breakdown bars, one per method, one panel per case (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = sorted({(r["shape"], r["tokens"], r["routing"]) for r in records})
    cols = min(3, len(cases))
    rows = math.ceil(len(cases) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    phases = PHASES_FWD + PHASES_BWD + ("other",)
    colors = plt.get_cmap("tab20").colors
    for ax, case in zip(axes.flat, cases):
        recs = [r for r in records if (r["shape"], r["tokens"], r["routing"]) == case]
        names = [r["method"] for r in recs]
        bottom = [0.0] * len(recs)
        for k, phase in enumerate(phases):
            if phase == "other":
                vals = [max(0.0, r["fwd_bwd_ms"] - sum(r["phases_ms"].get(p, 0.0)
                                                       for p in phases[:-1])) for r in recs]
            else:
                vals = [r["phases_ms"].get(phase, 0.0) for r in recs]
            ax.bar(names, vals, bottom=bottom, color=colors[k % len(colors)], label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{case[0]}, {case[1]} tokens, {case[2]}")
        ax.set_ylabel("ms (fwd + bwd)")
        ax.tick_params(axis="x", rotation=30)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_layer(shapes: Sequence[str], tokens: Sequence[int], routings: Sequence[str],
                rates: Sequence[float] = (0.0, 0.1, 0.2, 0.3),
                methods: Sequence[str] = ("lrmoe", "dropless", "transformers"),
                device: Optional[str] = None, dtype: str = "bfloat16", iters: int = 20,
                warmup: int = 5, rotate: int = 3, transformers_iters: int = 3,
                trace: Optional[str] = None, out_dir: str = "bench-out",
                append_md: Optional[str] = None, command: str = "") -> dict:
    """Run the benchmark and write ``layer_bench.json``, ``layer_bench.md`` and
    ``layer_bench.png`` under ``out_dir`` (and append the markdown to ``append_md``).

    Args:
        shapes: keys of :data:`SHAPES`. tokens: token counts T. routings: uniform, skewed,
            trace. rates: LRMoE recalibration rates. methods: lrmoe, dropless, transformers.
        device: ``cuda``/``cpu`` (default: cuda when available). dtype: bfloat16/float32.
        iters, warmup: timed and warm-up iterations (median reported). rotate: input sets.
        transformers_iters: timed iterations of the (slow, looped) transformers block.
        trace: routing trace (.npz) for ``trace`` routing.

    Returns:
        dict with ``records``, ``ceilings``, ``targets``, ``meta``.

    Raises:
        ValueError: unknown shape/routing/method/dtype.
    """
    torch_dtype = check_choices(shapes, methods, dtype)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ceilings = measure_ceilings(dev)
    records: List[dict] = []
    for case in cases(shapes, tokens, routings, torch_dtype, dev):
        records += run_case(case, rates, methods, dev, iters, warmup, rotate, trace,
                            transformers_iters)
    targets = check_targets(records, ceilings)
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
                command=command, iters=iters)
    result = dict(records=records, ceilings=ceilings, targets=targets, meta=meta)
    out = write_reports(result, markdown(records, ceilings, targets, meta), out_dir,
                        "layer_bench", append_md)
    plot(records, out / "layer_bench.png")
    return result


METHODS = ("lrmoe", "dropless", "transformers")


def cases(shapes: Sequence[str], tokens: Sequence[int], routings: Sequence[str],
          dtype: torch.dtype, device: torch.device):
    """Every (shape, tokens, routing) :class:`Case`; frees the CUDA cache after each."""
    for shape in shapes:
        for t in tokens:
            for routing in routings:
                yield Case(shape, t, routing, dtype)
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def check_choices(shapes: Sequence[str], methods: Sequence[str], dtype: str) -> torch.dtype:
    """Validate shape and method names; returns the torch dtype of ``dtype``.

    Raises:
        ValueError: naming the unknown shape, method or dtype and the choices.
    """
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"unknown shape {s!r}; choose from {sorted(SHAPES)}")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose lrmoe, dropless, transformers")
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    return torch_dtype


def write_reports(result: dict, md: str, out_dir: str, stem: str,
                  append_md: Optional[str]) -> Path:
    """Write ``<stem>.json`` and ``<stem>.md`` under ``out_dir`` (created), append the
    markdown to ``append_md`` when given; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(md)
    if append_md:
        with open(append_md, "a") as f:
            f.write("\n" + md)
    return out
