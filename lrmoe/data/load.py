"""``load_data``: read, split, tokenize and pack a source, with the cache (the module
docstring of :mod:`lrmoe.data` describes the sources and what is cached).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from tokenizers import Tokenizer

from lrmoe.data import tokenizer as _tok
from lrmoe.data.blocks import TokenBlocks
from lrmoe.data.cache import (RUN_NOTES, atomic_torch_save, digest, file_sha, load_cached,
                              pack_for_cache, unpack_from_cache)
from lrmoe.data.packing import Packed, encode_texts, pack_examples, pack_stream
from lrmoe.data.prepare import BPE_MAX_CHARS, Prepared, parse_spec, prepare

#: Bumped when parsing, cleaning, splitting or packing changes, to invalidate caches.
PIPELINE_VERSION = 2
SKIP_PROMPT_TOO_LONG = "prompt alone fills seq_len"


@dataclass
class DataReport:
    """Counts for the user (printed by the trainer).

    Attributes:
        source: what was read (``gcide (/usr/share/dictd)``, ``alpaca:/x.json``, ...).
        records_total: records in the source (headwords / JSON records / documents).
        records_used: records that ended up in the train or validation blocks;
            ``records_total == records_used + sum(skipped.values())``.
        skipped: reason -> count of records not used (never dropped silently).
        truncated: instruction examples whose response was cut to fit ``seq_len``.
        train_blocks, val_blocks: blocks of each split.
        train_tokens, val_tokens: non-padding tokens of each split.
        notes: further remarks (split method, capped BPE text, cache use, ...).
    """

    source: str
    records_total: int
    records_used: int
    skipped: Dict[str, int]
    truncated: int
    train_blocks: int
    val_blocks: int
    train_tokens: int
    val_tokens: int
    notes: List[str] = field(default_factory=list)

    def lines(self) -> List[str]:
        """Human-readable summary, one string per line."""
        out = [f"data: {self.source}: {self.records_total} records, {self.records_used} used"]
        if self.skipped:
            out.append("  not used: " + "; ".join(f"{n} {r}" for r, n in self.skipped.items()))
        if self.truncated:
            out.append(f"  truncated: {self.truncated} examples had their response cut to "
                       f"fit seq_len")
        out.append(f"  train: {self.train_blocks} blocks, {self.train_tokens} tokens; "
                   f"validation: {self.val_blocks} blocks, {self.val_tokens} tokens")
        out.extend(f"  {n}" for n in self.notes)
        return out


@dataclass
class LMData:
    """Everything the trainer needs from the data side.

    Attributes:
        train, val: packed blocks (``val`` has 0 blocks when ``val_fraction`` is 0).
        tokenizer: the :class:`tokenizers.Tokenizer`.
        tokenizer_path: its ``tokenizer.json`` (the cached file, or the user's).
        report: :class:`DataReport`.
        pad_id, eos_id: special token ids (pad = eos when the tokenizer has no pad).
    """

    train: TokenBlocks
    val: TokenBlocks
    tokenizer: Tokenizer
    tokenizer_path: Path
    report: DataReport
    pad_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary size including added/special tokens (all ids are below)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))


def _tokenize(prep: Prepared, tok, *, seq_len: int, eos_id: int, pad_id: int
              ) -> Tuple[Packed, Packed]:
    """Encode and pack both splits: one token stream (``text:``) or examples."""
    if prep.kind == "stream":
        return tuple(pack_stream(encode_texts(tok, docs), seq_len=seq_len, eos_id=eos_id,
                                 pad_id=pad_id) for docs in (prep.train, prep.val))
    out = []
    for recs in (prep.train, prep.val):
        prompts = encode_texts(tok, [r.prompt for r in recs])
        responses = encode_texts(tok, [r.response for r in recs])
        out.append(pack_examples(prompts, responses, seq_len=seq_len, eos_id=eos_id,
                                 pad_id=pad_id))
    return out[0], out[1]


def load_data(spec: str = "gcide", *, seq_len: int, cache_dir: Path,
              tokenizer: str | None = None, vocab_size: int = 4096,
              val_fraction: float = 0.02, max_records: int | None = None,
              seed: int = 0) -> LMData:
    """Read, split, tokenize and pack a data source (cached; see the module docstring).

    Args:
        spec: ``"gcide"``, ``"alpaca:PATH"`` or ``"text:PATH"``.
        seq_len: S, tokens per block (>= 8).
        cache_dir: folder for the tokenizer and the tokenized blocks (created).
        tokenizer: path of a ``tokenizer.json`` to use instead of training a BPE.
        vocab_size: size of the trained BPE (ignored with ``tokenizer``), >= 260.
        val_fraction: share of records (documents for ``text:``) in validation, in [0, 1).
        max_records: use only this many records (documents), the first in hash order, so
            the choice is deterministic and a record's split does not depend on it.
        seed: salt of the selection/split hashes (not of the batch order).
    Returns:
        :class:`LMData`.
    Raises:
        FileNotFoundError: GCIDE not installed (the message says ``apt-get install
            dict-gcide`` and the path looked at), a missing data or tokenizer file.
        ValueError: a bad argument, malformed JSON (file and line/record named), or no
            usable data (file and reason named).
    """
    if not isinstance(seq_len, int) or seq_len < 8:
        raise ValueError(f"seq_len must be an int >= 8, got {seq_len!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if max_records is not None and max_records < 1:
        raise ValueError(f"max_records must be >= 1 or None, got {max_records!r}")
    if tokenizer is None and vocab_size < _tok.MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {_tok.MIN_VOCAB}, got {vocab_size}")
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    src = parse_spec(spec)
    base = {"v": PIPELINE_VERSION, "kind": src.kind, "files": src.fingerprint,
            "val_fraction": val_fraction, "max_records": max_records, "seed": seed}
    notes: List[str] = []
    prep: Optional[Prepared] = None
    timings: Dict[str, float] = {}

    def prepared() -> Prepared:
        nonlocal prep
        if prep is None:
            t0 = time.perf_counter()
            prep = prepare(src, val_fraction=val_fraction, max_records=max_records, seed=seed)
            timings["read+split"] = time.perf_counter() - t0
        return prep

    if tokenizer is not None:
        tok_path = Path(tokenizer).expanduser().resolve()
        tok = _tok.load_tokenizer(tok_path)
        notes.append(f"tokenizer: {tok_path}")
    else:
        tok_path = cache_dir / f"tokenizer-{digest({**base, 'vocab_size': vocab_size})}.json"
        tok = load_cached(tok_path, _tok.load_tokenizer, notes, "tokenizer")
        if tok is None:
            texts, capped = prepared().bpe_texts()
            t0 = time.perf_counter()
            tok = _tok.train_bpe(texts, vocab_size, length=len(texts))
            timings["bpe"] = time.perf_counter() - t0
            _tok.save_tokenizer(tok, tok_path)
            subset = f" (its first {BPE_MAX_CHARS >> 20} MiB in hash order)" if capped else ""
            notes.append(f"tokenizer: byte-level BPE, vocab {vocab_size}, trained on the "
                         f"training split{subset} -> {tok_path}")
    eos_id, pad_id = _tok.special_ids(tok, tok_path)
    data_key = digest({**base, "tok": file_sha(tok_path), "seq_len": seq_len})
    data_path = cache_dir / f"data-{data_key}.pt"
    blob = load_cached(data_path, lambda p: torch.load(p, weights_only=True), notes, "data")
    if blob is not None:
        train, val = unpack_from_cache(blob["train"]), unpack_from_cache(blob["val"])
        report = DataReport(**blob["report"])
        report.notes = [n for n in report.notes if not n.startswith(RUN_NOTES)] + notes
        return LMData(train, val, tok, tok_path, report, pad_id, eos_id)
    p = prepared()
    t0 = time.perf_counter()
    packed_train, packed_val = _tokenize(p, tok, seq_len=seq_len, eos_id=eos_id,
                                         pad_id=pad_id)
    timings["tokenize+pack"] = time.perf_counter() - t0
    skipped = dict(p.skipped)
    too_long = packed_train.too_long + packed_val.too_long
    if too_long:
        skipped[SKIP_PROMPT_TOO_LONG] = too_long
    train = TokenBlocks(packed_train.input_ids_NS, packed_train.labels_NS,
                        packed_train.segment_ids_NS)
    val = TokenBlocks(packed_val.input_ids_NS, packed_val.labels_NS,
                      packed_val.segment_ids_NS)
    if len(train) == 0:
        raise ValueError(f"{src.label}: no training example fits seq_len={seq_len} "
                         f"({too_long} prompts alone are that long); raise seq_len")
    used = (packed_train.examples + packed_val.examples if p.kind == "instruct"
            else p.total - sum(skipped.values()))
    report = DataReport(
        source=src.label, records_total=p.total, records_used=used, skipped=skipped,
        truncated=packed_train.truncated + packed_val.truncated,
        train_blocks=len(train), val_blocks=len(val),
        train_tokens=packed_train.tokens, val_tokens=packed_val.tokens,
        notes=p.notes + notes)
    report.notes.append("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    atomic_torch_save({"train": pack_for_cache(train), "val": pack_for_cache(val),
                        "report": asdict(report)}, data_path)
    report.notes.append(f"data: saved {data_path}")
    return LMData(train, val, tok, tok_path, report, pad_id, eos_id)
