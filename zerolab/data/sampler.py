"""The deterministic, rank-sharded, resumable sampler, and what a batch is.

The training split is cut into fixed windows of block_size+1 tokens. Each epoch is a seeded
permutation of the windows; sample g of the run (counting all ranks) is window
perm_{g // n}[g % n]. Step s uses samples [s·B, (s+1)·B) with B the global batch; rank r takes
the contiguous slice r of it, and micro-batch m a slice of that. Everything is a pure function of
(seed, step, rank, world size) and the number of windows, whatever file layout the windows come
from, so any step can be resumed exactly and a global batch is the same set of windows whatever
the world size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class WindowSampler:
    """Maps (step, rank, micro-batch) to window indices; pure, so resuming is exact."""

    def __init__(self, n_windows: int, seed: int, micro_batch: int, grad_accum: int, world_size: int):
        if n_windows <= 0:
            raise ValueError("the data split has no complete window; use more data or a smaller block_size")
        self.n, self.seed = n_windows, seed
        self.micro_batch, self.grad_accum, self.world_size = micro_batch, grad_accum, world_size
        self.global_batch = micro_batch * grad_accum * world_size
        self._perm_cache: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm_cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm_cache = {epoch: torch.randperm(self.n, generator=g)}  # keep one epoch
        return self._perm_cache[epoch]

    def sample_ids(self, step: int, rank: int, micro: int) -> list[int]:
        """Global sample numbers of one micro-batch (g in [step·B, (step+1)·B))."""
        per_rank = self.micro_batch * self.grad_accum
        start = step * self.global_batch + rank * per_rank + micro * self.micro_batch
        return list(range(start, start + self.micro_batch))

    def windows(self, step: int, rank: int, micro: int) -> list[int]:
        return [int(self._perm(g // self.n)[g % self.n]) for g in self.sample_ids(step, rank, micro)]


def windows_to_batch(windows: torch.Tensor, device) -> Batch:
    """Inputs and targets (views of one copy) of token windows (batch, block_size + 1) on `device`.
    On CUDA the windows cross once, from pinned memory, without blocking: a plain .to() from
    pageable memory waits for every kernel already queued (the previous step's update and
    all-gathers), so the host could not prepare the next step while the device runs this one.
    Torch's pinned-memory cache keeps the source alive until the copy is done."""
    if torch.device(device).type == "cuda":  # callers may pass "cpu"/"cuda" strings
        windows = windows.pin_memory().to(device, non_blocking=True)
    else:
        windows = windows.to(device)
    return Batch(windows[:, :-1], windows[:, 1:])


def _mix(*parts: int) -> int:
    """A seed from integers that is the same in every process (unlike hash() of a str)."""
    key = 0
    for p in parts:
        key = (key * 1_000_003 + p) & 0x7FFFFFFFFFFF
    return key


class SyntheticData:
    """Random tokens, a pure function of (seed, step, rank, micro); for benchmarks."""

    def __init__(self, vocab_size: int, block_size: int, seed: int):
        self.vocab_size, self.block_size, self.seed = vocab_size, block_size, seed

    def _rand(self, key: int, micro_batch: int, device) -> Batch:
        g = torch.Generator().manual_seed(key)
        return windows_to_batch(torch.randint(0, self.vocab_size, (micro_batch, self.block_size + 1), generator=g),
                                device)

    def train_batch(self, sampler: WindowSampler, step: int, rank: int, micro: int, device) -> Batch:
        return self._rand(_mix(self.seed, step, rank, micro), sampler.micro_batch, device)

    def val_batch(self, index: int, rank: int, world: int, micro_batch: int, device) -> Batch:
        return self._rand(_mix(self.seed, -1 - index, rank, 0), micro_batch, device)
