"""Steps that are not logged decide the clip on the device and read nothing on the host.

Fast tier: one in-process gloo rank (conftest's one_rank). Steps 0 and the last are logged
(the first step of a run and the final eval always are); with trainer.log_every larger than the
run, the steps between are decided on the device (Strategy.unscale_clip_update).
"""
from __future__ import annotations

import os

import pytest
import torch

from conftest import fixed_corpus
from zerolab.config import compose
from zerolab.strategies.base import NonFiniteGradient
from zerolab.trainer import Trainer

STEPS = 5


def trainer_for(ctx, run_dir, strategy: str, *extra: str) -> Trainer:
    cfg = compose([f"strategy={strategy}", "model=gpt_tiny", "model.bias=false", "trainer.eval_every=0",
                   "data.micro_batch=2", f"data.path={fixed_corpus()}", f"run.dir={run_dir}",
                   f"trainer.max_steps={STEPS}", "logging.wandb.mode=disabled", "logging.progress=false",
                   "run.save_model=false", "strategy.bucket_mb=0.05", *extra])
    torch.manual_seed(cfg.trainer.seed)
    return Trainer(cfg, ctx)


class HostReads:
    """Counts the ways a tensor's value reaches Python (each one a device sync on CUDA) while the
    strategy's step runs. The optimizer's step counters are left out: they are CPU tensors on
    every device (zerolab.optim.base), so reading them never waits for the device."""
    WAYS = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch, strategy):
        self.count, self.active = 0, False
        self.host_counters = {id(st["step"]) for st in strategy.optimizer.state.values() if "step" in st}
        for way in self.WAYS:
            original = getattr(torch.Tensor, way)

            def counted(t, *a, _original=original, **k):
                if self.active and id(t) not in self.host_counters:
                    self.count += 1
                return _original(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, way, counted)
        step = strategy.step

        def watched(*a, **k):
            self.active = True
            try:
                return step(*a, **k)
            finally:
                self.active = False
        monkeypatch.setattr(strategy, "step", watched)


@pytest.mark.parametrize("strategy,precision", [("ddp", "fp32"), ("ddp", "bf16"), ("zero2", "fp32"),
                                                ("zero3", "fp32"), ("zero1", "bf16"),
                                                ("ddp", "bf16_pure"), ("zero2", "bf16_pure"), ("zero3", "bf16")])
def test_unlogged_steps_clip_on_the_device_bitwise_as_logged_ones(one_rank, tmp_path, monkeypatch,
                                                                   strategy, precision):
    """The same run logged at every step (every clip decided on the host) and logged only at its
    first and last step: bitwise the same weights, the same norms, with the clip active at every
    step (grad_clip 0.05 is below every norm here); the strategy's step reads nothing on the host
    at the unlogged steps."""
    weights, norms = {}, {}
    for every in (1, 100):
        trainer = trainer_for(one_rank, tmp_path / str(every), strategy, f"precision={precision}",
                              f"trainer.log_every={every}", "optim.grad_clip=0.05", "trainer.grad_accum_steps=2")
        norms[every], reads = [], []
        for step in range(STEPS):
            logged = trainer.logs_step(step)
            counter = HostReads(monkeypatch, trainer.strategy) if not logged else None
            _, _, info = trainer.train_step(step)
            if counter is not None:
                reads.append(counter.count)
                monkeypatch.undo()
            assert isinstance(info.grad_norm, torch.Tensor) != logged
            norms[every].append((float(info.grad_norm), float(info.grad_norm_clipped)))
        weights[every] = trainer.strategy.consolidated_state_dict()
        trainer.metrics.close()
        trainer.progress.close()
        if every == 100:
            assert reads == [0] * (STEPS - 2), reads  # steps 1..3 unlogged, none read the host
    assert norms[1] == norms[100]
    # Clip active: the clipped norm is n·0.05/(n + 1e-6) exactly, up to the two roundings of
    # that product and quotient in fp64 (~2e-16 each): 1e-12 relative is far above both.
    assert all(n > 0.05 and c == pytest.approx(0.05 * n / (n + 1e-6), rel=1e-12) for n, c in norms[1]), norms[1]
    assert weights[1].keys() == weights[100].keys()
    for k in weights[1]:
        assert torch.equal(weights[1][k], weights[100][k]), k


def test_nonfinite_unlogged_step_stops_before_its_weights_are_saved(one_rank, tmp_path):
    """An inf gradient at unlogged step 1 poisons the weights on the device; the checkpoint after
    step 2 settles first and stops the run naming step 1, and no checkpoint of it exists."""
    trainer = trainer_for(one_rank, tmp_path / "run", "zero2", "trainer.log_every=100", "checkpoint.every=2",
                          "fault.inf_grad_step=1")
    with pytest.raises(NonFiniteGradient, match=r"step 1 \(0-based.*not finite \(seen at step 2"):
        trainer.fit()
    trainer.metrics.close()
    trainer.progress.close()
    ckpt = tmp_path / "run" / "checkpoints"
    assert not ckpt.exists() or not [d for d in os.listdir(ckpt) if d.startswith("step_")]


def test_skip_and_fp16_still_decide_on_the_host(one_rank, tmp_path):
    """trainer.nonfinite=skip and fp16's loss scale must know before the update whether to skip
    it: their unlogged steps keep the host decision (a float norm)."""
    for i, extra in enumerate((["trainer.nonfinite=skip"], ["precision=fp16"])):
        trainer = trainer_for(one_rank, tmp_path / str(i), "ddp", "trainer.log_every=100", *extra)
        trainer.train_step(0)
        _, _, info = trainer.train_step(1)
        assert not trainer.logs_step(1) and isinstance(info.grad_norm, float), extra
        trainer.metrics.close()
        trainer.progress.close()
