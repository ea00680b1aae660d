"""The measured side of the ledger: bytes per category from the tensors that exist, each
storage counted once even when several tensors view it; and the process-level figures.

Categories (the ZeRO paper's "model states" are the first four):
  params       compute-dtype weights held by the model
  grads        gradients (full in the model, or the rank's shard)
  master       fp32 master weights (mixed precision), whole or sharded
  optim_state  optimizer state (Adam's m and v, momentum, ...)
  buffers      communication buckets, padding, model buffers
"""
from __future__ import annotations

from typing import Iterable

import torch

CATEGORIES = ("params", "grads", "master", "optim_state", "buffers")
MODEL_STATES = ("params", "grads", "master", "optim_state")


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


def on_host(bytes_by_category: dict[str, int], placement: dict[str, str]) -> int:
    """Bytes of the categories a strategy keeps in host memory (its Traits.placement says "host"):
    what does not count against the device's memory."""
    return sum(v for c, v in bytes_by_category.items() if placement.get(c, "device") == "host")


class StorageCounter:
    """Sums storage bytes over categories, never counting one storage twice."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = {c: 0 for c in CATEGORIES}

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> "StorageCounter":
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            storage, key = t.untyped_storage(), storage_key(t)
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.bytes[category] += storage.nbytes()
        return self

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> "StorageCounter":
        return self.add("optim_state", element_states(optimizer))

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


