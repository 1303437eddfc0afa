"""``lrmoe bench step`` (lrmoe/bench/step.py): the FLOP count against a hand count, and a
CPU run of two cells whose table holds what the runs logged."""
from __future__ import annotations

import json

import pytest

from test_train import micro  # noqa: E402

from lrmoe.bench.step import bench_step, flops_per_token  # noqa: E402


def micro_sets(tmp_path):
    """``--set`` items for a micro model on the CPU (test_train.micro's shapes)."""
    data = micro(tmp_path).data.source
    return [f"data.source={data}", "data.vocab_size=512", "data.seq_len=128",
            "data.batch_size=4", f"data.cache_dir={tmp_path / 'cache'}", "run.device=cpu",
            "run.torch_threads=1", "model.hidden_size=32", "model.num_hidden_layers=2",
            "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=16",
            "model.intermediate_size=64", "model.moe_intermediate_size=16",
            "model.num_experts=4", "model.num_experts_per_tok=2",
            "model.max_position_embeddings=128"]


def test_flops_per_token_matches_a_hand_count(tmp_path):
    m = micro(tmp_path).model  # H 32, 2 layers, 2 q / 1 kv heads of 16, E 4, K 2, I 16
    # per layer: q, o 32x32 each, k, v 32x16 each = 3,072; router 32x4 + 2 experts x 3 x
    # 32 x 16 = 3,200; LM head 32 x 512 = 16,384; N = 2 x 6,272 + 16,384 = 28,928;
    # 6 N = 173,568; attention 6 x 2 layers x 128 x 32 = 49,152
    assert flops_per_token(m, 512, 128) == 222_720


def test_two_cells_on_the_cpu(tmp_path):
    sets = micro_sets(tmp_path)
    out = tmp_path / "bench"
    result = bench_step("tiny", [0.0, 0.5], ["sdpa"], steps=3, warmup=1, sets=sets,
                        out_dir=out)
    cells = result["cells"]
    assert [c["name"] for c in cells] == ["sdpa-c0", "sdpa-c0.5"]
    for c in cells:
        rows = [json.loads(x) for x in (out / c["name"] / "metrics.jsonl").read_text()
                .splitlines()]
        train = [r for r in rows if r["kind"] == "train" and r["step"] > 1]
        assert c["steps"] == 2 and c["tokens_per_step"] == train[0]["tokens"]
        assert min(r["time_s"] for r in train) * 1e3 <= c["step_ms"] <= \
            max(r["time_s"] for r in train) * 1e3
        assert not (out / c["name"] / "checkpoints").exists()  # run.checkpoints=false
    assert cells[0]["speedup_vs_c0"] == 1.0
    assert (out / "step.md").read_text().count("| sdpa-c") == 2
    with pytest.raises(ValueError, match="must exceed --warmup"):
        bench_step("tiny", [0.0], ["sdpa"], steps=2, warmup=2, sets=sets, out_dir=out)


def test_profiled_steps_come_after_the_measured_ones(tmp_path):
    # the profiled cell trains 2 steps more; its median is over steps 2..3 only (the
    # profiler slows the host: counting its steps would inflate every ratio to c = 0)
    out = tmp_path / "bench"
    result = bench_step("tiny", [0.0], ["sdpa"], steps=3, warmup=1,
                        sets=micro_sets(tmp_path), out_dir=out, profile=True)
    cell = result["cells"][0]
    rows = [json.loads(x) for x in (out / "sdpa-c0" / "metrics.jsonl").read_text()
            .splitlines() if json.loads(x)["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    measured = sorted(r["time_s"] * 1e3 for r in rows if 1 < r["step"] <= 3)
    assert cell["steps"] == 2 and cell["step_ms"] == pytest.approx(sum(measured) / 2)
    assert "profile_ms" in cell  # the capture of steps 4..5 ran (no CUDA kernels here)


def test_profile_tables_skip_annotations_and_sum_by_hand():
    """Kernels summed per category and family per step; GPU-side record_function ranges
    (which span kernels already counted) and host events are left out."""
    from types import SimpleNamespace as E

    import torch

    from lrmoe.bench.step import profile_tables

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [E(name="void cutlass::device_kernel<X>(int)", device_type=cuda, device_time=3000.0),
              E(name="void cutlass::device_kernel<Y>(int)", device_type=cuda, device_time=1000.0),
              E(name="lrmoe.expert_gemm_fwd", device_type=cuda, device_time=3900.0,
                is_user_annotation=True),
              E(name="Optimizer.step#AdamW.step", device_type=cuda, device_time=500.0,
                is_user_annotation=True),
              E(name="void at::native::multi_tensor_apply_kernel<A>(B)", device_type=cuda,
                device_time=400.0),
              E(name="aten::mm", device_type=cpu, device_time=0.0)]
    got = profile_tables(events, steps=2)
    assert got["profile_ms"] == {"matmul": 2.0, "optimizer": 0.2}
    assert got["profile_kernels"] == [["matmul: cutlass::device_kernel", 2.0, 1.0],
                                      ["optimizer: at::native::multi_tensor_apply_kernel", 0.2, 0.5]]
    with pytest.raises(ValueError, match="steps"):
        profile_tables(events, steps=0)


def test_profile_ops_group_by_chain_shapes_and_source_by_hand():
    """Each op's own device time, summed over the calls with the same parent chain,
    input shapes and first non-torch source line (the nearest ancestor's stack when the
    op has none); ops without device time, GPU events and annotations left out."""
    from types import SimpleNamespace as E

    import torch

    from lrmoe.bench.step import profile_ops

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    src = "transformers/models/qwen3/modeling_qwen3.py(88): forward"

    def op(name, parent=None, us=0.0, shapes=None, stack=None, **kw):
        return E(name=name, device_type=cpu, self_device_time_total=us, cpu_parent=parent,
                 input_shapes=shapes or [], stack=stack or [], **kw)

    to = op("aten::to", stack=["/x/torch/nn/modules/module.py(1): _call_impl", src])
    copies = [op("aten::copy_", op("aten::_to_copy", to), us=600.0, shapes=[[4, 8], [4, 8]])
              for _ in range(3)]
    other = op("aten::copy_", op("aten::_to_copy", to), us=100.0, shapes=[[2, 2], [2, 2]])
    bwd = op("aten::copy_", op("autograd::engine::evaluate_function: ToCopyBackward0"),
             us=900.0, shapes=[[4, 8], [4, 8]])
    events = [*copies, other, bwd, to, op("aten::mm", us=0.0),
              op("lrmoe.expert_gemm_fwd", us=5000.0, is_user_annotation=True),
              E(name="void k<X>()", device_type=cuda, self_device_time_total=7.0)]
    want = [
        ["aten::copy_ < aten::_to_copy < aten::to", "[[4, 8], [4, 8]]", src, 0.6, 1.0],
        ["aten::copy_ < autograd::engine::evaluate_function: ToCopyBackward0",
         "[[4, 8], [4, 8]]", "", 0.3, 1 / 3],
        ["aten::copy_ < aten::_to_copy < aten::to", "[[2, 2], [2, 2]]", src, 0.1 / 3, 1 / 3]]
    got = profile_ops(events, steps=3)
    assert [r[:3] for r in got] == [[*r[:3]] for r in want]
    assert [x for r in got for x in r[3:]] == pytest.approx([x for r in want for x in r[3:]])
    assert len(profile_ops(events, steps=3, top=1)) == 1
    with pytest.raises(ValueError, match="steps"):
        profile_ops(events, steps=0)


def test_compile_cells_have_their_own_baseline(tmp_path):
    """``compiles=(False, True)``: every c runs eager and compiled, each compiled cell's
    ratio is to the compiled c = 0 (here itself: 1.0), ``vs_lrmoe_c0`` to the eager one."""
    sets = micro_sets(tmp_path)
    result = bench_step("tiny", [0.0], ["sdpa"], steps=3, warmup=1, sets=sets,
                        out_dir=tmp_path / "bench", compiles=(False, True))
    eager, compiled = result["cells"]
    assert (eager["name"], compiled["name"]) == ("sdpa-c0", "sdpa+compile-c0")
    assert (eager["compile"], compiled["compile"]) == (False, True)
    assert compiled["speedup_vs_c0"] == 1.0
    assert compiled["vs_lrmoe_c0"] == compiled["tokens_per_s"] / eager["tokens_per_s"]
    with pytest.raises(ValueError, match="--compile"):
        bench_step("tiny", [0.0], ["sdpa"], steps=3, warmup=1, sets=sets,
                   out_dir=tmp_path / "bench", compiles=())
