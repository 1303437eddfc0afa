"""``lrmoe bench layer``: CPU smoke run (CI) and the baselines' equivalence.

The timings of a CPU smoke run mean nothing; what is checked is that every method runs,
that the report files are written, and that the methods compute the same function, so
that the GPU benchmark compares like with like.
"""
import json

import pytest
import torch

from conftest import rel_err
from lrmoe.bench.layer import Case, build_methods, bench_layer, load_imbalance, make_routing


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
        outs[m.name], grads[m.name] = out.detach(), xi.grad
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
    result = bench_layer(["smoke"], [128], ["uniform"], rates=[0.0, 0.3], device="cpu",
                         dtype="float32", iters=1, warmup=1, rotate=1, transformers_iters=1,
                         out_dir=str(tmp_path / "out"), append_md=str(md), command="test")
    names = [r["method"] for r in result["records"]]
    assert names == ["lrmoe c=0", "lrmoe c=0.3", "dropless", "transformers"]
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
