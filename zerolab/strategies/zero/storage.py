"""This rank's shard under zerolab's ZeRO and where it lives, decided in one place (`shard_for`).

What holds the shard the optimizer updates, one kind per run:
  weights  the weights themselves, where they already are in the dtype the optimizer updates (fp32
           training, bf16_pure) and live where it runs: nothing is stored twice (the ZeRO paper's
           floor, Rajbhandari et al. 2019, section 5). zero1/2 update their chunk of each bucket's
           flat weights in place and all-gather it in place; zero3's persistent chunks are the shard.
  copy     a buffer of its own in that dtype: mixed precision's fp32 master, or any shard on the
           host. The compute-dtype weights are derived from it after each update (rounded as
           precision.weight_rounding says: zerolab/master.py).
  stored   precision.master=remainder|bf16 (zerolab/precision_modes.py): the bf16 weights hold the
           master, with int16 remainders (exact) or alone (lossy). The optimizer updates fp32
           stand-ins that hold no memory and writes the weights itself (zerolab/optim/stored.py).

Where: a Place. The Device here; the host (strategy.offload_optimizer: ZeRO-Offload's shard,
gradient and optimizer state; offload_params: ZeRO-Infinity's parameter chunks) in host.py. The
stage code asks the storage for what it needs (where reduced gradient chunks land, the fp32
gradients for the optimizer, the compute-dtype chunks to all-gather) and never which kind or
place it is.

The weights a shard feeds: zero1/2 keep the whole weights, so this rank's chunk of a bucket is a
view of the bucket's flat buffer; zero3 keeps only its chunks, in buffers of their own (one per
param group, laid out like the shard: `persistent`), on the device or, with offload_params, the host.

The gradient shard is in the dtype the stage reduces into: the dtype the optimizer updates, or 16
bits (zero1/2 with precision.grad_shard=bf16; zero3's reduce dtype). In the first case it is the
slabs' own .grad, which the optimizer reads in place; in the second a buffer of its own, which the
step copies to fp32 (fp32_grads). zero1 keeps the whole gradients (Bucket.flat_grads): where its
shard has their dtype and lives on the device, it is a view of them.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from zerolab.master import MasterStorage, derive_weight_, derived_weight
from zerolab.optim.segments import Segment
from zerolab.strategies.zero.host import Host


class Device:
    """The accelerator's memory (the CPU's on a machine without one): where a shard lives without
    offload, and zero3's persistent chunks without strategy.offload_params."""
    name = "device"  # its place in the ledger (zerolab.accounting.PLACES)
    # the optimizer's step runs here: the device may decide it (numerics.decide_on_device) and its
    # copies are the device's transients
    device_step = True

    def __init__(self, device: torch.device):
        self.device = device

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def gradient(self, shape, dtype: torch.dtype, whole) -> torch.Tensor:
        """A gradient shard: a view of the whole gradients' chunk `whole` (zero1's) where it has the
        dtype, else a buffer of its own."""
        return whole if whole is not None and whole.dtype == dtype else self.zeros(shape, dtype)

    def delivery(self, land):
        """How a reduced chunk reaches the gradient shard: here, where it was reduced."""
        return land

    def settle(self) -> None:
        """Every reduced chunk is in the gradient shard (on the device it is as soon as it lands)."""

    def gather_input(self, master: torch.Tensor, weights: torch.Tensor, rounding: str) -> tuple:
        """zero1/2: the compute-dtype chunk to all-gather into the weights (`weights`, this rank's
        chunk of a bucket) from its updated `master`, and the bytes of a copy made for it: here a
        copy of its own, alive until the all-gather is waited for."""
        chunk = derived_weight(master, weights.dtype, rounding)
        return chunk, chunk.untyped_storage().nbytes()

    def round_into(self, master: torch.Tensor, weights: torch.Tensor, rounding: str, _weights_place) -> None:
        """zero3: its persistent chunks `weights` follow the updated `master`, in place."""
        derive_weight_(master, weights, rounding)

    def take(self, t: torch.Tensor, source) -> torch.Tensor:
        """zero3's persistent chunks `t`, made where the shard lives (`source`), kept here."""
        return t if source is self else t.to(self.device, copy=True)

    def for_gather(self, chunk: torch.Tensor) -> tuple:
        """zero3: a persistent chunk ready for its all-gather, and the transient bytes of a copy made
        for it (none here: the device gathers from the chunk itself)."""
        return chunk, 0

    def all_reduce(self, t: torch.Tensor, collective):
        """Run an in-place collective on `t`; a tensor off the device goes through a device copy (NCCL
        reduces device memory only; gloo would take a host tensor as it is). Returns the work of an
        asynchronous collective on the device itself, None otherwise."""
        if t.device == self.device:
            return collective(t)
        d = t.to(self.device)
        work = collective(d)
        if work is not None:
            work.wait()
        t.copy_(d)
        return None


@dataclass
class GroupShard:
    """One param group's part of this rank's shard: the slabs the optimizer updates (one per bucket
    in zero1/2, one per group in zero3), where the group's tensors lie in them, how their fp32
    masters are stored, their gradient shard and the compute-dtype weights they feed."""
    slabs: list  # nn.Parameter each: the shard in the dtype the optimizer updates, or a stand-in
    segments: list[Segment]
    names: list[str]
    master: MasterStorage
    grads: list  # the gradient shard per slab: the slab's .grad, or a 16-bit buffer of its own
    weights: list  # per slab: a view of this rank's chunk of a bucket (zero1/2), or persistent chunks (zero3)

    def optimizer_keys(self) -> dict:
        """The optimizer group key that says where the masters live, when not in the slabs
        (zerolab/optim/stored.py)."""
        return {"master": self.master} if self.master.mode != "fp32" else {}


class ShardStorage:
    """This rank's shard of every param group (GroupShard), the kind of what holds it and its place.
    A kind (below) supplies the slabs and how the weights follow them."""

    def __init__(self, buckets, param_groups: list[dict], *, rank: int, place, weights_place, update_dtype,
                 compute_dtype, rounding: str, grad_dtype, persistent: bool, transient):
        self.place, self.weights_place, self.rounding, self.transient = place, weights_place, rounding, transient
        self.update_dtype, self.compute_dtype, self.persistent_chunks = update_dtype, compute_dtype, persistent
        sizes = [[0] * (1 + max((b.slab for b in buckets if b.group == gi), default=-1))
                 for gi in range(len(param_groups))]
        for b in buckets:
            sizes[b.group][b.slab] = max(sizes[b.group][b.slab], b.shard_pos + b.chunk)
        chunks = [b.flat_params[rank * b.chunk:(rank + 1) * b.chunk] for b in buckets]
        views = [[None] * len(s) for s in sizes]  # zero1/2 (one bucket per slab): the weights' own chunks
        for b, chunk in zip(buckets, chunks):
            views[b.group][b.slab] = chunk
        self.groups = [self._group(sizes[gi], None if persistent else views[gi], list(g["names"]))
                       for gi, g in enumerate(param_groups)]
        for b, chunk in zip(buckets, chunks):
            self._fill(self.groups[b.group], b, chunk)
            self.groups[b.group].segments += _segments(b, rank)
        self._finish()
        self._gradients(buckets, grad_dtype, rank)

    # ---- what a kind supplies ------------------------------------------------------------------
    def _group(self, sizes: list[int], views, names: list[str]) -> GroupShard:
        """A group's slabs (`sizes` elements each): zero1/2 over `views`, this rank's chunk of each
        slab's bucket in the weights; zero3 (`views` None) in buffers of their own."""
        raise NotImplementedError

    def _fill(self, group: GroupShard, b, chunk: torch.Tensor) -> None:
        """Bucket b's chunk of the weights (`chunk`) into the group's buffers that are not views of it."""

    def _finish(self) -> None:
        """After every slab is filled."""

    def gather_input(self, b) -> tuple:
        """zero1/2: this rank's updated chunk of bucket b in compute dtype, the all-gather's input,
        and the transient bytes of a copy made for it (0: the weights' own chunk, gathered in place)."""
        return self.groups[b.group].weights[b.slab], 0

    def refresh(self) -> None:
        """zero3: the persistent chunks follow the updated shard (nothing to do where they hold it)."""

    # ---- the gradient shard --------------------------------------------------------------------
    def _gradients(self, buckets, grad_dtype, rank: int) -> None:
        for g in self.groups:
            g.grads = [None] * len(g.slabs)
        for b in buckets:
            g = self.groups[b.group]
            whole = None if b.flat_grads is None else b.flat_grads[rank * b.chunk:(rank + 1) * b.chunk]
            slab = g.slabs[b.slab]
            if g.grads[b.slab] is None:
                dtype = slab.dtype if grad_dtype is None else grad_dtype
                g.grads[b.slab] = self.place.gradient(slab.shape, dtype, whole)
                slab.grad = g.grads[b.slab] if dtype == slab.dtype else None
        self.grads = [t for g in self.groups for t in g.grads]  # the gradient shard, slab by slab
        # where bucket i's reduced chunk lands
        self.landings = [self.groups[b.group].grads[b.slab][b.shard_pos:b.shard_pos + b.chunk] for b in buckets]
        # 16-bit gradient shards the step copies to fp32 (fp32_grads)
        self.copies = [(s, grad) for g in self.groups for s, grad in zip(g.slabs, g.grads) if s.grad is not grad]

    def settled_grads(self) -> list[torch.Tensor]:
        """The gradient shard with every reduced chunk in it (off the device: the copies waited for)."""
        self.place.settle()
        return self.grads

    @contextmanager
    def fp32_grads(self):
        """The optimizer's view of the gradient shard, yielded as a list: the slabs' .grad, which are
        the shard itself, or fp32 copies of a 16-bit one for the step only (a transient of the step
        where they are on the device)."""
        if not self.copies:
            yield [s.grad for g in self.groups for s in g.slabs]
            return
        nbytes = sum(4 * grad.numel() for _, grad in self.copies) if self.place.device_step else 0
        for s, grad in self.copies:
            s.grad = grad.float()
        self.transient.alloc(nbytes, "step")
        try:
            yield [s.grad for g in self.groups for s in g.slabs]
        finally:
            for s, _ in self.copies:
                s.grad = None
            self.transient.free(nbytes)

    def zero_grads(self) -> None:
        for grad in self.grads:
            grad.zero_()

    def first_nonfinite(self) -> str:
        """The name of the first tensor with a non-finite gradient in this rank's shard, or ''."""
        for g in self.groups:
            for s in g.segments:
                if not torch.isfinite(g.slabs[s.slab].grad[s.start:s.end]).all():
                    return g.names[s.tensor]
        return ""

    # ---- memory ------------------------------------------------------------------------------
    def persistent_chunk(self, b) -> torch.Tensor:
        """zero3: this rank's persistent chunk of bucket b, the all-gather's input (where the weights live)."""
        return self.groups[b.group].weights[b.slab][b.shard_pos:b.shard_pos + b.chunk]

    def persistent(self) -> list[torch.Tensor]:
        """zero3's persistent chunks, one buffer per group (zero1/2: none, the buckets hold the weights)."""
        return [w for g in self.groups for w in g.weights] if self.persistent_chunks else []

    def count(self, c, optimizer) -> None:
        """The gradient shard, the masters (the slabs: stand-ins hold nothing, views of the weights
        were counted with them; and the remainders) and the optimizer state, in their place."""
        where = self.place.name
        c.add("grads", self.grads, where).add("master", (s for g in self.groups for s in g.slabs), where)
        c.add("master", (r for g in self.groups for r in g.master.remainders)).add_optimizer(optimizer, where)


class WeightsShard(ShardStorage):
    """The shard is the weights: each slab a parameter over them, updated in place."""

    def _group(self, sizes, views, names):
        # zero3 (no views): the persistent chunks are the shard, in its place
        slabs = [nn.Parameter(self.place.zeros(n, self.update_dtype) if views is None else v)
                 for n, v in zip(sizes, views or sizes)]
        return GroupShard(slabs, [], names, MasterStorage("fp32", slabs), [], [s.data for s in slabs])

    def _fill(self, group, b, chunk):
        if self.persistent_chunks:
            group.slabs[b.slab].data[b.shard_pos:b.shard_pos + b.chunk].copy_(chunk)


class CopyShard(ShardStorage):
    """The shard is a buffer of its own, in the dtype the optimizer updates, in its place; the
    compute-dtype weights are derived from it after each update."""

    def _group(self, sizes, views, names):
        slabs = [nn.Parameter(self.place.zeros(n, self.update_dtype)) for n in sizes]
        return GroupShard(slabs, [], names, MasterStorage("fp32", slabs), [], views)

    def _fill(self, group, b, chunk):
        group.slabs[b.slab].data[b.shard_pos:b.shard_pos + b.chunk].copy_(chunk)

    def _finish(self):
        if self.persistent_chunks:  # zero3: the chunks derived from the shard, kept where the weights live
            for g in self.groups:
                g.weights = [self.weights_place.take(derived_weight(s.data, self.compute_dtype, self.rounding),
                                                     self.place) for s in g.slabs]

    def gather_input(self, b):
        g = self.groups[b.group]
        master = g.slabs[b.slab].data[b.shard_pos:b.shard_pos + b.chunk]
        return self.place.gather_input(master, g.weights[b.slab], self.rounding)

    @torch.no_grad()
    def refresh(self):
        for g in self.groups:
            for s, w in zip(g.slabs, g.weights):
                self.place.round_into(s.data, w, self.rounding, self.weights_place)


class StoredShard(ShardStorage):
    """The bf16 weights hold the master (precision.master=remainder|bf16): the optimizer updates
    stand-ins and writes the weights, which are then the all-gather's input in place."""

    def __init__(self, *args, mode: str, **kwargs):
        self.mode = mode
        super().__init__(*args, **kwargs)

    def _group(self, sizes, views, names):
        weights = [self.weights_place.zeros(n, self.compute_dtype) for n in sizes] if views is None else views
        master = MasterStorage.held_in(self.mode, weights)
        return GroupShard(master.masters, [], names, master, [], weights)

    def _fill(self, group, b, chunk):
        if self.persistent_chunks:  # zero3: its chunks, in buffers of their own
            group.weights[b.slab][b.shard_pos:b.shard_pos + b.chunk].copy_(chunk)


def _segments(b, rank: int) -> list[Segment]:
    """Where bucket b's tensors lie in this rank's chunk of it, as parts of its slab."""
    lo, hi, out = rank * b.chunk, (rank + 1) * b.chunk, []
    for p, ti, off in b.params:
        start, end = max(off, lo), min(off + p.numel(), hi)
        if start < end:
            out.append(Segment(tensor=ti, start=b.shard_pos + start - lo, end=b.shard_pos + end - lo,
                               offset=start - off, slab=b.slab))
    return out


def shard_for(buckets, param_groups: list[dict], *, ctx, settings, precision, rank: int, transient,
              persistent: bool = False, grad_dtype=None) -> ShardStorage:
    """This rank's shard of `buckets` (it owns chunk `rank` of each): its kind and place from the
    run's settings (module docstring). `persistent`: the weights keep only this rank's chunks
    (zero3); `grad_dtype`: the gradient shard's dtype where the stage fixes it (zero3's reduce
    dtype), else the dtype the optimizer updates or, with precision.grad_shard=bf16, the compute dtype."""
    device = Device(ctx.device)
    place = Host(device) if getattr(settings, "offload_optimizer", False) else device
    weights_place = place if getattr(settings, "offload_params", False) else device
    update, compute = precision.update_dtype, precision.compute_dtype
    if grad_dtype is None and precision.grad_shard == "bf16":
        grad_dtype = compute
    kw = dict(rank=rank, place=place, weights_place=weights_place, update_dtype=update, compute_dtype=compute,
              rounding=precision.weight_rounding, grad_dtype=grad_dtype, persistent=persistent, transient=transient)
    mode = precision.master if precision.master_weights else "fp32"
    if mode != "fp32":
        return StoredShard(buckets, param_groups, mode=mode, **kw)
    if update == compute and place is weights_place:
        return WeightsShard(buckets, param_groups, **kw)
    return CopyShard(buckets, param_groups, **kw)
