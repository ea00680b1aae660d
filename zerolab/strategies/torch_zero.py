"""torch's ZeroRedundancyOptimizer behind DDP: ZeRO-1 with whole tensors.

DDP all-reduces the gradients exactly as in strategy=ddp. The optimizer is a
torch.distributed.optim.ZeroRedundancyOptimizer wrapping the configured optimizer class: every
parameter is assigned whole to one rank (greedily, balancing sizes), only that rank keeps its
optimizer state and updates it, then each rank broadcasts the parameters it owns. So the state is
sharded ~1/N but not evenly (tensors are not split), gradients and the fp32 master copy are full,
and the broadcast carries the master dtype (fp32), not the compute dtype.

Because parameters stay whole, layer-wise optimizers (LAMB, LARS) see true per-tensor norms here.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from zerolab.memory import StorageCounter
from zerolab.strategies.base import OptimizerFactory, StepInfo
from zerolab.strategies.ddp import DDPStrategy


def as_class_and_groups(optimizer: torch.optim.Optimizer) -> tuple[type, dict, list[dict]]:
    """ZeroRedundancyOptimizer needs a class, its constructor keywords and param groups rather
    than an optimizer object: take them from the object zerolab's factory built (state is created
    lazily, so building it cost nothing). Its groups carry every per-group setting the factory
    chose (weight decay, LAMB's trust_ratio exclusions, ...)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    groups = [{k: v for k, v in g.items() if k != "names"} for g in optimizer.param_groups]
    return cls, kwargs, groups


class TorchZeroStrategy(DDPStrategy):
    name = "torch_zero"
    reference = False
    # DDP's checkpoint methods are inherited but wrong here: the optimizer state lives on the rank
    # that owns each parameter, which DDP's rank-0-writes-all would silently drop.
    checkpoint_format = "none"

    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        def make_zero(groups: list[dict]) -> torch.optim.Optimizer:
            cls, kwargs, groups = as_class_and_groups(make_optimizer(groups))
            return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)

        module = super().setup(model, param_groups, make_zero)
        # What the post-step broadcast moves: every optimizer-side parameter, once, from its owner.
        self.broadcast_numel = sum(p.numel() for p in self._optimizer_params())
        self.broadcast_elem = self._optimizer_params()[0].element_size()
        return module

    def step(self, lr: float, stats_level: int = 0) -> StepInfo:
        info = super().step(lr, stats_level)
        if not info.skipped and self.ctx.world_size > 1:
            self.comm.record("broadcast", self.broadcast_numel, self.broadcast_elem)
        return info

    def memory(self) -> dict[str, int]:
        c = StorageCounter()
        c.add("params", self.params).add("grads", (p.grad for p in self.params))
        if self.master:
            c.add("master", self.master.master)
        c.add_optimizer(self.optimizer.optim)  # the local optimizer: this rank's share of the state
        c.add("buffers", self.model.buffers())
        return c.result()
