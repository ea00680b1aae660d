"""Failures zerolab can explain to a person, and how they are shown.

A `ZerolabError` is a runtime failure whose message already says what happened, to which path or
rank, and what to do (disk full during a save, every checkpoint corrupt, a held run directory).
train.py prints such a message as one paragraph and exits non-zero without a Python traceback;
set ZEROLAB_DEBUG=1 to see the traceback too. Configuration mistakes are `ConfigError`
(zerolab.config) and exit with code 2.
"""
from __future__ import annotations

import os
import sys
import traceback


class ZerolabError(RuntimeError):
    """A failure with a message that names the problem and the fix; shown without a traceback."""

    exit_code = 1
    # True when every rank raises the same error (decided on one rank and shared): then rank 0
    # alone prints it. A failure seen by one rank only is printed by that rank.
    same_on_every_rank = False


def debug_enabled() -> bool:
    """ZEROLAB_DEBUG=1: show tracebacks for failures zerolab otherwise explains in one paragraph."""
    return os.environ.get("ZEROLAB_DEBUG", "") not in ("", "0")


def launcher_rank() -> int:
    """This process's rank as the launcher set it (torchrun, or srun without torchrun); 0 alone."""
    if os.environ.get("RANK"):
        return int(os.environ["RANK"])
    if os.environ.get("SLURM_PROCID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_PROCID"])
    return 0


def report(err: BaseException) -> int:
    """Print an explained failure (ZerolabError or zerolab.config.ConfigError) as one paragraph
    on stderr, with the traceback first under ZEROLAB_DEBUG=1; returns the exit code to use."""
    from zerolab.config import ConfigError

    config = isinstance(err, ConfigError)
    if launcher_rank() == 0 or not getattr(err, "same_on_every_rank", False):
        if debug_enabled():
            traceback.print_exception(err)
        print(f"zerolab: {'configuration error' if config else 'error'}: {err}", file=sys.stderr, flush=True)
    return 2 if config else getattr(err, "exit_code", 1)
