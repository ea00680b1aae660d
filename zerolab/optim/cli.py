"""`python -m zerolab lr` (batch-size LR scaling) and `python -m zerolab optim-state` (optimizer
state per parameter, measured from a real step)."""
from __future__ import annotations

import argparse

from zerolab.config import LR_SCALING, OPTIMIZERS


def lr_main(argv: list[str]) -> int:
    from zerolab.optim.schedule import scaled_lr

    p = argparse.ArgumentParser(prog="python -m zerolab lr",
                                description="the peak lr for a new global batch under a scaling rule")
    p.add_argument("--base-lr", type=float, required=True, help="lr tuned at --base-batch")
    p.add_argument("--base-batch", type=int, required=True, help="global batch (sequences) --base-lr was tuned at")
    p.add_argument("--batch", type=int, required=True, help="the new global batch")
    p.add_argument("--rule", choices=LR_SCALING, default="linear",
                   help="linear (Goyal et al. 2017, SGD), sqrt (Malladi et al. 2022, Adam-family), none")
    a = p.parse_args(argv)
    if a.base_lr <= 0 or a.base_batch <= 0 or a.batch <= 0:
        p.error("--base-lr, --base-batch and --batch must be > 0")
    k = a.batch / a.base_batch
    print(f"lr = {scaled_lr(a.base_lr, a.base_batch, a.batch, a.rule):.6g}   "
          f"({a.rule}: batch {a.base_batch} -> {a.batch} is x{k:g})")
    for rule in LR_SCALING:
        if rule != a.rule:
            print(f"  ({rule:6s} would give {scaled_lr(a.base_lr, a.base_batch, a.batch, rule):.6g})")
    print(f"train.py: optim.lr={a.base_lr:g} optim.base_batch={a.base_batch} optim.lr_scaling={a.rule}")
    return 0


def optim_state_main(argv: list[str]) -> int:
    import torch

    from zerolab.config import compose
    from zerolab.models import build_model, lm_loss, param_groups
    from zerolab.optim import measure_state

    p = argparse.ArgumentParser(prog="python -m zerolab optim-state",
                                description="optimizer state elements per parameter, measured from one real step")
    p.add_argument("--optim", nargs="+", choices=[*OPTIMIZERS, "all"], default=["all"])
    p.add_argument("--model", default="mlp", help="a conf/model/*.yaml name (default: mlp)")
    a = p.parse_args(argv)
    names = list(OPTIMIZERS) if "all" in a.optim else a.optim
    print(f"model={a.model}: one real step (fp32 params), state counted from optimizer.state")
    print(f"{'optimizer':14s} {'state/param':>11s} {'state bytes':>12s} {'params':>10s}")
    for name in names:
        cfg = compose([f"model={a.model}", f"optim={name}"])
        torch.manual_seed(0)
        model = build_model(cfg.model)
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))

        def loss_fn():
            return lm_loss(model(x), x)

        elements, nbytes, n = measure_state(cfg.optim, param_groups(model, cfg.optim.weight_decay), loss_fn)
        print(f"{name:14s} {elements / n:11.3g} {nbytes:12,d} {n:10,d}")
    return 0
