"""The multi-rank tier without torchrun: real ranks, real gloo, forked from a warm server.

A torchrun job of train.py spends most of a short test's time starting: the agent and every rank
start an interpreter and import torch, Hydra and zerolab (4-6 s on this machine's 2 cores)
before the first step. `train(run_dir, nproc, *overrides)` runs the same job (zerolab.job.run on
the config train.py would compose) as `nproc` real processes on a real gloo group, forked from a
forkserver that imported all of that once per pytest session, so a job costs its own work plus
a fork and a rendezvous.

What it does not do is be torchrun: no agent, no restarts, no signal forwarding, no exit-code
summary. Tests of those (tests/test_fault.py, test_preempt.py, test_launch.py, test_guards.py's
messages) keep starting torchrun; tests of what the ranks compute (parity, memory, resume,
resharding) run here. The ranks' output goes to <run_dir>/../<name>.rank<r>.log, and a failure
shows it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest

# Imported once by the forkserver; every rank forked from it starts with them loaded.
PRELOAD = ["torch", "torch.distributed", "hydra", "omegaconf", "numpy", "safetensors.torch",
           "zerolab.job", "zerolab.trainer", "zerolab.config", "zerolab.strategies.ddp",
           "zerolab.strategies.zero.stages", "zerolab.strategies.zero.stage3", "zerolab.strategies.fsdp",
           "zerolab.strategies.torch_zero"]
_context = None


def _ctx():
    global _context
    if _context is None:
        # torch reads its thread count when the forkserver imports it: one per rank, as under
        # torchrun (conftest.base_env), or the ranks' sums would run in another order.
        os.environ["OMP_NUM_THREADS"] = "1"
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def free_port() -> int:
    """A port nothing listens on, for a job's rendezvous, drawn below the kernel's ephemeral range.
    bind(0) draws from that range, which is also where every outgoing connection (gloo's pairs,
    the other pytest worker's jobs) takes its source port: a port found free there can be taken
    again before rank 0's store listens on it (seen once: EADDRINUSE under a CPU-heavy job)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default start of the range
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, env: dict, overrides: list[str], log: str,
               target: str | None = None) -> None:
    """One rank: the launcher's variables, output to its log file, then what train.py runs (or
    `target`, "module:function", called with `overrides`)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    # The forkserver's sys.path was fixed when it started: a PYTHONPATH given to this job (a
    # model=custom module) goes in front, as a fresh interpreter would put it.
    import sys

    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import logging

    from zerolab.config import compose
    from zerolab.errors import ConfigError, ZerolabError, report
    from zerolab.job import run

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        if target is None:
            run(compose(overrides))
        else:
            import importlib

            module, function = target.split(":")
            getattr(importlib.import_module(module), function)(overrides)
    except (ConfigError, ZerolabError) as err:
        sys.stdout.flush()
        os._exit(report(err, quiet=getattr(err, "reported", False)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(run_dir: Path, nproc: int, *overrides: str, check: bool = True, env: dict | None = None,
          timeout: float = 300) -> list[int]:
    """Run train.py's job with `nproc` ranks into run_dir; returns the ranks' exit codes. With
    `check`, a rank that fails fails the test with every rank's output."""
    args = [f"run.dir={run_dir}", "logging.wandb.mode=disabled", "logging.progress=false", *overrides]
    return _launch(Path(run_dir), nproc, args, check=check, env=env, timeout=timeout)


def call(log_dir: Path, nproc: int, target: str, *args: str, timeout: float = 300) -> list[int]:
    """`target` ("module:function", importable from tests/) called with the list `args` on each of
    `nproc` real gloo ranks forked as train() forks them (the launcher's variables set, the
    process group not yet made): for tests that drive the Trainer themselves, several runs in one
    launch. The ranks' output goes to <log_dir>.rank<r>.log; a rank that fails fails the test."""
    return _launch(Path(log_dir), nproc, list(args), check=True, env=None, timeout=timeout, target=target)


def _launch(run_dir: Path, nproc: int, args: list[str], *, check: bool, env: dict | None, timeout: float,
            target: str | None = None) -> list[int]:
    from conftest import base_env

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    job_env = {k: v for k, v in base_env(**(env or {})).items() if k not in os.environ or os.environ[k] != v}
    logs = [str(run_dir.parent / f"{run_dir.name}.rank{r}.log") for r in range(nproc)]
    for _attempt in range(3):  # a port taken between its choice and rank 0's listen: another port
        port, ctx = free_port(), _ctx()
        procs = [ctx.Process(target=_rank_main, args=(r, nproc, port, job_env, args, logs[r], target), daemon=True)
                 for r in range(nproc)]
        for p in procs:
            p.start()
        codes = _wait(procs, timeout)
        if not (codes[0] and "EADDRINUSE" in Path(logs[0]).read_text()):
            break
    if check and any(codes):
        output = "\n".join(f"--- rank {r} (exit {c}) ---\n{Path(logs[r]).read_text()[-5000:]}"
                           for r, c in enumerate(codes))
        pytest.fail(f"ranks failed ({codes}): {' '.join(args)}\n{output}")
    return codes


def _wait(procs, timeout: float) -> list[int]:
    """Exit codes, once every rank has exited. A rank that fails ends the job: the others get
    SIGTERM after a short grace (they would otherwise wait in a collective for dist.timeout_s);
    past `timeout` all are killed."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.is_alive() for p in procs):
        for p in procs:
            p.join(timeout=0.2)
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 10:
            _signal_all(procs, signal.SIGTERM)
        if time.monotonic() > deadline:
            _signal_all(procs, signal.SIGKILL)
            for p in procs:
                p.join()
            pytest.fail(f"ranks still running after {timeout:.0f} s")
    return [p.exitcode for p in procs]


def _signal_all(procs, sig) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, sig)
