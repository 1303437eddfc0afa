"""Cost files: the per-shape cost model that ``lrmoe calibrate`` measures
(:mod:`lrmoe.bench.calibrate` writes them) and the simulator replays (docs/simulation.md,
"Cost model"). Format ``lrmoe-costs/1``: ``meta``, ``bandwidth`` and per shape ``dims``,
``points`` and ``per_row_ms``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Dict

import numpy as np

from lrmoe.utils.phases import PHASES_BWD, PHASES_FWD


#: PerRowCosts of csrc/sim/sim.h, in its order (ms per pair; compact and scatter per
#: retained row; ep_fwd / ep_bwd per forward / retained row of an expert rank, from
#: ``lrmoe calibrate --ep``, 0 in files without them)
PER_ROW = ("router", "permute", "combine", "fwd_rest", "router_grad", "score", "select",
           "bwd_rest", "compact", "scatter", "ep_fwd", "ep_bwd")


@dataclasses.dataclass(frozen=True)
class Costs:
    """The cost model of one shape from a calibration file (:mod:`lrmoe.bench.calibrate`).

    Attributes:
        shape: the calibrated shape's name. dims: its hidden/inter/experts/top_k/shared.
        gemm_G4: (G, 4) float64 points: experts per rank, rows per expert, forward ms,
            backward ms of the grouped GEMMs (the ``expert_gemm_fwd/bwd`` phases), each
            plus its point's time outside the named phases where the file has the
            points' medians (then ``per_row``'s ``fwd_rest``/``bwd_rest`` are 0).
        per_row: ms per pair of each of :data:`PER_ROW`.
        h2d_GBps: host-to-device bandwidth (0 where the file has none: offload untimed).
        meta: the file's ``meta`` (machine, device, torch, date).
        copy_GBps: device copy bandwidth, bytes read + written (0 where not measured).
    """

    shape: str
    dims: dict
    gemm_G4: np.ndarray
    per_row: Dict[str, float]
    h2d_GBps: float
    meta: dict
    copy_GBps: float = 0.0

    @property
    def self_copy_GBps(self) -> float:
        """GB/s of a rank's all-to-all rows to itself: one read and one write per byte,
        so half the measured copy bandwidth (docs/simulation.md, "Links")."""
        return self.copy_GBps / 2

    @classmethod
    def from_file(cls, path: str, shape: str) -> "Costs":
        """Read ``shape``'s costs from a cost file.

        Raises:
            ValueError: the file holds no calibration of ``shape`` (naming those it has).
        """
        data = load_costs(path)
        if shape not in data["shapes"]:
            raise ValueError(f"{path} has no calibration of {shape!r} (it has "
                             f"{sorted(data['shapes'])}); run `lrmoe calibrate --shapes "
                             f"{shape}` or pick --costs-shape")
        s = data["shapes"][shape]
        points = s["points"]
        per_row = {k: float(s["per_row_ms"].get(k, 0.0)) for k in PER_ROW}
        # the time under no phase (launches, allocator, small kernels between the named
        # ones) is not proportional to pairs: 1.3 ms of a 1.7 ms Qwen3 forward at 2k
        # pairs, 2.0 of 6.9 ms at 262k, 0.6 of 21.7 ms at 1M (configs/costs/h200.json).
        # Where every point has its medians, each point's rest joins its GEMM time and
        # is interpolated with it; per-pair rests (the largest point's) would charge a
        # 32k-token layer 0.15 ms of the 2.0 (docs/simulation.md, "Cost model")
        absorb = all(p.get("fwd_ms") is not None and p.get("bwd_ms") is not None
                     for p in points)
        g = np.array([[p["experts"], p["rows_per_expert"],
                       p["phases_ms"].get("expert_gemm_fwd", 0.0)
                       + (point_rest(p, backward=False) if absorb else 0.0),
                       p["phases_ms"].get("expert_gemm_bwd", 0.0)
                       + (point_rest(p, backward=True) if absorb else 0.0)]
                      for p in points], dtype=np.float64)
        if absorb:
            per_row["fwd_rest"] = per_row["bwd_rest"] = 0.0
        return cls(shape, s["dims"], g, per_row,
                   float(data["bandwidth"].get("h2d_GBps") or 0.0), data["meta"],
                   float(data["bandwidth"].get("copy_GBps") or 0.0))


FORMAT = "lrmoe-costs/1"


def point_rest(point: dict, backward: bool) -> float:
    """ms of a calibration point's forward (or backward) median outside its named phases
    (:data:`lrmoe.utils.phases.PHASES_FWD` / ``PHASES_BWD``): launches, the allocator and
    small kernels between the ranges. Never below 0 (the medians and the one profiled
    step differ a little)."""
    total, phases = ("bwd_ms", PHASES_BWD) if backward else ("fwd_ms", PHASES_FWD)
    return max(0.0, point[total] - sum(point["phases_ms"].get(k, 0.0) for k in phases))


def load_costs(path: str) -> dict:
    """Read and check a cost file written by :func:`lrmoe.bench.calibrate.calibrate`.

    Every number the simulator reads is checked, so a corrupt file (negated, NaN or
    infinite times, a bandwidth below zero, a shape of zero experts) stops here instead of
    giving confident figures: dims positive ints (``shared`` >= 0), point sizes positive
    ints, every time (``fwd_ms``, ``bwd_ms``, ``phases_ms``, ``per_row_ms``, the EP points'
    times) a finite number >= 0 (``fwd_ms``/``bwd_ms`` may be null: not measured), every
    bandwidth a finite number >= 0 or null (0 or null: not measured).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a ``lrmoe-costs/1`` file, a shape without points, or a value out
            of range, naming the file, the key (``shapes.NAME.points[3].fwd_ms``) and the
            fix (rerun ``lrmoe calibrate``).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no cost file at {path}; write one with `lrmoe calibrate "
                                "--out FILE.json` (docs/simulation.md)")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a cost file (not JSON: {err}); write one with "
                         "`lrmoe calibrate --out FILE.json`") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a cost file ({FORMAT!r}); write one with "
                         "`lrmoe calibrate --out FILE.json`")
    _check_costs(data, str(path))
    return data


_DIMS = ("hidden", "inter", "experts", "top_k")
_POINT_SIZES = ("experts", "rows_per_expert")
_POINT_COUNTS = ("tokens", "pairs")


def _check_costs(data: dict, path: str) -> None:
    """Raise ValueError naming ``path`` and the key of the first value out of range."""
    def bad(key: str, value, want: str):
        return ValueError(f"{path}: {key} is {value!r}; {want} (a corrupt or hand-edited cost "
                          "file? rerun `lrmoe calibrate --out FILE.json`)")

    def mapping(key: str, value) -> dict:
        if not isinstance(value, dict):
            raise bad(key, value, "it must be a mapping")
        return value

    def time_ms(key: str, value, nullable: bool = False) -> None:
        if value is None and nullable:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise bad(key, value, "a time must be a finite number >= 0 ms"
                      + (" or null" if nullable else ""))

    def count(key: str, value, low: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise bad(key, value, f"it must be an int >= {low}")

    for k, v in mapping("bandwidth", data.get("bandwidth", {})).items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or v < 0):
            raise bad(f"bandwidth.{k}", v, "a bandwidth must be a finite number >= 0 or null")
    for name, s in mapping("shapes", data.get("shapes", {})).items():
        where = f"shapes.{name}"
        s = mapping(where, s)
        if not s.get("points"):
            raise ValueError(f"{path}: shape {name} has no measured points; rerun "
                             "`lrmoe calibrate`")
        dims = mapping(f"{where}.dims", s.get("dims"))
        for k in _DIMS:
            count(f"{where}.dims.{k}", dims.get(k), 1)
        count(f"{where}.dims.shared", dims.get("shared", 0), 0)
        for kind in ("points", "ep_points"):
            points = s.get(kind, [])
            if not isinstance(points, list):
                raise bad(f"{where}.{kind}", points, "it must be a list of points")
            for i, pt in enumerate(points):
                at = f"{where}.{kind}[{i}]"
                pt = mapping(at, pt)
                for k in _POINT_SIZES:
                    count(f"{at}.{k}", pt.get(k), 1)
                for k in _POINT_COUNTS:
                    if k in pt:
                        count(f"{at}.{k}", pt[k], 0)
                for k, v in pt.items():
                    if k.endswith("_ms") and k != "phases_ms":
                        time_ms(f"{at}.{k}", v, nullable=k in ("fwd_ms", "bwd_ms"))
                for k, v in mapping(f"{at}.phases_ms", pt.get("phases_ms", {})).items():
                    time_ms(f"{at}.phases_ms.{k}", v)
        for k, v in mapping(f"{where}.per_row_ms", s.get("per_row_ms", {})).items():
            time_ms(f"{where}.per_row_ms.{k}", v)
