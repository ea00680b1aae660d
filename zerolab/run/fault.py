"""Failing on purpose, and naming the rank that failed.

Steps are counted as metrics.jsonl counts them: step N is the N-th optimizer step, the one whose
record says "step": N (profile.steps counts the same way). The trainer's loop index is 0-based;
every method here that takes `step` takes that index and compares `step + 1` with the setting.

Fault injection (`fault.kill_rank=R fault.at_step=N fault.mode=exit|raise|hang`) makes rank R
fail just before it starts step N (after N-1 completed steps). `fault.mode=stop` instead
freezes rank R *inside* step N with SIGSTOP, in `fault.phase` (forward, backward: from a hook
while autograd runs, or optimizer), as a deadlocked kernel or a frozen node would. Faults fire
only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT=0), so a group that
torchrun restarts resumes and finishes instead of failing again.
`fault.slow_rank=R fault.slow_ms=M fault.at_step=N` makes rank R a straggler instead: it spends M
ms of host time inside step N, before its first forward (in every attempt; profile.steps=[N]
shows the others waiting for it, zerolab/profile/). `fault.inf_grad_step=N` puts an inf into
rank fault.inf_grad_rank's gradients in step N (its record says "skipped": true under fp16).
`fault.slow_save_s=S` makes every checkpoint save take S seconds longer on every rank (in every
attempt): a slow checkpoint directory, to rehearse a stop whose save outlasts a launcher's grace
period (launch/slurm.sbatch's stop budget; tests/test_slurm.py).

When a rank stops, the others wait in their next collective until dist.timeout_s and then get an
error from gloo/NCCL that says "timed out" or "connection closed" but not *who* stopped. Every
rank therefore posts where it is (step and phase, a few small writes per step) to the job's
key-value store, and a heartbeat thread bumps a counter every `interval` seconds while the
process lives. A rank whose collective fails reads the board: a rank whose heartbeat no longer
moves (frozen or dead) or that is steps behind is named, with the step and phase it was in.
A frozen rank on this host is killed so that the launcher need not wait for it, but only when
the process is provably the one that posted: same host, same boot, same pid and the same
process start time (a pid is reused once its process is gone; a host name can be shared).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from zerolab.schema import RECORD_CUT, FaultConfig
from zerolab.errors import ZerolabError, debug_enabled, say
from zerolab.run.preempt import StopRequest

log = logging.getLogger("zerolab")


class InjectedFault(RuntimeError):
    pass


class RankStopped(RuntimeError):
    """A collective failed because another rank stopped; the message names that rank. Said once per
    job: `said_by` is the rank whose verdict this is when another rank posted it first (then this
    rank says only that it stops too)."""

    said_by: "int | None" = None
    rank: "int | None" = None


def position(step: "int | None", phase: str) -> str:
    """Where a rank is, in metrics.jsonl's step numbers (`step`: the loop's 0-based index)."""
    if step is None or step < 0:
        return "before its first step"
    if phase == DONE:
        return f"after step {step + 1}, before step {step + 2} began"
    return f"in step {step + 1} ({phase})"


DONE = "done"  # the phase a rank posts once its step is over (Instruments.advance)
SAVING = "checkpoint"  # the phase a rank posts while it writes a checkpoint (Trainer.save)
VERDICT = "verdict"  # the board's key for the job's one verdict on who stopped (first rank to post wins)


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class FaultInjector:
    def __init__(self, cfg: FaultConfig, rank: int, world_size: int):
        """`cfg` was validated (zerolab.config: modes, phases, kill_rank < world_size, steps >= 1)."""
        self.cfg, self.rank = cfg, rank
        self.armed = cfg.kill_rank == rank and cfg.at_step >= 1 and restart_count() == 0
        self.slowed = -1  # the step a slow rank was last slowed in (fault.slow_rank: once per step)

    def _stop_now(self, step: int, phase: str) -> None:
        say(f"zerolab fault injection: rank {self.rank} stops itself (SIGSTOP) in step {step} ({phase})")
        os.kill(os.getpid(), signal.SIGSTOP)

    def in_phase(self, step: int, phase: str, loss: "torch.Tensor | None" = None) -> None:
        """fault.mode=stop: freeze in this phase of the chosen step. For backward, `loss` gets a
        hook, so the process stops while autograd is running, not before it starts. `step`: the
        loop's 0-based index (step + 1 is the step's number)."""
        n = step + 1
        if phase == "forward" and self.rank == self.cfg.slow_rank and n == self.cfg.at_step != self.slowed:
            self.slowed = n  # the first micro-batch's forward only
            time.sleep(self.cfg.slow_ms / 1000)  # host time inside the step: a straggler (fault.slow_rank)
        if not self.armed or self.cfg.mode != "stop" or n != self.cfg.at_step or phase != self.cfg.phase:
            return
        self.armed = False  # once (a hook on every micro-batch's loss would fire again)
        if phase == "backward" and loss is not None and loss.requires_grad:
            loss.register_hook(lambda grad: self._stop_now(n, phase))
        else:
            self._stop_now(n, phase)

    def in_save(self) -> None:
        """fault.slow_save_s: this rank's checkpoint save takes that much longer (a slow disk)."""
        if self.cfg.slow_save_s > 0:
            say(f"zerolab fault injection: rank {self.rank}'s save takes {self.cfg.slow_save_s:g} s longer "
                f"(fault.slow_save_s)")
            time.sleep(self.cfg.slow_save_s)

    def poison(self, loss: "torch.Tensor", step: int) -> "torch.Tensor":
        """fault.inf_grad_step: this rank's last backward of that step carries inf (call it with the
        last micro-batch's loss and the loop's 0-based index), so its gradients are non-finite
        before the reduction and every rank sees the overflow. Every other step: the loss as it is."""
        if step + 1 == self.cfg.inf_grad_step and self.rank == self.cfg.inf_grad_rank:
            return loss * float("inf")
        return loss

    def in_record_cut(self) -> None:
        """fault.phase=record_cut: exit while the resume's cut of the record is half done (its
        temporary file written, not yet renamed over metrics.jsonl)."""
        if self.armed and self.cfg.phase == RECORD_CUT:
            say(f"zerolab fault injection: rank {self.rank} exits while cutting the record back")
            os._exit(1)

    def before_step(self, step: int) -> None:
        """fault.mode=exit|raise|hang: fail before step fault.at_step starts (`step`: the loop's
        0-based index of the step about to start)."""
        n = step + 1
        if not self.armed or n != self.cfg.at_step or self.cfg.mode == "stop" or self.cfg.phase == RECORD_CUT:
            return
        msg = f"zerolab fault injection: rank {self.rank} fails before step {n} (fault.mode={self.cfg.mode})"
        say(msg)
        if self.cfg.mode == "exit":
            os._exit(1)  # no cleanup, no exception: as abrupt as a killed process
        if self.cfg.mode == "raise":
            raise InjectedFault(msg)
        threading.Event().wait()  # hang: blocks until the launcher kills the process


def stop_now(err: BaseException) -> None:
    """A peer stopped mid-collective: print the verdict and exit at once. Tearing down a process
    group whose peer is gone (destroy_process_group, the store client, interpreter exit) can take
    seconds or wait for another timeout, and nothing is left to save: the job ends now."""
    if debug_enabled():
        traceback.print_exception(err)
    said_by = getattr(err, "said_by", None)
    if said_by is not None:  # another rank said the verdict: one line here, not the paragraph again
        say(f"zerolab: rank {err.rank} stops too (rank {said_by} named the rank that stopped)")
    else:
        say(f"{type(err).__name__}: {err}")
    sys.stdout.flush()
    os._exit(1)


def _stat_fields(pid: int) -> "list[str] | None":
    """/proc/<pid>/stat from field 3 (state) on, None if the process is gone. The command name
    (field 2) is in parentheses and may hold spaces: the fields start after the last ')'."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> "str | None":
    """The one-letter state of a process on this host (R, S, D, T, Z, ...), None if it is gone."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in "ZX":
        return None
    return fields[0]


def process_start(pid: int) -> "int | None":
    """When the process started, in clock ticks since boot (/proc/<pid>/stat field 22): with the
    boot id, what tells this process from a later one that got the same pid."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 is the 20th after the state (field 3)
    except (IndexError, ValueError):
        return None


def boot_id() -> str:
    """This boot of this machine (a random id the kernel makes at boot); "?" without /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or "?"
    except OSError:
        return "?"


def identity(pid: int) -> str:
    """"<start ticks> <boot id>" of a process on this machine ("? ?" where /proc cannot tell)."""
    start = process_start(pid)
    return f"{start if start is not None else '?'} {boot_id()}"


def local_verdict(posted: dict, host: str) -> "str | None":
    """What this host can tell of the rank that posted `posted` (its host, pid, start, boot):
    "exited" (its process is gone: the pid is free or now another process's), "frozen" (stopped
    by a signal or a debugger: state T), or None (running, or not a process this host can see:
    another machine, perhaps one with the same host name, or no /proc)."""
    pid, start, boot = posted.get("pid"), posted.get("start"), posted.get("boot")
    if posted.get("host") != host or not pid or start is None or boot in (None, "?") or boot != boot_id():
        return None  # not provably this machine's process: never signal it
    if process_start(pid) != start:
        return "exited"  # the pid is free, or a later process has it
    state = process_state(pid)
    return "exited" if state is None else "frozen" if state in "Tt" else None


class ProgressBoard:
    """Where each rank is (step, phase) and whether it is alive (a heartbeat counter), in the
    launcher's store, to name the rank that stopped.

    Keys (prefix zerolab/progress/): `<r>` = "step phase" (the loop's 0-based index; messages
    name it step + 1, as metrics.jsonl does), `hb/<r>` = heartbeat counter, `who/<r>` =
    "host pid start boot" (zerolab.run.fault.identity). A frozen process (SIGSTOP, a debugger, a
    node that stopped scheduling it) freezes its heartbeat thread too; a busy one (a long kernel,
    a collective) keeps beating.
    """

    def __init__(self, rank: int, world_size: int, store: "dist.Store | None", timeout_s: float = 300.0):
        self.rank, self.world, self.step, self.phase = rank, world_size, -1, "setup"
        self.timeout_s, self.changed = timeout_s, time.monotonic()
        self.store = dist.PrefixStore("zerolab/progress/", store) if store is not None and world_size > 1 else None
        # Fine enough that blame() needs ~3 beats (a second or two), coarse enough to cost nothing.
        self.interval = min(1.0, max(0.1, timeout_s / 20))
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread = None
        if self.store is not None:
            self.store.set(f"who/{rank}", f"{self.host} {os.getpid()} {identity(os.getpid())}")
            self._thread = threading.Thread(target=self._beat, name="zerolab-heartbeat", daemon=True)
            self._thread.start()
            # A board nobody closed (a Trainer used from a script) must not leave its thread inside
            # a store call while the interpreter shuts down: that aborts the process ("terminate
            # called without an active exception"). atexit runs before the shutdown.
            atexit.register(self.close)

    def _beat(self) -> None:
        store = self.store
        while not self._stop.wait(self.interval):
            stuck = time.monotonic() - self.changed
            if StopRequest.signal_name is not None and stuck > self.timeout_s and self.phase != SAVING:
                # Asked to stop (torchrun's SIGTERM after a peer failed, or a preemption), but this
                # rank's main thread has not moved for longer than any peer waits for it: it is
                # hung, and the stop it was asked for will never come. End it now rather than after
                # the launcher's grace period. Not while it saves: a large checkpoint's write may
                # outlast dist.timeout_s and is what the stop is for (the save's own collectives
                # still time out; the launcher's stop budget bounds the rest).
                say(f"zerolab: rank {self.rank} got {StopRequest.signal_name} but has been stuck {self._where()} "
                    f"for {stuck:.0f} s (> dist.timeout_s); exiting")
                os._exit(1)
            try:
                store.add(f"hb/{self.rank}", 1)
            except Exception:  # the store went down with the job; nothing left to report to
                return

    def close(self) -> None:
        """Stop the heartbeat and drop the store: a store client destroyed during interpreter
        shutdown can abort it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.store = None

    def _where(self) -> str:
        return position(self.step, self.phase)

    def at(self, step: int, phase: str) -> None:
        """This rank entered `phase` of `step` (the loop's 0-based index; one small store write)."""
        self.step, self.phase, self.changed = step, phase, time.monotonic()
        if self.store is not None:
            self.store.set(str(self.rank), f"{step} {phase}")

    def _read(self) -> dict[int, dict]:
        """Every other rank's posted position, heartbeat, host and pid."""
        out = {}
        for r in range(self.world):
            if r == self.rank:
                continue
            pos = self.store.get(str(r)).decode().split() if self.store.check([str(r)]) else []
            who = self.store.get(f"who/{r}").decode().split() if self.store.check([f"who/{r}"]) else []
            beats = self.store.add(f"hb/{r}", 0)
            start = who[2] if len(who) > 2 else "?"
            out[r] = {"step": int(pos[0]) if pos else None, "phase": pos[1] if len(pos) > 1 else "setup",
                      "host": who[0] if who else "?", "pid": int(who[1]) if len(who) > 1 else None,
                      "start": int(start) if start.isdigit() else None, "boot": who[3] if len(who) > 3 else None,
                      "beats": beats}
        return out

    def stalled(self) -> list[tuple[int, dict, str]]:
        """Ranks that are frozen or dead (heartbeat still over three beats) or behind this one."""
        before = self._read()
        time.sleep(3 * self.interval)  # three beats: a live rank's counter moves in this time
        after = self._read()
        out = []
        for r, now in after.items():
            if now["beats"] == before[r]["beats"]:
                out.append((r, now, "stopped responding"))
            elif now["step"] is None or now["step"] < self.step:
                out.append((r, now, "fell behind"))
        return out

    def blame(self, err: BaseException) -> None:
        """Raise RankStopped naming the ranks that stopped, if any; otherwise return. A frozen
        (SIGSTOPped) rank on this host is killed, so that the launcher does not wait its grace
        period for it. Every survivor judges at once, and the first verdict posted to the board is
        the job's: a rank that finds one posted stops quietly (RankStopped.said_by)."""
        if self.store is None or isinstance(err, (RankStopped, InjectedFault, ZerolabError)):
            return
        # This rank beats until its verdict is posted: another judging survivor would otherwise name
        # it as a rank that stopped responding.
        try:
            self._judge(err)
        finally:
            self._stop.set()

    def _judge(self, err: BaseException) -> None:
        try:
            # The job is failing: a store that is itself gone must not add another full timeout.
            self.store.set_timeout(datetime.timedelta(seconds=max(2.0, 5 * self.interval)))
            if self.store.check([VERDICT]):
                raise self._said_already(err)
            found = self.stalled()
            if not found:
                return
            named = self._verdict(err, found)
            posted = self.store.compare_set(VERDICT, "", str(named)).decode()
        except RankStopped:
            raise
        except Exception:  # the store went down with the job: keep the original error
            return
        if posted != str(named):
            raise self._said_already(err)
        raise named from err

    def _said_already(self, err: BaseException) -> RankStopped:
        """Another rank has named who stopped (and says it): this one stops too, quietly."""
        said = self.store.get(VERDICT).decode()
        found = re.match(r"rank (\d+) was", said)
        out = RankStopped(f"rank {self.rank} stops too: {said}")
        out.said_by, out.rank = (int(found.group(1)) if found else -1), self.rank
        out.__cause__ = err
        return out

    def _verdict(self, err: BaseException, found: list) -> RankStopped:
        """RankStopped naming the ranks `found` stalled: where each was and what became of it."""
        parts = []
        for r, s, what in found:
            where = position(s["step"], s["phase"])
            verdict = local_verdict(s, self.host)
            if verdict == "exited":
                what = "exited"
            elif verdict == "frozen":
                # This job's rank (the very process that posted: host, boot, pid and start time
                # match), frozen: it cannot act on the launcher's SIGTERM, and torchrun would wait
                # its whole grace period (30 s) before SIGKILL. The job is over; end it now. (A
                # rank that is alive but stuck ends itself on that SIGTERM: ProgressBoard._beat.)
                os.kill(s["pid"], signal.SIGKILL)
                what = "frozen (stopped by a signal or a debugger); killed"
            parts.append(f"rank {r} {where}: {what} [pid {s['pid']} on {s['host']}]")
        verb = "timed out" if "timed out" in str(err).lower() or "timeout" in str(err).lower() else "failed"
        return RankStopped(f"rank {self.rank} was {self._where()} when its collective {verb}; "
                           f"stopped: {'; '.join(parts)}. A rank that dies or hangs ends the job within "
                           f"dist.timeout_s. Original error: {str(err).strip()[:300]}")
