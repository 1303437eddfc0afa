"""``lrmoe bench step``: the whole training step of ``lrmoe train``, end to end.

Each cell is a short ``lrmoe train`` run of one preset (same model, data and global batch)
at one recalibration rate c and one attention implementation, in this process, one after
another (nothing else on the GPU): no evaluation after step 0's (one batch), no
checkpoint, ``run.time_moe`` on. Per cell, over the train records after ``--warmup``
steps: the median step time and tokens per second (``metrics.jsonl``: host wall time of
the step, which ends on the loss's host read), the median MoE-layer time (forward and
backward, device events: :mod:`lrmoe.training.moe_timer`) and its share of the step, the
model-FLOP utilisation and the peak CUDA memory. Ratios are against the first cell of the
same attention at c = 0 in the same run. ``--profile`` adds, for the first cell, one
``torch.profiler`` capture of two steps: device time per kernel category (:data:`KINDS`),
per kernel family and per host op that launched it (:func:`profile_ops`).

``--titan`` (``--methods lrmoe titan titan-lrmoe``) adds, in the same run, torchtitan's
Qwen3 MoE model at the preset's shape and vocabulary on the same batches, with its own
MoE and with LRMoE's experts at each c (:mod:`lrmoe.bench.titan_step`: a plain loop,
because torchtitan's trainer needs torch >= 2.12), with ratios to torchtitan's own MoE
and to lrmoe at c = 0; their FLOPs come from the torchtitan model's shape.

Model FLOPs per token (:func:`flops_per_token`): ``6 N + 6 L S d_attn``. N = the matmul
parameters a token passes through (per layer q, k, v, o projections, the router and
its K experts' three matrices; the LM head), counted forward (2 per multiply-add) and
backward (4); the attention term is causal attention over the whole block of S tokens
(forward 2 * 2 * S/2 * d_attn per token and layer, x3 with the backward), d_attn =
heads x head_dim: packed examples kept apart compute less, so the utilisation with
``data.isolate_examples`` is a lower bound of the useful work's. Peak: the H200's dense
bf16 tensor rate, 989 TFLOP/s (NVIDIA H200 datasheet; ``--peak-tflops`` for another GPU).
"""
from __future__ import annotations

import gc
import json
import re
import statistics
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

#: dense bf16 tensor-core peak of one H200 SXM, TFLOP/s (NVIDIA H200 datasheet)
H200_BF16_TFLOPS = 989.0
#: kernel categories of the profile table: first matching pattern wins (lower-case names)
KINDS = (
    ("attention", r"fmha|flash|attention|attn|sdpa|flex|triton_tem_fused"),
    ("optimizer", r"adam|multi_tensor|foreach|_amp_"),
    ("matmul", r"gemm|cutlass|cublas|sm90|xmma|nvjet|grouped|matmul|wgmma"),
    ("softmax / loss", r"softmax|cross_entropy|nll|logsumexp"),
    ("copy / cast", r"copy|cast|memcpy|memset|convert|to_copy|fill"),
    ("elementwise / other", r"."),
)


#: kernel families listed in the profile (the most device time first)
TOP_KERNELS = 30
#: host ops listed in the profile by their own device time (:func:`profile_ops`)
TOP_OPS = 30


def flops_per_token(model: Any, vocab: int, seq_len: int) -> float:
    """Model FLOPs per token of one training step (module docstring).

    Args:
        model: a :class:`lrmoe.training.sections.ModelConfig` (or anything with its shape
            fields). vocab: the LM head's rows (the data's vocabulary). seq_len: S, tokens
            per block.
    """
    m = model
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    attn = h * q + 2 * h * kv + q * h
    moe = h * m.num_experts + m.num_experts_per_tok * 3 * h * m.moe_intermediate_size
    n = m.num_hidden_layers * (attn + moe) + h * vocab
    return 6.0 * n + 6.0 * m.num_hidden_layers * seq_len * q


def _kind(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return KINDS[-1][0]


def _records(run: Path, warmup: int) -> List[Dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train" and r["step"] > warmup]


def profile_tables(events: Iterable[Any], steps: int) -> Dict[str, Any]:
    """Device time per step of a profiler capture, by :data:`KINDS` category and by kernel
    family.

    Args:
        events: ``torch.profiler.profile.events()`` (FunctionEvent-like: ``name``,
            ``device_type``, ``device_time`` in us, ``is_user_annotation``).
        steps: the training steps the capture spans (> 0); times are divided by it.

    Returns:
        ``{"profile_ms": {category: ms per step}, "profile_kernels": [[family, ms per
        step, launches per step], ...]}``, the categories largest first, the
        :data:`TOP_KERNELS` largest families.

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the profiled steps), got {steps}")
    from lrmoe.bench.profile import kernel_family

    kinds: Dict[str, float] = {}
    kernels: Dict[str, List[float]] = {}
    for e in events:
        # record_function ranges (lrmoe.* phases, Optimizer.step#...) also appear on the
        # GPU timeline as annotations spanning their kernels: counting them counted those
        # kernels twice
        if (e.device_type != torch.autograd.DeviceType.CUDA
                or getattr(e, "is_user_annotation", False)):
            continue
        ms = e.device_time / 1e3 / steps
        k = _kind(e.name)
        kinds[k] = kinds.get(k, 0.0) + ms
        row = kernels.setdefault(f"{k}: {kernel_family(e.name)[:90]}", [0.0, 0])
        row[0] += ms
        row[1] += 1 / steps
    return {"profile_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "profile_kernels": sorted(([n, ms, cnt] for n, (ms, cnt) in kernels.items()),
                                      key=lambda r: -r[1])[:TOP_KERNELS]}


def profile_ops(events: Iterable[Any], steps: int, top: int = TOP_OPS) -> List[List[Any]]:
    """The host ops whose kernels took the most device time: which call made a copy.

    A kernel family (:func:`profile_tables`) says *what* ran (``elementwise_kernel``: a
    strided copy); this says *who* launched it: each op's own device time (its kernels
    minus its child ops'), grouped by the op's parent chain, its input shapes and the
    first source line outside torch on the Python stack of the op or its nearest
    ancestor that has one (backward ops run on autograd's thread and have no stack: their
    chain names the autograd node, e.g. ``ToCopyBackward0``).

    Args:
        events: ``torch.profiler.profile.events()`` of a capture with ``record_shapes``
            and ``with_stack`` (FunctionEvent-like: ``name``, ``device_type``,
            ``self_device_time_total`` in us, ``cpu_parent``, ``input_shapes``, ``stack``,
            ``is_user_annotation``).
        steps: the training steps the capture spans (> 0). top: rows kept.

    Returns:
        ``[[chain "op < parent < grandparent < ...", input shapes, source line, ms per
        step, calls per step], ...]``, the most device time first.

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the profiled steps), got {steps}")
    rows: Dict[tuple, List[float]] = {}
    for e in events:
        if (e.device_type != torch.autograd.DeviceType.CPU
                or getattr(e, "is_user_annotation", False)):
            continue
        us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if us <= 0:
            continue
        chain, line, p = [], "", e
        while p is not None:
            if len(chain) < 4:
                chain.append(p.name)
            if not line:
                line = next((f for f in (getattr(p, "stack", None) or [])
                             if "/torch/" not in f and "<built-in" not in f), "")
            if len(chain) >= 4 and line:
                break
            p = p.cpu_parent
        shapes = getattr(e, "input_shapes", None)
        key = (" < ".join(chain), str([list(s) for s in shapes]) if shapes else "", line)
        row = rows.setdefault(key, [0.0, 0.0])
        row[0] += us / 1e3 / steps
        row[1] += 1 / steps
    return sorted(([*k, ms, n] for k, (ms, n) in rows.items()), key=lambda r: -r[3])[:top]


def run_cell(cfg: Any, warmup: int, profile_steps: int = 0) -> Dict[str, Any]:
    """Train ``cfg`` (a :class:`lrmoe.training.config.TrainConfig` with checkpoints off)
    and summarise its steps ``warmup + 1 .. cfg.run.steps``; with ``profile_steps`` > 0
    train that many steps more and capture them with ``torch.profiler`` (device time
    per :data:`KINDS` category, ms per step). The profiled steps come after the measured
    ones and are left out of them: the profiler slows the host (2026-12-07, H100: the
    profiled c = 0 cell's median step was 217 ms against 192 ms of its c = 0.3 cell,
    whose MoE is only 10 ms shorter), which would inflate every ratio to c = 0."""
    from lrmoe.training import train as T

    prof = None
    last = cfg.run.steps
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       record_shapes=True, with_stack=True)
        cfg = cfg.replace(steps=last + profile_steps)

    def step_callback(trainer: Any, step: int) -> None:
        if prof is not None and step in (last, last + profile_steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.start() if step == last else prof.stop()

    result = T.train(cfg, overwrite=True, step_callback=step_callback if prof else None)
    out = {**_summary(result.out_dir, warmup, last),
           "peak_gib": result.summary.get("peak_cuda_memory_gib"),
           # the LM head's rows: the trained tokenizer's size, which can be below
           # data.vocab_size on a small corpus
           "vocab_size": int(result.model.config.vocab_size)}
    if prof is not None:
        events = prof.events()
        out.update(profile_tables(events, profile_steps))
        out["profile_ops"] = profile_ops(events, profile_steps)
    del result
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


#: the kinds of cell (``--methods``): lrmoe train; torchtitan's model with its own MoE;
#: torchtitan's model with LRMoE's experts (lrmoe/bench/titan_step.py)
METHODS = ("lrmoe", "titan", "titan-lrmoe")


def _summary(run: Path, warmup: int, last: Optional[int] = None) -> Dict[str, Any]:
    """Medians over the records of ``run/metrics.jsonl`` after ``warmup`` up to step
    ``last`` (None: all; any cell)."""
    recs = [r for r in _records(run, warmup) if last is None or r["step"] <= last]
    if not recs:
        raise ValueError(f"--steps must exceed --warmup ({warmup}): no step left to measure")
    out = {"tokens_per_step": recs[0]["tokens"],
           "step_ms": statistics.median(r["time_s"] for r in recs) * 1e3,
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs),
           "steps": len(recs),
           "losses": [r["loss"] for r in _records(run, 0)]}
    for key in ("moe_time_ms", "moe_forward_ms", "moe_backward_ms"):
        vals = [r[key] for r in recs if r.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    return out


def bench_step(preset: str, rates: Sequence[float], attentions: Sequence[str], steps: int,
               warmup: int, sets: Sequence[str], out_dir: Path, profile: bool = False,
               peak_tflops: float = H200_BF16_TFLOPS, methods: Sequence[str] = ("lrmoe",),
               titan_attention: str = "auto", compiles: Sequence[bool] = (False,)
               ) -> Dict[str, Any]:
    """Every cell of ``methods`` at one preset, one after another, with ratios.

    Cells: ``lrmoe``: every (compile, attention, c) of :func:`run_cell`, named
    ``{attention}-c{c}`` (``{attention}+compile-c{c}`` with ``run.compile``);
    ``titan``: torchtitan's Qwen3 MoE model with its own MoE, one cell
    ``titan-{backend}``; ``titan-lrmoe``: that model with LRMoE's experts at each c,
    ``titan-lrmoe-{backend}-c{c}`` (:mod:`lrmoe.bench.titan_step`: the same batches,
    loss, optimizer, clipping and timing as lrmoe train). Ratios of tokens/s in the same
    run: ``speedup_vs_c0`` (lrmoe cells: to the c = 0 cell of their attention and
    compile setting;
    titan-lrmoe cells: to titan-lrmoe at c = 0), ``vs_titan`` (to the titan cell) and
    ``vs_lrmoe_c0`` (to lrmoe at c = 0 of the first attention); None where the
    reference cell is not in the run.

    Args:
        preset: ``lrmoe train`` preset (e.g. ``qwen3-slice``). rates: c values (the first
            should be 0, the baseline of its attention). attentions: ``run.attention``
            values of the lrmoe cells. steps, warmup: steps per cell and how many to
            leave out.
        sets: extra ``--set key=value`` items for every cell. out_dir: the cells' run
            folders and ``step.json`` / ``step.md``. profile: capture the first lrmoe cell
            of each ``compiles`` value.
        peak_tflops: the device's dense bf16 peak, for the utilisation.
        methods: a subset of :data:`METHODS`. titan_attention: the torchtitan cells'
            attention (:data:`lrmoe.bench.titan_step.TITAN_ATTENTIONS`).
        compiles: ``run.compile`` values of the lrmoe cells (False: eager).

    Raises:
        ValueError: ``steps <= warmup``, an unknown method or attention, a bad preset or
            setting (from the trainer).
        ModuleNotFoundError: a titan method without torchtitan (naming
            requirements/torchtitan.txt).
    """
    from lrmoe.training import train as T

    if steps <= warmup:
        raise ValueError(f"--steps ({steps}) must exceed --warmup ({warmup})")
    if not compiles:
        raise ValueError("--compile needs at least one of off, on")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"--methods must be some of {', '.join(METHODS)}; got "
                         f"{list(methods)}")
    titan = [m for m in METHODS[1:] if m in methods]
    if titan:
        from lrmoe.bench import titan_step as TS

        TS.require_titan()
        if titan_attention not in TS.TITAN_ATTENTIONS:
            raise ValueError(f"--titan-attention must be one of "
                             f"{', '.join(TS.TITAN_ATTENTIONS)}; got {titan_attention!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    common = [*sets, f"run.steps={steps}", "run.eval_every=0", "run.eval_batches=1",
              "run.checkpoints=false", "run.time_moe=true", "run.progress=none"]
    cells: List[Dict[str, Any]] = []
    fpt = None

    def finish(cell: Dict[str, Any], flops: float) -> None:
        cell["flops_per_token"] = flops
        cell["mfu"] = cell["tokens_per_s"] * flops / (peak_tflops * 1e12)
        cell["moe_share"] = (cell["moe_time_ms"] / cell["step_ms"]
                             if cell.get("moe_time_ms") else None)
        cells.append(cell)
        (out_dir / "step.json").write_text(json.dumps(cells, indent=2) + "\n")

    lrmoe_cells = [(k, a, c) for k in compiles for a in attentions for c in rates]
    for compiled, attention, c in (lrmoe_cells if "lrmoe" in methods else []):
        name = f"{attention}{'+compile' if compiled else ''}-c{c:g}"
        cfg = T.build_config(preset, sets=[
            *common, f"run.attention={attention}", f"lrmoe.recalibration_rate={c}",
            f"run.compile={str(bool(compiled)).lower()}", f"run.out_dir={out_dir / name}"])
        # the first cell of each compile setting: the profile before and after compiling
        first = profile and not any(b.get("compile") == bool(compiled) for b in cells)
        cell = {"name": name, "method": "lrmoe", "attention": attention, "rate": c,
                "compile": bool(compiled),
                **run_cell(cfg, warmup, profile_steps=2 if first else 0)}
        fpt = flops_per_token(cfg.model, cell["vocab_size"], cfg.data.seq_len)
        finish(cell, fpt)
    if titan:
        cfg = T.build_config(preset, sets=[*common, f"run.out_dir={out_dir / 'titan'}"])
        data = TS.load_preset_data(cfg)
        if fpt is None:
            fpt = flops_per_token(cfg.model, data.vocab_size, cfg.data.seq_len)
        runs = ([("titan", None)] if "titan" in titan else []) + \
            ([("titan-lrmoe", c) for c in rates] if "titan-lrmoe" in titan else [])
        from lrmoe.training.setup import resolve_device

        backend = TS.resolve_attention(titan_attention, resolve_device(cfg.run.device))
        for method, c in runs:
            name = f"{method}-{backend}" + ("" if c is None else f"-c{c:g}")
            got = TS.train_titan(cfg, data, titan_attention, c, out_dir / name)
            cell = {"name": name, "method": method, "attention": got["attention"],
                    "rate": c, **_summary(out_dir / name, warmup), "peak_gib": got["peak_gib"]}
            finish(cell, got["flops_per_token"])

    def tps(pred: Any) -> Optional[float]:
        ref = next((b for b in cells if pred(b)), None)
        return ref["tokens_per_s"] if ref else None

    titan_tps = tps(lambda b: b["method"] == "titan")
    lrmoe_tps = tps(lambda b: b["method"] == "lrmoe" and b["rate"] == 0)
    for cell in cells:
        same = cell["method"]
        base = None if same == "titan" else tps(
            lambda b: b["method"] == same and b["attention"] == cell["attention"]
            and b.get("compile") == cell.get("compile") and b["rate"] == 0)
        cell["speedup_vs_c0"] = cell["tokens_per_s"] / base if base else None
        cell["vs_titan"] = cell["tokens_per_s"] / titan_tps if titan_tps else None
        cell["vs_lrmoe_c0"] = cell["tokens_per_s"] / lrmoe_tps if lrmoe_tps else None
    result = {"preset": preset, "steps": steps, "warmup": warmup, "sets": list(sets),
              "methods": list(methods), "peak_tflops": peak_tflops,
              "flops_per_token": fpt, "device": _device_name(), "cells": cells}
    (out_dir / "step.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "step.md").write_text(markdown(result))
    return result


def _device_name() -> str:
    """The GPU's name (timings of two cards must never mix unknowingly), else ``cpu``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def markdown(result: Dict[str, Any]) -> str:
    """The cells as a markdown table (and the profile of the first cell)."""
    titan = any(c.get("method", "lrmoe") != "lrmoe" for c in result["cells"])
    lines = [f"preset {result['preset']}, {result['steps']} steps (first {result['warmup']} "
             f"left out), model FLOPs {result['flops_per_token'] / 1e9:.2f} GFLOP/token, "
             f"peak {result['peak_tflops']:g} TFLOP/s, device {result.get('device', '?')}",
             "",
             "| cell | tok/s | step ms | MoE ms (fwd + bwd) | MoE share | MFU | peak GiB "
             "| x c=0 |" + (" x titan | x lrmoe c=0 |" if titan else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if titan else "")]

    def ratio(x: Optional[float]) -> str:
        return f"{x:.3f}" if x else "-"

    for c in result["cells"]:
        moe = (f"{c['moe_time_ms']:.1f} ({c['moe_forward_ms']:.1f} + {c['moe_backward_ms']:.1f})"
               if c.get("moe_time_ms") else "-")
        share = f"{100 * c['moe_share']:.0f} %" if c.get("moe_share") else "-"
        peak = f"{c['peak_gib']:.1f}" if c.get("peak_gib") else "-"
        row = (f"| {c['name']} | {c['tokens_per_s']:,.0f} | {c['step_ms']:.1f} | {moe} "
               f"| {share} | {100 * c['mfu']:.1f} % | {peak} | {ratio(c['speedup_vs_c0'])} |")
        if titan:
            row += f" {ratio(c.get('vs_titan'))} | {ratio(c.get('vs_lrmoe_c0'))} |"
        lines.append(row)
    for prof in (c for c in result["cells"] if "profile_ms" in c):
        total = sum(prof["profile_ms"].values())
        lines += ["", f"Device time per step by kernel kind ({prof['name']}, torch.profiler, "
                      f"2 steps; busy {total:.1f} ms of a {prof['step_ms']:.1f} ms step):", "",
                  "| kind | ms | share of busy |", "|---|---|---|"]
        lines += [f"| {k} | {v:.1f} | {100 * v / total:.0f} % |"
                  for k, v in prof["profile_ms"].items()]
        lines += ["", f"The {TOP_KERNELS} kernel families with the most device time per step:", "",
                  "| kind: kernel family | ms | launches |", "|---|---|---|"]
        lines += [f"| {n} | {ms:.2f} | {cnt:.0f} |" for n, ms, cnt in prof.get("profile_kernels", [])]
        if prof.get("profile_ops"):
            lines += ["", "Host ops by their own device time (op < parent < ...; input "
                      "shapes; first source line outside torch):", "",
                      "| op chain | input shapes | source | ms per step | calls per step |",
                      "|---|---|---|---|---|"]
            lines += [f"| {ch} | {sh[:120]} | {src[-90:]} | {ms:.2f} | {n:.0f} |"
                      for ch, sh, src, ms, n in prof["profile_ops"]]
    return "\n".join(lines) + "\n"
