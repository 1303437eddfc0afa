"""``lrmoe bench a2a``: the link fit against hand-computed lines, and the torchrun run on
loopback gloo (W = 2) writing a link file that ``lrmoe sim`` reads.
"""
import json
from pathlib import Path

import pytest
import yaml

from test_expert_parallel import _torchrun  # noqa: E402

from lrmoe.bench.a2a import fit_link  # noqa: E402
from lrmoe.sim.links import Links  # noqa: E402


def test_fit_recovers_an_exact_line():
    """ms = 0.025 + b / 200e6: latency 25 us, 200 GB/s (by hand: 1 MB takes 5 us)."""
    sizes = [4096, 65536, 1 << 20, 16 << 20, 64 << 20]
    ms = [0.025 + b / 200e6 for b in sizes]
    lat, gbps = fit_link(sizes, ms)
    assert lat == pytest.approx(25.0, rel=1e-9) and gbps == pytest.approx(200.0, rel=1e-9)


def test_fit_weighs_relative_residuals():
    """Noisy times: the fit is the least-squares solution of the relative residuals,
    checked against numpy's lstsq on the rows scaled by 1/t (an independent solver)."""
    import numpy as np

    b = np.array([4096.0, 65536.0, 1 << 20, 16 << 20, 64 << 20])
    t = (0.02 + b / 150e6) * np.array([1.08, 0.95, 1.03, 0.97, 1.05])
    A = np.stack([np.ones_like(b), b], 1) / t[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(A, np.ones_like(b), rcond=None)
    lat, gbps = fit_link(b.tolist(), t.tolist())
    assert lat == pytest.approx(intercept * 1e3, rel=1e-9)
    assert gbps == pytest.approx(1 / (slope * 1e6), rel=1e-9)
    # an unweighted fit would give another intercept: the weighting is what is tested
    (u_intercept, _), *_ = np.linalg.lstsq(np.stack([np.ones_like(b), b], 1), t, rcond=None)
    assert abs(u_intercept * 1e3 - lat) > 0.05 * lat


def test_fit_negative_intercept_goes_through_the_origin():
    """Times that extrapolate below zero: latency 0, bandwidth from the weighted fit
    through the origin (sum w b t / sum w b^2 with w = 1/t^2, by hand below)."""
    b, t = [1e6, 2e6, 4e6], [0.001, 0.003, 0.007]
    lat, gbps = fit_link(b, t)
    w = [1 / x ** 2 for x in t]
    slope = sum(wi * bi * ti for wi, bi, ti in zip(w, b, t)) / sum(
        wi * bi * bi for wi, bi in zip(w, b))
    assert lat == 0.0 and gbps == pytest.approx(1 / (slope * 1e6), rel=1e-12)


@pytest.mark.parametrize("b, t, match", [
    ([1e6], [1.0], "two distinct sizes"),
    ([1e6, 1e6], [1.0, 2.0], "two distinct sizes"),
    ([1e6, 2e6], [1.0], "2 sizes but 1 times"),
    ([1e6, 2e6], [1.0, 0.0], "must be > 0"),
    ([1e6, 2e6], [2.0, 1.0], "do not grow with the message size")])
def test_fit_refuses_what_it_cannot_fit(b, t, match):
    with pytest.raises(ValueError, match=match):
        fit_link(b, t)


def test_torchrun_gloo_writes_a_link_file_the_simulator_reads(tmp_path):
    out = tmp_path / "a2a"
    r = _torchrun(["--device", "cpu", "--sizes-kib", "1", "256", "4096", "--iters", "3",
                   "--warmup", "1", "--out", str(out)], tmp_path,
                  subcommand=("bench", "a2a"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "a2a.json").read_text())
    assert [x["bytes_per_peer"] for x in result["records"]] == [1024, 256 << 10, 4 << 20]
    for x in result["records"]:
        assert x["off_rank_bytes"] == x["bytes_per_peer"]  # W - 1 = 1 peer
        assert x["ms"] > 0
    links = Links.from_file(str(out / "links.yaml"))
    assert links.intra_GBps == pytest.approx(result["fit"]["GBps"], rel=1e-5)  # 6 digits
    assert links.gpus_per_node == 2
    base = yaml.safe_load((Path(__file__).resolve().parents[3] / "configs" / "links" /
                           "default.yaml").read_text())
    assert links.inter_GBps == base["inter_node"]["GBps"]  # one node: the base's network
    assert "lrmoe bench a2a" in links.sources["intra_node.source"]
    assert "| KiB per peer |" in (out / "a2a.md").read_text()


def test_without_torchrun_names_torchrun(tmp_path):
    r = _torchrun(["--device", "cpu", "--out", str(tmp_path / "a")], tmp_path, nproc=0,
                  subcommand=("bench", "a2a"))
    assert r.returncode == 2 and "torchrun --nproc-per-node N" in r.stderr, r.stderr


def _one_rank_out_of_memory(rank, world, kind):
    """Rank 1 cannot allocate the 2nd size's buffers: every rank raises the same
    ValueError at once (within the 120 s collective timeout, not waiting for rank 1).
    ``kind``: the CUDA caching allocator's error, or the CPU allocator's (a plain
    RuntimeError, as torch.empty raises it for more bytes than the machine has)."""
    import torch

    from lrmoe.bench import a2a

    real = torch.empty

    def empty(*shape, **kw):
        if rank == 1 and shape and shape[0] >= 2 * 64 * 1024:
            if kind == "cuda":
                raise torch.OutOfMemoryError("test: no memory")
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               "DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 131072 bytes. Error code 12 (Cannot allocate memory)")
        return real(*shape, **kw)
    torch.empty = empty
    try:
        with pytest.raises(ValueError, match="--sizes-kib 64: a rank could not allocate"):
            a2a.measure([1, 64], 1, 0, torch.device("cpu"))
    finally:
        torch.empty = real


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_one_rank_out_of_memory_stops_every_rank(kind):
    from test_expert_parallel import _spawn
    # a rank that waited would meet the collective timeout and raise a timeout error, not
    # the ValueError the check expects; 120 s keeps a slow (loaded) rank from looking so
    _spawn(_one_rank_out_of_memory, "gloo", 2, kind, timeout_s=120)


def _usage_error(argv, capsys, *needles):
    """``lrmoe ARGV`` ends in exit status 2 and one line holding every needle."""
    from lrmoe import cli
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize("flags, needles", [
    # 1e17 KiB overflowed torch.empty's int64 size (a TypeError and a C++ frame dump)
    (["--sizes-kib", "4", "99999999999999999"], ("--sizes-kib", "at most 16777216 KiB",
                                                 "got 99999999999999999")),
    # 16 GiB + 1 KiB: the first size over the bound (16 x 2^20 KiB)
    (["--sizes-kib", "4", str((16 << 20) + 1)], ("--sizes-kib", "16 GiB per peer")),
    (["--sizes-kib", "4", "64", "--iters", "10001"], ("--iters must be in 1..10000",)),
    (["--sizes-kib", "4", "64", "--warmup", "10001"], ("--warmup in 0..10000",))])
def test_absurd_sizes_and_iters_are_refused_before_measuring(tmp_path, capsys, flags,
                                                               needles):
    out = tmp_path / "a2a"
    _usage_error(["bench", "a2a", "--device", "cpu", *flags, "--out", str(out)], capsys,
                 *needles)
    assert not out.exists()


def test_a_broken_base_links_names_the_flag_and_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    _usage_error(["bench", "a2a", "--device", "cpu", "--base-links", str(bad), "--out",
                  str(tmp_path / "a2a")], capsys, f"--base-links {bad}: not valid YAML")


def test_a_failed_fit_keeps_the_earlier_run(tmp_path, monkeypatch):
    """A sweep whose times shrink with the size (no bandwidth to fit) into a folder of a
    good earlier run: its a2a.json, a2a.md and links.yaml stay byte for byte, the new
    records go to a2a_failed.json, and the message says both. One process: the group
    and the measurement are stand-ins (the records are what the fit sees)."""
    import lrmoe.parallel
    from lrmoe.bench import a2a

    out = tmp_path / "a2a"
    out.mkdir()
    earlier = {"a2a.json": '{"fit": {"GBps": 1.0}}\n', "a2a.md": "earlier\n",
               "links.yaml": "name: earlier\n"}
    for name, text in earlier.items():
        (out / name).write_text(text)
    # 4 and 5 KiB per peer, W = 2 (one peer): 2 ms then 1 ms, slower for fewer bytes
    records = [{"bytes_per_peer": 4096, "off_rank_bytes": 4096, "ms": 2.0, "GBps": 0.002048},
               {"bytes_per_peer": 5120, "off_rank_bytes": 5120, "ms": 1.0, "GBps": 0.00512}]
    for k, v in (("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"), ("RANK", "0")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(lrmoe.parallel, "init_torchrun_group", lambda *a, **k: "gloo")
    monkeypatch.setattr(a2a, "measure", lambda *a, **k: [dict(r) for r in records])
    monkeypatch.setattr(a2a.dist, "barrier", lambda *a, **k: None)
    with pytest.raises(ValueError) as err:
        a2a.bench_a2a([4, 5], 1, 0, "cpu", str(out), None, "the command")
    msg = str(err.value)
    assert "do not grow with the message size" in msg
    assert f"{out / 'a2a_failed.json'}" in msg
    assert "a2a.json, a2a.md, links.yaml of the earlier run" in msg and "untouched" in msg
    for name, text in earlier.items():
        assert (out / name).read_text() == text, name
    failed = json.loads((out / "a2a_failed.json").read_text())
    assert failed["fit"] is None and failed["records"] == records
    assert failed["meta"]["command"] == "the command"
    assert sorted(p.name for p in out.iterdir()) == sorted([*earlier, "a2a_failed.json"])
    # a later good sweep into the same folder replaces the set and drops the failed file
    good = [{"bytes_per_peer": 4096, "off_rank_bytes": 4096, "ms": 1.0, "GBps": 0.004096},
            {"bytes_per_peer": 5120, "off_rank_bytes": 5120, "ms": 1.25, "GBps": 0.004096}]
    monkeypatch.setattr(a2a, "measure", lambda *a, **k: [dict(r) for r in good])
    a2a.bench_a2a([4, 5], 1, 0, "cpu", str(out), None, "the good command")
    assert sorted(p.name for p in out.iterdir()) == sorted(earlier)
    assert json.loads((out / "a2a.json").read_text())["meta"]["command"] == "the good command"
