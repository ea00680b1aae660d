"""Token data and a deterministic, rank-sharded, resumable sampler.

A token file is a flat array of uint16 tokens (nanoGPT's format), memory-mapped. Text is
tokenized byte-level (token = byte value, vocab 256), so no tokenizer download is needed. The
embedded corpus is the running interpreter's own standard-library sources: real text that every
machine with Python has.

Sampling: the training split is cut into fixed windows of block_size+1 tokens. Each epoch is a
seeded permutation of the windows; sample g of the run (counting all ranks) is window
perm_{g // n}[g % n]. Step s uses samples [s·B, (s+1)·B) with B the global batch; rank r takes
the contiguous slice r of it, and micro-batch m a slice of that. Everything is a pure function of
(seed, step, rank, world size), so any step can be resumed exactly and a global batch is the
same set of windows whatever the world size.
"""
from __future__ import annotations

import glob
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch

from zerolab.atomic import atomic_path
from zerolab.config import ConfigError, DataConfig

TOKEN_DTYPE = np.uint16
EMBEDDED_NAME = "stdlib-py{}.{}-bytes.bin"
EMBEDDED_MAX_BYTES = 8 * 2**20  # plenty for CPU runs, small enough to prepare in about a second


def stdlib_sources() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py")))
    return [f for f in files if "site-packages" not in f and "test" not in os.path.relpath(f, root).split(os.sep)[0]]


def prepare(sources: Iterable[str], out: str, max_bytes: Optional[int] = None) -> int:
    """Byte-tokenize `sources` (files or directories of *.py/*.txt/*.md) into `out`; returns tokens."""
    files: list[str] = []
    for src in sources:
        if os.path.isdir(src):
            for ext in ("py", "txt", "md", "rst"):
                files += sorted(glob.glob(os.path.join(src, "**", f"*.{ext}"), recursive=True))
        elif os.path.isfile(src):
            files.append(src)
        else:
            raise FileNotFoundError(f"data source {src!r} does not exist")
    if not files:
        raise ValueError(f"no text files found in {list(sources)}")
    chunks, total = [], 0
    for f in files:
        with open(f, "rb") as fh:
            b = fh.read()
        if max_bytes is not None and total + len(b) > max_bytes:
            b = b[: max_bytes - total]
        chunks.append(b)
        total += len(b)
        if max_bytes is not None and total >= max_bytes:
            break
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(TOKEN_DTYPE)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with atomic_path(out) as tmp:  # concurrent ranks never see a half-written file
        tokens.tofile(tmp)
    return len(tokens)


def embedded_corpus(cache_dir: str) -> str:
    import sys

    path = os.path.join(os.path.expanduser(cache_dir), EMBEDDED_NAME.format(*sys.version_info[:2]))
    if not os.path.exists(path):
        prepare(stdlib_sources(), path, max_bytes=EMBEDDED_MAX_BYTES)
    return path


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


def split_sizes(n_tokens: int, val_fraction: float) -> tuple[int, int]:
    """(training tokens, validation tokens): the validation split is the file's tail."""
    n_val = int(n_tokens * val_fraction)
    return n_tokens - n_val, n_val


def check_token_file(path: str, block_size: int, val_fraction: float) -> None:
    """Raise ConfigError unless `path` is a token file with at least one window of block_size+1
    tokens in each split; the message names the path, the sizes and the fix."""
    prepare_cmd = f"`python -m zerolab data prepare --src DIR_OR_FILES --out {path}`"
    if not os.path.exists(path):
        raise ConfigError(f"data.path={path}: no such token file. Create it with {prepare_cmd}, "
                          f"or leave data.path empty to train on the embedded corpus.")
    if not os.path.isfile(path):
        raise ConfigError(f"data.path={path} is not a file; give a token file made by {prepare_cmd}.")
    size = os.path.getsize(path)
    if size == 0:
        raise ConfigError(f"token file {path} is empty (0 bytes). Prepare it again with {prepare_cmd}.")
    if size % np.dtype(TOKEN_DTYPE).itemsize:
        raise ConfigError(f"token file {path} has {size} bytes, not a whole number of uint16 tokens; "
                          f"it is truncated or not a zerolab token file. Prepare it again with {prepare_cmd}.")
    n = size // np.dtype(TOKEN_DTYPE).itemsize
    n_train, n_val = split_sizes(n, val_fraction)
    window = block_size + 1
    if min(n_train, n_val) >= window:
        return
    # val_fraction < 0.5, so the validation split is the shorter one
    short = "validation split has" if n_train >= window else "training and validation splits have"
    need = math.ceil(window / val_fraction)
    while split_sizes(need, val_fraction)[1] < window:  # int() rounding of the split
        need += 1
    fixes = [f"a longer token file (at least {need} tokens at this data.val_fraction)"]
    if min(n_train, n_val) > 1:
        fixes.append(f"model.block_size={min(n_train, n_val) - 1} or smaller")
    if n_train >= window and window / n < 0.5:
        fixes.append(f"data.val_fraction={math.ceil(window / n * 1000) / 1000} or more")
    raise ConfigError(f"token file {path} holds {n} tokens: {n_train} for training and {n_val} for "
                      f"validation (data.val_fraction={val_fraction}). One window is model.block_size+1 = "
                      f"{window} tokens, so the {short} no complete window. Use "
                      f"{' or '.join(fixes)}.")


def token_path(cfg: DataConfig) -> str:
    """The token file a text run reads: data.path, or the embedded corpus (prepared on first use)."""
    return cfg.path or embedded_corpus(cfg.cache_dir)


def check_data(cfg: DataConfig, block_size: int) -> None:
    """Before anything is built: the data can give at least one window of each split."""
    if cfg.kind == "text":
        check_token_file(token_path(cfg), block_size, cfg.val_fraction)


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


class TokenData:
    """Train/val splits of a token file, with the sampler and eval batches."""

    def __init__(self, path: str, block_size: int, val_fraction: float):
        check_token_file(path, block_size, val_fraction)
        self.tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
        self.block_size = block_size
        self.train_end = split_sizes(len(self.tokens), val_fraction)[0]
        self.window = block_size + 1

    def n_windows(self, split: str) -> int:
        length = self.train_end if split == "train" else len(self.tokens) - self.train_end
        return length // self.window

    def _gather(self, split: str, windows: list[int], device: torch.device) -> Batch:
        base = 0 if split == "train" else self.train_end
        rows = np.stack([self.tokens[base + w * self.window: base + (w + 1) * self.window] for w in windows])
        return windows_to_batch(torch.from_numpy(rows.astype(np.int64)), device)

    def train_batch(self, sampler: WindowSampler, step: int, rank: int, micro: int, device) -> Batch:
        return self._gather("train", sampler.windows(step, rank, micro), device)

    def val_batch(self, index: int, rank: int, world: int, micro_batch: int, device) -> Batch:
        """Fixed eval batches: the same windows every evaluation, disjoint across ranks."""
        n = self.n_windows("val")
        start = (index * world + rank) * micro_batch
        return self._gather("val", [(start + i) % n for i in range(micro_batch)], device)


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


def build_data(cfg: DataConfig, block_size: int, vocab_size: int, seed: int):
    """Returns (dataset, number of training windows). Any rank may prepare the embedded corpus:
    the write is atomic, so racing ranks produce the same file."""
    if cfg.kind == "synthetic":
        return SyntheticData(vocab_size, block_size, seed), 1 << 30
    data = TokenData(token_path(cfg), block_size, cfg.val_fraction)
    return data, data.n_windows("train")
