"""lrmoe.integrations.torchtitan under torchtitan's own parallelization: its Qwen3
``parallelize_fn`` (``parallelize_qwen3``: ``Module.parallelize`` for EP, then FSDP2 by
``apply_fsdp_to_decoder``) with a real ``ParallelDims``, gloo ranks on the CPU.

What the test (never lrmoe's code) changes so that torchtitan 0.3.0 runs on a CPU:

* the device type: ``torchtitan.tools.utils`` picks ``_get_available_device_type() or
  "cuda"`` at import, so on a CPU-only torch ``ParallelDims.build_mesh`` makes "cuda"
  meshes and ``Module._distribute_states`` fails in ``distribute_tensor`` ("Torch not
  compiled with CUDA enabled"). :func:`_point_torchtitan_at_cpu` sets ``device_type`` /
  ``device_module`` to "cpu" / ``torch.cpu`` there and in every torchtitan module that
  imported those names;
* FSDP2's gradient reduction: torchtitan sets ``set_gradient_divide_factor(1.0)`` (it
  scales by the global token count itself), which FSDP2 does as ``ReduceOp.PREMUL_SUM``,
  which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). The test sets
  ``set_force_sum_reduction_for_comms(True)`` on every FSDP module: a SUM with factor 1,
  the same numbers;
* attention: FlexAttention has no CPU backward, so the inner attention's forward is a
  causal ``scaled_dot_product_attention`` (:func:`_sdpa_attention`) on both sides of every
  comparison; every sequence is one document (positions ``arange``), where torchtitan's
  block-causal mask is the causal one (:func:`test_attention_stand_in_equals_flex_forward`).

The SPMD backend is "partial_dtensor" (DTensors for the model-parallel axes, as in
test_torchtitan_ep.py): under torchtitan's default "spmd_types" its own unswapped model
fails in ``fully_shard`` ("When dp_mesh_dims is provided, all parameters must be DTensors
on the full SPMD mesh ... Got plain tensor for parameter 'weight'",
torchtitan/distributed/fsdp.py:195), and "full_dtensor" needs the trainer to hand the
model DTensor inputs.

References, never the code under test:
* torchtitan's own unswapped model, parallelized the same way (its router,
  AllToAllTokenDispatcher, GroupedExperts on the local shards in fp32, FSDP2);
* the single-process unswapped model on the global batch (no parallelism).
The models are built on the CPU by torchtitan's init with the same seed on every rank,
then parallelized (torchtitan's trainer builds on meta and initialises after
parallelize; the weights here are the same on every rank, so the sharding is exact).
Skipped where torchtitan does not import (requirements/torchtitan.txt).
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lrmoe.integrations.torchtitan import (LRMoETitanConfig, require_torchtitan, swap_moe,
                                           swapped_layers)

try:
    require_torchtitan()
    SKIP = None
except ModuleNotFoundError as exc:
    SKIP = str(exc)
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

FP32_TOL = 1e-5
EP = 2
SEQ = 16
VOCAB = 64  # test_torchtitan.qwen3_config's vocab_size
# AdamW's first step is lr * g / (|g| + eps): with torch's eps 1e-8 it is lr * sign(g)
# for the gradient entries near zero, which turns their ~1e-7 fp32 rounding (FSDP2's
# reduction order, the ranks' partial sums) into an O(lr) difference of the updated
# weight (measured 2e-5 of the largest weight with eps 1e-6). eps 1e-4 (about the median
# |g| of this model) bounds that amplification by lr / eps; the large gradients (router,
# attention, LM head) are still in Adam's sign regime.
ADAMW = dict(lr=1e-3, eps=1e-4, weight_decay=0.01)


def _point_torchtitan_at_cpu():
    """Make torchtitan's device type "cpu" (see the module docstring): in
    ``torchtitan.tools.utils`` and every loaded torchtitan module holding its names."""
    import torchtitan.distributed.parallel_dims  # noqa: F401  (import the holders first)
    import torchtitan.distributed.utils  # noqa: F401
    import torchtitan.models.common.token_dispatcher  # noqa: F401
    import torchtitan.tools.utils as utils
    old_type, old_module = utils.device_type, utils.device_module
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torchtitan") or mod is None:
            continue
        if getattr(mod, "device_type", None) is old_type and isinstance(old_type, str):
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is old_module:
            mod.device_module = torch.cpu


def _sdpa_attention(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, score_mod=None,
                    scale=None, enable_gqa=False, out_transform=None, **kwargs):
    """FlexAttention.forward as a causal SDPA (same argument names: torchtitan's local_map
    wrapper reads them); valid for one document a sequence (module docstring)."""
    del attention_masks, kwargs
    assert score_mod is None and out_transform is None
    out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2),
                                         v_BLNH.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


def _batch(world):
    """Global batch: tokens, labels, positions (world sequences of SEQ tokens); rank r
    owns sequence r."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (world, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (world, SEQ), generator=gen)
    return tokens, labels, torch.arange(SEQ).repeat(world, 1)


def _full(t):
    """The whole tensor of a DTensor (gathered), a plain tensor as is."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train_step(model, tokens, labels, positions, n_global):
    """Logits, loss (cross-entropy summed here / global token count, torchtitan's
    scaling: the ranks' losses and gradients sum to the global batch's), every
    parameter's whole gradient and whole weight after one AdamW step."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens, positions, model.get_attention_masks(positions))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                           reduction="sum") / n_global
    loss.backward()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    before = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    after = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads, before, after


def _parallel_dims(world):
    """torchtitan's ParallelDims for dp_shard = world, EP 2 (efsdp = world / 2: FSDP2 on
    the experts from 4 ranks), meshes built on the CPU."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=EP,
                        world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    set_spmd_backend("partial_dtensor")  # what the trainer does, this process only
    return dims


def _parallelized(dims, lrmoe_config=None, seed=0):
    """The test_torchtitan Qwen3 MoE with its EP sharding config (what
    ``Qwen3Model.Config.update_from_config`` sets), swapped if ``lrmoe_config``, then
    torchtitan's ``parallelize_qwen3`` (fp32 FSDP2, no compile, no AC)."""
    from test_torchtitan import qwen3_config, qwen3_model
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.qwen3 import parallelize_qwen3
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    cfg = qwen3_config()
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)
    model = qwen3_model(seed, cfg)
    if lrmoe_config is not None:
        swap_moe(model, lrmoe_config)  # before parallelize, as documented
    model = parallelize_qwen3(
        model, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32",
                                mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(expert_parallel_degree=EP,
                                      spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    for module in model.modules():  # gloo has no PREMUL_SUM (module docstring)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _setup_rank():
    """Per rank: CPU device type, torchtitan's experts in fp32, the attention stand-in."""
    _point_torchtitan_at_cpu()
    from test_torchtitan_ep import _fp32_grouped_experts
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.moe import GroupedExperts
    GroupedExperts.forward = _fp32_grouped_experts  # this process only
    FlexAttention.forward = _sdpa_attention


def _gather_rows(t, world):
    """This rank's (1, ...) tensor gathered into the global (world, ...) batch."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _close(got, want, what, errors, key):
    """Assert ``got`` within FP32_TOL of ``want`` (relative to its largest entry); keep the
    largest error per ``key`` in ``errors``."""
    from test_torchtitan import rel
    err = rel(got, want)
    errors[key] = max(errors.get(key, 0.0), err)
    assert got.shape == want.shape and err < FP32_TOL, f"{what}: rel err {err}"


# ------------------------------------------- c = 0: torchtitan's parallelize, two references
def _check_exact(rank, world):
    _setup_rank()
    dims = _parallel_dims(world)
    tokens, labels, positions = _batch(world)
    mine = slice(rank, rank + 1)
    n = labels.numel()
    ours_model = _parallelized(dims, LRMoETitanConfig(expert_dtype="input"))
    titan = _train_step(_parallelized(dims), tokens[mine], labels[mine], positions[mine], n)
    ours = _train_step(ours_model, tokens[mine], labels[mine], positions[mine], n)
    from test_torchtitan import qwen3_model
    one = _train_step(qwen3_model(0), tokens, labels, positions, n)

    # lrmoe ran its own EP over torchtitan's ep mesh, on torchtitan's sharded DTensors
    layers = swapped_layers(ours_model)
    assert len(layers) == 2
    ep_mesh = dims.get_mesh("ep")
    from torch.distributed.tensor import DTensor
    for _, routed in layers:
        assert routed.token_dispatcher.ep_mesh is ep_mesh
        assert routed.lrmoe_core.routes.world_size == EP
        w1 = routed.inner_experts.w1_EFD
        assert isinstance(w1, DTensor) and w1.device_mesh.mesh_dim_names == ("efsdp", "ep")

    errors = {}
    logits = (_gather_rows(ours[0], world), _gather_rows(titan[0], world))
    losses = [ours[1].clone(), titan[1].clone()]
    for t in losses:
        dist.all_reduce(t)
    names = set(one[2])
    assert set(ours[2]) == set(titan[2]) == names and len(names) == 23
    for ref, tag in ((titan, "torchtitan parallelized"), (one, "one process")):
        ref_logits = logits[1] if ref is titan else ref[0]
        ref_loss = losses[1] if ref is titan else ref[1]
        _close(logits[0], ref_logits, f"logits vs {tag}", errors, f"logits vs {tag}")
        _close(losses[0], ref_loss, f"loss vs {tag}", errors, f"loss vs {tag}")
        for name in names:
            _close(ours[2][name], ref[2][name], f"grad {name} vs {tag}", errors,
                   f"grads vs {tag}")
            _close(ours[4][name], ref[4][name], f"weight {name} after AdamW vs {tag}",
                   errors, f"AdamW weights vs {tag}")
    # the reference itself: torchtitan parallelized = torchtitan in one process
    for name in names:
        _close(titan[2][name], one[2][name], f"torchtitan's grad {name}", errors,
               "torchtitan parallelized vs one process")
    # the step moved every weight by far more than the tolerance (the comparison above is
    # not of unchanged weights)
    from test_torchtitan import rel
    moved = min(rel(ours[4][k], ours[3][k]) for k in names)
    assert moved > 10 * FP32_TOL, moved
    if rank == 0:
        print(f"\nsmallest step {moved:.1e}")
        print(f"\nworld {world}: max rel errors", {k: f"{v:.1e}" for k, v in errors.items()})


@pytest.mark.parametrize("world", [2, 4], ids=["dp_shard2-ep2", "dp_shard4-ep2-efsdp2"])
def test_torchtitan_parallelize_ep_fsdp_equals_torchtitan_and_one_process(world):
    from test_expert_parallel import _spawn  # tests/python/parallel
    _spawn(_check_exact, "gloo", world, timeout_s=120)


# ------------------------------------------------------ c > 0 under torchtitan's parallelize
def _check_positive_rate(rank, world, c):
    _setup_rank()
    dims = _parallel_dims(world)
    tokens, labels, positions = _batch(world)
    mine = slice(rank, rank + 1)
    runs = {}
    for rate in (0.0, c):
        model = _parallelized(dims, LRMoETitanConfig(expert_dtype="input",
                                                     recalibration_rate=rate,
                                                     selection="topk"))
        runs[rate] = _train_step(model, tokens[mine], labels[mine], positions[mine],
                                 labels.numel())
        kept = torch.tensor([float(r.diagnostics()["num_retained"])
                             for _, r in swapped_layers(model)])
        dist.all_reduce(kept)
        runs[rate] += (kept,)
    # LRMoE changes only the backward: the forward is c = 0's bit for bit
    assert torch.equal(runs[c][0], runs[0.0][0]) and torch.equal(runs[c][1], runs[0.0][1])
    # the planned backward ran: (1 - c) of the 2 * world * SEQ pairs of each layer kept,
    # the expert gradients are finite and not c = 0's
    pairs = 2 * world * SEQ
    assert runs[0.0][5].tolist() == [pairs, pairs]
    assert runs[c][5].tolist() == [int((1 - c) * pairs)] * 2
    expert = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
    assert all(torch.isfinite(g).all() for g in runs[c][2].values())
    assert not torch.allclose(runs[c][2][expert], runs[0.0][2][expert], rtol=1e-3, atol=0)


def test_torchtitan_parallelize_positive_rate_forward_equals_c0_and_backward_runs():
    from test_expert_parallel import _spawn
    _spawn(_check_positive_rate, "gloo", 2, 0.3, timeout_s=120)


# --------------------------------------------------------------- the attention stand-in
def test_attention_stand_in_equals_flex_forward(monkeypatch):
    from test_torchtitan import qwen3_model, rel
    from torchtitan.models.common.attention import FlexAttention
    model = qwen3_model()
    tokens, _, positions = _batch(2)
    with torch.no_grad():
        flex = model(tokens, positions, model.get_attention_masks(positions))
        monkeypatch.setattr(FlexAttention, "forward", _sdpa_attention)
        sdpa = model(tokens, positions, model.get_attention_masks(positions))
    assert rel(sdpa, flex) < FP32_TOL
