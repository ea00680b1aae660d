"""zerolab's ZeRO-1 and ZeRO-2: what the two stages do differently on ZeroBase's buckets (base.py).

  zero1  P_os: the gradients stay whole, views into per-bucket flat buffers (so a bucket is
         reduce-scattered in place), accumulated locally over micro-batches (no_sync) and
         reduce-scattered once, during the last micro-batch's backward; the reduced chunk is
         copied into the gradient shard.
  zero2  P_os+g: each finished gradient is copied, averaged, into its bucket's send buffer and
         freed; every micro-batch is reduce-scattered and summed into the gradient shard, so no
         full gradient is ever held (only the shard and the buckets in flight).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from zerolab.strategies.zero.base import ZeroBase
from zerolab.strategies.zero.layout import Bucket


class Zero1Strategy(ZeroBase):
    name = "zero1"
    traits = replace(ZeroBase.traits, stage=1, memory_reference=("deepspeed", 1))  # memory: beside DeepSpeed's
    keeps_whole_grads = True

    def _flatten_params(self, b: Bucket) -> None:
        """zero2's flat weights, and the whole gradients as views into one flat buffer per bucket."""
        super()._flatten_params(b)
        b.flat_grads = torch.zeros_like(b.flat_params)
        for p, _, off in b.params:
            p.grad = b.flat_grads[off:off + p.numel()].view_as(p)

    def _piece_grad(self, b: Bucket, piece: torch.Tensor) -> None:
        """Where the shard is the weights, the whole gradient's chunk is the gradient shard."""
        if self.shard_is_weights:
            piece.grad = b.flat_grads[self.shard_rank * b.chunk:(self.shard_rank + 1) * b.chunk]
        else:
            super()._piece_grad(b, piece)

    def _bf16_grad_chunk(self, b: Bucket) -> torch.Tensor:
        """precision.grad_shard=bf16: its chunk of the whole bf16 gradients, no bytes of its own."""
        return b.flat_grads[self.shard_rank * b.chunk:(self.shard_rank + 1) * b.chunk]

    @contextmanager
    def no_sync(self):
        """Micro-batches before the last accumulate into the whole gradients and send nothing."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _into_bucket(self, b: Bucket, p: torch.Tensor) -> None:
        pass  # the gradient already is a view into the bucket's flat_grads

    def _send_buffer(self, b: Bucket) -> torch.Tensor:
        buf = b.flat_grads if self.reduce_dtype == b.flat_grads.dtype else b.flat_grads.to(self.reduce_dtype)
        buf.div_(self.world)  # average before summing, as DDP does: same rounding in 16 bits
        if buf is not b.flat_grads:  # a reduce_dtype copy (peak accounting)
            self.transient.alloc(buf.untyped_storage().nbytes(), "backward")
        return buf

    def _collect(self, b: Bucket, out: torch.Tensor) -> None:
        self._grad_chunk(b).copy_(out)  # once per step, into a zeroed shard or over this rank's own gradient

    def _clear_whole_grads(self) -> None:
        for b in self.buckets:
            b.flat_grads.zero_()


class Zero2Strategy(ZeroBase):
    name = "zero2"
    traits = replace(ZeroBase.traits, stage=2, memory_reference=("deepspeed", 2))

    # no_sync is the base's (a null context): zero2 reduces every micro-batch, its gradients are never whole

    def _into_bucket(self, b: Bucket, p: torch.Tensor) -> None:
        if b.comm_buf is None:
            b.comm_buf = torch.zeros(b.size, dtype=self.reduce_dtype, device=p.device)
            self.transient.alloc(b.comm_buf.untyped_storage().nbytes(), "backward")
        off = self.offset_of[id(p)]
        # copy and average in one pass (DDP also divides before summing)
        torch.div(p.grad.view(-1), self.world, out=b.comm_buf[off:off + p.numel()])
        p.grad = None  # the full-size gradient is freed right away

    def _send_buffer(self, b: Bucket) -> torch.Tensor:
        if b.comm_buf is None:  # no parameter of this bucket got a gradient
            b.comm_buf = torch.zeros(b.size, dtype=self.reduce_dtype, device=self.ctx.device)
            self.transient.alloc(b.comm_buf.untyped_storage().nbytes(), "backward")
        return b.comm_buf  # already averaged by _into_bucket

    def _collect(self, b: Bucket, out: torch.Tensor) -> None:
        self._grad_chunk(b).add_(out)  # zero2 and zero3 sum every micro-batch's reduction

    def _clear_whole_grads(self) -> None:
        pass  # nothing whole is kept
