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


def optimizer_class_and_kwargs(make_optimizer: OptimizerFactory) -> tuple[type, dict]:
    """The class and constructor defaults of the optimizer zerolab's factory builds, found by
    building it once on a throwaway tensor. ZeroRedundancyOptimizer needs a class, not an object."""
    probe = make_optimizer([{"params": [torch.zeros(1, requires_grad=True)], "names": ["probe"]}])
    cls = type(probe)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in probe.defaults.items() if k in accepted and k != "params"}
    return cls, kwargs


class TorchZeroStrategy(DDPStrategy):
    name = "torch_zero"

    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        cls, kwargs = optimizer_class_and_kwargs(make_optimizer)

        def make_zero(groups: list[dict]) -> torch.optim.Optimizer:
            groups = [{k: v for k, v in g.items() if k != "names"} for g in groups]
            return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)

        module = super().setup(model, param_groups, make_zero)
        # What the post-step broadcast moves: every optimizer-side parameter, once, from its owner.
        self.broadcast_numel = sum(p.numel() for p in self._optimizer_params())
        self.broadcast_elem = self._optimizer_params()[0].element_size()
        return module

    def step(self, lr: float) -> StepInfo:
        info = super().step(lr)
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
