"""The run directory: one per run, shared by all ranks, held by one job, holding one record.

`new_run_dir` names a fresh one (<run.root>/<experiment>/<time>-<strategy>[-job<SLURM_JOB_ID>]);
the launch scripts call it before any rank starts (launch/run_dir.py). `claim` is what the ranks
do: rank 0 takes the directory's lock (zerolab/run/lock.py: one live job per directory), refuses a
fresh start over another run's record (zerolab/run/record.py), writes config.yaml, and every rank
learns the outcome from one broadcast, so all of them go on or all raise the same error.
"""
from __future__ import annotations

import os
import time
from typing import Optional

from omegaconf import OmegaConf

from zerolab.run import lock as runlock, record
from zerolab.checkpoint import checkpoint_dir
from zerolab.schema import Config, to_dict
from zerolab.errors import ZerolabError


def new_run_dir(cfg: Config) -> str:
    """A fresh <run.root>/<experiment>/<time>-<strategy>[-job<SLURM_JOB_ID>] path (not created)."""
    job = os.environ.get("SLURM_JOB_ID")
    name = time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.strategy.name}" + (f"-job{job}" if job else "")
    base = path = os.path.join(cfg.run.root, cfg.experiment, name)
    n = 1
    while os.path.exists(path):  # two runs started in the same second
        path, n = f"{base}-{n}", n + 1
    return path


def claim(cfg: Config, ctx) -> tuple[str, Optional[runlock.RunLock]]:
    """One directory for all ranks, held by this job: given as run.dir, or chosen by rank 0 and
    broadcast. Rank 0 creates and locks it before anything in it is read or written, checks the
    record it may hold, then writes config.yaml; if it cannot (another job holds the directory, a
    fresh start over another run's record), every rank raises the same error.
    Returns the absolute path and, on rank 0, the lock (None on the other ranks)."""
    path = cfg.run.dir or ctx.broadcast_object(new_run_dir(cfg) if ctx.is_main else None)
    lock, problem = None, None
    if ctx.is_main:
        try:
            lock = runlock.acquire(path)
            record.prepare(cfg, os.path.abspath(path), checkpoint_dir(cfg, path))  # before anything is written
            with open(os.path.join(path, "config.yaml"), "w") as fh:
                fh.write(OmegaConf.to_yaml(to_dict(cfg)))
        except (runlock.RunDirLocked, record.RecordExists) as err:
            problem = err
            if lock is not None:
                lock.release()
        except OSError as err:
            problem = ZerolabError(f"cannot set up run directory {os.path.abspath(path)}: {err}. Check that it "
                                   f"is writable and the disk has room, or pick another run.dir.")
            problem.same_on_every_rank = True
            if lock is not None:
                lock.remove_created()
    problem = ctx.broadcast_object(problem)  # also the barrier: config.yaml exists after it
    if problem is not None:
        raise problem
    return os.path.abspath(path), lock
