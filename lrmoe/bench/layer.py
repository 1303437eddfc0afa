"""``lrmoe bench layer``: one MoE layer on one device, forward + backward, LRMoE against
its baselines.

In one run, for every (shape, token count, routing) case (:mod:`lrmoe.bench.routing`),
every method of :mod:`lrmoe.bench.methods` -- LRMoE at each recalibration rate (metric
``lrm``), ``dropless``, ``transformers`` and, where importable, ``torchtitan`` -- on one
set of weights, inputs and routing. A baseline first passes an agreement check against
LRMoE at c = 0, then it is timed (:mod:`lrmoe.bench.timing`); the reports and targets
are :mod:`lrmoe.bench.report`.

Expert parallelism (``--ep N`` under torchrun) is :mod:`lrmoe.bench.layer_ep`.
"""
from __future__ import annotations

import statistics
import time
from typing import List, Optional, Sequence

import torch

from lrmoe.bench.methods import (build_methods, check_agreement, check_choices,
                                 default_methods, reference_outputs)
from lrmoe.bench.report import FAILED, check_targets, markdown, plot, write_reports
from lrmoe.bench.routing import Case, cases, load_imbalance, make_inputs
from lrmoe.bench.timing import (PeakMemory, Timer, achieved_rates, kernel_split,
                                measure_ceilings, phase_times, profile_step,
                                time_iterations)
from lrmoe.offload import OFFLOAD_MODES


def run_case(case: Case, rates: Sequence[float], methods: Sequence[str], device: torch.device,
             iters: int, warmup: int, rotate: int, trace: Optional[str],
             transformers_iters: int, offload: str = "none") -> List[dict]:
    """Check and time every method of one case; returns one record per method (see
    :mod:`lrmoe.bench.report` for the fields; ``offload`` as ``LRMoEConfig.offload``
    of the LRMoE layer)."""
    d = case.dims
    timer = Timer(device)
    inputs = make_inputs(case, device, rotate, trace)
    imbalance = statistics.mean(load_imbalance(i, d["experts"]) for i in inputs.ids)
    built = build_methods(case, rates, methods, device, offload=offload)
    reference = (reference_outputs(built[0].reference, inputs)
                 if any(m.method != "lrmoe" for m in built) else None)
    records = []
    for method in built:
        rec = dict(shape=case.shape, tokens=case.tokens, routing=case.routing,
                   load_max_over_mean=imbalance, method=method.method, rate=method.rate,
                   label=method.label, agreement=None)
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
        with PeakMemory(device) as mem:
            fwd, bwd = time_iterations(method, inputs, timer, n_warm, n_iter)
        (prof,) = profile_step(method, inputs, device)
        rec.update(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd),
                   iters=n_iter, peak_bytes=mem.peak,
                   phases_ms=phase_times(prof, device.type == "cuda"))
        if device.type == "cuda":
            rec.update(kernel_split(prof))
        if method.layer is not None:
            st = method.layer.stats
            rec.update(backward_buffer_bytes=st.buffer_bytes, num_retained=st.num_retained,
                       num_pairs=st.num_pairs, offload=offload)
            if st.offload is not None:  # bytes of the last (profiled) step
                rec.update(offload_d2h_bytes=st.offload.d2h_bytes,
                           offload_h2d_bytes=st.offload.h2d_bytes)
        rec["fwd_bwd_ms"] = rec["fwd_ms"] + rec["bwd_ms"]
        achieved_rates(rec, case)
        records.append(rec)
    del built
    return records


def bench_layer(shapes: Sequence[str], tokens: Sequence[int], routings: Sequence[str],
                rates: Sequence[float] = (0.0, 0.1, 0.2, 0.3),
                methods: Optional[Sequence[str]] = None,
                device: Optional[str] = None, dtype: str = "bfloat16", iters: int = 20,
                warmup: int = 5, rotate: int = 3, transformers_iters: int = 3,
                trace: Optional[str] = None, out_dir: str = "bench-out",
                append_md: Optional[str] = None, command: str = "",
                offload: str = "none") -> dict:
    """Run the benchmark and write ``layer_bench.json``, ``layer_bench.md`` and
    ``layer_bench.png`` under ``out_dir`` (and append the markdown to ``append_md``).

    Args:
        shapes: keys of :data:`lrmoe.bench.routing.SHAPES`. tokens: token counts T.
            routings: uniform, skewed, trace. rates: LRMoE recalibration rates.
        methods: of :data:`lrmoe.bench.methods.METHODS` (default: every one importable
            here, :func:`lrmoe.bench.methods.default_methods`).
        device: ``cuda``/``cpu`` (default: cuda when available). dtype: bfloat16/float32.
        iters, warmup: timed and warm-up iterations (median reported). rotate: input sets.
        transformers_iters: timed iterations of the (slow) transformers block.
        trace: routing trace (.npz) for ``trace`` routing.
        offload: ``none`` or ``activations`` (``LRMoEConfig.offload`` of the LRMoE layer;
            the report's ``offload H2D / D2H MB`` column).

    Returns:
        dict with ``records``, ``ceilings``, ``targets``, ``meta``.

    Raises:
        ValueError: unknown shape/routing/method/dtype/offload, or ``torchtitan`` asked for
            where it cannot be imported.
    """
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    methods = list(methods) if methods is not None else default_methods()
    torch_dtype = check_choices(shapes, methods, dtype)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ceilings = measure_ceilings(dev)
    records: List[dict] = []
    for case in cases(shapes, tokens, routings, torch_dtype, dev):
        records += run_case(case, rates, methods, dev, iters, warmup, rotate, trace,
                            transformers_iters, offload)
    targets = check_targets(records, ceilings)
    meta = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
                command=command, iters=iters, methods=methods, offload=offload)
    result = dict(records=records, ceilings=ceilings, targets=targets, meta=meta)
    out = write_reports(result, markdown(records, ceilings, targets, meta), out_dir,
                        "layer_bench", append_md)
    plot(records, out / "layer_bench.png")
    return result
