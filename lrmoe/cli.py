"""The ``lrmoe`` command line: ``lrmoe train ...``, ``lrmoe export ...``, ``lrmoe plan
...``, ``lrmoe data wordnet-alpaca ...``, ``lrmoe sim ...``, ``lrmoe calibrate ...``, and
``lrmoe bench layer|a2a ...`` where :mod:`lrmoe.bench` is installed
(more subcommands go into :func:`build_parser`).

Exit status: 0 on success, 2 on a usage or config error (the message names the setting),
130 when a training run was stopped by Ctrl-C (after saving a checkpoint).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _add_backward_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`lrmoe.BackwardConfig` field whose metadata names one (type,
    choices and help from the field: a new knob gets its flag where it is declared)."""
    import dataclasses
    import typing

    from lrmoe.moe.config import BackwardConfig

    hints = typing.get_type_hints(BackwardConfig)
    for f in dataclasses.fields(BackwardConfig):
        meta = f.metadata
        if not meta.get("flag"):
            continue
        names = [meta["short"], meta["flag"]] if meta.get("short") else [meta["flag"]]
        kind = hints[f.name]
        p.add_argument(*names, dest=f"lrmoe.{f.name}", metavar=meta.get("metavar"),
                       type=None if meta.get("choices") else kind,
                       choices=meta.get("choices"),
                       help=f"{meta['help']} (lrmoe.{f.name})")


def _add_train_parser(sub: Any) -> None:
    from lrmoe.planner.plan import POLICIES
    from lrmoe.training.compose import PRESETS

    p = sub.add_parser(
        "train", help="train or fine-tune a Qwen3-MoE model with LRMoE layers",
        description=(
            "Train a Qwen3-MoE model (random init, or --init-from a transformers checkpoint) "
            "whose sparse-MoE blocks are LRMoE layers. Settings come in sections (model, data, "
            "optim, lrmoe, parallel, run) and compose as: --preset (default tiny), then "
            "--config FILE (nested YAML), then --set section.key=value, then the direct flags "
            "below. A key's bare name works too (--set lr=1e-3 is optim.lr, --set data=... "
            "is data.source). All keys: lrmoe train --print-config."),
        formatter_class=_HelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="starting configuration (default: tiny; on --resume: the checkpoint's)")
    p.add_argument("--config", metavar="FILE",
                   help="YAML file, nested by section (configs/tiny.yaml); flat keys of "
                        "earlier versions are read with a note")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
                   help="override one key (repeatable), e.g. --set optim.lr=1e-3 --set "
                        "model.num_experts=16; the bare name also works (--set lr=1e-3 = "
                        "optim.lr); values are YAML")
    _add_backward_flags(p)
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--data", metavar="SPEC", help="gcide | alpaca:PATH | text:PATH")
    p.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json to use instead of "
                                                       "training a BPE on the data")
    p.add_argument("--init-from", metavar="DIR", help="transformers checkpoint to fine-tune")
    p.add_argument("--out", metavar="DIR", dest="out_dir", help="run directory")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--ep", type=int, metavar="N", dest="ep_size",
                   help="expert-parallel size; run under torchrun --nproc-per-node N "
                        "(config key parallel.ep_size)")
    p.add_argument("--policy", choices=POLICIES,
                   help="placement of expert instances under --ep (replicas; "
                        "parallel.policy); default: fixed ownership without the planner")
    p.add_argument("--memory-budget", metavar="SIZE", dest="memory_budget",
                   help="per-GPU bytes the placement plan must fit, e.g. 80GiB "
                        "(parallel.memory_budget; default: no limit)")
    p.add_argument("--resident-bytes", type=int, metavar="N", dest="resident_bytes",
                   help="bytes outside the MoE experts and token buffers (parallel."
                        "resident_bytes; default: measured on the GPU, 0 on the CPU)")
    p.add_argument("--replica-slots", type=int, metavar="R", dest="replica_slots",
                   help="spare expert slots per rank for replicas (parallel.replica_slots)")
    p.add_argument("--dp", type=int, metavar="D", dest="dp_size",
                   help="data-parallel size of a DP x EP run: torchrun --nproc-per-node "
                        "D*N ranks on a (dp, ep) mesh, experts replicated over dp "
                        "(config key parallel.dp_size)")
    p.add_argument("--tensorboard", action="store_true", default=None,
                   help="also write the metrics as TensorBoard scalars to OUT/tensorboard "
                        "(run.tensorboard)")
    p.add_argument("--time-moe", action="store_true", default=None, dest="time_moe",
                   help="log moe_time_ms per step: the MoE layers' forward + backward time "
                        "(run.time_moe)")
    p.add_argument("--record-trace", metavar="PATH", dest="record_trace",
                   help="save the routed expert ids (.npz) for `lrmoe bench layer --routing "
                        "trace`")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                   help="continue from a checkpoint dir, or the newest checkpoint of a run dir "
                        "(default: of --out / the config's out_dir); the run goes on in the "
                        "checkpoint's run dir unless --out names another")
    p.add_argument("--overwrite", action="store_true",
                   help="a fresh run may replace the run files already in the out dir")
    p.add_argument("--print-config", action="store_true",
                   help="print the composed config as YAML and exit")
    p.set_defaults(func=_cmd_train)


def _add_export_parser(sub: Any) -> None:
    """``lrmoe export RUN_DIR OUT``: a plain transformers checkpoint (lrmoe/training/export.py)."""

    p = sub.add_parser(
        "export", help="write a run's checkpoint as a plain transformers checkpoint",
        description=(
            "Write the newest checkpoint of RUN_DIR (or the checkpoint folder RUN_DIR) into "
            "OUT as model.safetensors (sharded with model.safetensors.index.json above "
            "--max-shard-size), config.json, generation_config.json, tokenizer.json and "
            "tokenizer_config.json, which transformers' AutoModelForCausalLM and "
            "AutoTokenizer load without lrmoe. The checkpoint's sharded state (any EP / DP "
            "size) is read whole in this process (docs/training.md \"Export to "
            "transformers\")."),
        formatter_class=_HelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="run directory of lrmoe train (its --out), or one of its "
                        "checkpoints/step-XXXXXXXX")
    p.add_argument("out", metavar="OUT", help="folder to write (must be empty or missing)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest safetensors file, e.g. 500MB (default: 5GB, "
                        "lrmoe.training.export.DEFAULT_MAX_SHARD_SIZE)")

    def _cmd(args: argparse.Namespace) -> int:
        from lrmoe.utils.extras import require
        require("hf", "lrmoe export")
        from lrmoe.training.export import (DEFAULT_MAX_SHARD_SIZE, describe,
                                           export_checkpoint, resolve_checkpoint)

        text = args.max_shard_size or DEFAULT_MAX_SHARD_SIZE
        size = int(text) if str(text).strip().isdigit() else text
        ckpt = resolve_checkpoint(args.run_dir)
        out = export_checkpoint(ckpt, args.out, overwrite=args.overwrite, max_shard_size=size)
        print(f"lrmoe export: {ckpt} -> {out}: {describe(out)}")
        return 0

    p.set_defaults(func=_cmd)


def _add_bench_parser(sub: Any) -> None:
    """``lrmoe bench layer ...`` and ``lrmoe bench a2a ...`` when :mod:`lrmoe.bench` is
    present."""
    try:
        from lrmoe.bench.cli import add_layer_arguments, run_layer
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("lrmoe.bench"):
            return
        raise
    p = sub.add_parser("bench", help="benchmarks (lrmoe bench layer|a2a --help)")
    benches = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    benches.required = True
    layer = benches.add_parser(
        "layer", help="one MoE layer: LRMoE against the dropless, transformers and "
        "torchtitan baselines",
        formatter_class=_HelpFormatter)
    add_layer_arguments(layer)

    def _cmd_bench_layer(args: argparse.Namespace) -> int:
        run_layer(args, args.raw_argv[2:])
        return 0

    layer.set_defaults(func=_cmd_bench_layer)

    a2a = benches.add_parser(
        "a2a", help="the all-to-all link of one node, measured, as a link file for lrmoe sim",
        description=(
            "Under torchrun --nproc-per-node N (N >= 2): time all_to_all_single over a sweep "
            "of message sizes, fit latency + bytes / bandwidth (the simulator's link model) "
            "and write a2a.{json,md} and links.yaml (lrmoe sim --links) under --out "
            "(lrmoe/bench/a2a.py)."),
        formatter_class=_HelpFormatter)
    a2a.add_argument("--sizes-kib", nargs="+", type=int, default=None,
                     help="bytes each rank sends each peer, KiB (default: 4 16 64 256 1024 "
                          "4096 16384 65536)")
    a2a.add_argument("--iters", type=int, default=20, help="timed calls per size (median)")
    a2a.add_argument("--warmup", type=int, default=5, help="untimed calls per size first")
    a2a.add_argument("--device", default=None, choices=("cuda", "cpu"),
                     help="cuda (NCCL, each rank its cuda:LOCAL_RANK) or cpu (gloo) "
                          "(default: cuda if present)")
    a2a.add_argument("--base-links", default=None, metavar="FILE.yaml",
                     help="link file whose inter-node figures the result keeps (default: "
                          "configs/links/default.yaml)")
    a2a.add_argument("--out", default="a2a-out", help="folder for a2a.{json,md}, links.yaml")

    def _cmd_bench_a2a(args: argparse.Namespace) -> int:
        import shlex

        from lrmoe.bench.a2a import DEFAULT_SIZES_KIB, bench_a2a
        world = os.environ.get("WORLD_SIZE", "N")
        command = (f"torchrun --nproc-per-node {world} -m lrmoe "
                   + " ".join(shlex.quote(a) for a in args.raw_argv))
        result = bench_a2a(args.sizes_kib or DEFAULT_SIZES_KIB, args.iters, args.warmup,
                           args.device, args.out, args.base_links, command)
        if result is not None:
            f = result["fit"]
            print(f"all-to-all, {result['meta']['world_size']} x {result['meta']['device']}: "
                  f"latency {f['latency_us']:.2f} us, {f['GBps']:.2f} GB/s per rank; wrote "
                  f"{args.out}/a2a.{{json,md}} and {args.out}/links.yaml")
        return 0

    a2a.set_defaults(func=_cmd_bench_a2a)

    step = benches.add_parser(
        "step", help="the whole lrmoe train step at a preset: tok/s, MoE share, MFU",
        description=(
            "Short lrmoe train runs of one preset at each c and attention implementation, "
            "in this process one after another: median step time, tokens/s, MoE-layer "
            "time and share, model-FLOP utilisation, peak memory, and the ratio to c = 0 "
            "(lrmoe/bench/step.py). --profile adds a torch.profiler table of the first "
            "cell's device time by kernel kind."), formatter_class=_HelpFormatter)
    step.add_argument("--preset", default="qwen3-slice", help="lrmoe train preset")
    step.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.3, 0.5],
                      help="recalibration rates c (0 first: the baseline)")
    step.add_argument("--attention", nargs="+", default=["sdpa"],
                      help="run.attention values: sdpa, flex_attention")
    step.add_argument("--steps", type=int, default=12, help="steps per cell")
    step.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    step.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                      help="lrmoe train setting for every cell (repeatable)")
    step.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"],
                      help="run.compile values of the lrmoe cells (torch.compile of the "
                           "dense modules); 'off on' runs every cell both ways")
    step.add_argument("--profile", action="store_true", help="profile the first cell")
    step.add_argument("--peak-tflops", type=float, default=None,
                      help="the GPU's dense bf16 peak (default: the H200's 989)")
    step.add_argument("--out", default="runs/bench-step", help="folder of the cells and "
                      "step.json / step.md")
    step.add_argument("--methods", nargs="+", default=None,
                      choices=["lrmoe", "titan", "titan-lrmoe"],
                      help="kinds of cell: lrmoe train; torchtitan's Qwen3 MoE model with "
                           "its own MoE; that model with LRMoE experts at each c (default: "
                           "lrmoe)")
    step.add_argument("--titan", action="store_true",
                      help="all three kinds (--methods lrmoe titan titan-lrmoe); needs "
                           "requirements/torchtitan.txt")
    step.add_argument("--titan-attention", default="auto",
                      choices=["auto", "flex", "flex_flash", "varlen", "dense"],
                      help="attention of the torchtitan cells: auto = torchtitan's flex "
                           "(document mask) on CUDA, dense (the same mask, sdpa) on the CPU")

    def _cmd_bench_step(args: argparse.Namespace) -> int:
        from lrmoe.bench.step import H200_BF16_TFLOPS, bench_step

        if args.titan and args.methods is not None:
            raise ValueError("lrmoe bench step: give --titan or --methods, not both "
                             "(--titan is --methods lrmoe titan titan-lrmoe)")
        methods = (["lrmoe", "titan", "titan-lrmoe"] if args.titan
                   else args.methods or ["lrmoe"])
        result = bench_step(args.preset, args.rates, args.attention, args.steps, args.warmup,
                            args.sets, Path(args.out), profile=args.profile,
                            peak_tflops=args.peak_tflops or H200_BF16_TFLOPS,
                            methods=methods, titan_attention=args.titan_attention,
                            compiles=[c == "on" for c in args.compile])
        from lrmoe.bench.step import markdown
        print(markdown(result), end="")
        return 0

    step.set_defaults(func=_cmd_bench_step)


def _add_plan_parser(sub: Any) -> None:
    """``lrmoe plan ...``: placement policies on routed loads (lrmoe/planner/report.py)."""
    from lrmoe.planner.report import add_plan_arguments, run_plan

    p = sub.add_parser(
        "plan", help="plan expert placement and retention quotas per policy",
        description=(
            "Plan one MoE layer's expert placement with each policy (fixed, ultraep, symi, "
            "lrmoe) on synthetic or traced routed loads, and print per-rank loads, replicas, "
            "quotas, the memory breakdown and feasibility (docs/planner.md)."),
        formatter_class=_HelpFormatter)
    add_plan_arguments(p)
    p.set_defaults(func=run_plan)


def _add_data_parser(sub: Any) -> None:
    """``lrmoe data wordnet-alpaca ...``: build instruction data (lrmoe/data/wordnet.py)."""
    p = sub.add_parser("data", help="build training data files")
    kinds = p.add_subparsers(dest="data_command", metavar="KIND")
    kinds.required = True
    w = kinds.add_parser(
        "wordnet-alpaca", help="Alpaca-format JSONL from WordNet 3.0 (apt-get install "
                               "wordnet-base)",
        description=(
            "Write Alpaca-format instruction records (definition, synonyms, example sentence, "
            "hypernym of every WordNet lemma) as JSONL for --data alpaca:PATH, and the "
            "WordNet licence beside it (PATH.LICENSE.txt). Reproducible: the same database "
            "gives the same file (lrmoe/data/wordnet.py)."),
        formatter_class=_HelpFormatter)
    w.add_argument("--out", required=True, metavar="PATH", help="JSONL file to write")
    w.add_argument("--wordnet-dir", default="/usr/share/wordnet", metavar="DIR",
                   help="folder holding index.noun, data.noun, ... (Debian wordnet-base)")
    w.add_argument("--max-senses", type=int, default=3, metavar="N",
                   help="senses listed in a definition record")

    def _cmd(args: argparse.Namespace) -> int:
        from lrmoe.data.wordnet import build
        if args.max_senses < 1:
            raise ValueError(f"--max-senses must be >= 1, got {args.max_senses}")
        counts = build(args.out, args.wordnet_dir, args.max_senses)
        print(f"wrote {counts.pop('total')} records to {args.out} ("
              + ", ".join(f"{n} {t}" for t, n in counts.items()) + f"); licence: "
              f"{args.out}.LICENSE.txt")
        return 0

    w.set_defaults(func=_cmd)


def _add_calibrate_parser(sub: Any) -> None:
    """``lrmoe calibrate ...``: the simulator's cost model (lrmoe/bench/calibrate.py)."""
    from lrmoe.bench.calibrate import add_calibrate_arguments, calibrate

    p = sub.add_parser(
        "calibrate", help="measure the cluster simulator's cost model on this device",
        description=(
            "Time grouped-GEMM forward/backward over a grid of experts per rank and rows per "
            "expert, the other MoE kernels per row, copy and host-to-device bandwidth, and "
            "write them to a cost file for `lrmoe sim` (docs/simulation.md)."),
        formatter_class=_HelpFormatter)
    add_calibrate_arguments(p)

    def _cmd(args: argparse.Namespace) -> int:
        res = calibrate(args.out, args.device, args.shapes, args.quick, args.iters,
                        command="lrmoe " + " ".join(args.raw_argv), ep=args.ep)
        print(f"calibrate: {res['meta']['device']}: wrote {args.out} "
              f"({res['meta']['seconds']:.0f} s)")
        return 0
    p.set_defaults(func=_cmd)


def _add_sim_parser(sub: Any) -> None:
    """``lrmoe sim ...``: the cluster simulator (lrmoe/sim/simulate.py, lrmoe/sim/report.py)."""
    from lrmoe.sim.report import add_sim_arguments

    p = sub.add_parser(
        "sim", help="simulate MoE layers on a cluster (figures like the paper's; simulated)",
        description=(
            "Replay routed loads (a routing trace or synthetic skew) through each placement "
            "policy and a measured cost model: per-layer time, traffic, memory, feasibility, "
            "batch pressure and time to loss, as JSON and PNGs (docs/simulation.md). Every "
            "number is simulated."),
        formatter_class=_HelpFormatter)
    add_sim_arguments(p)

    def _cmd(args: argparse.Namespace) -> int:
        from lrmoe.utils.extras import require
        require("sim", "lrmoe sim (link files, figures)")
        from lrmoe.sim.report import print_summary, run_sim
        out = run_sim(args)
        print_summary(out)
        print(f"lrmoe sim: wrote {args.out}/sim.json and figures ({out['seconds']:.1f} s)")
        return 0
    p.set_defaults(func=_cmd)


def build_parser() -> argparse.ArgumentParser:
    """The ``lrmoe`` argument parser with its subcommands (``train``, ``export``, ...;
    ``bench layer`` where :mod:`lrmoe.bench` exists)."""
    parser = argparse.ArgumentParser(
        prog="lrmoe", description="LRMoE: exact-forward, planned-backward MoE training")
    parser.add_argument("--version", action=_VersionAction, nargs=0,
                        help="the lrmoe version, the torch it was built with and runs on, "
                             "and whether its CUDA kernels are built")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_train_parser(sub)
    _add_export_parser(sub)
    _add_bench_parser(sub)
    _add_plan_parser(sub)
    _add_data_parser(sub)
    _add_calibrate_parser(sub)
    _add_sim_parser(sub)
    return parser


def version_text() -> str:
    """``lrmoe --version``: e.g. ``lrmoe 0.1.0 (torch 2.11.0+cu130; built with torch
    2.11.0+cu130, CUDA kernels: yes)``."""
    import torch

    import lrmoe
    from lrmoe.ops import build_info

    info = build_info()
    built = ("built with torch (not recorded)" if info is None else
             f"built with torch {info.TORCH_VERSION}, CUDA kernels: "
             f"{'yes' if info.WITH_CUDA else 'no'}")
    return f"lrmoe {lrmoe.__version__} (torch {torch.__version__}; {built})"


class _VersionAction(argparse.Action):
    """``--version``: :func:`version_text` on one line (argparse's own version action wraps
    it at the terminal width) and exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


class _HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" only where X is a real default the help does not state."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS, False)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def train_overrides(args: argparse.Namespace) -> Dict[str, Any]:
    """The direct flags of ``lrmoe train`` (parsed by :func:`build_parser`) as flat config
    keys for :func:`lrmoe.training.train.build_config` (None: not given)."""
    backward = {k: v for k, v in vars(args).items() if k.startswith("lrmoe.")}
    return {**backward, "steps": args.steps, "data": args.data, "tokenizer": args.tokenizer, "init_from": args.init_from,
            "out_dir": args.out_dir, "device": args.device, "record_trace": args.record_trace,
            "ep_size": args.ep_size, "dp_size": args.dp_size, "tensorboard": args.tensorboard,
            "time_moe": args.time_moe, "policy": args.policy,
            "memory_budget": args.memory_budget, "resident_bytes": args.resident_bytes,
            "replica_slots": args.replica_slots}


def _cmd_train(args: argparse.Namespace) -> int:
    from lrmoe.training import train as T

    overrides = train_overrides(args)
    ckpt = None
    if args.resume is not None:
        # where to look: --resume DIR, else --out, else the composed config's out_dir
        probe = T.build_config(args.preset, args.config, args.sets, overrides)
        ckpt = T.find_checkpoint(args.resume or None, probe.run.out_dir)
        base = T.read_checkpoint_config(ckpt)
        if args.out_dir is None and args.resume and ckpt.parent.name == "checkpoints":
            # the run the checkpoint belongs to, even when --config/--preset name another
            # out_dir: resuming continues that run unless --out says otherwise
            overrides["out_dir"] = str(ckpt.parent.parent)
        cfg = T.build_config(args.preset, args.config, args.sets, overrides, base=base)
    else:
        cfg = T.build_config(args.preset, args.config, args.sets, overrides)
    if args.print_config:
        sys.stdout.write(T.config_yaml(cfg))
        return 0
    try:
        result = T.train(cfg, resume=ckpt, overwrite=args.overwrite)
    finally:
        # the process group a torchrun run joined ends with the command, before the
        # interpreter's exit: gloo's worker threads freeing a finished collective during
        # Py_Finalize can abort a rank that passed (tests/python/parallel/test_expert_parallel.py)
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return EXIT_INTERRUPTED if result.interrupted else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``lrmoe`` console script and ``python -m lrmoe``.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status (see the module docstring).
    """
    parser = build_parser()
    raw = list(argv) if argv is not None else sys.argv[1:]
    args = parser.parse_args(raw)
    args.raw_argv = raw
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"lrmoe {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as exc:
        if "pip install 'lrmoe[" not in str(exc) and "requirements/" not in str(exc):
            # not a missing extra or requirements file: a real bug
            raise
        print(f"lrmoe {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # only training has checkpoints; a benchmark or a simulation leaves its earlier
        # files as they were (each writes its outputs when it has finished)
        what = (" (nothing saved since the last checkpoint)" if args.command == "train"
                else "; earlier output files are as they were")
        print(f"lrmoe {args.command}: aborted by Ctrl-C{what}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
