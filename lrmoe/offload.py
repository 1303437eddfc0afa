"""CPU offload of the expert core's saved rows (``LRMoEConfig.offload = "activations"``).

Legend: N rows the expert forward saved for the backward (P pairs on one device, the rows
this rank's experts received under expert parallelism), C columns of one saved tensor
(2I for the pre-activations h, H for the dispatched inputs x), R rows the backward keeps.

What leaves the device: every tensor the expert core alone keeps alive for the backward,
namely h_N2I (both paths) and the dispatched inputs x_NH (expert parallel). On one device
the backward reads x from the layer input x_TH, which autograd holds for the router's own
backward anyway, so copying it would move bytes without freeing any; it stays.

Store (forward): :meth:`ActivationOffload.store` copies the rows into pinned host memory
on a side CUDA stream that first waits for the stream that produced them; the forward
never waits for the copy, and ``record_stream`` makes the caching allocator reuse the
device rows only after the copy has finished.

Load (backward): the kept set is known only after the selection, so the reload starts
there. :meth:`ActivationOffload.load` issues the device-to-host copy of the kept-row index
(R int32) at once; :meth:`PendingRows.get`, called where the expert backward first reads
the rows, waits for that index on the host, gathers the R kept rows on the host into a
pinned staging buffer (``torch.index_select(..., out=)``, multi-threaded) and copies
those R rows to the device on the side stream; the compute stream waits for that copy
only. Gathering on the host (rather than a device kernel reading host memory by index)
uses only torch's copy engine path, whose events keep the pinned blocks alive, and runs
unchanged on the CPU; it costs one host wait per load for the index. The overlap: the
expert backward issues dphi = G W_down (which reads no saved row) before it asks for h,
so the host gather and the h copy run under that GEMM; x (expert parallel) is asked for
last, under the SwiGLU backward and the dW_down GEMM. Host-to-device bytes are R C
itemsize per tensor, i.e. (1 - c) of the saved rows.

On the CPU the same code runs: the "pinned" buffers are ordinary host tensors, the
copies are plain copies, there are no streams or events; results are bitwise those of
no offload (the gather is an exact copy and the kernels read the same values).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Union

import torch
from torch import Tensor

#: values of ``LRMoEConfig.offload``
OFFLOAD_MODES = ("none", "activations")

_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one offload stream of a CUDA device (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


@dataclass
class OffloadStats:
    """Bytes moved by the offload of one layer in its last forward and backward.

    Attributes:
        d2h_bytes: device-to-host bytes: the stored rows (N C itemsize per tensor) plus the
            kept-row index of each reload (R * 4, once per index).
        h2d_bytes: host-to-device bytes: the reloaded kept rows (R C itemsize per tensor).
    """

    d2h_bytes: int = 0
    h2d_bytes: int = 0


@dataclass
class StoredRows:
    """Handle of rows held in host memory (from :meth:`ActivationOffload.store`).

    Attributes:
        host_NC: (N, C) the rows, pinned on a CUDA host; dtype of the stored rows.
        device: where the rows came from (and go back to).
        copied: CUDA event after the device-to-host copy, None on the CPU.
    """

    host_NC: Tensor
    device: torch.device
    copied: Optional["torch.cuda.Event"]


class PendingRows:
    """A reload in flight (from :meth:`ActivationOffload.load`); :meth:`get` the rows."""

    def __init__(self, stored: StoredRows, index_host_R: Optional[Tensor],
                 index_ready: Optional["torch.cuda.Event"]) -> None:
        self._stored, self._index, self._index_ready = stored, index_host_R, index_ready
        self._rows: Optional[Tensor] = None

    def get(self) -> Tensor:
        """The (R, C) kept rows on the device, in index order (all N rows for no index).

        On CUDA the first call waits on the host for the index, gathers on the host and
        starts the copy on the side stream; the current stream waits for that copy.
        Later calls return the same tensor.
        """
        if self._rows is not None:
            return self._rows
        stored, cuda = self._stored, self._stored.device.type == "cuda"
        if cuda:  # host reads follow the device copies they depend on
            stored.copied.synchronize()
            if self._index_ready is not None:
                self._index_ready.synchronize()
        host_NC = stored.host_NC
        if self._index is None:
            staging_RC = host_NC
        else:
            staging_RC = torch.empty((self._index.shape[0], host_NC.shape[1]),
                                     dtype=host_NC.dtype, pin_memory=cuda)
            torch.index_select(host_NC, 0, self._index, out=staging_RC)
        if not cuda:
            self._rows = staging_RC.to(stored.device)
        else:
            current, side = torch.cuda.current_stream(stored.device), _side_stream(
                stored.device)
            with torch.cuda.stream(side):
                rows_RC = staging_RC.to(stored.device, non_blocking=True)
            current.wait_stream(side)
            rows_RC.record_stream(current)  # allocated on the side stream, used here
            self._rows = rows_RC
        self._stored = self._index = None  # the host rows may go once copied
        return self._rows


def ready(rows: Union[Tensor, PendingRows]) -> Tensor:
    """``rows`` itself, or the reloaded rows of a :class:`PendingRows` (the point where
    the expert backward waits for a reload)."""
    return rows.get() if isinstance(rows, PendingRows) else rows


class ActivationOffload:
    """Moves saved rows to host memory in the forward and the kept ones back in the
    backward; one object per layer call, shared by the single-device and the
    expert-parallel autograd functions (see the module docstring for the streams).

    Args:
        stats: :class:`OffloadStats` that receives the byte counts.
    """

    def __init__(self, stats: OffloadStats) -> None:
        self.stats = stats
        self._index_key: Optional[Tensor] = None
        self._index_host: Optional[Tensor] = None
        self._index_ready = None

    def store(self, rows_NC: Tensor) -> StoredRows:
        """Copy (N, C) device rows to (pinned) host memory without making the caller wait.

        Args:
            rows_NC: (N, C) any float dtype; the caller drops its reference afterwards.

        Returns:
            :class:`StoredRows` for :meth:`load`.
        """
        device = rows_NC.device
        self.stats.d2h_bytes += rows_NC.numel() * rows_NC.element_size()
        if device.type != "cuda":
            host_NC = torch.empty(rows_NC.shape, dtype=rows_NC.dtype)
            host_NC.copy_(rows_NC)
            return StoredRows(host_NC, device, None)
        host_NC = torch.empty(rows_NC.shape, dtype=rows_NC.dtype, pin_memory=True)
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the rows are written first
        with torch.cuda.stream(side):
            host_NC.copy_(rows_NC, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        rows_NC.record_stream(side)  # freed memory is reused only after the copy
        return StoredRows(host_NC, device, copied)

    def load(self, stored: StoredRows, index_R: Optional[Tensor]) -> PendingRows:
        """Start the reload of the kept rows ``stored[index_R]``.

        Args:
            stored: from :meth:`store` of this object.
            index_R: (R,) int32/int64 rows to reload, on the rows' device, or None for all
                N rows in order. The same index tensor passed twice is copied to the host
                once.

        Returns:
            :class:`PendingRows`; its ``get()`` gives the (R, C) rows on the device.

        Raises:
            ValueError: ``index_R`` not 1-D or on another device than the stored rows.
        """
        host_NC = stored.host_NC
        if index_R is None:
            self.stats.h2d_bytes += host_NC.numel() * host_NC.element_size()
            return PendingRows(stored, None, None)
        if index_R.dim() != 1 or index_R.device != stored.device:
            raise ValueError(f"ActivationOffload.load: index_R must be a 1-D tensor on "
                             f"{stored.device}, got shape {tuple(index_R.shape)} on "
                             f"{index_R.device}")
        self.stats.h2d_bytes += index_R.shape[0] * host_NC.shape[1] * host_NC.element_size()
        if self._index_key is not index_R:
            cuda = stored.device.type == "cuda"
            index_host = torch.empty(index_R.shape, dtype=index_R.dtype, pin_memory=cuda)
            index_host.copy_(index_R, non_blocking=cuda)
            ready_event = None
            if cuda:
                ready_event = torch.cuda.Event()
                ready_event.record(torch.cuda.current_stream(stored.device))
            self._index_key, self._index_host, self._index_ready = (index_R, index_host,
                                                                   ready_event)
            self.stats.d2h_bytes += index_R.numel() * index_R.element_size()
        return PendingRows(stored, self._index_host, self._index_ready)


def offload_for(mode: str, stats_holder) -> Optional[ActivationOffload]:
    """The offload of one layer call: None for ``mode == "none"``; else a fresh
    :class:`ActivationOffload` whose :class:`OffloadStats` replaces
    ``stats_holder.offload`` (the counts are those of the last step)."""
    if mode == "none":
        stats_holder.offload = None
        return None
    stats_holder.offload = OffloadStats()
    return ActivationOffload(stats_holder.offload)
