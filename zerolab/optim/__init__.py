"""zerolab's optimizers and their construction from config.

Every strategy builds its optimizer through `build_optimizer(cfg, param_groups)`: with the
model's parameters (DDP), an fp32 master copy (mixed precision), or flat fp32 shards (zerolab's
ZeRO sharder; see segments.py). The same classes serve all three, so the optimizer math is
identical across strategies.
"""
from __future__ import annotations

import torch

from zerolab.accounting import element_states
from zerolab.schema import OPTIMIZERS, OptimConfig
from zerolab.optim.adamw import Adam, AdamW
from zerolab.optim.base import ZerolabOptimizer
from zerolab.optim.lamb import Lamb
from zerolab.optim.lars import Lars
from zerolab.optim.sgd import SGD



def _kwargs(cfg: OptimConfig) -> tuple[type, dict]:
    betas = tuple(cfg.betas)
    impl = cfg.impl
    if cfg.name == "adamw":
        return AdamW, dict(lr=cfg.lr, betas=betas, eps=cfg.eps, impl=impl)
    if cfg.name == "adam":
        return Adam, dict(lr=cfg.lr, betas=betas, eps=cfg.eps, impl=impl)
    if cfg.name == "sgd":
        return SGD, dict(lr=cfg.lr, momentum=0.0, impl=impl)
    if cfg.name == "sgd_momentum":
        return SGD, dict(lr=cfg.lr, momentum=cfg.momentum, impl=impl)
    if cfg.name == "lamb":
        return Lamb, dict(lr=cfg.lr, betas=betas, eps=cfg.eps, max_trust_ratio=cfg.max_trust_ratio, impl=impl)
    if cfg.name == "lars":
        return Lars, dict(lr=cfg.lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient, eps=cfg.eps,
                          max_trust_ratio=cfg.max_trust_ratio, impl=impl)
    raise ValueError(f"optim.name={cfg.name!r} is not valid; allowed values: {', '.join(OPTIMIZERS)}")


def build_optimizer(cfg: OptimConfig, param_groups: list[dict]) -> ZerolabOptimizer:
    """zerolab's optimizer for `cfg.name` over `param_groups` (each with "params", and usually
    "names" and "weight_decay"; flat groups also carry "shard", a segments.ShardMap).

    LAMB/LARS: the group without weight decay (biases, norm weights, position table) gets
    trust_ratio=False, the usual exclusion (You et al. 2019 §3; Goyal-style BN/bias exclusion):
    their norms are tiny or zero at init, so a norm ratio would freeze or explode them. With
    optim.weight_decay=0 no group can be told apart that way and every group keeps the trust
    ratio, unless a group sets "trust_ratio" itself."""
    cls, kwargs = _kwargs(cfg)
    groups = []
    for g in param_groups:
        g = dict(g)
        g.setdefault("weight_decay", cfg.weight_decay)
        if cls in (Lamb, Lars) and "trust_ratio" not in g:
            g["trust_ratio"] = not (g["weight_decay"] == 0 and cfg.weight_decay > 0)
        groups.append(g)
    return cls(groups, **kwargs)


@torch.no_grad()
def _count_state(optimizer: torch.optim.Optimizer) -> int:
    """Elements of per-element state (scalar step counters are not per-parameter state)."""
    return sum(v.numel() for v in element_states(optimizer))


def measure_state(cfg: OptimConfig, param_groups: list[dict], loss_fn=None) -> tuple[int, int, int]:
    """Build the optimizer, take one real step, and return (state elements, state bytes, params)."""
    opt = build_optimizer(cfg, param_groups)
    params = [p for g in param_groups for p in g["params"]]
    if loss_fn is None:
        for p in params:
            p.grad = torch.randn_like(p)
    else:
        loss_fn().backward()
    opt.step()
    nbytes = sum(v.numel() * v.element_size() for v in element_states(opt))
    return _count_state(opt), nbytes, sum(p.numel() for p in params)


def state_elements_per_param(name: str) -> float:
    """State elements the optimizer `name` keeps per parameter, measured from one real step on a
    small tensor (AdamW/Adam/LAMB 2, SGD with momentum and LARS 1, plain SGD 0)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    elements, _, n = measure_state(OptimConfig(name=name), [{"params": [w], "names": ["w"], "weight_decay": 0.01}])
    return elements / n


__all__ = ["AdamW", "Adam", "SGD", "Lamb", "Lars", "ZerolabOptimizer", "build_optimizer",
           "state_elements_per_param", "measure_state"]
