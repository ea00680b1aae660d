"""Guards around a run: one job per run directory, user errors caught before the first step with
one message and no traceback, a closed configuration schema, nothing left behind by a failed
start, and the final weights written before the final eval.

Fast tier: the pieces in-process (key suggestions, the lock, data checks, error reporting, the
finish order in a one-process gloo group). Slow tier: real torchrun jobs with 2 ranks, real
locks held by real processes, real signals; no test waits on time (FIFOs and pipes block).
"""
import fcntl
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from conftest import ROOT, TORCHRUN, base_env, load_weights, read_metrics, run_process, run_python, run_train
from zerolab.run import lock as runlock
from zerolab.config import ConfigError, check_overrides, compose, suggest
from zerolab.data import check_token_file
from zerolab.errors import ZerolabError, report

COMMON = ["model=gpt_tiny", "data=text", "trainer.eval_every=0", "data.micro_batch=4",
          "logging.wandb.mode=disabled", "logging.progress=false"]
ZEROLAB_FRAME = re.compile(r'File "[^"]*(/zerolab/[^"]*|train\.py)"')


def token_file(path, n):
    (np.arange(n) % 256).astype(np.uint16).tofile(path)
    return path


# ---- fast tier: in-process ------------------------------------------------------------------
@pytest.mark.parametrize("typo, nearest", [("trainer.max_step", "trainer.max_steps"), ("trainer.lr", "optim.lr"),
                                           ("logging.wandb.mod", "logging.wandb.mode"),
                                           ("chekpoint.every", "checkpoint.every")])
def test_suggests_nearest_key(typo, nearest):
    assert suggest(typo) == f"did you mean {nearest}?"


@pytest.mark.parametrize("override", ["+trainer.max_step=20", "++trainer.max_step=20"])
def test_schema_is_closed_to_added_keys(override):
    with pytest.raises(ConfigError, match=r"no such key; did you mean trainer\.max_steps\?"):
        compose([override])


def test_ds_config_overrides_stay_free_form():
    cfg = compose(["+strategy.ds_config_overrides.zero_optimization.round_robin_gradients=true"])
    assert cfg.strategy.ds_config_overrides == {"zero_optimization": {"round_robin_gradients": True}}
    check_overrides(["strategy.ds_config_overrides.any.deepspeed_key=1"])  # no error


def test_command_line_check_names_unknown_keys_only():
    with pytest.raises(ConfigError,
                       match=r"given as trainer\.max_step=20\): no such key; did you mean trainer\.max_steps"):
        check_overrides(["trainer.max_step=20"])
    # Group choices, Hydra's own keys and known keys pass; so does a group that is not a key.
    check_overrides(["strategy=zero2", "hydra.run.dir=x", "hydra/launcher=basic", "trainer.max_steps=3",
                     "launcher=slurm"], groups=["launcher"])
    with pytest.raises(ConfigError, match="no such key"):
        check_overrides(["launcher=slurm"])  # without knowing the group, it is an unknown key


def test_lock_refuses_a_second_holder_and_hands_over_cleanly(tmp_path, caplog):
    run_dir = tmp_path / "a" / "run"
    first = runlock.acquire(str(run_dir))
    # flock belongs to an open file description: a second open in this process conflicts like
    # another process would.
    with pytest.raises(runlock.RunDirLocked) as info:
        runlock.acquire(str(run_dir))
    msg = str(info.value)
    assert f"pid {os.getpid()}" in msg and f"host {socket.gethostname()}" in msg and "Pick another run.dir" in msg
    assert runlock.holder(str(run_dir))["pid"] == os.getpid()
    with pytest.raises(runlock.RunDirLocked, match=f"pid {os.getpid()}"):
        runlock.check_free(str(run_dir))  # the launchers' probe, which changes nothing
    first.release()
    runlock.check_free(str(run_dir))
    assert runlock.holder(str(run_dir)) is None  # a normal end leaves no holder behind
    with caplog.at_level(logging.INFO, logger="zerolab"):
        second = runlock.acquire(str(run_dir))
    assert not caplog.records  # a clean hand-over is not a stale lock
    second.release()


@pytest.mark.parametrize("same_job", [False, True])
def test_stale_lock_is_taken_over(tmp_path, caplog, monkeypatch, same_job):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps(
        {"host": "gone-host", "pid": 4242, "job_id": "job-b" if same_job else "job-a", "started": "then"}))
    with caplog.at_level(logging.INFO, logger="zerolab"):
        lock = runlock.acquire(str(tmp_path))
    (record,) = caplog.records
    assert "host gone-host, pid 4242" in record.getMessage()
    # A restart round of the same job is expected; another job's leftover lock is worth a warning.
    assert record.levelno == (logging.INFO if same_job else logging.WARNING)
    assert runlock.holder(str(tmp_path))["pid"] == os.getpid()
    lock.release()


def test_remove_created_keeps_directories_that_existed(tmp_path):
    lock = runlock.acquire(str(tmp_path / "root" / "exp" / "run"))
    (tmp_path / "root" / "exp" / "run" / "config.yaml").write_text("x")
    lock.remove_created()
    assert not (tmp_path / "root").exists()  # the run dir and the parents this job made
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep").write_text("x")
    lock = runlock.acquire(str(existing))
    assert lock.remove_created() == []
    assert (existing / "keep").exists()


def test_token_file_checks_name_path_and_sizes(tmp_path):
    with pytest.raises(ConfigError, match=f"data.path={tmp_path}/nope.bin: no such token file"):
        check_token_file(str(tmp_path / "nope.bin"), 8, 0.05)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=f"token file {tmp_path}/empty.bin is empty"):
        check_token_file(str(tmp_path / "empty.bin"), 8, 0.05)
    path = token_file(tmp_path / "short.bin", 1000)  # 950 train + 50 validation tokens
    with pytest.raises(ConfigError, match=r"950 for training and 50 for validation .* validation split has no "
                                          r"complete window.*model.block_size=49 or smaller"):
        check_token_file(str(path), 60, 0.05)
    with pytest.raises(ConfigError, match="the training and validation splits have no complete window"):
        check_token_file(str(path), 960, 0.05)
    check_token_file(str(path), 49, 0.05)  # 50 tokens: exactly one validation window


def test_launcher_refuses_bad_data_before_any_rank_starts(tmp_path, monkeypatch):
    """launch/run_dir.py (what launch/torchrun.sh and slurm.sbatch call first) checks a given token
    file: exit 2 in seconds, not after every rank has started, and no run directory is made."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_dir", ROOT / "launch" / "run_dir.py")
    run_dir = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_dir)
    monkeypatch.chdir(tmp_path)
    args = [f"run.root={tmp_path / 'runs'}", "model=gpt_tiny"]
    with pytest.raises(ConfigError, match=f"data.path={tmp_path}/nope.bin: no such token file"):
        run_dir.choose([*args, f"data.path={tmp_path / 'nope.bin'}"])
    path = token_file(tmp_path / "short.bin", 1000)
    with pytest.raises(ConfigError, match="validation split has no complete window"):
        run_dir.choose([*args, f"data.path={path}", "model.block_size=60"])
    assert not (tmp_path / "runs").exists()
    assert run_dir.choose([*args, f"data.path={path}", "model.block_size=40"]).startswith(str(tmp_path / "runs"))


def test_report_is_one_paragraph_unless_debugging(capsys, monkeypatch):
    def raised():
        try:
            raise ZerolabError("disk full while saving /x: free space or move checkpoint.dir")
        except ZerolabError as err:
            return err

    monkeypatch.delenv("ZEROLAB_DEBUG", raising=False)
    assert report(raised()) == 1
    err = capsys.readouterr().err
    assert err == "zerolab: error: disk full while saving /x: free space or move checkpoint.dir\n"
    monkeypatch.setenv("ZEROLAB_DEBUG", "1")
    assert report(raised()) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.endswith("move checkpoint.dir\n")
    assert report(ConfigError("bad")) == 2



@pytest.mark.slow  # real processes (the fast tier starts none); a fraction of a second
def test_lines_said_by_ranks_at_once_stay_whole():
    """Ranks under one launcher share its stderr pipe; four real processes each say 300 lines of 900
    bytes at once through zerolab.errors.say. Every line arrives whole: a verdict that starts in
    the middle of another rank's line is missed by whoever reads the job's output (print() with
    file=sys.stderr writes the newline apart and cut lines here)."""
    read_end, write_end = os.pipe()
    code = "import sys\nfrom zerolab.errors import say\nfor _ in range(300): say(sys.argv[1] * 900)\n"
    procs = [subprocess.Popen([sys.executable, "-c", code, letter], stderr=write_end, env=base_env(), cwd=ROOT)
             for letter in "abcd"]
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        lines = pipe.read().decode().splitlines()
    assert [p.wait() for p in procs] == [0] * 4
    cut = [line[:40] for line in lines if len(line) != 900 or len(set(line)) != 1]
    assert len(lines) == 1200 and not cut, (len(lines), cut[:5])


def test_agree_raises_the_same_explained_error_everywhere(one_rank):
    from zerolab.dist import agree

    def bad_config():
        raise ConfigError("token file x is empty")

    def broken():
        raise PermissionError("cannot write the corpus cache")

    with pytest.raises(ConfigError, match="token file x is empty") as info:
        agree(one_rank, bad_config)
    assert info.value.same_on_every_rank  # so rank 0 alone prints it
    with pytest.raises(ZerolabError, match="PermissionError: cannot write the corpus cache"):
        agree(one_rank, broken)
    agree(one_rank, lambda: None)


class BreaksInEval(torch.nn.Module):
    """A model whose eval fails: what a final eval that raises used to cost (the weights)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if not self.training:
            raise RuntimeError("the eval broke")
        return self.inner(x)


def test_weights_and_summary_are_written_before_the_final_eval(tmp_path, one_rank):
    from zerolab.models import build_model
    from zerolab.trainer import Trainer

    cfg = compose([*COMMON, "trainer.max_steps=3", f"run.dir={tmp_path / 'run'}", "dist.device=cpu"])
    torch.manual_seed(cfg.trainer.seed)
    trainer = Trainer(cfg, one_rank, model=BreaksInEval(build_model(cfg.model)))
    with pytest.raises(RuntimeError, match="the eval broke"):
        trainer.fit()
    trainer.close()
    weights = load_weights(tmp_path / "run")
    assert set(weights) == {f"inner.{k}" for k in build_model(cfg.model).state_dict()}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_loss"] is None and "the eval broke" in summary["final_eval_error"]
    last = read_metrics(tmp_path / "run")[-1]
    assert last["step"] == 3 and "eval_loss" not in last  # the last step's record still landed


# ---- slow tier: real processes --------------------------------------------------------------
def torchrun(*overrides, timeout=240, **popen):
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), *COMMON, *overrides]
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=base_env(), text=True, **popen)
    return run_process(cmd, timeout=timeout)


def assert_one_clean_message(out: str, *expected: str, label="configuration error"):
    """The job's output holds one zerolab message (from rank 0) and no traceback from zerolab.
    torchrun itself prints a ChildFailedError traceback whenever a worker exits non-zero; that
    one is allowed, and its summary must show the worker's exit code 2."""
    assert out.count(f"zerolab: {label}:") == 1, out[-6000:]
    for text in expected:
        assert text in out, out[-6000:]
    assert not ZEROLAB_FRAME.search(out), out[-6000:]
    assert out.count("Traceback (most recent call last)") == out.count("ChildFailedError:") == 1, out[-6000:]
    assert re.search(r"exitcode\s*:\s*2 ", out), out[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("override", ["+trainer.max_step=20", "trainer.max_step=20"])
def test_unknown_key_exits_2_naming_the_nearest(tmp_path, override):
    proc = run_python("train.py", f"run.dir={tmp_path / 'run'}", "logging.wandb.mode=disabled", override,
                      check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "did you mean trainer.max_steps?" in out and "To append to your config" not in out
    assert "Traceback" not in out
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "empty", "block_size_over_val_split"])
def test_bad_data_exits_2_under_torchrun_with_one_message(tmp_path, case):
    path = tmp_path / f"{case}.bin"
    extra, expected = [], [str(path)]
    if case == "empty":
        path.write_bytes(b"")
        expected.append("is empty (0 bytes)")
    elif case == "block_size_over_val_split":
        token_file(path, 1000)  # 950 train + 50 validation tokens: a 61-token window fits train only
        extra, expected = ["model.block_size=60"], [*expected, "1000 tokens", "validation split has no complete window"]
    else:
        expected.append("no such token file")
    proc = torchrun(f"data.path={path}", f"run.root={tmp_path / 'runs'}", *extra, timeout=180)
    assert proc.returncode == 1  # torchrun's code for a failed worker (the workers' own 2: below)
    assert_one_clean_message(proc.stdout + proc.stderr, *expected)
    assert not (tmp_path / "runs").exists()  # the checks come before the run directory


# Bad input said once per job, in the same words with one process and under torchrun, exit 2 for
# every one (the worker's own code under torchrun, which itself exits 1), and nothing created.
BAD_INPUT = {
    "unknown key": (["trainer.max_step=20"], "did you mean trainer.max_steps?"),
    "unknown group option": (["strategy=nonexistent"],
                             "strategy=nonexistent: no such option of config group strategy; choose one of ddp,"),
    "no such resume path": (["checkpoint.resume=/no/such/path"], "checkpoint.resume=/no/such/path: no such file"),
}


def _message_lines(out: str) -> list[str]:
    start = [i for i, line in enumerate(out.splitlines()) if line.startswith("zerolab: ")]
    assert len(start) == 1, out[-6000:]
    return [line for line in out.splitlines()[start[0]:] if line.strip()][:1]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUT))
@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_bad_input_is_said_once_and_exits_2(tmp_path, case, launch):
    overrides, expected = BAD_INPUT[case]
    args = [f"run.root={tmp_path / 'runs'}", *overrides]
    if launch == "python":
        proc = run_python("train.py", "logging.wandb.mode=disabled", *args, check=False, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        assert len(out.strip().splitlines()) <= 4 and "Traceback" not in out, out
        assert out.startswith("zerolab: configuration error: ") and expected in out, out
    else:
        proc = torchrun(*args, timeout=180)
        out = proc.stdout + proc.stderr
        assert_one_clean_message(out, expected)
        # Rank 0's code is torchrun's root cause; another rank exits 2 too once it has found the same
        # error, unless torchrun stopped it first (SIGTERM: still importing when rank 0 was done).
        codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)]
        root = re.search(r"Root Cause[\s\S]*?exitcode\s*:\s*(-?\d+)", out)
        assert root and int(root.group(1)) == 2 and sorted(set(codes)) in ([2], [-15, 2]), out[-6000:]
        (line,) = _message_lines(out)
        assert out.count(line) == 1  # no line of it twice
    assert "Could not find" not in out and "To append to your config" not in out  # no Hydra block
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_explained_runtime_error_has_no_traceback_and_failed_start_leaves_nothing(tmp_path):
    """A failure zerolab explains at run time (a checkpoint for another model, say): one
    paragraph without a traceback, and a start that fails leaves no directory it made."""
    other = tmp_path / "other"
    run_train(other, 1, *COMMON, "trainer.max_steps=1", "checkpoint.every=1", "model.n_embd=32")
    ckpt = other / "checkpoints" / "step_00000001"
    proc = run_python("train.py", *COMMON, f"run.root={tmp_path / 'runs'}", f"checkpoint.resume={ckpt}",
                      check=False, timeout=180, env={"ZEROLAB_DEBUG": "0"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "zerolab: error: " in out and "the checkpoint is for another model" in out and "Traceback" not in out
    # The run directory (and runs/<experiment>/) existed only because this start made them.
    assert not (tmp_path / "runs").exists()

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("kept")
    proc = run_python("train.py", *COMMON, f"run.dir={existing}", f"checkpoint.resume={ckpt}",
                      check=False, timeout=180, env={"ZEROLAB_DEBUG": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback (most recent call last)" in out and "the checkpoint is for another model" in out
    assert (existing / "notes.txt").read_text() == "kept"  # a directory given by run.dir stays


def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
def test_second_job_on_a_held_run_dir_is_refused_and_the_first_is_untouched(tmp_path):
    job = ["trainer.max_steps=10", "optim.lr=0.002"]
    ref = tmp_path / "ref"
    run_train(ref, 2, *COMMON, *job)

    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    fifo = run_dir / "metrics.jsonl"
    os.mkfifo(fifo)
    # Job A's rank 0 writes its metrics into this FIFO. Its pipe holds 4 KiB and nobody reads
    # until B is done; one record is about 1 KB, so A blocks in its first few steps, holding
    # the lock: no race with B, whatever the machine's speed.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)
    a_log = open(tmp_path / "a.log", "w")
    a = torchrun(f"run.dir={run_dir}", *job, stdout=a_log, stderr=subprocess.STDOUT, start_new_session=True)
    drained = []
    try:
        ready, _, _ = select.select([reader], [], [], 240)  # A's first record: A holds the lock
        if not ready:
            a_log.flush()
            pytest.fail(f"job A wrote no metrics in 240 s:\n{(tmp_path / 'a.log').read_text()[-6000:]}")
        b = torchrun(f"run.dir={run_dir}", "trainer.max_steps=30", "optim.lr=0.01", timeout=180)
        out = b.stdout + b.stderr
        assert b.returncode == 1  # torchrun's code for a failed worker (the workers' own 2: below)
        assert_one_clean_message(out, f"run directory {run_dir} is in use by another job",
                                 f"host {socket.gethostname()}", "Pick another run.dir")
        holder_pid = int(re.search(r"is in use by another job \(host [^,]+, pid (\d+)", out).group(1))
        assert _parent_pid(holder_pid) == a.pid  # the holder named is A's rank 0, a worker of A's torchrun

        fcntl.fcntl(reader, fcntl.F_SETFL, fcntl.fcntl(reader, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        drain = threading.Thread(target=lambda: drained.extend(iter(lambda: os.read(reader, 65536), b"")))
        drain.start()
        assert a.wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-6000:]
        drain.join(timeout=60)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
        os.close(reader)
        a_log.close()
    records = [json.loads(line) for line in b"".join(drained).decode().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))  # A's metrics alone, none of B's
    assert "lr: 0.002" in (run_dir / "config.yaml").read_text()  # B did not overwrite A's config
    wr, wa = load_weights(ref), load_weights(run_dir)
    assert all(torch.equal(wr[k], wa[k]) for k in wr), "job A's weights differ from a lone run"


HOLDER = """
import sys
from zerolab.run import lock as runlock
lock = runlock.acquire(sys.argv[1])  # held while this object lives
print("locked", flush=True)
sys.stdin.read()  # holds the lock until killed
"""


@pytest.mark.slow
def test_lock_of_a_killed_holder_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=ROOT, env=base_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(runlock.RunDirLocked, match=f"pid {holder.pid}"):
            runlock.acquire(str(run_dir))  # held by the other process
    finally:
        holder.kill()  # SIGKILL: no cleanup; the kernel drops its flock
        holder.wait()
    assert runlock.holder(str(run_dir))["pid"] == holder.pid  # the file still names it
    proc = run_train(run_dir, 2, *COMMON, "trainer.max_steps=3", timeout=240)
    out = proc.stdout + proc.stderr
    assert re.search(rf"pid {holder.pid}, .*which no longer holds it .*taking it over", out), out[-4000:]
    assert (run_dir / "model.safetensors").exists()
    assert runlock.holder(str(run_dir)) is None  # released at the end

