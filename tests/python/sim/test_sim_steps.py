"""Tests of the step terms in ``lrmoe sim --scale`` (csrc/sim/step.h, csrc/sim/cluster.h
cluster_steps, lrmoe/sim/simulate.py step_model / simulate_cluster, lrmoe/sim/report.py
scale): the step is the MoE layers plus the gradient all-reduces, Adam and SYMI's
broadcast, each worked out here from its formula (ring all-reduce 2 (n - 1) / n x bytes /
GBps + 2 (n - 1) x latency, Patarasuk and Yuan 2009; Adam 30 B per parameter over HBM),
and the registry's dense parameter counts against the transformers models themselves.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe import cli
from lrmoe.planner.plan import MemoryModel
from lrmoe.sim import simulate as S
from lrmoe.sim.costs import PER_ROW, Costs
from lrmoe.sim.links import Links
from lrmoe.workload.shapes import MODELS, ModelShape


def _ring_ms(nbytes, n, GBps, latency_us):
    """The ring all-reduce, written out here (not the code under test)."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (GBps * 1e6) + 2 * (n - 1) * latency_us * 1e-3


def _toy_costs():
    g = np.array([[1, 1024, 1.0, 2.0], [16, 1024, 16.0, 32.0]], dtype=np.float64)
    return Costs("toy", {}, g, {k: 1e-6 for k in PER_ROW}, 10.0, {"device": "toy"})


def test_step_model_sizes_by_hand_and_refusals():
    shape = ModelShape("t", 64, 32, 8, 2, 12, dense_params=1000)
    m = S.step_model(shape, 3, 2.0)
    # fp32 dense gradients (4 B each); one expert 3 H I = 3 x 64 x 32 parameters
    assert (m.dp_size, m.dense_grad_bytes, m.dense_params) == (3, 4000.0, 1000.0)
    assert (m.expert_params, m.hbm_GBps, m.moe_layers) == (6144.0, 2.0, 12)
    assert S.step_model(shape, 1, 2.0, dense_params=10, moe_layers=4).dense_grad_bytes == 40
    with pytest.raises(ValueError, match="--dense-params"):
        S.step_model(ModelShape("u", 64, 32, 8, 2, 12), 1, 2.0)
    with pytest.raises(ValueError, match="--hbm-gbps"):
        S.step_model(shape, 1, 0.0)
    with pytest.raises(ValueError, match="groups"):
        S.step_model(shape, 0, 2.0)


@pytest.mark.parametrize("policy", ["fixed", "symi"])
def test_simulate_cluster_steps_are_the_layers_plus_the_terms(policy):
    """2 groups of W = 4, E = 8, 2 steps x 2 simulated layers standing for 6: per step the
    layers' slowest-group times x 3, plus the terms by their formulas with the default
    links (4 x 2 = 8 GPUs: one node, so the dense ring runs over NVLink; the expert ring
    over the 2 groups at the network's)."""
    W, E, H, groups, steps, layers = 4, 8, 64, 2, 2, 2
    rng = np.random.default_rng(3)
    load = rng.integers(0, 80, size=(steps, groups, layers, W, E)).astype(np.int64)
    load[..., 0] *= 6  # a hot expert: symi gives it copies
    mem = MemoryModel(100, 200, 400, 3, 5, 1 << 40, 0, optimizer_on_device=False)
    shape = ModelShape("t", H, 32, E, 2, 6, dense_params=1000)
    links = Links.from_file()
    model = S.step_model(shape, groups, 1.0)
    r = S.simulate_cluster(load, policy, mem, _toy_costs(), links, H, replica_slots=1,
                           threads=2, top_k=1, step=model)
    st = r["steps"]
    assert set(st) == set(S.STEP_KEYS)
    per_step = r["time_ms"].reshape(steps, layers)
    np.testing.assert_allclose(st["moe_ms"], per_step.sum(axis=1) * 3, rtol=1e-12)
    np.testing.assert_allclose(st["mean_group_moe_ms"],
                               r["mean_group_ms"].reshape(steps, layers).sum(axis=1) * 3,
                               rtol=1e-12)
    owned = r["owned_experts_max"].reshape(steps, layers).sum(axis=1) * 3
    # fixed ownership: E / W experts per rank; symi shards its optimizer state: the same
    assert (r["owned_experts_max"] == E // W).all()
    if policy == "fixed":
        assert (st["broadcast_ms"] == 0).all()
    else:
        assert (r["broadcast_ms"] > 0).all()  # every layer has copies to refresh
        np.testing.assert_allclose(st["broadcast_ms"],
                                   r["broadcast_ms"].reshape(steps, layers).sum(axis=1) * 3,
                                   rtol=1e-12)
    for s in range(steps):
        assert st["expert_allreduce_ms"][s] == pytest.approx(
            _ring_ms(owned[s] * 200, groups, links.inter_GBps, links.inter_latency_us),
            rel=1e-12)
        assert st["dense_allreduce_ms"][s] == pytest.approx(
            _ring_ms(4000, W * groups, links.intra_GBps, links.intra_latency_us), rel=1e-12)
        # Adam: (owned experts x 3 H I + dense) x 30 B at 1 GB/s = 1e6 B/ms
        assert st["optimizer_ms"][s] == pytest.approx(
            (owned[s] * 3 * H * 32 + 1000) * 30 / 1e6, rel=1e-12)
    np.testing.assert_allclose(
        st["total_ms"], st["moe_ms"] + st["expert_allreduce_ms"] + st["dense_allreduce_ms"]
        + st["optimizer_ms"] + st["broadcast_ms"], rtol=1e-12)
    with pytest.raises(ValueError, match="dp_size"):
        S.simulate_cluster(load, policy, mem, _toy_costs(), links, H,
                           step=S.step_model(shape, 3, 1.0))


def test_sim_scale_refuses_a_model_without_dense_parameters(tmp_path):
    from lrmoe.sim.report import run_sim
    args = cli.build_parser().parse_args(["sim", "--costs", "x.json", "--model",
                                          "glm-4.5-air", "--scale", "8",
                                          "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--dense-params"):
        run_sim(args)
    args.dense_params = -1.0
    with pytest.raises(ValueError, match="--dense-params"):
        run_sim(args)


@pytest.mark.parametrize("name, kw", [
    ("qwen3-30b-a3b", dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)),
    # configs/gpu-small.yaml as lrmoe/training/setup.py builds it
    ("gpu-small", dict(vocab_size=16384, hidden_size=768, num_hidden_layers=8,
                       num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                       intermediate_size=2048, moe_intermediate_size=256, num_experts=128,
                       num_experts_per_tok=8))])
def test_dense_params_are_the_models_parameters_outside_the_experts(name, kw):
    """The registry's dense_params against the transformers model itself, built on the
    meta device (no memory): every parameter not in a routed expert."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(tie_word_embeddings=False, **kw))
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    assert MODELS[name].dense_params == dense
