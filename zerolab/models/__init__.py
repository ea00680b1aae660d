"""Model construction by config; every model can be built on the `meta` device (no memory).

Model sources: zerolab's own GPT and MLP (MODELS), a Hugging Face transformers causal LM
(model=hf) and any importable nn.Module (model=custom), zerolab/models/sources.py. Every one
maps token ids [B, T] to logits [B, T, V] under its own parameter names; its repeated blocks
(zerolab/models/units.py) are what zero3, fsdp and activation checkpointing work on.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerolab.errors import ConfigError
from zerolab.schema import ModelConfig
from zerolab.models.gpt import GPT
from zerolab.models.mlp import NextTokenMLP
from zerolab.models.recompute import checkpoint_blocks
from zerolab.models.sources import KEPT_BUFFERS_ATTR, build_custom, build_hf, check_weights, import_target, \
    load_weights, logits_only, resolve_hf
from zerolab.models.units import BLOCKS_ATTR, Blocks, block_of_parameters, find_blocks

MODELS = {"gpt": GPT, "mlp": NextTokenMLP}  # zerolab's own (whose activations zerolab.activations predicts)
SOURCES = {"hf": build_hf, "custom": build_custom}  # the user's


def resolve(cfg: ModelConfig) -> None:
    """What a user's model source must settle before anything else reads the config: model=hf's
    vocabulary (into cfg.vocab_size) and window limit, model=custom's target importing.
    ConfigError otherwise; nothing for zerolab's own models."""
    if cfg.kind == "hf":
        resolve_hf(cfg)
    elif cfg.kind == "custom":
        import_target(cfg.target)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", weights: bool = True) -> nn.Module:
    """Build on `device`; with device="meta" no parameter memory is allocated (and no weights are
    read). `weights`: load model.weights, if set (the digest's probe loads the run's own instead)."""
    if cfg.kind in MODELS:
        with torch.device(device):
            return MODELS[cfg.kind](cfg)
    resolve(cfg)
    model = SOURCES[cfg.kind](cfg, device)
    found = find_blocks(model, cfg.blocks)
    if found is not None:
        setattr(model, BLOCKS_ATTR, found.name)  # every later find_blocks(model) sees the same blocks
    if cfg.activation_checkpointing != "none":
        if found is None:
            raise _no_blocks(cfg, model, f"model.activation_checkpointing={cfg.activation_checkpointing}")
        checkpoint_blocks(found.modules, cfg.activation_checkpointing, cfg.checkpoint_every_k)
    logits_only(model)
    if weights and cfg.weights and torch.device(device).type != "meta":
        load_weights(model, cfg.weights)
    return model


def _no_blocks(cfg: ModelConfig, model: nn.Module, needed_by: str) -> ConfigError:
    what = cfg.target if cfg.kind == "custom" else f"model.config={cfg.config}"
    lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    return ConfigError(f"{what} ({type(model).__name__}) has no repeated blocks (no nn.ModuleList of modules of one "
                       f"class; its ModuleLists: {', '.join(lists) or 'none'}), and {needed_by} works block by "
                       "block: name them with model.blocks=PATH (a ModuleList or Sequential of its layers)")


def preflight(cfg: ModelConfig, needed_by: str = "") -> None:
    """The checks of a user's model that need files or code, before any rank trains (zerolab.job,
    launch/run_dir.py): the source resolves (resolve), the model builds on the meta device, it
    has repeated blocks where `needed_by` (a strategy that works block by block, e.g.
    "strategy=zero3") or activation checkpointing needs them, model.weights fits it, and a
    custom module returns [B, T, model.vocab_size] logits. ConfigError otherwise."""
    if cfg.kind not in SOURCES:
        return
    model = build_model(cfg, device="meta")  # resolves; refuses checkpointing without blocks
    if needed_by and find_blocks(model, cfg.blocks) is None:
        raise _no_blocks(cfg, model, needed_by)
    if cfg.weights:
        check_weights(model, cfg.weights)
    if cfg.kind == "custom":
        _check_logits(cfg, model)


def _check_logits(cfg: ModelConfig, model: nn.Module) -> None:
    """A forward on the meta device (no memory, no compute): ids [2, T] -> logits [2, T, V]. A module
    that cannot run on meta is not refused here; its first real forward will say what is wrong."""
    ids = torch.zeros(2, cfg.block_size, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            out = model(ids)
    except Exception:  # an op without a meta kernel, a data-dependent branch
        return
    want = (2, cfg.block_size, cfg.vocab_size)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"model.target={cfg.target} maps token ids [2, {cfg.block_size}] to {got}, not logits "
                          f"[2, {cfg.block_size}, model.vocab_size={cfg.vocab_size}] (a tensor, or an object with "
                          ".logits): set model.vocab_size to the V it returns")


def lm_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the compute dtype. `logits`: a
    [B, T, V] tensor, or an object holding one as `.logits`."""
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def place(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """`model.to(device, dtype)` for the strategies: floating parameters and buffers cast to
    `dtype`, everything moved to `device`, except the floating buffers a model keeps in their own
    dtype (sources.keep_buffer_dtypes: RoPE's inv_freq). Parameters change through `.data`, so
    each stays the same object (tied weights stay tied, param groups stay valid) and fake tensors
    work too: Module.to swaps a fake parameter for a new one, which torch refuses (a dry run,
    zerolab.rehearsal, places the model with this)."""
    def target(t: torch.Tensor, keep: bool = False) -> dict:
        cast = dtype is not None and t.is_floating_point() and not keep
        return {"device": device, "dtype": dtype if cast else t.dtype}

    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                p.data = p.data.to(**target(p))  # the same tensor when nothing changes
        kept = getattr(module, KEPT_BUFFERS_ATTR, ())
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(**target(b, keep=name in kept))
    return model


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


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


__all__: Iterable[str] = ["build_model", "place", "block_of_parameters", "lm_loss", "count_params", "param_groups",
                          "MODELS",
                          "SOURCES", "Blocks", "find_blocks", "preflight", "resolve"]
