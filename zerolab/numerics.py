"""The arithmetic of an optimizer step, the same for every strategy: the global gradient norm,
unscaling fp16's loss scale, clipping, and deciding whether the update is skipped.

Two ways to decide, with bitwise the same results (tests/test_numerics.py, tests/test_device_step.py):

  on the host    (logged steps) the norm is read as a Python float; a non-finite norm names the
                 tensor, stops the run or skips the update at once
  on the device  (unlogged steps) the norm, the clip coefficient and the unscale multiplier stay
                 0-dim tensors; a non-finite norm skips through the optimizer's found-inf flag (or is
                 noted), and `Pending.report` says it, as the host would have, at the next logged
                 step or checkpoint. Nothing is read on the host, so on CUDA the step never waits.

The functions take the numbers they need and return the decision; the strategy applies it
(zerolab/strategies/base.py). None of them knows which strategy runs.
"""
from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from zerolab.errors import ZerolabError
from zerolab.precision import LossScaler, clip_coefficient, grad_norm_sq

log = logging.getLogger("zerolab")


class NonFiniteGradient(ZerolabError):
    """trainer.nonfinite=stop: the global gradient norm is not finite. Every rank sees the same
    all-reduced norm and raises together, so rank 0 alone reports it (and no rank is blamed as
    having stopped: nothing stopped, the numbers did)."""

    same_on_every_rank = True


class Measure(enum.IntEnum):
    """What a step measures about its update (Strategy.step, Trainer.measure): NOTHING on the hot
    path (no timing sync, no norms: most steps); OPTIMIZER on a logged step (the optimizer step's
    time, the global update-to-weight ratio, trust-ratio min/median/max); PER_TENSOR every
    logging.layer_stats_every steps (also each tensor's update-to-weight ratio)."""
    NOTHING = 0
    OPTIMIZER = 1
    PER_TENSOR = 2


@dataclass
class StepInfo:
    # Global L2 norm of the (unscaled) gradient, before and after clipping: floats, or 0-dim
    # device tensors on steps decided on the device (read them on logged steps only).
    grad_norm: float
    grad_norm_clipped: float
    # True when the update was skipped (overflow / non-finite); a 0-dim device bool on steps
    # decided on the device (read it on logged steps only).
    skipped: bool = False
    extra: dict = field(default_factory=dict)  # strategy- or optimizer-specific metrics

    @property
    def known_skipped(self) -> bool:
        """Whether the host knows the update was skipped. A device-decided step may have updated,
        so whatever follows an update (refreshing the model's weights) runs: after a skip it
        rewrites the same values."""
        return self.skipped is True

    def read(self) -> "StepInfo":
        """The same with its device tensors read to the host (a logged step's record: a step logged
        only because it is profiled was decided on the device, as unlogged steps are)."""
        value = lambda v: v.item() if isinstance(v, torch.Tensor) else v
        return StepInfo(value(self.grad_norm), value(self.grad_norm_clipped), value(self.skipped), self.extra)


def step_name(step: int) -> str:
    """How messages name 0-based optimizer step `step`: as metrics.jsonl counts it, from 1."""
    return f"step {step + 1}"


# ---- the global norm and the multiplier -----------------------------------------------------------
def norm_sq(grads: list[torch.Tensor], device: torch.device,
            reduce: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
    """Σ g² over this rank's gradients (precision.grad_norm_sq: fp32, or fp64 when a gradient is)
    as a 0-dim tensor on `device`; `reduce` (an all-reduce) completes it when each rank holds a
    shard of the gradient."""
    sq = grad_norm_sq(grads).to(device)
    if reduce is not None:
        reduce(sq)
    return sq


@dataclass
class HostDecision:
    norm: float  # the unscaled global norm
    coef: float  # the clip coefficient (1.0: no clip)
    multiplier: float  # what the gradients are multiplied by: coef / loss scale

    @property
    def finite(self) -> bool:
        return math.isfinite(self.norm)


def decide_on_host(sq: torch.Tensor, scale: float, max_norm: float) -> HostDecision:
    """The norm read on the host, unscaled by the scale backward used, and the multiplier that
    unscales and clips in one pass. torch's fp64 sqrt, as the device path takes it (not
    math.sqrt): on some CPUs its kernel is not correctly rounded, and both paths must report one
    norm."""
    norm = sq.double().sqrt().item() / scale
    coef = clip_coefficient(norm, max_norm)
    return HostDecision(norm, coef, coef / scale)


@dataclass
class DeviceDecision:
    norm: torch.Tensor  # 0-dim fp64: the unscaled global norm
    found: torch.Tensor  # 0-dim bool: the norm is not finite
    clipped: torch.Tensor  # norm × coef
    multiplier: Optional[torch.Tensor]  # coef / scale, or None when neither clip nor scale acts


def decide_on_device(sq: torch.Tensor, scale: Optional[torch.Tensor], max_norm: float) -> DeviceDecision:
    """decide_on_host's arithmetic on 0-dim fp64 tensors: the same operations as its sqrt,
    clip_coefficient and coef / scale on Python floats, so the multiplier is bitwise the host's
    on CPU. On CUDA the two may differ in the last bit of a 16-bit gradient, by how each multiply
    rounds the multiplier (not measured: no GPU here). `scale`: fp16's loss scale, else None."""
    norm = sq.double().sqrt()
    if scale is not None:
        norm = norm / scale
    found = ~torch.isfinite(norm)
    if max_norm <= 0 and scale is None:
        return DeviceDecision(norm, found, norm, None)
    # full_like: `float / tensor` would run as reciprocal-then-multiply, a different rounding
    coef = torch.clamp(torch.full_like(norm, max_norm) / (norm + 1e-6), max=1.0) if max_norm > 0 \
        else torch.ones_like(norm)
    return DeviceDecision(norm, found, norm * coef, coef / scale if scale is not None else coef)


def multiply(grads: list[torch.Tensor], multiplier: "float | torch.Tensor") -> None:
    """Multiply the gradients in place, in each gradient's dtype: the multiplier rounded to the
    gradient's dtype first, then multiplied in fp32 (a Python float's opmath; the product of two
    16-bit numbers is exact in fp32), so the host's float and the device's tensor give bitwise
    the same 16-bit gradients whatever kernel the CPU picks. A float 1.0 changes nothing and is
    skipped."""
    if not grads or (not isinstance(multiplier, torch.Tensor) and multiplier == 1.0):
        return
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        if isinstance(multiplier, torch.Tensor):
            torch._foreach_mul_(same, multiplier.to(dtype))
        else:
            torch._foreach_mul_(same, torch.tensor(multiplier, dtype=torch.float64).to(dtype).item())


# ---- what device-decided steps leave for the host -------------------------------------------------
class Pending:
    """What steps decided on the device leave to be said: the first step whose norm was not finite
    (-1: none) and how many updates were skipped, as device tensors, read by report()."""

    def __init__(self, device: torch.device):
        # torch.tensor: constants to a dry run (zerolab.precision.LossScaler says why)
        self.first = torch.tensor(-1, dtype=torch.int64, device=device)
        self.count = torch.tensor(0, dtype=torch.int64, device=device)

    def note(self, found: torch.Tensor, step: int, skipped: bool) -> None:
        self.first.masked_fill_(found & (self.first < 0), step)  # in place, no host read
        if skipped:
            self.count.add_(found.long())

    def report(self, scaler: LossScaler, skips: bool, now: int) -> None:
        """Say what the device decided, as the host path would have: raise NonFiniteGradient
        (trainer.nonfinite=stop without a loss scale) naming the first step whose norm was not
        finite; log the skipped updates; raise LossScaleUnderflow if an overflow would have taken
        the loss scale below its minimum. `now`: the 0-based step the host reads this at."""
        first, count = int(self.first.item()), int(self.count.item())
        later = (f"(seen at {step_name(now)}: steps that are not logged decide on the device; "
                 "trainer.log_every=1 decides every step on the host and names the tensor)")
        if first >= 0 and not skips:
            raise NonFiniteGradient(f"{step_name(first)}: the gradient norm is not finite {later}; lower the lr, "
                                    "enable clipping (optim.grad_clip) or set trainer.nonfinite=skip")
        scaler.raise_if_underflowed()
        if count and scaler.enabled:
            log.info("%d fp16 overflow(s) from %s on: updates skipped, loss scale now %g %s", count,
                     step_name(first), scaler.scale, later)
        elif count:
            log.warning("%d update(s) skipped from %s on: the gradient norm was not finite "
                        "(trainer.nonfinite=skip) %s", count, step_name(first), later)


def refuse_or_skip(norm: float, scaler: LossScaler, stop: bool, step: int, where: str) -> None:
    """A host-decided step whose norm is not finite: raise NonFiniteGradient when the run stops
    on it (no loss scale, trainer.nonfinite=stop), else say that the update is skipped. `where`
    names the first non-finite gradient."""
    if not scaler.enabled and stop:
        raise NonFiniteGradient(f"{step_name(step)}: the gradient norm is {norm} ({where}); lower the lr, enable "
                                "clipping (optim.grad_clip) or set trainer.nonfinite=skip")
    if not scaler.enabled:
        log.warning("%s: the gradient norm is %s (%s); skipping the update (trainer.nonfinite=skip)",
                    step_name(step), norm, where)
    else:
        log.info("%s: fp16 gradients overflowed; update skipped, loss scale now %g", step_name(step), scaler.scale)
