"""LRMoELayer on CUDA: bf16 fused path against the float64 reference, no host syncs."""
from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from test_layer import BF16_TOL, _expected_keep, make_case, run_reference
from lrmoe import LRMoEConfig, LRMoELayer
from lrmoe.moe.stats import BackwardStats
from lrmoe.moe.experts import ExpertFunction

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run_cuda(case, cfg, dtype=torch.bfloat16):
    dev = "cuda"
    x = case["x"].to(dev, dtype).requires_grad_()
    w = case["weights"].to(dev, torch.float32).requires_grad_()
    w_gu = case["w_gu"].to(dev, dtype).requires_grad_()
    w_d = case["w_d"].to(dev, dtype).requires_grad_()
    ids = case["ids"].to(dev)
    grad = case["grad"].to(dev, dtype)
    stats = BackwardStats()
    torch.cuda.synchronize()
    # bf16 runs on the fused grouped GEMM and must never sync; other dtypes take the
    # per-expert loop, which reads the offsets on the host by design
    torch.cuda.set_sync_debug_mode("error" if dtype == torch.bfloat16 else "default")
    try:
        out = ExpertFunction.apply(x, w, ids, w_gu, w_d, cfg, stats)
        out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return dict(out=out.detach().cpu(), x=x.grad.cpu(), weights=w.grad.cpu(),
                w_gu=w_gu.grad.cpu(), w_d=w_d.grad.cpu(), stats=stats)


@pytest.mark.parametrize("c", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_layer_matches_reference_without_sync(c, dtype):
    # H, I multiples of 16 so bf16 takes the fused torch._grouped_mm path; skewed routing
    case = make_case(256, 64, 32, 16, 4, seed=21, skew=2.0)
    # the reference keeps the best pairs: the paper's top-k, not the default sampling
    cfg = LRMoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=16, top_k=4,
                      recalibration_rate=c, selection="topk")
    got = _run_cuda(case, cfg, dtype)
    keep = None
    if c and dtype == torch.float32:
        keep = _expected_keep(case, "lrm", c)[0]
        assert torch.equal(torch.sort(got["stats"].kept_pair_R.long().cpu()).values,
                           torch.nonzero(keep).flatten())
    elif c:
        # bf16 scores differ from float64 ones by rounding, so near-ties may legitimately
        # flip; the selection itself is checked bit-exact against the CPU op in
        # test_cuda_ops_lrmoe.py. Here: compaction and GEMMs given the layer's kept set.
        keep = torch.zeros(1024, dtype=torch.bool)
        keep[got["stats"].kept_pair_R.long().cpu()] = True
        assert int(keep.sum()) == cfg.backward.retained_pairs(1024)
    ref = run_reference(case, keep)
    tol = BF16_TOL if dtype == torch.bfloat16 else 1e-4
    for k in ("out", "x", "weights", "w_gu", "w_d"):
        assert rel_err(got[k], ref[k]) < tol, k
    assert got["stats"].num_retained == cfg.backward.retained_pairs(1024)


def test_cuda_c0_bit_identical_to_selection_off():
    case = make_case(512, 64, 32, 16, 4, seed=22, skew=1.0)
    base = dict(hidden_size=64, moe_intermediate_size=32, num_experts=16, top_k=4)
    on = _run_cuda(case, LRMoEConfig(**base))
    off = _run_cuda(case, LRMoEConfig(**base, selective_backward=False))
    for k in ("out", "x", "weights", "w_gu", "w_d"):
        assert torch.equal(on[k], off[k]), k


def test_cuda_layer_matches_cpu_layer_qwen_like():
    torch.manual_seed(0)
    cfg = LRMoEConfig(hidden_size=256, moe_intermediate_size=128, num_experts=32, top_k=8,
                      recalibration_rate=0.2, shared_expert_intermediate_size=128)
    cpu = LRMoELayer(cfg)
    gpu = LRMoELayer(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 300, 256)
    g = torch.randn(2, 300, 256)
    cpu(x).backward(g)
    gpu(x.cuda()).backward(g.cuda())
    for (n, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        assert rel_err(b.grad.cpu(), a.grad) < 1e-4, n
    assert cpu.diagnostics()["quota"] == gpu.diagnostics()["quota"]
    assert gpu.diagnostics()["retained_mass"] == pytest.approx(
        cpu.diagnostics()["retained_mass"], rel=1e-5)


def test_cuda_backward_peak_memory_scales_with_retained():
    """Allocated bytes of the backward at c = 0.3 vs c = 0 (Qwen3-like expert shape)."""
    torch.manual_seed(0)
    peaks = {}
    for c in (0.0, 0.3):
        cfg = LRMoEConfig(hidden_size=1024, moe_intermediate_size=512, num_experts=64,
                          top_k=8, recalibration_rate=c)
        layer = LRMoELayer(cfg).cuda().to(torch.bfloat16)
        x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
        out = layer(x)
        g = torch.randn_like(out)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.backward(g)
        torch.cuda.synchronize()
        peaks[c] = torch.cuda.max_memory_allocated() - base
        del layer, out, g, x
    assert peaks[0.3] < 0.85 * peaks[0.0], peaks


@pytest.mark.parametrize("c", [0.0, 0.2])
def test_cuda_full_layer_has_no_host_sync(c):
    """Router, aux loss, experts, shared expert: forward + backward never wait for the
    device (bf16, fused grouped GEMM path)."""
    torch.manual_seed(0)
    cfg = LRMoEConfig(hidden_size=256, moe_intermediate_size=128, num_experts=32, top_k=8,
                      recalibration_rate=c, shared_expert_intermediate_size=128,
                      router_z_loss_coef=1e-3)
    layer = LRMoELayer(cfg).cuda().to(torch.bfloat16)
    x = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    layer(x).backward(g)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x)
        (out.float() * g.float()).sum().add(layer.aux_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert layer.router_logits.dtype == torch.float32


def test_cuda_router_logits_and_gradients_bf16():
    """The 16-bit router GEMM with fp32 output against float64 (logits, dx, dW)."""
    from lrmoe.moe.router import _router_logits
    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32, 256, device="cuda") * 0.05).requires_grad_()
    g = torch.randn(512, 32, device="cuda")
    logits = _router_logits(x, w)
    assert logits.dtype == torch.float32
    logits.backward(g)
    xd = x.detach().double().requires_grad_()
    wd = w.detach().to(torch.bfloat16).double().requires_grad_()
    ref = xd @ wd.t()
    ref.backward(g.double())
    assert rel_err(logits, ref) < 1e-5  # exact bf16 products, fp32 sums
    assert rel_err(x.grad, xd.grad) < BF16_TOL
    assert rel_err(w.grad, wd.grad) < BF16_TOL


def _graph_case(seed, tokens=2048, hidden=256, experts=32, top_k=8):
    """bf16 (x, skewed distinct expert ids, output gradient) on CUDA from ``seed``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    pop = 1.0 / torch.arange(1, experts + 1, device="cuda", dtype=torch.float32) ** 1.2
    keys = torch.rand(tokens, experts, device="cuda", generator=gen).log() / pop  # Gumbel-top-k
    return x, keys.topk(top_k, dim=1).indices, g


@pytest.mark.parametrize("c,forced", [(0.0, True), (0.2, True), (0.3, False)])
def test_cuda_graph_replay_equals_eager_bitwise(c, forced):
    """Forward + backward captured as CUDA graphs (lrmoe/bench/graph.py) replay the eager
    layer bit for bit -- output, input gradient, every parameter gradient -- on the
    capture's inputs and on new inputs copied into the static buffers (so nothing of the
    capture step is baked in: routing, loads and the kept set change)."""
    from lrmoe.bench.graph import GraphedStep, eager_step
    torch.manual_seed(0)
    # top-k: a replay repeats its capture's seed, so importance sampling cannot replay
    cfg = LRMoEConfig(hidden_size=256, moe_intermediate_size=128, num_experts=32, top_k=8,
                      selection="topk", recalibration_rate=c, shared_expert_intermediate_size=128,
                      router_z_loss_coef=1e-3)
    layer = LRMoELayer(cfg).cuda().to(torch.bfloat16)
    params = list(layer.parameters())

    def forward(x, ids):
        return layer(x, ids if forced else None)
    x0, ids0, g0 = _graph_case(1)
    step = GraphedStep(forward, params, x0, ids0, g0)
    graph_kept = layer.stats.kept_pair_R  # the static buffer the backward graph writes
    outs = []
    for x, ids, g in (_graph_case(1), _graph_case(2)):
        ref_out, ref_dx, ref_grads = eager_step(forward, params, x, ids, g)
        ref_kept = layer.stats.kept_pair_R.clone()
        step.restore_grads()
        step.load(x, ids, g)
        step.replay()
        torch.cuda.synchronize()
        assert torch.equal(step.out_TH, ref_out) and torch.equal(step.dx_TH, ref_dx)
        assert torch.equal(graph_kept, ref_kept)
        assert layer.stats.num_retained == cfg.backward.retained_pairs(2048 * 8)
        for i, (a, b) in enumerate(zip(step.grads, ref_grads)):
            assert b is not None and torch.equal(a, b), i
        outs.append(ref_out)
    assert not torch.equal(outs[0], outs[1])  # the second input really differs


def test_cuda_bench_graph_rows_and_kernel_profile(tmp_path):
    """``bench layer --cuda-graph --profile-dir`` on the smoke shape: graph rows replay the
    eager step bitwise; the traces hold the layer's kernels, split forward/backward, with
    the idle time inside the span."""
    from lrmoe.bench.layer import bench_layer
    prof = tmp_path / "prof"
    result = bench_layer(["smoke"], [512], ["skewed"], rates=[0.0, 0.3], methods=["lrmoe"],
                         device="cuda", dtype="bfloat16", iters=3, warmup=1, rotate=2,
                         out_dir=str(tmp_path / "out"), profile_dir=str(prof),
                         cuda_graph=True)
    labels = [r["label"] for r in result["records"]]
    assert labels == ["lrmoe c=0", "lrmoe c=0 graph", "lrmoe c=0.3", "lrmoe c=0.3 graph"]
    for r in result["records"]:
        assert r["fwd_ms"] is not None, (r["label"], r.get("status"))  # a failed row says why
        if r["method"] == "lrmoe_graph":
            assert r["graph_bitwise"], r["graph_mismatched"]
            if "time_goes" not in r:  # the profiled capture may fail; it must say why
                assert r["profile_status"].startswith("profiled capture failed"), r
                continue
        assert "time_goes" in r, (r["label"], r.get("profile_status"))
        tg = r["time_goes"]
        for part in ("forward", "backward"):
            p = tg[part]
            assert p["num_ops"] > 3 and 0 <= p["idle_ms"] < p["span_ms"], (r["label"], part)
            assert sum(k["ms"] for k in p["kernels"]) >= p["busy_ms"] - 1e-6
        if r["method"] == "lrmoe_graph":
            assert r["graph_bitwise"], r["graph_mismatched"]
            assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0
        else:  # eager kernels carry their phase
            assert "lrmoe.select" in tg["backward"]["phases"]
            assert "lrmoe.expert_gemm_fwd" in tg["forward"]["phases"]
    profiled = sum("time_goes" in r for r in result["records"])
    assert profiled >= 2  # the eager rows at least
    assert len(list(prof.glob("*.json"))) == profiled + 1  # + where_time_goes.json
