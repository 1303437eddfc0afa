"""``lrmoe bench layer``: CPU smoke run (CI) and the baselines' equivalence.

The timings of a CPU smoke run mean nothing; what is checked is that every method runs,
that the report files are written, that the methods compute the same function (so that
the GPU benchmark compares like with like), that a method which does not is reported and
not timed, that the targets come from the package's data file, and that the command runs
from an installed copy of the package with the profiler's messages kept off stderr.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from lrmoe.bench import layer as bench_layer_module
from lrmoe.bench.layer import bench_layer, run_case
from lrmoe.bench.methods import build_methods
from lrmoe.bench.report import check_targets, load_targets, markdown
from lrmoe.bench.routing import Case, load_imbalance, make_routing

REPO = Path(__file__).resolve().parents[2]


def test_methods_compute_the_same_layer():
    # float32: transformers' grouped_mm experts path takes no float64
    case = Case("smoke", 64, "skewed", torch.float32)
    ids = make_routing("skewed", 64, 8, 2, seed=0)
    x = torch.randn(64, 64)
    g = torch.randn(64, 64)
    outs, grads = {}, {}
    for m in build_methods(case, [0.0], ["lrmoe", "dropless", "transformers"],
                           torch.device("cpu")):
        xi = x.clone().requires_grad_()
        out = m.forward(xi, ids)
        out.backward(g)
        outs[m.label], grads[m.label] = out.detach(), xi.grad
    # the same float32 function summed in other orders: agreement to fp32 rounding
    for name in ("dropless", "transformers"):
        assert rel_err(outs[name], outs["lrmoe c=0"]) < 1e-5, name
        assert rel_err(grads[name], grads["lrmoe c=0"]) < 1e-5, name


def test_routing_kinds():
    uni = make_routing("uniform", 4096, 16, 4, seed=1)
    skew = make_routing("skewed", 4096, 16, 4, seed=1)
    for ids in (uni, skew):
        assert ids.shape == (4096, 4)
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # K distinct experts
    assert load_imbalance(uni, 16) < 1.15 < 2.0 < load_imbalance(skew, 16)
    with pytest.raises(ValueError, match="--trace"):
        make_routing("trace", 8, 16, 4, seed=0)


def test_smoke_run_writes_reports(tmp_path):
    md = tmp_path / "perf.md"
    md.write_text("# perf\n")
    result = bench_layer(["smoke"], [128], ["uniform"], rates=[0.0, 0.3],
                         methods=["lrmoe", "dropless", "transformers"], device="cpu",
                         dtype="float32", iters=1, warmup=1, rotate=1, transformers_iters=1,
                         out_dir=str(tmp_path / "out"), append_md=str(md), command="test")
    names = [r["label"] for r in result["records"]]
    assert names == ["lrmoe c=0", "lrmoe c=0.3", "dropless", "transformers"]
    assert [(r["method"], r["rate"]) for r in result["records"]] == [
        ("lrmoe", 0.0), ("lrmoe", 0.3), ("dropless", None), ("transformers", None)]
    for r in result["records"][2:]:  # float32: the baselines agree to float32 rounding
        a = r["agreement"]
        assert a["passed"] and a["out_rel_err"] < 1e-5 and a["dx_rel_err"] < 1e-5, r["label"]
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0
    data = json.loads((tmp_path / "out" / "layer_bench.json").read_text())
    c0, c3 = data["records"][0], data["records"][1]
    assert c3["num_retained"] == int(0.7 * 256) and c0["num_retained"] == 256
    assert c3["backward_buffer_bytes"] < 0.71 * c0["backward_buffer_bytes"]
    assert {"router", "permute", "expert_gemm_fwd", "combine", "score", "select",
            "compact", "expert_gemm_bwd", "scatter"} <= set(c3["phases_ms"])
    assert (tmp_path / "out" / "layer_bench.png").stat().st_size > 10_000
    assert "| smoke | 128 | uniform" in md.read_text()


def test_routing_trace_round_trip(tmp_path):
    from lrmoe.trace import RoutingTrace, load_trace
    trace = RoutingTrace(num_experts=16, top_k=4, every=2)
    recorded = {}
    for step in range(4):
        trace.step = step
        if trace.wants():
            for layer in range(2):
                ids = make_routing("skewed", 50, 16, 4, seed=10 * step + layer)
                trace.record(layer, ids)
                recorded[(step, layer)] = ids
    path = trace.save(tmp_path / "t.npz")
    meta, arrays = load_trace(path)
    assert meta == dict(num_experts=16, top_k=4, layers=[0, 1], steps=[0, 2])
    for got, key in zip(arrays, sorted(recorded)):
        assert torch.equal(torch.from_numpy(got), recorded[key])
    ids = make_routing("trace", 300, 16, 4, seed=0, trace=str(path))
    rows = {tuple(r) for v in recorded.values() for r in v.tolist()}
    assert ids.shape == (300, 4) and all(tuple(r) in rows for r in ids.tolist())
    with pytest.raises(ValueError, match="E=16, K=4"):
        make_routing("trace", 10, 8, 4, seed=0, trace=str(path))


def test_torchtitan_moe_matches_lrmoe():
    # torchtitan's experts always run torch._grouped_mm in bf16 (no other path in 0.3.0),
    # so even against the float32 LRMoE layer the agreement is bf16-level
    from lrmoe.bench.torchtitan_moe import torchtitan_missing
    from test_layer import BF16_TOL
    if torchtitan_missing():
        pytest.skip(torchtitan_missing())
    case = Case("smoke", 64, "skewed", torch.float32)
    ids = make_routing("skewed", 64, 8, 2, seed=0)
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
    lrm, titan = build_methods(case, [0.0], ["lrmoe", "torchtitan"], torch.device("cpu"))
    assert (titan.method, titan.rate, titan.label) == ("torchtitan", None, "torchtitan")
    got = {}
    for m in (lrm, titan):
        xi = x.clone().requires_grad_()
        out = m.forward(xi, ids)
        out.backward(g)
        got[m.method] = (out.detach(), xi.grad)
    assert rel_err(got["torchtitan"][0], got["lrmoe"][0]) < BF16_TOL
    assert rel_err(got["torchtitan"][1], got["lrmoe"][1]) < BF16_TOL
    # the routed part alone (the float32 shared expert dominates the output's norm)
    layer, block = lrm.reference, titan.module
    shared = layer.shared_expert(x).detach()
    assert rel_err(got["torchtitan"][0] - shared, got["lrmoe"][0] - shared) < BF16_TOL
    # weight gradients land in the layout the docstring maps: w1/w3 = gate/up rows
    inter = case.dims["inter"]
    experts = block.routed_experts.inner_experts
    pairs = [(experts.w1_EFD.grad, layer.experts.gate_up_proj.grad[:, :inter]),
             (experts.w3_EFD.grad, layer.experts.gate_up_proj.grad[:, inter:]),
             (experts.w2_EDF.grad, layer.experts.down_proj.grad),
             (block.router.gate.weight.grad, layer.gate.weight.grad),
             (block.shared_experts.w1.weight.grad, layer.shared_expert.gate_proj.weight.grad),
             (block.shared_experts.w2.weight.grad, layer.shared_expert.down_proj.weight.grad)]
    for k, (a, b) in enumerate(pairs):
        assert rel_err(a, b) < BF16_TOL, k


def test_a_disagreeing_baseline_is_reported_not_timed(monkeypatch):
    real = bench_layer_module.build_methods

    def off_by_ten_percent(*args, **kwargs):
        built = real(*args, **kwargs)
        for m in built:
            if m.method == "dropless":
                m.forward = lambda x, ids, f=m.forward: f(x, ids) * 1.1
        return built
    monkeypatch.setattr(bench_layer_module, "build_methods", off_by_ten_percent)
    recs = run_case(Case("smoke", 64, "uniform", torch.float32), [0.0], ["lrmoe", "dropless"],
                    torch.device("cpu"), iters=1, warmup=0, rotate=1, trace=None,
                    transformers_iters=1)
    lrm, bad = recs
    assert lrm["agreement"] is None and lrm["fwd_ms"] > 0
    assert bad["status"] == "failed agreement check" and bad["fwd_ms"] is None
    # output and input gradient both scaled by 1.1: relative error 0.1 exactly
    assert bad["agreement"]["out_rel_err"] == pytest.approx(0.1, rel=1e-4)
    assert bad["agreement"]["dx_rel_err"] == pytest.approx(0.1, rel=1e-4)
    assert not bad["agreement"]["passed"]
    meta = dict(date="d", device="CPU", command="c", torch="t", iters=1)
    assert "| dropless | - | - | - |" in markdown(recs, {}, [], meta)
    assert "FAILED 1.0e-01" in markdown(recs, {}, [], meta)


def _rec(method, rate, fwd, bwd, tokens=32768, **extra):
    return dict(shape="qwen3-30b-a3b", tokens=tokens, routing="skewed", method=method,
                rate=rate, fwd_ms=fwd, bwd_ms=bwd, fwd_bwd_ms=fwd + bwd,
                phases_ms=extra.pop("phases_ms", {}), **extra)


def test_targets_come_from_the_data_file(tmp_path):
    records = [
        _rec("lrmoe", 0.0, 4.0, 8.0, backward_buffer_bytes=1000, phase_GBps={"permute": 3000.0},
             phases_ms={"score": 0.125, "select": 0.125, "compact": 0.25}),
        _rec("lrmoe", 0.2, 4.0, 6.0, backward_buffer_bytes=790),
        _rec("lrmoe", 0.3, 4.0, 6.4, backward_buffer_bytes=750),
        _rec("dropless", None, 5.0, 7.0),
        _rec("dropless", None, 1.0, 1.0, tokens=16384),  # another case: not read
    ]
    rows = {t["target"]: t for t in check_targets(records, {"copy_GBps": 4000.0})}
    expect = {  # hand-computed from the records above
        "c=0 fwd+bwd / dropless": (12 / 12, True, False),
        "score+select+compact / c=0 backward": (0.5 / 8, False, False),
        "backward c=0.2 / c=0": (6 / 8, True, False),
        "backward c=0.3 / c=0": (6.4 / 8, False, False),
        "dropless / c=0.2 fwd+bwd (speed-up)": (12 / 10, True, False),
        "permute bandwidth / copy ceiling": (3000 / 4000, True, False),
        "buffer bytes c=0.2 / c=0": (0.79, True, False),
        "buffer bytes c=0.3 / c=0": (0.75, False, False),
        "c=0 fwd+bwd ms": (12.0, True, True),
        "c=0 fwd ms": (4.0, True, True),
        "c=0 bwd ms": (8.0, True, True),
        "c=0.2 fwd+bwd / c=0 fwd+bwd": (10 / 12, True, True),
        "c=0.3 fwd+bwd / c=0 fwd+bwd": (10.4 / 12, False, True),
    }
    assert set(rows) == set(expect)
    for name, (value, met, info) in expect.items():
        assert rows[name]["value"] == pytest.approx(value), name
        assert (rows[name]["met"], rows[name]["info"]) == (met, info), name
    assert rows["c=0 fwd+bwd / dropless"]["limit"] == "<= 1.05"
    assert rows["dropless / c=0.2 fwd+bwd (speed-up)"]["limit"] == ">= 1.12"
    # no ceiling (CPU): the bandwidth rows are left out
    assert "permute bandwidth / copy ceiling" not in {
        t["target"] for t in check_targets(records, {"copy_GBps": None})}
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"case": {}, "targets": [
        {"name": "x", "value": {"method": "dropless", "field": "fwd_ms"}, "op": "<"}]}))
    with pytest.raises(ValueError, match="target x: 'op' must be <= or >="):
        load_targets(str(bad))
    assert load_targets()["case"] == dict(shape="qwen3-30b-a3b", tokens=32768,
                                          routing="skewed")


def test_cli_runs_from_an_installed_copy_without_profiler_noise(tmp_path):
    # the package alone (as pip installs it) in a folder of its own, run from another
    # folder, every sys.path entry holding a benchmarks/ folder removed
    site = tmp_path / "site"
    shutil.copytree(REPO / "lrmoe", site / "lrmoe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    driver = ("import os, sys\n"
              "sys.path[:] = [p for p in sys.path\n"
              "               if not os.path.isdir(os.path.join(p or '.', 'benchmarks'))]\n"
              "import lrmoe.cli\n"
              "print('LRMOE', lrmoe.cli.__file__)\n"
              "sys.exit(lrmoe.cli.main(sys.argv[1:]))\n")
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).resolve() != REPO]  # e.g. where torchtitan is installed
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(site)] + extra)}
    r = subprocess.run([sys.executable, "-c", driver, "bench", "layer", "--smoke", "--device",
                        "cpu", "--routing", "uniform", "--rates", "0", "0.3", "--methods",
                        "lrmoe", "dropless", "--out", str(work / "out")],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"LRMOE {site / 'lrmoe' / 'cli.py'}" in r.stdout
    assert re.search(r"smoke +256 +uniform +dropless fwd", r.stdout), r.stdout
    assert (work / "out" / "layer_bench.json").is_file()
    noise = [ln for ln in r.stderr.splitlines()
             if re.search(r"STAGE:|USDT:|cupti|kineto|profiler", ln, re.IGNORECASE)]
    assert noise == [], r.stderr[-3000:]


def test_torchtitan_asked_for_but_missing_names_the_install_line(monkeypatch):
    from lrmoe.bench import torchtitan_moe
    from lrmoe.bench.methods import check_choices, default_methods
    monkeypatch.setattr(torchtitan_moe, "torchtitan_missing",
                        lambda: "no torchtitan; install it with `pip install --no-deps x`")
    with pytest.raises(ValueError, match="--methods torchtitan: no torchtitan; install it"):
        check_choices(["smoke"], ["lrmoe", "torchtitan"], "float32")
    assert default_methods() == ["lrmoe", "dropless", "transformers"]
    with pytest.raises(ValueError, match="unknown method 'titan'; choose from lrmoe, dropless, "
                                         "transformers, torchtitan"):
        check_choices(["smoke"], ["titan"], "float32")
