"""The strategy protocol: everything the trainer needs from a data-parallel strategy.

The trainer never asks which strategy it runs. A strategy wraps the model, owns the optimizer
(it decides what the optimizer sees: model params, an fp32 master copy, or flat shards), runs
backward and the step, and reports its memory by category and its communication volume.
"""
from __future__ import annotations

import abc
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab.comm import CommCounter
from zerolab.config import Config
from zerolab.dist import DistContext
from zerolab.precision import Precision, clip_coefficient, grad_norm_sq

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass
class ShardPiece:
    tensor: torch.Tensor  # 1-D, elements [start, end) of the flattened full tensor
    start: int
    end: int
    shape: tuple  # shape of the full tensor


class NonFiniteGradient(RuntimeError):
    pass


@dataclass
class StepInfo:
    grad_norm: float  # global L2 norm of the (unscaled) gradient, before clipping
    grad_norm_clipped: float  # after clipping
    skipped: bool = False  # True when the update was skipped (overflow / non-finite)
    extra: dict = field(default_factory=dict)  # strategy- or optimizer-specific metrics


class Strategy(abc.ABC):
    name: str = "?"
    sharded_grads: bool = False  # True when each rank holds only part of the gradient

    def __init__(self, cfg: Config, ctx: DistContext, precision: Precision):
        self.cfg, self.ctx, self.precision = cfg, ctx, precision
        self.comm = CommCounter(ctx.world_size)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.step_count = 0

    # ---- protocol -------------------------------------------------------------------------
    @abc.abstractmethod
    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        """Place and wrap the model, build the optimizer; returns the module to call forward on."""

    def no_sync(self) -> ContextManager:
        """Context for micro-batches that must not communicate (gradient accumulation)."""
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        scaler = self.precision.scaler
        (loss * scaler.scale if scaler.enabled else loss).backward()

    @abc.abstractmethod
    def step(self, lr: float) -> StepInfo:
        """Finish gradient reduction, unscale, clip by global norm, update, zero gradients."""

    @abc.abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes on this rank by category (zerolab.memory.CATEGORIES)."""

    @abc.abstractmethod
    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Full fp32 weights keyed like model.state_dict() on rank 0 (None elsewhere).
        Collective: every rank must call it."""

    # ---- checkpoints (name-keyed, reshardable) ------------------------------------------------
    # A rank's checkpoint state is a set of pieces "<kind>/<param name>" -> ShardPiece, where kind
    # is "master" (fp32 weights; the weights themselves for fp32 strategies) or an optimizer state
    # name ("exp_avg", "exp_avg_sq", "momentum_buffer", ...). A piece is a 1-D slice [start, end)
    # of the flattened tensor. Loading asks for exactly the ranges this rank now owns, so a
    # checkpoint written by N ranks of one strategy loads into M ranks of another.
    def checkpoint_state(self) -> dict[str, "ShardPiece"]:
        raise NotImplementedError(f"strategy {self.name} cannot write zerolab checkpoints yet")

    def load_checkpoint_state(self, read: "Callable[[str, int, int], torch.Tensor]") -> None:
        """`read(key, start, end)` returns elements [start, end) of the flattened tensor `key`.
        `read` is a zerolab.checkpoint.PieceReader: `read.kinds(name)` also lists the optimizer-state
        kinds saved for parameter `name`, for optimizers that create their state lazily (torch's).
        The optimizer's scalar state (Adam's `step`), the loss scaler, RNG and `step_count` are
        restored by zerolab.checkpoint after this returns; strategies load tensors only."""
        raise NotImplementedError(f"strategy {self.name} cannot load zerolab checkpoints yet")

    # ---- shared helpers --------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def unscale_clip_update(self, grads: list[torch.Tensor]) -> StepInfo:
        """The part of a step every strategy shares, given this rank's fp32 gradients (whole
        tensors or shards; `sharded_grads` says which): global norm from local sums of squares
        (one all-reduce when sharded), overflow check agreed by all ranks, one multiply that
        unscales and clips, then the optimizer update unless the step must be skipped."""
        scaler = self.precision.scaler
        sq = grad_norm_sq(grads).to(self.ctx.device)
        if self.sharded_grads and self.ctx.world_size > 1:
            self.comm.record("all_reduce", sq)
            dist.all_reduce(sq)
        norm = math.sqrt(sq.item()) / scaler.scale
        finite = math.isfinite(norm)
        scaler.update(found_inf=not finite, step=self.step_count)
        if not finite:
            if not scaler.enabled and self.cfg.trainer.nonfinite == "stop":
                raise NonFiniteGradient(
                    f"step {self.step_count}: the gradient norm is {norm} ({self.describe_nonfinite()}); "
                    "lower the lr, enable clipping (optim.grad_clip) or set trainer.nonfinite=skip")
            self.step_count += 1
            return StepInfo(grad_norm=norm, grad_norm_clipped=norm, skipped=True)
        coef = clip_coefficient(norm, self.cfg.optim.grad_clip)
        multiplier = coef / (scaler.scale if scaler.enabled else 1.0)
        if multiplier != 1.0 and grads:
            torch._foreach_mul_(grads, multiplier)
        self.optimizer.step()
        self.step_count += 1
        return StepInfo(grad_norm=norm, grad_norm_clipped=norm * coef)

    def describe_nonfinite(self) -> str:
        """Names the first gradient that is not finite; strategies refine this."""
        return "a gradient is not finite"
