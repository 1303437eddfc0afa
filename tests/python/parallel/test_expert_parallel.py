"""Expert parallelism (lrmoe.parallel): gloo on CPU (W = 2, 4; in CI) and NCCL on GPUs
(W = 1, 2, 4, 8, as many as the machine has; one GPU per rank; skipped otherwise).

Each test spawns W processes on 127.0.0.1 (free port, 30 s collective timeout). Every rank
builds the EP layer and, from the same seed, the single-process layer (same weights: the
EP shard is a slice of the same initialisation), runs the full batch split over ranks and
compares. The c > 0 reference (retained set by global quota -> per-(source, expert) share
by largest remainder -> top scores) is written here in plain float64 PyTorch / Python
Fractions from docs/algorithm.md (sections 3 and 8), not from the code under test.
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from datetime import timedelta
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lrmoe.moe.config import LRMoEConfig
from lrmoe.layer import LRMoELayer


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DEVICE = torch.device("cpu")  # this rank's device (set by _worker)


def _worker(rank, world, port, backend, fn, args, timeout_s=600):
    global _DEVICE
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        _DEVICE = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    # A passing rank leaves without finalizing the interpreter: gloo's worker thread can
    # still be freeing a finished all-to-all (it holds tensors with Python objects) when
    # Py_Finalize runs; its GIL acquire then kills the thread inside a noexcept
    # destructor and the rank aborts (SIGABRT, "terminate called without an active
    # exception") after the test passed -- a torch teardown race, ~1 run in 15 here
    # and once in CI. A failing rank raises above and exits through spawn as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn, backend, world, *args, timeout_s=600):
    """Run ``fn(rank, world, *args)`` on W spawned ranks (collective timeout
    ``timeout_s``)."""
    mp.spawn(_worker, args=(world, _free_port(), backend, fn, args, timeout_s), nprocs=world,
             join=True)


def _backends(gloo_worlds, nccl_worlds=(1, 2, 4, 8)):
    """(backend, world) parameters: gloo always; NCCL where the machine has W GPUs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = dist.is_available() and dist.is_nccl_available()
    return ([pytest.param("gloo", w, id=f"gloo-W{w}") for w in gloo_worlds]
            + [pytest.param("nccl", w, id=f"nccl-W{w}", marks=[pytest.mark.gpu, pytest.mark.skipif(
                not nccl or gpus < w, reason=f"needs NCCL and {w} CUDA GPUs")])
               for w in nccl_worlds])


def _cfg(**kw):
    base = dict(hidden_size=8, moe_intermediate_size=6, num_experts=4, top_k=2,
                router_aux_loss_coef=0.0, selection="topk")  # references pick the best pairs
    base.update(kw)
    return LRMoEConfig(**base)


def _layers(cfg, seed=0):
    torch.manual_seed(seed)
    ep = LRMoELayer(cfg, ep_group=dist.group.WORLD).double().to(_DEVICE)
    torch.manual_seed(seed)
    ref = LRMoELayer(cfg.replace(recalibration_rate=0.0)).double().to(_DEVICE)
    return ep, ref


def _split(total, world, sizes=None):
    if sizes is None:
        sizes = [len(c) for c in torch.arange(total).tensor_split(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    return sizes, starts


# --------------------------------------------------------------- c = 0: equals one device
def _check_exact(rank, world, total, sizes, forced):
    cfg = _cfg(num_experts=2 * world)
    ep, ref = _layers(cfg, seed=3)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(total, 8, generator=gen, dtype=torch.float64).to(_DEVICE)
    w_out = torch.randn(total, 8, generator=gen, dtype=torch.float64).to(_DEVICE)
    ids = None
    if forced == "one_rank":   # every token to rank 0's experts
        ids = torch.stack([torch.zeros(total, dtype=torch.long),
                           torch.ones(total, dtype=torch.long)], 1)
    elif forced == "skip_expert":   # expert 1 (and every expert of the last rank but one) idle
        ids = torch.stack([torch.zeros(total, dtype=torch.long),
                           torch.full((total,), 2 * world - 1, dtype=torch.long)], 1)
    ids = None if ids is None else ids.to(_DEVICE)
    sizes, starts = _split(total, world, sizes)
    sl = slice(starts[rank], starts[rank] + sizes[rank])
    x_ref = x.clone().requires_grad_()
    o_ref = ref(x_ref, ids)
    (o_ref * w_out).sum().backward()
    x_ep = x[sl].clone().requires_grad_()
    o_ep = ep(x_ep, None if ids is None else ids[sl])
    (o_ep * w_out[sl]).sum().backward()
    torch.testing.assert_close(o_ep, o_ref[sl], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_ep.grad, x_ref.grad[sl], rtol=1e-10, atol=1e-12)
    g_gate = ep.gate.weight.grad.clone()
    dist.all_reduce(g_gate)
    torch.testing.assert_close(g_gate, ref.gate.weight.grad, rtol=1e-5, atol=1e-7)  # fp32 router
    el = cfg.num_experts // world
    es = slice(rank * el, (rank + 1) * el)
    torch.testing.assert_close(ep.experts.gate_up_proj.grad,
                               ref.experts.gate_up_proj.grad[es], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ep.experts.down_proj.grad, ref.experts.down_proj.grad[es],
                               rtol=1e-10, atol=1e-12)
    assert ep.experts.gate_up_proj.shape[0] == el


@pytest.mark.parametrize("backend,world", _backends([2, 4]))
def test_c0_matches_single_process(backend, world):
    _spawn(_check_exact, backend, world, 37, None, None)


@pytest.mark.parametrize("backend,world", _backends([2], (2,)))
def test_zero_token_rank_and_forced_routing(backend, world):
    _spawn(_check_zero_cases, backend, world)


def _check_zero_cases(rank, world):
    _check_exact(rank, world, 9, [9, 0], None)          # rank 1 owns no tokens
    _check_exact(rank, world, 11, None, "one_rank")     # rank 1's experts get nothing
    _check_exact(rank, world, 11, None, "skip_expert")  # experts 1, 2 idle everywhere
    # c > 0 with the same degenerate routings: runs, finite, no hang; the rank without
    # tokens reports a finite (zero) aux loss
    cfg = _cfg(num_experts=4, recalibration_rate=0.3, router_aux_loss_coef=0.01,
               router_z_loss_coef=0.001)
    ep, _ = _layers(cfg)
    for n_local, ids in ((0 if rank else 7, None),
                         (6, torch.zeros(6, 2, dtype=torch.long).add_(torch.tensor([0, 1])))):
        x = torch.randn(n_local, 8, dtype=torch.float64, device=_DEVICE, requires_grad=True)
        o = ep(x, None if ids is None else ids.to(_DEVICE))
        assert torch.isfinite(ep.aux_loss) and (n_local or float(ep.aux_loss.detach()) == 0)
        (o.square().sum() + ep.aux_loss).backward()
        assert torch.isfinite(x.grad).all()
        assert torch.isfinite(ep.experts.down_proj.grad).all()


# ----------------------------------------------------------- c > 0: independent reference
def _largest_remainder(ideal, total):
    """Round the rationals ``ideal`` to integers summing to ``total`` (largest remainder,
    ties to the lower index)."""
    base = [int(v) for v in ideal]
    order = sorted(range(len(ideal)), key=lambda i: (-(ideal[i] - base[i]), i))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


def _ref_expert_grads(x, w_out, weights, ids, wgu, wd, sizes, starts, c):
    """float64 plain-torch expert gradients and dx from the retained pairs."""
    T, K = ids.shape
    E, I = wgu.shape[0], wd.shape[2]
    world = len(sizes)
    src = torch.repeat_interleave(torch.arange(world), torch.tensor(sizes))
    a = torch.einsum("th,eih->tei", x, wgu[:, :I])
    b = torch.einsum("th,eih->tei", x, wgu[:, I:])
    phi = F.silu(a) * b                                   # (T, E, I) every (token, expert)
    pairs = [(t, k, int(ids[t, k])) for t in range(T) for k in range(K)]
    n = [[0] * E for _ in range(world)]
    for t, k, e in pairs:
        n[int(src[t])][e] += 1
    N = [sum(n[s][e] for s in range(world)) for e in range(E)]
    keep_frac = 1 - Fraction(c).limit_denominator(1 << 20)
    # global quota: (1 - c) N_e by largest remainder, sum floor((1 - c) sum N)
    Q = _largest_remainder([keep_frac * v for v in N], int(keep_frac * sum(N)))
    share = [[0] * E for _ in range(world)]
    for e in range(E):
        # source s's share: Q_e n[s][e] / N_e by largest remainder, ties to the lower rank
        col = (_largest_remainder([Fraction(Q[e] * n[s][e], N[e]) for s in range(world)], Q[e])
               if N[e] else [0] * world)
        for s in range(world):
            share[s][e] = col[s]
    kept = set()
    for s in range(world):
        for e in range(E):
            cand = [(t, k) for t, k, ee in pairs if ee == e and int(src[t]) == s]
            score = {(t, k): float(weights[t, k]) ** 2 * float(w_out[t].square().sum())
                     * float(phi[t, e].square().sum()) for t, k in cand}
            # local pair id order = (t - start) * K + k: same order as global (t, k)
            best = sorted(cand, key=lambda p: (-score[p], p))[: share[s][e]]
            kept.update(best)
    gwgu, gwd, dx = torch.zeros_like(wgu), torch.zeros_like(wd), torch.zeros_like(x)
    for t, k, e in pairs:
        if (t, k) not in kept:
            continue
        G = weights[t, k] * w_out[t]
        gwd[e] += torch.outer(G, phi[t, e])
        dphi = wd[e].t() @ G
        sa = torch.sigmoid(a[t, e])
        da = dphi * b[t, e] * sa * (1 + a[t, e] * (1 - sa))
        db = dphi * F.silu(a[t, e])
        gwgu[e, :I] += torch.outer(da, x[t])
        gwgu[e, I:] += torch.outer(db, x[t])
        dx[t] += wgu[e, :I].t() @ da + wgu[e, I:].t() @ db
    return gwgu, gwd, dx, len(kept)


def _check_selective(rank, world, c):
    cfg = _cfg(num_experts=2 * world, recalibration_rate=c)
    ep, ref = _layers(cfg, seed=5)
    total = 29
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(total, 8, generator=gen, dtype=torch.float64).to(_DEVICE)
    w_out = torch.randn(total, 8, generator=gen, dtype=torch.float64).to(_DEVICE)
    sizes, starts = _split(total, world)
    sl = slice(starts[rank], starts[rank] + sizes[rank])
    x_ref = x.clone().requires_grad_()
    (ref(x_ref) * w_out).sum().backward()          # exact: router gradient is c-independent
    x_ep = x[sl].clone().requires_grad_()
    (ep(x_ep) * w_out[sl]).sum().backward()
    g_gate = ep.gate.weight.grad.clone()
    dist.all_reduce(g_gate)
    torch.testing.assert_close(g_gate, ref.gate.weight.grad, rtol=1e-5, atol=1e-7)  # fp32 router

    with torch.no_grad():
        routing = ref.gate(x)
    gwgu, gwd, dx_expert, n_kept = (t.to(_DEVICE) if torch.is_tensor(t) else t for t in
                                    _ref_expert_grads(
        x.cpu(), w_out.cpu(), routing.weights_TK.double().cpu(), routing.expert_ids_TK.cpu(),
        ref.experts.gate_up_proj.detach().cpu(), ref.experts.down_proj.detach().cpu(), sizes,
        starts, c))
    el = cfg.num_experts // world
    es = slice(rank * el, (rank + 1) * el)
    # alpha comes from the fp32 router, whose GEMM may round differently for the local
    # (T/W rows) and the full batch; a wrongly kept or dropped pair moves a gradient by
    # a whole pair's contribution, far above this tolerance
    for got, want in ((ep.experts.gate_up_proj.grad, gwgu[es]),
                      (ep.experts.down_proj.grad, gwd[es])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    # dx = expert part from the kept pairs + router part (exact, c-independent)
    x_r = x.clone().requires_grad_()
    routing_r = ref.gate(x_r)
    with torch.no_grad():
        y = torch.stack([ref.experts.down_proj[e] @ (
            F.silu(ref.experts.gate_up_proj[e, :6] @ x[t]) * (ref.experts.gate_up_proj[e, 6:] @ x[t]))
            for t in range(total) for e in routing.expert_ids_TK[t].tolist()]).view(total, 2, 8)
    dalpha = torch.einsum("tkh,th->tk", y, w_out)
    (dx_router,) = torch.autograd.grad(routing_r.weights_TK, x_r, grad_outputs=dalpha.float())
    torch.testing.assert_close(x_ep.grad, (dx_expert + dx_router)[sl], rtol=1e-5, atol=1e-7)
    kept = torch.tensor([ep.stats.num_retained], device=_DEVICE)
    dist.all_reduce(kept)
    assert int(kept) == n_kept == int((1 - Fraction(c)) * total * cfg.top_k)


@pytest.mark.parametrize("backend,world", _backends([2, 4]))
def test_selective_matches_per_source_quota_reference(backend, world):
    _spawn(_check_selective, backend, world, 0.3 if world <= 2 else 0.25)


# --------------------------------------------------------------------- all-to-all bytes
def _check_bytes(rank, world):
    totals = {}
    for c in (0.0, 0.3):
        cfg = _cfg(num_experts=2 * world, recalibration_rate=c)
        ep, _ = _layers(cfg, seed=1)
        torch.manual_seed(100 + rank)
        x = torch.randn(40, 8, dtype=torch.float64, device=_DEVICE, requires_grad=True)
        ep(x).square().sum().backward()
        b = ep.diagnostics()["a2a_bytes"]
        t = torch.tensor([b["backward_grad"] + b["backward_dx"], b["backward_index"],
                          b["forward_dispatch"]], dtype=torch.float64, device=_DEVICE)
        dist.all_reduce(t)
        totals[c] = t
    assert totals[0.3][2] == totals[0.0][2]                       # forward unchanged
    assert totals[0.3][0] <= 0.7 * totals[0.0][0]                 # payload rows
    assert totals[0.3][0] + totals[0.3][1] <= 0.7 * (totals[0.0][0] + totals[0.0][1]) + 8


@pytest.mark.parametrize("backend,world", _backends([2], (1, 2)))
def test_backward_bytes_shrink_with_c(backend, world):
    _spawn(_check_bytes, backend, world)


# ------------------------------------------------------------------- host syncs (NCCL)
def host_syncs_of_step(layer, x_TH):
    """The host-sync warnings of one forward and of one backward of ``layer`` on
    ``x_TH`` (CUDA, ``torch.cuda.set_sync_debug_mode("warn")``): two lists of messages."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as fwd:
            warnings.simplefilter("always")
            loss = layer(x_TH).float().square().sum()
        with warnings.catch_warnings(record=True) as bwd:
            warnings.simplefilter("always")
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return tuple([str(w.message) for w in caught if "synchroniz" in str(w.message)]
                 for caught in (fwd, bwd))


def _check_host_syncs(rank, world):
    # bf16: the fused grouped GEMM reads device offsets (the float64 fallback loops over
    # experts with host offsets, a sync per GEMM by design)
    cfg = _cfg(hidden_size=64, moe_intermediate_size=32, num_experts=4 * world, top_k=4,
               recalibration_rate=0.25)
    torch.manual_seed(0)
    ep = LRMoELayer(cfg, ep_group=dist.group.WORLD).to(_DEVICE, torch.bfloat16)
    x = torch.randn(256, 64, dtype=torch.bfloat16, device=_DEVICE, requires_grad=True)
    ep(x).float().square().sum().backward()  # warm-up: NCCL communicators, allocator
    torch.cuda.synchronize()
    fwd, bwd = host_syncs_of_step(ep, x)
    # the split sizes of the dispatch all-to-all are the forward's one host sync; the
    # backward's quotas and shares come from those counts, computed on the host
    assert len(fwd) == 1, fwd
    assert bwd == [], bwd


@pytest.mark.parametrize("backend,world", _backends([], (1, 2)))
def test_one_host_sync_per_forward_none_in_backward(backend, world):
    _spawn(_check_host_syncs, backend, world)


# ---------------------------------------------------------------------- config mismatch
def _check_mismatch(rank, world):
    cfg = _cfg(moe_intermediate_size=6 if rank == 0 else 10)
    with pytest.raises(ValueError, match="disagree.*ranks \\[1\\]"):
        LRMoELayer(cfg, ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="num_experts=5 is not divisible by the "
                                         "expert-parallel size 2"):
        LRMoELayer(_cfg(num_experts=5, top_k=2), ep_group=dist.group.WORLD)
    # drift after construction (set_recalibration on one rank) fails at the next forward
    layer = LRMoELayer(_cfg(), ep_group=dist.group.WORLD).double().to(_DEVICE)
    if rank == 1:
        layer.set_recalibration(recalibration_rate=0.2)
    with pytest.raises(ValueError, match="disagree"):
        layer(torch.randn(5, 8, dtype=torch.float64, device=_DEVICE))
    # compute dtypes that differ across ranks: a ValueError on every rank, not an abort
    torch.manual_seed(0)
    dt = torch.float32 if rank == 0 else torch.float64
    layer = LRMoELayer(_cfg(), ep_group=dist.group.WORLD).to(_DEVICE, dt)
    with pytest.raises(ValueError, match="compute dtype.*dtype=" + str(dt)):
        layer(torch.randn(6, 8, dtype=dt, device=_DEVICE))
    # a bad input on ONE rank fails every rank at once (no collective timeout)
    layer = LRMoELayer(_cfg(), ep_group=dist.group.WORLD).double().to(_DEVICE)
    ids = torch.tensor([[0, 1]] * (6 if rank == 0 else 5), device=_DEVICE)
    want = ("expert_ids must be \\(T, top_k\\) = \\(6, 2\\)" if rank == 1
            else "ranks \\[1\\] failed")
    with pytest.raises((ValueError, RuntimeError), match=want):
        layer(torch.randn(6, 8, dtype=torch.float64, device=_DEVICE), ids)
    if _DEVICE.type == "cpu":  # on CUDA these are device-side assertions
        x = torch.randn(6, 8, dtype=torch.float64)
        ids = torch.tensor([[0, 1]] * 6)
        if rank == 0:
            x[0, 0] = float("nan")
        else:
            ids[0, 0] = 7
        with pytest.raises((ValueError, RuntimeError, IndexError)):
            layer(x, ids if rank == 1 else None)
    layer(torch.randn(6, 8, dtype=torch.float64, device=_DEVICE)).sum().backward()  # usable


@pytest.mark.parametrize("backend,world", _backends([2], (2,)))
def test_mismatched_config_fails_fast(backend, world):
    _spawn(_check_mismatch, backend, world)


# ------------------------------------- a patched transformers model: failure on one rank
def _check_patched_failure(rank, world):
    """What ``lrmoe train --ep`` runs: a patched model whose rank 1 fails in the MoE
    layer's input checks (before the counts exchange). Every rank must raise at once,
    not wait for the collective timeout."""
    import time

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lrmoe.integrations.transformers import patch_moe_blocks
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, intermediate_size=32, moe_intermediate_size=8,
        num_experts=4, num_experts_per_tok=2)).double()
    ((_, layer),) = patch_moe_blocks(model, ep_group=dist.group.WORLD)
    others = "ranks \\[1\\] failed before the dispatch"
    x = torch.randn(5, 16 if rank == 0 else 15, dtype=torch.float64)  # rank 1: bad width
    start = time.monotonic()
    with pytest.raises((ValueError, RuntimeError),
                       match="last dimension" if rank == 1 else others):
        layer(x)
    # through the whole model: non-finite activations on rank 1 (router logits check)
    embeds = torch.randn(1, 6, 16, dtype=torch.float64)
    if rank == 1:
        embeds[0, 2, 3] = float("nan")
    with pytest.raises((ValueError, RuntimeError),
                       match="NaN or inf" if rank == 1 else others):
        model(inputs_embeds=embeds)
    # the collective timeout is 300 s (below): a rank that waited for it would take that
    # long; half of it is far above what two tiny forwards take on a loaded machine
    assert time.monotonic() - start < 150, "a rank waited for the collective timeout"
    ids = torch.randint(0, 50, (1, 6))
    model(input_ids=ids, labels=ids).loss.backward()  # still usable on every rank


def test_patched_transformers_model_fails_on_every_rank_at_once():
    _spawn(_check_patched_failure, "gloo", 2, timeout_s=300)


# ------------------------------------------- data-parallel grads, global clip, checkpoints
def _check_dp_helpers(rank, world, path):
    from lrmoe.parallel import DataParallel, clip_grad_norm_, is_expert_param
    from lrmoe.parallel.group import init_dp_ep_mesh
    from lrmoe.parallel.state import checkpoint_mesh, load_whole, save_sharded_state
    cfg = _cfg(num_experts=4, shared_expert_intermediate_size=5)
    ep, ref = _layers(cfg, seed=9)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(13, 8, generator=gen, dtype=torch.float64).to(_DEVICE)
    w_out = torch.randn(13, 8, generator=gen, dtype=torch.float64).to(_DEVICE)
    sizes, starts = _split(13, world)
    sl = slice(starts[rank], starts[rank] + sizes[rank])
    (ref(x) * w_out).sum().backward()
    dp = DataParallel(ep, dist.group.WORLD, bucket_cap_mb=256 / 2**20)  # several buckets
    (dp.module(x[sl]) * w_out[sl]).sum().backward()
    dp.finish()
    el = cfg.num_experts // world
    for (name, p), (_, q) in zip(ep.named_parameters(), ref.named_parameters()):
        # loss = mean of the ranks' losses: every gradient is the full-batch one / W
        want = q.grad[rank * el:(rank + 1) * el] if is_expert_param(p) else q.grad
        torch.testing.assert_close(p.grad * world, want, rtol=1e-5, atol=1e-7, msg=name)
    expect_sq = sum(float(q.grad.double().square().sum()) / world ** 2
                    for q in ref.parameters())
    before = [p.grad.clone() for p in ep.parameters()]
    norm = clip_grad_norm_(ep, max_norm=0.5 * expect_sq ** 0.5)
    assert abs(float(norm) - expect_sq ** 0.5) <= 1e-5 * expect_sq ** 0.5
    for b, p in zip(before, ep.parameters()):
        torch.testing.assert_close(p.grad, b * 0.5, rtol=1e-5, atol=1e-12)
    # the sharded state, written by the W ranks, read back whole by one process (another
    # EP size): the single-device layer's weights
    save_sharded_state(path, ep, None, checkpoint_mesh(init_dp_ep_mesh(1, world)),
                       dist.group.WORLD)
    torch.manual_seed(123)
    whole = LRMoELayer(cfg.replace(recalibration_rate=0.0)).double()
    load_whole(path, whole.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(whole.state_dict()[k], v.cpu()), k


@pytest.mark.parametrize("backend,world", _backends([2], (1, 2)))
def test_data_parallel_grads_global_clip_and_checkpoint(backend, world, tmp_path):
    _spawn(_check_dp_helpers, backend, world, str(tmp_path / "state"))


# ------------------------------------------------------------- lrmoe train --ep 2 (torchrun)
def _torchrun(args, cwd, nproc=2, timeout=600, subcommand=("train",), wait=True):
    """``torchrun --nproc-per-node nproc -m lrmoe SUBCOMMAND ARGS`` on loopback gloo
    (nproc=0: plain ``python -m lrmoe``, no torchrun); ``wait=False``: the Popen."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                 str(nproc), "--master-addr", "127.0.0.1", "--master-port",
                 str(_free_port())] if nproc else [sys.executable])
    cmd = launcher + ["-m", "lrmoe", *subcommand, *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _train_records(run, *keys):
    """(key values) of each train line of a run's metrics.jsonl."""
    import json
    return [tuple(x[k] for k in keys) for x in map(
        json.loads, (run / "metrics.jsonl").read_text().splitlines()) if x["kind"] == "train"]


def test_lrmoe_train_ep2_resume_and_ep_size_check(tmp_path):
    from test_train import micro
    from lrmoe.training import train as T

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(T.config_yaml(micro(tmp_path, steps=4, eval_every=0, save_every=2)))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = _torchrun(["--config", str(cfg_file), "--ep", "2", "--out", str(straight)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # every rank resumes its own shard of step 2 and trains steps 3, 4 again
    r = _torchrun(["--resume", str(straight / "checkpoints" / "step-00000002"), "--out",
                   str(resumed)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]

    def losses(run):
        return _train_records(run, "step", "loss", "grad_norm")
    a, b = losses(straight), losses(resumed)
    assert [s for s, _, _ in a] == [1, 2, 3, 4] and a == b, (a, b)
    # each ep rank wrote its own expert rows, once: two chunks of E / 2 = 2 experts
    assert _chunks(straight / "checkpoints" / "step-00000004",
                   "model.model.layers.0.mlp.experts.down_proj") == [0, 2]
    # another EP size resumes only with the same global batch (ep x dp x grad_accum):
    # refused with the setting that keeps it
    r = _torchrun(["--out", str(resumed), "--resume", "--steps", "6", "--ep", "1"], tmp_path,
                  nproc=0)
    assert r.returncode != 0 and "global batch" in r.stderr and \
        "--set data.grad_accum=2" in r.stderr, r.stderr[-2000:]
    # with it, one process resumes the EP = 2 checkpoint: every expert read back whole
    # (test_dp_ep.py compares such a resume with the straight run on equal-token data)
    one = tmp_path / "one"
    r = _torchrun(["--resume", str(straight / "checkpoints" / "step-00000002"), "--out",
                   str(one), "--ep", "1", "--set", "data.grad_accum=2"], tmp_path, nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(one)
    assert [s for s, _, _ in got] == [1, 2, 3, 4] and got[:2] == a[:2]


def _chunks(ckpt, key):
    """The first-dim offsets of the chunks DCP stored for ``key`` (each written once)."""
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(str(ckpt / "state")).read_metadata()
    return sorted(int(c.offsets[0]) for c in meta.state_dict_metadata[key].chunks)


def test_torchrun_ep1_runs_expert_parallel_with_ordinary_checkpoints(tmp_path):
    """torchrun with one process runs the EP layer over a group of one; its checkpoint
    resumes without torchrun; a world size other than --ep is refused."""
    from test_train import micro
    from lrmoe.training import train as T

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(T.config_yaml(micro(tmp_path, steps=4, eval_every=0, save_every=2)))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = _torchrun(["--config", str(cfg_file), "--ep", "1", "--out", str(straight)], tmp_path,
                  nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = straight / "checkpoints" / "step-00000002"
    assert _chunks(ckpt, "model.model.layers.0.mlp.experts.down_proj") == [0]
    assert not (straight / "ep-rank-1").exists()
    r = _torchrun(["--resume", str(ckpt), "--out", str(resumed)], tmp_path, nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]

    def losses(run):
        return _train_records(run, "step", "loss")
    a, b = losses(straight), losses(resumed)
    assert [s for s, _ in a] == [1, 2, 3, 4]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    r = _torchrun(["--config", str(cfg_file), "--out", str(tmp_path / "two")], tmp_path)
    assert r.returncode != 0 and "launch with torchrun --nproc-per-node 1" in r.stderr, \
        r.stderr[-2000:]
    # an EP run into a folder holding a run is refused by every rank before any write
    r = _torchrun(["--config", str(cfg_file), "--ep", "2", "--out", str(straight)], tmp_path)
    assert r.returncode != 0 and "already holds a run" in r.stderr, r.stderr[:3000]
    assert not (straight / "ep-rank-1").exists()
    # --resume CKPT with --config continues the checkpoint's run, not the config's out_dir
    r = _torchrun(["--config", str(cfg_file), "--resume", str(ckpt), "--steps", "5"],
                  tmp_path, nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s for s, _ in losses(straight)] == [1, 2, 3, 4, 5]
    assert not (tmp_path / "run").exists()


def test_ctrl_c_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGINT to rank 1 only: both ranks finish the same step, save matching shards and
    exit with the interrupted code; the run resumes from them."""
    import signal
    import subprocess
    import time
    from pathlib import Path
    from test_train import micro
    from lrmoe.training import train as T
    from lrmoe.cli import EXIT_INTERRUPTED

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(T.config_yaml(micro(tmp_path, steps=100000, eval_every=0,
                                            save_every=0, log_every=1)))
    run = tmp_path / "run"
    proc = _torchrun(["--config", str(cfg_file), "--ep", "2", "--out", str(run)], tmp_path,
                     wait=False)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (
            metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 3):
        time.sleep(0.2)
    rank1 = [pid for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], text=True,
                                           capture_output=True).stdout.split()
             if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]
    assert len(rank1) == 1, rank1
    os.kill(int(rank1[0]), signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_INTERRUPTED or "interrupted" in err, err[-3000:]
    steps0 = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert len(steps0) == 1 and all((run / "checkpoints" / steps0[0] / "ranks" / f).is_file()
                                    for f in ("rank-0.pt", "rank-1.pt")), steps0
    r = _torchrun(["--resume", str(run / "checkpoints" / steps0[0]), "--steps",
                   str(int(steps0[0].split("-")[1]) + 2), "--out", str(tmp_path / "more")],
                  tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("stop", ["sigterm_to_torchrun", "second_ctrl_c_to_torchrun",
                                  "torchrun_killed"])
def test_a_stopped_torchrun_job_leaves_a_checkpoint_that_resumes_bitwise(tmp_path, stop):
    """Issue 26: torchrun passes a Ctrl-C on to its workers and escalates a second one to
    SIGTERM, which killed them without their checkpoint; a scheduler's SIGTERM did the
    same, and a kill -9 of torchrun left them training. Now each ends with one checkpoint
    of the same step on both ranks, and resuming from it gives the straight run's losses
    bit for bit (the schedule is fixed by optim.lr_decay_steps, not by the step count)."""
    import signal
    import subprocess
    import time
    from pathlib import Path
    from test_train import micro, without_timing
    from lrmoe.training import train as T

    def config(name, steps):
        path = tmp_path / f"{name}.yaml"
        path.write_text(T.config_yaml(micro(tmp_path, steps=steps, eval_every=0, save_every=0,
                                            log_every=1, lr_decay_steps=1000)))
        return path

    run = tmp_path / "run"
    proc = _torchrun(["--config", str(config("long", 100000)), "--ep", "2", "--out", str(run)],
                     tmp_path, wait=False)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not (
            metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 3):
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], text=True,
                             capture_output=True).stdout.split()
    assert len(workers) == 2, workers
    if stop == "sigterm_to_torchrun":
        os.kill(proc.pid, signal.SIGTERM)
    elif stop == "second_ctrl_c_to_torchrun":
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1.5)  # past the trainer's repeat window: a second Ctrl-C, not the same
        os.kill(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGKILL)  # the workers' parent-death signal is SIGTERM
    _, err = proc.communicate(timeout=180)
    for pid in workers:  # after a kill -9 of torchrun they end on their own
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline + 180:
            time.sleep(0.2)
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} still runs"
    steps0 = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert len(steps0) == 1 and (run / "checkpoints" / steps0[0] / "ranks" /
                                 "rank-1.pt").is_file(), (steps0, err[-3000:])
    n = int(steps0[0].split("-")[1]) + 2
    r = _torchrun(["--resume", str(run), "--steps", str(n)], tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    straight = tmp_path / "straight"
    r = _torchrun(["--config", str(config("short", n)), "--ep", "2", "--out", str(straight)],
                  tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = (without_timing(T.read_metrics(d / "metrics.jsonl")) for d in (run, straight))
    assert [x["step"] for x in got if x["kind"] == "train"] == list(range(1, n + 1))
    assert got == want


def _adaptive_rate_refused(rank, world):
    group = dist.group.WORLD
    with pytest.raises(ValueError, match="adaptive rate"):
        LRMoELayer(_cfg(recalibration_rate=0.5, retained_mass_target=0.9), ep_group=group)
    layer = LRMoELayer(_cfg(recalibration_rate=0.5), ep_group=group)
    layer.set_recalibration(retained_mass_target=0.9)  # turned on after construction
    with pytest.raises(ValueError, match="adaptive rate"):
        layer(torch.randn(4, 8))


def test_adaptive_rate_is_refused_under_ep():
    _spawn(_adaptive_rate_refused, "gloo", 2)
