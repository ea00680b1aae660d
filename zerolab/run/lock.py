"""One job per run directory: a lock that rank 0 holds for the job's lifetime.

Two jobs in one directory would resume each other's checkpoints, delete each other's
in-progress saves and interleave their metrics. Rank 0 therefore takes an exclusive
`fcntl.flock` on `<run dir>/.lock` before anything in the directory is read or written, and
writes who holds it (host, pid, job id, start time) into the file as JSON. A second job finds
the lock held and is refused with that holder named.

The kernel drops a flock when its holder's last file descriptor closes, so a job that is killed
(even with SIGKILL) frees the directory by itself: the next job finds the file still naming the
dead holder but not locked, and takes it over with a warning. A torchrun restart round of the
same job (same TORCHELASTIC_RUN_ID / SLURM_JOB_ID) takes it over the same way, only logged at
info level. A job that ends normally empties the file before it lets go.

The lock file is never deleted: unlinking it while another job has it open would let two jobs
lock two different files of the same name. On a network filesystem, flock must reach the server
(NFSv4 does; Lustre needs the `flock` mount option).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from typing import Optional

from zerolab.errors import ConfigError

log = logging.getLogger("zerolab")
LOCK_NAME = ".lock"


class RunDirLocked(ConfigError):
    """Another live job holds the run directory; the message names it and the fix."""

    same_on_every_rank = True  # rank 0 decides and shares it (zerolab.run.directory.claim)


def job_id() -> str:
    """The launcher's job id, shared by every rank and every restart round of one job."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""


def describe(holder: dict) -> str:
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"job {holder.get('job_id') or 'none'}, started {holder.get('started', '?')}")


def _read(fh) -> Optional[dict]:
    fh.seek(0)
    text = fh.read()
    if not text.strip():
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
    return holder if isinstance(holder, dict) else {"host": "?", "pid": "?", "raw": text[:200]}


class RunLock:
    """The held lock of one run directory, and the directories this job created for it."""

    def __init__(self, run_dir: str, fh, created: list[str]):
        self.run_dir, self._fh, self.created = run_dir, fh, created

    @property
    def held(self) -> bool:
        return self._fh is not None

    def release(self) -> None:
        """Empty the file (so the next job sees a clean hand-over, not a stale lock) and unlock."""
        if self._fh is None:
            return
        try:
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.flush()
        except OSError:  # the directory is gone (removed below) or the disk is full: closing unlocks
            pass
        self._fh.close()
        self._fh = None

    def remove_created(self) -> list[str]:
        """Release, then delete the run directory and its parents if this job created them
        (never a directory that existed before). Returns what was removed."""
        self.release()
        removed = []
        if self.created and os.path.abspath(self.run_dir) == self.created[-1]:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            removed.append(self.run_dir)
            for parent in reversed(self.created[:-1]):  # innermost first; only if left empty
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                removed.append(parent)
        return removed


def _make_dirs(path: str) -> list[str]:
    """os.makedirs that returns the directories it created, outermost first."""
    missing, p = [], os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:  # another job made it in the meantime: not ours to remove
            created = []
            continue
        created.append(d)
    return created


def _refusal(run_dir: str, fh) -> RunDirLocked:
    return RunDirLocked(
        f"run directory {os.path.abspath(run_dir)} is in use by another job ({describe(_read(fh) or {})}; "
        f"lock file {os.path.join(run_dir, LOCK_NAME)}). Two jobs in one directory would overwrite each "
        f"other's checkpoints and metrics. Pick another run.dir, or stop that job and wait for it to exit.")


def check_free(run_dir: str) -> None:
    """Raise RunDirLocked if a live job holds `run_dir`; changes nothing (for launchers that
    write into the directory before the job's rank 0 takes the lock)."""
    try:
        fh = open(os.path.join(run_dir, LOCK_NAME))
    except (FileNotFoundError, NotADirectoryError):
        return
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a holder's LOCK_EX
        except BlockingIOError:
            raise _refusal(run_dir, fh) from None


def acquire(run_dir: str) -> RunLock:
    """Create `run_dir` if needed and lock it for this process, or raise RunDirLocked."""
    created = _make_dirs(run_dir)
    path = os.path.join(run_dir, LOCK_NAME)
    fh = open(path, "a+")  # a+: create if missing, never truncate another job's record
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        err = _refusal(run_dir, fh)
        fh.close()
        raise err from None
    previous = _read(fh)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id(),
          "restart_round": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if previous is not None:
        if me["job_id"] and previous.get("job_id") == me["job_id"]:
            log.info("run directory %s: taking over the lock from an earlier round of this job (%s)",
                     run_dir, describe(previous))
        else:
            log.warning("run directory %s: its lock names %s, which no longer holds it (the job was "
                        "killed or crashed); taking it over", run_dir, describe(previous))
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps(me) + "\n")
    fh.flush()
    os.fsync(fh.fileno())
    return RunLock(run_dir, fh, created)


def holder(run_dir: str) -> Optional[dict]:
    """Who the lock file names (a live holder or a stale one), or None."""
    try:
        with open(os.path.join(run_dir, LOCK_NAME)) as fh:
            return _read(fh)
    except FileNotFoundError:
        return None
