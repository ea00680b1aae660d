"""What a checkpoint is on disk: meta.json (validated, self-digested), safetensors written one
tensor at a time, and the only ways zerolab opens a torch.save file (weights_only, allow-listed).

Checkpoint formats: "pieces" (zerolab's name-keyed, reshardable pieces in rank*.safetensors) and
"native" (a strategy's own files, which that strategy's class writes, reads, checks and exports;
see zerolab/strategies/base.py; its torch.save files are opened only through zerolab/safeload.py).
meta.json records the format and the strategy that wrote it; the
strategy registry turns that name into the class that implements a native format.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from typing import Callable, Optional

import torch

from zerolab.errors import CheckpointError
from zerolab.safeload import check_torch_file, load_torch_file, safe_torch_load  # noqa: F401  (re-exported)

FORMAT = "zerolab-checkpoint"
# 2: meta.json carries "meta_sha256", a digest of its other fields (1 had none).
# 3: meta.json says which checkpoint format it holds ("checkpoint_format": pieces | native) and
#    keeps a native format's own record under "native". 1 and 2 are read as their writer's format,
#    a native record under the writer's name (see upgrade_meta).
# 4: the model's persistent buffers are in the rank files ("buffer/<name>", each rank its own) and
#    their shapes in meta.json ("buffer_shapes"). Only a checkpoint that held buffers was written
#    as 4, so that a zerolab that would ignore them refuses it; every other one stayed 3.
# 5: every strategy writes pieces (fsdp, torch_zero and deepspeed too: the writer may be another
#    library), and "optimizer_scalars" is library-neutral: a reader restores each counter in its
#    own optimizer's type (an int for DeepSpeed's Adam, a tensor for torch's), where 3 and 4 were
#    read in the writer's type, which a zerolab of those versions would misapply to a counter
#    another library wrote. So every checkpoint is written as 5, and 1 to 4 are still read.
FORMAT_VERSION = 5
BUFFERS_FORMAT_VERSION = 4  # the first version whose rank files may hold model buffers
NEWEST_READ = FORMAT_VERSION
FORMATS = ("pieces", "native")
META, LATEST = "meta.json", "latest"
STEP_RE = re.compile(r"^step_(\d{8,})$")


# ---- safetensors, written one tensor at a time ---------------------------------------------------
# safetensors' own save_file needs every tensor in memory at once (and refuses views that share
# storage). Its format is simple: an 8-byte little-endian header length, a JSON header giving
# each tensor's dtype, shape and byte range, then the raw bytes. Writing it ourselves lets a rank
# stream its pieces, and lets export hold one tensor at a time.
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}
DTYPE_NAMES = {str(d).removeprefix("torch.") for d in _ST_DTYPES}


def write_safetensors(path: str, entries: list[tuple[str, torch.dtype, tuple, Callable[[], torch.Tensor]]],
                      metadata: Optional[dict] = None) -> dict:
    """entries: (name, dtype, shape, produce); produce() is called once, in order, just before its
    bytes are written. Returns {"sha256", "bytes"} of the file, which is fsynced."""
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as fh:
        for chunk_src in (struct.pack("<Q", len(blob)), blob):
            fh.write(chunk_src)
            digest.update(chunk_src)
            size += len(chunk_src)
        for name, dtype, shape, produce in entries:
            t = produce().detach().to("cpu").contiguous()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{path}: tensor {name} changed to {t.dtype} {tuple(t.shape)} while saving")
            raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            fh.write(raw)
            digest.update(raw)
            size += raw.nbytes
            del t, raw
        fh.flush()
        os.fsync(fh.fileno())
    return {"sha256": digest.hexdigest(), "bytes": size}


def safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file (tensors' dtypes, shapes and byte ranges, and
    `__metadata__`), read without loading a tensor; CheckpointError when the file is not one (a
    pickle under the .safetensors name, a truncated header, ranges beyond the file's end)."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError(f"its header claims {n} bytes, the file has {size}")
            header = json.loads(fh.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            raise ValueError(f"its tensors end at byte {8 + n + end}, the file has {size}")
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}): corrupt, or replaced by "
                              "something else") from err
    return header


# ---- meta.json ---------------------------------------------------------------------------------
def meta_digest(meta: dict) -> str:
    """sha256 of meta.json's canonical form (sorted keys, no whitespace) without the digest itself."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def meta_text(meta: dict) -> str:
    return json.dumps({**meta, "meta_sha256": meta_digest(meta)}, indent=1)


def writer_class(meta: dict):
    """The strategy class that wrote this checkpoint, or None when this zerolab does not know it."""
    from zerolab.strategies import REGISTRY, strategy_class

    return strategy_class(meta["strategy"]) if meta.get("strategy") in REGISTRY else None


def upgrade_meta(meta: dict) -> None:
    """Formats 1 and 2 did not record the checkpoint format: it is the writing strategy's, and a
    native format's record was kept under the strategy's own name. In memory only (after the
    digest check): the file on disk is never rewritten."""
    if meta.get("format_version", 0) >= 3:
        return
    cls = writer_class(meta)
    meta["checkpoint_format"] = cls.checkpoint_format if cls is not None else None  # None: refused on load
    if meta["checkpoint_format"] == "native":
        meta["native"] = meta.pop(meta["strategy"], None)


def version_of(meta: dict) -> int:
    v = meta.get("format_version")
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def read_meta(path: str) -> dict:
    mpath = os.path.join(path, META)
    if not os.path.exists(mpath):
        raise CheckpointError(f"{mpath} is missing: {path} is not a complete zerolab checkpoint")
    try:
        with open(mpath) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{mpath} is not readable JSON ({err}); the checkpoint is corrupt") from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: format {meta.get('format')!r} is not {FORMAT!r}")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > NEWEST_READ:
        raise CheckpointError(f"{mpath}: format version {version} is newer than this zerolab reads "
                              f"({NEWEST_READ}); load it with the zerolab version that wrote it "
                              f"({meta.get('versions', {}).get('zerolab', '?')}) or newer")
    # Version 1 had no digest; from 2 on one is required, and any one present must match.
    if version >= 2 or "meta_sha256" in meta:
        if meta.get("meta_sha256") != meta_digest(meta):
            raise CheckpointError(f"{mpath}: its content does not match its own sha256 (meta_sha256): the "
                                  f"file was changed or corrupted after it was written")
    validate_meta(meta, mpath, os.path.basename(os.path.normpath(path)))
    return meta


def validate_meta(meta: dict, mpath: str, dirname: str) -> None:
    """Every field zerolab reads, by type and range: a checksum catches corruption, this catches a
    meta.json that was rewritten (with its digest) into something zerolab would misread."""
    def bad(field, why):
        raise CheckpointError(f"{mpath}: field {field!r} {why}; the checkpoint is corrupt")

    def is_int(v, lo=0):
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    def want(field, ok, what):
        if not ok(meta.get(field)):
            bad(field, f"is {meta.get(field)!r}, expected {what}")

    want("step", is_int, "an integer >= 0")
    want("world_size", lambda v: is_int(v, 1), "an integer >= 1")
    for field in ("strategy", "precision", "optimizer"):
        want(field, lambda v: isinstance(v, str) and v != "", "a name")
    for field in ("config", "lr_schedule", "loss_scaler", "sampler", "optimizer_scalars", "aliases", "pieces", "files"):
        want(field, lambda v: isinstance(v, dict), "an object")
    want("state_dict_keys", lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v), "a list of names")
    want("buffers", lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v), "a list of names")
    if meta.get("buffers") and version_of(meta) >= BUFFERS_FORMAT_VERSION:
        want("buffer_shapes", lambda v: isinstance(v, dict) and set(v) == set(meta["buffers"]) and all(
            isinstance(s, list) and all(is_int(d) for d in s) for s in v.values()), "buffer names -> shapes")
    want("params", lambda v: isinstance(v, dict) and all(
        isinstance(s, list) and all(is_int(d) for d in s) for s in v.values()), "names -> shapes")
    m = STEP_RE.match(dirname)
    if m and int(m.group(1)) != meta["step"]:
        bad("step", f"is {meta['step']}, but the directory is {dirname}")
    sampler = meta["sampler"]
    if not (is_int(sampler.get("next_step")) and is_int(sampler.get("seed"))
            and is_int(sampler.get("global_batch"), 1)):
        bad("sampler", f"is {sampler!r}, expected next_step, seed >= 0 and global_batch >= 1")
    # The step, the data position, the optimizer's count of updates and the LR schedule's position
    # must tell one story: a meta.json rewritten to another step (and its digest recomputed) is
    # refused here or by verify(), which reads the step each rank file was written at.
    if sampler["next_step"] != meta["step"]:
        bad("sampler", f"says the data continues at step {sampler['next_step']}, but the checkpoint is of step "
                       f"{meta['step']}")
    _validate_counters(meta, bad, is_int)
    _validate_entries(meta, bad, is_int)
    upgrade_meta(meta)
    if meta["format_version"] >= 3:
        want("checkpoint_format", lambda v: v in FORMATS, " or ".join(FORMATS))
    if meta["checkpoint_format"] == "native":
        cls = writer_class(meta)
        if cls is None or not hasattr(cls, "load_native"):  # (strategies/native.py: a reader of its own old files)
            bad("strategy", f"is {meta['strategy']!r}, whose native checkpoint format this zerolab does not read")
        problem = cls.native_meta_problem(meta.get("native"))
        if problem:
            bad("native", f"is {meta.get('native')!r}, expected {problem}")


# The LR a schedule gives at a step is computed by the same formula at save and here; a libm that
# rounds cos differently on another machine may move its last bits (1 ulp ~ 2e-16 relative), and
# two steps apart it moves by far more than this, except where the schedule is flat (the
# optimizer's count catches those).
LR_REL_TOL = 1e-12


def _validate_counters(meta: dict, bad, is_int) -> None:
    """Every counter meta.json holds against the step it claims: the optimizer's count of updates
    plus the updates skipped (a non-finite gradient norm, an fp16 overflow) is the step; the fp16
    loss scaler counts no more skips than that, and no more clean steps than there were steps;
    the LR schedule gives its recorded next lr at this step; and the run's own settings allow the
    updates it says it skipped."""
    step, scalars = meta["step"], meta["optimizer_scalars"]
    count = scalars["step"].get("value") if isinstance(scalars.get("step"), dict) else None
    skipped = meta.get("skipped_updates")
    if skipped is not None and not (is_int(skipped) and skipped <= step):
        bad("skipped_updates", f"is {skipped!r}, expected an integer from 0 to the step ({step})")
    if isinstance(count, (int, float)) and not isinstance(count, bool):
        if count > step:  # skipped updates make it smaller, never larger
            bad("optimizer_scalars", f"count {count:g} optimizer updates, more than the checkpoint's {step} steps")
        # an imported checkpoint (weights only) starts a fresh optimizer: its count says nothing of the step
        if skipped is not None and meta.get("optimizer_state") is not False and count + skipped != step:
            bad("optimizer_scalars", f"count {count:g} optimizer updates, and {skipped} were skipped: "
                                     f"{count + skipped:g} steps, but the checkpoint claims step {step}")
    scaler = meta["loss_scaler"]
    for key, most in (("skipped_steps", skipped if skipped is not None else step), ("clean_steps", step)):
        if key in scaler and not (is_int(scaler[key]) and scaler[key] <= most):
            bad("loss_scaler", f"has {key}={scaler[key]!r}, more than the {most} the checkpoint's step allows")
    _validate_lr(meta, bad)
    if skipped is not None:  # last: the counters agree with each other, now with the run's settings
        _validate_skips(meta, skipped, bad, is_int)


def _skips_possible(config: dict) -> "bool | None":
    """Whether a run with this config (meta.json's "config") can skip an update: only fp16's loss
    scaler (an overflow) and trainer.nonfinite=skip do; every other run stops at a non-finite
    gradient norm instead. None when the config does not say."""
    precision = (config.get("precision") or {}).get("name") if isinstance(config, dict) else None
    nonfinite = (config.get("trainer") or {}).get("nonfinite") if isinstance(config, dict) else None
    if not isinstance(precision, str) or not isinstance(nonfinite, str):
        return None
    return precision == "fp16" or nonfinite == "skip"


def _validate_skips(meta: dict, skipped: int, bad, is_int) -> None:
    """The skipped updates a checkpoint counts (skipped_updates) against the settings of the run that
    wrote it: skipped_updates_before were counted when that run started (0, or those of the
    checkpoint it resumed from, written under other settings perhaps), and a run that cannot skip
    adds none. A checkpoint of another step relabelled, with its counters made to add up, is
    refused here."""
    before = meta.get("skipped_updates_before", 0)  # checkpoints older than the key: none before
    if not (is_int(before) and before <= skipped):
        bad("skipped_updates_before", f"is {before!r}, expected an integer from 0 to skipped_updates ({skipped})")
    if _skips_possible(meta.get("config")) is False and skipped != before:
        cfg = meta["config"]
        bad("skipped_updates", f"is {skipped}, but the run that wrote it (precision={cfg['precision']['name']}, "
                               "trainer.nonfinite=stop) cannot skip an update: it stops at a non-finite gradient "
                               f"instead, and {before} were skipped before it started. The counters do not belong "
                               "to this checkpoint (a copy of another step's, relabelled?)")


def _validate_lr(meta: dict, bad) -> None:
    from dataclasses import fields

    from zerolab.optim.schedule import LRSchedule

    sched = meta["lr_schedule"]
    if "next_lr" not in sched:
        return
    if not isinstance(sched["next_lr"], (int, float)) or isinstance(sched["next_lr"], bool):
        bad("lr_schedule", "has a non-numeric next_lr")
    try:
        expected = LRSchedule(**{f.name: sched[f.name] for f in fields(LRSchedule) if f.name in sched})(meta["step"])
    except (TypeError, ValueError, ArithmeticError):
        bad("lr_schedule", f"is {sched!r}, which is not a schedule zerolab computes")
    if not math.isclose(sched["next_lr"], expected, rel_tol=LR_REL_TOL, abs_tol=0.0):
        bad("lr_schedule", f"gives lr {expected!r} at step {meta['step']}, but records next_lr {sched['next_lr']!r}: "
                           "the schedule is at another step")


def _validate_entries(meta: dict, bad, is_int) -> None:
    """The file and piece records of meta.json: names inside the checkpoint, well-formed entries."""
    for fname, info in meta["files"].items():
        # names stay inside the checkpoint directory
        if os.path.isabs(fname) or ".." in fname.split("/") or not fname:
            bad("files", f"names {fname!r}, outside the checkpoint directory")
        if not (isinstance(info, dict) and is_int(info.get("bytes")) and isinstance(info.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", info["sha256"])
                and (info.get("rank") is None or is_int(info["rank"]))):
            bad("files", f"has a malformed entry for {fname!r}: {info!r}")
    for key, pieces in meta["pieces"].items():
        for pc in pieces if isinstance(pieces, list) else [None]:
            if not (isinstance(pc, dict) and pc.get("file") in meta["files"] and isinstance(pc.get("tensor"), str)
                    and is_int(pc.get("start")) and is_int(pc.get("end")) and pc["start"] <= pc["end"]
                    and pc.get("dtype") in DTYPE_NAMES):
                bad("pieces", f"has a malformed piece of {key!r}: {pc!r}")
