"""Learning-rate schedule: batch-size scaling rule, linear warmup, then decay to a floor.

Scaling rules for a global batch B tuned at base batch B0 (lr0 = optim.lr):
  linear  lr = lr0 · B/B0       (Goyal et al. 2017, arXiv 1706.02677; SGD)
  sqrt    lr = lr0 · √(B/B0)    (Malladi et al. 2022, arXiv 2205.10287; Adam-family)
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

from zerolab.schema import OptimConfig

log = logging.getLogger("zerolab")


def scaled_lr(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
    if rule == "none" or base_batch <= 0:
        return base_lr
    ratio = batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"unknown lr scaling rule {rule!r}; use none, linear or sqrt")


@dataclass
class LRSchedule:
    peak_lr: float
    warmup_steps: int
    max_steps: int
    decay: str = "cosine"
    min_lr_ratio: float = 0.1
    # How peak_lr was derived; saved in checkpoints so a resumed run can re-derive it.
    base_lr: float = 0.0
    base_batch: int = 0  # the batch base_lr belongs to (optim.base_batch, else the run's first batch)
    batch: int = 0  # the global batch peak_lr is for
    rule: str = "none"
    base_batch_from_run: bool = False  # optim.base_batch was 0: "tuned at this run's own batch"

    @classmethod
    def from_config(cls, cfg: OptimConfig, global_batch: int, max_steps: int) -> "LRSchedule":
        base_batch = cfg.base_batch or global_batch
        peak = scaled_lr(cfg.lr, base_batch, global_batch, cfg.lr_scaling)
        return cls(peak, cfg.warmup_steps, max_steps, cfg.decay, cfg.min_lr_ratio, base_lr=cfg.lr,
                   base_batch=base_batch, batch=global_batch, rule=cfg.lr_scaling,
                   base_batch_from_run=not cfg.base_batch)

    def resume_from(self, saved: dict) -> Optional[str]:
        """Keep the scaling rule's result consistent when a run resumes at another global batch
        (another world size). `saved` is the checkpoint's schedule (dataclasses.asdict of the
        saving run's LRSchedule). With optim.base_batch=0 the lr was "tuned at the run's own
        batch": that reference is the batch the run *started* with, so it is carried over and
        the rule re-applied to the new batch, instead of silently treating the new batch as the
        reference. Returns the line to log (also logged here), or None when the batch is unchanged."""
        old_batch = int(saved.get("batch") or 0)
        if not old_batch or old_batch == self.batch:
            return None
        before = self.peak_lr
        if self.base_batch_from_run and saved.get("base_batch"):
            self.base_batch = int(saved["base_batch"])
        self.peak_lr = scaled_lr(self.base_lr, self.base_batch, self.batch, self.rule)
        if self.rule == "none":
            msg = (f"resumed at global batch {self.batch} (the checkpoint ran at {old_batch}): optim.lr_scaling=none, "
                   f"so the peak lr stays {self.peak_lr:.4g}; set optim.lr_scaling=linear|sqrt to scale it")
        else:
            msg = (f"resumed at global batch {self.batch} (the checkpoint ran at {old_batch}): optim.lr_scaling="
                   f"{self.rule} with base lr {self.base_lr:.4g} at batch {self.base_batch} gives peak lr "
                   f"{self.peak_lr:.4g} (this config alone would give {before:.4g}; the checkpoint used "
                   f"{float(saved.get('peak_lr', float('nan'))):.4g})")
        log.info("lr scaling: %s", msg)  # info: rank 0 prints it (other ranks log warnings only)
        return msg

    def __call__(self, step: int) -> float:
        """lr for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        floor = self.peak_lr * self.min_lr_ratio
        if self.decay == "constant" or self.max_steps <= self.warmup_steps:
            return self.peak_lr
        progress = min(1.0, (step - self.warmup_steps) / (self.max_steps - self.warmup_steps))
        if self.decay == "linear":
            return self.peak_lr - (self.peak_lr - floor) * progress
        return floor + 0.5 * (self.peak_lr - floor) * (1.0 + math.cos(math.pi * progress))
