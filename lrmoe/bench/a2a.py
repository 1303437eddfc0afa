"""``lrmoe bench a2a``: the all-to-all link of one node, measured, and the link file the
simulator reads (configs/links/*.yaml, docs/simulation.md "Links").

    torchrun --nproc-per-node N -m lrmoe bench a2a --out a2a-out
    lrmoe sim --costs configs/costs/h200.json --links a2a-out/links.yaml \\
        --validate bench-ep/layer_bench_ep.json

Every rank sends ``S`` bytes to every rank (``torch.distributed.all_to_all_single``,
equal splits) for each size ``S`` of a sweep; per size the median over ``--iters`` calls
(after ``--warmup``), the maximum of the ranks' medians. The simulator charges one
all-to-all ``latency + off-rank bytes / bandwidth`` per rank (csrc/sim/sim.cpp,
``sums_ms``), where the off-rank bytes are the larger of what the rank sends to and
receives from the other ranks: here ``(W - 1) S``. :func:`fit_link` fits exactly that
line to the medians, minimising the relative residuals so that the small sizes (latency)
weigh as much as the large ones (bandwidth).

One node only: the network figures (``inter_node``) are copied from ``--base-links``
with their sources; a world spanning nodes is refused.

Legend: N sizes of the sweep, W ranks.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import yaml

from lrmoe.utils.paths import check_output
from lrmoe.sim.links import DEFAULT_LINKS, Links

#: default per-peer message sizes, KiB: 4 KiB (latency-bound) to 64 MiB (bandwidth-bound)
DEFAULT_SIZES_KIB = (4, 16, 64, 256, 1024, 4096, 16384, 65536)
#: the largest per-peer size, KiB (16 GiB): each rank holds 2 x W x size bytes, so even at
#: W = 2 this is 64 GiB, and larger sizes only measure the same bandwidth again
MAX_SIZE_KIB = 16 << 20
#: the most timed (and untimed) calls per size: the median is settled long before
MAX_ITERS = 10_000
#: the file a sweep whose fit failed is written to, so that a good earlier a2a.json,
#: a2a.md and links.yaml in the same folder stay a consistent set
FAILED_JSON = "a2a_failed.json"


def fit_link(bytes_N: Sequence[float], ms_N: Sequence[float]) -> Tuple[float, float]:
    """Fit ``ms = latency_us / 1e3 + bytes / (GBps * 1e6)`` to measured all-to-all times.

    Weighted least squares with weights ``1 / ms^2`` (the relative residuals), solved in
    closed form from the 2 x 2 normal equations.

    Args:
        bytes_N: off-rank bytes per rank of each measurement (> 0), N >= 2 distinct.
        ms_N: its time in milliseconds (> 0).
    Returns:
        ``(latency_us, GBps)``; latency 0 when the fit's intercept is negative (the
        smallest sizes are then bandwidth-bound too).
    Raises:
        ValueError: fewer than two distinct sizes, a length mismatch, a non-positive
            value, or times that do not grow with the size (no bandwidth to fit: the
            sweep needs larger sizes, ``--sizes-kib``).
    """
    if len(bytes_N) != len(ms_N):
        raise ValueError(f"fit_link: {len(bytes_N)} sizes but {len(ms_N)} times")
    if len(set(bytes_N)) < 2:
        raise ValueError("fit_link: needs at least two distinct sizes (--sizes-kib)")
    if min(bytes_N) <= 0 or min(ms_N) <= 0:
        raise ValueError("fit_link: sizes and times must be > 0")
    w = [1.0 / (t * t) for t in ms_N]
    s0 = sum(w)
    s1 = sum(wi * b for wi, b in zip(w, bytes_N))
    s2 = sum(wi * b * b for wi, b in zip(w, bytes_N))
    t0 = sum(wi * t for wi, t in zip(w, ms_N))
    t1 = sum(wi * b * t for wi, b, t in zip(w, bytes_N, ms_N))
    det = s0 * s2 - s1 * s1
    slope = (s0 * t1 - s1 * t0) / det          # ms per byte
    intercept = (t0 - slope * s1) / s0         # ms
    if intercept < 0:  # through the origin: ms = slope * bytes, same weights
        slope, intercept = t1 / s2, 0.0
    if not slope > 0:
        raise ValueError("fit_link: the times do not grow with the message size, so no "
                         "bandwidth can be fitted; add larger --sizes-kib")
    return intercept * 1e3, 1.0 / (slope * 1e6)


def _time_one(x: torch.Tensor, out: torch.Tensor, iters: int, warmup: int, group) -> float:
    """Median ms of ``all_to_all_single(out, x)`` on this rank, each call after a barrier
    so that no rank's time includes waiting for a late peer."""
    cuda = x.is_cuda
    times: List[float] = []
    for i in range(warmup + iters):
        dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(x.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_to_all_single(out, x, group=group)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            dist.all_to_all_single(out, x, group=group)
            ms = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def measure(sizes_kib: Sequence[int], iters: int, warmup: int, device: torch.device,
            group=None) -> List[Dict[str, float]]:
    """Time the all-to-all at each per-peer size on every rank of ``group`` (a collective:
    every rank calls it with the same arguments).

    Args:
        sizes_kib: bytes each rank sends each peer, in KiB (uint8 buffers of W x size).
        iters, warmup: timed and untimed calls per size (median of the timed).
        device: the rank's device (CUDA for NCCL, the CPU for gloo).
        group: the process group (None: the default group).

    Raises:
        ValueError: a rank could not allocate a size's buffers (``torch.OutOfMemoryError``
            on CUDA, the CPU allocator's ``RuntimeError``), raised on every rank alike.

    Returns:
        One record per size: ``bytes_per_peer``, ``off_rank_bytes`` ((W - 1) x
        bytes_per_peer), ``ms`` (the maximum over ranks of their medians) and
        ``GBps`` (off-rank bytes / ms, the effective bandwidth at that size); the same on
        every rank.
    """
    world = dist.get_world_size(group)
    out = []
    flag_device = device if device.type == "cuda" else "cpu"
    for kib in sizes_kib:
        per_peer = int(kib) * 1024
        try:
            x = torch.empty(world * per_peer, dtype=torch.uint8, device=device).fill_(1)
            y = torch.empty_like(x)
            ok = 1.0
        except RuntimeError as err:
            # torch.OutOfMemoryError on CUDA; the CPU allocator raises a plain RuntimeError
            # ("DefaultCPUAllocator: can't allocate memory"). Anything else is a bug to see.
            if not (isinstance(err, torch.OutOfMemoryError) or "allocate" in str(err)):
                raise
            x = y = None
            ok = 0.0
        # every rank learns of one rank's failed allocation, instead of waiting for it in
        # the next collective until the timeout
        flag = torch.tensor([ok], dtype=torch.float64, device=flag_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if float(flag) < 1.0:
            raise ValueError(f"--sizes-kib {kib}: a rank could not allocate the 2 x "
                             f"{world * per_peer / 2**20:.0f} MiB buffers; drop the largest "
                             "sizes")
        ms = torch.tensor([_time_one(x, y, iters, warmup, group)], dtype=torch.float64,
                          device=flag_device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
        off = (world - 1) * per_peer
        out.append({"bytes_per_peer": per_peer, "off_rank_bytes": off,
                    "ms": float(ms), "GBps": off / (float(ms) * 1e6)})
        del x, y
    return out


def links_document(latency_us: float, GBps: float, gpus_per_node: int, base: Dict[str, Any],
                   source: str) -> Dict[str, Any]:
    """A link file (the format of configs/links/default.yaml): the measured
    ``intra_node`` figures with ``source``, ``inter_node`` as in ``base``.

    Args:
        latency_us: microseconds per all-to-all (written as at least 0.001: the link
            file needs it > 0). GBps: 1e9 bytes per second per rank.
        gpus_per_node: the node's GPUs. base: a parsed link file (its ``inter_node``
            mapping is copied). source: where the figures come from (the command).
    """
    return {"name": f"measured: {source.split(';')[0]} + {base.get('name', 'base')}",
            "gpus_per_node": int(gpus_per_node),
            "intra_node": {"GBps": float(f"{GBps:.6g}"), "source": source,
                           "latency_us": float(f"{max(latency_us, 1e-3):.6g}"),
                           "latency_source": source + " (intercept of the same fit)"},
            "inter_node": dict(base["inter_node"])}


def bench_a2a(sizes_kib: Sequence[int], iters: int, warmup: int, device_name: Optional[str],
              out_dir: str, base_links: Optional[str], command: str) -> Optional[dict]:
    """Measure the node's all-to-all under torchrun and write ``a2a.json``, ``a2a.md`` and
    ``links.yaml`` into ``out_dir`` (rank 0; the other ranks return None).

    Args:
        sizes_kib: bytes each rank sends each peer, KiB (at least two distinct sizes).
        iters, warmup: timed and untimed calls per size.
        device_name: ``cuda`` (NCCL, each rank its ``cuda:LOCAL_RANK``) or ``cpu``
            (gloo); None: CUDA where torch sees it.
        out_dir: the folder written. base_links: the link file whose ``inter_node``
            figures are kept (None: configs/links/default.yaml). command: how it was run,
            for the report.

    ``gpus_per_node`` in the link file is the number of GPUs torch sees
    (``CUDA_VISIBLE_DEVICES`` narrows it); edit it for a larger node.

    Raises:
        ValueError: not under torchrun or fewer than 2 ranks, a world spanning nodes, a
            size below 1 KiB or above :data:`MAX_SIZE_KIB` or fewer than two distinct
            sizes, ``--iters`` outside 1..:data:`MAX_ITERS` or ``--warmup`` outside
            0..:data:`MAX_ITERS`, an unwritable ``--out``, a ``--base-links`` file the
            simulator cannot read (checked before measuring), a size a rank cannot
            allocate, or a failed fit (see :func:`fit_link`). A failed fit writes the
            measured sizes to ``a2a_failed.json`` and leaves ``a2a.json``, ``a2a.md``
            and ``links.yaml`` of an earlier run untouched; the message says so.
        FileNotFoundError: no ``--base-links`` file.
    """
    from lrmoe.parallel import init_torchrun_group

    check_output("--out", out_dir, is_dir=True)
    if not (1 <= iters <= MAX_ITERS and 0 <= warmup <= MAX_ITERS):
        raise ValueError(f"--iters must be in 1..{MAX_ITERS} and --warmup in "
                         f"0..{MAX_ITERS}, got {iters}, {warmup}")
    if not sizes_kib or min(sizes_kib) < 1:
        raise ValueError(f"--sizes-kib must be >= 1 KiB each, got {list(sizes_kib)}")
    if max(sizes_kib) > MAX_SIZE_KIB:
        raise ValueError(f"--sizes-kib must be at most {MAX_SIZE_KIB} KiB (16 GiB per "
                         f"peer) each, got {max(sizes_kib)}: every rank allocates 2 x W x "
                         "that size, already 64 GiB at W = 2, and the bandwidth is "
                         "settled long before; drop the larger sizes")
    if len(set(sizes_kib)) < 2:
        raise ValueError(f"--sizes-kib needs at least two distinct sizes to fit latency and "
                         f"bandwidth, got {list(sizes_kib)}")
    base_path = Path(base_links) if base_links else DEFAULT_LINKS
    Links.from_file(str(base_path), flag="--base-links")  # the simulator's reader, first
    base = yaml.safe_load(base_path.read_text(encoding="utf-8"))
    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    if world < 2:
        raise ValueError("bench a2a times an all-to-all between ranks: launch it with "
                         "torchrun --nproc-per-node N (N >= 2) -m lrmoe bench a2a ...")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local != world:
        raise ValueError(f"bench a2a measures one node, but the world has {world} ranks and "
                         f"{local} per node; run it on one node (--nnodes 1)")
    use_cuda = (device_name or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu"
    created = not dist.is_initialized()
    backend = init_torchrun_group(world, use_cuda, f"bench a2a ({world} ranks)", 1)
    try:
        device = (torch.device("cuda", torch.cuda.current_device()) if use_cuda
                  else torch.device("cpu"))
        records = measure(sizes_kib, iters, warmup, device)
        dist.barrier()  # leave together: no rank tears the group down under another's feet
    finally:
        # a group left to the interpreter's exit aborts gloo's threads (SIGABRT)
        if created and dist.is_initialized():
            dist.destroy_process_group()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    name = torch.cuda.get_device_name(device) if use_cuda else "cpu"
    date = datetime.date.today().isoformat()
    out = Path(out_dir)
    meta = {"device": name, "world_size": world, "backend": backend, "date": date,
            "command": command, "iters": iters, "warmup": warmup,
            "base_links": str(base_path)}
    # every rank has the same records (max over ranks): the fit fails or not everywhere
    try:
        latency_us, GBps = fit_link([r["off_rank_bytes"] for r in records],
                                    [r["ms"] for r in records])
    except ValueError as err:
        # beside, not over, an earlier run's files: its links.yaml and a2a.md describe
        # its a2a.json, and the minutes of this sweep are kept for a look all the same
        if rank0:
            _write_files(out, {FAILED_JSON: json.dumps(
                {"meta": meta, "fit": None, "error": str(err), "records": records},
                indent=1) + "\n"})
        earlier = [f for f in ("a2a.json", "a2a.md", "links.yaml") if (out / f).exists()]
        kept = (f"; {', '.join(earlier)} of the earlier run in {out} are untouched"
                if earlier else "")
        raise ValueError(f"{err} (the {len(records)} measured sizes are in "
                         f"{out / FAILED_JSON}{kept})") from None
    for r in records:
        r["fit_ms"] = latency_us / 1e3 + r["off_rank_bytes"] / (GBps * 1e6)
        r["fit_err_pct"] = 100.0 * (r["fit_ms"] / r["ms"] - 1.0)
    if not rank0:
        return None
    gpus_per_node = torch.cuda.device_count() if use_cuda else local
    source = (f"lrmoe bench a2a on {world} x {name} ({backend}), {date}; fit of "
              f"{len(records)} sizes {min(sizes_kib)}-{max(sizes_kib)} KiB per peer; "
              f"`{command}`")
    doc = links_document(latency_us, GBps, gpus_per_node, base, source)
    result = {"meta": meta, "fit": {"latency_us": latency_us, "GBps": GBps},
              "records": records}
    _write_files(out, {"a2a.json": json.dumps(result, indent=1) + "\n",
                       "links.yaml": yaml.safe_dump(doc, sort_keys=False, width=88),
                       "a2a.md": markdown(result)})
    # a failed sweep's records beside a good fit would read as this run's
    (out / FAILED_JSON).unlink(missing_ok=True)
    return result


def _write_files(out: Path, texts: Dict[str, str]) -> None:
    """Write ``{name: text}`` into ``out`` (created if missing): all to temporary files
    first, then renamed over the old ones, so that a write failing half-way (a full disk)
    leaves the earlier files whole instead of a truncated or mixed set."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = {name: out / f".{name}.tmp" for name in texts}
    try:
        for name, text in texts.items():
            tmp[name].write_text(text, encoding="utf-8")
        for name in texts:
            os.replace(tmp[name], out / name)
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)


def markdown(result: Dict[str, Any]) -> str:
    """The sweep and the fit as a markdown table (KiB per peer, MB = 1e6 bytes off the
    rank, ms, GB/s = 1e9 bytes per second, the fit's ms and its error in percent)."""
    m, f = result["meta"], result["fit"]
    rows = "\n".join(f"| {r['bytes_per_peer'] / 1024:g} | {r['off_rank_bytes'] / 1e6:.3f} | "
                     f"{r['ms']:.4f} | {r['GBps']:.2f} | {r['fit_ms']:.4f} | "
                     f"{r['fit_err_pct']:+.1f} % |" for r in result["records"])
    return (f"All-to-all on {m['world_size']} x {m['device']} ({m['backend']}), {m['date']}: "
            f"`{m['command']}`\n\nFit: latency {f['latency_us']:.2f} us, bandwidth "
            f"{f['GBps']:.2f} GB/s per rank (off-rank bytes)\n\n"
            "| KiB per peer | off-rank MB per rank | ms (max over ranks) | GB/s | fit ms | "
            "fit error |\n|---|---|---|---|---|---|\n" + rows + "\n")
