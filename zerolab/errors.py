"""Failures zerolab can explain to a person, and how they are shown.

A `ZerolabError` is a runtime failure whose message already says what happened, to which path or
rank, and what to do (disk full during a save, every checkpoint corrupt, a held run directory).
train.py prints such a message as one paragraph and exits non-zero without a Python traceback;
set ZEROLAB_DEBUG=1 to see the traceback too. Configuration mistakes are `ConfigError` and exit
with code 2. Both live here, at the bottom of zerolab's layers, so every module can raise them.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix. Exit code 2."""

    same_on_every_rank = False  # see ZerolabError


class ZerolabError(RuntimeError):
    """A failure with a message that names the problem and the fix; shown without a traceback."""

    exit_code = 1
    # True when every rank raises the same error at the same point (one rank decided and shared
    # it): then zerolab.job.run has rank 0 alone print it. Otherwise each rank that raises an
    # error prints it.
    same_on_every_rank = False


class CheckpointError(ZerolabError):
    """A checkpoint that cannot be used; the message names the file and the mismatch."""


def say(line: str) -> None:
    """`line` and its newline on stderr in one write. Every rank under torchrun or srun shares the
    launcher's pipe, and print() on Python's unbuffered stderr writes the text and the newline as
    two writes, so two ranks speaking at once cut into each other's lines (one rank's verdict then
    starts in the middle of another's line). One write call of the whole line leaves the stream as
    one write of the pipe, which POSIX keeps whole up to PIPE_BUF (4096 bytes on Linux)."""
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def debug_enabled() -> bool:
    """ZEROLAB_DEBUG=1: show tracebacks for failures zerolab otherwise explains in one paragraph."""
    return os.environ.get("ZEROLAB_DEBUG", "") not in ("", "0")


def report(err: BaseException, quiet: bool = False) -> int:
    """Print an explained failure (ZerolabError or zerolab.config.ConfigError) as one paragraph
    on stderr, after its traceback only under ZEROLAB_DEBUG=1, unless it was reported already or
    `quiet`; returns the exit code: 2 for a configuration error, else the error's exit_code."""
    config = isinstance(err, ConfigError)
    if not quiet and not getattr(err, "reported", False):
        if debug_enabled():
            traceback.print_exception(err)
        text = str(err)  # a message that already speaks as zerolab (a preemption) is not an "error"
        prefix = "" if text.startswith("zerolab:") else f"zerolab: {'configuration error' if config else 'error'}: "
        say(prefix + text)
    err.reported = True
    return 2 if config else getattr(err, "exit_code", 1)


def launch_rank() -> int:
    """This process's rank as its launcher set it (torchrun's RANK, srun's SLURM_PROCID), known
    before any process group exists; 0 for a single process."""
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


# How long a rank other than 0 waits for its launcher to stop it after a failure every rank met
# alike (see exit_for). Only a launcher that never stops the other ranks makes it wait this long.
WAIT_FOR_LAUNCHER_S = 60.0


def exit_for(err: BaseException, every_rank_alike: bool = False, signalled: bool = False) -> None:
    """Exit for an explained failure (ZerolabError, zerolab.config.ConfigError), said once per job.

    `every_rank_alike`: every rank meets this failure the same way: before the ranks can talk (a
    configuration error, found before the process group exists), or shared by a collective (rank
    0 has printed it already: zerolab.job.run). Rank 0 alone prints it. The other ranks print
    nothing and wait for their launcher to stop them, which it does once rank 0 has exited
    (torchrun, srun --kill-on-bad-exit), then exit with the same code: leaving first would make the
    launcher stop the job, rank 0 perhaps before its message was out, and a rank the launcher stops
    before it exits would show the launcher's signal instead of the error's code.

    `signalled`: this rank got its stop signal already (zerolab.run.preempt: a preemption, or the
    launcher stopping the job). A launcher signals each worker once (torchrun's shutdown sends one
    SIGTERM, then SIGKILLs after --shutdown-timeout): a rank that waited for a second would wait
    out that whole grace period and die by SIGKILL. It exits at once instead; the stop it got is
    the one the wait is for."""
    quiet = every_rank_alike and launch_rank() != 0
    code = report(err, quiet=quiet)
    if quiet and not signalled:
        stop = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # delivered to sigtimedwait, not to a handler
        signal.sigtimedwait(stop, WAIT_FOR_LAUNCHER_S)
        sys.stdout.flush()
        os._exit(code)
    # This rank has said why it stops (or rank 0 has) and exits with that code. A launcher that saw
    # another rank exit first sends the rest a SIGTERM; Python's finalization resets its handlers to
    # the default action, so a SIGTERM arriving there would turn this rank's code into -15 (3 ranks
    # stopping together on a preemption showed 75, -15, -15). An ignored signal stays ignored
    # through finalization. A rank that hangs on the way out is still SIGKILLed.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)
