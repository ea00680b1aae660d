"""Learning-rate schedule: batch-size scaling rule, linear warmup, then decay to a floor.

Scaling rules for a global batch B tuned at base batch B0 (lr0 = optim.lr):
  linear  lr = lr0 · B/B0       (Goyal et al. 2017, arXiv 1706.02677; SGD)
  sqrt    lr = lr0 · √(B/B0)    (Malladi et al. 2022, arXiv 2205.10287; Adam-family)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zerolab.config import OptimConfig


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

    @classmethod
    def from_config(cls, cfg: OptimConfig, global_batch: int, max_steps: int) -> "LRSchedule":
        peak = scaled_lr(cfg.lr, cfg.base_batch, global_batch, cfg.lr_scaling)
        return cls(peak, cfg.warmup_steps, max_steps, cfg.decay, cfg.min_lr_ratio)

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
