"""Tests of lrmoe/training/readout.py: a step's numbers read one step late.

References: hand-computed losses of staged scalars; the synchronous read of the MoE
layers' diagnostics (``diagnostics_means``, the path the loop used before) taken inside
the step itself; a weight poisoned with NaN whose loss must stop the run before a
checkpoint holds it; on a GPU, an event that has not passed when the earlier record is
handed back (the host did not wait for the step it just queued).
"""
from __future__ import annotations

import math

import pytest
import torch

from lrmoe.training import train as T
from lrmoe.training.metrics import diagnostics_means, read_metrics
from lrmoe.training.readout import StepReadout, to_host

from test_train import micro  # noqa: E402  (tests/python/training is on sys.path)


def _record(step):
    return {"kind": "train", "step": step, "lr": 0.1, "tokens": 40, "loss_tokens": 8}


def test_records_come_one_step_late_with_hand_computed_values():
    r = StepReadout(torch.device("cpu"))
    s1 = r.stage(r.clock.event(), _record(1), torch.tensor(16.0), None, torch.tensor(3.0),
                 denom=8, aux_div=1)
    assert r.push(s1) is None  # nothing finished yet
    s2 = r.stage(r.clock.event(), _record(2), torch.tensor(4.0), torch.tensor(0.5), 1.25,
                 denom=8, aux_div=2)
    assert s2.since == s1.end  # consecutive: step 2's time runs from step 1's end
    one = r.push(s2)
    assert one["step"] == 1 and one["loss"] == 2.0 and one["ppl"] == pytest.approx(math.e ** 2)
    assert one["aux_loss"] is None and one["grad_norm"] == 3.0
    assert one["time_s"] >= 0 and one["tokens"] == 40 and one["loss_tokens"] == 8
    two = r.flush(gap=True)
    assert two["step"] == 2 and two["loss"] == 0.5 and two["aux_loss"] == 0.25
    assert two["grad_norm"] == 1.25 and r.flush() is None
    s3 = r.stage(r.clock.event(), _record(3), torch.tensor(8.0), None, 1.0, denom=8,
                 aux_div=1)
    assert s3.since is None  # after a gap (an evaluation): from its own start


def test_to_host_copies_are_not_the_next_steps_values():
    t = torch.arange(4)
    h = to_host(t)
    t += 10
    assert h.tolist() == [0, 1, 2, 3]


def test_logged_diagnostics_are_those_of_their_own_step(tmp_path):
    """The record of step N must carry step N's diagnostics, though it is written after
    step N + 1 ran (the stats tensors are replaced every step)."""
    seen = {}

    def callback(trainer, step):  # runs after step N is queued, before N + 1
        seen[step] = diagnostics_means(trainer.model)

    T.train(micro(tmp_path, "d", steps=5, eval_every=0), step_callback=callback)
    recs = [r for r in read_metrics(tmp_path / "d" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    values = set()
    for r in recs:
        for key, value in seen[r["step"]].items():
            assert r[key] == value, (r["step"], key)
        values.add(r["retained_mass"])
    assert len(values) > 1  # the steps differ, so a shifted record would have failed


def test_a_non_finite_loss_stops_the_run_before_a_checkpoint_holds_it(tmp_path):
    def poison(trainer, step):
        if step == 3:  # step 4's loss is NaN (the LM head: the routers still see numbers)
            with torch.no_grad():
                trainer.model.lm_head.weight.fill_(float("nan"))

    cfg = micro(tmp_path, "nan", steps=8, eval_every=0, save_every=2, checkpoints=True)
    with pytest.raises(FloatingPointError, match="step 4: the loss is nan"):
        T.train(cfg, step_callback=poison)
    # steps 1-3 are logged, the checkpoint of step 2 is intact, step 4 was never saved
    recs = [r for r in read_metrics(tmp_path / "nan" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert [p.name for p in T.list_checkpoints(tmp_path / "nan")] == ["step-00000002"]

    # without a save to flush at step 4, step 5's router meets the NaN weights first:
    # the loss of step 4 is still what is reported, the router's error its context
    cfg = micro(tmp_path, "nan2", steps=8, eval_every=0, save_every=0, checkpoints=True)
    with pytest.raises(FloatingPointError, match="step 4: the loss is nan") as info:
        T.train(cfg, step_callback=poison)
    assert "router logits" in str(info.value.__context__)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_push_does_not_wait_for_the_step_just_queued():
    dev = torch.device("cuda")
    r = StepReadout(dev)
    a = torch.randn(4096, 4096, device=dev)
    s1 = r.stage(r.clock.event(), _record(1), (a[0, 0] * 0 + 6.0), None,
                 torch.tensor(2.0, device=dev), denom=3, aux_div=1)
    r.push(s1)
    start = r.clock.event()
    for _ in range(200):  # seconds of GPU work queued as "step 2"
        a = torch.tanh(a @ a)
    s2 = r.stage(start, _record(2), a[0, 0] * 0 + 3.0, None, 1.0, denom=3, aux_div=1)
    one = r.push(s2)
    assert not s2.end.query(), "push waited for the step it was handed"
    assert one["step"] == 1 and one["loss"] == 2.0 and one["grad_norm"] == 2.0
    two = r.flush()
    assert two["loss"] == 1.0 and s2.end.query()
    # step 2's time runs from step 1's end and holds the queued work
    assert two["time_s"] > 0
