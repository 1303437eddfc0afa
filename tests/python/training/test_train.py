"""Tests of ``lrmoe train``: config composition, the learning-rate schedule, validation
perplexity, metrics/plot files, checkpoints, Ctrl-C and exact resume (CPU, micro models).

References are independent of the code under test: hand-computed schedule values, a
float64 per-sequence NLL loop, a straight run compared with an interrupted-and-resumed one,
transformers' own unpatched model loading the checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from lrmoe.training import train as T
from lrmoe.training.train import (DataConfig, BackwardConfig, ModelConfig, OptimConfig,
                                  RunConfig, TrainConfig)

REPO = Path(__file__).resolve().parents[3]
TIMING_KEYS = ("tokens_per_s", "time_s")

WORDS = ("apple river stone cloud bright quick silent green paper window garden music "
         "winter summer yellow orange mountain forest ocean simple gentle ancient modern "
         "letter number circle square").split()


def write_alpaca(path: Path, n: int = 96, seed: Optional[int] = None) -> Path:
    """A JSONL Alpaca file of ``n`` fresh random records."""
    rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    with open(path, "w") as f:
        for i in range(n):
            word = rng.choice(WORDS)
            out = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
            rec = {"instruction": f"Define {word} {i}.", "input": "" if i % 3 else "briefly",
                   "output": f"{word}: {out}."}
            f.write(json.dumps(rec) + "\n")
    return path


def micro(tmp_path: Path, name: str = "run", **changes) -> TrainConfig:
    """A model and run small enough for a few CPU seconds; ``changes`` are flat keys
    (``steps=6``) or whole sections."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_alpaca(data)
    cfg = TrainConfig(
        model=ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, intermediate_size=64,
                          moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=128),
        data=DataConfig(source=f"alpaca:{data}", vocab_size=512, seq_len=128, batch_size=4,
                        val_fraction=0.1, cache_dir=str(tmp_path / "cache")),
        optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2),
        lrmoe=BackwardConfig(recalibration_rate=0.3, selection="importance", metric="lrm"),
        run=RunConfig(steps=8, eval_every=3, eval_batches=2, save_every=0,
                      out_dir=str(tmp_path / name), progress="none", device="cpu",
                      torch_threads=1))
    return cfg.replace(**changes) if changes else cfg


def res_moment(res, p):
    """AdamW's first moment of parameter ``p`` in the finished run's optimizer."""
    return res.optimizer.state[p]["exp_avg"]


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# ---------------------------------------------------------------------------- config
def test_set_values_are_typed():
    cfg = T.build_config("tiny", sets=[
        "lr=3e-4", "steps=1e3", "betas=[0.8, 0.99]", "model.num_experts=16",
        "num_experts_per_tok=4",
        "init_from=null", "norm_topk_prob=false", "max_records=250", "metric=grad_sq",
        "recalibration_rate=0.25"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)  # YAML 1.1 reads 3e-4 as a string
    assert cfg.run.steps == 1000 and isinstance(cfg.run.steps, int)
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.model.num_experts == 16 and cfg.model.num_experts_per_tok == 4
    assert cfg.model.init_from is None and cfg.model.norm_topk_prob is False
    assert cfg.data.max_records == 250 and cfg.lrmoe.metric == "grad_sq"
    assert cfg.lrmoe.recalibration_rate == 0.25
    # flags win over --set
    cfg = T.build_config("tiny", sets=["steps=7"], overrides={"steps": 9, "metric": None})
    assert cfg.run.steps == 9 and cfg.lrmoe.metric == "lrm"


def test_yaml_config_and_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: gpu-small\nlr: 5e-4\nmodel:\n  num_experts: 32\n"
                    "model.num_hidden_layers: 3\nsteps: 11\n")
    cfg = T.build_config(config_file=path)
    gpu = T.get_preset("gpu-small")
    assert cfg.optim.lr == 5e-4 and cfg.model.num_experts == 32 and cfg.model.num_hidden_layers == 3
    assert cfg.model.hidden_size == gpu.model.hidden_size and cfg.data.seq_len == gpu.data.seq_len
    cfg = T.build_config("tiny", config_file=path, sets=["steps=12"])
    assert cfg.model.hidden_size == T.get_preset("tiny").model.hidden_size  # --preset wins
    assert cfg.run.steps == 12  # --set wins over the file
    # what --print-config writes reads back to the same config
    again = tmp_path / "again.yaml"
    again.write_text(T.config_yaml(cfg))
    assert T.build_config(config_file=again) == cfg


@pytest.mark.parametrize("name", sorted(T.PRESETS))
def test_config_files_spell_out_the_presets(name):
    assert T.build_config(config_file=REPO / "configs" / f"{name}.yaml") == T.get_preset(name)


def test_unknown_key_and_bad_values_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"'hidden_siz'.*model\.hidden_size"):
        T.build_config("tiny", sets=["hidden_siz=64"])
    with pytest.raises(ValueError, match=r"'lerning_rate'"):
        T.build_config("tiny", sets=["lerning_rate=0.1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_expert: 4\n")
    with pytest.raises(ValueError, match=r"model\.num_expert.*model\.num_experts"):
        T.build_config(config_file=bad)
    with pytest.raises(ValueError, match="unknown preset 'tinyy'.*tiny"):
        T.build_config("tinyy")
    for item, field in (("batch_size=0", "batch_size"), ("metric=foo", "metric"),
                        ("recalibration_rate=1.0", "recalibration_rate"),
                        ("model.num_experts_per_tok=99", "model.num_experts_per_tok"),
                        ("steps=abc", "steps"), ("min_lr=1.0", "min_lr"),
                        ("device=gpu", "device"), ("data=csv:x", "data")):
        with pytest.raises(ValueError, match=field):
            T.build_config("tiny", sets=[item])
    with pytest.raises(ValueError, match="key=value"):
        T.build_config("tiny", sets=["lr"])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        T.build_config(config_file=tmp_path / "nope.yaml")


def test_cli_print_config_and_errors(capsys):
    from lrmoe.cli import main

    assert main(["train", "--preset", "tiny", "-c", "0.2", "--metric", "grad_abs",
                 "--steps", "5", "--set", "model.num_experts=6", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "recalibration_rate: 0.2" in out and "metric: grad_abs" in out
    assert "steps: 5" in out and "num_experts: 6" in out
    assert main(["train", "--set", "hidden_siz=3", "--print-config"]) == 2
    assert "model.hidden_size" in capsys.readouterr().err


# ---------------------------------------------------------------------------- schedule
def test_lr_schedule_hand_computed():
    kw = dict(lr=2.0, min_lr=0.2, warmup_steps=4, decay_steps=14)
    # warm-up (s + 1) / 4; cosine over steps 4..14: p = (s - 4) / 10
    expected = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 9: (0.2 + 1.8 * 0.5) / 2.0,
                6: (0.2 + 0.9 * (1 + math.cos(math.pi * 0.2))) / 2.0, 14: 0.1, 30: 0.1}
    for step, want in expected.items():
        assert T.lr_factor(step, **kw) == pytest.approx(want, rel=1e-12), step
    # through LambdaLR as the trainer drives it: lr used by optimizer step s
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: T.lr_factor(s, **kw))
    seen = []
    for _ in range(16):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(0.5) and seen[3] == pytest.approx(2.0)
    assert seen[9] == pytest.approx(1.1) and seen[15] == pytest.approx(0.2)
    # no warm-up: full lr at step 0
    assert T.lr_factor(0, lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10) == 1.0


# ---------------------------------------------------------------------------- evaluation
class Blocks:
    """The part of lrmoe.data.TokenBlocks that evaluate() reads."""

    def __init__(self, input_ids, labels):
        self.input_ids, self.labels = input_ids, labels

    def __len__(self):
        return self.input_ids.shape[0]


def ref_nll(model, ids, labels):
    """float64, one sequence and one position at a time."""
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        logits = model(input_ids=ids[b:b + 1]).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        for s in range(ids.shape[1] - 1):
            target = int(labels[b, s + 1])
            if target != -100:
                total -= float(logp[s, target])
                count += 1
    return total, count


def test_val_ppl_matches_hand_computation():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    hf = Qwen3MoeConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                        num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(hf).eval()
    ids = torch.randint(0, 50, (5, 9))
    labels = ids.clone()
    labels[:, :3] = -100          # a masked prompt
    labels[1, 6:] = -100          # padding
    labels[4, :] = -100           # a sequence with no loss token
    blocks = Blocks(ids, labels)
    with torch.no_grad():
        total, count = ref_nll(model, ids, labels)
    res = T.evaluate(model, blocks, batch_size=2, max_batches=0, device=torch.device("cpu"),
                     autocast_dtype=None)
    assert res["val_tokens"] == count
    assert res["val_loss"] == pytest.approx(total / count, rel=1e-6)
    assert res["val_ppl"] == pytest.approx(math.exp(total / count), rel=1e-6)
    # the cap takes the first batches in order: 2 batches = sequences 0..3
    with torch.no_grad():
        total2, count2 = ref_nll(model, ids[:4], labels[:4])
    res2 = T.evaluate(model, blocks, batch_size=2, max_batches=2, device=torch.device("cpu"),
                      autocast_dtype=None)
    assert res2["val_tokens"] == count2
    assert res2["val_loss"] == pytest.approx(total2 / count2, rel=1e-6)


# ---------------------------------------------------------------------------- training runs
def test_metrics_plot_summary_and_checkpoint_contents(tmp_path):
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    cfg = micro(tmp_path, steps=6, save_every=2, keep_checkpoints=2, eval_every=4)
    res = T.train(cfg)
    out = Path(cfg.run.out_dir)
    assert not res.interrupted and res.step == 6
    records = T.read_metrics(out / "metrics.jsonl")
    train_r = [r for r in records if r["kind"] == "train"]
    eval_r = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train_r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in eval_r] == [0, 4, 6]      # start, every 4, end
    for r in train_r:
        for key in ("loss", "ppl", "lr", "grad_norm", "tokens_per_s", "dropped_fraction",
                    "retained_mass", "load_max_over_mean_before", "load_max_over_mean_after",
                    "aux_loss"):
            assert r[key] is not None and math.isfinite(r[key]), key
        assert r["ppl"] == pytest.approx(math.exp(r["loss"]))
        assert r["tokens"] == cfg.data.batch_size * cfg.data.seq_len
        assert r["dropped_fraction"] == pytest.approx(0.3, abs=0.02)
        assert 0.0 < r["retained_mass"] <= 1.0
    for r in eval_r:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
    # the lr column follows the schedule (warm-up 2, cosine to step 6)
    for r in train_r:
        want = cfg.optim.lr * T.lr_factor(r["step"] - 1, lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
                                    warmup_steps=2, decay_steps=6)
        assert r["lr"] == pytest.approx(want, rel=1e-12)
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["first_val_step"] == 0
    assert summary["last_val_ppl"] == pytest.approx(eval_r[-1]["val_ppl"])
    assert summary["dropped_fraction"] == pytest.approx(0.3, abs=0.02)

    # keep the newest 2; nothing half-written left over
    ckpts = T.list_checkpoints(out)
    assert [p.name for p in ckpts] == ["step-00000004", "step-00000006"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [p.name for p in ckpts]
    last = ckpts[-1]
    for name in ("state/.metadata", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "train_config.json", "trainer_state.pt",
                 "metrics.jsonl", "ranks/rank-0.pt", "ranks/metrics-rank-0.jsonl"):
        assert (last / name).is_file(), name
    assert T.read_checkpoint_config(last) == cfg
    state = torch.load(last / "trainer_state.pt", weights_only=True)
    assert state["step"] == 6 and state["lr_decay_steps"] == 6 and state["format"] == 2
    assert set(state["data_position"]) == {"epoch", "index"}
    assert set(torch.load(last / "ranks" / "rank-0.pt", weights_only=True)["rng"]) >= {
        "python", "torch"}
    assert len(state["lrmoe_backward_steps"]) == cfg.model.num_hidden_layers
    assert all(v == 6 for v in state["lrmoe_backward_steps"].values())
    # torch's own DCP converter reads the weights and the AdamW moments by name
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(last / "state", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    trained = res.model.eval()
    for k, v in trained.state_dict().items():
        assert torch.equal(whole["model." + k], v), k
    for k, p in trained.named_parameters():
        assert torch.equal(whole[f"optim.{k}.exp_avg"], res_moment(res, p)), k

    # an unpatched transformers model loads the export: same parameters, same logits
    assert load_file(str(out / "export" / "model.safetensors"))  # plain safetensors
    plain = Qwen3MoeForCausalLM.from_pretrained(out / "export", dtype=torch.float32).eval()
    sd_plain, sd_trained = plain.state_dict(), trained.state_dict()
    assert set(sd_plain) == set(sd_trained)
    for k in sd_plain:
        assert torch.equal(sd_plain[k], sd_trained[k]), k
    ids = torch.randint(0, plain.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(trained(input_ids=ids).logits, plain(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-5)


def test_resume_reproduces_the_straight_run_exactly(tmp_path):
    straight = T.train(micro(tmp_path, "straight"))
    # the first half of the same schedule (lr_decay_steps fixes it), then resume
    first = T.train(micro(tmp_path, "resumed", steps=4, lr_decay_steps=8))
    assert first.step == 4
    resumed_cfg = micro(tmp_path, "resumed", eval_every=3, log_every=1)
    ckpt = T.find_checkpoint(None, resumed_cfg.run.out_dir)
    assert ckpt.name == "step-00000004"
    second = T.train(resumed_cfg, resume=ckpt)
    assert second.step == 8

    a = T.read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = T.read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    losses_a = [r["loss"] for r in a if r["kind"] == "train"]
    losses_b = [r["loss"] for r in b if r["kind"] == "train"]
    assert len(losses_a) == 8 and losses_a == losses_b          # bitwise on the CPU
    assert without_timing(a) == without_timing(b)               # the whole log, evals too
    for (ka, va), (kb, vb) in zip(straight.model.state_dict().items(),
                                  second.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_resume_with_incompatible_config_is_refused(tmp_path):
    T.train(micro(tmp_path, steps=3))
    ckpt = T.find_checkpoint(None, tmp_path / "run")
    bad = micro(tmp_path, steps=6, lr=2e-2, model=ModelConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2, max_position_embeddings=128))
    with pytest.raises(ValueError) as err:
        T.train(bad, resume=ckpt)
    msg = str(err.value)
    assert "lr: checkpoint 0.01, now 0.02" in msg
    assert "model.num_experts: checkpoint 4, now 6" in msg
    assert "steps" not in msg.split("(only")[0]        # steps may change
    with pytest.raises(ValueError, match="recalibration_rate: checkpoint 0.3, now 0.2"):
        T.train(micro(tmp_path, recalibration_rate=0.2), resume=ckpt)
    with pytest.raises(ValueError, match="lr_decay_steps: checkpoint 3, now 9"):
        T.train(micro(tmp_path, lr_decay_steps=9), resume=ckpt)
    # a fresh run into a directory holding a run is refused unless --overwrite
    with pytest.raises(FileExistsError, match="--resume"):
        T.train(micro(tmp_path, steps=3))
    assert T.train(micro(tmp_path, steps=2), overwrite=True).step == 2


def test_sigint_saves_and_resume_continues(tmp_path, monkeypatch):
    def interrupt_at(step):
        def callback(trainer, s):
            if s == step:
                os.kill(os.getpid(), signal.SIGINT)
        return callback

    handler = signal.getsignal(signal.SIGINT)
    cut = T.train(micro(tmp_path, "cut"), step_callback=interrupt_at(5))
    assert cut.interrupted and cut.step == 5
    assert signal.getsignal(signal.SIGINT) is handler          # restored
    assert [p.name for p in T.list_checkpoints(tmp_path / "cut")] == ["step-00000005"]
    done = T.train(micro(tmp_path, "cut"), resume=T.find_checkpoint(tmp_path / "cut", "."))
    assert done.step == 8 and not done.interrupted
    straight = T.train(micro(tmp_path, "straight"))
    a = T.read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = T.read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert without_timing(a) == without_timing(b)

    # one Ctrl-C that arrives twice at once (the terminal's, sent to the whole process
    # group, and the one a parent such as experiments/grid.py passes on) still saves
    def twice(trainer, s):
        if s == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    got = T.train(micro(tmp_path, "twice"), step_callback=twice)
    assert got.interrupted and got.step == 2
    assert [p.name for p in T.list_checkpoints(tmp_path / "twice")] == ["step-00000002"]
    # a second Ctrl-C after the repeat window aborts at once
    from lrmoe.training import stop
    monkeypatch.setattr(stop, "SIGINT_REPEAT_S", 0.0)
    with pytest.raises(KeyboardInterrupt):
        T.train(micro(tmp_path, "abort"), step_callback=twice)
    assert signal.getsignal(signal.SIGINT) is handler


def test_sigterm_saves_never_aborts_and_the_run_folder_is_locked_meanwhile(tmp_path):
    """Issue 26: SIGTERM (Slurm, Kubernetes, torchrun's escalation of a second Ctrl-C)
    killed the run without its checkpoint. Now it stops like Ctrl-C, a second SIGTERM does
    not abort, the resume equals a straight run, and while the run trains a second job on
    its folder is refused (lrmoe/training/run_lock.py)."""
    import subprocess
    import sys

    from lrmoe.training.run_lock import RunLock

    refused = []

    def callback(trainer, s):
        if s == 3:
            try_lock = subprocess.run(
                [sys.executable, "-c", "import sys; from lrmoe.training.run_lock import "
                 "RunLock; RunLock(sys.argv[1])", str(tmp_path / "cut")],
                capture_output=True, text=True, timeout=600)
            refused.append(try_lock.returncode != 0 and "is in use by pid" in try_lock.stderr)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    cut = T.train(micro(tmp_path, "cut"), step_callback=callback)
    assert refused == [True]
    assert cut.interrupted and cut.step == 3
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    assert [p.name for p in T.list_checkpoints(tmp_path / "cut")] == ["step-00000003"]
    RunLock(tmp_path / "cut").release()  # the ended run holds nothing
    done = T.train(micro(tmp_path, "cut"), resume=T.find_checkpoint(tmp_path / "cut", "."))
    assert done.step == 8 and not done.interrupted
    T.train(micro(tmp_path, "straight"))
    a = T.read_metrics(tmp_path / "straight" / "metrics.jsonl")
    b = T.read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert without_timing(a) == without_timing(b)


def test_cli_subprocess_ctrl_c_then_resume(tmp_path):
    """``python -m lrmoe train`` stopped by SIGINT exits 130 after saving; --resume ends it."""
    data = write_alpaca(tmp_path / "data.jsonl")
    out = tmp_path / "cli"
    args = [sys.executable, "-m", "lrmoe", "train", "--data", f"alpaca:{data}", "--out", str(out),
            "--device", "cpu", "--steps", "400", "-c", "0.2",
            "--set", "model.hidden_size=32", "--set", "model.num_hidden_layers=1",
            "--set", "model.num_attention_heads=2", "--set", "model.num_key_value_heads=1",
            "--set", "model.head_dim=16", "--set", "model.moe_intermediate_size=16",
            "--set", "model.num_experts=4", "--set", "vocab_size=512", "--set", "seq_len=128",
            "--set", "batch_size=4", "--set", "eval_every=0", "--set", "save_every=0",
            "--set", "progress=lines", "--set", "torch_threads=1",
            "--set", f"cache_dir={tmp_path / 'cache'}"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and sum(1 for _ in open(metrics)) >= 3:  # eval at 0 + 2 steps
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 130, stderr
    assert "Continue with" in stderr
    ckpts = T.list_checkpoints(out)
    assert len(ckpts) == 1
    step = int(ckpts[0].name.split("-")[1])
    assert 2 <= step < 400
    lines = T.read_metrics(metrics)
    assert max(r["step"] for r in lines) == step
    # resume from the run dir alone (config from the checkpoint), running 2 more steps
    res = subprocess.run([sys.executable, "-m", "lrmoe", "train", "--resume", str(out),
                          "--steps", str(step + 2)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    train_steps = [r["step"] for r in T.read_metrics(metrics) if r["kind"] == "train"]
    assert train_steps == list(range(1, step + 3))
    assert "val ppl (last)" in res.stdout


def test_bf16_autocast_on_cpu(tmp_path):
    """dtype=bfloat16 runs the autocast path (as on CUDA) with float32 master weights."""
    res = T.train(micro(tmp_path, dtype="bfloat16", steps=4, eval_every=0))
    assert all(p.dtype == torch.float32 for p in res.model.parameters())
    evals = [r for r in T.read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


@pytest.mark.gpu
def test_train_and_resume_on_cuda(tmp_path):
    """bf16 autocast on CUDA; resume continues the same curve (cuBLAS/attention kernels
    need not be bitwise reproducible, so a tolerance)."""
    straight = T.train(micro(tmp_path, "straight", device="cuda", dtype="auto"))
    assert "peak_cuda_memory_gib" in straight.summary
    T.train(micro(tmp_path, "resumed", device="cuda", steps=4, lr_decay_steps=8))
    T.train(micro(tmp_path, "resumed", device="cuda"),
            resume=T.find_checkpoint(None, tmp_path / "resumed"))
    a = [r["loss"] for r in T.read_metrics(tmp_path / "straight" / "metrics.jsonl")
         if r["kind"] == "train"]
    b = [r["loss"] for r in T.read_metrics(tmp_path / "resumed" / "metrics.jsonl")
         if r["kind"] == "train"]
    assert len(a) == len(b) == 8
    assert a[:4] == pytest.approx(b[:4], rel=1e-2) and a[4:] == pytest.approx(b[4:], rel=2e-2)
    evals = [r for r in T.read_metrics(tmp_path / "straight" / "metrics.jsonl")
             if r["kind"] == "eval"]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_cli_bench_subcommand_when_present():
    pytest.importorskip("lrmoe.bench.cli")
    from lrmoe.cli import build_parser

    args = build_parser().parse_args(["bench", "layer", "--smoke", "--out", "x"])
    assert args.command == "bench" and args.benchmark == "layer" and args.smoke
    assert callable(args.func)


def test_resume_of_a_finished_run_changes_nothing(tmp_path):
    """--resume on a run already at its last step trains nothing and keeps the run's
    metrics and summary as they were."""
    cfg = micro(tmp_path, steps=3)
    T.train(cfg, overwrite=True)
    out = Path(cfg.run.out_dir)
    before = {f: (out / f).read_bytes() for f in ("metrics.jsonl", "summary.json")}
    ckpt = T.find_checkpoint(None, out)
    result = T.train(cfg, resume=ckpt)
    assert result.step == 3
    for f, data in before.items():
        assert (out / f).read_bytes() == data, f


# ---------------------------------------------------------------------------- a new user's start
def _bad_start(tmp_path, case, monkeypatch):
    """(config, expected exception, message) of a start that must fail before writing."""
    cfg = micro(tmp_path, steps=2, eval_every=0)
    if case == "malformed":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"instruction": "x", "output": "y"}\n{not json\n')
        return cfg.replace(data=f"alpaca:{bad}"), ValueError, "malformed JSON"
    if case == "missing":
        return cfg.replace(data=f"alpaca:{tmp_path / 'nope.jsonl'}"), FileNotFoundError, "nope"
    if case == "device":
        return cfg.replace(device="cuda:99"), ValueError, "run.device"
    if case == "init_from":
        return cfg.replace(init_from=str(tmp_path / "nomodel")), FileNotFoundError, "config.json"
    if case == "tokenizer":
        return cfg.replace(tokenizer=str(tmp_path / "no.json")), FileNotFoundError, "no.json"
    if case == "ctrl_c":
        from lrmoe.training import setup

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr(setup, "load_data", interrupted)
        return cfg, KeyboardInterrupt, None
    assert case == "ep"
    from transformers import Qwen3MoeConfig

    model_dir = tmp_path / "model"
    Qwen3MoeConfig(num_experts=4).save_pretrained(model_dir)
    return (cfg.replace(init_from=str(model_dir), ep_size=3), ValueError,
            r"parallel\.ep_size=3 must divide num_experts of .*=4")


@pytest.mark.parametrize("case", ["malformed", "missing", "device", "init_from", "tokenizer",
                                  "ctrl_c", "ep"])
def test_a_failed_start_writes_nothing(tmp_path, monkeypatch, case):
    cfg, exc, msg = _bad_start(tmp_path, case, monkeypatch)
    with pytest.raises(exc, match=msg):
        T.train(cfg)
    assert not Path(cfg.run.out_dir).exists()


def test_same_command_runs_after_a_failed_start(tmp_path, monkeypatch):
    cfg, _, _ = _bad_start(tmp_path, "ctrl_c", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        T.train(cfg)
    monkeypatch.undo()
    # a folder left by an earlier version's failed start (an empty metrics.jsonl, a plot of
    # step 0) holds no step: it is reused without --overwrite
    out = Path(cfg.run.out_dir)
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "val_loss": 1.0}\n')
    assert T.train(cfg).step == 2
    assert [r["step"] for r in T.read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 2]


def test_interrupted_saves_are_removed_at_the_next_start(tmp_path):
    cfg = micro(tmp_path, steps=2, eval_every=0)
    T.train(cfg)
    root = Path(cfg.run.out_dir) / "checkpoints"
    (root / ".tmp-step-00000003-4242").mkdir()
    (root / ".tmp-step-00000003-4242" / "model.safetensors").write_bytes(b"half")
    (root / ".old-step-00000002-4242").mkdir()
    T.train(cfg.replace(steps=3), resume=T.find_checkpoint(None, cfg.run.out_dir))
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003"]


def test_largest_seed_trains(tmp_path):
    res = T.train(micro(tmp_path, steps=2, eval_every=0, metric="random", seed=2 ** 63 - 1))
    assert res.step == 2


# ---------------------------------------------------------------------------- padding, packing
def _tiny_lm(attn: str = "sdpa", seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3MoeConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                        num_experts_per_tok=2, attn_implementation=attn)
    return Qwen3MoeForCausalLM(hf).eval()


def ref_switch_loss(router_logits, real, num_experts, top_k):
    """Switch-Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6, as transformers
    sums it over layers) in float64 over the rows ``real`` only: E * sum_e f_e * P_e with
    f_e = top-k assignments to e / rows, P_e = mean router probability of e."""
    counts = torch.zeros(num_experts, dtype=torch.float64)
    probs = torch.zeros(num_experts, dtype=torch.float64)
    rows = 0
    for layer in router_logits:
        p = torch.softmax(layer[real].double(), dim=-1)
        for t in range(p.shape[0]):
            for e in torch.topk(p[t], top_k).indices.tolist():
                counts[e] += 1
        probs += p.sum(0)
        rows += p.shape[0]
    return float(num_experts * ((counts / rows) * (probs / rows)).sum())


def test_load_balancing_loss_counts_only_real_tokens():
    """Our auxiliary loss equals the float64 reference over the real tokens; transformers'
    own equals the reference over every token, padding included. A fixed seed and a sharpened
    router keep the two references apart (a near-uniform random router makes them agree to
    1e-5, which made a random-seed version of this test flaky)."""
    from lrmoe.data import TokenBlocks
    from lrmoe.training.batches import make_batch
    from lrmoe.training.loss import lm_forward

    model = _tiny_lm(seed=0)
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.gate.weight.mul_(50.0)
    ids = torch.randint(0, 50, (3, 12))
    seg = torch.tensor([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12, [1] * 7 + [0] * 5])
    batch = make_batch(TokenBlocks(ids, ids.clone(), seg), slice(0, 3), True)
    with torch.no_grad():
        _, aux = lm_forward(model, batch, aux_loss=True)
        out = model(input_ids=ids, position_ids=batch.position_ids_BS, use_cache=False,
                    output_router_logits=True)
    want = ref_switch_loss(out.router_logits, (seg != 0).reshape(-1), 4, 2)
    with_padding = ref_switch_loss(out.router_logits, torch.ones(36, dtype=torch.bool), 4, 2)
    assert abs(want - with_padding) > 1e-3 * with_padding, "the references must differ"
    assert float(aux) == pytest.approx(want, rel=1e-5)
    assert float(out.aux_loss) == pytest.approx(with_padding, rel=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_example_sees_only_itself(attn):
    """The second example of a packed block gets the logits it gets alone; without
    isolation it does not (so the check can fail)."""
    from lrmoe.data import TokenBlocks
    from lrmoe.data.packing import pack_examples
    from lrmoe.training.batches import make_batch
    from lrmoe.training.loss import lm_forward

    model = _tiny_lm(attn, seed=int.from_bytes(os.urandom(4), "little"))
    a, b = torch.randint(2, 50, (5,)).tolist(), torch.randint(2, 50, (7,)).tolist()
    packed = pack_examples([a[:2], b[:3]], [a[2:], b[3:]], seq_len=16, eos_id=0, pad_id=1)
    assert packed.input_ids_NS.shape[0] == 1  # both in one block, then 2 pads
    blocks = TokenBlocks(packed.input_ids_NS, packed.labels_NS, packed.segment_ids_NS)
    alone_ids = torch.tensor([b + [0]])
    with torch.no_grad():
        alone = model(input_ids=alone_ids).logits[0]
        packed_logits, _ = lm_forward(model, make_batch(blocks, slice(0, 1), True),
                                      aux_loss=False)
        joined, _ = lm_forward(model, make_batch(blocks, slice(0, 1), False), aux_loss=False)
    torch.testing.assert_close(packed_logits[0, 6:14], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(joined[0, 6:14], alone, rtol=1e-3, atol=1e-3)


def test_each_rank_builds_only_its_own_batches():
    """Ranks take the global batches j*W + r of one order (lrmoe.data.batches, epoch after
    epoch) and gather only their own blocks."""
    from lrmoe.data import TokenBlocks, batches
    from lrmoe.training.batches import BatchStream

    ids = torch.arange(23 * 3).reshape(23, 3)
    order = [x for e in range(3)
             for _, x, _ in batches(TokenBlocks(ids, ids.clone()), 4, seed=5, epoch=e)]

    class Counting:
        """input_ids that count the rows gathered."""

        def __init__(self, t):
            self.t, self.rows, self.shape = t, 0, t.shape

        def __getitem__(self, index):
            out = self.t[index]
            self.rows += out.shape[0]
            return out

    class CountingBlocks:
        def __init__(self, t):
            self.input_ids, self.labels = Counting(t), t.clone()

        def __len__(self):
            return self.labels.shape[0]

    for rank in (0, 1):
        counted = CountingBlocks(ids)
        stream = BatchStream(counted, 4, 5, world=2, rank=rank)
        got = [stream.next() for _ in range(8)]
        for j, (batch, tokens) in enumerate(got):
            assert torch.equal(batch.input_ids_BS, order[2 * j + rank])
            assert tokens == order[2 * j].numel() + order[2 * j + 1].numel()
        assert counted.input_ids.rows == sum(order[2 * j + rank].shape[0] for j in range(8))
    assert stream.position() == {"epoch": 2, "index": 4}  # 16 batches, 6 per epoch


# ---------------------------------------------------------------------------- tensorboard, old runs
def test_tensorboard_holds_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = micro(tmp_path, steps=3, eval_every=0, tensorboard=True)
    T.train(cfg)
    out = Path(cfg.run.out_dir)
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    records = T.read_metrics(out / "metrics.jsonl")
    for kind, key in (("train", "loss"), ("train", "lr"), ("train", "grad_norm"),
                      ("train", "aux_loss"), ("train", "dropped_fraction"),
                      ("eval", "val_loss"), ("eval", "val_ppl")):
        want = [(r["step"], r[key]) for r in records if r["kind"] == kind]
        got = [(e.step, e.value) for e in acc.Scalars(f"{kind}/{key}")]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key


def test_flat_train_config_of_an_earlier_version_resumes(tmp_path):
    cfg = micro(tmp_path, steps=2, eval_every=0)
    T.train(cfg)
    ckpt = T.find_checkpoint(None, cfg.run.out_dir)
    nested = json.loads((ckpt / "train_config.json").read_text())
    # the flat layout the previous version wrote: model nested, everything else top-level
    flat = {"model": {k: v for k, v in nested["model"].items() if k != "init_from"},
            "init_from": nested["model"]["init_from"]}
    for section in ("data", "optim", "lrmoe", "parallel", "run"):
        for key, value in nested[section].items():
            if key not in ("isolate_examples", "tensorboard"):  # did not exist then
                flat["data" if key == "source" else key] = value
    (ckpt / "train_config.json").write_text(json.dumps(flat))
    assert T.read_checkpoint_config(ckpt) == cfg
    assert T.train(cfg.replace(steps=3), resume=ckpt).step == 3


def _val_texts(cfg: TrainConfig) -> list:
    from lrmoe.training.setup import load_run_data
    data = load_run_data(cfg, None)
    return [data.tokenizer.decode(row.tolist()) for row in data.val.input_ids]


def test_the_validation_split_stays_fixed_across_run_seeds(tmp_path):
    """data.split_seed (default 0) salts the split, not run.seed: seeds 0 and 1 hold out
    the same text, so their differences are paired; split_seed=None follows run.seed
    (the behaviour before the field) and moves it."""
    cfg = micro(tmp_path)
    assert cfg.data.split_seed == 0
    fixed = [_val_texts(cfg.replace(seed=s)) for s in (0, 1)]
    assert fixed[0] == fixed[1] and fixed[0]
    moving = [_val_texts(cfg.replace(seed=s, split_seed=None)) for s in (0, 1)]
    assert moving[0] == fixed[0]  # None at seed 0 is the same salt as split_seed 0
    assert moving[1] != moving[0]
    with pytest.raises(ValueError, match="data.split_seed"):
        cfg.replace(split_seed=-1)


def test_a_checkpoint_without_split_seed_resumes_on_its_own_split(tmp_path):
    """A train_config.json written before data.split_seed existed reads as split_seed =
    None (its split was salted by run.seed), not the new default 0."""
    cfg = micro(tmp_path, steps=2, eval_every=0, seed=1)
    T.train(cfg)
    ckpt = T.find_checkpoint(None, cfg.run.out_dir)
    saved = json.loads((ckpt / "train_config.json").read_text())
    del saved["data"]["split_seed"]
    (ckpt / "train_config.json").write_text(json.dumps(saved))
    old = T.read_checkpoint_config(ckpt)
    assert old.data.split_seed is None and old == cfg.replace(split_seed=None)
