"""The memory model of zerolab's own ZeRO (zero1/2 in stages.py, zero3 in stage3.py): what memory()
measures between steps, term by term, predicted from the same packing the sharder runs
(zerolab/buckets.py, below both: the sharder imports nothing from here but the two predict_
functions its classes' predict_memory calls).

`shards` is the number of chunks a bucket is cut into: N, or the ranks of a node under
strategy.shard_within=node (layout.py); the buckets are padded to multiples of it and a
rank's shard is 1/shards of them. zero3 adds hpZ's secondary copy (1/per_node of the padded
buckets, in compute dtype: 2Ψ/n bytes in bf16, counted as params) and the wire buffers of the
quantized collectives (transients, quantized.py).
"""
from __future__ import annotations

import math

from zerolab.accounting import MIXED, dtype_name, fmt_n, state_bytes
from zerolab.buckets import MAX_IN_FLIGHT, MAX_LIVE_BUCKETS, bucket_cap, pack_units, zero_buckets
from zerolab.precision import COMPUTE_BYTES
from zerolab.precision_modes import Mode, master_term, working_bytes_per_element
from zerolab.strategies.zero.quantized import wire_bytes

def _fp32_floor_notes(p, whole_grads: bool, view: bool, dt: str, sd: str, s: int, c: int, pad: int) -> None:
    paper = "4Ψ + KΨ/N" if whole_grads else "2Ψ + (2 + K)Ψ/N"
    why = []
    if not view:
        why.append(f"zerolab keeps an {sd} gradient shard ({s}Ψ/N) on top of the whole gradients (the paper "
                   "reduces into them, no shard)" if whole_grads else
                   f"zerolab's gradient shard is {sd} ({s}Ψ/N) where the paper's is {c}-byte ({c}Ψ/N)")
    if pad:
        why.append("buckets are padded to multiples of N")
    p.why = "; ".join(why)
    if view:
        p.notes.append(f"the shard the optimizer updates is a view of this rank's chunk of the {dt} weights (no "
                       "master copy)" + (", and the gradient shard a view of its chunk of the whole gradients"
                                         if whole_grads else ""))
    else:
        p.notes.append(f"vs the paper ({paper} in mixed precision): the gradient shard is fp32 (4Ψ/N)"
                       + (" on top of the whole 16-bit gradients" if whole_grads else " rather than 16-bit (2Ψ/N)"))


def predict_zero12(p, shape, *, whole_grads: bool, shards: int, precision: str, k: float, bucket_mb: float,
                   reduce_dtype: str, hsdp: bool, mode: Mode = Mode(), offload: bool = False) -> None:
    """zero1/zero2 (stages.py): every bucket padded to a multiple of `shards`, one chunk owned; the
    shard the optimizer updates, its gradient and the optimizer state exist for the owned chunks
    only; `whole_grads`: zero1 keeps the whole gradients between steps, zero2 only their shard.
    The shard is an fp32 master copy in mixed precision and a view of the weights where they are
    in the dtype it updates (fp32, bf16_pure), as is zero1's gradient shard then. `offload`
    (strategy.offload_optimizer, host.py): the shard, its gradient and state on the host, the
    shard a copy of its own there."""
    n, c, dt, N = shape.n_params, COMPUTE_BYTES[precision], dtype_name(precision), shards
    sizes = zero_buckets(shape, N, c, bucket_mb)
    padded, shard = sum(sizes), sum(sizes) // N
    pad = padded - n
    s = state_bytes(precision)  # the shard's bytes per element: fp32, or bf16 in bf16_pure
    sd = "bf16" if s == 2 else "fp32"
    view = s == c and not offload  # the shard is the weights' own owned chunk (fp32 training, bf16_pure)
    place = "host" if offload else "device"
    p.add("params", n * c, f"{dt} weights, whole, views into per-bucket flat buffers: Ψ × {c}")
    if pad:
        p.add("params", pad * c, f"padding of {len(sizes)} bucket(s) to multiples of N: {fmt_n(pad)} × {c}")
    if whole_grads:
        p.add("grads", padded * c, f"{dt} gradients, whole, views into per-bucket flat buffers "
                                   f"(kept between steps): {fmt_n(padded)} × {c}"
                                   + (" (the owned chunks are the gradient shard)" if view else ""))
    if mode.grad_shard == "bf16":  # precision.grad_shard=bf16: fp32 copies for the step only
        if not whole_grads:
            p.add("grads", shard * c, f"{dt} gradient shard (the owned chunks, precision.grad_shard=bf16): "
                                      f"{fmt_n(shard)} × {c}")
        p.add("transient", shard * 4, f"fp32 copy of the {dt} gradient shard for the optimizer, during the step"
                                      + (" (zero1's shard is its chunk of the whole gradients)" if whole_grads else "")
                                      + f": {fmt_n(shard)} × 4", when="step")
    elif not (whole_grads and view):
        p.add("grads", shard * s, f"{sd} gradient shard (the owned chunks): {fmt_n(shard)} × {s}", place=place)
    if offload and s == c:  # fp32, bf16_pure: the weights' own dtype, a copy on the host
        p.add("master", shard * s, f"{sd} shard the optimizer updates, on the host (a copy of the owned chunks of "
                                   f"the weights): {fmt_n(shard)} × {s}", place=place)
    elif not view:
        master_term(p, shard, mode, "shard the optimizer updates", place)
    _state_and_working_copies(p, shard, k, s, mode, place)
    _zero12_transients(p, sizes, N, 4 if reduce_dtype == "fp32" else c, c, s, whole_grads=whole_grads,
                       offload=offload, gathers_copy=not view and mode.master == "fp32", dt=dt)
    if shape.buffer_bytes:
        p.add("buffers", shape.buffer_bytes, "model buffers")
    _fp32_floor_notes(p, whole_grads, view, dt, sd, s, c, pad)
    if offload:
        p.notes.append(OFFLOAD_NOTE)
    if hsdp:
        p.notes.append(f"strategy.shard_within=node: sharded over the {N} ranks of a node (N = {N} in the terms "
                       "above), replicated on every node; the gradient shard is all-reduced across nodes in place")


def _zero12_transients(p, sizes: list[int], N: int, rb: int, c: int, s: int, *, whole_grads: bool, offload: bool,
                       gathers_copy: bool, dt: str) -> None:
    """zero1/2's buffers alive during part of a step (`rb`: bytes per element of the reduction)."""
    shard = sum(sizes) // N
    if not whole_grads:
        # backward waits once more than MAX_IN_FLIGHT are in flight, i.e. after launching one more
        p.add("transient", min(len(sizes), 2 + MAX_IN_FLIGHT) * max(sizes) * rb,
              "gradient buckets copied for reduce-scatter, freed as each finishes during backward "
              f"(at most MAX_IN_FLIGHT + 1 = {MAX_IN_FLIGHT + 1} in flight plus the one filling)")
    elif rb != c:
        p.add("transient", max(sizes) * rb, "fp32 copy of a bucket for reduce-scatter (strategy.reduce_dtype=fp32)")
    in_flight = min(len(sizes), 1 + MAX_IN_FLIGHT)  # the drain runs after a launch past MAX_IN_FLIGHT
    p.add("transient", in_flight * (max(sizes) // N) * rb,
          f"reduce-scatter outputs (one chunk per bucket) of the {in_flight} bucket(s) in flight during backward")
    if offload:
        _offload_transients(p, max(sizes) // N, in_flight, rb, max(sizes) // N, c, s)
    elif gathers_copy:  # fp32, bf16_pure and a master held in the weights gather in place
        p.add("transient", shard * c, f"{dt} copies of the owned chunks, the all-gather inputs of every bucket "
                                      f"from the optimizer step to the next forward: {fmt_n(shard)} × {c}",
              when="step")


def predict_zero3(p, shape, *, shards: int, per_node: int, precision: str, k: float, bucket_mb: float,
                  reduce_dtype: str, settings: dict, mode: Mode = Mode()) -> None:
    """zero3 (stage3.py), what memory() measures between steps: the persistent chunks and the fp32
    shards of every bucket, packed unit by unit (pack_units) and padded to multiples of `shards`;
    hpZ's secondary copy; the quantized collectives' wire buffers as transients."""
    n, c, dt, N = shape.n_params, COMPUTE_BYTES[precision], dtype_name(precision), shards
    tensors = [(g, math.prod(s_), shape.block_of(i) + 1) for i, (g, s_) in enumerate(shape.tensors)]
    sizes = [size for _, _, _, size in pack_units(tensors, bucket_cap(bucket_mb, c), N)]
    shard = sum(sizes) // N
    s = state_bytes(precision)  # bf16_pure updates a bf16 shard: no fp32 anywhere
    rb = 4 if reduce_dtype == "fp32" else c
    gb = rb if precision in MIXED else s  # the gradient shard is kept in the reduce dtype
    opt, par = settings.get("offload_optimizer", False), settings.get("offload_params", False)
    place = "host" if opt else "device"  # host.py: the optimizer's shard, its gradient and state
    p.add("params", shard * c, f"{dt} weights: this rank's chunk of every bucket, the only persistent copy"
                               + (" (on the host: strategy.offload_params)" if par else "") + f": {fmt_n(shard)} × {c}"
                               + (" (it is the shard the optimizer updates)" if precision not in MIXED
                                  and not (opt and not par) else ""), place="host" if par else "device")
    if settings.get("hpz"):
        p.add("params", sum(sizes) // per_node * c,
              f"hpZ's secondary copy of the {dt} weights, sharded over the node's {per_node} ranks (taken after "
              f"each forward all-gather, read by the backward one): {fmt_n(sum(sizes) // per_node)} × {c}")
    p.add("grads", shard * gb, f"gradient shard in the reduce dtype (reduce-scattered into): {fmt_n(shard)} × {gb}",
          place=place)
    if precision in MIXED:
        master_term(p, shard, mode, "shard the optimizer updates", place)
    elif opt and not par:  # the device keeps its chunks, the host the shard the step updates: a copy
        p.add("master", shard * s, f"the shard the optimizer updates, on the host (the device keeps the weights' "
                                   f"chunks): {fmt_n(shard)} × {s}", place=place)
    if gb != s:
        p.add("transient", shard * s, f"fp32 copy of the gradient shard for the optimizer, during the step: "
                                      f"{fmt_n(shard)} × {s}", when="step", place=place)
    _state_and_working_copies(p, shard, k, s, mode, place)
    largest = sorted(sizes, reverse=True)  # upper bounds: the biggest buckets alive at once
    p.add("transient", sum(largest[:MAX_LIVE_BUCKETS]) * c,
          f"gathered buckets during forward/backward (the running unit, the root and a prefetch: at most "
          f"MAX_LIVE_BUCKETS = {MAX_LIVE_BUCKETS}, bounded by the largest ones; every unit at the end of "
          "forward with strategy.reshard_after_forward=false)")
    p.add("transient", sum(largest[:2 + MAX_IN_FLIGHT]) * rb,
          f"gradient buckets copied for reduce-scatter (at most MAX_IN_FLIGHT + 1 = {MAX_IN_FLIGHT + 1} in flight "
          "plus the one filling)")
    p.add("transient", sum(largest[:1 + MAX_IN_FLIGHT]) // N * rb,
          "reduce-scatter outputs (one chunk per bucket) of the buckets in flight during backward")
    _quantized_transients(p, largest, N, per_node, settings)
    if opt:
        _offload_transients(p, largest[0] // N, min(len(sizes), 1 + MAX_IN_FLIGHT), rb, 0 if par else shard, c, s)
        p.notes.append(OFFLOAD_NOTE)
    if par:
        p.add("transient", sum(largest[:MAX_LIVE_BUCKETS]) // N * c, "this rank's chunks copied from the host for "
              f"the all-gathers in flight (strategy.offload_params; at most {MAX_LIVE_BUCKETS})")
        p.notes.append("strategy.offload_params=true (ZeRO-Infinity, Rajbhandari et al., SC 2021): the persistent "
                       "chunks are on the host; each all-gather copies this rank's chunk to the device first")
    if shape.buffer_bytes:
        p.add("buffers", shape.buffer_bytes, "model buffers")
    _zero3_notes(p, n, sizes, gb, c, precision, N, settings)


def _state_and_working_copies(p, shard: int, k: float, s: int, mode: Mode, place: str = "device") -> None:
    """The optimizer state of the shard (in bf16 with precision.optim_states=bf16), and the fp32
    working copies a step over a stored master or state makes (bounded by the whole shard: an
    elementwise update materialises a chunk at a time, LAMB's a group's shard at once)."""
    ss = 2 if mode.optim_states == "bf16" else s
    p.add("optim_state", shard * k * ss, f"optimizer state of the shard: {fmt_n(shard)} × {k:g} × {ss}"
                                         + (" (precision.optim_states=bf16)" if ss != s else ""), place=place)
    per = working_bytes_per_element(mode, k)
    if per:
        p.add("transient", shard * per, f"fp32 working copies of the stored master/state during the update "
                                        f"(zerolab/optim/stored.py), at most the whole shard: {fmt_n(shard)} × {per:g}",
              when="step", place=place)


OFFLOAD_NOTE = ("strategy.offload_optimizer=true (ZeRO-Offload, Ren et al., USENIX ATC 2021): the shard the "
                "optimizer updates, its gradient and its state are on the host (pinned on CUDA), and the step runs "
                "there; a node's ranks share its host memory")


def _offload_transients(p, chunk: int, in_flight: int, rb: int, rounded: int, c: int, s: int) -> None:
    """What offload moves through the host between the device and the shard: reduced chunks on
    their way down, and the updated weights rounded to the compute dtype on the host on their way
    up (`rounded` elements at once: a bucket's chunk in zero1/2, the shard in zero3)."""
    p.add("transient", in_flight * chunk * rb, f"reduced chunks copied to the host, until added into the gradient "
                                               f"shard (at most the {in_flight} in flight)", place="host")
    if c != s and rounded:
        p.add("transient", rounded * c, "updated weights rounded to the compute dtype on the host, on their way to "
                                        "the device", when="step", place="host")


def _quantized_transients(p, largest: list[int], N: int, per_node: int, settings: dict) -> None:
    block = settings.get("quant_block", 256)
    if settings.get("quantize_weights"):
        wires = [(N + 1) * wire_bytes(size // N, block, 8) for size in largest[:MAX_LIVE_BUCKETS]]
        p.add("transient", sum(wires), "qwZ's int8 wire buffers (this rank's quantized chunk and the gathered "
                                       f"parts) of the buckets gathered at once (at most {MAX_LIVE_BUCKETS})")
    if settings.get("quantize_grads"):
        nodes, size = N // per_node, largest[0]
        hops = [2 * per_node * wire_bytes(nodes * (size // N), block, 4) if per_node > 1 else 0,
                2 * nodes * wire_bytes(size // N, block, 4) if nodes > 1 else 0]
        p.add("transient", max(hops), "qgZ's int4 send and receive buffers of one hop of the largest bucket "
                                      "(the hops run one after the other, one bucket at a time)")


def _zero3_notes(p, n: int, sizes: list[int], gb: int, c: int, precision: str, N: int, settings: dict) -> None:
    why = []
    if gb != c:
        why.append(f"the gradient shard is {gb}-byte ({gb}Ψ/N) where the paper's is {c}-byte ({c}Ψ/N)"
                   + (" (strategy.reduce_dtype=fp32)" if precision in MIXED else ""))
    if sum(sizes) != n:
        why.append("buckets are packed per block and padded to multiples of N")
    p.why = "; ".join(why)
    if precision in MIXED:
        p.notes.append("the gradient shard is kept in the reduce dtype: 16-bit with strategy.reduce_dtype=auto "
                       "(the paper's 2Ψ/N; accumulation sums micro-batches in 16-bit, and the step makes an "
                       "fp32 copy for the optimizer), fp32 with reduce_dtype=fp32 (4Ψ/N, fp32 sums)")
    if settings.get("shard_within") == "node":
        p.notes.append(f"strategy.shard_within=node (HSDP): sharded over the {N} ranks of a node (N = {N} in the "
                       "terms above), replicated on every node")
