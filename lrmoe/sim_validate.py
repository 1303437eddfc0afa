"""``lrmoe sim --validate``: the simulator against measured ``lrmoe bench layer`` runs.

  * a one-device file (``layer_bench.json``): every ``lrmoe`` record simulated at W = 1
    on the bench's own routing (:func:`validate_one`);
  * an expert-parallel file (``layer_bench_ep.json``, ``lrmoe bench layer --ep N``):
    every ``lrmoe`` record simulated at W = N under its placement policy (fixed ownership
    where it ran without one) on every rank's own routing, forward, backward and the four
    timed all-to-alls next to the measured ones (:func:`validate_ep`).

The simulated time of a (step, layer) is the slowest rank's, as the bench reports the
maximum over ranks; the bench's median runs over its rotated input sets, so the
simulation takes the mean over the same sets. Every number here is simulated; the
relative error is ``simulated / measured - 1``.

Legend: S rotated input sets, W ranks, E experts.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, List

import numpy as np

from lrmoe import sim as S
from lrmoe.planner import MODEL_SHAPES, ModelShape

#: the planner's model shapes and the gpu-small preset's (lrmoe sim --model)
SHAPES: Dict[str, ModelShape] = dict(MODEL_SHAPES)
SHAPES["gpu-small"] = ModelShape("gpu-small", 768, 256, 128, 8, 8)
#: simulated field -> the bench's profiled range of the same all-to-all
A2A_FIELDS = {"dispatch_ms": "a2a_dispatch", "combine_ms": "a2a_combine",
              "grad_a2a_ms": "a2a_grad", "dx_a2a_ms": "a2a_dx"}


def bench_loads(routing: str, tokens: int, experts: int, top_k: int, rotate: int = 3,
                ranks: int = 1) -> np.ndarray:
    """(rotate, 1, ranks, E) int64 per-expert loads of ``lrmoe bench layer``'s input sets:
    set s of rank r routed with seed ``s + ROUTING_SEED_STRIDE r``
    (:func:`lrmoe.bench.routing.make_inputs`; rank 0 is the one-device bench). A
    ``trace`` routing needs the trace file: the pairs spread evenly."""
    if routing not in ("uniform", "skewed"):
        load = np.full((1, 1, ranks, experts), tokens * top_k // experts, np.int64)
        load[..., : tokens * top_k % experts] += 1
        return load
    from lrmoe.bench.routing import ROUTING_SEED_STRIDE, make_routing
    return np.stack([np.stack([np.bincount(
        make_routing(routing, tokens, experts, top_k, s + ROUTING_SEED_STRIDE * r)
        .reshape(-1).numpy(), minlength=experts) for r in range(ranks)])
        for s in range(rotate)]).astype(np.int64).reshape(rotate, 1, ranks, experts)


def _costs(cache: Dict[str, S.Costs], costs_file: str, shape: str):
    """The cost file's costs of ``shape`` (None where it does not calibrate it)."""
    if shape not in cache:
        try:
            cache[shape] = S.Costs.from_file(costs_file, shape)
        except ValueError:
            cache[shape] = None
    return cache[shape]


def validate_one(records: List[dict], costs_file: str, links: S.Links) -> List[dict]:
    """One GPU, simulated vs measured: every ``lrmoe`` record whose shape the cost file
    calibrates, simulated at W = 1 with its tokens and c on the bench's own routing (the
    per-expert loads decide the grouped GEMMs' time, ``GemmTable::ms_instances``).
    Returns rows with both times and the relative errors; other methods and shapes the
    cost file lacks are skipped (:func:`validate` refuses a file where nothing is left)."""
    rows = []
    cache: Dict[str, S.Costs] = {}
    rotate = 3  # the one-device bench's default; its records do not carry it
    for r in records:
        if r.get("method") != "lrmoe" or r.get("fwd_ms") is None or r["shape"] not in SHAPES:
            continue
        costs = _costs(cache, costs_file, r["shape"])
        if costs is None:
            continue
        shape = SHAPES[r["shape"]]
        load = bench_loads(r["routing"], r["tokens"], shape.num_experts, shape.top_k, rotate)
        mem = S.memory_model(shape, 1 << 50, 0)
        # the one-device layer has no all-to-all (the EP path's self-copy is not charged)
        res = S.simulate(load, "lrmoe", mem, dataclasses.replace(costs, copy_GBps=0.0), links,
                         shape.hidden_size,
                         float(r["rate"] or 0.0), replica_slots=0, threads=1)
        f, b = float(np.mean(res["fwd_ms"])), float(np.mean(res["bwd_ms"]))
        rows.append(dict(shape=r["shape"], tokens=r["tokens"], routing=r["routing"],
                         rate=r["rate"], bench_fwd_ms=r["fwd_ms"], sim_fwd_ms=f,
                         bench_bwd_ms=r["bwd_ms"], sim_bwd_ms=b,
                         fwd_rel_err=f / r["fwd_ms"] - 1, bwd_rel_err=b / r["bwd_ms"] - 1))
    return rows


def validate_ep(result: dict, costs_file: str, links: S.Links) -> List[dict]:
    """Expert parallel, simulated vs measured: every timed ``lrmoe`` record of a
    ``lrmoe bench layer --ep N`` result whose shape the cost file calibrates, simulated
    at W = N with unlimited memory on the loads of every rank's own routing
    (:func:`bench_loads`):

      * without a policy (fixed ownership, the layer's own quotas at c): the planner's
        ``lrmoe`` policy with no replica slots and no balance target, which is fixed
        ownership with the quota rule's cut (as :func:`validate_one` models one device);
      * under ``lrmoe``: that policy with the bench's ``replica_slots``;
      * under ``fixed``, ``ultraep``, ``symi``: that policy at c = 0 only. At c > 0 the
        runtime runs the baseline's placement with the layer's quotas, which the
        simulator does not model (its baselines keep every pair, csrc/planner/plan.h),
        so those records are left out, as are other methods and shapes the cost file
        lacks (:func:`validate` refuses a file where nothing is left).

    Returns:
        Rows: shape, world, tokens per rank, routing, policy, rate; ``bench_*`` and
        ``sim_*`` of ``fwd_ms``, ``bwd_ms`` and the all-to-alls of :data:`A2A_FIELDS`
        (the bench's: its profiled step's range, max over ranks), and ``*_rel_err``.
    """
    meta = result.get("meta", {})
    slots, rotate = int(meta.get("replica_slots", 2)), int(meta.get("rotate", 3))
    rows = []
    cache: Dict[str, S.Costs] = {}
    for r in result["records"]:
        if (r.get("method") != "lrmoe" or r.get("fwd_ms") is None
                or r["shape"] not in SHAPES):
            continue
        costs = _costs(cache, costs_file, r["shape"])
        if costs is None:
            continue
        shape, world = SHAPES[r["shape"]], int(r["world_size"])
        load = bench_loads(r["routing"], r["tokens_per_rank"], shape.num_experts,
                           shape.top_k, rotate=rotate, ranks=world)
        policy, rate = r.get("policy"), float(r["rate"] or 0.0)
        if policy not in (None, "lrmoe") and rate > 0:
            continue  # a baseline placement with LRMoE's quotas: not modelled
        plain = policy is None
        res = S.simulate(load, "lrmoe" if plain else policy,
                         S.memory_model(shape, 1 << 50, 0), costs, links, shape.hidden_size,
                         rate, replica_slots=0 if plain else slots,
                         balance_slack=None if plain else S.DEFAULT_BALANCE_SLACK, threads=1)
        row = dict(shape=r["shape"], world=world, tokens_per_rank=r["tokens_per_rank"],
                   routing=r["routing"], policy=r.get("policy"), rate=r["rate"])
        measured = {"fwd_ms": r["fwd_ms"], "bwd_ms": r["bwd_ms"],
                    **{k: r.get("phases_ms", {}).get(v) for k, v in A2A_FIELDS.items()}}
        for key, bench in measured.items():
            # fwd/bwd: the median over the rotated sets; the all-to-alls: the profiled
            # step, input set 0 (lrmoe/bench/timing.py profile_step)
            sim = float(np.mean(res[key]) if key in ("fwd_ms", "bwd_ms") else res[key][0])
            row[f"bench_{key}"], row[f"sim_{key}"] = bench, sim
            row[f"{key[:-3]}_rel_err"] = sim / bench - 1 if bench else None
        rows.append(row)
    return rows


def validate(bench_json: str, costs_file: str, links: S.Links) -> List[dict]:
    """Either file kind of ``lrmoe bench layer``: an expert-parallel result (its records
    carry ``world_size``) goes to :func:`validate_ep`, a one-device one to
    :func:`validate_one`.

    Raises:
        FileNotFoundError: no file. ValueError: not a bench result (:func:`read_bench`),
            or no record the simulator can compare (none of LRMoE, at a shape the cost
            file calibrates; the message names the shapes).
    """
    data = read_bench(bench_json)
    ep = any("world_size" in r for r in data["records"])
    rows = (validate_ep(data, costs_file, links) if ep
            else validate_one(data["records"], costs_file, links))
    if not rows:
        shapes = sorted({str(r.get("shape")) for r in data["records"]})
        raise ValueError(f"--validate {bench_json}: no LRMoE record at a shape that "
                         f"{costs_file} calibrates and the simulator models (shapes in the "
                         f"file: {', '.join(shapes)}; simulated: {', '.join(sorted(SHAPES))})")
    return rows


def read_bench(bench_json: str) -> dict:
    """The JSON of ``lrmoe bench layer`` (one device or ``--ep``), checked before any
    simulation runs.

    Raises:
        FileNotFoundError: no file. ValueError: not JSON, or not a bench result (a dict
            whose ``records`` list holds records with a ``method``; an ``lrmoe bench
            a2a`` file is refused by name).
    """
    path = Path(bench_json)
    if not path.is_file():
        raise FileNotFoundError(f"--validate {bench_json}: no such file (a layer_bench.json "
                                "or layer_bench_ep.json of lrmoe bench layer)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--validate {bench_json}: not a JSON file ({err})") from None
    records = data.get("records") if isinstance(data, dict) else None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "method" in r
                                                for r in records):
        kind = (" (it is an lrmoe bench a2a result: give it to --links as links.yaml)"
                if isinstance(data, dict) and "fit" in data else "")
        raise ValueError(f"--validate {bench_json}: not an lrmoe bench layer result{kind}; "
                         "give layer_bench.json or layer_bench_ep.json")
    return data
