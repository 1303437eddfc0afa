"""A patched transformers model (``patch_moe_blocks``, no expert parallelism) in the user's
own training loop: torch DDP and FSDP2 (``fully_shard``) at 2 ranks on the CPU (gloo), and
``torch.compile``.

The reference of every equality is the *unpatched* transformers model (its own experts),
trained in one process on the whole global batch: at c = 0 a patched model computes the
same loss and gradients (up to the fp32 summation order), DDP / FSDP2 average the two
ranks' gradients, and each rank's loss is the mean over the same number of tokens, so the
mean of the two ranks' losses is the global batch's mean loss. Compared: the first step's
gradients (a sum instead of a mean, or no reduction, fails there: AdamW's step is nearly
invariant to the gradient's scale) and the weights after the AdamW steps. AdamW's step is
lr * m / (sqrt(v) + eps): ``eps`` = 1e-5 keeps a weight whose gradient is ~0 from turning
fp32 rounding noise into an O(lr) step (measured: 1.2e-7 on the weights; 4e-6 at lr 1e-2,
eps 1e-6, also between two unpatched runs that differ only in the batch split).

One ``mp.spawn`` (the harness of parallel/test_expert_parallel.py) runs every distributed
check; rank 0 writes each check's numbers (or its error) to a file that the tests read.
"""
from __future__ import annotations

import json
import traceback

import pytest
import torch
import torch.distributed as dist

from test_expert_parallel import _spawn  # noqa: E402  (tests/python/parallel)

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from lrmoe.integrations.transformers import collect_diagnostics, patch_moe_blocks  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 4      # global batch: 4 sequences of 16 tokens, 2 per rank
STEPS, LR, EPS = 2, 1e-3, 1e-5
WEIGHT_ATOL = 1e-6
GRAD_RTOL = 1e-5   # of each gradient's largest entry


def _config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=SEQ, output_router_logits=False)


def _model(seed: int = 0, patched: bool = False, **settings) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(_config()).float().train()
    if patched:
        patch_moe_blocks(model, **settings)
    return model


def _batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)


def _full(t):
    """A DTensor (FSDP2) gathered to the whole tensor (a collective); others as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _name(n):
    # the wrappers' prefixes: DDP's module., torch.compile's _orig_mod.
    return n.removeprefix("module.").removeprefix("_orig_mod.")


def _train(model, ids, steps=STEPS):
    """``steps`` AdamW steps on ``ids`` (labels = ids, the model's mean loss):
    (losses, the first step's (reduced) gradients {name: tensor})."""
    opt, losses, grads = _optimizer(model), [], None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if grads is None:
            grads = {_name(n): _full(p.grad).detach().clone()
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def _weights(model):
    return {_name(n): _full(p).detach().clone() for n, p in model.named_parameters()}


def _reference():
    """The unpatched model trained in one process on the whole batch:
    (losses, first gradients, final weights)."""
    model = _model()
    losses, grads = _train(model, _batch())
    return losses, grads, _weights(model)


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[n] - want[n]).abs().max().item() for n in want)


def _max_rel_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


def _mean_over_ranks(values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _compare(model, losses, grads):
    ref_losses, ref_grads, ref_weights = _reference()
    return {"loss_diff": max(abs(a - b) for a, b in zip(_mean_over_ranks(losses),
                                                          ref_losses)),
            "grad_rel_diff": _max_rel_diff(grads, ref_grads),
            "weight_diff": _max_diff(_weights(model), ref_weights)}


def _half(rank, world):
    return _batch().tensor_split(world)[rank]


# ------------------------------------------------------------------------ the checks
def _ddp_exact(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_model(patched=True, recalibration_rate=0.0))
    return _compare(model, *_train(model, _half(rank, world)))


def _fsdp2_exact(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    model = _model(patched=True, recalibration_rate=0.0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    embed = model.model.embed_tokens.weight       # a DTensor, sharded on dim 0
    sharded = {"type": type(embed).__name__, "local_rows": embed.to_local().shape[0],
               "rows": embed.shape[0]}
    return {**_compare(model, *_train(model, _half(rank, world))), "sharded": sharded}


def _replicas_differ(model) -> float:
    """Largest difference of any parameter between the ranks (all-gathered)."""
    worst = 0.0
    for p in model.parameters():
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, p.detach().contiguous())
        worst = max(worst, max((c - copies[0]).abs().max().item() for c in copies))
    return worst


def _ddp_planned(rank, world):
    """c = 0.3: each rank drops its own pairs; DDP still keeps the replicas equal."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_model(patched=True, recalibration_rate=0.3, metric="lrm"))
    losses, _ = _train(model, _half(rank, world), steps=3)
    diag = collect_diagnostics(model.module)
    dropped = [d["dropped_fraction"] for d in diag.values()]
    return {"replicas_differ": _replicas_differ(model.module), "losses": losses,
            "dropped": dropped,
            "moved": _max_diff(_weights(model), _weights(_model()))}


def _ddp_idle_expert(rank, world):
    """Rank 1 sees one 2-token sequence: some experts get no token there. DDP without
    ``find_unused_parameters`` still steps (the stacked expert tensors always get a
    gradient), and the replicas stay equal."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_model(patched=True, recalibration_rate=0.3), find_unused_parameters=False)
    ids = _half(rank, world) if rank == 0 else _batch()[:1, :2]
    _train(model, ids, steps=2)
    loads = [list(d["tokens_per_expert"]) for d in collect_diagnostics(model.module).values()]
    counts = [torch.tensor(l) for l in loads]
    idle = sum(int((c == 0).sum()) for c in counts)
    every = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(every, torch.tensor([idle]))
    return {"idle_experts_per_rank": [int(x) for x in every],
            "replicas_differ": _replicas_differ(model.module)}


CHECKS = {"ddp_exact": _ddp_exact, "fsdp2_exact": _fsdp2_exact,
          "ddp_planned": _ddp_planned, "ddp_idle_expert": _ddp_idle_expert}


def _run_checks(rank, world, out):
    results = {}
    for name, check in CHECKS.items():
        try:
            result = {"ok": True, **check(rank, world)}
        except Exception as exc:  # recorded; the test of this check reports it
            result = {"ok": False, "error": f"rank {rank}: {type(exc).__name__}: {exc}",
                      "trace": traceback.format_exc()[-3000:]}
        every = [None] * world
        dist.all_gather_object(every, result)
        # rank 0's numbers, or the first rank's error
        results[name] = next((r for r in every if not r["ok"]), every[0])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("user_loops") / "results.json"
    _spawn(_run_checks, "gloo", 2, str(out), timeout_s=600)
    return json.loads(out.read_text())


def _result(results, name):
    r = results[name]
    assert r["ok"], f"{r['error']}\n{r['trace']}"
    return r


# ------------------------------------------------------------------------ the tests
def _assert_equal_to_reference(r):
    assert r["loss_diff"] <= 1e-6 * 5, r   # losses ~4.2 (measured: 7e-7)
    assert r["grad_rel_diff"] <= GRAD_RTOL, r
    assert r["weight_diff"] <= WEIGHT_ATOL, r


def test_ddp_two_ranks_equal_one_unpatched_process(two_ranks):
    _assert_equal_to_reference(_result(two_ranks, "ddp_exact"))


def test_fsdp2_two_ranks_equal_one_unpatched_process(two_ranks):
    r = _result(two_ranks, "fsdp2_exact")
    assert r["sharded"] == {"type": "DTensor", "local_rows": VOCAB // 2, "rows": VOCAB}, r
    _assert_equal_to_reference(r)


def test_ddp_planned_backward_keeps_replicas_identical(two_ranks):
    r = _result(two_ranks, "ddp_planned")
    assert r["replicas_differ"] == 0.0, r
    assert all(torch.isfinite(torch.tensor(r["losses"]))), r
    assert all(0.25 <= d <= 0.35 for d in r["dropped"]), r   # about c of the pairs
    assert r["moved"] > 1e-3, r                             # it did train


def test_ddp_needs_no_find_unused_parameters_for_idle_experts(two_ranks):
    r = _result(two_ranks, "ddp_idle_expert")
    assert r["idle_experts_per_rank"][1] > 0, r   # the case is exercised
    assert r["replicas_differ"] == 0.0, r


# ------------------------------------------------------------------------ torch.compile
def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {_name(n): p.grad.detach().clone()
                           for n, p in model.named_parameters()}


@pytest.mark.parametrize("how, backend", [("model", "eager"), ("layers", "aot_eager")])
def test_compile_equals_eager(how, backend):
    """``torch.compile(model)`` and ``layer.compile()`` per decoder layer (the form used
    with FSDP2) give the eager loss and gradients at c = 0. The LRMoE layer's graph breaks
    (docs/integrations.md) make Dynamo run parts of it eagerly; the result is the same."""
    import torch._dynamo
    torch._dynamo.reset()
    ids = _batch()[:2]
    want_loss, want = _loss_and_grads(_model(patched=True, recalibration_rate=0.0), ids)
    model = _model(patched=True, recalibration_rate=0.0)
    if how == "model":
        model = torch.compile(model, backend=backend)
    else:
        for layer in model.model.layers:
            layer.compile(backend=backend)
    for _ in range(2):   # the second call runs the cached graphs
        got_loss, got = _loss_and_grads(model, ids)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    torch._dynamo.reset()
