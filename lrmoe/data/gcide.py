"""GCIDE, the Collaborative International Dictionary of English, read from its dictd files.

Debian's ``dict-gcide`` package installs two files in ``/usr/share/dictd``:

* ``gcide.index``: one line per index word, ``word \\t offset \\t length``, the numbers in
  dictd's base64 (alphabet ``A-Za-z0-9+/``, most significant digit first, no padding);
* ``gcide.dict.dz``: the entries, dictzip-compressed (a gzip file whose extra field lets
  dictd seek; Python's :mod:`gzip` reads it as a plain gzip stream). ``offset`` and
  ``length`` address bytes of the *decompressed* text (about 40 MB).

Many index lines do not name an entry of their own: sub-phrases ("Law Latin", "To go to
law") and inflected forms ("Leaned") point into the entry of another headword. A
record is made only for an index word whose entry's head line names that word (compared
case- and accent-insensitively); the others are counted in the report, never dropped
silently. A word with several entries of its own (``Cock`` n., ``Cock`` v. ...) becomes
ONE record whose text is those entries, in index order, separated by a blank line.
"""
from __future__ import annotations

import functools
import gzip
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

#: dictd's base64 digit alphabet, digit value = position.
B64_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_VALUE = {c: i for i, c in enumerate(B64_ALPHABET)}

DEFAULT_DIR = Path("/usr/share/dictd")
ENV_DIR = "LRMOE_GCIDE_DIR"
INDEX_NAME = "gcide.index"
DICT_NAMES = ("gcide.dict.dz", "gcide.dict")

#: Index words that describe the database itself (dictd's 00-database-* and the gcide /
#: web1913 aliases of them), not dictionary entries.
_META_WORD = re.compile(r"^00-?(database|gcide|web1913)-")

SKIP_META = "dictd metadata entry"
SKIP_SUBENTRY = "sub-phrase or inflection inside another headword's entry"
SKIP_EMPTY = "empty entry text"
SKIP_USED = "entry already used by an earlier headword"


def decode_b64(digits: str) -> int:
    """Value of a dictd base64 number (``"A"`` = 0, ``"BA"`` = 64, ``"5I"`` = 3656).

    Raises:
        ValueError: on an empty string or a character outside ``A-Za-z0-9+/``.
    """
    if not digits:
        raise ValueError("dictd base64 number is empty")
    value = 0
    for ch in digits:
        try:
            value = value * 64 + _B64_VALUE[ch]
        except KeyError:
            raise ValueError(f"invalid dictd base64 digit {ch!r} in {digits!r}") from None
    return value


def gcide_dir() -> Path:
    """The dictd folder: ``$LRMOE_GCIDE_DIR`` when set, else ``/usr/share/dictd``."""
    env = os.environ.get(ENV_DIR)
    return Path(env) if env else DEFAULT_DIR


def gcide_files(directory: Path | None = None) -> Tuple[Path, Path]:
    """Paths of (gcide.index, gcide.dict.dz or gcide.dict) in ``directory``.

    Raises:
        FileNotFoundError: naming the folder looked at and how to install the package.
    """
    directory = gcide_dir() if directory is None else Path(directory)
    index = directory / INDEX_NAME
    data = next((directory / n for n in DICT_NAMES if (directory / n).is_file()), None)
    if not index.is_file() or data is None:
        missing = index if not index.is_file() else directory / DICT_NAMES[0]
        raise FileNotFoundError(
            f"GCIDE dictionary not found: {missing} does not exist. Install it with "
            f"`apt-get install dict-gcide` (Debian/Ubuntu), set {ENV_DIR} to a folder "
            f"holding {INDEX_NAME} and {DICT_NAMES[0]}, or use another data spec "
            f"(alpaca:PATH or text:PATH).")
    return index, data


def read_index(path: Path) -> List[Tuple[str, int, int]]:
    """Parse a dictd index into ``(word, offset, length)`` rows in file order.

    Raises:
        ValueError: naming the file and line of a malformed row.
    """
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            parts = line.split("\t")
            if len(parts) < 3:
                raise ValueError(f"{path}, line {lineno}: expected 'word<TAB>offset<TAB>length',"
                                 f" got {line[:80]!r}")
            try:
                rows.append((parts[0], decode_b64(parts[1]), decode_b64(parts[2])))
            except ValueError as e:
                raise ValueError(f"{path}, line {lineno}: {e}") from None
    return rows


def read_dict(path: Path) -> bytes:
    """The decompressed dictd text (gzip/dictzip, or plain when the name lacks ``.dz``)."""
    if path.suffix in (".dz", ".gz"):
        with gzip.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()


# ------------------------------------------------------------------------ entry cleaning
# GCIDE's dictd text writes non-ASCII letters as bracketed codes: [=a] macron, [a^] breve,
# ['e] acute, [ae] ligature, [eth], [alpha] ... Codes with a letter and a mark become the
# Unicode letter; named symbols get their character; unknown codes stay as written.
_MARKS = {"`": "\u0300", "'": "\u0301", "^": "\u0302", "~": "\u0303", "=": "\u0304",
          '"': "\u0308", ",": "\u0327", "-": "\u0304", "*": "\u030a"}
_NAMED = {
    "ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "=ae": "ǣ", "eth": "ð", "thorn": "þ",
    "ng": "ŋ", "deg": "°", "sect": "§", "root": "√", "yogh": "ȝ", "add": "ä", "aum": "ä",
    "udd": "ü", "imac": "ī", "asl": "a", "th": "th", "dsdot": "ḍ", "=oo": "o͞o",
    "oo^": "o͝o", "pound": "£", "para": "¶", "frac12": "½", "frac14": "¼", "frac34": "¾",
    "prime": "′", "sharp": "♯", "flat": "♭", "natural": "♮", "hand": "☞", "bar": "|",
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "Delta": "Δ", "epsilon": "ε",
    "zeta": "ζ", "eta": "η", "theta": "θ", "iota": "ι", "kappa": "κ", "lambda": "λ",
    "mu": "μ", "nu": "ν", "xi": "ξ", "omicron": "ο", "pi": "π", "rho": "ρ", "sigma": "σ",
    "Sigma": "Σ", "tau": "τ", "upsilon": "υ", "phi": "φ", "chi": "χ", "psi": "ψ",
    "omega": "ω", "Omega": "Ω",
}
_HEAD = re.compile(r"^([^\s\\][^\\\n]*)", re.MULTILINE)
_FOLD_SEP = re.compile(r"[\s`\"*']+")
_CODE = re.compile(r"\[([A-Za-z=^`'~\",.*-]{1,8})\]")
_PRON = re.compile(r"\s?\\[^\\\n]*\\(?:\s*\([^()\n]*[*\"`\[][^()\n]*\))?")
_BRACED = re.compile(r"\{([^{}\n]*)\}")
_SYLLABLE_MARKS = re.compile(r"(?<=\w)[`*\"](?=\w)|(?<=\w)`")
_SOURCE_TAG = re.compile(
    r"\[(?:[^\[\]\n]*(?:Webster|WordNet|PJC|Century Dict|RHUD|RDH|MW1\d)[^\[\]\n]*|AS)\]")


def _code_to_text(match: re.Match) -> str:
    code = match.group(1)
    if code in _NAMED:
        return _NAMED[code]
    if len(code) == 2:
        mark, letter = code[0], code[1]
        if mark == "." and letter.isalpha():  # dot below for Sanskrit consonants, else above
            return unicodedata.normalize(
                "NFC", letter + ("\u0307" if letter in "aeiouAEIOU" else "\u0323"))
        if mark in _MARKS and letter.isalpha():
            return unicodedata.normalize("NFC", letter + _MARKS[mark])
        if letter == "^" and mark.isalpha():  # [a^]: breve written after the letter
            return unicodedata.normalize("NFC", mark + "\u0306")
    return match.group(0)


@functools.lru_cache(maxsize=None)
def _fold(text: str) -> str:
    """Lower-case ASCII skeleton of a word, for matching index words to head lines."""
    if not text.isascii() or "[" in text:
        text = _CODE.sub(_code_to_text, text)
        text = unicodedata.normalize("NFKD", text)
        text = "".join(c for c in text if not unicodedata.combining(c))
    return _FOLD_SEP.sub(" ", text).strip().lower()


def head_words(raw: str) -> List[str]:
    """Folded headwords of an entry: the text before `` \\`` on each line at column 0."""
    return [_fold(h) for h in _HEAD.findall(raw)]


def clean_entry(raw: str) -> str:
    """Readable text of one dictd entry.

    Drops stray lines before the first head line, the syllabified pronunciation
    ``\\Con`ti*nu"i*ty\\`` (and a respelling in parentheses right after it), source tags
    (``[1913 Webster]``, ``[WordNet 1.5 +PJC]``), and the cross-reference braces
    ``{Lie}`` -> ``Lie`` (dropping syllable marks inside them: ``{Re*new"al}`` ->
    ``Renewal``); turns letter codes into Unicode (``[=a]`` -> ``ā``); joins the
    hard-wrapped lines of each paragraph with single spaces and separates paragraphs
    with one newline.
    """
    lines = raw.split("\n")
    first = next((i for i, ln in enumerate(lines) if ln and not ln[0].isspace()), 0)
    text = "\n".join(lines[first:])
    text = _PRON.sub("", text)
    text = _SOURCE_TAG.sub("", text)
    text = _CODE.sub(_code_to_text, text)
    text = _BRACED.sub(lambda m: _SYLLABLE_MARKS.sub("", m.group(1)), text)
    text = text.replace("{", "").replace("}", "").replace("\\", "")
    paragraphs = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if para:
            paragraphs.append(para)
    return "\n".join(paragraphs)


@dataclass
class GcideRecords:
    """Parsed GCIDE: the raw entries of each headword, plus skip counts.

    Attributes:
        records: ``(headword, raw entry texts)`` in index order; :func:`entry_text`
            gives the record text (cleaning is left to the caller, which often needs
            only a few records).
        index_words: distinct index words read, case-insensitively (records_total).
        skipped: reason -> number of index words without a record of their own.
        bad_utf8: entries whose bytes were not UTF-8 (decoded with replacement).
    """

    records: List[Tuple[str, List[str]]]
    index_words: int
    skipped: Dict[str, int]
    bad_utf8: int


def load_gcide(directory: Path | None = None) -> GcideRecords:
    """Read the dictd index and data and build one record per headword.

    Index words are grouped case-insensitively (``Abject``/``abject`` -> one record
    under the first spelling in index order). A group's text is the entries whose head
    line names it, in index order; an entry already used by an earlier group is not
    repeated (so no text appears in two records, and the split cannot leak).

    Raises:
        FileNotFoundError: the package is not installed (see :func:`gcide_files`).
        ValueError: a malformed index row, or an offset beyond the data.
    """
    index_path, dict_path = gcide_files(directory)
    rows = read_index(index_path)
    data = read_dict(dict_path)
    heads: Dict[Tuple[int, int], frozenset] = {}
    raws: Dict[Tuple[int, int], str] = {}
    owner: Dict[Tuple[int, int], str] = {}     # entry -> folded word that uses it
    groups: Dict[str, Tuple[str, List[Tuple[int, int]]]] = {}  # fold -> (spelling, entries)
    reasons: Dict[str, str] = {}                # fold -> skip reason while it has no entry
    bad_utf8 = 0
    for word, offset, length in rows:
        folded = _fold(word)
        group = groups.setdefault(folded, (word, []))
        if _META_WORD.match(word):
            reasons[folded] = SKIP_META
            continue
        if offset + length > len(data):
            raise ValueError(f"{index_path}: entry {word!r} addresses bytes "
                             f"{offset}..{offset + length} but {dict_path} holds {len(data)}"
                             f" (mismatched files?)")
        key = (offset, length)
        if key not in heads:
            chunk = data[offset:offset + length]
            try:
                raw = chunk.decode("utf-8")
            except UnicodeDecodeError:
                raw = chunk.decode("utf-8", errors="replace")
                bad_utf8 += 1
            raws[key] = raw
            heads[key] = frozenset(head_words(raw))
        if folded not in heads[key]:
            reasons.setdefault(folded, SKIP_SUBENTRY)
        elif owner.setdefault(key, folded) != folded:
            reasons.setdefault(folded, SKIP_USED)
        elif key not in group[1]:
            group[1].append(key)
    records = []
    skipped: Dict[str, int] = {}
    for folded, (word, keys) in groups.items():
        if keys:
            records.append((word, [raws[k] for k in keys]))
        else:
            reason = reasons.get(folded, SKIP_EMPTY)
            skipped[reason] = skipped.get(reason, 0) + 1
    return GcideRecords(records, len(groups), skipped, bad_utf8)


def entry_text(raw_entries: List[str]) -> str:
    """The record text of a headword: its cleaned entries, separated by a blank line
    (empty when cleaning leaves nothing)."""
    return "\n\n".join(t for t in map(clean_entry, raw_entries) if t)
