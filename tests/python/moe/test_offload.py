"""Activation offload (``LRMoEConfig.offload = "activations"``, lrmoe/moe/offload.py).

On the CPU the offload runs the path it runs on CUDA (store a copy, gather the kept rows
by index over a word view of it, copy them back), so a layer with it must be bitwise
equal to the same layer without it (outputs and every gradient), on one device and under
gloo expert parallelism. The byte counts are checked
against values computed here by hand from the shapes: P = T K routed pairs,
R = floor((1 - c) P) kept (exact rationals), itemsize of the dtype. The GPU test (skipped
without CUDA) compares with no offload within bf16 rounding and checks that the peak
memory of a stack of layers falls.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from lrmoe.moe.config import LRMoEConfig
from lrmoe.layer import LRMoELayer
from lrmoe.moe.offload import ActivationOffload, OffloadStats, ready
from lrmoe.moe.config import BackwardConfig

import test_expert_parallel as tep
from test_expert_parallel import _backends, _spawn

H, I, E, K, T = 16, 12, 4, 2, 40


def _cfg(**kw):
    base = dict(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K,
                router_aux_loss_coef=0.0)
    base.update(kw)
    return LRMoEConfig(**base)


def _run(cfg, x, w_out, seed=0, ep_group=None, ids=None):
    """Output, input gradient, every parameter gradient of one step, and the layer (on
    the device of ``x``)."""
    torch.manual_seed(seed)
    layer = LRMoELayer(cfg, ep_group=ep_group).to(x.device)
    x = x.clone().requires_grad_()
    out = layer(x, ids)
    (out.float() * w_out).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads, layer


def _assert_bitwise(a, b):
    out_a, gx_a, g_a, _ = a
    out_b, gx_b, g_b, _ = b
    assert torch.equal(out_a, out_b)
    assert torch.equal(gx_a, gx_b)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert torch.equal(g_a[name], g_b[name]), name


def _inputs(num_tokens=T, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, H, generator=gen),
            torch.randn(num_tokens, H, generator=gen))


@pytest.mark.parametrize("dtype,cols", [(torch.float64, 3), (torch.bfloat16, 5),
                                        (torch.float16, 6), (torch.float32, 7)])
def test_store_load_equals_plain_indexing(dtype, cols):
    """Any row width (the reload moves machine words of a row), any index order,
    repeats; the reference is plain tensor indexing."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(9, cols, generator=gen).to(dtype)
    index = torch.tensor([8, 0, 3, 3, 5], dtype=torch.int32)
    stats = OffloadStats()
    off = ActivationOffload(stats)
    stored = off.store(rows)
    got = ready(off.load(stored, index))
    assert got.dtype == dtype and torch.equal(got, rows[index.long()])
    assert torch.equal(ready(off.load(stored, None)), rows)
    assert ready(off.load(stored, index[:0])).shape == (0, cols)
    row = cols * rows.element_size()
    assert (stats.d2h_bytes, stats.h2d_bytes) == (9 * row, (5 + 9) * row)
    with pytest.raises(ValueError, match="index_R must be a 1-D tensor"):
        off.load(stored, index.reshape(1, -1))


@pytest.mark.parametrize("settings", [
    dict(recalibration_rate=0.0),
    dict(recalibration_rate=0.3),
    dict(recalibration_rate=0.3, selection="importance", metric="grad_sq"),
    dict(recalibration_rate=0.5, retained_mass_target=0.8),   # the adaptive rate
    dict(selective_backward=False),                            # every row, no index
], ids=["c0", "c0.3", "importance", "adaptive", "exact-backward"])
def test_single_device_bitwise_equal_to_no_offload(settings):
    x, w_out = _inputs()
    plain = _run(_cfg(**settings), x, w_out)
    offloaded = _run(_cfg(offload="activations", **settings), x, w_out)
    _assert_bitwise(plain, offloaded)
    assert offloaded[3].stats.offload is not None and plain[3].stats.offload is None


def test_single_device_bitwise_bf16_odd_width():
    x, w_out = _inputs()
    outs = []
    for mode in ("none", "activations"):
        torch.manual_seed(0)
        layer = LRMoELayer(_cfg(moe_intermediate_size=5, recalibration_rate=0.3,
                                offload=mode)).to(torch.bfloat16)
        xb = x.to(torch.bfloat16).requires_grad_()
        (layer(xb).float() * w_out).sum().backward()
        outs.append([xb.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("c", [0.0, 0.3])
def test_single_device_byte_counts(c):
    x, w_out = _inputs()
    *_, layer = _run(_cfg(offload="activations", recalibration_rate=c), x, w_out)
    pairs = T * K
    kept = int((1 - Fraction(c).limit_denominator(1 << 20)) * pairs)
    assert layer.stats.num_retained == kept
    h_row = 2 * I * 4  # fp32 pre-activation row
    d = layer.diagnostics()
    assert d["offload_d2h_bytes"] == pairs * h_row  # stored: all P rows of h
    assert d["offload_h2d_bytes"] == kept * h_row  # only the kept rows come back


def test_no_offload_without_grad():
    x, _ = _inputs()
    layer = LRMoELayer(_cfg(offload="activations"))
    with torch.no_grad():
        layer(x)
    assert layer.stats.offload is None  # nothing is kept for a backward that never runs


def test_bad_offload_value():
    with pytest.raises(ValueError, match=r"LRMoEConfig.offload must be one of none, "
                                         r"activations; got 'disk'"):
        _cfg(offload="disk")
    with pytest.raises(ValueError, match=r"lrmoe.offload must be one of none, activations; "
                                         r"got 'gpu'"):
        BackwardConfig(offload="gpu").validate()


# ------------------------------------------------------------------------ expert parallel
def _check_ep(rank, world, c):
    dev = tep._DEVICE  # this rank's device, set by the spawned worker
    x_all, w_all = (t.to(dev) for t in _inputs(T * world, seed=5))
    sl = slice(rank * T, (rank + 1) * T)
    experts = 2 * world  # two per rank: rank d holds experts 2d, 2d + 1
    # forced routing (K distinct experts per token), known to the byte count below
    gen = torch.Generator().manual_seed(7)
    ids_TK = torch.stack([torch.randperm(experts, generator=gen)[:K]
                          for _ in range(T * world)])[sl].to(dev)
    cfg = _cfg(num_experts=experts, recalibration_rate=c)
    group = dist.group.WORLD
    plain = _run(cfg, x_all[sl], w_all[sl], seed=3, ep_group=group, ids=ids_TK)
    offloaded = _run(cfg.replace(offload="activations"), x_all[sl], w_all[sl], seed=3,
                     ep_group=group, ids=ids_TK)
    _assert_bitwise(plain, offloaded)
    # hand count: rows this rank's experts received from every source, and the kept ones
    layer = offloaded[3]
    rank_of_pair = ids_TK.reshape(-1) // 2
    rank_of_kept = rank_of_pair[layer.stats.kept_pair_R.long()]
    counts = torch.stack([torch.bincount(rank_of_pair, minlength=world),
                          torch.bincount(rank_of_kept, minlength=world)])
    dist.all_reduce(counts)  # summed over the sources
    rows, kept = int(counts[0, rank]), int(counts[1, rank])
    row = (H + 2 * I) * 4  # one fp32 x row and one h row
    d = layer.diagnostics()
    assert d["offload_d2h_bytes"] == rows * row
    assert d["offload_h2d_bytes"] == kept * row


@pytest.mark.parametrize("backend,world", _backends([2], nccl_worlds=(2,)))
@pytest.mark.parametrize("c", [0.0, 0.3])
def test_expert_parallel_bitwise_equal_to_no_offload(backend, world, c):
    _spawn(_check_ep, backend, world, c)


# ---------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("c", [0.0, 0.3])
def test_cuda_offload_matches_and_lowers_peak_memory(c):
    """bf16 on CUDA: equal to no offload within bf16 rounding; a stack of layers holds
    less memory at its peak (the saved h of every layer waits on the host)."""
    dev, hidden, inter, experts, layers, tokens = "cuda", 512, 768, 8, 6, 4096

    def step(offload):
        cfg = LRMoEConfig(hidden_size=hidden, moe_intermediate_size=inter,
                          num_experts=experts, top_k=2, router_aux_loss_coef=0.0,
                          recalibration_rate=c, offload=offload)
        torch.manual_seed(0)
        stack = torch.nn.ModuleList(LRMoELayer(cfg) for _ in range(layers)).to(
            dev, torch.bfloat16)
        gen = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        x.requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        h = x
        for layer in stack:
            h = h + layer(h)
        h.float().square().sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return h.detach(), x.grad, [p.grad for p in stack.parameters()], peak

    out_a, gx_a, g_a, peak_plain = step("none")
    out_b, gx_b, g_b, peak_off = step("activations")
    tol = dict(rtol=1.6e-2, atol=1e-3)  # bf16 rounding
    torch.testing.assert_close(out_b, out_a, **tol)
    torch.testing.assert_close(gx_b, gx_a, **tol)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, **tol)
    h_bytes = tokens * 2 * 2 * inter * 2  # one layer's saved h: P rows of 2I bf16
    assert peak_off < peak_plain - 2 * h_bytes, (peak_off, peak_plain, h_bytes)


def test_bench_layer_reports_offload_bytes(tmp_path):
    from lrmoe.bench.layer import bench_layer
    from lrmoe.workload.shapes import SHAPES

    result = bench_layer(["smoke"], [64], ["uniform"], rates=[0.3], methods=["lrmoe"],
                         device="cpu", dtype="float32", iters=1, warmup=1, rotate=1,
                         out_dir=str(tmp_path), offload="activations")
    (rec,) = result["records"]
    d = SHAPES["smoke"].dims
    pairs = 64 * d["top_k"]
    kept = int((1 - Fraction(3, 10)) * pairs)
    h_row = 2 * d["inter"] * 4
    assert rec["offload"] == "activations" and rec["num_retained"] == kept
    assert rec["offload_h2d_bytes"] == kept * h_row
    assert rec["offload_d2h_bytes"] == pairs * h_row
    table = (tmp_path / "layer_bench.md").read_text()
    assert f"| {kept * h_row / 1e6:.1f} / {pairs * h_row / 1e6:.1f} |" in table
    with pytest.raises(ValueError, match="offload must be one of none, activations"):
        bench_layer(["smoke"], [64], ["uniform"], offload="host", device="cpu")


def test_retain_graph_backward_twice():
    x, w_out = _inputs()
    grads = []
    for mode in ("none", "activations"):
        torch.manual_seed(0)
        layer = LRMoELayer(_cfg(recalibration_rate=0.3, offload=mode))
        xr = x.clone().requires_grad_()
        loss = (layer(xr) * w_out).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # the stored rows are still there for a second backward
        grads.append([xr.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_training_settings_reach_every_patched_layer():
    """``--offload`` / ``lrmoe.offload`` -> patch_moe_blocks -> each layer; a patched
    transformers model trains bitwise as without offload, and the trainer's per-step
    metrics sum the layers' bytes (hand count: layers x T K rows of h)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lrmoe.training import train as T
    from lrmoe.cli import build_parser, train_overrides
    from lrmoe.integrations.transformers import patch_moe_blocks
    from lrmoe.training.metrics import diagnostics_means

    args = build_parser().parse_args(["train", "--offload", "activations"])
    cfg = T.build_config("tiny", overrides=train_overrides(args))
    assert cfg.lrmoe.offload == "activations"
    assert cfg.backward.offload == "activations"
    with pytest.raises(ValueError, match="lrmoe.offload must be one of"):
        T.build_config("tiny", sets=["lrmoe.offload=gpu"])

    hf = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                        moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, max_position_embeddings=32)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    runs = []
    for mode in ("none", "activations"):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(hf)
        patch_moe_blocks(model, recalibration_rate=0.3, offload=mode)
        model(input_ids=ids, labels=ids).loss.backward()
        runs.append((model, [p.grad for p in model.parameters()]))
    for a, b in zip(runs[0][1], runs[1][1]):
        assert (a is None and b is None) or torch.equal(a, b)
    record = diagnostics_means(runs[1][0])
    assert record["offload_d2h_bytes"] == 2 * (2 * 8 * 2) * (2 * 8) * 4
    assert "offload_d2h_bytes" not in diagnostics_means(runs[0][0])
