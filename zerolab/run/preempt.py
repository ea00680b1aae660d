"""Save on preemption: SIGTERM or SIGUSR1 ends the job after a checkpoint, not before.

Schedulers announce the end of a job with a signal: torchrun's agent forwards the SIGTERM it gets
(from a preempting scheduler, `kill`, or Slurm at the time limit) to every worker and SIGKILLs
them after its grace period (`--shutdown-timeout`, default 30 s); launch/slurm.sbatch turns
Slurm's early warning (USR1) into the same SIGTERM. A handler here only records the request: the
rank finishes the step it is in, then all ranks agree through one tiny all-reduce per step (MAX of
a 0/1 flag on CPU, over a gloo group: on CUDA it never waits for the step's kernels; so no rank
stops alone and all stop after the same step), save a checkpoint and exit with EXIT_PREEMPTED.

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

import torch
import torch.distributed as dist

from zerolab.errors import ZerolabError

log = logging.getLogger("zerolab")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# EX_TEMPFAIL (sysexits.h): "temporary failure, the user is invited to retry". Distinct from a
# crash (1), a configuration error (2) and a process killed by a signal (128+n).
EXIT_PREEMPTED = 75
# Written by rank 0 next to the checkpoint when a run stops on a signal; the launch scripts read it
# to write status=preempted (and, under Slurm, to requeue). Removed when a run starts training.
MARKER = "preempted.json"


class Preempted(ZerolabError):
    """Stopped on request after saving a checkpoint; resuming with checkpoint.resume=auto continues."""

    exit_code = EXIT_PREEMPTED

    @classmethod
    def after(cls, done: int, max_steps: int, why: str, checkpoint, run_dir: str) -> "Preempted":
        resume = (f"resume it with checkpoint.resume=auto run.dir={run_dir}" if checkpoint else
                  "no checkpoint was written (this strategy cannot write one)")
        return cls(f"zerolab: stopped after step {done} of {max_steps} on {why}; checkpoint {checkpoint or '(none)'}; "
                   f"{resume}")


class StopRequest:
    """Process-wide: which stop signal arrived (None if none). Installed once, early."""

    signal_name: str | None = None
    _installed = False

    @classmethod
    def install(cls) -> None:
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
        # os.write: no locks taken inside a signal handler (print/logging could deadlock).
        os.write(2, f"zerolab: rank {os.environ.get('RANK', '0')} got {name}; stopping after this step "
                    f"with a checkpoint\n".encode())

    @classmethod
    def agreed(cls, world_size: int, host_group=None) -> bool:
        """Collective: True on every rank if any rank was asked to stop. A CPU tensor on the
        host group (DistContext.host_group): reading it back never waits for the device, so the
        per-step check does not stall the CPU behind the step's kernels."""
        flag = cls.signal_name is not None
        if world_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group)
        return bool(t.item())
