"""What a run reports: ``metrics.jsonl`` (and, as an option, the same scalars as
TensorBoard events), the progress bar or lines, the loss-curve PNG and the summary table.

``metrics.jsonl`` holds one JSON object per line: ``{"kind": "train", "step", "loss",
"ppl", "aux_loss", "lr", "grad_norm", "tokens", "loss_tokens", "tokens_per_s", "time_s",
"dropped_fraction", "retained_mass", "load_max_over_mean_before",
"load_max_over_mean_after"}`` every ``run.log_every`` steps and ``{"kind": "eval",
"step", "val_loss", "val_ppl", "val_tokens"}`` at step 0, every ``run.eval_every`` steps
and at the end. TensorBoard gets every numeric field as the scalar ``<kind>/<field>`` at
global step ``step`` (``train/loss``, ``eval/val_ppl``, ...).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from torch import nn

from lrmoe.training.distributed import log

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss_curve.png"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
DIAGNOSTIC_KEYS = ("dropped_fraction", "retained_mass", "load_max_over_mean_before",
                   "load_max_over_mean_after")


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (flushed per record) and, with
    ``tensorboard``, writes their numeric fields with ``torch.utils.tensorboard``.

    Args:
        path: the ``metrics.jsonl`` file (appended to).
        tensorboard_dir: folder of the TensorBoard events, or None for none.
        purge_step: on resume, the first step the new events replace (TensorBoard drops
            events of the earlier writer from this step on).

    Raises:
        ImportError: ``tensorboard_dir`` given but the ``tensorboard`` package is missing
            (the message says what to install).
    """

    def __init__(self, path: Path, tensorboard_dir: Optional[Path] = None,
                 purge_step: Optional[int] = None) -> None:
        self.path = path
        self.writer = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("run.tensorboard needs the tensorboard package: pip install "
                                  "'lrmoe[train]' (or pip install tensorboard)") from exc
            self.writer = SummaryWriter(str(tensorboard_dir), purge_step=purge_step)
        self._file = open(path, "a")

    def write(self, record: Mapping[str, Any]) -> None:
        """One record: a JSON line, and its numbers as ``<kind>/<key>`` scalars."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    self.writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def flush(self) -> None:
        """Flush the JSON file and the event file."""
        self._file.flush()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush and close both."""
        self._file.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | os.PathLike) -> List[Dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order ([] when there is none)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def mean(values: Sequence[Optional[float]]) -> Optional[float]:
    """Mean of the values that are not None (None when none is)."""
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def diagnostics_means(model: nn.Module) -> Dict[str, Optional[float]]:
    """The LRMoE diagnostics of the last step (:data:`DIAGNOSTIC_KEYS`) over the MoE
    layers: :func:`diagnostics_means_of` of
    ``lrmoe.integrations.transformers.collect_diagnostics(model)`` (synchronises with the
    device)."""
    from lrmoe.integrations.transformers import collect_diagnostics

    return diagnostics_means_of(collect_diagnostics(model))


def diagnostics_means_of(diagnostics: Mapping[str, Mapping[str, Any]]
                         ) -> Dict[str, Optional[float]]:
    """:data:`DIAGNOSTIC_KEYS` of per-layer diagnostics (``{layer name: dict}`` as
    ``collect_diagnostics`` returns): ``lrmoe.integrations.transformers.
    summarize_diagnostics`` (the dropped fraction pooled over the layers' pairs -- its one
    definition, ``lrmoe.moe.stats.dropped_fraction`` --, the other keys means over the
    layers); with offload also the summed bytes of :func:`offload_bytes`."""
    from lrmoe.integrations.transformers import summarize_diagnostics

    summary = summarize_diagnostics(diagnostics)
    out = {k: summary.get(k) for k in DIAGNOSTIC_KEYS}
    out.update(offload_bytes(diagnostics))
    return out


def offload_bytes(diagnostics: Mapping[str, Mapping[str, Any]]) -> Dict[str, int]:
    """``offload_d2h_bytes`` and ``offload_h2d_bytes`` of the last micro-step, summed over
    the MoE layers (``lrmoe.moe.offload.OffloadStats``); empty without offload."""
    out: Dict[str, int] = {}
    for key in ("offload_d2h_bytes", "offload_h2d_bytes"):
        values = [int(d[key]) for d in diagnostics.values() if d.get(key) is not None]
        if values:
            out[key] = sum(values)
    return out


class Progress:
    """A tqdm bar on a terminal, else plain lines to stderr (rank 0 only).

    Args:
        mode: ``auto``, ``bar``, ``lines`` or ``none`` (``run.progress``).
        total, initial: the run's last step and the step it starts from.
        log_every: ``lines`` prints every this many steps (``auto`` every ~2 % of the run).
    """

    def __init__(self, mode: str, total: int, initial: int, log_every: int) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() and _terminal_columns() >= 40 else "lines"
            every = max(log_every, total // 50)
        else:
            every = log_every
        self.mode, self.every, self.bar = mode, max(1, every), None
        if mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def update(self, step: int, total: int, record: Mapping[str, Any]) -> None:
        """After step ``step``: the bar advances / a line every ``every`` steps."""
        text = progress_text(record)
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.mode == "lines" and (step % self.every == 0 or step == total):
            log(f"step {step}/{total}  {text}")

    def write(self, text: str) -> None:
        """A line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        elif self.mode != "none":
            log(text)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def progress_text(r: Mapping[str, Any]) -> str:
    """``loss 3.210  ppl 24.8  tok/s 5120  drop 20.0%  rho 0.934`` of a train record."""
    parts = [f"loss {r['loss']:.3f}", f"ppl {r['ppl']:.1f}"]
    if r.get("tokens_per_s"):
        parts.append(f"tok/s {r['tokens_per_s']:.0f}")
    if r.get("dropped_fraction") is not None:
        parts.append(f"drop {100 * r['dropped_fraction']:.1f}%")
    if r.get("retained_mass") is not None:
        parts.append(f"rho {r['retained_mass']:.3f}")
    return "  ".join(parts)


def write_loss_curve(metrics_path: str | os.PathLike, png_path: str | os.PathLike,
                     title: str = "") -> None:
    """Plot training loss (per logged step) and validation loss against the step (PNG, Agg
    backend, no pyplot state; written atomically)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    train_r = [r for r in records if r["kind"] == "train"]
    eval_r = [r for r in records if r["kind"] == "eval"]
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train_r:
        ax.plot([r["step"] for r in train_r], [r["loss"] for r in train_r], lw=0.8,
                alpha=0.8, label="train loss")
    if eval_r:
        ax.plot([r["step"] for r in eval_r], [r["val_loss"] for r in eval_r], "o-", lw=1.5,
                label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if train_r or eval_r:
        ax.legend()
    fig.tight_layout()
    tmp = Path(str(png_path) + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, png_path)


def print_summary(summary: Mapping[str, Any], file: Any = None) -> None:
    """Print the run summary (``summary.json``'s numbers) as a rich table to stdout."""
    from rich.console import Console
    from rich.table import Table

    def fmt(v: Any, spec: str = "") -> str:
        if v is None:
            return "-"
        return format(v, spec) if spec else str(v)

    rows = [
        ("steps", f"{summary['steps']} ({summary['steps_this_run']} in this run)"
         + (", interrupted" if summary.get("interrupted") else "")),
        ("tokens", fmt(summary["tokens"], ",")),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
        ("tokens/s", fmt(summary["tokens_per_s"], ",.0f")),
        ("parameters", f"{summary['params_millions']:.2f} M"),
        ("val ppl (first)", f"{fmt(summary['first_val_ppl'], '.2f')} at step "
                            f"{fmt(summary['first_val_step'])}"),
        ("val ppl (last)", f"{fmt(summary['last_val_ppl'], '.2f')} at step "
                           f"{fmt(summary['last_val_step'])}"),
        ("dropped fraction", fmt(summary["dropped_fraction"], ".2%")),
        ("retained mass rho", fmt(summary["retained_mass"], ".4f")),
    ]
    if "peak_cuda_memory_gib" in summary:
        rows.append(("peak CUDA memory", f"{summary['peak_cuda_memory_gib']:.2f} GiB"))
    else:
        rows.append(("max RSS", f"{summary['max_rss_gib']:.2f} GiB"))
    rows += [("device", summary["device"]), ("out dir", summary["out_dir"])]
    table = Table(title=f"lrmoe train: c={summary['recalibration_rate']:g}, "
                        f"metric={summary['metric']}")
    table.add_column("")
    table.add_column("value")
    for k, v in rows:
        table.add_row(k, v)
    Console(file=file or sys.stdout).print(table)
