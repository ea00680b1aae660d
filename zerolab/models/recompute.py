"""Activation checkpointing: which blocks recompute their forward in backward instead of
keeping its activations (model.activation_checkpointing)."""
from __future__ import annotations

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
