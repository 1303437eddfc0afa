"""lrmoe.parallel.hooks: the placement driven from a training loop (gloo on the CPU, W = 2,
float64 layers).

The push is checked in a plain user loop (forward, backward, ``optimizer.step()``, no
lrmoe call in the loop): after every step the replica copies a rank holds must equal the
owners' updated weights, gathered here with ``all_gather`` from the owner shards, row by
row for the experts whose remote instances the planner (``lrmoe.planner.plan.plan``, the
decision under test in tests/python/planner/) puts on this rank for the popularity
counted here from the forced routing. Checkpoint state and metrics are checked against
numbers computed here from that routing; ``lrmoe train --policy symi`` (torchrun) against
its straight run.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import test_expert_parallel as tep
from lrmoe.layer import LRMoELayer
from lrmoe.parallel.hooks import PlacementHooks
from lrmoe.planner.plan import MemoryModel, plan as planner_plan
from lrmoe.workload.shapes import ModelShape

H, I, K = 8, 6, 2
T_RANK = 6  # tokens per rank


def _ids(E):
    """(T_RANK, K) forced routing, the same on every rank: every token to expert 0 (hot,
    owned by rank 0) and one of the others."""
    return torch.tensor([[0, 1 + t % (E - 1)] for t in range(T_RANK)])


def _model(cfg, policy, seed=3):
    torch.manual_seed(seed)
    return nn.ModuleDict({"moe": LRMoELayer(cfg, ep_group=dist.group.WORLD,
                                            policy=policy).double()})


def _step(model, opt, x, w_out, ids):
    """One step of a user's own loop: no lrmoe call between backward and the next
    forward."""
    opt.zero_grad()
    (model["moe"](x, expert_ids=ids) * w_out).sum().backward()
    opt.step()


def _full(param):
    """(E, ...) the owners' shards of ``param`` gathered in rank order."""
    parts = [torch.empty_like(param) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, param.detach().contiguous())
    return torch.cat(parts)


def _symi_plan(loads_E, world, E):
    shape = ModelShape("t", H, I, E, K, 1)
    return planner_plan([[0] * E] * world, "symi", MemoryModel.from_shape(shape, 1 << 62, 0),
                        previous_load_E=torch.tensor(loads_E))


def _copies_expected(plan, rank, el):
    """Experts of this rank's remote instances (instance order), and how many copies of
    its own experts this rank sends."""
    off, where = plan.instance_offsets.tolist(), plan.instance_rank.tolist()
    mine, sent = [], 0
    for e in range(len(off) - 1):
        for i in range(off[e], off[e + 1]):
            owner = e // el
            if where[i] == rank and owner != rank:
                mine.append(e)
            if owner == rank and where[i] != rank:
                sent += 1
    return mine, sent


def _check_user_loop(rank, world):
    E, el = 2 * world, 2
    cfg = tep._cfg(num_experts=E)
    model = _model(cfg, "symi")
    layer = model["moe"]
    hooks = PlacementHooks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert hooks.active and hooks.attach(opt) is not None
    ids = _ids(E)
    loads = (torch.bincount(ids.reshape(-1), minlength=E) * world).tolist()
    gen = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(T_RANK, H, generator=gen, dtype=torch.float64)
    w_out = torch.randn(T_RANK, H, generator=gen, dtype=torch.float64)
    state, st = layer.core.replicas, layer.core.replicas.stats
    copy_bytes = 3 * I * H * 8
    plan = _symi_plan(loads, world, E)
    experts_here, sent = _copies_expected(plan, rank, el)
    got_copies = torch.tensor([len(experts_here)])
    dist.all_reduce(got_copies)
    assert int(got_copies) > 0  # the hot expert has a replica somewhere: the check bites
    for step in range(3):
        _step(model, opt, x, w_out, ids)
        if step > 0:  # the forward of this step used the copies pushed after the last
            assert st.bytes["weights_fetched"] == 0
        gu, d = _full(layer.experts.gate_up_proj), _full(layer.experts.down_proj)
        want = torch.cat([gu[experts_here].reshape(len(experts_here), -1),
                          d[experts_here].reshape(len(experts_here), -1)], 1)
        assert torch.equal(state._pushed.weights_F, want), step
        assert st.bytes["weights_pushed"] == sent * copy_bytes
        # what a checkpoint keeps: the popularity of the step just done, nothing since
        assert hooks.state_dict() == {"moe": {"popularity": loads, "loads_since_push": None}}
        m = hooks.metrics()
        assert m["placement_policy"] == "symi"
        assert m["replica_bytes_pushed"] == sent * copy_bytes
        if step > 0:  # step 0's forward planned without a popularity yet
            assert m["replicas"] == plan.replicas
    # a second hook would push twice a step
    with pytest.raises(RuntimeError, match="already attached"):
        hooks.attach(opt)
    # detached: the step changes the weights, no push follows, the next forward fetches
    hooks.detach()
    _step(model, opt, x, w_out, ids)
    assert not state.copies_fresh_now()
    model["moe"](x, expert_ids=ids).sum().backward()
    fetched = torch.tensor([st.bytes["weights_fetched"]])
    dist.all_reduce(fetched)
    assert int(fetched) == int(got_copies) * copy_bytes

    # a resumed layer: state restored into a fresh one, which then plans like the first
    fresh = _model(cfg, "symi")
    restored = PlacementHooks(fresh)
    restored.load_state_dict({"moe": {"popularity": loads, "loads_since_push": None}})
    assert fresh["moe"].core.replicas.popularity_E == loads
    fresh["moe"](x, expert_ids=ids)
    assert fresh["moe"].core.replicas.stats.replicas == plan.replicas

    # an optimizer that does not update the experts is refused
    dense = torch.optim.SGD(layer.gate.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not update the expert weights of layer 'moe'"):
        PlacementHooks(model).attach(dense)


def _check_data_writes_are_seen(rank, world):
    """Issue 26.1: after a push, a change of the owners' weights through ``.data`` (what
    EMA and weight-loading code do) moves no tensor version; the next forward used the old
    copies (output 72 % off). Now the checksum in the counts exchange makes every rank
    fetch: the output equals a layer that never pushed, computed on the same weights."""
    import warnings

    E = 2 * world
    cfg = tep._cfg(num_experts=E)
    model = _model(cfg, "symi")
    layer = model["moe"]
    hooks = PlacementHooks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks.attach(opt)
    ids = _ids(E)
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(T_RANK, H, generator=gen, dtype=torch.float64)
    for _ in range(2):
        _step(model, opt, x, torch.ones_like(x), ids)
    st = layer.core.replicas.stats
    for write in ("scale", "assign"):
        if write == "scale":
            layer.experts.gate_up_proj.data.mul_(0.5)  # in place through .data: no version
        else:  # a new storage: no version either
            layer.experts.down_proj.data = layer.experts.down_proj.data * 2.0
        reference = _model(cfg, None)["moe"]  # no placement: the owners compute, no copies
        reference.load_state_dict(layer.state_dict())
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = layer(x, expert_ids=ids)
        fetched = torch.tensor([st.bytes["weights_fetched"]])
        dist.all_reduce(fetched)
        assert int(fetched) > 0, write  # the stale copies were not used
        assert torch.allclose(got, reference(x, expert_ids=ids), rtol=1e-12, atol=1e-12), write
        if write == "scale":  # one warning names the cause, once
            assert any("changed after the last push" in str(w.message) for w in seen)
        hooks.push()  # as the warning says: a push after such writes ends the fetching
        layer(x, expert_ids=ids)
        assert st.bytes["weights_fetched"] == 0, write


def _check_fetching_policy(rank, world):
    """ultraep fetches in the forward: nothing is registered, a step pushes nothing."""
    E = 2 * world
    model = _model(tep._cfg(num_experts=E), "ultraep")
    hooks = PlacementHooks({"moe": model["moe"]})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert hooks.active and hooks.attach(opt) is None
    x = torch.randn(T_RANK, H, dtype=torch.float64)
    for _ in range(2):
        _step(model, opt, x, torch.ones_like(x), _ids(E))
    state = model["moe"].core.replicas
    assert state._pushed is None and state.stats.bytes["weights_pushed"] == 0
    assert hooks.state_dict() == {"moe": {"popularity": None, "loads_since_push": None}}


def _check_all(rank, world):
    _check_user_loop(rank, world)
    _check_data_writes_are_seen(rank, world)
    _check_fetching_policy(rank, world)


def test_step_hook_pushes_replica_copies_in_a_user_loop():
    tep._spawn(_check_all, "gloo", 2)


def test_one_device_layer_has_no_placement():
    model = nn.ModuleDict({"moe": LRMoELayer(tep._cfg())})
    hooks = PlacementHooks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not hooks.active and hooks.attach(opt) is None
    assert hooks.state_dict() == {} and hooks.metrics() == {} and hooks.push() == 0
    assert not opt._optimizer_step_post_hooks  # nothing registered on the optimizer


def test_lrmoe_train_symi_pushes_every_step_and_resumes_exactly(tmp_path):
    """The trainer attaches the hook: after step 1 no forward fetches copies; a run resumed
    from step 2 fetches once (the copies are not checkpointed), then trains as the
    straight run."""
    from test_train import micro
    from lrmoe.training import train as T

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(T.config_yaml(micro(tmp_path, steps=4, eval_every=0, save_every=2,
                                            log_every=1)))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = tep._torchrun(["--config", str(cfg_file), "--ep", "2", "--policy", "symi", "--out",
                       str(straight)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = tep._torchrun(["--resume", str(straight / "checkpoints" / "step-00000002"), "--out",
                       str(resumed)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    keys = ("step", "loss", "grad_norm", "replica_bytes_pushed", "replica_bytes_fetched")
    a, b = tep._train_records(straight, *keys), tep._train_records(resumed, *keys)
    assert [x[0] for x in a] == [1, 2, 3, 4]
    assert all(x[3] > 0 for x in a)                     # pushed after every step
    assert a[0][4] > 0 and all(x[4] == 0 for x in a[1:])  # step 1 fetched, then copies
    assert b[2][4] == a[0][4] and b[3][4] == 0          # the resumed step 3 fetched once
    assert [x[:4] for x in a] == [x[:4] for x in b]
