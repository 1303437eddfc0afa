"""``lrmoe bench step --titan`` (lrmoe/bench/titan_step.py) on the CPU at a micro shape:
the cells' structure, the batches they see, and torchtitan's own MoE as the independent
reference of the swapped-in LRMoE experts at c = 0 (the loss of every step, the first
before any update and the next ones after AdamW steps on their gradients).

Skipped where torchtitan does not import (requirements/torchtitan.txt). No timing is
checked beyond a table's medians lying between the logged steps'.
"""
from __future__ import annotations

import json

import pytest
import torch

from test_step import micro_sets  # noqa: E402
from test_train import micro  # noqa: E402

from lrmoe.integrations.torchtitan import require_torchtitan

try:
    require_torchtitan()
    SKIP = None
except ModuleNotFoundError as exc:  # the message names requirements/torchtitan.txt
    SKIP = str(exc)
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

# relative: one bf16 ulp (2**-8). Both MoEs compute their experts in bf16; the mean loss
# over a batch averages their rounding away (measured: ~1e-7), so this is not slack
LOSS_TOL = 2.0 ** -8


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_titan_cells_on_the_cpu(tmp_path):
    from lrmoe.bench.step import bench_step, flops_per_token

    out = tmp_path / "bench"
    result = bench_step("tiny", [0.0, 0.5], ["sdpa"], steps=3, warmup=1,
                        sets=micro_sets(tmp_path), out_dir=out,
                        methods=["lrmoe", "titan", "titan-lrmoe"])
    cells = {c["name"]: c for c in result["cells"]}
    assert list(cells) == ["sdpa-c0", "sdpa-c0.5", "titan-dense", "titan-lrmoe-dense-c0",
                           "titan-lrmoe-dense-c0.5"]
    for name, c in cells.items():
        train = rows(out / name / "metrics.jsonl")
        assert [r["step"] for r in train if r["kind"] == "train"] == [1, 2, 3]
        kept = [r for r in train if r["kind"] == "train" and r["step"] > 1]
        assert c["steps"] == 2 and c["tokens_per_step"] == 4 * 128 == kept[0]["tokens"]
        assert min(r["time_s"] for r in kept) * 1e3 <= c["step_ms"] <= \
            max(r["time_s"] for r in kept) * 1e3
        assert c["moe_time_ms"] > 0 and c["moe_forward_ms"] > 0 and c["moe_backward_ms"] > 0
        assert 0 < c["moe_share"] < 1 and c["mfu"] > 0
        assert len(c["losses"]) == 3
    titan, lr0 = cells["titan-dense"], cells["sdpa-c0"]
    # the same shape: torchtitan's model counts the FLOPs lrmoe's does
    assert titan["flops_per_token"] == lr0["flops_per_token"] == result["flops_per_token"]
    vocab = lr0["vocab_size"]  # the trained tokenizer's, below data.vocab_size here
    assert titan["flops_per_token"] == flops_per_token(micro(tmp_path).model, vocab, 128)
    assert titan["vs_titan"] == 1.0 and titan["speedup_vs_c0"] is None
    assert lr0["vs_lrmoe_c0"] == 1.0 and lr0["speedup_vs_c0"] == 1.0
    assert cells["titan-lrmoe-dense-c0"]["speedup_vs_c0"] == 1.0
    assert cells["titan-lrmoe-dense-c0.5"]["vs_titan"] == pytest.approx(
        cells["titan-lrmoe-dense-c0.5"]["tokens_per_s"] / titan["tokens_per_s"])
    # LRMoE's experts at c = 0 against torchtitan's own MoE: the same init and batches
    ref, got = titan["losses"], cells["titan-lrmoe-dense-c0"]["losses"]
    for a, b in zip(ref, got):
        assert abs(a - b) / a < LOSS_TOL, (ref, got)
    # the two models are not lrmoe's (another init): the losses are not lrmoe train's
    assert ref[0] != lr0["losses"][0]
    md = (out / "step.md").read_text()
    assert "| x titan | x lrmoe c=0 |" in md and md.count("| titan-") == 3
    saved = json.loads((out / "step.json").read_text())
    assert [c["name"] for c in saved["cells"]] == list(cells)


def test_titan_cells_see_lrmoe_train_batches(tmp_path, monkeypatch):
    # the titan loop's batches are those of lrmoe train's BatchStream (same order)
    from lrmoe.bench import titan_step as TS
    from lrmoe.training import train as T
    from lrmoe.training.batches import BatchStream

    cfg = T.build_config("tiny", sets=[*micro_sets(tmp_path), "run.steps=2",
                                       "run.progress=none"])
    data = TS.load_preset_data(cfg)
    seen = []
    original = BatchStream.next

    def spy(self):
        batch, tokens = original(self)
        seen.append(batch.input_ids_BS.clone())
        return batch, tokens

    monkeypatch.setattr(BatchStream, "next", spy)
    TS.train_titan(cfg, data, "auto", None, tmp_path / "cell")
    want = BatchStream(data.train, cfg.data.batch_size, cfg.run.seed)
    monkeypatch.setattr(BatchStream, "next", original)
    assert len(seen) == 2
    for got in seen:
        assert torch.equal(got, want.next()[0].input_ids_BS)


def test_dense_attention_is_torchtitans_document_mask():
    # the CPU stand-in computes what torchtitan's flex attention computes (forward)
    from lrmoe.bench import titan_step as TS
    from lrmoe.integrations.torchtitan_qwen3 import build_qwen3_moe, qwen3_moe_config

    cfg = qwen3_moe_config(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                           moe_inter=16, num_experts=4, top_k=2, vocab_size=64,
                           max_seq_len=64)
    flex = build_qwen3_moe(cfg, seed=0)
    dense = build_qwen3_moe(cfg, seed=0)
    dense.layers["0"].attention.inner_attention.__class__ = TS._dense_attention_class()
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(12), torch.arange(20)]).repeat(2, 1)
    with torch.no_grad():
        want = flex(tokens, positions, flex.get_attention_masks(positions))
        got = dense(tokens, positions, dense.get_attention_masks(positions))
    assert float((got - want).abs().max()) < 1e-5


def test_bad_titan_arguments(tmp_path):
    from lrmoe.bench.step import bench_step
    from lrmoe.bench.titan_step import resolve_attention

    with pytest.raises(ValueError, match="--methods"):
        bench_step("tiny", [0.0], ["sdpa"], 2, 1, micro_sets(tmp_path), tmp_path,
                   methods=["torchtitan"])
    with pytest.raises(ValueError, match="--titan-attention"):
        bench_step("tiny", [0.0], ["sdpa"], 2, 1, micro_sets(tmp_path), tmp_path,
                   methods=["titan"], titan_attention="sdpa")
    with pytest.raises(ValueError, match="--titan-attention dense"):
        resolve_attention("flex", torch.device("cpu"))
    assert resolve_attention("auto", torch.device("cpu")) == "dense"
