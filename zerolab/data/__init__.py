"""Token data: files on disk, the sampler, and the preparation of text into tokens.

- tokens.py: the two layouts `data.path` names (a prepared file whose tail is the validation
  split, or nanoGPT's directory of train.bin and val.bin), the sidecar that says each file's dtype
  and tokenizer, and the checks made before any rank trains (sizes, and no token at or above
  model.vocab_size);
- sampler.py: the deterministic, rank-sharded, resumable window sampler (a pure function of
  seed, step, rank and world size, whatever the layout);
- prepare.py: text to tokens, byte-level or with a Hugging Face tokenizer.json, streaming and in
  parallel; the embedded corpus (the running interpreter's standard-library sources, real text
  that every machine with Python has); cli.py: `python -m zerolab data prepare`.

zerolab's data code imports only zerolab.schema, zerolab.errors and zerolab.atomic from zerolab.
"""
from __future__ import annotations

from zerolab.schema import DataConfig
from zerolab.data.prepare import (EMBEDDED_MAX_BYTES, EMBEDDED_NAME, Prepared, embedded_corpus, prepare,
                                  prepare_tokens, source_files, stdlib_sources, train_tokenizer)
from zerolab.data.sampler import Batch, SyntheticData, WindowSampler, windows_to_batch
from zerolab.data.tokens import (DTYPES, TOKEN_DTYPE, TokenData, TokenFile, check_token_file, check_vocab,
                                 dtype_for_vocab, read_sidecar, scan_max, sidecar_path, split_sizes,
                                 token_layout, write_sidecar)

__all__ = [
    "Batch", "DTYPES", "EMBEDDED_MAX_BYTES", "EMBEDDED_NAME", "Prepared", "SyntheticData", "TOKEN_DTYPE",
    "TokenData", "TokenFile", "WindowSampler", "build_data", "check_data", "check_token_file", "check_vocab",
    "dtype_for_vocab", "embedded_corpus", "prepare", "prepare_tokens", "read_sidecar", "scan_max",
    "sidecar_path", "source_files", "split_sizes", "stdlib_sources", "token_layout", "token_path",
    "train_tokenizer", "windows_to_batch", "write_sidecar",
]


def token_path(cfg: DataConfig) -> str:
    """What a text run reads: data.path (a token file or a nanoGPT directory), or the embedded
    corpus (prepared on first use)."""
    return cfg.path or embedded_corpus(cfg.cache_dir)


def check_data(cfg: DataConfig, block_size: int, vocab_size: int, fix=None) -> None:
    """Before anything is built: the data gives at least one window of each split, and its
    largest token is below the model's vocabulary (from the sidecar, else one scan). `fix`: how
    to give the model more rows where that is not model.vocab_size (tokens.check_vocab)."""
    if cfg.kind == "text":
        check_token_file(token_path(cfg), block_size, cfg.val_fraction, vocab_size, fix)


def build_data(cfg: DataConfig, block_size: int, vocab_size: int, seed: int):
    """Returns (dataset, number of training windows). Any rank may prepare the embedded corpus:
    the write is atomic, so racing ranks produce the same file."""
    if cfg.kind == "synthetic":
        return SyntheticData(vocab_size, block_size, seed), 1 << 30
    data = TokenData(token_path(cfg), block_size, cfg.val_fraction)
    return data, data.n_windows("train")
