"""Temporary files a killed `data prepare` left behind, found and removed by the next one.

A prepare writes each file it makes (the token file, its sidecar, a trained tokenizer) to
`<file>.tmp.<pid>` beside it and renames that over the file when it is complete
(zerolab.atomic). A prepare that is killed never renames, and the next one, with another pid,
would not look at the old name: a large corpus leaves gigabytes behind. So each prepare first
removes the temporary files of its targets that no live writer owns.

No live writer owns a temporary file when its pid is no live process on this machine *and* no
process holds the file's lock: the token file's writer holds an exclusive `flock` on it while it
writes (`hold`), which the kernel drops when the process dies, however it dies, and which a
writer on another machine sharing the filesystem holds too (NFSv4 and Lustre with `flock`). A
pid that was reused keeps its file until that pid is free again: nothing is removed that a live
process might be writing.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re

log = logging.getLogger("zerolab")


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (any user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _locked(path: str) -> bool:
    """Whether a live process holds the flock of `path` (a writer on this machine or another)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing lets go of the lock it may have taken
    return False


def hold(fh) -> None:
    """Lock the open temporary file `fh` for as long as it stays open: the writer's mark that it
    is alive, which `remove_stale` respects."""
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX)


def remove_stale(targets: list[str]) -> list[tuple[str, int, int]]:
    """Remove `<target>.tmp.<pid>` for each target whose writer is gone (see the module's
    docstring); returns (path, bytes, pid) of each removed, and says so (log level info: the CLI
    prints it)."""
    removed = []
    for target in targets:
        directory, name = os.path.split(os.path.abspath(target))
        pattern = re.compile(re.escape(name) + r"\.tmp\.(\d+)$")
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for entry in entries:
            m = pattern.match(entry)
            if not m:
                continue
            pid, path = int(m.group(1)), os.path.join(directory, entry)
            if pid == os.getpid() or _alive(pid) or _locked(path):
                continue
            try:
                size = os.path.getsize(path)
                os.remove(path)
            except FileNotFoundError:  # another prepare removed it first
                continue
            removed.append((path, size, pid))
            log.info("removed %s (%d bytes): the temporary file of a prepare (pid %d) that did not finish",
                     path, size, pid)
    return removed
