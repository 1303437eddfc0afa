"""Tests of the nested settings of ``lrmoe train`` (lrmoe/training/config.py): sections,
flat names, YAML files old and new, --print-config, and the values a new user gets wrong
(seeds, a recalibration rate that rounds to 1, E not divisible by the EP size).

Expected values are written by hand: the section layout, the key names, the limits.
"""
from __future__ import annotations

import pytest
import yaml

from lrmoe.training import train as T

SECTIONS = ["model", "data", "optim", "lrmoe", "parallel", "run"]


def test_nested_and_flat_names_set_the_same_field():
    nested = T.build_config("tiny", sets=["optim.lr=1e-3", "run.steps=7", "data.source=gcide",
                                          "parallel.ep_size=2", "lrmoe.metric=grad_abs"])
    flat = T.build_config("tiny", sets=["lr=1e-3", "steps=7", "data=gcide", "ep_size=2",
                                        "metric=grad_abs"])
    assert nested == flat
    assert flat.optim.lr == 1e-3 and flat.run.steps == 7 and flat.parallel.ep_size == 2
    assert flat.lrmoe.metric == "grad_abs" and flat.data.source == "gcide"
    # a key under the wrong section names the right one
    with pytest.raises(ValueError, match=r"'optim\.steps'.*run\.steps"):
        T.build_config("tiny", sets=["optim.steps=3"])
    # flat names on the Python side too
    cfg = T.get_preset("tiny").replace(lr=2e-3, data="alpaca:x.json")
    assert cfg.optim.lr == 2e-3 and cfg.data.source == "alpaca:x.json"


def test_print_config_is_nested_yaml(capsys):
    from lrmoe.cli import main

    assert main(["train", "--preset", "tiny", "--set", "lr=1e-3", "--tensorboard",
                 "--print-config"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert list(data) == SECTIONS
    assert data["optim"]["lr"] == 1e-3 and data["run"]["tensorboard"] is True
    assert data["data"]["source"] == "gcide" and data["parallel"] == {
        "ep_size": 1, "dp_size": 1, "policy": None, "memory_budget": None,
        "resident_bytes": None, "replica_slots": 2}


def test_nested_yaml_and_flat_yaml_with_a_note(tmp_path, capsys):
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  lr: 5e-4\nrun:\n  steps: 11\nmodel:\n  num_experts: 16\n")
    flat = tmp_path / "flat.yaml"
    flat.write_text("lr: 5e-4\nsteps: 11\nmodel:\n  num_experts: 16\n")
    a = T.build_config(config_file=nested)
    assert "flat keys" not in capsys.readouterr().err
    b = T.build_config(config_file=flat)
    err = capsys.readouterr().err
    assert a == b and a.optim.lr == 5e-4 and a.run.steps == 11 and a.model.num_experts == 16
    assert "lr -> optim.lr" in err and "steps -> run.steps" in err


def test_resume_mutable_fields_are_the_same_set():
    old = {"steps", "eval_every", "eval_batches", "log_every", "save_every",
           "keep_checkpoints", "out_dir", "device", "torch_threads", "progress", "cache_dir",
           "record_trace", "trace_every"}
    assert {k.split(".")[1] for k in T.RESUME_MUTABLE_FIELDS} == old | {
        "tensorboard", "time_moe", "export", "attention", "checkpoints", "compile"}
    assert all(T.FLAT_KEYS[k] in T.RESUME_MUTABLE_FIELDS for k in old)


@pytest.mark.parametrize("seed", [1.5, "7", True, -1, 2 ** 63, None])
def test_bad_seeds_are_refused(seed):
    with pytest.raises(ValueError, match=r"run\.seed must be an int in \[0, 2\^63\)"):
        T.TrainConfig(run=T.RunConfig(seed=seed))


def test_seed_via_set_and_largest_seed():
    with pytest.raises(ValueError, match=r"run\.seed"):
        T.build_config("tiny", sets=["seed=1.5"])
    with pytest.raises(ValueError, match=r"run\.seed"):
        T.build_config("tiny", sets=["seed=abc"])
    assert T.build_config("tiny", sets=["seed=1e3"]).run.seed == 1000
    assert T.build_config("tiny", sets=[f"seed={2 ** 63 - 1}"]).run.seed == 2 ** 63 - 1


def test_rate_that_rounds_to_one_is_refused():
    # nearest fraction with denominator <= 2^20: 1 - 1e-7 is 1/1 (hand: 1e-7 < 1 / (2 * 2^20))
    with pytest.raises(ValueError, match=r"lrmoe\.recalibration_rate=.*rounds to c = 1"):
        T.build_config("tiny", sets=["recalibration_rate=0.9999999"])
    assert T.build_config("tiny", sets=["recalibration_rate=0.999999"]).lrmoe \
        .recalibration_rate == 0.999999


def test_ep_size_must_divide_the_experts():
    with pytest.raises(ValueError, match=r"parallel\.ep_size=3 must divide "
                                         r"model\.num_experts=8.*\[1, 2, 4, 8\]"):
        T.build_config("tiny", sets=["parallel.ep_size=3"])
    assert T.build_config("tiny", sets=["ep_size=4"]).parallel.ep_size == 4


def test_replica_slots_above_the_experts_are_refused_before_training():
    """tiny has E = 8: 9 slots per rank could never be filled (one instance of an expert
    per rank), and above int32 they had wrapped around in the planner."""
    base = ["parallel.ep_size=2", "parallel.policy=ultraep"]
    for slots in (9, 4294967298):
        with pytest.raises(ValueError, match=rf"parallel\.replica_slots must be an int in "
                                             rf"\[0, E=8\].*got {slots} \(model\.num_experts\)"):
            T.build_config("tiny", sets=[*base, f"parallel.replica_slots={slots}"])
    assert T.build_config("tiny", sets=[*base, "parallel.replica_slots=8"]) \
        .parallel.replica_slots == 8


def test_adaptive_rate_settings_reach_the_layers_and_bad_ones_are_named(tmp_path):
    from lrmoe.training.train import TrainConfig  # noqa: F401  (the nested config)
    from test_train import micro
    cfg = micro(tmp_path, recalibration_rate=0.5, retained_mass_target=0.95)
    assert cfg.backward.retained_mass_target == 0.95
    with pytest.raises(ValueError, match="lrmoe.retained_mass_target must be"):
        micro(tmp_path, recalibration_rate=0.5, retained_mass_target=2.0)
    with pytest.raises(ValueError, match="needs lrmoe.recalibration_rate"):
        micro(tmp_path, recalibration_rate=0.0, retained_mass_target=0.9)
    with pytest.raises(ValueError, match="one device only"):
        micro(tmp_path, recalibration_rate=0.5, retained_mass_target=0.9, ep_size=2)
