"""SGD, with or without heavy-ball momentum, the same math as torch.optim.SGD (dampening 0).

  g ← g + λ·w                       (classic L2 decay, coupled to the gradient)
  plain:     Δw = −η·g
  momentum:  b ← μ·b + g,  Δw = −η·b
The buffer starts at zero, so the first step gives b = g exactly, as torch's copy does.

Kernel: with impl=auto on fp32/fp64 tensors (CPU or CUDA) the step runs in torch's fused SGD kernel
(torch._fused_sgd_, what torch.optim.SGD(fused=True) runs): one pass over memory and no
temporaries, for whole tensors (ddp) and a flat ZeRO shard alike. Otherwise the composed ops run.
"""
from __future__ import annotations

import torch

from zerolab.optim.base import ZerolabOptimizer


class SGD(ZerolabOptimizer):
    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
                 impl: str = "auto"):
        if lr < 0 or weight_decay < 0 or not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid SGD settings: lr={lr}, momentum={momentum}, weight_decay={weight_decay} "
                             "(need lr, decay >= 0 and momentum in [0, 1))")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay), impl)

    def _step_group(self, group: dict) -> None:
        params, grads, names = self._live(group)
        if not params:
            return
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        # Plain SGD keeps no state at all (state_elements_per_param("sgd") == 0).
        bufs = [self._state(p, "momentum_buffer")[0] for p in params] if mu else [None] * len(params)
        if self._fused_group(group):
            self._fused_step(group, params, grads, names, bufs if mu else [])
            return
        if mu:
            self._advance_step(params)
        updates = []
        for ps, gs, bs in self._chunks(group, params, grads, bufs):
            d = torch._foreach_add(gs, ps, alpha=wd) if wd else gs
            if mu:
                torch._foreach_mul_(bs, mu)
                torch._foreach_add_(bs, d)
                d = bs
            updates.extend(torch._foreach_mul(d, -lr))  # a new list: Δw never aliases grad or buffer
        self._apply(group, params, updates, names)

    def _fused_group(self, group: dict) -> bool:
        params, grads, _ = self._live(group)
        return bool(params) and self._fusable(params, grads, self._existing_state(params, "momentum_buffer"))

    def _fused_step(self, group: dict, params: list, grads: list, names: list, bufs: list) -> None:
        """The same math in one fused pass per tensor. is_first_step=False: the zero-initialised
        buffer makes the first step's b = μ·0 + g = g exactly, as torch's copy of g does."""
        steps = self._device_steps(params) if bufs else []  # momentum keeps a step count (plain SGD none)
        self._fused(group, params, names, lambda found_inf: torch._fused_sgd_(
            params, grads, bufs, weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
            dampening=0.0, nesterov=False, maximize=False, is_first_step=False, found_inf=found_inf), steps)
