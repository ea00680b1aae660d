"""Model construction by config; every model can be built on the `meta` device (no memory)."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerolab.schema import ModelConfig
from zerolab.models.gpt import GPT
from zerolab.models.mlp import NextTokenMLP

MODELS = {"gpt": GPT, "mlp": NextTokenMLP}


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """Build on `device`; with device="meta" no parameter memory is allocated."""
    with torch.device(device):
        return MODELS[cfg.kind](cfg)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def block_of_parameters(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> index of the transformer block (`model.blocks[i]`) it belongs to, or -1
    when it is registered outside the blocks or in more than one place (the GPT's lm_head.weight
    is wte.weight). Sharders that gather the model block by block (zero3) and the ledger that
    predicts their buckets read the model's structure from here."""
    blocks = getattr(model, "blocks", None)
    prefixes = [f"blocks.{i}." for i in range(len(blocks))] if isinstance(blocks, nn.ModuleList) else []
    homes: dict[int, set] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        homes.setdefault(id(p), set()).add(next((i for i, pre in enumerate(prefixes) if name.startswith(pre)), -1))
    return {pid: next(iter(h)) if len(h) == 1 else -1 for pid, h in homes.items()}


def no_decay(name: str, param: nn.Parameter) -> bool:
    """Biases, norm weights and the position table get no weight decay (1-D or position)."""
    return param.ndim < 2 or name.endswith("wpe.weight")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups, each carrying parameter names so sharders can key state by name."""
    decay, skip = {"params": [], "names": [], "weight_decay": weight_decay}, \
        {"params": [], "names": [], "weight_decay": 0.0}
    for name, p in model.named_parameters():  # named_parameters() yields a tied weight once
        if not p.requires_grad:
            continue
        group = skip if no_decay(name, p) else decay
        group["params"].append(p)
        group["names"].append(name)
    return [g for g in (decay, skip) if g["params"]]


__all__: Iterable[str] = ["build_model", "block_of_parameters", "lm_loss", "count_params", "param_groups", "MODELS"]
