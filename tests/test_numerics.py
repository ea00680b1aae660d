"""The step's arithmetic (zerolab/numerics.py) without a strategy: the norm, the multiplier that
unscales and clips, the skip, and the two ways of deciding them agreeing bitwise."""
import math

import pytest
import torch

from zerolab import numerics
from zerolab.numerics import NonFiniteGradient
from zerolab.precision import LossScaler, LossScaleUnderflow
from zerolab.schema import PrecisionConfig


def _grads(seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape in [(7, 5), (11,), (3, 3, 2)]]


def test_the_norm_is_the_global_l2_norm_and_a_reduce_completes_it():
    grads = _grads()
    want = math.sqrt(sum((g.double() ** 2).sum().item() for g in grads))
    sq = numerics.norm_sq(grads, torch.device("cpu"))
    # fp32 sums of 100 squares of N(0,1): relative error ~ 100 · 2^-24 ≈ 6e-6 at worst, 1e-5 bounds it
    assert math.sqrt(sq.item()) == pytest.approx(want, rel=1e-5)
    doubled = numerics.norm_sq(grads, torch.device("cpu"), reduce=lambda t: t.mul_(2))  # as if 2 equal shards
    assert doubled.item() == 2 * sq.item()


@pytest.mark.parametrize("max_norm,scale", [(0.0, 1.0), (0.5, 1.0), (1e6, 1.0), (0.5, 2.0 ** 16), (0.0, 2.0 ** 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_and_device_decide_bitwise_alike(max_norm, scale, dtype):
    """The same gradients multiplied by the host's float and by the device's 0-dim tensor end up
    bitwise equal, in every gradient dtype, with and without a clip and a loss scale."""
    grads = [g * scale for g in _grads(1, torch.float32)]
    sq = numerics.norm_sq(grads, torch.device("cpu"))
    host = numerics.decide_on_host(sq, scale, max_norm)
    device = numerics.decide_on_device(sq, torch.tensor(scale, dtype=torch.float64) if scale != 1.0 else None,
                                       max_norm)
    assert device.norm.item() == host.norm and not device.found.item()
    a, b = [g.to(dtype) for g in grads], [g.to(dtype) for g in grads]
    numerics.multiply(a, host.multiplier)
    if device.multiplier is not None:
        numerics.multiply(b, device.multiplier)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    if max_norm and host.norm > max_norm:  # clipped: the clipped norm is max_norm up to the 1e-6 guard
        assert host.norm * host.coef == pytest.approx(max_norm, rel=1e-5)


def test_a_nonfinite_norm_is_found_on_both_paths():
    grads = _grads()
    grads[1][3] = float("inf")
    sq = numerics.norm_sq(grads, torch.device("cpu"))
    assert not numerics.decide_on_host(sq, 1.0, 1.0).finite
    assert numerics.decide_on_device(sq, None, 1.0).found.item()


def test_refuse_or_skip_follows_the_policy(caplog):
    scaler = LossScaler(PrecisionConfig(name="fp32"), enabled=False)
    with pytest.raises(NonFiniteGradient, match=r"^step 4: the gradient norm is inf \(a gradient is not finite\)"):
        numerics.refuse_or_skip(float("inf"), scaler, stop=True, step=3, where="a gradient is not finite")
    with caplog.at_level("WARNING", logger="zerolab"):
        numerics.refuse_or_skip(float("nan"), scaler, stop=False, step=3, where="x")
    assert "step 4: the gradient norm is nan (x); skipping the update" in caplog.text


def test_pending_says_what_the_device_decided(caplog):
    """Two device-decided skips at 0-based steps 2 and 4, read at step 6: one line naming the first."""
    scaler = LossScaler(PrecisionConfig(name="fp32"), enabled=False)
    pending = numerics.Pending(torch.device("cpu"))
    for step, found in enumerate([False, False, True, False, True, False]):
        pending.note(torch.tensor(found), step, skipped=True)
    with caplog.at_level("WARNING", logger="zerolab"):
        pending.report(scaler, skips=True, now=5)
    assert "2 update(s) skipped from step 3 on" in caplog.text and "seen at step 6" in caplog.text
    stop = numerics.Pending(torch.device("cpu"))
    stop.note(torch.tensor(True), 1, skipped=False)
    with pytest.raises(NonFiniteGradient, match="^step 2: the gradient norm is not finite"):
        stop.report(scaler, skips=False, now=3)


def test_an_underflowing_loss_scale_is_raised_when_settled():
    scaler = LossScaler(PrecisionConfig(name="fp16", initial_scale=2.0, min_scale=2.0), enabled=True)
    pending = numerics.Pending(torch.device("cpu"))
    scaler.update(torch.tensor(True), 4)  # a device-decided overflow would take 2 to 1 < min_scale
    with pytest.raises(LossScaleUnderflow, match="^step 5: fp16 loss scale would fall to 1"):
        pending.report(scaler, skips=True, now=4)
