"""How a flat shard maps onto the tensors it came from.

The ZeRO sharder hands the optimizer this rank's shard of each param group as flat tensors, its
slabs: one per bucket the group's tensors were packed into (zero1, zero2: this rank's chunk of
each bucket, in fp32 training a view of the weights themselves), or one for the whole group (zero3).
Elementwise optimizers (SGD, Adam, AdamW) need nothing more. Layer-wise ones (LAMB, LARS) need
per-*tensor* norms: each rank sums squares over the segments it owns and one all-reduce completes
them. A flat group carries:
  "params":    [the shard's slabs]
  "names":     the tensors' names, indexed by Segment.tensor
  "shard":     a ShardMap (below): where the tensors lie in the slabs, and how to complete a sum
The shard's .grad belongs to the sharder, which zeroes it after every step: an optimizer may
overwrite it during step() once it has read it (LAMB and LARS build their update there, so a
step allocates no shard-sized temporary; fresh allocations that large cost page faults per step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch


@dataclass(frozen=True)
class Segment:
    tensor: int  # index of the original tensor within its param group
    start: int  # [start, end) within the slab `slab` of this rank's shard
    end: int
    offset: int  # where the segment starts inside the original (flattened) tensor
    slab: int = 0  # which of the group's slabs ("params") holds it


@dataclass(frozen=True)
class ShardMap:
    """What a flat (ZeRO) param group carries beside its params, under the group's "shard" key: the
    map of this rank's shard of the group."""
    segments: list[Segment]  # the parts of original tensors inside the group's slabs
    n_tensors: int  # tensors in the group: the length of a per-tensor norm vector
    allreduce: Callable[[torch.Tensor], None]  # sums a tensor over the ranks that share the shard, in place


def is_flat_group(group: dict) -> bool:
    return "shard" in group


LOW_PRECISION = (torch.float16, torch.bfloat16)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """16-bit tensors in fp32 for sums and norms; fp32 and fp64 stay as they are (a float64
    norm computed in fp32 would lose the precision the user asked for)."""
    return t.float() if t.dtype in LOW_PRECISION else t


def per_tensor_sum_sq(slabs: list[torch.Tensor], segments: list[Segment], n_tensors: int) -> torch.Tensor:
    """This rank's partial sums of squares per original tensor over the shard's `slabs`
    (length n_tensors; fp32, or fp64 for an fp64 shard)."""
    out = torch.zeros(n_tensors, dtype=upcast(slabs[0][:0]).dtype, device=slabs[0].device)
    for s in segments:
        out[s.tensor] += upcast(slabs[s.slab][s.start:s.end]).pow(2).sum()
    return out


def whole_tensor_sum_sq(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """‖t‖² of each whole tensor (fp32 for 16-bit tensors, fp64 if any is fp64), as one vector."""
    tensors = list(tensors)
    norms = torch._foreach_norm([upcast(t) for t in tensors])
    dtype = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    return torch.stack([n.to(dtype) for n in norms]).pow(2)
