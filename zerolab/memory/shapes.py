"""What the ledger predicts from: a model's trainable tensors by param group and shape
(ModelShape, from a parameter count, a live module or a config built on the meta device), and
the optimizer's state elements per parameter, measured rather than tabulated."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from zerolab.memory.storage import StorageCounter


@dataclass(frozen=True)
class ModelShape:
    """What the ledger needs from a model: every trainable tensor's param group and shape, in
    registration order (model.parameters()), which is the order sharders pack buckets in."""
    name: str
    tensors: tuple  # ((group index, shape), ...)
    buffer_bytes: int = 0
    # False for a bare parameter count: tensor boundaries are unknown, so strategies that place
    # whole tensors (whole-tensor optimizer shards, gradient partitions of whole tensors) are taken
    # as evenly divided.
    exact: bool = True
    # Per tensor, the transformer block (model.blocks[i]) it belongs to, -1 outside the blocks or
    # shared (zerolab.models.block_of_parameters); empty when unknown (a bare count: all -1).
    blocks: tuple = ()

    def block_of(self, i: int) -> int:
        return self.blocks[i] if self.blocks else -1

    @property
    def shapes(self) -> list[tuple]:
        return [s for _, s in self.tensors]

    @property
    def group_numels(self) -> list[int]:
        out = [0] * (1 + max(g for g, _ in self.tensors))
        for g, s in self.tensors:
            out[g] += math.prod(s)
        return out

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors)


def shape_from_params(n: float) -> ModelShape:
    """A bare parameter count: one group holding one flat tensor."""
    n = int(round(float(n)))
    if n <= 0:
        raise ValueError(f"--params must be a positive number of parameters, got {n}")
    return ModelShape(f"{n:.3g} params", ((0, (n,)),), exact=False)


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

    from zerolab.config import ModelConfig

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
    with torch.random.fork_rng(devices=[]):  # never disturb the caller's random stream
        try:
            from zerolab.optim import state_elements_per_param
        except ImportError:
            return _measure_state_elements(optim)
        try:
            return float(state_elements_per_param(optim))
        except (NotImplementedError, KeyError, ValueError) as e:
            raise NotImplementedError(f"cannot measure the optimizer state of optim={optim}: {e}") from e


def _measure_state_elements(optim: str) -> float:
    from zerolab.config import OptimConfig
    from zerolab.optim import build_optimizer

    p = torch.nn.Parameter(torch.ones(4, 8))
    try:
        opt = build_optimizer(OptimConfig(name=optim), [{"params": [p], "weight_decay": 0.0}])
    except NotImplementedError as e:
        raise NotImplementedError(f"optim={optim}: build_optimizer cannot build it yet, so its state "
                                  f"cannot be measured ({e})") from e
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    c = StorageCounter().add_optimizer(opt)
    return c.bytes["optim_state"] / (p.numel() * p.element_size())

