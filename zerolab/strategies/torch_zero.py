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
import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from zerolab.accounting import MIXED, StorageCounter, ceil_div, fmt_n, state_bytes
from zerolab.numerics import Measure, StepInfo
from zerolab.strategies.base import PRECISION_MODE_SETTINGS, OptimizerFactory, materialise_state
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
    # ZeroRedundancyOptimizer steps zerolab's optimizer class itself: no per-layer statistics. Whole
    # tensors are assigned greedily, so ranks hold uneven shares; the memory sweep shows rank 0 only.
    traits = replace(DDPStrategy.traits, reference=False, stage=1, uneven_memory=True, sweep_stages=(),
                     also_reads=DDPStrategy.traits.also_reads - {"logging.layer_stats_every"}
                     - PRECISION_MODE_SETTINGS,  # its optimizer holds the master shards
                     # measured by collective, gpt_mid on 2 ranks: all_reduce 2Ψ + broadcast Ψ
                     comm_extra="DDP's all-reduce of the gradients (2Ψ), then ZeroRedundancyOptimizer's broadcast "
                                "of every updated parameter from the rank that owns it (Ψ more, in the master dtype)")
    # checkpoint_format "pieces" (ddp.py's, whole tensors): each rank writes the masters and state of
    # the tensors its optimizer owns (no consolidation on one rank: ZeroRedundancyOptimizer's
    # consolidate_state_dict would broadcast pickles), and on load every rank reads every master
    # (they are whole everywhere) and the state of the tensors it owns now, at any world size.

    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        def make_zero(groups: list[dict]) -> torch.optim.Optimizer:
            cls, kwargs, groups = as_class_and_groups(make_optimizer(groups))
            return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)

        module = super().setup(model, param_groups, make_zero)
        # The optimizer-side parameters this rank's share updates: its local optimizer's (`.optim`),
        # whatever rule ZeroRedundancyOptimizer used to assign them.
        self.owned = {id(q) for g in self.optimizer.optim.param_groups for q in g["params"]}
        # What the post-step broadcast moves: every optimizer-side parameter, once, from its owner.
        self.broadcast_numel = sum(p.numel() for p in self._optimizer_params())
        self.broadcast_elem = self._optimizer_params()[0].element_size()
        return module

    def _state_holder(self, p: torch.Tensor) -> Optional[dict]:
        return self.optimizer.optim.state[p] if id(p) in self.owned else None

    def _writes(self, p: torch.Tensor) -> bool:
        return id(p) in self.owned

    def _materialise_state(self) -> None:
        """The local optimizer's state for the tensors this rank owns (not through the wrapper,
        whose step would broadcast)."""
        materialise_state(self.optimizer.optim, [p for p in self._optimizer_params() if id(p) in self.owned])

    def optimizer_states(self):
        return self.optimizer.optim.state.values()  # the local optimizer's: this rank's share

    def step(self, lr: float, measure: Measure = Measure.NOTHING) -> StepInfo:
        info = super().step(lr, measure)
        if not info.known_skipped and self.ctx.world_size > 1:
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

    # ---- memory prediction (zerolab.memory asks it; Strategy.predict_memory says how) ----------
    @classmethod
    def predict_memory(cls, p, shape, *, world, precision, k, rank, **_) -> None:
        """Only the optimizer state is sharded, by whole tensors: DDP's terms with this rank's state."""
        super().predict_memory(p, shape, precision=precision, k=k)
        owned = torch_zero_partition(shape, world)[rank]
        s = state_bytes(precision)
        p.terms = [t for t in p.terms if t.category != "optim_state"]
        p.add("optim_state", owned * k * s, f"optimizer state of the whole tensors rank {rank} owns: "
                                            f"{fmt_n(owned)} × {k:g} × {s}")
        p.why = ("only the optimizer state is sharded" + (" (the fp32 master copy stays whole: 4Ψ, not 4Ψ/N)"
                                                       if precision in MIXED else "")
                 + ", by whole tensors, so shards are uneven")
        p.notes.append("whole tensors are assigned greedily, so shards are uneven: "
                       + ", ".join(f"rank {r} {fmt_n(x)}" for r, x in enumerate(torch_zero_partition(shape, world))))


def torch_zero_partition(shape, world: int) -> list[int]:
    """Elements each rank's optimizer owns under torch's ZeroRedundancyOptimizer: per param group,
    whole tensors largest first, each to the rank with the fewest elements so far (sizes carry
    over between groups; ties go to the lowest rank)."""
    if not shape.exact:
        return [ceil_div(shape.n_params, world)] * world
    sizes = [0] * world
    for g in range(len(shape.group_numels)):
        numels = sorted((math.prod(s) for gi, s in shape.tensors if gi == g), reverse=True)
        for x in numels:
            sizes[sizes.index(min(sizes))] += x
    return sizes
