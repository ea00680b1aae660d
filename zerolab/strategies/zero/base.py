"""What zerolab's own ZeRO-1, ZeRO-2 and ZeRO-3 share (Rajbhandari et al. 2019, arXiv 1910.02054):
ZeroBase, the sharder over buckets, chunks and shards; a class per stage supplies what differs
(stages.py: zero1, zero2; stage3.py: zero3).

Layout. Parameters are packed, in the order their gradients become ready in backward (reverse
registration order), into buckets of about `strategy.bucket_mb`; a bucket never mixes param
groups and is padded to a multiple of N. Every bucket is split into N equal chunks and rank r
owns chunk r of every bucket: the weights the optimizer updates, the gradient shard and the
optimizer state exist only for owned chunks (this rank's "shard" of a group is its chunks of that
group's buckets, one flat piece per bucket). A parameter may straddle chunk boundaries.

What the shard is (the ZeRO paper's accounting, Rajbhandari et al. 2019, section 5): in mixed
precision an fp32 master copy of the owned chunks, beside the 16-bit weights. Where the weights
already are in the dtype the optimizer updates (fp32 training, and bf16_pure), a master copy
would only duplicate them: the shard is then a view of the owned chunk of the weights' own flat
buffer, updated in place and all-gathered in place. Likewise zero1's gradient shard, in fp32
training, is a view of the owned chunk of the whole reduced gradient. So with AdamW in fp32 a
rank holds (4 + 4 + 8/N) bytes per parameter under zero1 and (4 + (4 + 8)/N) under zero2.

Why per-bucket chunks instead of one contiguous slice of the whole group (the simplest layout): a
reduce-scatter hands chunk r of its input to rank r, so with per-bucket ownership a bucket can be
reduce-scattered the moment its gradients are complete, while backward is still running. With one
slice per rank, the first reduce-scatter would need gradients from all over the model and nothing
could overlap.

Step, per stage (the hooks each stage class supplies: _into_bucket, _send_buffer, _collect,
_clear_whole_grads, _piece_grad, no_sync):
  zero1  gradients accumulate in the model (views into per-bucket buffers, so a bucket is
         reduce-scattered in place); on the last micro-batch each bucket is reduce-scattered as
         soon as it is complete. Full-size gradients stay allocated.
  zero2  a hook copies each finished gradient into its bucket and frees it; complete buckets
         are reduce-scattered while backward continues and summed into the fp32 gradient shard.
         Only the shard plus in-flight buckets exist. With accumulation this communicates on
         every micro-batch (that is what keeps gradient memory sharded).
Then: global norm from partial sums (one all-reduce), unscale + clip, optimizer update on the
fp32 shard, and a bucketed all-gather writes the updated chunks, in compute dtype, straight into
the model's parameters (which are views into per-bucket flat buffers).

Collectives are launched in one fixed bucket order on every rank (a bucket waits for the ones
before it), and buckets whose parameters got no gradient are flushed with zeros at the end of
backward, so unused parameters can neither hang nor misalign the reductions.

Across nodes (strategy.shard_within=node, layout.py): "N chunks" above become the n ranks
of a node, whose group runs the reduce-scatters and all-gathers; each node holds a replica of the
shards, and the gradient shard is averaged across the replicas by one all-reduce per step.

Below the paper's floor (precision.master=remainder|bf16, zerolab/precision_modes.py) the master
shard is held in this rank's chunk of the bf16 weights (plus int16 remainders): shard.py.
"""
from __future__ import annotations

import abc
from collections import deque

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab.buckets import MAX_IN_FLIGHT, bucket_cap, pack_buckets
from zerolab.master import derived_weight
from zerolab.accounting import StorageCounter
from zerolab.models import place
from zerolab.optim.segments import FlatShard, Segment
from zerolab.numerics import Measure, StepInfo
from zerolab.schema import ZeroSettings
from zerolab.strategies.base import PRECISION_MODE_SETTINGS, ZEROLAB_STEP_SETTINGS, OptimizerFactory, Strategy, \
    Traits, precision_lossy, set_lr
from zerolab.strategies.zero.checkpoint import ZeroPieces
from zerolab.strategies.zero.estimate import deepspeed_estimate, offload_modes
from zerolab.strategies.zero.layout import Bucket, check_node_settings, layout_for, shards_for
from zerolab.strategies.zero.memory import predict_zero12
from zerolab.strategies.zero.offload import Offload, check_offload
from zerolab.strategies.zero.shard import FlatGroup, ShardGrads


class ZeroBase(Offload, ZeroPieces, ShardGrads, Strategy):
    """The sharder the three stages share; registered only through a stage class."""
    traits = Traits(settings=ZeroSettings, stage=1, sharded_grads=True, zerolab_sharder=True,
                    also_reads=ZEROLAB_STEP_SETTINGS | PRECISION_MODE_SETTINGS | {"precision.grad_shard"})
    checkpoint_format = "pieces"
    shards_params = False  # zero3: only the owned chunks of the weights persist between uses
    keeps_whole_grads = False  # zero1: the whole gradients persist between steps (the memory model reads it)

    # ---- setup ------------------------------------------------------------------------------
    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        self._place(model)
        self.buckets = self._make_buckets(model, param_groups)
        self.bucket_of = {id(p): b for b in self.buckets for p, _, _ in b.params}
        self.offset_of = {id(p): off for b in self.buckets for p, _, off in b.params}
        self.groups = self._make_flat_groups(param_groups)
        self.grad_shards = self._make_grad_shards()
        self.optimizer = self._make_optimizer(param_groups, make_optimizer)
        # Reduce-scatters in flight, in launch order: (work, output chunk, bucket, send buffer).
        # The send buffer must stay referenced until the work completes: an asynchronous
        # collective reads it in the background, and zero2's comm_buf is otherwise dropped.
        self.pending: deque = deque()
        self.next_launch = 0
        self.sync = True
        for p in (p for b in self.buckets for p, _, _ in b.params):
            p.register_post_accumulate_grad_hook(self._grad_ready)
        # All-gathers issued after a step finish in the background; a module waits for the
        # buckets of its own parameters just before its forward, so the next forward overlaps them.
        # (This assumes a parameter is used by the module that owns it, as in torch.nn layers.)
        self.gathers: dict[int, tuple] = {}  # bucket index -> (work, input chunk)
        self._gather_input_bytes: dict[int, int] = {}  # bucket index -> bytes of a copied input chunk (peak accounting)
        self.bucket_index = {id(b): i for i, b in enumerate(self.buckets)}
        for module in model.modules():
            # Frozen parameters (requires_grad=False) are in no param group, hence in no bucket:
            # they stay ordinary tensors, identical on every rank after the broadcast above.
            own = {self.bucket_index[id(self.bucket_of[id(p)])] for p in module.parameters(recurse=False)
                   if id(p) in self.bucket_of}
            if own:
                module.register_forward_pre_hook(lambda _m, _inp, own=sorted(own): self._wait_gathers(own))
        return model

    def _place(self, model: nn.Module) -> None:
        """Model on the device in compute dtype, rank 0's weights everywhere, and the dtypes of the
        reduction and of the shard the optimizer updates."""
        place(model, self.ctx.device, self.precision.compute_dtype)
        self.model, self.world, self.rank = model, self.ctx.world_size, self.ctx.rank
        for p in model.parameters():  # every rank starts from rank 0's weights
            dist.broadcast(p.data, src=0)
        # who shares a shard and which groups the collectives use (layout.py): by default
        # every rank (group None), self.shards = N and this rank owns chunk self.rank of every bucket
        self.layout = layout_for(self.ctx, self.settings)
        self.shards, self.shard_rank, self.shard_group = self.layout.shards, self.layout.shard_rank, \
            self.layout.shard_group
        self.reduce_dtype = torch.float32 if self.settings.reduce_dtype == "fp32" else self.precision.compute_dtype
        # The shard the optimizer updates: fp32 master weights, except in bf16_pure, whose point
        # is to update the 16-bit weights themselves (the owned chunk, then all-gathered). Where
        # that is the weights' own dtype, the shard is a view of the weights (module docstring).
        self.shard_dtype = self.precision.update_dtype
        self._offload_setup()  # offload.py: the shard on the host is a copy of its own, never a view of the weights
        self.shard_is_weights = self.shard_dtype == self.precision.compute_dtype and not self.shards_params \
            and not self.offload_optimizer
        # precision.master (module docstring): where the master shard lives under bf16
        self.master_mode = self.precision.master if self.precision.master_weights else "fp32"

    def _make_buckets(self, model: nn.Module, param_groups: list[dict]) -> list[Bucket]:
        order = {id(p): i for i, p in enumerate(model.parameters())}
        entries = sorted(((order[id(p)], gi, ti, p) for gi, g in enumerate(param_groups)
                          for ti, p in enumerate(g["params"])), key=lambda e: e[0])
        cap = bucket_cap(self.settings.bucket_mb, self.precision.compute_dtype.itemsize)
        closed = [(gi, [(entries[i][3], entries[i][2]) for i in members])
                  for gi, members in pack_buckets([(gi, p.numel()) for _, gi, _, p in entries], cap)]
        self.piece_sizes: list[list[int]] = [[] for _ in param_groups]  # per group, per piece: elements
        buckets = []
        for gi, members in closed:
            offsets, total = [], 0
            for p, ti in members:
                offsets.append((p, ti, total))
                total += p.numel()
            size = -(-total // self.shards) * self.shards
            b = Bucket(group=gi, params=offsets, size=size, shard_pos=0, shards=self.shards,
                       piece=len(self.piece_sizes[gi]))
            self.piece_sizes[gi].append(b.chunk)
            self._flatten_params(b)
            buckets.append(b)
        return buckets

    def _flatten_params(self, b: Bucket) -> None:
        """Make the bucket's params views into one flat buffer, so all-gather lands in place."""
        p0 = b.params[0][0]
        b.flat_params = torch.zeros(b.size, dtype=p0.dtype, device=p0.device)
        for p, _, off in b.params:
            b.flat_params[off:off + p.numel()].copy_(p.data.view(-1))
            p.data = b.flat_params[off:off + p.numel()].view_as(p)

    def _make_flat_groups(self, param_groups: list[dict]) -> list[FlatGroup]:
        """The shard's pieces (with their gradients) and segments, from the buckets' weights."""
        groups = [FlatGroup([None] * len(sizes), names=list(g["names"]))
                  for sizes, g in zip(self.piece_sizes, param_groups)]
        for b in self.buckets:
            lo, hi = self.shard_rank * b.chunk, (self.shard_rank + 1) * b.chunk
            fg = groups[b.group]
            if self.shard_is_weights:  # the owned chunk of the weights is the shard (shares their storage)
                fg.pieces[b.piece] = nn.Parameter(b.flat_params[lo:hi])
            elif self.master_mode != "fp32":  # zero3 frees its buckets: its masters need a buffer of their own
                fg.hold_master(b.piece, self.piece_sizes[b.group][b.piece], b.flat_params[lo:hi], b.shard_pos,
                               self.master_mode, own_buffer=self.shards_params)
            else:
                if fg.pieces[b.piece] is None:
                    size = self.piece_sizes[b.group][b.piece]
                    fg.pieces[b.piece] = nn.Parameter(self._shard_zeros(size, self.shard_dtype))
                fg.pieces[b.piece].data[b.shard_pos:b.shard_pos + b.chunk].copy_(b.flat_params[lo:hi])
            for p, ti, off in b.params:
                start, end = max(off, lo), min(off + p.numel(), hi)
                if start < end:
                    fg.segments.append(Segment(tensor=ti, start=b.shard_pos + start - lo, end=b.shard_pos + end - lo,
                                               offset=start - off, piece=b.piece))
        for b in self.buckets:
            self._piece_grad(b, groups[b.group].pieces[b.piece])
        return groups

    def _piece_grad(self, b: Bucket, piece: torch.Tensor) -> None:
        """The gradient of the shard's piece that holds bucket b's chunk: a buffer of its own."""
        if piece.grad is None:  # (not zeros_like: a stand-in's strides are all 0)
            piece.grad = torch.zeros(piece.shape, dtype=piece.dtype, device=piece.device,
                                     pin_memory=self.pinned and piece.device == self.host)

    def _shard_chunk(self, b: Bucket) -> torch.Tensor:
        """This rank's chunk of bucket b in the shard the optimizer updates."""
        return self.groups[b.group].pieces[b.piece].data[b.shard_pos:b.shard_pos + b.chunk]

    def _grad_chunk(self, b: Bucket) -> torch.Tensor:
        """Where bucket b's reduce-scattered gradient chunk goes: its place in the gradient shard."""
        return self.grad_shards[b.group][b.piece][b.shard_pos:b.shard_pos + b.chunk]

    def _make_optimizer(self, param_groups: list[dict], make_optimizer: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over this rank's shard: one group per param group, its flat pieces and
        where each tensor lies in them (zerolab's optimizers keep per-tensor norms for LAMB/LARS
        with one all-reduce)."""
        return make_optimizer([
            {**{k: v for k, v in g.items() if k not in ("params", "names")}, "params": fg.pieces,
             "shard": FlatShard(fg.segments, len(g["params"]), self._all_reduce), "names": g["names"],
             **self.precision.state_keys(), **fg.optimizer_keys()}
            for g, fg in zip(param_groups, self.groups)])

    # ---- what a stage supplies (stages.py, stage3.py) ------------------------------------------
    @abc.abstractmethod
    def _into_bucket(self, b: Bucket, p: torch.Tensor) -> None:
        """p's gradient is complete: put it where bucket b's reduce-scatter reads it."""

    @abc.abstractmethod
    def _send_buffer(self, b: Bucket) -> torch.Tensor:
        """Bucket b's averaged gradients in the reduce dtype: the reduce-scatter's input."""

    @abc.abstractmethod
    def _collect(self, b: Bucket, out: torch.Tensor) -> None:
        """Bucket b's reduced chunk `out` into the gradient shard (a copy, or a sum over micro-batches)."""

    @abc.abstractmethod
    def _clear_whole_grads(self) -> None:
        """After a step: zero the whole gradients where the stage keeps them."""

    # ---- backward: hooks, in-order launches ---------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        b = self.bucket_of[id(p)]
        self._into_bucket(b, p)
        b.arrived += 1
        self._launch_ready()

    def _launch_ready(self, flush: bool = False) -> None:
        """Launch buckets strictly in list order; `flush` launches the rest (missing grads = 0)."""
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if not flush and b.arrived < len(b.params):
                break  # (not return: the drain below must run, or nothing is freed before backward ends)
            self._reduce_scatter(b)
            self.next_launch += 1
        # Free finished buckets while backward goes on, so zero2 never holds a whole gradient;
        # past MAX_IN_FLIGHT buckets, wait for the oldest (bounds memory if comm falls behind).
        self._drain(block=len(self.pending) > MAX_IN_FLIGHT)

    def _reduce_scatter(self, b: Bucket) -> None:
        buf = self._send_buffer(b)
        out = torch.empty(b.chunk, dtype=buf.dtype, device=buf.device)
        self.transient.alloc(out.untyped_storage().nbytes(), "backward")
        self.comm.record("reduce_scatter", buf, group=self.shard_group)
        work = dist.reduce_scatter_single(out, buf, group=self.shard_group, async_op=True)
        self.pending.append((work, out, b, buf))

    def _drain(self, block: bool = True) -> None:
        """Collect launched reductions, oldest first, and add each averaged chunk into the
        gradient shard (_grad_chunk). Without `block`, stop at the first one still in flight.
        (Each bucket owns its own region of the shard, and a bucket's micro-batches are always
        collected in launch order, so the sums do not depend on when this runs.)"""
        while self.pending and (block or self.pending[0][0].is_completed()):
            work, out, b, buf = self.pending.popleft()
            work.wait()
            self._arrived(b, out)  # into the gradient shard (_collect), through the host under offload
            self.transient.free(out.untyped_storage().nbytes()
                                 + (buf.untyped_storage().nbytes() if buf is not b.flat_grads else 0))
            b.comm_buf = None  # zero2: the bucket's memory goes back to the allocator
        self._host_collect(block)  # offload: the chunks whose copy to the host is done

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        if self.sync:
            self._launch_ready(flush=True)
            self._drain()
            for b in self.buckets:
                b.arrived = 0
            self.next_launch = 0

    # ---- step -------------------------------------------------------------------------------
    def step(self, lr: float, measure: Measure = Measure.NOTHING) -> StepInfo:
        set_lr(self.optimizer, lr)
        self._drain()
        self._average_replicas(self._all_grad_shards())
        with self._fp32_grads():
            info = self._update(self._shard_grads(), measure)
        if not info.known_skipped:
            self._all_gather_params(wait=False)  # completes behind the next forward
        for grad in self._all_grad_shards():
            grad.zero_()
        self._clear_whole_grads()
        return info

    @torch.no_grad()
    def _all_gather_params(self, wait: bool = True) -> None:
        """Write every bucket's updated chunks, in compute dtype, into the model's parameters.
        Issued in forward order (the reverse of the bucket list), so the first layers arrive first.
        Where the shard is the weights, or the weights hold the master (precision.master), the input
        is the output's own chunk, which the optimizer updated (gathered in place)."""
        self._wait_gathers()
        for i in reversed(range(len(self.buckets))):
            b = self.buckets[i]
            if self.master_mode != "fp32":
                chunk = self.groups[b.group].storage.weights[b.piece]
            elif self.offload_optimizer:  # the host's updated chunk, into its place in the weights
                chunk = self._weights_to_device(b)
            else:
                chunk = derived_weight(self._shard_chunk(b), b.flat_params.dtype, self.precision.weight_rounding)
            if not (self.shard_is_weights or self.master_mode != "fp32" or self.offload_optimizer):  # a 16-bit copy
                self._gather_input_bytes[i] = chunk.untyped_storage().nbytes()
                self.transient.alloc(self._gather_input_bytes[i], "step")
            self.comm.record("all_gather", b.flat_params, group=self.shard_group)
            self.gathers[i] = (dist.all_gather_single(b.flat_params, chunk, group=self.shard_group, async_op=True),
                               chunk, None)
        if wait:
            self._wait_gathers()

    def _weights_follow_shard(self) -> None:
        """After the shard changed outside a step (a checkpoint loaded): the model's weights follow."""
        self._all_gather_params()  # every chunk is written

    def _wait_gathers(self, indices=None) -> None:
        """Wait for all-gathers in flight: (work, input kept alive, what finishes it or None)."""
        for i in (list(self.gathers) if indices is None else indices):
            entry = self.gathers.pop(i, None)
            if entry is not None:
                work, _, finish = entry
                work.wait()
                if finish is not None:  # zero3's quantized all-gather: dequantize
                    finish()
                self.transient.free(self._gather_input_bytes.pop(i, 0))

    # ---- across nodes (layout.py) --------------------------------------------------------------
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
            if g.device != self.ctx.device:  # offload: a host shard is reduced from a device copy (offload.py)
                self._on_device(g, lambda t: dist.all_reduce(t, group=group))
                continue
            works.append(dist.all_reduce(g, group=group, async_op=True))
        for work in works:
            work.wait()

    def _all_reduce(self, t: torch.Tensor) -> None:
        """Partial sums over this rank's shard (the clip norm, LAMB's per-tensor norms, update ratios)
        complete over the ranks that share the shards: every rank, or the node's under HSDP (the
        other nodes hold the same shards: summing them too would count every element once per node)."""
        if self.shard_group is None:
            return self._on_device(t, super()._all_reduce)
        self.comm.record("all_reduce", t, group=self.shard_group)
        self._on_device(t, lambda d: dist.all_reduce(d, group=self.shard_group))

    # ---- introspection ------------------------------------------------------------------------
    def _describe_nonfinite(self) -> str:
        for g in self.groups:
            for s in g.segments:
                if not torch.isfinite(g.pieces[s.piece].grad[s.start:s.end]).all():
                    return f"first non-finite gradient: {g.names[s.tensor]} (on rank {self.rank})"
        return "the non-finite values are on another rank, or only their norm overflowed"

    def memory(self) -> dict[str, int]:
        self._wait_gathers()
        c, where = StorageCounter(), self.shard_place  # offload: the optimizer's side is the host's
        c.add("params", (b.flat_params for b in self.buckets))
        c.add("grads", (b.flat_grads for b in self.buckets)).add("grads", self._all_grad_shards(), where)
        c.add("master", (piece for g in self.groups for piece in g.pieces), where)  # (stand-ins hold nothing)
        c.add("master", (r for g in self.groups for r in g.storage.remainders)).add_optimizer(self.optimizer, where)
        c.add("buffers", (b.comm_buf for b in self.buckets)).add("buffers", self.model.buffers())
        return c.result()

    # ---- memory prediction (zerolab.memory asks it; Strategy.predict_memory says how) ----------
    @classmethod
    def predict_memory(cls, p, shape, *, world, precision, k, bucket_mb, reduce_dtype, ranks_per_node, settings,
                       mode, **_) -> None:
        """memory.predict_zero12: the owned chunks' shard, gradient and optimizer state, the
        whole weights (and zero1's whole gradients), measured at the end of a step as memory() sees it."""
        predict_zero12(p, shape, whole_grads=cls.keeps_whole_grads, shards=shards_for(world, ranks_per_node, settings),
                       precision=precision, k=k, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype,
                       hsdp=settings.get("shard_within") == "node" and ranks_per_node < world, mode=mode,
                       offload=bool(settings.get("offload_optimizer")))

    @classmethod
    def offload_modes(cls) -> list[dict]:
        """The strategy.* offload settings this stage runs, none first (python -m zerolab memory --offload)."""
        return offload_modes(cls.shards_params)

    @classmethod
    def offload_reference(cls, shape, world: int, settings: dict):
        """memory_reference's own estimate for these offload settings (estimate.py), or None."""
        return deepspeed_estimate(shape, world, cls.traits.memory_reference[1], settings)

    @classmethod
    def lossy(cls, cfg: dict):
        return precision_lossy(cfg)  # precision.master=bf16, optim_states=bf16, ... (base.py)

    @classmethod
    def check_config(cls, cfg, world_size: int) -> None:
        super().check_config(cfg, world_size)
        check_node_settings(cfg, world_size, cls.traits.stage)  # shard_within, ZeRO++ (layout.py)
        check_offload(cfg, cls.traits.stage)  # offload.py

