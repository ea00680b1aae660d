"""Slurm for real: a one-node cluster (launch/local_slurm.sh) runs launch/slurm.sbatch and a
submitit sweep; nothing about Slurm is mocked.

Needs root and Debian's slurm-wlm + munge (`make test` installs them when it runs as root with
apt-get); otherwise every test here is skipped and the reason is printed, except on CI (CI=true),
where a missing binary fails the suite naming it. The cluster gets its own
state dir and ports, and is torn down at the end of the module.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import torch

from conftest import (ROOT, Output, assert_same_weights, assert_stopped_in_time, base_env, load_weights, missing,
                      read_metrics, run_process, run_train)

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

LOCAL_SLURM = ROOT / "launch" / "local_slurm.sh"
SBATCH = ROOT / "launch" / "slurm.sbatch"
TRAIN = ["model=gpt_tiny", "model.bias=false", "data=text", "trainer.max_steps=5", "trainer.eval_every=0",
         "logging.wandb.mode=disabled", "logging.progress=false"]


# Every Slurm binary the tests and launch scripts run (Makefile's slurm-deps checks the same list).
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")


def why_no_slurm() -> str | None:
    if os.geteuid() != 0:
        return "Slurm tests need root (slurmd starts job steps as the submitting user)"
    missing = [c for c in SLURM_BINARIES if shutil.which(c) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found); `make test` installs "
                "slurm-wlm and munge when run as root with apt-get")
    return None


def assert_job_ended(sbatch_code: int, log: str, status: str) -> None:
    """launch/slurm.sbatch's last line says the status and the launch's exit code; the job (and so
    `sbatch --wait`) exits with that code, or 1 where it was 0 (anything but completed fails)."""
    found = re.findall(r"zerolab: (\w+) \(exit (\d+)\)", log)
    assert found and found[-1][0] == status, said(log)
    rc = int(found[-1][1])
    assert sbatch_code == (rc or 1), (sbatch_code, rc, said(log))


def said(log: str) -> str:
    """A failed job's log for an assertion message: zerolab's own lines first (what each rank said
    and when it stopped), then the end of the log."""
    lines = [line for line in log.splitlines() if "zerolab" in line or "exitcode" in line or "Error" in line]
    return "\n".join(lines[-40:]) + "\n--- the end of the log ---\n" + log[-2500:]


def free_port_pair() -> int:
    """A port P with P and P+1 free (slurmctld, slurmd)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def cluster():
    reason = why_no_slurm()
    if reason:
        missing(reason)  # a skip naming the reason; on CI a failure
    # Not under pytest's tmp dir: munged runs as the munge user and must reach its socket dir.
    state = Path(tempfile.mkdtemp(prefix="zerolab-slurm-", dir="/tmp"))
    state.chmod(0o755)
    env = base_env(ZEROLAB_SLURM_DIR=str(state), ZEROLAB_SLURM_PORT=str(free_port_pair()))
    up = subprocess.run([str(LOCAL_SLURM), "up"], env=env, capture_output=True, text=True, timeout=120)
    if up.returncode != 0:
        subprocess.run([str(LOCAL_SLURM), "down"], env=env, capture_output=True, timeout=120)
        pytest.fail(f"local_slurm.sh up failed ({up.returncode}):\n{up.stdout}\n{up.stderr}")
    # What a user's shell looks like after `source .venv/bin/activate` + `eval $(local_slurm.sh env)`.
    job_env = dict(env, SLURM_CONF=str(state / "slurm.conf"))
    if sys.prefix != sys.base_prefix:
        job_env["VIRTUAL_ENV"] = sys.prefix
        job_env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    else:
        job_env["ZEROLAB_PYTHON"] = sys.executable
    yield {"env": env, "job_env": job_env, "state": state}
    started = [int(line.split()[1]) for line in (state / "pids").read_text().splitlines()]
    down = subprocess.run([str(LOCAL_SLURM), "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not state.exists(), "local_slurm.sh down left its state dir behind"
    still = [pid for pid in started if running(pid)]
    assert not still, f"daemons still running after down: {still}"


def running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def sbatch_wait(cluster, tmp: Path, *args: str, launch: str = "torchrun", sbatch_opts=(), timeout=300):
    env = dict(cluster["job_env"], ZEROLAB_LAUNCH=launch)
    cmd = ["sbatch", "--wait", "--parsable", f"--output={tmp}/slurm-%j.out", *sbatch_opts, str(SBATCH), *args]
    proc = run_process(cmd, env=env, timeout=timeout)
    job = proc.stdout.strip().split(";")[0]
    out = tmp / f"slurm-{job}.out"
    log = out.read_text() if out.exists() else "(no job output)"
    return proc, job, log


def the_run_dir(root: Path, pattern: str) -> Path:
    found = sorted(root.glob(pattern))
    assert len(found) == 1, f"expected one run dir matching {pattern} under {root}, found {found}"
    return found[0]


@pytest.fixture(scope="module")
def zero2_job(cluster, tmp_path_factory):
    """`sbatch --wait launch/slurm.sbatch strategy=zero2 ...`: srun -> torchrun -> 2 ranks."""
    tmp = tmp_path_factory.mktemp("sbatch_zero2")
    proc, job, log = sbatch_wait(cluster, tmp, "strategy=zero2", *TRAIN, f"run.root={tmp}/runs")
    assert proc.returncode == 0, f"sbatch failed ({proc.returncode}): {proc.stderr}\n{log}"
    return the_run_dir(tmp / "runs" / "default", f"*-zero2-job{job}"), log


def test_up_is_idempotent(cluster):
    again = subprocess.run([str(LOCAL_SLURM), "up"], env=cluster["env"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already up" in again.stdout, again.stdout + again.stderr
    status = subprocess.run([str(LOCAL_SLURM), "status"], env=cluster["env"], capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0 and "debug" in status.stdout


def test_sbatch_zero2_completes(zero2_job):
    run, log = zero2_job
    assert (run / "status").read_text().strip() == "completed", log
    metrics = read_metrics(run)
    assert metrics[-1]["step"] == 5 and "rank1/comm_bytes" in metrics[-1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "zero2" and summary["steps"] == 5
    # torchrun's per-rank logs went into the run dir.
    assert len(list(run.glob("logs/**/stdout.log"))) == 2, log


def test_srun_ranks_without_torchrun_match(cluster, zero2_job, tmp_path):
    """Slurm starts both ranks itself (zerolab.dist reads SLURM_PROCID/LOCALID/NTASKS): same job,
    same world size and reduction order as the torchrun job, so the same weights (fp32)."""
    proc, job, log = sbatch_wait(cluster, tmp_path, "strategy=zero2", *TRAIN, f"run.root={tmp_path}/runs",
                                 launch="srun", sbatch_opts=["--ntasks-per-node=2"])
    assert proc.returncode == 0, f"sbatch failed ({proc.returncode}): {proc.stderr}\n{log}"
    run = the_run_dir(tmp_path / "runs" / "default", f"*-zero2-job{job}")
    assert (run / "status").read_text().strip() == "completed"
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    # Slurm starting the ranks instead of torchrun: the same ranks, data and sums, bit for bit.
    assert_same_weights(load_weights(run), load_weights(zero2_job[0]), "srun-started ranks vs torchrun ranks")


def test_failed_run_writes_failed(cluster, tmp_path):
    # Rank 1 exits abruptly before its first step; torchrun stops the other rank, srun and the job fail.
    proc, job, log = sbatch_wait(cluster, tmp_path, *TRAIN, f"run.dir={tmp_path}/run",
                                 "fault.kill_rank=1", "fault.at_step=1", "fault.mode=exit")
    assert_job_ended(proc.returncode, log, "failed")
    assert (tmp_path / "run" / "status").read_text().strip() == "failed", log


@contextlib.contextmanager
def submitted(cmd, env):
    """`sbatch --wait --parsable ...` started; yields (the sbatch process, the job id read from its
    first line, with a deadline). The job is cancelled and sbatch killed if the block fails."""
    sbatch = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = None
    try:
        head = Output(sbatch.stdout, timeout=60)  # its thread drains sbatch's output to the end
        for _ in range(5):  # a warning line may come first
            head.until("\n")
            ids = [line.split(";")[0] for line in head.text.splitlines() if line.split(";")[0].isdigit()]
            if ids:
                break
        assert ids, f"sbatch gave no job id:\n{head.text}"
        job = ids[0]
        yield sbatch, job
    finally:
        if sbatch.poll() is None:
            if job:
                subprocess.run(["scancel", job], env=env, timeout=30)
            sbatch.kill()
            sbatch.wait()


def test_usr1_before_time_limit_writes_timeout(cluster, tmp_path):
    """The signal Slurm sends 90 s before the limit (--signal=B:USR1@90), delivered now with
    `scancel --signal=USR1 --batch`, stops the ranks and marks the run `timeout`."""
    run = tmp_path / "run"
    env = dict(cluster["job_env"], ZEROLAB_LAUNCH="torchrun")
    # Rank 0 hangs before step 2 (after step 1 is logged): the job runs until it is stopped. Asked
    # to stop, the hung rank ends itself dist.timeout_s after it last moved (fault.ProgressBoard),
    # inside the stop's budget (300 s here: the cluster's jobs have no time limit).
    # The job's output goes into a FIFO the test reads (conftest.Output: every wait has a
    # deadline): the fault's own message ("... fails before step 2") says training is under way.
    fifo = tmp_path / "job.out"
    os.mkfifo(fifo)
    cmd = ["sbatch", "--wait", "--parsable", f"--output={fifo}", str(SBATCH), *TRAIN, "dist.timeout_s=20",
           f"run.dir={run}", "trainer.max_steps=1000", "fault.kill_rank=0", "fault.at_step=2", "fault.mode=hang"]
    with submitted(cmd, env) as (sbatch, job):
        out = Output(fifo)
        out.until("zerolab fault injection: rank 0 fails before step 2")
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
        log = out.rest(timeout=120)  # until the job closes its output
        sbatch.wait(timeout=120)
    assert read_metrics(run), log  # step 1 was logged before the hang
    assert_job_ended(sbatch.returncode, log, "timeout")
    assert (run / "status").read_text().strip() == "timeout", log


def test_submitit_sweep_one_job_per_strategy(cluster, tmp_path):
    """`train.py -m launcher=slurm strategy=ddp,zero2`: two Slurm jobs, each with 2 srun tasks
    that find each other through zerolab.dist's SLURM_* path."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "launcher=slurm", "strategy=ddp,zero2", *TRAIN,
           f"run.root={tmp_path}/runs", f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = run_process(cmd, env=cluster["job_env"], timeout=540)
    logs = "\n".join(p.read_text()[-3000:] for p in (tmp_path / "sweep").glob(".submitit/*/*.out"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    jobs = set()
    for strategy in ("ddp", "zero2"):
        run = the_run_dir(tmp_path / "runs" / "default", f"*-{strategy}-job*")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["strategy"] == strategy and summary["steps"] == 5
        jobs.add(run.name.rsplit("-job", 1)[1])
    assert len(jobs) == 2, "the two strategies ran in the same Slurm job"


SLOW_SAVE_S = 35  # longer than torchrun's own grace period (30 s) and than the job's dist.timeout_s (20)


def test_usr1_warning_saves_requeues_and_resumes(cluster, tmp_path):
    """Slurm's time-limit warning (--signal=B:USR1@90, delivered now with `scancel --signal=USR1
    --batch` as in the test above) to a job whose save takes longer than torchrun's default grace
    period (fault.slow_save_s: a slow checkpoint directory): the stop's budget is the job's time
    left (torchrun --shutdown-timeout), so the ranks save at the step they are in, the status says
    `preempted`, the job requeues itself, the second start resumes from that checkpoint
    (checkpoint.resume=auto, same run dir) and ends bitwise equal to an uninterrupted run. With
    torchrun's 30 s the ranks would be SIGKILLed mid-save (status `timeout`, no requeue); with the
    heartbeat's stuck rule applied to a save, a rank would end itself after dist.timeout_s."""
    steps = ["trainer.max_steps=12", "data.micro_batch=4"]
    ref = tmp_path / "ref"
    run_train(ref, 2, *TRAIN, *steps)
    run = tmp_path / "run"
    env = dict(cluster["job_env"], ZEROLAB_LAUNCH="torchrun")
    fifo = tmp_path / "job.out"
    os.mkfifo(fifo)
    # Step 3 holds rank 0 for 8 s (a straggler, fault.slow_rank; rank 1 waits in its collective,
    # within dist.timeout_s): the warning sent once step 2 is logged must land before training ends,
    # and the twelve steps alone take a quarter of a second, less than a loaded machine's delay
    # between the log line and the signal (one run beside a training loop finished first).
    slow = [f"fault.slow_save_s={SLOW_SAVE_S}", "dist.timeout_s=20", "fault.slow_rank=0", "fault.slow_ms=8000",
            "fault.at_step=3"]
    cmd = ["sbatch", "--wait", "--parsable", f"--output={fifo}", "--time=10", str(SBATCH), *TRAIN, *steps, *slow,
           f"run.dir={run}"]
    with submitted(cmd, env) as (sbatch, job):
        out = Output(fifo)  # attempt 1: the reading thread's open returns once the job opens its output
        out.until("step 2/12 |")  # rank 0 logged step 2: training is under way, step 3 is held
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
        first = out.rest(timeout=120 + SLOW_SAVE_S)  # until the first start closes its output
        budget = re.search(r"a stop may take (\d+) s \(the job's time left\): torchrun --shutdown-timeout=(\d+)",
                           first)
        # the 10-minute limit, less the seconds the job had run when it started torchrun
        assert budget and budget.group(1) == budget.group(2) and 480 <= int(budget.group(1)) <= 600, said(first)
        slowed = re.findall(rf"rank (\d)'s save takes {SLOW_SAVE_S} s longer", first)
        assert sorted(set(slowed)) == ["0", "1"], said(first)  # each rank's save was the slow one
        assert f"requeueing job {job}" in first, said(first)
        # Slurm holds a requeued job for cred_expire + 1 s (its BeginTime; 30 s in local_slurm.sh).
        second = Output(fifo).rest(timeout=240)  # attempt 2: the requeued start opens it again
        sbatch.wait(timeout=120)
    assert "zerolab: preempted" in first, said(first)
    # Every rank exits by itself once saved (none waits out torchrun's grace period for a second signal)
    assert_stopped_in_time(first)
    saved = int(re.search(r"stopped after step (\d+) of 12 on SIGTERM", first).group(1))
    assert f"resumed at step {saved}" in second and "zerolab: completed" in second, said(second)
    assert (run / "status").read_text().strip() == "completed"
    wr, wi = load_weights(ref), load_weights(run)
    assert all(torch.equal(wr[k], wi[k]) for k in wr), "requeued job's weights differ from the uninterrupted run"
