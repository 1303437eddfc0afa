"""lrmoe.training.moe_timer: the MoE-layer time of a step (the time-to-loss metric).

A known delay is put inside each MoE layer's forward and backward (a hook on its router
that sleeps); the timer must count at least that much in each bracket, nothing for a
forward outside ``armed()`` (evaluation), and its parts must add up. A trainer run with
``run.time_moe`` logs the fields on every train record.
"""
import dataclasses
import time

import pytest
import torch
from torch import nn

from lrmoe import LRMoEConfig, LRMoELayer
from lrmoe.training import train as T
from lrmoe.training.moe_timer import MoELayerTimer

from test_train import micro

DELAY_S = 0.03


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps DELAY_S (runs inside the layer's backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(DELAY_S)
        return g


def _delay(module, args, routing):
    time.sleep(DELAY_S)
    return dataclasses.replace(routing, weights_TK=_SleepInBackward.apply(routing.weights_TK))


def _model():
    torch.manual_seed(0)
    cfg = LRMoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=2,
                      recalibration_rate=0.25)
    model = nn.Sequential(nn.Linear(16, 16), LRMoELayer(cfg), LRMoELayer(cfg))
    for layer in model[1:]:
        layer.gate.register_forward_hook(_delay)
    return model


def test_timer_counts_each_layers_forward_and_backward():
    model = _model()
    timer = MoELayerTimer(model, torch.device("cpu"))
    x = torch.randn(8, 16)
    t0 = time.perf_counter()
    with timer.armed():
        model(x).sum().backward()
    wall_ms = (time.perf_counter() - t0) * 1e3
    ms = timer.step_ms()
    # two layers, one delay each in forward and in backward
    assert ms["moe_forward_ms"] >= 2 * DELAY_S * 1e3
    assert ms["moe_backward_ms"] >= 2 * DELAY_S * 1e3
    assert ms["moe_time_ms"] == pytest.approx(ms["moe_forward_ms"] + ms["moe_backward_ms"])
    assert ms["moe_time_ms"] <= wall_ms
    # an unarmed forward (evaluation) counts nothing; step_ms resets
    with torch.no_grad():
        model(x)
    assert timer.step_ms() == {"moe_time_ms": 0.0, "moe_forward_ms": 0.0,
                               "moe_backward_ms": 0.0}
    timer.remove()
    with timer.armed():
        model(x).sum().backward()
    assert timer.step_ms()["moe_time_ms"] == 0.0


def test_timer_refuses_a_model_without_moe_layers():
    with pytest.raises(ValueError, match="run.time_moe"):
        MoELayerTimer(nn.Linear(2, 2), torch.device("cpu"))


def test_trainer_logs_moe_time(tmp_path):
    cfg = micro(tmp_path, steps=2, eval_every=0, time_moe=True)
    T.train(cfg)
    records = [r for r in T.read_metrics(tmp_path / "run" / "metrics.jsonl")
               if r["kind"] == "train"]
    assert len(records) == 2
    for r in records:
        assert 0 < r["moe_time_ms"] <= r["time_s"] * 1e3
        assert r["moe_time_ms"] == pytest.approx(r["moe_forward_ms"] + r["moe_backward_ms"])
