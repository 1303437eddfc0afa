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
from lrmoe.bench.cases import Case
from lrmoe.bench.cases import load_imbalance
from lrmoe.workload.routing import make_routing

REPO = Path(__file__).resolve().parents[3]


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
    from lrmoe.workload.trace import RoutingTrace, load_trace
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
    from lrmoe.bench.baselines.torchtitan_moe import torchtitan_missing
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
    # the CUDA-graph rows (--cuda-graph) have targets of their own; c=0.2 graph not run
    graph = [_rec("lrmoe_graph", 0.0, 3.0, 7.0), _rec("lrmoe_graph", 0.3, 2.0, 6.25),
             _rec("torchtitan", None, 10.0, 11.0)]
    rows = {t["target"]: t for t in check_targets(records + graph, {})}
    expect = {"c=0 graph fwd+bwd ms": (10.0, True), "c=0 graph fwd ms": (3.0, True),
              "c=0 graph bwd ms": (7.0, True),
              "torchtitan fwd+bwd / c=0 graph fwd+bwd (speed-up)": (21 / 10, False),
              "c=0.3 graph fwd+bwd / c=0 graph fwd+bwd": (8.25 / 10, False)}
    for name, (value, met) in expect.items():
        assert rows[name]["value"] == pytest.approx(value), name
        assert (rows[name]["met"], rows[name]["info"]) == (met, True), name
    assert "c=0.2 graph fwd+bwd / c=0 graph fwd+bwd" not in rows


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
    from lrmoe.bench.baselines import torchtitan_moe
    from lrmoe.bench.methods import check_choices, default_methods
    monkeypatch.setattr(torchtitan_moe, "torchtitan_missing",
                        lambda: "no torchtitan; install it with `pip install --no-deps x`")
    with pytest.raises(ValueError, match="--methods torchtitan: no torchtitan; install it"):
        check_choices(["smoke"], ["lrmoe", "torchtitan"], "float32")
    assert default_methods() == ["lrmoe", "dropless", "transformers"]
    with pytest.raises(ValueError, match="unknown method 'titan'; choose from lrmoe, dropless, "
                                         "transformers, torchtitan"):
        check_choices(["smoke"], ["titan"], "float32")


# ----------------------------------------------------------- where the time goes (--profile-dir)
def _x(name, cat, ts, dur, tid=1, pid=1, corr=None):
    e = dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, pid=pid, tid=tid, args={})
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def _synthetic_trace():
    """A hand-made step (us): forward 0-100 and backward 100-300 host ranges; kernels on
    the device (pid 0) launched from thread 1 (forward) and thread 2 (autograd)."""
    return [
        _x("lrmoe:forward", "user_annotation", 0, 100),
        _x("lrmoe:backward", "user_annotation", 100, 200),
        _x("lrmoe.router", "user_annotation", 0, 20),
        _x("lrmoe.permute", "user_annotation", 20, 20),
        _x("aten::foo", "cpu_op", 45, 15),
        _x("lrmoe.combine", "user_annotation", 60, 35),
        _x("lrmoe.score", "user_annotation", 110, 20, tid=2),
        _x("lrmoe.select", "user_annotation", 140, 15),  # thread 1: not k6's phase
        _x("cudaLaunchKernel", "cuda_runtime", 5, 1, corr=1),
        _x("cudaLaunchKernel", "cuda_runtime", 25, 1, corr=2),
        _x("cudaLaunchKernel", "cuda_runtime", 65, 1, corr=3),
        _x("cudaLaunchKernel", "cuda_runtime", 115, 1, tid=2, corr=4),
        _x("cudaMemsetAsync", "cuda_runtime", 120, 1, tid=2, corr=5),
        _x("cuLaunchKernel", "cuda_driver", 150, 1, tid=2, corr=6),
        _x("cudaLaunchKernel", "cuda_runtime", 350, 1, corr=7),
        _x("void a<int>(int*)", "kernel", 10, 10, pid=0, tid=7, corr=1),
        _x("b", "kernel", 30, 5, pid=0, tid=7, corr=2),
        _x("void a<float, 4>(float*)", "kernel", 70, 20, pid=0, tid=7, corr=3),
        _x("c", "kernel", 118, 10, pid=0, tid=7, corr=4),
        _x("Memset (Device)", "gpu_memset", 125, 10, pid=0, tid=8, corr=5),  # overlaps c
        _x("d", "kernel", 160, 40, pid=0, tid=7, corr=6),
        _x("late", "kernel", 400, 5, pid=0, tid=7, corr=7),  # launched after the step
        _x("lrmoe:forward", "gpu_user_annotation", 10, 80, pid=0, tid=7),  # a mirror
    ]


def test_where_time_goes_on_a_hand_made_trace():
    from lrmoe.bench.profile import where_time_goes
    tg = where_time_goes(_synthetic_trace())
    f, b = tg["forward"], tg["backward"]
    # forward ops 10-20, 30-35, 70-90: span 80, busy 35, gaps 10 (20-30) and 35 (35-70)
    assert (f["span_ms"], f["busy_ms"], f["idle_ms"]) == pytest.approx((0.080, 0.035, 0.045))
    assert (f["num_ops"], f["num_gaps"]) == (3, 2)
    assert f["kernels"] == [dict(name="a", ms=pytest.approx(0.030), count=2),
                            dict(name="b", ms=pytest.approx(0.005), count=1)]
    assert f["phases"] == pytest.approx({"lrmoe.combine": 0.020, "lrmoe.router": 0.010,
                                         "lrmoe.permute": 0.005})
    g1, g2 = f["gaps"]
    assert g1["ms"] == pytest.approx(0.035) and g1["start_ms"] == pytest.approx(0.025)
    assert (g1["host_range"], g1["before"], g1["after"]) == ("aten::foo", "b", "a")
    assert (g1["before_phase"], g1["after_phase"]) == ("lrmoe.permute", "lrmoe.combine")
    assert g2["ms"] == pytest.approx(0.010) and g2["host_range"] == "lrmoe.permute"
    assert f["idle_by_host_range"] == pytest.approx({"aten::foo": 0.035,
                                                     "lrmoe.permute": 0.010})
    # backward ops 118-128, 125-135 (overlapping), 160-200: span 82, busy 57, one gap 25
    assert (b["span_ms"], b["busy_ms"], b["idle_ms"]) == pytest.approx((0.082, 0.057, 0.025))
    assert (b["num_ops"], b["num_gaps"]) == (3, 1)
    assert b["phases"] == pytest.approx({"(no phase)": 0.040, "lrmoe.score": 0.020})
    (g,) = b["gaps"]
    assert g["host_range"] == "lrmoe.select" and g["after_phase"] == "(no phase)"
    assert g["before"] == "Memset"  # kernel_family drops the "(...)"
    assert f["graph_launches"] == b["graph_launches"] == 0
    # a graph replay: its kernels correlate to the cudaGraphLaunch inside the part
    graph = [_x("lrmoe:forward", "user_annotation", 0, 10),
             _x("lrmoe:backward", "user_annotation", 10, 10),
             _x("cudaGraphLaunch", "cuda_runtime", 2, 1, corr=9),
             _x("k1", "kernel", 20, 5, pid=0, corr=9), _x("k2", "kernel", 30, 5, pid=0, corr=9)]
    tg = where_time_goes(graph)
    assert tg["forward"]["graph_launches"] == 1 and tg["backward"]["graph_launches"] == 0
    assert tg["forward"]["num_ops"] == 2 and tg["forward"]["idle_ms"] == pytest.approx(0.005)


def test_where_time_goes_needs_the_step_markers():
    from lrmoe.bench.profile import kernel_family, where_time_goes
    events = [e for e in _synthetic_trace() if e["name"] != "lrmoe:backward"]
    with pytest.raises(ValueError, match="no lrmoe:backward range"):
        where_time_goes(events)
    assert kernel_family("void at::native::f<float, 4>(float*, int)") == "at::native::f"
    assert kernel_family("sm90_xmma_gemm_bf16bf16_bf16f32") == "sm90_xmma_gemm_bf16bf16_bf16f32"


def test_profile_dir_smoke_writes_traces_and_tables(tmp_path):
    from lrmoe.bench.profile import load_trace
    prof = tmp_path / "prof"
    result = bench_layer(["smoke"], [64], ["uniform"], rates=[0.0], methods=["lrmoe"],
                         device="cpu", dtype="float32", iters=1, warmup=0, rotate=1,
                         out_dir=str(tmp_path / "out"), profile_dir=str(prof))
    (rec,) = result["records"]
    trace = prof / "smoke_64_uniform_lrmoe-c-0.json"
    names = {e["name"] for e in load_trace(trace)}
    assert {"lrmoe:forward", "lrmoe:backward", "lrmoe.select"} <= names
    for part in ("forward", "backward"):
        p = rec["time_goes"][part]
        assert p["num_ops"] > 0 and 0 <= p["idle_ms"] <= p["span_ms"]
        assert p["busy_ms"] == pytest.approx(p["span_ms"] - p["idle_ms"])
    data = json.loads((prof / "where_time_goes.json").read_text())
    assert data["records"][0]["label"] == "lrmoe c=0"
    assert "#### smoke, 64 tokens, uniform: lrmoe c=0" in (prof / "where_time_goes.md").read_text()
    # the part markers are no phase and no kernel of the breakdown
    assert not any(k.startswith(":") for k in rec["phases_ms"])


def test_cuda_graph_refusals():
    from lrmoe import LRMoEConfig
    from lrmoe.bench.cli import add_layer_arguments, run_layer
    from lrmoe.bench.graph import check_capturable
    with pytest.raises(ValueError, match="--cuda-graph captures CUDA graphs, but the device"):
        bench_layer(["smoke"], [64], ["uniform"], rates=[0.0], methods=["lrmoe"],
                    device="cpu", dtype="float32", cuda_graph=True)
    base = dict(hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2,
                selection="topk")
    check_capturable(LRMoEConfig(**base))  # lrm + topk replays exactly
    check_capturable(LRMoEConfig(**base, metric="random", selective_backward=False))
    with pytest.raises(ValueError, match="seed that advances every backward"):
        check_capturable(LRMoEConfig(**base, metric="random"))
    with pytest.raises(ValueError, match="seed that advances every backward"):
        check_capturable(LRMoEConfig(**{**base, "selection": "importance"}))
    with pytest.raises(ValueError, match="adaptive rate"):
        check_capturable(LRMoEConfig(**base, recalibration_rate=0.3,
                                     retained_mass_target=0.9))
    with pytest.raises(ValueError, match="offload"):
        bench_layer(["smoke"], [64], ["uniform"], rates=[0.0], methods=["lrmoe"],
                    device="cpu", dtype="float32", cuda_graph=True, offload="activations")
    import argparse
    args = add_layer_arguments(argparse.ArgumentParser()).parse_args(
        ["--ep", "2", "--cuda-graph"])
    with pytest.raises(ValueError, match="drop them with --ep"):
        run_layer(args, [])


def test_a_failed_cuda_graph_row_is_reported_not_fatal(monkeypatch):
    from lrmoe.bench.cli import _extra, _failed

    def boom(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(bench_layer_module, "graph_record", boom)
    case = Case("smoke", 32, "uniform", torch.float32)
    records = run_case(case, [0.0], ["lrmoe"], torch.device("cpu"), 1, 0, 1, None, 1,
                       cuda_graph=True)
    eager, graph = records
    assert eager["fwd_ms"] > 0 and graph["label"] == "lrmoe c=0 graph"
    assert graph["fwd_ms"] is None and graph["method"] == "lrmoe_graph"
    want = "cuda graph failed: RuntimeError: operation not permitted when stream is capturing"
    assert graph["status"] == want and _failed(graph) == want and _extra(graph) == ""
    md = markdown(records, {}, [], dict(date="d", device="cpu", command="c", torch="t",
                                        iters=1))
    assert "| lrmoe c=0 graph | - | - | - |" in md and want in md



def test_a_method_out_of_memory_keeps_the_other_rows(tmp_path, monkeypatch):
    """A method that runs out of device memory is reported as such; the rows timed before
    and after it stay, and the report is still written."""
    import lrmoe.bench.layer as layer_mod
    real = layer_mod.time_iterations

    def flaky(method, *a, **kw):
        if method.method == "dropless":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real(method, *a, **kw)
    monkeypatch.setattr(layer_mod, "time_iterations", flaky)
    result = bench_layer(["smoke"], [64], ["uniform"], rates=[0.0], methods=["lrmoe", "dropless"],
                         device="cpu", dtype="float32", iters=1, warmup=0, rotate=1,
                         out_dir=str(tmp_path / "out"))
    by = {r["method"]: r for r in result["records"]}
    assert by["dropless"]["status"].startswith("out of memory") and by["dropless"]["fwd_ms"] is None
    assert by["lrmoe"]["fwd_ms"] > 0
    assert (tmp_path / "out" / "layer_bench.md").read_text().count("out of memory") >= 1


def test_profiled_step_starts_from_cleared_gradients():
    """The profiled step is one step like the timed ones: its weight gradients are one
    backward's (an independent backward of a fresh copy), not added to the last timed
    step's, so its profile holds no gradient accumulation."""
    from lrmoe.bench.cases import make_inputs
    from lrmoe.bench.timing import Timer, profile_step, time_iterations
    case = Case("smoke", 32, "uniform", torch.float32)
    dev = torch.device("cpu")
    (m,) = build_methods(case, [0.0], ["lrmoe"], dev)
    inputs = make_inputs(case, dev, 2, None)
    time_iterations(m, inputs, Timer(dev), 1, 2)  # leaves the last step's .grad
    profile_step(m, inputs, dev)
    got = [p.grad.clone() for p in m.params]
    for p in m.params:
        p.grad = None
    m.forward(inputs.xs[0].detach().requires_grad_(), inputs.ids[0]).backward(inputs.gs[0])
    for a, p in zip(got, m.params):
        assert torch.equal(a, p.grad)


def test_time_iterations_waits_as_documented():
    """The timed loop with a recording clock: pipelined, the host waits for step i - 2
    before queuing past step i (QUEUE_AHEAD); sync_each, for every step, warm-up
    included; both return the timed steps' spans only (hand-made stamps)."""
    from lrmoe.bench.cases import Inputs
    from lrmoe.bench.timing import QUEUE_AHEAD, time_iterations

    class Clock:
        def __init__(self):
            self.n, self.log = 0, []

        def event(self):
            self.n += 1
            return self.n  # stamp k of step s is 3 s + k (k = 1, 2, 3)

        def wait(self, a):
            self.log.append(("wait", a))

        def ms(self, a, b):
            return float(b - a) * (10.0 if a % 3 == 2 else 1.0)  # bwd spans x 10

    w = torch.ones(3, requires_grad=True)

    class M:
        params = [w]

        @staticmethod
        def forward(x, ids):
            return x * w
    ins = Inputs([None, None], [torch.ones(3), torch.ones(3)], [torch.ones(3)] * 2, [0, 0])
    for sync_each in (False, True):
        clock = Clock()
        fwd, bwd = time_iterations(M, ins, clock, warmup=2, iters=3, sync_each=sync_each)
        assert fwd == [1.0] * 3 and bwd == [10.0] * 3
        t2 = [3 * s + 3 for s in range(5)]
        want = t2 if sync_each else [t2[i - QUEUE_AHEAD] for i in range(QUEUE_AHEAD, 5)]
        assert [a for _, a in clock.log] == want


def test_peak_memory_frees_the_gradients_it_is_given():
    """Every row counts the weight gradients its backward allocates: PeakMemory frees the
    given parameters' .grad before reading its start (on the CPU: the freeing only)."""
    from lrmoe.bench.timing import PeakMemory
    w = torch.ones(4, requires_grad=True)
    (w * 2).sum().backward()
    assert w.grad is not None
    with PeakMemory(torch.device("cpu"), [w]) as mem:
        assert w.grad is None
    assert mem.peak is None


@pytest.mark.gpu
def test_peak_memory_counts_weight_gradients_left_by_an_earlier_step():
    """A step after one that left its gradients: the peak includes the new weight
    gradient (hand count: 2048 x 2048 float32 = 16 MiB), as for a row with none before."""
    from lrmoe.bench.timing import PeakMemory
    dev = torch.device("cuda")
    w = torch.randn(2048, 2048, device=dev, requires_grad=True)
    x = torch.randn(4, 2048, device=dev)
    (x @ w).sum().backward()  # an earlier step's gradient stays allocated
    with PeakMemory(dev, [w]) as mem:
        w.grad = None  # as time_iterations does before every step
        (x @ w).sum().backward()
    # without the freeing in PeakMemory the start would hold the old gradient, and the
    # new one (allocated after the old was freed) would not rise above it
    assert mem.peak >= 2048 * 2048 * 4
