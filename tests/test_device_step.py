"""Steps that are not logged decide the clip on the device and read nothing on the host.

Fast tier: one in-process gloo rank (conftest's one_rank). Steps 0 and the last are logged
(the first step of a run and the final eval always are); with trainer.log_every larger than the
run, the steps between are decided on the device (zerolab.numerics).
"""
from __future__ import annotations

import os

import pytest
import torch

from conftest import fixed_corpus
from zerolab.config import compose
from zerolab.precision import LossScaleUnderflow
from zerolab.numerics import NonFiniteGradient
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
    strategy's step runs. The composed optimizers' step counters are left out: they are CPU
    tensors on every device (zerolab.optim.base), so reading them never waits for the device (the
    fused kernels' counters live on the device and are never read)."""
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


def logged_vs_unlogged(one_rank, tmp_path, monkeypatch, strategy: str, *extra: str) -> dict:
    """The same run logged at every step (every decision on the host) and logged only at its first
    and last step (the steps between decided on the device). Asserts bitwise the same weights,
    norms, skipped steps and loss scale, and that the strategy's step read nothing on the host at
    the unlogged steps; returns the host run's norms and skipped flags."""
    weights, norms, skipped, scale = {}, {}, {}, {}
    for every in (1, 100):
        trainer = trainer_for(one_rank, tmp_path / str(every), strategy, f"trainer.log_every={every}",
                              "trainer.grad_accum_steps=2", *extra)
        norms[every], skipped[every], reads = [], [], []
        for step in range(STEPS):
            logged = trainer.logs_step(step)
            counter = HostReads(monkeypatch, trainer.strategy) if not logged else None
            _, _, info = trainer.train_step(step)
            if counter is not None:
                reads.append(counter.count)
                monkeypatch.undo()
            assert isinstance(info.grad_norm, torch.Tensor) != logged
            norms[every].append((float(info.grad_norm), float(info.grad_norm_clipped)))
            skipped[every].append(bool(info.skipped))
        weights[every] = trainer.strategy.consolidated_state_dict()
        scale[every] = trainer.precision.scaler.state_dict()
        trainer.close()
        if every == 100:
            assert reads == [0] * (STEPS - 2), reads  # steps 1..3 unlogged, none read the host
    # A skipped step's norm is inf or nan (nan != nan): compare the finite ones, and where the others are.
    finite = [[n if n == n and abs(n) != float("inf") else "nonfinite" for n in pair] for pair in norms[1]]
    assert finite == [[n if n == n and abs(n) != float("inf") else "nonfinite" for n in pair] for pair in norms[100]]
    assert skipped[1] == skipped[100] and scale[1] == scale[100], (skipped, scale)
    assert weights[1].keys() == weights[100].keys()
    for k in weights[1]:
        assert torch.equal(weights[1][k], weights[100][k]), k
    return {"norms": norms[1], "skipped": skipped[1], "scale": scale[1]}


@pytest.mark.parametrize("strategy,precision", [("ddp", "fp32"), ("ddp", "bf16"), ("zero2", "fp32"),
                                                ("zero3", "fp32"), ("zero1", "bf16"),
                                                ("ddp", "bf16_pure"), ("zero2", "bf16_pure"), ("zero3", "bf16")])
def test_unlogged_steps_clip_on_the_device_bitwise_as_logged_ones(one_rank, tmp_path, monkeypatch,
                                                                   strategy, precision):
    """The clip active at every step (grad_clip 0.05 is below every norm here): bitwise the same
    run whether its steps are decided on the host or on the device."""
    run = logged_vs_unlogged(one_rank, tmp_path, monkeypatch, strategy, f"precision={precision}",
                             "optim.grad_clip=0.05")
    # Clip active: the clipped norm is n·0.05/(n + 1e-6) exactly, up to the two roundings of
    # that product and quotient in fp64 (~2e-16 each): 1e-12 relative is far above both.
    assert all(n > 0.05 and c == pytest.approx(0.05 * n / (n + 1e-6), rel=1e-12) for n, c in run["norms"]), run


@pytest.mark.parametrize("strategy,extra", [
    ("ddp", ("precision=fp16",)), ("zero1", ("precision=fp16", "optim=sgd_momentum")),
    ("zero2", ("precision=fp16",)), ("zero3", ("precision=fp16",)),
    ("ddp", ("trainer.nonfinite=skip",)), ("zero2", ("precision=bf16", "trainer.nonfinite=skip"))])
def test_unlogged_steps_skip_on_the_device_bitwise_as_logged_ones(one_rank, tmp_path, monkeypatch, strategy, extra):
    """An inf gradient at unlogged step 3 (fault.inf_grad_step): the fused optimizer skips the
    update on the device flag, fp16's loss scale halves on the device (and doubles after
    growth_interval=2 clean steps), bitwise as the host decides them; clip active elsewhere."""
    run = logged_vs_unlogged(one_rank, tmp_path, monkeypatch, strategy, *extra, "fault.inf_grad_step=3",
                             "optim.grad_clip=0.05", "precision.growth_interval=2")
    assert run["skipped"] == [False, False, True, False, False], run
    if "precision=fp16" in extra:  # x2 after steps 1-2, /2 at step 3, x2 after steps 4-5
        assert run["scale"] == {"scale": 2.0 ** 17, "clean_steps": 2, "skipped_steps": 1}, run


def test_nonfinite_unlogged_step_stops_before_its_weights_are_saved(one_rank, tmp_path):
    """An inf gradient at unlogged step 2 poisons the weights on the device; the checkpoint after
    it settles first and stops the run naming step 2, and no checkpoint of it exists."""
    trainer = trainer_for(one_rank, tmp_path / "run", "zero2", "trainer.log_every=100", "checkpoint.every=2",
                          "fault.inf_grad_step=2")
    with pytest.raises(NonFiniteGradient, match=r"step 2: the gradient norm is not finite \(seen at step 2"):
        trainer.fit()
    trainer.close()
    ckpt = tmp_path / "run" / "checkpoints"
    assert not ckpt.exists() or not [d for d in os.listdir(ckpt) if d.startswith("step_")]


def test_skips_decided_on_the_device_are_reported_at_the_next_logged_step(one_rank, tmp_path, caplog):
    """What the host would have said at once is said when the device's decisions are read: the
    skipped update (trainer.nonfinite=skip), in the log and in summary.json's count; an fp16
    overflow that takes the loss scale below precision.min_scale stops the run."""
    trainer = trainer_for(one_rank, tmp_path / "skip", "ddp", "trainer.log_every=100", "trainer.nonfinite=skip",
                          "fault.inf_grad_step=3")
    with caplog.at_level("WARNING", logger="zerolab"):
        summary = trainer.fit()
    trainer.close()
    assert summary["skipped_steps"] == 1
    assert any("1 update(s) skipped from step 3 " in r.getMessage() for r in caplog.records), caplog.text
    trainer = trainer_for(one_rank, tmp_path / "fp16", "ddp", "trainer.log_every=100", "precision=fp16",
                          "precision.min_scale=65536", "fault.inf_grad_step=3")
    with pytest.raises(LossScaleUnderflow, match="step 3: fp16 loss scale would fall to 32768"):
        trainer.fit()
    trainer.close()


@pytest.mark.parametrize("extra", [("optim=lamb",), ("optim=lars",), ("precision=bf16_pure",),
                                   ("optim.impl=foreach",)])
def test_composed_optimizers_still_skip_on_the_host(one_rank, tmp_path, extra):
    """Paths whose optimizer takes no found-inf flag (LAMB, LARS, 16-bit weights, the composed
    AdamW) must know before the update whether to skip it: their unlogged steps keep the host
    decision (a float norm) when a non-finite norm would skip."""
    trainer = trainer_for(one_rank, tmp_path / "run", "zero2", "trainer.log_every=100", "trainer.nonfinite=skip",
                          *extra)
    trainer.train_step(0)
    _, _, info = trainer.train_step(1)
    assert not trainer.logs_step(1) and isinstance(info.grad_norm, float), extra
    trainer.close()


@pytest.mark.parametrize("every", [1, 100])
def test_fp16_unscales_by_the_scale_backward_used(one_rank, tmp_path, every):
    """growth_interval=1: every clean step doubles the loss scale. The gradient the optimizer
    sees must be the model's fp16 gradient divided by the scale backward multiplied by, not by the
    doubled one (a power of two either way, so the division is exact and the check is equality;
    the wrong scale is off by exactly 2x). Host-decided (every=1) and device-decided steps alike."""
    trainer = trainer_for(one_rank, tmp_path / "run", "ddp", "precision=fp16", "precision.growth_interval=1",
                          "precision.initial_scale=1024",
                          f"trainer.log_every={every}", "optim=sgd", "optim.grad_clip=0")
    strategy, seen = trainer.strategy, []
    step_group = strategy.optimizer._step_group

    def watched(group):  # the master gradients the update reads, beside the model's (scaled) fp16 ones
        seen.append([(m.grad.clone(), strategy.master.model_params[i].grad.clone())
                     for i, m in enumerate(strategy.master.master) if any(m is q for q in group["params"])])
        return step_group(group)
    strategy.optimizer._step_group = watched
    for step in range(3):
        used, seen[:] = trainer.precision.scaler.scale, []
        trainer.train_step(step)
        pairs = [pair for group in seen for pair in group]
        assert len(pairs) == len(strategy.master.master), step
        assert all(torch.equal(master, model.float() / used) for master, model in pairs), step
    assert trainer.precision.scaler.scale == 2.0 ** 13  # 2^10 doubled after each of the 3 clean steps
    trainer.close()


def test_a_step_logged_only_for_its_profile_runs_as_an_unlogged_step(one_rank, tmp_path, monkeypatch):
    """profile.steps=[3]: step 3 is logged (its parts need a record) but is not a reporting step, so
    it is the step a run does not log, the one the time model predicts: decided on the device, no
    host read inside the strategy's step, no optimizer statistics; its record holds the norms read
    after the step."""
    trainer = trainer_for(one_rank, tmp_path / "run", "zero2", "trainer.log_every=100", "profile.steps=[3]",
                          "optim.grad_clip=0.05")
    step = 2  # 0-based: metrics.jsonl's step 3
    assert trainer.logs_step(step) and trainer.measure(step, True) == 0
    assert trainer.measure(0, True) == 1  # the run's first step reports: measured on the host
    summary = trainer.fit()
    trainer.close()
    import json

    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    profiled = next(r for r in records if r.get("step") == 3)
    assert isinstance(profiled["grad_norm"], float) and profiled["grad_norm"] > 0.05
    assert not any(k.startswith("update") for k in profiled), sorted(profiled)
    assert summary["time_per_rank"][0]["time/step_s"] > 0  # its parts were measured
    assert any(k.startswith("update") for k in records[0]), sorted(records[0])  # step 1 reports them
    assert summary["skipped_steps"] == 0
