"""`python -m zerolab data prepare --tokenizer` throughput against a plain tokenizers loop.

    python bench/prepare.py [--reps 5] [--vocab 50257] [--workers N]

The corpus is zerolab's embedded corpus: the running interpreter's standard-library sources
(zerolab.data.stdlib_sources), the first EMBEDDED_MAX_BYTES (8 MiB) of them, each file a
document. The tokenizer has GPT-2's shape: a byte-level BPE of 50257 tokens (256 bytes, 50000
merges, `<|endoftext|>` last), trained here, offline, on all of the standard-library sources
(about 11 MB: the first 8 MiB alone have pairs for fewer than 50000 merges) with zerolab's
`--train-tokenizer` code (zerolab.data.prepare.train_tokenizer). Its merges are the standard
library's, not GPT-2's web text, so tokens per byte differ from GPT-2's; the work per byte is the
same kind (ByteLevel pre-tokenizer with GPT-2's split regex, BPE merges).

Each repetition runs, in a new random order, in this one process:
- "plain loop": what a user writes first: one Tokenizer, `tok.encode(text).ids` for each file
  in turn, one process, the ids appended to a uint16 file;
- "prepare, 1 worker" and "prepare, N workers": zerolab.data.prepare_tokens (the function behind
  the command): 1 MiB pieces, encode_batch_fast, N threads, streaming writes and the sidecar;
- "CLI": `python -m zerolab data prepare --tokenizer ...` as a new process, timed from outside,
  so its figure includes the interpreter's start and zerolab's imports (torch among them).
Every variant loads the tokenizer from its file, so none starts with a warm BPE cache. p50 over
the repetitions; MB/s counts source bytes, tokens/s the tokens written (end-of-text included).
The outputs are checked to be the same tokens. Prints the conditions: CPU count, load average
before and after, the commit, the versions.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerolab.data import EMBEDDED_MAX_BYTES, prepare_tokens, stdlib_sources  # noqa: E402
from zerolab.data.prepare import EOT, train_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def embedded_files(max_bytes: int) -> tuple[list[str], list[bytes]]:
    """The embedded corpus's files and their bytes, the last one cut at max_bytes in all."""
    files, texts, total = [], [], 0
    for f in stdlib_sources():
        with open(f, "rb") as fh:
            b = fh.read(max_bytes - total)
        files.append(f)
        texts.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    return files, texts


def plain_loop(tokenizer: str, files: list[str], max_bytes: int, out: str) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    eot = tok.token_to_id(EOT)
    n, left = 0, max_bytes
    with open(out, "wb") as fh:
        for f in files:
            with open(f, "rb") as src:
                data = src.read(left)
            left -= len(data)
            ids = tok.encode(data.decode("utf-8", errors="replace")).ids + [eot]
            np.asarray(ids, dtype=np.uint16).tofile(fh)
            n += len(ids)
    return n


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        return head + (" + uncommitted changes" if dirty.strip() else "")
    except OSError:
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-bytes", type=int, default=EMBEDDED_MAX_BYTES)
    args = p.parse_args()
    import tokenizers

    load_before = os.getloadavg()
    files, texts = embedded_files(args.max_bytes)
    nbytes = sum(len(t) for t in texts)
    tmp = tempfile.mkdtemp(prefix="zerolab-bench-prepare-")
    tok_path = os.path.join(tmp, "gpt2-shape.tokenizer.json")
    t = time.perf_counter()
    train_tokenizer(stdlib_sources(), args.vocab, tok_path)  # all of them: 8 MiB has too few pairs for 50000 merges
    train_s = time.perf_counter() - t
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(tok_path).get_vocab_size()
    print(f"corpus: the embedded corpus, {len(files)} files of the standard library, {nbytes / 1e6:.2f} MB; "
          f"tokenizer: byte-level BPE of {vocab} tokens trained on all the standard-library sources in {train_s:.1f} s")
    print(f"conditions: {os.cpu_count()} CPUs, load average {load_before[0]:.2f} before; commit {commit()}; "
          f"python {platform.python_version()}, tokenizers {tokenizers.__version__}, numpy {np.__version__}")

    def run_prepare(workers: int, out: str) -> int:
        return prepare_tokens(files, out, tokenizer=tok_path, workers=workers, max_bytes=args.max_bytes).tokens

    def run_cli(out: str) -> int:
        subprocess.run([sys.executable, "-m", "zerolab", "data", "prepare", "--src", *files, "--tokenizer", tok_path,
                        "--out", out, "--workers", str(args.workers), "--max-bytes", str(args.max_bytes),
                        "--no-progress"], cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return os.path.getsize(out) // 2

    variants = {
        "plain loop (tokenizers, 1 process)": lambda out: plain_loop(tok_path, files, args.max_bytes, out),
        "prepare, 1 worker": lambda out: run_prepare(1, out),
        f"prepare, {args.workers} workers": lambda out: run_prepare(args.workers, out),
        f"CLI, {args.workers} workers (a new process)": run_cli,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, int] = {}
    rng = random.Random(0)
    for _ in range(args.reps):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            out = os.path.join(tmp, f"{list(variants).index(name)}.bin")
            t = time.perf_counter()
            tokens[name] = variants[name](out)
            times[name].append(time.perf_counter() - t)
    outs = {name: np.fromfile(os.path.join(tmp, f"{i}.bin"), dtype=np.uint16) for i, name in enumerate(variants)}
    ref = outs[next(iter(variants))]
    same = all(np.array_equal(ref, o) for o in outs.values())
    load_after = os.getloadavg()

    base = statistics.median(times[next(iter(variants))])
    print(f"\n{args.reps} repetitions, interleaved; the same tokens from every variant: {'yes' if same else 'NO'}; "
          f"load average {load_after[0]:.2f} after\n")
    print("| variant | p50 s | min s | MB/s | tokens/s | speed ÷ plain loop |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in variants:
        p50 = statistics.median(times[name])
        print(f"| {name} | {p50:.2f} | {min(times[name]):.2f} | {nbytes / 1e6 / p50:.2f} | "
              f"{tokens[name] / p50:,.0f} | {base / p50:.2f} |")
    print(f"\ntokens: {len(ref)} ({len(ref) / nbytes:.3f} per byte)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
