"""The data cache: content keys, atomic writes, and the compact on-disk form of token
blocks (:func:`lrmoe.data.load_data` caches the tokenizer and the blocks with these).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, TypeVar

import torch

from lrmoe.data.blocks import TokenBlocks
from lrmoe.data.packing import IGNORE_INDEX

T = TypeVar("T")


def digest(obj) -> str:
    """A 20-hex-digit SHA-256 of ``obj`` as sorted JSON: the cache key of a configuration."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def file_sha(path: Path) -> str:
    """A 20-hex-digit SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:20]


def stat(path: Path) -> List:
    """``[path, size in bytes, mtime in ns]``: a changed file changes the cache key."""
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename: an interrupted
    write leaves no partial cache file (the temporary one is removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pack_for_cache(blocks: TokenBlocks) -> Dict[str, torch.Tensor]:
    """``{"ids": (N, S) int32, "loss": (N, S) bool, "segments": (N, S) int32 or None}``."""
    # int32 ids + a loss mask + int32 segments: ~60 % of two int64 tensors on disk.
    return {"ids": blocks.input_ids.to(torch.int32),
            "loss": blocks.labels != IGNORE_INDEX, "segments": blocks.segment_ids}


def unpack_from_cache(d: Dict[str, torch.Tensor]) -> TokenBlocks:
    """The inverse of :func:`pack_for_cache` (int64 ids, -100 labels off the loss mask)."""
    ids = d["ids"].to(torch.int64)
    return TokenBlocks(ids, torch.where(d["loss"], ids, torch.full_like(ids, IGNORE_INDEX)),
                       d["segments"])


#: Notes that describe one run (not the cached data), dropped when the report is reloaded.
RUN_NOTES = ("tokenizer:", "data:", "timings:")


def load_cached(path: Path, load: Callable[[Path], T], notes: List[str], what: str
                 ) -> Optional[T]:
    """``load(path)`` when the cache file exists and reads back, else None (an unreadable
    file, e.g. from another library version, is noted and rebuilt)."""
    if not path.is_file():
        return None
    try:
        value = load(path)
    except Exception as e:  # noqa: BLE001 -- any failure means: rebuild it
        notes.append(f"{what}: cache {path} unreadable ({type(e).__name__}), rebuilt")
        return None
    notes.append(f"{what}: cached {path}")
    return value
