"""CPU offload of the expert core's saved rows (``LRMoEConfig.offload = "activations"``).

Legend: N rows the expert forward saved for the backward (P pairs on one device, the rows
this rank's experts received under expert parallelism), C columns of one saved tensor
(2I for the pre-activations h, H for the dispatched inputs x), R rows the backward keeps,
W machine words of one row (the row's bytes / 8, 4, 2 or 1, the widest that divides).

What leaves the device: every tensor the expert core alone keeps alive for the backward,
namely h_N2I (both paths) and the dispatched inputs x_NH (expert parallel). On one device
the backward reads x from the layer input x_TH, which autograd holds for the router's own
backward anyway, so copying it would move bytes without freeing any; it stays.

Store (forward): :meth:`ActivationOffload.store` copies the rows into pinned host memory
on a side CUDA stream that first waits for the stream that produced them; the forward
never waits for the copy, and ``record_stream`` makes the caching allocator reuse the
device rows only after the copy has finished.

Load (backward): the kept set is known only after the selection, so the reload starts
there, as soon as the caller has the kept-row index. :meth:`ActivationOffload.load`
gathers the R kept rows by index straight from pinned host memory: a device
``index_select`` on the side stream over a device view of the host rows (the
``__cuda_array_interface__`` of the pinned block: with unified addressing, pinned host
memory is readable by kernels at its host address), on W-byte words so that each warp
reads wide runs of a row. Only the kept rows cross the bus (R C itemsize bytes, i.e.
(1 - c) of the saved rows), the index never leaves the device and the host does no work
and never waits. The compute stream waits for the gather only where the expert backward
first reads the rows (:meth:`PendingRows.get`): the reload of h runs under the G/X
compaction and the dphi = G W_down GEMM (which reads no saved row); x (expert parallel)
is read last, under the SwiGLU forward recompute, dW_down and the SwiGLU backward. The
router gradient, the scores and the selection come before the reload can start.
When the index is every row in order (c = 0 on one device) the rows come back with one
plain copy instead.

Where torch refuses the device view of host memory, the loads fall back (with a warning,
once) to a host gather: the index comes to the host (one wait), ``torch.index_select``
fills a pinned staging buffer and a copy on the side stream brings the R rows back; the
same bytes cross the bus, plus R * 4 of index. ``LRMOE_OFFLOAD_HOST_GATHER=1`` in the
environment chooses this path from the start (to compare the two, or where a device
cannot read host memory).

On the CPU the same code runs: the "device view" is the host tensor itself, the copies
are plain copies, there are no streams or events; results are bitwise those of no
offload (a gather is an exact copy, and the kernels read the same values).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

import torch
from torch import Tensor

#: values of ``LRMoEConfig.offload``
OFFLOAD_MODES = ("none", "activations")

_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.uint8: "|u1"}
_DEVICE_VIEW_REFUSED: Optional[str] = None  # why torch refused it (then: host gathers)


def reload_path() -> str:
    """How CUDA reloads gather the kept rows in this process: ``device gather`` (the
    kernel reads pinned host memory in place), or ``host gather (<why>)`` once torch
    refused the device view."""
    if _DEVICE_VIEW_REFUSED is None:
        return "device gather"
    return f"host gather ({_DEVICE_VIEW_REFUSED})"


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one offload stream of a CUDA device (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _as_words(rows_NC: Tensor) -> Tensor:
    """(N, W) integer view of contiguous rows: the widest word that divides a row."""
    row_bytes = rows_NC.shape[1] * rows_NC.element_size()
    width = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)
    return rows_NC.view(torch.uint8).view(_WORDS[width])


class _HostArray:
    """``__cuda_array_interface__`` of pinned host words (keeps them alive while the
    device view lives)."""

    def __init__(self, words_NW: Tensor) -> None:
        self.words_NW = words_NW
        self.__cuda_array_interface__ = {
            "shape": tuple(words_NW.shape), "typestr": _TYPESTR[words_NW.dtype],
            "data": (words_NW.data_ptr(), False), "strides": None, "version": 3}


def _device_view(words_NW: Tensor, device: torch.device) -> Optional[Tensor]:
    """A CUDA tensor over the pinned host words (no copy), or None where torch refuses
    it (the reason is kept and warned about once)."""
    global _DEVICE_VIEW_REFUSED
    if _DEVICE_VIEW_REFUSED is not None:
        return None
    if os.environ.get("LRMOE_OFFLOAD_HOST_GATHER") == "1":
        _DEVICE_VIEW_REFUSED = "LRMOE_OFFLOAD_HOST_GATHER=1"
        return None
    try:
        view_NW = torch.as_tensor(_HostArray(words_NW), device=device)
        if view_NW.data_ptr() != words_NW.data_ptr() or view_NW.device != device:
            raise RuntimeError(f"torch made a copy on {view_NW.device} instead of a view")
    except Exception as exc:  # any refusal: the host gather works everywhere
        _DEVICE_VIEW_REFUSED = f"{type(exc).__name__}: {exc}"
        warnings.warn("lrmoe offload: CUDA kernels cannot read the pinned host rows in "
                      f"place here ({_DEVICE_VIEW_REFUSED}); reloads gather on the host "
                      "instead (one host wait per load)", RuntimeWarning, stacklevel=3)
        return None
    return view_NW


@dataclass
class OffloadStats:
    """Bytes moved by the offload of one layer in its last forward and backward.

    Attributes:
        d2h_bytes: device-to-host bytes: the stored rows (N C itemsize per tensor), plus
            the kept-row index (R * 4, once per index) where reloads gather on the host.
        h2d_bytes: host-to-device bytes: the reloaded kept rows (R C itemsize per tensor).
    """

    d2h_bytes: int = 0
    h2d_bytes: int = 0


@dataclass
class StoredRows:
    """Handle of rows held in host memory (from :meth:`ActivationOffload.store`).

    Attributes:
        host_NC: (N, C) the rows, pinned on a CUDA host; dtype of the stored rows.
        words_NW: the same bytes as words; view_NW: their device view (CUDA; None where
            refused), or ``words_NW`` itself on the CPU.
        device: where the rows came from (and go back to).
        copied: CUDA event after the device-to-host copy, None on the CPU.
    """

    host_NC: Tensor
    words_NW: Tensor
    view_NW: Optional[Tensor]
    device: torch.device
    copied: Optional["torch.cuda.Event"]


class PendingRows:
    """A reload in flight (from :meth:`ActivationOffload.load`); :meth:`get` the rows."""

    def __init__(self, finish: Callable[[], Tensor]) -> None:
        self._finish: Optional[Callable[[], Tensor]] = finish
        self._rows: Optional[Tensor] = None

    def get(self) -> Tensor:
        """The (R, C) kept rows on the device, in index order (all N rows for no index);
        on CUDA the current stream waits for the reload here. Later calls return the
        same tensor."""
        if self._finish is not None:
            self._rows, self._finish = self._finish(), None
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
            rows_NC: (N, C) any dtype; the caller drops its reference afterwards.

        Returns:
            :class:`StoredRows` for :meth:`load`.
        """
        device = rows_NC.device
        self.stats.d2h_bytes += rows_NC.numel() * rows_NC.element_size()
        cuda = device.type == "cuda"
        host_NC = torch.empty(rows_NC.shape, dtype=rows_NC.dtype, pin_memory=cuda)
        words_NW = _as_words(host_NC)
        if not cuda:
            host_NC.copy_(rows_NC)
            return StoredRows(host_NC, words_NW, words_NW, device, None)
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the rows are written first
        with torch.cuda.stream(side):
            host_NC.copy_(rows_NC, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        rows_NC.record_stream(side)  # freed memory is reused only after the copy
        view_NW = _device_view(words_NW, device) if host_NC.numel() else None
        return StoredRows(host_NC, words_NW, view_NW, device, copied)

    def load(self, stored: StoredRows, index_R: Optional[Tensor],
             ascending: bool = False) -> PendingRows:
        """Start the reload of the kept rows ``stored[index_R]``.

        Args:
            stored: from :meth:`store` of this object.
            index_R: (R,) int32/int64 rows to reload, on the rows' device, or None for all
                N rows in order.
            ascending: the caller guarantees ``index_R`` is strictly ascending (then
                R = N means every row in order: one plain copy).

        Returns:
            :class:`PendingRows`; its ``get()`` gives the (R, C) rows on the device.

        Raises:
            ValueError: ``index_R`` not 1-D or on another device than the stored rows.
        """
        host_NC, device = stored.host_NC, stored.device
        if index_R is not None and (index_R.dim() != 1 or index_R.device != device):
            raise ValueError(f"ActivationOffload.load: index_R must be a 1-D tensor on "
                             f"{device}, got shape {tuple(index_R.shape)} on "
                             f"{index_R.device}")
        if index_R is not None and ascending and index_R.shape[0] == host_NC.shape[0]:
            index_R = None  # every row, in order
        num_rows = host_NC.shape[0] if index_R is None else index_R.shape[0]
        self.stats.h2d_bytes += num_rows * host_NC.shape[1] * host_NC.element_size()
        if num_rows == 0:
            return PendingRows(lambda: host_NC.new_empty((0, host_NC.shape[1]),
                                                         device=device))
        if device.type != "cuda":
            rows_RC = host_NC if index_R is None else torch.index_select(
                stored.view_NW, 0, index_R).view(host_NC.dtype)
            return PendingRows(lambda: rows_RC.to(device))
        if index_R is not None and stored.view_NW is None:
            return self._load_by_host_gather(stored, index_R)
        current, side = torch.cuda.current_stream(device), _side_stream(device)
        side.wait_stream(current)  # the index is written on the current stream
        with torch.cuda.stream(side):
            if index_R is None:
                rows_RC = host_NC.to(device, non_blocking=True)
            else:  # the kernel reads only the kept rows from host memory
                rows_RC = torch.index_select(stored.view_NW, 0, index_R).view(host_NC.dtype)
                # a one-byte copy from the pinned block makes torch's host allocator
                # keep it until this stream has passed the gather (it tracks copies,
                # not kernels)
                torch.empty(1, dtype=torch.uint8, device=device).copy_(
                    stored.words_NW.view(-1).view(torch.uint8)[:1], non_blocking=True)
                index_R.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)

        def finish() -> Tensor:
            current.wait_event(done)
            rows_RC.record_stream(current)  # allocated on the side stream, used here
            return rows_RC
        return PendingRows(finish)

    def _load_by_host_gather(self, stored: StoredRows, index_R: Tensor) -> PendingRows:
        """The fallback reload: index to the host, gather into pinned staging there, copy
        the R rows back on the side stream (see the module docstring)."""
        device, host_NC = stored.device, stored.host_NC
        if self._index_key is not index_R:  # the same index for x and h: copied once
            index_host = torch.empty(index_R.shape, dtype=index_R.dtype, pin_memory=True)
            index_host.copy_(index_R, non_blocking=True)
            self._index_ready = torch.cuda.Event()
            self._index_ready.record(torch.cuda.current_stream(device))
            self._index_key, self._index_host = index_R, index_host
            self.stats.d2h_bytes += index_R.numel() * index_R.element_size()
        index_host, index_ready = self._index_host, self._index_ready

        def finish() -> Tensor:
            stored.copied.synchronize()  # host reads follow the device copies they need
            index_ready.synchronize()
            staging_RC = torch.empty((index_host.shape[0], host_NC.shape[1]),
                                     dtype=host_NC.dtype, pin_memory=True)
            torch.index_select(host_NC, 0, index_host, out=staging_RC)
            current, side = torch.cuda.current_stream(device), _side_stream(device)
            with torch.cuda.stream(side):
                rows_RC = staging_RC.to(device, non_blocking=True)
            current.wait_stream(side)
            rows_RC.record_stream(current)
            return rows_RC
        return PendingRows(finish)


def offload_for(mode: str, stats_holder) -> Optional[ActivationOffload]:
    """The offload of one layer call: None for ``mode == "none"``; else a fresh
    :class:`ActivationOffload` whose :class:`OffloadStats` replaces
    ``stats_holder.offload`` (the counts are those of the last step)."""
    if mode == "none":
        stats_holder.offload = None
        return None
    stats_holder.offload = OffloadStats()
    return ActivationOffload(stats_holder.offload)
