"""BackwardConfig, the one schema of the planned backward: the layer's ``config.backward``,
``lrmoe train``'s ``lrmoe`` section, its flags and the EP config hash all follow its fields.

The expected values are written out by hand here (flag spellings, per-field alternative
values, the settings a command line should produce), so a field added without its flag,
hash entry or check makes a test fail.
"""
from __future__ import annotations

import dataclasses

import pytest

from lrmoe import BackwardConfig, LRMoEConfig, LRMoELayer
from lrmoe.cli import build_parser, train_overrides
from lrmoe.moe.config import BACKWARD_FIELDS
from lrmoe.parallel.group import config_hash
from lrmoe.training import train as T
from lrmoe.training.config import TrainConfig

ARCH = dict(hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2)

#: every planned-backward field with a value other than its default that validates
#: (selective_backward=False needs c = 0, which is the default)
ALTERNATIVE = {"recalibration_rate": 0.25, "metric": "random", "quota_rule": "water_level",
               "selection": "topk", "seed": 7, "selective_backward": False,
               "retained_mass_target": 0.0, "offload": "activations"}


def test_fields_are_the_ones_documented():
    assert BACKWARD_FIELDS == ("recalibration_rate", "metric", "quota_rule", "selection",
                               "seed", "selective_backward", "retained_mass_target", "offload")


def test_flat_keywords_and_backward_build_the_same_config():
    flat = LRMoEConfig(**ARCH, recalibration_rate=0.3, metric="grad_sq", seed=3)
    nested = LRMoEConfig(**ARCH, backward=BackwardConfig(recalibration_rate=0.3,
                                                         metric="grad_sq", seed=3))
    assert flat == nested
    assert flat.backward.recalibration_rate == 0.3 and flat.backward.seed == 3
    assert flat.backward.rate_pq == (3, 10)  # 0.3 = 3/10 exactly
    assert flat.backward.retained_pairs(20) == 14  # floor(0.7 * 20)
    with pytest.raises(ValueError, match=r"backward= and the backward field\(s\) "
                                         r"\['metric'\]"):
        LRMoEConfig(**ARCH, backward=BackwardConfig(), metric="lrm")


def test_layers_built_from_one_backward_config_do_not_share_it():
    shared = BackwardConfig(recalibration_rate=0.2)
    a = LRMoELayer(LRMoEConfig(**ARCH, backward=shared))
    b = LRMoELayer(LRMoEConfig(**ARCH, backward=shared))
    a.set_recalibration(recalibration_rate=0.5)
    assert a.config.backward.recalibration_rate == 0.5
    assert b.config.backward.recalibration_rate == 0.2 and shared.recalibration_rate == 0.2


@pytest.mark.parametrize("field, value, message", [
    ("recalibration_rate", 1.0, "recalibration_rate must be in [0, 1)"),
    ("recalibration_rate", True, "recalibration_rate must be in [0, 1)"),
    ("metric", "lrn", "metric must be one of lrm, grad_sq, grad_abs, random; got 'lrn'"),
    ("quota_rule", "flat", "quota_rule must be one of proportional, water_level"),
    ("selection", "best", "selection must be one of topk, importance"),
    ("seed", -1, "seed must be an int in [0, 2**63) or None"),
    ("seed", 1 << 63, "seed must be an int in [0, 2**63) or None"),
    ("selective_backward", "yes", "selective_backward must be true or false"),
    ("retained_mass_target", 1.5, "retained_mass_target must be 0 (off) or in (0, 1]"),
    ("offload", "disk", "offload must be one of none, activations"),
])
def test_one_check_per_value_named_for_the_layer_and_for_the_trainer(field, value, message):
    with pytest.raises(ValueError) as layer_err:
        LRMoEConfig(**ARCH, **{field: value})
    assert str(layer_err.value).startswith(f"LRMoEConfig.{field}") and message in str(
        layer_err.value)
    if isinstance(value, bool) or value == "yes":
        return  # the trainer's typed keys read these as YAML first (True -> "a number")
    with pytest.raises(ValueError) as train_err:
        TrainConfig(lrmoe={field: value})
    assert str(train_err.value).startswith(f"lrmoe.{field}") and message in str(train_err.value)


def test_every_field_changes_the_ep_config_hash():
    assert set(ALTERNATIVE) == set(BACKWARD_FIELDS)  # a new field needs its entry here
    base = LRMoEConfig(**ARCH)
    h0 = config_hash(base, 2)
    for field, value in ALTERNATIVE.items():
        if field == "retained_mass_target":
            changed = base.replace(recalibration_rate=0.5, retained_mass_target=0.9)
            assert config_hash(changed, 2) != config_hash(base.replace(
                recalibration_rate=0.5), 2), field
            continue
        assert config_hash(base.replace(**{field: value}), 2) != h0, field


def _train_cfg(argv):
    args = build_parser().parse_args(["train", *argv])
    return T.build_config(args.preset, args.config, args.sets, train_overrides(args))


def test_train_flags_come_from_the_fields_and_land_in_the_section():
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for flag in ("-c", "--recalibration-rate", "--metric", "--quota-rule", "--selection",
                 "--retained-mass-target", "--offload"):
        assert f"{flag} " in help_text or f"{flag}\n" in help_text, flag
    cfg = _train_cfg(["-c", "0.5", "--metric", "grad_abs", "--quota-rule", "water_level",
                      "--selection", "topk", "--retained-mass-target", "0.9",
                      "--offload", "activations", "--set", "lrmoe.seed=11",
                      "--set", "run.seed=5"])
    assert dataclasses.astuple(cfg.lrmoe)[:8] == (0.5, "grad_abs", "water_level", "topk", 11,
                                                  True, 0.9, "activations")
    assert cfg.run.seed == 5 and cfg.backward.seed == 11
    assert _train_cfg([]).backward.seed == 0  # tiny's run.seed when lrmoe.seed is unset
    assert _train_cfg(["--set", "seed=9"]).run.seed == 9  # the flat name is run.seed


def test_yaml_section_round_trip_and_older_checkpoints(tmp_path):
    cfg = _train_cfg(["-c", "0.2", "--selection", "topk"])
    again = T.build_config(config_file=_write(tmp_path / "c.yaml", T.config_yaml(cfg)))
    assert again == cfg
    assert "rate_pq" not in cfg.to_dict()["lrmoe"]  # derived, never written
    # a checkpoint of the version before the section had seed / selective_backward
    old = cfg.to_dict()
    del old["lrmoe"]["seed"], old["lrmoe"]["selective_backward"]
    assert TrainConfig.from_dict(old) == cfg


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, first, second", [
    ("model:\n  hidden_size: 64\nhidden_size: 32\n", "model.hidden_size", "hidden_size"),
    ("recalibration_rate: 0.1\nlrmoe:\n  recalibration_rate: 0.2\n", "recalibration_rate",
     "lrmoe.recalibration_rate"),
    ("run:\n  seed: 1\nseed: 2\n", "run.seed", "seed"),
])
def test_a_key_given_nested_and_flat_is_refused_naming_both(tmp_path, text, first, second):
    path = _write(tmp_path / "both.yaml", text)
    with pytest.raises(ValueError, match=f"'{first}' and '{second}' both set"):
        T.build_config(config_file=path)
    import yaml
    with pytest.raises(ValueError, match=f"'{first}' and '{second}' both set"):
        TrainConfig.from_dict(yaml.safe_load(text))
