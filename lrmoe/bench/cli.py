"""Argument parsing of ``lrmoe bench layer`` (shared by the console script and
``benchmarks/layer_bench.py``): the one-device benchmark (:mod:`lrmoe.bench.layer`), or
with ``--ep N`` the expert-parallel one (:mod:`lrmoe.bench.layer_ep`) under ``torchrun
--nproc-per-node N``."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from typing import List, Optional

from lrmoe.bench.methods import EP_METHODS, METHODS
from lrmoe.utils.phases import A2A_PHASES
from lrmoe.bench.report import FAILED
from lrmoe.workload.routing import DEFAULT_ROTATE, ROUTINGS
from lrmoe.workload.shapes import SHAPES
from lrmoe.moe.offload import OFFLOAD_MODES
from lrmoe.planner.plan import POLICIES
from lrmoe.utils.paths import check_output
from lrmoe.moe.config import BackwardConfig


DEFAULT_TOKENS = (16384, 32768)


def add_layer_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``lrmoe bench layer``."""
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "glm-4.5-air"],
                   choices=sorted(SHAPES), help="layer shapes (default: both paper shapes)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS),
                   help="tokens per step T, per rank with --ep (default: 16384 32768)")
    p.add_argument("--routing", nargs="+", default=["uniform", "skewed"],
                   choices=list(ROUTINGS), help="routing kinds")
    p.add_argument("--trace", default=None, help="routing trace .npz for --routing trace")
    p.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.1, 0.2, 0.3],
                   help="LRMoE recalibration rates")
    p.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                   help="LRMoE at each rate, the dropless grouped baseline, transformers' "
                        "block, torchtitan's MoE (default: all, torchtitan where it is "
                        "importable; with --ep: lrmoe dropless)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="activation and weight dtype")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    p.add_argument("--rotate", type=int, default=DEFAULT_ROTATE, help="input sets rotated over")
    p.add_argument("--transformers-iters", type=int, default=3,
                   help="timed iterations of the transformers block")
    p.add_argument("--out", default="bench-out", help="folder for json/md/png")
    p.add_argument("--append-md", default=None,
                   help="also append the markdown table to this file (docs/journal/performance.md)")
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="expert-parallel benchmark over N processes: launch with torchrun "
                        "--nproc-per-node N; experts sharded E/N per rank, --tokens per rank; "
                        "writes layer_bench_ep.{json,md}")
    p.add_argument("--policies", nargs="+", default=None, choices=["none", *POLICIES],
                   help="with --ep: the placement policies LRMoE runs under, each over the "
                        "same weights (none: fixed ownership without the planner, the "
                        "default; fixed: Megatron-style ownership through the planner; "
                        "ultraep, symi, lrmoe: replicas, docs/planner.md); rows 'lrmoe "
                        "POLICY c=..' with the plan's replicas and memory per rank")
    p.add_argument("--replica-slots", type=int, default=None,
                   help="with --policies: spare expert slots per rank (default 2)")
    p.add_argument("--offload", default="none", choices=OFFLOAD_MODES,
                   help="LRMoE layer's LRMoEConfig.offload: activations keeps the saved "
                        "expert rows in pinned host memory (report column offload H2D / "
                        "D2H MB); one device")
    p.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="write one Chrome trace per method (its profiled forward + "
                        "backward) and where_time_goes.{md,json} (device ms per kernel, "
                        "idle gaps and the host ranges they fall in) under DIR")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time every LRMoE rate as CUDA-graph replays of forward and "
                        "backward (rows 'lrmoe c=.. graph'; CUDA only)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny CPU-sized run (CI): shape smoke, 256 tokens, 2 iterations")
    return p


def _check_policies(args: argparse.Namespace) -> None:
    """``--policies`` and ``--replica-slots`` before any process group or layer exists.

    Raises:
        ValueError: ``--policies`` without ``--ep``, without ``lrmoe`` in ``--methods``,
            with a policy twice or without 0 in ``--rates`` (each policy's c = 0 is the
            check against the layer without one); ``--replica-slots`` without
            ``--policies``, below 0, or 0 with ``ultraep`` (its replicas live there).
    """
    pols = args.policies
    if pols is None:
        if args.replica_slots is not None:
            raise ValueError("--replica-slots sets the placement policies' spare slots; give "
                             "--policies too")
        args.replica_slots = 2  # unused without policies; the record's meta keeps it
        return
    if args.ep is None:
        raise ValueError("--policies place experts over an expert-parallel group; add --ep "
                         "N under torchrun --nproc-per-node N")
    if args.methods is not None and "lrmoe" not in args.methods:
        raise ValueError("--policies place the LRMoE layer; add lrmoe to --methods")
    if len(set(pols)) != len(pols):
        raise ValueError(f"--policies lists a policy twice ({' '.join(pols)}); list each once")
    if 0 not in args.rates:
        raise ValueError("--policies needs 0 among --rates: each policy's c = 0 is checked "
                         "against the layer without a policy before it is timed")
    slots = 2 if args.replica_slots is None else args.replica_slots
    if slots < 0:
        raise ValueError(f"--replica-slots must be >= 0, got {slots}")
    if slots == 0 and "ultraep" in pols:
        raise ValueError("--policies ultraep needs --replica-slots >= 1 (its replicas live in "
                         "the spare slots)")
    args.replica_slots = slots


def _check_trace(args: argparse.Namespace) -> None:
    """``--routing trace`` needs a readable ``--trace`` recorded with every shape's E and
    K: checked before the first case runs, not when the trace's turn comes."""
    if "trace" not in args.routing:
        return
    if not args.trace:
        raise ValueError("--routing trace needs --trace PATH (a .npz from `lrmoe train "
                         "--record-trace PATH`)")
    from lrmoe.workload.trace import load_trace

    meta, _ = load_trace(args.trace)
    for name in args.shapes:
        d = SHAPES[name].dims
        if (meta["num_experts"], meta["top_k"]) != (d["experts"], d["top_k"]):
            raise ValueError(f"--trace {args.trace} was recorded with E={meta['num_experts']}, "
                             f"K={meta['top_k']}, but --shapes {name} has E={d['experts']}, "
                             f"K={d['top_k']}; record a trace of that shape or drop it from "
                             "--shapes")


def run_layer(args: argparse.Namespace, argv: Optional[List[str]] = None) -> dict:
    """Run ``bench layer`` from parsed arguments and print the targets table.

    Raises:
        ValueError: bad ``--policies`` / ``--replica-slots`` (:func:`_check_policies`),
            ``--tokens`` below 1; ``--tokens``, ``--shapes``, ``--iters``, ``--warmup``,
            ``--rotate`` or ``--transformers-iters`` together with ``--smoke`` (which
            fixes them); repeated values of a list option; a ``--device`` other than
            cpu, cuda or cuda:N; ``--routing trace`` without a matching ``--trace``;
            several torchrun processes without ``--ep``, or ``--offload``,
            ``--profile-dir`` or ``--cuda-graph`` with ``--ep``; an ``--out``,
            ``--profile-dir`` or ``--append-md`` that cannot be written
            (:func:`lrmoe.utils.paths.check_output`); ``--iters``/``--rotate``/
            ``--transformers-iters`` < 1, ``--warmup`` < 0, a rate outside [0, 1), or
            ``--device cuda`` without a CUDA device.
    """
    check_output("--out", args.out, is_dir=True)
    if args.profile_dir:
        check_output("--profile-dir", args.profile_dir, is_dir=True)
    if min(args.tokens) < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    if args.smoke:
        # --smoke fixes these; a value given beside it would be dropped without a word
        defaults = add_layer_arguments(argparse.ArgumentParser()).parse_args([])
        for dest in ("tokens", "shapes", "iters", "warmup", "rotate", "transformers_iters"):
            if getattr(args, dest) != getattr(defaults, dest):
                flag = "--" + dest.replace("_", "-")
                raise ValueError(f"--smoke fixes {flag} (shape smoke, 256 tokens, 2 "
                                 f"iterations); drop {flag}, or drop --smoke to time it")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ep is None and world > 1:
        raise ValueError(f"torchrun started {world} processes but --ep is not given: pass "
                         f"--ep {world} for the expert-parallel benchmark (without it every "
                         "process would run the one-device benchmark into the same files)")
    if args.ep is not None and (args.profile_dir or args.cuda_graph):
        raise ValueError("--profile-dir and --cuda-graph time the one-device layer; drop "
                         "them with --ep (the expert-parallel step has collectives between "
                         "its kernels)")
    if args.smoke:
        args.shapes, args.tokens, args.iters, args.warmup = ["smoke"], [256], 2, 1
        args.transformers_iters, args.rotate = 1, 2
        args.dtype = "float32" if (args.device or "cpu") == "cpu" else args.dtype
    for flag, v, lo in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                        ("--rotate", args.rotate, 1),
                        ("--transformers-iters", args.transformers_iters, 1)):
        if v < lo:
            raise ValueError(f"{flag} must be >= {lo}, got {v}")
    for c in args.rates:  # the one check of a rate (BackwardConfig.validate)
        try:
            BackwardConfig(recalibration_rate=c).validate("--rates")
        except ValueError as err:
            raise ValueError(f"--rates are recalibration rates: {err}") from None
    for flag, values in (("--rates", args.rates), ("--shapes", args.shapes),
                         ("--tokens", args.tokens), ("--routing", args.routing),
                         ("--methods", args.methods or [])):
        if len(set(values)) != len(values):  # each repeat would be timed as its own row
            raise ValueError(f"{flag} lists a value twice ({' '.join(map(str, values))}); "
                             "list each once")
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        # --ep would otherwise run anything that is not cuda* on gloo and the CPU
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if (args.device or "").startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device here; use --device cpu")
    if args.append_md:
        check_output("--append-md", args.append_md, is_dir=False)
    _check_trace(args)
    _check_policies(args)
    if args.ep is not None and args.offload != "none":
        raise ValueError("--offload is measured by the one-device benchmark; drop --ep (the "
                         "expert-parallel layer runs it too, but bench layer --ep does not "
                         "time it)")
    if args.ep is not None:
        return _run_layer_ep(args, argv)
    from lrmoe.bench.layer import bench_layer

    command = "lrmoe bench layer " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result = bench_layer(args.shapes, args.tokens, args.routing, args.rates, args.methods,
                         args.device, args.dtype, args.iters, args.warmup, args.rotate,
                         args.transformers_iters, args.trace, args.out, args.append_md,
                         command, args.offload, args.profile_dir, args.cuda_graph)
    print((result["meta"]["device"]) + ": wrote " + args.out + "/layer_bench.{json,md,png}"
          + (f", {args.profile_dir}/where_time_goes.{{md,json}} and traces"
             if args.profile_dir else ""))
    for r in result["records"]:
        head = f"{r['shape']:>14} {r['tokens']:>6} {r['routing']:>8} {r['label']:>14} "
        print(head + (f"fwd {r['fwd_ms']:8.2f} ms  bwd {r['bwd_ms']:8.2f} ms"
                      if r["fwd_ms"] is not None else _failed(r)) + _extra(r))
    for t in result["targets"]:
        met = "-" if t["met"] is None else "met" if t["met"] else "MISSED"
        print(f"{'info' if t['info'] else 'target'} {t['target']}: {t['value']:.3f} "
              f"({t['limit']}) {met}")
    return result


def _extra(r: dict) -> str:
    """The graph check and, with --profile-dir, the device idle time of each part."""
    out = ""
    if "graph_bitwise" in r:
        out += "  replay == eager bitwise" if r["graph_bitwise"] else (
            "  replay DIFFERS from eager: " + ", ".join(r["graph_mismatched"]))
    if "profile_status" in r:
        out += "  " + r["profile_status"]
    tg = r.get("time_goes")
    if tg:
        out += "  idle/span ms fwd {:.2f}/{:.2f} bwd {:.2f}/{:.2f}".format(
            tg["forward"]["idle_ms"], tg["forward"]["span_ms"], tg["backward"]["idle_ms"],
            tg["backward"]["span_ms"])
    return out


def _failed(r: dict) -> str:
    a = r["agreement"]
    if a is None:  # not an agreement failure (a CUDA-graph row whose capture failed)
        return r.get("status", "not timed")
    return (f"not timed: disagrees with lrmoe c=0 (output {a['out_rel_err']:.2e}, input "
            f"gradient {a['dx_rel_err']:.2e}, tolerance {a['tolerance']:.0e})")


def _run_layer_ep(args: argparse.Namespace, argv: Optional[List[str]]) -> Optional[dict]:
    """``--ep N``: the expert-parallel benchmark; rank 0 prints the summary."""
    from lrmoe.bench.layer_ep import bench_layer_ep, torchrun_command

    command = torchrun_command(argv if argv is not None else sys.argv[1:],
                               None if argv is not None else sys.argv[0])
    result = bench_layer_ep(args.ep, args.shapes, args.tokens, args.routing, args.rates,
                            args.methods or list(EP_METHODS), args.device, args.dtype,
                            args.iters, args.warmup, args.rotate, args.trace, args.out,
                            args.append_md, command,
                            [None if p == "none" else p for p in args.policies or ["none"]],
                            args.replica_slots)
    if result is None:  # ranks > 0
        return None
    meta = result["meta"]
    print(f"{meta['device']} x{meta['world_size']} ({meta['backend']}): wrote "
          f"{args.out}/layer_bench_ep.{{json,md}}; ms are max over ranks, bytes summed")
    for r in result["records"]:
        if r.get("status") == FAILED:
            print(f"{r['shape']:>14} {r['tokens_per_rank']:>6}/rank {r['routing']:>8} "
                  f"{r['label']:>14} {_failed(r)}")
            continue
        ph = r["phases_ms"]
        ratio = "-" if r["vs_dropless"] is None else f"{r['vs_dropless']:.3f}"
        bratio = "-" if r["bwd_bytes_vs_c0"] is None else f"{r['bwd_bytes_vs_c0']:.3f}"
        print(f"{r['shape']:>14} {r['tokens_per_rank']:>6}/rank {r['routing']:>8} "
              f"{r['label']:>14} fwd {r['fwd_ms']:8.2f} bwd {r['bwd_ms']:8.2f} ms "
              f"(x dropless {ratio})  a2a ms "
              + " ".join(f"{k[4:]} {ph.get(k, float('nan')):.2f}" for k in A2A_PHASES)
              + f"  a2a MB fwd {r['a2a_bytes_fwd'] / 1e6:.2f} bwd {r['a2a_bytes_bwd'] / 1e6:.2f}"
              f" (bwd x c=0 {bratio})")
    return result
