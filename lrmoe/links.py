"""Link files (configs/links/*.yaml): the all-to-all costs per GPU that ``lrmoe sim``
charges (docs/simulation.md, "Links") and that ``lrmoe bench a2a`` writes from a
measurement. Units: GB/s = 1e9 bytes per second per GPU (the larger of sent and received
bytes); latency in microseconds per all-to-all.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Optional

import yaml

DEFAULT_LINKS = Path(__file__).resolve().parent.parent / "configs" / "links" / "default.yaml"


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

    @classmethod
    def from_file(cls, path: Optional[str] = None) -> "Links":
        """Read a link file (default: configs/links/default.yaml).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: a missing or non-positive figure (naming the key).
        """
        p = Path(path) if path else DEFAULT_LINKS
        if not p.is_file():
            raise FileNotFoundError(f"no link config at {p}; see configs/links/default.yaml")
        d = yaml.safe_load(p.read_text())
        try:
            vals = dict(gpus_per_node=int(d["gpus_per_node"]),
                        intra_GBps=float(d["intra_node"]["GBps"]),
                        intra_latency_us=float(d["intra_node"]["latency_us"]),
                        inter_GBps=float(d["inter_node"]["GBps"]),
                        inter_latency_us=float(d["inter_node"]["latency_us"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{p}: missing {exc}; every link file needs gpus_per_node and "
                             "intra_node/inter_node GBps and latency_us") from None
        for k, v in vals.items():
            if not v > 0:
                raise ValueError(f"{p}: {k} must be > 0, got {v}")
        src = {f"{side}.{k}": str(d[side].get(k, "")) for side in ("intra_node", "inter_node")
               for k in ("source", "latency_source")}
        return cls(str(d.get("name", p.stem)), sources=src, **vals)

    def as_list(self, self_GBps: float = 0.0) -> list:
        """The op's link list; ``self_GBps``: the device copy of the rows a rank sends
        itself (:meth:`Costs.self_copy_GBps`; 0: free)."""
        return [float(self.gpus_per_node), self.intra_GBps, self.intra_latency_us,
                self.inter_GBps, self.inter_latency_us, float(self_GBps)]
