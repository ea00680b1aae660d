"""How zerolab's sharders pack parameters into communication buckets.

Shared by the strategies that run it (strategies/zero.py) and by their memory predictions, so
the ledger's bucket sizes are the sharder's own, not a second implementation of the rule.
"""
from __future__ import annotations

import math

MAX_IN_FLIGHT = 4  # zero2: reduce-scatters allowed in flight before backward waits for the oldest


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
