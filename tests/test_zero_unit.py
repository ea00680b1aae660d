"""zerolab's ZeRO sharder in one process (world size 1, gloo on an in-memory store): cases that
need no second rank to show, kept in the fast tier."""
import pytest
import torch

from conftest import fixed_corpus, rel_l2_diff
from zerolab.config import compose
from zerolab.models import build_model
from zerolab.trainer import Trainer


@pytest.fixture()
def ctx(one_rank):
    return one_rank  # conftest: a one-process gloo group


def train_with_frozen(ctx, tmp_path, strategy: str, steps: int = 3) -> tuple[dict, dict]:
    cfg = compose([f"strategy={strategy}", "model=gpt_tiny", "model.bias=false", "trainer.eval_every=0",
                   "data.micro_batch=2", f"data.path={fixed_corpus()}", f"run.dir={tmp_path / strategy}",
                   "logging.wandb.mode=disabled", "logging.progress=false", "run.save_model=false"])
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model)
    frozen = ("blocks.0.attn.qkv.weight", "blocks.1.ln_1.weight")
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen}
    trainer = Trainer(cfg, ctx, model=model)
    for step in range(steps):
        trainer.train_step(step)
    weights = trainer.strategy.consolidated_state_dict()
    trainer.close()
    return weights, before


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_frozen_parameters_stay_outside_the_buckets(ctx, tmp_path, strategy):
    """A frozen parameter (requires_grad=False, in no param group) used to make setup fail with a
    bare KeyError; it now trains like DDP: frozen tensors unchanged, the rest equal to DDP's.
    World size 1: both strategies do the same arithmetic apart from ZeRO's flat shard, so they
    agree to fp32 rounding (the 1e-6 argument of tests/test_zero.py)."""
    zero, before = train_with_frozen(ctx, tmp_path, strategy)
    ddp, _ = train_with_frozen(ctx, tmp_path, "ddp")
    for name, value in before.items():
        assert torch.equal(zero[name], value.float()), f"{strategy} changed frozen {name}"
    assert rel_l2_diff(zero, ddp) < 1e-6  # fp32 rounding of one flat shard vs per-tensor: test_zero.py argues 1e-6
    assert not torch.equal(zero["blocks.0.mlp.fc.weight"], ddp["blocks.0.mlp.fc.weight"] * 0)  # trained
