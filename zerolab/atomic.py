"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Every writer in zerolab that replaces a file others may read (summary.json, the preemption
marker, checkpoint metadata and `latest`, exported weights, prepared token files) goes through
here: write a temporary file next to the target, fsync it, rename it over the target (atomic on
POSIX within one filesystem), fsync the directory so the rename itself survives a crash.
The temporary name carries the process id: ranks preparing the same file at once never write
into each other's temporary file.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from typing import Iterator


def fsync_dir(path: str) -> None:
    """Makes a rename or a new entry in `path` durable (POSIX: a directory is fsynced like a file)."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path to write `path`'s new content to (by any means: numpy's tofile,
    safetensors' save_file, ...); on success it becomes `path`, on failure it is removed."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str, obj, indent: int = 2) -> None:
    """JSON with non-JSON values (paths, numpy numbers) written as their str()."""
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str))


def sha256_file(path: str) -> str:
    """The file's SHA-256, read in 1 MiB blocks (memory flat in file size): what a checkpoint's
    meta.json and a token file's sidecar record of the files they name."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
