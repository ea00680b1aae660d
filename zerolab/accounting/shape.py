"""What the ledger predicts from: a model's trainable tensors by param group and shape. Built
from a live module or a config by zerolab.memory.shapes; strategies read it in predict_memory."""
from __future__ import annotations

import math
from dataclasses import dataclass


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
