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
    assert wandb_init_kwargs(_logging_cfg("auto"), "/r", "e", "d", {}, environ={"WANDB_API_KEY": "k"})["mode"] == "online"
    # an explicit mode is the config's word: passed as given, whatever the environment says
    assert wandb_init_kwargs(_logging_cfg("offline"), "/r", "e", "d", {}, environ=env)["mode"] == "offline"
    assert wandb_init_kwargs(_logging_cfg("disabled"), "/r", "e", "d", {}, environ={"WANDB_MODE": "online"}) is None
    assert wandb_init_kwargs(_logging_cfg("auto"), "/r", "e", "d", {}, environ={"WANDB_DISABLED": "true"}) is None
