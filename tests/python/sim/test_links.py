"""Link files (lrmoe/sim/links.py), read by ``lrmoe sim --links`` and ``lrmoe bench a2a
--base-links``: a good file's figures as written, and every malformed one refused with
the file and the key named (no YAML or codec traceback, no silently truncated value).
"""
import pytest

from lrmoe.sim.links import Links

_SIDES = ("intra_node: {GBps: 370, latency_us: 10, source: here}\n"
          "inter_node: {GBps: 43, latency_us: 20}\n")


def _file(tmp_path, text):
    p = tmp_path / "links.yaml"
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    return p


def test_a_good_file_reads_as_written(tmp_path):
    # 8.0 is 8 GPUs; "1.5e3" without a dot in the mantissa: YAML 1.1 reads `1e3` as a
    # string, which the reader has always taken as the number it spells
    p = _file(tmp_path, "name: n\ngpus_per_node: 8.0\n"
              "intra_node: {GBps: 1e3, latency_us: 0.5, source: here}\n"
              "inter_node: {GBps: 43, latency_us: 20}\n")
    links = Links.from_file(str(p))
    assert links.gpus_per_node == 8 and isinstance(links.gpus_per_node, int)
    assert (links.intra_GBps, links.intra_latency_us, links.inter_GBps,
            links.inter_latency_us) == (1000.0, 0.5, 43.0, 20.0)
    assert links.name == "n" and links.sources["intra_node.source"] == "here"
    assert links.sources["inter_node.source"] == ""


@pytest.mark.parametrize("text, needle", [
    ("a: [\n", "not valid YAML at line 2"),
    ("gpus_per_node: 8\nintra_node: {GBps: 1\n", "not valid YAML at line"),
    ("", "must be a YAML mapping of gpus_per_node, intra_node and inter_node"),
    ("- 1\n- 2\n", "got a list"),
    ("just words\n", "got the single value 'just words'"),
    (b"gpus_per_node: 8\nname: \xff\n", "not a UTF-8 text file"),
    ("gpus_per_node: 8\n", "missing 'intra_node'"),
    ("gpus_per_node: 8\nintra_node: [1]\ninter_node: {GBps: 43, latency_us: 20}\n",
     "intra_node must be a mapping of GBps and latency_us"),
    (_SIDES, "missing 'gpus_per_node'"),
    ("gpus_per_node: 8\nintra_node: {GBps: 1}\ninter_node: {GBps: 43, latency_us: 20}\n",
     "missing 'intra_node.latency_us'"),
    ("gpus_per_node: 8\nintra_node: {GBps: fast, latency_us: 1}\n"
     "inter_node: {GBps: 43, latency_us: 20}\n", "intra_node.GBps must be a number, got 'fast'"),
    ("gpus_per_node: 8\nintra_node: {GBps: [1], latency_us: 1}\n"
     "inter_node: {GBps: 43, latency_us: 20}\n", "intra_node.GBps must be a number"),
    ("gpus_per_node: 8\nintra_node: {GBps: 370, latency_us: 10}\n"
     "inter_node: {GBps: .inf, latency_us: 20}\n",
     "inter_node.GBps (inter_GBps) must be a finite number > 0, got inf"),
    ("gpus_per_node: 8\nintra_node: {GBps: 370, latency_us: .nan}\n"
     "inter_node: {GBps: 43, latency_us: 20}\n", "intra_node.latency_us (intra_latency_us)"),
    ("gpus_per_node: 8\nintra_node: {GBps: 370, latency_us: 10}\n"
     "inter_node: {GBps: 43, latency_us: 0}\n", "must be a finite number > 0, got 0.0"),
    ("gpus_per_node: true\n" + _SIDES, "gpus_per_node must be a whole number of GPUs >= 1, "
     "got True"),
    ("gpus_per_node: 8.9\n" + _SIDES, "whole number of GPUs >= 1, got 8.9"),
    ("gpus_per_node: 0.5\n" + _SIDES, "whole number of GPUs >= 1, got 0.5"),
    ("gpus_per_node: 0\n" + _SIDES, "whole number of GPUs >= 1, got 0"),
    ("gpus_per_node: eight\n" + _SIDES, "gpus_per_node must be a number, got 'eight'")])
def test_malformed_files_name_the_file_and_the_key(tmp_path, text, needle):
    p = _file(tmp_path, text)
    with pytest.raises(ValueError) as err:
        Links.from_file(str(p))
    assert str(err.value).startswith(f"{p}: ") and needle in str(err.value), str(err.value)


def test_flag_names_the_option(tmp_path):
    p = _file(tmp_path, "a: [\n")
    with pytest.raises(ValueError, match=f"^--base-links {p}: not valid YAML"):
        Links.from_file(str(p), flag="--base-links")
    with pytest.raises(FileNotFoundError, match=f"^--links {tmp_path / 'no.yaml'}: no link"):
        Links.from_file(str(tmp_path / "no.yaml"), flag="--links")


def test_the_all_to_all_model_keys_read_as_written_and_default_to_off(tmp_path):
    """per_peer_us and chunks (csrc/sim/a2a.h): optional; absent they are 0 and 1 (one
    latency per link class, phases in sequence); present they are taken as written."""
    plain = Links.from_file(str(_file(tmp_path, "gpus_per_node: 8\n" + _SIDES)))
    assert (plain.per_peer_us, plain.chunks) == (0.0, 1)
    p = tmp_path / "b.yaml"
    p.write_text("gpus_per_node: 8\nper_peer_us: 2.5\nchunks: 4.0\n" + _SIDES)
    links = Links.from_file(str(p))
    assert (links.per_peer_us, links.chunks) == (2.5, 4) and isinstance(links.chunks, int)


@pytest.mark.parametrize("extra, needle", [
    ("per_peer_us: -1\n", "per_peer_us must be a finite number >= 0"),
    ("per_peer_us: .inf\n", "per_peer_us must be a finite number >= 0"),
    ("per_peer_us: fast\n", "per_peer_us must be a number"),
    ("chunks: 0\n", "chunks must be a whole number of chunks >= 1"),
    ("chunks: 2.5\n", "chunks must be a whole number of chunks >= 1"),
    ("chunks: true\n", "chunks must be a whole number of chunks >= 1"),
])
def test_a_bad_all_to_all_model_key_is_refused_naming_it(tmp_path, extra, needle):
    p = _file(tmp_path, "gpus_per_node: 8\n" + extra + _SIDES)
    with pytest.raises(ValueError, match=needle) as err:
        Links.from_file(str(p), flag="--links")
    assert str(err.value).startswith(f"--links {p}")


def test_overlap_chunks_reads_as_written_defaults_to_one_and_refuses_bad_values(tmp_path):
    """overlap_chunks (csrc/sim/sim.h): optional, 1 (the phases in sequence) when absent."""
    assert Links.from_file(str(_file(tmp_path, "gpus_per_node: 8\n" + _SIDES))
                           ).overlap_chunks == 1
    p = tmp_path / "o.yaml"
    p.write_text("gpus_per_node: 8\noverlap_chunks: 4\n" + _SIDES)
    assert Links.from_file(str(p)).overlap_chunks == 4
    for bad in ("0", "2.5", "true"):
        p.write_text(f"gpus_per_node: 8\noverlap_chunks: {bad}\n" + _SIDES)
        with pytest.raises(ValueError, match="overlap_chunks must be a whole number"):
            Links.from_file(str(p), flag="--links")


def test_tile_overlap_keys_read_as_written_default_off_and_refuse_bad_values(tmp_path):
    """overlap_tile_rows / overlap_comm_share (csrc/sim/sim.h LinkModel): optional; absent,
    no tile-level overlap and DeepEP's 20 of 132 SMs; bad values and both overlap models
    at once are refused naming the key."""
    base = Links.from_file(str(_file(tmp_path, "gpus_per_node: 8\n" + _SIDES)))
    assert (base.overlap_tile_rows, base.overlap_comm_share) == (0, 20 / 132)
    p = tmp_path / "t.yaml"
    p.write_text("gpus_per_node: 8\noverlap_tile_rows: 128\noverlap_comm_share: 0.25\n"
                 + _SIDES)
    got = Links.from_file(str(p))
    assert (got.overlap_tile_rows, got.overlap_comm_share) == (128, 0.25)
    for extra, needle in (("overlap_tile_rows: -1\n", "overlap_tile_rows must be"),
                          ("overlap_tile_rows: 2.5\n", "overlap_tile_rows must be"),
                          ("overlap_tile_rows: true\n", "overlap_tile_rows must be"),
                          ("overlap_comm_share: 1\n", "overlap_comm_share must be"),
                          ("overlap_comm_share: -0.1\n", "overlap_comm_share must be"),
                          ("overlap_tile_rows: 64\noverlap_chunks: 2\n", "two models")):
        p.write_text("gpus_per_node: 8\n" + extra + _SIDES)
        with pytest.raises(ValueError, match=needle) as err:
            Links.from_file(str(p), flag="--links")
        assert str(err.value).startswith(f"--links {p}")
