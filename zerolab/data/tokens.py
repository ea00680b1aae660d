"""Token files on disk: the two layouts, the sidecar, and the checks made before any rank trains.

A token file is a flat, headerless array of token ids (nanoGPT's format), memory-mapped, never
read whole. `data.path` names one of two layouts:

- a file (what `python -m zerolab data prepare` writes): the validation split is its tail,
  `data.val_fraction` of its tokens;
- a directory holding `train.bin` and `val.bin` (nanoGPT's layout): each split is its own file
  and `data.val_fraction` is not used.

Each token file is uint16 unless its sidecar says otherwise. The sidecar is a small JSON file
beside it, named `<token file>.json` (`corpus.bin.json`, `train.bin.json`), written by prepare
after the tokens: dtype, the tokenizer's vocabulary size and sha256, the token count, the largest
token and the sources. Training reads only `dtype` (and checks `tokens` against the file's size,
so a sidecar left beside a different file is refused); the vocabulary check reads `max_token`
when it is there and scans the file once otherwise. A hand-written `{"dtype": "uint32"}` is a
valid sidecar.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from zerolab.atomic import atomic_write_text
from zerolab.data.sampler import Batch, WindowSampler, windows_to_batch
from zerolab.errors import ConfigError

TOKEN_DTYPE = np.uint16  # a token file without a sidecar
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
NANOGPT_SPLITS = {"train": "train.bin", "val": "val.bin"}
SCAN_CHUNK_TOKENS = 1 << 24  # tokens mapped at a time by the scan: 32 MiB of uint16, 64 MiB of uint32
SIDECAR_VERSION = 1


def sidecar_path(path: str) -> str:
    return path + ".json"


def dtype_for_vocab(vocab_size: int) -> str:
    """uint16 when every id (0 .. vocab_size-1) fits in 16 bits, else uint32: half the bytes for
    GPT-2's 50257, whole ids for Llama 3's 128256."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit in uint32 token ids")


def write_sidecar(path: str, meta: dict) -> None:
    meta = {"format": "zerolab-tokens", "version": SIDECAR_VERSION, **meta}
    atomic_write_text(sidecar_path(path), json.dumps(meta, indent=1) + "\n")


def read_sidecar(path: str) -> Optional[dict]:
    """The sidecar of token file `path`, checked; None when there is none."""
    side = sidecar_path(path)
    if not os.path.isfile(side):
        return None
    fix = f"prepare the file again, or delete {side} to read {path} as uint16"
    try:
        with open(side) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as err:
        raise ConfigError(f"the sidecar {side} of token file {path} is not readable JSON ({err}); {fix}.") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"the sidecar {side} of token file {path} is not a JSON object; {fix}.")
    if meta.setdefault("dtype", "uint16") not in DTYPES:
        raise ConfigError(f"the sidecar {side} says dtype {meta['dtype']!r}; token files are "
                          f"{' or '.join(DTYPES)}. {fix[0].upper()}{fix[1:]}.")
    for key in ("tokens", "max_token", "vocab_size"):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"the sidecar {side} has {key}={value!r}, not a count; {fix}.")
    return meta


@dataclass(frozen=True)
class TokenFile:
    """One headerless token file: its dtype (from its sidecar, uint16 without one) and length."""
    path: str
    dtype: type
    n_tokens: int
    sidecar: Optional[dict]

    def open(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r")


def _prepare_cmd(path: str) -> str:
    return f"`python -m zerolab data prepare --src DIR_OR_FILES --out {path}`"


def open_token_file(path: str) -> TokenFile:
    """Raise ConfigError unless `path` is a non-empty file of whole tokens that agrees with its
    sidecar; the message names the path and the fix."""
    prepare_cmd = _prepare_cmd(path)
    if not os.path.exists(path):
        raise ConfigError(f"data.path={path}: no such token file. Create it with {prepare_cmd}, "
                          f"or give a directory holding train.bin and val.bin (nanoGPT's layout), "
                          f"or leave data.path empty to train on the embedded corpus.")
    if not os.path.isfile(path):
        raise ConfigError(f"data.path={path} is not a file; give a token file made by {prepare_cmd}.")
    meta = read_sidecar(path)
    name = meta["dtype"] if meta else "uint16"
    dtype = DTYPES[name]
    size = os.path.getsize(path)
    if size == 0:
        raise ConfigError(f"token file {path} is empty (0 bytes). Prepare it again with {prepare_cmd}.")
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ConfigError(f"token file {path} has {size} bytes, not a whole number of {name} tokens; "
                          f"it is truncated or not a zerolab token file. Prepare it again with {prepare_cmd}.")
    n = size // itemsize
    if meta and meta.get("tokens") is not None and meta["tokens"] != n:
        raise ConfigError(f"token file {path} holds {n} {name} tokens ({size} bytes) but its sidecar "
                          f"{sidecar_path(path)} says {meta['tokens']}: the sidecar belongs to another "
                          f"version of the file. Prepare it again with {prepare_cmd}, or delete the sidecar "
                          f"(the file is then read as uint16 and scanned).")
    return TokenFile(path, dtype, n, meta)


def token_layout(path: str) -> tuple[TokenFile, Optional[TokenFile]]:
    """(train, val) token files of data.path: val is None for a single file (its tail is the
    validation split), the directory's val.bin in nanoGPT's layout."""
    if not os.path.isdir(path):
        return open_token_file(path), None
    files = {split: os.path.join(path, name) for split, name in NANOGPT_SPLITS.items()}
    missing = [os.path.basename(f) for f in files.values() if not os.path.isfile(f)]
    if missing:
        raise ConfigError(f"data.path={path} is a directory without {' and '.join(missing)}: a directory "
                          f"must hold train.bin and val.bin (nanoGPT's layout, uint16 unless a sidecar "
                          f"train.bin.json says otherwise); or give a token file made by "
                          f"{_prepare_cmd(path + '.bin')}.")
    train, val = open_token_file(files["train"]), open_token_file(files["val"])
    digests = {tf.path: ((tf.sidecar or {}).get("tokenizer") or {}).get("sha256") for tf in (train, val)}
    if None not in digests.values() and len(set(digests.values())) > 1:
        raise ConfigError(f"train.bin and val.bin of {path} were made with different tokenizers (sha256 "
                          f"{', '.join(f'{os.path.basename(p)} {d[:12]}' for p, d in digests.items())}, from their "
                          f"sidecars); tokenize both splits with one tokenizer.")
    return train, val


def split_sizes(n_tokens: int, val_fraction: float) -> tuple[int, int]:
    """(training tokens, validation tokens) of a single file: the validation split is its tail."""
    n_val = int(n_tokens * val_fraction)
    return n_tokens - n_val, n_val


def _check_single_file_windows(path: str, n: int, block_size: int, val_fraction: float) -> None:
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


def _check_split_file_windows(tf: TokenFile, split: str, block_size: int) -> None:
    window = block_size + 1
    if tf.n_tokens >= window:
        return
    fixes = [f"a longer {os.path.basename(tf.path)}"]
    if tf.n_tokens > 1:
        fixes.append(f"model.block_size={tf.n_tokens - 1} or smaller")
    raise ConfigError(f"token file {tf.path} (the {split} split, nanoGPT's layout) holds {tf.n_tokens} tokens, "
                      f"less than one window of model.block_size+1 = {window} tokens. Use {' or '.join(fixes)}.")


def scan_max(path: str, dtype, chunk_tokens: int = SCAN_CHUNK_TOKENS) -> int:
    """The largest token of a token file, read once through memory maps of `chunk_tokens` each:
    each window is unmapped before the next, so resident memory stays one window whatever the
    file's size, and numpy's max runs at memory speed (about a second per few GB from the page
    cache)."""
    itemsize = np.dtype(dtype).itemsize
    n = os.path.getsize(path) // itemsize
    top = 0
    for start in range(0, n, chunk_tokens):
        window = np.memmap(path, dtype=dtype, mode="r", offset=start * itemsize,
                           shape=(min(chunk_tokens, n - start),))
        top = max(top, int(window.max()))
        del window
    return top


def largest_token(tf: TokenFile) -> tuple[int, str]:
    """The largest token of `tf` and where that figure comes from: its sidecar, else a scan."""
    if tf.sidecar and tf.sidecar.get("max_token") is not None:
        return tf.sidecar["max_token"], f"from its sidecar {os.path.basename(sidecar_path(tf.path))}"
    return scan_max(tf.path, tf.dtype), "found by scanning the file"


def check_vocab(tf: TokenFile, vocab_size: int, fix: Optional[Callable[[int], str]] = None) -> None:
    """Every token must index a row of the model's embedding: the largest below model.vocab_size.
    `fix`: need -> the advice where model.vocab_size is not what sets the model's vocabulary
    (model=hf: its transformers config's vocab_size; zerolab.models.sources.vocab_fix)."""
    top, where = largest_token(tf)
    if top < vocab_size:
        return
    tok_vocab = (tf.sidecar or {}).get("vocab_size")
    need = max(top + 1, tok_vocab or 0)
    tokenizer = f"; its tokenizer's vocabulary is {tok_vocab}" if tok_vocab else ""
    below = f"the model's vocabulary ({vocab_size} tokens)" if fix else f"model.vocab_size={vocab_size}"
    advice = fix(need) if fix else (f"Set model.vocab_size={need} or more, or prepare the data with a tokenizer "
                                    f"whose vocabulary is at most {vocab_size}.")
    raise ConfigError(f"token file {tf.path} holds token {top} ({where}{tokenizer}), which is not below {below}: "
                      f"the model has no embedding row for it. {advice}")


def check_token_file(path: str, block_size: int, val_fraction: float, vocab_size: Optional[int] = None,
                     fix: Optional[Callable[[int], str]] = None) -> tuple[TokenFile, Optional[TokenFile]]:
    """Raise ConfigError unless data.path (a token file or a nanoGPT directory) gives at least one
    window of block_size+1 tokens in each split and, when `vocab_size` is given, holds no token
    at or above it. The message names the file, the sizes and the fix (`fix`: check_vocab's).
    Returns the layout."""
    train, val = token_layout(path)
    if val is None:
        _check_single_file_windows(path, train.n_tokens, block_size, val_fraction)
    else:
        _check_split_file_windows(train, "training", block_size)
        _check_split_file_windows(val, "validation", block_size)
    if vocab_size is not None:
        for tf in (train, val) if val is not None else (train,):
            check_vocab(tf, vocab_size, fix)
    return train, val


class TokenData:
    """Train/val splits of a token file or a nanoGPT directory, with the sampler and eval batches."""

    def __init__(self, path: str, block_size: int, val_fraction: float):
        train, val = check_token_file(path, block_size, val_fraction)
        self.block_size = block_size
        self.window = block_size + 1
        self.tokens = train.open()  # memory-mapped: pages are read as windows are gathered
        if val is None:
            self.train_end = split_sizes(len(self.tokens), val_fraction)[0]
            self.splits = {"train": self.tokens[:self.train_end], "val": self.tokens[self.train_end:]}
        else:
            self.train_end = len(self.tokens)
            self.splits = {"train": self.tokens, "val": val.open()}

    def n_windows(self, split: str) -> int:
        return len(self.splits[split]) // self.window

    def _gather(self, split: str, windows: list[int], device: torch.device) -> Batch:
        tokens, w = self.splits[split], self.window
        rows = np.stack([tokens[i * w: (i + 1) * w] for i in windows])
        return windows_to_batch(torch.from_numpy(rows.astype(np.int64)), device)

    def train_batch(self, sampler: WindowSampler, step: int, rank: int, micro: int, device) -> Batch:
        return self._gather("train", sampler.windows(step, rank, micro), device)

    def val_batch(self, index: int, rank: int, world: int, micro_batch: int, device) -> Batch:
        """Fixed eval batches: the same windows every evaluation, disjoint across ranks."""
        n = self.n_windows("val")
        start = (index * world + rank) * micro_batch
        return self._gather("val", [(start + i) % n for i in range(micro_batch)], device)
