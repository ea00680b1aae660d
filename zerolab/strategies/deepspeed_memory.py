"""DeepSpeed's bytes per rank, predicted as DeepSpeed 0.19 allocates them (runtime/zero/stage_1_and_2.py,
stage3.py, partition_parameters.py), for the zero_optimization config a run hands it: zerolab's
settings (strategy.stage, bucket_mb, overlap_comm) with strategy.ds_config_overrides merged over
them, as zerolab/strategies/deepspeed.py builds the real config.

What the prediction follows: `stage`, `reduce_bucket_size` (the backward bucket),
`stage3_param_persistence_threshold` and `stage3_model_persistence_threshold` (small tensors kept
whole on every rank), `stage3_max_reuse_distance` (weights kept gathered from forward to backward
when it reaches the model's elements), `zero_hpz_partition_size` (ZeRO++'s hpZ, stage 3: every tensor's secondary
partition over the n ranks of its group, ds_secondary_tensor), and keys that change no model state
(`overlap_comm`, measured here: with contiguous gradients a rank keeps the same buffers either way;
`allgather_bucket_size`, `contiguous_gradients`, `reduce_scatter`, `round_robin_gradients`,
`stage3_prefetch_bucket_size`).
Offload (zerolab's strategy.offload_optimizer / offload_params, which build `offload_optimizer` /
`offload_param` with device cpu): stages 1 and 2 keep the fp32 master, its fp32 gradient (allocated
once, not inside step() only) and the optimizer state on the host, with a 16-bit copy of the
partition the updated weights go back through, and a staging buffer of the largest tensor on each
side; stage 3 puts the same states on the host by place (and its parameter partitions with
offload_param). Any other override (sub_group_size, nvme, ...) is not modelled: the prediction
says so in a note, naming the keys, and its figures assume DeepSpeed without them.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from zerolab.accounting import ModelShape, ceil_div, dtype_name, fmt_n
from zerolab.precision import COMPUTE_BYTES

# keys of zero_optimization the prediction follows, or that change no model state it counts
FOLLOWED = {"stage", "reduce_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
            "zero_hpz_partition_size", "stage3_max_reuse_distance"}
NO_EFFECT = {"overlap_comm", "allgather_bucket_size", "contiguous_gradients", "reduce_scatter", "round_robin_gradients",
             "stage3_prefetch_bucket_size", "allgather_partitions"}
OFFLOAD = {"offload_optimizer", "offload_param"}  # followed: device cpu (or none)
TOP_NO_EFFECT = {"steps_per_print", "wall_clock_breakdown", "gradient_clipping", "prescale_gradients"}  # outside it
# zerolab's config sets stage3_param_persistence_threshold to 0 (no tensor stays whole) when strategy.stage=3;
# a stage 3 that only an override asks for runs with DeepSpeed's own default, 1e5 (runtime/zero/config.py)
ZEROLAB_PERSISTENCE, DEEPSPEED_PERSISTENCE = 0, 100_000
# stage3_max_reuse_distance: 0 with strategy.reshard_after_forward=true, else DeepSpeed's default (config.py)
DEEPSPEED_REUSE = 1_000_000_000


@dataclass
class ZeroConfig:
    stage: int
    bucket: int  # reduce_bucket_size, elements
    persistence: int  # stage3_param_persistence_threshold, elements
    model_persistence: int  # stage3_model_persistence_threshold: the most elements kept whole in all
    unmodelled: list  # override keys the prediction does not follow
    hpz: int = 1  # zero_hpz_partition_size: ranks sharing a secondary copy of the weights (1: none)
    offload_optimizer: bool = False  # offload_optimizer.device cpu: master, its gradient and the state on the host
    offload_params: bool = False  # offload_param.device cpu (stage 3): the parameter partitions on the host
    reuse: int = 0  # stage3_max_reuse_distance: a weight used again within this many elements stays gathered


def ds_zero_config(settings: dict, stage: int, bucket: int) -> ZeroConfig:
    """The zero_optimization section a run hands DeepSpeed, from its strategy settings (a dict;
    {} outside a run: the schema's defaults) and the stage and bucket of the keywords."""
    overrides = dict(settings.get("ds_config_overrides") or {})
    zero = dict(overrides.pop("zero_optimization", {}) or {})
    def on_cpu(key: str, setting: str) -> bool:  # zerolab's setting, or the override's own section
        return (zero.get(key) or {}).get("device", "cpu" if settings.get(setting) else "none") == "cpu"

    unmodelled = sorted(f"zero_optimization.{k}" for k in zero if k not in FOLLOWED | NO_EFFECT | OFFLOAD)
    unmodelled += sorted(k for k in overrides if k not in TOP_NO_EFFECT)
    return ZeroConfig(stage=int(zero.get("stage", stage)), bucket=int(zero.get("reduce_bucket_size", bucket)),
                      persistence=int(zero.get("stage3_param_persistence_threshold",
                                               ZEROLAB_PERSISTENCE if stage == 3 else DEEPSPEED_PERSISTENCE)),
                      model_persistence=int(zero.get("stage3_model_persistence_threshold", sys.maxsize)),
                      unmodelled=unmodelled, hpz=int(zero.get("zero_hpz_partition_size", 1) or 1),
                      offload_optimizer=on_cpu("offload_optimizer", "offload_optimizer"),
                      offload_params=on_cpu("offload_param", "offload_params"),
                      reuse=int(zero.get("stage3_max_reuse_distance",
                                         0 if stage == 3 and settings.get("reshard_after_forward", True)
                                         else DEEPSPEED_REUSE)))


def predict_ds_memory(p, shape: ModelShape, zero: ZeroConfig, *, world: int, precision: str, k: float,
                      rank: int) -> None:
    if shape.buffer_bytes:  # (RoPE's inv_freq in a transformers model: memory() counts module.buffers())
        p.add("buffers", shape.buffer_bytes, "model buffers")
    if zero.stage in (1, 2):
        _stages_1_2(p, shape, zero, world, precision, k, rank)
    elif zero.stage == 3:
        _stage_3(p, shape, zero, world, precision, k)
    else:
        raise ValueError(f"DeepSpeed stage {zero.stage} has no memory model (stages 1, 2 and 3 do)")
    if zero.unmodelled:
        p.notes.append(f"not modelled: strategy.ds_config_overrides sets {', '.join(zero.unmodelled)}; the figures are "
                       "DeepSpeed's without them")


def _stages_1_2(p, shape: ModelShape, zero: ZeroConfig, N: int, precision: str, k: float, rank: int) -> None:
    n, c, dt = shape.n_params, COMPUTE_BYTES[precision], dtype_name(precision)
    # Each group's flat 16-bit buffer is padded to a multiple of 2N (4-byte alignment of fp16
    # partitions); every rank owns 1/N of it.
    padded = [ceil_div(g, 2 * N) * 2 * N for g in shape.group_numels]
    part = sum(g // N for g in padded)
    p.add("params", sum(padded) * c, f"{dt} flat weight buffer, padded to a multiple of 2N: {fmt_n(sum(padded))} × {c}")
    if zero.offload_optimizer:
        _offloaded_1_2(p, shape, zero, N, precision, k, part)
        return
    # With contiguous gradients (zerolab's config) stage 1 reduces during backward like stage 2,
    # overlap_comm or not: the rank keeps the gradients of the tensors overlapping its partition, whole.
    owned = ds_grads_in_partition(shape, N, rank)
    p.add("grads", owned * c, f"{dt} gradients of the tensors overlapping this partition, whole "
                              f"(grads_in_partition): {fmt_n(owned)} × {c}")
    p.add("transient", part * 4, f"fp32 gradient partition, alive inside step() only: {fmt_n(part)} × 4", when="step")
    p.add("master", part * 4, f"fp32 weight partition (kept even in fp32 training): {fmt_n(part)} × 4")
    p.add("optim_state", part * k * 4, f"optimizer state of the partition: {fmt_n(part)} × {k:g} × 4")
    p.add("transient", min(zero.bucket * c, n * c), f"{dt} reduce bucket during backward (reduce_bucket_size)")
    fp32 = precision == "fp32"
    p.why = (("stage 1 frees the gradients outside its partition during backward, as stage 2 does (the paper's "
              "stage 1 keeps all of them); " if zero.stage == 1 else "")
             + f"the tensors overlapping the partition keep whole {dt} gradients; flat buffers padded to 2N; "
             + ("an fp32 weight partition (4Ψ/N) even in fp32 training; " if fp32 else "")
             + "the fp32 gradient partition (4Ψ/N) exists inside step() only (transient, not counted)")
    p.notes.append("stage 1 frees gradients outside its partition during backward, as stage 2 does; vs the paper: "
                   f"an fp32 gradient partition (4Ψ/N) exists during step() on top of the {dt} gradients"
                   + ("; in fp32 training the fp32 partition duplicates the weights (4Ψ/N)" if fp32 else ""))


def _offloaded_1_2(p, shape: ModelShape, zero: ZeroConfig, N: int, precision: str, k: float, part: int) -> None:
    """ZeRO-Offload in DeepSpeed's stages 1 and 2 (stage_1_and_2.py with cpu_offload): the device
    keeps the 16-bit weights and a staging buffer; the host keeps the fp32 partition, its gradient
    (accumulated there during backward), the optimizer state and a 16-bit copy of the partition."""
    n, c, dt = shape.n_params, COMPUTE_BYTES[precision], dtype_name(precision)
    largest = max(math.prod(s) for s in shape.shapes)
    host = "host"
    p.add("grads", part * 4, f"fp32 gradient partition on the host, held across steps: {fmt_n(part)} × 4", place=host)
    p.add("master", part * 4, f"fp32 weight partition on the host: {fmt_n(part)} × 4", place=host)
    p.add("optim_state", part * k * 4, f"optimizer state of the partition on the host: {fmt_n(part)} × {k:g} × 4",
          place=host)
    p.add("buffers", part * c, f"{dt} copy of the partition on the host, the updated weights' way back: "
                               f"{fmt_n(part)} × {c}", place=host)
    p.add("buffers", largest * c, f"{dt} gradient staging buffer of the largest tensor on the device "
                                  f"(temp_grad_buffer_for_gpu_offload): {fmt_n(largest)} × {c}")
    p.add("buffers", largest * c, f"{dt} gradient staging buffer of the largest tensor on the host: "
                                  f"{fmt_n(largest)} × {c}", place=host)
    p.add("transient", min(zero.bucket * c, n * c), f"{dt} reduce bucket during backward (reduce_bucket_size)")
    p.why = ("offload_optimizer: the fp32 partition, its fp32 gradient and the optimizer state on the host "
             f"(4Ψ/N + 4Ψ/N + {k:g}·4Ψ/N), with a {dt} copy of the partition; the device keeps the {dt} weights")
    p.notes.append("vs the paper (ZeRO-Offload): the gradient shard is held on the host in fp32 for the whole step, "
                   "and DeepSpeed keeps staging buffers of the largest tensor on both sides")


def _stage_3(p, shape: ModelShape, zero: ZeroConfig, N: int, precision: str, k: float) -> None:
    """Every tensor padded to a multiple of N and partitioned on its own; tensors of at most
    `persistence` elements also stay whole on every rank, while their running total stays within
    `model_persistence` (partition_parameters.py, in the model's parameter order)."""
    n, c, dt = shape.n_params, COMPUTE_BYTES[precision], dtype_name(precision)
    sizes = [math.prod(s) for s in shape.shapes]
    part = sum(ceil_div(x, N) for x in sizes)
    persistent, kept = 0, []
    for x in sizes:
        kept.append(x <= zero.persistence and persistent + x <= zero.model_persistence)
        persistent += x if kept[-1] else 0
    ph, oh = ("host" if zero.offload_params else "device"), ("host" if zero.offload_optimizer else "device")
    p.add("params", part * c, f"{dt} weight partitions, each tensor padded to N: {fmt_n(part)} × {c}", place=ph)
    if persistent:
        p.add("params", persistent * c, f"tensors of at most {zero.persistence:,} elements kept whole on every rank "
                                        f"(stage3_param_persistence_threshold): {fmt_n(persistent)} × {c}")
    # hpZ (partition_parameters.py, _partition_param_sec): each partitioned tensor, padded to N, cut over
    # its group's n ranks; a tensor kept whole gets none (measured: all of them kept whole, no copy)
    secondary = sum(ceil_div(x, N) * N // zero.hpz for x, whole in zip(sizes, kept) if not whole) if zero.hpz > 1 else 0
    if secondary:
        p.add("params", secondary * c, f"hpZ's secondary copy (zero_hpz_partition_size={zero.hpz}): each partitioned "
                                       f"tensor, padded to N, over {zero.hpz} ranks: {fmt_n(secondary)} × {c}")
    if zero.offload_optimizer:  # stage3.py: the fp32 partition's gradient is filled on the host during backward
        p.add("grads", part * 4, f"fp32 gradient partition on the host: {fmt_n(part)} × 4", place=oh)
    else:
        p.add("grads", part * c, f"{dt} gradient partitions (flat buffer): {fmt_n(part)} × {c}")
        p.add("transient", part * 4, f"fp32 gradient partition, alive inside step() only: {fmt_n(part)} × 4",
              when="step")
    p.add("master", part * 4, f"fp32 weight partition (kept even in fp32 training): {fmt_n(part)} × 4", place=oh)
    p.add("optim_state", part * k * 4, f"optimizer state of the partition: {fmt_n(part)} × {k:g} × 4", place=oh)
    p.add("transient", min(zero.bucket * c, n * c), f"{dt} reduce bucket during backward (reduce_bucket_size)")
    if zero.offload_optimizer or zero.offload_params:
        p.notes.append("stage 3 offload: the states by place; not modelled: DeepSpeed's staging buffers for the "
                       "copies and, under 16-bit precision, its 16-bit gradient buffer on the host")
    if zero.reuse >= n:  # every weight's next use lies within the distance: none is freed before backward
        p.add("transient", sum(x * c for x, whole in zip(sizes, kept) if not whole),
              f"weights kept gathered from their forward to their backward (stage3_max_reuse_distance "
              f"{zero.reuse:,} ≥ the model's elements)")
    else:
        p.add("transient", max(sizes) * c, "weights all-gathered for the module being computed (largest tensor)")
        if zero.reuse:
            p.notes.append(f"stage3_max_reuse_distance {zero.reuse:,}: the weights it keeps gathered between uses "
                           "are not modelled (the prediction frees each module's after its forward)")
    p.why = ("each tensor padded to N; " + ("an fp32 weight partition (4Ψ/N) even in fp32 training; "
                                            if precision == "fp32" else "")
             + ("small tensors kept whole on every rank; " if persistent else "")
             + (f"hpZ's secondary copy, 1/{zero.hpz} of the partitioned weights; " if secondary else "")
             + "the fp32 gradient partition (4Ψ/N) exists inside step() only (transient, not counted)")
    p.notes.append("vs the paper: the fp32 gradient partition (4Ψ/N) during step(); with DeepSpeed's own default "
                   "stage3_param_persistence_threshold (1e5; zerolab sets 0) small tensors also stay whole on every "
                   "rank")


def ds_grads_in_partition(shape: ModelShape, world: int, rank: int) -> int:
    """Elements of DeepSpeed 1/2's 16-bit gradient buffer on `rank` (grads_in_partition): every
    tensor that overlaps the rank's partition of its group's flat buffer, whole."""
    if not shape.exact:
        return sum(ceil_div(x, 2 * world) * 2 for x in shape.group_numels)
    total = 0
    for g, numel in enumerate(shape.group_numels):
        part = ceil_div(numel, 2 * world) * 2  # padded to 2N, split in N
        lo, hi, off = rank * part, (rank + 1) * part, 0
        for gi, s in shape.tensors:
            if gi != g:
                continue
            x = math.prod(s)
            if off < hi and off + x > lo:
                total += x
            off += x
    return total
