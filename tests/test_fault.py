"""Fault tolerance under torchrun, with real processes and real gloo collectives.

- A rank that dies with `--max-restarts`: torchrun restarts the group, which resumes from the
  newest checkpoint (checkpoint.resume=auto) and ends with exactly the weights of a run that
  never failed.
- A rank that hangs or dies without restarts: the job ends (no test sleeps; the subprocess
  timeout below only bounds a broken implementation) with an error naming the rank.
"""
import re

import pytest
import torch

from conftest import ROOT, TORCHRUN, load_weights, read_metrics, run_process, run_train

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

COMMON = ["model=gpt_tiny", "data=text", "trainer.eval_every=0", "data.micro_batch=4", "trainer.max_steps=7",
          "model.dropout=0.1", "logging.wandb.mode=disabled", "logging.progress=false"]


def torchrun(run_dir, *overrides, restarts=0, timeout=300):
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}", str(ROOT / "train.py"),
           f"run.dir={run_dir}", *COMMON, *overrides]
    # torchrun's own store is shared across restart rounds; zerolab.dist namespaces it per round.
    return run_process(cmd, timeout=timeout)


def test_killed_rank_restarts_and_matches_uninterrupted(tmp_path):
    ref = tmp_path / "ref"
    run_train(ref, 2, *COMMON, "trainer.max_steps=12")
    run = tmp_path / "run"
    proc = torchrun(run, "trainer.max_steps=12", "checkpoint.every=4", "checkpoint.resume=auto", "fault.kill_rank=1",
                    "fault.at_step=8", "fault.mode=exit", restarts=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "rank 1 fails before step 8" in out  # the first attempt really died, after 7 steps ...
    assert "no checkpoint in" in out and "resumed at step 4" in out  # ... and the restart resumed
    # One history: the restart cut the record back to step 4 before logging 5, 6, 7 again.
    steps = [r["step"] for r in read_metrics(run)]
    assert steps == list(range(1, 13)), steps
    wr, wi = load_weights(ref), load_weights(run)
    assert all(torch.equal(wr[k], wi[k]) for k in wr), "final weights differ from the uninterrupted run"


# dist.timeout_s=10: the hung rank is only found when rank 0's collective times out, so the test
# waits that long; 10 s is the smallest that still clears start-up skew between two ranks on a
# loaded 2-core machine (tests/test_preempt.py uses the same). A dead rank (exit/raise) closes its
# connections, so its peer fails at once, whatever the timeout.
TIMEOUT = "dist.timeout_s=10"


def test_hung_rank_ends_job_naming_it(tmp_path):
    proc = torchrun(tmp_path / "run", TIMEOUT, "fault.kill_rank=1", "fault.at_step=3", "fault.mode=hang",
                    timeout=240)
    out = proc.stdout + proc.stderr
    # torchrun exits 1 when a worker fails; the first failure in its summary is rank 0's os._exit(1),
    # after it named the rank that stopped (zerolab.run.fault.stop_now)
    assert proc.returncode == 1 and re.search(r"Root Cause[\s\S]*exitcode\s*:\s*1 ", out), out[-6000:]
    assert "rank 1 fails before step 3 (fault.mode=hang)" in out
    # Rank 1 is alive (its heartbeat moves) but never began step 3, in which rank 0 waits.
    assert "RankStopped" in out and "stopped: rank 1 after step 2, before step 3 began: fell behind" in out, out[-6000:]


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_dead_rank_without_restarts_ends_job_naming_it(tmp_path, mode):
    proc = torchrun(tmp_path / "run", TIMEOUT, "fault.kill_rank=1", "fault.at_step=3", f"fault.mode={mode}",
                    timeout=240)
    out = proc.stdout + proc.stderr
    # the dead rank's own code is 1 (os._exit(1), or the uncaught InjectedFault); torchrun exits 1
    assert proc.returncode == 1 and re.search(r"Root Cause[\s\S]*exitcode\s*:\s*1 ", out), out[-6000:]
    assert f"rank 1 fails before step 3 (fault.mode={mode})" in out
    # torchrun's summary names the first failure; if rank 0 saw the broken collective first, ours does.
    assert "rank      : 1 (local_rank: 1)" in out.split("Root Cause")[-1] or "stopped: rank 1" in out


def test_dead_rank_of_four_is_named_once_as_of_the_step_it_finished(tmp_path):
    """Four ranks, rank 2 exits before step 3 (after step 2 is done): the three survivors each find a
    collective broken and judge at once, but the job says one verdict (the first posted to the
    board), naming rank 2 alone, "after step 2" in the words of the fault's own message ("fails
    before step 3"); the other survivors say only that they stop too."""
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=4", str(ROOT / "train.py"), f"run.dir={tmp_path / 'run'}",
           *COMMON, TIMEOUT, "fault.kill_rank=2", "fault.at_step=3", "fault.mode=exit"]
    proc = run_process(cmd, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "rank 2 fails before step 3 (fault.mode=exit)" in out, out[-6000:]
    verdicts = re.findall(r"^RankStopped: (.*)$", out, re.MULTILINE)
    assert len(verdicts) == 1, out[-6000:]
    stopped = verdicts[0].split("stopped: ", 1)[1].split(". A rank that dies", 1)[0]
    assert re.fullmatch(r"rank 2 after step 2, before step 3 began: exited \[pid \d+ on \S+\]", stopped), verdicts[0]
    quiet = re.findall(r"^zerolab: rank (\d) stops too \(rank (\d) named the rank that stopped\)$", out, re.MULTILINE)
    assert all(r != "2" and by != "2" for r, by in quiet) and len(quiet) <= 2, out[-6000:]


def test_watchdog_signals_only_the_process_that_posted():
    """The board of rank 0 reads three frozen ranks of a 4-rank job (a real in-memory store, real
    stopped processes on this host). Each posted host and pid match a stopped process here, but only
    rank 3's start time and boot id match too: rank 1's pid now belongs to a later process (a reused
    pid), rank 2 posted another machine's boot id (a host name two machines share). Only rank 3's
    process is killed; the other two are left as they are, and the verdict says why."""
    import os
    import signal
    import socket
    import subprocess

    import torch.distributed as dist

    from zerolab.run.fault import ProgressBoard, RankStopped, boot_id, process_start, process_state

    victims = [subprocess.Popen(["sleep", "300"]) for _ in range(3)]
    try:
        for v in victims:
            os.kill(v.pid, signal.SIGSTOP)
            os.waitpid(v.pid, os.WUNTRACED)  # returns once the child is stopped
        store = dist.HashStore()
        board = ProgressBoard(0, 4, store, timeout_s=2.0)  # beats every 0.1 s: blame() reads for 0.3 s
        board.at(5, "backward")
        posted = dist.PrefixStore("zerolab/progress/", store)
        host = socket.gethostname()
        starts = [process_start(v.pid) for v in victims]
        who = {1: f"{victims[0].pid} {starts[0] + 1} {boot_id()}",  # the pid, but a later process's start
               2: f"{victims[1].pid} {starts[1]} another-machines-boot-id",
               3: f"{victims[2].pid} {starts[2]} {boot_id()}"}  # the very process that posted
        for r, ident in who.items():
            posted.set(str(r), "5 backward")
            posted.set(f"who/{r}", f"{host} {ident}")
        with pytest.raises(RankStopped) as err:
            board.blame(RuntimeError("gloo: connection timed out"))
        board.close()
        said = str(err.value)
        assert f"rank 1 in step 6 (backward): exited [pid {victims[0].pid} on {host}]" in said, said
        assert f"rank 2 in step 6 (backward): stopped responding [pid {victims[1].pid} on {host}]" in said, said
        assert "rank 3 in step 6 (backward): frozen (stopped by a signal or a debugger); killed" in said, said
        assert victims[2].wait(timeout=60) == -signal.SIGKILL
        assert [process_state(v.pid) for v in victims[:2]] == ["T", "T"]  # untouched: still stopped
    finally:
        for v in victims:
            if v.poll() is None:
                v.kill()
                v.wait()
