"""Failures zerolab can explain to a person, and how they are shown.

A `ZerolabError` is a runtime failure whose message already says what happened, to which path or
rank, and what to do (disk full during a save, every checkpoint corrupt, a held run directory).
train.py prints such a message as one paragraph and exits non-zero without a Python traceback;
set ZEROLAB_DEBUG=1 to see the traceback too. Configuration mistakes are `ConfigError`
(zerolab.config) and exit with code 2.
"""
from __future__ import annotations

import os


class ZerolabError(RuntimeError):
    """A failure with a message that names the problem and the fix; shown without a traceback."""

    exit_code = 1


def debug_enabled() -> bool:
    """ZEROLAB_DEBUG=1: show tracebacks for failures zerolab otherwise explains in one paragraph."""
    return os.environ.get("ZEROLAB_DEBUG", "") not in ("", "0")
