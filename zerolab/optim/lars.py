"""LARS (You, Gitman & Ginsburg 2017, arXiv 1708.03888): SGD with momentum and a per-tensor
("layer-wise") learning rate.

Per tensor, with trust coefficient η_t (0.001 in the paper), decay λ, global lr γ:
  local = η_t·‖w‖ / (‖g‖ + λ·‖w‖ + ε)   (1 where ‖w‖ or ‖g‖ is 0; optionally clamped)
  b ← μ·b + γ·local·(g + λ·w)            (the paper's Algorithm 1: lr inside the buffer)
  Δw = −b
Groups with trust_ratio=False (biases, norm weights) take local = 1: plain momentum SGD at γ.
Because local is ~1e-3·‖w‖/‖g‖, γ is typically large (1–10), unlike SGD's.
Under ZeRO the norms of split tensors come from partial sums and one all-reduce.
"""
from __future__ import annotations

import torch

from zerolab.optim.base import ZerolabOptimizer, layer_norms, scale_per_tensor, trust_ratio
from zerolab.optim.segments import is_flat_group


class Lars(ZerolabOptimizer):
    def __init__(self, params, lr: float = 1.0, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, max_trust_ratio=None,
                 trust_ratio: bool = True, impl: str = "auto"):
        if lr < 0 or weight_decay < 0 or trust_coefficient <= 0 or not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid Lars settings: lr={lr}, momentum={momentum}, weight_decay={weight_decay}, "
                             f"trust_coefficient={trust_coefficient}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, max_trust_ratio=max_trust_ratio, trust_ratio=trust_ratio)
        super().__init__(params, defaults, impl)

    def _layerwise(self, group: dict) -> bool:
        return group["trust_ratio"]

    def _step_group(self, group: dict) -> None:
        params, grads, names = self._live(group)
        if not params:
            return
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        if group["trust_ratio"]:  # the norms first: a flat shard's gradient becomes d below
            w_norm, g_norm = layer_norms(group, params, grads)
        # d = g + λw (it becomes Δw): a new tensor per parameter, or a flat shard's own gradient
        # (segments.py), so the step allocates no shard-sized temporary.
        if is_flat_group(group):
            d = grads
            if wd:
                torch._foreach_add_(d, params, alpha=wd)
        else:
            d = []
            for gs, ps in self._chunks(group, grads, params):
                d.extend(torch._foreach_add(gs, ps, alpha=wd) if wd else torch._foreach_mul(gs, 1.0))
        if group["trust_ratio"]:
            local = trust_ratio(group["trust_coefficient"] * w_norm, g_norm + wd * w_norm + group["eps"],
                                group["max_trust_ratio"])
            local = torch.where((w_norm > 0) & (g_norm > 0), local, torch.ones_like(local))
            self.update_stats.record_trust(local)
            scale_per_tensor(group, d, local * lr)
        else:
            for ds, in self._chunks(group, d):
                torch._foreach_mul_(ds, lr)
        if mu:
            bufs = [self._state(p, "momentum_buffer")[0] for p in params]
            self._advance_step(params)
            for bs, ds in self._chunks(group, bufs, d):
                torch._foreach_mul_(bs, mu)
                torch._foreach_add_(bs, ds)
                torch._foreach_copy_(ds, bs)
        for ds, in self._chunks(group, d):
            torch._foreach_neg_(ds)
        self._apply(group, params, d, names)
