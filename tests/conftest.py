"""Shared helpers: launch real torchrun jobs of train.py (real processes, real gloo)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# ---- tiers ------------------------------------------------------------------------------------
# `make test-fast` runs `pytest -m "not slow"`: unit and in-process tests only. A test that starts
# any process (torchrun, python, sbatch, g++ through DeepSpeed's op builder) belongs to the slow
# tier and must say so with @pytest.mark.slow (or a module-level `pytestmark`). The guard below
# makes a mislabelled test fail in every tier, so the fast tier cannot quietly grow slow.
_spawn_allowed = True
_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, *args, **kwargs):
    if not _spawn_allowed:
        raise RuntimeError("this test starts a process but is not marked @pytest.mark.slow; mark it "
                           "(the fast tier, `make test-fast`, runs in-process tests only)")
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init

# matplotlib builds its font cache on first use by running `fc-list` (a process): build it now,
# while starting processes is allowed, so an in-process test that draws a figure stays in-process.
import matplotlib.font_manager  # noqa: E402,F401


# The slow tier's longest files (by their tests' durations in the 2026-12-05 quiet run), collected
# first: `make test`'s two workers take one file at a time in collection order, and a long file
# taken last keeps one worker busy after the other has nothing left (5 minutes of test_readme_runs
# alone at the end of that run). The rest keep their order; so does each file's own.
LONGEST_FIRST = ("test_resume_matrix.py", "test_readme_runs.py", "test_slurm.py", "test_predict_runs.py",
                 "test_choosing.py", "test_resume_strategies.py", "test_profile_runs.py", "test_zero.py",
                 "test_master_runs.py", "test_offload.py", "test_models_runs.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # a stable sort


def pytest_runtest_setup(item):
    # Runs before any fixture of the item, module-scoped ones included.
    global _spawn_allowed
    _spawn_allowed = item.get_closest_marker("slow") is not None


def pytest_runtest_teardown(item, nextitem):
    global _spawn_allowed
    _spawn_allowed = True  # fixtures' teardown and collection may spawn freely


def run_linter(cmd: list[str]) -> str:
    """The one process a fast test may start: the linter's own binary (ruff, a compiled tool that
    checks the tree in well under a second), not a Python or torchrun process. Returns what it
    printed."""
    global _spawn_allowed
    was, _spawn_allowed = _spawn_allowed, True
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        _spawn_allowed = was
    return (done.stdout + done.stderr).strip()


# pytest-timeout kills a test at 600 s (pyproject.toml). Every process a test starts has a deadline
# below it, so the test fails with the process's output, and the whole process group goes with it
# (a torchrun agent's workers included) instead of outliving the test.
MAX_PROCESS_S = 540


def run_process(cmd: list[str], *, timeout: float, env: dict | None = None, cwd: Path = ROOT,
                input: str | None = None) -> subprocess.CompletedProcess:
    """subprocess.run in its own process group, with a deadline (at most MAX_PROCESS_S) after
    which the whole group is killed and the test fails with what it printed."""
    import signal

    assert timeout <= MAX_PROCESS_S, f"timeout={timeout} s: keep it under pytest's own limit"
    proc = subprocess.Popen(cmd, cwd=cwd, env=env if env is not None else base_env(), text=True, start_new_session=True,
                            stdin=subprocess.PIPE if input is not None else None, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} still running after {timeout:.0f} s (process group killed):\n"
                    f"{out[-4000:]}\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class Output:
    """A process's output, read by a thread, so that every wait on it has a deadline: `until(text)`
    returns once `text` has appeared, `rest()` once the writer has closed it; either fails the test
    after `timeout` seconds with what was read. The source is a pipe (a Popen's stdout, text mode)
    or the path of a FIFO, opened in the thread (an open blocks until the writer opens it; a
    writer that never comes leaves only that daemon thread waiting). `cleanup` runs before a
    failed wait fails the test (to kill the job that did not say what was waited for)."""

    def __init__(self, source, timeout: float = 240, cleanup=None):
        import queue
        import threading

        self.timeout, self.chunks, self._queue, self._matched = timeout, [], queue.Queue(), 0
        self._cleanup = cleanup
        threading.Thread(target=self._read, args=(source,), daemon=True).start()

    def _read(self, source) -> None:
        try:
            if isinstance(source, (str, Path)):
                with open(source, "rb", buffering=0) as fifo:
                    while chunk := fifo.read(4096):
                        self._queue.put(chunk.decode(errors="replace"))
            else:
                for line in source:
                    self._queue.put(line)
        finally:
            self._queue.put(None)  # the end of the output

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def _fail(self, message: str):
        if self._cleanup is not None:
            self._cleanup()
        pytest.fail(message)

    def _next(self, deadline: float, waiting_for: str):
        import queue
        import time

        try:
            return self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self._fail(f"no {waiting_for} within the deadline; output so far:\n{self.text[-6000:]}")

    def until(self, text: str, timeout: float | None = None) -> None:
        """Waits for `text` after the end of the last match (a second wait for the same line waits
        for its next appearance)."""
        import time

        deadline = time.monotonic() + (timeout or self.timeout)
        while (found := self.text.find(text, self._matched)) < 0:
            chunk = self._next(deadline, repr(text))
            if chunk is None:
                self._fail(f"the output ended before {text!r}:\n{self.text[-6000:]}")
            self.chunks.append(chunk)
        self._matched = found + len(text)

    def rest(self, timeout: float | None = None) -> str:
        import time

        deadline = time.monotonic() + (timeout or self.timeout)
        while (chunk := self._next(deadline, "end of the output")) is not None:
            self.chunks.append(chunk)
        return self.text


def assert_stopped_in_time(text: str, *, stops: int = 1) -> None:
    """A job stopped by a signal ended by its ranks' own hand: every worker exited before its launcher's
    grace period ran out (torchrun says "forcefully exiting via 9" when it had to SIGKILL one; Slurm's
    KillWait would show as a killed step), and the stop was said `stops` time(s)."""
    assert "forcefully exiting" not in text and "Unable to shutdown process" not in text, text[-6000:]
    # (launch/torchrun.sh tees each rank's lines behind torchrun's "[default<r>]:")
    said = re.findall(r"^(?:\[default\d+\]:)?zerolab: stopped after step", text, re.MULTILINE)
    assert len(said) == stops, text[-6000:]


def bench_module(name: str):
    """A script of bench/ imported as a module (bench/ is not a package; its scripts import
    zerolab themselves), without leaving bench/ on the path."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def base_env(**extra) -> dict:
    env = dict(os.environ)
    fixed_corpus()
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
                "HYDRA_FULL_ERROR": "1", "ZEROLAB_CACHE": str(TEST_CACHE)})
    env.update(extra)
    return env


@pytest.fixture
def one_rank(monkeypatch):
    """A one-process gloo group (in-memory store): real collectives, no launcher, no process."""
    from zerolab import dist as zdist
    from zerolab.config import DistConfig

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    ctx = zdist.init(DistConfig(device="cpu"))
    yield ctx
    zdist.shutdown(ctx)


def missing(reason: str) -> None:
    """A prerequisite this machine lacks (Slurm, root for a tmpfs, DeepSpeed's built ops): outside
    CI the test skips naming it; on CI (CI=true) the suite fails naming it, since CI must have
    everything and a skip there would read as a pass."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and a prerequisite is missing: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def deepspeed_ops():
    """DeepSpeed tests need its CPU ops built at install (zerolab/ds_ops.py): a first-use compile
    inside a test would take minutes, or wait forever behind a stale build lock. DeepSpeed itself
    is pinned: it is imported, and a broken install fails the test."""
    import deepspeed  # noqa: F401  (a pinned dependency: an ImportError is a failure, not a skip)

    from zerolab import ds_ops

    reason = ds_ops.missing_reason()
    if reason:
        missing(reason)


# ---- a corpus that is the same on every machine ----------------------------------------------
# zerolab's embedded corpus is the running interpreter's standard library, which differs between
# Python builds: a numeric bound checked on it would be checked on different text on each machine.
# Tests train on this one instead: sentences drawn from a fixed word list by splitmix64, a PRNG in
# plain integer arithmetic, so the bytes depend on nothing but this code. Every process a test
# starts gets ZEROLAB_CACHE pointing at a test cache whose "embedded corpus" file is this corpus,
# so train.py, launch scripts and Slurm jobs all read it without an override (data.path given
# explicitly still wins).
_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
          "but have an they you were her she there been one all we their has would when if so no will "
          "model rank shard gradient weight step batch memory optimizer state loss layer tensor bucket "
          "reduce gather scatter sum mean norm scale update master copy byte token window seed order").split()
CORPUS_BYTES = 1 << 20  # 1 MiB: ~16k windows of 64 tokens, far more than any test reads
TEST_CACHE = Path(tempfile.gettempdir()) / "zerolab-test-cache-v1"


def _splitmix64(state: int):
    while True:
        state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        yield z ^ (z >> 31)


def generated_corpus_bytes() -> bytes:
    rng, out, size = _splitmix64(20261130), [], 0
    while size < CORPUS_BYTES:
        n = 4 + next(rng) % 12
        words = [_WORDS[next(rng) % len(_WORDS)] for _ in range(n)]
        sentence = (" ".join(words).capitalize() + (". ", "? ", ".\n")[next(rng) % 3]).encode()
        out.append(sentence)
        size += len(sentence)
    return b"".join(out)[:CORPUS_BYTES]


def fixed_corpus() -> Path:
    """The generated test corpus as a zerolab token file (uint16 bytes), written once per machine,
    under the name zerolab.data gives the embedded corpus in TEST_CACHE."""
    import numpy as np

    from zerolab.data import EMBEDDED_NAME

    path = TEST_CACHE / EMBEDDED_NAME.format(*sys.version_info[:2])
    if path.exists() and path.stat().st_size == 2 * CORPUS_BYTES:
        return path
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    data = np.frombuffer(generated_corpus_bytes(), dtype=np.uint8).astype(np.uint16)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    data.tofile(tmp)
    os.replace(tmp, path)  # atomic: parallel test processes see the whole file or none
    return path


def run_train(run_dir: Path, nproc: int, *overrides: str, check: bool = True, env: dict | None = None,
              timeout: float = 300, torchrun: bool = False) -> subprocess.CompletedProcess:
    """train.py's job with `nproc` ranks into run_dir, on the fixed test corpus (base_env); fails the
    test with the output on error. By default the ranks run without torchrun (tests/ranks.py: real
    gloo ranks forked from a warm server, bitwise the job torchrun runs, without its start-up cost):
    the result's stdout is every rank's output (rank 0 first) and its returncode the first failing
    rank's exit code (0 when all succeeded). torchrun=True starts a real torchrun job, for tests of
    what torchrun itself does or prints (its exit code is 1 when a worker fails; the workers' own
    codes are in its summary)."""
    if not torchrun:
        codes = run_ranks(run_dir, nproc, *overrides, check=check, env=env, timeout=timeout)
        out = "".join(rank_log(run_dir, r) for r in range(nproc))
        return subprocess.CompletedProcess(["ranks", str(run_dir), *overrides], next((c for c in codes if c), 0),
                                           stdout=out, stderr="")
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "train.py"),
           f"run.dir={run_dir}", "logging.wandb.mode=disabled", "logging.progress=false",
           *overrides]
    proc = run_process(cmd, timeout=timeout, env=base_env(**(env or {})))
    if check and proc.returncode != 0:
        pytest.fail(f"train.py failed ({proc.returncode}): {' '.join(cmd)}\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_ranks(run_dir: Path, nproc: int, *overrides: str, **kwargs) -> list[int]:
    """train.py's job with `nproc` real gloo ranks, without torchrun (tests/ranks.py): for tests of
    what the ranks compute. Returns the ranks' exit codes; each rank's output is in
    <run_dir>.rank<r>.log beside the run directory."""
    import ranks

    return ranks.train(run_dir, nproc, *overrides, **kwargs)


def rank_log(run_dir: Path, rank: int = 0) -> str:
    return (Path(run_dir).parent / f"{Path(run_dir).name}.rank{rank}.log").read_text()


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`shared_run(nproc, *overrides)`: the run directory of that job, trained once per pytest
    invocation however many tests ask for it (a reference run several files compare against).
    The directory is shared: read it, never write into it (copy what you change)."""
    made: dict[tuple, Path] = {}

    def get(nproc: int, *overrides: str) -> Path:
        key = (nproc, *overrides)
        if key not in made:
            run = tmp_path_factory.mktemp("shared") / "run"
            run_ranks(run, nproc, *overrides)
            made[key] = run
        return made[key]
    return get


def run_python(*args: str, check: bool = True, timeout: float = 300, env: dict | None = None,
               cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = run_process([sys.executable, *args], cwd=cwd, env=base_env(**(env or {})), timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"python {' '.join(args)} failed ({proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def load_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))


def read_metrics(run_dir: Path) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def assert_same_weights(a: dict, b: dict, what: str) -> None:
    """Bitwise equal, tensor by tensor: for runs whose summation order is argued to be the same."""
    import torch

    assert a.keys() == b.keys(), f"{what}: different tensor names: {sorted(a.keys() ^ b.keys())}"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: not bitwise equal in {differ[:5]}"


def rel_l2_diff(a: dict, b: dict) -> float:
    """max over tensors of ‖a−b‖₂ / ‖b‖₂: the relative error of each tensor as a whole. Unlike an
    elementwise max it does not single out the few elements whose gradient is ~0, where Adam's
    normalised update turns last-bit summation differences into lr-sized steps."""
    assert a.keys() == b.keys(), f"different tensor names: {sorted(a.keys() ^ b.keys())}"
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)).item() for k in a)


# ---- wandb's offline run files, read back -----------------------------------------------------
# An offline run writes <dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb: wandb's protobuf
# Records in the LevelDB log format (a 7-byte file header ":W&B" + magic 0xBEE1 + version 0, then
# 32 KiB blocks of chunks, each with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST;
# a block's last < 7 bytes are zero padding). wandb 0.31 no longer ships a Python reader.
def _wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, parts = path.read_bytes(), 32768, 7, []
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # padding at the end of a block
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if length == 0 and kind == 0:
            break
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_offline_runs(run_dir: Path) -> list[dict]:
    """Every offline wandb run under run_dir/wandb, oldest first: its id, group, job type, and the
    `_step` and keys of each history row it logged."""
    runs = []
    for path in sorted((Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb")):
        run = {"path": path, "steps": [], "keys": set()}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, group=record.run.run_group, job_type=record.run.job_type)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                run["steps"].append(items.get("_step"))
                run["keys"] |= set(items)
        runs.append(run)
    return runs
