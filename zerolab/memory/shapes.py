"""What the ledger predicts from: a model's trainable tensors by param group and shape
(ModelShape, from a parameter count, a live module or a config built on the meta device), and
the optimizer's state elements per parameter, measured rather than tabulated."""
from __future__ import annotations

import os

import torch

from zerolab.accounting import ModelShape


def shape_from_model(model, weight_decay: float = 0.1, name: str = "model") -> ModelShape:
    """Groups as zerolab builds them (zerolab.models.param_groups): decay and no-decay tensors."""
    from zerolab.models import block_of_parameters, param_groups

    group_of = {id(p): gi for gi, g in enumerate(param_groups(model, weight_decay)) for p in g["params"]}
    trainable = [p for p in model.parameters() if id(p) in group_of]
    tensors = tuple((group_of[id(p)], tuple(p.shape)) for p in trainable)
    block_of = block_of_parameters(model)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return ModelShape(name, tensors, buffers, blocks=tuple(block_of[id(p)] for p in trainable))


def load_model_config(name: str):
    """conf/model/<name>.yaml merged onto zerolab's ModelConfig (defaults and types apply)."""
    from omegaconf import OmegaConf

    from zerolab.schema import ModelConfig

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # zerolab/memory/ -> root
    conf_dir = os.path.join(repo, "conf", "model")
    path = os.path.join(conf_dir, f"{name}.yaml")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(conf_dir) if f.endswith(".yaml"))
        raise ValueError(f"no model config {path}; known models: {', '.join(known)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))


def shape_from_model_config(mcfg, weight_decay: float = 0.1) -> ModelShape:
    """Build the model on the meta device (no memory is allocated) and read its shapes."""
    from zerolab.models import build_model

    return shape_from_model(build_model(mcfg, device="meta"), weight_decay, mcfg.name)


# ---- optimizer state per parameter (measured, not tabulated) ---------------------------------
def optimizer_state_elements(optim: str) -> float:
    """Optimizer-state elements per parameter, measured on a tiny instance: by
    zerolab.optim.state_elements_per_param where it exists, else here with build_optimizer
    (one step on a small tensor, counting state tensors as the ledger's measured side does)."""
    from zerolab.optim import state_elements_per_param

    with torch.random.fork_rng(devices=[]):  # never disturb the caller's random stream
        try:
            return float(state_elements_per_param(optim))
        except (NotImplementedError, KeyError, ValueError) as e:
            raise NotImplementedError(f"cannot measure the optimizer state of optim={optim}: {e}") from e
