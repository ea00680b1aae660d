"""The layout of zerolab's own ZeRO: the buckets, who shares a shard, and over which group each
collective runs.

A bucket (Bucket below) is a run of parameters packed into one flat buffer (zerolab/buckets.py
packs them: `pack` for zero1/2, units.py per unit for zero3); it is padded to a multiple of
`shards` and cut into that many equal chunks, and a rank owns one chunk of every bucket. Its
shard of a param group is its chunks of that group's buckets (storage.py).

Ranks are laid out node-major (zerolab.topology): N = per_node x nodes. Three layouts:

  strategy.shard_within=world (the default, the ZeRO paper's): every bucket is cut into N chunks,
      rank r owns chunk r; reduce-scatters and all-gathers run over every rank (group None), so
      with more than one node every one of their bytes crosses nodes (the counter's ring model).
  strategy.shard_within=node (HSDP, FSDP2's 2-D mesh; the same for zero1/2's optimizer state):
      every bucket is cut into n = per_node chunks, local rank l owns chunk l, and the ranks with
      the same local index on the other nodes hold the same chunk (replicas). Reduce-scatters and
      all-gathers run over the node's group ("local"); the gradient shard is averaged across the
      replicas by one all-reduce over the "node" group (the ranks sharing a local index) per step.
  zero3 with ZeRO++'s settings (hpz, quantize_weights, quantize_grads) keeps the world-wide
      shards and needs both subgroups: hpZ's secondary copy is gathered over the node's group,
      qgZ's all-to-all runs inside the node, then across.

The subgroups come from ctx.node_mesh() (every rank builds it in the same order) and only when a
setting needs them, so the default layout creates no group and runs the collectives it always did.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from zerolab.buckets import pack_buckets
from zerolab.errors import ConfigError, ZerolabError, launch_rank
from zerolab.topology import topology_for

log = logging.getLogger("zerolab")

SHARD_WITHIN = ("world", "node")
ZERO_PLUS_PLUS = ("hpz", "quantize_weights", "quantize_grads")  # zero3's settings, world-wide shards only


@dataclass
class Bucket:
    group: int  # param group index
    params: list  # [(param, tensor index in group, offset in bucket)]
    size: int  # padded to a multiple of the shards
    shard_pos: int  # where this bucket's chunk sits in its slab of the rank's group shard
    shards: int  # the bucket is `shards` chunks of `chunk` elements (N, or a node's ranks: NodeLayout)
    slab: int = 0  # which flat slab of the group's shard holds its chunk (zero1/2: one per bucket; zero3: one)
    index: int = 0  # its place in the sharder's bucket list (the reduce-scatters' launch order)
    flat_params: Optional[torch.Tensor] = None  # compute-dtype buffer the params view into
    flat_grads: Optional[torch.Tensor] = None  # zero1: the whole gradients, a buffer the grads view into
    comm_buf: Optional[torch.Tensor] = None  # zero2, zero3: in-flight gradient copy
    arrived: int = 0  # gradients complete in this backward
    chunk: int = field(init=False)  # elements per chunk (a plain field: read on every collective)

    def __post_init__(self):
        self.chunk = self.size // self.shards

    def flatten(self, whole_grads: bool = False) -> None:
        """Make the bucket's params views into one flat buffer, so an all-gather lands in place;
        `whole_grads` (zero1, which keeps them between steps): their gradients too, so a bucket is
        reduce-scattered in place."""
        p0 = self.params[0][0]
        self.flat_params = torch.zeros(self.size, dtype=p0.dtype, device=p0.device)
        for p, _, off in self.params:
            self.flat_params[off:off + p.numel()].copy_(p.data.view(-1))
            p.data = self.flat_params[off:off + p.numel()].view_as(p)
        if whole_grads:
            self.flat_grads = torch.zeros_like(self.flat_params)
            for p, _, off in self.params:
                p.grad = self.flat_grads[off:off + p.numel()].view_as(p)


def make_bucket(members: list, *, group: int, shards: int, index: int, shard_pos: int = 0, slab: int = 0,
                whole_grads: bool = False) -> Bucket:
    """A bucket of `members` ([(param, tensor index in its group)]), padded to a multiple of `shards`
    and flattened (Bucket.flatten)."""
    offsets, total = [], 0
    for p, ti in members:
        offsets.append((p, ti, total))
        total += p.numel()
    b = Bucket(group=group, params=offsets, size=-(-total // shards) * shards, shard_pos=shard_pos, shards=shards,
               slab=slab, index=index)
    b.flatten(whole_grads)
    return b


def pack(model, param_groups: list[dict], shards: int, cap: int, whole_grads: bool) -> list[Bucket]:
    """zero1/2's buckets: the param groups' tensors in the order their gradients become ready
    (zerolab.buckets.pack_buckets), one slab per bucket; each bucket is flattened."""
    order = {id(p): i for i, p in enumerate(model.parameters())}
    entries = sorted(((order[id(p)], gi, ti, p) for gi, g in enumerate(param_groups)
                      for ti, p in enumerate(g["params"])), key=lambda e: e[0])
    slabs, buckets = [0] * len(param_groups), []
    for gi, members in pack_buckets([(gi, p.numel()) for _, gi, _, p in entries], cap):
        buckets.append(make_bucket([(entries[i][3], entries[i][2]) for i in members], group=gi, shards=shards,
                                   index=len(buckets), slab=slabs[gi], whole_grads=whole_grads))
        slabs[gi] += 1
    return buckets


@dataclass
class NodeLayout:
    """Where this rank's shard lives and which groups its collectives use (module docstring)."""
    shards: int  # ranks one bucket is cut over: N, or per_node under shard_within=node
    shard_rank: int  # which chunk of every bucket this rank owns
    shard_group: Optional[Any] = None  # the group of the reduce-scatters and all-gathers; None: every rank
    replica_group: Optional[Any] = None  # HSDP across nodes: the ranks holding this rank's chunk
    replica: int = 0  # which replica this rank's shard is (its node under HSDP; 0 otherwise)
    local_group: Optional[Any] = None  # this rank's node (hpZ, qgZ); None when the node is the world
    cross_group: Optional[Any] = None  # the ranks with this local index on every node (qgZ); None on one node
    per_node: int = 1
    nodes: int = 1
    local_rank: int = 0


def layout_for(ctx, settings) -> NodeLayout:
    """The layout of a zerolab ZeRO run from its context (ctx.topology) and settings."""
    t, rank = ctx.topology, ctx.rank
    base = dict(per_node=t.per_node, nodes=t.nodes, local_rank=t.local_of(rank))
    hsdp = getattr(settings, "shard_within", "world") == "node"
    plus = any(getattr(settings, k, False) for k in ZERO_PLUS_PLUS)
    if t.nodes == 1 or not (hsdp or plus):  # one node: the node is the world
        return NodeLayout(shards=ctx.world_size, shard_rank=rank, **base)
    local, cross = _node_groups(ctx)
    if hsdp:
        return NodeLayout(shards=t.per_node, shard_rank=t.local_of(rank), shard_group=local, replica_group=cross,
                          replica=t.node_of(rank), local_group=local, cross_group=cross, **base)
    return NodeLayout(shards=ctx.world_size, shard_rank=rank, local_group=local, cross_group=cross, **base)


def _node_groups(ctx) -> tuple[Any, Any]:
    """(this rank's node, the ranks with its local index on every node) from ctx.node_mesh(),
    checked against the topology the comm counter books links by: the mesh must lay ranks out
    node-major, as torchrun and Slurm number them."""
    t, rank = ctx.topology, ctx.rank
    mesh = ctx.node_mesh()
    local, cross = mesh.get_group("local"), mesh.get_group("node")
    want = (t.node_ranks(t.node_of(rank)), t.cross_ranks(t.local_of(rank)))
    got = (dist.get_process_group_ranks(local), dist.get_process_group_ranks(cross))
    if [list(g) for g in got] != [list(w) for w in want]:
        raise ZerolabError(f"rank {rank}: the node mesh's groups {got} are not the topology's {want} "
                           f"(ranks per node {t.per_node}, node-major)")
    return local, cross


def shards_for(world: int, ranks_per_node: int, settings: dict) -> int:
    """What NodeLayout.shards will be, for the memory ledger (settings: the strategy section as a dict)."""
    return ranks_per_node if settings.get("shard_within", "world") == "node" else world


def check_node_settings(cfg, world: int, stage: int) -> None:
    """Refuse, before any rank starts, a node setting the chosen zerolab sharder cannot honour,
    naming the fix; warn where a setting costs memory and saves nothing on this layout."""
    s = cfg.strategy
    if s.shard_within not in SHARD_WITHIN:
        raise ConfigError(f"strategy.shard_within={s.shard_within!r} is not valid; allowed values: world (shard over "
                          "every rank), node (shard inside each node, replicate across nodes: HSDP)")
    if stage == 3 and (s.quant_block < 2 or s.quant_block % 2):  # zero1/2 read no quant_block (config warns)
        raise ConfigError(f"strategy.quant_block={s.quant_block} must be an even number >= 2 (int4 blocks pack two "
                          "elements per byte), e.g. 256")
    on = [k for k in ZERO_PLUS_PLUS if getattr(s, k)]
    if not on:
        return
    names = ", ".join(f"strategy.{k}=true" for k in on)
    if stage < 3:
        raise ConfigError(f"{names}: ZeRO++'s settings change zero3's weight all-gathers and gradient "
                          f"reduce-scatter; strategy={s.name} keeps whole weights. Use strategy=zero3, or for "
                          f"{s.name} across nodes strategy.shard_within=node (optimizer state sharded inside a node)")
    if s.shard_within == "node":
        raise ConfigError(f"{names} with strategy.shard_within=node: under HSDP only the gradient all-reduce "
                          "crosses nodes, and ZeRO++'s settings act on zero3's world-wide collectives. Use "
                          "strategy.shard_within=world with them, or HSDP alone")
    if s.hpz and not s.reshard_after_forward:
        raise ConfigError("strategy.hpz=true with strategy.reshard_after_forward=false: a unit kept gathered from "
                          "its forward to its backward needs no backward all-gather, which is all hpZ changes. "
                          "Use strategy.reshard_after_forward=true with hpz, or hpz=false")
    topology = topology_for(cfg.dist.ranks_per_node, world)
    if s.hpz and topology.nodes == 1 and launch_rank() == 0:
        log.warning("strategy.hpz=true on one node (%d ranks per node): every all-gather already stays inside the "
                    "node; the secondary copy costs 1/%d of the weights per rank and saves no cross-node byte "
                    "(set dist.ranks_per_node to lay out nodes, docs/nodes.md)", topology.per_node, topology.per_node)
