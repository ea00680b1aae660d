"""The prediction of a finished run beside what its profiled steps measured (zerolab.predict.runs,
zerolab.rehearsal.predict_run; slow tier: a real 2-rank run first). Correctness only: the
comparison reads the run's own config and parts; how close the two are is bench/predict_check.py's."""
from __future__ import annotations

import json
import statistics

import pytest

from conftest import run_ranks
from test_predict import CALIBRATION
from zerolab.errors import ConfigError
from zerolab.predict.runs import plot_comparison, read_run
from zerolab.rehearsal import predict_run
from zerolab.report.build import build_report

PARTS = ("compute", "optimizer", "comm_exposed", "other")


@pytest.mark.slow
def test_a_profiled_run_is_predicted_from_its_own_directory(tmp_path, monkeypatch):
    calibration = tmp_path / "cal.json"  # the test's own figures: nothing depends on this machine's calibration
    calibration.write_text(json.dumps(CALIBRATION))
    monkeypatch.setenv("ZEROLAB_CPU_CALIBRATION", str(calibration))
    run = tmp_path / "run"
    codes = run_ranks(run, 2, "model=gpt_tiny", "strategy=zero2", "data.micro_batch=2", "trainer.max_steps=6",
                      "profile.steps=[3,5]", "trainer.eval_every=0", "run.save_model=false")
    assert codes == [0, 0]
    job = read_run(str(run))
    assert (job.world, job.strategy, job.cfg.model.name) == (2, "zero2", "gpt_tiny")
    assert set(job.measured) == {*PARTS, "step"}
    # each part is its median over the profiled steps and ranks (2 x 2 samples, from metrics.jsonl)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m[f"rank{r}/time/compute_s"] for m in rows for r in range(2) if f"rank{r}/time/compute_s" in m]
    assert len(steps) == 4 and job.measured["compute"] == pytest.approx(statistics.median(steps), rel=1e-12)
    got = predict_run(str(run))
    assert got["strategy"] == "zero2" and got["world"] == 2 and got["hardware"] == "cpu"
    parts = got["parts"]
    assert sum(parts[p]["predicted"] for p in PARTS) == pytest.approx(parts["step"]["predicted"], rel=1e-9)
    assert all(parts[p]["measured"] == job.measured[p] for p in (*PARTS, "step"))
    assert parts["step"]["ratio"] == pytest.approx(parts["step"]["predicted"] / parts["step"]["measured"])
    plot_comparison([got], str(tmp_path / "predicted.png"))
    assert (tmp_path / "predicted.png").stat().st_size > 0
    # python -m zerolab compare lays the same prediction beside the run's profiled parts
    report = build_report([str(run)], str(tmp_path / "report"), predict="cpu")
    beside = report["predicted"][0]["parts"]  # the same medians, now with their 95 % intervals
    for p in (*PARTS, "step"):  # (the prediction is made again: its host sections are timed anew, so not equal)
        assert beside[p]["measured"] == pytest.approx(parts[p]["measured"], rel=1e-12)
        assert beside[p]["lo"] <= beside[p]["measured"] <= beside[p]["hi"]
    assert sum(beside[p]["predicted"] for p in PARTS) == pytest.approx(beside["step"]["predicted"], rel=1e-9)
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## The time model beside the profiled steps" in text and "predicted.png" in text
    assert (tmp_path / "report" / "predicted.png").stat().st_size > 0
    monkeypatch.setenv("ZEROLAB_CPU_CALIBRATION", str(tmp_path / "none.json"))  # an uncalibrated machine:
    report = build_report([str(run)], str(tmp_path / "report2"), predict="calibrated")  # said, not failed
    assert report["predicted"] == [] and "python -m zerolab.predict calibrate" in report["predicted_note"]
    with pytest.raises(ConfigError, match="python -m zerolab.predict calibrate"):
        build_report([str(run)], str(tmp_path / "report3"), predict="cpu")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the real calibration and a run: ~210 s quiet, 600 and more beside a CPU-heavy job
def test_the_default_report_calibrates_a_fresh_machine_once(tmp_path, monkeypatch):
    """`compare`'s default (auto) on a machine without a calibration measures it (the real
    calibration: 1, 2 and 3 ranks, about a minute and a half), writes it where `--hardware cpu` reads it, says
    so in the report, and lays the prediction beside the profiled parts; a second report reuses it."""
    path = tmp_path / "fresh" / "cpu-calibration.json"
    monkeypatch.setenv("ZEROLAB_CPU_CALIBRATION", str(path))
    run = tmp_path / "run"
    assert run_ranks(run, 2, "model=gpt_tiny", "strategy=ddp", "data.micro_batch=2", "trainer.max_steps=4",
                     "profile.steps=[3]", "trainer.eval_every=0", "run.save_model=false") == [0, 0]
    report = build_report([str(run)], str(tmp_path / "report"), predict="auto")
    assert path.exists() and set(json.loads(path.read_text())["ranks"]) == {"1", "2", "3"}
    assert report["predicted"] and report["predicted"][0]["hardware"] == "cpu"
    said = report["predicted_table"]
    assert said.startswith("This machine had no calibration for the time model: it was measured now, once"), said
    assert str(path) in said and "| step | predicted ÷ measured [95 %] |" in said
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## The time model beside the profiled steps" in text and "it was measured now, once" in text
    mtime = path.stat().st_mtime_ns
    again = build_report([str(run)], str(tmp_path / "report2"), predict="auto")
    assert path.stat().st_mtime_ns == mtime and "measured now" not in again["predicted_table"]


def test_a_directory_without_a_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no summary.json; a prediction needs a finished run's directory"):
        read_run(str(tmp_path))
