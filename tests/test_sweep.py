"""`python train.py -m ... experiment=compare`: the torchrun launcher runs each job as its own
2-rank torchrun into one sweep directory, in two rounds of alternating order, then reports
(timings pooled over the rounds); nothing else is written."""
import json

from conftest import ROOT, run_python
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)


def test_compare_sweep_runs_each_job_under_torchrun(tmp_path):
    proc = run_python(str(ROOT / "train.py"), "-m", "experiment=compare", "strategy=ddp,torch_zero",
                      "model=gpt_tiny", "data.micro_batch=4", "trainer.max_steps=4", "trainer.eval_every=2",
                      "trainer.log_every=1",  # every step timed (the experiment logs its first and last only)
                      f"run.root={tmp_path / 'runs'}",
                      "logging.wandb.mode=disabled", cwd=tmp_path,
                      timeout=540)  # 4 jobs; generous: a loaded 2-core machine
    sweeps = list((tmp_path / "runs" / "compare").iterdir())
    assert len(sweeps) == 1
    sweep = sweeps[0]
    assert sorted(p.name for p in sweep.iterdir()) == [
        "0-ddp", "0-ddp-r1", "0-ddp-r1.log", "0-ddp.log", "1-torch_zero", "1-torch_zero-r1", "1-torch_zero-r1.log",
        "1-torch_zero.log", "multirun.yaml", "report", "sweep.json"]
    # Hydra wrote nothing into the working directory besides zerolab's runs/ (no outputs/, multirun/, .hydra/).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    index = json.loads((sweep / "sweep.json").read_text())
    jobs = index["jobs"]
    # the second round runs the list in reverse order
    assert [(j["name"], j["round"]) for j in jobs] == [
        ("0-ddp", 0), ("1-torch_zero", 0), ("1-torch_zero-r1", 1), ("0-ddp-r1", 1)]
    assert [j["status"] for j in jobs] == ["ok"] * 4
    assert len(index["loadavg"]["before"]) == 3 and len(index["loadavg"]["after"]) == 3
    for job, strategy in zip(jobs, ["ddp", "torch_zero", "torch_zero", "ddp"]):
        summary = json.loads((sweep / job["name"] / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["strategy"] == strategy  # really 2 ranks each
        assert "torch.distributed.run" in job["command"]
    assert "| torch_zero |" in proc.stdout and str(sweep / "report" / "loss.png") in proc.stdout
    # one row per strategy, its timings pooled over both rounds (2 rounds x 3 timed steps)
    report = json.loads((sweep / "report" / "report.json").read_text())
    assert report["runs"] == ["ddp", "torch_zero"]
    assert report["timing"]["torch_zero"]["rounds"] == 2 and report["timing"]["torch_zero"]["steps"] == 6
    assert "Load average" in report["machine"] and "before" in report["machine"]


def test_failed_job_is_reported_and_the_sweep_fails(tmp_path):
    proc = run_python(str(ROOT / "train.py"), "-m", "experiment=compare", "strategy=ddp",
                      "trainer.max_steps=2", "data.global_batch=7", "hydra.launcher.report=false",
                      "hydra.launcher.rounds=1",
                      f"run.root={tmp_path / 'runs'}", "logging.wandb.mode=disabled", cwd=tmp_path, check=False)
    assert proc.returncode == 1  # the launcher raises after the sweep: Hydra's exit code 1
    assert "FAILED" in proc.stderr and "data.global_batch=7" in proc.stderr
