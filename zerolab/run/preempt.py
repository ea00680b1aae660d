"""Save on preemption: SIGTERM or SIGUSR1 ends the job after a checkpoint, not before.

Schedulers announce the end of a job with a signal: torchrun's agent forwards the SIGTERM it gets
(from a preempting scheduler, `kill`, or Slurm at the time limit) to every worker and SIGKILLs
them after its grace period (`--shutdown-timeout`, default 30 s); launch/slurm.sbatch turns
Slurm's early warning (USR1) into the same SIGTERM. A handler here only records the request: the
rank finishes the step it is in, then all ranks agree through one tiny all-reduce per step (MAX of
each rank's signal number on CPU, over a gloo group: on CUDA it never waits for the step's
kernels; so no rank stops alone, all stop after the same step, and all know which rank got which
signal), save a checkpoint and exit with EXIT_PREEMPTED, rank 0 alone saying so. The same
agreement carries a write that did not fit on the disk (StopRequest.write_failed): every rank
stops after that step too (zerolab.run.results.DiskFull).

A repeated signal changes nothing. Under Slurm one stop reaches a rank twice: slurmstepd signals
every process of the step (proctrack tracks the whole tree, torchrun's workers included) and the
torchrun agent forwards its own copy a moment later. Whether the two merge into one pending signal
depends on scheduling, so "a second SIGTERM kills at once" lost the checkpoint on a busy machine.
The hard stop belongs to the launcher: torchrun SIGKILLs workers after --shutdown-timeout (30 s),
Slurm after KillWait; by hand, `kill -9` or Ctrl-C (SIGINT is not handled here).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from zerolab.atomic import atomic_write_json
from zerolab.errors import ZerolabError
from zerolab.run.results import NO_SPACE, disk_full

log = logging.getLogger("zerolab")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# EX_TEMPFAIL (sysexits.h): "temporary failure, the user is invited to retry". Distinct from a
# crash (1), a configuration error (2) and a process killed by a signal (128+n).
EXIT_PREEMPTED = 75
# Written by rank 0 next to the checkpoint when a run stops on a signal; the launch scripts read it
# to write status=preempted (and, under Slurm, to requeue). Removed when a run starts training.
MARKER = "preempted.json"


class Preempted(ZerolabError):
    """Stopped on request after saving a checkpoint; resuming with checkpoint.resume=auto continues.
    Every rank raises it with the same words (the stop and its signal were agreed), so rank 0
    alone says it: one "stopped after" line per job."""

    exit_code = EXIT_PREEMPTED
    same_on_every_rank = True

    @classmethod
    def after(cls, done: int, max_steps: int, stop: "Stop", checkpoint, run_dir: str) -> "Preempted":
        resume = (f"resume it with checkpoint.resume=auto run.dir={run_dir}" if checkpoint else
                  "no checkpoint was written (this strategy cannot write one)")
        return cls(f"zerolab: stopped after step {done} of {max_steps} on {stop.why()}; checkpoint "
                   f"{checkpoint or '(none)'}; {resume}")


@dataclass(frozen=True)
class Stop:
    """What every rank agreed after a step (StopRequest.agreed): the same on every rank."""
    signal: Optional[str]  # the stop signal (the highest-numbered one, if ranks got different ones)
    signalled: tuple  # the ranks that got a stop signal
    write_failed: tuple  # the ranks whose write did not fit on the disk (StopRequest.write_failed)
    world_size: int

    def why(self) -> str:
        """The signal and who got it, in the same words on every rank."""
        if len(self.signalled) == self.world_size:
            who = "every rank" if self.world_size > 1 else ""
        else:
            who = ("rank " if len(self.signalled) == 1 else "ranks ") + ", ".join(map(str, self.signalled))
        return f"{self.signal} (received by {who})" if who else str(self.signal)


class StopRequest:
    """Process-wide: which stop signal arrived (None if none), and the first write of this run that
    did not fit on the disk. Installed once, early."""

    signal_name: str | None = None
    write_failure: tuple | None = None  # (the path, what was not written and why): the first of this run
    _installed = False

    @classmethod
    def install(cls) -> None:
        cls.write_failure = None  # a new run in this process: nothing of the last one's
        if cls._installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            signal.signal(sig, cls._handle)
        cls._installed = True

    @classmethod
    def _handle(cls, signum, frame) -> None:
        name = signal.Signals(signum).name
        if cls.signal_name is not None:
            return  # the same stop delivered again (see the module docstring): already recorded
        cls.signal_name = name
        # os.write: no locks taken inside a signal handler (print/logging could deadlock). What follows
        # is said when it happens: a rank in a job that is failing anyway never gets to stop on it.
        os.write(2, f"zerolab: rank {os.environ.get('RANK', '0')} got {name}\n".encode())

    @classmethod
    def write_failed(cls, path: str, what: str) -> None:
        """A write of this run into `path` did not fit (a full disk, a quota): every rank stops after
        this step (the trainer's agreement reads it), and what is said then names it (`what`: one
        sentence of what was and was not written)."""
        if cls.write_failure is None:
            cls.write_failure = (path, what)

    @classmethod
    def agreed(cls, world_size: int, host_group=None) -> Optional[Stop]:
        """Collective: on every rank the same Stop if any rank was asked to stop or could not
        write, else None. One small CPU tensor on the host group (DistContext.host_group), MAX
        all-reduced: each rank's signal number and write-failure flag in its own slot, so every
        rank learns who got what. Reading it back never waits for the device, so the per-step
        check does not stall the CPU behind the step's kernels."""
        t = torch.zeros(2 * world_size, dtype=torch.int32)
        rank = dist.get_rank() if world_size > 1 else 0
        if cls.signal_name is not None:
            t[rank] = int(signal.Signals[cls.signal_name])
        t[world_size + rank] = int(cls.write_failure is not None)
        if world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group)
        signums, failed = t[:world_size].tolist(), t[world_size:].tolist()
        if not any(signums) and not any(failed):
            return None
        return Stop(signal=signal.Signals(max(signums)).name if any(signums) else None,
                    signalled=tuple(r for r, s in enumerate(signums) if s), world_size=world_size,
                    write_failed=tuple(r for r, f in enumerate(failed) if f))


def stop_run(stop: Stop, *, cfg, ctx, run_dir: str, done: int, saved: Optional[str],
             save: Optional[Callable[[], str]], metrics, checkpointer) -> NoReturn:
    """Every rank, after step `done`, on which `stop` was agreed (StopRequest.agreed). A write that
    did not fit ends the run with zerolab.run.results.DiskFull. A stop signal: a checkpoint
    (`saved`, this step's own save, else `save()`; None when the strategy writes none), the stop's
    record (metrics.jsonl, and the marker the launch scripts read), then Preempted on every rank."""
    if stop.write_failed:
        raise disk_full(ctx, cfg, done, saved, checkpointer, save)
    path = saved if saved is not None or save is None else save()
    record = {"step": done, "stopped": "preempted", "signal": stop.signal, "checkpoint": path}
    unsaid = []
    if ctx.is_main:
        if metrics.log(record) is not None:
            unsaid.append("metrics.jsonl")
        try:
            atomic_write_json(os.path.join(run_dir, MARKER), {**record, "max_steps": cfg.trainer.max_steps})
        except OSError as err:
            if err.errno not in NO_SPACE:
                raise
            unsaid.append(MARKER)
    metrics.close({"stopped": "preempted", "stopped_at_step": done})
    err = Preempted.after(done, cfg.trainer.max_steps, stop, path, run_dir)
    if unsaid:  # the checkpoint is what matters; say what of the stop's record the full disk refused
        err = Preempted(f"{err}. The disk is full: the stop was not recorded in {' or '.join(unsaid)}")
    raise err
