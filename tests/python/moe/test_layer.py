"""LRMoELayer and ExpertFunction against the float64 references of conftest.py."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from conftest import (ref_experts, ref_proportional_quota, ref_routing, ref_scores,
                      ref_topk_keep, ref_water_level_quota, rel_err)
from lrmoe import LRMoEConfig, LRMoELayer
from lrmoe.moe.stats import BackwardStats
from lrmoe.moe.experts import ExpertFunction

# fp32 accumulation over at most a few hundred terms: relative error ~1e-6; 1e-5 leaves
# a margin while any indexing or formula error gives O(1).
FP32_TOL = 1e-5
# bf16 has an 8-bit mantissa (relative rounding 2^-9 = 2e-3 per value); errors of a few
# roundings accumulate through two GEMMs, so 3e-2 of the norm.
BF16_TOL = 3e-2


def make_case(T, H, I, E, K, seed, dtype=torch.float32, skew=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w_gu = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5
    w_d = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    logits[:, 0] += skew
    ids = torch.topk(logits, K, dim=-1).indices
    weights = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
    grad = torch.randn(T, H, generator=g, dtype=torch.float64)
    return dict(x=x, w_gu=w_gu, w_d=w_d, ids=ids, weights=weights, grad=grad, dtype=dtype)


def run_lrmoe(case, cfg):
    """ExpertFunction forward + backward with a fixed upstream gradient."""
    dt = case["dtype"]
    x = case["x"].to(dt, copy=True).requires_grad_()
    w = case["weights"].to(torch.float32, copy=True).requires_grad_()
    w_gu = case["w_gu"].to(dt, copy=True).requires_grad_()
    w_d = case["w_d"].to(dt, copy=True).requires_grad_()
    stats = BackwardStats()
    out = ExpertFunction.apply(x, w, case["ids"], w_gu, w_d, cfg, stats)
    out.backward(case["grad"].to(dt))
    return dict(out=out.detach(), x=x.grad, weights=w.grad, w_gu=w_gu.grad, w_d=w_d.grad,
                stats=stats)


def run_reference(case, keep=None):
    x = case["x"].clone().requires_grad_()
    w = case["weights"].clone().requires_grad_()
    w_gu = case["w_gu"].clone().requires_grad_()
    w_d = case["w_d"].clone().requires_grad_()
    out, phi = ref_experts(x, w, case["ids"], w_gu, w_d, keep)
    out.backward(case["grad"])
    return dict(out=out.detach(), x=x.grad, weights=w.grad, w_gu=w_gu.grad, w_d=w_d.grad,
                phi=phi.detach())


def cfg_for(case, **kw):
    # the retained-pair references here pick the best pairs: the paper's top-k
    kw.setdefault("selection", "topk")
    E, twoI, H = case["w_gu"].shape
    return LRMoEConfig(hidden_size=H, moe_intermediate_size=twoI // 2, num_experts=E,
                       top_k=case["ids"].shape[1], **kw)


def assert_close_all(got, ref, tol, keys=("out", "x", "weights", "w_gu", "w_d")):
    for k in keys:
        assert got[k] is not None, k
        err = rel_err(got[k], ref[k])
        assert err < tol, f"{k}: relative error {err:.3g} >= {tol}"


# --------------------------------------------------------------------------- c = 0
@pytest.mark.parametrize("T,H,I,E,K", [(40, 16, 8, 6, 2), (37, 24, 16, 5, 3), (1, 8, 8, 4, 2),
                                       (12, 16, 8, 4, 4)])
def test_c0_matches_float64_reference(T, H, I, E, K):
    case = make_case(T, H, I, E, K, seed=T + E)
    got = run_lrmoe(case, cfg_for(case))
    assert_close_all(got, run_reference(case), FP32_TOL)


def test_c0_bit_identical_to_selection_off():
    case = make_case(64, 32, 16, 8, 2, seed=1, skew=1.5)
    on = run_lrmoe(case, cfg_for(case, recalibration_rate=0.0, selective_backward=True))
    off = run_lrmoe(case, cfg_for(case, selective_backward=False))
    for k in ("out", "x", "weights", "w_gu", "w_d"):
        assert torch.equal(on[k], off[k]), k
    assert on["stats"].num_retained == 64 * 2
    assert on["stats"].quota_E.tolist() == on["stats"].tokens_per_expert_E.tolist()


def test_c0_float64_inputs_match_reference_tightly():
    case = make_case(33, 16, 8, 5, 2, seed=7, dtype=torch.float64)
    got = run_lrmoe(case, cfg_for(case))
    assert_close_all(got, run_reference(case), 1e-6)  # fp32 accumulators inside the ops


def test_bf16_matches_float64_reference():
    case = make_case(96, 64, 32, 8, 2, seed=3, dtype=torch.bfloat16)
    got = run_lrmoe(case, cfg_for(case))
    assert_close_all(got, run_reference(case), BF16_TOL)


# --------------------------------------------------------------------------- c > 0
def _expected_keep(case, metric, c, rule="proportional", seed=0):
    ref = run_reference(case)
    scores = ref_scores(metric, case["grad"], case["weights"], ref["phi"], seed)
    loads = torch.bincount(case["ids"].reshape(-1), minlength=case["w_gu"].shape[0]).tolist()
    quota_fn = ref_proportional_quota if rule == "proportional" else ref_water_level_quota
    quota = quota_fn(loads, Fraction(c).limit_denominator(1000))
    return ref_topk_keep(scores, case["ids"], quota), quota


@pytest.mark.parametrize("metric", ["lrm", "grad_sq", "grad_abs", "random"])
@pytest.mark.parametrize("rule", ["proportional", "water_level"])
def test_selective_backward_equals_retained_pair_reference(metric, rule):
    c = 0.3
    case = make_case(50, 16, 8, 6, 2, seed=11, skew=1.0)
    keep, quota = _expected_keep(case, metric, c, rule)
    got = run_lrmoe(case, cfg_for(case, recalibration_rate=c, metric=metric, quota_rule=rule))
    ref = run_reference(case, keep)
    # forward exact; router gradient exact; expert gradients from the kept pairs only
    assert_close_all(got, ref, FP32_TOL)
    assert got["stats"].quota_E.tolist() == quota
    assert got["stats"].num_retained == int(0.7 * 100) == sum(quota)
    full = run_reference(case)
    assert rel_err(got["w_d"], full["w_d"]) > 10 * FP32_TOL  # something was really dropped


def test_dropped_pairs_contribute_nothing():
    """An expert whose quota is 0 gets exactly zero weight gradient, and a token whose
    pairs are all dropped gets exactly zero dx (shared expert absent)."""
    case = make_case(10, 8, 8, 3, 1, seed=5)
    case["ids"] = torch.tensor([[0]] * 9 + [[1]])  # expert 1: one pair; expert 2: none
    # loads [9, 1, 0] at c = 0.5: ideal [4.5, 0.5, 0] -> total 5: [5, 0, 0] (ties to lower)
    got = run_lrmoe(case, cfg_for(case, recalibration_rate=0.5))
    assert got["stats"].quota_E.tolist() == [5, 0, 0]
    assert torch.count_nonzero(got["w_gu"][1:]) == 0
    assert torch.count_nonzero(got["w_d"][1:]) == 0
    assert torch.count_nonzero(got["x"][9]) == 0
    assert torch.count_nonzero(got["weights"][9]) == 1  # router gradient still exact
    assert rel_err(got["weights"], run_reference(case)["weights"]) < FP32_TOL


def test_retained_mass_and_diagnostics():
    case = make_case(64, 16, 8, 4, 2, seed=2, skew=2.0)
    c = 0.25
    got = run_lrmoe(case, cfg_for(case, recalibration_rate=c))
    keep, quota = _expected_keep(case, "lrm", c)
    ref = run_reference(case)
    s = ref_scores("lrm", case["grad"], case["weights"], ref["phi"])
    rho = float(s[keep].sum() / s.sum())
    d = got["stats"].summary()
    assert abs(d["retained_mass"] - rho) < 1e-5
    assert rho > 1 - c  # the best pairs carry more than their share
    loads = torch.bincount(case["ids"].reshape(-1), minlength=4).double()
    assert d["tokens_per_expert"] == loads.long().tolist()
    assert d["quota"] == quota
    assert d["dropped_fraction"] == pytest.approx(1 - sum(quota) / 128)
    assert d["load_max_over_mean_before"] == pytest.approx(float(loads.max() / loads.mean()))
    q = torch.tensor(quota, dtype=torch.float64)
    assert d["load_max_over_mean_after"] == pytest.approx(float(q.max() / q.mean()))


def test_importance_selection_is_unbiased():
    """Mean of dW over many seeds -> exact dW.

    Tolerance: each seed gives an independent unbiased estimate with per-entry variance
    v_i; the mean of N has E||mean - exact||^2 = sum_i v_i / N. With the sample variances
    in place of v_i the ratio ||mean - exact||^2 / (sum_i v_i / N) concentrates near 1 over
    hundreds of entries; we allow 3. A biased estimator (e.g. no 1/p rescaling) gives a
    ratio in the hundreds here, which the second assertion shows.
    """
    case = make_case(24, 8, 8, 3, 2, seed=9)
    exact = run_reference(case)["w_d"].double()
    n = 300
    samples = torch.stack([
        run_lrmoe(case, cfg_for(case, recalibration_rate=0.5, selection="importance",
                                seed=s))["w_d"].double() for s in range(n)])
    mean = samples.mean(0)
    noise = samples.var(0).sum() / n
    ratio = float(((mean - exact) ** 2).sum() / noise)
    assert ratio < 3.0, ratio
    topk = run_lrmoe(case, cfg_for(case, recalibration_rate=0.5))["w_d"].double()
    assert float(((topk - exact) ** 2).sum() / noise) > 10 * ratio


def test_importance_scales_are_exposed_and_give_the_expert_gradient():
    """Issue 26: with the default selection the 1/p scales were not exposed, so nobody could
    check an expert gradient at c > 0. dW_down[e] = sum over the kept pairs (t, k) of e of
    scale * alpha_tk * g_t phi_tk^T, in float64 from the reference's phi."""
    case = make_case(40, 8, 8, 4, 2, seed=5, skew=1.0)
    got = run_lrmoe(case, cfg_for(case, recalibration_rate=0.5, selection="importance",
                                  seed=3))
    st = got["stats"]
    pairs, scales = st.kept_pair_R.long(), st.kept_scale_R.double()
    assert pairs.numel() == st.num_retained == 40 and scales.shape == pairs.shape
    assert bool((scales > 1.0).any()), "importance sampling rescales some pairs by 1/p > 1"
    phi = run_reference(case)["phi"]  # (T*K, I) in pair order
    T, K = case["ids"].shape
    ref = torch.zeros_like(case["w_d"])
    for p, s in zip(pairs.tolist(), scales.tolist()):
        t, k = divmod(p, K)
        e = int(case["ids"][t, k])
        ref[e] += s * case["weights"][t, k] * torch.outer(case["grad"][t], phi[p])
    assert rel_err(got["w_d"], ref) < FP32_TOL
    topk = run_lrmoe(case, cfg_for(case, recalibration_rate=0.5))["stats"]
    assert torch.equal(topk.kept_scale_R, torch.ones(40))  # top-k keeps every scale at 1
    exact = run_lrmoe(case, cfg_for(case, selective_backward=False))["stats"]
    assert exact.kept_scale_R is None


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("ids_kind", ["zero_token_expert", "all_to_one", "one_token",
                                      "topk_equals_E"])
@pytest.mark.parametrize("c", [0.0, 0.3])
def test_edge_routings(ids_kind, c):
    E = 5
    if ids_kind == "zero_token_expert":
        case = make_case(20, 16, 8, E, 2, seed=4)
        case["ids"] = torch.stack([torch.arange(20) % 2, 2 + torch.arange(20) % 3], 1)
    elif ids_kind == "all_to_one":
        case = make_case(20, 16, 8, E, 1, seed=4)
        case["ids"] = torch.full((20, 1), 3)
    elif ids_kind == "one_token":
        case = make_case(1, 16, 8, E, 2, seed=4)
    else:
        case = make_case(7, 16, 8, E, E, seed=4)
    keep = None
    if c:
        keep, _ = _expected_keep(case, "lrm", c)
    got = run_lrmoe(case, cfg_for(case, recalibration_rate=c))
    assert_close_all(got, run_reference(case, keep), FP32_TOL)


def test_non_contiguous_inputs():
    case = make_case(30, 16, 8, 4, 2, seed=6)
    cfg = cfg_for(case, recalibration_rate=0.2)
    base = run_lrmoe(case, cfg)
    x_big = torch.randn(30, 48, dtype=torch.float32)
    x_big[:, ::3] = case["x"].float()
    case2 = dict(case, x=x_big[:, ::3], ids=case["ids"].t().contiguous().t(),
                 weights=case["weights"].t().contiguous().t())
    x = case2["x"].requires_grad_()
    w = case2["weights"].float().requires_grad_()
    out = ExpertFunction.apply(x, w, case2["ids"], case["w_gu"].float(), case["w_d"].float(),
                               cfg, BackwardStats())
    out.backward(case["grad"].float())
    assert torch.allclose(out, base["out"], rtol=1e-6, atol=1e-6)
    assert torch.allclose(x.grad, base["x"], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- memory
def test_backward_buffers_scale_with_retained_count():
    case = make_case(200, 32, 16, 8, 2, seed=8, skew=1.0)
    b0 = run_lrmoe(case, cfg_for(case, recalibration_rate=0.0))["stats"]
    b3 = run_lrmoe(case, cfg_for(case, recalibration_rate=0.3))["stats"]
    assert b0.buffers["G"][0] == 400 and b3.buffers["G"][0] == 280
    for name, shape in b3.buffers.items():
        assert shape[0] == 280, name
    # 0.7x of the c = 0 bytes plus one row of every buffer for rounding
    row_bytes = sum(s[1] for s in b0.buffers.values()) * 4
    assert b3.buffer_bytes <= 0.7 * b0.buffer_bytes + row_bytes


# --------------------------------------------------------------------------- full layer
def _layer_and_ref(router="softmax", shared=0, gate=False, c=0.0, seed=0):
    torch.manual_seed(seed)
    cfg = LRMoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2,
                      router=router, shared_expert_intermediate_size=shared,
                      shared_expert_gate=gate, recalibration_rate=c,
                      routed_scaling_factor=1.0 if router == "softmax" else 2.0)
    layer = LRMoELayer(cfg)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.5)
        if router == "sigmoid":
            layer.gate.e_score_correction_bias.normal_(0, 0.1)
    return cfg, layer


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared,gate", [(0, False), (12, False), (12, True)])
def test_layer_c0_matches_float64_reference(router, shared, gate):
    cfg, layer = _layer_and_ref(router, shared, gate)
    x = torch.randn(2, 20, 16, requires_grad=True)
    grad = torch.randn(2, 20, 16)
    layer(x).backward(grad)

    xd = x.detach().double().reshape(-1, 16).requires_grad_()
    p = {n: t.detach().double().requires_grad_() for n, t in layer.named_parameters()}
    bias = layer.gate.e_score_correction_bias if router == "sigmoid" else None
    w, ids = ref_routing(xd, p["gate.weight"], 2, True, router, bias,
                         cfg.routed_scaling_factor)
    out, _ = ref_experts(xd, w, ids, p["experts.gate_up_proj"], p["experts.down_proj"])
    if shared:
        s = (torch.nn.functional.silu(xd @ p["shared_expert.gate_proj.weight"].t())
             * (xd @ p["shared_expert.up_proj.weight"].t())) @ p["shared_expert.down_proj.weight"].t()
        if gate:
            s = torch.sigmoid(xd @ p["shared_expert_gate.weight"].t()) * s
        out = out + s
    out.backward(grad.double().reshape(-1, 16))
    assert rel_err(x.grad.reshape(-1, 16), xd.grad) < FP32_TOL
    for n, t in layer.named_parameters():
        assert rel_err(t.grad, p[n].grad) < FP32_TOL, n


def test_layer_c_positive_router_gradient_exact():
    _, exact = _layer_and_ref(c=0.0, seed=3)
    _, planned = _layer_and_ref(c=0.3, seed=3)
    x = torch.randn(64, 16)
    grad = torch.randn(64, 16)
    for layer in (exact, planned):
        layer(x).backward(grad)
    assert torch.equal(exact.gate.weight.grad, planned.gate.weight.grad)
    assert not torch.allclose(exact.experts.down_proj.grad, planned.experts.down_proj.grad)
    assert planned.diagnostics()["dropped_fraction"] == pytest.approx(1 - 89 / 128)


def test_aux_and_z_loss_formulas():
    cfg, layer = _layer_and_ref()
    layer.set_recalibration(recalibration_rate=0.0)
    layer.config = layer.config.replace(router_aux_loss_coef=1.0, router_z_loss_coef=0.5)
    layer.gate.config = layer.config
    x = torch.randn(30, 16)
    layer(x)
    logits = x.double() @ layer.gate.weight.detach().double().t()
    probs = torch.softmax(logits, -1)
    ids = torch.topk(probs, 2, -1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=6).double()
    aux = 6 * float((counts / 30 * probs.mean(0)).sum())
    z = float((torch.logsumexp(logits, -1) ** 2).mean())
    assert float(layer.aux_loss.detach()) == pytest.approx(aux + 0.5 * z, rel=1e-5)


def test_activation_checkpointing_matches_eager():
    _, layer = _layer_and_ref(c=0.2, seed=4)
    x = torch.randn(40, 16, requires_grad=True)
    layer(x).sum().backward()
    g_eager = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    layer.stats.backward_steps = 0
    x.grad = None
    from torch.utils.checkpoint import checkpoint
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    g_ckpt = [p.grad for p in layer.parameters()] + [x.grad]
    for a, b in zip(g_eager, g_ckpt):
        assert torch.equal(a, b)


def test_torch_compile_traces_the_layer():
    """torch.compile (aot_eager: dynamo + AOTAutograd with the fake kernels, no codegen)
    gives the eager results."""
    _, layer = _layer_and_ref(c=0.2, seed=5)
    x = torch.randn(40, 16, requires_grad=True)
    layer(x).sum().backward()
    g_eager = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer.stats.backward_steps = 0
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=False)
    compiled(x).sum().backward()
    for a, p in zip(g_eager, layer.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw,match", [
    (dict(top_k=7), "top_k=7 exceeds num_experts=6"),
    (dict(top_k=0), "top_k must be a positive int"),
    (dict(recalibration_rate=1.0), r"recalibration_rate must be in \[0, 1\)"),
    (dict(recalibration_rate=-0.1), r"recalibration_rate must be in \[0, 1\)"),
    (dict(recalibration_rate=float("nan")), r"recalibration_rate must be in \[0, 1\)"),
    (dict(metric="norm"), "metric must be one of"),
    (dict(quota_rule="equal"), "quota_rule must be one of"),
    (dict(selection="greedy"), "selection must be one of"),
    (dict(selective_backward=False, recalibration_rate=0.2), "selective_backward=False"),
    (dict(recalibration_rate=1 - 2 ** -22), "rounds to c = 1"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(seed=1 << 63), r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(seed=1.5), r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(seed="0"), r"seed must be an int in \[0, 2\*\*63\)"),
])
def test_bad_config_is_refused(kw, match):
    base = dict(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2)
    with pytest.raises(ValueError, match=match):
        LRMoEConfig(**{**base, **kw})


def test_largest_seed_wraps_instead_of_overflowing():
    # seed + backward count passes 2**63 at the second backward: it must wrap (the op
    # takes int64), and the wrapped draw must equal a layer seeded with the wrapped value
    kw = dict(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2,
              recalibration_rate=0.5, metric="random")
    x = torch.randn(12, 16)
    kept = []
    for seed, skip in (((1 << 63) - 1, 1), (0, 0)):
        torch.manual_seed(0)
        layer = LRMoELayer(LRMoEConfig(**kw, seed=seed))
        for _ in range(skip + 1):
            layer(x).sum().backward()
        kept.append(layer.stats.kept_pair_R.sort().values)
    assert torch.equal(kept[0], kept[1])


def test_bad_inputs_are_refused():
    _, layer = _layer_and_ref()
    with pytest.raises(ValueError, match="hidden_size=16"):
        layer(torch.randn(4, 15))
    with pytest.raises(ValueError, match="call layer.to"):
        layer(torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="on meta"):
        layer(torch.randn(4, 16, device="meta"))
    with pytest.raises(ValueError, match="floating point"):
        layer(torch.ones(4, 16, dtype=torch.int64))
    x = torch.randn(4, 16)
    x[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        layer(x)
    x[2, 3] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        layer(x)


@pytest.mark.parametrize("c", [0.0, 0.1, 0.2, 0.3, 1 / 3, 0.123456, 0.999])
def test_retained_count_is_exact_floor(c):
    from lrmoe.ops import rate_fraction, retained_total
    p, q = rate_fraction(c)
    assert Fraction(p, q) == Fraction(c).limit_denominator(2 ** 20)
    for n in (0, 1, 9, 100, 262144, 2000001):
        assert retained_total(n, c) == int((1 - Fraction(p, q)) * n)
    with pytest.raises(ValueError, match="recalibration_rate"):
        rate_fraction(1.0)


# --------------------------------------------------------------------- layer-level bugs
def _loss_layer(router="softmax"):
    cfg, layer = _layer_and_ref(router)
    layer.config = layer.config.replace(router_aux_loss_coef=1.0, router_z_loss_coef=0.5)
    layer.gate.config = layer.config
    return layer


@pytest.mark.parametrize("mask", [None, "all_false"])
def test_empty_batch_aux_and_z_loss_are_zero_not_nan(mask):
    layer = _loss_layer()
    x = torch.randn(0, 16, requires_grad=True) if mask is None else torch.randn(3, 16)
    token_mask = None if mask is None else torch.zeros(3, dtype=torch.bool)
    out = layer(x) if token_mask is None else layer(x, token_mask=token_mask)
    assert float(layer.aux_loss.detach()) == 0.0  # the mean over no token is NaN
    (out.sum() + layer.aux_loss).backward()
    assert torch.isfinite(layer.gate.weight.grad).all()


def test_token_mask_counts_only_real_tokens_like_transformers():
    """aux_loss with a (B, S) attention mask equals transformers' own
    ``load_balancing_loss_func(..., attention_mask)`` plus the z-loss over the real
    tokens (float64 by hand); without the mask it differs."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    layer = _loss_layer()
    x = torch.randn(2, 10, 16)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    layer(x, token_mask=mask)
    logits = x.reshape(-1, 16).double() @ layer.gate.weight.detach().double().t()
    lb = load_balancing_loss_func((logits,), 6, 2, mask)
    real = mask.reshape(-1).bool()
    z = float((torch.logsumexp(logits[real], -1) ** 2).mean())
    assert float(layer.aux_loss.detach()) == pytest.approx(float(lb) + 0.5 * z, rel=1e-5)
    unmasked = float(load_balancing_loss_func((logits,), 6, 2)) + 0.5 * float(
        (torch.logsumexp(logits, -1) ** 2).mean())
    assert abs(unmasked - float(layer.aux_loss.detach())) > 1e-3
    with pytest.raises(ValueError, match="token_mask must hold one entry per token"):
        layer(x, token_mask=mask[:, :5])


def test_bad_expert_ids_are_refused_naming_them():
    _, layer = _layer_and_ref()
    x = torch.randn(4, 16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 5]])
    for bad, match in ((ids.clone().fill_(6), r"expert_ids must be in \[0, num_experts\) "
                                              r"= \[0, 6\), got values in \[6, 6\]"),
                       (ids - 1, r"expert_ids must be in .*got values in \[-1, 4\]"),
                       (ids.float(), "expert_ids must be an int64"),
                       (ids.to(torch.int16), "expert_ids must be an int64"),
                       (ids[:, :1], r"expert_ids must be \(T, top_k\)")):
        with pytest.raises(ValueError, match=match):
            layer(x, bad)
    # int32 ids route exactly like int64 ones
    torch.testing.assert_close(layer(x, ids.to(torch.int32)), layer(x, ids), rtol=0, atol=0)


def test_sigmoid_router_bias_stays_fp32_when_the_layer_is_cast():
    _, layer = _layer_and_ref("sigmoid")
    with torch.no_grad():
        layer.gate.e_score_correction_bias.copy_(torch.linspace(-1e-3, 1e-3, 6) + 1e-5)
    bias = layer.gate.e_score_correction_bias.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()):
        cast(layer)
        assert layer.gate.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(layer.gate.e_score_correction_bias, bias)  # not rounded
    layer.to(torch.bfloat16)
    assert layer.gate.weight.dtype == torch.bfloat16
    out = layer(torch.randn(5, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert layer.state_dict()["gate.e_score_correction_bias"].dtype == torch.float32


def test_reentrant_checkpointing_warns_once_that_aux_loss_has_no_gradient():
    from torch.utils.checkpoint import checkpoint
    import warnings
    layer = _loss_layer()
    x = torch.randn(20, 16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the non-reentrant form keeps the aux gradient
        out = checkpoint(layer, x, use_reentrant=False)
        assert layer.aux_loss.requires_grad
        (out.sum() + layer.aux_loss).backward()
    for attempt in range(2):
        out = checkpoint(layer, x, use_reentrant=True)
        assert not layer.aux_loss.requires_grad  # why the warning is needed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (out.sum() + layer.aux_loss).backward()
        got = [w for w in caught if "use_reentrant=False" in str(w.message)]
        assert len(got) == (1 if attempt == 0 else 0), [str(w.message) for w in caught]


# --------------------------------------------------------------------------- adaptive rate
def _top_q_mass(scores, n, q):
    """Exact sum of the q_e largest scores of each expert (rows grouped by expert)."""
    from fractions import Fraction
    out, start = Fraction(0), 0
    for n_e, q_e in zip(n, q):
        seg = sorted((Fraction(float(v)) for v in scores[start:start + n_e]), reverse=True)
        out += sum(seg[:q_e], Fraction(0))
        start += n_e
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rule", ["proportional", "water_level"])
def test_adaptive_rate_against_brute_force(seed, rule):
    # every R from the cap up, quotas from the independent reference of conftest
    from fractions import Fraction
    from conftest import ref_proportional_quota, ref_water_level_quota
    from lrmoe.moe.selection import adaptive_rate
    ref = ref_proportional_quota if rule == "proportional" else ref_water_level_quota
    g = torch.Generator().manual_seed(seed)
    n = [int(v) for v in torch.randint(0, 12, (5,), generator=g)]
    p = sum(n)
    scores = (torch.rand(p, generator=g) ** (1 + seed)).tolist()
    offsets = torch.tensor(n).cumsum(0).to(torch.int32)
    total = sum((Fraction(v) for v in scores), Fraction(0))
    for target in (0.5, 0.9, 0.99, 1.0):
        for cap in (0.3, 0.7):
            r_min = int((1 - Fraction(cap).limit_denominator(1 << 20)) * p)
            want = next(r for r in range(r_min, p + 1)
                        if _top_q_mass(scores, n, ref(n, Fraction(p - r, p)))
                        >= Fraction(target) * total)
            got = adaptive_rate(torch.tensor(scores), offsets,
                                torch.tensor(n, dtype=torch.int32), target, cap, rule)
            assert got == pytest.approx(min(cap, 1 - want / p), abs=1e-12), (target, cap)
    assert adaptive_rate(torch.zeros(0), torch.zeros(3, dtype=torch.int32),
                         torch.zeros(3, dtype=torch.int32), 0.9, 0.5, rule) == 0.0


def test_layer_adaptive_rate_follows_the_target():
    kw = dict(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2,
              recalibration_rate=0.6, selection="topk")  # top-k keeps the promised mass
    x = torch.randn(64, 16)
    dropped = {}
    for target in (1e-9, 0.9, 0.999, 1.0):
        torch.manual_seed(0)
        layer = LRMoELayer(LRMoEConfig(**kw, retained_mass_target=target))
        layer(x).sum().backward()
        d = layer.diagnostics()
        dropped[target] = d["dropped_fraction"]
        assert sum(d["quota"]) == d["num_retained"]
        assert d["retained_mass"] >= target - 1e-6  # top-k keeps what the rate promised
    # the cap binds for a tiny target, nothing with a positive score is dropped at 1
    assert dropped[1e-9] == pytest.approx(1 - int(0.4 * 128) / 128)
    assert dropped[1.0] == 0.0
    assert dropped[1e-9] >= dropped[0.9] >= dropped[0.999] >= dropped[1.0]
    assert dropped[0.9] > 0


@pytest.mark.parametrize("kw,match", [
    (dict(recalibration_rate=0.0, retained_mass_target=0.9), "set recalibration_rate"),
    (dict(recalibration_rate=0.5, retained_mass_target=1.5), "retained_mass_target must be"),
    (dict(recalibration_rate=0.5, retained_mass_target=float("nan")),
     "retained_mass_target must be"),
])
def test_bad_adaptive_rate_config(kw, match):
    with pytest.raises(ValueError, match=match):
        LRMoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2, **kw)
