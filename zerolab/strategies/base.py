"""The strategy protocol: everything the trainer needs from a data-parallel strategy.

The trainer never asks which strategy it runs. A strategy wraps the model, owns the optimizer
(it decides what the optimizer sees: model params, an fp32 master copy, or flat shards), runs
backward and the step, and reports its memory by category and its communication volume.
"""
from __future__ import annotations

import abc
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab.comm import CommCounter
from zerolab.config import Config
from zerolab.dist import DistContext
from zerolab.errors import ZerolabError
from zerolab.precision import Precision, clip_coefficient, grad_norm_sq
from zerolab.strategies.memory_protocol import MemoryModel

_log = logging.getLogger("zerolab")

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass
class ShardPiece:
    tensor: torch.Tensor  # 1-D, elements [start, end) of the flattened full tensor
    start: int
    end: int
    shape: tuple  # shape of the full tensor


class NonFiniteGradient(ZerolabError):
    """trainer.nonfinite=stop: the global gradient norm is not finite. Every rank sees the same
    all-reduced norm and raises together, so rank 0 alone reports it (and no rank is blamed as
    having stopped: nothing stopped, the numbers did)."""

    same_on_every_rank = True


@dataclass
class StepInfo:
    grad_norm: float  # global L2 norm of the (unscaled) gradient, before clipping
    grad_norm_clipped: float  # after clipping
    skipped: bool = False  # True when the update was skipped (overflow / non-finite)
    extra: dict = field(default_factory=dict)  # strategy- or optimizer-specific metrics


class Strategy(MemoryModel, abc.ABC):  # MemoryModel: predict_memory and what the ledger asks
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

    def close(self) -> None:
        """Undo whatever setup changed outside this object (process-wide patches); the trainer
        calls it once when the run ends, successfully or not."""

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
            where = (f"step {self.step_count} (0-based, as fault.*_step; \"step\": {self.step_count + 1} in "
                     f"metrics.jsonl)")
            if not scaler.enabled and self.cfg.trainer.nonfinite == "stop":
                raise NonFiniteGradient(
                    f"{where}: the gradient norm is {norm} ({self.describe_nonfinite()}); "
                    "lower the lr, enable clipping (optim.grad_clip) or set trainer.nonfinite=skip")
            if not scaler.enabled:
                _log.warning("%s: the gradient norm is %s (%s); skipping the update (trainer.nonfinite=skip)",
                             where, norm, self.describe_nonfinite())
            else:
                _log.info("%s: fp16 gradients overflowed; update skipped, loss scale now %g", where, scaler.scale)
            self.step_count += 1
            return StepInfo(grad_norm=norm, grad_norm_clipped=norm, skipped=True)
        coef = clip_coefficient(norm, self.cfg.optim.grad_clip)
        multiplier = coef / (scaler.scale if scaler.enabled else 1.0)
        if multiplier != 1.0 and grads:
            torch._foreach_mul_(grads, multiplier)
        extra = self._optimizer_step()
        self.step_count += 1
        return StepInfo(grad_norm=norm, grad_norm_clipped=norm * coef, extra=extra)

    # ---- watching the optimizer ----------------------------------------------------------------
    # The trainer sets `stats_level` before each step: 0 = nothing extra (the hot path: no timing
    # sync, no norms), 1 = optimizer step time, global update-to-weight ratio, trust-ratio
    # min/median/max, 2 = also the update-to-weight ratio of every tensor.
    stats_level: int = 0

    def _optimizer_step(self) -> dict:
        opt, level = self.optimizer, self.stats_level
        if not level:
            opt.step()
            return {}
        tracks = hasattr(opt, "pop_update_stats")  # zerolab's optimizers; torch's are only timed
        if tracks:
            opt.track_updates = True
        self.ctx.synchronize()
        t0 = time.perf_counter()
        try:
            opt.step()
            self.ctx.synchronize()
        finally:
            if tracks:
                opt.track_updates = False
        extra = {"optim_step_s": time.perf_counter() - t0}
        if tracks:
            extra.update(self._update_ratios(opt.pop_update_stats(), per_tensor=level > 1))
            extra.update(opt.step_stats())
        return extra

    def _update_ratios(self, records: list[dict], per_tensor: bool) -> dict:
        """‖Δw‖/‖w‖ over the whole model (and per tensor) from the optimizer's per-tensor sums of
        squares; flat shards give partial sums, completed here by one all-reduce."""
        if not records:
            return {}
        vec = torch.cat([torch.cat([r["update_sq"], r["weight_sq"]]) for r in records]).to(self.ctx.device)
        if any(r["partial"] for r in records) and self.ctx.world_size > 1:
            self.comm.record("all_reduce", vec)
            dist.all_reduce(vec)
        vec, out, offset = vec.double().cpu(), {}, 0
        upd_total = weight_total = 0.0
        for r in records:
            n = len(r["names"])
            upd, wsq = vec[offset:offset + n], vec[offset + n:offset + 2 * n]
            offset += 2 * n
            upd_total += upd.sum().item()
            weight_total += wsq.sum().item()
            if per_tensor:
                for name, u, w in zip(r["names"], upd.tolist(), wsq.tolist()):
                    if w > 0:
                        out[f"update_ratio/{name}"] = math.sqrt(u / w)
        if weight_total > 0:
            out["update_ratio"] = math.sqrt(upd_total / weight_total)
        return out

    def describe_nonfinite(self) -> str:
        """Names the first gradient that is not finite; strategies refine this."""
        return "a gradient is not finite"
