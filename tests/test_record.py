"""One run, one record (zerolab/run/record.py): a fresh start never writes a second history into a
run directory, and a resume cuts the record back to its step, atomically.

Fast tier: the rules on directories built here. The slow tier (real torchrun jobs, a kill inside
the cut) is in tests/test_record_runs.py.
"""
import json
import os

import pytest

from zerolab.run import record
from zerolab.config import ConfigError, compose


def write_metrics(run_dir, steps, torn_tail=False):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in steps]
    lines.append(json.dumps({"step": steps[-1], "stopped": "preempted"}))
    text = "\n".join(lines) + "\n" + ('{"step": 99, "lo' if torn_tail else "")
    (run_dir / "metrics.jsonl").write_text(text)


def finished_run(run_dir, steps=range(1, 11), ckpt_steps=(8,)):
    write_metrics(run_dir, list(steps))
    for name in ("summary.json", "model.safetensors", "wandb_run_id"):
        (run_dir / name).write_text("x")
    for s in ckpt_steps:
        (run_dir / "checkpoints" / f"step_{s:08d}").mkdir(parents=True)
    return run_dir


def check(run_dir, *overrides):
    cfg = compose([f"run.dir={run_dir}", *overrides])
    record.check(cfg, str(run_dir), str(run_dir / "checkpoints"))


def snapshot(run_dir):
    return {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_fresh_start_over_a_record_is_refused_with_every_way_on(tmp_path, monkeypatch):
    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    run = finished_run(tmp_path / "run")
    before = snapshot(run)
    with pytest.raises(record.RecordExists) as info:
        check(run)
    msg = str(info.value)
    assert isinstance(info.value, ConfigError) and info.value.same_on_every_rank  # exit 2, said by rank 0
    assert "metrics.jsonl (steps 1-10)" in msg and "summary.json" in msg and "model.safetensors" in msg
    assert "checkpoint.resume=auto (from step_00000008)" in msg and "another run.dir" in msg
    assert ("run.overwrite=true (it removes metrics.jsonl, summary.json, model.safetensors, wandb_run_id, "
            "checkpoints)") in msg
    assert snapshot(run) == before  # nothing touched


def test_resume_auto_without_a_checkpoint_is_refused_over_a_record(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    run = finished_run(tmp_path / "run", ckpt_steps=())
    with pytest.raises(record.RecordExists, match="found no checkpoint") as info:
        check(run, "checkpoint.resume=auto")
    assert "checkpoint.resume=auto (from" not in str(info.value)  # nothing to continue from: not advised
    check(run.parent / "empty", "checkpoint.resume=auto")  # an empty (or new) directory: nothing to protect


def test_what_passes_the_check(tmp_path, monkeypatch):
    run = finished_run(tmp_path / "run")
    check(run, "checkpoint.resume=auto")  # continues; the trainer cuts the record back to its step
    check(run, f"checkpoint.resume={run / 'checkpoints' / 'step_00000008'}")
    check(run, "run.overwrite=true")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a later round of the job that wrote it
    check(run)
    with pytest.raises(ConfigError, match="choose one"):
        compose(["run.overwrite=true", "checkpoint.resume=auto"])


def test_overwrite_removes_what_it_names_and_keeps_the_rest(tmp_path, caplog):
    run = finished_run(tmp_path / "run")
    (run / "config.yaml").write_text("kept")
    (run / "logs").mkdir()
    cfg = compose([f"run.dir={run}", "run.overwrite=true"])
    with caplog.at_level("WARNING", logger="zerolab"):
        record.prepare(cfg, str(run), str(run / "checkpoints"))
    left = sorted(p.name for p in run.iterdir())
    assert left == ["config.yaml", "logs"]
    said = caplog.text
    for name in ("metrics.jsonl", "summary.json", "model.safetensors", "wandb_run_id", "checkpoints"):
        assert f"removing {run / name}" in said


def test_cut_back_keeps_steps_up_to_the_resume_step(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, list(range(1, 11)), torn_tail=True)
    assert record.cut_back(str(run), 8) == 4  # steps 9, 10, the preempted line of step 10, the torn line
    kept = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == list(range(1, 9))
    assert record.cut_back(str(run), 8) == 0  # nothing more to drop: the file is left as it is
    assert record.cut_back(str(tmp_path / "none"), 3) == 0


def test_a_cut_that_dies_before_its_rename_leaves_the_old_record(tmp_path):
    """The kill between writing the kept prefix and renaming it: the old file is whole, the
    temporary file is never read and the next cut removes it (a real kill: test_record_runs.py)."""
    run = tmp_path / "run"
    write_metrics(run, list(range(1, 6)))
    before = (run / "metrics.jsonl").read_bytes()

    def die():
        raise SystemExit("killed here")

    with pytest.raises(SystemExit):
        record.cut_back(str(run), 2, before_replace=die)
    assert (run / "metrics.jsonl").read_bytes() == before
    stale = run / f"metrics.jsonl.tmp.{os.getpid()}"
    stale.write_text("half")  # what a SIGKILLed cut leaves (atomic_path removes it on an exception)
    record.cut_back(str(run), 2)
    assert not stale.exists()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("keep, every, max_steps, resume, kept, expected", [
    # the first save of a fresh run fails (nothing kept): with keep_last=2 the rerun holds one kept
    # checkpoint beside the one it writes, so two need room, not one
    (2, 5, 20, 0, 0, 2),
    (2, 5, 20, 5, 1, 1),  # resumed from the one kept: one more beside it at a time
    (3, 1, 10, 2, 1, 2),  # keep_last=3 keeps 2 while it writes the third
    (2, 5, 20, 15, 1, 1),  # one save left (step 20)
    (1, 1, 4, 0, 0, 2),  # keep_last=1 still keeps the newest good one while it writes
    (0, 5, 20, 5, 1, 3),  # keep_last=0 keeps every save: 10, 15, 20
    (2, 0, 20, 0, 0, 0),  # checkpoint.every=0: no saves
    (5, 10, 20, 0, 0, 2),  # only two saves in the whole run
])
def test_room_for_the_checkpoints_the_rest_of_a_run_keeps(keep, every, max_steps, resume, kept, expected):
    from zerolab.checkpoint.room import saves_beyond_kept

    cfg = compose([f"checkpoint.keep_last={keep}", f"checkpoint.every={every}", f"trainer.max_steps={max_steps}"])
    assert saves_beyond_kept(cfg, resume, kept) == expected
