"""``lrmoe sim --validate``: the simulator against measured ``lrmoe bench layer`` runs.

  * a one-device file (``layer_bench.json``): every ``lrmoe`` record simulated at W = 1
    on the bench's own routing (:func:`validate_one`);
  * an expert-parallel file (``layer_bench_ep.json``, ``lrmoe bench layer --ep N``):
    every ``lrmoe`` record simulated at W = N under its placement policy (fixed ownership
    where it ran without one) on every rank's own routing, forward, backward and the four
    timed all-to-alls next to the measured ones (:func:`validate_ep`).

The simulated time of a (step, layer) is the slowest rank's, as the bench reports the
maximum over ranks; the bench's median runs over its rotated input sets, so the
simulation takes the mean over the same sets (the file's recorded ``rotate``). Every
number here is simulated; the relative error is ``simulated / measured - 1``.

The bench file is checked before any simulation runs (:func:`read_bench`: every field
the simulation reads, one error naming ``--validate FILE``, the record and the field);
a bench device or dtype other than the cost file's is warned of (:func:`bench_notes`).

Legend: S rotated input sets, W ranks, E experts.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from lrmoe.sim import simulate as S
from lrmoe.sim.costs import Costs
from lrmoe.sim.links import Links
# DEFAULT_ROTATE: the input sets of a file whose meta does not record them (one-device
# files written before it did)
from lrmoe.workload.routing import DEFAULT_ROTATE as BENCH_ROTATE
from lrmoe.workload.routing import ROUTING_SEED_STRIDE, ROUTINGS, make_routing
from lrmoe.sim.costs import load_costs
from lrmoe.workload.shapes import MODELS
from lrmoe.planner.plan import POLICIES

#: simulated field -> the bench's profiled range of the same all-to-all
A2A_FIELDS = {"dispatch_ms": "a2a_dispatch", "combine_ms": "a2a_combine",
              "grad_a2a_ms": "a2a_grad", "dx_a2a_ms": "a2a_dx"}


def bench_loads(routing: str, tokens: int, experts: int, top_k: int,
                rotate: int = BENCH_ROTATE, ranks: int = 1) -> np.ndarray:
    """(rotate, 1, ranks, E) int64 per-expert loads of ``lrmoe bench layer``'s input sets:
    set s of rank r routed with seed ``s + ROUTING_SEED_STRIDE r``
    (:func:`lrmoe.bench.cases.make_inputs`; rank 0 is the one-device bench). A
    ``trace`` routing needs the trace file: the pairs spread evenly."""
    if routing not in ("uniform", "skewed"):
        load = np.full((1, 1, ranks, experts), tokens * top_k // experts, np.int64)
        load[..., : tokens * top_k % experts] += 1
        return load
    return np.stack([np.stack([np.bincount(
        make_routing(routing, tokens, experts, top_k, s + ROUTING_SEED_STRIDE * r)
        .reshape(-1).numpy(), minlength=experts) for r in range(ranks)])
        for s in range(rotate)]).astype(np.int64).reshape(rotate, 1, ranks, experts)


def _costs(cache: Dict[str, Costs], costs_file: str, shape: str):
    """The cost file's costs of ``shape`` (None where it does not calibrate it)."""
    if shape not in cache:
        try:
            cache[shape] = Costs.from_file(costs_file, shape)
        except ValueError:
            cache[shape] = None
    return cache[shape]


def validate_one(records: List[dict], costs_file: str, links: Links,
                 rotate: int = BENCH_ROTATE) -> List[dict]:
    """One GPU, simulated vs measured: every ``lrmoe`` record whose shape the cost file
    calibrates, simulated at W = 1 with its tokens and c on the bench's own routing (the
    per-expert loads decide the grouped GEMMs' time, ``GemmTable::ms_instances``) over
    its ``rotate`` input sets (:func:`bench_rotate`). The records are those of a file
    :func:`read_bench` has checked. Returns rows with both times (ms) and the relative
    errors; other methods and shapes the cost file lacks are skipped (:func:`validate`
    refuses a file where nothing is left)."""
    rows = []
    cache: Dict[str, Costs] = {}
    for r in records:
        if not _used(r):
            continue
        costs = _costs(cache, costs_file, r["shape"])
        if costs is None:
            continue
        shape = MODELS[r["shape"]]
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


def validate_ep(result: dict, costs_file: str, links: Links) -> List[dict]:
    """Expert parallel, simulated vs measured: every timed ``lrmoe`` record of a
    ``lrmoe bench layer --ep N`` result whose shape the cost file calibrates, simulated
    at W = N with unlimited memory on the loads of every rank's own routing
    (:func:`bench_loads`) over its recorded input sets (:func:`bench_rotate`); the
    result is one :func:`read_bench` has checked:

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
    meta = result.get("meta") or {}
    slots, rotate = int(meta.get("replica_slots", 2)), bench_rotate(result)
    rows = []
    cache: Dict[str, Costs] = {}
    for r in result["records"]:
        if not _used(r):
            continue
        costs = _costs(cache, costs_file, r["shape"])
        if costs is None:
            continue
        shape, world = MODELS[r["shape"]], int(r["world_size"])
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


def validate(bench_json: str, costs_file: str, links: Links) -> List[dict]:
    """Either file kind of ``lrmoe bench layer``: an expert-parallel result (its records
    carry ``world_size``) goes to :func:`validate_ep`, a one-device one to
    :func:`validate_one`. Before simulating it prints to stderr the notes of
    :func:`bench_notes` (a rotate the file does not record, a device or dtype other than
    the cost file's): warnings, not errors.

    Raises:
        FileNotFoundError: no file. ValueError: not a bench result, a record or meta
            field the simulator cannot use, or no LRMoE record at a shape the simulator
            models and the cost file calibrates (:func:`read_bench`); or no record left
            to compare (an expert-parallel file of baselines at c > 0 only).
    """
    data = read_bench(bench_json, costs_file)
    for line in bench_notes(data, bench_json, costs_file):
        print(line, file=sys.stderr)
    rows = (validate_ep(data, costs_file, links) if _is_ep(data["records"])
            else validate_one(data["records"], costs_file, links, bench_rotate(data)))
    if not rows:
        shapes = sorted({str(r.get("shape")) for r in data["records"]})
        raise ValueError(f"--validate {bench_json}: no LRMoE record at a shape that "
                         f"{costs_file} calibrates and the simulator models (shapes in the "
                         f"file: {', '.join(shapes)}; simulated: {', '.join(sorted(MODELS))})")
    return rows


def bench_rotate(data: dict) -> int:
    """The input sets the bench rotated over: its meta's ``rotate`` (checked by
    :func:`read_bench`), else the bench default :data:`BENCH_ROTATE` (files written
    before the one-device bench recorded it; :func:`bench_notes` says so)."""
    return int((data.get("meta") or {}).get("rotate", BENCH_ROTATE))


def _words(items: List[str], conj: str = "and") -> str:
    """a, b and c."""
    return f" {conj} ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def bench_notes(data: dict, bench_json: str, costs_file: str) -> List[str]:
    """Lines to print before the comparison, none of them an error:

      * a warning when the bench's ``meta.device`` or ``meta.dtype`` differs from the
        cost file's: the simulated times are of the cost file's set-up, so the errors
        would compare two set-ups (a CPU float32 bench against H200 bfloat16 costs reads
        as -99.9 % otherwise, with no hint why);
      * a note for what either file does not record: a ``rotate`` the bench file lacks
        (the bench default :data:`BENCH_ROTATE` is simulated), a device or dtype that
        cannot be compared (it is not guessed).

    Raises:
        FileNotFoundError, ValueError: the cost file (:func:`lrmoe.sim.costs.load_costs`).
    """
    meta = data.get("meta") or {}
    cmeta = load_costs(costs_file).get("meta") or {}
    differ, bench_lacks, costs_lack = [], [], []
    if "rotate" not in meta:
        bench_lacks.append("rotate")
    for key in ("device", "dtype"):
        bench, cost = meta.get(key), cmeta.get(key)
        if bench is None:
            bench_lacks.append(key)
        elif cost is None:
            costs_lack.append(key)
        elif str(bench) != str(cost):
            differ.append((key, bench, cost))
    lines = []
    if differ:
        lines.append(
            f"warning: --validate {bench_json}: measured with "
            f"{_words([f'{k} {b}' for k, b, _ in differ])}, but {costs_file} is calibrated "
            f"with {_words([f'{k} {c}' for k, _, c in differ])}: the simulated times are of "
            "the cost file's set-up, so the errors compare two set-ups; validate against a "
            "cost file calibrated where the bench ran (lrmoe calibrate there)")
    if bench_lacks:
        checked = [k for k in bench_lacks if k != "rotate"]
        lines.append(
            f"note: --validate {bench_json}: its meta records no "
            f"{_words(bench_lacks, 'or')} (a hand-made file or one of an earlier lrmoe bench "
            "layer): "
            + (f"simulated over the bench default of {BENCH_ROTATE} input sets; "
               if "rotate" in bench_lacks else "")
            + (f"{_words(checked)} not checked against {costs_file}'s; " if checked else "")
            + "rerun the bench to record them")
    if costs_lack:
        lines.append(f"note: {costs_file} records no {_words(costs_lack, 'or')}; the bench's "
                     f"{_words([f'{k} {meta[k]}' for k in costs_lack])} not checked against it")
    return lines


def _is_ep(records: List[dict]) -> bool:
    """An expert-parallel file: its records carry ``world_size``."""
    return any("world_size" in r for r in records)


def _used(r: dict) -> bool:
    """A record the simulator compares: a timed LRMoE one at a simulated shape (an
    untimed one, failed or out of memory, has no or a null ``fwd_ms``)."""
    return (r.get("method") == "lrmoe" and r.get("fwd_ms") is not None
            and isinstance(r.get("shape"), str) and r["shape"] in MODELS)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(r: dict, key: str) -> str:
    """How a field reads in the message: as written in the file, or missing."""
    return f"is {json.dumps(r[key])}" if key in r else "is missing"


def _check_record(r: dict, ep: bool) -> Optional[tuple]:
    """The first field of a compared record (:func:`_used`) the simulation cannot take,
    as (field, how it reads, fix), or None: every field it reads, in the range it needs
    (a negative token count reaches torch as a tensor size, a rate >= 1 the planner, a
    world size not dividing E the placement; a time of 0 divides the error)."""
    shape = MODELS[r["shape"]]
    checks = [("routing", lambda v: v in ROUTINGS, f"one of {', '.join(ROUTINGS)}")]
    if ep:
        e = shape.num_experts
        checks += [
            ("world_size", lambda v: _whole(v) and 1 <= v <= e and e % v == 0,
             f"the ranks, a whole number dividing E={e} of {r['shape']} (1, 2, 4, 8, ...)"),
            ("tokens_per_rank", lambda v: _whole(v) and v >= 1,
             "a whole number of tokens per rank >= 1")]
    else:
        checks.append(("tokens", lambda v: _whole(v) and v >= 1,
                       "a whole number of tokens >= 1"))
    checks += [
        ("rate", lambda v: v is None or (_number(v) and 0 <= v < 1),
         "the recalibration rate c in [0, 1) (null for none)"),
        ("fwd_ms", lambda v: _number(v) and v > 0,
         "the measured forward, a number of ms > 0 (null for a record not timed)"),
        ("bwd_ms", lambda v: _number(v) and v > 0, "the measured backward, a number of ms > 0")]
    for key, ok, fix in checks:
        if key not in r or not ok(r[key]):
            return key, _shown(r, key), fix
    if not ep:
        return None
    # absent in files of a bench without policies: fixed ownership
    if r.get("policy") is not None and r["policy"] not in POLICIES:
        return ("policy", _shown(r, "policy"),
                f"one of {', '.join(POLICIES)}, or null for fixed ownership without one")
    phases = r.get("phases_ms")
    if phases is None:
        return None
    if not isinstance(phases, dict):
        return "phases_ms", _shown(r, "phases_ms"), "an object of ms per profiled range"
    for rng in A2A_FIELDS.values():
        v = phases.get(rng)
        if v is not None and not (_number(v) and v >= 0):
            return (f"phases_ms.{rng}", _shown(phases, rng), "the measured all-to-all, a "
                    "number of ms >= 0 (0 or absent: not compared)")
    return None


def _check_meta(meta, bench_json: str) -> None:
    """The meta fields the simulation reads (``rotate``; ``replica_slots`` of an EP
    file). Raises ValueError naming the field."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise ValueError(f"--validate {bench_json}: meta is {json.dumps(meta)}; it must be an "
                         "object (the bench's run facts), or leave it out")
    for key, lo, what in (("rotate", 1, "the input sets the bench rotated over "
                                        "(lrmoe bench layer --rotate)"),
                          ("replica_slots", 0, "the spare expert slots per rank "
                                               "(lrmoe bench layer --replica-slots)")):
        if key in meta and not (_whole(meta[key]) and meta[key] >= lo):
            raise ValueError(f"--validate {bench_json}: meta field {key} is "
                             f"{json.dumps(meta[key])}; {what}, a whole number >= {lo}: "
                             "correct it or rerun the bench")


def read_bench(bench_json: str, costs_file: Optional[str] = None) -> dict:
    """The JSON of ``lrmoe bench layer`` (one device or ``--ep``), checked before any
    simulation runs: its structure, and every field the simulation reads of every record
    it compares (the timed LRMoE records at a simulated shape, :data:`lrmoe.workload.shapes.MODELS`): present,
    of the right type and range (times in ms > 0 and finite, tokens whole and >= 1, rate
    in [0, 1), a known routing and policy, a world size dividing E), and the meta's
    ``rotate``/``replica_slots``. With ``costs_file`` also that it calibrates one of their
    shapes. Records are numbered from 1 in the messages.

    Raises:
        FileNotFoundError: no file. ValueError: not JSON, or not a bench result (a dict
            whose ``records`` list holds records with a ``method``; an ``lrmoe bench
            a2a`` file is refused by name); a record or meta field as above (``--validate
            FILE: record N (method, shape): field X is V; the fix``); no timed LRMoE record
            at a simulated shape (a ``--smoke`` result is named as such), or, with
            ``costs_file``, none at a shape it calibrates.
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
    _check_meta(data.get("meta"), bench_json)
    ep = _is_ep(records)
    for i, r in enumerate(records, 1):
        if (r.get("method") == "lrmoe" and r.get("fwd_ms") is not None
                and not isinstance(r.get("shape"), str)):
            # the shape decides whether a timed LRMoE record is simulated: it must be a name
            bad = ("shape", _shown(r, "shape"),
                   f"the layer shape's name (simulated: {', '.join(sorted(MODELS))})")
        else:
            bad = _check_record(r, ep) if _used(r) else None
        if bad is not None:
            key, shown, fix = bad
            raise ValueError(f"--validate {bench_json}: record {i} ({r.get('method')}, "
                             f"{r.get('shape')}): field {key} {shown}; {fix}: correct it, "
                             "drop the record, or use the file lrmoe bench layer wrote")
    used = [r for r in records if _used(r)]
    if not used:
        shapes = sorted({str(r.get("shape")) for r in records if r.get("method") == "lrmoe"})
        smoke = ("; a --smoke run times the smoke shape only, which is not simulated: run "
                 "lrmoe bench layer --shapes gpu-small (or a paper shape) without --smoke"
                 if "smoke" in shapes else
                 "; run lrmoe bench layer --shapes with one of the simulated shapes")
        raise ValueError(f"--validate {bench_json}: no LRMoE record at a shape the simulator "
                         f"models, with measured times (LRMoE shapes in the file: "
                         f"{', '.join(shapes) or 'none'}; simulated: "
                         f"{', '.join(sorted(MODELS))}){smoke}")
    if costs_file is not None:
        calibrated = set(load_costs(costs_file)["shapes"])
        mine = sorted({r["shape"] for r in used})
        if not calibrated & set(mine):
            raise ValueError(
                f"--validate {bench_json}: no LRMoE record at a shape that {costs_file} "
                f"calibrates (the records' shapes: {', '.join(mine)}; calibrated: "
                f"{', '.join(sorted(calibrated))}); run lrmoe calibrate --shapes "
                f"{mine[0]}, or give the cost file of the bench's shapes")
    return data
