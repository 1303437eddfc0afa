"""One clock for timing device work: CUDA events on a GPU, the host clock elsewhere.

Used by the layer benchmark (``lrmoe/bench/timing.py``) and the trainer's MoE-layer timer
(``lrmoe/training/moe_timer.py``).
"""
from __future__ import annotations

import time

import torch


class DeviceClock:
    """Time stamps on ``device``'s current stream.

    Args:
        device: CUDA devices get ``torch.cuda.Event`` stamps (no host sync to take one);
            any other device ``time.perf_counter`` (its ops run synchronously).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def event(self):
        """A stamp now: a recorded CUDA event, or perf_counter seconds."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def wait(self, a) -> None:
        """Block the host until stamp ``a`` has happened (nothing to wait for off CUDA)."""
        if self.cuda:
            a.synchronize()

    def ms(self, a, b) -> float:
        """Milliseconds from stamp ``a`` to stamp ``b`` (on CUDA waits for ``b``)."""
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3
