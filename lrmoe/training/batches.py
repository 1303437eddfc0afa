"""Token blocks -> batches: what the model is called with, and the endless, resumable
stream of training batches of one rank.

Legend: B sequences per batch, S = seq_len, N blocks in a split, W ranks (EP size).

Packed examples are kept apart (``data.isolate_examples``): position ids restart at 0 at
every example, and transformers' mask builder (``find_packed_sequence_indices`` in
``transformers.masking_utils``, used by its sdpa / eager / flex attention when no 2-D
mask is given) turns the restarts into a block-diagonal causal mask, so an example sees
exactly the positions and tokens it would see alone. Padding sits at the end of a block
(``lrmoe.data.packing``), so causal attention never reads it; the padding mask is what
the load-balancing loss needs (:mod:`lrmoe.training.loss`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from lrmoe.data import epoch_permutation, num_batches


@dataclass
class Batch:
    """One micro-batch.

    Attributes:
        input_ids_BS: int64 token ids.
        labels_BS: int64, -100 where no loss is taken (prompt, padding).
        attention_mask_BS: bool, True on real tokens, False on padding.
        position_ids_BS: int64 positions restarting at every packed example, or None
            (positions 0..S-1).
    """

    input_ids_BS: Tensor
    labels_BS: Tensor
    attention_mask_BS: Tensor
    position_ids_BS: Optional[Tensor] = None

    def to(self, device: torch.device) -> "Batch":
        """The batch on ``device`` (non-blocking copies)."""
        pos = self.position_ids_BS
        return Batch(self.input_ids_BS.to(device, non_blocking=True),
                     self.labels_BS.to(device, non_blocking=True),
                     self.attention_mask_BS.to(device, non_blocking=True),
                     None if pos is None else pos.to(device, non_blocking=True))

    def num_loss_tokens(self) -> int:
        """Positions predicted with a loss (the model shifts: label s + 1 for position s)."""
        return int((self.labels_BS[:, 1:] != -100).sum())


def position_ids_from_segments(segment_ids_BS: Tensor) -> Tensor:
    """Positions that restart at 0 wherever the segment id changes.

    Args:
        segment_ids_BS: (B, S) integer segment ids (equal ids in a run = one segment).

    Returns:
        (B, S) int64: ``s - start(segment of s)``; e.g. segments ``[1, 1, 1, 2, 2, 0]``
        give ``[0, 1, 2, 0, 1, 0]``.
    """
    seg = segment_ids_BS.long()
    s = seg.shape[1]
    index_BS = torch.arange(s, device=seg.device).expand_as(seg)
    starts_BS = torch.ones_like(seg, dtype=torch.bool)
    starts_BS[:, 1:] = seg[:, 1:] != seg[:, :-1]
    first_BS = torch.where(starts_BS, index_BS, torch.zeros_like(index_BS)).cummax(dim=1).values
    return index_BS - first_BS


def make_batch(blocks: Any, index: Tensor, isolate_examples: bool) -> Batch:
    """The blocks ``index`` of a split as a :class:`Batch`.

    Args:
        blocks: :class:`lrmoe.data.TokenBlocks` (``input_ids``, ``labels``, optional
            ``segment_ids``: (N, S)).
        index: (B,) int64 block indices (or a slice).
        isolate_examples: position ids restart per packed example (module docstring).
    """
    ids, labels = blocks.input_ids[index], blocks.labels[index]
    seg = getattr(blocks, "segment_ids", None)
    if seg is None:
        return Batch(ids, labels, torch.ones_like(ids, dtype=torch.bool))
    seg = seg[index]
    pos = position_ids_from_segments(seg) if isolate_examples else None
    return Batch(ids, labels, seg != 0, pos)


class BatchStream:
    """Endless deterministic training batches of one rank: epoch after epoch of the
    :func:`lrmoe.data.batches` order (batch i of an epoch = blocks ``perm[i*B:(i+1)*B]``,
    the last one smaller when B does not divide N).

    Under expert parallelism the W ranks walk the same global sequence of batches; micro
    step j of the run gives global batches ``j*W .. j*W + W-1`` and rank r takes the r-th,
    gathering only its own blocks. The position (epoch, index = global batches consumed in
    the epoch) is what a checkpoint stores.

    Args:
        blocks: the training :class:`lrmoe.data.TokenBlocks`.
        batch_size: B >= 1. seed: ``run.seed``.
        world, rank: W and this rank.
        isolate_examples: see :func:`make_batch`.
        epoch, index: where to start (a checkpoint's :meth:`position`).

    Raises:
        ValueError: a split with no block (no batch at all).
    """

    def __init__(self, blocks: Any, batch_size: int, seed: int, *, world: int = 1,
                 rank: int = 0, isolate_examples: bool = True, epoch: int = 0,
                 index: int = 0) -> None:
        if len(blocks) == 0:
            raise ValueError("the training split holds no block; add data")
        self.blocks, self.batch_size, self.seed = blocks, batch_size, seed
        self.world, self.rank, self.isolate = world, rank, isolate_examples
        self.epoch, self.index = epoch, index
        self.per_epoch = num_batches(blocks, batch_size)
        self.seq_len = int(blocks.input_ids.shape[1])
        self._perm: Optional[Tuple[int, Tensor]] = None

    def _slice(self) -> Tensor:
        """Block indices of the global batch at the current position; advances it."""
        if self.index >= self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        if self._perm is None or self._perm[0] != self.epoch:
            self._perm = (self.epoch, epoch_permutation(len(self.blocks), seed=self.seed,
                                                        epoch=self.epoch))
        b = self.batch_size
        idx = self._perm[1][self.index * b:(self.index + 1) * b]
        self.index += 1
        return idx

    def next(self) -> Tuple[Batch, int]:
        """The next micro-batch of this rank and the input tokens (padding included) of
        all W ranks' micro-batches together."""
        own, tokens = None, 0
        for r in range(self.world):
            idx = self._slice()
            tokens += idx.numel() * self.seq_len
            if r == self.rank:
                own = make_batch(self.blocks, idx, self.isolate)
        assert own is not None
        return own, tokens

    def position(self) -> Dict[str, int]:
        """``{"epoch", "index"}`` to checkpoint."""
        return {"epoch": self.epoch, "index": self.index}


def micro_batches(stream: BatchStream, grad_accum: int) -> Tuple[List[Batch], int]:
    """The ``grad_accum`` micro-batches of one optimizer step and their input tokens over
    all ranks."""
    out, tokens = [], 0
    for _ in range(grad_accum):
        batch, n = stream.next()
        out.append(batch)
        tokens += n
    return out, tokens
