"""Routing trace: the expert ids each MoE layer routed, per recorded step.

Recorded from a real training run (``lrmoe train --record-trace PATH``) and replayed by
``lrmoe bench layer --routing trace`` so the benchmark sees real routing skew. Stored as
one compressed ``.npz``: an array ``s{step}_l{layer}`` of shape (T, K) per record, uint8
when E <= 256 else int16, plus ``meta`` (JSON: num_experts, top_k, layers, steps).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch
from torch import Tensor


class RoutingTrace:
    """Collects (T, K) expert ids per (step, layer) and saves them compressed.

    Args:
        num_experts: E (decides the integer width on disk).
        top_k: K.
        every: record one step in ``every`` (copying ids to the host costs a sync).

    Raises:
        ValueError: ids of another K, or outside [0, E).
    """

    def __init__(self, num_experts: int, top_k: int, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"RoutingTrace every must be >= 1, got {every}")
        self.num_experts, self.top_k, self.every = num_experts, top_k, every
        self.step = 0
        self.records: Dict[Tuple[int, int], np.ndarray] = {}

    def wants(self) -> bool:
        """True when the current step is one to record."""
        return self.step % self.every == 0

    def record(self, layer: int, expert_ids_TK: Tensor) -> None:
        """Keep the ids of ``layer`` for the current step (copies to the host)."""
        if expert_ids_TK.dim() != 2 or expert_ids_TK.shape[1] != self.top_k:
            raise ValueError(f"RoutingTrace expects (T, {self.top_k}) ids, got "
                             f"{tuple(expert_ids_TK.shape)}")
        dtype = np.uint8 if self.num_experts <= 256 else np.int16
        self.records[(self.step, layer)] = expert_ids_TK.detach().cpu().numpy().astype(dtype)

    def save(self, path: os.PathLike) -> Path:
        """Write the trace atomically to ``path`` (.npz); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f"s{s}_l{l}": v for (s, l), v in sorted(self.records.items())}
        meta = dict(num_experts=self.num_experts, top_k=self.top_k,
                    layers=sorted({l for _, l in self.records}),
                    steps=sorted({s for s, _ in self.records}))
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
        os.close(fd)
        np.savez_compressed(tmp, **arrays)
        os.replace(tmp, path)
        return path


def load_trace(path: os.PathLike) -> Tuple[dict, List[np.ndarray]]:
    """Read a trace written by :meth:`RoutingTrace.save`.

    Returns:
        (meta dict, list of (T, K) integer arrays in (step, layer) order).

    Raises:
        FileNotFoundError: no file at ``path`` (record one with ``lrmoe train
            --record-trace PATH``).
        ValueError: a file that is not such a trace (naming it and the fix).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no routing trace at {path}; record one with "
                                "`lrmoe train --record-trace PATH`")
    bad = (f"{path} is not a routing trace (an .npz with 'meta' written by `lrmoe train "
           "--record-trace PATH`)")
    try:
        data = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError):  # numpy's own text suggests unpickling it
        raise ValueError(bad) from None
    if not isinstance(data, np.lib.npyio.NpzFile) or "meta" not in data.files:
        raise ValueError(bad)
    with data:
        meta = json.loads(bytes(data["meta"]).decode())
        keys = sorted((k for k in data.files if k != "meta"),
                      key=lambda k: tuple(int(p[1:]) for p in k.split("_")))
        return meta, [data[k].astype(np.int64) for k in keys]


def trace_routing(path: os.PathLike, num_tokens: int, num_experts: int, top_k: int,
                  seed: int = 0) -> Tensor:
    """(num_tokens, top_k) int64 expert ids drawn from a recorded trace.

    Rows (tokens) are sampled with replacement from all records, so any token count can
    be served from a trace of another batch size; the per-token expert sets (and hence
    the load skew of the recorded model) are kept.

    Raises:
        ValueError: the trace was recorded with another number of experts or top_k.
    """
    meta, arrays = load_trace(path)
    if meta["num_experts"] != num_experts or meta["top_k"] != top_k:
        raise ValueError(f"trace {path} has E={meta['num_experts']}, K={meta['top_k']} but "
                         f"the benchmark shape needs E={num_experts}, K={top_k}")
    rows = torch.from_numpy(np.concatenate(arrays))
    gen = torch.Generator().manual_seed(seed)
    return rows[torch.randint(0, rows.shape[0], (num_tokens,), generator=gen)]
