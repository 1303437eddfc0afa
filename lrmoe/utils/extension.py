"""The compiled extension ``lrmoe._C``, loaded once and checked against the running torch.

A C++ extension is compiled against one torch and runs only with it: another version
fails with an undefined-symbol ImportError (or, worse, loads and misbehaves). setup.py
records the torch it compiled against in ``lrmoe/_build_info.py``; :func:`load` compares
it with the running torch BEFORE importing the library, so a mismatch is one clear error
with the fix. A CPU-only build under a CUDA torch on a machine with a GPU warns once:
every op would run on the CPU kernels only and the CUDA tensors would be refused.
"""
from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Optional

import torch

REBUILD = ("rebuild lrmoe against the torch you run: `pip install --no-build-isolation "
           "--force-reinstall --no-deps .` in the lrmoe source folder (or `bash "
           "scripts/bootstrap.sh` in a checkout)")


def _release(version: str) -> str:
    # 2.11.0+cu130 and 2.11.0+cpu share one C++ ABI; the local tag says which kernels
    return version.split("+", 1)[0]


def build_info() -> Optional[ModuleType]:
    """``lrmoe._build_info`` (TORCH_VERSION, TORCH_CUDA, WITH_CUDA), or None for a build
    made before it was recorded."""
    try:
        return importlib.import_module("lrmoe._build_info")
    except ModuleNotFoundError:
        return None


def check_torch(built: str, running: str) -> None:
    """Raise when ``running`` torch is not the release ``built`` was compiled against.

    Raises:
        ImportError: naming both versions and :data:`REBUILD`.
    """
    if _release(built) != _release(running):
        raise ImportError(f"lrmoe._C was compiled against torch {built}, but torch {running} "
                          f"is installed; a compiled extension runs only with its own torch: "
                          f"{REBUILD}, or install torch=={_release(built)}")


def load() -> ModuleType:
    """Import ``lrmoe._C`` after the torch check (:func:`check_torch`).

    Returns:
        the extension module.

    Raises:
        ImportError: a torch mismatch, or no compiled extension (naming how to build it).
    """
    info = build_info()
    if info is not None:
        check_torch(info.TORCH_VERSION, torch.__version__)
    try:
        ext = importlib.import_module("lrmoe._C")
    except ModuleNotFoundError as exc:
        if exc.name != "lrmoe._C":
            raise
        raise ImportError("lrmoe._C, the compiled extension, is missing: build it with `bash "
                          "scripts/bootstrap.sh` (a checkout) or install lrmoe with `pip "
                          "install --no-build-isolation .`") from None
    if info is not None and not info.WITH_CUDA and torch.version.cuda is not None:
        if torch.cuda.is_available():
            warnings.warn(
                f"lrmoe._C was built without CUDA kernels, but torch {torch.__version__} "
                "sees a GPU: lrmoe's ops refuse CUDA tensors. Rebuild with nvcc on the "
                f"PATH (LRMOE_CUDA=1 fails loudly when it cannot): {REBUILD}", stacklevel=3)
    return ext


_C = load()
