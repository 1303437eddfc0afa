"""``lrmoe plan``: plan one layer with each placement policy and report loads, replicas,
quotas, memory per rank and feasibility (text table, ``--json``, PNG figures).

The planning is :func:`lrmoe.planner.plan.plan`; this module reads the command's arguments,
builds the routed loads (synthetic or from a routing trace) and lays out the results.
docs/planner.md shows the output and explains each column.

Legend: W ranks, E experts, ``load_WE`` routed pairs per (source, expert).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from lrmoe.moe.stats import max_over_mean
from lrmoe.planner import plan as P
from lrmoe.workload.loads import synthetic_loads, trace_loads
from lrmoe.utils.extras import require
from lrmoe.workload.shapes import MODELS, ModelShape


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``lrmoe plan`` (defaults: the paper's EP8 setting)."""
    from lrmoe.ops import QUOTA_RULES

    src = p.add_argument_group("routed loads")
    src.add_argument("--loads", choices=("uniform", "zipf", "trace"), default="zipf",
                     help="synthetic uniform or Zipf loads, or a routing trace (--trace)")
    src.add_argument("--max-over-mean", type=float, default=4.0, metavar="X",
                     help="Zipf skew: the hottest expert's load over the mean expert load")
    src.add_argument("--trace", metavar="PATH",
                     help="routing trace .npz from `lrmoe train --record-trace` (--loads trace)")
    src.add_argument("--record", type=int, metavar="N",
                     help="plan one (step, layer) record of the trace instead of resampling")
    src.add_argument("--tokens-per-rank", type=int, default=4 * 8192, metavar="T",
                     help="tokens per source rank (the paper: micro-batch 4 x 8192); each "
                          "routes top_k pairs")
    src.add_argument("--seed", type=int, default=0, help="seed of the synthetic draw/resampling")
    m = p.add_argument_group("cluster and model")
    m.add_argument("--ep", type=int, default=8, metavar="W", help="expert-parallel size")
    m.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b",
                   help="model shape for expert and token-row bytes")
    m.add_argument("--experts", type=int, default=0, metavar="E",
                   help="override the model's expert count (synthetic loads; e.g. 16 with "
                        "--exact, which takes E <= 16)")
    m.add_argument("--budget", default="80GiB", help="device memory per GPU")
    m.add_argument("--resident", default="64GiB",
                   help="bytes outside this layer's experts and token buffers")
    m.add_argument("--optimizer", choices=("device", "host"), default="device",
                   help="where the experts' optimizer state lives")
    pol = p.add_argument_group("policy")
    pol.add_argument("--policy", choices=P.POLICIES + ("all",), default="all")
    pol.add_argument("-c", "--recalibration-rate", type=float, default=0.3, metavar="C",
                     help="c for the lrmoe policy (the baselines keep every pair)")
    pol.add_argument("--quota-rule", choices=QUOTA_RULES, default="proportional")
    pol.add_argument("--replica-slots", type=int, default=2, metavar="R",
                     help="spare expert slots per rank (ultraep, symi; lrmoe's most replicas "
                          "per rank)")
    pol.add_argument("--symi-slots", type=int, default=0, metavar="S",
                     help="symi slots per GPU (0: ceil(E/W) + R)")
    pol.add_argument("--max-expert-cut", type=float, default=0.5,
                     help="lrmoe: most of one expert's demand it may cut under the budget")
    pol.add_argument("--row-capacity", type=int, default=0, metavar="ROWS",
                     help="most retained rows per rank (0: memory only)")
    pol.add_argument("--balance", type=float, default=P.DEFAULT_BALANCE_SLACK,
                     metavar="SLACK",
                     help="lrmoe: aim at most (1 + SLACK) x the mean retained rows per rank, "
                          "with replicas (default %(default)s; a negative value: memory "
                          "only)")
    pol.add_argument("--min-replica-rows", type=int, default=1, metavar="U",
                     help="ultraep u_min: the fewest rows a replica carries")
    pol.add_argument("--joint", action="store_true",
                     help="lrmoe: refine on one objective, the max rank time of forward + "
                          "retained rows + replica traffic, c as a budget (csrc/planner/joint.h)")
    pol.add_argument("--replica-cost-rows", type=int, default=None, metavar="KAPPA",
                     help="with --joint: one replica's weight and grad traffic in row-times. "
                          "Default: derived from --costs and --links as lrmoe sim does, "
                          "round(t_w / t_row) (lrmoe.sim.simulate.derived_replica_cost_rows); "
                          "without --costs 0 (a replica costs only its slot); a number "
                          "overrides both")
    hw = p.add_argument_group("hardware (the joint plan's replica cost)")
    hw.add_argument("--costs", default=None, metavar="FILE.json",
                    help="with --joint: cost file from `lrmoe calibrate` "
                         "(configs/costs/h200.json) whose expert GEMM curve gives t_row")
    hw.add_argument("--costs-shape", default=None,
                    help="calibrated shape to take the costs from (default: --model)")
    hw.add_argument("--links", default=None, metavar="FILE.yaml",
                    help="with --costs: link costs whose NVLink bandwidth and latency give "
                         "t_w (default: configs/links/default.yaml)")
    pol.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                     help="ranks per node (NVLink domain): ultraep and lrmoe replicate on "
                          "the owner's node first, forward splits prefer same-node "
                          "instances (default 0: one node of all --ep ranks)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of the table")
    out.add_argument("--exact", action="store_true",
                     help="also compute the exact optimum of the max rows per rank (offline; "
                          "W <= 8, E <= 16, R <= 2; no memory limit) and print each policy's "
                          "gap to it")
    out.add_argument("--png", metavar="PREFIX",
                     help="write PREFIX_memory.png (stacked memory per policy) and "
                          "PREFIX_loads.png (per-rank loads)")


def _loads(args: argparse.Namespace, shape: ModelShape):
    """(load_WE, previous_load_E, source description)."""
    W = args.ep
    if args.tokens_per_rank < 1:
        raise ValueError(f"--tokens-per-rank must be >= 1, got {args.tokens_per_rank}")
    if W < 1:
        raise ValueError(f"--ep must be >= 1, got {W}")
    if args.loads != "trace":
        # a trace flag without --loads trace would be ignored without a word
        for flag, value in (("--record", args.record), ("--trace", args.trace)):
            if value is not None:
                raise ValueError(f"{flag} reads a routing trace: it needs --loads trace "
                                 f"(the loads are {args.loads} now)")
    if args.loads == "trace":
        if not args.trace:
            raise ValueError("--loads trace needs --trace PATH (record one with `lrmoe train "
                             "--record-trace PATH`)")
        load, meta = trace_loads(args.trace, W, args.tokens_per_rank, args.record, args.seed)
        if meta["num_experts"] != shape.num_experts:
            raise ValueError(f"trace {args.trace} has E={meta['num_experts']} experts but "
                             f"--model {shape.name} has E={shape.num_experts}")
        prev, _ = trace_loads(args.trace, W, args.tokens_per_rank,
                                None if args.record is None else args.record - 1, args.seed + 1)
        what = f"trace {args.trace}" + (f" record {args.record}" if args.record is not None
                                        else f" resampled to {args.tokens_per_rank} tokens/rank")
        return load, prev.sum(axis=0), what
    pairs = args.tokens_per_rank * shape.top_k
    skew = 1.0 if args.loads == "uniform" else args.max_over_mean
    load = synthetic_loads(W, shape.num_experts, pairs, skew, seed=args.seed)
    # symi plans from the previous step: the same popularity, another draw
    prev = synthetic_loads(W, shape.num_experts, pairs, skew, seed=args.seed + 1,
                             popularity_seed=args.seed)
    what = "uniform" if skew == 1.0 else f"Zipf max/mean {skew:g}"
    return load, prev.sum(axis=0), f"{what}, {pairs} pairs/rank"


def _summary(plan: P.Plan, load_WE: np.ndarray) -> Dict[str, Any]:
    n_E = load_WE.sum(axis=0)
    q = plan.quota_E.numpy()
    mem = plan.memory_W4.numpy()
    worst = int(mem.sum(axis=1).argmax())
    cut = np.where(n_E > 0, 1.0 - q / np.maximum(n_E, 1), 0.0)
    return {
        "policy": plan.policy,
        "feasible": plan.feasible,
        "reason": plan.reason,
        "binding": plan.binding,
        "binding_rank": plan.binding_rank,
        "shortfall": plan.shortfall,
        "replicas": plan.replicas,
        "load_before_max_over_mean": max_over_mean(plan.fixed_rows_W.tolist()),
        "forward_max_over_mean": max_over_mean(plan.forward_rows_W.tolist()),
        "backward_max_over_mean": max_over_mean(plan.backward_rows_W.tolist()),
        "rows_before": plan.fixed_rows_W.tolist(),
        "forward_rows": plan.forward_rows_W.tolist(),
        "backward_rows": plan.backward_rows_W.tolist(),
        "max_forward_rows": plan.max_forward_rows(),
        "forward_bound": plan.forward_bound,
        "max_backward_rows": plan.max_backward_rows(),
        "backward_bound": plan.backward_bound,
        "retained_fraction": float(q.sum() / max(1, n_E.sum())),
        "max_expert_cut": float(cut.max()),
        "quota": q.tolist(),
        "limit_bytes": plan.limit_bytes,
        "peak_rank": worst,
        "memory_bytes_per_rank": {k: mem[:, j].tolist() for j, k in enumerate(
            ("base_experts", "replicas", "forward_tokens", "backward_tokens"))},
        "peak_memory_bytes": {k: int(mem[worst, j]) for j, k in enumerate(
            ("base_experts", "replicas", "forward_tokens", "backward_tokens"))},
    }


def _table(rows: List[Dict[str, Any]], header: str) -> str:
    g = lambda b: f"{b / P.GiB:6.2f}"  # noqa: E731
    ratio = lambda v: "     -" if v is None else f"{v:6.2f}"  # noqa: E731  (None: no rows)
    lines = [header, "",
             f"{'policy':8} {'fits':4} {'rep':>4} {'before':>6} {'fwd':>6} {'bwd':>6} "
             f"{'kept':>5} {'cut':>5} | peak rank GiB: {'base':>6} {'repl':>6} {'fwd tok':>7} "
             f"{'bwd tok':>7} {'total':>6} / limit",
             "-" * 110]
    for r in rows:
        m = r["peak_memory_bytes"]
        lines.append(
            f"{r['policy']:8} {'yes' if r['feasible'] else 'NO':4} {r['replicas']:4d} "
            f"{ratio(r['load_before_max_over_mean'])} {ratio(r['forward_max_over_mean'])} "
            f"{ratio(r['backward_max_over_mean'])} {r['retained_fraction']:5.2f} "
            f"{r['max_expert_cut']:5.2f} | rank {r['peak_rank']:3d}      {g(m['base_experts'])} "
            f"{g(m['replicas'])} {g(m['forward_tokens']):>7} {g(m['backward_tokens']):>7} "
            f"{g(sum(m.values()))} / {r['limit_bytes'] / P.GiB:.2f}")
    lines += ["", "before/fwd/bwd: max/mean rows per rank under fixed ownership, in this plan's "
              "forward and backward; kept: sum(Q)/sum(n); cut: the largest 1 - Q_e/n_e", "",
              "memory per rank, GiB (base + replicas + forward + backward tokens), and quotas:"]
    for r in rows:
        per_rank = np.sum([r["memory_bytes_per_rank"][k] for k in r["memory_bytes_per_rank"]],
                          axis=0) / P.GiB
        q = np.asarray(r["quota"])
        lines.append(f"{r['policy']:8} " + " ".join(f"{v:.2f}" for v in per_rank)
                     + f" | Q_e min {q.min()} median {int(np.median(q))} max {q.max()}")
    lines += ["", "max rows per rank / lower bound (csrc/planner/bound.h; the backward bound "
              "uses the plan's own quotas)" + ("; gap to the exact optimum" if any(
                  "exact" in r for r in rows) else "") + ":"]
    for r in rows:
        line = (f"{r['policy']:8} fwd {r['max_forward_rows']} / {r['forward_bound']}  "
                f"bwd {r['max_backward_rows']} / {r['backward_bound']}")
        x = r.get("exact")
        if x:
            line += (f" | optimum fwd {x['forward_optimum']}{'' if x['proven'] else ' (unproven)'}"
                     f" gap {100 * x['forward_gap']:+.2f} %, bwd {x['backward_optimum']} gap "
                     f"{100 * x['backward_gap']:+.2f} %")
        lines.append(line)
    for r in rows:
        if not r["feasible"]:
            lines.append(f"{r['policy']}: infeasible: {r['reason']}")
    return "\n".join(lines)


def exact_gaps(plans: List[P.Plan], load_WE: np.ndarray, replica_slots: int) -> List[Dict[str, Any]]:
    """Each plan's gap to the exact optimum of its objectives (no memory limit): the forward
    against the instance optimum of the routed demand (the smaller of the owners and free
    models, which hold every policy's placements), the backward against the optimum of the
    plan's own quotas (= the forward for the baselines). gap = max rows / optimum - 1.

    Raises:
        ValueError: the instance is too large for the exact search (W > 8, E > 16, R > 2).
    """
    def best(pair):
        done = [x for x in pair if x.proven] or list(pair)
        return min(x.optimum for x in done), all(x.proven for x in pair)

    fwd, fwd_proven = best(P.instance_optimum(load_WE, replica_slots))
    out = []
    for plan in plans:
        if plan.policy == "lrmoe" and not np.array_equal(plan.quota_E.numpy(), load_WE.sum(axis=0)):
            bwd, bwd_proven = best(P.instance_optimum(load_WE, replica_slots, plan.quota_E.numpy()))
        else:
            bwd, bwd_proven = fwd, fwd_proven
        gap = lambda v, o: (v / o - 1.0) if o > 0 else 0.0  # noqa: E731
        out.append({"forward_optimum": fwd, "backward_optimum": bwd,
                    "proven": fwd_proven and bwd_proven,
                    "forward_gap": gap(plan.max_forward_rows(), fwd),
                    "backward_gap": gap(plan.max_backward_rows(), bwd)})
    return out


def _figures(rows: List[Dict[str, Any]], prefix: str) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = ("base_experts", "replicas", "forward_tokens", "backward_tokens")
    labels = ("base experts", "replicas", "forward token buffers", "backward token buffers")
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for part, label in zip(parts, labels):
        v = np.array([r["peak_memory_bytes"][part] for r in rows]) / P.GiB
        ax.bar(x, v, bottom=bottom, label=label)
        bottom += v
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.2f}", ha="center", va="bottom")
    ax.axhline(rows[0]["limit_bytes"] / P.GiB, color="k", ls="--", lw=1, label="budget - resident")
    ax.set_xticks(x, [r["policy"] for r in rows])
    ax.set_ylabel("GiB on the peak rank (one MoE layer)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    mem_png = Path(f"{prefix}_memory.png")
    mem_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(mem_png, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.2), sharey=True,
                             squeeze=False)
    for ax, r in zip(axes[0], rows):
        ranks = np.arange(len(r["forward_rows"]))
        if r["rows_before"][0] >= 0:
            ax.step(ranks, r["rows_before"], where="mid", color="grey", label="fixed ownership")
        ax.bar(ranks - 0.2, r["forward_rows"], width=0.4, label="forward")
        ax.bar(ranks + 0.2, r["backward_rows"], width=0.4, label="backward (retained)")
        ax.set_title(r["policy"])
        ax.set_xlabel("rank")
    axes[0][0].set_ylabel("rows")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    load_png = Path(f"{prefix}_loads.png")
    fig.savefig(load_png, dpi=120)
    plt.close(fig)
    return [mem_png, load_png]


def replica_cost(args: argparse.Namespace, shape: ModelShape, load_WE: np.ndarray):
    """The joint lrmoe plan's replica cost kappa (rows) for ``lrmoe plan`` and where it
    came from: ``--replica-cost-rows`` when given; else, with ``--costs``, the one
    ``lrmoe sim`` derives, :func:`lrmoe.sim.simulate.derived_replica_cost_rows` of
    ``load_WE`` (round(t_w / t_row): one expert's weights over the NVLink of ``--links``
    over one row of the cost file's expert GEMMs at E / W experts per rank); else 0.

    Args:
        args: parsed ``lrmoe plan`` arguments (``joint``, ``replica_cost_rows``,
            ``costs``, ``costs_shape``, ``links``, ``model``).
        shape: the planned model (its hidden and moe_intermediate sizes give t_w).
        load_WE: (W, E) routed pairs of the planned layer (their mean per expert is r).

    Returns:
        (kappa >= 0, a one-line description of its source for the report). kappa is 0
        without ``--joint`` (the sequential plan does not read it).

    Raises:
        ValueError: ``--replica-cost-rows`` < 0, or given (non-zero) without ``--joint``;
            ``--costs``, ``--costs-shape`` or ``--links`` without ``--joint`` (they would
            be read for nothing), ``--costs-shape`` or ``--links`` without ``--costs``;
            a cost file without the shape, a bad link file, a layer with no routed pair
            (each naming the option).
        FileNotFoundError: no file at ``--costs`` or ``--links``.
        ModuleNotFoundError: ``--links``/``--costs`` without the ``sim`` extra (yaml).
    """
    k = args.replica_cost_rows
    if k is not None and k < 0:
        raise ValueError(f"--replica-cost-rows must be >= 0 (one replica's traffic in "
                         f"row-times), got {k}")
    if k and not args.joint:  # read by the joint objective only
        raise ValueError("--replica-cost-rows is a term of lrmoe's joint objective and does "
                         "nothing without it; add --joint or drop --replica-cost-rows")
    hw = [(f, v) for f, v in (("--costs", args.costs), ("--costs-shape", args.costs_shape),
                              ("--links", args.links)) if v is not None]
    if hw and not args.joint:
        raise ValueError(f"{hw[0][0]} is read by lrmoe plan only to derive the joint plan's "
                         f"replica cost; add --joint or drop {' and '.join(f for f, _ in hw)}")
    if args.costs is None and hw:
        flag = hw[0][0]
        raise ValueError(f"{flag} refines the replica cost derived from a cost file; give "
                         f"--costs FILE.json (configs/costs/h200.json) or drop {flag}")
    if not args.joint:
        return 0, "not read: no --joint"
    if k is not None:
        return int(k), "--replica-cost-rows" + (
            "; --costs not used" if args.costs is not None else "")
    if args.costs is None:
        return 0, ("default without --costs: a replica costs only its slot; give --costs "
                   "FILE.json [--links FILE.yaml] to derive it as lrmoe sim does, or "
                   "--replica-cost-rows N")
    require("sim", "lrmoe plan --costs (link files)", ["yaml"])
    # the same rule and code as lrmoe sim (lrmoe/sim/report.py _kappa), so a plan and a
    # simulation of one layer charge a replica alike; imported here because lrmoe.sim
    # needs the simulator extension's sim module, which plain planning does not
    from lrmoe.sim import simulate as S
    from lrmoe.sim.costs import Costs
    from lrmoe.sim.links import Links

    cshape = args.costs_shape or args.model
    costs = Costs.from_file(args.costs, cshape)
    links = Links.from_file(args.links, flag="--links")
    kappa = S.derived_replica_cost_rows(shape, costs, links, np.asarray(load_WE))
    return int(kappa), (f"derived round(t_w / t_row) from --costs {args.costs} "
                        f"({cshape}) and --links {args.links or 'configs/links/default.yaml'}")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``lrmoe plan`` from parsed arguments; prints the table (or JSON). Returns 0.

    Raises:
        ValueError: bad arguments or input (the message names the option).
        ModuleNotFoundError: ``--png`` without matplotlib (naming ``lrmoe[plots]``).
    """
    if args.png:
        require("plots", "lrmoe plan --png")
    shape = MODELS[args.model]
    if args.experts:
        if args.loads == "trace":
            raise ValueError("--experts overrides the expert count of synthetic loads; a trace "
                             "has its own")
        if args.experts < 1:
            raise ValueError(f"--experts must be >= 1, got {args.experts}")
        shape = dataclasses.replace(shape, num_experts=args.experts)
    memory = P.MemoryModel.from_shape(shape, P.parse_bytes(args.budget, "--budget"),
                                      P.parse_bytes(args.resident, "--resident"),
                                      args.optimizer == "device")
    load_WE, prev_E, what = _loads(args, shape)
    policies = P.POLICIES if args.policy == "all" else (args.policy,)
    if args.joint and "lrmoe" not in policies:
        # the loop below hands joint to the lrmoe plan only, so plan()'s own refusal of
        # joint for another policy never sees it
        raise ValueError(f"--joint refines the lrmoe plan only, and --policy {args.policy} "
                         f"plans no lrmoe; use --policy lrmoe (or all) or drop --joint")
    kappa, kappa_source = replica_cost(args, shape, load_WE)
    rows, plans = [], []
    for name in policies:
        plan = P.plan(load_WE, name, memory, args.recalibration_rate, args.quota_rule,
                      args.replica_slots, args.symi_slots, prev_E, args.max_expert_cut,
                      args.row_capacity, args.min_replica_rows,
                      None if args.balance < 0 else args.balance,
                      joint=args.joint and name == "lrmoe",
                      replica_cost_rows=kappa if name == "lrmoe" else 0,
                      gpus_per_node=args.gpus_per_node or None)
        plans.append(plan)
        rows.append(_summary(plan, load_WE))
    if args.exact:
        for r, x in zip(rows, exact_gaps(plans, load_WE, args.replica_slots)):
            r["exact"] = x
    header = (f"{shape.name} at W={args.ep}, {what}; budget {args.budget}, resident "
              f"{args.resident}, c={args.recalibration_rate:g} (lrmoe), R={args.replica_slots}")
    if args.joint:
        header += f"\njoint lrmoe plan: replica cost kappa = {kappa} rows ({kappa_source})"
    files = _figures(rows, args.png) if args.png else []
    if args.json:
        json.dump({"setting": header, "model": dataclasses.asdict(shape),
                   "memory_model": dataclasses.asdict(memory),
                   "replica_cost_rows": ({"value": kappa, "source": kappa_source}
                                         if args.joint else None),
                   "plans": rows, "figures": [str(f) for f in files]}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(_table(rows, header))
        for f in files:
            print(f"wrote {f}")
    return 0

