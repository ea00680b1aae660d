"""A strategy's side of the "pieces" checkpoint format (Strategy.checkpoint_state and
load_checkpoint_state; zerolab/checkpoint/reshard.py writes and reads the files).

A rank's checkpoint state is a set of pieces "<kind>/<param name>" -> ShardPiece, where kind
is "master" (fp32 weights; the weights themselves for fp32 strategies) or an optimizer state
name ("exp_avg", "exp_avg_sq", "momentum_buffer", ...). A piece is a 1-D slice [start, end)
of the flattened tensor. Loading asks for exactly the ranges this rank now owns, so a
checkpoint written by N ranks of one strategy loads into M ranks of another.

The strategies' loading shares two steps: creating the optimizer's state before loaded values
overwrite it (materialise_state), and choosing which saved optimizer-state kinds to read
(kinds_to_load). zerolab.strategies.base re-exports all three names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zerolab.errors import CheckpointError


@dataclass
class ShardPiece:
    tensor: torch.Tensor  # 1-D, elements [start, end) of the flattened full tensor
    start: int
    end: int
    shape: tuple  # shape of the full tensor


@torch.no_grad()
def materialise_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create the optimizer's state for `params` before a checkpoint is loaded into it. torch's,
    zerolab's and DeepSpeed's optimizers create their state at their first step, so one step with
    zero gradients at lr 0 creates every entry, in the optimizer's own dtypes and types, and changes
    no weight (the update and the decoupled decay are multiplied by lr); the loaded values then
    overwrite the tensors, and zerolab.checkpoint the counters. Gradients are put back as they were."""
    if all(optimizer.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:  # (not zeros_like: a stand-in master's strides are all 0)
        p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad


def kinds_to_load(read, name: str, held: list[str], who: str) -> list[str]:
    """The optimizer-state kinds of parameter `name` to read from a checkpoint into a reader whose
    optimizer keeps `held`: all of them when the checkpoint saved the same kinds; none when it saved
    none (a weights-only import, or an optimizer that had not stepped: the reader's fresh zeros are
    that state). Any other mismatch is refused before a tensor changes, naming the way out."""
    saved = sorted(read.kinds(name))
    if not saved:
        return []
    if saved != sorted(held):
        raise CheckpointError(
            f"{read.path}: the checkpoint holds optimizer state {saved} for {name}, and {who} keeps "
            f"{sorted(held) or 'none'}: it cannot hold what was saved. Resume with the optimizer that wrote it "
            "(meta.json's \"optimizer\") under a strategy that runs it, or export its weights (python -m zerolab "
            "export CKPT --as-checkpoint --out DIR) and start a fresh optimizer from them")
    return saved
