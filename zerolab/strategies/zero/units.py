"""zerolab's ZeRO-3 weights (stage3.py's part): the model cut into units, each gathered just before
it runs and freed after it.

Units. Each of the model's repeated blocks is one (zerolab.models.find_blocks: the GPT's `blocks`,
a transformers model's `model.layers` or `transformer.h`, or model.blocks), and the "root" unit
holds every other parameter (the embeddings, tied LM head and final norm; all of a model without
blocks). Buckets are packed per unit, so a unit's weights are exactly its buckets. The model's
parameters stay views into each bucket's full-size flat buffer, as in zero1/2, but that buffer's
storage is resized to 0 bytes while the unit is not in use: the parameters keep their shapes and
names (so state_dict, checkpoints and the memory ledger see the usual model) but hold no memory.
An all-gather resizes the storage back and writes the chunks of every rank into it (from this
rank's persistent chunks, storage.py); the views see the new memory because they share the
storage object, not its address.

Per micro-batch, for every unit:
  forward   a pre-hook all-gathers the unit (and starts the next unit's all-gather, the prefetch,
            while this one computes); a post-hook frees it again when
            strategy.reshard_after_forward=true, and hooks the unit's output tensor(s).
  backward  the output hook fires when the gradient of the unit's output is complete, i.e. just
            before the unit's own backward starts: it all-gathers the unit again (a no-op when it
            was kept) and prefetches the next unit in backward order. Autograd saved the weights
            as views of the same storage, so backward reads the re-gathered values. When the last
            parameter of the unit has its gradient (after the reduction took it: reduce.py),
            nothing will read the unit's weights again and it is freed.

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
Evaluation runs forward under torch.no_grad(): no backward follows, so every unit (the root
included) is freed right after its forward whatever reshard_after_forward says. Between steps no
unit is gathered. Collectives are issued from hooks at the same points of the same graph on every
rank, and every prefetch decision depends only on that history, so all ranks issue them in one order.

ZeRO++ (Wang et al. 2023): strategy.hpz=true copies, after each forward all-gather, this rank's 1/n
of every gathered bucket (n ranks per node) into a secondary copy, and the backward all-gathers
that copy over the node instead of the primary chunks over every rank (the same values, no
cross-node byte); quantize_weights sends the primary all-gathers as int8 blocks (quantized.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zerolab.buckets import MAX_LIVE_BUCKETS, pack_units
from zerolab.comm import InFlight
from zerolab.models import block_of_parameters, find_blocks
from zerolab.models.recompute import tensors_in
from zerolab.strategies.zero.layout import make_bucket
from zerolab.strategies.zero.quantized import gather_quantized


@dataclass
class Unit:
    name: str  # "root" or the block's module name, e.g. "blocks.3"
    module: nn.Module
    params: list  # trainable parameters this unit owns
    buckets: list[int] = field(default_factory=list)  # indices into the sharder's buckets
    arrived: int = 0  # parameters whose gradient is complete in this backward


def make_units(model: nn.Module, param_groups: list[dict], blocks: str) -> list[Unit]:
    """[root, blocks.0, blocks.1, ...] in forward order, the blocks being the model's repeated
    blocks (zerolab.models.find_blocks, or `blocks`: model.blocks). A parameter goes to a block only
    if every name it is registered under lies inside that one block; anything shared between
    units, or registered outside the blocks, goes to the root (block_of_parameters)."""
    found = find_blocks(model, blocks)
    modules = list(found.modules) if found is not None else []
    units = [Unit("root", model, [])] + [Unit(f"{found.name}.{i}", b, []) for i, b in enumerate(modules)]
    block_of = block_of_parameters(model, blocks)
    trainable = {id(p) for g in param_groups for p in g["params"]}
    for p in model.parameters():  # registration order; frozen parameters stay whole, in no unit
        if id(p) in trainable:
            units[block_of[id(p)] + 1].params.append(p)
    return units


def unit_buckets(units: list[Unit], param_groups: list[dict], shards: int, cap: int) -> list:
    """zero1/2's packing run unit by unit, so that no bucket spans two units (pack_units), one slab
    per group. The list is in the order backward completes the units (last block first, the root
    last, because the tied embedding's gradient is the last of all): the reduce-scatter launch order."""
    where = {id(p): (gi, ti) for gi, g in enumerate(param_groups) for ti, p in enumerate(g["params"])}
    params = [p for unit in units for p in unit.params]
    tensors = [(where[id(p)][0], p.numel(), ui) for ui, unit in enumerate(units) for p in unit.params]
    shard_pos, buckets = [0] * len(param_groups), []
    for ui, gi, members, _ in pack_units(tensors, cap, shards):
        b = make_bucket([(params[m], where[id(params[m])][1]) for m in members], group=gi, shards=shards,
                        index=len(buckets), shard_pos=shard_pos[gi])
        shard_pos[gi] += b.chunk
        units[ui].buckets.append(b.index)
        buckets.append(b)
    return buckets


class Units:
    """The model's weights under zero3: only this rank's chunks persist; a unit's buckets are
    gathered for its forward and backward and freed after (module docstring)."""

    def __init__(self, units: list[Unit], buckets, shard, *, layout, settings, comm, transient, compute_dtype,
                 device):
        self.units, self.buckets, self.shard, self.layout = units, buckets, shard, layout
        self.comm, self.transient, self.settings = comm, transient, settings
        self.unit_of = {id(p): u for u in units for p in u.params}
        # this rank's persistent chunk of every bucket, where the storage keeps it (storage.py)
        self.chunks = [shard.persistent_chunk(b) for b in buckets]
        self.place = shard.weights_place
        self.in_flight = InFlight()  # all-gathers by bucket index
        self.live: set[int] = set()  # buckets whose full buffer exists (gathered or in flight)
        self.in_backward = False  # between the first unit's backward gather and the end of backward
        self.secondary = self._make_secondary(compute_dtype, device)  # hpZ; [] without it
        self.weight_error: dict[int, torch.Tensor] = {}  # qwZ: bucket -> bound² on its ‖ŵ − w‖ (last gather)
        for unit in units:
            for p in unit.params:  # after the reduction's hook on each (ZeroBase.setup registers it first)
                p.register_post_accumulate_grad_hook(self._arrived)
        for i in range(len(buckets)):  # from now on only the chunks persist
            self._free_bucket(i)
        for i, unit in enumerate(units):
            if unit.buckets:
                unit.module.register_forward_pre_hook(lambda _m, _args, i=i: self._before_forward(i))
                unit.module.register_forward_hook(lambda _m, _args, out, i=i: self._after_forward(i, out))

    # ---- what the sharder asks (ZeroBase) -----------------------------------------------------
    def follow(self, wait: bool = True) -> None:
        """The shard changed (a step, a loaded checkpoint): the persistent chunks follow it; the next
        forward gathers them, so nothing is gathered here."""
        self.shard.refresh()

    def wait(self) -> None:
        self._wait()

    def end_backward(self) -> None:
        """Units with unused parameters never completed: free them here."""
        self.in_backward = False
        for unit in self.units:
            self._free(unit)
            unit.arrived = 0

    def report(self, info, measure) -> None:
        """qwZ, a logged step: the loss band's forward term (docs/nodes.md)."""
        if measure and self.weight_error:
            info.extra["qwz_weight_error_bound"] = math.sqrt(sum(self.weight_error.values()).item())

    def count(self, c) -> None:
        """The gathered buckets (none between steps) and hpZ's secondary copy."""
        c.add("params", (b.flat_params for b in self.buckets)).add("params", self.secondary)

    # ---- gathering and freeing units ------------------------------------------------------------
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
            self.live.add(i)
            if self.secondary and self.in_backward:
                group, chunk, nbytes = self.layout.local_group, self.secondary[i], 0
            else:  # the persistent chunk, copied to the device first where it lives on the host
                group, (chunk, nbytes) = self.layout.shard_group, self.place.for_gather(self.chunks[i])
                if nbytes:
                    self.transient.alloc(nbytes, "backward")
                if self.settings.quantize_weights:
                    work, keep, finish = gather_quantized(b.flat_params, chunk, group, self.layout.shards,
                                                          self.settings.quant_block, self.comm, self.transient)
                    self.in_flight.add(i, work, keep, nbytes,
                                       lambda i=i, finish=finish: self.weight_error.__setitem__(i, finish()))
                    continue
            self.comm.record("all_gather", b.flat_params, group=group)
            self.in_flight.add(i, dist.all_gather_single(b.flat_params, chunk, group=group, async_op=True), chunk,
                               nbytes)

    def _wait(self, indices=None) -> None:
        freed = self.in_flight.wait(indices)
        if freed:
            self.transient.free(freed)

    def _make_secondary(self, dtype, device) -> list[torch.Tensor]:
        """hpZ: one compute-dtype buffer of 1/per_node of every bucket, a view per bucket."""
        if not self.settings.hpz:
            return []
        n = self.layout.per_node
        flat = torch.zeros(sum(b.size for b in self.buckets) // n, dtype=dtype, device=device)
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
        self._wait([i])  # never take memory from under a collective still writing it
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

    # ---- the hooks --------------------------------------------------------------------------------
    def _before_forward(self, index: int) -> None:
        unit = self.units[index]
        self._gather(unit)
        self._prefetch(index + 1 if index + 1 < len(self.units) else None)
        self._wait(unit.buckets)
        if self.secondary and torch.is_grad_enabled() and not self.in_backward:  # (not a recompute in backward)
            self._keep_secondary(unit)

    def _after_forward(self, index: int, output) -> None:
        unit = self.units[index]
        training = torch.is_grad_enabled()
        if self.settings.reshard_after_forward or not training:
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
        self._wait(unit.buckets)

    def _arrived(self, p: torch.Tensor) -> None:
        unit = self.unit_of[id(p)]
        unit.arrived += 1
        if unit.arrived == len(unit.params):
            # Every autograd node that read these weights ran before this last gradient was
            # accumulated: the unit's backward is over.
            self._free(unit)
