"""lrmoe.integrations.torchtitan against torchtitan's own MoE modules (Qwen3 MoE and
DeepSeek-V3 flavours built by torchtitan's config helpers, torchtitan's own weights).

The reference is always an untouched deep copy of the torchtitan model: its router, token
dispatcher, GroupedExperts and shared experts. torchtitan's GroupedExperts computes in
bf16 whatever the weights' dtype, so the comparison with it is at bf16 tolerance; the
float32 comparison runs torchtitan's MoE with its expert forward in float32 (its own code
and its own ``_grouped_mm`` seam, the three ``.bfloat16()`` casts left out).
Skipped where torchtitan does not import (requirements/torchtitan.txt).
"""
from __future__ import annotations

import copy

import pytest
import torch

from lrmoe.integrations.torchtitan import (LRMoETitanConfig, collect_diagnostics,
                                           require_torchtitan, set_recalibration,
                                           swap_moe, swapped_layers)
from lrmoe.integrations.torchtitan_qwen3 import build_qwen3_moe, qwen3_moe_config

try:
    require_torchtitan()
    SKIP = None
except ModuleNotFoundError as exc:  # the message names requirements/torchtitan.txt
    SKIP = str(exc)
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

DIM, INTER, EXPERTS, TOP_K = 32, 24, 8, 2
BF16_TOL = 3e-2  # relative to the largest entry; as lrmoe/bench/method.py BF16_TOL
FP32_TOL = 1e-5


def qwen3_config():
    """A 2-layer Qwen3 MoE from torchtitan's own config helpers
    (lrmoe.integrations.torchtitan_qwen3: the settings of torchtitan 0.3.0's
    ``_build_qwen3_moe_layers``, flex attention)."""
    return qwen3_moe_config(dim=DIM, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                            moe_inter=INTER, num_experts=EXPERTS, top_k=TOP_K,
                            vocab_size=64, max_seq_len=64)


def qwen3_model(seed: int = 0, cfg=None) -> torch.nn.Module:
    """The model of ``cfg`` (default :func:`qwen3_config`), initialised by torchtitan."""
    return build_qwen3_moe(qwen3_config() if cfg is None else cfg, seed)


def deepseek_moe(seed: int = 0) -> torch.nn.Module:
    """A DeepSeek-V3-style torchtitan MoE: sigmoid router, 4 expert groups of which 2 are
    searched, route_scale 2.5, 2 shared experts (the 671B flavour's router settings)."""
    from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)
    init = {"weight": lambda w: torch.nn.init.normal_(w, std=0.1)}
    cfg = make_moe_config(
        num_experts=EXPERTS,
        router=make_router_config(dim=DIM, num_experts=EXPERTS, gate_param_init=init,
                                  top_k=TOP_K, score_func="sigmoid", num_expert_groups=4,
                                  num_limited_groups=2, route_scale=2.5, route_norm=True),
        routed_experts=make_routed_experts_config(
            dim=DIM, hidden_dim=INTER, num_experts=EXPERTS, top_k=TOP_K,
            param_init={"w1_EFD": init["weight"], "w2_EDF": init["weight"],
                        "w3_EFD": init["weight"]}, comm_backend="standard"),
        shared_experts=make_ffn_config(dim=DIM, hidden_dim=2 * INTER, w1_param_init=init,
                                       w2w3_param_init=init))
    torch.manual_seed(seed)
    moe = cfg.build()
    moe.init_states()
    with torch.no_grad():  # a nonzero bias: the biased top-K must be torchtitan's too
        moe.expert_bias_E.copy_(torch.linspace(-0.05, 0.05, EXPERTS))
    return moe


class Holder(torch.nn.Module):
    """A module holding one MoE (swap_moe replaces inside a model)."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe


def fp32_grouped_experts(experts, x_RD, num_tokens_per_expert_E):
    """torchtitan 0.3.0's GroupedExperts.forward without its .bfloat16() casts."""
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    mm = experts._grouped_mm
    h_RF = torch.nn.functional.silu(mm(A=x_RD, B_t=experts.w1_EFD.transpose(-2, -1),
                                       offs=offsets_E))
    h_RF = h_RF * mm(A=x_RD, B_t=experts.w3_EFD.transpose(-2, -1), offs=offsets_E)
    return mm(A=h_RF, B_t=experts.w2_EDF.transpose(-2, -1), offs=offsets_E)


def run(moe, x, g):
    """Output and the gradients of the input and every parameter for upstream ``g``."""
    x = x.clone().requires_grad_(True)
    moe.zero_grad(set_to_none=True)
    out = moe(x)
    out.backward(g)
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return out.detach(), x.grad.clone(), grads


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def pair(kind, seed=0):
    """(reference MoE, MoE to swap, holder of the latter)."""
    moe = qwen3_model(seed).layers["0"].moe if kind == "qwen3" else deepseek_moe(seed)
    return copy.deepcopy(moe), moe, Holder(moe)


def inputs(seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, DIM, generator=gen)
    g = torch.randn(2, 16, DIM, generator=gen)
    return x.to(device), g.to(device)


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_equals_torchtitan_fp32_experts(kind, monkeypatch):
    ref, moe, holder = pair(kind)
    monkeypatch.setattr(type(ref.routed_experts.inner_experts), "forward",
                        fp32_grouped_experts)
    swap_moe(holder, LRMoETitanConfig(expert_dtype="input"))
    x, g = inputs()
    want, got = run(ref, x, g), run(moe, x, g)
    assert rel(got[0], want[0]) < FP32_TOL
    assert rel(got[1], want[1]) < FP32_TOL
    assert set(got[2]) == set(want[2]) and len(got[2]) >= 4  # router, w1, w2, w3 (+shared)
    for name in want[2]:
        assert rel(got[2][name], want[2][name]) < FP32_TOL, name


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_equals_torchtitan_bf16_experts(kind):
    ref, moe, holder = pair(kind)
    swap_moe(holder, LRMoETitanConfig())  # expert_dtype="bfloat16", as GroupedExperts
    x, g = inputs()
    want, got = run(ref, x, g), run(moe, x, g)
    assert rel(got[0], want[0]) < BF16_TOL
    assert rel(got[1], want[1]) < BF16_TOL
    for name in want[2]:
        assert rel(got[2][name], want[2][name]) < BF16_TOL, name
    # the bf16 experts are not the fp32 ones: the tolerance above is bf16's, not slack
    _, moe32, holder32 = pair(kind)
    swap_moe(holder32, LRMoETitanConfig(expert_dtype="input"))
    assert rel(run(moe32, x, g)[0], got[0]) > 1e-4


def test_whole_qwen3_model_forward_equals_torchtitan(monkeypatch):
    # the whole decoder (torchtitan's flex attention has no CPU backward: forward only)
    model = qwen3_model()
    ref = copy.deepcopy(model)
    monkeypatch.setattr(type(ref.layers["0"].moe.routed_experts.inner_experts), "forward",
                        fp32_grouped_experts)
    swap_moe(model, LRMoETitanConfig(expert_dtype="input"))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).repeat(2, 1)
    with torch.no_grad():
        want = ref(tokens, positions, ref.get_attention_masks(positions))
        got = model(tokens, positions, model.get_attention_masks(positions))
    assert rel(got, want) < FP32_TOL


def test_compiled_moe_equals_eager():
    _, eager, holder = pair("qwen3")
    _, _, compiled = pair("qwen3")
    swap_moe(holder, LRMoETitanConfig(recalibration_rate=0.3))
    swap_moe(compiled, LRMoETitanConfig(recalibration_rate=0.3))
    compiled.moe.compile(backend="aot_eager")  # in place: parameter names unchanged
    x, g = inputs()
    want, got = run(eager, x, g), run(compiled.moe, x, g)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), name


def test_state_dict_and_parameters_unchanged():
    model = qwen3_model()
    before = model.state_dict()
    params = {n: p for n, p in model.named_parameters()}
    swap_moe(model, LRMoETitanConfig(recalibration_rate=0.2))
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in before)
    assert {n: id(p) for n, p in model.named_parameters()} == \
        {n: id(p) for n, p in params.items()}
    layers = swapped_layers(model)
    assert [n for n, _ in layers] == ["layers.0.moe.routed_experts",
                                      "layers.1.moe.routed_experts"]
    assert [m.lrmoe_config.backward.seed for _, m in layers] == [0, 1 << 32]
    # still torchtitan's RoutedExperts (its parallelize and sharding config apply)
    from torchtitan.models.common.moe import RoutedExperts
    assert all(isinstance(m, RoutedExperts) for _, m in layers)
    copy.deepcopy(model)  # the swapped class survives a copy


def test_dcp_checkpoint_of_torchtitan_loads_into_swapped_model(tmp_path):
    # torch.distributed.checkpoint (what torchtitan's checkpointer writes), one process
    import torch.distributed.checkpoint as dcp
    source = qwen3_model(seed=0)
    dcp.save(source.state_dict(), checkpoint_id=str(tmp_path / "step-0"))
    model = swap_moe(qwen3_model(seed=1), LRMoETitanConfig(recalibration_rate=0.2))
    state = model.state_dict()
    assert not all(torch.equal(state[k], v) for k, v in source.state_dict().items())
    dcp.load(state, checkpoint_id=str(tmp_path / "step-0"))
    model.load_state_dict(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.state_dict().items())
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "step-1"))
    back = qwen3_model(seed=2)
    back_state = back.state_dict()
    dcp.load(back_state, checkpoint_id=str(tmp_path / "step-1"))
    assert all(torch.equal(back_state[k], v) for k, v in source.state_dict().items())


def test_positive_rate_changes_only_the_backward():
    ref, moe, holder = pair("qwen3")
    swap_moe(holder, LRMoETitanConfig(recalibration_rate=0.5, selection="topk"))
    _, exact, holder0 = pair("qwen3")
    swap_moe(holder0, LRMoETitanConfig())
    x, g = inputs()
    got, want = run(moe, x, g), run(exact, x, g)
    assert torch.equal(got[0], want[0])  # forward bitwise that of c = 0
    gate = "router.gate.weight"
    assert torch.equal(got[2][gate], want[2][gate])  # router gradient exact
    w2 = "routed_experts.inner_experts.w2_EDF"
    assert rel(got[2][w2], want[2][w2]) > 1e-3  # the experts' gradient is planned
    stats = collect_diagnostics(holder)["moe.routed_experts"]
    assert stats["num_retained"] == stats["num_pairs"] // 2
    assert set_recalibration(holder, recalibration_rate=0.0) == 1
    assert torch.equal(run(moe, x, g)[2][w2], want[2][w2])


def test_override_builds_lrmoe_experts_through_torchtitan_config(monkeypatch):
    # torchtitan's own override mechanism (--override.imports) on the model config tree
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from lrmoe.integrations import torchtitan_override
    monkeypatch.setattr(torchtitan_override, "_LAYER_COUNT", iter(range(100)))
    cfg = qwen3_config()
    target = "lrmoe.integrations.torchtitan_override.lrmoe_moe"
    apply_overrides(OverrideConfig(imports=[(target, {"expert_dtype": "input"})]), cfg)
    model = qwen3_model(0, cfg)
    ref = qwen3_model(0)  # the same seed: the same initial weights
    assert list(model.state_dict()) == list(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 ref.state_dict().values()))
    layers = swapped_layers(model)
    assert [type(m).__name__ for _, m in layers] == ["LRMoETitanRoutedExperts"] * 2
    assert [m.lrmoe_config.backward.seed for _, m in layers] == [0, 1 << 32]
    monkeypatch.setattr(type(ref.layers["0"].moe.routed_experts.inner_experts), "forward",
                        fp32_grouped_experts)
    x, g = inputs()
    want, got = run(ref.layers["1"].moe, x, g), run(model.layers["1"].moe, x, g)
    assert rel(got[0], want[0]) < FP32_TOL
    for name in want[2]:
        assert rel(got[2][name], want[2][name]) < FP32_TOL, name
    with pytest.raises(TypeError):
        torchtitan_override.lrmoe_moe(qwen3_config().layers[0].moe, top_k=3)


def test_bad_settings_and_models():
    with pytest.raises(ValueError, match="LRMoETitanConfig.recalibration_rate"):
        swap_moe(qwen3_model(), LRMoETitanConfig(recalibration_rate=1.5))
    with pytest.raises(ValueError, match="LRMoETitanConfig.expert_dtype"):
        swap_moe(qwen3_model(), LRMoETitanConfig(expert_dtype="fp8"))
    with pytest.raises(TypeError, match="LRMoETitanConfig"):
        swap_moe(qwen3_model(), {"recalibration_rate": 0.2})
    with pytest.raises(ValueError, match="no torchtitan MoE"):
        swap_moe(torch.nn.Linear(2, 2), LRMoETitanConfig())
    model = swap_moe(qwen3_model(), LRMoETitanConfig())
    with pytest.raises(ValueError, match="already swapped"):
        swap_moe(model, LRMoETitanConfig())
    with pytest.raises(ValueError, match="unknown field"):
        set_recalibration(model, top_k=3)
    untouched = qwen3_model()
    assert swap_moe(untouched, LRMoETitanConfig(enabled=False)) is untouched
    assert swapped_layers(untouched) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_equals_torchtitan_on_gpu(kind):
    ref, moe, holder = pair(kind)
    ref.cuda(), moe.cuda()
    swap_moe(holder, LRMoETitanConfig())
    x, g = inputs(device="cuda")
    want, got = run(ref, x, g), run(moe, x, g)
    assert rel(got[0], want[0]) < BF16_TOL
    assert rel(got[1], want[1]) < BF16_TOL
    for name in want[2]:
        assert rel(got[2][name], want[2][name]) < BF16_TOL, name


def _fsdp2_check(rank, world, out):
    # each rank: the same swapped MoE under fully_shard, half the batch; FSDP2 averages
    # the gradients over the ranks, so twice that is the full-batch gradient
    import json
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    ref, moe, holder = pair("qwen3")
    type(ref.routed_experts.inner_experts).forward = fp32_grouped_experts  # own process
    swap_moe(holder, LRMoETitanConfig(expert_dtype="input"))
    fully_shard(holder.moe, mesh=init_device_mesh("cpu", (world,)))
    x, g = inputs()
    half = slice(rank, rank + 1)  # batch 2: one sequence per rank
    got = run(holder.moe, x[half], g[half])
    want = run(ref, x, g)
    errs = {n: rel(2 * got[2][n].full_tensor(), want[2][n]) for n in want[2]}
    errs["out"] = rel(got[0], want[0][half])
    sharded = type(holder.moe.routed_experts.inner_experts.w1_EFD).__name__
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"errs": errs, "sharded": sharded}, f)


def test_fsdp2_two_ranks_equal_torchtitan(tmp_path):
    import json
    from test_expert_parallel import _spawn  # tests/python/parallel
    out = tmp_path / "fsdp2.json"
    _spawn(_fsdp2_check, "gloo", 2, str(out), timeout_s=300)
    result = json.loads(out.read_text())
    assert result["sharded"] == "DTensor"  # the parameters are sharded between steps
    assert len(result["errs"]) >= 5
    assert all(e < FP32_TOL for e in result["errs"].values()), result


def test_block_mask_compat_drops_only_the_default_keyword(monkeypatch):
    """On a torch whose ``create_block_mask`` lacks ``separate_full_blocks`` (2.11), the
    shim passes torchtitan's call through without the keyword when it is True (the old
    torch's only behaviour) and refuses False; a torch with the keyword is left alone."""
    import torch.nn.attention.flex_attention as fa
    from torchtitan.models.common import attention, decoder

    from lrmoe.integrations import torchtitan_qwen3 as tq

    calls = []
    monkeypatch.setattr(attention, "create_attention_mask",
                        lambda *a, **k: calls.append((a, k)) or "mask")
    monkeypatch.setattr(decoder, "create_attention_mask", attention.create_attention_mask)
    monkeypatch.setattr(fa, "create_block_mask", lambda mask_mod, B, H, Q, KV, device="cpu",
                        BLOCK_SIZE=128: None)  # the 2.11 signature, no keyword
    tq._block_mask_compat()
    patched = decoder.create_attention_mask
    assert patched("m", 2, None, 8, 8, device="cpu", separate_full_blocks=True) == "mask"
    assert calls == [(("m", 2, None, 8, 8), {"device": "cpu"})]
    with pytest.raises(RuntimeError, match="batch-invariant"):
        patched("m", 2, None, 8, 8, separate_full_blocks=False)
    tq._block_mask_compat()  # idempotent: not wrapped twice
    assert decoder.create_attention_mask is patched

    monkeypatch.setattr(decoder, "create_attention_mask", attention.create_attention_mask)
    monkeypatch.setattr(fa, "create_block_mask",
                        lambda mask_mod, B, H, Q, KV, separate_full_blocks=True: None)
    tq._block_mask_compat()  # a torch with the keyword: untouched
    assert decoder.create_attention_mask is attention.create_attention_mask
