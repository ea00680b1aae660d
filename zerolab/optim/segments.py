"""How a flat shard maps onto the tensors it came from.

The ZeRO sharder hands the optimizer one flat fp32 tensor per param group: this rank's slice of
the concatenated, padded group. Elementwise optimizers (SGD, Adam, AdamW) need nothing more.
Layer-wise ones (LAMB, LARS) need per-*tensor* norms: each rank sums squares over the segments
it owns and one all-reduce completes them. A flat group carries:
  "params":    [flat_shard]
  "segments":  list[Segment], the pieces of original tensors inside flat_shard
  "n_tensors": number of tensors in the group (length of the per-tensor norm vector)
  "names":     the tensors' names, indexed by Segment.tensor
  "allreduce": callable(t) summing t over the data-parallel ranks in place
The shard's .grad belongs to the sharder, which zeroes it after every step: an optimizer may
overwrite it during step() once it has read it (LAMB and LARS build their update there, so a
step allocates no shard-sized temporary; fresh allocations that large cost page faults per step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    tensor: int  # index of the original tensor within its param group
    start: int  # [start, end) within this rank's flat shard
    end: int
    offset: int  # where the segment starts inside the original (flattened) tensor


def is_flat_group(group: dict) -> bool:
    return "segments" in group


LOW_PRECISION = (torch.float16, torch.bfloat16)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """16-bit tensors in fp32 for sums and norms; fp32 and fp64 stay as they are (a float64
    norm computed in fp32 would lose the precision the user asked for)."""
    return t.float() if t.dtype in LOW_PRECISION else t


def per_tensor_sum_sq(flat: torch.Tensor, segments: list[Segment], n_tensors: int) -> torch.Tensor:
    """This rank's partial sums of squares per original tensor (length n_tensors; fp32, or
    fp64 for an fp64 shard)."""
    out = torch.zeros(n_tensors, dtype=upcast(flat[:0]).dtype, device=flat.device)
    for s in segments:
        out[s.tensor] += upcast(flat[s.start:s.end]).pow(2).sum()
    return out
