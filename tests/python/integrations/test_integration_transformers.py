"""transformers integration: patched sparse-MoE blocks against the unpatched models.

The reference is always the unpatched transformers model itself (its own router, its own
expert code -- ``eager`` loop or ``grouped_mm``), built from the same tiny config with the
same seed, so nothing here is derived from the code under test. Tiny random models
(hidden 32, 2 layers, 6-8 experts, top-2/3, vocab 100, batch 2 x 16 tokens) built from
configs: no downloads.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
from safetensors import safe_open
from transformers import (Glm4MoeConfig, Glm4MoeForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from lrmoe import LRMoEConfig
from lrmoe.layer import MoELayerBase
from lrmoe.integrations.transformers import (SEED_STRIDE, TransformersMoELayer,
                                             collect_diagnostics, patch_moe_blocks,
                                             set_recalibration, summarize_diagnostics)

VOCAB, BATCH, SEQ = 100, 2, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
               tie_word_embeddings=False)
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
#: families whose CausalLM adds router_aux_loss_coef * load_balancing_loss (GLM has none)
WITH_AUX = ("qwen3_moe", "qwen2_moe", "mixtral")
_CLASSES = {"qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM,
            "mixtral": MixtralForCausalLM, "glm4_moe": Glm4MoeForCausalLM}

# fp32 tolerance: the patched and unpatched models compute the same sums in different
# orders (per-token fp32 accumulation over k in lrmoe.ops.combine vs grouped_mm + sum or
# index_add; dW as grouped GEMMs over retained rows vs per-expert autograd), so results
# differ by a few ulps (fp32 eps = 1.2e-7) amplified through 2 layers and the softmax;
# measured <= 6e-7 of each tensor's largest entry. 1e-5 leaves a ~20x margin and is far
# below any real error (a dropped pair or a wrong weight moves gradients by O(1e-1)).
FP32_GRAD_TOL = 1e-5
FP32_LOSS_RTOL = 1e-6
# fp64: same argument with eps = 2.2e-16 (measured <= 6e-16)
FP64_GRAD_TOL = 1e-11
FP64_LOSS_RTOL = 1e-13


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, which only add synchronisation
    (on a busy 2-core machine this file ran 10x slower with 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(family: str, **overrides):
    if family == "qwen3_moe":
        kw = dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True)
        cfg = Qwen3MoeConfig(**{**_COMMON, **kw, **overrides})
    elif family == "qwen2_moe":
        kw = dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                  num_experts_per_tok=2, shared_expert_intermediate_size=24,
                  norm_topk_prob=False)
        cfg = Qwen2MoeConfig(**{**_COMMON, **kw, **overrides})
    elif family == "mixtral":
        kw = dict(intermediate_size=16, num_local_experts=6, num_experts_per_tok=2)
        cfg = MixtralConfig(**{**_COMMON, **kw, **overrides})
    elif family == "glm4_moe":
        # group-limited routing (2 groups of 4, 1 group kept), top-3, scaling 1.5
        kw = dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                  num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=0,
                  n_shared_experts=1, routed_scaling_factor=1.5)
        cfg = Glm4MoeConfig(**{**_COMMON, **kw, **overrides})
    else:
        raise ValueError(family)
    return cfg


def _model(family: str, dtype=torch.float32, experts="grouped_mm", seed=0, **overrides):
    """A tiny random model; the same (family, seed, overrides) gives the same weights."""
    torch.manual_seed(seed)
    model = _CLASSES[family](_config(family, **overrides))
    if family == "glm4_moe":  # a non-zero selection bias, so that it matters
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, Glm4MoeTopkRouter):
                    module.e_score_correction_bias.uniform_(-0.05, 0.05)
    model.set_experts_implementation(experts)
    return model.to(dtype).train()


def _pair(family: str, dtype=torch.float32, experts="grouped_mm", **overrides):
    """(unpatched reference, patched model, patched names) holding equal weights."""
    ref = _model(family, dtype, experts, **overrides)
    model = _model(family, dtype, experts, **overrides)
    for (n1, t1), (n2, t2) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)
    names = [name for name, _ in patch_moe_blocks(model)]
    return ref, model, names


def _ids(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _run(model, family, ids, attention_mask=None):
    kw = {"output_router_logits": True} if family in WITH_AUX else {}
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, attention_mask=attention_mask, **kw)
    out.loss.backward()
    return out


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_grads_close(ref_grads, grads, tol):
    assert ref_grads.keys() == grads.keys()
    for name, g_ref in ref_grads.items():
        err = float((grads[name] - g_ref).abs().max())
        scale = float(g_ref.abs().max())
        assert err <= tol * scale + 1e-30, f"{name}: max err {err:.3e}, max |grad| {scale:.3e}"


def _moe_index(name: str) -> int:
    return int(re.match(r"model\.layers\.(\d+)\.mlp$", name).group(1))


# ------------------------------------------------------------------------- c = 0: exact
@pytest.mark.parametrize("family", FAMILIES)
def test_c0_float64_loss_and_every_gradient_match_unpatched(family):
    """fp64 against the unpatched model's eager expert loop: tight tolerance."""
    ref, model, names = _pair(family, torch.float64, experts="eager")
    assert len(names) == 2
    ids = _ids()
    out_ref, out = _run(ref, family, ids), _run(model, family, ids)
    assert math.isclose(out.loss.item(), out_ref.loss.item(), rel_tol=FP64_LOSS_RTOL)
    if family in WITH_AUX:  # the model's own aux loss, from router logits recorded by hooks
        assert len(out.router_logits) == len(out_ref.router_logits) == 2
        assert math.isclose(out.aux_loss.item(), out_ref.aux_loss.item(), rel_tol=1e-13)
    _assert_grads_close(_grads(ref), _grads(model), FP64_GRAD_TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_c0_float32_loss_and_every_gradient_match_unpatched(family):
    """fp32 against the default (``grouped_mm``) expert implementation of transformers;
    tolerance FP32_GRAD_TOL of each gradient's largest entry (see its comment)."""
    ref, model, _ = _pair(family, torch.float32)
    ids = _ids(2)
    out_ref, out = _run(ref, family, ids), _run(model, family, ids)
    assert math.isclose(out.loss.item(), out_ref.loss.item(), rel_tol=FP32_LOSS_RTOL)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    if family in WITH_AUX:
        assert math.isclose(out.aux_loss.item(), out_ref.aux_loss.item(), rel_tol=1e-6)
    _assert_grads_close(_grads(ref), _grads(model), FP32_GRAD_TOL)


# --------------------------------------------------------------- c > 0: planned backward
@pytest.mark.parametrize("family,overrides", [
    ("qwen3_moe", {}), ("qwen2_moe", {}), ("mixtral", {}), ("glm4_moe", {}),
    # MoE in layers 0 and 1, a dense MLP in layer 2: a whole decoder layer downstream
    ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [2]}),
])
def test_c_positive_exact_forward_and_gradients_change_only_through_experts(family,
                                                                            overrides):
    """Same patched model, same batch, c = 0 and then c = 0.5.

    The forward is exact at any c, so the loss and logits are bitwise identical. In the
    backward a dropped pair loses its expert gradients and its dx contribution through
    that expert, while dalpha = <g, y> (the router gradient) stays exact. Hence:

    * bitwise identical: every parameter downstream of the LAST MoE layer's output (later
      decoder layers, final norm, lm_head) -- they see identical activations and an
      identical loss -- plus the last MoE layer's router and shared expert(s), whose
      gradients need only g at the layer output and the layer input x;
    * different: the routed experts of every MoE layer;
    * different too (not "only experts"): parameters upstream of the last MoE layer, because
      the dropped pairs' dx changes the gradient in the residual stream. On a model with a
      single MoE layer as its last block this is the exact meaning of "only expert
      gradients differ".
    """
    model = _model(family, **overrides)
    names = [n for n, _ in patch_moe_blocks(model, recalibration_rate=0.0)]
    last = max(_moe_index(n) for n in names)
    ids = _ids(3)
    out0 = _run(model, family, ids)
    grads0 = _grads(model)
    set_recalibration(model, recalibration_rate=0.5)
    out1 = _run(model, family, ids)
    grads1 = _grads(model)

    assert torch.equal(out0.loss, out1.loss)
    assert torch.equal(out0.logits, out1.logits)

    def downstream(name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if m is None:
            return name != "model.embed_tokens.weight"
        index, rest = int(m.group(1)), m.group(2)
        return index > last or (index == last and rest.startswith("mlp.")
                                and not rest.startswith("mlp.experts."))

    kinds = {"downstream": 0, "expert": 0, "upstream_changed": 0}
    for name in grads0:
        same = torch.equal(grads0[name], grads1[name])
        if downstream(name):
            assert same, f"{name} is downstream of the last MoE layer but changed"
            kinds["downstream"] += 1
        elif ".mlp.experts." in name:
            assert not same, f"{name}: expert gradient unchanged at c = 0.5"
            kinds["expert"] += 1
        elif not same:
            kinds["upstream_changed"] += 1
    assert kinds["downstream"] >= 3 and kinds["expert"] == 2 * len(names)
    assert kinds["upstream_changed"] > 0  # the residual stream carries the change upstream

    pairs = BATCH * SEQ * model.get_submodule(names[0]).config.top_k
    for diag in collect_diagnostics(model).values():
        assert diag["num_pairs"] == pairs and diag["num_retained"] == pairs // 2
        assert diag["dropped_fraction"] == pytest.approx(0.5)
        assert 0.0 < diag["retained_mass"] <= 1.0
    summary = summarize_diagnostics(collect_diagnostics(model))
    assert summary["dropped_fraction"] == pytest.approx(0.5)


# ------------------------------------------------------------ structure, save and load
@pytest.mark.parametrize("family", FAMILIES)
def test_same_parameter_objects_and_state_dict_keys(family):
    model = _model(family)
    keys_before = list(model.state_dict().keys())
    params_before = dict(model.named_parameters())
    buffers_before = dict(model.named_buffers())
    layers = patch_moe_blocks(model)

    assert list(model.state_dict().keys()) == keys_before  # names and order
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is p for n, p in params_before.items())
    assert all(dict(model.named_buffers())[n] is b for n, b in buffers_before.items())

    hf = _config(family)
    expected_experts = getattr(hf, "num_experts", None) or hf.num_local_experts
    for name, layer in layers:
        assert isinstance(layer, MoELayerBase) and model.get_submodule(name) is layer
        cfg = layer.config
        assert (cfg.num_experts, cfg.top_k, cfg.hidden_size) == (
            expected_experts, hf.num_experts_per_tok, hf.hidden_size)
        assert cfg.router == ("sigmoid" if family == "glm4_moe" else "softmax")
    layer = layers[0][1]
    if family == "qwen2_moe":
        assert layer.config.shared_expert_intermediate_size == 24
        assert layer.config.shared_expert_gate and not layer.config.norm_topk_prob
    if family == "glm4_moe":
        assert layer.config.routed_scaling_factor == 1.5
        assert layer.config.shared_expert_intermediate_size == 16
        assert "model.layers.0.mlp.gate.e_score_correction_bias" in keys_before
    if family == "mixtral":
        assert layer.config.norm_topk_prob


def _safetensors_keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_into_unpatched_model(family, tmp_path):
    ref, model, _ = _pair(family)
    with torch.no_grad():  # move away from the initial weights through the patched model
        gen = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(tmp_path / "patched")
    ref.load_state_dict(model.state_dict())
    ref.save_pretrained(tmp_path / "unpatched")
    # the same checkpoint layout (e.g. Mixtral is saved as per-expert w1/w2/w3 by both)
    assert _safetensors_keys(tmp_path / "patched") == _safetensors_keys(tmp_path / "unpatched")

    loaded = _CLASSES[family].from_pretrained(tmp_path / "patched", dtype=torch.float32)
    loaded.set_experts_implementation("grouped_mm")
    assert not any(isinstance(m, MoELayerBase) for m in loaded.modules())
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    ids = _ids(4)
    for m in (model, ref, loaded):
        m.eval()
    with torch.no_grad():
        logits_loaded = loaded(input_ids=ids).logits
        assert torch.equal(logits_loaded, ref(input_ids=ids).logits)
        torch.testing.assert_close(model(input_ids=ids).logits, logits_loaded,
                                   rtol=1e-5, atol=1e-5)
        patch_moe_blocks(loaded)  # and a loaded checkpoint patches to the same model
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_gradient_checkpointing_gives_the_same_planned_backward():
    """Activation checkpointing re-runs the forward of each decoder layer inside the
    backward; routing, scores and selection must come out the same (bitwise)."""
    ids = _ids(10)
    results = []
    for checkpointing in (False, True):
        model = _model("qwen2_moe")
        patch_moe_blocks(model, recalibration_rate=0.3)
        if checkpointing:
            model.gradient_checkpointing_enable()
        out = _run(model, "qwen2_moe", ids)
        results.append((out.loss, _grads(model), collect_diagnostics(model)))
    (loss0, grads0, diag0), (loss1, grads1, diag1) = results
    assert torch.equal(loss0, loss1) and diag0 == diag1
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


# ------------------------------------------------------------------ router logits / aux
@pytest.mark.parametrize("family", WITH_AUX)
def test_router_logits_and_aux_loss_when_hooks_were_installed_before_patching(family):
    """transformers installs its OutputRecorder hooks on the router modules at the first
    ``output_router_logits=True`` call; patching afterwards keeps those router objects, so
    the same hooks keep collecting. With padding (attention_mask) in the aux loss."""
    model = _model(family, torch.float64, experts="eager")
    ids = _ids(6)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :5] = 0
    before = _run(model, family, ids, mask)
    grads_before = _grads(model)
    patch_moe_blocks(model)
    after = _run(model, family, ids, mask)
    assert len(after.router_logits) == len(before.router_logits) == 2
    for a, b in zip(after.router_logits, before.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert math.isclose(after.aux_loss.item(), before.aux_loss.item(), rel_tol=1e-12)
    assert math.isclose(after.loss.item(), before.loss.item(), rel_tol=FP64_LOSS_RTOL)
    _assert_grads_close(grads_before, _grads(model), FP64_GRAD_TOL)


def test_mixtral_router_jitter_noise_is_reproduced():
    """Mixtral multiplies router and expert input by U(1 - j, 1 + j) in training: the
    patched layer draws the same numbers from the same generator state."""
    ref, model, _ = _pair("mixtral", torch.float64, experts="eager", router_jitter_noise=0.2)
    ids = _ids(7)
    torch.manual_seed(11)
    out_ref = _run(ref, "mixtral", ids)
    torch.manual_seed(11)
    out = _run(model, "mixtral", ids)
    assert math.isclose(out.loss.item(), out_ref.loss.item(), rel_tol=FP64_LOSS_RTOL)
    _assert_grads_close(_grads(ref), _grads(model), FP64_GRAD_TOL)
    torch.manual_seed(12)  # and the noise is really there
    assert not math.isclose(_run(model, "mixtral", ids).loss.item(), out.loss.item(),
                            rel_tol=1e-6)


# ------------------------------------------------------------------------ bf16, autocast
def _cosine(a: dict, b: dict) -> float:
    x = torch.cat([v.double().flatten() for v in a.values()])
    y = torch.cat([b[k].double().flatten() for k in a])
    return float(x @ y / (x.norm() * y.norm()))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_weights(family):
    """bf16 model: both compute in bf16 (eps 7.8e-3) with different rounding points, so
    only closeness is checked: loss within 2 %, gradients (all, concatenated) with cosine
    similarity > 0.99, every gradient bf16 and finite, c > 0 runs."""
    ref, model, _ = _pair(family, torch.bfloat16)
    ids = _ids(8)
    out_ref, out = _run(ref, family, ids), _run(model, family, ids)
    assert out.logits.dtype == torch.bfloat16
    assert math.isclose(out.loss.item(), out_ref.loss.item(), rel_tol=2e-2)
    grads = _grads(model)
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads.values())
    assert _cosine(grads, _grads(ref)) > 0.99
    set_recalibration(model, recalibration_rate=0.3)
    out_c = _run(model, family, ids)
    assert torch.equal(out_c.loss, out.loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_model_under_bf16_autocast(family):
    ref, model, _ = _pair(family, torch.float32)
    ids = _ids(9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, out = _run(ref, family, ids), _run(model, family, ids)
    assert math.isclose(out.loss.item(), out_ref.loss.item(), rel_tol=2e-2)
    grads = _grads(model)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert _cosine(grads, _grads(ref)) > 0.99


# ------------------------------------------------------------------------------ settings
def test_settings_forms_seeds_and_set_recalibration():
    model = _model("qwen3_moe")
    settings = LRMoEConfig(hidden_size=1, moe_intermediate_size=1, num_experts=1, top_k=1,
                           recalibration_rate=0.2, metric="random", seed=7)
    layers = patch_moe_blocks(model, settings, quota_rule="water_level")
    for index, (_, layer) in enumerate(layers):
        cfg = layer.config
        assert isinstance(layer, TransformersMoELayer) and layer.layer_index == index
        # the settings object's LRMoE fields, not its architecture
        assert (cfg.backward.recalibration_rate, cfg.backward.metric, cfg.backward.quota_rule) == (0.2, "random",
                                                                       "water_level")
        assert cfg.hidden_size == 32 and cfg.top_k == 2
        assert cfg.backward.seed == 7 + index * SEED_STRIDE
        assert cfg.router_aux_loss_coef == model.config.router_aux_loss_coef

    other = _model("qwen3_moe")
    layers = patch_moe_blocks(other, {"recalibration_rate": 0.1, "selection": "importance"},
                              recalibration_rate=0.3)
    assert all(layer.config.backward.recalibration_rate == 0.3 and
               layer.config.backward.selection == "importance" for _, layer in layers)

    assert set_recalibration(model, recalibration_rate=0.25, seed=3, metric="lrm") == 2
    for index, (_, layer) in enumerate(layers_of(model)):
        assert (layer.config.backward.recalibration_rate, layer.config.backward.metric) == (0.25, "lrm")
        assert layer.config.backward.seed == 3 + index * SEED_STRIDE
    with pytest.raises(ValueError, match="recalibration_rate"):
        set_recalibration(model, recalibration_rate=1.0)
    assert all(layer.config.backward.recalibration_rate == 0.25 for _, layer in layers_of(model))

    # diagnostics before any backward: forward entries only
    diags = collect_diagnostics(model)
    assert list(diags) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert summarize_diagnostics(diags)["dropped_fraction"] is None
    _run(model, "qwen3_moe", _ids())
    summary = summarize_diagnostics(collect_diagnostics(model))
    pairs = BATCH * SEQ * 2
    assert summary["dropped_fraction"] == pytest.approx(1 - int(0.75 * pairs) / pairs)
    assert 0 < summary["retained_mass"] <= 1 and summary["backward_buffer_bytes"] > 0


def layers_of(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TransformersMoELayer)]


# -------------------------------------------------------------------------------- errors
def test_model_without_moe_blocks_is_refused():
    dense = LlamaForCausalLM(LlamaConfig(**_COMMON, intermediate_size=48))
    with pytest.raises(ValueError, match="'llama'.*no sparse-MoE block"):
        patch_moe_blocks(dense)
    all_dense = _model("qwen3_moe", mlp_only_layers=[0, 1])
    with pytest.raises(ValueError, match="'qwen3_moe'.*no sparse-MoE block"):
        patch_moe_blocks(all_dense)
    with pytest.raises(ValueError, match="patch_moe_blocks"):
        set_recalibration(dense, recalibration_rate=0.1)


def test_unmapped_family_is_refused():
    model = OlmoeForCausalLM(OlmoeConfig(**_COMMON, intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2))
    with pytest.raises(NotImplementedError, match="'olmoe'.*OlmoeSparseMoeBlock.*qwen3_moe"):
        patch_moe_blocks(model)


def test_non_swiglu_experts_are_refused():
    model = _model("qwen3_moe", hidden_act="gelu")
    with pytest.raises(NotImplementedError, match="hidden_act='gelu'.*SwiGLU"):
        patch_moe_blocks(model)


def test_bad_settings_leave_the_model_untouched():
    model = _model("mixtral")
    with pytest.raises(ValueError, match="'top_k' is an architecture setting"):
        patch_moe_blocks(model, top_k=1)
    with pytest.raises(ValueError, match="unknown setting 'rate'"):
        patch_moe_blocks(model, rate=0.1)
    with pytest.raises(ValueError, match="recalibration_rate must be in"):
        patch_moe_blocks(model, recalibration_rate=1.5)
    with pytest.raises(ValueError, match="metric must be one of"):
        patch_moe_blocks(model, {"metric": "loss"})
    with pytest.raises(TypeError, match="settings must be"):
        patch_moe_blocks(model, 0.2)
    assert not any(isinstance(m, MoELayerBase) for m in model.modules())
    with pytest.raises(ValueError, match="got an MoE block itself"):
        patch_moe_blocks(model.model.layers[0].mlp)


def test_second_patch_and_forced_routing_are_refused():
    model = _model("qwen2_moe")
    layers = patch_moe_blocks(model)
    with pytest.raises(ValueError, match="already holds 2 LRMoE layer"):
        patch_moe_blocks(model)
    with pytest.raises(NotImplementedError, match="forced expert_ids"):
        layers[0][1](torch.randn(3, 32), expert_ids=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="last dimension"):
        layers[0][1](torch.randn(3, 31))
