"""Tests of lrmoe.data: GCIDE (dictd) parsing, Alpaca/text sources, packing, caching,
batches.

GCIDE tests build small dictd files in tmp_path (index + gzip data, written here with an
independent base64 encoder) and point LRMOE_GCIDE_DIR at them; one test reads the real
/usr/share/dictd when the dict-gcide package is installed. Expected texts, prompts,
packing layouts and counts are written by hand.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import List, Sequence, Tuple

import pytest
import torch

import lrmoe.data as D
import lrmoe.data.tokenizer
from lrmoe.data import TokenBlocks, alpaca_prompt, batches, load_data, num_batches
from lrmoe.data import gcide as G
from lrmoe.data.packing import encode_texts, pack_examples, split_pieces

REAL_GCIDE = Path("/usr/share/dictd/gcide.index")
EOT = "<|endoftext|>"
PAD = "<|pad|>"


# ------------------------------------------------------------------ helpers
def b64(n: int) -> str:
    """dictd base64, written independently of the decoder under test."""
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = digits[n % 64]
    while n >= 64:
        n //= 64
        out = digits[n % 64] + out
    return out


def write_dictd(folder: Path, entries: Sequence[Tuple[Sequence[str], str]]) -> Path:
    """A dictd pair in ``folder``: each entry is (index words, raw text). The index is
    sorted like dictd's (case-insensitively)."""
    folder.mkdir(parents=True, exist_ok=True)
    data, rows = b"", []
    for words, text in entries:
        raw = text.encode("utf-8")
        for w in words:
            rows.append((w, len(data), len(raw)))
        data += raw
    rows.sort(key=lambda r: (r[0].lower(), r[1]))
    (folder / "gcide.index").write_text(
        "".join(f"{w}\t{b64(o)}\t{b64(n)}\n" for w, o, n in rows), encoding="utf-8")
    with gzip.open(folder / "gcide.dict.dz", "wb") as f:
        f.write(data)
    return folder


APPLE = ('Apple \\Ap"ple\\, n. [AS. [ae]ppel.]\n'
         '   1. The fleshy fruit of a {rosaceous} tree.\n'
         '      [1913 Webster]\n'
         '\n'
         '   {Apple of the eye}, the pupil.\n'
         '      [1913 Webster]\n')
APPLE_TEXT = ("Apple, n. [AS. æppel.] 1. The fleshy fruit of a rosaceous tree.\n"
              "Apple of the eye, the pupil.")
COCK_N = 'Cock \\Cock\\, n.\n   The male of birds.\n   [1913 Webster]\n'
COCK_V = 'Cock \\Cock\\, v. t.\n   To set erect.\n   [1913 Webster]\n'
CAFE = "Caf['e] \\Caf`['e]\\, n.\n   A coffee house.\n   [Webster 1913 Suppl.]\n"
META = "00-database-info\n   This file was converted from the original database.\n"


def synthetic_entries(n_words: int = 0) -> List[Tuple[List[str], str]]:
    entries = [(["00-database-info", "00-database-short"], META),
               (["Apple", "Apple of the eye"], APPLE),
               (["Cock"], COCK_N), (["Cock", "cock"], COCK_V), (["Cafe"], CAFE)]
    for i in range(n_words):
        w = f"Testword{i:04d}"
        entries.append(([w], f"{w} \\Test*word\\, n.\n   Definition number {i} of a "
                             f"made-up word, with\n   some more words.\n   [PJC]\n"))
    return entries


@pytest.fixture
def dictd(tmp_path, monkeypatch):
    folder = write_dictd(tmp_path / "dictd", synthetic_entries(300))
    monkeypatch.setenv("LRMOE_GCIDE_DIR", str(folder))
    return folder


def examples_of(tok, blocks: TokenBlocks, pad_id: int) -> List[Tuple[str, str]]:
    """(unlabelled text, labelled text) of every example in ``blocks``; checks that
    labels equal the ids wherever set and that padding only ends a block."""
    out = []
    for ids, lab in zip(blocks.input_ids.tolist(), blocks.labels.tolist()):
        cur: List[Tuple[int, int]] = []
        for t, l in zip(ids, lab):
            assert l == -100 or l == t
            cur.append((t, l))
            if l != -100 and tok.id_to_token(t) == EOT:
                out.append(cur)
                cur = []
        if cur:  # padding (or a truncated example) ends the block
            if all(t == pad_id and l == -100 for t, l in cur):
                continue
            first_pad = next((i for i, (t, l) in enumerate(cur) if t == pad_id), len(cur))
            assert all(t == pad_id and l == -100 for t, l in cur[first_pad:])
            out.append(cur[:first_pad])
    dec = lambda xs: tok.decode(xs, skip_special_tokens=False)  # noqa: E731
    return [(dec([t for t, l in ex if l == -100]), dec([t for t, l in ex if l != -100]))
            for ex in out]


def words_in(tok, blocks: TokenBlocks) -> List[str]:
    text = "".join(tok.decode(r, skip_special_tokens=False) for r in blocks.input_ids.tolist())
    return re.findall(r"### Instruction:\nDefine (.+?)\.\n", text)


# ------------------------------------------------------------------ dictd base64 + GCIDE text
def test_decode_b64_hand_values():
    assert G.decode_b64("A") == 0
    assert G.decode_b64("B") == 1
    assert G.decode_b64("/") == 63
    assert G.decode_b64("BA") == 64
    assert G.decode_b64("5I") == 57 * 64 + 8 == 3656     # the real index's "0" entry
    assert G.decode_b64("+8") == 62 * 64 + 60 == 4028
    assert G.decode_b64("BNy") == 1 * 4096 + 13 * 64 + 50
    for n in (0, 1, 63, 64, 4095, 4096, 123456789):
        assert G.decode_b64(b64(n)) == n
    with pytest.raises(ValueError, match="invalid dictd base64 digit '='"):
        G.decode_b64("AB=")
    with pytest.raises(ValueError, match="empty"):
        G.decode_b64("")


def test_gcide_record_text_and_counts(dictd):
    g = G.load_gcide()
    recs = {w: G.entry_text(r) for w, r in g.records}
    assert recs["Apple"] == APPLE_TEXT
    # Two entries of one headword (and a case variant of it) -> one record, index order.
    assert recs["Cock"] == "Cock, n. The male of birds.\n\nCock, v. t. To set erect."
    assert "cock" not in recs
    assert recs["Cafe"] == "Café, n. A coffee house."
    assert len(g.records) == 3 + 300
    # 00-database-info/-short; "Apple of the eye" lives inside Apple's entry.
    assert g.index_words == 2 + 1 + 1 + 1 + 1 + 300
    assert g.skipped == {G.SKIP_META: 2, G.SKIP_SUBENTRY: 1}


def test_clean_entry_markup_by_hand():
    raw = ('\n   a stray quotation line. --Locke.\n'
           'Run \\Run\\ (r[u^]n), v. i. [imp. {Ran} (r[a^]n); p. pr. {Run"ning}.]\n'
           '   To move  swiftly;\n   to flee. See {Amp[`e]re\'s law}.\n'
           '   [1913 Webster +PJC]\n\n   Syn: hasten.\n')
    assert G.clean_entry(raw) == ("Run, v. i. [imp. Ran (răn); p. pr. Running.] To move "
                                  "swiftly; to flee. See Ampère's law.\nSyn: hasten.")


def test_missing_gcide_says_what_to_install(tmp_path, monkeypatch):
    empty = tmp_path / "nothing"
    empty.mkdir()
    monkeypatch.setenv("LRMOE_GCIDE_DIR", str(empty))
    with pytest.raises(FileNotFoundError) as e:
        load_data("gcide", seq_len=64, cache_dir=tmp_path / "cache")
    assert "apt-get install dict-gcide" in str(e.value)
    assert str(empty / "gcide.index") in str(e.value)


# ------------------------------------------------------------------ GCIDE through load_data
def test_gcide_load_split_deterministic_and_stable(dictd, tmp_path):
    kw = dict(seq_len=128, vocab_size=1000, val_fraction=0.2)
    a = load_data("gcide", cache_dir=tmp_path / "c1", **kw)
    b = load_data("gcide", cache_dir=tmp_path / "c2", **kw)  # fresh cache: recomputed
    assert torch.equal(a.train.input_ids, b.train.input_ids)
    assert torch.equal(a.val.labels, b.val.labels)
    tr, va = words_in(a.tokenizer, a.train), words_in(a.tokenizer, a.val)
    assert sorted(tr + va) == sorted(["Apple", "Cock", "Cafe"]
                                     + [f"Testword{i:04d}" for i in range(300)])
    assert 30 <= len(va) <= 90  # 20% of 303, hash split
    r = a.report
    assert (r.records_total, r.records_used) == (306, 303)
    assert r.records_used + sum(r.skipped.values()) == r.records_total
    assert (r.train_blocks, r.val_blocks) == (len(a.train), len(a.val))
    # max_records: a hash-order prefix; a record's side never depends on it.
    small = load_data("gcide", cache_dir=tmp_path / "c3", max_records=100, **kw)
    s_tr, s_va = words_in(small.tokenizer, small.train), words_in(small.tokenizer, small.val)
    assert len(s_tr) + len(s_va) == 100
    assert set(s_tr) <= set(tr) and set(s_va) <= set(va)
    assert small.report.skipped[D.SKIP_OVER_MAX] == 203
    # Another seed salts the hashes: another split.
    other = load_data("gcide", cache_dir=tmp_path / "c4", seed=1, **kw)
    assert set(words_in(other.tokenizer, other.val)) != set(va)


def test_gcide_examples_prompt_and_labels(dictd, tmp_path):
    d = load_data("gcide", seq_len=160, cache_dir=tmp_path / "c", vocab_size=400,
                  val_fraction=0.0)
    assert len(d.val) == 0 and d.val.input_ids.shape == (0, 160)
    exs = examples_of(d.tokenizer, d.train, d.pad_id)
    by_word = {re.search(r"Define (.+?)\.", p).group(1): (p, r) for p, r in exs}
    prompt = ("Below is an instruction that describes a task. Write a response that "
              "appropriately completes the request.\n\n### Instruction:\nDefine Apple.\n\n"
              "### Response:\n")
    assert by_word["Apple"] == (prompt, APPLE_TEXT + EOT)
    assert d.report.truncated == 0 and len(exs) == 303
    assert d.train.num_loss_tokens() == sum(len(d.tokenizer.encode(r).ids) for _, r in exs)


@pytest.mark.skipif(not REAL_GCIDE.is_file(), reason="dict-gcide is not installed "
                    "(/usr/share/dictd/gcide.index missing; apt-get install dict-gcide)")
def test_real_gcide(tmp_path, monkeypatch):
    monkeypatch.delenv("LRMOE_GCIDE_DIR", raising=False)
    index, data_path = G.gcide_files()
    rows = G.read_index(index)
    assert len(rows) > 100_000
    data = G.read_dict(data_path)
    assert 20e6 < len(data) < 100e6
    o, n = next((o, n) for w, o, n in rows if w == "Pieman")
    assert G.clean_entry(data[o:o + n].decode()) == \
        "Pieman, n.; pl. Piemen. A man who makes or sells pies."
    d = load_data("gcide", seq_len=128, cache_dir=tmp_path / "c", max_records=2000,
                  vocab_size=1024)
    r = d.report
    assert r.records_used + sum(r.skipped.values()) == r.records_total > 150_000
    assert r.records_used == 2000 - r.skipped.get(G.SKIP_EMPTY, 0)
    assert 10 <= len(words_in(d.tokenizer, d.val)) <= 80
    assert r.truncated > 0 and r.train_tokens > 100_000
    assert d.vocab_size == 1024 and d.train.input_ids.max() < 1024


# ------------------------------------------------------------------ Alpaca
def test_prompt_template_exact():
    assert alpaca_prompt("Say hi.") == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nSay hi.\n\n### Response:\n")
    assert alpaca_prompt("Translate.", "chat") == (
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nTranslate.\n\n### Input:\nchat\n\n### Response:\n")
    assert alpaca_prompt("Say hi.", "  ") == alpaca_prompt("Say hi.")


ALPACA = [
    {"instruction": "Give a color.", "input": "", "output": "Blue."},
    {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a fruit.", "output": "Apple."},                # no "input" key
    {"instruction": "Say nothing.", "input": "", "output": ""},          # no output
    {"instruction": "Also nothing.", "input": ""},                       # no output
    {"input": "x", "output": "orphan"},                                  # no instruction
]
ALPACA_OK = [ALPACA[i] for i in range(4)]


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_alpaca_parsing_labels_and_counts(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(ALPACA, indent=2))
    else:
        path.write_text("\n".join(json.dumps(r) for r in ALPACA) + "\n\n")
    d = load_data(f"alpaca:{path}", seq_len=128, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.0)
    r = d.report
    assert (r.records_total, r.records_used) == (7, 4)
    assert r.skipped == {"no output": 2, "no instruction": 1}
    assert r.truncated == 0 and r.val_blocks == 0
    expected = sorted((alpaca_prompt(x["instruction"], x.get("input", "")),
                       x["output"] + EOT) for x in ALPACA_OK)
    assert sorted(examples_of(d.tokenizer, d.train, d.pad_id)) == expected
    assert r.train_tokens == int((d.train.input_ids != d.pad_id).sum())
    assert r.train_tokens == sum(len(d.tokenizer.encode(p + q[:-len(EOT)]).ids) + 1
                                 for p, q in expected)


def test_alpaca_split_by_record(tmp_path):
    recs = [{"instruction": f"Count to {i}.", "input": "", "output": " ".join(map(str, range(i)))}
            for i in range(1, 61)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(recs))
    d = load_data(f"alpaca:{path}", seq_len=256, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.25)
    tr = examples_of(d.tokenizer, d.train, d.pad_id)
    va = examples_of(d.tokenizer, d.val, d.pad_id)
    assert len(tr) + len(va) == 60 and 5 <= len(va) <= 25
    assert not {p for p, _ in tr} & {p for p, _ in va}
    # Reordering the file does not move any record to the other side.
    path.write_text(json.dumps(recs[::-1]))
    d2 = load_data(f"alpaca:{path}", seq_len=256, cache_dir=tmp_path / "c2", vocab_size=1000,
                   val_fraction=0.25)
    assert sorted(p for p, _ in examples_of(d2.tokenizer, d2.val, d2.pad_id)) == \
        sorted(p for p, _ in va)


def test_alpaca_overlong_records_are_reported(tmp_path):
    long_out = " ".join(f"word{i}" for i in range(400))
    recs = [{"instruction": "Be long.", "input": "", "output": long_out},
            {"instruction": "Too long " + "very " * 300, "input": "", "output": "x"},
            {"instruction": "Be short.", "input": "", "output": "Ok."}]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(map(json.dumps, recs)))
    d = load_data(f"alpaca:{path}", seq_len=64, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.0)
    r = d.report
    assert r.truncated == 1
    assert r.skipped == {"prompt alone fills seq_len": 1}
    assert (r.records_total, r.records_used) == (3, 2)
    exs = examples_of(d.tokenizer, d.train, d.pad_id)
    assert len(exs) == 2
    cut = next(x for x in exs if "Be long" in x[0])
    assert not cut[1].endswith(EOT) and long_out.startswith(cut[1])   # response cut, no EOS
    full_block = next(i for i in range(len(d.train)) if "Be long" in
                      d.tokenizer.decode(d.train.input_ids[i].tolist()))
    assert (d.train.input_ids[full_block] != d.pad_id).all()           # fills its block


def test_alpaca_malformed_and_empty(tmp_path):
    bad_list = tmp_path / "bad.json"
    bad_list.write_text('[\n {"instruction": "a", "output": "b"},\n {"instruction": "c",,}\n]')
    with pytest.raises(ValueError, match=r"bad\.json: malformed JSON at line 3"):
        load_data(f"alpaca:{bad_list}", seq_len=64, cache_dir=tmp_path / "c")
    bad_lines = tmp_path / "bad.jsonl"
    bad_lines.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "c", '
                         '"output": "d"}\n{"instruction": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 4: malformed JSON"):
        load_data(f"alpaca:{bad_lines}", seq_len=64, cache_dir=tmp_path / "c")
    not_obj = tmp_path / "notobj.json"
    not_obj.write_text('[{"instruction": "a", "output": "b"}, "just a string"]')
    with pytest.raises(ValueError, match=r"notobj\.json, record 2: expected a JSON object"):
        load_data(f"alpaca:{not_obj}", seq_len=64, cache_dir=tmp_path / "c")
    bad_type = tmp_path / "badtype.jsonl"
    bad_type.write_text('{"instruction": "a", "output": ["b"]}\n')
    with pytest.raises(ValueError, match=r"badtype\.jsonl, line 1: field 'output' must be"):
        load_data(f"alpaca:{bad_type}", seq_len=64, cache_dir=tmp_path / "c")
    no_output = tmp_path / "noout.json"
    no_output.write_text(json.dumps([{"instruction": "a", "output": " "},
                                     {"instruction": "b"}]))
    with pytest.raises(ValueError, match=r"noout\.json: no usable records \(2 read: 2 no "
                                         r"output\)"):
        load_data(f"alpaca:{no_output}", seq_len=64, cache_dir=tmp_path / "c")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no records"):
        load_data(f"alpaca:{empty}", seq_len=64, cache_dir=tmp_path / "c")
    with pytest.raises(FileNotFoundError, match=r"alpaca data file not found: .*missing\.json"):
        load_data(f"alpaca:{tmp_path / 'missing.json'}", seq_len=64, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="unknown data spec 'wiki'"):
        load_data("wiki", seq_len=64, cache_dir=tmp_path / "c")


def test_alpaca_bom_non_utf8_and_folder(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in ALPACA_OK).encode())
    d = load_data(f"alpaca:{bom}", seq_len=128, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.0)
    assert d.report.records_used == 4
    bom_list = tmp_path / "bom.json"
    bom_list.write_bytes(b"\xef\xbb\xbf" + json.dumps(ALPACA_OK).encode())
    assert load_data(f"alpaca:{bom_list}", seq_len=128, cache_dir=tmp_path / "c",
                     vocab_size=1000, val_fraction=0.0).report.records_used == 4
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"instruction": "Say caf\u00e9.", "output": "caf\u00e9"},
                                  ensure_ascii=False).encode("latin-1") + b"\n")
    d = load_data(f"alpaca:{latin1}", seq_len=128, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.0)
    assert any("latin1.jsonl had bytes that are not UTF-8" in n for n in d.report.notes)
    with pytest.raises(FileNotFoundError, match=r"is a folder; alpaca:PATH takes one JSON"):
        load_data(f"alpaca:{tmp_path}", seq_len=128, cache_dir=tmp_path / "c")


def test_text_folder_skips_binary_files(tmp_path):
    root = tmp_path / "corpus"
    _write(root / "a.txt", "plain words in a file\n" * 5)
    _write(root / "b.md", "more plain words\n" * 5)
    (root / "blob.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    d = load_data(f"text:{root}", seq_len=32, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.3)
    r = d.report
    assert (r.records_total, r.records_used) == (3, 2)
    assert r.skipped == {"binary file (NUL bytes)": 1}
    assert any("1 binary file(s) skipped: blob.txt" in n for n in r.notes)


# ------------------------------------------------------------------ packing
def test_pack_examples_hand_layout():
    # seq_len 8; EOS 9, pad 0. Lengths with EOS: 4, 5, 3, 8 (truncated from 11), skip, 2.
    prompts = [[1, 2], [3], [4], [5, 5], [6] * 8, [7]]
    responses = [[11], [12, 13, 14], [15], [16] * 9, [17], []]
    p = pack_examples(prompts, responses, seq_len=8, eos_id=9, pad_id=0)
    H = -100
    assert p.input_ids_NS.tolist() == [
        [1, 2, 11, 9, 4, 15, 9, 0],     # ex 0, then ex 2 fills the gap left by ex 1
        [3, 12, 13, 14, 9, 7, 9, 0],    # ex 1, ex 5
        [5, 5, 16, 16, 16, 16, 16, 16]]  # ex 3 cut to 8, no EOS
    assert p.labels_NS.tolist() == [
        [H, H, 11, 9, H, 15, 9, H],
        [H, 12, 13, 14, 9, H, 9, H],
        [H, H, 16, 16, 16, 16, 16, 16]]
    assert (p.truncated, p.too_long, p.examples, p.tokens) == (1, 1, 5, 4 + 5 + 3 + 8 + 2)
    assert p.input_ids_NS.dtype == torch.int64 and p.labels_NS.dtype == torch.int64
    assert p.segment_ids_NS.tolist() == [   # k-th example of its block, 0 = padding
        [1, 1, 1, 1, 2, 2, 2, 0],
        [1, 1, 1, 1, 1, 2, 2, 0],
        [1, 1, 1, 1, 1, 1, 1, 1]]


def test_segment_ids_survive_the_cache_and_streams_are_one_segment(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(ALPACA_OK))
    kw = dict(seq_len=128, cache_dir=tmp_path / "c", vocab_size=1000, val_fraction=0.0)
    first = load_data(f"alpaca:{path}", **kw)
    again = load_data(f"alpaca:{path}", **kw)
    assert any("data: cached" in n for n in again.report.notes)
    assert torch.equal(first.train.segment_ids, again.train.segment_ids)
    seg = again.train.segment_ids
    assert torch.equal(seg != 0, again.train.input_ids != again.pad_id)
    assert sum(int(row.max()) for row in seg) == 4  # the 4 examples, numbered per block
    text = _write(tmp_path / "t.txt", "one two three four five six seven\n" * 20)
    d = load_data(f"text:{text}", seq_len=32, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.0)
    real = d.train.input_ids != d.pad_id
    assert torch.equal(d.train.segment_ids, real.to(torch.int32))


def test_packing_never_splits_an_example(tmp_path):
    recs = [{"instruction": f"Repeat {i}.", "input": "", "output": ("ab " * (i % 23)).strip()
             or "none"} for i in range(120)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(recs))
    d = load_data(f"alpaca:{path}", seq_len=64, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.0)
    assert d.report.truncated == 0
    for row, lab in zip(d.train.input_ids.tolist(), d.train.labels.tolist()):
        text = d.tokenizer.decode(row, skip_special_tokens=False)
        assert text.startswith("Below is an instruction")            # block starts an example
        body = text.replace(PAD, "")
        assert body.endswith(EOT)                                    # ... and ends one
        assert all(seg.startswith("Below is an instruction") for seg in body.split(EOT)[:-1])
    assert len(examples_of(d.tokenizer, d.train, d.pad_id)) == 120


def test_encode_in_pieces_equals_one_shot(tmp_path):
    text = "".join(f"Line {i}:  some words, numbers {i * 7} and\tspaces.\n"
                   + ("\n" if i % 5 == 0 else "") for i in range(3000))
    pieces = split_pieces(text, piece_chars=1000)
    assert len(pieces) > 50 and "".join(pieces) == text
    d = load_data(f"text:{_write(tmp_path / 'one.txt', text)}", seq_len=64,
                  cache_dir=tmp_path / "c", vocab_size=1000, val_fraction=0.0)
    (got,) = encode_texts(d.tokenizer, [text], piece_chars=1000)
    assert got.tolist() == d.tokenizer.encode(text, add_special_tokens=False).ids


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------ text:PATH
def test_text_folder_packing(tmp_path):
    root = tmp_path / "corpus"
    docs = {f"d{i:02d}.txt": f"Document {i} says: " + " ".join(["alpha beta gamma"] * (i + 3))
            + "\n" for i in range(12)}
    docs["sub/notes.md"] = "# Notes\nMarkdown is read too.\n"
    for name, text in docs.items():
        _write(root / name, text)
    _write(root / "empty.txt", "  \n")
    _write(root / "skip.json", '{"not": "text"}')
    d = load_data(f"text:{root}", seq_len=32, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.25)
    r = d.report
    assert (r.records_total, r.records_used, r.skipped) == (14, 13, {"empty document": 1})
    for blocks in (d.train, d.val):
        real = blocks.input_ids != d.pad_id
        assert torch.equal(blocks.labels[real], blocks.input_ids[real])  # labels = ids
        assert (blocks.labels[~real] == -100).all()
        assert not (real[:-1] == False).any()  # noqa: E712  only the last block pads
    dec = lambda b: d.tokenizer.decode(b.input_ids.flatten().tolist(),  # noqa: E731
                                      skip_special_tokens=False).replace(PAD, "")
    tr_docs, va_docs = dec(d.train).split(EOT)[:-1], dec(d.val).split(EOT)[:-1]
    assert sorted(tr_docs + va_docs) == sorted(docs.values())         # whole docs, once
    assert tr_docs == sorted(tr_docs, key=lambda t: [k for k, v in docs.items() if v == t][0])
    assert 1 <= len(va_docs) <= 7
    assert r.train_tokens + r.val_tokens == int((d.train.input_ids != d.pad_id).sum()
                                                + (d.val.input_ids != d.pad_id).sum())


def test_text_single_file_tail_split(tmp_path):
    lines = [f"This is line number {i:03d} of the one file.\n" for i in range(200)]  # equal

    path = _write(tmp_path / "book.txt", "".join(lines))
    d = load_data(f"text:{path}", seq_len=40, cache_dir=tmp_path / "c", vocab_size=1000,
                  val_fraction=0.1)
    dec = lambda b: d.tokenizer.decode(b.input_ids.flatten().tolist(),  # noqa: E731
                                      skip_special_tokens=False).replace(PAD, "")
    assert dec(d.train) == "".join(lines[:180]) + EOT
    assert dec(d.val) == "".join(lines[180:]) + EOT
    assert any("last 10.0%" in n for n in d.report.notes)


def test_text_missing_and_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"text data not found: .*nope"):
        load_data(f"text:{tmp_path / 'nope'}", seq_len=32, cache_dir=tmp_path / "c")
    (tmp_path / "bare").mkdir()
    _write(tmp_path / "bare" / "x.csv", "a,b\n")
    with pytest.raises(ValueError, match=r"bare: the folder holds no \.txt or \.md files"):
        load_data(f"text:{tmp_path / 'bare'}", seq_len=32, cache_dir=tmp_path / "c")
    _write(tmp_path / "blank" / "a.txt", "\n\n")
    with pytest.raises(ValueError, match=r"no usable records \(1 read: 1 empty document\)"):
        load_data(f"text:{tmp_path / 'blank'}", seq_len=32, cache_dir=tmp_path / "c")


# ------------------------------------------------------------------ tokenizer + caches
def test_tokenizer_and_data_are_cached(dictd, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    kw = dict(seq_len=64, cache_dir=cache, vocab_size=1000, val_fraction=0.1)
    first = load_data("gcide", **kw)
    assert first.tokenizer_path.parent == cache and first.tokenizer_path.is_file()
    assert first.tokenizer.id_to_token(first.eos_id) == EOT
    assert first.tokenizer.id_to_token(first.pad_id) == PAD
    assert first.vocab_size == first.tokenizer.get_vocab_size() <= 1000
    mtime = first.tokenizer_path.stat().st_mtime_ns
    calls = []

    def no_training(*a, **k):
        calls.append(1)
        raise AssertionError("BPE retrained although it is cached")

    def no_parsing(*a, **k):
        raise AssertionError("GCIDE parsed again although the blocks are cached")
    with monkeypatch.context() as m:
        m.setattr(lrmoe.data.tokenizer, "train_bpe", no_training)
        m.setattr(G, "load_gcide", no_parsing)
        second = load_data("gcide", **kw)
    assert not calls and second.tokenizer_path.stat().st_mtime_ns == mtime
    assert torch.equal(first.train.input_ids, second.train.input_ids)
    assert torch.equal(first.train.labels, second.train.labels)
    assert torch.equal(first.val.labels, second.val.labels)
    assert second.report.lines()[:4] == first.report.lines()[:4]
    assert any(n.startswith("data: cached") for n in second.report.notes)
    # Another seq_len re-packs (parsing again) but keeps the tokenizer.
    with monkeypatch.context() as m:
        m.setattr(lrmoe.data.tokenizer, "train_bpe", no_training)
        third = load_data("gcide", **{**kw, "seq_len": 96})
    assert third.train.input_ids.shape[1] == 96 and third.tokenizer_path == first.tokenizer_path
    assert not list(cache.glob("*.tmp"))


def test_interrupted_cache_write_leaves_no_file(dictd, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def crash(obj, f, *a, **k):
        Path(f).write_bytes(b"half")
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(torch, "save", crash)
        with pytest.raises(KeyboardInterrupt):
            load_data("gcide", seq_len=64, cache_dir=cache, vocab_size=1000)
    assert not list(cache.glob("data-*")) and not list(cache.glob("*.tmp"))
    d = load_data("gcide", seq_len=64, cache_dir=cache, vocab_size=1000)
    assert len(d.train) > 0
    # A damaged cache file (not ours to write, e.g. a full disk) is rebuilt, not trusted.
    (data_file,) = cache.glob("data-*.pt")
    data_file.write_bytes(b"garbage")
    again = load_data("gcide", seq_len=64, cache_dir=cache, vocab_size=1000)
    assert any("unreadable" in n for n in again.report.notes)
    assert torch.equal(again.train.labels, d.train.labels)


def test_user_tokenizer(dictd, tmp_path):
    from tokenizers import Tokenizer, models
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}  # characters, no merges
    vocab.update({"\n": len(vocab), "<unk>": len(vocab) + 1, "</s>": len(vocab) + 2})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    d = load_data("gcide", seq_len=512, cache_dir=tmp_path / "c", tokenizer=str(path))
    assert d.tokenizer_path == path.resolve()
    assert d.eos_id == d.pad_id == vocab["</s>"]       # no pad token: pad = eos
    assert d.vocab_size == len(vocab)
    assert not list((tmp_path / "c").glob("tokenizer-*"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer file not found: .*absent\.json"):
        load_data("gcide", seq_len=64, cache_dir=tmp_path / "c",
                  tokenizer=str(tmp_path / "absent.json"))


def test_bad_arguments(dictd, tmp_path):
    with pytest.raises(ValueError, match="seq_len must be an int >= 8"):
        load_data("gcide", seq_len=4, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        load_data("gcide", seq_len=64, cache_dir=tmp_path, val_fraction=1.0)
    with pytest.raises(ValueError, match="max_records must be >= 1"):
        load_data("gcide", seq_len=64, cache_dir=tmp_path, max_records=0)
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        load_data("gcide", seq_len=64, cache_dir=tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="lacks a path"):
        load_data("alpaca:", seq_len=64, cache_dir=tmp_path)


# ------------------------------------------------------------------ batches
def _blocks(n: int, s: int = 5) -> TokenBlocks:
    ids = torch.arange(n * s, dtype=torch.int64).reshape(n, s)
    return TokenBlocks(ids, ids.clone())


def test_batches_deterministic_and_resumable():
    blocks = _blocks(23)
    assert num_batches(blocks, 4) == 6
    full = list(batches(blocks, 4, seed=3, epoch=1))
    again = list(batches(blocks, 4, seed=3, epoch=1))
    assert [p for p, _, _ in full] == list(range(6))
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(full, again))
    assert [x.shape[0] for _, x, _ in full] == [4, 4, 4, 4, 4, 3]
    order = torch.cat([x[:, 0] // 5 for _, x, _ in full])
    assert sorted(order.tolist()) == list(range(23))                # each block once
    assert order.tolist() != list(range(23))                        # shuffled
    for k in (0, 1, 4, 5, 6):
        tail = list(batches(blocks, 4, seed=3, epoch=1, start=k))
        assert [p for p, _, _ in tail] == list(range(k, 6))
        assert all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
                   for a, b in zip(tail, full[k:]))
    other_epoch = torch.cat([x[:, 0] for _, x, _ in batches(blocks, 4, seed=3, epoch=2)])
    other_seed = torch.cat([x[:, 0] for _, x, _ in batches(blocks, 4, seed=4, epoch=1)])
    assert not torch.equal(other_epoch, order * 5) and not torch.equal(other_seed, order * 5)
    with pytest.raises(ValueError, match=r"start must be in \[0, 6\]"):
        next(batches(blocks, 4, seed=3, epoch=1, start=7))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(batches(blocks, 0, seed=3, epoch=1))
    assert list(batches(_blocks(0), 4, seed=0, epoch=0)) == []


def test_token_blocks_counts():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    labels = torch.tensor([[-100, 6, 7, -100], [-100, -100, -100, -100]])
    tb = TokenBlocks(ids, labels)
    assert len(tb) == 2 and tb.num_loss_tokens() == 2
    rep = D.DataReport("x", 3, 2, {"no output": 1}, 0, 2, 0, 5, 0)
    assert rep.lines()[0] == "data: x: 3 records, 2 used"
    assert rep.lines()[1] == "  not used: 1 no output"
