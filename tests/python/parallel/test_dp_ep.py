"""DP x EP (``lrmoe train --dp D --ep N``): a (dp, ep) device mesh, experts sharded over ep
and replicated over dp, gloo on the CPU.

The reference for a D x N run is ONE process (``lrmoe.training.train``, no process group) on the
same global batch: batch_size D*N*B against B per rank. The two are equal up to the fp32
summation order (per-rank GEMMs + all-reduce against one GEMM over the whole batch) when

* c = 0: under EP the backward quotas are split into per-source shares (docs/algorithm.md
  section 8), so c > 0 selects differently from one process;
* the load-balancing loss is off (it is nonlinear in the batch and computed per rank);
* every rank's micro-batch holds the same number of loss tokens: the objective of a
  multi-rank run is the mean of the ranks' per-token means (as under ``--ep`` alone),
  which is the global per-token mean only then. The data here are text documents of
  exactly S tokens under a word-level tokenizer, so every block is full.

Legend: D dp size, N ep size, W = D * N ranks, B sequences per rank, S = seq_len.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import test_expert_parallel as tep  # noqa: E402
from test_expert_parallel import (_backends, _free_port, _spawn, _torchrun,  # noqa: E402
                                  _train_records)

from lrmoe.training import train as T  # noqa: E402
from lrmoe.training.config import (DataConfig, BackwardConfig, ModelConfig,  # noqa: E402
                                   OptimConfig, RunConfig, TrainConfig)

S = 32  # tokens per block
WORDS = [f"w{i}" for i in range(60)]
#: float32 summation order of W per-rank GEMMs + all-reduce against one batched GEMM,
#: carried through a few AdamW steps. AdamW's step is lr * g / (sqrt(v) + eps): for a
#: weight whose gradient is near 0 (an expert row that one token touched) eps = 1e-8
#: turns rounding noise into a large relative change, so the runs here use eps = 1e-6
#: (a wrong reduction still moves a weight by O(lr) = 1e-2)
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5  # (measured: 1.1e-6 on the weights)


def _text_data(root: Path) -> tuple[Path, Path]:
    """Documents of S - 1 words (+ EOS = S tokens, one full block each) and a word-level
    tokenizer.json for them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    docs = root / "docs"
    if not docs.is_dir():
        docs.mkdir(parents=True)
        gen = torch.Generator().manual_seed(5)
        for i in range(48):
            ids = torch.randint(len(WORDS), (S - 1,), generator=gen).tolist()
            (docs / f"doc{i:03d}.txt").write_text(" ".join(WORDS[j] for j in ids) + "\n")
        vocab = {"<|endoftext|>": 0, "<|pad|>": 1, "[UNK]": 2}
        vocab.update({w: i + 3 for i, w in enumerate(WORDS)})
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(root / "tokenizer.json"))
    return docs, root / "tokenizer.json"


def _cfg(root: Path, name: str, **changes) -> TrainConfig:
    """The smallest model of the EP tests, on full blocks, c = 0, no load-balancing
    loss, every step logged."""
    docs, tok = _text_data(root)
    cfg = TrainConfig(
        model=ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, intermediate_size=64,
                          moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                          router_aux_loss_coef=0.0, max_position_embeddings=S),
        data=DataConfig(source=f"text:{docs}", tokenizer=str(tok), seq_len=S, batch_size=1,
                        val_fraction=0.1, cache_dir=str(root / "cache")),
        optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, adam_eps=1e-6),
        lrmoe=BackwardConfig(recalibration_rate=0.0),
        run=RunConfig(steps=4, eval_every=0, eval_batches=1, save_every=2, log_every=1,
                      out_dir=str(root / name), progress="none", device="cpu",
                      torch_threads=1))
    return cfg.replace(**changes) if changes else cfg


def _launch(root: Path, cfg: TrainConfig, dp: int, ep: int, *extra: str):
    cfg_file = root / f"{Path(cfg.run.out_dir).name}.yaml"
    cfg_file.write_text(T.config_yaml(cfg))
    r = _torchrun(["--config", str(cfg_file), "--dp", str(dp), "--ep", str(ep), *extra],
                  root, nproc=dp * ep, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    return Path(cfg.run.out_dir)


def _weights(ckpt: Path) -> dict:
    """A checkpoint's whole model in its own (fused-expert) names: an lrmoe checkpoint
    read by torch's own DCP converter (``dcp_to_torch_save``, not lrmoe's loader), or an
    export loaded by transformers (``save_pretrained`` writes one tensor per expert)."""
    if (ckpt / "model.safetensors").is_file():
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    whole = ckpt.parent / f".whole-{ckpt.name}.pt"
    dcp_to_torch_save(ckpt / "state", whole)
    state = torch.load(whole, weights_only=True)
    whole.unlink()
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _assert_same_model(got: dict, want: dict, atol: float) -> None:
    keys = [k for k in want if not k.endswith("inv_freq")]
    assert sorted(k for k in got if not k.endswith("inv_freq")) == sorted(keys)
    for k in keys:
        if atol == 0:
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=k)


@pytest.fixture(scope="module")
def run_2x2(tmp_path_factory):
    """A straight 2 x 2 run of 4 steps (checkpoints at 2 and 4) and its root folder."""
    root = tmp_path_factory.mktemp("dpep")
    run = _launch(root, _cfg(root, "straight"), 2, 2)
    return root, run


def test_dp2_ep2_equals_one_process_on_the_same_global_batch(run_2x2):
    from test_expert_parallel import _chunks
    root, run = run_2x2
    ref = T.train(_cfg(root, "one", batch_size=4)).out_dir  # W * B sequences in one step
    got, want = (_train_records(r, "step", "loss", "grad_norm", "tokens", "loss_tokens")
                 for r in (run, ref))
    assert [g[0] for g in got] == [1, 2, 3, 4]
    assert all(g[4] == 4 * (S - 1) for g in got)  # full blocks: equal loss tokens per rank
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[3:] == w[3:], (g, w)  # the same global batch
        assert g[1] == pytest.approx(w[1], rel=LOSS_RTOL) and \
            g[2] == pytest.approx(w[2], rel=LOSS_RTOL), (g, w)
    _assert_same_model(_weights(_step(run, 4)), _weights(_step(ref, 4)), WEIGHT_ATOL)
    # one checkpoint for the 4 ranks: each ep shard's expert rows stored once (not once
    # per dp replica), a dense tensor once
    ckpt = _step(run, 4)
    assert _chunks(ckpt, "model.model.layers.0.mlp.experts.down_proj") == [0, 2]
    assert _chunks(ckpt, "model.model.embed_tokens.weight") == [0]
    assert _chunks(ckpt, "optim.model.layers.0.mlp.experts.down_proj.exp_avg") == [0, 2]
    assert sorted(p.name for p in (ckpt / "ranks").glob("rank-*.pt")) == [
        f"rank-{r}.pt" for r in range(4)]
    # the dp replicas log the same steps as their shard and keep no checkpoint
    for replica, shard_dir in ((run / "dp-rank-1", run),
                               (run / "ep-rank-1" / "dp-rank-1", run / "ep-rank-1")):
        assert not (replica / "checkpoints").exists()
        assert _train_records(replica, "step", "loss", "grad_norm") == \
            _train_records(shard_dir, "step", "loss", "grad_norm")
    assert not (run / "ep-rank-1" / "checkpoints").exists()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert (state["dp_size"], state["ep_size"], state["format"]) == (2, 2, 2)


def test_dp2_ep2_resume_continues_the_straight_run(run_2x2):
    """Resumed at the same sizes: the straight run's steps, to float32 rounding (DDP
    rebuilds its buckets after the first iteration, so at W = 4 the resumed run's first
    step sums the gradients in another order: lrmoe/parallel/data_parallel.py)."""
    root, run = run_2x2
    resumed = root / "resumed"
    r = _torchrun(["--resume", str(_step(run, 2)), "--out", str(resumed)], root, nproc=4,
                  timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    keys = ("step", "lr", "tokens")
    assert _train_records(resumed, *keys) == _train_records(run, *keys)
    for g, w in zip(*(_train_records(d, "loss", "grad_norm") for d in (resumed, run))):
        assert g == pytest.approx(w, rel=LOSS_RTOL)
    _assert_same_model(_weights(_step(resumed, 4)), _weights(_step(run, 4)), WEIGHT_ATOL)


@pytest.mark.parametrize("dp,ep,accum", [(1, 1, 4), (1, 4, 1)])
def test_dp2_ep2_resumes_at_another_size(run_2x2, dp, ep, accum):
    """The 2 x 2 checkpoint of step 2 re-sharded: resumed by one process (every expert,
    4 micro-batches a step) or by 4 EP ranks (one expert each), steps 3-4 equal the
    straight 2 x 2 run's up to the summation order, and so are the final weights."""
    root, run = run_2x2
    out = root / f"at-{dp}x{ep}"
    cfg = T.read_checkpoint_config(_step(run, 2)).replace(
        dp_size=dp, ep_size=ep, grad_accum=accum, out_dir=str(out))
    if dp * ep == 1:
        T.train(cfg, resume=_step(run, 2))
    else:
        _launch(root, cfg, dp, ep, "--resume", str(_step(run, 2)), "--out", str(out))
    got, want = (_train_records(r, "step", "loss", "grad_norm", "tokens") for r in (out, run))
    assert [g[0] for g in got] == [1, 2, 3, 4] and got[:2] == want[:2]  # the log so far
    for g, w in zip(got[2:], want[2:]):
        assert g[0] == w[0] and g[3] == w[3], (g, w)  # the same global batches
        assert g[1] == pytest.approx(w[1], rel=LOSS_RTOL) and \
            g[2] == pytest.approx(w[2], rel=LOSS_RTOL), (g, w)
    _assert_same_model(_weights(_step(out, 4)), _weights(_step(run, 4)), WEIGHT_ATOL)


def test_another_global_batch_is_refused_on_resume(run_2x2):
    root, run = run_2x2
    cfg = T.read_checkpoint_config(_step(run, 2)).replace(dp_size=1, ep_size=1,
                                                          out_dir=str(root / "other"))
    with pytest.raises(ValueError, match=r"global batch: checkpoint ep_size x dp_size x "
                                         r"grad_accum = 2 x 2 x 1 = 4 micro-batches, now "
                                         r"1 x 1 x 1 = 1; keep it with --set "
                                         r"data.grad_accum=4"):
        T.train(cfg, resume=_step(run, 2))
    assert not (root / "other").exists()


def test_dp2_ep2_run_exports_the_whole_model(run_2x2):
    """The run's own export (run.export: rank 0, after the collective save): transformers
    loads the whole model, equal to the checkpoint read by torch's DCP converter; no other
    rank exports."""
    root, run = run_2x2
    export = run / "export"
    assert (export / "model.safetensors").is_file()
    assert (export / "tokenizer_config.json").is_file()
    assert not any((run / sub / "export").exists()
                   for sub in ("dp-rank-1", "ep-rank-1", "ep-rank-1/dp-rank-1"))
    _assert_same_model(_weights(export), _weights(_step(run, 4)), 0)


def test_dp2_ep1_equals_one_process(tmp_path):
    run = _launch(tmp_path, _cfg(tmp_path, "dp2", steps=3, save_every=0), 2, 1)
    ref = T.train(_cfg(tmp_path, "one", steps=3, save_every=0, batch_size=2)).out_dir
    got, want = (_train_records(r, "step", "loss", "grad_norm", "tokens") for r in (run, ref))
    assert [g[0] for g in got] == [1, 2, 3]
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[3] == w[3]
        assert g[1] == pytest.approx(w[1], rel=LOSS_RTOL) and \
            g[2] == pytest.approx(w[2], rel=LOSS_RTOL), (g, w)
    assert not (run / "ep-rank-1").exists() and not (run / "dp-rank-1" / "checkpoints").exists()
    _assert_same_model(_weights(_step(run, 3)), _weights(_step(ref, 3)), WEIGHT_ATOL)


# ---------------------------------------------------------------- errors (no training)
def test_world_size_other_than_dp_times_ep_is_refused(monkeypatch):
    from lrmoe.parallel import init_torchrun_group
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"--dp x --ep = 2 x 2 = 4 processes, but torchrun "
                                         r"started 3 \(world size 3\).*--dp D --ep N with "
                                         r"D x N = 3.*--nproc-per-node 4 \.\.\. --dp 2 --ep 2"):
        init_torchrun_group(2, False, "parallel.dp_size=2 x parallel.ep_size=2", dp_size=2)
    with pytest.raises(ValueError, match="parallel.dp_size"):
        TrainConfig().replace(dp_size=0)
    with pytest.raises(ValueError, match="adaptive rate.*parallel.dp_size=2"):
        TrainConfig().replace(dp_size=2, recalibration_rate=0.5, retained_mass_target=0.9)


def _check_mesh(rank, world):
    from lrmoe.moe.config import LRMoEConfig
    from lrmoe.layer import LRMoELayer
    from lrmoe.parallel import DataParallel, clip_grad_norm_, is_expert_param
    from lrmoe.parallel.group import init_dp_ep_mesh

    # ranks started with another --dp fail on every rank, before any mesh is built
    dp, ep = (2, 2) if rank < 2 else (1, 4)
    with pytest.raises(ValueError, match=r"ranks \[2, 3\] were started with another --dp"):
        init_dp_ep_mesh(dp, ep)
    g = init_dp_ep_mesh(2, 2)
    # row-major (dp, ep): the ranks of an ep group are consecutive
    assert (g.dp_rank, g.ep_rank) == (rank // 2, rank % 2)
    assert dist.get_process_group_ranks(g.ep) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert dist.get_process_group_ranks(g.dp) == [rank % 2, rank % 2 + 2]

    cfg = LRMoEConfig(hidden_size=8, moe_intermediate_size=6, num_experts=4, top_k=2,
                      router_aux_loss_coef=0.0, shared_expert_intermediate_size=5)
    dev = tep._DEVICE  # this rank's GPU under NCCL (set by test_expert_parallel._worker)
    torch.manual_seed(9)
    layer = LRMoELayer(cfg, ep_group=g.ep).double().to(dev)
    torch.manual_seed(9)
    ref = LRMoELayer(cfg).double().to(dev)  # one process, the whole batch, float64
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(14, 8, generator=gen, dtype=torch.float64).to(dev)
    w_out = torch.randn(14, 8, generator=gen, dtype=torch.float64).to(dev)
    sl = slice(rank * 14 // world, (rank + 1) * 14 // world)  # global rank order
    (ref(x) * w_out).sum().backward()
    # DDP over WORLD (tiny buckets: several), the experts summed over dp by their hooks
    dp_sync = DataParallel(layer, dist.group.WORLD, g.dp, bucket_cap_mb=256 / 2**20)
    (dp_sync.module(x[sl]) * w_out[sl]).sum().backward()
    dp_sync.finish()
    el = cfg.num_experts // 2
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters()):
        # loss = mean of the W ranks' losses: every gradient is the full-batch one / W
        # (test_expert_parallel's tolerance: the router computes in float32)
        want = q.grad[g.ep_rank * el:(g.ep_rank + 1) * el] if is_expert_param(p) else q.grad
        torch.testing.assert_close(p.grad * world, want, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")
    # the two dp replicas of a shard hold bitwise equal gradients
    for p in layer.parameters():
        other = [torch.empty_like(p.grad) for _ in range(2)]
        dist.all_gather(other, p.grad, group=g.dp)
        assert torch.equal(other[0], other[1])
    want_norm = sum(float(q.grad.square().sum()) for q in ref.parameters()) ** 0.5 / world
    norm = clip_grad_norm_(layer, float("inf"), g.ep)
    assert float(norm) == pytest.approx(want_norm, rel=1e-6)

    # a micro-batch under no_sync is not reduced: the dp replicas' increments differ
    # (each saw its own tokens), for DDP's parameters and for the expert shards
    before = [p.grad.clone() for p in layer.parameters()]
    with dp_sync.no_sync():
        (dp_sync.module(x[sl]) * w_out[sl]).sum().backward()
    for (name, p), b in zip(layer.named_parameters(), before):
        step = p.grad - b
        both = [torch.empty_like(step) for _ in range(2)]
        dist.all_gather(both, step, group=g.dp)
        assert not torch.equal(both[0], both[1]), name


@pytest.mark.parametrize("backend,world", _backends([4], (4,)))
def test_mesh_layout_grad_groups_and_mismatched_dp(backend, world):
    _spawn(_check_mesh, backend, world)
