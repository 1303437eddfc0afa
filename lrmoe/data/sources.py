"""Reading the data sources: Alpaca-format instruction files and plain-text documents.

Both readers return plain Python strings; tokenization and packing live elsewhere.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

#: The Stanford Alpaca prompt templates (github.com/tatsu-lab/stanford_alpaca, train.py).
PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

SKIP_NO_OUTPUT = "no output"
SKIP_NO_INSTRUCTION = "no instruction"
SKIP_EMPTY_DOC = "empty document"
SKIP_BINARY = "binary file (NUL bytes)"
#: A file whose first this many bytes hold a NUL byte is binary (git's heuristic).
BINARY_PROBE = 8192

#: File name suffixes read by ``text:FOLDER``.
TEXT_SUFFIXES = (".txt", ".md")


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca prompt for one record (the variant with ``### Input:`` when ``input``
    is not blank); the response text follows it directly."""
    if input.strip():
        return PROMPT_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


@dataclass
class InstructionRecord:
    """One instruction example.

    Attributes:
        key: identity used by the train/validation hash (headword, or the record's text).
        prompt: the formatted prompt (no loss on its tokens).
        response: the text the model learns (EOS is appended at tokenization).
    """

    key: str
    prompt: str
    response: str


@dataclass
class SourceRecords:
    """What a reader found.

    Attributes:
        records: usable records, in source order.
        total: records in the source (usable or not).
        skipped: reason -> count of records that are not usable.
        notes: remarks for the user (e.g. undecodable bytes that were replaced).
    """

    records: list
    total: int
    skipped: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def _field(obj: dict, name: str, path: Path, where: str) -> str:
    value = obj.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{path}, {where}: field {name!r} must be a string, got "
                         f"{type(value).__name__} ({str(value)[:60]!r})")
    return value


def _parse_json_objects(path: Path, text: str) -> List[Tuple[str, object]]:
    """``(where, object)`` for every record of a JSON list or of JSONL lines."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: "
                             f"{e.msg}. Expected a JSON list of objects or JSONL (one object"
                             f" per line) with instruction/input/output.") from None
        return [(f"record {i}", item) for i, item in enumerate(items, 1)]
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {lineno}: malformed JSON at column {e.colno}: "
                             f"{e.msg}. Expected a JSON list of objects or JSONL (one object"
                             f" per line) with instruction/input/output.") from None
    return out


def decode_text(raw: bytes) -> Tuple[str, bool]:
    """UTF-8 text of ``raw`` without a leading byte-order mark; bytes that are not UTF-8
    become U+FFFD. Returns ``(text, all bytes were UTF-8)``."""
    try:
        return raw.decode("utf-8-sig"), True
    except UnicodeDecodeError:
        return raw.decode("utf-8-sig", errors="replace"), False


def check_alpaca_path(path: Path) -> None:
    """Raises FileNotFoundError (naming ``path``) unless it is a file; a folder is named
    as such (``alpaca:`` reads one file, ``text:`` reads folders)."""
    if path.is_dir():
        raise FileNotFoundError(f"alpaca data {path} is a folder; alpaca:PATH takes one JSON "
                                f"list or JSONL file (text:PATH reads a folder of .txt/.md "
                                f"files)")
    if not path.is_file():
        raise FileNotFoundError(f"alpaca data file not found: {path}")


def read_alpaca(path: Path) -> SourceRecords:
    """Alpaca-format records from a JSON list or a JSONL file (UTF-8, a byte-order mark
    allowed; bytes that are not UTF-8 are replaced by U+FFFD and noted).

    Each record is an object with ``instruction`` (str), optional ``input`` (str) and
    ``output`` (str). Records without (or with blank) ``output`` are counted under
    ``"no output"``, those without instruction under ``"no instruction"``.

    Raises:
        FileNotFoundError: naming ``path`` when it does not exist or is a folder.
        ValueError: on malformed JSON (naming the file and line), a record that is not an
            object or has a non-string field (naming the file and record or line), or a
            file with no records at all.
    """
    check_alpaca_path(path)
    text, clean = decode_text(path.read_bytes())
    notes = [] if clean else [f"{path.name} had bytes that are not UTF-8, replaced by U+FFFD"]
    items = _parse_json_objects(path, text)
    if not items:
        raise ValueError(f"{path}: no records (the file is empty or an empty list); expected "
                         f"Alpaca records with instruction/input/output")
    records, skipped = [], {}
    for where, obj in items:
        if not isinstance(obj, dict):
            raise ValueError(f"{path}, {where}: expected a JSON object with instruction/input/"
                             f"output, got {type(obj).__name__}")
        instruction = _field(obj, "instruction", path, where)
        inp = _field(obj, "input", path, where)
        output = _field(obj, "output", path, where)
        reason = (SKIP_NO_OUTPUT if not output.strip() else
                  SKIP_NO_INSTRUCTION if not instruction.strip() else None)
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        key = json.dumps([instruction, inp, output])
        records.append(InstructionRecord(key, alpaca_prompt(instruction, inp), output))
    return SourceRecords(records, len(items), skipped, notes)


def text_files(path: Path) -> List[Path]:
    """The files of ``text:PATH``: the file itself, or every ``*.txt`` / ``*.md`` under a
    folder (recursive, sorted by relative path).

    Raises:
        FileNotFoundError: naming ``path`` when it does not exist.
        ValueError: a folder without any ``.txt``/``.md`` file.
    """
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"text data not found: {path} (give a file or a folder of "
                                f".txt/.md files)")
    files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix.lower()
                    in TEXT_SUFFIXES), key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise ValueError(f"{path}: the folder holds no .txt or .md files (searched "
                         f"recursively)")
    return files


def read_text_documents(path: Path) -> SourceRecords:
    """Documents ``(relative name, text)`` of ``text:PATH``; empty ones are counted under
    ``"empty document"``, binary files (a NUL byte in the first 8 KiB) are skipped and
    named in a note; bytes that are not UTF-8 are replaced (and noted).

    Raises:
        FileNotFoundError, ValueError: see :func:`text_files`.
    """
    files = text_files(path)
    docs, skipped, bad, binary = [], {}, [], []
    for f in files:
        raw = f.read_bytes()
        name = f.name if f == path else f.relative_to(path).as_posix()
        if b"\0" in raw[:BINARY_PROBE]:
            skipped[SKIP_BINARY] = skipped.get(SKIP_BINARY, 0) + 1
            binary.append(name)
            continue
        text, clean = decode_text(raw)
        if not clean:
            bad.append(f.name)
        if not text.strip():
            skipped[SKIP_EMPTY_DOC] = skipped.get(SKIP_EMPTY_DOC, 0) + 1
            continue
        docs.append((name, text))
    notes = [f"{len(bad)} file(s) had bytes that are not UTF-8, replaced by U+FFFD: "
             f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"] if bad else []
    if binary:
        notes.append(f"{len(binary)} binary file(s) skipped: {', '.join(binary[:5])}"
                     f"{' ...' if len(binary) > 5 else ''}")
    return SourceRecords(docs, len(files), skipped, notes)
