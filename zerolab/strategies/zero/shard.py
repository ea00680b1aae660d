"""This rank's shard of a param group under zerolab's ZeRO (base.py, stage3.py): the flat pieces
the optimizer updates and where the group's tensors lie in them.

Below the paper's floor (precision.master, zerolab/precision_modes.py): under bf16 the master
shard need not be a copy. With master=remainder it is this rank's chunk of the bf16 weights plus
an int16 remainder (the master's low halves, zerolab/master.py): the pair is the fp32 master bit
for bit, rebuilt piece by piece inside the optimizer step and split again after it
(zerolab/optim/stored.py), so the optimizer updates exactly what an fp32 master would, and the
updated bf16 chunk is the all-gather's input in place. With master=bf16 the chunk alone is the
master (lossy). The optimizer's params are then stand-ins (fp32 shapes that hold no memory,
zerolab.master.stand_in) carrying the fp32 gradient shard and keying the state.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from zerolab.master import MasterStorage, stand_in
from zerolab.optim.segments import Segment


@dataclass
class FlatGroup:
    """This rank's shard of one param group: the flat pieces the optimizer updates (fp32 master
    weights, or the weights themselves where they are in that dtype: base.py), each
    piece's .grad its gradient, and where the group's tensors lie in them."""
    pieces: list = field(default_factory=list)  # nn.Parameter, one per bucket (zero1/2) or per group (zero3)
    segments: list[Segment] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    # where each piece's fp32 master lives (zerolab/master.py): the piece itself, or under
    # precision.master=remainder|bf16 (module docstring) the bf16 weights that hold it (the pieces
    # are then stand-ins) and, for remainder, the int16 low halves
    storage: Optional[MasterStorage] = None

    def __post_init__(self):
        if self.storage is None:
            self.storage = MasterStorage("fp32", self.pieces)

    @property
    def master(self) -> nn.Parameter:
        """The one piece of a shard kept whole per group (zero3)."""
        (piece,) = self.pieces
        return piece

    def hold_master(self, k: int, size: int, chunk: torch.Tensor, at: int, mode: str, own_buffer: bool) -> None:
        """Piece k (`size` elements) holds its master in the bf16 weights (precision.master=`mode`):
        `chunk`, this rank's chunk of one bucket's weights, goes at `at` in it. zero1/2 keep the
        whole weights, so the piece's weights are a view of the chunk (one bucket per piece);
        zero3 frees its buckets, so its pieces' weights are the persistent chunks, a buffer of
        their own (`own_buffer`). The remainder starts at 0: the master starts as the weight, as
        an fp32 master copied from the weights does."""
        if self.pieces[k] is None:
            self.pieces[k] = stand_in((size,), chunk.device)
            if self.storage.mode == "fp32":
                n = len(self.pieces)
                self.storage = MasterStorage(mode, self.pieces, [None] * n, [None] * n if mode == "remainder" else [])
            self.storage.weights[k] = torch.zeros(size, dtype=chunk.dtype, device=chunk.device) if own_buffer \
                else chunk
            if mode == "remainder":
                self.storage.remainders[k] = torch.zeros(size, dtype=torch.int16, device=chunk.device)
        if own_buffer:
            self.storage.weights[k][at:at + chunk.numel()].copy_(chunk)

    def optimizer_keys(self) -> dict:
        """The optimizer group key that says where the masters live, when not in the pieces
        (zerolab/optim/stored.py)."""
        return {"master": self.storage} if self.storage.mode != "fp32" else {}


class ShardGrads:
    """The gradient shard of zerolab's ZeRO, mixed into ZeroBase (base.py), whose layout it
    reads (`groups`, `buckets`, `shard_rank`, the precision): where the reduce-scatters deliver,
    and the fp32 view the optimizer reads."""

    def _make_grad_shards(self) -> list[list[torch.Tensor]]:
        """The gradient shard, per group and piece, where the reduce-scatters deliver: the pieces'
        own .grad, which the optimizer reads in place; with precision.grad_shard=bf16 the bf16
        chunks instead (zero1: its chunk of the whole bf16 gradients, no bytes of its own; zero2:
        a buffer), from which the step makes fp32 copies (_fp32_grads). Without accumulation the
        values are the fp32 shard's: it only ever holds one bf16 reduction."""
        if self.precision.grad_shard != "bf16":
            return [[piece.grad for piece in g.pieces] for g in self.groups]
        out = [[None] * len(g.pieces) for g in self.groups]
        for b in self.buckets:  # (one bucket per piece)
            out[b.group][b.piece] = self._bf16_grad_chunk(b)
        for g in self.groups:
            for piece in g.pieces:
                piece.grad = None
        return out

    def _bf16_grad_chunk(self, b) -> torch.Tensor:
        """Where bucket b's bf16 reduced chunk goes with precision.grad_shard=bf16: a buffer of its
        own (zero1's is its chunk of the whole gradients: stages.py)."""
        return torch.zeros(b.chunk, dtype=self.precision.compute_dtype, device=self.ctx.device)

    def _shard_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the optimizer reads (inside _fp32_grads where the shard is 16-bit)."""
        return [piece.grad for g in self.groups for piece in g.pieces]

    def _all_grad_shards(self) -> list[torch.Tensor]:
        return [shard for shards in self.grad_shards for shard in shards]

    @contextmanager
    def _fp32_grads(self):
        """The optimizer's view of a 16-bit gradient shard: fp32 copies as the pieces' .grad, for
        the step only (recorded as a step transient for peak accounting). Nothing to do where the
        shard already is the pieces' .grad."""
        copies = [(piece, shard) for g, shards in zip(self.groups, self.grad_shards)
                  for piece, shard in zip(g.pieces, shards) if shard is not piece.grad]
        # (offload: the copies are the host's, not the device's transients)
        nbytes = 0 if self.offload_optimizer else sum(shard.numel() * 4 for _, shard in copies)
        for piece, shard in copies:
            piece.grad = shard.float()
        self.transient.alloc(nbytes, "step")
        try:
            yield
        finally:
            for piece, _ in copies:
                piece.grad = None
            self.transient.free(nbytes)

