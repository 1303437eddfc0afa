"""Reading a source and splitting it, before any tokenizer: the ``spec`` of
:func:`lrmoe.data.load_data` parsed into a :class:`Source`, its records selected and split
by deterministic hashes into a :class:`Prepared` (the module docstring of
:mod:`lrmoe.data` describes the sources).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from lrmoe.data import gcide as _gcide
from lrmoe.data import sources as _sources
from lrmoe.data.cache import stat
from lrmoe.data.sources import InstructionRecord, alpaca_prompt

#: BPE training reads at most this many characters of training text (a deterministic
#: prefix of the hash-ordered training records); beyond that merges barely change.
BPE_MAX_CHARS = 64 << 20
SKIP_OVER_MAX = "over max_records"

T = TypeVar("T")


def hash2(key: str, seed: int) -> Tuple[int, float]:
    """Two independent hashes of a record key: an order key (int) and a split draw in [0, 1)."""
    d = hashlib.blake2b(f"{seed}\x00{key}".encode("utf-8", "surrogatepass"),
                        digest_size=16).digest()
    return int.from_bytes(d[:8], "big"), int.from_bytes(d[8:], "big") / 2.0 ** 64


def select_and_split(items: Sequence[T], key: Callable[[T], str], *, val_fraction: float,
                      max_records: Optional[int], seed: int
                      ) -> Tuple[List[T], List[T], int, List[str]]:
    """Hash-ordered selection of ``max_records`` items, then a hash split.

    Returns ``(train, val, n_over_max, notes)``; both lists are in hash order (a fixed
    shuffle). An item is in validation iff its split draw is < ``val_fraction``, which
    does not depend on ``max_records`` or on the other items. When that leaves a split
    empty (tiny data), the item with the lowest draw goes to validation / the highest to
    training, and a note says so.
    """
    keyed = sorted(((hash2(key(it), seed), i, it) for i, it in enumerate(items)),
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


@dataclass
class Source:
    """A parsed data spec: what to read, and the file stats that key its cache."""

    kind: str                 # gcide | alpaca | text
    path: Path
    label: str                # for the report
    fingerprint: List         # file stats: a changed file invalidates the cache


def parse_spec(spec: str) -> Source:
    """``gcide`` | ``alpaca:PATH`` | ``text:PATH`` -> :class:`Source`.

    Raises:
        FileNotFoundError: GCIDE not installed, or a missing file (named).
        ValueError: an unknown spec or one without its path (the forms named).
    """
    kind, sep, rest = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "gcide" and not rest:
        index, data = _gcide.gcide_files()
        return Source("gcide", index.parent, f"gcide ({index.parent})",
                       [stat(index), stat(data)])
    if kind in ("alpaca", "text") and sep:
        if not rest.strip():
            raise ValueError(f"data spec {spec!r} lacks a path: use {kind}:PATH")
        path = Path(rest).expanduser().resolve()
        if kind == "alpaca":
            _sources.check_alpaca_path(path)
            return Source("alpaca", path, f"alpaca:{path}", [stat(path)])
        files = _sources.text_files(path)
        return Source("text", path, f"text:{path}", [stat(f) for f in files])
    raise ValueError(f"unknown data spec {spec!r}: use 'gcide', 'alpaca:PATH' (Alpaca JSON "
                     f"or JSONL) or 'text:PATH' (a text file or a folder of .txt/.md files)")


@dataclass
class Prepared:
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


def prepare(src: Source, *, val_fraction: float, max_records: Optional[int],
             seed: int) -> Prepared:
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
        train_g, val_g, over, split_notes = select_and_split(
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
        train, val, over, split_notes = select_and_split(
            found.records, lambda r: r.key, val_fraction=val_fraction,
            max_records=max_records, seed=seed)
        notes.append(f"split: by hash of the record's text (val_fraction={val_fraction}, "
                     f"seed={seed})")
        kind = "instruct"
    else:
        docs = found.records  # (relative name, text)
        over = 0
        if max_records is not None and len(docs) > max_records:
            order = sorted(docs, key=lambda d: (hash2(d[0], seed)[0], d[0]))
            kept = {d[0] for d in order[:max_records]}
            over = len(docs) - max_records
            docs = [d for d in docs if d[0] in kept]
        if len(docs) >= 2:
            train_d, val_d, _, split_notes = select_and_split(
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
    return Prepared(kind, train, val, found.total, skipped, notes)
