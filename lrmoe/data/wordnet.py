"""Alpaca-format instruction data built from WordNet 3.0 (the SFT setting's fine-tuning data).

    lrmoe data wordnet-alpaca --out wordnet_alpaca.jsonl

reads the WordNet 3.0 database files of Debian's ``wordnet-base`` package
(``/usr/share/wordnet/{index,data}.{noun,verb,adj,adv}``, Princeton WordNet licence) and
writes Stanford-Alpaca JSONL records (``instruction``, ``input``, ``output``) that
``lrmoe train --data alpaca:PATH`` reads. For every lemma of every part of speech, in the
order of the index files, up to four records:

* **definition**: instruction ``Define the <pos> below.``, input the word, output the
  definitions of its first :data:`MAX_SENSES` senses (WordNet's sense order, most frequent
  first), numbered when there are several;
* **synonyms**: instruction ``Give synonyms of the <pos> below.``, input the word, output
  the other words of its first sense that has any (``, ``-joined);
* **sentence**: instruction ``Use the word "<word>" in a sentence.``, output the first of
  WordNet's example sentences (its senses in order) that holds the word or an inflection
  of it (:func:`mentions`);
* **hypernym** (nouns and verbs): instruction ``What kind of thing is "<word>"?`` /
  ``What is a more general verb than "<word>"?``, output ``<Word> is a kind of <h>.`` /
  ``<Word> is an instance of <h>.`` / ``To <word> is a way to <h>.`` from the first
  hypernym pointer of the first sense (``@`` or ``@i``; ``h`` is the hypernym synset's
  first word).

A record is only written when its output is not empty. The file format is the one of the
WordNet 3.0 manual page ``wndb(5)``: a data line is ``offset lex_filenum ss_type w_cnt
(word lex_id)* p_cnt (pointer_symbol offset pos source/target)* [frames] | gloss``
(``w_cnt`` in hexadecimal), an index line ``lemma pos synset_cnt p_cnt (ptr_symbol)*
sense_cnt tagsense_cnt (synset_offset)*``; lines starting with two spaces are the licence.
The licence text of the database is written beside the output (``<out>.LICENSE.txt``), as
the licence asks of every copy.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

from lrmoe.utils.paths import check_output

#: Where Debian's ``wordnet-base`` installs the database.
DEFAULT_DIR = Path("/usr/share/wordnet")
#: (file suffix, index/pointer pos letter, name in the instructions), in output order.
POS = (("noun", "n", "noun"), ("verb", "v", "verb"), ("adj", "a", "adjective"),
       ("adv", "r", "adverb"))
#: Senses listed in a definition record (WordNet's words have up to ~75 senses).
MAX_SENSES = 3
#: Synonyms listed in a synonym record.
MAX_SYNONYMS = 8
TASKS = ("definition", "synonyms", "sentence", "hypernym")
_ADJ_MARKER = re.compile(r"\((?:a|p|ip)\)$")  # wndb(5): adjective position markers


@dataclass
class Synset:
    """One data line.

    Attributes:
        offset: byte offset of the line in its data file (the synset's id in that file).
        words: the synset's words, spaces for underscores, adjective markers removed.
        pointers: ``(pointer_symbol, target offset, target pos letter)``.
        definition: the gloss without its example sentences.
        examples: the gloss's quoted example sentences, in order.
    """

    offset: int
    words: List[str]
    pointers: List[Tuple[str, int, str]]
    definition: str
    examples: List[str]


def _word(token: str) -> str:
    return _ADJ_MARKER.sub("", token).replace("_", " ")


def parse_data_line(line: str) -> Synset:
    """A :class:`Synset` from one line of ``data.<pos>`` (format: module docstring).

    Raises:
        ValueError: a line that does not follow that format (quoted in the message).
    """
    head, sep, gloss = line.partition(" | ")
    f = head.split()
    try:
        n_words = int(f[3], 16)
        words = [_word(f[4 + 2 * i]) for i in range(n_words)]
        at = 4 + 2 * n_words
        n_ptr = int(f[at])
        pointers = [(f[at + 1 + 4 * i], int(f[at + 2 + 4 * i]), f[at + 3 + 4 * i])
                    for i in range(n_ptr)]
        offset = int(f[0])
    except (IndexError, ValueError):
        raise ValueError(f"not a WordNet data line (wndb(5) format): {line[:120]!r}") from None
    gloss = gloss.strip() if sep else ""
    quote = gloss.find('"')
    definition = (gloss if quote < 0 else gloss[:quote]).strip().rstrip(";").strip()
    examples = [e.strip() for e in re.findall(r'"([^"]*)"', gloss) if e.strip()]
    return Synset(offset, words, pointers, definition, examples)


def read_data(path: Path) -> Dict[int, Synset]:
    """``{offset: Synset}`` of one ``data.<pos>`` file (licence lines skipped).

    Raises:
        ValueError: a malformed line (naming the file and line number).
    """
    out = {}
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.startswith("  ") or not line.strip():
                continue
            try:
                s = parse_data_line(line.rstrip("\n"))
            except ValueError as e:
                raise ValueError(f"{path}, line {lineno}: {e}") from None
            out[s.offset] = s
    return out


def read_index(path: Path) -> Iterator[Tuple[str, List[int]]]:
    """``(lemma, synset offsets in sense order)`` of every line of ``index.<pos>``.

    Raises:
        ValueError: a malformed line (naming the file and line number).
    """
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.startswith("  ") or not line.strip():
                continue
            f = line.split()
            try:
                n_syn, n_ptr = int(f[2]), int(f[3])
                offsets = [int(x) for x in f[6 + n_ptr:6 + n_ptr + n_syn]]
            except (IndexError, ValueError):
                offsets = []
            if not offsets or len(offsets) != n_syn:
                raise ValueError(f"{path}, line {lineno}: not a WordNet index line (wndb(5) "
                                 f"format): {line[:120]!r}")
            yield f[0], offsets


def mentions(sentence: str, word: str) -> bool:
    """True when ``sentence`` holds ``word`` or an inflection of it, case-insensitively:
    the first token may carry a suffix (``tone`` matches ``tones``; ``warm up`` matches
    ``warmed up``), and a final ``e`` of a first token of four letters or more may be
    dropped (``tone`` matches ``toning``). Over-matches (``bank`` in ``banking``) are
    accepted: the sentence still shows the word's stem in use."""
    first, *rest = word.lower().split(" ")
    stem = first[:-1] if len(first) >= 4 and first.endswith("e") else first
    pattern = r"\b" + re.escape(stem) + r"\w*" + "".join(r"\s+" + re.escape(t) for t in rest)
    return re.search(pattern + r"\b", sentence.lower()) is not None


def _display(lemma: str, synsets: Sequence[Synset]) -> str:
    """The index lemma (lower case, underscores) as the synsets spell it (``Paris``)."""
    plain = lemma.replace("_", " ")
    for s in synsets:
        for w in s.words:
            if w.lower() == plain:
                return w
    return plain


def lemma_records(lemma: str, senses: Sequence[Synset], pos_name: str,
                  synsets: Dict[int, Synset], max_senses: int = MAX_SENSES
                  ) -> List[Dict[str, str]]:
    """The records of one lemma (see the module docstring), in :data:`TASKS` order.

    Args:
        lemma: the index lemma (``warm_up``).
        senses: its synsets in sense order.
        pos_name: ``noun``, ``verb``, ``adjective`` or ``adverb``.
        synsets: every synset of that part of speech by offset (hypernym targets).
        max_senses: senses in the definition record, >= 1.
    Returns:
        ``[{"task", "instruction", "input", "output"}, ...]``.
    """
    word = _display(lemma, senses)
    out = []
    defs = [s.definition for s in senses[:max_senses] if s.definition]
    if defs:
        text = defs[0] if len(defs) == 1 else "\n".join(
            f"{i}. {d}" for i, d in enumerate(defs, 1))
        out.append({"task": "definition", "instruction": f"Define the {pos_name} below.",
                    "input": word, "output": text})
    for s in senses:
        others = [w for w in s.words if w.lower() != word.lower()]
        if others:
            out.append({"task": "synonyms",
                        "instruction": f"Give synonyms of the {pos_name} below.",
                        "input": word, "output": ", ".join(others[:MAX_SYNONYMS])})
            break
    example = next((e for s in senses for e in s.examples if mentions(e, word)), None)
    if example is not None:
        out.append({"task": "sentence",
                    "instruction": f'Use the word "{word}" in a sentence.', "input": "",
                    "output": example})
    hyper = next(((sym, off) for sym, off, _ in senses[0].pointers if sym in ("@", "@i")),
                 None) if pos_name in ("noun", "verb") else None
    if hyper is not None and hyper[1] in synsets:
        h = synsets[hyper[1]].words[0]
        if pos_name == "verb":
            q, a = f'What is a more general verb than "{word}"?', f"To {word} is a way to {h}."
        else:
            q = f'What kind of thing is "{word}"?'
            kind = "an instance of" if hyper[0] == "@i" else "a kind of"
            a = f"{word[:1].upper()}{word[1:]} is {kind} {h}."
        out.append({"task": "hypernym", "instruction": q, "input": "", "output": a})
    return out


def build_records(wordnet_dir: str | os.PathLike = DEFAULT_DIR,
                  max_senses: int = MAX_SENSES) -> List[Dict[str, str]]:
    """Every record of the database in ``wordnet_dir`` (parts of speech in :data:`POS`
    order, lemmas in index order, tasks in :data:`TASKS` order).

    Returns:
        ``[{"task", "instruction", "input", "output"}, ...]`` (``task`` is kept in the
        JSONL; the Alpaca reader ignores it).
    Raises:
        FileNotFoundError: a database file is missing (the message says
            ``apt-get install wordnet-base`` and the folder looked at).
        ValueError: ``max_senses < 1``, or a malformed line (file and line named).
    """
    if not isinstance(max_senses, int) or max_senses < 1:
        raise ValueError(f"max_senses must be an int >= 1, got {max_senses!r}")
    root = Path(wordnet_dir)
    missing = [f"{kind}.{suffix}" for suffix, _, _ in POS for kind in ("index", "data")
               if not (root / f"{kind}.{suffix}").is_file()]
    if missing:
        raise FileNotFoundError(f"WordNet 3.0 database not found in {root} (missing "
                                f"{', '.join(missing)}): install it with `apt-get install "
                                f"wordnet-base`, or pass the folder holding index.noun, "
                                f"data.noun, ... (--wordnet-dir)")
    records: List[Dict[str, str]] = []
    for suffix, _, pos_name in POS:
        synsets = read_data(root / f"data.{suffix}")
        for lemma, offsets in read_index(root / f"index.{suffix}"):
            senses = [synsets[o] for o in offsets if o in synsets]
            if senses:
                records.extend(lemma_records(lemma, senses, pos_name, synsets, max_senses))
    return records


def licence_text(wordnet_dir: str | os.PathLike = DEFAULT_DIR) -> str:
    """The licence header of ``data.noun`` (its two-space lines without their numbers)."""
    lines = []
    with open(Path(wordnet_dir) / "data.noun", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.startswith("  "):
                break
            lines.append(re.sub(r"^\s+\d+\s?", "", line).rstrip())
    return "\n".join(lines).strip() + "\n"


def write_jsonl(records: Sequence[Dict[str, str]], path: str | os.PathLike) -> Path:
    """Write ``records`` as JSONL (UTF-8, one object a line) atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for r in records:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; a data file is for sharing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def build(out: str | os.PathLike, wordnet_dir: str | os.PathLike = DEFAULT_DIR,
          max_senses: int = MAX_SENSES) -> Dict[str, int]:
    """Build the JSONL at ``out`` and the licence beside it (``<out>.LICENSE.txt``).

    Returns:
        ``{task: records}`` counts, plus ``"total"``.
    Raises:
        FileNotFoundError, ValueError: see :func:`build_records`; ValueError also for an
            ``out`` that cannot be written (:func:`lrmoe.utils.paths.check_output`).
    """
    check_output("--out", out, is_dir=False)
    records = build_records(wordnet_dir, max_senses)
    path = write_jsonl(records, out)
    Path(str(path) + ".LICENSE.txt").write_text(
        "Built from WordNet 3.0 (Princeton University) by `lrmoe data wordnet-alpaca`.\n"
        "The WordNet licence follows.\n\n" + licence_text(wordnet_dir))
    counts = {t: sum(r["task"] == t for r in records) for t in TASKS}
    counts["total"] = len(records)
    return counts
