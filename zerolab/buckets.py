"""How zerolab's sharders pack parameters into communication buckets, and how many may be alive.

Shared by the strategies that run it (zerolab/strategies/zero/) and by their memory model
(zerolab/strategies/zero/memory.py), so the ledger's bucket sizes and its bounds on the buckets
alive at once are the sharder's own, not a second copy of the rule: this module sits below both.
"""
from __future__ import annotations

import math

# zero2 and zero3: gradient buckets whose reduce-scatter may be in flight before backward waits for
# the oldest. Why a bound: each in-flight bucket holds a full-size gradient copy, so without one a
# backward that outruns the network would hold the whole gradient, which zero2 exists to avoid.
# Why 4: enough queued collectives that a backward a few buckets ahead of the network keeps
# computing (the overlap), while the copies stay a handful of buckets (MAX_IN_FLIGHT + 1 in flight
# plus the one filling); the memory model adds exactly that many (strategies/zero/memory.py).
MAX_IN_FLIGHT = 4
# zero3: buckets gathered or being gathered (full-size weight buffers) above which the next unit is
# not prefetched. Why a bound: a prefetch allocates the next unit's weights before the running one
# is freed, so the live weights are the running unit, the root (gathered for the whole forward)
# and the prefetch; unbounded, a model whose units span many buckets could hold far more. Why 12:
# those three units of up to four buckets each (at strategy.bucket_mb's default 25 MiB, four bf16
# buckets are a block of about 52M parameters) still overlap the prefetch, and the bound stays a
# fixed number of buckets the memory model can add up (the 12 largest).
MAX_LIVE_BUCKETS = 12


def pack_buckets(tensors: list[tuple[int, int]], cap: int) -> list[tuple[int, list[int]]]:
    """Bucket packing. `tensors` lists (param group, numel) in registration order. Greedy in
    reverse registration order (≈ the order gradients become ready in backward), one open bucket
    per group, closed once it holds `cap` elements. Returns (group, tensor indices) per bucket,
    in the order buckets fill up (launch order)."""
    open_: dict[int, list[int]] = {}
    filled: dict[int, int] = {}
    closed: list[tuple[int, list[int]]] = []
    for i in reversed(range(len(tensors))):
        group, numel = tensors[i]
        open_.setdefault(group, []).append(i)
        filled[group] = filled.get(group, 0) + numel
        if filled[group] >= cap:
            closed.append((group, open_.pop(group)))
            filled[group] = 0
    # the rest, by when their last tensor arrives (lowest registration index = latest gradient)
    return closed + sorted(open_.items(), key=lambda kv: -kv[1][-1])


def pack_units(tensors: list[tuple[int, int, int]], cap: int, world: int) -> list[tuple[int, int, list[int], int]]:
    """Buckets of zero3: `tensors` lists (param group, numel, unit) in unit order (root = unit 0,
    then the blocks), registration order within a unit. Each unit is packed alone by pack_buckets's
    rule, last block first and the root last, and each bucket is padded to a multiple of `world`
    (the shards). Returns (unit, group, tensor indices, padded size) per bucket, in launch order.
    The sharder builds its buckets from this and the memory model predicts them from it."""
    n_units = 1 + max((u for _, _, u in tensors), default=0)
    out = []
    for ui in [*range(n_units - 1, 0, -1), 0]:
        index = [i for i, (_, _, u) in enumerate(tensors) if u == ui]
        for gi, members in pack_buckets([(tensors[i][0], tensors[i][1]) for i in index], cap):
            total = sum(tensors[index[m]][1] for m in members)
            out.append((ui, gi, [index[m] for m in members], -(-total // world) * world))
    return out


def bucket_cap(bucket_mb: float, element_bytes: int) -> int:
    """Elements per bucket for strategy.bucket_mb (MiB) of `element_bytes`-byte elements, at least one."""
    return max(1, int(bucket_mb * 2 ** 20 / element_bytes))


def zero_buckets(shape, world: int, compute_bytes: int, bucket_mb: float) -> list[int]:
    """Padded bucket sizes (elements) of zerolab's sharder for a zerolab.memory.ModelShape: its
    packing (pack_buckets, `bucket_mb` of compute-dtype elements per bucket), each bucket padded
    to a multiple of N."""
    cap = bucket_cap(bucket_mb, compute_bytes)
    numels = [math.prod(s) for _, s in shape.tensors]
    buckets = pack_buckets([(g, n) for (g, _), n in zip(shape.tensors, numels)], cap)
    return [-(-sum(numels[i] for i in members) // world) * world for _, members in buckets]
