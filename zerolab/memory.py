"""The memory ledger: bytes per rank by category, measured from the tensors that exist, and
predicted from the model's shapes for any strategy, precision, optimizer and world size
(`predict`, `python -m zerolab memory`). The trainer holds one against the other at the first
optimizer step (`ledger_for_run`, `check_against`).

Categories (the ZeRO paper's "model states" are the first four):
  params       compute-dtype weights held by the model
  grads        gradients (full in the model, or the rank's shard)
  master       fp32 master weights (mixed precision), whole or sharded
  optim_state  optimizer state (Adam's m and v, momentum, ...)
  buffers      communication buckets, padding, model buffers
Storage is counted once even when several tensors view it.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Iterable

import torch

log = logging.getLogger(__name__)

CATEGORIES = ("params", "grads", "master", "optim_state", "buffers")
MODEL_STATES = ("params", "grads", "master", "optim_state")


class StorageCounter:
    """Sums storage bytes over categories, never counting one storage twice."""

    def __init__(self):
        self.seen: set[tuple[str, int]] = set()
        self.bytes = {c: 0 for c in CATEGORIES}

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> "StorageCounter":
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.bytes[category] += storage.nbytes()
        return self

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> "StorageCounter":
        return self.add("optim_state", (v for state in optimizer.state.values() for v in state.values()
                                        if isinstance(v, torch.Tensor) and v.ndim > 0))  # skip scalar step counters

    def result(self) -> dict[str, int]:
        out = dict(self.bytes)
        out["model_states"] = sum(out[c] for c in MODEL_STATES)
        out["total"] = sum(out[c] for c in CATEGORIES)
        return out


def process_memory(device: torch.device) -> dict[str, int]:
    """Process-level figures: RSS (and its peak) on CPU, allocator statistics on CUDA."""
    import resource

    import psutil

    out = {"rss_bytes": psutil.Process().memory_info().rss,
           "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out.update({
            "cuda_allocated_bytes": torch.cuda.memory_allocated(device),
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "cuda_alloc_retries": stats.get("num_alloc_retries", 0),
            "cuda_ooms": stats.get("num_ooms", 0),
        })
    return out


# =============================================================================================
# The predicted side: what each strategy should hold per rank, term by term.
#
# Notation: Ψ parameters, N data-parallel ranks, c bytes per compute-dtype element (4 fp32,
# 2 bf16/fp16), k optimizer-state elements per parameter (measured from the optimizer), s bytes
# per state element (the dtype of the tensors the optimizer updates).
# Every term carries a sentence saying where it comes from, so the CLI can print the ledger and
# a run can hold each category against what its strategy measures.
# =============================================================================================

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16_pure": 2}
MIXED = ("bf16", "fp16")  # precisions with an fp32 master copy
PREDICTED_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "deepspeed", "fsdp", "torch_zero")
# DeepSpeed stage 3 keeps tensors of at most this many elements whole on every rank. DeepSpeed's
# default is 1e5; zerolab's deepspeed strategy sets stage3_param_persistence_threshold to 0.
DS_PERSISTENCE_THRESHOLD = 0
GB, GIB = 1e9, 2 ** 30


@dataclass(frozen=True)
class ModelShape:
    """What the ledger needs from a model: every trainable tensor's param group and shape, in
    registration order (model.parameters()), which is the order sharders pack buckets in."""
    name: str
    tensors: tuple  # ((group index, shape), ...)
    buffer_bytes: int = 0
    # False for a bare parameter count: tensor boundaries are unknown, so strategies that place
    # whole tensors (torch_zero, DeepSpeed's gradient partitions) are taken as evenly divided.
    exact: bool = True

    @property
    def shapes(self) -> list[tuple]:
        return [s for _, s in self.tensors]

    @property
    def group_numels(self) -> list[int]:
        out = [0] * (1 + max(g for g, _ in self.tensors))
        for g, s in self.tensors:
            out[g] += math.prod(s)
        return out

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors)


def shape_from_params(n: float) -> ModelShape:
    """A bare parameter count: one group holding one flat tensor."""
    n = int(round(float(n)))
    if n <= 0:
        raise ValueError(f"--params must be a positive number of parameters, got {n}")
    return ModelShape(f"{n:.3g} params", ((0, (n,)),), exact=False)


def shape_from_model(model, weight_decay: float = 0.1, name: str = "model") -> ModelShape:
    """Groups as zerolab builds them (zerolab.models.param_groups): decay and no-decay tensors."""
    from zerolab.models import param_groups

    group_of = {id(p): gi for gi, g in enumerate(param_groups(model, weight_decay)) for p in g["params"]}
    tensors = tuple((group_of[id(p)], tuple(p.shape)) for p in model.parameters() if id(p) in group_of)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return ModelShape(name, tensors, buffers)


def load_model_config(name: str):
    """conf/model/<name>.yaml merged onto zerolab's ModelConfig (defaults and types apply)."""
    from omegaconf import OmegaConf

    from zerolab.config import ModelConfig

    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "model")
    path = os.path.join(conf_dir, f"{name}.yaml")
    if not os.path.exists(path):
        known = sorted(f[:-5] for f in os.listdir(conf_dir) if f.endswith(".yaml"))
        raise ValueError(f"no model config {path}; known models: {', '.join(known)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path)))


def shape_from_model_config(mcfg, weight_decay: float = 0.1) -> ModelShape:
    """Build the model on the meta device (no memory is allocated) and read its shapes."""
    from zerolab.models import build_model

    return shape_from_model(build_model(mcfg, device="meta"), weight_decay, mcfg.name)


# ---- optimizer state per parameter (measured, not tabulated) ---------------------------------
def optimizer_state_elements(optim: str) -> float:
    """Optimizer-state elements per parameter, measured on a tiny instance: by
    zerolab.optim.state_elements_per_param where it exists, else here with build_optimizer
    (one step on a small tensor, counting state tensors as the ledger's measured side does)."""
    with torch.random.fork_rng(devices=[]):  # never disturb the caller's random stream
        try:
            from zerolab.optim import state_elements_per_param
        except ImportError:
            return _measure_state_elements(optim)
        try:
            return float(state_elements_per_param(optim))
        except (NotImplementedError, KeyError, ValueError) as e:
            raise NotImplementedError(f"cannot measure the optimizer state of optim={optim}: {e}") from e


def _measure_state_elements(optim: str) -> float:
    from zerolab.config import OptimConfig
    from zerolab.optim import build_optimizer

    p = torch.nn.Parameter(torch.ones(4, 8))
    try:
        opt = build_optimizer(OptimConfig(name=optim), [{"params": [p], "weight_decay": 0.0}])
    except NotImplementedError as e:
        raise NotImplementedError(f"optim={optim}: build_optimizer cannot build it yet, so its state "
                                  f"cannot be measured ({e})") from e
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    c = StorageCounter().add_optimizer(opt)
    return c.bytes["optim_state"] / (p.numel() * p.element_size())


# ---- one prediction ------------------------------------------------------------------------
@dataclass
class Term:
    category: str  # one of CATEGORIES, or "transient" (exists only during part of the step)
    bytes: int
    what: str


@dataclass
class Prediction:
    strategy: str  # ddp | zero1 | zero2 | zero3 | deepspeed-<stage> | fsdp
    precision: str
    optim: str
    world: int
    model: str
    n_params: int
    state_elements: float
    terms: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    why: str = ""  # why this implementation differs from the ZeRO paper's formula (set by its builder)

    def add(self, category: str, nbytes: float, what: str) -> None:
        self.terms.append(Term(category, int(math.ceil(nbytes)), what))

    def bytes(self) -> dict[str, int]:
        """Same keys as StorageCounter.result(), so predicted and measured line up."""
        out = {c: 0 for c in CATEGORIES}
        for t in self.terms:
            if t.category in out:
                out[t.category] += t.bytes
        out["model_states"] = sum(out[c] for c in MODEL_STATES)
        out["total"] = sum(out[c] for c in CATEGORIES)
        return out

    @property
    def transient_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.category == "transient")

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "precision": self.precision, "optim": self.optim, "world": self.world,
                "model": self.model, "n_params": self.n_params, "state_elements_per_param": self.state_elements,
                "bytes": self.bytes(), "transient_bytes": self.transient_bytes,
                "bytes_per_param": {k: v / self.n_params for k, v in self.bytes().items()},
                "terms": [vars(t) for t in self.terms], "notes": list(self.notes),
                "paper_bytes": paper_bytes(self), "paper": {"formula": paper_formula(self), "K": paper_k(self),
                                                            "bytes_by_category": paper_split(self)},
                "vs_paper": vs_paper(self)}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _fmt_n(n: int) -> str:
    return f"{n:,}"


def predict(shape: ModelShape, strategy: str, world: int = 1, precision: str = "bf16", optim: str = "adamw",
            stage: int = 0, bucket_mb: float = 25.0, state_elements: float | None = None,
            reduce_dtype: str = "auto", rank: int = 0) -> Prediction:
    """Predicted bytes on one rank. `state_elements` overrides the measured optimizer state
    (elements per parameter), e.g. for tests of the formulas."""
    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    if precision not in COMPUTE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(COMPUTE_BYTES)}")
    if strategy not in PREDICTED_STRATEGIES:
        raise ValueError(f"no memory model for strategy {strategy!r}; known: {', '.join(PREDICTED_STRATEGIES)}")
    if strategy == "deepspeed" and stage not in (1, 2, 3):
        raise ValueError(f"strategy=deepspeed needs --stage 1, 2 or 3 (got {stage})")
    k = optimizer_state_elements(optim) if state_elements is None else float(state_elements)
    name = f"deepspeed-{stage}" if strategy == "deepspeed" else strategy
    pred = Prediction(name, precision, optim, world, shape.name, shape.n_params, k)
    builder = {"ddp": _ddp, "zero1": _zero12, "zero2": _zero12, "zero3": _zero3,
               "deepspeed": _deepspeed, "fsdp": _fsdp, "torch_zero": _torch_zero}[strategy]
    builder(pred, shape, strategy=strategy, world=world, precision=precision, k=k, stage=stage,
            bucket_mb=bucket_mb, bucket_bytes=int(bucket_mb * 2 ** 20), reduce_dtype=reduce_dtype, rank=rank)
    return pred


def _dtype_name(precision: str) -> str:
    return "fp32" if precision == "fp32" else ("fp16" if precision == "fp16" else "bf16")


def _ddp(p: Prediction, shape: ModelShape, *, precision, k, bucket_bytes, **_):
    n, c, dt = shape.n_params, COMPUTE_BYTES[precision], _dtype_name(precision)
    p.add("params", n * c, f"{dt} weights: Ψ × {c}")
    p.add("grads", n * c, f"{dt} gradients, views into DDP's all-reduce buckets: Ψ × {c}")
    s = 4 if precision != "bf16_pure" else 2  # the optimizer updates fp32 masters, or the bf16 weights
    if precision in MIXED:
        p.add("master", n * 4, "fp32 master weights: Ψ × 4")
        p.add("transient", n * 4, "fp32 copies of the gradients while the optimizer steps: Ψ × 4")
    p.add("optim_state", n * k * s, f"optimizer state: Ψ × {k:g} elements × {s}")
    if shape.buffer_bytes:
        p.add("buffers", shape.buffer_bytes, "model buffers")


def zero_buckets(shape: ModelShape, world: int, compute_bytes: int, bucket_mb: float) -> list[int]:
    """Padded bucket sizes (elements) of zerolab's sharder: its own packing (zero.pack_buckets),
    each bucket padded to a multiple of N."""
    from zerolab.strategies.zero import pack_buckets

    cap = max(1, int(bucket_mb * 2 ** 20 / compute_bytes))
    numels = [math.prod(s) for _, s in shape.tensors]
    buckets = pack_buckets([(g, n) for (g, _), n in zip(shape.tensors, numels)], cap)
    return [_ceil_div(sum(numels[i] for i in members), world) * world for _, members in buckets]


def _zero12(p: Prediction, shape: ModelShape, *, strategy, world, precision, k, bucket_mb, reduce_dtype, **_):
    """zerolab's sharder (zerolab/strategies/zero.py): every bucket is padded to a multiple of N and
    rank r owns chunk r of each; master weights, their gradient and the optimizer state are fp32
    and exist for the owned chunks only. Measured at the end of a step (as memory() sees it)."""
    n, c, dt, N = shape.n_params, COMPUTE_BYTES[precision], _dtype_name(precision), world
    sizes = zero_buckets(shape, N, c, bucket_mb)
    padded, shard = sum(sizes), sum(sizes) // N
    pad = padded - n
    p.add("params", n * c, f"{dt} weights, whole, views into per-bucket flat buffers: Ψ × {c}")
    if pad:
        p.add("params", pad * c, f"padding of {len(sizes)} bucket(s) to multiples of N: {_fmt_n(pad)} × {c}")
    if strategy == "zero1":
        p.add("grads", padded * c, f"{dt} gradients, whole, views into per-bucket flat buffers "
                                   f"(kept between steps): {_fmt_n(padded)} × {c}")
    s = 2 if precision == "bf16_pure" else 4  # bf16_pure updates a bf16 shard: no fp32 anywhere
    sd = "bf16" if s == 2 else "fp32"
    p.add("grads", shard * s, f"{sd} gradient shard (the owned chunks): {_fmt_n(shard)} × {s}")
    p.add("master", shard * s, f"{sd} {'weight' if s == 2 else 'master'} shard the optimizer updates: "
          f"{_fmt_n(shard)} × {s}"
          + (" (in fp32 training it duplicates the owned weights)" if precision == "fp32" else ""))
    p.add("optim_state", shard * k * s, f"optimizer state of the shard: {_fmt_n(shard)} × {k:g} × {s}")
    rb = 4 if reduce_dtype == "fp32" else c
    if strategy == "zero2":
        p.add("transient", min(len(sizes), 1 + 4) * max(sizes) * rb,
              "gradient buckets copied for reduce-scatter, freed as each finishes during backward "
              "(at most MAX_IN_FLIGHT = 4 in flight plus the one filling)")
    elif rb != c:
        p.add("transient", max(sizes) * rb, "fp32 copy of a bucket for reduce-scatter (strategy.reduce_dtype=fp32)")
    p.add("transient", max(sizes) // N * (4 + rb), "reduce-scatter output / all-gather input chunk of one bucket")
    if shape.buffer_bytes:
        p.add("buffers", shape.buffer_bytes, "model buffers")
    paper = "4Ψ + KΨ/N" if strategy == "zero1" else "2Ψ + (2 + K)Ψ/N"
    why = [f"zerolab keeps its {sd} gradient shard ({s}Ψ/N) on top of the whole gradients (the paper reduces into "
           "them, no shard)" if strategy == "zero1" else
           f"zerolab's gradient shard is {sd} ({s}Ψ/N) where the paper's is {c}-byte ({c}Ψ/N)" if s != c else ""]
    if precision not in MIXED:
        why.append(f"the {sd} shard the optimizer updates duplicates the owned weights ({s}Ψ/N); without mixed "
                   "precision the paper's K has no master copy")
    if pad:
        why.append("buckets are padded to multiples of N")
    p.why = "; ".join(w for w in why if w)
    p.notes.append(f"vs the paper ({paper} in mixed precision): the gradient shard is fp32 (4Ψ/N)"
                   + (" on top of the whole 16-bit gradients" if strategy == "zero1" else " rather than 16-bit (2Ψ/N)")
                   + ("; in fp32 training the fp32 master shard (4Ψ/N) duplicates owned weights" if precision == "fp32" else "")
                   + ("; bf16_pure updates a bf16 shard (no fp32 copy)" if precision == "bf16_pure" else ""))


def _zero3(p: Prediction, shape: ModelShape, *, world, precision, k, **_):
    """The ZeRO paper's P_os+g+p: every model state divided by N (formula only)."""
    n, c, dt, N = shape.n_params, COMPUTE_BYTES[precision], _dtype_name(precision), world
    shard = _ceil_div(n, N)
    p.add("params", shard * c, f"{dt} weight shard: ⌈Ψ/N⌉ × {c}")
    p.add("grads", shard * c, f"{dt} gradient shard: ⌈Ψ/N⌉ × {c}")
    s = 2 if precision == "bf16_pure" else 4
    if precision in MIXED:
        p.add("master", shard * 4, "fp32 master shard: ⌈Ψ/N⌉ × 4")
    p.add("optim_state", shard * k * s, f"optimizer state shard: ⌈Ψ/N⌉ × {k:g} × {s}")
    biggest = max(math.prod(s_) for s_ in shape.shapes)
    p.add("transient", biggest * c, "one layer's weights all-gathered for forward/backward (largest tensor)")
    p.notes.append("formula only (Rajbhandari et al. 2019); zerolab has no own stage-3 sharder")
    p.why = "zerolab has no stage-3 sharder: this is the formula itself, with ⌈Ψ/N⌉ shards"


def ds_grads_in_partition(shape: ModelShape, world: int, rank: int) -> int:
    """Elements of DeepSpeed 1/2's 16-bit gradient buffer on `rank` (grads_in_partition): every
    tensor that overlaps the rank's partition of its group's flat buffer, whole."""
    if not shape.exact:
        return sum(_ceil_div(x, 2 * world) * 2 for x in shape.group_numels)
    total = 0
    for g, numel in enumerate(shape.group_numels):
        part = _ceil_div(numel, 2 * world) * 2  # padded to 2N, split in N
        lo, hi, off = rank * part, (rank + 1) * part, 0
        for gi, s in shape.tensors:
            if gi != g:
                continue
            x = math.prod(s)
            if off < hi and off + x > lo:
                total += x
            off += x
    return total


def _deepspeed(p: Prediction, shape: ModelShape, *, world, precision, k, stage, bucket_bytes, rank, **_):
    """DeepSpeed 0.19 as it allocates (runtime/zero/stage_1_and_2.py, stage3.py), at the moment of the
    optimizer update, where its model states peak."""
    n, c, dt, N = shape.n_params, COMPUTE_BYTES[precision], _dtype_name(precision), world
    if precision == "bf16_pure":
        raise ValueError("DeepSpeed has no bf16_pure mode (its bf16 ZeRO keeps fp32 master weights); "
                         "use --precision bf16")
    if stage in (1, 2):
        # Each group's flat 16-bit buffer is padded to a multiple of 2N (4-byte alignment of fp16
        # partitions); every rank owns 1/N of it.
        padded = [_ceil_div(g, 2 * N) * 2 * N for g in shape.group_numels]
        part = sum(g // N for g in padded)
        p.add("params", sum(padded) * c, f"{dt} flat weight buffer, padded to a multiple of 2N: {_fmt_n(sum(padded))} × {c}")
        # With overlap_comm (zerolab's default) stage 1 reduces during backward like stage 2: the
        # rank keeps the gradients of the tensors that overlap its partition, whole.
        owned = ds_grads_in_partition(shape, N, rank)
        p.add("grads", owned * c, f"{dt} gradients of the tensors overlapping this partition, whole "
                                  f"(grads_in_partition): {_fmt_n(owned)} × {c}")
        p.add("transient", part * 4, f"fp32 gradient partition, alive inside step() only: {_fmt_n(part)} × 4")
        p.add("master", part * 4, f"fp32 weight partition (kept even in fp32 training): {_fmt_n(part)} × 4")
        p.add("optim_state", part * k * 4, f"optimizer state of the partition: {_fmt_n(part)} × {k:g} × 4")
        p.add("transient", min(bucket_bytes, n * c), f"{dt} reduce bucket during backward (reduce_bucket_size = strategy.bucket_mb)")
        p.why = (("with overlap_comm stage 1 frees the gradients outside its partition, as stage 2 does (the paper's "
                  "stage 1 keeps all of them); " if stage == 1 else "")
                 + f"the tensors overlapping the partition keep whole {dt} gradients; flat buffers padded to 2N; "
                 + ("an fp32 weight partition (4Ψ/N) even in fp32 training; " if precision == "fp32" else "")
                 + "the fp32 gradient partition (4Ψ/N) exists inside step() only (transient, not counted)")
        p.notes.append("with overlap_comm, stage 1 frees gradients outside its partition during backward, as stage 2 "
                       "does; vs the paper: an fp32 gradient partition (4Ψ/N) exists during step() on top of the "
                       f"{dt} gradients" + ("; in fp32 training the fp32 partition duplicates the weights (4Ψ/N)"
                                            if precision == "fp32" else ""))
        return
    # Stage 3: every tensor is padded to a multiple of N and partitioned on its own; tensors of at most
    # 1e5 elements (stage3_param_persistence_threshold) also stay whole on every rank.
    sizes = [math.prod(s) for s in shape.shapes]
    part = sum(_ceil_div(x, N) for x in sizes)
    persistent = sum(x for x in sizes if x <= DS_PERSISTENCE_THRESHOLD)
    p.add("params", part * c, f"{dt} weight partitions, each tensor padded to N: {_fmt_n(part)} × {c}")
    if persistent:
        p.add("params", persistent * c, f"small tensors kept whole on every rank: {_fmt_n(persistent)} × {c}")
    p.add("grads", part * c, f"{dt} gradient partitions (flat buffer): {_fmt_n(part)} × {c}")
    p.add("transient", part * 4, f"fp32 gradient partition, alive inside step() only: {_fmt_n(part)} × 4")
    p.add("master", part * 4, f"fp32 weight partition (kept even in fp32 training): {_fmt_n(part)} × 4")
    p.add("optim_state", part * k * 4, f"optimizer state of the partition: {_fmt_n(part)} × {k:g} × 4")
    p.add("transient", min(bucket_bytes, n * c), f"{dt} reduce bucket during backward (reduce_bucket_size = strategy.bucket_mb)")
    biggest = max(sizes)
    p.add("transient", biggest * c, "weights all-gathered for the module being computed (largest tensor)")
    p.why = ("each tensor padded to N; " + ("an fp32 weight partition (4Ψ/N) even in fp32 training; "
                                            if precision == "fp32" else "")
             + "the fp32 gradient partition (4Ψ/N) exists inside step() only (transient, not counted)")
    p.notes.append("vs the paper: the fp32 gradient partition (4Ψ/N) during step(); with DeepSpeed's default "
                   "stage3_param_persistence_threshold (1e5, zerolab sets 0) small tensors also stay whole on every rank")


def _fsdp(p: Prediction, shape: ModelShape, *, world, precision, k, **_):
    """FSDP2 (fully_shard): every parameter is a DTensor sharded on dim 0, padded to a multiple of N
    rows. With MixedPrecisionPolicy the sharded parameters stay fp32 (they are the master weights)
    and the compute-dtype copy exists only while a module runs."""
    c, dt, N = COMPUTE_BYTES[precision], _dtype_name(precision), world
    shard = sum(_ceil_div(s[0], N) * math.prod(s[1:]) for s in shape.shapes)
    s = 2 if precision == "bf16_pure" else 4
    kind = "bf16" if s == 2 else "fp32"
    if precision in MIXED:
        p.add("master", shard * 4, f"fp32 sharded parameters (the optimizer's weights): {_fmt_n(shard)} × 4")
    else:
        p.add("params", shard * s, f"{kind} sharded parameters: {_fmt_n(shard)} × {s}")
    p.add("grads", shard * s, f"{kind} sharded gradients: {_fmt_n(shard)} × {s}")
    p.add("optim_state", shard * k * s, f"optimizer state of the shard: {_fmt_n(shard)} × {k:g} × {s}")
    biggest = max(math.prod(s_) for s_ in shape.shapes)
    p.add("transient", biggest * c, f"{dt} unsharded weights of the module being computed (largest tensor)")
    padded = shard * N > shape.n_params
    p.why = "; ".join(w for w in ("no 16-bit weight shard (the fp32 shard is the weights) and an fp32 gradient shard "
                                  "(4Ψ/N, not 2Ψ/N): the same total" if precision in MIXED else "",
                                  "each tensor's dim 0 padded to a multiple of N" if padded else "") if w)
    p.notes.append("vs the paper: no separate 16-bit weight shard; the gradient shard is fp32 (4Ψ/N, not 2Ψ/N)"
                   if precision in MIXED else "every model state is sharded on dim 0 of each tensor")


def torch_zero_partition(shape: ModelShape, world: int) -> list[int]:
    """Elements each rank's optimizer owns under torch's ZeroRedundancyOptimizer: per param group,
    whole tensors largest first, each to the rank with the fewest elements so far (sizes carry
    over between groups; ties go to the lowest rank)."""
    if not shape.exact:
        return [_ceil_div(shape.n_params, world)] * world
    sizes = [0] * world
    for g in range(len(shape.group_numels)):
        numels = sorted((math.prod(s) for gi, s in shape.tensors if gi == g), reverse=True)
        for x in numels:
            sizes[sizes.index(min(sizes))] += x
    return sizes


def _torch_zero(p: Prediction, shape: ModelShape, *, world, precision, k, rank, **_):
    """torch's ZeroRedundancyOptimizer behind DDP: only the optimizer state is sharded, by whole tensors."""
    _ddp(p, shape, precision=precision, k=k, bucket_bytes=0)
    owned = torch_zero_partition(shape, world)[rank]
    s = 2 if precision == "bf16_pure" else 4
    p.terms = [t for t in p.terms if t.category != "optim_state"]
    p.add("optim_state", owned * k * s, f"optimizer state of the whole tensors rank {rank} owns: "
                                        f"{_fmt_n(owned)} × {k:g} × {s}")
    p.why = ("only the optimizer state is sharded" + (" (the fp32 master copy stays whole: 4Ψ, not 4Ψ/N)"
                                                   if precision in MIXED else "")
             + ", by whole tensors, so shards are uneven")
    p.notes.append("whole tensors are assigned greedily, so shards are uneven: "
                   + ", ".join(f"rank {r} {_fmt_n(x)}" for r, x in enumerate(torch_zero_partition(shape, world))))


# ---- the ZeRO paper beside zerolab -----------------------------------------------------------
# Rajbhandari et al. 2019 (ZeRO, §5.1 and Figure 1): per rank, 2Ψ of 16-bit weights, 2Ψ of 16-bit
# gradients and KΨ of optimizer states (K = 12 for mixed-precision Adam: fp32 master weights,
# momentum and variance, 4 bytes each); stage 1 (P_os) divides the optimizer states by N, stage 2
# (P_os+g) also the gradients, stage 3 (P_os+g+p) also the weights. For other precisions and
# optimizers the same formula is taken with c = compute-dtype bytes instead of 2 and
# K = master bytes + the optimizer's state elements × their bytes.
PAPER_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "deepspeed-1": 1, "deepspeed-2": 2,
               "deepspeed-3": 3, "fsdp": 3, "torch_zero": 1}
PAPER_FORMULA = {0: "({c}+{c}+K)Ψ", 1: "{c}Ψ+{c}Ψ+KΨ/N", 2: "{c}Ψ+({c}+K)Ψ/N", 3: "({c}+{c}+K)Ψ/N"}


def _state_bytes(precision: str) -> int:
    return 2 if precision == "bf16_pure" else 4  # bf16_pure keeps its optimizer state in bf16


def paper_k(pred: Prediction) -> float:
    """The paper's K: optimizer-state bytes per parameter (master copy included)."""
    return (4 if pred.precision in MIXED else 0) + pred.state_elements * _state_bytes(pred.precision)


def paper_k_text(pred: Prediction) -> str:
    k, s = pred.state_elements, _state_bytes(pred.precision)
    parts = (["fp32 master 4"] if pred.precision in MIXED else []) + [f"{k:g} state elements × {s}"]
    return f"K = {paper_k(pred):g} ({' + '.join(parts)})"


def paper_formula(pred: Prediction) -> str:
    return PAPER_FORMULA[PAPER_STAGE[pred.strategy]].format(c=COMPUTE_BYTES[pred.precision])


def paper_split(pred: Prediction) -> dict[str, float]:
    """The paper's bytes per rank by category (exact fractions of Ψ; no padding, no buffers)."""
    stage, n, N = PAPER_STAGE[pred.strategy], pred.n_params, pred.world
    c, s = COMPUTE_BYTES[pred.precision], _state_bytes(pred.precision)
    div = lambda at: N if stage >= at else 1  # the stage at which a state starts being divided
    return {"params": c * n / div(3), "grads": c * n / div(2),
            "master": (4 * n if pred.precision in MIXED else 0) / div(1),
            "optim_state": pred.state_elements * s * n / div(1), "buffers": 0.0}


def paper_bytes(pred: Prediction) -> int:
    return int(round(sum(paper_split(pred).values())))


def vs_paper(pred: Prediction) -> str:
    """One line: which categories differ from the paper's, by how much, and why."""
    ours, paper = pred.bytes(), paper_split(pred)
    stage, n, N = PAPER_STAGE[pred.strategy], pred.n_params, pred.world
    parts = []
    for cat in CATEGORIES:
        d = ours[cat] - paper[cat]
        if abs(d) < 1:  # the paper's exact fraction against whole bytes
            continue
        size = f"{'+' if d > 0 else '-'}{human_bytes(abs(d))}"
        per_shard = d * N / n
        if cat == "buffers":
            parts.append(f"buffers {size} (model buffers; the paper counts model states only)")
        elif abs(per_shard) < 0.01:
            parts.append(f"{cat} {size} (padding)")
        elif N > 1 and abs(per_shard - round(per_shard)) < 0.01 and abs(per_shard) <= 16:
            # a whole number of bytes per parameter of a shard: a term of the form xΨ/N
            parts.append(f"{cat} {size} ({per_shard:+.3g}Ψ/N)")
        else:
            parts.append(f"{cat} {size} ({d / n:+.3g}Ψ)")
    if not parts:
        return "same as the paper" + (f" ({pred.why})" if pred.strategy == "zero3" else "")
    return ", ".join(parts) + (f": {pred.why}" if pred.why else "")


def _gb(v: float) -> str:
    """GB as the paper's Figure 1 prints them: one decimal from 1 GB up, three digits below."""
    x = v / GB
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def format_paper(pred: Prediction, deepspeed: Prediction | None = None) -> list[str]:
    """The block under a single prediction: the paper's formula and figure, this strategy's, and
    DeepSpeed's at the same stage where the ledger models it. Figures of 1 GB and up are rounded
    as the paper's Figure 1 prints them; the differences are exact."""
    fig = lambda v: f"{_gb(v)} GB" if v >= GB else human_bytes(v)
    lines = [f"vs the ZeRO paper (Rajbhandari et al. 2019), per rank, {paper_k_text(pred)}:",
             f"  {'paper':<22} {paper_formula(pred):<16} {fig(paper_bytes(pred)):>10}"]
    for p in (pred, deepspeed):
        if p is not None:
            lines.append(f"  {p.strategy + ' (ledger)':<22} {'':<16} {fig(p.bytes()['total']):>10}  {vs_paper(p)}")
    return lines


# ---- formatting -----------------------------------------------------------------------------
def _num(x: float) -> str:
    """Two decimals for big figures, four significant digits for small ones."""
    return f"{x:.2f}" if x >= 1 or x == 0 else f"{x:.4g}"


def human_bytes(v: float) -> str:
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{int(v)} B"


def format_table(pred: Prediction, deepspeed: Prediction | None = None) -> str:
    b, n = pred.bytes(), pred.n_params
    total = b["total"] or 1
    head = (f"{pred.model}: {_fmt_n(n)} parameters | strategy {pred.strategy} | precision {pred.precision} | "
            f"optimizer {pred.optim} ({pred.state_elements:g} state elements/param) | world {pred.world} | per rank")
    rows = [f"{'category':<13} {'bytes/param':>11} {'bytes':>19} {'GB':>10} {'GiB':>10} {'share':>7}"]

    def row(label, v):
        rows.append(f"{label:<13} {v / n:>11.3f} {v:>19,} {_num(v / GB):>10} {_num(v / GIB):>10} {100 * v / total:>6.1f}%")

    for cat in MODEL_STATES:
        row(cat, b[cat])
    rows.append("-" * len(rows[0]))
    row("model states", b["model_states"])
    row("buffers", b["buffers"])
    row("total", b["total"])
    opt = b["master"] + b["optim_state"]
    ms = b["model_states"] or 1
    lines = [head, "", *rows, "",
             f"model states (weights + grads + master + optimizer state, the ZeRO paper's definition): "
             f"{b['model_states'] / n:.3f} bytes/param = {_num(b['model_states'] / GB)} GB per rank",
             f"optimizer states (fp32 master + optimizer state): {opt / n:.3f} bytes/param = {_num(opt / GB)} GB "
             f"= {100 * opt / ms:.1f}% of model states"]
    if pred.transient_bytes:
        lines.append(f"transient, on top during part of the step (not in total): {human_bytes(pred.transient_bytes)}")
    lines += ["", *format_paper(pred, deepspeed)]
    lines += ["", "where it comes from:"]
    lines += [f"  {t.category:<12} {human_bytes(t.bytes):>10}  {t.what}" for t in pred.terms]
    lines += [f"  note: {note}" for note in pred.notes]
    lines.append("  (activations are not included: they depend on batch and sequence length, not on the strategy)")
    return "\n".join(lines)


SWEEP_STRATEGIES = (("ddp", 0), ("zero1", 0), ("zero2", 0), ("zero3", 0), ("deepspeed", 1), ("deepspeed", 2),
                    ("deepspeed", 3), ("fsdp", 0))


def sweep_predictions(shape: ModelShape, worlds: list[int], precision: str, optim: str, bucket_mb: float = 25.0,
                      state_elements: float | None = None) -> dict[str, list[Prediction]]:
    """Rank 0's prediction for each strategy at each world size."""
    k = optimizer_state_elements(optim) if state_elements is None else state_elements
    out = {}
    for strategy, stage in SWEEP_STRATEGIES:
        if strategy == "deepspeed" and precision == "bf16_pure":
            continue
        label = f"deepspeed-{stage}" if stage else strategy
        out[label] = [predict(shape, strategy, w, precision, optim, stage=stage, bucket_mb=bucket_mb,
                              state_elements=k) for w in worlds]
    return out


def sweep(shape: ModelShape, worlds: list[int], precision: str, optim: str, bucket_mb: float = 25.0,
          state_elements: float | None = None) -> dict[str, list[int]]:
    """Per-rank total bytes (model states + buffers) for each strategy at each world size."""
    return {label: [p.bytes()["total"] for p in preds] for label, preds in
            sweep_predictions(shape, worlds, precision, optim, bucket_mb, state_elements).items()}


def format_sweep(shape: ModelShape, worlds: list[int], preds: dict[str, list[Prediction]], precision: str,
                 optim: str) -> str:
    """Per world size, the paper's figure beside the ledger's for each implementation; then, at the
    largest N, why they differ."""
    first = next(iter(preds.values()))[0]
    lines = [f"{shape.name}: {_fmt_n(shape.n_params)} parameters | precision {precision} | optimizer {optim} | "
             "GB on rank 0",
             f"paper: the ZeRO paper's formula (Rajbhandari et al. 2019), {paper_k_text(first)}; "
             "ledger: model states + buffers as this implementation allocates them", ""]
    lines.append(f"{'':<12}{'':<16}" + "".join(f"{'N=' + str(w):>16}" for w in worlds))
    lines.append(f"{'strategy':<12}{'paper formula':<16}" + "".join(f"{'paper':>8}{'ledger':>8}" for _ in worlds))
    for label, row in preds.items():
        lines.append(f"{label:<12}{paper_formula(row[0]):<16}"
                     + "".join(f"{_gb(paper_bytes(p)):>8}{_gb(p.bytes()['total']):>8}" for p in row))
    lines += ["", f"why ledger and paper differ (N={worlds[-1]}):"]
    lines += [f"  {label:<12} {vs_paper(row[-1])}" for label, row in preds.items()]
    return "\n".join(lines)


def plot_sweep(path: str, shape: ModelShape, worlds: list[int], table: dict[str, list[int]], precision: str,
               optim: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":", "-."]  # strategies that coincide (zero3 / fsdp) stay visible
    for i, (label, values) in enumerate(table.items()):
        ax.plot(worlds, [v / GB for v in values], marker="os^vDx*P"[i % 8], linestyle=styles[i % 4], label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("GB on rank 0 (model states + buffers)")
    ax.set_title(f"{shape.name}, {precision}, {optim}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the CLI: python -m zerolab memory ------------------------------------------------------
def cli_main(argv: list[str]) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m zerolab memory",
                                description="Predicted memory per rank by category, for any model size and strategy.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    src.add_argument("--model", help="a model config name from conf/model/ (built on the meta device)")
    p.add_argument("--world", type=int, default=1, help="data-parallel ranks N")
    p.add_argument("--strategy", default="ddp", choices=PREDICTED_STRATEGIES)
    p.add_argument("--stage", type=int, default=0, help="DeepSpeed ZeRO stage (1, 2, 3) with --strategy deepspeed")
    p.add_argument("--rank", type=int, default=0, help="which rank (torch_zero's shards are uneven)")
    p.add_argument("--precision", default="bf16", choices=list(COMPUTE_BYTES))
    p.add_argument("--optim", default="adamw", help="adamw | adam | lamb | lars | sgd | sgd_momentum")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size (strategy.bucket_mb)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--sweep-world", help="comma-separated world sizes, e.g. 1,2,4,8,16,64: one line per strategy")
    p.add_argument("--plot", help="with --sweep-world: also write this PNG (GB per rank against N)")
    args = p.parse_args(argv)
    try:
        shape = shape_from_params(args.params) if args.params is not None else \
            shape_from_model_config(load_model_config(args.model))
        if args.sweep_world:
            try:
                worlds = [int(w) for w in args.sweep_world.split(",") if w.strip()]
            except ValueError:
                raise ValueError(f"--sweep-world={args.sweep_world!r}: give integers separated by commas, e.g. 1,2,4,8")
            if not worlds or min(worlds) < 1:
                raise ValueError(f"--sweep-world={args.sweep_world!r}: world sizes must be >= 1")
            preds = sweep_predictions(shape, worlds, args.precision, args.optim, args.bucket_mb)
            table = {label: [p.bytes()["total"] for p in row] for label, row in preds.items()}
            if args.json:
                first = next(iter(preds.values()))[0]
                print(json.dumps({"model": shape.name, "n_params": shape.n_params, "worlds": worlds,
                                  "precision": args.precision, "optim": args.optim, "total_bytes": table,
                                  "paper_bytes": {label: [paper_bytes(p) for p in row] for label, row in preds.items()},
                                  "paper_formula": {label: paper_formula(row[0]) for label, row in preds.items()},
                                  "paper_K": paper_k(first),
                                  "vs_paper": {label: [vs_paper(p) for p in row] for label, row in preds.items()}},
                                 indent=2))
            else:
                print(format_sweep(shape, worlds, preds, args.precision, args.optim))
            if args.plot:  # files only where the user asked for them
                plot_sweep(args.plot, shape, worlds, table, args.precision, args.optim)
                print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
            return 0
        if not 0 <= args.rank < args.world:
            raise ValueError(f"--rank={args.rank} must be in [0, --world={args.world})")
        pred = predict(shape, args.strategy, args.world, args.precision, args.optim, stage=args.stage,
                       bucket_mb=args.bucket_mb, rank=args.rank)
        deepspeed = None  # DeepSpeed at the same ZeRO stage, beside zerolab's own sharder
        if args.strategy in ("zero1", "zero2", "zero3") and args.precision != "bf16_pure":
            deepspeed = predict(shape, "deepspeed", args.world, args.precision, args.optim,
                                stage=PAPER_STAGE[args.strategy], bucket_mb=args.bucket_mb,
                                state_elements=pred.state_elements, rank=args.rank)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(pred.to_dict(), indent=2) if args.json else format_table(pred, deepspeed))
    return 0


# ---- in every run: predicted vs measured ---------------------------------------------------
WARN_RATIO = 1.10  # measured above predicted by more than 10% gets a warning


def ledger_for_run(cfg, world_size: int, model=None) -> list[Prediction] | None:
    """The prediction for this run's model (the module about to be trained, else cfg.model built on
    the meta device), strategy, precision and optimizer, one per rank; None (with the reason
    logged) where the ledger has no model of the strategy or optimizer."""
    s = cfg.strategy
    try:
        shape = shape_from_model(model, cfg.optim.weight_decay, cfg.model.name) if model is not None \
            else shape_from_model_config(cfg.model, cfg.optim.weight_decay)
        k = optimizer_state_elements(cfg.optim.name)
        one = lambda r: predict(shape, s.name, world_size, cfg.precision.name, cfg.optim.name, stage=s.stage,
                                bucket_mb=s.bucket_mb, reduce_dtype=s.reduce_dtype, state_elements=k, rank=r)
        if s.name in ("torch_zero", "deepspeed"):  # strategies whose ranks hold different amounts
            return [one(r) for r in range(world_size)]
        return [one(0)] * world_size
    except (ValueError, NotImplementedError) as e:
        log.info("memory ledger: no prediction for this run (%s)", e)
        return None


def check_against(preds: list[Prediction] | None, per_rank: list[dict], warn: bool = True) -> tuple[dict, dict]:
    """Hold each rank's measured `mem/<cat>_bytes` (Strategy.memory()) against the prediction.
    Returns (metrics keys `rank{r}/mem_pred/<cat>_bytes`, summary section with measured/predicted
    per rank per category); logs a warning for every category measured >10% above prediction."""
    if not preds:
        return {}, {"predicted": None}
    keys, ratios, warnings = {}, [], []
    for r, figures in enumerate(per_rank):
        pred = preds[r]
        want = pred.bytes()
        rank_ratio = {}
        figures = dict(figures)
        if all(f"mem/{c}_bytes" in figures for c in CATEGORIES):  # derive the sums from the categories
            figures["mem/model_states_bytes"] = sum(figures[f"mem/{c}_bytes"] for c in MODEL_STATES)
            figures["mem/total_bytes"] = sum(figures[f"mem/{c}_bytes"] for c in CATEGORIES)
        for cat, predicted in want.items():
            keys[f"rank{r}/mem_pred/{cat}_bytes"] = predicted
            measured = figures.get(f"mem/{cat}_bytes")
            if measured is None:
                continue
            rank_ratio[cat] = measured / predicted if predicted else (1.0 if measured == 0 else None)
            if measured > predicted * WARN_RATIO:
                msg = (f"rank {r}: measured {cat} = {measured:,} bytes exceeds the prediction "
                       f"{predicted:,} by more than {100 * (WARN_RATIO - 1):.0f}%")
                warnings.append(msg)
                if warn:
                    log.warning("memory ledger: %s (%s)", msg, pred.strategy)
        ratios.append(rank_ratio)
    return keys, {"predicted": preds[0].to_dict(), "predicted_bytes_per_rank": [p.bytes() for p in preds],
                  "measured_over_predicted": ratios, "warnings": warnings}


PROCESS_KEYS = ("rss_bytes", "rss_peak_bytes", "cuda_allocated_bytes", "cuda_max_allocated_bytes",
                "cuda_max_reserved_bytes", "cuda_alloc_retries", "cuda_ooms")


def process_summary(per_rank: list[dict]) -> list[dict]:
    """The process-level figures of each rank (RSS on CPU; allocator peaks, retries, OOMs on CUDA)."""
    return [{k: r[k] for k in PROCESS_KEYS if k in r} for r in per_rank]
