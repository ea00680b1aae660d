"""zerolab's ZeRO-1/2/3 state going out and coming in: this rank's shard as name-keyed pieces
(checkpoint_format "pieces"), by parameter name and element range, so a checkpoint of N ranks of
any of ddp, zero1, zero2, zero3 loads into M ranks of any other (zerolab/checkpoint/reshard.py
reads the ranges); and the full fp32 weights gathered bucket by bucket (consolidated_state_dict).

Mixed into ZeroBase (base.py), whose layout it reads: `groups` (each a FlatGroup of pieces,
segments and names), the optimizer, and `_weights_follow_shard` (zero1/2 all-gather the loaded
shard into the model; zero3 refreshes its persistent chunks).

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


class ZeroPieces:
    def _pieces(self, write_back: bool = False):
        """(group, segment, {kind: the tensor of its piece}) for every segment this rank owns:
        kind "master" (the shard, in fp32: rebuilt where precision.master stores it otherwise, so
        a checkpoint holds the exact fp32 master in every mode) and every per-element optimizer
        state (in its stored dtype). `write_back`: the masters were written into, store them."""
        for g in self.groups:
            tensors = []
            for k, piece in enumerate(g.pieces):
                state = self.optimizer.state.get(piece, {})
                tensors.append({"master": g.storage.fp32(k),
                                **{kind: v for kind, v in state.items() if is_element_state(v, like=piece)}})
            for s in g.segments:
                yield g, s, tensors[s.piece]
            if write_back:
                for k, t in enumerate(tensors):
                    g.storage.store(k, t["master"])

    def checkpoint_state(self) -> dict[str, ShardPiece]:
        self._wait_gathers()
        if self.layout.replica:  # another node holds the same shards and writes them (module docstring)
            return {}
        out = {}
        for g, s, tensors in self._pieces():
            name = g.names[s.tensor]
            shape = tuple(self._param_by_name[name].shape)
            for kind, t in tensors.items():
                out[f"{kind}/{name}"] = ShardPiece(t[s.start:s.end].detach().clone().cpu(), s.offset,
                                                   s.offset + s.end - s.start, shape)
        return out

    @torch.no_grad()
    def load_checkpoint_state(self, read) -> None:
        self._materialise_optimizer_state()
        for g, s, tensors in self._pieces(write_back=True):
            name = g.names[s.tensor]
            for kind, t in tensors.items():
                t[s.start:s.end].copy_(read(f"{kind}/{name}", s.offset, s.offset + s.end - s.start))
        self._weights_follow_shard()

    def _materialise_optimizer_state(self) -> None:
        """A fresh optimizer has no state to load into: one update with zero gradients and lr 0
        creates it (and changes no weight); the loaded values then overwrite it."""
        if all(self.optimizer.state.get(piece) for g in self.groups for piece in g.pieces):
            return
        saved = [(grp["lr"], grp.get("weight_decay", 0.0)) for grp in self.optimizer.param_groups]
        for grp in self.optimizer.param_groups:
            grp["lr"] = 0.0
        for grad in self._all_grad_shards():
            grad.zero_()
        with self._fp32_grads():  # (the optimizer reads fp32 gradients)
            self.optimizer.step()
        for grp, (lr, _) in zip(self.optimizer.param_groups, saved):
            grp["lr"] = lr

    @property
    def _param_by_name(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """All-gather the fp32 master one bucket at a time (collective); rank 0 copies that
        bucket's tensors out before the next one is gathered, so no rank ever holds a full-model
        buffer: beside rank 0's copies, the transient is one bucket, at the end of a run, when a
        large model has the least room. Under HSDP only node 0 gathers (over its own group)."""
        self._wait_gathers()
        if self.layout.replica:
            return None
        main = self.ctx.is_main
        state = self.model.state_dict(keep_vars=True)
        names: dict[int, list[str]] = {}
        for name, t in state.items():
            names.setdefault(id(t), []).append(name)  # a tied weight has two names: two copies
        out = {}
        for b in self.buckets:
            chunk = self.groups[b.group].storage.fp32(b.piece, b.shard_pos, b.shard_pos + b.chunk)
            full = torch.empty(b.size, dtype=self.shard_dtype, device=self.ctx.device)
            dist.all_gather_single(full, chunk.to(self.ctx.device).contiguous(), group=self.shard_group)
            if main:
                for p, _, off in b.params:
                    for name in names.get(id(p), ()):
                        out[name] = full[off:off + p.numel()].view(p.shape).float().cpu().clone()
            del full
        if not main:
            return None
        return {name: out[name] if name in out else t.detach().float().cpu().clone() for name, t in state.items()}
