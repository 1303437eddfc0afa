"""Output paths a command will write, checked before the work starts, so that a mistyped
``--out`` fails in a second with the flag named, not after minutes of measurement with
an ``OSError`` traceback."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_output(flag: str, path: str | os.PathLike, is_dir: bool) -> Path:
    """Check that ``path`` can be written as a file (``is_dir`` False) or a folder of
    files (True); creates and leaves nothing.

    Args:
        flag: the option that named ``path`` (``"--out"``), for the message.
        path: the output path; missing parent folders are fine (the command creates them).
        is_dir: the command writes a folder of files at ``path``.

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: ``path`` is a file where a folder is wanted or a folder where a file is
            wanted, a file lies in the way of its parent folders, or the nearest existing
            folder above it is not writable (naming ``flag`` and the fix).
    """
    p = Path(path)
    if is_dir and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path} is a file; name a folder (new or existing) for "
                         "the output files")
    if not is_dir and p.is_dir():
        raise ValueError(f"{flag} {path} is a folder; name a file (in that folder or "
                         "elsewhere) to write")
    # the nearest existing ancestor is where the first new entry will be made
    folder = p if (is_dir and p.is_dir()) else p.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, so no folder can be made "
                         "under it; name another path")
    try:
        # a real write, not os.access: root passes access() even on read-only mounts
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write in {folder} "
                         f"({err.strerror or err}); name a writable path") from None
    return p
