"""LAMB (You et al. 2019, arXiv 1904.00962): Adam's direction, rescaled per tensor.

Per tensor, with Adam's bias-corrected moments m̂, v̂:
  u = m̂/(√v̂ + ε) + λ·w                 (decoupled decay inside the direction)
  r = ‖w‖/‖u‖   (1 where either norm is 0; optionally clamped to max_trust_ratio)
  Δw = −η·r·u
So every tensor moves by η·‖w‖ in norm, whatever its gradient scale: the property that lets
large batches (large η) train stably. A group with trust_ratio=False (biases and norm weights:
zerolab's build_optimizer gives it to the group without weight decay) takes r = 1, i.e. AdamW.

Under ZeRO a tensor may be split across ranks: the norms come from partial sums and one
all-reduce (base.layer_norms), so the result equals LAMB on whole tensors.
"""
from __future__ import annotations

import math

import torch

from zerolab.optim.base import ZerolabOptimizer, layer_norms, scale_per_tensor, trust_ratio
from zerolab.optim.segments import is_flat_group


class Lamb(ZerolabOptimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, max_trust_ratio=None,
                 trust_ratio: bool = True, impl: str = "auto"):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid Lamb settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        if max_trust_ratio is not None and max_trust_ratio <= 0:
            raise ValueError(f"max_trust_ratio={max_trust_ratio} must be > 0 (or None for no clamp)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust_ratio=max_trust_ratio, trust_ratio=trust_ratio)
        super().__init__(params, defaults, impl)

    def _layerwise(self, group: dict) -> bool:
        return group["trust_ratio"]

    def _step_group(self, group: dict) -> None:
        live = self._adam_state(group)
        if live is None:
            return
        params, grads, names, m_all, v_all = live
        bc1, bc2 = self._bias_corrections(group, params)
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        updates = []
        for ps, gs, ms, vs in self._chunks(group, params, grads, m_all, v_all):
            self._update_moments(ms, vs, gs, group["betas"])
            # u = m̂/(√v̂ + ε) + λw, in one temporary per tensor; in a flat shard's own gradient
            # (read above, never again: segments.py) instead of a fresh shard-sized tensor.
            if is_flat_group(group):
                for v, g in zip(vs, gs):
                    torch.sqrt(v, out=g)
                u = gs
            else:
                u = torch._foreach_sqrt(vs)
            torch._foreach_div_(u, math.sqrt(bc2))
            torch._foreach_add_(u, eps)
            torch._foreach_reciprocal_(u)
            torch._foreach_mul_(u, ms)
            torch._foreach_div_(u, bc1)
            if wd:
                torch._foreach_add_(u, ps, alpha=wd)
            updates.extend(u)
        if group["trust_ratio"]:
            w_norm, u_norm = layer_norms(group, params, updates)
            ratio = trust_ratio(w_norm, u_norm, group["max_trust_ratio"])
            self.update_stats.record_trust(ratio)
            scale_per_tensor(group, updates, ratio * -lr)
        else:
            torch._foreach_mul_(updates, -lr)
        self._apply(group, params, updates, names)
