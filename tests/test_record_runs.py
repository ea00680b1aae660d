"""One run, one record, with real jobs (zerolab/run/record.py; the rules in-process: test_record.py).

One chain of launches, shared by the tests below (module fixture); the ranks run without torchrun
(tests/ranks.py) except for the refusals, which are about what train.py and torchrun print:
  1. a finished 2-rank run: 10 steps, checkpoint.every=4 (it also checkpoints its last step);
  2. the same command again, as `python train.py` and under torchrun: refused (exit 2 on every
     rank), one message, nothing in the directory changed;
  3. checkpoint.resume=auto trainer.max_steps=15: continues at step 10;
  4. a resume from step 12 whose rank 0 dies inside the cut of metrics.jsonl (fault.phase=record_cut):
     the record is the old one, whole;
  5. the same resume again: the record is cut back to 12 and continues to 15, and the weights equal
     those of step 3's run (the same steps from the same checkpoints: bitwise).
Every launch that trains mirrors its metrics to wandb in offline mode, read back from wandb's own
run files: one wandb run id for the whole record, each resumed run logging from its step on.
"""
import re

import pytest
import torch

from conftest import ROOT, load_weights, rank_log, read_metrics, run_python, run_ranks, run_train, wandb_offline_runs

pytestmark = pytest.mark.slow

# wandb offline (needs no network; run_train's logging.wandb.mode=disabled comes first, this wins):
# every launch that trains mirrors into <run>/wandb, read back by test_wandb_keeps_one_run_per_record.
COMMON = ["model=gpt_tiny", "trainer.eval_every=0", "data.micro_batch=4", "checkpoint.every=4",
          "logging.wandb.mode=offline"]
ZEROLAB_FRAME = re.compile(r'File "[^"]*(/zerolab/[^"]*|train\.py)"')
RESULTS = ("metrics.jsonl", "model.safetensors", "summary.json")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    run = tmp_path_factory.mktemp("record") / "run"
    out = {"run": run}
    run_ranks(run, 2, *COMMON, "trainer.max_steps=10")
    out["ckpts_after_first"] = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    out["bytes_before"] = {n: (run / n).read_bytes() for n in RESULTS}
    out["again_python"] = run_python(str(ROOT / "train.py"), f"run.dir={run}", *COMMON, "trainer.max_steps=10",
                                     "logging.wandb.mode=disabled", check=False, timeout=120)
    out["again_torchrun"] = run_train(run, 2, *COMMON, "trainer.max_steps=10", check=False, timeout=120, torchrun=True)
    out["bytes_after_refusals"] = {n: (run / n).read_bytes() for n in RESULTS}
    run_ranks(run, 2, *COMMON, "trainer.max_steps=15", "checkpoint.resume=auto")
    out["steps_resumed"] = [r["step"] for r in read_metrics(run)]
    out["weights_resumed"] = load_weights(run)
    step12 = run / "checkpoints" / "step_00000012"
    out["metrics_before_kill"] = (run / "metrics.jsonl").read_bytes()
    out["killed"] = run_ranks(run, 2, *COMMON, "trainer.max_steps=15", f"checkpoint.resume={step12}",
                              "fault.kill_rank=0", "fault.at_step=12", "fault.mode=exit", "fault.phase=record_cut",
                              check=False, timeout=120)
    out["killed_log"] = rank_log(run)
    out["metrics_after_kill"] = (run / "metrics.jsonl").read_bytes()
    out["temps_after_kill"] = sorted(p.name for p in run.glob("metrics.jsonl.tmp.*"))
    run_ranks(run, 2, *COMMON, "trainer.max_steps=15", f"checkpoint.resume={step12}")
    out["steps_recut"] = [r["step"] for r in read_metrics(run)]
    out["temps_after_recut"] = sorted(p.name for p in run.glob("metrics.jsonl.tmp.*"))
    out["weights_recut"] = load_weights(run)
    return out


def test_a_finished_run_checkpoints_its_last_step(chain):
    assert chain["ckpts_after_first"] == ["step_00000008", "step_00000010"]


@pytest.mark.parametrize("launch", ["again_python", "again_torchrun"])
def test_starting_again_is_refused_and_changes_nothing(chain, launch):
    proc = chain[launch]
    out = proc.stdout + proc.stderr
    if launch == "again_python":
        assert proc.returncode == 2, out[-4000:]
    else:  # torchrun exits 1 when a worker fails; the workers' own code is in its summary
        assert proc.returncode == 1 and len(re.findall(r"exitcode\s*:\s*2 ", out)) == 2, out[-6000:]
    message = [line for line in out.splitlines() if line.startswith("zerolab: configuration error:")]
    assert len(message) == 1, out[-6000:]  # said once, by rank 0
    assert "already holds the record of a run (metrics.jsonl (steps 1-10)" in message[0]
    assert "checkpoint.resume=auto (from step_00000010)" in message[0] and "run.overwrite=true" in message[0]
    assert not ZEROLAB_FRAME.search(out), out[-6000:]
    assert chain["bytes_after_refusals"] == chain["bytes_before"]


def test_resume_auto_continues_a_finished_run_once_per_step(chain):
    assert chain["steps_resumed"] == list(range(1, 16))


def test_a_kill_inside_the_cut_leaves_the_old_record(chain):
    codes = chain["killed"]
    assert codes[0] == 1 and "exits while cutting the record back" in chain["killed_log"], chain["killed_log"][-4000:]
    assert chain["metrics_after_kill"] == chain["metrics_before_kill"]  # the old record, whole
    assert chain["temps_after_kill"]  # the kill really came between the write and the rename
    assert chain["steps_recut"] == list(range(1, 16)) and chain["temps_after_recut"] == []
    w1, w2 = chain["weights_resumed"], chain["weights_recut"]
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # same checkpoint, same steps: bitwise


def test_wandb_keeps_one_run_per_record(chain):
    runs = wandb_offline_runs(chain["run"])
    # first run, resume=auto, resume from 12 (the killed one never started wandb)
    assert len(runs) == 3, [r["path"] for r in runs]
    assert {r["id"] for r in runs} == {(chain["run"] / "wandb_run_id").read_text().strip()}
    assert [r["steps"] for r in runs] == [list(range(1, 11)), list(range(11, 16)), list(range(13, 16))]
    for r in runs:
        assert r["group"] == "default" and r["job_type"] == "ddp"  # the experiment groups a sweep's jobs
        for rank in (0, 1):  # per-rank figures as keys of the one run, not one run per rank
            assert f"rank{rank}/mem/params_bytes" in r["keys"] and f"rank{rank}/comm_bytes" in r["keys"]
