"""Placement policies executed under expert parallelism (lrmoe.parallel.replicas): gloo
on the CPU, W = 2 and 4 (one W = 8 case), float64 layers.

Every case builds, from one seed, the single-process layer, the EP layer without a
policy and the EP layer with the policy, runs the same global batch and compares:

* c = 0: outputs, dx, router and expert gradients equal the no-replica run and the single
  process (``fixed`` bit for bit; with replicas the owner's gradient is a sum of its
  instances' partial GEMMs: fp64 summation order, rtol 1e-10);
* c > 0: router gradients exact, every expert's weight gradient equal to a float64
  reference built here from exactly the retained pairs: the instance layout comes from
  ``lrmoe.planner.plan.plan`` (the decision under test elsewhere, tests/python/test_planner.py),
  the split of each quota over (instance, source) cells, the pairs of each cell (a
  source's pairs of expert e in pair order, the first ``forward_IW[i0, s]`` to the first
  instance) and the top scores within each cell are computed here with Fractions and
  plain torch, not with lrmoe;
* the splits each collective was given equal what the plan predicts (rows per
  destination from ``forward_IW`` / the retained cells, expert copies from the instance
  ranks), and the byte counters equal those splits times the row sizes.

Skewed routings: random, every token to one expert, every token to one rank's experts, an
expert with no tokens anywhere, a rank with no tokens.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import test_expert_parallel as tep
from lrmoe.layer import LRMoELayer
from lrmoe.parallel.placement import Placement
from lrmoe.parallel.hooks import push_replica_weights
from lrmoe.planner.plan import MemoryModel, plan as planner_plan
from lrmoe.workload.shapes import ModelShape

H, I, K = 8, 6, 2
POLICIES = ("fixed", "ultraep", "symi", "lrmoe")
MODES = ("random", "one_expert", "one_rank", "idle_expert", "empty_rank")
UNLIMITED = 1 << 62


def _routing(mode, total, world, seed):
    """Global (T, K) expert ids and the tokens per source rank."""
    E = 2 * world
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, E, (total,), generator=g)
    if mode == "one_expert":
        first = torch.zeros(total, dtype=torch.long)
    second = (first + 1 + torch.randint(0, E - 1, (total,), generator=g)) % E
    ids = torch.stack([first, second], 1)
    if mode == "one_rank":      # rank 0 owns experts 0 and 1
        ids = torch.tensor([[0, 1]] * total)
    if mode == "idle_expert":   # experts 1 and E - 1 get nothing
        pool = torch.tensor([0] + list(range(2, E - 1)))
        a = torch.randint(0, len(pool), (total,), generator=g)
        b = (a + 1 + torch.randint(0, len(pool) - 1, (total,), generator=g)) % len(pool)
        ids = torch.stack([pool[a], pool[b]], 1)
    sizes = [len(c) for c in torch.arange(total).tensor_split(world)]
    if mode == "empty_rank":
        sizes = sizes[:-1] + [0]
        sizes[0] += total - sum(sizes)
    return ids, sizes


def _counts(ids, sizes, E):
    out, start = [], 0
    for n in sizes:
        out.append(torch.bincount(ids[start:start + n].reshape(-1), minlength=E).tolist())
        start += n
    return out


def _memory(budget):
    shape = ModelShape("t", H, I, 0, K, 1)
    return MemoryModel.from_shape(shape, budget or UNLIMITED, 0)


def _budget(policy, counts, c):
    """lrmoe places replicas only over budget: the largest budget below the fixed
    peak at which its plan is feasible and moves rows off the hot rank."""
    if policy != "lrmoe":
        return None
    peak = planner_plan(counts, "fixed", _memory(None)).peak_bytes()
    for f in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6):
        budget = int(peak * f)
        p = planner_plan(counts, "lrmoe", _memory(budget), recalibration_rate=c)
        if p.feasible and (p.replicas > 0 or c > 0):
            return budget
    return None


def _cells(plan_, counts, policy, c):
    """(I, W) retained rows per (instance, source) cell, computed here: lrmoe's own
    quotas, else the layer's proportional quota of each expert split over its cells by
    largest remainder in (instance, source) order."""
    fwd = plan_.forward_IW
    if c == 0:
        return fwd.clone()
    if policy == "lrmoe":
        return plan_.retained_IW.clone()
    W, E = len(counts), len(counts[0])
    N = [sum(counts[s][e] for s in range(W)) for e in range(E)]
    keep = 1 - Fraction(c).limit_denominator(1 << 20)
    Q = tep._largest_remainder([keep * v for v in N], int(keep * sum(N)))
    out = torch.zeros_like(fwd)
    off = plan_.instance_offsets.tolist()
    for e in range(E):
        cells = [(i, s) for i in range(off[e], off[e + 1]) for s in range(W)]
        if not N[e]:
            continue
        got = tep._largest_remainder([Fraction(Q[e] * int(fwd[i, s]), N[e]) for i, s in cells],
                                     Q[e])
        for (i, s), v in zip(cells, got):
            out[i, s] = v
    return out


def _reference(x, w_out, weights, ids, wgu, wd, sizes, plan_, kept_IW):
    """float64 expert gradients and expert-part dx from the retained pairs of each cell."""
    T = ids.shape[0]
    E = wgu.shape[0]
    W = len(sizes)
    a = torch.einsum("th,eih->tei", x, wgu[:, :I])
    b = torch.einsum("th,eih->tei", x, wgu[:, I:])
    phi = F.silu(a) * b
    starts = [sum(sizes[:s]) for s in range(W)]
    off = plan_.instance_offsets.tolist()
    kept = set()
    for s in range(W):
        for e in range(E):
            cand = [(t, k) for t in range(starts[s], starts[s] + sizes[s]) for k in range(K)
                    if int(ids[t, k]) == e]
            pos = 0
            for i in range(off[e], off[e + 1]):
                cell = cand[pos:pos + int(plan_.forward_IW[i, s])]
                pos += len(cell)
                score = {p: float(weights[p]) ** 2 * float(w_out[p[0]].square().sum())
                         * float(phi[p[0], e].square().sum()) for p in cell}
                kept.update(sorted(cell, key=lambda p: (-score[p], p))[: int(kept_IW[i, s])])
            assert pos == len(cand)   # every routed pair runs on exactly one instance
    gwgu, gwd, dx = torch.zeros_like(wgu), torch.zeros_like(wd), torch.zeros_like(x)
    for t, k in kept:
        e = int(ids[t, k])
        G = weights[t, k] * w_out[t]
        gwd[e] += torch.outer(G, phi[t, e])
        dphi = wd[e].t() @ G
        sa = torch.sigmoid(a[t, e])
        da = dphi * b[t, e] * sa * (1 + a[t, e] * (1 - sa))
        db = dphi * F.silu(a[t, e])
        gwgu[e, :I] += torch.outer(da, x[t])
        gwgu[e, I:] += torch.outer(db, x[t])
        dx[t] += wgu[e, :I].t() @ da + wgu[e, I:].t() @ db
    return gwgu, gwd, dx


def _predicted_splits(plan_, kept_IW, rank, world, el):
    """Rows / expert copies per destination this rank hands to each collective."""
    rank_I = plan_.instance_rank.tolist()
    expert_I = torch.repeat_interleave(torch.arange(len(plan_.instance_offsets) - 1),
                                       plan_.instance_offsets.diff()).tolist()
    per = {k: [0] * world for k in ("dispatch", "grad", "replica_fetch", "replica_grads")}
    for i, (d, e) in enumerate(zip(rank_I, expert_I)):
        per["dispatch"][d] += int(plan_.forward_IW[i, rank])
        per["grad"][d] += int(kept_IW[i, rank])
        owner = e // el
        if d != owner and owner == rank:
            per["replica_fetch"][d] += 1
        if d == rank and owner != rank:
            per["replica_grads"][owner] += 1
    return per


def _layers(cfg, policy, budget, seed):
    torch.manual_seed(seed)
    ref = LRMoELayer(cfg.replace(recalibration_rate=0.0)).double()
    torch.manual_seed(seed)
    plain = LRMoELayer(cfg, ep_group=dist.group.WORLD).double()
    torch.manual_seed(seed)
    placed = LRMoELayer(cfg, ep_group=dist.group.WORLD,
                        policy=dict(policy=policy, memory_budget=budget)).double()
    return ref, plain, placed


def _run(layer, x, w_out, ids):
    x = x.clone().requires_grad_()
    o = layer(x, ids)
    (o * w_out).sum().backward()
    return o, x.grad


def _check_case(rank, world, policy, mode, c, seen):
    E = 2 * world
    el = E // world
    cfg = tep._cfg(num_experts=E, recalibration_rate=c)
    total = 6 * world
    ids, sizes = _routing(mode, total, world, seed=17 + world)
    counts = _counts(ids, sizes, E)
    budget = _budget(policy, counts, c)
    ref, plain, placed = _layers(cfg, policy, budget, seed=5)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(total, H, generator=gen, dtype=torch.float64)
    w_out = torch.randn(total, H, generator=gen, dtype=torch.float64)
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    o_ref, dx_ref = _run(ref, x, w_out, ids)
    o_plain, dx_plain = _run(plain, x[sl], w_out[sl], ids[sl])
    o, dx = _run(placed, x[sl], w_out[sl], ids[sl])
    what = f"{policy} {mode} c={c} rank {rank}"
    es = slice(rank * el, (rank + 1) * el)

    torch.testing.assert_close(o, o_plain, rtol=1e-12, atol=1e-12, msg=what)
    # the single process routes all tokens in one fp32 batch: its routing weights may
    # differ from this rank's by an fp32 rounding (relative 1.2e-7 seen) where the CPU's
    # GEMM kernel depends on the batch size, so comparisons with it use the fp32 router's
    # tolerance of the c > 0 check below; a wrong pair moves a value far more
    torch.testing.assert_close(o, o_ref[sl], rtol=1e-6, atol=1e-6 * max(1.0, float(
        o_ref.abs().max())), msg=what)
    g_gate = placed.gate.weight.grad.clone()
    dist.all_reduce(g_gate)
    torch.testing.assert_close(g_gate, ref.gate.weight.grad, rtol=1e-5, atol=1e-7,
                               msg=what)  # fp32 router: exact at any c
    grads = (placed.experts.gate_up_proj.grad, placed.experts.down_proj.grad)
    plain_grads = (plain.experts.gate_up_proj.grad, plain.experts.down_proj.grad)
    if policy == "fixed":   # the planner's fixed plan runs exactly today's path
        assert torch.equal(o, o_plain) and torch.equal(dx, dx_plain), what
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads)), what
    if c == 0:
        # against the single process: its fp32 routing weights (above)
        torch.testing.assert_close(dx, dx_ref[sl], rtol=1e-6, atol=1e-6 * max(1.0, float(
            dx_ref.abs().max())), msg=what)
        for got, want, alone in zip(grads, (ref.experts.gate_up_proj.grad[es],
                                            ref.experts.down_proj.grad[es]), plain_grads):
            # replica partials summed into the owner: fp64 summation order only
            torch.testing.assert_close(got, alone, rtol=1e-10, atol=1e-12, msg=what)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * max(1.0, float(
                want.abs().max())), msg=what)

    # the plan, independently: same counts, same settings
    plan_ = planner_plan(counts, policy, _memory(budget), recalibration_rate=c)
    kept_IW = _cells(plan_, counts, policy, c)
    _check_bytes(placed, plan_, kept_IW, rank, world, el, what)
    seen[policy] = seen.get(policy, 0) + plan_.replicas
    if c == 0:   # compared with the single process above
        return
    with torch.no_grad():
        routing = ref.gate(x, ids)
    gwgu, gwd, dx_expert = _reference(x, w_out, routing.weights_TK.double(), ids,
                                      ref.experts.gate_up_proj.detach(),
                                      ref.experts.down_proj.detach(), sizes, plan_, kept_IW)
    for got, want in zip(grads, (gwgu[es], gwd[es])):
        # alpha from the fp32 router; a wrongly kept or dropped pair moves a gradient by a
        # whole pair's contribution, far above this tolerance
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * max(1.0, float(
            want.abs().max())), msg=what)
    assert placed.stats.num_retained == int(kept_IW[:, rank].sum()), what


def _check_bytes(placed, plan_, kept_IW, rank, world, el, what):
    E = len(plan_.instance_offsets) - 1
    st = placed.core.replicas.stats
    per = _predicted_splits(plan_, kept_IW, rank, world, el)
    row = H * 8
    copy = (2 * I * H + H * I) * 8
    assert st.splits["dispatch"] == (per["dispatch"], row), what
    assert st.splits["combine"][1] == row + 4
    assert st.splits["grad"] == (per["grad"], row), what
    assert placed.stats.a2a_bytes["forward_dispatch"] == sum(per["dispatch"]) * row
    assert placed.stats.a2a_bytes["backward_grad"] == sum(per["grad"]) * row
    moves = bool((plan_.instance_rank != torch.repeat_interleave(
        torch.arange(E), plan_.instance_offsets.diff()) // el).any())
    if moves:
        assert st.splits["replica_fetch"] == (per["replica_fetch"], copy), what
        assert st.splits["replica_grads"] == (per["replica_grads"], copy), what
    assert st.bytes["weights_fetched"] == sum(per["replica_fetch"]) * copy, what
    assert st.bytes["grads_reduced"] == sum(per["replica_grads"]) * copy, what
    assert st.replicas == plan_.replicas, what


def _check_policies(rank, world, cs, modes):
    seen = {}
    for policy in POLICIES:
        for mode in modes:
            for c in cs:
                _check_case(rank, world, policy, mode, c, seen)
    # the skewed cases did place replicas (so the checks above covered them)
    assert seen["fixed"] == 0 and all(seen[p] > 0 for p in ("ultraep", "symi", "lrmoe")), seen


@pytest.mark.parametrize("world,modes", [(2, MODES), (4, ("one_rank", "idle_expert"))],
                         ids=["W2", "W4"])
def test_policies_equal_no_replica_run_and_retained_pair_reference(world, modes):
    # every routing at W = 2; the two hardest for the planner at W = 4 (time on 2 cores)
    tep._spawn(_check_policies, "gloo", world, (0.0, 0.3), modes)


def _check_w8(rank, world):
    seen = {}
    for policy in ("ultraep", "symi"):
        _check_case(rank, world, policy, "one_rank", 0.0, seen)
    assert all(v > 0 for v in seen.values())


def test_policies_w8():
    tep._spawn(_check_w8, "gloo", 8)


# ------------------------------------------------------------------ symi: the push
def _check_push(rank, world):
    E, el = 2 * world, 2
    cfg = tep._cfg(num_experts=E)
    _, plain, placed = _layers(cfg, "symi", None, seed=2)
    ids, sizes = _routing("one_expert", 6 * world, world, seed=4)
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6 * world, H, generator=gen, dtype=torch.float64)[sl]
    w_out = torch.randn(6 * world, H, generator=gen, dtype=torch.float64)[sl]
    st = placed.core.replicas.stats
    counts = _counts(ids, sizes, E)
    for step in range(3):
        for layer in (plain, placed):
            layer.zero_grad()
        o_plain, _ = _run(plain, x, w_out, ids[sl])
        o, _ = _run(placed, x, w_out, ids[sl])
        torch.testing.assert_close(o, o_plain, rtol=1e-12, atol=1e-12)
        for a, b in zip(placed.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
        if step == 1:   # the copies pushed after step 0's update: nothing fetched
            assert st.bytes["weights_fetched"] == 0
        if step == 2:   # weights changed without a push: stale copies, fetched again
            assert st.bytes["weights_fetched"] > 0
        with torch.no_grad():   # an SGD step on both (bumps the weights' versions)
            for layer in (plain, placed):
                for p in layer.parameters():
                    p -= 0.1 * p.grad
        if step == 0:
            sent = push_replica_weights(placed)
            # the placement of the next step: symi over the popularity of this one
            loads = torch.tensor(counts).sum(0)
            nxt = planner_plan([[0] * E] * world, "symi", _memory(None),
                               previous_load_E=loads)
            per = _predicted_splits(nxt, nxt.forward_IW, rank, world, el)
            copy = (3 * I * H) * 8
            assert sent == st.bytes["weights_pushed"] == sum(per["replica_fetch"]) * copy
            assert st.splits["replica_push"] == (per["replica_fetch"], copy)




# ---------------------------------------------------------------- settings checks
def _check_mismatch(rank, world):
    cfg = tep._cfg()
    cases = [(dict(policy="ultraep"), dict(policy="symi")),
             (dict(policy="ultraep", replica_slots=2), dict(policy="ultraep", replica_slots=1)),
             (dict(policy="lrmoe", memory_budget=1 << 30),
              dict(policy="lrmoe", memory_budget=1 << 31)),
             (dict(policy="lrmoe", resident_bytes=10), dict(policy="lrmoe"))]
    for mine, other in cases:
        with pytest.raises(ValueError, match="placement policy, memory budget, resident "
                                             "bytes and replica slots"):
            LRMoELayer(cfg, ep_group=dist.group.WORLD, policy=mine if rank == 0 else other)
    with pytest.raises(ValueError, match="disagree"):
        LRMoELayer(cfg, ep_group=dist.group.WORLD, policy="symi" if rank == 0 else None)
    layer = LRMoELayer(cfg, ep_group=dist.group.WORLD, policy="ultraep").double()
    layer(torch.randn(5, H, dtype=torch.float64)).sum().backward()   # still usable


def _check_push_and_mismatch(rank, world):
    _check_push(rank, world)
    _check_mismatch(rank, world)


def test_symi_push_after_optimizer_step_and_mismatched_placement_fails_fast():
    tep._spawn(_check_push_and_mismatch, "gloo", 2)


def test_placement_settings_are_checked():
    with pytest.raises(ValueError, match="policy must be one of"):
        Placement("megatron")
    with pytest.raises(ValueError, match="replica_slots >= 1"):
        Placement("ultraep", replica_slots=0)
    with pytest.raises(ValueError, match="memory_budget.*above resident_bytes=100"):
        Placement("lrmoe", memory_budget=50, resident_bytes=100)
    with pytest.raises(TypeError, match="policy must be None"):
        Placement.coerce(3)
    with pytest.raises(ValueError, match="pass ep_group too"):
        LRMoELayer(tep._cfg(), policy="fixed")
    assert Placement.coerce(None) is None
    assert Placement.coerce({"policy": "symi", "replica_slots": 1}).replica_slots == 1


# ------------------------------------------------------------- lrmoe train --policy
def _train_run(tmp_path, policy):
    import json
    from test_train import micro
    from lrmoe.training import train as T

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(T.config_yaml(micro(tmp_path, steps=3, eval_every=0, save_every=2)))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["--ep", "4", "--policy", policy, "--replica-slots", "1"]
    if policy == "lrmoe":
        common += ["--memory-budget", "40KiB"]
    r = tep._torchrun(["--config", str(cfg_file), "--out", str(straight), *common], tmp_path,
                      nproc=4, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    r = tep._torchrun(["--resume", str(straight / "checkpoints" / "step-00000002"), "--out",
                       str(resumed)], tmp_path, nproc=4, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    a = tep._train_records(straight, "step", "loss", "grad_norm")
    b = tep._train_records(resumed, "step", "loss", "grad_norm")
    # resumed: the straight run's steps to float32 rounding, not bitwise -- DDP rebuilds
    # its buckets after its first iteration, and the resumed run's first step reduces the
    # dense gradients in the first layout (lrmoe/parallel/data_parallel.py; as
    # tests/python/parallel/test_dp_ep.py)
    assert [s for s, _, _ in a] == [1, 2, 3] == [s for s, _, _ in b], (a, b)
    for (_, la, ga), (_, lb, gb) in zip(a, b):
        assert la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-5), (a, b)
    recs = [x for x in map(json.loads, (straight / "metrics.jsonl").read_text().splitlines())
            if x["kind"] == "train"]
    for rec in recs:
        assert rec["placement_policy"] == policy
        for key in ("replicas", "rank_load_max_over_mean_before",
                    "rank_load_max_over_mean_forward", "rank_load_max_over_mean_backward",
                    "replica_bytes_fetched", "replica_bytes_pushed", "replica_bytes_reduced"):
            assert key in rec, key
        assert rec["rank_load_max_over_mean_before"] >= 1.0
    return recs


@pytest.mark.parametrize("policy", [
    "symi", pytest.param("fixed", marks=pytest.mark.slow),
    pytest.param("ultraep", marks=pytest.mark.slow), pytest.param("lrmoe", marks=pytest.mark.slow)])
def test_lrmoe_train_ep4_policy_runs_and_resumes(tmp_path, policy):
    recs = _train_run(tmp_path, policy)
    if policy == "symi":   # copies pushed after every step; nothing fetched after step 1
        assert all(r["replica_bytes_pushed"] > 0 for r in recs)
        assert all(r["replica_bytes_fetched"] == 0 for r in recs[1:])
    if policy == "fixed":
        assert all(r["replicas"] == 0 and r["replica_bytes_reduced"] == 0 for r in recs)


# ------------------------------------------------------------------ host syncs (NCCL)
def _check_host_syncs(rank, world):
    cfg = tep._cfg(hidden_size=64, moe_intermediate_size=32, num_experts=4 * world,
                   top_k=4, recalibration_rate=0.25)
    for policy in POLICIES:
        torch.manual_seed(0)
        ep = LRMoELayer(cfg, ep_group=dist.group.WORLD, policy=policy).to(
            tep._DEVICE, torch.bfloat16)
        x = torch.randn(256, 64, dtype=torch.bfloat16, device=tep._DEVICE,
                        requires_grad=True)
        ep(x).float().square().sum().backward()  # warm-up
        torch.cuda.synchronize()
        fwd, bwd = tep.host_syncs_of_step(ep, x)
        # the plan is host C++ on the exchanged counts: still the one sync of the dispatch
        assert len(fwd) == 1 and bwd == [], (policy, fwd, bwd)


@pytest.mark.parametrize("backend,world", tep._backends([], (1, 2)))
def test_policies_add_no_host_sync(backend, world):
    tep._spawn(_check_host_syncs, backend, world)
