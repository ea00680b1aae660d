"""The gradient reduction of zerolab's ZeRO, into the shard: each gradient, once complete, goes into
its bucket; a complete bucket is reduce-scattered while backward goes on, and each rank's reduced
chunk lands in its gradient shard (where the storage says: storage.py's landings and place).

Collectives are launched in one fixed bucket order on every rank (a bucket waits for the ones
before it), and buckets whose parameters got no gradient are flushed with zeros at the end of
backward, so unused parameters can neither hang nor misalign the reductions. Past MAX_IN_FLIGHT
reductions in flight backward waits for the oldest (zerolab/buckets.py says why).

Per stage (the class the stage composes):
  zero1  WholeGrads: the gradients accumulate in the model, views into each bucket's flat buffer
         (layout.py), locally over micro-batches (no_sync); during the last micro-batch's backward
         each complete bucket is reduce-scattered in place, and its chunk copied into the shard.
  zero2, zero3  BucketCopies: a hook copies each finished gradient, averaged, into its bucket's
         send buffer and frees it; every micro-batch is reduce-scattered and summed into the shard,
         so no whole gradient is ever held (only the shard and the buckets in flight). zero3 may
         reduce-scatter through ZeRO++'s quantized hops instead (quantized.py: `scatter`).
"""
from __future__ import annotations

import abc
from collections import deque
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from zerolab.buckets import MAX_IN_FLIGHT


class Reduction(abc.ABC):
    """Gradients into the shard, bucket by bucket, in one launch order (module docstring)."""

    def __init__(self, buckets, shard, *, group, comm, transient, world: int, reduce_dtype, device, scatter=None):
        """`shard`: the storage.ShardStorage the reduced chunks land in; `group`: the reduce-scatters'
        process group (layout.py); `scatter(out, buf)`, if given, runs a reduce-scatter of its own and
        returns its work (qgZ's)."""
        self.buckets, self.group, self.comm, self.transient = buckets, group, comm, transient
        self.world, self.reduce_dtype, self.device = world, reduce_dtype, device
        self.bucket_of = {id(p): b for b in buckets for p, _, _ in b.params}
        self.offset_of = {id(p): off for b in buckets for p, _, off in b.params}
        self.dest = shard.landings  # bucket i's place in the gradient shard
        self.deliver = shard.place.delivery(self._land)  # off the device: through a copy there first
        self.scatter = scatter or self._reduce_scatter
        # Reductions in flight, in launch order: (work, output chunk, bucket, send buffer). The send
        # buffer stays referenced until the work completes: an asynchronous collective reads it in
        # the background, and zero2's comm_buf is otherwise dropped.
        self.pending: deque = deque()
        self.next_launch = 0
        self.sync = True

    # ---- what a stage supplies ---------------------------------------------------------------
    @abc.abstractmethod
    def _into_bucket(self, b, p: torch.Tensor) -> None:
        """p's gradient is complete: put it where bucket b's reduce-scatter reads it."""

    @abc.abstractmethod
    def _send_buffer(self, b) -> torch.Tensor:
        """Bucket b's averaged gradients in the reduce dtype: the reduce-scatter's input."""

    @abc.abstractmethod
    def _collect(self, dest: torch.Tensor, out: torch.Tensor) -> None:
        """A reduced chunk `out` into its place `dest` in the gradient shard (a copy, or a sum over micro-batches)."""

    def no_sync(self):
        """Micro-batches before the last: zero2 and zero3 reduce every one (a null context)."""
        return nullcontext()

    def clear(self) -> None:
        """After a step: zero the whole gradients where the stage keeps them."""

    # ---- backward: hooks, in-order launches ---------------------------------------------------
    def grad_ready(self, p: torch.Tensor) -> None:
        """Autograd's hook: p's gradient is complete."""
        if not self.sync:
            return
        b = self.bucket_of[id(p)]
        self._into_bucket(b, p)
        b.arrived += 1
        self._launch_ready()

    def finish_backward(self) -> None:
        """The end of backward: launch what is left (missing gradients are zeros), wait for every
        reduction and land it."""
        if not self.sync:
            return
        self._launch_ready(flush=True)
        self.drain()
        for b in self.buckets:
            b.arrived = 0
        self.next_launch = 0

    def _launch_ready(self, flush: bool = False) -> None:
        """Launch buckets strictly in list order; `flush` launches the rest (missing grads = 0)."""
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if not flush and b.arrived < len(b.params):
                break  # (not return: the drain below must run, or nothing is freed before backward ends)
            buf = self._send_buffer(b)
            out = torch.empty(b.chunk, dtype=buf.dtype, device=buf.device)
            self.transient.alloc(out.untyped_storage().nbytes(), "backward")
            self.pending.append((self.scatter(out, buf), out, b, buf))
            self.next_launch += 1
        # Free finished buckets while backward goes on, so zero2 never holds a whole gradient;
        # past MAX_IN_FLIGHT buckets, wait for the oldest (bounds memory if comm falls behind).
        self.drain(block=len(self.pending) > MAX_IN_FLIGHT)

    def _reduce_scatter(self, out: torch.Tensor, buf: torch.Tensor):
        self.comm.record("reduce_scatter", buf, group=self.group)
        return dist.reduce_scatter_single(out, buf, group=self.group, async_op=True)

    def drain(self, block: bool = True) -> None:
        """Land the launched reductions, oldest first. Without `block`, stop at the first one still
        in flight. (Each bucket owns its own region of the shard, and a bucket's micro-batches are
        always landed in launch order, so the sums do not depend on when this runs.)"""
        while self.pending and (block or self.pending[0][0].is_completed()):
            work, out, b, buf = self.pending.popleft()
            work.wait()
            self.deliver(b.index, out)
            self.transient.free(out.untyped_storage().nbytes()
                                + (buf.untyped_storage().nbytes() if buf is not b.flat_grads else 0))
            b.comm_buf = None  # zero2: the bucket's memory goes back to the allocator

    def _land(self, i: int, out: torch.Tensor) -> None:
        self._collect(self.dest[i], out)


class WholeGrads(Reduction):
    """zero1 (P_os): the whole gradients stay in the model, reduced once per step."""

    @contextmanager
    def no_sync(self):
        """Micro-batches before the last accumulate into the whole gradients and send nothing."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _into_bucket(self, b, p):
        pass  # the gradient already is a view into the bucket's flat_grads

    def _send_buffer(self, b):
        buf = b.flat_grads if self.reduce_dtype == b.flat_grads.dtype else b.flat_grads.to(self.reduce_dtype)
        buf.div_(self.world)  # average before summing, as DDP does: same rounding in 16 bits
        if buf is not b.flat_grads:  # a reduce_dtype copy (peak accounting)
            self.transient.alloc(buf.untyped_storage().nbytes(), "backward")
        return buf

    def _collect(self, dest, out):
        dest.copy_(out)  # once per step, into a zeroed shard or over this rank's own gradient

    def clear(self):
        for b in self.buckets:
            b.flat_grads.zero_()


class BucketCopies(Reduction):
    """zero2 and zero3 (P_os+g): every micro-batch's gradients are copied into a bucket, reduced and
    summed into the shard; only the shard and the buckets in flight exist."""

    def _into_bucket(self, b, p):
        if b.comm_buf is None:
            b.comm_buf = torch.zeros(b.size, dtype=self.reduce_dtype, device=p.device)
            self.transient.alloc(b.comm_buf.untyped_storage().nbytes(), "backward")
        off = self.offset_of[id(p)]
        # copy and average in one pass (DDP also divides before summing)
        torch.div(p.grad.view(-1), self.world, out=b.comm_buf[off:off + p.numel()])
        p.grad = None  # the full-size gradient is freed right away

    def _send_buffer(self, b):
        if b.comm_buf is None:  # no parameter of this bucket got a gradient
            b.comm_buf = torch.zeros(b.size, dtype=self.reduce_dtype, device=self.device)
            self.transient.alloc(b.comm_buf.untyped_storage().nbytes(), "backward")
        return b.comm_buf  # already averaged by _into_bucket

    def _collect(self, dest, out):
        dest.add_(out)  # sum every micro-batch's reduction
