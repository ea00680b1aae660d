"""`python train.py -m ... experiment=compare`: the torchrun launcher runs each job as its own
2-rank torchrun into one sweep directory, then reports; nothing else is written."""
import json

from conftest import ROOT, run_python
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)


def test_compare_sweep_runs_each_job_under_torchrun(tmp_path):
    proc = run_python(str(ROOT / "train.py"), "-m", "experiment=compare", "strategy=ddp,torch_zero",
                      "trainer.max_steps=4", "trainer.eval_every=2", f"run.root={tmp_path / 'runs'}",
                      "logging.wandb.mode=disabled", cwd=tmp_path)
    sweeps = list((tmp_path / "runs" / "compare").iterdir())
    assert len(sweeps) == 1
    sweep = sweeps[0]
    assert sorted(p.name for p in sweep.iterdir()) == [
        "0-ddp", "0-ddp.log", "1-torch_zero", "1-torch_zero.log", "multirun.yaml", "report", "sweep.json"]
    # Hydra wrote nothing into the working directory besides zerolab's runs/ (no outputs/, multirun/, .hydra/).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    jobs = json.loads((sweep / "sweep.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["ok", "ok"]
    for job, strategy in zip(jobs, ["ddp", "torch_zero"]):
        summary = json.loads((sweep / job["name"] / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["strategy"] == strategy  # really 2 ranks each
        assert "torch.distributed.run" in job["command"]
    assert "| torch_zero |" in proc.stdout and str(sweep / "report" / "loss.png") in proc.stdout


def test_failed_job_is_reported_and_the_sweep_fails(tmp_path):
    proc = run_python(str(ROOT / "train.py"), "-m", "experiment=compare", "strategy=ddp",
                      "trainer.max_steps=2", "data.global_batch=7", "hydra.launcher.report=false",
                      f"run.root={tmp_path / 'runs'}", "logging.wandb.mode=disabled", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "FAILED" in proc.stderr and "data.global_batch=7" in proc.stderr
