"""Scratch folders on local disk (a state's database, a listing's files), removed with the object that owns them,
and swept on the next start when a killed process left them behind."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

PREFIX = "imgest-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep(kind: str) -> list[str]:
    """Remove the `kind` folders whose process is gone (a kill -9 runs no finaliser)."""
    removed, root, head = [], tempfile.gettempdir(), f"{PREFIX}{kind}-"
    for name in os.listdir(root):
        pid = name[len(head):].split("-", 1)[0] if name.startswith(head) else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def scratch_folder(owner: object, kind: str) -> str:
    """A new folder `imgest-<kind>-<pid>-<random>` under TMPDIR, removed when `owner` is garbage collected."""
    sweep(kind)
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-{os.getpid()}-")
    weakref.finalize(owner, shutil.rmtree, path, True)
    return path
