"""The cache of the embedded grounds: where built models live, and how a build happens once.

Built models sit under `~/.cache/tinypost/` (override with `TINYPOST_CACHE`, or XDG_CACHE_HOME), one folder per
model keyed by a hash of its recipe, so a changed recipe builds a new folder and a stale one is never loaded.
"""

from __future__ import annotations

import os
import shutil


def cache_root() -> str:
    root = os.environ.get("TINYPOST_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "tinypost")
    return root


def build_once(path: str, done, build) -> str:
    """The cache folder `path`, made by `build(tmp)` into a temporary folder that then becomes `path` by one atomic
    rename (a crash mid-build leaves no half-written `path`), unless `done()` says it is already there. Processes that
    need it at once (torchrun ranks, parallel runs) take turns on an exclusive lock on `path`.lock: the first
    builds, the others wait, then find it done and load it. Under torchrun only rank 0 builds: while a process group
    is up, transformers' save_pretrained writes the weights on rank 0 alone, so a build on another rank would leave a
    folder without them; the other ranks wait for rank 0's."""
    import fcntl
    import time

    import torch.distributed as dist

    builder = not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)
    while not done():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if builder and not done():
                shutil.rmtree(path, ignore_errors=True)  # a corrupt or unfinished folder
                tmp = f"{path}.tmp{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                build(tmp)
                os.replace(tmp, path)
        if builder:
            break
        time.sleep(0.5)  # rank 0 has not taken the lock yet
    return path
