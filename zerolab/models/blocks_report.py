"""Which modules a run takes as the model's repeated blocks, and how that was decided, said once.

The blocks are the unit zero3 gathers, fsdp wraps and activation checkpointing recomputes
(zerolab/models/units.py finds them). A run and a dry run say which they took, so nobody has to
call find_blocks to learn it: the dotted path, how many, their class, and the rule that chose
them (model.blocks named them, or the search took the longest nn.ModuleList of same-class
children, or the model has none and is one unit).
"""
from __future__ import annotations

import logging

import torch.nn as nn

from zerolab.models.units import find_blocks

NAMED = "model.blocks"  # the user named them
SEARCHED = "longest same-class nn.ModuleList"  # units.find_blocks' search chose them
NONE = "none"  # no such list: the whole model is one unit


def _class_name(module: nn.Module) -> str:
    """The module's own class, not the subclass a strategy made of it (FSDP2's fully_shard turns a
    LlamaDecoderLayer into an FSDPLlamaDecoderLayer whose bases are FSDPModule and the original)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def describe_blocks(model: nn.Module, named: str = "") -> dict:
    """How `model`'s repeated blocks were found: {"path", "count", "class", "found_by"}, where
    found_by is "model.blocks" when `named` (the run's model.blocks) gave them, "longest same-class
    nn.ModuleList" when the search chose them, "none" when the model has none (path "", count 0).
    A named list may hold blocks of several classes: "class" then lists them in order, joined by
    ", ". ConfigError when `named` does not lead to such a list (as find_blocks)."""
    found = find_blocks(model, named)
    if found is None:
        return {"path": "", "count": 0, "class": "", "found_by": NONE}
    classes = list(dict.fromkeys(_class_name(m) for m in found.modules.children()))
    return {"path": found.name, "count": len(found.modules), "class": ", ".join(classes),
            "found_by": NAMED if named else SEARCHED}


def blocks_line(info: dict) -> str:
    """One line for a run's log and a dry run's output, from describe_blocks."""
    if info["found_by"] == NONE:
        return ("repeated blocks: none (no nn.ModuleList of modules of one class): the whole model is one unit "
                "(zero3 gathers it whole, fsdp wraps it once, activation checkpointing has no block to recompute); "
                "model.blocks=PATH names a ModuleList or Sequential of its layers")
    how = "named by model.blocks" if info["found_by"] == NAMED else \
        "the longest nn.ModuleList of same-class children; model.blocks=PATH names others"
    return f"repeated blocks: {info['path']}, {info['count']} × {info['class']} ({how})"


def say_blocks(model: nn.Module, named: str = "", is_main: bool = True) -> dict:
    """describe_blocks, said once in the run's log (rank 0: `is_main`); returns it, for
    summary.json's "blocks". Call it on the model as built, before a strategy wraps it."""
    info = describe_blocks(model, named)
    if is_main:
        logging.getLogger("zerolab").info("%s", blocks_line(info))
    return info
