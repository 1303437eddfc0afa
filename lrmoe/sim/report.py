"""``lrmoe sim``: the cluster simulator's command line -- JSON and PNG figures laid out like
the paper's Figs. 6, 7, 8 and Table 1, every one labelled "simulated" (docs/simulation.md).

  * Fig. 7 (memory per MoE layer): base experts, replicas, token buffers per policy, the
    largest rank of the worst layer;
  * Fig. 8 (latency per MoE layer): forward and backward phases per policy, mean over
    the simulated (step, layer) plans;
  * Fig. 6 (batch pressure): the base batch multiplied 1x..20x; a plan that does not fit
    takes more, smaller micro-batches, each holding the whole model's activations
    (``--activations``, csrc/sim/activations.h); effective throughput per policy, and the
    multiplier where a perfectly balanced uncompressed backward stops fitting;
  * Table 1 (MoE-layer time to a loss): steps to each target loss from an experiments
    ``results.json`` times the simulated MoE time per step;
  * with ``--scale``: cost per token vs cluster size per policy.

Policies: ``fixed`` (Megatron-LM fixed ownership), ``ultraep``, ``symi``, ``lrmoe``; the
baselines run at c = 0, lrmoe at ``--rate``.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from importlib import resources
from pathlib import Path
import dataclasses
from typing import Optional, Tuple

import numpy as np

from lrmoe.sim import simulate as S
from lrmoe.sim.costs import Costs
from lrmoe.sim.links import Links
from lrmoe.workload.drift import load_fit
from lrmoe.workload.loads import cluster_loads
from lrmoe.utils.paths import check_output
from lrmoe.workload.shapes import MODELS
from lrmoe.sim.table1 import table1
from lrmoe.sim.validate import read_bench, validate
from lrmoe.planner.plan import DEFAULT_BALANCE_SLACK, MAX_BYTES, GiB, POLICIES

LABELS = {"fixed": "Megatron-LM (fixed)", "ultraep": "UltraEP", "symi": "SYMI",
          "lrmoe": "LRMoE"}
SIMULATED = "simulated"
#: the paper's reported numbers the figures are set beside (docs/simulation.md)
PAPER = {"fig7_GiB": {"fixed": 12.88, "ultraep": 8.03, "symi": 12.88, "lrmoe": 5.44},
         "fig8_bwd_ms": {"fixed": 29.64, "lrmoe": 12.69},
         "fig6_at_20x": {"lrmoe": 1.0, "ultraep": 0.584, "symi": 0.449, "fixed": 0.400},
         "fig6_balanced_boundary": 16}
#: the planner flags the documented figures run with (experiments/sim_figs_seeds.py,
#: sim_fig6_seeds.py, sim_drift.py pass them explicitly; they are also ``lrmoe sim``'s
#: defaults): LRMoE's joint plan, UltraEP with its refinement passes and spare-capacity
#: split, as the paper describes both; the all-to-alls deduplicate over the model's
#: top_k (``--dedup-top-k`` left at its default) and the planner knows the nodes of
#: ``--links``. ``--no-joint --no-ultraep-refine --spare-capacity-split none --dedup-top-k
#: 1`` gives the figures of before 2026-12-07's wiring (docs/journal/experiments.md)
FIGURE_FLAGS = ("--joint", "--ultraep-refine", "--spare-capacity-split", "ultraep")


def add_sim_arguments(p) -> None:
    """The options of ``lrmoe sim``."""
    p.add_argument("--costs", required=True, metavar="FILE.json",
                   help="cost file from `lrmoe calibrate` (configs/costs/h200.json)")
    p.add_argument("--costs-shape", default=None,
                   help="calibrated shape to take the costs from (default: --model)")
    p.add_argument("--links", default=None, metavar="FILE.yaml",
                   help="link costs (default: configs/links/default.yaml)")
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the EP group (nodes of 8)")
    p.add_argument("--tokens-per-gpu", type=int, default=4 * 8192,
                   help="tokens per GPU per micro-batch (the paper: 4 x 8192)")
    p.add_argument("--steps", type=int, default=10, help="simulated steps")
    p.add_argument("--layers", type=int, default=None, help="MoE layers (default: model's)")
    p.add_argument("--trace", default=None, help="routing trace .npz (lrmoe train "
                   "--record-trace); default synthetic Zipf skew")
    p.add_argument("--skew", type=float, default=2.0,
                   help="synthetic max/mean expert load per layer")
    p.add_argument("--drift", default="off", metavar="off|fitted|PHI,SIGMA[,JITTER]",
                   help="synthetic loads: each layer's log-popularity drifts across steps as "
                        "an AR(1) (lrmoe.workload.loads.drift_popularity): 'fitted' takes "
                        "phi, sigma and jitter fitted to a real trace (configs/drift/"
                        "gcide-tiny-e32.json; docs/simulation.md, 'Popularity drift'), or "
                        "give them; off (default): a fixed popularity, so SYMI's one-step "
                        "lag costs nothing")
    p.add_argument("--counts", default=None, metavar="FILE.npz",
                   help="replay each step's and layer's popularity from recorded routed "
                        "counts (experiments/results/drift/gcide-tiny-e32-counts.npz; "
                        "lrmoe.workload.loads.counts_loads); not with --trace or --drift")
    p.add_argument("--counts-start", type=int, default=0, metavar="STEP",
                   help="--counts: the recorded step simulated step 0 replays")
    p.add_argument("--counts-control", default="real",
                   choices=("real", "shuffled", "frozen", "ranked"),
                   help="--counts: matched-skew controls (lrmoe.workload.loads."
                        "counts_popularity): 'shuffled' permutes each step's recorded "
                        "expert ids (same skew, no persistence), 'frozen' repeats step "
                        "--counts-start (one step's skew, full persistence), 'ranked' gives "
                        "each step's own loads in step --counts-start's order (same skew, "
                        "fixed ranking); default 'real', the recording as it is")
    p.add_argument("--rate", type=float, default=0.3, help="lrmoe recalibration rate c")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--budget-gib", type=float, default=80.0)
    p.add_argument("--resident-gib", type=float, default=64.0)
    p.add_argument("--replica-slots", type=int, default=2)
    p.add_argument("--balance-slack", type=float, default=DEFAULT_BALANCE_SLACK,
                   help="lrmoe: aim at most (1 + this) x the mean retained rows per rank, "
                        "with replicas (default %(default)s, as the runtime; negative: off)")
    p.add_argument("--offload", action="store_true", help="saved activations on the host")
    p.add_argument("--dedup-top-k", type=int, default=None, metavar="K",
                   help="experts per token the all-to-alls deduplicate over, per rank and "
                        "node (csrc/sim/a2a.h). Default: the model's top_k (8 for "
                        "qwen3-30b-a3b), what a DeepEP-style dispatcher deduplicates over, "
                        "for every policy; 1: one row per (token, expert) pair, what lrmoe's "
                        "own EP layer sends today")
    # the planner's options (lrmoe.planner.plan.plan; docs/planner.md); the defaults are
    # the paper's policies: LRMoE plans jointly, UltraEP has its refinement passes and
    # its spare-capacity split, every policy knows the node boundaries of --links
    p.add_argument("--joint", action=argparse.BooleanOptionalAction, default=None,
                   help="lrmoe: plan where to cut and where to replicate on one objective, "
                        "the max rank time of forward + retained rows + replica traffic, c as "
                        "a budget (csrc/planner/joint.h). Default on (the paper plans them "
                        "together); --no-joint: the sequential plan (fixed-rule quotas, a cut "
                        "only on ranks over budget, then replicas)")
    p.add_argument("--replica-cost-rows", type=int, default=None, metavar="KAPPA",
                   help="with --joint: one replica's cost in rows of expert compute. Default: "
                        "derived, round(t_w / t_row) with t_w one expert's weights (3 H I x "
                        "2 B) over NVLink (intra_GBps + intra latency of --links) and t_row "
                        "one row of the calibrated expert GEMMs, forward and backward averaged, "
                        "at E / W experts per rank and the mean rows per expert "
                        "(lrmoe.sim.simulate.derived_replica_cost_rows); a number overrides it")
    p.add_argument("--ultraep-refine", action=argparse.BooleanOptionalAction, default=None,
                   help="ultraep: refinement passes after the bisection (local moves of rows "
                        "that lower the max rank load; csrc/planner/ultraep_refine.h). Default "
                        "on, as the paper's UltraEP; --no-ultraep-refine: the bisection alone")
    p.add_argument("--spare-capacity-split", default="ultraep", choices=("none", "ultraep", "all"),
                   help="which policies deal the forward rows beyond a source's own rank (and "
                        "node) in proportion to the instances' remaining capacity, UltraEP's "
                        "rule, instead of north-west (the rows per instance are unchanged). "
                        "Default ultraep (the paper's UltraEP)")
    p.add_argument("--replan-threshold", type=float, default=None, metavar="T",
                   help="hysteresis (csrc/planner/hysteresis.h) for fixed, ultraep and lrmoe "
                        "in Figs. 7/8: each layer keeps its previous step's placement unless a "
                        "fresh plan's max rank time is lower by more than T in [0, 1). Default "
                        "off (docs/simulation.md, \"Hysteresis and the price of a move\": it "
                        "does not pay in either replica model). Batch pressure and --scale "
                        "take it too")
    p.add_argument("--resident-replicas", action=argparse.BooleanOptionalAction, default=False,
                   help="ultraep, lrmoe: a replica keeps its slot and weights from step to step; "
                        "one placed anew fetches its weights from the owner in the layer's "
                        "forward, before its GEMMs, every replica is refreshed after the "
                        "optimizer step (csrc/sim/sim.h SimConfig.resident_replicas). Default "
                        "off: the figures' model, weights streamed per layer")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="ranks per node (NVLink domain) for the planner's topology (replicas "
                        "on the owner's node first, forward splits prefer same-node "
                        "instances) and for the all-to-all model. Default: gpus_per_node of "
                        "--links (8 in configs/links/default.yaml); must divide --gpus")
    p.add_argument("--overlap-chunks", type=int, default=None, metavar="N",
                   help="pipeline each layer's token all-to-alls with its expert GEMMs over N "
                        "chunks (chunk i computes while chunk i + 1 is dispatched and i - 1 "
                        "combined; each chunk pays the latencies again and runs 1/N of the "
                        "rows; csrc/sim/sim.h). Default: overlap_chunks of --links (1: the "
                        "phases in sequence, an upper bound)")
    p.add_argument("--overlap-tile-rows", type=int, default=None, metavar="R",
                   help="overlap each layer's token all-to-alls with its expert GEMMs tile "
                        "by tile inside one fused kernel (the Comet approach): rows leave "
                        "and arrive in R-row GEMM tiles, the latencies are paid once, the "
                        "GEMMs run whole on the SMs communication leaves them "
                        "(--overlap-comm-share; csrc/sim/sim.h). Default: overlap_tile_rows "
                        "of --links (0: off). Not with --overlap-chunks > 1")
    p.add_argument("--overlap-comm-share", type=float, default=None, metavar="F",
                   help="with --overlap-tile-rows: the share of the SMs given to "
                        "communication, in [0, 1). Default: overlap_comm_share of --links "
                        "(20 / 132 = 0.152, DeepEP's 20 SMs of an H100 / H200)")
    p.add_argument("--pressure", nargs="*", type=float, default=list(range(1, 21)),
                   help="batch multipliers of Fig. 6 (default 1, 2, ..., 20: a 1x grid, so "
                        "a policy's step where it stops fitting is not an artifact of "
                        "the grid; none: skip)")
    p.add_argument("--pressure-tokens-per-gpu", type=int, default=4096,
                   help="base batch of Fig. 6 (docs/simulation.md says why 4096)")
    p.add_argument("--pressure-steps", type=int, default=2)
    p.add_argument("--activations", default="keep", choices=S.ACTIVATION_MODES,
                   help="Fig. 6's memory (csrc/sim/activations.h; docs/simulation.md, "
                        "'Memory and feasibility'): a micro-batch fits when resident + the "
                        "activations every layer saves for backward + the planned MoE "
                        "layer's experts and token buffers <= budget. keep (default): every "
                        "layer keeps all (attention and norms, --dense-token-bytes, and its "
                        "experts' forward rows); recompute: every layer keeps its input (H "
                        "bf16 per token), one layer is recomputed at a time (its MoE forward "
                        "is timed again); offload: as keep with the experts' gate/up rows on "
                        "the host (as --offload, which it implies). layer: the old default "
                        "(before issue 30): the planned MoE layer's buffers only, against a "
                        "fixed --resident-gib. Figs. 7 and 8 are per MoE layer and do not "
                        "use it")
    p.add_argument("--layers-resident", type=int, default=None, metavar="N",
                   help="--activations: the layers whose activations one GPU holds, the "
                        "planned one included (default: the model's MoE layers, "
                        "lrmoe/workload/shapes.py moe_layers, 48 for qwen3-30b-a3b; fewer "
                        "for a pipeline stage)")
    p.add_argument("--dense-token-bytes", type=int, default=None, metavar="B",
                   help="--activations: bytes one token saves per layer outside the experts "
                        "(default 15 H + 4 E in bf16: the attention and norms of the Megatron "
                        "per-layer activation estimate, without its 5as/h score term, which "
                        "flash attention does not keep, plus fp32 router probabilities; "
                        "lrmoe.sim.simulate.dense_token_bytes)")
    p.add_argument("--results", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="experiments results.json file(s) for Table 1 (steps to loss, "
                        "per seed; several files are merged)")
    p.add_argument("--targets", nargs="*", type=float, default=[],
                   help="target validation losses of Table 1")
    p.add_argument("--scale", nargs="*", type=int, default=[],
                   help="cluster sizes for cost per token vs W (e.g. 64 128 256 512 1024)")
    p.add_argument("--dense-params", type=float, default=None, metavar="N",
                   help="--scale's step terms: parameters outside the routed experts, which "
                        "every GPU all-reduces and steps (default: the model's, "
                        "lrmoe/workload/shapes.py; qwen3-30b-a3b 1.54e9)")
    p.add_argument("--hbm-gbps", type=float, default=S.H200_HBM_GBPS, metavar="GB/s",
                   help="--scale's step terms: device memory GB/s of the bandwidth-bound "
                        "Adam step (default %(default)s, the H200's)")
    p.add_argument("--validate", default=None, metavar="LAYER_BENCH.json",
                   help="also compare the simulation with `lrmoe bench layer` results: "
                        "layer_bench.json at W = 1 (fwd/bwd per shape, tokens and c; target "
                        "within 10 %%) or layer_bench_ep.json at its W and policies (fwd, "
                        "bwd and each all-to-all; target within 15 %%)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="sim-out", help="folder for sim.json and the PNGs")


#: the AR(1) drift fitted to the recorded GCIDE trace (docs/simulation.md, "Popularity drift")
FITTED_DRIFT = Path(str(resources.files("lrmoe") / "configs" / "drift" / "gcide-tiny-e32.json"))


def parse_drift(value: str) -> Optional[Tuple[float, ...]]:
    """``--drift`` -> None (off) or (phi, sigma) / (phi, sigma, jitter).

    Raises:
        ValueError: not off, fitted or PHI,SIGMA[,JITTER] with phi in [0, 1] and sigma,
            jitter >= 0 (naming the flag and the forms it takes).
    """
    v = value.strip().lower()
    if v in ("off", "none", "0"):
        return None
    if v == "fitted":
        return load_fit(FITTED_DRIFT)
    form = ("--drift takes off, fitted or PHI,SIGMA[,JITTER] (the AR(1) persistence per "
            "step in [0, 1], the std of log-popularity's persistent change per step >= 0 "
            f"and of its non-persistent part >= 0, e.g. 0.97,0.1,0.1); got {value!r}")
    parts = v.split(",")
    if len(parts) not in (2, 3):
        raise ValueError(form)
    try:
        nums = tuple(float(x) for x in parts)
    except ValueError:
        raise ValueError(form) from None
    if not (0.0 <= nums[0] <= 1.0 and all(x >= 0.0 for x in nums[1:])):
        raise ValueError(form)
    return nums


def _memory(shape, args, offload=False):
    return S.memory_model(shape, int(args.budget_gib * GiB), int(args.resident_gib * GiB),
                          offload=offload)


def planner_options(args, policy: str, num_ranks: int, derived_kappa: int = 0) -> dict:
    """The planner's options of ``policy`` from ``lrmoe sim``'s resolved flags
    (:func:`resolve_planner_flags`), as keyword arguments of
    :func:`lrmoe.sim.simulate.simulate`: joint and its replica cost for lrmoe only,
    refinement for ultraep only, the spare-capacity split where ``--spare-capacity-split``
    names the policy, and the node size when it is smaller than the ``num_ranks`` group
    (a node of W or more ranks is one node: the flat plan). ``derived_kappa``: the joint
    plan's replica cost when ``--replica-cost-rows`` is not given
    (:func:`lrmoe.sim.simulate.derived_replica_cost_rows`)."""
    g = getattr(args, "planner_gpus_per_node", None)
    split = getattr(args, "spare_capacity_split", "none")
    joint = bool(getattr(args, "joint", False)) and policy == "lrmoe"
    return dict(joint=joint,
                replica_cost_rows=(int(derived_kappa) if getattr(args, "replica_cost_rows", None)
                                   is None else int(args.replica_cost_rows)) if joint else 0,
                ultraep_refine=bool(getattr(args, "ultraep_refine", False)) and policy == "ultraep",
                spare_capacity_split=split == "all" or (split == "ultraep" and policy == "ultraep"),
                gpus_per_node=g if g is not None and g < num_ranks else None)


def resolve_planner_flags(args, links: Links) -> Links:
    """Check the planner flags of ``lrmoe sim`` against each other and the policies, and
    resolve their defaults in ``args`` (``joint``, ``ultraep_refine`` on;
    ``dedup_top_k`` the model's top_k; ``planner_gpus_per_node`` from ``--gpus-per-node``
    or ``links``).

    Returns:
        ``links``, with ``gpus_per_node`` replaced by ``--gpus-per-node`` when given (the
        planner and the all-to-all model see one topology).

    Raises:
        ValueError: naming the flag and the fix: ``--joint`` or ``--ultraep-refine``
            without its policy in ``--policies``, ``--replica-cost-rows`` < 0 or without
            ``--joint``, ``--replan-threshold`` outside [0, 1) or with symi alone,
            ``--gpus-per-node`` < 1 or not dividing ``--gpus``, ``--dedup-top-k`` above the
            model's top_k.
    """
    pols = set(args.policies)
    for flag, v, pol in (("--joint", args.joint, "lrmoe"),
                         ("--ultraep-refine", args.ultraep_refine, "ultraep")):
        if v and pol not in pols:
            raise ValueError(f"{flag} applies to policy {pol} only, which is not in --policies "
                             f"({' '.join(args.policies)}); add {pol} to --policies or drop "
                             f"{flag}")
    args.joint = "lrmoe" in pols if args.joint is None else bool(args.joint)
    args.ultraep_refine = "ultraep" in pols if args.ultraep_refine is None \
        else bool(args.ultraep_refine)
    if args.replica_cost_rows is not None and args.replica_cost_rows < 0:
        raise ValueError(f"--replica-cost-rows must be >= 0 (one replica's traffic in "
                         f"row-times), got {args.replica_cost_rows}")
    if args.replica_cost_rows and not args.joint:
        raise ValueError("--replica-cost-rows is a term of lrmoe's joint objective and does "
                         "nothing without it; drop --no-joint (joint is the default) or drop "
                         "--replica-cost-rows")
    t = args.replan_threshold
    if t is not None:
        if not 0.0 <= t < 1.0:
            raise ValueError(f"--replan-threshold must be in [0, 1) (the fraction of the kept "
                             f"plan's max rank time a new plan must save), got {t}")
        if not pols - {"symi"}:
            raise ValueError("--replan-threshold (hysteresis) applies to fixed, ultraep and "
                             "lrmoe; symi's slots move every step by design. Add one of them "
                             "to --policies or drop --replan-threshold")
    g = args.gpus_per_node
    if g is not None:
        if not g >= 1 or args.gpus % g:
            raise ValueError(f"--gpus-per-node must be an integer >= 1 that divides --gpus "
                             f"{args.gpus} (ranks per node), got {g}; leave it out to take "
                             f"gpus_per_node from --links ({links.gpus_per_node})")
        links = dataclasses.replace(links, gpus_per_node=int(g))
    args.planner_gpus_per_node = int(links.gpus_per_node)
    # the overlap flags override the link file's keys of the same names (csrc/sim/sim.h
    # LinkModel); each (flag, valid?, what a valid value is)
    for attr, ok, need in (
            ("overlap_chunks", lambda v: v >= 1,
             "an integer >= 1 (1: the all-to-alls and expert GEMMs in sequence)"),
            ("overlap_tile_rows", lambda v: v >= 0,
             "an integer >= 0 (rows per GEMM tile; 0: no tile-level overlap)"),
            ("overlap_comm_share", lambda v: math.isfinite(v) and 0 <= v < 1,
             "a number in [0, 1) (the share of the SMs given to communication)")):
        v = getattr(args, attr, None)
        if v is None:
            continue
        flag = "--" + attr.replace("_", "-")
        if not ok(v):
            raise ValueError(f"{flag} must be {need}, got {v}")
        if attr == "overlap_comm_share" and links.overlap_tile_rows == 0:
            raise ValueError("--overlap-comm-share applies to the tile-level overlap only; "
                             "add --overlap-tile-rows R (or overlap_tile_rows in --links)")
        links = dataclasses.replace(links, **{attr: type(getattr(links, attr))(v)})
    if links.overlap_tile_rows > 0 and links.overlap_chunks > 1:
        raise ValueError(f"--overlap-tile-rows (tile-level overlap, {links.overlap_tile_rows} "
                         f"rows) and --overlap-chunks {links.overlap_chunks} (chunked) are two "
                         f"models of one overlap; pass --overlap-chunks 1 or "
                         f"--overlap-tile-rows 0")
    top_k = MODELS[args.model].top_k
    if args.dedup_top_k is None:
        args.dedup_top_k = top_k
    elif not 1 <= args.dedup_top_k <= top_k:
        raise ValueError(f"--dedup-top-k must be in [1, {top_k}] (the experts per token "
                         f"{args.model} routes to; 1: no dedup), got {args.dedup_top_k}")
    return links


def _kappa(args, shape, costs, links, policy, loads) -> int:
    """The derived replica cost of the joint lrmoe plan on ``loads`` (..., W, E) when
    ``--replica-cost-rows`` is not given (0 where it does not apply)."""
    if not (policy == "lrmoe" and getattr(args, "joint", False)
            and getattr(args, "replica_cost_rows", None) is None):
        return 0
    return S.derived_replica_cost_rows(shape, costs, links, loads)


def _run(args, shape, costs, links, policy, loads, multiplier=0.0, memory=None,
         activations=None):
    rate = args.rate if policy == "lrmoe" else 0.0
    # --activations offload puts the planned layer's gate/up rows on the host too
    offload = args.offload or (activations is not None and
                               activations.mode == S._C.sim.ActivationMode.offload)
    mem = memory or _memory(shape, args, offload)
    t = getattr(args, "replan_threshold", None)
    res = S.simulate(loads, policy, mem, costs, links, shape.hidden_size, rate,
                     replica_slots=args.replica_slots, threads=args.threads,
                     balance_slack=None if args.balance_slack < 0 else args.balance_slack,
                     offload=offload,
                     offload_row_bytes=4 * shape.moe_intermediate_size if offload else 0,
                     multiplier=multiplier, top_k=args.dedup_top_k or 1,
                     activations=activations,
                     replan_threshold=t if policy != "symi" else None,
                     resident_replicas=bool(getattr(args, "resident_replicas", False)),
                     **planner_options(args, policy, loads.shape[2],
                                       _kappa(args, shape, costs, links, policy, loads)))
    return res


def _activations(args, shape):
    """``--activations`` / ``--layers-resident`` / ``--dense-token-bytes`` as the
    simulator's ActivationModel (None for ``layer``, the old model)."""
    mode = getattr(args, "activations", "layer")
    if mode == "layer":
        return None
    return S.activation_model(shape, mode, getattr(args, "layers_resident", None),
                              dense_bytes=getattr(args, "dense_token_bytes", None))


def run_sim(args) -> dict:
    """Run ``lrmoe sim`` from parsed arguments; writes ``sim.json`` and the figures.

    Raises:
        ValueError: bad sizes (naming the flag), an ``--out`` that cannot be written
            (:func:`lrmoe.utils.paths.check_output`) or inputs the simulator refuses.
        FileNotFoundError: a missing ``--trace``, ``--results`` or ``--validate`` file.
    """
    if args.gpus < 1 or args.steps < 1:
        raise ValueError(f"--gpus and --steps must be >= 1, got {args.gpus}, {args.steps}")
    if not 0 <= args.rate < 1:
        raise ValueError(f"--rate is the recalibration rate c in [0, 1), got {args.rate}")
    # the flags' names, not the simulator's parameter names, in the message
    for flag, v, lo in (("--tokens-per-gpu", args.tokens_per_gpu, 1),
                        ("--layers", args.layers, 1), ("--threads", args.threads, 1),
                        ("--replica-slots", args.replica_slots, 0),
                        ("--dedup-top-k", args.dedup_top_k, 1),
                        ("--pressure-tokens-per-gpu", args.pressure_tokens_per_gpu, 1),
                        ("--pressure-steps", args.pressure_steps, 1),
                        ("--layers-resident", getattr(args, "layers_resident", None), 1),
                        ("--dense-token-bytes", getattr(args, "dense_token_bytes", None), 0),
                        ("--budget-gib", args.budget_gib, 0),
                        ("--resident-gib", args.resident_gib, 0)):
        if v is not None and not v >= lo:
            raise ValueError(f"{flag} must be >= {lo}, got {v}")
    for flag, gib in (("--budget-gib", args.budget_gib), ("--resident-gib", args.resident_gib)):
        if not gib * GiB <= MAX_BYTES:  # the planner's int64 bytes (also inf)
            raise ValueError(f"{flag} {gib:g} is more than 2^32 GiB, the largest size the "
                             "planner takes; write e.g. 80")
    if not args.skew >= 1:
        raise ValueError(f"--skew is the max/mean expert load per layer, >= 1 (1: uniform), "
                         f"got {args.skew}")
    drift = parse_drift(getattr(args, "drift", "off"))
    if drift is not None and args.trace is not None:
        raise ValueError("--drift is for synthetic loads; --trace replays its recorded steps "
                         "in order (their own drift): pass one of them")
    args.drift_fit = drift
    if getattr(args, "counts", None) is not None:
        if args.trace is not None or drift is not None:
            raise ValueError("--counts replays recorded popularity; it does not combine with "
                             "--trace or --drift: pass one of them")
        from lrmoe.workload.loads import counts_popularity
        counts_popularity(args.counts, MODELS[args.model].num_experts, args.steps,
                          args.layers or MODELS[args.model].moe_layers, args.counts_start,
                          flag="--counts", control=getattr(args, "counts_control", "real"))
    elif getattr(args, "counts_control", "real") != "real":
        raise ValueError(f"--counts-control {args.counts_control} changes replayed counts; "
                         "give --counts FILE.npz too, or drop --counts-control")
    if any(not m > 0 for m in args.pressure):
        raise ValueError(f"--pressure multipliers must be > 0, got {args.pressure}")
    e = MODELS[args.model].num_experts
    if args.scale:  # the step terms' sizes, before the simulation (names the flag)
        S.step_model(MODELS[args.model], 1, args.hbm_gbps, args.dense_params)
    for w in args.scale:  # W GPUs: W / ep copies of one EP group of ep = min(W, E) ranks
        if w < 1 or e % min(w, e) or w % min(w, e):
            raise ValueError(f"--scale {w}: a cluster size must divide E={e} or be a "
                             f"multiple of it (e.g. --scale 64 128 256 512 1024)")
    # inputs read only after the simulation, and the output, are checked before it
    if args.validate is not None:
        read_bench(args.validate, args.costs)  # its records and shapes, before the simulation
    for flag, f in [("--trace", args.trace)] + [("--results", r) for r in args.results or []]:
        if f is not None and not Path(f).is_file():
            raise FileNotFoundError(f"{flag} {f}: no such file")
        if f is not None and flag != "--trace":
            try:
                runs = json.loads(Path(f).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{flag} {f}: not a JSON file ({err})") from None
            if isinstance(runs, dict):
                runs = runs.get("cells", [])
            if not isinstance(runs, list) or not runs:
                raise ValueError(f"{flag} {f}: no runs in the file (the results.json an "
                                 "experiments/ grid writes: a list of cells or {\"cells\": "
                                 "[...]}); Table 1 needs them")
    check_output("--out", args.out, is_dir=True)
    shape = MODELS[args.model]
    if args.gpus > shape.num_experts or shape.num_experts % args.gpus:
        raise ValueError(f"--gpus {args.gpus} must divide E={shape.num_experts} (one EP "
                         "group); for larger clusters (data-parallel copies of a group) "
                         "use --scale 64 128 ... 1024")
    layers = args.layers or shape.moe_layers
    costs = Costs.from_file(args.costs, args.costs_shape or args.model)
    links = resolve_planner_flags(args, Links.from_file(args.links, flag="--links"))
    t0 = time.time()
    loads = cluster_loads(args.gpus, shape.num_experts, args.tokens_per_gpu, shape.top_k,
                            args.steps, layers, args.skew, args.trace, args.seed,
                            drift=args.drift_fit, counts=getattr(args, "counts", None),
                            counts_start=getattr(args, "counts_start", 0),
                            counts_control=getattr(args, "counts_control", "real"))
    out: dict = dict(label=SIMULATED, note="every number here is simulated by lrmoe sim "
                     "(csrc/sim) from a cost model, not measured", paper=PAPER,
                     setup=dict(model=args.model, gpus=args.gpus, steps=args.steps,
                                layers=layers, tokens_per_gpu=args.tokens_per_gpu,
                                trace=args.trace, skew=None if args.trace else args.skew,
                                rate=args.rate, budget_gib=args.budget_gib,
                                resident_gib=args.resident_gib, offload=args.offload,
                                replica_slots=args.replica_slots,
                                balance_slack=args.balance_slack,
                                dedup_top_k=args.dedup_top_k, joint=args.joint,
                                replica_cost_rows=args.replica_cost_rows,
                                ultraep_refine=args.ultraep_refine,
                                spare_capacity_split=args.spare_capacity_split,
                                replan_threshold=args.replan_threshold,
                                resident_replicas=bool(getattr(args, "resident_replicas",
                                                               False)),
                                gpus_per_node=args.planner_gpus_per_node,
                                drift=None if args.drift_fit is None else
                                dict(zip(("phi", "sigma", "jitter"), args.drift_fit)),
                                counts=getattr(args, "counts", None),
                                counts_start=getattr(args, "counts_start", 0),
                                counts_control=getattr(args, "counts_control", "real")),
                     costs=dict(file=args.costs, shape=costs.shape, meta=costs.meta),
                     links=dict(name=links.name, sources=links.sources,
                                per_peer_us=links.per_peer_us, chunks=links.chunks,
                                overlap_chunks=links.overlap_chunks,
                                overlap_tile_rows=links.overlap_tile_rows,
                                overlap_comm_share=links.overlap_comm_share),
                     policies={})
    for pol in args.policies:
        res = _run(args, shape, costs, links, pol, loads)
        summ = S.summarize(res, layers)
        # the joint plan's replica cost it ran with (derived unless --replica-cost-rows)
        summ["replica_cost_rows"] = planner_options(
            args, pol, loads.shape[2], _kappa(args, shape, costs, links, pol, loads)
        )["replica_cost_rows"]
        # a layer whose plan does not fit runs as more, smaller micro-batches (its time
        # is k x one micro-batch's; 'none fits' stays NaN): the time Table 1 charges
        summ["moe_ms_per_step_microbatched"] = summ["moe_ms_per_step"]
        if summ["feasible"] < 1:
            mb = _run(args, shape, costs, links, pol, loads, multiplier=1.0)
            per_step = mb["time_ms"].reshape(-1, layers).sum(axis=1)
            summ["moe_ms_per_step_microbatched"] = float(np.mean(per_step))
            summ["max_micro_batches"] = int(mb["micro_batches"].max())
        out["policies"][pol] = summ
    out["seconds_layer_sim"] = time.time() - t0
    if args.pressure:
        out["pressure"] = pressure(args, shape, costs, links, layers)
    if args.results and args.targets:
        out["table1"] = table1(args.results, args.targets, args.rate, out["policies"])
    if args.scale:
        out["scale"] = scale(args, shape, costs, links, layers)
    if args.validate:
        out["validation"] = validate(args.validate, args.costs, links)
    out["seconds"] = time.time() - t0
    d = Path(args.out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "sim.json").write_text(strict_json(out, indent=1) + "\n")
    plot_all(out, d)
    return out


def _nan(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def _finite(v):
    """``v`` with every non-finite float (NaN, +-inf) as None and numpy scalars and
    arrays as Python numbers and lists, recursively through dicts, lists and tuples."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    if isinstance(v, np.ndarray):
        return _finite(v.tolist())
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v


def strict_json(obj, **kwargs) -> str:
    """``obj`` as JSON text that every parser reads: NaN and +-inf (an undefined mean, an
    interval of one seed, the time of a plan that does not fit), which ``json.dumps``
    would write as the non-JSON tokens NaN and Infinity (RFC 8259 section 6), become
    null. ``kwargs`` go to :func:`json.dumps` (e.g. ``indent``).

    Raises:
        TypeError: an object JSON cannot hold (as :func:`json.dumps`).
    """
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def pressure(args, shape, costs, links, layers) -> dict:
    """Fig. 6: per multiplier and policy, micro-batches, time and effective throughput.

    ``throughput``: tokens per ms at m x the base batch with the micro-batches it needs,
    over the same policy's at 1x (0 when no count of micro-batches fits). ``one_pass``:
    the largest multiplier <= m that fits in one pass, over m (the share of the batch
    that can run at once). With ``--activations`` other than ``layer`` every micro-batch
    also holds the whole model's activations (csrc/sim/activations.h): ``activation_GiB``
    is the largest over the simulated layers, ``recompute_ms`` the recomputed MoE
    forwards (``recompute`` only, part of ``time_ms``)."""
    few = min(layers, 4)
    loads = cluster_loads(args.gpus, shape.num_experts, args.pressure_tokens_per_gpu,
                            shape.top_k, args.pressure_steps, few, args.skew, args.trace,
                            args.seed + 1, drift=getattr(args, "drift_fit", None),
                            counts=getattr(args, "counts", None),
                            counts_start=getattr(args, "counts_start", 0),
                            counts_control=getattr(args, "counts_control", "real"))
    act = _activations(args, shape)
    mem = _memory(shape, args, args.offload or getattr(args, "activations", "") == "offload")
    out: dict = {"multipliers": list(args.pressure), "base_tokens_per_gpu":
                 args.pressure_tokens_per_gpu, "policies": {},
                 "activations": dict(mode=getattr(args, "activations", "layer"),
                                     layers=None if act is None else act.layers,
                                     dense_token_bytes=None if act is None
                                     else act.dense_token_bytes,
                                     moe_row_bytes=None if act is None else act.moe_row_bytes)}
    for pol in args.policies:
        rows = []
        for m in args.pressure:
            r = _run(args, shape, costs, links, pol, loads, multiplier=m, activations=act)
            micro = r["micro_batches"]
            ok = bool((micro > 0).all())
            rows.append(dict(multiplier=m, fits=ok, micro_batches=int(micro.max()),
                             retained_fraction=float(r["retained"].sum()
                                                     / max(1.0, r["pairs"].sum())),
                             time_ms=float(r["time_ms"].sum()) if ok else None,
                             activation_GiB=float(r["activation_bytes"].max()) / GiB,
                             recompute_ms=float(r["recompute_ms"].sum()) if ok else None,
                             one_pass=bool((micro == 1).all()), reason=r["reason"]))
        base = rows[0]["time_ms"] / rows[0]["multiplier"] if rows[0]["time_ms"] else None
        best_one = 0.0
        for row in rows:
            m = row["multiplier"]
            row["throughput"] = (base * m / row["time_ms"]) if (base and row["time_ms"]) else 0.0
            if row["one_pass"]:
                best_one = m
            row["one_pass_share"] = min(1.0, best_one / m)
        out["policies"][pol] = rows
    out["balanced_uncompressed_stops_fitting_at"] = S.balanced_boundary(
        shape, mem, args.gpus, args.pressure_tokens_per_gpu, args.pressure, act)
    return out


def scale(args, shape, costs, links, layers) -> dict:
    """Cost per token vs cluster size: W GPUs are Gr = W / ep data-parallel copies of an
    EP group of ep = min(W, E) ranks, and every group is simulated on its own draws of
    the same layers' popularity (:func:`lrmoe.sim.simulate.simulate_cluster`); a layer
    waits for its slowest group. Per row (means over the simulated steps and layers):

      * ``layer_ms``: the slowest group's fwd + bwd of one MoE layer; ``mean_group_ms``
        the mean group's, so ``slowest_over_mean`` = layer_ms / mean_group_ms - 1 is the
        cost of waiting for the slowest; ``us_per_token``: layer_ms over the tokens per
        GPU (every GPU routes its own tokens at once), GPU-us per token per MoE layer;
      * the step (csrc/sim/step.h, csrc/sim/cluster.h cluster_steps): ``moe_ms`` (the
        simulated layers' sum scaled to the model's ``layers``), ``expert_allreduce_ms``
        (owned experts' fp32 gradients, ring over the Gr groups), ``dense_allreduce_ms``
        (the dense gradients, ring over all W GPUs), ``optimizer_ms`` (Adam at
        ``--hbm-gbps``), ``broadcast_ms`` (symi's weights to its copies), ``step_ms``
        their sum and ``step_us_per_token`` = step_ms over the tokens per GPU (GPU-us
        per token per training step).

    Raises:
        ValueError: no dense parameter count for the model (``--dense-params``), and
            what :func:`lrmoe.sim.simulate.simulate_cluster` raises.
    """
    out = {"gpus": list(args.scale), "model_layers": layers, "hbm_GBps": args.hbm_gbps,
           "dense_params": args.dense_params or shape.dense_params,
           "policies": {p: [] for p in args.policies}}
    steps = max(1, min(args.steps, 4))
    few = min(layers, 4)
    out["simulated"] = dict(steps=steps, layers=few)
    mem = _memory(shape, args)
    for w in args.scale:
        ep = min(w, shape.num_experts)
        groups = max(1, w // ep)
        loads = np.stack([cluster_loads(ep, shape.num_experts, args.tokens_per_gpu,
                                        shape.top_k, steps, few, args.skew, args.trace,
                                        args.seed + 2, group=g,
                                        drift=getattr(args, "drift_fit", None),
                                        counts=getattr(args, "counts", None),
                                        counts_start=getattr(args, "counts_start", 0),
                                        counts_control=getattr(args, "counts_control", "real"))
                          for g in range(groups)],
                         axis=1)
        model = S.step_model(shape, groups, args.hbm_gbps, args.dense_params, layers)
        for pol in args.policies:
            r = S.simulate_cluster(loads, pol, mem, costs, links, shape.hidden_size,
                                   args.rate if pol == "lrmoe" else 0.0,
                                   replica_slots=args.replica_slots, threads=args.threads,
                                   balance_slack=None if args.balance_slack < 0
                                   else args.balance_slack, top_k=args.dedup_top_k or 1,
                                   step=model,
                                   replan_threshold=None if pol == "symi"
                                   else getattr(args, "replan_threshold", None),
                                   resident_replicas=bool(getattr(args, "resident_replicas",
                                                                  False)),
                                   **planner_options(args, pol, ep, _kappa(
                                       args, shape, costs, links, pol, loads)))
            ok = bool((r["feasible"] > 0).all())
            nan = float("nan")
            ms = float(np.mean(r["time_ms"])) if ok else nan
            mean = float(np.mean(r["mean_group_ms"])) if ok else nan
            row = dict(gpus=w, ep=ep, groups=groups, feasible=float((r["feasible"] > 0).mean()),
                       layer_ms=_nan(ms), mean_group_ms=_nan(mean),
                       slowest_over_mean=_nan(ms / mean - 1 if ok else nan),
                       us_per_token=_nan(1e3 * ms / args.tokens_per_gpu),
                       reason="" if ok else "a group's plan does not fit the budget")
            for k in S.STEP_KEYS:
                row["step_ms" if k == "total_ms" else k] = _nan(
                    float(np.mean(r["steps"][k])) if ok else nan)
            row["step_us_per_token"] = _nan(1e3 * row["step_ms"] / args.tokens_per_gpu
                                            if ok else nan)
            out["policies"][pol].append(row)
    return out


def scale_table(sc: dict) -> str:
    """The ``--scale`` rows as a Markdown table: per policy and cluster size, the step's
    columns (ms) and the cost per token (GPU-us per token per step), the slowest group's
    excess over the mean group in brackets."""
    lines = ["| GPUs (EP x groups) | policy | MoE layers | expert all-reduce | dense "
             "all-reduce | Adam | SYMI broadcast | step | us/token (slowest over mean) |",
             "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for i, w in enumerate(sc["gpus"]):
        for p, rows in sc["policies"].items():
            r = rows[i]
            if r["step_ms"] is None:
                lines.append(f"| {w} ({r['ep']} x {r['groups']}) | {LABELS[p]} | infeasible "
                             f"({1 - r['feasible']:.0%} of layers) | | | | | | |")
                continue
            lines.append(
                f"| {w} ({r['ep']} x {r['groups']}) | {LABELS[p]} | {f(r['moe_ms'])} | "
                f"{f(r['expert_allreduce_ms'])} | {f(r['dense_allreduce_ms'])} | "
                f"{f(r['optimizer_ms'])} | {f(r['broadcast_ms'])} | {f(r['step_ms'])} | "
                f"{f(r['step_us_per_token'], 2)} (+{100 * r['slowest_over_mean']:.1f} %) |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots
def plot_all(out: dict, d: Path) -> None:
    """fig7_memory.png, fig8_latency.png, fig6_pressure.png, scale.png (where run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pols = list(out["policies"])
    names = [LABELS[p] for p in pols]
    tag = f" -- SIMULATED ({out['setup']['model']}, EP{out['setup']['gpus']})"
    # Fig. 7
    fig, ax = plt.subplots(figsize=(7, 4))
    parts = [("memory_base_experts", "base experts"), ("memory_replicas", "replicas"),
             ("memory_tokens", "token buffers")]
    bottom = np.zeros(len(pols))
    for key, lab in parts:
        v = np.array([(out["policies"][p]["memory_forward_tokens"]
                       + out["policies"][p]["memory_backward_tokens"]) if key == "memory_tokens"
                      else out["policies"][p][key] for p in pols]) / GiB
        ax.bar(names, v, bottom=bottom, label=lab)
        bottom += v
    for j, p in enumerate(pols):
        if p in PAPER["fig7_GiB"]:
            ax.plot(j, PAPER["fig7_GiB"][p], "k_", ms=30, mew=2)
    ax.set_ylabel("GiB per rank, one MoE layer (black: paper)")
    ax.set_title("Fig. 7 memory" + tag, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(d / "fig7_memory.png", dpi=110); plt.close(fig)
    # Fig. 8: per policy a forward and a backward stack, the paper's backward beside it
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = np.arange(len(pols))
    for off, phases in ((-0.2, ["src_fwd_ms", "dispatch_ms", "expert_fwd_ms", "combine_ms",
                                "replica_ms", "offload_ms"]),
                        (0.2, ["src_bwd_ms", "grad_a2a_ms", "expert_bwd_ms", "dx_a2a_ms"])):
        bottom = np.zeros(len(pols))
        for ph in phases:
            v = np.nan_to_num(np.array([out["policies"][p][ph] for p in pols]))
            ax.bar(x + off, v, 0.38, bottom=bottom, label=ph[:-3] if v.any() else None)
            bottom += v
    for j, p in enumerate(pols):
        if p in PAPER["fig8_bwd_ms"]:
            ax.plot(j + 0.2, PAPER["fig8_bwd_ms"][p], "k_", ms=22, mew=2)
    ax.set_xticks(x, [n + "\nfwd | bwd" for n in names], fontsize=8)
    ax.set_ylabel("ms per MoE layer (black: paper backward)")
    ax.set_title("Fig. 8 latency" + tag, fontsize=9)
    ax.legend(fontsize=7, ncol=1, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout(); fig.savefig(d / "fig8_latency.png", dpi=110); plt.close(fig)
    if "pressure" in out:
        pr = out["pressure"]
        fig, axs = plt.subplots(1, 2, figsize=(10, 4))
        for p, rows in pr["policies"].items():
            ms = [r["multiplier"] for r in rows]
            axs[0].plot(ms, [r["throughput"] for r in rows], "o-", label=LABELS[p])
            axs[1].plot(ms, [r["one_pass_share"] for r in rows], "o-", label=LABELS[p])
        for ax, t in zip(axs, ("effective throughput (time model)",
                               "share of the batch that fits in one pass")):
            b = pr["balanced_uncompressed_stops_fitting_at"]
            if b:
                ax.axvline(b, color="k", ls="--", lw=1, label="balanced c=0 stops fitting")
            mode = pr.get("activations", {}).get("mode", "layer")
            ax.set_xlabel("batch multiplier")
            ax.set_title(f"{t} -- SIMULATED\n(--activations {mode})", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout(); fig.savefig(d / "fig6_pressure.png", dpi=110); plt.close(fig)
    if "scale" in out:
        sc = out["scale"]
        fig, axs = plt.subplots(1, 2, figsize=(11, 4))
        for p, rows in sc["policies"].items():
            x = [r["gpus"] for r in rows]
            for ax, key in zip(axs, ("us_per_token", "step_us_per_token")):
                ax.plot(x, [np.nan if r[key] is None else r[key] for r in rows], "o-",
                        label=LABELS[p])
        for ax, lab in zip(axs, ("GPU-us per token per MoE layer (slowest group)",
                                 "GPU-us per token per step (MoE layers + step terms)")):
            ax.set_xscale("log", base=2); ax.set_xlabel("GPUs"); ax.legend(fontsize=8)
            ax.set_ylabel(lab, fontsize=8)
            ax.set_title("cost per token vs cluster size -- SIMULATED", fontsize=9)
        fig.tight_layout(); fig.savefig(d / "scale.png", dpi=110); plt.close(fig)


def print_summary(out: dict) -> None:
    """One line per policy (and per Table 1 row) on stdout, marked simulated."""
    print(f"lrmoe sim ({SIMULATED}): {out['setup']['model']} EP{out['setup']['gpus']}, "
          f"{out['setup']['steps']} steps x {out['setup']['layers']} layers, costs from "
          f"{out['costs']['meta'].get('device')} ({out['costs']['meta'].get('date')})")
    for p, v in out["policies"].items():
        print(f"  {LABELS[p]:>20}: fwd {v['fwd_ms']:.2f} bwd {v['bwd_ms']:.2f} ms/layer, "
              f"memory {v['memory_peak'] / GiB:.2f} GiB, feasible {v['feasible']:.0%}"
              + (f" ({v['reason'][:80]})" if v["feasible"] < 1 else ""))
    for v in out.get("validation", []):
        where = (f"EP{v['world']} {v['policy'] or 'no policy'} T={v['tokens_per_rank']}/rank"
                 if "world" in v else f"T={v['tokens']}")
        print(f"  validate {v['shape']} {where} {v['routing']} c={v['rate']}: fwd "
              f"{v['sim_fwd_ms']:.2f} vs {v['bench_fwd_ms']:.2f} ({v['fwd_rel_err']:+.1%}), bwd "
              f"{v['sim_bwd_ms']:.2f} vs {v['bench_bwd_ms']:.2f} ({v['bwd_rel_err']:+.1%})"
              + "".join(f", {k} {v['sim_' + k + '_ms']:.2f} vs {v['bench_' + k + '_ms']:.2f}"
                        for k in ("dispatch", "combine", "grad_a2a", "dx_a2a")
                        if v.get("bench_" + k + "_ms") is not None))
    if "scale" in out:
        print("  --scale (simulated; ms per training step, GPU-us per token per step):")
        print("\n".join("    " + line for line in scale_table(out["scale"]).splitlines()))
    for row in out.get("table1", []):
        vs = [f"LRMoE/{LABELS[p]} {v['mean']:.3f} ({v['min']:.3f}-{v['max']:.3f}, "
              f"{v['n']} seeds)" for p in out["policies"]
              if (v := row.get(f"lrmoe_over_{p}")) is not None]
        print("  table1 loss {target_loss}: ".format(**row) + ", ".join(
            f"{LABELS[p]} {row[p]:.2f} min" if row.get(p) is not None else f"{LABELS[p]} -"
            for p in out["policies"]) + (f"; {', '.join(vs)}" if vs else ""))
