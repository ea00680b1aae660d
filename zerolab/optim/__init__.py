"""Optimizer construction from config."""
from __future__ import annotations

import torch

from zerolab.config import OptimConfig


def build_optimizer(cfg: OptimConfig, param_groups: list[dict]) -> torch.optim.Optimizer:
    groups = [{k: v for k, v in g.items()} for g in param_groups]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    raise NotImplementedError(f"optim={cfg.name} is not available yet; use optim=adamw")
