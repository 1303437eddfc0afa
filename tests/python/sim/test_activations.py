"""Tests of the whole-model activation memory of batch pressure (csrc/sim/activations.h,
bound as ``lrmoe._C.sim.activation_bytes``; ``lrmoe.sim.simulate.activation_model``;
``lrmoe sim --activations``).

References: byte counts and micro-batch counts worked out by hand in the comments from
the formulas of csrc/sim/activations.h and of the one-GEMM-point toy of
tests/python/sim/test_sim_binding.py, never from the code under test.
"""
from __future__ import annotations

import numpy as np
import pytest

from lrmoe import _C, cli
from lrmoe.planner.plan import MemoryModel
from lrmoe.sim import simulate as S
from lrmoe.sim.costs import PER_ROW, Costs
from lrmoe.sim.links import Links
from lrmoe.workload.shapes import MODELS

B = _C.sim


def test_dense_bytes_and_the_model_of_qwen3_by_hand():
    q = MODELS["qwen3-30b-a3b"]  # H 2048, I 768, E 128, K 8, 48 layers
    # 15 x 2048 + 4 x 128
    assert S.dense_token_bytes(q) == 31232
    m = S.activation_model(q, "keep")
    assert (m.layers, m.top_k, m.dense_token_bytes) == (48, 8, 31232)
    # forward row 4 H + 4 I = 11264, gate/up 4 I = 3072, input 2 H = 4096
    assert (m.moe_row_bytes, m.offload_row_bytes, m.input_token_bytes) == (11264, 3072, 4096)
    # keep at 4096 tokens: 48 x 4096 x 31232 + 47 x 4096 x 8 x 11264 bytes
    b = B.activation_bytes(m, 4096)
    assert (b.dense, b.moe, b.inputs) == (6_140_461_056, 17_347_641_344, 0)
    # recompute: 4096 x 31232 + 47 x 4096 x 4096
    b = B.activation_bytes(S.activation_model(q, "recompute"), 4096)
    assert (b.dense, b.moe, b.inputs) == (127_926_272, 0, 788_529_152)
    # a pipeline stage of 12 layers, offload: 12 x 4096 x 31232; 11 x 4096 x 8 x 8192
    b = B.activation_bytes(S.activation_model(q, "offload", layers=12), 4096)
    assert (b.dense, b.moe) == (1_535_115_264, 2_952_790_016)


def test_bad_activation_settings_are_named():
    q = MODELS["qwen3-30b-a3b"]
    with pytest.raises(ValueError, match="--activations must be one of layer, keep"):
        S.activation_model(q, "all")
    with pytest.raises(ValueError, match="--layers-resident must be an integer >= 1"):
        S.activation_model(q, "keep", layers=0)
    with pytest.raises(ValueError, match="--dense-token-bytes must be >= 0"):
        S.activation_model(q, "keep", dense_bytes=-1)
    with pytest.raises(ValueError, match="tokens per GPU must be >= 0"):
        B.activation_bytes(S.activation_model(q, "keep"), -1)


def toy():
    """One rank, one expert, 100 pairs per layer (2 steps); one GEMM point (1 expert, 100
    rows): forward 1 ms, backward 2 ms, growing in proportion beyond it; rows 1 + 1 bytes,
    no expert bytes, budget 1000, resident 0."""
    costs = Costs("toy", {}, np.array([[1, 100, 1.0, 2.0]]), {k: 0.0 for k in PER_ROW},
                  0.0, {})
    memory = MemoryModel(0, 0, 0, 1, 1, budget_bytes=1000, resident_bytes=0)
    return np.full((2, 1, 1, 1), 100, dtype=np.int64), memory, costs


def act(mode):
    """N = 3 layers, K = 1; 2 dense bytes and a 1-byte input per token, 1-byte rows."""
    return B.ActivationModel(mode=getattr(B.ActivationMode, mode), layers=3, top_k=1,
                             dense_token_bytes=2, moe_row_bytes=1, input_token_bytes=1)


@pytest.mark.parametrize("mode, micro, time_ms, recompute_ms, act_bytes", [
    # old model at 2x: 200 rows x 2 B = 400 <= 1000, one pass: 2 ms + 4 ms
    ("layer", 1, 6.0, 0.0, 0),
    # keep: 3 T 2 + 2 T 1 = 8 T; 2x: T = 200, 1600 > 1000; two of T = 100: 800 + 200 =
    # 1000 <= 1000, each 1 + 2 ms
    ("keep", 2, 6.0, 0.0, 800),
    # recompute: T 2 + 2 T 1 = 4 T; 2x: 800 + 400 > 1000; two of T = 100: 400 + 200;
    # each micro-batch's forward again: 2 x (1 + 2 + 1)
    ("recompute", 2, 8.0, 2.0, 400),
])
def test_pressure_with_each_mode_by_hand(mode, micro, time_ms, recompute_ms, act_bytes):
    load, memory, costs = toy()
    r = S.simulate(load, "fixed", memory, costs, Links.from_file(), hidden=64, replica_slots=0,
                   threads=1, multiplier=2.0, activations=act(mode))
    assert r["micro_batches"].tolist() == [micro, micro]
    assert r["time_ms"].tolist() == pytest.approx([time_ms, time_ms])
    assert r["recompute_ms"].tolist() == pytest.approx([recompute_ms, recompute_ms])
    assert r["activation_bytes"].tolist() == [act_bytes, act_bytes]


def test_keep_at_1x_fits_exactly_and_one_byte_more_does_not():
    # keep at 1x: T = 100, 800 + 200 = 1000 = the budget: one pass
    load, memory, costs = toy()
    r = S.simulate(load, "fixed", memory, costs, Links.from_file(), hidden=64, replica_slots=0,
                   threads=1, multiplier=1.0, activations=act("keep"))
    assert r["micro_batches"].tolist() == [1, 1]
    m = act("keep")
    m.dense_token_bytes = 3  # 3 T 3 + 2 T = 11 T = 1100 alone: over, then T = 50: 550 + 100
    r = S.simulate(load, "fixed", memory, costs, Links.from_file(), hidden=64, replica_slots=0,
                   threads=1, multiplier=1.0, activations=m, max_micro_batches=1)
    assert r["micro_batches"].tolist() == [0, 0]
    assert "activations of all layers" in r["reason"]


def _sim(tmp_path, *extra):
    """``lrmoe sim`` on gpu-small (H 768, I 256, E 128, K 8, 8 layers), EP2, one fixed
    plan of 64 tokens per GPU at 1x and 2x (the committed H200 costs); its sim.json."""
    import json
    out = tmp_path / "o"
    rc = cli.main(["sim", "--costs", "configs/costs/h200.json", "--model", "gpu-small",
                   "--gpus", "2", "--tokens-per-gpu", "64", "--steps", "1", "--layers", "1",
                   "--policies", "fixed", "--pressure", "1", "2", "--pressure-steps", "1",
                   "--pressure-tokens-per-gpu", "64", "--threads", "1", "--out", str(out),
                   *extra])
    assert rc == 0
    return json.loads((out / "sim.json").read_text())["pressure"]


def test_the_cli_charges_the_whole_models_activations_by_hand(tmp_path):
    gib = float(1 << 30)
    # keep (the default): 64 tokens per GPU at 1x (64 x 8 pairs per source): dense
    # 8 x 64 x (15 x 768 + 4 x 128) = 6,160,384; rows 7 x 64 x 8 x (4 x 768 + 4 x 256)
    # = 14,680,064; 2x twice that
    pr = _sim(tmp_path)
    assert pr["activations"]["mode"] == "keep" and pr["activations"]["layers"] == 8
    rows = pr["policies"]["fixed"]
    assert [r["activation_GiB"] * gib for r in rows] == pytest.approx(
        [20_840_448, 2 * 20_840_448])
    # recompute with 4 layers resident: 64 x 12032 + 3 x 64 x 1536
    pr = _sim(tmp_path, "--activations", "recompute", "--layers-resident", "4")
    assert pr["policies"]["fixed"][0]["activation_GiB"] * gib == pytest.approx(1_064_960)
    assert pr["policies"]["fixed"][0]["recompute_ms"] > 0
    # layer: the old model, nothing added
    pr = _sim(tmp_path, "--activations", "layer")
    assert [r["activation_GiB"] for r in pr["policies"]["fixed"]] == [0.0, 0.0]
    assert pr["activations"]["layers"] is None


def test_the_cli_refuses_bad_activation_flags(tmp_path, capsys):
    from lrmoe.sim.report import run_sim
    base = ["sim", "--costs", "configs/costs/h200.json", "--out", str(tmp_path / "o")]
    with pytest.raises(ValueError, match="--layers-resident must be >= 1, got 0"):
        run_sim(cli.build_parser().parse_args(base + ["--layers-resident", "0"]))
    with pytest.raises(ValueError, match="--dense-token-bytes must be >= 0, got -5"):
        run_sim(cli.build_parser().parse_args(base + ["--dense-token-bytes", "-5"]))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(base + ["--activations", "all"])
    assert "invalid choice: 'all'" in capsys.readouterr().err
