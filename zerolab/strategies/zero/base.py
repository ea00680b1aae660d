"""What zerolab's own ZeRO-1, ZeRO-2 and ZeRO-3 share (Rajbhandari et al. 2019, arXiv 1910.02054):
ZeroBase, the sharder, composed of parts; a class per stage says which (stages.py: zero1, zero2;
stage3.py: zero3).

Layout (layout.py). Parameters are packed, in the order their gradients become ready in backward
(reverse registration order), into buckets of about `strategy.bucket_mb`; a bucket never mixes
param groups and is padded to a multiple of N. Every bucket is split into N equal chunks and rank
r owns chunk r of every bucket: the weights the optimizer updates, the gradient shard and the
optimizer state exist only for owned chunks (this rank's "shard" of a group is its chunks of that
group's buckets). A parameter may straddle chunk boundaries. Across nodes
(strategy.shard_within=node) "N chunks" are a node's ranks, each node holds a replica of the
shards, and the gradient shard is averaged across the replicas by one all-reduce per step.

Why per-bucket chunks instead of one contiguous slice of the whole group (the simplest layout): a
reduce-scatter hands chunk r of its input to rank r, so with per-bucket ownership a bucket can be
reduce-scattered the moment its gradients are complete, while backward is still running. With one
slice per rank, the first reduce-scatter would need gradients from all over the model and nothing
could overlap.

The parts, each in its file:
  shard       storage.py: what holds the shard (the weights, a copy, or the bf16 weights with
              remainders) and where (the device, or the host: host.py); the stage code asks it
              where reduced chunks land, for the optimizer's fp32 gradients and for the chunks to
              all-gather, never which kind or place it is
  reduction   reduce.py: gradients into buckets, reduce-scattered in one order, landed in the shard
  weights     how the model's weights follow the shard: zero1/2 keep them whole and all-gather the
              updated chunks (WholeWeights, below); zero3 gathers them unit by unit (units.py)
  pieces      checkpoint.py: the shard as name-keyed checkpoint pieces

One step (ZeroBase.step): the reductions still in flight land in the shard; the global norm from
partial sums (one all-reduce), unscale and clip, the optimizer's update on the shard
(strategies/base.py's _update); then the weights follow the updated shard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab.accounting import StorageCounter
from zerolab.buckets import bucket_cap
from zerolab.comm import InFlight
from zerolab.models import place
from zerolab.numerics import Measure, StepInfo
from zerolab.optim.segments import ShardMap
from zerolab.strategies.base import OptimizerFactory, set_lr
from zerolab.strategies.zero.checkpoint import ShardCheckpoint
from zerolab.strategies.zero.declared import ZeroDeclared
from zerolab.strategies.zero.layout import Bucket, layout_for, pack
from zerolab.strategies.zero.reduce import Reduction
from zerolab.strategies.zero.storage import shard_for


class ZeroBase(ZeroDeclared):
    """The sharder the three stages share; registered only through a stage class."""
    reduction_class: type[Reduction]  # what the stage does with the gradients (reduce.py)

    # ---- setup: the parts, in the order each needs the last --------------------------------
    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        self._place_model(model)
        self.buckets = self._make_buckets(model, param_groups)
        self.shard = shard_for(self.buckets, param_groups, ctx=self.ctx, settings=self.settings,
                               precision=self.precision, rank=self.layout.shard_rank, transient=self.transient,
                               **self._shard_options())
        self.reduction = self._make_reduction()
        self.optimizer = make_optimizer([
            {**{k: v for k, v in g.items() if k not in ("params", "names")}, "params": sg.slabs,
             "shard": ShardMap(sg.segments, len(g["params"]), self._all_reduce), "names": g["names"],
             **self.precision.state_keys(), **sg.optimizer_keys()}
            for g, sg in zip(param_groups, self.shard.groups)])
        self.pieces = ShardCheckpoint(self.shard, self.optimizer, model, self.buckets, layout=self.layout,
                                      ctx=self.ctx, dtype=self.precision.update_dtype)
        for b in self.buckets:
            for p, _, _ in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.weights = self._make_weights(model)
        return model

    def _place_model(self, model: nn.Module) -> None:
        """Model on the device in compute dtype, rank 0's weights everywhere, the layout (who shares
        a shard: by default every rank, group None) and the reduction's dtype."""
        place(model, self.ctx.device, self.precision.compute_dtype)
        self.model, self.world, self.rank = model, self.ctx.world_size, self.ctx.rank
        for p in model.parameters():  # every rank starts from rank 0's weights
            dist.broadcast(p.data, src=0)
        self.layout = layout_for(self.ctx, self.settings)
        self.reduce_dtype = torch.float32 if self.settings.reduce_dtype == "fp32" else self.precision.compute_dtype

    # ---- the steps of setup a stage changes -------------------------------------------------
    def _make_buckets(self, model: nn.Module, param_groups: list[dict]) -> list[Bucket]:
        cap = bucket_cap(self.settings.bucket_mb, self.precision.compute_dtype.itemsize)
        return pack(model, param_groups, self.layout.shards, cap, whole_grads=self.keeps_whole_grads)

    def _shard_options(self) -> dict:
        """What the stage fixes about its shard (storage.shard_for): zero3 keeps persistent chunks."""
        return {}

    def _make_reduction(self, scatter=None) -> Reduction:
        return self.reduction_class(self.buckets, self.shard, group=self.layout.shard_group, comm=self.comm,
                                    transient=self.transient, world=self.world, reduce_dtype=self.reduce_dtype,
                                    device=self.ctx.device, scatter=scatter)

    def _make_weights(self, model: nn.Module):
        return WholeWeights(model, self.buckets, self.shard, group=self.layout.shard_group, comm=self.comm,
                            transient=self.transient)

    # ---- the step ---------------------------------------------------------------------------
    def no_sync(self):
        return self.reduction.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)  # autograd: _grad_ready as each gradient completes
        self.reduction.finish_backward()
        self.weights.end_backward()

    def _grad_ready(self, p: torch.Tensor) -> None:
        """Autograd's hook on every trainable parameter: its gradient is complete; the reduction takes it."""
        self.reduction.grad_ready(p)

    def step(self, lr: float, measure: Measure = Measure.NOTHING) -> StepInfo:
        set_lr(self.optimizer, lr)
        self.reduction.drain()
        self._average_replicas(self.shard.settled_grads())
        with self.shard.fp32_grads() as grads:
            info = self._update(grads, measure)
        if not info.known_skipped:
            self.weights.follow(wait=False)  # zero1/2: completes behind the next forward
        self.shard.zero_grads()
        self.reduction.clear()
        self.weights.report(info, measure)
        return info

    def _average_replicas(self, grads: list[torch.Tensor]) -> None:
        """strategy.shard_within=node: each node reduced its own ranks' gradients into its shards;
        one all-reduce per gradient shard over the ranks holding it (one per node) completes the
        sum over every rank (the buckets were already divided by N). In place, all in flight at once."""
        group = self.layout.replica_group
        if group is None:
            return
        works = []
        for g in grads:
            self.comm.record("all_reduce", g, group=group)
            works.append(self.shard.place.all_reduce(g, lambda t: dist.all_reduce(t, group=group, async_op=True)))
        for work in works:
            if work is not None:
                work.wait()

    def _all_reduce(self, t: torch.Tensor) -> None:
        """Partial sums over this rank's shard (the clip norm, LAMB's per-tensor norms, update ratios)
        complete over the ranks that share the shards: every rank, or the node's under HSDP (the
        other nodes hold the same shards: summing them too would count every element once per node)."""
        group = self.layout.shard_group
        if group is None:
            return self.shard.place.all_reduce(t, super()._all_reduce)
        self.comm.record("all_reduce", t, group=group)
        self.shard.place.all_reduce(t, lambda d: dist.all_reduce(d, group=group))

    def _decides_on_device(self, grads) -> bool:
        """Where the step runs off the device (storage.py's place), the host decides it."""
        return self.shard.place.device_step and super()._decides_on_device(grads)

    def _note_working_copies(self) -> None:
        if self.shard.place.device_step:  # off the device they are not the device's transients
            super()._note_working_copies()

    def _describe_nonfinite(self) -> str:
        name = self.shard.first_nonfinite()
        return f"first non-finite gradient: {name} (on rank {self.rank})" if name else \
            "the non-finite values are on another rank, or only their norm overflowed"

    # ---- memory, checkpoints --------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes by category and place: zero3's persistent chunks, the weights the model computes with,
        zero1's whole gradients, the shard (storage.py) and the buffers."""
        self.weights.wait()
        c = StorageCounter().add("params", self.shard.persistent(), self.shard.weights_place.name)
        self.weights.count(c)
        c.add("grads", (b.flat_grads for b in self.buckets))
        self.shard.count(c, self.optimizer)
        c.add("buffers", (b.comm_buf for b in self.buckets)).add("buffers", self.model.buffers())
        return c.result()

    def checkpoint_state(self):
        self.weights.wait()
        return self.pieces.state()

    def load_checkpoint_state(self, read) -> None:
        self.pieces.load(read)
        self.weights.follow()  # the model's weights follow the loaded shard

    def consolidated_state_dict(self):
        self.weights.wait()
        return self.pieces.consolidated()


class WholeWeights:
    """zero1/2's weights: whole on every rank, views into each bucket's flat buffer. After an
    update every bucket's chunks are all-gathered into them in place, in the background, in forward
    order (the reverse of the bucket list); each module waits for its own buckets just before its
    forward, so the next forward overlaps the all-gathers. (This assumes a parameter is used by the
    module that owns it, as in torch.nn layers.)"""

    def __init__(self, model: nn.Module, buckets, shard, *, group, comm, transient):
        self.buckets, self.shard, self.group, self.comm, self.transient = buckets, shard, group, comm, transient
        self.in_flight = InFlight()  # all-gathers by bucket index
        bucket_of = {id(p): b.index for b in buckets for p, _, _ in b.params}
        for module in model.modules():
            # Frozen parameters (requires_grad=False) are in no param group, hence in no bucket:
            # they stay ordinary tensors, identical on every rank after the broadcast.
            own = {bucket_of[id(p)] for p in module.parameters(recurse=False) if id(p) in bucket_of}
            if own:
                module.register_forward_pre_hook(lambda _m, _inp, own=sorted(own): self.wait(own))

    @torch.no_grad()
    def follow(self, wait: bool = True) -> None:
        """Write every bucket's updated chunks, in compute dtype, into the model's parameters: the
        input is this rank's chunk, from the shard (storage.py: the weights' own chunk, gathered in
        place, or a copy rounded from the master)."""
        self.wait()
        for b in reversed(self.buckets):
            chunk, nbytes = self.shard.gather_input(b)
            if nbytes:
                self.transient.alloc(nbytes, "step")
            self.comm.record("all_gather", b.flat_params, group=self.group)
            work = dist.all_gather_single(b.flat_params, chunk, group=self.group, async_op=True)
            self.in_flight.add(b.index, work, chunk, nbytes)
        if wait:
            self.wait()

    def wait(self, indices=None) -> None:
        """Wait for the all-gathers in flight (of `indices`, or every one)."""
        freed = self.in_flight.wait(indices)
        if freed:
            self.transient.free(freed)

    def end_backward(self) -> None:
        """Nothing was gathered for backward: the weights are whole."""

    def report(self, info, measure) -> None:
        """Nothing to add to a step's record."""

    def count(self, c) -> None:
        c.add("params", (b.flat_params for b in self.buckets))
