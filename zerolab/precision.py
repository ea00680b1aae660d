"""Precision modes: compute dtype, FP32 master weights, dynamic loss scaling.

  fp32       weights, grads, optimizer all fp32
  bf16       bf16 weights and grads in the model; the optimizer updates an fp32 master copy
  fp16       as bf16 with fp16, plus dynamic loss scaling (fp16's range is too small for grads)
  bf16_pure  bf16 weights updated in place, no master copy: an opt-in demonstration of why
             master weights matter (small updates vanish in bf16's 8-bit mantissa)
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from zerolab.config import PrecisionConfig

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16_pure": torch.bfloat16}
# Bytes per element of each mode's compute dtype (the model's weights and gradients): the one
# precision-to-bytes table, read by the memory ledger and the report.
COMPUTE_BYTES = {name: dtype.itemsize for name, dtype in _DTYPES.items()}


class LossScaleUnderflow(RuntimeError):
    pass


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2017): start high, halve and skip the
    step on overflow, double after `growth_interval` clean steps. The overflow flag it receives
    must already agree across ranks (strategies all-reduce it), so every rank skips together."""

    def __init__(self, cfg: PrecisionConfig, enabled: bool):
        self.enabled = enabled
        self.scale = cfg.initial_scale if enabled else 1.0
        self.growth_interval, self.min_scale = cfg.growth_interval, cfg.min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool, step: int) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            new = self.scale / 2
            if new < self.min_scale:
                raise LossScaleUnderflow(
                    f"step {step}: fp16 loss scale would fall to {new:g}, below precision.min_scale="
                    f"{self.min_scale:g}; the gradients overflow even unscaled. Lower the lr, enable "
                    "clipping, or use precision=bf16")
            self.scale = new
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


@dataclass
class Precision:
    name: str
    compute_dtype: torch.dtype
    master_weights: bool
    scaler: LossScaler

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> "Precision":
        if cfg.name == "bf16_pure":
            log.warning("precision=bf16_pure: the optimizer updates bf16 weights directly, with no fp32 "
                        "master copy. Updates smaller than ~0.4% of a weight are lost. This mode exists "
                        "to show why master weights matter; use precision=bf16 to train.")
        return cls(cfg.name, _DTYPES[cfg.name], cfg.name in ("bf16", "fp16"),
                   LossScaler(cfg, enabled=cfg.name == "fp16"))

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.compute_dtype


class MasterCopy:
    """FP32 master weights for unsharded strategies: the optimizer updates these, the model's
    16-bit weights are refreshed from them after every step."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.model_params = params
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
        self.by_model = {id(p): m for p, m in zip(params, self.master)}

    def grads_to_master(self) -> None:
        for p, m in zip(self.model_params, self.master):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in zip(self.model_params, self.master):
            p.copy_(m)


def grad_norm_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all gradients (a 0-dim tensor), accumulated in fp32, or in fp64 when a
    gradient is fp64 (16-bit gradients are upcast, fp64 ones never downcast)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    return torch.stack([g.to(dtype).pow(2).sum() for g in grads]).sum()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm/(norm+1e-6) when that is < 1."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
