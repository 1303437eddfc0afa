"""``lrmoe export`` and the trainer's export at the end of a run (lrmoe/training/export.py).

The references are independent of the code under test: the export is loaded by plain
transformers (``AutoModelForCausalLM`` / ``AutoTokenizer``) in a subprocess where lrmoe
cannot be imported (checked there), and its logits are compared with those of lrmoe's own
trained model -- the patched model a run returns: in this process for a single-process run,
and for an EP = 2 run on its 2 gloo ranks under torchrun (each rank holding its own expert
shard). Token ids are compared with the trainer's own encoding
(``lrmoe.data.packing.encode_texts``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_expert_parallel import _free_port  # noqa: E402
from test_train import micro  # noqa: E402

from lrmoe.cli import main
from lrmoe.training import train as T

#: digits and spaces: a tokenizer class that rebuilds the pre-tokenizer (Qwen2Tokenizer,
#: what AutoTokenizer picks from config.json without tokenizer_config.json) splits them
TEXTS = ["Define apple 3.\nbriefly apple: river stone 42.", "  quiet  green 2026 window"]
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json")

#: runs with lrmoe off sys.path (the venv's lrmoe-checkout.pth is its only install) and
#: writes what plain transformers makes of each folder
PLAIN_LOAD = r"""
import importlib.util, os, sys
sys.path[:] = [p for p in sys.path
               if not os.path.isfile(os.path.join(p or os.getcwd(), "lrmoe", "__init__.py"))]
assert importlib.util.find_spec("lrmoe") is None, sys.path
try:
    import lrmoe
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("lrmoe is importable: " + lrmoe.__file__)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
job = torch.load(sys.argv[1])
out = {}
for d in job["models"]:
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = m(input_ids=job["ids"]).logits
    sd = m.state_dict()
    out[d] = {"logits": logits, "class": type(m).__module__ + "." + type(m).__name__,
              "experts": sd["model.layers.0.mlp.experts.gate_up_proj"].shape[0],
              "eos": m.generation_config.eos_token_id, "pad": m.generation_config.pad_token_id}
for d in job["tokenizers"]:
    t = AutoTokenizer.from_pretrained(d)
    out["tok:" + d] = {
        "pad": t.pad_token, "pad_id": t.pad_token_id, "eos_id": t.eos_token_id,
        "bos_id": t.bos_token_id,
        "ids": [t(x, add_special_tokens=False)["input_ids"] for x in job["texts"]],
        "ids_default": [t(x)["input_ids"] for x in job["texts"]]}
assert not [k for k in sys.modules if k == "lrmoe" or k.startswith("lrmoe.")]
torch.save(out, sys.argv[2])
"""


def plain_load(tmp: Path, models=(), tokenizers=(), ids=None) -> dict:
    """What plain transformers, without lrmoe, loads from each folder (a subprocess in
    isolated mode, cwd outside the repo)."""
    job, result = tmp / "plain-job.pt", tmp / "plain-out.pt"
    torch.save({"models": [str(m) for m in models], "tokenizers": [str(t) for t in tokenizers],
                "ids": ids, "texts": TEXTS}, job)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-I", "-c", PLAIN_LOAD, str(job), str(result)],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(result)


def trainer_ids(tokenizer_json: Path) -> list:
    """The ids the trainer gives ``TEXTS`` (its own encoding function)."""
    from tokenizers import Tokenizer
    from lrmoe.data.packing import encode_texts
    return [list(map(int, x)) for x in encode_texts(Tokenizer.from_file(str(tokenizer_json)),
                                                     TEXTS)]


def check_tokenizer(got: dict, tokenizer_json: Path) -> None:
    want = trainer_ids(tokenizer_json)
    assert got["ids"] == want and got["ids_default"] == want, (got, want)
    # the trained BPE: 0 = <|endoftext|> (eos), 1 = <|pad|>, no bos (lrmoe/data/tokenizer.py)
    assert (got["pad"], got["pad_id"], got["eos_id"], got["bos_id"]) == ("<|pad|>", 1, 0, None)


def fixed_ids(vocab: int) -> torch.Tensor:
    return torch.randint(2, vocab, (2, 16), generator=torch.Generator().manual_seed(7))


def cli(capsys, *args):
    """``lrmoe ARGS`` in this process: (exit status, stderr)."""
    rc = main(list(args))
    return rc, capsys.readouterr().err


# ------------------------------------------------------------------- the runs
#: run under torchrun: the trainer itself (what ``lrmoe train --ep 2`` runs), then the EP
#: run's own final model -- every rank its expert shard, all-to-all between them -- gives
#: the reference logits
EP_SCRIPT = r"""
import os, sys
import torch
import torch.distributed as dist
from lrmoe.training import train as T
res = T.train(T.build_config(config_file=sys.argv[1]))
assert res.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 2
with torch.no_grad():
    logits = res.model.eval()(input_ids=torch.load(sys.argv[2])).logits
if dist.get_rank() == 0:
    torch.save({"logits": logits, "export": str(res.export)}, sys.argv[3])
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # gloo's teardown race at interpreter exit (test_expert_parallel._worker)
"""


def _torchrun_script(script: Path, args, cwd: Path):
    """``torchrun --nproc-per-node 2 SCRIPT ARGS`` on loopback gloo, as
    test_expert_parallel._torchrun launches ``lrmoe train``."""
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(_free_port()), str(script), *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 3-step single-process run and a 2-step EP = 2 run (checkpoints at steps 1, 2),
    each exported by the trainer; the single-process run also by the command, sharded;
    and what plain transformers without lrmoe loads from every export and checkpoint."""
    root = tmp_path_factory.mktemp("export")
    one = T.train(micro(root, "one", steps=3, eval_every=0))
    sharded = root / "sharded"
    assert main(["export", str(one.out_dir), str(sharded), "--max-shard-size", "20KB"]) == 0
    vocab = json.loads((one.checkpoint / "config.json").read_text())["vocab_size"]
    ids = fixed_ids(vocab)
    with torch.no_grad():
        one_logits = one.model.eval()(input_ids=ids).logits

    cfg_file, ids_file, ep_out = root / "ep.yaml", root / "ids.pt", root / "ep-logits.pt"
    cfg_file.write_text(T.config_yaml(micro(root, "ep", steps=2, eval_every=0, save_every=1,
                                            ep_size=2)))
    torch.save(ids, ids_file)
    (root / "ep_run.py").write_text(EP_SCRIPT)
    r = _torchrun_script(root / "ep_run.py", [cfg_file, ids_file, ep_out], root)
    assert r.returncode == 0, r.stderr[-3000:]
    ep = torch.load(ep_out)
    ep_run = root / "ep"
    ep_ckpt = ep_run / "checkpoints" / "step-00000002"
    plain = plain_load(root, models=[one.export, sharded, ep_run / "export"],
                       tokenizers=[one.export, one.checkpoint, ep_run / "export", ep_ckpt],
                       ids=ids)
    return dict(root=root, one=one, one_logits=one_logits, sharded=sharded, ep_run=ep_run,
                ep_ckpt=ep_ckpt, ep=ep, plain=plain)


QWEN3 = "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeForCausalLM"


def test_single_process_export_loads_in_plain_transformers_with_equal_logits(runs):
    one, sharded, plain = runs["one"], runs["sharded"], runs["plain"]
    run, ckpt = one.out_dir, one.checkpoint
    assert one.export == run / "export"  # run.export: on by default
    assert all((run / "export" / f).is_file() for f in MODEL_FILES + ("model.safetensors",))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # --max-shard-size 20KB: shards
    assert not (sharded / "model.safetensors").exists()
    for d in (run / "export", sharded):
        g = plain[str(d)]
        assert g["class"] == QWEN3 and g["experts"] == 4 and (g["eos"], g["pad"]) == (0, 1)
        torch.testing.assert_close(g["logits"], runs["one_logits"], rtol=0, atol=1e-5)
    # the export's tokenizer, and the checkpoint's own one (tokenizer_config.json, issue 27)
    assert (ckpt / "tokenizer_config.json").is_file()
    for d in (run / "export", ckpt):
        check_tokenizer(plain[f"tok:{d}"], ckpt / "tokenizer.json")


def test_ep2_export_gathers_the_shards_with_the_ep_models_logits(runs):
    ep_run, ep, plain = runs["ep_run"], runs["ep"], runs["plain"]
    export = ep_run / "export"
    assert ep["export"] == str(export)
    from test_expert_parallel import _chunks  # each ep rank's expert rows, stored once
    assert _chunks(ep_run / "checkpoints" / "step-00000002",
                   "model.model.layers.0.mlp.experts.down_proj") == [0, 2]
    assert all((export / f).is_file() for f in MODEL_FILES + ("model.safetensors",))
    g = plain[str(export)]
    assert g["class"] == QWEN3 and g["experts"] == 4  # E = 4 whole, from 2 shards of 2
    torch.testing.assert_close(g["logits"], ep["logits"], rtol=0, atol=1e-5)
    # the EP run's shards are not the single-process run's model (a different batch/run)
    assert not torch.allclose(g["logits"], runs["one_logits"], atol=1e-3)
    for d in (export, runs["ep_ckpt"]):
        check_tokenizer(plain[f"tok:{d}"], runs["ep_ckpt"] / "tokenizer.json")


def test_stopped_run_and_export_false_write_no_export(tmp_path):
    def stop(trainer, step):
        trainer.request_stop()
    res = T.train(micro(tmp_path, steps=3, eval_every=0), step_callback=stop)
    assert res.interrupted and res.export is None and res.checkpoint is not None
    assert not (res.out_dir / "export").exists()
    res = T.train(micro(tmp_path, steps=3, eval_every=0, export=False),
                  resume=res.checkpoint)
    assert not res.interrupted and res.step == 3 and res.export is None
    assert not (res.out_dir / "export").exists()


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns(".lrmoe.lock", "export"))
    return to


def test_bad_inputs_are_refused_in_one_line(runs, tmp_path, capsys):
    run = runs["ep_run"]

    def refused(*args, says):
        rc, err = cli(capsys, "export", *map(str, args))
        assert rc == 2 and err.count("\n") == 1 and err.startswith("lrmoe export: error: "), err
        for part in says:
            assert part in err, (part, err)

    refused(tmp_path / "nope", tmp_path / "o", says=["RUN_DIR", "does not exist", "--out"])
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", tmp_path / "o", says=["RUN_DIR", "holds no checkpoint"])
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    refused(run, busy, says=["OUT", "not empty", "--overwrite"])
    refused(run, tmp_path / "o", "--max-shard-size", "lots", says=["--max-shard-size", "5GB"])
    refused(run / "checkpoints" / "step-00000002", run / "checkpoints" / "step-00000002",
            "--overwrite", says=["OUT", "holds the checkpoint"])
    assert not (tmp_path / "o").exists()

    # a chunk file of the DCP state missing: the file named, and what to do
    lost = _copy(run, tmp_path / "lost")
    state = lost / "checkpoints" / "step-00000002" / "state"
    chunk = sorted(state.glob("*.distcp"))[-1]
    chunk.unlink()
    refused(lost, tmp_path / "o", says=[str(chunk), "missing", "incomplete"])
    # a checkpoint of the per-rank format of earlier versions: named, not guessed at
    old = _copy(run, tmp_path / "old")
    shutil.rmtree(old / "checkpoints" / "step-00000002" / "state")
    refused(old, tmp_path / "o", says=["neither a state/ folder nor model.safetensors",
                                       "before checkpoint format 2"])
    assert not (tmp_path / "o").exists()

    # --overwrite replaces the folder's contents; the command writes what the run wrote
    rc, err = cli(capsys, "export", str(run), str(busy), "--overwrite")
    assert rc == 0, err
    assert sorted(p.name for p in busy.iterdir()) == sorted(MODEL_FILES + ("model.safetensors",))
    from safetensors.torch import load_file
    a, b = (load_file(str(d / "model.safetensors")) for d in (busy, run / "export"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
