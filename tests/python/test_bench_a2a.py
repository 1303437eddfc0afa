"""``lrmoe bench a2a``: the link fit against hand-computed lines, and the torchrun run on
loopback gloo (W = 2) writing a link file that ``lrmoe sim`` reads.
"""
import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_expert_parallel import _torchrun  # noqa: E402

from lrmoe.bench.a2a import fit_link  # noqa: E402
from lrmoe.links import Links  # noqa: E402


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
                  subcommand=("bench", "a2a"), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "a2a.json").read_text())
    assert [x["bytes_per_peer"] for x in result["records"]] == [1024, 256 << 10, 4 << 20]
    for x in result["records"]:
        assert x["off_rank_bytes"] == x["bytes_per_peer"]  # W - 1 = 1 peer
        assert x["ms"] > 0
    links = Links.from_file(str(out / "links.yaml"))
    assert links.intra_GBps == pytest.approx(result["fit"]["GBps"], rel=1e-5)  # 6 digits
    assert links.gpus_per_node == 2
    base = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "links" /
                           "default.yaml").read_text())
    assert links.inter_GBps == base["inter_node"]["GBps"]  # one node: the base's network
    assert "lrmoe bench a2a" in links.sources["intra_node.source"]
    assert "| KiB per peer |" in (out / "a2a.md").read_text()


def test_without_torchrun_names_torchrun(tmp_path):
    r = _torchrun(["--device", "cpu", "--out", str(tmp_path / "a")], tmp_path, nproc=0,
                  subcommand=("bench", "a2a"))
    assert r.returncode == 2 and "torchrun --nproc-per-node N" in r.stderr, r.stderr


def _one_rank_out_of_memory(rank, world):
    """Rank 1 cannot allocate the 2nd size's buffers: every rank raises the same
    ValueError at once (within the 10 s collective timeout, not waiting for rank 1)."""
    import torch

    from lrmoe.bench import a2a

    real = torch.empty

    def empty(*shape, **kw):
        if rank == 1 and shape and shape[0] >= 2 * 64 * 1024:
            raise torch.OutOfMemoryError("test: no memory")
        return real(*shape, **kw)
    torch.empty = empty
    try:
        with pytest.raises(ValueError, match="--sizes-kib 64: a rank could not allocate"):
            a2a.measure([1, 64], 1, 0, torch.device("cpu"))
    finally:
        torch.empty = real


def test_one_rank_out_of_memory_stops_every_rank():
    from test_expert_parallel import _spawn
    _spawn(_one_rank_out_of_memory, "gloo", 2, timeout_s=10)
