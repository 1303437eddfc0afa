"""``lrmoe bench layer``: one MoE layer on one device, forward + backward, LRMoE against
its baselines.

In one run, for every (shape, token count, routing) case (:mod:`lrmoe.bench.cases`),
every method of :mod:`lrmoe.bench.methods` -- LRMoE at each recalibration rate (metric
``lrm``), ``dropless``, ``transformers`` and, where importable, ``torchtitan`` -- on one
set of weights, inputs and routing. A baseline first passes an agreement check against
LRMoE at c = 0, then it is timed (:mod:`lrmoe.bench.timing`); the reports and targets
are :mod:`lrmoe.bench.report`.

Expert parallelism (``--ep N`` under torchrun) is :mod:`lrmoe.bench.layer_ep`.
"""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from lrmoe.bench.methods import (build_methods, check_agreement, check_choices,
                                 default_methods, reference_outputs)
from lrmoe.bench.profile import (CPU_OP_CAT, DEVICE_CATS, load_trace, trace_name,
                                 where_time_goes)
from lrmoe.bench.profile import write as write_time_goes
from lrmoe.bench.report import FAILED, check_targets, markdown, plot, write_reports
from lrmoe.workload.routing import DEFAULT_ROTATE
from lrmoe.bench.cases import Case, cases, load_imbalance, make_inputs
from lrmoe.bench.timing import (PeakMemory, Timer, achieved_rates, kernel_split,
                                measure_ceilings, phase_times, profile_step, time_iterations)
from lrmoe.moe.offload import OFFLOAD_MODES


def run_case(case: Case, rates: Sequence[float], methods: Sequence[str], device: torch.device,
             iters: int, warmup: int, rotate: int, trace: Optional[str],
             transformers_iters: int, offload: str = "none",
             profile_dir: Optional[str] = None,
             cuda_graph: bool = False) -> List[dict]:
    """Check and time every method of one case; returns one record per method (see
    :mod:`lrmoe.bench.report` for the fields; ``offload`` as ``LRMoEConfig.offload``
    of the LRMoE layer), and with ``cuda_graph`` one more record
    after each LRMoE rate (:func:`graph_record`). ``profile_dir``: write each method's
    profiled step there as a Chrome trace and add its ``time_goes``
    (:func:`lrmoe.bench.profile.where_time_goes`) to the record."""
    d = case.dims
    timer = Timer(device)
    inputs = make_inputs(case, device, rotate, trace)
    imbalance = statistics.mean(load_imbalance(i, d["experts"]) for i in inputs.ids)
    built = build_methods(case, rates, methods, device, offload=offload)
    reference = (reference_outputs(built[0].reference, inputs)
                 if any(m.method != "lrmoe" for m in built) else None)
    records, graphed = [], []
    for method in built:
        rec = dict(shape=case.shape, tokens=case.tokens, routing=case.routing,
                   load_max_over_mean=imbalance, method=method.method, rate=method.rate,
                   label=method.label, agreement=None)
        try:
            if reference is not None:
                rec["agreement"] = check_agreement(method, inputs, reference)
            if rec["agreement"] is not None and not rec["agreement"]["passed"]:
                rec.update(status=FAILED, fwd_ms=None, bwd_ms=None, fwd_bwd_ms=None, iters=0,
                           peak_bytes=None, phases_ms={})
                records.append(rec)
                continue
            slow = method.method == "transformers"
            n_iter = transformers_iters if slow else iters
            n_warm = min(warmup, 1) if slow else warmup
            with PeakMemory(device, method.params) as mem:
                fwd, bwd = time_iterations(method, inputs, timer, n_warm, n_iter)
            (prof,) = profile_step(method, inputs, device)
        except torch.OutOfMemoryError as err:
            # one method out of memory (e.g. after the CUDA-graph pools of the rows before
            # it) must not lose the rows already timed: report it, free, go on
            _release(method, device)
            rec.update(status=f"out of memory: {str(err).splitlines()[0][:200]}",
                       fwd_ms=None, bwd_ms=None, fwd_bwd_ms=None, iters=0, peak_bytes=None,
                       phases_ms={})
            records.append(rec)
            continue
        rec.update(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd),
                   iters=n_iter, peak_bytes=mem.peak,
                   phases_ms=phase_times(prof, device.type == "cuda"))
        _finish(rec, method, prof, case, device, profile_dir, offload)
        records.append(rec)
        if cuda_graph and method.layer is not None:
            graphed.append((rec, method))
    # graph rows last: a graph's memory pool, or a failed capture, must not cost a
    # baseline its row (session 4 lost every GLM baseline to the pools of the graphs
    # before it, docs/journal/performance.md); each row still follows its eager row
    for rec, method in graphed:
        try:
            grec = graph_record(rec, method, inputs, case, device, timer, warmup, iters,
                                profile_dir)
        except RuntimeError as err:  # a failed capture: report it, keep the other rows
            grec = _graph_failed(rec, method, err)
        _release(method, device)
        records.insert(records.index(rec) + 1, grec)
    del built
    return records


def _release(method, device: torch.device) -> None:
    """Drop a method's gradients and return cached blocks (a graph's pool included) to
    the device, so that the next row starts from the same free memory."""
    for p in method.params:
        p.grad = None
    if method.layer is not None:  # its last step's tensors would pin a graph's pool
        st = method.layer.stats
        st.tokens_per_expert_E = st.quota_E = st.retained_mass = st.kept_pair_R = None
        st.kept_scale_R = None
        # the last forward's aux_loss and router_logits hold its autograd graph, and with
        # it the router weight's AccumulateGrad node made on the stream of the eager
        # steps; each later forward reuses that node, so a capture's backward would
        # accumulate on the default stream from the capture stream, which invalidates the
        # capture (torch warns "AccumulateGrad node's stream does not match"; on the H200
        # every capture after an eager step failed so, none without one,
        # docs/journal/performance.md session 6)
        method.layer.aux_loss = method.layer.router_logits = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _finish(rec: dict, method, prof, case: Case, device: torch.device,
            profile_dir: Optional[str], offload: str = "none") -> None:
    """Add kernel split, LRMoE stats (offload bytes of the last, profiled, step),
    fwd_bwd_ms, achieved rates and (``profile_dir``) the trace and ``time_goes`` of
    ``prof`` to a timed record."""
    if device.type == "cuda" and prof is not None:
        rec.update(kernel_split(prof))
    if method.layer is not None:
        st = method.layer.stats
        rec.update(backward_buffer_bytes=st.buffer_bytes, num_retained=st.num_retained,
                   num_pairs=st.num_pairs, offload=offload)
        if st.offload is not None:
            rec.update(offload_d2h_bytes=st.offload.d2h_bytes,
                       offload_h2d_bytes=st.offload.h2d_bytes)
    rec["fwd_bwd_ms"] = rec["fwd_ms"] + rec["bwd_ms"]
    achieved_rates(rec, case)
    if profile_dir is not None and prof is not None:
        path = Path(profile_dir) / f"{trace_name(rec)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        cats = DEVICE_CATS if device.type == "cuda" else (CPU_OP_CAT,)
        rec["time_goes"] = where_time_goes(load_trace(path), cats)


def _graph_failed(eager: dict, method, err: Exception) -> dict:
    """The record of a CUDA-graph row whose capture or replay raised: not timed, with
    ``status`` naming the error (the caller frees the method: :func:`_release`)."""
    rec = {k: eager[k] for k in ("shape", "tokens", "routing", "load_max_over_mean",
                                 "rate")}
    rec.update(method="lrmoe_graph", label=f"{eager['label']} graph", agreement=None,
               status=f"cuda graph failed: {type(err).__name__}: {str(err)[:300]}",
               fwd_ms=None, bwd_ms=None, fwd_bwd_ms=None, iters=0, peak_bytes=None,
               phases_ms={})
    return rec


def graph_record(eager: dict, method, inputs, case: Case, device: torch.device, timer,
                 warmup: int, iters: int, profile_dir: Optional[str]) -> dict:
    """Time an LRMoE method as CUDA-graph replays (:class:`lrmoe.bench.graph.GraphedStep`).

    Returns a record like the eager one (``method`` ``lrmoe_graph``, label ``lrmoe c=..
    graph``) with ``graph_bitwise`` (replay == eager step bit for bit on input set 0,
    output, input and parameter gradients; ``graph_mismatched`` names the others) and
    ``peak_bytes`` = the peak allocation of warm-up, capture and one replay (the graphs'
    pool included). No ``phases_ms``: a replay runs no host ranges (its kernels are in
    ``time_goes``, all under the phase ``(no phase)``). With ``profile_dir`` the profile
    comes from a second, profiled capture; where that capture fails the row keeps its
    times and ``profile_status`` says why it has no ``time_goes``.

    Raises:
        ValueError: off CUDA, or a config a replay would not repeat
            (:func:`lrmoe.bench.graph.check_capturable`).
    """
    from lrmoe.bench.graph import (GraphedStep, capture_profiled, check_capturable,
                                   graph_matches_eager, time_graph)
    check_capturable(method.layer.config)
    _release(method, device)  # no autograd graph of an eager step alive into the capture
    rec = {k: eager[k] for k in ("shape", "tokens", "routing", "load_max_over_mean",
                                 "rate")}
    rec.update(method="lrmoe_graph", label=f"{eager['label']} graph", agreement=None)
    with PeakMemory(device, method.params) as mem:
        step = GraphedStep(method.forward, method.params, inputs.xs[0], inputs.ids[0],
                           inputs.gs[0])
    check = graph_matches_eager(step, method.forward, inputs.xs[0], inputs.ids[0],
                                inputs.gs[0])
    fwd, bwd = time_graph(step, inputs, timer, warmup, iters)
    rec.update(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd), iters=iters,
               peak_bytes=mem.peak, phases_ms={}, graph_bitwise=check["bitwise"],
               graph_mismatched=check["mismatched"])
    del step
    _release(method, device)
    prof = None
    if profile_dir is not None:
        # the kernels of a replay are only traced when the profiler runs during the
        # capture; that capture is a second one, apart from the timed graphs, because on
        # the H200 it has failed where the plain capture worked (docs/journal/performance.md,
        # session 5): then the row keeps its times and says why it has no profile
        try:
            step = GraphedStep(method.forward, method.params, inputs.xs[0], inputs.ids[0],
                               inputs.gs[0], capture=False)
            prof = capture_profiled(step, inputs, device)
            del step
        except RuntimeError as err:
            rec["profile_status"] = (f"profiled capture failed: {type(err).__name__}: "
                                     f"{str(err).splitlines()[0][:200]}")
    _finish(rec, method, prof, case, device, profile_dir)
    return rec


def bench_layer(shapes: Sequence[str], tokens: Sequence[int], routings: Sequence[str],
                rates: Sequence[float] = (0.0, 0.1, 0.2, 0.3),
                methods: Optional[Sequence[str]] = None,
                device: Optional[str] = None, dtype: str = "bfloat16", iters: int = 20,
                warmup: int = 5, rotate: int = DEFAULT_ROTATE, transformers_iters: int = 3,
                trace: Optional[str] = None, out_dir: str = "bench-out",
                append_md: Optional[str] = None, command: str = "",
                offload: str = "none", profile_dir: Optional[str] = None,
                cuda_graph: bool = False) -> dict:
    """Run the benchmark and write ``layer_bench.json``, ``layer_bench.md`` and
    ``layer_bench.png`` under ``out_dir`` (and append the markdown to ``append_md``).

    Args:
        shapes: keys of :data:`lrmoe.workload.shapes.SHAPES`. tokens: token counts T.
            routings: uniform, skewed, trace. rates: LRMoE recalibration rates.
        methods: of :data:`lrmoe.bench.methods.METHODS` (default: every one importable
            here, :func:`lrmoe.bench.methods.default_methods`).
        device: ``cuda``/``cpu`` (default: cuda when available). dtype: bfloat16/float32.
        iters, warmup: timed and warm-up iterations (median reported). rotate: input sets.
        transformers_iters: timed iterations of the (slow) transformers block.
        trace: routing trace (.npz) for ``trace`` routing.
        offload: ``none`` or ``activations`` (``LRMoEConfig.offload`` of the LRMoE layer;
            the report's ``offload H2D / D2H MB`` column).
        profile_dir: also write there one Chrome trace per method (its profiled step)
            and ``where_time_goes.{md,json}`` (:mod:`lrmoe.bench.profile`).
        cuda_graph: also time each LRMoE rate as CUDA-graph replays
            (:func:`graph_record`; CUDA only).

    Returns:
        dict with ``records``, ``ceilings``, ``targets``, ``meta``.

    Raises:
        ValueError: unknown shape/routing/method/dtype/offload, ``torchtitan`` asked for
            where it cannot be imported, or ``cuda_graph`` off CUDA.
    """
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    methods = list(methods) if methods is not None else default_methods()
    torch_dtype = check_choices(shapes, methods, dtype)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cuda_graph and offload != "none":
        raise ValueError("--cuda-graph with --offload activations: the offload's host copies "
                         "and side stream are not captured; time them separately")
    if cuda_graph and dev.type != "cuda":
        raise ValueError(f"--cuda-graph captures CUDA graphs, but the device is {dev}; "
                         "run on a GPU (--device cuda) or drop --cuda-graph")
    ceilings = measure_ceilings(dev)
    records: List[dict] = []
    for case in cases(shapes, tokens, routings, torch_dtype, dev):
        records += run_case(case, rates, methods, dev, iters, warmup, rotate, trace,
                            transformers_iters, offload, profile_dir, cuda_graph)
    targets = check_targets(records, ceilings)
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
                command=command, iters=iters, methods=methods, offload=offload,
                # lrmoe sim --validate simulates the same input sets and checks the dtype
                rotate=rotate, dtype=dtype)
    result = dict(records=records, ceilings=ceilings, targets=targets, meta=meta)
    out = write_reports(result, markdown(records, ceilings, targets, meta), out_dir,
                        "layer_bench", append_md)
    plot(records, out / "layer_bench.png")
    if profile_dir is not None:
        write_time_goes(records, meta, profile_dir)
    return result
