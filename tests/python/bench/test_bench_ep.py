"""``lrmoe bench layer --ep N`` on CPU with gloo: the torchrun smoke run, the expert-
parallel dropless baseline against the single-process one, and the launch errors.

The byte counts of the smoke run are checked against a hand computation from the routing
the bench documents (input set 0 of rank r: ``make_routing(kind, T, E, K, seed=1000 r)``)
and the proportional quota written from docs/algorithm.md (conftest), not from the code
under test.
"""
from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from conftest import ref_proportional_quota
from lrmoe.workload.shapes import SHAPES
from lrmoe.workload.routing import make_routing
from test_expert_parallel import _spawn, _torchrun

A2A = ("a2a_counts", "a2a_dispatch", "a2a_combine", "a2a_grad", "a2a_dx")


def _baseline():
    from lrmoe.bench.baselines import dropless
    return dropless


# ------------------------------------------------------------ (a) torchrun smoke run, W = 2
def test_ep_smoke_run_phases_and_bytes(tmp_path):
    world, tokens = 2, 256
    md = tmp_path / "perf.md"
    md.write_text("# perf\n")
    r = _torchrun(["--ep", "2", "--smoke", "--device", "cpu", "--routing", "skewed", "--out",
                   str(tmp_path / "o"),
                   "--append-md", str(md)], tmp_path, nproc=world, timeout=180,
                  subcommand=("bench", "layer"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "wrote" in r.stdout and "dropless" in r.stdout, r.stdout
    data = json.loads((tmp_path / "o" / "layer_bench_ep.json").read_text())
    recs = {x["label"]: x for x in data["records"]}
    assert list(recs) == ["lrmoe c=0", "lrmoe c=0.1", "lrmoe c=0.2", "lrmoe c=0.3",
                          "dropless"]
    assert [(x["method"], x["rate"]) for x in data["records"]] == [
        ("lrmoe", 0.0), ("lrmoe", 0.1), ("lrmoe", 0.2), ("lrmoe", 0.3), ("dropless", None)]
    # float32 on gloo: the EP dropless baseline agrees with the EP layer at c = 0 to
    # float32 rounding (max over ranks)
    check = recs["dropless"]["agreement"]
    assert check["passed"] and max(check["out_rel_err"], check["dx_rel_err"]) < 1e-5
    assert data["meta"]["world_size"] == world and data["meta"]["backend"] == "gloo"
    assert "--nproc-per-node 2 -m lrmoe bench layer --ep 2" in data["meta"]["command"]
    for name, rec in recs.items():
        for k in A2A + ("expert_gemm_fwd",):
            assert rec["phases_ms"][k] >= 0 and rec["phases_ms_mean"][k] >= 0, (name, k)
        assert rec["fwd_ms"] >= rec["fwd_ms_mean"] > 0 and rec["bwd_ms"] > 0
        assert rec["tokens_per_rank"] == tokens and len(rec["a2a_bytes_per_rank"]) == world

    # hand computation from the documented routing of input set 0 of each rank
    d = SHAPES["smoke"].dims
    E, K, H, esize = d["experts"], d["top_k"], d["hidden"], 4  # float32 on the CPU
    el = E // world
    ids = [make_routing("skewed", tokens, E, K, seed=1000 * rank) for rank in range(world)]
    n_e = sum(torch.bincount(i.reshape(-1), minlength=E) for i in ids).tolist()
    assert recs["dropless"]["tokens_per_expert"] == n_e
    recv = [sum(n_e[r * el:(r + 1) * el]) for r in range(world)]   # rows each rank's experts get
    P = tokens * K                                                   # pairs per rank
    row = H * esize
    for name in ("lrmoe c=0", "dropless"):
        per_rank = recs[name]["a2a_bytes_per_rank"]
        side = 4 if name.startswith("lrmoe") else 0                  # fp32 phi_sq side band
        assert [b["forward_dispatch"] for b in per_rank] == [P * row] * world
        assert [b["forward_combine"] for b in per_rank] == [n * (row + side) for n in recv]
        assert [b["backward_grad"] for b in per_rank] == [P * row] * world
        assert [b["backward_dx"] for b in per_rank] == [n * row for n in recv]
        assert [b["backward_index"] for b in per_rank] == [P * 4 * bool(side)] * world
    assert [b["counts"] for b in recs["lrmoe c=0"]["a2a_bytes_per_rank"]] == \
        [(E + 1) * 8 * world] * world
    assert [b["counts"] for b in recs["dropless"]["a2a_bytes_per_rank"]] == [E * 8] * world
    lr, dl = recs["lrmoe c=0"]["a2a_bytes"], recs["dropless"]["a2a_bytes"]
    assert lr["forward_dispatch"] == dl["forward_dispatch"] == world * P * row
    assert lr["forward_combine"] == dl["forward_combine"] + 4 * world * P
    # c = 0.3: global quotas by the proportional rule; only kept rows cross
    kept = sum(ref_proportional_quota(n_e, Fraction(3, 10)))
    c3 = recs["lrmoe c=0.3"]
    assert c3["num_retained"] == kept and kept * 10 <= 7 * world * P
    assert c3["a2a_bytes"]["backward_grad"] == kept * row
    assert c3["a2a_bytes"]["backward_index"] == kept * 4
    assert c3["a2a_bytes"]["backward_dx"] == kept * row
    assert c3["a2a_bytes"]["backward_grad"] <= 0.7 * lr["backward_grad"]
    assert (c3["a2a_bytes"]["backward_grad"] + c3["a2a_bytes"]["backward_index"]
            <= 0.7 * (lr["backward_grad"] + lr["backward_index"]))
    assert c3["bwd_bytes_vs_c0"] == pytest.approx(kept / (world * P))
    for c in ("0.1", "0.2", "0.3"):   # the forward is exact: same bytes at every c
        assert recs[f"lrmoe c={c}"]["a2a_bytes_fwd"] == recs["lrmoe c=0"]["a2a_bytes_fwd"]
    text = (tmp_path / "o" / "layer_bench_ep.md").read_text()
    assert "| smoke | 256 | skewed" in text and "a2a_dx" in text
    assert md.read_text().startswith("# perf\n") and "expert parallel W = 2" in md.read_text()


# ----------------------------------------- (b) EP dropless == single-process dropless, fp64
def _check_dropless_ep(rank, world, sizes):
    mod = _baseline()
    E, K, H, I = 4, 2, 8, 6
    total = sum(sizes)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(total, H, generator=gen, dtype=torch.float64)
    w_out = torch.randn(total, H, generator=gen, dtype=torch.float64)
    weights = torch.rand(total, K, generator=gen, dtype=torch.float64) + 0.1
    w_gu = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64) * 0.3
    w_d = torch.randn(E, H, I, generator=gen, dtype=torch.float64) * 0.3
    ids = make_routing("skewed", total, E, K, seed=4)
    ids[0] = torch.tensor([0, 3])  # both ranks' experts from one token

    ref = [t.clone().requires_grad_() for t in (x, weights, w_gu, w_d)]
    (mod.dropless_moe(ref[0], ref[1], ids, ref[2], ref[3]) * w_out).sum().backward()

    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    el = E // world
    es = slice(rank * el, (rank + 1) * el)
    mine = [t.clone().requires_grad_() for t in (x[sl], weights[sl], w_gu[es], w_d[es])]
    nbytes = {}
    o = mod.dropless_moe_ep(mine[0], mine[1], ids[sl], mine[2], mine[3],
                            group=dist.group.WORLD, a2a_bytes=nbytes)
    (o * w_out[sl]).sum().backward()
    close = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o, mod.dropless_moe(x, weights, ids, w_gu, w_d)[sl], **close)
    torch.testing.assert_close(mine[0].grad, ref[0].grad[sl], **close)
    torch.testing.assert_close(mine[1].grad, ref[1].grad[sl], **close)
    torch.testing.assert_close(mine[2].grad, ref[2].grad[es], **close)  # sums over all ranks
    torch.testing.assert_close(mine[3].grad, ref[3].grad[es], **close)
    recv = int(((ids >= rank * el) & (ids < (rank + 1) * el)).sum())
    assert nbytes == dict(counts=E * 8, forward_dispatch=sizes[rank] * K * H * 8,
                          forward_combine=recv * H * 8, backward_grad=sizes[rank] * K * H * 8,
                          backward_index=0, backward_dx=recv * H * 8)


@pytest.mark.parametrize("sizes", [[15, 8], [23, 0]])
def test_dropless_ep_matches_single_process(sizes):
    _spawn(_check_dropless_ep, "gloo", 2, sizes)


def test_dropless_ep_checks_token_rows():
    mod = _baseline()
    with pytest.raises(ValueError, match="expert_ids_TK has 3 rows but x_TH has 4 tokens"):
        mod.dropless_moe_ep(torch.zeros(4, 8), torch.zeros(3, 2), torch.zeros(3, 2,
                            dtype=torch.long), torch.zeros(2, 12, 8), torch.zeros(2, 8, 6))


# ------------------------------------------------------------------- (c) launch errors
def test_ep_without_torchrun_names_ep_and_torchrun(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    r = _torchrun(["--ep", "2", "--smoke", "--out", str(tmp_path)], tmp_path, nproc=0,
                  subcommand=("bench", "layer"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("--ep 2 needs 2 processes started by torchrun" in r.stderr
            and "torchrun --nproc-per-node 2" in r.stderr), r.stderr[-2000:]


def test_ep_wrong_world_size_and_transformers(tmp_path, monkeypatch):
    from lrmoe.bench.layer_ep import bench_layer_ep
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=r"--ep 2 needs 2 processes, but torchrun started 4; "
                                         r"pass --ep 4 .* launch with torchrun "
                                         r"--nproc-per-node 2"):
        bench_layer_ep(2, ["smoke"], [16], ["uniform"], device="cpu", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--methods transformers has no expert-parallel mode"):
        bench_layer_ep(2, ["smoke"], [16], ["uniform"], methods=["lrmoe", "transformers"],
                       device="cpu", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--methods torchtitan has no expert-parallel mode"):
        bench_layer_ep(2, ["smoke"], [16], ["uniform"], methods=["torchtitan", "lrmoe"],
                       device="cpu", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="--shapes smoke has 8 experts, not divisible by --ep 3"):
        bench_layer_ep(3, ["smoke"], [16], ["uniform"], device="cpu", out_dir=str(tmp_path))
    assert not dist.is_initialized()


# ------------------------------------------------ merging ranks and the NCCL report branch
def test_merge_ranks_max_mean_sums_and_nccl_markdown():
    from lrmoe.bench.layer_ep import _add_ratios, _merge_ranks, markdown_ep

    def rank_rec(rate, fwd, bwd, grad_bytes, kernels):
        b = dict(counts=8, forward_dispatch=100, forward_combine=104, backward_grad=grad_bytes,
                 backward_index=grad_bytes // 25, backward_dx=grad_bytes)
        return dict(method="lrmoe", rate=rate, label=f"lrmoe c={rate:g}", agreement=None,
                    fwd_ms=fwd, bwd_ms=bwd, fwd_bwd_ms=fwd + bwd,
                    phases_ms={k: fwd / 10 for k in A2A}, a2a_bytes=b, peak_bytes=None,
                    a2a_kernels_ms={"fwd": kernels, "bwd": kernels[:1]})
    c0 = _merge_ranks([rank_rec(0.0, 2.0, 4.0, 100, [0.5, 0.25]),
                       rank_rec(0.0, 3.0, 1.0, 100, [1.0])])
    c3 = _merge_ranks([rank_rec(0.3, 1.0, 1.0, 75, []),
                       rank_rec(0.3, 1.0, 2.0, 65, [])])
    assert (c0["method"], c0["rate"], c0["label"]) == ("lrmoe", 0.0, "lrmoe c=0")
    assert (c0["fwd_ms"], c0["fwd_ms_mean"], c0["bwd_ms"]) == (3.0, 2.5, 4.0)
    assert c0["fwd_bwd_ms"] == 6.0
    assert c0["phases_ms"]["a2a_dx"] == 0.3 and c0["phases_ms_mean"]["a2a_dx"] == 0.25
    assert c0["a2a_bytes"]["backward_grad"] == 200 and c0["a2a_bytes_bwd"] == 200 + 8 + 200
    assert c0["a2a_kernels_ms"]["fwd"] == {"max": 1.0, "mean": 0.875}
    _add_ratios([c0, c3])
    assert c3["bwd_bytes_vs_c0"] == pytest.approx((140 + 3 + 2 + 140) / 408)
    assert c0["vs_dropless"] is None
    for r in (c0, c3):
        r.update(shape="qwen3-30b-a3b", tokens_per_rank=32768, routing="skewed",
                 load_max_over_mean=2.5)
    meta = dict(world_size=2, date="d", device="GPU", command="torchrun ...", hosts=["h"],
                backend="nccl", torch="2.11", iters=3)
    text = markdown_ep([c0, c3], meta)
    assert "| qwen3-30b-a3b | 32768 | skewed (2.50) | lrmoe c=0 | 2.00 |" not in text
    assert "| qwen3-30b-a3b | 32768 | skewed (2.50) | lrmoe c=0 | 3.00 | 4.00 | 6.00 |" in text
    assert "NCCL all-to-all kernels" in text and "| lrmoe c=0 | 1.000 | 1.000 |" in text


def test_bench_cli_rejects_bad_tokens_and_torchrun_without_ep(monkeypatch):
    from lrmoe.bench.cli import run_layer
    from lrmoe.cli import build_parser

    def run(*argv):
        return run_layer(build_parser().parse_args(["bench", "layer", *argv]), list(argv))
    with pytest.raises(ValueError, match="--tokens must be >= 1, got \\[0\\]"):
        run("--tokens", "0")
    with pytest.raises(ValueError, match="--smoke fixes --tokens .*; drop --tokens"):
        run("--smoke", "--tokens", "64")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="torchrun started 2 processes but --ep is not "
                                         "given: pass --ep 2"):
        run("--smoke", "--device", "cpu")


# ------------------------------------------------------- (d) placement policies, W = 2
def test_ep_policies_rows_agreement_and_plan(tmp_path):
    """--policies: one row per policy and rate over the same weights; each policy at c = 0
    reproduces the layer without a policy (output and input gradient); every policy's
    plan computes each routed pair exactly once (its forward rows per rank sum to the
    routed pairs, counted here from the documented routing), and the placement table is
    written."""
    world, tokens = 2, 256
    r = _torchrun(["--ep", "2", "--smoke", "--device", "cpu", "--routing", "skewed",
                   "--rates", "0", "0.3", "--methods", "lrmoe", "--policies", "none",
                   "fixed", "ultraep", "lrmoe", "--out", str(tmp_path / "o")], tmp_path, nproc=world, timeout=240,
                  subcommand=("bench", "layer"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "o" / "layer_bench_ep.json").read_text())
    assert [x["label"] for x in data["records"]] == [
        "lrmoe c=0", "lrmoe c=0.3", "lrmoe fixed c=0", "lrmoe fixed c=0.3",
        "lrmoe ultraep c=0", "lrmoe ultraep c=0.3", "lrmoe lrmoe c=0", "lrmoe lrmoe c=0.3"]
    d = SHAPES["smoke"].dims
    pairs = sum(make_routing("skewed", tokens, d["experts"], d["top_k"], seed=1000 * rank)
                .numel() for rank in range(world))
    for rec in data["records"]:
        if rec["policy"] is None:
            assert "placement" not in rec and rec["agreement"] is None
            continue
        p = rec["placement"]
        assert sum(p["rows_forward_W"]) == sum(p["rows_before_W"]) == pairs, rec["label"]
        assert sum(p["rows_backward_W"]) == rec["num_retained"], rec["label"]
        assert set(p["memory_max_bytes"]) == {"base_experts", "replicas", "forward_tokens",
                                              "backward_tokens"}
        assert p["memory_total_max_bytes"] >= p["memory_max_bytes"]["base_experts"] > 0
        if rec["rate"] == 0:
            assert rec["agreement"]["passed"], rec
        else:
            assert rec["agreement"] is None
    by = {x["label"]: x for x in data["records"]}
    assert by["lrmoe fixed c=0"]["placement"]["replicas"] == 0  # ownership: no copies
    assert by["lrmoe ultraep c=0.3"]["bwd_bytes_vs_c0"] == pytest.approx(
        by["lrmoe ultraep c=0.3"]["a2a_bytes_bwd"] / by["lrmoe ultraep c=0"]["a2a_bytes_bwd"])
    assert "Placement policies" in (tmp_path / "o" / "layer_bench_ep.md").read_text()


def test_policies_without_ep_are_refused(tmp_path):
    r = _torchrun(["--smoke", "--device", "cpu", "--policies", "ultraep", "--out",
                   str(tmp_path / "o")], tmp_path, nproc=0, subcommand=("bench", "layer"))
    assert r.returncode == 2 and "--policies place experts" in r.stderr, r.stderr[-2000:]
