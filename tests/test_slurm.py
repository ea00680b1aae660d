"""Slurm for real: a one-node cluster (launch/local_slurm.sh) runs launch/slurm.sbatch and a
submitit sweep; nothing about Slurm is mocked.

Needs root and Debian's slurm-wlm + munge (`make test` installs them when it runs as root with
apt-get); otherwise every test here is skipped and the reason is printed. The cluster gets its own
state dir and ports, and is torn down at the end of the module.
"""
from __future__ import annotations

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

from conftest import ROOT, base_env, load_weights, max_rel_diff, read_metrics, run_train

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

LOCAL_SLURM = ROOT / "launch" / "local_slurm.sh"
SBATCH = ROOT / "launch" / "slurm.sbatch"
TRAIN = ["model=gpt_tiny", "model.bias=false", "data=text", "trainer.max_steps=5", "trainer.eval_every=0",
         "logging.wandb.mode=disabled", "logging.progress=false"]


def why_no_slurm() -> str | None:
    if os.geteuid() != 0:
        return "Slurm tests need root (slurmd starts job steps as the submitting user)"
    missing = [c for c in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")
               if shutil.which(c) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found); `make test` installs "
                "slurm-wlm and munge when run as root with apt-get")
    return None


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
        pytest.skip(reason)
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
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
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
    diff = max_rel_diff(load_weights(run), load_weights(zero2_job[0]))
    assert diff <= 1e-6, f"srun-started ranks vs torchrun ranks: max relative difference {diff:.3g}"


def test_failed_run_writes_failed(cluster, tmp_path):
    # Rank 1 exits abruptly before its first step; torchrun stops the other rank, srun and the job fail.
    proc, job, log = sbatch_wait(cluster, tmp_path, *TRAIN, f"run.dir={tmp_path}/run",
                                 "fault.kill_rank=1", "fault.at_step=0", "fault.mode=exit")
    assert proc.returncode != 0, log
    assert (tmp_path / "run" / "status").read_text().strip() == "failed", log


def test_usr1_before_time_limit_writes_timeout(cluster, tmp_path):
    """The signal Slurm sends 90 s before the limit (--signal=B:USR1@90), delivered now with
    `scancel --signal=USR1 --batch`, stops the ranks and marks the run `timeout`."""
    run = tmp_path / "run"
    env = dict(cluster["job_env"], ZEROLAB_LAUNCH="torchrun")
    # Rank 0 hangs before step 1 (after step 0 is logged): the job runs until it is stopped.
    # The job's output goes into a FIFO the test reads with blocking reads: the fault's own
    # message ("... fails before step 1") says training is under way, with no polling.
    fifo = tmp_path / "job.out"
    os.mkfifo(fifo)
    cmd = ["sbatch", "--wait", "--parsable", f"--output={fifo}", str(SBATCH), *TRAIN,
           f"run.dir={run}", "trainer.max_steps=1000", "fault.kill_rank=0", "fault.at_step=1", "fault.mode=hang"]
    sbatch = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = b""
    try:
        job = sbatch.stdout.readline().strip().split(";")[0]
        assert job, sbatch.stderr.read()
        with open(fifo, "rb", buffering=0) as out:  # returns once the job opens its output
            while b"zerolab fault injection: rank 0 fails before step 1" not in seen:
                chunk = out.read(4096)
                assert chunk, f"job ended before its first step: {seen.decode(errors='replace')[-3000:]}"
                seen += chunk
            subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
            while chunk := out.read(4096):  # until the job closes its output
                seen += chunk
        sbatch.wait(timeout=120)
    finally:
        if sbatch.poll() is None:
            subprocess.run(["scancel", job], env=env, timeout=30)
            sbatch.kill()
    log = seen.decode(errors="replace")
    assert read_metrics(run), log  # step 0 was logged before the hang
    assert sbatch.returncode != 0, log
    assert (run / "status").read_text().strip() == "timeout", log


def test_submitit_sweep_one_job_per_strategy(cluster, tmp_path):
    """`train.py -m launcher=slurm strategy=ddp,zero2`: two Slurm jobs, each with 2 srun tasks
    that find each other through zerolab.dist's SLURM_* path."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "launcher=slurm", "strategy=ddp,zero2", *TRAIN,
           f"run.root={tmp_path}/runs", f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = subprocess.run(cmd, cwd=ROOT, env=cluster["job_env"], capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in (tmp_path / "sweep").glob(".submitit/*/*.out"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    jobs = set()
    for strategy in ("ddp", "zero2"):
        run = the_run_dir(tmp_path / "runs" / "default", f"*-{strategy}-job*")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["strategy"] == strategy and summary["steps"] == 5
        jobs.add(run.name.rsplit("-job", 1)[1])
    assert len(jobs) == 2, "the two strategies ran in the same Slurm job"


def test_usr1_warning_saves_requeues_and_resumes(cluster, tmp_path):
    """Slurm's time-limit warning (--signal=B:USR1@90, delivered now with `scancel --signal=USR1
    --batch` as in the test above): the ranks save at the step they are in, the status says
    `preempted`, the job requeues itself, the second start resumes from that checkpoint
    (checkpoint.resume=auto, same run dir) and ends bitwise equal to an uninterrupted run."""
    steps = ["trainer.max_steps=12", "data.micro_batch=4"]
    ref = tmp_path / "ref"
    run_train(ref, 2, *TRAIN, *steps)
    run = tmp_path / "run"
    env = dict(cluster["job_env"], ZEROLAB_LAUNCH="torchrun")
    fifo = tmp_path / "job.out"
    os.mkfifo(fifo)
    cmd = ["sbatch", "--wait", "--parsable", f"--output={fifo}", str(SBATCH), *TRAIN, *steps, f"run.dir={run}"]
    sbatch = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    attempts = []
    try:
        job = sbatch.stdout.readline().strip().split(";")[0]
        assert job, sbatch.stderr.read()
        with open(fifo, "rb", buffering=0) as out:  # attempt 1: returns once the job opens its output
            seen = b""
            while b"step 2/12 |" not in seen:  # rank 0 logged step 2: training is under way
                chunk = out.read(4096)
                assert chunk, f"job ended before step 2: {seen.decode(errors='replace')[-3000:]}"
                seen += chunk
            subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
            while chunk := out.read(4096):  # until the first start closes its output
                seen += chunk
        attempts.append(seen.decode(errors="replace"))
        assert f"requeueing job {job}" in attempts[0], attempts[0][-4000:]
        # Slurm holds a requeued job for cred_expire + 1 s (its BeginTime; 30 s in local_slurm.sh).
        with open(fifo, "rb", buffering=0) as out:  # attempt 2: the requeued start opens it again
            attempts.append(b"".join(iter(lambda: out.read(4096), b"")).decode(errors="replace"))
        sbatch.wait(timeout=120)
    finally:
        if sbatch.poll() is None:
            subprocess.run(["scancel", job], env=env, timeout=30)
            sbatch.kill()
    first, second = attempts
    assert "zerolab: preempted" in first, first[-4000:]
    saved = int(re.search(r"stopped after step (\d+) of 12 on SIGTERM", first).group(1))
    assert f"resumed at step {saved}" in second and "zerolab: completed" in second, second[-4000:]
    assert (run / "status").read_text().strip() == "completed"
    wr, wi = load_weights(ref), load_weights(run)
    assert all(torch.equal(wr[k], wi[k]) for k in wr), "requeued job's weights differ from the uninterrupted run"
