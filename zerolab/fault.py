"""Failing on purpose, and naming the rank that failed.

Fault injection (`fault.kill_rank=R fault.at_step=S fault.mode=exit|raise|hang`) makes rank R
fail just before it starts step S (0-based: after S completed steps). It fires only in the first
attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT=0), so a group that torchrun restarts
resumes and finishes instead of failing again.

When a rank stops, the others wait in their next collective until dist.timeout_s and then get an
error from gloo/NCCL that says "timed out" or "connection closed" but not *who* stopped. Every
rank therefore posts the step it is starting to the job's key-value store (one small write per
step); a rank whose collective fails reads the board and names the ranks that fell behind.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

import torch.distributed as dist

from zerolab.config import ConfigError, FaultConfig

log = logging.getLogger("zerolab")
MODES = ("exit", "raise", "hang")


class InjectedFault(RuntimeError):
    pass


class RankStopped(RuntimeError):
    """A collective failed because another rank stopped; the message names that rank."""


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class FaultInjector:
    def __init__(self, cfg: FaultConfig, rank: int, world_size: int):
        if cfg.mode not in MODES:
            raise ConfigError(f"fault.mode={cfg.mode!r} is not valid; allowed values: {', '.join(MODES)}")
        if cfg.kill_rank >= world_size:
            raise ConfigError(f"fault.kill_rank={cfg.kill_rank} but the job has {world_size} ranks")
        self.cfg, self.rank = cfg, rank
        self.armed = cfg.kill_rank == rank and cfg.at_step >= 0 and restart_count() == 0

    def before_step(self, step: int) -> None:
        if not self.armed or step != self.cfg.at_step:
            return
        msg = f"zerolab fault injection: rank {self.rank} fails before step {step} (fault.mode={self.cfg.mode})"
        print(msg, file=sys.stderr, flush=True)
        if self.cfg.mode == "exit":
            os._exit(1)  # no cleanup, no exception: as abrupt as a killed process
        if self.cfg.mode == "raise":
            raise InjectedFault(msg)
        threading.Event().wait()  # hang: blocks until the launcher kills the process


class ProgressBoard:
    """Each rank's current step in the launcher's store, to name the rank that stopped."""

    def __init__(self, rank: int, world_size: int, store: "dist.Store | None"):
        self.rank, self.world, self.step = rank, world_size, -1
        self.store = dist.PrefixStore("zerolab/progress/", store) if store is not None and world_size > 1 else None

    def close(self) -> None:
        """Drop the store: a store client destroyed during interpreter shutdown can abort it."""
        self.store = None

    def starting(self, step: int) -> None:
        self.step = step
        if self.store is not None:
            self.store.set(str(self.rank), str(step))

    def blame(self, err: BaseException) -> None:
        """Raise RankStopped naming the ranks behind this one, if any; otherwise return."""
        if self.store is None or self.step < 0:
            return
        behind = []
        try:
            for r in range(self.world):
                if r == self.rank:
                    continue
                seen = int(self.store.get(str(r))) if self.store.check([str(r)]) else None
                if seen is None or seen < self.step:
                    behind.append((r, seen))
        except Exception:  # the store went down with the job: keep the original error
            return
        if not behind:
            return
        who = ", ".join(f"rank {r} (last started step {'none' if s is None else s})" for r, s in behind)
        raise RankStopped(f"rank {self.rank} was at step {self.step} when its collective failed; stopped: {who}. "
                          f"A rank that dies or hangs ends the job within dist.timeout_s. Original error: "
                          f"{str(err).strip()[:300]}") from err
