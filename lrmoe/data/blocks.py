"""Fixed-length token blocks and their batches: the form every data source ends in
(:mod:`lrmoe.data.load` makes them), and the epoch order the trainer and every rank of a
data-parallel run share.

Legend: N blocks, S seq_len, B batch size.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from lrmoe.data.packing import IGNORE_INDEX


@dataclass
class TokenBlocks:
    """Fixed-length token blocks.

    Attributes:
        input_ids: ``(N, seq_len)`` int64 token ids.
        labels: ``(N, seq_len)`` int64, aligned with ``input_ids`` (the model shifts them,
            transformers convention); -100 where there is no loss (prompt tokens, padding).
        segment_ids: ``(N, seq_len)`` int32: 1, 2, ... for the examples packed into a
            block (a text-stream block is one segment), 0 on padding; None: every
            position is a real token of one sequence.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    segment_ids: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        """N, the number of blocks."""
        return int(self.input_ids.shape[0])

    def num_loss_tokens(self) -> int:
        """Positions with a label (!= -100). With the model's shift, the loss counts the
        labelled positions that are not first in their block."""
        return int((self.labels != IGNORE_INDEX).sum())


def num_batches(blocks: TokenBlocks, batch_size: int) -> int:
    """Batches per epoch, ``ceil(N / batch_size)`` (the last one may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return -(-len(blocks) // batch_size)


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"lrmoe-batches:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def epoch_permutation(n: int, *, seed: int, epoch: int) -> torch.Tensor:
    """The block order of one epoch: ``torch.randperm(n)`` (int64) from a CPU generator
    seeded by a hash of ``(seed, epoch)``, the same on every machine and run."""
    gen = torch.Generator(device="cpu").manual_seed(_epoch_seed(seed, epoch))
    return torch.randperm(n, generator=gen)


def batches(blocks: TokenBlocks, batch_size: int, *, seed: int, epoch: int, start: int = 0
            ) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
    """Shuffled batches of one epoch, resumable.

    The order is :func:`epoch_permutation`. Batch ``i`` holds blocks
    ``perm[i*B:(i+1)*B]``; the last batch of an epoch is smaller when B does not divide N
    (no block is left out).

    Args:
        blocks: the split to iterate.
        batch_size: B >= 1.
        seed, epoch: select the permutation.
        start: first batch index to yield, in ``[0, num_batches]``; resuming at ``start``
            yields exactly the tail of the full epoch.
    Yields:
        ``(position, input_ids (B, S), labels (B, S))``: position is the batch index in
        the epoch (checkpoint ``position + 1`` to resume after it); tensors are int64 on
        the CPU.
    Raises:
        ValueError: ``batch_size < 1`` or ``start`` outside ``[0, num_batches]``.
    """
    nb = num_batches(blocks, batch_size)
    if not 0 <= start <= nb:
        raise ValueError(f"start must be in [0, {nb}] (batches per epoch for {len(blocks)} "
                         f"blocks of batch_size {batch_size}), got {start}")
    perm = epoch_permutation(len(blocks), seed=seed, epoch=epoch)
    for pos in range(start, nb):
        idx = perm[pos * batch_size:(pos + 1) * batch_size]
        yield pos, blocks.input_ids[idx], blocks.labels[idx]
