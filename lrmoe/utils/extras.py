"""Optional dependencies, grouped as the package's extras (pyproject.toml
``[project.optional-dependencies]``): ``import lrmoe`` needs only torch and numpy; each
command checks the extra it needs before it starts, so a missing package is one line naming
the ``pip install`` that adds it, not a traceback after minutes of set-up.
"""
from __future__ import annotations

import importlib.util
from typing import Dict, Optional, Sequence, Tuple

#: extra -> the modules it provides (import names), as pyproject.toml lists them
EXTRAS: Dict[str, Tuple[str, ...]] = {
    "hf": ("transformers", "tokenizers", "safetensors"),
    "train": ("transformers", "tokenizers", "safetensors", "yaml", "tqdm", "rich",
              "matplotlib", "tensorboard"),
    "plots": ("matplotlib",),
    "sim": ("yaml", "matplotlib"),
}
#: what the trainer cannot start without (tensorboard only serves run.tensorboard, which
#: the preflight checks when it is set)
TRAIN_CORE: Tuple[str, ...] = tuple(m for m in EXTRAS["train"] if m != "tensorboard")
#: import name -> distribution name, where they differ
_DISTRIBUTION = {"yaml": "pyyaml"}


def missing(extra: str, modules: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """The modules of ``extra`` (or ``modules`` of it) that cannot be imported, found
    without importing them."""
    return tuple(m for m in (modules or EXTRAS[extra]) if importlib.util.find_spec(m) is None)


def require(extra: str, what: str, modules: Optional[Sequence[str]] = None) -> None:
    """Check that the packages of ``extra`` are installed.

    Args:
        extra: a key of :data:`EXTRAS`.
        what: the command or feature that needs them, for the message.
        modules: only these modules of the extra (``require("train", "--tensorboard",
            ["tensorboard"])``); None: all of them.

    Raises:
        KeyError: an unknown extra (a programming error).
        ModuleNotFoundError: naming the missing packages and ``pip install 'lrmoe[extra]'``.
    """
    lost = missing(extra, modules)
    if lost:
        names = ", ".join(_DISTRIBUTION.get(m, m) for m in lost)
        err = ModuleNotFoundError(
            f"{what} needs {names}, not installed: pip install 'lrmoe[{extra}]' (or "
            f"pip install {' '.join(_DISTRIBUTION.get(m, m) for m in lost)})")
        err.name = lost[0]
        raise err
