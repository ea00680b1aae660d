"""`python -m zerolab lr`: the peak learning rate a batch-size scaling rule gives."""
from __future__ import annotations

import argparse

from zerolab.schema import LR_SCALING


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
