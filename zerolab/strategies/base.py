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
from zerolab.schema import Config
from zerolab.dist import DistContext
from zerolab.errors import ConfigError, ZerolabError
from zerolab.precision import Precision, clip_coefficient, grad_norm_sq
from zerolab.strategies.memory_protocol import MemoryModel
from zerolab.strategies.transient import TransientPeak

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


class Strategy(MemoryModel, TransientPeak, abc.ABC):  # predict_memory; transient bytes it records while running
    """What a strategy is (class attributes, read without building one) and what it does (methods)."""
    name: str = "?"
    sharded_grads: bool = False  # True when each rank holds only part of the gradient
    # The strategy the others are compared against (report baseline; an imported checkpoint is
    # recorded as written by it on one rank). Exactly one registered strategy sets it.
    reference: bool = False
    # zerolab's own ZeRO implementation (as opposed to a borrowed library's): bench/zero.py times
    # these against the reference by default.
    zerolab_sharder: bool = False
    # Settings (dotted config keys) this strategy reads among those whose schema field says the
    # strategy decides (schema.setting(applies=BY_STRATEGY): every strategy.* key but `name`, and a
    # few more). Validation warns when one it does not read is set away from its default
    # (zerolab.config.unused_settings). The base reads what unscale_clip_update honours and what
    # zerolab's own optimizers take (their kernel, the per-layer statistics they record).
    uses: frozenset = frozenset({"trainer.nonfinite", "optim.impl", "logging.layer_stats_every"})
    # How it checkpoints:
    #   "pieces": zerolab's name-keyed, reshardable pieces (checkpoint_state / load_checkpoint_state);
    #             a checkpoint of N ranks of one such strategy loads into M ranks of any other.
    #   "native": its own files (save_native / native_meta / load_native, and the classmethods
    #             native_meta_problem / check_native_compatible / native_weights, plus
    #             checkpoint_globals for its torch.save files); loads only into itself.
    #   "none":   cannot checkpoint (checkpoint.every is refused by check_config; a preempted run stops
    #             without a checkpoint).
    checkpoint_format: str = "none"
    checkpoint_globals: tuple = ()  # "native": pickle globals its torch.save files may name

    def __init__(self, cfg: Config, ctx: DistContext, precision: Precision):
        self.cfg, self.ctx, self.precision = cfg, ctx, precision
        self.comm = CommCounter(ctx.world_size)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.step_count = 0  # optimizer steps taken (skipped ones included); restore_step sets it on resume
        self._device_pending: Optional[dict[str, torch.Tensor]] = None  # what settle() reads (_pending)

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
        # The scale as a device tensor, never read here (a power of two: exact in lm_loss's fp32).
        (loss * scaler.scale_tensor.to(loss.dtype) if scaler.enabled else loss).backward()

    @abc.abstractmethod
    def step(self, lr: float, stats_level: int = 0) -> StepInfo:
        """Finish gradient reduction, unscale, clip by global norm, update, zero gradients; count
        the step (step_count += 1, skipped or not). `stats_level`: what to measure about the
        update, 0 = nothing (the hot path: no timing sync, no norms), 1 = optimizer step time,
        global update-to-weight ratio, trust-ratio min/median/max, 2 = also the update-to-weight
        ratio of every tensor (in StepInfo.extra). A strategy may measure less than asked."""

    @abc.abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes on this rank by category (zerolab.memory.CATEGORIES)."""

    @abc.abstractmethod
    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Full fp32 weights keyed like model.state_dict() on rank 0 (None elsewhere).
        Collective: every rank must call it."""

    def restore_step(self, step: int) -> None:
        """Resume: `step` optimizer steps were taken before this run (the loss scaler's growth
        schedule and the step named in messages count from it). Called after the state is loaded."""
        self.step_count = step

    # ---- settings and reports ----------------------------------------------------------------
    @classmethod
    def reads(cls, key: str, cfg: Config) -> bool:
        """Whether this strategy reads setting `key` under `cfg` (default: it is in `uses`)."""
        return key in cls.uses

    @classmethod
    def check_config(cls, cfg: Config, world_size: int) -> None:
        """Raise ConfigError for settings this strategy cannot honour; called by
        zerolab.config.validate before any process group exists. The base refuses checkpoints
        from a strategy that cannot write them (checkpoint_format "none")."""
        if cfg.checkpoint.every and cls.checkpoint_format == "none":
            from zerolab.strategies import REGISTRY, names_where

            able = [n for n in REGISTRY if n not in names_where(checkpoint_format="none")]
            raise ConfigError(f"checkpoint.every={cfg.checkpoint.every}: strategy={cfg.strategy.name} cannot write "
                              f"checkpoints yet; use one of {', '.join(able)}, or checkpoint.every=0")

    @classmethod
    def label(cls, strategy_cfg: dict) -> str:
        """A run's short name in reports, from its strategy.* settings (e.g. a stage number)."""
        return cls.name

    @classmethod
    def known_cause(cls, cfg: dict) -> str:
        """A reason, from a run's whole config (as a dict), why its weights may legitimately differ
        from the reference's; '' when this strategy knows none."""
        return ""

    # ---- checkpoints, format "pieces" (name-keyed, reshardable) ---------------------------------
    # A rank's checkpoint state is a set of pieces "<kind>/<param name>" -> ShardPiece, where kind
    # is "master" (fp32 weights; the weights themselves for fp32 strategies) or an optimizer state
    # name ("exp_avg", "exp_avg_sq", "momentum_buffer", ...). A piece is a 1-D slice [start, end)
    # of the flattened tensor. Loading asks for exactly the ranges this rank now owns, so a
    # checkpoint written by N ranks of one strategy loads into M ranks of another.
    def checkpoint_state(self) -> dict[str, "ShardPiece"]:
        raise NotImplementedError(f"strategy {self.name} does not write the pieces format")

    def load_checkpoint_state(self, read: "Callable[[str, int, int], torch.Tensor]") -> None:
        """`read(key, start, end)` returns elements [start, end) of the flattened tensor `key`.
        `read` is a zerolab.checkpoint.PieceReader: `read.kinds(name)` also lists the optimizer-state
        kinds saved for parameter `name`, for optimizers that create their state lazily (torch's).
        The optimizer's scalar state (Adam's `step`), the loss scaler and RNG are restored by
        zerolab.checkpoint after this returns, then restore_step; strategies load tensors only."""
        raise NotImplementedError(f"strategy {self.name} does not read the pieces format")

    # ---- checkpoints, format "native" (the strategy's own files) --------------------------------
    def save_native(self, directory: str) -> None:
        """Collective: write this strategy's own checkpoint files under `directory` (the save's
        temporary directory; zerolab records, checksums and publishes every file found there,
        beside its own meta.json and rank*.safetensors)."""
        raise NotImplementedError(f"strategy {self.name} has no native checkpoint format")

    def native_meta(self) -> dict:
        """Rank 0, after save_native: what load_native and the classmethods below need, stored
        as meta.json's "native" record (JSON values)."""
        raise NotImplementedError(f"strategy {self.name} has no native checkpoint format")

    def load_native(self, path: str, meta: dict) -> None:
        """Collective: restore weights, optimizer state and loss scaler from the checkpoint at
        `path` (meta: its verified meta.json, the record under meta["native"]). Open torch.save
        files only inside zerolab.checkpoint.safe_torch_load(self.checkpoint_globals)."""
        raise NotImplementedError(f"strategy {self.name} has no native checkpoint format")

    @classmethod
    def native_meta_problem(cls, native) -> Optional[str]:
        """What a valid "native" record looks like, when `native` is not one; None when it is."""
        return None

    @classmethod
    def check_native_compatible(cls, meta: dict, path: str, cfg: Config, world_size: int) -> None:
        """Raise zerolab.checkpoint.CheckpointError (naming what to do instead) unless this run's
        config and world size can load the native checkpoint `meta` describes."""

    @classmethod
    def native_weights(cls, path: str, meta: dict) -> dict[str, Callable[[], torch.Tensor]]:
        """Export: parameter name -> a function returning its full weights (any float dtype, any
        shape with the right element count), called one at a time inside safe_torch_load."""
        raise NotImplementedError(f"strategy {cls.name} has no native checkpoint format")

    # ---- shared helpers --------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def unscale_clip_update(self, grads: list[torch.Tensor], stats_level: int = 0) -> StepInfo:
        """The part of a step every strategy shares, given this rank's fp32 gradients (whole
        tensors or shards; `sharded_grads` says which): global norm from local sums of squares
        (one all-reduce when sharded), overflow check agreed by all ranks, one multiply that
        unscales and clips, then the optimizer update unless the step must be skipped.

        A step that is not logged (stats_level 0) decides all of this on the device when it can
        (_decides_on_device): nothing is read on the host, and what the host would have said (a
        non-finite norm that stops the run, skipped updates, a loss-scale underflow) is said by
        settle() at the next logged step or checkpoint. Logged steps decide on the host (they read
        the loss anyway) and name the non-finite tensor."""
        if stats_level:
            self.settle()  # a logged step reads the host anyway
        sq = grad_norm_sq(grads).to(self.ctx.device)
        if self.sharded_grads and self.ctx.world_size > 1:
            self.comm.record("all_reduce", sq)
            dist.all_reduce(sq)
        if not stats_level and self._decides_on_device(grads):
            return self._update_on_device(grads, sq)
        scaler = self.precision.scaler
        scale = scaler.scale if scaler.enabled else 1.0  # the one backward multiplied by, before update() changes it
        # torch's sqrt, as the device path takes it (not math.sqrt): on some CPUs its fp64 kernel is
        # not correctly rounded (one ulp off, measured), and the two paths must report one norm.
        norm = sq.double().sqrt().item() / scale
        finite = math.isfinite(norm)
        scaler.update(found_inf=not finite, step=self.step_count)
        if not finite:
            where = self._where(self.step_count)
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
        multiplier = coef / scale
        if multiplier != 1.0 and grads:
            for dtype in {g.dtype for g in grads}:
                # The multiplier rounded to the gradient's dtype first, then multiplied in fp32 (a
                # Python float's opmath): the product of two 16-bit numbers is exact in fp32, so this
                # is the 16-bit multiply the device path does (_update_on_device), bitwise, whatever
                # kernel the CPU picks for a Python scalar.
                m = torch.tensor(multiplier, dtype=torch.float64).to(dtype).item()
                torch._foreach_mul_([g for g in grads if g.dtype == dtype], m)
        extra = self._optimizer_step(stats_level)
        self.step_count += 1
        return StepInfo(grad_norm=norm, grad_norm_clipped=norm * coef, extra=extra)

    # ---- deciding on the device ------------------------------------------------------------------
    def _skips(self) -> bool:
        """Whether a non-finite norm skips the update (fp16's overflow, trainer.nonfinite=skip)
        rather than stopping the run."""
        return self.precision.scaler.enabled or self.cfg.trainer.nonfinite == "skip"

    def _decides_on_device(self, grads: list[torch.Tensor]) -> bool:
        """Whether this step can be decided without reading the norm on the host: plain tensors
        (a DTensor gradient cannot be multiplied by a plain device tensor), and, when a non-finite
        norm must skip the update, an optimizer that can skip on a device flag
        (ZerolabOptimizer.skips_on_device: torch's fused Adam/AdamW/SGD kernels). When the run
        stops on a non-finite norm instead, nothing has to be skipped: the update goes ahead and
        settle() stops the run before its weights are saved or logged."""
        if not all(type(g) is torch.Tensor for g in grads):
            return False
        if not self._skips():
            return True
        skips = getattr(self.optimizer, "skips_on_device", None)
        return skips is not None and skips()

    def _update_on_device(self, grads: list[torch.Tensor], sq: torch.Tensor) -> StepInfo:
        """The host path's arithmetic on 0-dim fp64 tensors: the same operations as its sqrt,
        clip_coefficient and coef/scale on Python floats, so the multiplier, and the gradients it
        multiplies, are bitwise the host path's on CPU (an exact 1.0 when neither clip nor scale
        acts; tests/test_device_step.py). On CUDA the two may differ in the last bit of a 16-bit
        gradient, by how each multiply rounds the multiplier (not measured: no GPU here).
        A non-finite norm either skips the update on the optimizer's device flag (and the loss
        scale halves on the device), or, when the run must stop, is noted for settle()."""
        scaler, max_norm = self.precision.scaler, self.cfg.optim.grad_clip
        norm = sq.double().sqrt()
        if scaler.enabled:
            norm = norm / scaler.scale_tensor
        found = ~torch.isfinite(norm)
        clipped = norm
        if (max_norm > 0 or scaler.enabled) and grads:
            # full_like: `float / tensor` would run as reciprocal-then-multiply, a different rounding
            coef = torch.clamp(torch.full_like(norm, max_norm) / (norm + 1e-6), max=1.0) if max_norm > 0 \
                else torch.ones_like(norm)
            multiplier = coef / scaler.scale_tensor if scaler.enabled else coef  # the scale before update()
            # In each gradient's dtype: what _foreach_mul_ with a Python float does with it on CPU
            # (a 16-bit gradient is multiplied by the 16-bit coefficient), so bitwise the host path.
            for dtype in {g.dtype for g in grads}:
                torch._foreach_mul_([g for g in grads if g.dtype == dtype], multiplier.to(dtype))
            clipped = norm * coef
        pending = self._pending()
        pending["first"].masked_fill_(found & (pending["first"] < 0), self.step_count)  # in place, no host read
        skip = None
        if self._skips():
            pending["count"].add_(found.long())
            scaler.update(found, self.step_count)
            skip = found
        extra = self._optimizer_step(0, skip)
        self.step_count += 1
        return StepInfo(grad_norm=norm, grad_norm_clipped=clipped, extra=extra, skipped=False if skip is None else skip)

    def _pending(self) -> dict[str, torch.Tensor]:
        """What device-decided steps leave for settle(): the first step whose norm was not finite
        (-1: none) and how many updates were skipped, as device tensors."""
        if self._device_pending is None:
            device = self.ctx.device
            # torch.tensor: constants to a dry run (zerolab.precision.LossScaler says why)
            self._device_pending = {"first": torch.tensor(-1, dtype=torch.int64, device=device),
                                    "count": torch.tensor(0, dtype=torch.int64, device=device)}
        return self._device_pending

    def settle(self) -> None:
        """Read what steps decided on the device left pending, and say it as the host path would
        have: raise NonFiniteGradient (trainer.nonfinite=stop without a loss scale) naming the
        first step whose gradient norm was not finite; log the updates skipped since the last
        settle (trainer.nonfinite=skip, fp16 overflows); raise LossScaleUnderflow if an overflow
        would have taken the loss scale below its minimum. The trainer's logged steps and
        zerolab.checkpoint call it, so a non-finite weight is never saved or logged."""
        pending, self._device_pending = self._device_pending, None
        if pending is None:
            return
        first, count = int(pending["first"].item()), int(pending["count"].item())
        later = (f"(seen at step {self.step_count}: steps that are not logged decide on the device; "
                 "trainer.log_every=1 decides every step on the host and names the tensor)")
        if first >= 0 and not self._skips():
            raise NonFiniteGradient(
                f"{self._where(first)}: the gradient norm is not finite {later}; lower the lr, enable "
                "clipping (optim.grad_clip) or set trainer.nonfinite=skip")
        self.precision.scaler.settle()
        if count and self.precision.scaler.enabled:
            _log.info("%d fp16 overflow(s) from %s on: updates skipped, loss scale now %g %s", count,
                      self._where(first), self.precision.scaler.scale, later)
        elif count:
            _log.warning("%d update(s) skipped from %s on: the gradient norm was not finite "
                         "(trainer.nonfinite=skip) %s", count, self._where(first), later)

    @staticmethod
    def _where(step: int) -> str:
        return f"step {step} (0-based, as fault.*_step; \"step\": {step + 1} in metrics.jsonl)"

    # ---- watching the optimizer ----------------------------------------------------------------
    def _optimizer_step(self, level: int, skip: Optional[torch.Tensor] = None) -> dict:
        """The optimizer's update, measured as `level` asks (see step); a no-op where the device
        flag `skip` is set (only passed to an optimizer whose skips_on_device() said yes)."""
        opt = self.optimizer
        if not level:
            if skip is None:
                opt.step()
            else:
                opt.step_unless(skip)
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
