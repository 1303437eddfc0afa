"""Link files (configs/links/*.yaml): the all-to-all costs per GPU that ``lrmoe sim``
charges (docs/simulation.md, "Links") and that ``lrmoe bench a2a`` writes from a
measurement. Units: GB/s = 1e9 bytes per second per GPU (the larger of sent and received
bytes); latency in microseconds per all-to-all.
"""
from __future__ import annotations

import dataclasses
import math
from importlib import resources
from pathlib import Path
from typing import Dict, Optional


#: package data (lrmoe/configs/, also reachable as configs/ in a checkout): found the same
#: way in a checkout and in an installed wheel
DEFAULT_LINKS = Path(str(resources.files("lrmoe") / "configs" / "links" / "default.yaml"))
_FORMAT = "configs/links/default.yaml for the format"
_KEYS = "gpus_per_node, intra_node and inter_node (each with GBps and latency_us)"


def _number(where: str, key: str, v: object) -> float:
    """``v`` as a float, or a ValueError naming the file and the key."""
    # a bool is an int to Python, but ``GBps: yes`` is a typo, not 1 GB/s
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"{where}: {key} must be a number, got {v!r}")
    try:
        # strings too: YAML 1.1 reads ``1e3`` (no dot) as a string
        return float(v)
    except ValueError:
        raise ValueError(f"{where}: {key} must be a number, got {v!r}") from None


def _positive(where: str, d: dict, side: str, key: str, field: str) -> float:
    """``d[side][key]`` (the :class:`Links` ``field``): a finite number > 0 (the
    simulator divides by bandwidths, and an infinite one would make the link free)."""
    if key not in d[side]:
        raise ValueError(f"{where}: missing '{side}.{key}'; every link file needs {_KEYS}")
    v = _number(where, f"{side}.{key}", d[side][key])
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{where}: {side}.{key} ({field}) must be a finite number > 0, "
                         f"got {v}")
    return v


def _positive_int(where: str, d: dict, key: str, what: str = "a whole number of GPUs") -> int:
    """``d[key]``: an integer >= 1 (``8.0`` is 8; ``8.9``, ``0.5`` and ``true`` are
    refused rather than truncated to a GPU count the user did not write)."""
    if key not in d:
        raise ValueError(f"{where}: missing '{key}'; every link file needs {_KEYS}")
    v = d[key]
    bad = ValueError(f"{where}: {key} must be {what} >= 1, got {v!r}")
    if isinstance(v, bool):
        raise bad
    if isinstance(v, int):
        n = v
    else:
        f = _number(where, key, v)
        if not (math.isfinite(f) and f.is_integer()):
            raise bad
        n = int(f)
    if n < 1:
        raise bad
    return n


@dataclasses.dataclass(frozen=True)
class Links:
    """All-to-all link costs (configs/links/*.yaml): per-GPU GB/s and per-collective us
    within a node and between nodes, and where each figure comes from."""

    name: str
    gpus_per_node: int
    intra_GBps: float
    intra_latency_us: float
    inter_GBps: float
    inter_latency_us: float
    sources: Dict[str, str]
    #: us per distinct peer a rank exchanges with over a link class, on top of the class's
    #: latency (csrc/sim/a2a.h hierarchical_a2a_ms); optional key ``per_peer_us``, 0: one
    #: latency per class
    per_peer_us: float = 0.0
    #: chunks the network and NVLink phases of a hierarchical all-to-all are pipelined
    #: over (csrc/sim/a2a.h); optional key ``chunks``, 1: in sequence
    chunks: int = 1
    #: chunks a layer's all-to-alls are pipelined with its expert GEMMs over (csrc/sim/
    #: sim.h LinkModel::overlap_chunks); optional key ``overlap_chunks``, 1: in sequence
    overlap_chunks: int = 1
    #: rows per GEMM tile of the tile-level overlap (csrc/sim/sim.h LinkModel::
    #: overlap_tile_rows); optional key ``overlap_tile_rows``, 0: off
    overlap_tile_rows: int = 0
    #: share of the SMs the fused kernel gives to communication under tile-level overlap
    #: (sim.h LinkModel::overlap_comm_share); optional key ``overlap_comm_share``, in
    #: [0, 1); the default is DeepEP's 20 SMs (its Buffer.num_sms) of an H100 / H200's 132
    overlap_comm_share: float = 20 / 132

    @classmethod
    def from_file(cls, path: Optional[str] = None, flag: Optional[str] = None) -> "Links":
        """Read a link file (default: configs/links/default.yaml).

        Args:
            path: the YAML file: a mapping with ``gpus_per_node`` (a positive integer) and
                ``intra_node``/``inter_node`` mappings of ``GBps`` and ``latency_us``
                (finite numbers > 0), each optionally with ``source``/``latency_source``;
                optionally ``per_peer_us`` (a finite number >= 0), ``chunks`` (an
                integer >= 1) for the all-to-all model of csrc/sim/a2a.h, and
                ``overlap_chunks`` (an integer >= 1: the all-to-alls pipelined with the
                expert GEMMs, csrc/sim/sim.h), or ``overlap_tile_rows`` (an integer
                >= 0: the tile-level overlap, 0 off; not with ``overlap_chunks`` > 1) with
                ``overlap_comm_share`` (a number in [0, 1): the SMs' share given to
                communication).
            flag: the command-line option that named ``path`` (``"--base-links"``); the
                messages then start with it, so the user knows which argument to fix.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: a file that is not UTF-8 text, not valid YAML (naming the line),
                not a mapping, or with a missing key, a non-number, a non-finite or
                non-positive figure, or a ``gpus_per_node`` that is not a positive
                integer (naming the file and the key).
        """
        p = Path(path) if path else DEFAULT_LINKS
        where = f"{flag} {p}" if flag else str(p)
        if not p.is_file():
            raise FileNotFoundError(f"{where}: no link file there; see "
                                    "configs/links/default.yaml for the format")
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{where}: not a UTF-8 text file (byte {err.start}: "
                             f"{err.reason}); a link file is YAML, see {_FORMAT}") from None
        except OSError as err:
            raise ValueError(f"{where}: cannot read it ({err.strerror or err})") from None
        import yaml  # the [sim] extra: not needed to import lrmoe

        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{where}: not valid YAML{at} ({what}); see {_FORMAT}") from None
        if not isinstance(d, dict):
            got = ("an empty file" if d is None else "a list" if isinstance(d, list)
                   else f"the single value {str(d)[:60]!r}")
            raise ValueError(f"{where}: a link file must be a YAML mapping of {_KEYS}, got "
                             f"{got}; see {_FORMAT}")
        for side in ("intra_node", "inter_node"):
            if side not in d:
                raise ValueError(f"{where}: missing '{side}'; every link file needs {_KEYS}")
            if not isinstance(d[side], dict):
                raise ValueError(f"{where}: {side} must be a mapping of GBps and latency_us, "
                                 f"got {d[side]!r}; see {_FORMAT}")
        vals: dict = dict(gpus_per_node=_positive_int(where, d, "gpus_per_node"))
        for field in ("intra_GBps", "intra_latency_us", "inter_GBps", "inter_latency_us"):
            side, key = field.split("_", 1)
            vals[field] = _positive(where, d, side + "_node", key, field)
        if "per_peer_us" in d:
            v = _number(where, "per_peer_us", d["per_peer_us"])
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{where}: per_peer_us must be a finite number >= 0 "
                                 f"(us per distinct peer), got {d['per_peer_us']!r}")
            vals["per_peer_us"] = v
        if "chunks" in d:
            vals["chunks"] = _positive_int(where, d, "chunks", "a whole number of chunks")
        if "overlap_chunks" in d:
            vals["overlap_chunks"] = _positive_int(where, d, "overlap_chunks",
                                                   "a whole number of chunks")
        if "overlap_tile_rows" in d:
            v = d["overlap_tile_rows"]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: overlap_tile_rows must be a whole number >= 0 "
                                 f"(rows per GEMM tile; 0: no tile-level overlap), got {v!r}")
            vals["overlap_tile_rows"] = v
        if "overlap_comm_share" in d:
            v = _number(where, "overlap_comm_share", d["overlap_comm_share"])
            if not (math.isfinite(v) and 0 <= v < 1):
                raise ValueError(f"{where}: overlap_comm_share must be a number in [0, 1) "
                                 f"(the share of the SMs given to communication), got "
                                 f"{d['overlap_comm_share']!r}")
            vals["overlap_comm_share"] = v
        if vals.get("overlap_tile_rows", 0) > 0 and vals.get("overlap_chunks", 1) > 1:
            raise ValueError(f"{where}: overlap_tile_rows > 0 (tile-level overlap) and "
                             f"overlap_chunks > 1 (chunked) are two models of one overlap; "
                             f"keep one of them")
        src = {f"{side}.{k}": str(d[side].get(k, "")) for side in ("intra_node", "inter_node")
               for k in ("source", "latency_source")}
        return cls(str(d.get("name", p.stem)), sources=src, **vals)
