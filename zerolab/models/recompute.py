"""Activation checkpointing: which blocks recompute their forward in backward instead of
keeping its activations (model.activation_checkpointing), and how, for any model.

One way for every model: the block runs under torch's non-reentrant checkpoint with the RNG state
preserved (dropout draws the same masks again), and the tensors it is called with, which
checkpoint keeps alive to recompute it, are reported to the activation meter (keep_for_backward).
zerolab's GPT calls `checkpointed_call` from its own forward (it reads its config there); any
other model (model=hf, model=custom) has the forward of each chosen block wrapped
(`checkpoint_blocks`), so the model's own code, which calls its blocks, needs no change. The
block's module hooks (zero3's gather and free, FSDP2's) stay outside the recomputation: in
backward a block's weights are gathered again before its output's gradient reaches it, which is
before anything is recomputed (torchtitan wraps blocks the same way, inside fully_shard).
Non-reentrant checkpoint also gives gradients to blocks whose input needs none (a frozen
embedding), where the reentrant one silently gives none.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from zerolab.accounting.saved import keep_for_backward

CHECKPOINTING = ("none", "blocks", "every_k")


def checkpointed_blocks(n_layer: int, mode: str, every_k: int = 1) -> list[bool]:
    """Which blocks run under activation checkpointing: none, all (blocks), or blocks
    0, k, 2k, ... (every_k: one block in k recomputes, the others keep their activations)."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(CHECKPOINTING)}")
    if mode == "every_k" and every_k < 1:
        raise ValueError(f"checkpoint_every_k={every_k} must be >= 1")
    k = 1 if mode == "blocks" else every_k
    return [mode != "none" and i % k == 0 for i in range(n_layer)]


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in a module's inputs or output: a tensor, or a tuple/list/dict holding some
    (transformers' layers return tuples and ModelOutput dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def checkpointed_call(fn, *args, **kwargs):
    """fn(*args, **kwargs) keeping only its inputs for backward, which runs it again. With grad
    disabled (eval) it simply runs."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    keep_for_backward(*tensors_in((args, kwargs)))  # held by checkpoint, not autograd's saved tensors
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def checkpoint_blocks(blocks: nn.Module, mode: str, every_k: int = 1) -> int:
    """Wrap the forward of the chosen blocks (checkpointed_blocks) in checkpointed_call; returns
    how many. The block stays the same module (names, hooks and parameters unchanged)."""
    chosen = [b for b, again in zip(blocks, checkpointed_blocks(len(blocks), mode, every_k)) if again]
    for block in chosen:
        block.forward = _wrapped(block.forward)
    return len(chosen)


def _wrapped(forward):
    def recomputed(*args, **kwargs):
        return checkpointed_call(forward, *args, **kwargs)
    return recomputed
