"""What a user installing lrmoe into their own environment meets: the extension checked
against the running torch, optional packages named by their extra, ``lrmoe --version``,
the tested transformers range and the package data.

The expected outcomes are written out by hand (versions, messages, the files a wheel must
carry: ``git ls-files``), never taken from the code under test.
"""
from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tomllib
import types
import warnings
from pathlib import Path

import pytest
import torch

import lrmoe
from lrmoe import cli
from lrmoe import ops as extension
from lrmoe.utils import extras

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("built, running, ok", [
    ("2.11.0+cu130", "2.11.0+cu130", True),
    ("2.11.0+cu130", "2.11.0+cpu", True),   # one C++ ABI; the kernels are another matter
    ("2.11.0", "2.11.0+cu130", True),
    ("2.11.0+cu130", "2.12.0+cu130", False),
    ("2.13.0+cpu", "2.13.1+cpu", False),
])
def test_the_extension_runs_only_with_the_torch_it_was_built_against(built, running, ok):
    if ok:
        extension.check_torch(built, running)
        return
    with pytest.raises(ImportError) as err:
        extension.check_torch(built, running)
    text = str(err.value)
    assert f"compiled against torch {built}" in text and f"torch {running} is installed" in text
    assert "--no-build-isolation" in text and f"torch=={built.split('+')[0]}" in text


def _fake_info(version, with_cuda):
    return types.SimpleNamespace(TORCH_VERSION=version, TORCH_CUDA=None, WITH_CUDA=with_cuda)


def test_load_checks_before_it_imports(monkeypatch):
    monkeypatch.setattr(extension, "build_info", lambda: _fake_info("1.0.0", False))
    with pytest.raises(ImportError, match="compiled against torch 1.0.0"):
        extension.load()


def test_a_cpu_only_build_under_a_cuda_torch_with_a_gpu_warns(monkeypatch):
    monkeypatch.setattr(extension, "build_info", lambda: _fake_info(torch.__version__, False))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match="built without CUDA kernels"):
        extension.load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extension.load()


def test_the_build_recorded_the_torch_we_run():
    info = extension.build_info()
    assert info is not None, "lrmoe/_build_info.py is written by every setup.py build"
    assert info.TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]


def test_a_missing_extra_is_named_with_its_pip_install(monkeypatch):
    monkeypatch.setitem(extras.EXTRAS, "sim", ("yaml", "no_such_module_for_lrmoe_tests"))
    with pytest.raises(ModuleNotFoundError) as err:
        extras.require("sim", "lrmoe sim")
    assert str(err.value) == (
        "lrmoe sim needs no_such_module_for_lrmoe_tests, not installed: pip install "
        "'lrmoe[sim]' (or pip install no_such_module_for_lrmoe_tests)")
    extras.require("sim", "lrmoe sim", ["yaml"])  # only the named modules are checked


def test_the_cli_reports_a_missing_extra_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(extras.EXTRAS, "sim", ("no_such_module_for_lrmoe_tests",))
    rc = cli.main(["sim", "--costs", str(ROOT / "configs" / "costs" / "h200.json")])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_USAGE
    assert err.strip().splitlines() == [
        "lrmoe sim: error: lrmoe sim (link files, figures) needs "
        "no_such_module_for_lrmoe_tests, not installed: pip install 'lrmoe[sim]' (or pip "
        "install no_such_module_for_lrmoe_tests)"]


def test_every_extra_of_the_package_is_checked_by_the_same_names():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["dependencies"] == ["torch>=2.10", "numpy"]  # import lrmoe needs only these
    declared = meta["optional-dependencies"]
    dist = {"yaml": "pyyaml"}
    for extra, modules in extras.EXTRAS.items():
        names = {d.split(">")[0].split("<")[0].split("=")[0] for d in declared[extra]}
        assert {dist.get(m, m) for m in modules} == names, extra


def test_version_names_lrmoe_and_both_torches():
    got = subprocess.run([sys.executable, "-m", "lrmoe", "--version"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "COLUMNS": "40"})
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith(f"lrmoe {lrmoe.__version__} (torch {torch.__version__}; "
                                 f"built with torch ")
    assert "CUDA kernels: " in got.stdout and got.stdout.count("\n") == 1  # one line


@pytest.mark.parametrize("version, tested", [
    ("5.17.0", True), ("5.24.1", True), ("5.99.0", True), ("5.17.0.dev0", True),
    ("5.16.2", False), ("6.0.0", False), ("4.57.1", False)])
def test_transformers_range(version, tested):
    from lrmoe.integrations.transformers import transformers_tested
    assert transformers_tested(version) is tested


def test_package_data_covers_every_config_and_is_found_through_the_package():
    from lrmoe.sim.links import DEFAULT_LINKS
    assert DEFAULT_LINKS.is_file()
    assert Path(lrmoe.__file__).resolve().parent in DEFAULT_LINKS.resolve().parents
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["lrmoe"]
    # the files on disk (the GPU machine's copy of the tree is not a git checkout)
    tracked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "lrmoe" / "configs").rglob("*")
                     if p.is_file())
    assert tracked, "lrmoe/configs holds the presets, cost and link files"
    for path in tracked:
        rel = path[len("lrmoe/"):]
        assert any(fnmatch.fnmatch(rel, p) and rel.count("/") == p.count("/")
                   for p in patterns), f"{path} is not package data"
