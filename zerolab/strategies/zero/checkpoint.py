"""zerolab's ZeRO-1/2/3 state going out and coming in: this rank's shard as name-keyed pieces
(checkpoint_format "pieces"), by parameter name and element range, so a checkpoint of N ranks of
any of ddp, zero1, zero2, zero3 loads into M ranks of any other (zerolab/checkpoint/reshard.py
reads the ranges); and the full fp32 weights gathered bucket by bucket (consolidated).

A part of the sharder (base.py composes it): it reads the shard's groups (storage.py: each
group's slabs, segments, names and master storage), the optimizer's state and the buckets; the
sharder waits for its all-gathers before and makes the weights follow a loaded shard after.

Across nodes (strategy.shard_within=node) every node holds a replica of the shards: the ranks of
node 0 write the pieces (a checkpoint's pieces tile each tensor once), the others write their
rank files without pieces (RNG, buffers), and every rank loads the ranges its chunks cover, so a
hierarchical run's checkpoint loads into any world size, node count and layout, and back.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from zerolab.accounting import is_element_state
from zerolab.strategies.base import ShardPiece


class ShardCheckpoint:
    """This rank's shard as checkpoint pieces, and the full weights gathered (module docstring)."""

    def __init__(self, shard, optimizer, model, buckets, *, layout, ctx, dtype):
        """`dtype`: the dtype the optimizer updates (a gathered bucket's)."""
        self.shard, self.optimizer, self.model, self.buckets = shard, optimizer, model, buckets
        self.layout, self.ctx, self.dtype = layout, ctx, dtype

    def _tensors(self, write_back: bool = False):
        """(group, segment, {kind: the tensor of its slab}) for every segment this rank owns: kind
        "master" (the shard, in fp32: rebuilt where precision.master stores it otherwise, so a
        checkpoint holds the exact fp32 master in every mode) and every per-element optimizer state
        (in its stored dtype). `write_back`: the masters were written into, store them."""
        for g in self.shard.groups:
            tensors = []
            for k, slab in enumerate(g.slabs):
                state = self.optimizer.state.get(slab, {})
                tensors.append({"master": g.master.fp32(k),
                                **{kind: v for kind, v in state.items() if is_element_state(v, like=slab)}})
            for s in g.segments:
                yield g, s, tensors[s.slab]
            if write_back:
                for k, t in enumerate(tensors):
                    g.master.store(k, t["master"])

    def state(self) -> dict[str, ShardPiece]:
        if self.layout.replica:  # another node holds the same shards and writes them (module docstring)
            return {}
        shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        out = {}
        for g, s, tensors in self._tensors():
            name = g.names[s.tensor]
            for kind, t in tensors.items():
                out[f"{kind}/{name}"] = ShardPiece(t[s.start:s.end].detach().clone().cpu(), s.offset,
                                                   s.offset + s.end - s.start, shapes[name])
        return out

    @torch.no_grad()
    def load(self, read) -> None:
        self._materialise_optimizer_state()
        for g, s, tensors in self._tensors(write_back=True):
            name = g.names[s.tensor]
            for kind, t in tensors.items():
                t[s.start:s.end].copy_(read(f"{kind}/{name}", s.offset, s.offset + s.end - s.start))

    def _materialise_optimizer_state(self) -> None:
        """A fresh optimizer has no state to load into: one update with zero gradients and lr 0
        creates it (and changes no weight); the loaded values then overwrite it."""
        if all(self.optimizer.state.get(slab) for g in self.shard.groups for slab in g.slabs):
            return
        saved = [grp["lr"] for grp in self.optimizer.param_groups]
        for grp in self.optimizer.param_groups:
            grp["lr"] = 0.0
        self.shard.zero_grads()
        with self.shard.fp32_grads():  # (the optimizer reads fp32 gradients)
            self.optimizer.step()
        for grp, lr in zip(self.optimizer.param_groups, saved):
            grp["lr"] = lr

    @torch.no_grad()
    def consolidated(self) -> Optional[dict[str, torch.Tensor]]:
        """All-gather the fp32 master one bucket at a time (collective); rank 0 copies that
        bucket's tensors out before the next one is gathered, so no rank ever holds a full-model
        buffer: beside rank 0's copies, the transient is one bucket, at the end of a run, when a
        large model has the least room. Under HSDP only node 0 gathers (over its own group)."""
        if self.layout.replica:
            return None
        main = self.ctx.is_main
        state = self.model.state_dict(keep_vars=True)
        names: dict[int, list[str]] = {}
        for name, t in state.items():
            names.setdefault(id(t), []).append(name)  # a tied weight has two names: two copies
        out = {}
        for b in self.buckets:
            chunk = self.shard.groups[b.group].master.fp32(b.slab, b.shard_pos, b.shard_pos + b.chunk)
            full = torch.empty(b.size, dtype=self.dtype, device=self.ctx.device)
            dist.all_gather_single(full, chunk.to(self.ctx.device).contiguous(), group=self.layout.shard_group)
            if main:
                for p, _, off in b.params:
                    for name in names.get(id(p), ()):
                        out[name] = full[off:off + p.numel()].view(p.shape).float().cpu().clone()
            del full
        if not main:
            return None
        return {name: out[name] if name in out else t.detach().float().cpu().clone() for name, t in state.items()}
