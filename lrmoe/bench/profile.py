"""Where the time goes: the Chrome trace of one profiled step and its analysis
(``lrmoe bench layer --profile-dir DIR``).

:func:`lrmoe.bench.timing.profile_step` wraps the forward in a ``lrmoe:forward`` and the
backward in a ``lrmoe:backward`` range; the profile is written as a Chrome trace
(``torch.profiler`` ``export_chrome_trace``, open it in https://ui.perfetto.dev or
chrome://tracing) and read back by :func:`where_time_goes`:

* every device op (CUDA kernel, memcpy, memset) belongs to the forward or the backward by
  the host time of its launch (the ``cuda_runtime``/``cuda_driver`` event with the same
  ``correlation`` id), and to the innermost ``lrmoe.*`` range around that launch on the
  launching thread (its *phase*);
* per part: device time and count per kernel name (template arguments dropped, so one
  kernel family is one row), the span from the first op's start to the last op's end,
  the busy time (union of the ops' intervals) and the idle time (span - busy = the sum
  of the gaps between consecutive ops);
* every gap: its length, the ops before and after it with their phases, and the host
  range running at the gap's middle (the innermost ``record_function`` range on any
  thread, else the innermost ``cpu_op``): the GPU is idle because the host was there.

Times in the trace are microseconds; every result here is in ms. Off CUDA there are no
device ops: the smoke run treats the host's ``cpu_op`` events as the ops.
"""
from __future__ import annotations

import bisect
import json
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from lrmoe.utils.phases import BWD_RANGE, FWD_RANGE

PARTS = (("forward", FWD_RANGE), ("backward", BWD_RANGE))
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_RANGE_CAT = "user_annotation"
CPU_OP_CAT = "cpu_op"
#: gaps listed per part (the largest), and kernel rows per part in the markdown
TOP_GAPS, TOP_KERNELS = 10, 15


def load_trace(path) -> List[dict]:
    """The complete ("ph": "X") events of a Chrome trace file (``torch.profiler``
    ``export_chrome_trace``), as dicts with at least ``name``, ``cat``, ``ts``, ``dur``."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def kernel_family(name: str) -> str:
    """A kernel's name without its return type, template arguments and parameter list
    (``void at::native::f<float, 4>(float*)`` -> ``at::native::f``): one row per kernel
    family in the tables."""
    s = re.sub(r"^void ", "", name.strip())
    out, depth = [], 0
    for ch in s:  # drop everything inside <...>, also nested
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out)
    s = s.split("(", 1)[0].strip()
    return s or name


class _Ranges:
    """Host ranges of one thread (or of all), for "innermost range containing t"."""

    def __init__(self, events: Iterable[dict]) -> None:
        self.items = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
                             for e in events), key=lambda r: r[0])
        self.starts = [r[0] for r in self.items]

    def innermost(self, t: float, prefix: str = "") -> Optional[str]:
        best = None
        for start, end, name in self.items[:bisect.bisect_right(self.starts, t)]:
            if start <= t <= end and name.startswith(prefix):
                if best is None or end - start < best[0]:
                    best = (end - start, name)
        return None if best is None else best[1]


def _thread(e: dict) -> Tuple[object, object]:
    return e.get("pid"), e.get("tid")


def where_time_goes(events: Sequence[dict], device_cats: Sequence[str] = DEVICE_CATS,
                    top_gaps: int = TOP_GAPS) -> dict:
    """Kernel totals and idle gaps of the forward and the backward of one step.

    Args:
        events: complete trace events (:func:`load_trace`), each with ``name``, ``cat``,
            ``ts`` and ``dur`` (us), optionally ``pid``/``tid`` and ``args.correlation``.
            Must hold one ``lrmoe:forward`` and one ``lrmoe:backward`` host range (the
            first of each is used).
        device_cats: the categories that are device ops (``cpu_op`` for the CPU smoke).
        top_gaps: how many of the largest gaps to list per part.

    Returns:
        ``{"forward": part, "backward": part}``, each part a dict: ``span_ms``,
        ``busy_ms``, ``idle_ms``, ``num_ops``, ``num_gaps``; ``kernels``: list of
        ``{"name", "ms", "count"}`` by decreasing ms (per :func:`kernel_family`);
        ``phases``: phase -> device ms of its ops; ``graph_launches``: CUDA-graph
        launches in the part (their kernels count only if the profiler recorded them:
        it must run while the graph is captured); ``idle_by_host_range``: host range ->
        ms of the gaps it was running in; ``gaps``: the ``top_gaps`` largest, each
        ``{"ms", "start_ms"`` (from the part's first op), ``"before", "after"`` (kernel
        families), ``"before_phase", "after_phase", "host_range"}``.

    Raises:
        ValueError: no ``lrmoe:forward`` or ``lrmoe:backward`` range in ``events``
            (the trace is not from :func:`lrmoe.bench.timing.profile_step`).
    """
    marks = {}
    for e in events:
        if e.get("cat") == HOST_RANGE_CAT and e["name"] in (FWD_RANGE, BWD_RANGE):
            marks.setdefault(e["name"], (float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    missing = [n for n in (FWD_RANGE, BWD_RANGE) if n not in marks]
    if missing:
        raise ValueError(f"trace has no {' or '.join(missing)} range: profile the step with "
                         "lrmoe.bench.timing.profile_step, which marks forward and backward")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    host_ranges = [e for e in events if e.get("cat") == HOST_RANGE_CAT
                   and e["name"] not in (FWD_RANGE, BWD_RANGE)]
    by_thread: Dict[tuple, List[dict]] = {}
    for e in host_ranges:
        by_thread.setdefault(_thread(e), []).append(e)
    thread_ranges = {k: _Ranges(v) for k, v in by_thread.items()}
    all_ranges = _Ranges(host_ranges)
    cpu_ops = _Ranges(e for e in events if e.get("cat") == CPU_OP_CAT)

    ops = {name: [] for name, _ in PARTS}
    for e in events:
        if e.get("cat") not in device_cats:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        src = launch if launch is not None else e
        t = float(src["ts"])
        part = next((p for p, mark in PARTS if marks[mark][0] <= t <= marks[mark][1]), None)
        if part is None:
            continue
        ranges = thread_ranges.get(_thread(src))
        phase = (ranges.innermost(t, "lrmoe.") if ranges else None) or "(no phase)"
        start = float(e["ts"])
        ops[part].append((start, start + float(e["dur"]), kernel_family(e["name"]), phase))
    out = {part: _part(sorted(ops[part]), all_ranges, cpu_ops, top_gaps)
           for part, _ in PARTS}
    for part, mark in PARTS:  # a replayed CUDA graph's kernels may go unrecorded
        out[part]["graph_launches"] = sum(
            1 for e in launches.values() if "GraphLaunch" in e["name"]
            and marks[mark][0] <= float(e["ts"]) <= marks[mark][1])
    return out


def _part(ops: List[tuple], ranges: _Ranges, cpu_ops: _Ranges, top_gaps: int) -> dict:
    """One part's totals and gaps from its (start, end, family, phase) ops, sorted."""
    kernels: Dict[str, List[float]] = {}
    phases: Dict[str, float] = {}
    gaps, busy = [], 0.0
    reach, last = None, None  # the latest end so far and the op that reaches it
    for op in ops:
        start, end, family, phase = op
        k = kernels.setdefault(family, [0.0, 0])
        k[0] += end - start
        k[1] += 1
        phases[phase] = phases.get(phase, 0.0) + end - start
        if reach is None:
            busy += end - start
        elif start > reach:
            mid = 0.5 * (reach + start)
            host = ranges.innermost(mid) or cpu_ops.innermost(mid) or "(host idle)"
            gaps.append(dict(ms=(start - reach) / 1e3, start_ms=(reach - ops[0][0]) / 1e3,
                             before=last[2], after=family, before_phase=last[3],
                             after_phase=phase, host_range=host))
            busy += end - start
        else:
            busy += max(0.0, end - reach)
        if reach is None or end > reach:
            reach, last = end, op
    span = (reach - ops[0][0]) if ops else 0.0
    idle_by: Dict[str, float] = {}
    for g in gaps:
        idle_by[g["host_range"]] = idle_by.get(g["host_range"], 0.0) + g["ms"]
    return dict(
        span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3,
        num_ops=len(ops), num_gaps=len(gaps),
        kernels=[dict(name=n, ms=v[0] / 1e3, count=v[1])
                 for n, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])],
        phases={k: v / 1e3 for k, v in sorted(phases.items(), key=lambda kv: -kv[1])},
        idle_by_host_range=dict(sorted(idle_by.items(), key=lambda kv: -kv[1])),
        gaps=sorted(gaps, key=lambda g: -g["ms"])[:top_gaps])


def trace_name(rec: dict) -> str:
    """File stem of a record's trace: ``qwen3-30b-a3b_32768_skewed_lrmoe-c-0.2``."""
    raw = f"{rec['shape']}_{rec['tokens']}_{rec['routing']}_{rec['label']}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw.replace("=", "-")).strip("-")


def markdown(records: Sequence[dict], meta: dict) -> str:
    """The "where the time goes" section of the records that carry ``time_goes``."""
    lines = [f"### Where the time goes, {meta['date']} ({meta['device']})", "",
             f"Command: `{meta['command']}`  ",
             "One profiled forward + backward per method (Chrome traces beside this file). "
             "span: first op start to last op end; busy: union of the device ops; idle = "
             "span - busy, the sum of the gaps between consecutive ops. ms.", ""]
    for r in records:
        tg = r.get("time_goes")
        if not tg:
            continue
        lines += [f"#### {r['shape']}, {r['tokens']} tokens, {r['routing']}: {r['label']}",
                  "", "| part | span | busy | idle | ops | gaps | idle by host range |",
                  "|---|---|---|---|---|---|---|"]
        for part, _ in PARTS:
            p = tg[part]
            idle = ", ".join(f"{k} {v:.3f}" for k, v in
                             list(p["idle_by_host_range"].items())[:4]) or "-"
            lines.append(f"| {part} | {p['span_ms']:.3f} | {p['busy_ms']:.3f} | "
                         f"{p['idle_ms']:.3f} | {p['num_ops']} | {p['num_gaps']} | {idle} |")
        for part, _ in PARTS:
            p = tg[part]
            if p.get("graph_launches") and not p["num_ops"]:
                lines += ["", f"{part}: {p['graph_launches']} CUDA-graph launch(es) but no "
                          "kernel recorded: the profiler did not see the graph's kernels"]
            lines += ["", f"{part}: kernels (ms, count) and phases", "",
                      "| kernel | ms | count |", "|---|---|---|"]
            lines += [f"| `{k['name'][:90]}` | {k['ms']:.3f} | {k['count']} |"
                      for k in p["kernels"][:TOP_KERNELS]]
            if len(p["kernels"]) > TOP_KERNELS:
                rest = p["kernels"][TOP_KERNELS:]
                lines.append(f"| ({len(rest)} more) | {sum(k['ms'] for k in rest):.3f} | "
                             f"{sum(k['count'] for k in rest)} |")
            lines += ["", "phases: " + ", ".join(f"{k} {v:.3f}"
                                                 for k, v in p["phases"].items()), ""]
            if p["gaps"]:
                lines += [f"{part}: largest gaps", "",
                          "| ms | at ms | host range | before (phase) | after (phase) |",
                          "|---|---|---|---|---|"]
                lines += [f"| {g['ms']:.3f} | {g['start_ms']:.3f} | {g['host_range']} | "
                          f"`{g['before'][:50]}` ({g['before_phase']}) | "
                          f"`{g['after'][:50]}` ({g['after_phase']}) |" for g in p["gaps"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def write(records: Sequence[dict], meta: dict, out_dir) -> Path:
    """Write ``where_time_goes.md`` and ``where_time_goes.json`` (the records' ``label``,
    case and ``time_goes``) under ``out_dir``; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keep = [dict(shape=r["shape"], tokens=r["tokens"], routing=r["routing"],
                 label=r["label"], time_goes=r["time_goes"])
            for r in records if r.get("time_goes")]
    (out / "where_time_goes.json").write_text(json.dumps(dict(meta=meta, records=keep),
                                                         indent=1))
    (out / "where_time_goes.md").write_text(markdown(records, meta))
    return out
