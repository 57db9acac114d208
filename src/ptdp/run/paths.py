"""Whether a folder the run will write into can be used, checked before any work is done.

``ptdp train`` writes its run directory (``--output-dir``), its data cache (``--data-cache-dir``)
and its checkpoints (``--save``); a folder that cannot be created or written must be refused
before the data are prepared and before any worker starts, naming the path and why.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def folder_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be used as a folder to write into, or None.

    It must be a writable folder, or not exist yet and have a nearest existing ancestor that is a
    writable folder (so it can be created). Writable means a file can be created there: a probe
    file is created and removed at once (permissions, read-only file systems and special file
    systems such as ``/proc`` all answer truly); nothing else is created.
    """
    path = Path(path).expanduser()
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            return f"{path} exists and is not a directory"
        why = _unwritable(path)
        return f"{path} is not writable ({why})" if why else None
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is a file, not a directory"
    why = _unwritable(parent)
    return f"{path} cannot be created: {parent} is not writable ({why})" if why else None


def _unwritable(folder: Path) -> str | None:
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".ptdp-probe-"):
            return None
    except OSError as err:
        return err.strerror or str(err)
