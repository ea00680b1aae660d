"""What the training loop shows and where wandb writes, in-process."""
import logging

from zerolab.run.metrics import Progress


def test_progress_without_a_terminal_is_one_line_per_logged_step(caplog):
    # pytest captures stdout and stderr, so neither is a terminal here: no bar, plain log lines
    with caplog.at_level(logging.INFO, logger="zerolab.run.metrics"):
        p = Progress(True, True, 30, 0, "ddp")
        assert p.bar is None
        p.logged(5, 5.4321, 0.0512, 1e-3)
        p.advance()
        p.logged(6, 5.4, 0.05, 1e-3, skipped=True)
        p.close()
        Progress(False, True, 30, 0, "ddp").logged(7, 1.0, 0.1, 1e-3)  # not rank 0: silent
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step 5/30 | loss 5.4321 | step 0.051 s | lr 0.001",
                     "step 6/30 | loss 5.4000 | step 0.050 s | lr 0.001 | update skipped"]


def _logging_cfg(mode="auto"):
    from zerolab.config import LoggingConfig

    cfg = LoggingConfig()
    cfg.wandb.mode = mode
    return cfg


def test_wandb_mode_disabled_in_the_environment_is_respected(tmp_path, monkeypatch):
    """mode=auto used to pass mode=offline explicitly and write an offline run anyway."""
    from zerolab.run.metrics import MetricsSink

    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = MetricsSink(str(tmp_path), _logging_cfg("auto"), True, "exp", "ddp", {})
    sink.log({"step": 1, "loss": 1.0})
    sink.close({"final_loss": 1.0})
    assert sink.wandb is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no wandb/ directory


def test_wandb_environment_wins_under_auto_only():
    from zerolab.run.metrics import wandb_init_kwargs

    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "theirs", "WANDB_RUN_GROUP": "g", "WANDB_DIR": "/x"}
    kw = wandb_init_kwargs(_logging_cfg("auto"), "/runs/a", "exp", "zero2", {}, environ=env)
    # not passed, so wandb reads them from the environment; the others are zerolab's
    assert not {"mode", "project", "group", "dir"} & kw.keys()
    assert (kw["name"], kw["job_type"], kw["entity"]) == ("a", "zero2", None)
    kw = wandb_init_kwargs(_logging_cfg("auto"), "/runs/a", "exp", "ddp", {}, environ={})
    assert (kw["mode"], kw["project"], kw["group"], kw["dir"]) == ("offline", "zerolab", "exp", "/runs/a")
    keyed = wandb_init_kwargs(_logging_cfg("auto"), "/r", "e", "d", {}, environ={"WANDB_API_KEY": "k"})
    assert keyed["mode"] == "online"
    # an explicit mode is the config's word: passed as given, whatever the environment says
    assert wandb_init_kwargs(_logging_cfg("offline"), "/r", "e", "d", {}, environ=env)["mode"] == "offline"
    assert wandb_init_kwargs(_logging_cfg("disabled"), "/r", "e", "d", {}, environ={"WANDB_MODE": "online"}) is None
    assert wandb_init_kwargs(_logging_cfg("auto"), "/r", "e", "d", {}, environ={"WANDB_DISABLED": "true"}) is None


def test_a_record_that_does_not_fit_is_cut_back_and_stops_the_run(tmp_path, monkeypatch):
    """An ENOSPC injected at the write, after part of the record went out (what a filling disk
    does): the partial record is cut off again, the sink says why and writes nothing more, the
    run is asked to stop (StopRequest.write_failed), and closing raises nothing. (A real full
    tmpfs under a real job: tests/test_checkpoint_safety.py.)"""
    import errno
    import json
    import os

    import zerolab.run.metrics as metrics
    from zerolab.run.preempt import StopRequest

    monkeypatch.setattr(StopRequest, "write_failure", None)
    sink = metrics.MetricsSink(str(tmp_path), _logging_cfg("disabled"), True, "exp", "ddp", {})
    assert sink.log({"step": 1, "loss": 1.0}) is None
    real_write, calls = os.write, []

    def filling(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[:len(data) // 2])  # half of it fits ...
        raise OSError(errno.ENOSPC, "No space left on device")  # ... the rest does not

    monkeypatch.setattr(metrics.os, "write", filling)
    assert sink.log({"step": 2, "loss": 0.5, "note": "x" * 200}) == "No space left on device"
    assert sink.log({"step": 3, "loss": 0.4}) == "No space left on device" and len(calls) == 2  # nothing more
    sink.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [1]
    path, what = StopRequest.write_failure
    assert path == str(tmp_path / "metrics.jsonl")
    assert what == (f"the record of step 2 did not fit in {path} (No space left on device); the records up to step 1 "
                    "are there, whole")
