"""`python -m zerolab data prepare`: text files to a token file and its sidecar."""
from __future__ import annotations

import argparse
import os
import sys

from zerolab.errors import ConfigError


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="zerolab data",
        description="Tokenize text into a token file (flat uint16 or uint32 ids, nanoGPT's format) and its "
                    "sidecar OUT.json. Byte-level (token = byte, vocabulary 256) unless --tokenizer or "
                    "--train-tokenizer is given. Each source file is a document. Nothing is downloaded.")
    p.add_argument("action", choices=["prepare"])
    p.add_argument("--src", nargs="+", required=True,
                   help="files, or directories (their *.py, *.txt, *.md, *.rst files, recursively)")
    p.add_argument("--out", required=True, help="the token file to write (then data.path=OUT)")
    p.add_argument("--tokenizer", metavar="TOKENIZER_JSON",
                   help="a Hugging Face tokenizer.json (GPT-2's, or your own BPE); ids are uint16 when the "
                        "vocabulary fits in 65536, uint32 otherwise")
    p.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                   help="first train a byte-level BPE of VOCAB tokens (GPT-2's shape: 256 bytes, merges, "
                        "<|endoftext|> last) on the sources, offline; saved beside OUT as OUT_STEM.tokenizer.json")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="threads encoding in parallel (default: the CPU count); the output does not depend on it")
    p.add_argument("--eot", default="auto", metavar="TOKEN",
                   help="the token appended after each file: auto (<|endoftext|> when the tokenizer has it), "
                        "a token of the tokenizer, or '' for none")
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of the sources")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal anyway)")
    args = p.parse_args(argv)

    from zerolab.data.prepare import prepare_tokens

    try:
        done = prepare_tokens(args.src, args.out, tokenizer=args.tokenizer, train_vocab=args.train_tokenizer,
                              max_bytes=args.max_bytes, workers=args.workers, eot=args.eot,
                              progress=False if args.no_progress else None)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"zerolab data prepare: {err}", file=sys.stderr)
        return 2
    for path, size, pid in done.removed:
        print(f"removed {path} ({size / 1e6:.1f} MB), the temporary file of an earlier prepare (pid {pid}) that was "
              "killed before it finished")
    mb = done.bytes / 1e6
    if args.train_tokenizer:
        print(f"trained a byte-level BPE of {done.vocab_size} tokens: {done.tokenizer}")
    print(f"wrote {done.tokens} {done.dtype} tokens (vocabulary {done.vocab_size}, largest token {done.max_token}) "
          f"from {done.files} files ({mb:.1f} MB) to {args.out} in {done.seconds:.1f} s "
          f"({mb / max(done.seconds, 1e-9):.2f} MB/s, {done.tokens / max(done.seconds, 1e-9):,.0f} tokens/s, "
          f"{args.workers} workers, at most {done.max_pending_bytes / 1e6:.1f} MB of text in flight); "
          f"sidecar {args.out}.json")
    return 0
