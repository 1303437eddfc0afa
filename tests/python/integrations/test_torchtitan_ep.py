"""lrmoe.integrations.torchtitan under expert parallelism: 2 gloo ranks on the CPU.

The EP layout is torchtitan's, built by hand, on one MoE module (the DeepSeek-V3-style
router and shared experts, which the whole Qwen3 model of test_torchtitan_parallelize.py,
parallelized by torchtitan's own ``parallelize_qwen3``, does not have). Each rank does
what ``RoutedExperts.parallelize`` (torchtitan's models/common/moe.py) does for EP: the three
``GroupedExperts`` weights become ``distribute_tensor(w, ep_mesh, [Shard(0)])`` parameters
of a 1-D ``DeviceMesh("cpu", ..., mesh_dim_names=("ep",))`` and
``token_dispatcher.wire_meshes(ep_mesh=...)`` wires torchtitan's
``AllToAllTokenDispatcher``; the SPMD backend is "partial_dtensor" (its dispatcher then
takes the group from ``ep_mesh``, as under the DTensor backends of torchtitan's config).

References, never the code under test:
* torchtitan's own EP MoE (its router, AllToAllTokenDispatcher, GroupedExperts on the
  local shards, shared experts), with its expert forward in fp32 (its code without the
  three ``.bfloat16()`` casts: bf16 grouped GEMMs are not what is compared here);
* the single-process unswapped torchtitan MoE on the global batch (sum of the ranks'
  router / shared gradients, the slice of the expert gradients);
* at c > 0, the float64 plain-PyTorch kept-pair reference of tests/python/parallel
  (``_ref_expert_grads``: global quota, per-source share, top scores).
Skipped where torchtitan does not import (requirements/torchtitan.txt).
"""
from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from lrmoe.integrations.torchtitan import LRMoETitanConfig, require_torchtitan, swap_moe

try:
    require_torchtitan()
    SKIP = None
except ModuleNotFoundError as exc:
    SKIP = str(exc)
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

WORLD = 2
FP32_TOL = 1e-5
WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def _fp32_grouped_experts(experts, x_RD, num_tokens_per_expert_E):
    """torchtitan 0.3.0's GroupedExperts.forward (local shards under EP, as it does)
    without its .bfloat16() casts."""
    from torch.distributed.tensor import DTensor
    w1, w2, w3 = (getattr(experts, n) for n in WEIGHTS)
    if isinstance(w1, DTensor):
        w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    mm = experts._grouped_mm
    h_RF = torch.nn.functional.silu(mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offsets_E))
    h_RF = h_RF * mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offsets_E)
    return mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offsets_E)


def _ep_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    set_spmd_backend("partial_dtensor")  # this process only
    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))


def _shard(moe, mesh):
    """torchtitan's EP layout by hand (see the module docstring)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    experts = moe.routed_experts.inner_experts
    for name in WEIGHTS:
        w = getattr(experts, name)
        experts.register_parameter(name, torch.nn.Parameter(
            distribute_tensor(w.detach(), mesh, [Shard(0)])))
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe


def _inputs(dtype=torch.float32):
    """Global batch (4, 8, D) and upstream gradient; rank r owns sequences 2r, 2r + 1."""
    from test_torchtitan import DIM
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * WORLD, 8, DIM, generator=gen).to(dtype)
    g = torch.randn(2 * WORLD, 8, DIM, generator=gen).to(dtype)
    return x, g


def _run(moe, x, g):
    """Output, dx and every parameter's gradient (DTensor gradients as local shards)."""
    from torch.distributed.tensor import DTensor
    x = x.clone().requires_grad_(True)
    moe.zero_grad(set_to_none=True)
    out = moe(x)
    out.backward(g)
    grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in moe.named_parameters()}
    return out.detach(), x.grad.clone(), grads


def _close(got, want, what):
    from test_torchtitan import rel
    err = rel(got, want)
    assert got.shape == want.shape and err < FP32_TOL, f"{what}: rel err {err}"


# ------------------------------------------------------- c = 0: torchtitan's own EP MoE
def _check_exact(rank, world):
    from test_torchtitan import Holder, deepseek_moe
    from torchtitan.models.common.moe import GroupedExperts
    GroupedExperts.forward = _fp32_grouped_experts  # own process
    mesh = _ep_mesh()
    single = deepseek_moe()  # same seed on every rank: the same initial weights
    titan_ep = _shard(copy.deepcopy(single), mesh)
    ours = copy.deepcopy(single)
    swap_moe(Holder(ours), LRMoETitanConfig(expert_dtype="input"))
    _shard(ours, mesh)
    x, g = _inputs()
    mine = slice(2 * rank, 2 * rank + 2)
    want_ep = _run(titan_ep, x[mine], g[mine])
    got = _run(ours, x[mine], g[mine])
    want_one = _run(single, x, g)
    # the parameters are torchtitan's DTensors, sharded over the 2 ranks
    assert type(ours.routed_experts.inner_experts.w1_EFD).__name__ == "DTensor"
    routes = ours.routed_experts.lrmoe_core.routes
    assert routes.world_size == world
    assert set(got[2]) == set(want_ep[2]) and len(got[2]) == 7  # gate, w1-3, shared w1-3
    _close(got[0], want_ep[0], "out vs torchtitan EP")
    _close(got[1], want_ep[1], "dx vs torchtitan EP")
    for name in want_ep[2]:
        _close(got[2][name], want_ep[2][name], f"{name} vs torchtitan EP")
    _close(got[0], want_one[0][mine], "out vs one process")
    _close(got[1], want_one[1][mine], "dx vs one process")
    el = 8 // world
    for name in want_one[2]:
        if name.split(".")[-1] in WEIGHTS and "routed_experts" in name:
            want = want_one[2][name][rank * el:(rank + 1) * el]
        else:  # replicated: the ranks' sum is the global batch's
            dist.all_reduce(got[2][name])
            want = want_one[2][name]
        _close(got[2][name], want, f"{name} vs one process")
    # the dispatcher's counters stay torchtitan's: MoE.forward counts local routing
    torch.testing.assert_close(ours.tokens_per_expert_E, titan_ep.tokens_per_expert_E,
                               rtol=0, atol=0)
    with torch.no_grad():  # made once, at the first forward (one config check)
        ours(x[mine])
    assert ours.routed_experts.lrmoe_core.routes is routes
    _check_refusals(mesh)


def _check_refusals(mesh):
    """What is not mapped: refused before any collective, on every rank alike."""
    from test_torchtitan import Holder, deepseek_moe
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torchtitan.models.common.config_utils import (make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)
    from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher
    x = torch.randn(1, 4, 32)

    def swapped():
        moe = deepseek_moe()
        swap_moe(Holder(moe), LRMoETitanConfig(expert_dtype="input"))
        return moe

    # tensor parallelism on the experts: another placement, a 2-D mesh
    moe = _shard(swapped(), mesh)
    experts = moe.routed_experts.inner_experts
    experts.w2_EDF = torch.nn.Parameter(distribute_tensor(experts.w2_EDF.full_tensor().detach(),
                                                          mesh, [Shard(1)]))
    with pytest.raises(NotImplementedError, match=r"w2_EDF.*Shard\(0\)"):
        moe(x)
    moe = swapped()
    mesh2 = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "ep"))
    experts = moe.routed_experts.inner_experts
    experts.w1_EFD = torch.nn.Parameter(distribute_tensor(experts.w1_EFD.detach(), mesh2,
                                                          [Replicate(), Shard(0)]))
    with pytest.raises(NotImplementedError, match="2-D mesh"):
        moe(x)
    # sharded weights but no EP mesh wired on the dispatcher
    moe = _shard(swapped(), mesh)
    moe.routed_experts.token_dispatcher.ep_mesh = None
    with pytest.raises(NotImplementedError, match="wire_meshes"):
        moe(x)
    # another EP dispatcher (DeepEP, HybridEP, ... stand-in)

    class OtherEP(BaseEPTokenDispatcher):
        def dispatch(self, *a):
            raise AssertionError("not called")

        def combine(self, *a):
            raise AssertionError("not called")

    moe = _shard(swapped(), mesh)
    other = OtherEP(BaseEPTokenDispatcher.Config(num_experts=8, top_k=2))
    other.wire_meshes(ep_mesh=mesh)
    moe.routed_experts.token_dispatcher = other
    with pytest.raises(NotImplementedError, match="AllToAllTokenDispatcher"):
        moe(x)
    # E not divisible by W: 3 experts on 2 ranks
    init = {"weight": lambda w: torch.nn.init.normal_(w, std=0.1)}
    cfg = make_moe_config(
        num_experts=3,
        router=make_router_config(dim=32, num_experts=3, gate_param_init=init, top_k=1),
        routed_experts=make_routed_experts_config(
            dim=32, hidden_dim=8, num_experts=3, top_k=1,
            param_init={n: init["weight"] for n in WEIGHTS}, comm_backend="standard"))
    moe = cfg.build()
    moe.init_states()
    swap_moe(Holder(moe), LRMoETitanConfig(expert_dtype="input"))
    _shard(moe, mesh)
    with pytest.raises(NotImplementedError, match="num_experts=3 is not divisible"):
        moe(x)


def test_ep2_equals_torchtitan_ep_and_one_process():
    from test_expert_parallel import _spawn  # tests/python/parallel
    _spawn(_check_exact, "gloo", WORLD, timeout_s=120)


# --------------------------------------------- c > 0: kept rows only, kept-pair gradients
def _check_selective(rank, world, c):
    from test_expert_parallel import _ref_expert_grads
    from test_torchtitan import Holder, deepseek_moe
    mesh = _ep_mesh()
    totals = {}
    for rate in (0.0, c):
        moe = deepseek_moe(seed=3).double()
        ref = copy.deepcopy(moe)  # unswapped, whole: the routing of the global batch
        swap_moe(Holder(moe), LRMoETitanConfig(expert_dtype="input", recalibration_rate=rate,
                                               selection="topk", metric="lrm"))
        _shard(moe, mesh)
        x, g = _inputs(torch.float64)
        mine = slice(2 * rank, 2 * rank + 2)
        _, _, grads = _run(moe, x[mine], g[mine])
        stats = moe.routed_experts.diagnostics()
        b = stats["a2a_bytes"]
        t = torch.tensor([b["forward_dispatch"], b["backward_grad"], stats["num_retained"]],
                         dtype=torch.float64)
        dist.all_reduce(t)
        totals[rate] = t
    # the backward sends only the kept rows: (1 - c) of the forward's, every pair at c = 0
    assert totals[c][0] == totals[0.0][0] and totals[0.0][1] == totals[0.0][0]
    assert totals[c][1] <= (1 - c) * totals[c][0] < totals[0.0][1]
    # the kept pairs' expert gradients: float64 plain-PyTorch reference
    with torch.no_grad():
        weights_BLK, ids_BLK, _ = ref.router(x, ref.expert_bias_E)
    dim = x.shape[-1]
    e = ref.routed_experts.inner_experts
    tokens = x.reshape(-1, dim)
    sizes = [tokens.shape[0] // world] * world
    starts = [r * sizes[0] for r in range(world)]
    gwgu, gwd, _, n_kept = _ref_expert_grads(
        tokens, g.reshape(-1, dim), weights_BLK.reshape(tokens.shape[0], -1).double(),
        ids_BLK.reshape(tokens.shape[0], -1), torch.cat([e.w1_EFD, e.w3_EFD], 1).detach(),
        e.w2_EDF.detach(), sizes, starts, c)
    assert int(totals[c][2]) == n_kept == int((1 - Fraction(c)) * ids_BLK.numel())
    el, inter = e.w1_EFD.shape[0] // world, e.w1_EFD.shape[1]
    es = slice(rank * el, (rank + 1) * el)
    prefix = "routed_experts.inner_experts."
    for got, want in ((grads[prefix + "w1_EFD"], gwgu[es, :inter]),
                      (grads[prefix + "w3_EFD"], gwgu[es, inter:]),
                      (grads[prefix + "w2_EDF"], gwd[es])):
        # the router runs in fp32 (torchtitan's autocast): alpha may round differently
        # for 2 and 4 sequences; a wrongly kept or dropped pair moves far more than this
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_ep2_positive_rate_sends_kept_rows_and_matches_kept_pair_reference():
    from test_expert_parallel import _spawn
    _spawn(_check_selective, "gloo", WORLD, 0.3, timeout_s=120)


def test_swap_after_parallelize_is_refused():
    from test_torchtitan import Holder, deepseek_moe
    moe = deepseek_moe()
    moe.routed_experts._parallelized = True  # what torchtitan's Module.parallelize sets
    with pytest.raises(ValueError, match="before torchtitan's parallelize"):
        swap_moe(Holder(moe), LRMoETitanConfig())
