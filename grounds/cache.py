"""The cache of the embedded grounds: where built models live, and how a build happens once.

Built models sit under `~/.cache/tinypost/` (override with `TINYPOST_CACHE`, or XDG_CACHE_HOME), one folder per
model keyed by a hash of its recipe, so a changed recipe builds a new folder and a stale one is never loaded.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time


def cache_root() -> str:
    root = os.environ.get("TINYPOST_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "tinypost")
    return root


def build_once(path: str, done, build, what: str = "", minutes: float = 0.0, every: float = 60.0) -> str:
    """The cache folder `path`, made by `build(tmp)` into a temporary folder that then becomes `path` by one atomic
    rename (a crash mid-build leaves no half-written `path`), unless `done()` says it is already there. Processes that
    need it at once (torchrun ranks, parallel runs) take turns on an exclusive lock on `path`.lock: the first
    builds, the others wait, then find it done and load it. Under torchrun only rank 0 builds: while a process group
    is up, transformers' save_pretrained writes the weights on rank 0 alone, so a build on another rank would leave a
    folder without them; the other ranks wait for rank 0's.

    A process that waits for another's build is not silent (on stderr; under torchrun rank 0 alone): one line at once
    naming `what` is built, where, since when and by which process, and how long a build takes (`minutes`, measured on
    2 cores), then one line every `every` seconds with the time waited so far, and one when the wait is over. Ctrl-C
    while building or waiting is one line and exit status 130, the unfinished build removed."""
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    builder = not (up and dist.get_rank() != 0)
    talk = (dist.get_rank() if up else int(os.environ.get("RANK", "0"))) == 0  # torchrun sets RANK before the group
    what, lock_path = what or os.path.basename(path), path + ".lock"
    try:
        while not done():
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(lock_path, "a+") as lock:  # "a+": opening does not erase the holder's line (`_holder`)
                waited = _take(lock, lock_path, what, path, minutes, every, talk)
                if talk and waited is not None:
                    _say(f"[cache] waited {_minutes(waited)} for {what}: "
                         + ("built by the other process" if done() else "not built there; building it here"))
                if builder and not done():
                    lock.seek(0)
                    lock.truncate()
                    lock.write(f"{os.getpid()} {time.time():.0f}\n")  # who builds since when, for a process that waits
                    lock.flush()
                    try:
                        shutil.rmtree(path, ignore_errors=True)  # a corrupt or unfinished folder
                        tmp = f"{path}.tmp{os.getpid()}"
                        shutil.rmtree(tmp, ignore_errors=True)
                        build(tmp)
                        os.replace(tmp, path)
                    finally:
                        lock.seek(0)
                        lock.truncate()  # no builder now
            if builder:
                break
            time.sleep(0.5)  # rank 0 has not taken the lock yet
    except KeyboardInterrupt:  # Ctrl-C while building or waiting: one line, no traceback, nothing half-built kept
        shutil.rmtree(f"{path}.tmp{os.getpid()}", ignore_errors=True)
        if talk:
            _say(f"interrupted while building or waiting for {what}; nothing of it is kept (the next run builds it)")
        raise SystemExit(130) from None
    return path


def _take(lock, lock_path: str, what: str, path: str, minutes: float, every: float, talk: bool) -> float | None:
    """Take the exclusive lock on the open file `lock` (released when it closes). None when it was free; else the
    seconds waited, having said (`talk`) at once that this process waits, for what and on whom, and every `every`
    seconds how long so far. A lock held for under a second without a builder's line (a torchrun rank that only
    looked) is waited for silently."""
    t0, said = time.time(), 0.0
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return time.time() - t0 if said else None
        except BlockingIOError:
            pass
        waited, holder = time.time() - t0, _holder(lock_path)
        if talk and not said and (holder or waited >= 1.0):
            typical = f"; it takes about {minutes:g} minute{'s' * (minutes != 1)} on 2 cores" if minutes else ""
            _say(f"[cache] waiting for another process to finish building {what} in {path} "
                 f"({holder or 'lock held by another process'}{typical})")
            said = time.time()
        elif talk and said and time.time() - said >= every:
            _say(f"[cache] still waiting for {what}: {_minutes(waited)} so far ({holder or 'lock still held'})")
            said = time.time()
        time.sleep(0.2)


def _holder(lock_path: str) -> str:
    """'lock held since 09:12:03 (4 min ago) by process 4242' from the builder's line in the lock file; '' if none."""
    try:
        with open(lock_path) as f:
            pid, since = f.read().split()
        return (f"lock held since {time.strftime('%H:%M:%S', time.localtime(float(since)))} "
                f"({_minutes(time.time() - float(since))} ago) by process {pid}")
    except (OSError, ValueError):
        return ""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"
