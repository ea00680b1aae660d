"""Batch-size LR scaling, warmup and decay, the `lr` command, and resuming at another batch."""
import math
from dataclasses import asdict

import pytest

from zerolab.config import OptimConfig
from zerolab.optim.cli import lr_main
from zerolab.optim.schedule import LRSchedule, scaled_lr


def test_scaling_rules():
    assert scaled_lr(3e-4, 256, 2560, "linear") == pytest.approx(3e-3)  # batch ×10: lr ×10
    assert scaled_lr(3e-4, 256, 2560, "sqrt") == pytest.approx(3e-4 * math.sqrt(10))
    assert scaled_lr(3e-4, 256, 2560, "none") == 3e-4
    with pytest.raises(ValueError, match="use none, linear or sqrt"):
        scaled_lr(1.0, 1, 2, "cubic")


def test_warmup_then_decay_to_floor():
    for decay in ("cosine", "linear"):
        s = LRSchedule(peak_lr=1.0, warmup_steps=10, max_steps=110, decay=decay, min_lr_ratio=0.1)
        assert [s(i) for i in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # linear warmup, in steps
        assert s(10) == pytest.approx(1.0)
        assert s(60) == pytest.approx(0.55)  # half way: the mean of peak and floor for both shapes
        assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)  # the floor, never below
        values = [s(i) for i in range(10, 111)]
        assert all(a >= b for a, b in zip(values, values[1:]))
    cos = LRSchedule(1.0, 0, 100, "cosine", 0.0)
    assert cos(25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert LRSchedule(1.0, 5, 100, "constant")(80) == 1.0


def test_from_config_scales_peak():
    cfg = OptimConfig(name="adamw", lr=1e-3, base_batch=32, lr_scaling="sqrt", warmup_steps=0)
    s = LRSchedule.from_config(cfg, global_batch=128, max_steps=10)
    assert s.peak_lr == pytest.approx(2e-3) and s.base_batch == 32 and s.batch == 128
    own = LRSchedule.from_config(OptimConfig(name="adamw", lr=1e-3, lr_scaling="linear"), 64, 10)
    assert own.peak_lr == pytest.approx(1e-3) and own.base_batch == 64  # base_batch 0: tuned at this batch


def test_resume_at_another_world_size_keeps_the_rule():
    """A run started at global batch 64 (4 ranks × 16) with lr tuned at "its own batch" resumes on
    2 ranks (batch 32): linear scaling must halve the lr, not keep it."""
    cfg = OptimConfig(name="sgd", lr=0.4, lr_scaling="linear")
    saved = asdict(LRSchedule.from_config(cfg, 64, 100))
    resumed = LRSchedule.from_config(cfg, 32, 100)
    assert resumed.peak_lr == pytest.approx(0.4)  # what the config alone would say
    msg = resumed.resume_from({**saved, "next_lr": 0.1})
    assert resumed.peak_lr == pytest.approx(0.2) and resumed.base_batch == 64
    assert "global batch 32" in msg and "64" in msg and "linear" in msg
    # Explicit base_batch: the rule already has its reference; the result is the same either way.
    cfg = OptimConfig(name="sgd", lr=0.4, lr_scaling="sqrt", base_batch=16)
    saved = asdict(LRSchedule.from_config(cfg, 64, 100))
    resumed = LRSchedule.from_config(cfg, 32, 100)
    resumed.resume_from(saved)
    assert resumed.peak_lr == pytest.approx(0.4 * math.sqrt(2))
    # Same batch: nothing to say. No scaling rule: the lr stays and the message says how to scale.
    assert LRSchedule.from_config(cfg, 64, 100).resume_from(saved) is None
    none = LRSchedule.from_config(OptimConfig(name="sgd", lr=0.4), 32, 100)
    assert "lr_scaling=none" in none.resume_from(
        asdict(LRSchedule.from_config(OptimConfig(name="sgd", lr=0.4), 64, 100)))
    assert none.peak_lr == 0.4


def test_lr_command(capsys):
    assert lr_main(["--base-lr", "3e-4", "--base-batch", "256", "--batch", "2560", "--rule", "linear"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("lr = 0.003 ")
    with pytest.raises(SystemExit):
        lr_main(["--base-lr", "3e-4", "--base-batch", "0", "--batch", "10"])


def test_large_batch_lamb_experiment():
    from zerolab.config import compose, global_batch, validate

    cfg = compose(["experiment=large_batch_lamb"])
    assert cfg.experiment == "large_batch_lamb" and cfg.optim.name == "lamb"
    cfg = validate(cfg, world_size=2)  # 2 ranks: 256 = 8 per micro-batch x 16 micro-batches x 2
    assert global_batch(cfg, 2) == 256 and cfg.trainer.grad_accum_steps == 16
    peak = LRSchedule.from_config(cfg.optim, 256, cfg.trainer.max_steps).peak_lr
    assert peak == pytest.approx(4e-3 * math.sqrt(256 / 32))


@pytest.mark.slow
def test_resume_on_fewer_ranks_rescales_lr_and_says_so(tmp_path):
    """2 ranks × 4 sequences (batch 8), linear rule with lr tuned at the run's own batch; resumed
    on 1 rank (batch 4) the peak lr halves, and the log line says why."""
    from conftest import read_metrics, run_train

    run = tmp_path / "run"
    common = ["model=mlp", "data=synthetic", "data.micro_batch=4", "optim=sgd", "optim.lr=0.2",
              "optim.lr_scaling=linear", "optim.decay=constant", "optim.warmup_steps=0", "trainer.eval_every=0",
              "checkpoint.every=2"]
    run_train(run, 2, *common, "trainer.max_steps=2")
    proc = run_train(run, 1, *common, "trainer.max_steps=4", "checkpoint.resume=auto")
    lrs = {r["step"]: (r["lr"], r["global_batch"]) for r in read_metrics(run)}
    assert lrs[1] == (pytest.approx(0.2), 8) and lrs[4] == (pytest.approx(0.1), 4)
    assert "resumed at global batch 4 (the checkpoint ran at 8): optim.lr_scaling=linear" in proc.stdout + proc.stderr
