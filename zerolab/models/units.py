"""A model's repeated blocks: the unit that zero3 gathers, fsdp wraps and activation checkpointing
recomputes, found once for any nn.Module (zerolab's GPT, a Hugging Face causal LM, a custom one).

Found automatically as the longest nn.ModuleList whose children all share one class, at any
depth (`blocks`, `model.layers`, `transformer.h`, `model.decoder.layers`, `trunk.stack`), among
the lists that are not themselves inside a block of another such list (a mixture-of-experts
layer's list of experts is not the model's blocks, however many experts it has). Or named:
`model.blocks=dotted.path` (a ModuleList or Sequential of the model's blocks). Everything outside
the blocks is the root unit. When the model source built the model it records the path it used
(BLOCKS_ATTR), so every later reader (the sharders, the memory ledger) finds the same blocks.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch.nn as nn

from zerolab.errors import ConfigError

BLOCKS_ATTR = "_zerolab_blocks"  # the dotted path of the blocks, recorded on the model when it was built


class Blocks(NamedTuple):
    name: str  # dotted path from the model's root, e.g. "model.layers" ("" never: the root is no block list)
    modules: nn.Module  # the ModuleList (or Sequential) holding them

    def prefixes(self) -> list[str]:
        """Parameter-name prefix of each block: "model.layers.0.", "model.layers.1.", ..."""
        return [f"{self.name}.{i}." for i in range(len(self.modules))]


def _same_class(ml: nn.Module) -> bool:
    kids = list(ml.children())
    return bool(kids) and len({type(k) for k in kids}) == 1


def named_blocks(model: nn.Module, path: str) -> Blocks:
    """The module at dotted `path` as the model's blocks, or a ConfigError saying what is there."""
    try:
        found = model.get_submodule(path)
    except AttributeError:
        lists = ", ".join(n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)) or "none"
        raise ConfigError(f"model.blocks={path}: {type(model).__name__} has no submodule {path!r} "
                          f"(its nn.ModuleLists: {lists})") from None
    if not isinstance(found, (nn.ModuleList, nn.Sequential)) or not len(found):
        raise ConfigError(f"model.blocks={path}: {path!r} is a {type(found).__name__}, not a non-empty "
                          "nn.ModuleList or nn.Sequential of the model's blocks")
    return Blocks(path, found)


def find_blocks(model: nn.Module, path: str = "") -> Optional[Blocks]:
    """The model's repeated blocks: those at `path` when given, else the path recorded when the
    model was built, else the longest same-class nn.ModuleList not inside another one's blocks
    (the first of equally long ones, in registration order); None when the model has none."""
    path = path or getattr(model, BLOCKS_ATTR, "")
    if path:
        return named_blocks(model, path)
    candidates = [(name, m) for name, m in model.named_modules()
                  if name and isinstance(m, nn.ModuleList) and _same_class(m)]
    inner = {id(sub) for _, m in candidates for block in m.children() for sub in block.modules()}
    outer = [(name, m) for name, m in candidates if id(m) not in inner]
    if not outer:
        return None
    name, m = max(outer, key=lambda c: len(c[1]))  # max keeps the first of equals
    return Blocks(name, m)


def block_of_parameters(model: nn.Module, path: str = "") -> dict[int, int]:
    """id(parameter) -> index of the block (find_blocks) it belongs to, or -1 when it is registered
    outside the blocks or in more than one place (a tied head: GPT's lm_head.weight is wte.weight,
    GPT-2's lm_head.weight is transformer.wte.weight). Sharders that gather the model block by
    block (zero3) and the ledger that predicts their buckets read the model's structure here."""
    found = find_blocks(model, path)
    prefixes = found.prefixes() if found is not None else []
    homes: dict[int, set] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        homes.setdefault(id(p), set()).add(next((i for i, pre in enumerate(prefixes) if name.startswith(pre)), -1))
    return {pid: next(iter(h)) if len(h) == 1 else -1 for pid, h in homes.items()}
