"""The strategy protocol: everything the trainer needs from a data-parallel strategy.

The trainer never asks which strategy it runs. A strategy wraps the model, owns the optimizer
(it decides what the optimizer sees: model params, an fp32 master copy, or flat shards), runs
backward and the step, and reports the memory it holds and the bytes it communicates.

A strategy is a small core plus what it declares (docs/writing-a-strategy.md lists both):

  declared   name, traits (what it is: Traits below), checkpoint_format
  required   setup, step, memory, consolidated_state_dict
  optional   backward, no_sync, close, restore_step, report_pending; checkpoint_state and
             load_checkpoint_state for checkpoint_format "pieces", with optimizer_states where the
             optimizer is inside a wrapper (a strategy that also reads an older format of its own
             mixes in strategies/native.py's NativeCheckpoint)
  classes    check_config, reads, label, known_cause, lossy, predict_memory, memory_identity

The arithmetic of the step (the global norm, unscale, clip, skip) is zerolab/numerics.py's; a
strategy hands its fp32 gradients to `_update` and gets a StepInfo back. What a logged step
measures about the update is strategies/measured_step.py's; what the "pieces" checkpoint hooks
share, strategies/pieces.py's.
"""
from __future__ import annotations

import abc
import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab import numerics
from zerolab.comm import CommCounter
from zerolab.dist import DistContext
from zerolab.errors import ConfigError
from zerolab.numerics import Measure, StepInfo
from zerolab.precision import Precision
from zerolab.precision_modes import MODE_KEYS, Mode, lossy_settings
from zerolab.schema import Config, StrategySettings, settings_for
from zerolab.strategies.measured_step import measured_step
from zerolab.strategies.pieces import ShardPiece, kinds_to_load, materialise_state  # noqa: F401  (re-exported)
from zerolab.strategies.transient import TransientPeak

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
# Settings outside the strategy section that a strategy running zerolab's step honours: what
# `_update` reads (trainer.nonfinite) and what zerolab's optimizers take (their kernel, per-layer
# statistics). A strategy that steps another library's optimizer declares fewer.
ZEROLAB_STEP_SETTINGS = frozenset({"trainer.nonfinite", "optim.impl", "logging.layer_stats_every"})
# How a bf16 run keeps its master and optimizer state below the paper's 16 bytes
# (zerolab/precision_modes.py): read by the strategies that hold their own master (ddp, zero1/2/3);
# precision.grad_shard only by zero1/zero2, the strategies that keep an fp32 gradient shard.
PRECISION_MODE_SETTINGS = frozenset(MODE_KEYS) - {"precision.grad_shard"}


@dataclass(frozen=True)
class Traits:
    """What a strategy is, read from its class without building one."""
    settings: type = StrategySettings  # its schema dataclass (zerolab/schema.py): the strategy.* keys it reads
    also_reads: frozenset = ZEROLAB_STEP_SETTINGS  # settings outside its section it honours
    stage: int = 0  # the ZeRO stage it implements (Rajbhandari et al. 2019): 0 plain DP, 1 P_os, 2 +g, 3 +p
    reference: bool = False  # the one strategy the others are compared against (exactly one)
    zerolab_sharder: bool = False  # zerolab's own ZeRO (bench/zero.py times these by default)
    sharded_grads: bool = False  # each rank holds only part of the gradient: the norm is all-reduced
    needs_blocks: bool = False  # a model without repeated blocks is refused before any rank trains
    not_rehearsable: str = ""  # why `python -m zerolab dry-run` cannot run it on fake tensors ("": it can)
    uneven_memory: bool = False  # ranks hold different amounts: the ledger predicts every rank
    sweep_stages: tuple = (0,)  # strategy.stage values `memory --sweep-world` gives a row; () none
    memory_reference: Optional[tuple] = None  # (strategy, stage) of another implementation, shown beside
    comm_extra: str = ""  # where its bytes per step above the ZeRO paper's come from, if they are (said by the report)


@dataclass(frozen=True)
class Lossy:
    """What makes a run's arithmetic round what the reference computes exactly, on purpose
    (Strategy.lossy): the report holds such a run within a loss band (zerolab/report/band.py)
    instead of calling it a match or a mismatch."""
    kind: str  # the parity status's first word: "quantized" gives "quantized: within band"
    what: str  # the settings and what they round, in words
    # L of the forward's weight rounding: each weight the forward computes with is off by at most
    # max|w|/(2L) (qwZ's int8: 127); 0 when the forward computes with the exact weights
    forward_levels: int = 0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's lr, scaled by its own lr_scale (zerolab.optim's per-group factor)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def larger_of(before: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    """Bytes by category, the larger of two moments: for strategies that free gradients inside
    their step (FSDP2, DeepSpeed), what existed just before the last update against now. They
    count "before" on a step that measures (a logged one) and on their first, not on every step:
    the count walks every tensor's storage (~2.4 ms a step on gpt_mid under FSDP2 on this CPU,
    bench/RESULTS.md), and the gradients it finds are the same sizes each step, so a step logged
    only because it is profiled reads the earlier count."""
    return {k: max(v, before.get(k, 0)) for k, v in now.items()}


def precision_lossy(cfg: dict) -> Optional[Lossy]:
    """The Lossy of a run whose master, optimizer state or gradient sums are kept in bf16 on purpose
    (precision.master=bf16, ...: zerolab/precision_modes.py), for the strategies that hold them."""
    settings = lossy_settings(cfg)
    return Lossy("lossy", "bf16 storage rounds every update (" + ", ".join(settings) + ")") if settings else None


class Strategy(abc.ABC):
    name: str = "?"
    traits: Traits = Traits()
    # How it checkpoints: "pieces" (zerolab's name-keyed, reshardable pieces: checkpoint_state /
    # load_checkpoint_state; N ranks of any strategy load into M ranks of any other: every
    # registered strategy writes them), or "none" (checkpoint.every is refused; a preempted run
    # stops without one). "native" (a library's own files) is only read, from checkpoints written
    # before every strategy wrote pieces (strategies/native.py).
    checkpoint_format: str = "none"

    def __init__(self, cfg: Config, ctx: DistContext, precision: Precision):
        self.cfg, self.ctx, self.precision = cfg, ctx, precision
        self.settings = settings_for(cfg.strategy, self.traits.settings)  # this strategy's own section
        self.comm = CommCounter(ctx.topology)
        self.transient = TransientPeak()  # buffers alive during part of the step (CPU peak accounting)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.step_count = 0  # optimizer steps taken (skipped ones included); restore_step sets it on resume
        self._pending: Optional[numerics.Pending] = None  # what device-decided steps leave for settle()

    # ---- the core ---------------------------------------------------------------------------
    @abc.abstractmethod
    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        """Place and wrap the model, build the optimizer; returns the module to call forward on."""

    def no_sync(self) -> ContextManager:
        """Context for micro-batches that must not communicate (gradient accumulation)."""
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        scaler = self.precision.scaler
        # The scale as a device tensor, never read here (a power of two: exact in lm_loss's fp32).
        (loss * scaler.scale_tensor.to(loss.dtype) if scaler.enabled else loss).backward()

    @abc.abstractmethod
    def step(self, lr: float, measure: Measure = Measure.NOTHING) -> StepInfo:
        """Finish gradient reduction, unscale, clip by global norm, update, zero gradients; count
        the step (step_count += 1, skipped or not). `measure`: what to measure about the
        update (numerics.Measure: nothing on the hot path; the optimizer's statistics; also every
        tensor's update-to-weight ratio, in StepInfo.extra). A strategy may measure less than asked."""

    @abc.abstractmethod
    def memory(self) -> dict[str, int]:
        """Bytes on this rank by category (zerolab.accounting.CATEGORIES)."""

    @abc.abstractmethod
    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Full fp32 weights keyed like model.state_dict() on rank 0 (None elsewhere).
        Collective: every rank must call it."""

    def close(self) -> None:
        """Undo whatever setup changed outside this object (process-wide patches); the trainer
        calls it once when the run ends, successfully or not."""

    def restore_step(self, step: int) -> None:
        """Resume: `step` optimizer steps were taken before this run (the loss scaler's growth
        schedule and the step named in messages count from it). Called after the state is loaded."""
        self.step_count = step

    def report_pending(self) -> None:
        """Say what steps decided on the device left pending (numerics.Pending.report): a
        non-finite norm that stops the run, skipped updates, a loss-scale underflow. The trainer's
        logged steps and zerolab.checkpoint call it, so a non-finite weight is never saved or logged."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.report(self.precision.scaler, self._skips(), self.step_count - 1)

    # ---- checkpoints, format "pieces" (pieces.py: what a piece is, and what loading them shares) ----
    def checkpoint_state(self) -> dict[str, ShardPiece]:
        raise NotImplementedError(f"strategy {self.name} does not write the pieces format")

    def load_checkpoint_state(self, read: "Callable[[str, int, int], torch.Tensor]") -> None:
        """`read(key, start, end)` returns elements [start, end) of the flattened tensor `key`.
        `read` is a zerolab.checkpoint.PieceReader: `read.kinds(name)` also lists the optimizer-state
        kinds saved for parameter `name`, for optimizers that create their state lazily (torch's).
        The optimizer's scalar state (Adam's `step`), the loss scaler and RNG are restored by
        zerolab.checkpoint after this returns, then restore_step; strategies load tensors only."""
        raise NotImplementedError(f"strategy {self.name} does not read the pieces format")

    def optimizer_states(self) -> Iterable[dict]:
        """This rank's per-parameter optimizer state dicts: where the scalar counters (Adam's
        `step`) live, which zerolab.checkpoint saves once and restores into every one of them. A
        strategy whose optimizer keeps its state elsewhere (a wrapper's inner optimizer) says where."""
        return self.optimizer.state.values()

    # ---- what the class says without an instance ------------------------------------------------
    @classmethod
    def reads(cls, key: str, cfg: Config) -> bool:
        """Whether this strategy reads setting `key` under `cfg`: a field of its settings
        dataclass, or one of traits.also_reads."""
        if key.startswith("strategy."):
            return key[len("strategy."):] in {f.name for f in dataclasses.fields(cls.traits.settings)}
        return key in cls.traits.also_reads

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

    @classmethod
    def lossy(cls, cfg: dict) -> Optional[Lossy]:
        """A Lossy when a run's whole config (as a dict) makes this strategy round on purpose what
        the reference computes exactly (quantized collectives); None when it computes the same math."""
        return None

    @classmethod
    def predict_memory(cls, pred, shape, *, world: int, precision: str, k: float, stage: int, bucket_mb: float,
                       reduce_dtype: str, rank: int, ranks_per_node: int, settings: dict, mode: Mode) -> None:
        """Add this strategy's bytes on rank `rank` of `world` to `pred` (zerolab.accounting's
        Prediction), term by term, each with the sentence that says where it comes from:
        pred.add(category, bytes, what), category one of zerolab.accounting.CATEGORIES or
        "transient" (alive during part of the step only, not in the total). Set pred.why to why the
        figures differ from the ZeRO paper's, and add notes. `shape`: the model's tensors
        (zerolab.accounting.ModelShape); `k`: optimizer-state elements per parameter; `stage`,
        `bucket_mb`, `reduce_dtype`: the run's strategy.* settings, `settings` all of them as a dict
        ({} outside a run: the schema's defaults); `ranks_per_node`: the ranks' layout in nodes
        (zerolab.topology); `mode`: how a bf16 run stores its master, optimizer state and gradient
        shard (zerolab.precision_modes.Mode: precision.master, optim_states, grad_shard). Every
        keyword is always passed (zerolab/memory/prediction.py);
        take the ones you use and `**_` for the rest. Raise zerolab.accounting.NotPredicted for
        settings the strategy cannot run, ValueError for other bad input."""
        raise NotImplementedError(f"strategy {cls.name} has no memory model (Strategy.predict_memory)")

    @classmethod
    def memory_identity(cls, stage: int) -> tuple[str, int]:
        """(label, ZeRO stage) of the ledger's prediction for strategy.stage=`stage`; a ValueError
        naming the fix where the strategy has no such stage."""
        return cls.name, cls.traits.stage

    # ---- the step's arithmetic, applied (zerolab/numerics.py) ------------------------------------
    def _update(self, grads: list[torch.Tensor], measure: Measure = Measure.NOTHING) -> StepInfo:
        """Given this rank's fp32 gradients (whole tensors or shards: traits.sharded_grads), the
        global norm from local sums of squares (one all-reduce when sharded), then one multiply
        that unscales and clips, then the update unless it must be skipped. An unlogged step
        (Measure.NOTHING) decides on the device when it can (_decides_on_device); a logged one on
        the host, naming the non-finite tensor."""
        if measure:
            self.report_pending()  # a logged step reads the host anyway
        sharded = self.traits.sharded_grads and self.ctx.world_size > 1
        sq = numerics.norm_sq(grads, self.ctx.device, self._all_reduce if sharded else None)
        if not measure and self._decides_on_device(grads):
            return self._update_on_device(grads, sq)
        scaler = self.precision.scaler
        decision = numerics.decide_on_host(sq, scaler.scale if scaler.enabled else 1.0, self.cfg.optim.grad_clip)
        scaler.update(found_inf=not decision.finite, step=self.step_count)
        if not decision.finite:
            numerics.refuse_or_skip(decision.norm, scaler, self.cfg.trainer.nonfinite == "stop", self.step_count,
                                    self._describe_nonfinite())
            self.step_count += 1
            return StepInfo(grad_norm=decision.norm, grad_norm_clipped=decision.norm, skipped=True)
        numerics.multiply(grads, decision.multiplier)
        extra = self._optimizer_step(measure)
        self.step_count += 1
        return StepInfo(grad_norm=decision.norm, grad_norm_clipped=decision.norm * decision.coef, extra=extra)

    def _update_on_device(self, grads: list[torch.Tensor], sq: torch.Tensor) -> StepInfo:
        """The host path's decision as 0-dim tensors: a non-finite norm either skips the update on
        the optimizer's device flag (the loss scale halves on the device), or is noted for report_pending()."""
        scaler = self.precision.scaler
        d = numerics.decide_on_device(sq, scaler.scale_tensor if scaler.enabled else None, self.cfg.optim.grad_clip)
        if d.multiplier is not None:
            numerics.multiply(grads, d.multiplier)  # the scale before update() changes it
        if self._pending is None:
            self._pending = numerics.Pending(self.ctx.device)
        skips = self._skips()
        self._pending.note(d.found, self.step_count, skipped=skips)
        if skips:
            scaler.update(d.found, self.step_count)
        extra = self._optimizer_step(Measure.NOTHING, d.found if skips else None)
        self.step_count += 1
        return StepInfo(grad_norm=d.norm, grad_norm_clipped=d.clipped, extra=extra, skipped=d.found if skips else False)

    def _skips(self) -> bool:
        """Whether a non-finite norm skips the update (fp16's overflow, trainer.nonfinite=skip)
        rather than stopping the run."""
        return self.precision.scaler.enabled or self.cfg.trainer.nonfinite == "skip"

    def _decides_on_device(self, grads: list[torch.Tensor]) -> bool:
        """Plain tensors (a DTensor gradient cannot be multiplied by a plain device tensor), and,
        when a non-finite norm must skip the update, an optimizer that can skip on a device flag
        (ZerolabOptimizer.skips_on_device: torch's fused Adam/AdamW/SGD kernels). When the run
        stops on a non-finite norm instead, nothing has to be skipped: the update goes ahead and
        report_pending() stops the run before its weights are saved or logged."""
        if not all(type(g) is torch.Tensor for g in grads):
            return False
        if not self._skips():
            return True
        skips = getattr(self.optimizer, "skips_on_device", None)
        return skips is not None and skips()

    def _all_reduce(self, t: torch.Tensor) -> None:
        self.comm.record("all_reduce", t)
        dist.all_reduce(t)

    def _describe_nonfinite(self) -> str:
        """Names the first gradient that is not finite; strategies refine this."""
        return "a gradient is not finite"

    # ---- watching the optimizer ----------------------------------------------------------------
    def _optimizer_step(self, measure: Measure, skip: Optional[torch.Tensor] = None) -> dict:
        """The optimizer's update, measured as `measure` asks (see step; measured_step.py); a no-op
        where the device flag `skip` is set (only passed to an optimizer whose skips_on_device() said yes)."""
        if measure:
            return measured_step(self.optimizer, measure, self.ctx, self._all_reduce, self._note_working_copies)
        self.optimizer.step() if skip is None else self.optimizer.step_unless(skip)
        self._note_working_copies()
        return {}

    def _note_working_copies(self) -> None:
        """The fp32 copies a step over a stored master or state made, piece by piece
        (zerolab/optim/stored.py), for peak accounting: alive during the step, on top of the rest."""
        working = getattr(self.optimizer, "last_working_bytes", 0)
        if working:
            self.transient.alloc(working, "step")
            self.transient.free(working)
