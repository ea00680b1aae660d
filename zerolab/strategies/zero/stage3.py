"""zerolab's own ZeRO-3: ZeRO-2 plus sharded parameters (Rajbhandari et al. 2019, P_os+g+p).

Read base.py and stages.py first: the buckets, the per-bucket chunks, the fp32 shard the optimizer updates and
the bucketed reduce-scatter of gradients are zero2's, reused from there. What stage 3 adds is
that a rank no longer keeps the whole model between uses.

Layout. The model is cut into units: each of its repeated blocks is one (zerolab.models.find_blocks:
the GPT's `blocks`, a transformers model's `model.layers` or `transformer.h`, or model.blocks), and
the "root" unit holds every other parameter (the embeddings, tied LM head and final norm; all of
a model without blocks). Buckets are packed per unit, so a unit's weights are exactly its
buckets. Rank r keeps chunk r of every bucket as the persistent copy of the weights, in compute
dtype: a slice of the fp32 master shard's compute-dtype twin (bf16/fp16), or the shard itself
(fp32, and bf16_pure, where the optimizer updates the 16-bit weights). The model's parameters
stay views into each bucket's full-size flat buffer, as in zero1/2, but that buffer's storage is
resized to 0 bytes while the unit is not in use: the parameters keep their shapes and names (so
state_dict, checkpoints and the memory ledger see the usual model) but hold no memory. An
all-gather resizes the storage back and writes the chunks of every rank into it; the views
see the new memory because they share the storage object, not its address.

Per micro-batch, for every unit:
  forward   a pre-hook all-gathers the unit (and starts the next unit's all-gather, the prefetch,
            while this one computes); a post-hook frees it again when
            strategy.reshard_after_forward=true, and hooks the unit's output tensor(s).
  backward  the output hook fires when the gradient of the unit's output is complete, i.e. just
            before the unit's own backward starts: it all-gathers the unit again (a no-op when it
            was kept) and prefetches the next unit in backward order. Autograd saved the weights
            as views of the same storage, so backward reads the re-gathered values. Each
            parameter's gradient goes into its bucket and is reduce-scattered into the gradient
            shard as in zero2; when the last parameter of the unit has its gradient, nothing will
            read the unit's weights again and it is freed.
The gradient shard is kept in the dtype the reduce-scatter delivers (strategy.reduce_dtype):
with bf16/fp16 mixed precision and reduce_dtype=auto that is 16-bit, the paper's 2Ψ/N, so the
model states are its (2 + 2 + K)Ψ/N (1.9 GB per GPU for 7.5B parameters on 64 GPUs). The step
converts it to fp32 for the optimizer (unscale, clip norm and update all run in fp32), a copy
that lives only during the step. The price: with gradient accumulation the micro-batches are
summed in 16-bit. strategy.reduce_dtype=fp32 reduces and sums in fp32 instead, as zero1/2 always
do (4Ψ/N: 2.1 GB in the example). Without mixed precision nothing changes: the shard is fp32
(bf16 for bf16_pure), the dtype the optimizer updates.

So a micro-batch moves 2Ψ all-gathered (Ψ with reshard_after_forward=false) and Ψ reduce-scattered
elements: 3Ψ(N-1)/N per rank (2Ψ(N-1)/N), the paper's 1.5x of DDP. With gradient accumulation
every micro-batch does this (as zero2, gradients accumulate in the shard; nothing is ever whole).

Tied and shared weights. A parameter registered in more than one unit (the GPT's lm_head.weight
is wte.weight) or outside the blocks belongs to the root. The root is gathered for the whole
forward of the model (its pre-hook runs first, its post-hook last) and, in backward, from the
first gradient (the logits') until its last parameter's gradient arrives, which for the tied
embedding is the very end of backward. Every use of a root parameter falls inside those spans.
The root follows the same rule as the blocks between forward and backward (freed when
reshard_after_forward=true), so the traffic is exactly the paper's 3Ψ; FSDP2 instead keeps its
root gathered there, which saves Ψ_root(N-1)/N per micro-batch. A block parameter used by code
outside its block (not registered there) is not supported: it would be read while freed.

Prefetch is bounded: the next unit's all-gather starts early only if the buckets then allocated
(gathered or in flight) stay within MAX_LIVE_BUCKETS. The unit about to run is always gathered.

Evaluation runs forward under torch.no_grad(): then no backward follows, so every unit (the root
included) is freed right after its forward whatever reshard_after_forward says. Between steps,
when the trainer measures memory, no unit is gathered: params = the persistent chunks.

Collectives are issued from hooks at the same points of the same graph on every rank, and every
prefetch decision depends only on that history, so all ranks issue them in one order.

Across nodes (layout.py, docs/nodes.md). strategy.shard_within=node is HSDP: the chunks
are cut over a node's ranks, the gathers and reduce-scatters run over the node, the gradient
shard is all-reduced across nodes once per step (base.py). ZeRO++ (Wang et al. 2023) keeps the
world-wide chunks: strategy.hpz=true copies, after each forward all-gather, this rank's 1/n of
every gathered bucket (n ranks per node) into a secondary copy, and the backward all-gathers that
copy over the node instead of the primary chunks over every rank: the same values (bitwise
zero3), no cross-node byte. quantize_weights / quantize_grads send the primary all-gathers as
int8 blocks and the reduce-scatter as int4 blocks through a two-hop all-to-all (quantized.py).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab.buckets import MAX_LIVE_BUCKETS, bucket_cap, pack_units
from zerolab.master import derived_weight
from zerolab.numerics import Measure
from zerolab.accounting import StorageCounter
from zerolab.models import block_of_parameters, find_blocks
from zerolab.models.recompute import tensors_in
from zerolab.schema import Zero3Settings
from zerolab.strategies.base import PRECISION_MODE_SETTINGS, ZEROLAB_STEP_SETTINGS, OptimizerFactory, set_lr
from zerolab.strategies.zero.base import ZeroBase
from zerolab.strategies.zero.layout import Bucket, shards_for
from zerolab.strategies.zero.memory import predict_zero3
from zerolab.strategies.zero.quantized import FinishedWork, gather_quantized, reduce_scatter_quantized
from zerolab.strategies.zero.stages import Zero2Strategy

@dataclass
class Zero3Bucket(Bucket):
    unit: int = 0  # index into Zero3Strategy.units


@dataclass
class Unit:
    name: str  # "root" or the block's module name, e.g. "blocks.3"
    module: nn.Module
    params: list  # trainable parameters this unit owns
    buckets: list[int] = field(default_factory=list)  # indices into Zero3Strategy.buckets
    arrived: int = 0  # parameters whose gradient is complete in this backward


class Zero3Strategy(Zero2Strategy):
    name = "zero3"
    # stage 3 takes zero2's gradient path (bucket copies, a reduce-scatter per micro-batch: stages.py);
    # a model without repeated blocks is refused before any rank trains (needs_blocks)
    traits = replace(ZeroBase.traits, settings=Zero3Settings, stage=3, needs_blocks=True,
                     memory_reference=("deepspeed", 3),
                     # its gradient shard is in the reduce dtype already (16-bit under bf16): no precision.grad_shard
                     also_reads=ZEROLAB_STEP_SETTINGS | PRECISION_MODE_SETTINGS)
    shards_params = True  # only the owned chunks of the weights persist (base.py reads it)
    # checkpoint_format "pieces" (base.py): the fp32 master shard and optimizer state by parameter
    # name and element range, exactly zero2's, so zero3 reshards to and from ddp/zero1/zero2.

    # ---- setup ------------------------------------------------------------------------------
    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        self._place(model)  # base.py: device, dtype, rank 0's weights, reduce and shard dtypes
        self.reshard_after_forward = self.settings.reshard_after_forward
        self.units = self._make_units(model, param_groups)
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        self.buckets = self._make_buckets(model, param_groups)  # whole flat buffers, for now
        self.bucket_of = {id(p): b for b in self.buckets for p, _, _ in b.params}
        self.offset_of = {id(p): off for b in self.buckets for p, _, off in b.params}
        self.groups = self._make_flat_groups(param_groups)  # fp32 master chunks, from the whole buffers
        self.grad_shards = self._make_grad_shards()
        # The persistent weights: this rank's chunks in compute dtype, one flat tensor per group
        # laid out like the master shard. When the shard already is in compute dtype (fp32,
        # bf16_pure) it is the weights, and nothing is stored twice; under precision.master=remainder
        # or bf16 the persistent chunks hold the master (shard.py): the optimizer writes them.
        if self.master_mode != "fp32":
            self.local = [g.storage.weights[0] for g in self.groups]
        else:  # offload (offload.py): on the host with the parameters, else a device copy of the host's
            dtype, rounding = self.precision.compute_dtype, self.precision.weight_rounding
            self.local = self._make_local([g.master.data if self.shard_dtype == dtype
                                           else derived_weight(g.master.data, dtype, rounding) for g in self.groups])
        self.optimizer = self._make_optimizer(param_groups, make_optimizer)
        self.pending: deque = deque()  # reduce-scatters in flight (base.py)
        self.next_launch = 0
        self.sync = True  # zero2's path: never False, every micro-batch reduces
        self.gathers: dict[int, tuple] = {}  # all-gathers in flight: bucket index -> (work, input chunk)
        self._gather_input_bytes: dict[int, int] = {}  # base.py's; empty unless offload_params stages the chunks
        self.live: set[int] = set()  # buckets whose full buffer exists (gathered or in flight)
        self.in_backward = False  # between the first unit's backward gather and the end of backward
        self.secondary = self._make_secondary()  # hpZ (module docstring); [] without it
        self._weight_error: dict[int, torch.Tensor] = {}  # qwZ: bucket -> bound² on its ‖ŵ − w‖ (last gather)
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        for i in range(len(self.buckets)):  # from now on only the chunks persist
            self._free_bucket(i)
        for i, unit in enumerate(self.units):
            if unit.buckets:
                unit.module.register_forward_pre_hook(lambda _m, _args, i=i: self._before_forward(i))
                unit.module.register_forward_hook(lambda _m, _args, out, i=i: self._after_forward(i, out))
        return model

    def _make_units(self, model: nn.Module, param_groups: list[dict]) -> list[Unit]:
        """[root, blocks.0, blocks.1, ...] in forward order, the blocks being the model's repeated
        blocks (zerolab.models.find_blocks: `blocks`, `model.layers`, `transformer.h`, ... or
        model.blocks). A parameter goes to a block only if every name it is registered under
        lies inside that one block; anything shared between units, or registered outside the
        blocks, goes to the root (block_of_parameters)."""
        found = find_blocks(model, self.cfg.model.blocks)
        blocks = list(found.modules) if found is not None else []
        units = [Unit("root", model, [])] + [Unit(f"{found.name}.{i}", b, []) for i, b in enumerate(blocks)]
        block_of = block_of_parameters(model, self.cfg.model.blocks)
        trainable = {id(p) for g in param_groups for p in g["params"]}
        for p in model.parameters():  # registration order; frozen parameters stay whole, in no unit
            if id(p) in trainable:
                units[block_of[id(p)] + 1].params.append(p)
        return units

    def _make_buckets(self, model: nn.Module, param_groups: list[dict]) -> list[Bucket]:
        """zero1/2's packing, run unit by unit so that no bucket spans two units (pack_units). The
        list is in the order backward completes the units (last block first, the root last,
        because the tied embedding's gradient is the last of all): the reduce-scatter launch order."""
        where = {id(p): (gi, ti) for gi, g in enumerate(param_groups) for ti, p in enumerate(g["params"])}
        params = [p for unit in self.units for p in unit.params]
        tensors = [(where[id(p)][0], p.numel(), ui) for ui, unit in enumerate(self.units) for p in unit.params]
        cap = bucket_cap(self.settings.bucket_mb, self.precision.compute_dtype.itemsize)
        shard_pos = [0] * len(param_groups)
        buckets = []
        for ui, gi, members, size in pack_units(tensors, cap, self.shards):
            offsets, total = [], 0
            for m in members:
                offsets.append((params[m], where[id(params[m])][1], total))
                total += params[m].numel()
            b = Zero3Bucket(group=gi, params=offsets, size=size, shard_pos=shard_pos[gi], shards=self.shards, unit=ui)
            shard_pos[gi] += b.chunk
            self._flatten_params(b)
            self.units[ui].buckets.append(len(buckets))
            buckets.append(b)
        self.piece_sizes = [[n] for n in shard_pos]  # one flat piece per group (shard.py's FlatGroup.master)
        return buckets

    # ---- gathering and freeing units ------------------------------------------------------------
    def _chunk(self, b: Bucket) -> torch.Tensor:
        """This rank's persistent chunk of bucket b (compute dtype)."""
        return self.local[b.group][b.shard_pos:b.shard_pos + b.chunk]

    def _gather(self, unit: Unit) -> None:
        """Start all-gathering the unit's buckets that are not already there (asynchronous): in
        backward from hpZ's secondary copy over the node, else the primary chunks (int8 with qwZ)."""
        for i in unit.buckets:
            if i in self.live:
                continue
            b = self.buckets[i]
            b.flat_params.untyped_storage().resize_(b.size * b.flat_params.element_size())
            # gathered weights are transient (peak accounting): forward or backward, until freed
            self.transient.alloc(b.size * b.flat_params.element_size(), "backward")
            if self.secondary and self.in_backward:
                group, chunk = self.layout.local_group, self.secondary[i]
            else:  # (offload_params: the host's chunk, copied to the device first)
                group, chunk = self.shard_group, self._staged_chunk(i, self._chunk(b))
                if self.settings.quantize_weights:
                    work, keep, finish = gather_quantized(b.flat_params, chunk, group, self.shards,
                                                          self.settings.quant_block, self.comm, self.transient)
                    self.gathers[i] = (work, keep,
                                       lambda i=i, finish=finish: self._weight_error.__setitem__(i, finish()))
                    self.live.add(i)
                    continue
            self.comm.record("all_gather", b.flat_params, group=group)
            self.gathers[i] = (dist.all_gather_single(b.flat_params, chunk, group=group, async_op=True), chunk, None)
            self.live.add(i)

    def _make_secondary(self) -> list[torch.Tensor]:
        """hpZ: one compute-dtype buffer of 1/per_node of every bucket, a view per bucket."""
        if not self.settings.hpz:
            return []
        n = self.layout.per_node
        flat = torch.zeros(sum(b.size for b in self.buckets) // n, dtype=self.precision.compute_dtype,
                           device=self.ctx.device)
        views, at = [], 0
        for b in self.buckets:
            views.append(flat[at:at + b.size // n])
            at += b.size // n
        return views

    def _keep_secondary(self, unit: Unit) -> None:
        """hpZ: after the forward all-gather, this rank's 1/n of each of the unit's buckets (what the
        node's all-gather in backward hands back to every rank of the node)."""
        lo = self.layout.local_rank
        for i in unit.buckets:
            part = self.secondary[i]
            part.copy_(self.buckets[i].flat_params[lo * part.numel():(lo + 1) * part.numel()])

    def _free_bucket(self, i: int) -> None:
        self._wait_gathers([i])  # never take memory from under a collective still writing it
        if i in self.live:
            self.transient.free(self.buckets[i].flat_params.untyped_storage().nbytes())
        self.buckets[i].flat_params.untyped_storage().resize_(0)
        self.live.discard(i)

    def _free(self, unit: Unit) -> None:
        for i in unit.buckets:
            if i in self.live:
                self._free_bucket(i)

    def _prefetch(self, index: Optional[int]) -> None:
        if index is None:
            return
        unit = self.units[index]
        missing = [i for i in unit.buckets if i not in self.live]
        if missing and len(self.live) + len(missing) <= MAX_LIVE_BUCKETS:
            self._gather(unit)

    def _next_in_backward(self, index: int) -> Optional[int]:
        """Backward visits the root first (the logits' gradient), then the blocks last to first."""
        if index == 0:
            return len(self.units) - 1 if len(self.units) > 1 else None
        return index - 1 if index > 1 else None

    def _before_forward(self, index: int) -> None:
        unit = self.units[index]
        self._gather(unit)
        self._prefetch(index + 1 if index + 1 < len(self.units) else None)
        self._wait_gathers(unit.buckets)
        if self.secondary and torch.is_grad_enabled() and not self.in_backward:  # (not a recompute in backward)
            self._keep_secondary(unit)

    def _after_forward(self, index: int, output) -> None:
        unit = self.units[index]
        training = torch.is_grad_enabled()
        if self.reshard_after_forward or not training:
            self._free(unit)
        if training:
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda _grad, index=index: self._before_backward(index))

    def _before_backward(self, index: int) -> None:
        unit = self.units[index]
        self.in_backward = True
        self._gather(unit)
        self._prefetch(self._next_in_backward(index))
        self._wait_gathers(unit.buckets)

    # ---- backward -------------------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        super()._grad_ready(p)  # zero2: into its bucket, full gradient freed, complete buckets launched
        unit = self.unit_of[id(p)]
        unit.arrived += 1
        if unit.arrived == len(unit.params):
            # Every autograd node that read these weights ran before this last gradient was
            # accumulated: the unit's backward is over.
            self._free(unit)

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)  # base.py: backward, flush the buckets, collect the reductions
        self.in_backward = False
        for unit in self.units:  # units with unused parameters never completed: free them here
            self._free(unit)
            unit.arrived = 0

    def _reduce_scatter(self, b: Bucket) -> None:
        """qgZ replaces base.py's reduce-scatter by quantized.py's two all-to-all hops, done in place
        (queued as finished, so base.py's drain adds the chunk to the gradient shard in order)."""
        if not self.settings.quantize_grads:
            return super()._reduce_scatter(b)
        buf = self._send_buffer(b)  # zero2's averaged bucket (stages.py)
        out = torch.empty(b.chunk, dtype=buf.dtype, device=buf.device)
        self.transient.alloc(out.untyped_storage().nbytes(), "backward")
        reduce_scatter_quantized(out, buf, self.layout, self.settings.quant_block, self.comm, self.transient)
        self.pending.append((FinishedWork(), out, b, buf))

    def _make_grad_shards(self) -> list[list[torch.Tensor]]:
        """The gradient shard in the reduce dtype (module docstring). When that is the dtype the
        optimizer updates, the shard is master.grad, as in zero2; otherwise master.grad exists
        only during the step, as an fp32 copy (shard.py's _fp32_grads)."""
        if self.reduce_dtype == self.shard_dtype:
            return [[g.master.grad] for g in self.groups]
        for g in self.groups:
            g.master.grad = None
        return [[self._shard_zeros(g.master.numel(), self.reduce_dtype)] for g in self.groups]

    # ---- step -------------------------------------------------------------------------------
    def step(self, lr: float, measure: Measure = Measure.NOTHING):
        set_lr(self.optimizer, lr)
        self._drain()
        self._average_replicas(self._all_grad_shards())  # HSDP: across nodes (base.py)
        with self._fp32_grads():
            info = self._update([g.master.grad for g in self.groups], measure)
        if not info.known_skipped:
            self._refresh_local()  # the next forward all-gathers the new weights: no all-gather here
        for shard in self._all_grad_shards():
            shard.zero_()
        if measure and self._weight_error:  # qwZ, a logged step: the loss band's forward term (docs/nodes.md)
            info.extra["qwz_weight_error_bound"] = math.sqrt(sum(self._weight_error.values()).item())
        return info

    @torch.no_grad()
    def _refresh_local(self) -> None:
        if self.master_mode != "fp32" or self._local_to_device():  # (offload.py: the host's, rounded there)
            return  # the persistent chunks are the master's weights: the optimizer wrote them
        for g, local in zip(self.groups, self.local):
            if local is g.master.data:
                continue
            if self.precision.weight_rounding == "nearest_even":
                local.copy_(g.master.data)  # one rounding to compute dtype, as zero2's all-gather input
            else:  # (ties away from zero: weights derived as a remainder run derives them)
                local.copy_(derived_weight(g.master.data, local.dtype, self.precision.weight_rounding))

    # ---- introspection ------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """params: the persistent chunks, plus any bucket gathered at the time of the call (none
        between steps, where the trainer measures); in fp32 and bf16_pure the chunks are the
        shard the optimizer updates, counted once, as params, and master is 0."""
        self._wait_gathers()
        c, where = StorageCounter(), self.shard_place  # offload: the optimizer's side is the host's
        c.add("params", self.local, "host" if self.offload_params else "device")
        c.add("params", (b.flat_params for b in self.buckets)).add("params", self.secondary)
        c.add("grads", self._all_grad_shards(), where).add("master", (g.master for g in self.groups), where)
        c.add("master", (r for g in self.groups for r in g.storage.remainders))
        c.add_optimizer(self.optimizer, where)
        c.add("buffers", (b.comm_buf for b in self.buckets)).add("buffers", self.model.buffers())
        return c.result()

    def _weights_follow_shard(self) -> None:
        """A loaded master: the persistent chunks follow it; nothing is gathered until the next forward."""
        self._refresh_local()

    # ---- memory prediction (zerolab.memory asks it; Strategy.predict_memory says how) ----------
    @classmethod
    def predict_memory(cls, p, shape, *, world, precision, k, bucket_mb, reduce_dtype, ranks_per_node, settings,
                       mode, **_) -> None:
        """memory.predict_zero3: the persistent chunks and shards packed unit by unit, hpZ's
        secondary copy, the quantized collectives' buffers."""
        predict_zero3(p, shape, shards=shards_for(world, ranks_per_node, settings), per_node=ranks_per_node,
                      precision=precision, k=k, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, settings=settings,
                      mode=mode)

    @classmethod
    def known_cause(cls, cfg: dict) -> str:
        s = cfg.get("strategy", {})
        quantized = [what for key, what in (("quantize_weights", "int8 weight all-gathers (qwZ)"),
                                            ("quantize_grads", "int4 gradient reduce-scatters (qgZ)")) if s.get(key)]
        return (f"ZeRO++'s {' and '.join(quantized)} round what they send: the run follows another trajectory "
                "(docs/nodes.md: the loss band)") if quantized else ""

    @classmethod
    def lossy(cls, cfg: dict):
        """qwZ and qgZ round what they send: the report holds the run within its loss band. qwZ's
        forward computes with int8-rounded weights (L = 127); qgZ rounds only the gradients. A bf16
        master or state (base.py) is lossy too, and named beside them."""
        from zerolab.strategies.base import Lossy
        from zerolab.strategies.zero.quantized import LEVELS

        cause = cls.known_cause(cfg)
        weights = cfg.get("strategy", {}).get("quantize_weights")
        stored = super().lossy(cfg)  # a bf16 master or state (base.py)
        if not cause:
            return stored
        what = cause + (f"; {stored.what}" if stored else "")
        return Lossy("quantized", what, forward_levels=LEVELS[8] if weights else 0)
