"""Preemption and frozen ranks, with real signals to real torchrun jobs (2 ranks, gpt_tiny).

- SIGTERM to the torchrun agent (what a preempting scheduler or Slurm's time limit sends): every
  rank finishes its step, they agree to stop, save a checkpoint at that step and exit; resuming
  from it ends bitwise equal to a run that was never interrupted.
- A rank frozen mid-step (SIGSTOP: by zerolab's fault injection inside backward, or from outside)
  is named by the others and the job ends; the subprocess timeout bounds it (dist.timeout_s=10
  plus margin), so a regression to torchrun's 30 s grace wait for the frozen rank fails the test.

Waiting for a step means reading the job's output (conftest.Output: each wait has a deadline), never sleeping.
"""
import json
import os
import re
import signal
import subprocess

import pytest
import torch

import ranks
from conftest import ROOT, TORCHRUN, Output, assert_stopped_in_time, base_env, load_weights, read_metrics, run_train

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

COMMON = ["model=gpt_tiny", "data=text", "trainer.eval_every=0", "data.micro_batch=4", "model.dropout=0.1",
          "logging.wandb.mode=disabled", "logging.progress=false"]


def start(cmd_head, run_dir, *overrides, env=None):
    """The job with stdout and stderr merged into one pipe, read by conftest.Output (every wait on
    it has a deadline)."""
    cmd = [*cmd_head, f"run.dir={run_dir}", *COMMON, *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=base_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, Output(proc.stdout, cleanup=lambda: kill_job(proc))


def finish(proc, out: Output, timeout: float) -> str:
    """The whole output once the job has closed it, within `timeout` s; the job's process group
    is killed if it is still there (a failed wait included)."""
    try:
        text = out.rest(timeout)
        proc.wait(timeout=60)  # its output is closed: the agent is exiting
    finally:
        kill_job(proc)
    return text


def kill_job(proc) -> None:
    """SIGKILL to the job's whole session, also when the agent is gone already: an agent killed by
    a signal it does not handle leaves its workers running (start(): start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


TORCHRUN_2 = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py")]


def test_sigterm_to_agent_saves_and_resume_matches_uninterrupted(tmp_path):
    ref = tmp_path / "ref"
    run_train(ref, 2, *COMMON, "trainer.max_steps=12")
    run = tmp_path / "run"
    proc, out = start(TORCHRUN_2, run, "trainer.max_steps=12", "checkpoint.every=0")
    out.until("step 4/12 |")  # rank 0 logged step 4: training is under way
    proc.send_signal(signal.SIGTERM)  # to the agent only; it forwards SIGTERM to its workers
    # torchrun's grace period (30 s) bounds the workers; this bounds a job that ignores it.
    text = finish(proc, out, timeout=90)
    # Every rank left by itself, before torchrun's grace period: torchrun signals each worker once,
    # and a rank that waited for a second SIGTERM was SIGKILLed 30 s later. torchrun itself exits 1
    # after a SIGTERM, whatever its workers' codes (docs/checkpoints.md#preemption).
    assert_stopped_in_time(text)
    assert proc.returncode == 1, text[-6000:]
    marker = json.loads((run / "preempted.json").read_text())
    step = marker["step"]
    assert marker["stopped"] == "preempted" and marker["signal"] == "SIGTERM", marker
    assert 4 <= step < 12, marker  # the step each rank was in when the signal came (or the next)
    said = [line for line in text.splitlines() if line.startswith("zerolab: stopped after")]  # rank 0's, once
    assert len(said) == 1 and said[0].startswith(f"zerolab: stopped after step {step} of 12 on SIGTERM"), text[-6000:]
    assert (run / "checkpoints" / f"step_{step:08d}" / "meta.json").exists(), text[-6000:]
    assert read_metrics(run)[-1] == {"step": step, "stopped": "preempted", "signal": "SIGTERM",
                                     "checkpoint": marker["checkpoint"]}
    assert not (run / "model.safetensors").exists()  # stopped, not finished

    resumed = run_train(run, 2, *COMMON, "trainer.max_steps=12", "checkpoint.resume=auto")
    assert f"resumed at step {step}" in resumed.stdout + resumed.stderr
    assert not (run / "preempted.json").exists()  # the resumed run cleared the stale marker
    wr, wi = load_weights(ref), load_weights(run)
    assert all(torch.equal(wr[k], wi[k]) for k in wr), "resumed weights differ from the uninterrupted run"


@pytest.mark.parametrize("nproc, strategy", [(2, "zero2"), (3, "zero3")])
def test_one_rank_signalled_stops_every_rank_after_the_same_step(tmp_path, nproc, strategy):
    """SIGUSR1 to the last rank alone (a node's own warning): the stop agreement (one MAX
    all-reduce per step over the host group) makes every rank stop after the same step, save
    there together, and the resumed run ends bitwise where an uninterrupted one does."""
    job = [f"strategy={strategy}", "trainer.max_steps=12"]
    ref = tmp_path / "ref"
    ranks.train(ref, nproc, *COMMON, *job)
    run = tmp_path / "run"
    head = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "train.py")]
    proc, out = start(head, run, *job)
    out.until("step 4/12 |")
    os.kill(rank_pid(proc.pid, nproc - 1), signal.SIGUSR1)
    text = finish(proc, out, timeout=90)
    assert_stopped_in_time(text)
    # One line for the job (rank 0 says what every rank agreed), naming the rank that got the signal
    # (torchrun's failure block may quote it again, indented, from the error file train.py writes).
    stops = re.findall(r"^zerolab: stopped after step (\d+) of 12 on (.*?); checkpoint", text, re.MULTILINE)
    assert len(stops) == 1 and stops[0][1] == f"SIGUSR1 (received by rank {nproc - 1})", text[-6000:]
    assert len(re.findall(r"exitcode\s*:\s*75 ", text)) == nproc, text[-6000:]  # every worker: EX_TEMPFAIL
    step = int(stops[0][0])
    assert (run / "checkpoints" / f"step_{step:08d}" / "meta.json").exists()
    ranks.train(run, nproc, *COMMON, *job, "checkpoint.resume=auto")
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, 13))  # one history
    wr, wi = load_weights(ref), load_weights(run)
    assert all(torch.equal(wr[k], wi[k]) for k in wr), "resumed weights differ from the uninterrupted run"


def test_usr1_to_a_bare_torchrun_agent_saves_when_it_forwards_usr1(tmp_path):
    """torchrun's agent handles TERM, INT, HUP and QUIT; a USR1 kills it (and its workers, with no
    checkpoint) unless its --signals-to-handle (or PET_SIGNALS_TO_HANDLE in its environment) adds
    SIGUSR1: then it forwards the USR1 to its workers, which save and stop as on a TERM (docs: which
    signals save, per launcher). torchrun sets TORCHELASTIC_SIGNALS_TO_HANDLE from that option, so
    setting that variable by hand changes nothing."""
    run = tmp_path / "run"
    proc, out = start(TORCHRUN_2, run, "trainer.max_steps=1000",
                       env={"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"})
    out.until("step 3/1000 |")
    proc.send_signal(signal.SIGUSR1)
    text = finish(proc, out, timeout=90)
    assert_stopped_in_time(text)  # torchrun forwards the USR1 once, as it does a TERM
    assert proc.returncode == 1, text[-6000:]
    marker = json.loads((run / "preempted.json").read_text())
    assert marker["signal"] == "SIGUSR1", text[-6000:]
    assert (run / "checkpoints" / f"step_{marker['step']:08d}" / "meta.json").exists()


def test_sigterm_to_launch_script_writes_preempted_status(tmp_path):
    """launch/torchrun.sh forwards the signal, then says `preempted` and exits 75 (EX_TEMPFAIL)."""
    run = tmp_path / "run"
    proc, out = start([str(ROOT / "launch" / "torchrun.sh")], run, "trainer.max_steps=1000")
    out.until("step 2/1000 |")
    proc.send_signal(signal.SIGTERM)
    text = finish(proc, out, timeout=90)
    assert_stopped_in_time(text)
    assert proc.returncode == 75, text[-6000:]
    assert (run / "status").read_text().strip() == "preempted", text[-6000:]
    step = json.loads((run / "preempted.json").read_text())["step"]
    assert (run / "checkpoints" / f"step_{step:08d}" / "meta.json").exists()


def test_usr1_to_launch_script_at_four_ranks_stops_in_time(tmp_path):
    """Four ranks under launch/torchrun.sh, and a SIGUSR1 to the script (Slurm's warning, or `kill
    -USR1`): the script passes a TERM to torchrun, torchrun one TERM to each worker, and every rank
    saves at the same step and exits by itself (none waits for a second signal that never comes):
    said once, status preempted, exit 75. The script gives torchrun the stop's budget,
    ZEROLAB_STOP_S, as its --shutdown-timeout (read from the running agent's command line)."""
    run = tmp_path / "run"
    proc, out = start([str(ROOT / "launch" / "torchrun.sh")], run, "trainer.max_steps=1000",
                      env={"NPROC": "4", "ZEROLAB_STOP_S": "45"})
    out.until("step 2/1000 |")
    agents = [pid for pid in children(proc.pid) if b"torch.distributed.run" in cmdline(pid)]
    assert len(agents) == 1 and b"--shutdown-timeout=45" in cmdline(agents[0]).split(b"\0"), agents
    proc.send_signal(signal.SIGUSR1)
    text = finish(proc, out, timeout=120)
    assert_stopped_in_time(text)
    assert proc.returncode == 75 and (run / "status").read_text().strip() == "preempted", text[-6000:]
    got = sorted(re.findall(r"^\[default\d\]:zerolab: rank (\d) got SIGTERM", text, re.MULTILINE))
    assert got == ["0", "1", "2", "3"], text[-6000:]
    marker = json.loads((run / "preempted.json").read_text())
    meta = json.loads((run / "checkpoints" / f"step_{marker['step']:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 4 and marker["signal"] == "SIGTERM", marker


def test_rank_frozen_mid_backward_is_named(tmp_path):
    # Rank 1 SIGSTOPs itself from a hook on its loss: inside autograd, in step 4. Rank 0's gradient
    # all-reduce times out after dist.timeout_s=10; the 45 s bound counts from the stop (start-up
    # on a loaded machine is not what is measured) and is under 10 s + torchrun's 30 s grace wait.
    proc, out = start(TORCHRUN_2, tmp_path / "run", "trainer.max_steps=20", "dist.timeout_s=10",
                       "fault.kill_rank=1", "fault.at_step=4", "fault.mode=stop", "fault.phase=backward")
    out.until("rank 1 stops itself (SIGSTOP) in step 4 (backward)")
    text = finish(proc, out, timeout=45)
    assert proc.returncode == 1  # torchrun's code once rank 0 named and killed the frozen rank and exited 1
    assert "RankStopped: rank 0 was in step 4 (backward) when its collective timed out" in text, text[-6000:]
    assert "stopped: rank 1 in step 4 (backward): frozen (stopped by a signal or a debugger); killed" in text


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except OSError:
            continue
    return out


def proc_file(pid: int, name: str) -> bytes:
    """/proc/<pid>/<name> (cmdline, environ: NUL-separated), empty if the process is gone."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def cmdline(pid: int) -> bytes:
    return proc_file(pid, "cmdline")


def rank_pid(agent_pid: int, rank: int) -> int:
    """The worker of torchrun agent `agent_pid` that runs `rank` (from its environment)."""
    for pid in children(agent_pid):
        env = dict(kv.split(b"=", 1) for kv in proc_file(pid, "environ").split(b"\0") if b"=" in kv)
        if env.get(b"RANK") == str(rank).encode():
            return pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {agent_pid}")


def test_rank_frozen_from_outside_is_named(tmp_path):
    proc, out = start(TORCHRUN_2, tmp_path / "run", "trainer.max_steps=1000", "dist.timeout_s=10")
    out.until("step 3/1000 |")
    os.kill(rank_pid(proc.pid, 1), signal.SIGSTOP)  # wherever it is: every step has a collective
    text = finish(proc, out, timeout=45)  # as above: 10 s + margin, under 10 s + torchrun's 30 s grace
    assert proc.returncode == 1  # as above
    # (either rank may be between two steps: "after step N, before step N+1 began")
    assert re.search(r"RankStopped: rank 0 was (in|after) step", text), text[-6000:]
    assert re.search(r"stopped: rank 1 (in|after) step", text), text[-6000:]
    assert "frozen (stopped by a signal or a debugger); killed" in text
