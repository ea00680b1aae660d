"""The measured side of the ledger: bytes per category from the tensors that exist, each
storage counted once even when several tensors view it; and the process-level figures.

Categories (the ZeRO paper's "model states" are the first four):
  params       compute-dtype weights held by the model
  grads        gradients (full in the model, or the rank's shard)
  master       fp32 master weights (mixed precision), whole or sharded
  optim_state  optimizer state (Adam's m and v, momentum, ...)
  buffers      communication buckets, padding, model buffers

Every byte also has a place (PLACES): "device", the accelerator's memory, or "host", the CPU
memory of its node (ZeRO-Offload's master, optimizer state and gradient shard, ZeRO-Infinity's
parameter shards). The place is said by whoever adds the tensors, not read from tensor.device:
on a CPU-only machine both places are the CPU's memory, and offload keeps them apart anyway.
"""
from __future__ import annotations

from typing import Iterable

import torch

CATEGORIES = ("params", "grads", "master", "optim_state", "buffers")
MODEL_STATES = ("params", "grads", "master", "optim_state")
PLACES = ("device", "host")


def storage_key(t: torch.Tensor) -> int:
    """The identity of `t`'s storage, the same for every view of it: the address of its
    StorageImpl. Not data_ptr(): a fake tensor (a dry run, zerolab.rehearsal) has none (0)."""
    return t.untyped_storage()._cdata


def is_element_state(v, like: "torch.Tensor | None" = None) -> bool:
    """Whether an optimizer state value holds one number per element of its parameter (Adam's
    moments, a momentum buffer) rather than a scalar (Adam's step counter); with `like`, of that
    parameter's shape exactly."""
    return isinstance(v, torch.Tensor) and v.ndim > 0 and (like is None or v.shape == like.shape)


def element_states(optimizer: torch.optim.Optimizer):
    """Every per-element state tensor of an optimizer (is_element_state)."""
    return (v for state in optimizer.state.values() for v in state.values() if is_element_state(v))


def placed(every: dict[str, int], host: dict[str, int]) -> dict[str, int]:
    """Bytes by category over every place (`every`), with the places added: "device" and "host"
    (totals over CATEGORIES) and "host/<category>" for each category with host bytes. What a
    run records as mem/<key>_bytes (device bytes of a category: its figure minus host/<category>)."""
    out = dict(every)
    out["host"] = sum(host.get(c, 0) for c in CATEGORIES)
    out["device"] = out.get("total", sum(every.get(c, 0) for c in CATEGORIES)) - out["host"]
    out.update({f"host/{c}": host[c] for c in CATEGORIES if host.get(c)})
    return out


def device_part(figures: dict[str, int]) -> dict[str, int]:
    """The device's bytes by category from placed()'s flat keys (a category minus its host/ part)."""
    return {c: figures.get(c, 0) - figures.get(f"host/{c}", 0) for c in CATEGORIES}


class StorageCounter:
    """Sums storage bytes over categories and places, never counting one storage twice.
    `placement` (category -> place) says where a category lives when add() is not told (FSDP2
    under its CPU offload policy keeps every category but buffers on the host)."""

    def __init__(self, placement: dict[str, str] | None = None):
        self.seen: set[int] = set()
        self.placement = placement or {}
        self.bytes = {c: 0 for c in CATEGORIES}
        self.host = {c: 0 for c in CATEGORIES}

    def add(self, category: str, tensors: Iterable[torch.Tensor | None], place: str | None = None) -> "StorageCounter":
        """Count `tensors` under `category`, in `place` ("device" or "host"; by default where the
        counter's placement puts the category, else the device)."""
        place = place or self.placement.get(category, "device")
        if place not in PLACES:
            raise ValueError(f"place={place!r} is not one of {', '.join(PLACES)}")
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            storage, key = t.untyped_storage(), storage_key(t)
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.bytes[category] += storage.nbytes()
            if place == "host":
                self.host[category] += storage.nbytes()
        return self

    def add_optimizer(self, optimizer: torch.optim.Optimizer, place: str | None = None) -> "StorageCounter":
        return self.add("optim_state", element_states(optimizer), place)

    def result(self) -> dict[str, int]:
        """Bytes by category (every place), model_states, total, and the places (placed())."""
        out = dict(self.bytes)
        out["model_states"] = sum(out[c] for c in MODEL_STATES)
        out["total"] = sum(out[c] for c in CATEGORIES)
        return placed(out, self.host)


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


