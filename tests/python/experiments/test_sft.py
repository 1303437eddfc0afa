"""The SFT setting: the WordNet builder (lrmoe/data/wordnet.py), the refusal of a fine-tune
without the model's tokenizer, and experiments/sft.py end to end on a micro model.

The builder is checked on a hand-written database in the WordNet 3.0 file format against
records written out by hand; the recipe is checked by re-computing the base model's loss on
the fine-tuning validation data (plain transformers model loaded from the base checkpoint)
and comparing it with the step-0 evaluation of every fine-tune.
"""
import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "experiments"))

import sft  # noqa: E402
from lrmoe.training import train as T  # noqa: E402
from lrmoe.data import wordnet as W  # noqa: E402

LICENCE = ("  1 Fixture licence, line one.  \n"
           "  2 WordNet 3.0 Copyright 2006 by Princeton University.  \n")
FILES = {
    "data.noun": """\
00000100 03 n 02 bank 0 depository_financial_institution 0 001 @ 00000300 n 0000 | a financial institution; "he cashed a check at the bank"  
00000200 17 n 01 bank 1 000 | sloping land beside water; "they pulled the canoe up on the bank"; "the embankment"  
00000300 14 n 02 financial_institution 0 financial_organization 0 000 | an institution that deals with money  
00000400 15 n 01 Paris 0 001 @i 00000500 n 0000 | the capital of France  
00000500 15 n 01 national_capital 0 000 | the capital city of a nation  
""",
    "index.noun": """\
bank n 2 1 @ 2 1 00000100 00000200  
financial_institution n 1 0 1 0 00000300  
national_capital n 1 0 1 0 00000500  
paris n 1 1 @i 1 0 00000400  
""",
    "data.verb": """\
00000600 29 v 02 warm_up 0 limber_up 0 001 @ 00000700 v 0000 01 + 09 00 | prepare for exercise; "the athletes warmed up before the race"  
00000700 29 v 01 prepare 0 000 01 + 08 00 | make ready  
""",
    "index.verb": """\
prepare v 1 0 1 0 00000700  
warm_up v 1 1 @ 1 0 00000600  
""",
    "data.adj": """\
00000800 00 a 02 quick(a) 0 speedy 0 000 | moving fast; "a quick runner"  
""",
    "index.adj": """\
quick a 1 0 1 0 00000800  
speedy a 1 0 1 0 00000800  
""",
    "data.adv": """\
00000900 02 r 01 fast 0 000 | quickly; "he ran fast"  
""",
    "index.adv": """\
fast r 1 0 1 0 00000900  
""",
}


def rec(task, instruction, inp, output):
    return {"task": task, "instruction": instruction, "input": inp, "output": output}


#: Written by hand from FILES and the rules of lrmoe/data/wordnet.py's docstring.
EXPECTED = [
    rec("definition", "Define the noun below.", "bank",
        "1. a financial institution\n2. sloping land beside water"),
    rec("synonyms", "Give synonyms of the noun below.", "bank",
        "depository financial institution"),
    rec("sentence", 'Use the word "bank" in a sentence.', "", "he cashed a check at the bank"),
    rec("hypernym", 'What kind of thing is "bank"?', "",
        "Bank is a kind of financial institution."),
    rec("definition", "Define the noun below.", "financial institution",
        "an institution that deals with money"),
    rec("synonyms", "Give synonyms of the noun below.", "financial institution",
        "financial organization"),
    rec("definition", "Define the noun below.", "national capital",
        "the capital city of a nation"),
    rec("definition", "Define the noun below.", "Paris", "the capital of France"),
    rec("hypernym", 'What kind of thing is "Paris"?', "",
        "Paris is an instance of national capital."),
    rec("definition", "Define the verb below.", "prepare", "make ready"),
    rec("definition", "Define the verb below.", "warm up", "prepare for exercise"),
    rec("synonyms", "Give synonyms of the verb below.", "warm up", "limber up"),
    rec("sentence", 'Use the word "warm up" in a sentence.', "",
        "the athletes warmed up before the race"),
    rec("hypernym", 'What is a more general verb than "warm up"?', "",
        "To warm up is a way to prepare."),
    rec("definition", "Define the adjective below.", "quick", "moving fast"),
    rec("synonyms", "Give synonyms of the adjective below.", "quick", "speedy"),
    rec("sentence", 'Use the word "quick" in a sentence.', "", "a quick runner"),
    rec("definition", "Define the adjective below.", "speedy", "moving fast"),
    rec("synonyms", "Give synonyms of the adjective below.", "speedy", "quick"),
    rec("definition", "Define the adverb below.", "fast", "quickly"),
    rec("sentence", 'Use the word "fast" in a sentence.', "", "he ran fast"),
]


@pytest.fixture
def wordnet_dir(tmp_path):
    root = tmp_path / "wordnet"
    root.mkdir()
    for name, text in FILES.items():
        (root / name).write_text(LICENCE + text)
    return root


# ---------------------------------------------------------------------------- builder
def test_builder_matches_hand_written_records(wordnet_dir):
    assert W.build_records(wordnet_dir) == EXPECTED
    one = W.build_records(wordnet_dir, max_senses=1)
    assert one[0]["output"] == "a financial institution" and one[1:] == EXPECTED[1:]


def test_build_writes_jsonl_the_alpaca_reader_reads_and_the_licence(wordnet_dir, tmp_path):
    from lrmoe.data.sources import alpaca_prompt, read_alpaca

    out = tmp_path / "sft" / "wn.jsonl"
    counts = W.build(out, wordnet_dir)
    assert counts == {"definition": 9, "synonyms": 5, "sentence": 4, "hypernym": 3,
                      "total": 21} == {**{t: sum(r["task"] == t for r in EXPECTED)
                                          for t in W.TASKS}, "total": len(EXPECTED)}
    assert [json.loads(l) for l in out.read_text().splitlines()] == EXPECTED
    found = read_alpaca(out)
    assert found.total == len(EXPECTED) and not found.skipped
    assert found.records[0].prompt == alpaca_prompt("Define the noun below.", "bank")
    assert found.records[2].prompt == alpaca_prompt('Use the word "bank" in a sentence.')
    licence = Path(str(out) + ".LICENSE.txt").read_text()
    assert "Fixture licence, line one." in licence and "Princeton" in licence
    assert "  1 " not in licence


def test_mentions_takes_inflections_not_other_words():
    assert W.mentions("The athletes Warmed  up early", "warm up")
    assert W.mentions("toning the muscles", "tone") and W.mentions("she tones", "tone")
    assert not W.mentions("the embankment", "bank")
    assert not W.mentions("warm water", "warm up")


def test_builder_errors_name_the_fix(tmp_path, wordnet_dir):
    with pytest.raises(FileNotFoundError, match="apt-get install wordnet-base"):
        W.build_records(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="max_senses"):
        W.build_records(wordnet_dir, max_senses=0)
    (wordnet_dir / "data.verb").write_text(LICENCE + "00000600 29 v zz warm_up\n")
    with pytest.raises(ValueError, match=r"data\.verb, line 3: not a WordNet data line"):
        W.build_records(wordnet_dir)


def test_cli_builds_the_file(wordnet_dir, tmp_path, capsys):
    from lrmoe.cli import main

    out = tmp_path / "cli.jsonl"
    assert main(["data", "wordnet-alpaca", "--out", str(out), "--wordnet-dir",
                 str(wordnet_dir)]) == 0
    assert len(out.read_text().splitlines()) == len(EXPECTED)
    assert f"wrote {len(EXPECTED)} records" in capsys.readouterr().out


# ---------------------------------------------------------------------------- tokenizer
def test_fine_tune_without_the_models_tokenizer_refuses(tmp_path):
    """A transformers directory without tokenizer.json and no --tokenizer: a new BPE
    would not match the embeddings, so the run stops before writing anything."""
    from transformers import Qwen3MoeConfig

    model = tmp_path / "model"
    Qwen3MoeConfig(num_experts=4).save_pretrained(model)
    cfg = T.build_config("tiny", overrides={"init_from": str(model), "device": "cpu",
                                            "out_dir": str(tmp_path / "run")})
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json.*--tokenizer"):
        T.train(cfg)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- the grid
def test_grid_covers_rates_and_settings():
    args = sft.argparse.Namespace(seeds=[0, 1], rates=[0.2, 0.3, 0.5],
                                  settings=["lrm:topk", "lrm:importance", "random:topk"])
    cells = sft.sft_cells(args)
    got = {(c.labels["setting"], c.labels["rate"], c.labels["seed"]) for c in cells}
    want = {("c=0", 0.0, s) for s in (0, 1)} | {
        (f"{m} {sel}", c, s) for m, sel in (("lrm", "topk"), ("lrm", "importance"),
                                           ("random", "topk"))
        for c in (0.2, 0.3, 0.5) for s in (0, 1)}
    assert got == want and len(cells) == len(want)
    random_cell = next(c for c in cells if c.name == "sft-random-topk-c0.5-s1")
    assert random_cell.args == ["-c", "0.5", "--metric", "random", "--selection", "topk",
                                "--set", "seed=1"]
    with pytest.raises(ValueError, match="METRIC:SELECTION"):
        sft.parse_settings(["lrm"])


def test_grid_quota_rules_and_adaptive_cells():
    """A third field names the quota rule (and only then the cell name and arguments carry
    it); --targets add one adaptive cell per adaptive setting, target and seed."""
    args = sft.argparse.Namespace(seeds=[0], rates=[0.3],
                                  settings=["lrm:topk", "lrm:importance:water_level"],
                                  targets=[0.99, 0.995], adaptive_settings=["lrm:importance"],
                                  cap=0.5)
    by_name = {c.name: c for c in sft.sft_cells(args)}
    assert set(by_name) == {"sft-c0-s0", "sft-lrm-topk-c0.3-s0",
                            "sft-lrm-importance-water_level-c0.3-s0",
                            "sft-lrm-importance-rho0.99-cap0.5-s0",
                            "sft-lrm-importance-rho0.995-cap0.5-s0"}
    assert by_name["sft-lrm-importance-water_level-c0.3-s0"].args == [
        "-c", "0.3", "--metric", "lrm", "--selection", "importance", "--quota-rule",
        "water_level", "--set", "seed=0"]
    adaptive = by_name["sft-lrm-importance-rho0.99-cap0.5-s0"]
    assert adaptive.args == ["-c", "0.5", "--retained-mass-target", "0.99", "--metric", "lrm",
                             "--selection", "importance", "--set", "seed=0"]
    assert adaptive.labels["setting"] == "lrm importance rho*=0.99"
    assert adaptive.labels["target"] == 0.99 and adaptive.labels["rate"] == 0.5


@pytest.mark.parametrize("item, match", [
    ("lrm:topk:water", "unknown quota rule 'water'"),
    ("lrn:topk", "unknown metric 'lrn'"),
    ("lrm:top_k", "unknown selection 'top_k'"),
    ("lrm:topk:water_level:x", "METRIC:SELECTION"),
    ("lrm::water_level", "METRIC:SELECTION")])
def test_bad_setting_is_named_before_the_base_runs(item, match):
    with pytest.raises(ValueError, match=match):
        sft.parse_settings([item])


MICRO = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
         "model.num_key_value_heads=1", "model.head_dim=16", "model.intermediate_size=64",
         "model.moe_intermediate_size=16", "model.num_experts=4", "data.vocab_size=300",
         "data.seq_len=256", "data.batch_size=2", "run.eval_batches=2", "run.save_every=0",
         "run.torch_threads=1"]


def test_recipe_end_to_end_starts_every_fine_tune_from_the_base(tmp_path, wordnet_dir,
                                                                monkeypatch):
    """Pre-train 2 steps on real text, fine-tune 2 cells 2 steps on the builder's data:
    each fine-tune's step-0 validation loss is the base checkpoint's loss on the
    fine-tuning validation data, and its tokenizer is the base's, byte for byte."""
    from transformers import AutoModelForCausalLM

    from lrmoe.data import load_data
    from lrmoe.training.loss import evaluate

    monkeypatch.setenv("LRMOE_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "wn.jsonl"
    W.build(data, wordnet_dir)
    out = tmp_path / "grid"
    argv = ["--preset", "tiny", "--device", "cpu", "--seeds", "0", "--out", str(out),
            "--pretrain-data", f"text:{ROOT / 'docs' / 'algorithm.md'}",
            "--pretrain-steps", "2", "--sft-data", str(data), "--sft-steps", "2",
            "--settings", "lrm:topk", "--rates", "0.3", "--sft-warmup", "1",
            "--sft-set", "data.val_fraction=0.25", "--eval-every", "2",
            *[x for s in MICRO for x in ("--set", s)]]
    assert sft.main(argv) == 0
    base_ckpt = out / "base-c0-s0" / "checkpoints" / "step-00000002"
    assert json.loads((out / sft.BASE_FILE).read_text()) == {"checkpoint": str(base_ckpt)}
    records = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in records] == ["sft-c0-s0", "sft-lrm-topk-c0.3-s0"]

    base = _checkpoint_model(base_ckpt, tmp_path / "base-whole.pt")
    for r in records:
        run = out / r["name"]
        ckpt = run / "checkpoints" / "step-00000002"
        assert (ckpt / "tokenizer.json").read_bytes() == \
            (base_ckpt / "tokenizer.json").read_bytes()
        cfg = T.TrainConfig.from_dict(json.loads((ckpt / "train_config.json").read_text()))
        assert cfg.model.init_from == str(base_ckpt) and cfg.data.source == f"alpaca:{data}"
        assert r["summary"]["steps"] == 2 and [e["step"] for e in r["evals"]] == [0, 2]
        d = cfg.data
        ft = load_data(d.source, seq_len=d.seq_len, cache_dir=tmp_path / "ref-cache",
                       tokenizer=str(base_ckpt / "tokenizer.json"), val_fraction=0.25,
                       max_records=d.max_records, seed=cfg.run.seed)
        ref = evaluate(base, ft.val, d.batch_size, cfg.run.eval_batches,
                       torch.device("cpu"), None, d.isolate_examples)
        assert r["evals"][0]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
    assert (out / "report.md").read_text().startswith("Command: `python experiments/sft.py")
    assert (out / "sft_dppl.png").is_file() and (out / "sft_curves_lrm-topk.png").is_file()

    # the same command again runs nothing; another base for the same --out is refused
    logs = {p.name: p.stat().st_size for p in (out / "logs").iterdir()}
    assert sft.main(argv) == 0
    assert {p.name: p.stat().st_size for p in (out / "logs").iterdir()} == logs
    more = [("3" if a == "2" and argv[i - 1] == "--pretrain-steps" else a)
            for i, a in enumerate(argv)]
    with pytest.raises(ValueError, match="holds fine-tunes .* another --out"):
        sft.main(more)

    # a clone without the fine-tuning data re-makes the same table from the runs
    table = (out / "report.md").read_text().split("| setting")[1]
    data_flag = argv.index("--sft-data")
    assert sft.main(argv[:data_flag] + argv[data_flag + 2:] + ["--analyse-only"]) == 0
    assert (out / "report.md").read_text().split("| setting")[1] == table


def _checkpoint_model(ckpt, scratch):
    """The transformers model of an lrmoe checkpoint, its weights read by torch's own DCP
    converter (not lrmoe's loader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM
    dcp_to_torch_save(ckpt / "state", scratch)
    whole = torch.load(scratch, weights_only=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt),
                                             dtype=torch.float32)
    model.load_state_dict({k[len("model."):]: v for k, v in whole.items()
                           if k.startswith("model.")})
    return model.eval()


def test_base_check_refuses_another_base_not_another_spelling(tmp_path):
    """base.json written with --out relative still matches the same --out given absolute;
    a base of another step count (or seed) with fine-tunes already started is refused."""
    out = tmp_path / "grid"
    (out / "sft-c0-s0").mkdir(parents=True)
    (out / sft.BASE_FILE).write_text(json.dumps(
        {"checkpoint": "runs/grid/base-c0-s0/checkpoints/step-00000300"}))
    cells = [sft._grid.Cell("sft-c0-s0", [], {})]
    sft.check_base(out, out / "base-c0-s0" / "checkpoints" / "step-00000300", cells)
    with pytest.raises(ValueError, match="use another --out"):
        sft.check_base(out, out / "base-c0-s0" / "checkpoints" / "step-00000200", cells)
    with pytest.raises(ValueError, match="use another --out"):
        sft.check_base(out, out / "base-c0-s1" / "checkpoints" / "step-00000300", cells)
    sft.check_base(out, out / "base-c0-s1" / "checkpoints" / "step-00000300", [])  # none started


def test_fine_tune_problems_are_found_before_the_base_trains(tmp_path, wordnet_dir, capsys):
    """A bad fine-tune setting or a data file the fine-tunes cannot read stops the recipe
    at once, before the base pre-trains (which they used to wait for, then all fail)."""
    data = tmp_path / "wn.jsonl"
    W.build(data, wordnet_dir)
    bad = tmp_path / "bad.txt"
    bad.write_text("not json\n")
    out = tmp_path / "grid"
    argv = ["--preset", "tiny", "--device", "cpu", "--seeds", "0", "--out", str(out),
            "--pretrain-data", f"text:{ROOT / 'docs' / 'algorithm.md'}",
            "--pretrain-steps", "2", "--sft-steps", "2", "--settings", "lrm:topk",
            "--rates", "0.3", *[x for s in MICRO for x in ("--set", s)]]
    for extra, match in ((["--sft-data", str(bad)], r"--sft-data: .*bad\.txt, line 1: "
                                                    r"malformed JSON"),
                         (["--sft-data", str(data), "--sft-set", "bogus.key=1"],
                          r"the fine-tunes would not start: .*unknown config key 'bogus\.key'"),
                         (["--sft-data", str(data), "--sft-lr", "-1"],
                          r"the fine-tunes would not start: .*optim\.lr must be")):
        with pytest.raises(SystemExit) as exc:
            sft.main(argv + extra)
        assert exc.value.code == 2
        assert re.search(match, capsys.readouterr().err)
        assert not (out / "base-c0-s0").exists(), "the base trained before the check"


@pytest.mark.parametrize("text", ["[1]", '{"checkpoint": ', "\xff"])
def test_a_broken_base_record_is_named(tmp_path, text):
    out = tmp_path / "grid"
    out.mkdir()
    (out / sft.BASE_FILE).write_text(text)
    with pytest.raises(ValueError, match=r"base\.json is not the record this recipe writes"):
        sft.check_base(out, out / "base-c0-s0" / "checkpoints" / "step-00000002", [])


def test_the_base_perplexity_in_the_report_is_the_mean_of_its_last_evaluations(tmp_path):
    """The report's header gives the base's final perplexity by the definition every dPPL
    uses (the mean of the last --last-evals evaluations after step 0), not its last
    evaluation (what summary.json's last_val_ppl holds)."""
    import argparse

    out = tmp_path / "grid"
    run = out / "base-c0-s0"
    run.mkdir(parents=True)
    ppl = {0: 19795.6, 100: 61.0, 200: 55.5, 260: 54.0, 280: 52.25, 300: 50.0}
    lines = [json.dumps({"kind": "eval", "step": s, "val_loss": 1.0, "val_ppl": p,
                         "val_tokens": 10}) for s, p in ppl.items()]
    lines.insert(1, json.dumps({"kind": "train", "step": 1, "loss": 9.0}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 300, "last_val_ppl": 50.0}))
    args = argparse.Namespace(base_seed=0, pretrain_data="gcide", last_evals=3)
    assert sft.base_perplexity(out, args) == (
        "52.08, the mean of the evaluations at steps 260, 280, 300; 50 at the last one")
    assert (54.0 + 52.25 + 50.0) / 3 == pytest.approx(52.0833, abs=1e-4)  # by hand
    args.last_evals = 5  # more than the run has after step 0: all of them
    assert sft.base_perplexity(out, args).startswith(
        f"{(61.0 + 55.5 + 54.0 + 52.25 + 50.0) / 5:.4g}, the mean of the evaluations at "
        "steps 100, 200, 260, 280, 300;")
    assert sft.base_perplexity(tmp_path / "empty", args) == "nan"  # no base yet
