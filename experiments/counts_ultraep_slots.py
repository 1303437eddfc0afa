"""Why SYMI beats UltraEP on the replayed GCIDE counts (docs/simulation.md, "Popularity
drift", "Why SYMI beats UltraEP on the counts"): UltraEP keeps fixed owners and moves
load only through R spare slots per rank, each replica carrying at most one expert's
rows; the replay splits each recorded expert into r contiguous children, so (a) the
recorded model's rank imbalance lands whole on the fixed owners (rank max/mean ~2 at
EP8) and (b) every child is small. SYMI has no owners: S = E / W + R slots per GPU,
every instance re-placed each step.

Per (step, layer) of the simulated EP8 loads (Qwen3-30B-A3B, 32k tokens x top-8 per
GPU, ``lrmoe.workload.loads.cluster_loads``), max forward rows per rank over the mean
rank's, for fixed, UltraEP (refined, spare-capacity split: the figures' options) and
SYMI (planned from the previous step's loads, as simulated), and the *owners bound*:
the smallest T with sum_r min(c_r, T) >= the layer's pairs, where c_r = rank r's own
experts' rows + its R largest non-owned experts' rows, the most rank r can compute
under fixed ownership plus R replicas, so every UltraEP plan has max >= T. Layouts:
``contiguous`` (the replay: recorded expert e -> experts r e .. r e + r - 1) and
``strided`` (the same loads with expert ids j -> children spread: recorded expert e's
children at e, e + E_rec, ...: on r different EP8 owners). Then the simulated per-layer
fwd + bwd ms of UltraEP and SYMI (``lrmoe.sim.simulate.simulate``, the figures' planner
options and dedup) for each layout and R, with their dispatch and expert GEMM phases,
and from the plans the most remote pair rows a rank receives (over the mean rank's
pairs) and the share of pairs computed on their own source rank (no all-to-all).
Steps 1.. (step 0 has no previous step).

    python experiments/counts_ultraep_slots.py --starts 50 200 600 1168 --steps 8 \\
        --layers 8 --slots 2 4 --out experiments/results/sim_drift_controls/ultraep_slots.json

Every number is simulated (the plans are the planner's; the times the simulator's).
Writes strict JSON (``--out``) and prints one line per (start, layout, R).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from lrmoe.planner.plan import plan
from lrmoe.sim import simulate as S
from lrmoe.sim.costs import Costs
from lrmoe.sim.links import Links
from lrmoe.workload.loads import cluster_loads
from lrmoe.workload.shapes import MODELS

GiB = 1 << 30
COUNTS = str(Path(__file__).resolve().parent / "results" / "drift" / "gcide-tiny-e32-counts.npz")


def owners_bound(n_E: np.ndarray, W: int, R: int) -> float:
    """Rows: a lower bound on the max rows per rank of every plan with fixed owners
    (e // (E / W)) and at most R replicas per rank, each computing at most its expert's
    n_e rows. n_E: (E,) int routed pairs per expert."""
    E = n_E.shape[0]
    per = E // W
    own = n_E.reshape(W, per).sum(1)
    cap = np.array([own[r] + np.sort(np.delete(n_E, np.arange(r * per, (r + 1) * per)))[-R:].sum()
                    if R > 0 else own[r] for r in range(W)], dtype=np.float64)
    total = float(n_E.sum())
    lo, hi = total / W, total
    for _ in range(64):  # bisection: sum_r min(cap_r, T) grows with T
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.minimum(cap, mid).sum() < total else (lo, mid)
    return hi


def remote_rows(p) -> tuple:
    """(max over ranks of the pair rows a rank receives from other ranks, same of the rows
    a source sends to other ranks, the share of pairs computed on their source's rank) of
    a plan: the all-to-all's rows before any dedup (forward_IW, instance_rank)."""
    F = p.forward_IW.numpy()
    rk = p.instance_rank.numpy()
    W = F.shape[1]
    remote = rk[:, None] != np.arange(W)[None, :]
    sent = (F * remote).sum(0)
    recv = np.array([(F[rk == d] * remote[rk == d]).sum() for d in range(W)])
    return float(recv.max()), float(sent.max()), float(1 - sent.sum() / F.sum())


def strided(E: int, E_rec: int) -> np.ndarray:
    """(E,) permutation: column j of the strided loads is column perm[j] of the
    contiguous ones (child k of recorded expert e: contiguous id r e + k, strided id
    e + E_rec k)."""
    r = E // E_rec
    return np.array([r * (j % E_rec) + j // E_rec for j in range(E)])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", nargs="+", type=int, default=[50, 200, 600, 1168])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--slots", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--costs", default="configs/costs/h200.json")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    shape = MODELS["qwen3-30b-a3b"]
    W, E = 8, shape.num_experts
    mem = S.memory_model(shape, 80 * GiB, 64 * GiB)
    costs = Costs.from_file(a.costs, "qwen3-30b-a3b")
    links = Links.from_file()
    perm = strided(E, 32)
    rows = []
    for start in a.starts:
        base = cluster_loads(W, E, 32768, shape.top_k, a.steps, a.layers, counts=COUNTS,
                             counts_start=start, seed=a.seed)
        for layout, loads in (("contiguous", base), ("strided", base[..., perm])):
            for R in a.slots:
                m = {k: [] for k in ("fixed", "ultraep", "symi", "owners_bound",
                                     "ultraep_recv", "symi_recv", "ultraep_local_share",
                                     "symi_local_share")}
                for s in range(1, a.steps):
                    for l in range(a.layers):
                        n = loads[s, l].sum(0)
                        mean = n.sum() / W
                        m["fixed"].append(n.reshape(W, -1).sum(1).max() / mean)
                        m["owners_bound"].append(owners_bound(n, W, R) / mean)
                        u = plan(loads[s, l], "ultraep", mem, replica_slots=R,
                                 ultraep_refine=True, spare_capacity_split=True)
                        m["ultraep"].append(float(u.forward_rows_W.max()) / mean)
                        y = plan(loads[s, l], "symi", mem, replica_slots=R,
                                 previous_load_E=loads[s - 1, l].sum(0))
                        m["symi"].append(float(y.forward_rows_W.max()) / mean)
                        for pol, pl in (("ultraep", u), ("symi", y)):
                            recv, _, local = remote_rows(pl)
                            m[f"{pol}_recv"].append(recv / mean)  # x the mean rank's pairs
                            m[f"{pol}_local_share"].append(local)
                ms = {}
                for pol, kw in (("ultraep", dict(ultraep_refine=True, spare_capacity_split=True)),
                                ("symi", {})):
                    r = S.simulate(loads, pol, mem, costs, links, shape.hidden_size, 0.0,
                                   replica_slots=R, threads=1, top_k=shape.top_k, **kw)
                    ok = r["feasible"] > 0
                    ms[pol] = float(np.mean((r["fwd_ms"] + r["bwd_ms"])[ok]))
                    for ph in ("dispatch_ms", "expert_fwd_ms", "expert_bwd_ms"):
                        ms[f"{pol}_{ph}"] = float(np.mean(r[ph][ok]))
                row = dict(start=start, layout=layout, replica_slots=R,
                           **{k if k.endswith("share") else f"{k}_max_over_mean":
                              float(np.mean(v)) for k, v in m.items()},
                           ultraep_over_bound_max=float(np.max(np.array(m["ultraep"]) /
                                                               np.array(m["owners_bound"]) - 1)),
                           ultraep_ms=ms["ultraep"], symi_ms=ms["symi"],
                           symi_over_ultraep=ms["symi"] / ms["ultraep"] - 1,
                           phases_ms={k: v for k, v in ms.items() if k.endswith("_ms")})
                rows.append(row)
                print(f"counts:{start} {layout:10s} R {R}: max/mean fixed {row['fixed_max_over_mean']:.3f} "
                      f"owners bound {row['owners_bound_max_over_mean']:.3f} ultraep "
                      f"{row['ultraep_max_over_mean']:.3f} (worst {100 * row['ultraep_over_bound_max']:+.1f} % "
                      f"over the bound) symi {row['symi_max_over_mean']:.3f}; ms ultraep "
                      f"{ms['ultraep']:.2f} symi {ms['symi']:.2f} ({100 * row['symi_over_ultraep']:+.2f} %); "
                      f"remote rows received (max rank / mean rank's pairs) ultraep "
                      f"{row['ultraep_recv_max_over_mean']:.3f} symi {row['symi_recv_max_over_mean']:.3f}, "
                      f"pairs on their own rank ultraep {row['ultraep_local_share']:.3f} symi "
                      f"{row['symi_local_share']:.3f}; dispatch / expert fwd / expert bwd ms "
                      f"ultraep {ms['ultraep_dispatch_ms']:.2f} / {ms['ultraep_expert_fwd_ms']:.2f} / "
                      f"{ms['ultraep_expert_bwd_ms']:.2f} symi {ms['symi_dispatch_ms']:.2f} / "
                      f"{ms['symi_expert_fwd_ms']:.2f} / {ms['symi_expert_bwd_ms']:.2f}")
    out = dict(args=vars(a), rows=rows)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
