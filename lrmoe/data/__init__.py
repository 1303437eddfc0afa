"""Training data for ``lrmoe train``: sources, tokenizer, packed blocks, batches.

Sources (the ``spec`` of :func:`load_data`):

* ``gcide`` (default): an Alpaca-style instruction set built from the GCIDE dictionary of
  Debian's ``dict-gcide`` package -- one record per headword, instruction
  ``"Define <word>."``, output the cleaned entry text (see :mod:`lrmoe.data.gcide`).
* ``alpaca:PATH``: a Stanford-Alpaca JSON list or JSONL file (instruction/input/output).
* ``text:PATH``: a text file, or a folder of ``*.txt``/``*.md`` files (recursive,
  sorted), packed as one token stream for plain language modelling.

Instruction records are formatted with the Alpaca prompt template; the loss is on the
response and its EOS only. They are packed greedily into ``seq_len`` blocks without ever
splitting an example. Train/validation splits are deterministic hashes (below).

Everything expensive is cached under ``cache_dir``: the trained tokenizer (keyed by the
source's identity and file sizes/mtimes, the split parameters, ``max_records`` and
``vocab_size``) and the tokenized blocks (that key + the tokenizer file's hash +
``seq_len``); a second call with the same arguments only loads two files. Cache files
are written atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
from tokenizers import Tokenizer

from lrmoe.data import gcide as _gcide
from lrmoe.data import sources as _sources
from lrmoe.data import tokenizer as _tok
from lrmoe.data.packing import IGNORE_INDEX, Packed, encode_texts, pack_examples, pack_stream
from lrmoe.data.sources import InstructionRecord, alpaca_prompt

__all__ = ["TokenBlocks", "DataReport", "LMData", "load_data", "batches", "num_batches",
           "epoch_permutation", "IGNORE_INDEX", "alpaca_prompt"]

#: Bumped when parsing, cleaning, splitting or packing changes, to invalidate caches.
PIPELINE_VERSION = 2
#: BPE training reads at most this many characters of training text (a deterministic
#: prefix of the hash-ordered training records); beyond that merges barely change.
BPE_MAX_CHARS = 64 << 20
SKIP_OVER_MAX = "over max_records"
SKIP_PROMPT_TOO_LONG = "prompt alone fills seq_len"

T = TypeVar("T")


# ================================================================== public data classes
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


# ================================================================== batches
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


# ================================================================== split helpers
def _hash2(key: str, seed: int) -> Tuple[int, float]:
    """Two independent hashes of a record key: an order key (int) and a split draw in [0, 1)."""
    d = hashlib.blake2b(f"{seed}\x00{key}".encode("utf-8", "surrogatepass"),
                        digest_size=16).digest()
    return int.from_bytes(d[:8], "big"), int.from_bytes(d[8:], "big") / 2.0 ** 64


def _select_and_split(items: Sequence[T], key: Callable[[T], str], *, val_fraction: float,
                      max_records: Optional[int], seed: int
                      ) -> Tuple[List[T], List[T], int, List[str]]:
    """Hash-ordered selection of ``max_records`` items, then a hash split.

    Returns ``(train, val, n_over_max, notes)``; both lists are in hash order (a fixed
    shuffle). An item is in validation iff its split draw is < ``val_fraction``, which
    does not depend on ``max_records`` or on the other items. When that leaves a split
    empty (tiny data), the item with the lowest draw goes to validation / the highest to
    training, and a note says so.
    """
    keyed = sorted(((_hash2(key(it), seed), i, it) for i, it in enumerate(items)),
                   key=lambda t: (t[0][0], t[1]))
    over = 0
    if max_records is not None and len(keyed) > max_records:
        over = len(keyed) - max_records
        keyed = keyed[:max_records]
    val = [t for t in keyed if t[0][1] < val_fraction]
    train = [t for t in keyed if t[0][1] >= val_fraction]
    notes = []
    if val_fraction > 0 and not val and len(train) >= 2:
        low = min(train, key=lambda t: t[0][1])
        train.remove(low)
        val.append(low)
        notes.append("validation: the hash split chose no record; the lowest-hash one is "
                     "used for validation")
    if not train and len(val) >= 2:
        high = max(val, key=lambda t: t[0][1])
        val.remove(high)
        train.append(high)
        notes.append("training: the hash split chose no record; the highest-hash "
                     "validation one is used for training")
    return [t[2] for t in train], [t[2] for t in val], over, notes


# ================================================================== cache helpers
def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:20]


def _stat(path: Path) -> List:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def _atomic_torch_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _pack_for_cache(blocks: TokenBlocks) -> Dict[str, torch.Tensor]:
    # int32 ids + a loss mask + int32 segments: ~60 % of two int64 tensors on disk.
    return {"ids": blocks.input_ids.to(torch.int32),
            "loss": blocks.labels != IGNORE_INDEX, "segments": blocks.segment_ids}


def _unpack_from_cache(d: Dict[str, torch.Tensor]) -> TokenBlocks:
    ids = d["ids"].to(torch.int64)
    return TokenBlocks(ids, torch.where(d["loss"], ids, torch.full_like(ids, IGNORE_INDEX)),
                       d["segments"])


#: Notes that describe one run (not the cached data), dropped when the report is reloaded.
_RUN_NOTES = ("tokenizer:", "data:", "timings:")


def _load_cached(path: Path, load: Callable[[Path], T], notes: List[str], what: str
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


# ================================================================== sources
@dataclass
class _Source:
    kind: str                 # gcide | alpaca | text
    path: Path
    label: str                # for the report
    fingerprint: List         # file stats: a changed file invalidates the cache


def _parse_spec(spec: str) -> _Source:
    kind, sep, rest = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "gcide" and not rest:
        index, data = _gcide.gcide_files()
        return _Source("gcide", index.parent, f"gcide ({index.parent})",
                       [_stat(index), _stat(data)])
    if kind in ("alpaca", "text") and sep:
        if not rest.strip():
            raise ValueError(f"data spec {spec!r} lacks a path: use {kind}:PATH")
        path = Path(rest).expanduser().resolve()
        if kind == "alpaca":
            _sources.check_alpaca_path(path)
            return _Source("alpaca", path, f"alpaca:{path}", [_stat(path)])
        files = _sources.text_files(path)
        return _Source("text", path, f"text:{path}", [_stat(f) for f in files])
    raise ValueError(f"unknown data spec {spec!r}: use 'gcide', 'alpaca:PATH' (Alpaca JSON "
                     f"or JSONL) or 'text:PATH' (a text file or a folder of .txt/.md files)")


@dataclass
class _Prepared:
    """Split text, before tokenization."""

    kind: str                               # "instruct" or "stream"
    train: list                             # InstructionRecord or document str
    val: list
    total: int
    skipped: Dict[str, int]
    notes: List[str]

    def bpe_texts(self) -> Tuple[List[str], bool]:
        """Training-split text for BPE, capped at :data:`BPE_MAX_CHARS`; (texts, capped)."""
        texts, size = [], 0
        for item in self.train:
            t = item.prompt + item.response if self.kind == "instruct" else item
            if size + len(t) > BPE_MAX_CHARS and texts:
                return texts, True
            texts.append(t)
            size += len(t)
        return texts, False


def _prepare(src: _Source, *, val_fraction: float, max_records: Optional[int],
             seed: int) -> _Prepared:
    """Read the source, select ``max_records`` and split (no tokenizer involved)."""
    if src.kind == "gcide":
        g = _gcide.load_gcide(src.path)
        found = _sources.SourceRecords(g.records, g.index_words, dict(g.skipped))
        if g.bad_utf8:
            found.notes.append(f"{g.bad_utf8} GCIDE entries had bytes that are not UTF-8, "
                               f"replaced by U+FFFD")
    elif src.kind == "alpaca":
        found = _sources.read_alpaca(src.path)
    else:
        found = _sources.read_text_documents(src.path)
    if not found.records:
        why = ", ".join(f"{n} {r}" for r, n in found.skipped.items()) or "no records"
        raise ValueError(f"{src.label}: no usable records ({found.total} read: {why}); fix "
                         f"the data or choose another data spec")
    skipped, notes = dict(found.skipped), list(found.notes)
    if src.kind == "gcide":
        # (headword, raw entries): only the selected records are cleaned.
        train_g, val_g, over, split_notes = _select_and_split(
            found.records, lambda r: r[0], val_fraction=val_fraction,
            max_records=max_records, seed=seed)
        train, val = [], []
        for part, out in ((train_g, train), (val_g, val)):
            for word, raws in part:
                text = _gcide.entry_text(raws)
                if text:
                    out.append(InstructionRecord(word, alpaca_prompt(f"Define {word}."), text))
                else:
                    skipped[_gcide.SKIP_EMPTY] = skipped.get(_gcide.SKIP_EMPTY, 0) + 1
        notes.append(f"split: by hash of the headword (val_fraction={val_fraction}, "
                     f"seed={seed})")
        kind = "instruct"
    elif src.kind == "alpaca":
        train, val, over, split_notes = _select_and_split(
            found.records, lambda r: r.key, val_fraction=val_fraction,
            max_records=max_records, seed=seed)
        notes.append(f"split: by hash of the record's text (val_fraction={val_fraction}, "
                     f"seed={seed})")
        kind = "instruct"
    else:
        docs = found.records  # (relative name, text)
        over = 0
        if max_records is not None and len(docs) > max_records:
            order = sorted(docs, key=lambda d: (_hash2(d[0], seed)[0], d[0]))
            kept = {d[0] for d in order[:max_records]}
            over = len(docs) - max_records
            docs = [d for d in docs if d[0] in kept]
        if len(docs) >= 2:
            train_d, val_d, _, split_notes = _select_and_split(
                docs, lambda d: d[0], val_fraction=val_fraction, max_records=None, seed=seed)
            train = [t for _, t in sorted(train_d)]  # the stream follows file order
            val = [t for _, t in sorted(val_d)]
            notes.append(f"split: by hash of the file's relative path (val_fraction="
                         f"{val_fraction}, seed={seed}); {len(val)} validation file(s)")
        else:
            text = docs[0][1]
            cut = len(text) - int(round(len(text) * val_fraction))
            if 0 < cut < len(text):
                nl = text.rfind("\n", 0, cut)
                cut = nl + 1 if nl > 0 else cut
            train, val = [text[:cut]], ([text[cut:]] if text[cut:].strip() else [])
            split_notes = []
            notes.append(f"split: one document; its last {val_fraction:.1%} of characters "
                         f"(cut after a line break) is the validation text")
        kind = "stream"
    if over:
        skipped[SKIP_OVER_MAX] = over
    notes.extend(split_notes)
    return _Prepared(kind, train, val, found.total, skipped, notes)


def _tokenize(prep: _Prepared, tok, *, seq_len: int, eos_id: int, pad_id: int
              ) -> Tuple[Packed, Packed]:
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


# ================================================================== load_data
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
    src = _parse_spec(spec)
    base = {"v": PIPELINE_VERSION, "kind": src.kind, "files": src.fingerprint,
            "val_fraction": val_fraction, "max_records": max_records, "seed": seed}
    notes: List[str] = []
    prep: Optional[_Prepared] = None
    timings: Dict[str, float] = {}

    def prepared() -> _Prepared:
        nonlocal prep
        if prep is None:
            t0 = time.perf_counter()
            prep = _prepare(src, val_fraction=val_fraction, max_records=max_records, seed=seed)
            timings["read+split"] = time.perf_counter() - t0
        return prep

    if tokenizer is not None:
        tok_path = Path(tokenizer).expanduser().resolve()
        tok = _tok.load_tokenizer(tok_path)
        notes.append(f"tokenizer: {tok_path}")
    else:
        tok_path = cache_dir / f"tokenizer-{_digest({**base, 'vocab_size': vocab_size})}.json"
        tok = _load_cached(tok_path, _tok.load_tokenizer, notes, "tokenizer")
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
    data_key = _digest({**base, "tok": _file_sha(tok_path), "seq_len": seq_len})
    data_path = cache_dir / f"data-{data_key}.pt"
    blob = _load_cached(data_path, lambda p: torch.load(p, weights_only=True), notes, "data")
    if blob is not None:
        train, val = _unpack_from_cache(blob["train"]), _unpack_from_cache(blob["val"])
        report = DataReport(**blob["report"])
        report.notes = [n for n in report.notes if not n.startswith(_RUN_NOTES)] + notes
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
    _atomic_torch_save({"train": _pack_for_cache(train), "val": _pack_for_cache(val),
                        "report": asdict(report)}, data_path)
    report.notes.append(f"data: saved {data_path}")
    return LMData(train, val, tok, tok_path, report, pad_id, eos_id)
