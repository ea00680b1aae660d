"""What one dispatched op costs: its FLOPs (a formula) and the bytes it reads and writes (its tensors).

FLOPs come from torch.utils.flop_counter's formulas (matmuls, convolutions, attention), which take
shapes and so count fake tensors as well as real ones, plus two of zerolab's own for the kernels a
CPU dry run dispatches to and torch has no formula for: the CPU flash attention forward and
backward (the formulas are torch's SDPA counts, applied to these ops' arguments). A causal
attention does half the work of a full one (a flash kernel skips the masked tiles), so its FLOPs
are halved here; MFU still counts the full product (the convention, zerolab.profile.flops).

Bytes: every input tensor is read once and every tensor the op writes (a fresh output, or an
argument it mutates) is written once, at its own size; an argument the op only writes (`out=`, the
destination of copy_, zero_, fill_) is not also read (an expanded view counts its storage, not
its broadcast size). An op whose outputs are views of its inputs (view, transpose, detach,
_unsafe_view) moves nothing and costs nothing; so do allocations (empty).

An op without a FLOP formula is priced by its bytes alone (memory-bound). That is what an
elementwise op, a reduction, a copy or an optimizer's foreach kernel is; for any other op
without a formula (a softmax, a norm, an embedding's backward, a kernel of the user's) the record
keeps its name, and the prediction prints them (`unpriced`), so nothing costs zero silently.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils import flop_counter as fc
from torch.utils._pytree import tree_leaves

from zerolab.precision import DTYPE_NAMES

aten = torch.ops.aten
_CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward
FREE = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.lift_fresh,
        aten.resize_, aten.set_, aten.alias}
# Ops that are memory-bound by nature: priced by their bytes without a note.
_MEMORY_BOUND_PREFIXES = ("_foreach_", "_fused_", "copy", "_to_copy", "clone", "cat", "stack", "zero", "fill",
                          "split", "index", "embedding", "ones", "full", "rand", "arange", "scatter", "gather",
                          "where", "masked_fill", "_local_scalar_dense", "constant_pad", "flip", "roll", "narrow",
                          "chunk_cat", "native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm",
                          "_log_softmax", "_softmax", "nll_loss", "native_dropout", "linalg_vector_norm", "norm",
                          "dot", "vdot", "cumsum", "sort", "topk", "max", "min")


def _cpu_flash(query, key, value, *_args, **_kwargs) -> int:
    return fc.sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *_args, **_kwargs) -> int:
    return fc.sdpa_backward_flop_count(grad_out, query, key, value)


FORMULAS = {**fc.flop_registry,
            _CPU_FLASH: fc.shape_wrapper(_cpu_flash),
            _CPU_FLASH_BACKWARD: fc.shape_wrapper(_cpu_flash_backward)}


# In-place ops that overwrite their first argument without reading it.
WRITE_ONLY_SELF = {aten.copy_, aten.zero_, aten.fill_, aten.normal_, aten.uniform_, aten.random_,
                   aten.bernoulli_, aten.exponential_, aten._foreach_zero_, aten._foreach_copy_}


def _read_arguments(sch, args, kwargs) -> list:
    """The tensors an op reads: its tensor arguments but those it only writes (sch.written_only).
    By position, not storage: div(m, d, out=d) reads d."""
    if not sch.written_only:
        return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    positions = {i for i, _ in sch.written_only}
    names = {n for _, n in sch.written_only}
    positional = [a for i, a in enumerate(args) if i not in positions]
    named = {k: v for k, v in kwargs.items() if k not in names}
    return [t for t in tree_leaves((positional, named)) if isinstance(t, torch.Tensor)]


@dataclass(frozen=True)
class _Schema:
    """What an op's schema says about its arguments and results, read once per op."""
    mutated: tuple  # (position, name) of each argument it writes
    fresh: tuple  # per result: True when it is a new tensor (not an alias of an input)
    causal: tuple  # (position, name) of an is_causal argument, if any
    written_only: tuple  # (position, name) of each argument it writes without reading (`out`, WRITE_ONLY_SELF's)


@functools.lru_cache(maxsize=None)
def _schema(func) -> _Schema:
    s = func._schema
    mutated = tuple((i, a.name) for i, a in enumerate(s.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    fresh = tuple(r.alias_info is None for r in s.returns)
    causal = tuple((i, a.name) for i, a in enumerate(s.arguments) if a.name == "is_causal")
    written_only = tuple((i, n) for i, n in mutated
                         if n.startswith("out") or (i == 0 and func._overloadpacket in WRITE_ONLY_SELF))
    return _Schema(mutated, fresh, causal, written_only)


def _arg(args, kwargs, position: int, name: str):
    return args[position] if position < len(args) else kwargs.get(name)


def local(t):
    """A DTensor's local shard (what this rank computes on and moves), else the tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t


def tensor_bytes(t) -> int:
    """Bytes a kernel touches for tensor `t`: its elements, at most its storage (expanded views)."""
    t = local(t)
    if not isinstance(t, torch.Tensor):
        return 0
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
        return n


def _storages(leaves) -> set:
    out = set()
    for t in leaves:
        t = local(t)
        if isinstance(t, torch.Tensor):
            try:
                out.add(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                pass
    return out


def memory_bound(func) -> bool:
    """Whether an op without a FLOP formula is memory-bound by its nature (no note needed)."""
    tags = getattr(func, "tags", ())
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags:
        return True
    base = func._overloadpacket.__name__.split(".")[-1]
    return base.startswith(_MEMORY_BOUND_PREFIXES) or base.lstrip("_").startswith(_MEMORY_BOUND_PREFIXES)




_GEMMS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "_scaled_mm": (0, 1)}


def gemm_dims(func, args) -> tuple:
    """(batch, m, n, k) of a matmul-family op's product; (batch, heads, sequence, head dim) of an
    attention kernel's query (its backward's output gradient: the same shape); else (). What a
    GPU's rate by shape needs (zerolab.predict.gpu)."""
    name = func._overloadpacket.__name__
    if "attention" in name and args and isinstance(local(args[0]), torch.Tensor) and local(args[0]).dim() == 4:
        return tuple(int(x) for x in local(args[0]).shape)
    where = _GEMMS.get(name)
    if where is None or len(args) <= where[1]:
        return ()
    a, b = local(args[where[0]]), local(args[where[1]])
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2 or b.dim() < 2:
        return ()
    batch = a.shape[0] if a.dim() == 3 else 1
    return int(batch), int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1])


def cost(func, args, kwargs, out) -> tuple[float, int, int, bool, str]:
    """(FLOPs, bytes read + written, kernels, has a FLOP formula, compute dtype) of one op on its
    real arguments. Kernels: a foreach op over n tensors is n kernels on a CPU (its per-op overhead
    n times); 0 for an op that costs nothing."""
    packet = func._overloadpacket
    if packet in FREE:
        return 0.0, 0, 0, True, ""
    sch = _schema(func)
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outs = [o for o, new in zip(out if isinstance(out, (tuple, list)) else (out,), sch.fresh) if new]
    out_leaves = [t for t in tree_leaves(outs) if isinstance(t, torch.Tensor)]
    mutated = [t for i, n in sch.mutated for t in tree_leaves(_arg(args, kwargs, i, n)) if isinstance(t, torch.Tensor)]
    if not mutated and (not out_leaves or _storages(out_leaves) <= _storages(ins)):
        return 0.0, 0, 0, True, ""  # views (declared, or sharing their input's storage): nothing moves
    # A written argument is also read, unless the op only writes it (an `out=`, or a fill's, zero's
    # or copy's destination): the calibration's add-into-out moves three tensors, not four.
    read = _read_arguments(sch, args, kwargs)
    moved = sum(map(tensor_bytes, read)) + sum(map(tensor_bytes, out_leaves)) + sum(map(tensor_bytes, mutated))
    first = args[0] if args else None
    kernels = len(first) if isinstance(first, (list, tuple)) and first and isinstance(first[0], torch.Tensor) else 1
    formula = FORMULAS.get(packet)
    if formula is None:
        return 0.0, moved, kernels, False, ""
    la, lk = [local(a) for a in args], {k: local(v) for k, v in kwargs.items()}
    flops = float(formula(*la, **lk, out_val=out))
    if any(_arg(args, kwargs, i, n) for i, n in sch.causal):
        flops /= 2  # a flash kernel skips the masked half (module docstring)
    dtype = next((DTYPE_NAMES.get(local(t).dtype, "fp32") for t in ins if local(t).is_floating_point()), "fp32")
    return flops, moved, kernels, True, dtype
