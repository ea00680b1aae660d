"""Text to token files: byte-level (token = byte, vocabulary 256) or with any Hugging Face
tokenizer.json, streaming and in parallel.

Streaming: sources are read in pieces of about `chunk_bytes`; a few tasks (each about
`chunk_bytes` of text) are in flight at once, and their tokens are appended to the output in
source order as they come back, so memory stays (2·workers + 1) tasks whatever the corpus size.
Each file is a document: its pieces are encoded separately, and the tokenizer's end-of-text token
(`<|endoftext|>` when it has one) follows its last piece, as in nanoGPT's GPT-2 preparation.
A file longer than a piece is cut at a line start before a printable ASCII character, or between
two ASCII words ("word| word"): for regex-splitting byte-level BPE (GPT-2, cl100k, Llama 3) no
pre-token crosses such a cut, so the tokens are the same as encoding the file whole
(tests/test_tokenized_data.py checks it). A tokenizer that adds a prefix space, or whose
pre-tokens can cross spaces or lines (SentencePiece's Metaspace, no pre-tokenizer), sees each
cut as a document start, once per `chunk_bytes` of a long file.

Parallel: `workers` threads each encode a task with `encode_batch_fast` (no offsets computed);
the tokenizers library releases the GIL while it encodes, so the threads run on separate cores
within one process (its own rayon pool is switched off meanwhile, so `workers` is the number of
cores used). The output does not depend on `workers`.
"""
from __future__ import annotations

import functools
import glob
import os
import re
import sys
import sysconfig
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import numpy as np

from zerolab.atomic import atomic_path, sha256_file
from zerolab.data.stale import hold, remove_stale
from zerolab.data.tokens import DTYPES, TOKEN_DTYPE, dtype_for_vocab, sidecar_path, write_sidecar

EMBEDDED_NAME = "stdlib-py{}.{}-bytes.bin"
EMBEDDED_MAX_BYTES = 8 * 2**20  # plenty for CPU runs, small enough to prepare in about a second
TEXT_EXTENSIONS = ("py", "txt", "md", "rst")  # what a directory given to --src contributes
CHUNK_BYTES = 1 << 20  # a piece of a file, and the text of one task: 1 MiB
MAX_LISTED = 100  # --src arguments the sidecar lists (a shell glob can give millions)
EOT = "<|endoftext|>"  # GPT-2's document separator; --train-tokenizer gives its BPE one, last


def stdlib_sources() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py")))
    return [f for f in files if "site-packages" not in f and "test" not in os.path.relpath(f, root).split(os.sep)[0]]


def source_files(sources: Iterable[str]) -> list[str]:
    """Files named, and the *.py/*.txt/*.md/*.rst files under directories named, in a stable order."""
    files: list[str] = []
    sources = list(sources)
    for src in sources:
        if os.path.isdir(src):
            for ext in TEXT_EXTENSIONS:
                files += sorted(glob.glob(os.path.join(src, "**", f"*.{ext}"), recursive=True))
        elif os.path.isfile(src):
            files.append(src)
        else:
            raise FileNotFoundError(f"data source {src!r} does not exist")
    if not files:
        raise ValueError(f"no text files found in {sources}")
    return files


# Where a long file may be cut: at a line start before a printable character ("\n|x"), or
# between an ASCII letter and a space before another letter ("word| word"). No pre-token of the
# GPT-2 or cl100k/Llama 3 split patterns crosses either: the first pre-token ends with the newline
# or the letter, the next starts with the character or the space.
_CUT = re.compile(rb"\n(?=[!-~])|(?<=[A-Za-z])(?= [A-Za-z])")


def _cut(buf: bytes) -> int:
    """Where to end a piece of `buf`: its last cut point (see _CUT); 0 when it has none."""
    for tail in (1 << 16, len(buf)):  # a cut is nearly always in the last 64 KiB
        last = 0
        for m in _CUT.finditer(buf, max(0, len(buf) - tail)):
            last = m.end()
        if last:
            return last
    return 0


def _whole_chars(buf: bytes) -> int:
    """The length of the longest prefix of `buf` that does not end inside a UTF-8 character."""
    j = len(buf) - 1
    while j > 0 and len(buf) - j < 4 and buf[j] & 0xC0 == 0x80:  # continuation bytes
        j -= 1
    if j < 0:
        return 0
    lead = buf[j]
    need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return j if j + need > len(buf) else len(buf)


class _Reader:
    """(piece, ends a document) over the files, at most `max_bytes` in all, in order."""

    def __init__(self, files: list[str], chunk_bytes: int, max_bytes: Optional[int], split_lines: bool):
        self.files, self.chunk, self.left, self.split_lines = files, chunk_bytes, max_bytes, split_lines
        self.files_read, self.bytes_read = 0, 0

    def __iter__(self) -> Iterator[tuple[bytes, bool]]:
        for path in self.files:
            if self.left is not None and self.left <= 0:
                return
            self.files_read += 1
            yield from self._file(path)

    def _file(self, path: str) -> Iterator[tuple[bytes, bool]]:
        buf = b""
        with open(path, "rb") as fh:
            while True:
                want = self.chunk if self.left is None else min(self.chunk, self.left)
                data = fh.read(want) if want > 0 else b""
                self.bytes_read += len(data)
                if self.left is not None:
                    self.left -= len(data)
                if not data:
                    if self.split_lines and self.left is not None and self.left <= 0:
                        buf = buf[:_whole_chars(buf)]  # the byte budget may end mid-character
                    yield buf, True
                    return
                buf += data
                if len(buf) < self.chunk:
                    continue
                if not self.split_lines:
                    yield buf, False
                    buf = b""
                    continue
                end = _cut(buf)
                if not end:
                    if len(buf) < 4 * self.chunk:
                        continue  # a long line: read on to its end, up to 4 pieces
                    end = _whole_chars(buf) or len(buf)  # a line of 4 pieces: cut inside it
                yield buf[:end], False
                buf = buf[end:]


@dataclass
class Prepared:
    """What a prepare wrote, and how it went."""
    out: str
    tokens: int
    dtype: str
    vocab_size: int
    max_token: int
    files: int
    bytes: int
    seconds: float
    max_pending_bytes: int  # the most source bytes read but not yet written: flat in corpus size
    tokenizer: Optional[str] = None
    meta: dict = field(default_factory=dict)
    # (path, bytes, pid) of each temporary file a killed prepare had left, removed (zerolab.data.stale)
    removed: list = field(default_factory=list)


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from its tokenizer.json: a local file, nothing is downloaded."""
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {path!r} does not exist (give a Hugging Face tokenizer.json)")
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the library raises a bare Exception for a malformed file
        raise ValueError(f"{path} is not a Hugging Face tokenizer.json: {err}") from None


def vocab_bound(tok) -> int:
    """One more than the largest id the tokenizer can produce (added tokens included)."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def train_tokenizer(files: list[str], vocab_size: int, out: str, max_bytes: Optional[int] = None,
                    chunk_bytes: int = CHUNK_BYTES, progress: Optional[bool] = False) -> str:
    """Train a byte-level BPE of GPT-2's shape on `files` (offline) and save it as `out`: 256 byte
    tokens, merges up to `vocab_size` - 1, then `<|endoftext|>` as the last id (GPT-2: 50257 =
    256 + 50000 merges + 1). Streaming: the trainer counts pre-tokens, it never holds the text.
    Fewer merges than asked when the sources have no more pairs to merge."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 257:
        raise ValueError(f"--train-tokenizer {vocab_size}: a byte-level BPE needs at least 257 tokens "
                         f"(256 bytes and {EOT})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=bool(progress))
    texts = (piece.decode("utf-8", errors="replace") for piece, _ in _Reader(files, chunk_bytes, max_bytes, True))
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([EOT])
    with atomic_path(out) as tmp:
        tok.save(tmp)
    return out


def tokenizer_beside(out: str) -> str:
    """Where --train-tokenizer saves its tokenizer: corpus.bin -> corpus.tokenizer.json."""
    return os.path.splitext(out)[0] + ".tokenizer.json"


def _encode(tok, dtype, eot: Optional[int], items: list[tuple[bytes, bool]]) -> np.ndarray:
    texts = [piece.decode("utf-8", errors="replace") for piece, _ in items]
    parts = []
    for enc, (_, ends) in zip(tok.encode_batch_fast(texts, add_special_tokens=False), items):
        parts.append(np.asarray(enc.ids, dtype=dtype))
        if ends and eot is not None:
            parts.append(np.array([eot], dtype=dtype))
    return np.concatenate(parts) if parts else np.empty(0, dtype)


def _bytes(items: list[tuple[bytes, bool]]) -> np.ndarray:
    """Byte-level: token = byte, no end-of-text (the files are concatenated, as always)."""
    return np.frombuffer(b"".join(piece for piece, _ in items), dtype=np.uint8).astype(TOKEN_DTYPE)


def _tasks(reader: _Reader, chunk_bytes: int) -> Iterator[list[tuple[bytes, bool]]]:
    """Pieces grouped into tasks of about chunk_bytes (small files share one)."""
    task, size = [], 0
    for piece, ends in reader:
        task.append((piece, ends))
        size += len(piece)
        if size >= chunk_bytes:
            yield task
            task, size = [], 0
    if task:
        yield task


@contextmanager
def _own_threads_only() -> Iterator[None]:
    """Switches the tokenizers library's own thread pool off while our threads encode."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _tokenizer_for(tokenizer: Optional[str], eot: Optional[str]):
    """(tokenizer, vocabulary bound, end-of-document id, dtype name, what the sidecar says of it);
    byte-level when `tokenizer` is None."""
    if not tokenizer:
        return None, 256, None, "uint16", {"kind": "bytes"}
    tok = load_tokenizer(tokenizer)
    vocab = vocab_bound(tok)
    eot_id = None
    if eot == "auto":
        eot_id = tok.token_to_id(EOT)
    elif eot:
        eot_id = tok.token_to_id(eot)
        if eot_id is None:
            raise ValueError(f"--eot {eot!r} is not a token of {tokenizer}")
    about = {"kind": "huggingface", "path": os.path.abspath(tokenizer), "sha256": sha256_file(tokenizer), "eot": eot_id}
    return tok, vocab, eot_id, dtype_for_vocab(vocab), about


class _TokenSink:
    """Appends encoded pieces to the open token file in source order, keeping the count, the
    largest token, the progress bar and the text in flight (encoded or not yet written)."""

    def __init__(self, fh, bar):
        self.fh, self.bar = fh, bar
        self.tokens, self.top, self.pending, self.max_pending = 0, 0, 0, 0

    def submitted(self, nbytes: int) -> None:
        self.pending += nbytes
        self.max_pending = max(self.max_pending, self.pending)

    def write(self, tokens: np.ndarray, nbytes: int) -> None:
        tokens.tofile(self.fh)
        self.tokens += len(tokens)
        if len(tokens):
            self.top = max(self.top, int(tokens.max()))
        self.pending -= nbytes
        self.bar.update(nbytes)


def _encode_all(reader, encode, workers: int, chunk_bytes: int, sink: _TokenSink) -> None:
    """Every task of the reader through `encode`, on `workers` threads, written in order; at most
    2 tasks per worker in flight (the reader waits for the oldest), so memory stays flat."""
    if workers == 1:
        for task in _tasks(reader, chunk_bytes):
            nbytes = sum(len(p) for p, _ in task)
            sink.submitted(nbytes)
            sink.write(encode(task), nbytes)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="tokenize") as pool:
        queue: deque = deque()
        for task in _tasks(reader, chunk_bytes):
            nbytes = sum(len(p) for p, _ in task)
            sink.submitted(nbytes)
            queue.append((pool.submit(encode, task), nbytes))
            if len(queue) >= 2 * workers:
                fut, nb = queue.popleft()
                sink.write(fut.result(), nb)
        while queue:
            fut, nb = queue.popleft()
            sink.write(fut.result(), nb)


def prepare_tokens(sources: Iterable[str], out: str, tokenizer: Optional[str] = None,
                   train_vocab: Optional[int] = None, max_bytes: Optional[int] = None,
                   workers: int = 1, chunk_bytes: int = CHUNK_BYTES, eot: Optional[str] = "auto",
                   progress: Optional[bool] = False) -> Prepared:
    """Tokenize `sources` into the token file `out` and its sidecar `out`.json.

    tokenizer: a Hugging Face tokenizer.json; None (and no train_vocab): byte-level.
    train_vocab: first train a byte-level BPE of this vocabulary on the sources, saved beside out.
    eot: the token that ends each document: "auto" (`<|endoftext|>` if the tokenizer has it),
    a token string, or None/"" for none. Byte-level files have none (token = byte, as always).
    progress: a progress bar on stderr (None: when stderr is a terminal).
    """
    from tqdm import tqdm

    sources = list(sources)
    files = source_files(sources)
    if workers < 1:
        raise ValueError(f"workers={workers}: give 1 or more")
    if tokenizer and train_vocab:
        raise ValueError("give --tokenizer or --train-tokenizer, not both")
    start = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    removed = remove_stale([out, sidecar_path(out), tokenizer_beside(out)])
    if train_vocab:
        tokenizer = train_tokenizer(files, train_vocab, tokenizer_beside(out), max_bytes, chunk_bytes, progress)
    tok, vocab, eot_id, name, about = _tokenizer_for(tokenizer, eot)
    total = sum(os.path.getsize(f) for f in files)
    total = total if max_bytes is None else min(total, max_bytes)
    reader = _Reader(files, chunk_bytes, max_bytes, split_lines=tok is not None)
    encode = _bytes if tok is None else functools.partial(_encode, tok, DTYPES[name], eot_id)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {os.path.basename(out)}",
               disable=None if progress is None else not progress, file=sys.stderr)
    with atomic_path(out) as tmp, open(tmp, "wb") as fh, _own_threads_only():
        hold(fh)  # while it is written: a later prepare leaves a live writer's file alone
        sink = _TokenSink(fh, bar)
        _encode_all(reader, encode, workers, chunk_bytes, sink)
        # Last, just before the new tokens replace the old: an old sidecar must not describe the new
        # tokens, even for a moment, and a prepare that failed leaves the old file and sidecar whole.
        try:
            os.remove(sidecar_path(out))
        except FileNotFoundError:
            pass
    bar.close()
    meta = {"dtype": name, "vocab_size": vocab, "max_token": sink.top, "tokens": sink.tokens, "tokenizer": about,
            "sources": [os.path.abspath(s) for s in sources[:MAX_LISTED]], "files": reader.files_read,
            "bytes": reader.bytes_read}
    if len(sources) > MAX_LISTED:
        meta["sources_not_listed"] = len(sources) - MAX_LISTED
    write_sidecar(out, meta)
    return Prepared(out, sink.tokens, name, vocab, sink.top, reader.files_read, reader.bytes_read,
                    time.perf_counter() - start, sink.max_pending, tokenizer, meta, removed)


def prepare(sources: Iterable[str], out: str, max_bytes: Optional[int] = None, **kwargs) -> int:
    """Tokenize `sources` (files or directories of *.py/*.txt/*.md/*.rst) into `out`, byte-level
    unless a tokenizer is given (see prepare_tokens); returns the number of tokens."""
    return prepare_tokens(sources, out, max_bytes=max_bytes, **kwargs).tokens


def embedded_corpus(cache_dir: str) -> str:
    path = os.path.join(os.path.expanduser(cache_dir), EMBEDDED_NAME.format(*sys.version_info[:2]))
    if not os.path.exists(path):
        prepare(stdlib_sources(), path, max_bytes=EMBEDDED_MAX_BYTES)
    return path
