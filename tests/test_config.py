"""Bad configuration fails fast, with exit code 2, a message naming the key and the allowed
values, and before any process group exists."""
import pytest

from conftest import run_python
from zerolab.config import ConfigError, compose


@pytest.mark.parametrize("override, expected", [
    ("precision.name=fp8", "precision.name='fp8' is not valid; allowed values: fp32, bf16, fp16, bf16_pure"),
    ("strategy.name=ddpp", "strategy.name='ddpp' is not valid; allowed values:"),
    ("trainer.max_steps=0", "trainer.max_steps=0 must be > 0"),
    ("trainer.foo=1", "Could not override 'trainer.foo'"),
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("strategy=nosuch", "strategy=nosuch: no such option of config group strategy"),
    ("model.n_head=3", "model.n_embd=64 must be divisible by model.n_head=3"),
    ("data.global_batch=12", "data.global_batch=12 is not divisible by data.micro_batch"),
    ("precision.master=remainder", "needs precision=bf16: under precision=fp32"),  # docs/below-the-floor.md
])
@pytest.mark.slow
def test_bad_config_exits_2_before_process_group(tmp_path, override, expected):
    proc = run_python("train.py", f"run.dir={tmp_path / 'run'}", "logging.wandb.mode=disabled", override,
                      check=False, env={"WORLD_SIZE": "1"} if "global_batch" not in override else {})
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr + proc.stdout
    # Nothing ran: the run directory was never created.
    assert not (tmp_path / "run").exists()


def test_global_batch_derives_accumulation():
    import os

    os.environ.pop("WORLD_SIZE", None)
    cfg = compose(["data.global_batch=32", "data.micro_batch=8"])
    assert cfg.trainer.grad_accum_steps == 4


def test_compose_rejects_bad_value():
    with pytest.raises(ConfigError, match="optim.name='adamx'"):
        compose(["optim.name=adamx"])


def test_max_skipped_share_must_be_a_share():
    with pytest.raises(ConfigError, match=r"trainer.max_skipped_share=1.5 must be in \[0, 1\]"):
        compose(["trainer.max_skipped_share=1.5"])
