"""Checkpoints: sharded, name-keyed, atomic, reshardable; export for inference.

On disk (checkpoint.dir, default <run dir>/checkpoints):

  step_00000020/
    meta.json            written by rank 0 (its field "meta_sha256" is the digest of the rest):
                         step, world size, strategy, precision, optimizer,
                         config, LR schedule, loss scaler, sampler position, optimizer scalars
                         (the step counter), versions, the piece index, and the sha256 and size
                         of every rank file
    rank0.safetensors    rank r's pieces "<kind>/<param>@<start>:<end>": elements [start, end)
    rank1.safetensors    of the flattened tensor (kind = master | exp_avg | ...), plus that
    ...                  rank's RNG state as "rng/cpu" (and "rng/cuda")
  latest                 "step_00000020", replaced last
  .tmp-step_00000030/    a save in progress, or one a crash interrupted: never read

A save writes everything into the .tmp- directory, fsyncs every file and the directory, renames
the directory into place, and only then replaces `latest`; a crash at any point leaves the
previous checkpoint intact. Loading asks the strategy which element ranges it owns now and
assembles each from whatever pieces were saved, so N ranks of ddp/zero1/zero2 load into M ranks
of any of them. Tensors are read with safetensors and metadata is JSON: nothing is unpickled.
DeepSpeed's own .pt files are scanned for globals and loaded weights_only (see DEEPSPEED_GLOBALS).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import sys
from contextlib import contextmanager
from dataclasses import asdict
from typing import Callable, Optional

import torch

from zerolab.errors import ZerolabError

log = logging.getLogger("zerolab")

FORMAT = "zerolab-checkpoint"
FORMAT_VERSION = 2  # 2: meta.json carries "meta_sha256", a digest of its other fields (1 had none)
RESHARDABLE = ("ddp", "zero1", "zero2", "zero3")  # strategies whose checkpoints share this piece format
META, LATEST = "meta.json", "latest"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ZerolabError):
    """A checkpoint that cannot be used; the message names the file and the mismatch."""


# ---- safetensors, written one tensor at a time ---------------------------------------------------
# safetensors' own save_file needs every tensor in memory at once (and refuses views that share
# storage). Its format is simple: an 8-byte little-endian header length, a JSON header giving
# each tensor's dtype, shape and byte range, then the raw bytes. Writing it ourselves lets a rank
# stream its pieces, and lets export hold one tensor at a time.
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}
_DTYPE_NAMES = {str(d).removeprefix("torch.") for d in _ST_DTYPES}
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_torch_file(path: str, map_location: str = "cpu"):
    """torch.load restricted to tensors and plain containers (weights_only=True): a file that
    would need to unpickle code (a callable, a custom class) is refused, never executed."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: refused, it holds pickled objects other than tensors and plain "
                              f"containers, which zerolab never unpickles ({str(err).splitlines()[0]})") from err


# ---- DeepSpeed's torch.save files -----------------------------------------------------------------
# DeepSpeed writes its checkpoints with torch.save and reads them with torch.load(weights_only=False),
# which would run any code a replaced file carries. zerolab lets DeepSpeed (and its zero_to_fp32
# consolidation) open a .pt file only after (1) a static scan of the file's pickle refused every
# global beyond torch's tensors and plain containers and the few DeepSpeed classes below, and
# (2) inside `safe_torch_load`, which turns each of DeepSpeed's torch.load calls into a
# weights_only one with the same allow-list, so a payload the scan could not see is refused too.
# The list: the globals torch does not allow by default that DeepSpeed 0.19.8's ZeRO checkpoints
# hold, as torch.serialization.get_unsafe_globals_in_checkpoint reports them on saved stage-1 and
# stage-2 checkpoints (CPU, fp32 and bf16), plus DynamicLossScaler, the class fp16's dynamic loss
# scaling saves in LossScaler's place (fp16 cannot run on the CPU accelerator here).
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def check_torch_file(path: str, allowed=DEEPSPEED_GLOBALS) -> None:
    """Refuses a torch.save file whose pickle names a global outside torch's weights_only set and
    `allowed`, without unpickling anything (the pickle opcodes are read, never run)."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        unsafe = get_unsafe_globals_in_checkpoint(path)
    except Exception as err:  # noqa: BLE001  (not a torch.save zip archive, or a malformed pickle)
        raise CheckpointError(f"{path}: refused, it is not a torch.save archive zerolab can inspect without "
                              f"unpickling it ({type(err).__name__}: {err})") from err
    refused = sorted(g for g in unsafe if g not in allowed)
    if refused:
        raise CheckpointError(f"{path}: refused, its pickle names {', '.join(refused)}, which is not a tensor, a plain "
                              f"container or one of the DeepSpeed classes its checkpoints hold; zerolab never "
                              f"unpickles it. Delete this checkpoint or restore it from a trusted copy")


def _allowed_objects(names) -> list:
    import importlib

    out = []
    for name in names:
        module, attr = name.rsplit(".", 1)
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue  # another DeepSpeed version: a file that needs it is refused, never run
    return out


@contextmanager
def safe_torch_load(allowed=DEEPSPEED_GLOBALS):
    """Within: every torch.load (DeepSpeed's included, which ask for weights_only=False) is a
    weights_only load that accepts only torch's safe set and `allowed`."""
    import pickle

    original = torch.load

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{f}: refused while loading, it holds pickled objects outside the allow-list "
                                  f"({str(err).splitlines()[0]})") from err

    torch.load = load
    try:
        with torch.serialization.safe_globals(_allowed_objects(allowed)):
            yield
    finally:
        torch.load = original


# ---- what a model and an optimizer look like ------------------------------------------------------
def model_layout(model: torch.nn.Module) -> dict:
    """Parameter names and shapes, tied aliases (a second name of one parameter) and state-dict order."""
    params = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    by_id = {id(p): n for n, p in model.named_parameters()}
    aliases, buffers = {}, []
    keys = list(model.state_dict(keep_vars=True).keys())
    for key, t in model.state_dict(keep_vars=True).items():
        if key in params:
            continue
        if id(t) in by_id:
            aliases[key] = by_id[id(t)]
        else:
            buffers.append(key)
    return {"params": params, "aliases": aliases, "state_dict_keys": keys, "buffers": buffers}


def optimizer_scalars(optimizer: torch.optim.Optimizer) -> dict:
    """Per-parameter scalar state (Adam's `step`); it must agree across parameters."""
    found: dict[str, dict] = {}
    for state in optimizer.state.values():
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                continue
            rec = {"value": float(v), "tensor": isinstance(v, torch.Tensor),
                   "dtype": str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else type(v).__name__}
            if key in found and found[key]["value"] != rec["value"]:
                raise CheckpointError(f"optimizer scalar state {key!r} differs between parameters "
                                      f"({found[key]['value']} vs {rec['value']}); zerolab checkpoints store one value")
            found[key] = rec
    return found


def restore_optimizer_scalars(optimizer: torch.optim.Optimizer, scalars: dict) -> None:
    for state in optimizer.state.values():
        for key, rec in scalars.items():
            if rec["tensor"]:
                state[key] = torch.tensor(rec["value"], dtype=getattr(torch, rec["dtype"]))
            else:
                state[key] = int(rec["value"]) if rec["dtype"] == "int" else rec["value"]


def _rng_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"rng/cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["rng/cuda"] = torch.cuda.get_rng_state(device)
    return out


# ---- reading -------------------------------------------------------------------------------------
class PieceReader:
    """`read(key, start, end)` for Strategy.load_checkpoint_state: elements [start, end) of the
    flattened tensor `key`, assembled from the pieces of whichever ranks saved them. Reads only
    the bytes asked for (safetensors slices of memory-mapped files)."""

    def __init__(self, path: str, meta: dict):
        self.path, self.index = path, meta["pieces"]
        self.weights_only = meta.get("optimizer_state") is False  # imported: no optimizer state saved
        self._files: dict = {}
        self._kinds: dict[str, list[str]] = {}
        for key in self.index:
            kind, name = key.split("/", 1)
            if kind != "master":
                self._kinds.setdefault(name, []).append(kind)

    def kinds(self, name: str) -> list[str]:
        """Optimizer-state kinds saved for parameter `name` (for optimizers that create state lazily)."""
        return list(self._kinds.get(name, []))

    def file(self, fname: str):
        from safetensors import safe_open

        if fname not in self._files:
            full = os.path.join(self.path, fname)
            try:
                self._files[fname] = safe_open(full, framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{full}: not a readable safetensors file ({err})") from err
        return self._files[fname]

    def __call__(self, key: str, start: int, end: int) -> torch.Tensor:
        pieces = self.index.get(key)
        if pieces is None and self.weights_only and not key.startswith("master/"):
            return torch.zeros(end - start)  # a fresh optimizer's state (its step counter is reset to 0)
        if pieces is None:
            raise CheckpointError(f"{self.path}: the checkpoint has no {key!r} (saved keys look like "
                                  f"{next(iter(self.index), '?')!r})")
        out = torch.empty(end - start, dtype=getattr(torch, pieces[0]["dtype"]))
        covered = 0
        for pc in pieces:
            lo, hi = max(start, pc["start"]), min(end, pc["end"])
            if lo >= hi:
                continue
            out[lo - start:hi - start] = self.file(pc["file"]).get_slice(pc["tensor"])[lo - pc["start"]:hi - pc["start"]]
            covered += hi - lo
        if covered != end - start:
            raise CheckpointError(f"{self.path}: elements [{start}, {end}) of {key!r} are not all in the checkpoint")
        return out

    def rng(self, rank: int) -> dict[str, torch.Tensor]:
        f = self.file(f"rank{rank}.safetensors")
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}


def _meta_digest(meta: dict) -> str:
    """sha256 of meta.json's canonical form (sorted keys, no whitespace) without the digest itself."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _meta_text(meta: dict) -> str:
    return json.dumps({**meta, "meta_sha256": _meta_digest(meta)}, indent=1)


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
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format version {version} is newer than this zerolab reads "
                              f"({FORMAT_VERSION}); load it with the zerolab version that wrote it "
                              f"({meta.get('versions', {}).get('zerolab', '?')}) or newer")
    # Version 1 had no digest; from 2 on one is required, and any one present must match.
    if version >= 2 or "meta_sha256" in meta:
        if meta.get("meta_sha256") != _meta_digest(meta):
            raise CheckpointError(f"{mpath}: its content does not match its own sha256 (meta_sha256): the "
                                  f"file was changed or corrupted after it was written")
    _validate_meta(meta, mpath, os.path.basename(os.path.normpath(path)))
    return meta


def _validate_meta(meta: dict, mpath: str, dirname: str) -> None:
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
    want("buffers", lambda v: isinstance(v, list), "a list")
    want("params", lambda v: isinstance(v, dict) and all(
        isinstance(s, list) and all(is_int(d) for d in s) for s in v.values()), "names -> shapes")
    m = _STEP_RE.match(dirname)
    if m and int(m.group(1)) != meta["step"]:
        bad("step", f"is {meta['step']}, but the directory is {dirname}")
    sampler = meta["sampler"]
    if not (is_int(sampler.get("next_step")) and is_int(sampler.get("seed")) and is_int(sampler.get("global_batch"), 1)):
        bad("sampler", f"is {sampler!r}, expected next_step, seed >= 0 and global_batch >= 1")
    if not isinstance(meta["lr_schedule"].get("next_lr", 0.0), (int, float)):
        bad("lr_schedule", "has a non-numeric next_lr")
    for fname, info in meta["files"].items():
        # names stay inside the checkpoint directory
        if os.path.isabs(fname) or ".." in fname.split("/") or not fname:
            bad("files", f"names {fname!r}, outside the checkpoint directory")
        if not (isinstance(info, dict) and is_int(info.get("bytes")) and isinstance(info.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", info["sha256"]) and (info.get("rank") is None or is_int(info["rank"]))):
            bad("files", f"has a malformed entry for {fname!r}: {info!r}")
    for key, pieces in meta["pieces"].items():
        for pc in pieces if isinstance(pieces, list) else [None]:
            if not (isinstance(pc, dict) and pc.get("file") in meta["files"] and isinstance(pc.get("tensor"), str)
                    and is_int(pc.get("start")) and is_int(pc.get("end")) and pc["start"] <= pc["end"]
                    and pc.get("dtype") in _DTYPE_NAMES):
                bad("pieces", f"has a malformed piece of {key!r}: {pc!r}")
    if meta["strategy"] == "deepspeed":
        ds = meta.get("deepspeed")
        if not (isinstance(ds, dict) and ds.get("tag") == DS_TAG and is_int(ds.get("stage")) and ds["stage"] <= 3):
            bad("deepspeed", f"is {ds!r}, expected {{'tag': {DS_TAG!r}, 'stage': 0..3, ...}}")


def verify(path: str, checksums: bool = True) -> dict:
    """Metadata readable, every rank file present with its recorded size and sha256."""
    meta = read_meta(path)
    for fname, info in meta["files"].items():
        full = os.path.join(path, fname)
        if not os.path.exists(full):
            owner = f"shard of rank {info['rank']} of {meta['world_size']}" if info.get("rank") is not None else "DeepSpeed file"
            raise CheckpointError(f"{full} is missing ({owner})")
        size = os.path.getsize(full)
        if size != info["bytes"]:
            raise CheckpointError(f"{full} has {size} bytes, the checkpoint recorded {info['bytes']}: truncated or corrupt")
        if checksums and _sha256(full) != info["sha256"]:
            raise CheckpointError(f"{full}: sha256 does not match the one recorded in {META}: corrupt")
        if not fname.endswith(".safetensors"):
            check_torch_file(full)  # DeepSpeed's torch.save files: refused before anything opens them
    if meta["strategy"] == "deepspeed":  # DeepSpeed finds its files by pattern: no unrecorded ones
        ds_dir = os.path.join(path, meta["deepspeed"]["tag"])
        for root, _, names in os.walk(ds_dir):
            for n in names:
                rel = os.path.relpath(os.path.join(root, n), path)
                if rel not in meta["files"]:
                    raise CheckpointError(f"{os.path.join(path, rel)} is not recorded in {META}: the checkpoint was "
                                          f"changed after it was written; remove that file or the checkpoint")
    return meta


def list_checkpoints(root: str) -> list[str]:
    """Complete-looking checkpoint directories under root, newest step first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := _STEP_RE.match(d))]
    return [p for _, p in sorted(found, reverse=True)]


def newest_good(root: str, say: Callable[[str], None] = log.warning) -> Optional[str]:
    """The newest checkpoint under root that verifies; says which ones it skipped and why."""
    skipped = []
    for path in list_checkpoints(root):
        try:
            verify(path)
        except CheckpointError as err:
            say(f"checkpoint {path} is unusable: {err}")
            skipped.append(path)
            continue
        if skipped:
            say(f"falling back to {path}, the newest good checkpoint (skipped {len(skipped)} newer)")
        return path
    if skipped:
        raise CheckpointError(f"no usable checkpoint in {root}: all {len(skipped)} failed verification (see above)")
    return None


def resolve(path: str) -> str:
    """A step directory as given, or the newest good one in a checkpoints directory."""
    if os.path.exists(os.path.join(path, META)) or _STEP_RE.match(os.path.basename(os.path.normpath(path))):
        return path
    if os.path.isdir(path):
        found = newest_good(path)
        if found:
            return found
    raise CheckpointError(f"{path} is neither a checkpoint (no {META}) nor a directory holding step_* checkpoints")


def _check_compatible(meta: dict, path: str, cfg, strategy, layout: dict) -> None:
    """Everything that can be checked before a single tensor is touched."""
    from zerolab.strategies.base import Strategy

    where = os.path.join(path, META)
    if meta["strategy"] == "deepspeed":
        ds, stage = meta["deepspeed"], cfg.strategy.stage
        if cfg.strategy.name != "deepspeed" or ds["stage"] != stage or meta["world_size"] != ctx_world(strategy):
            raise CheckpointError(
                f"{where}: a DeepSpeed stage-{ds['stage']} checkpoint of {meta['world_size']} ranks loads only into "
                f"strategy=deepspeed strategy.stage={ds['stage']} with {meta['world_size']} ranks (this run: "
                f"strategy={cfg.strategy.name} stage {stage}, {ctx_world(strategy)} ranks). To continue elsewhere, "
                f"convert its weights: python -m zerolab export {path} --as-checkpoint --out DIR "
                f"(the optimizer state does not carry over)")
    elif meta["strategy"] not in RESHARDABLE:
        raise CheckpointError(f"{where}: written by strategy {meta['strategy']!r}; zerolab's format loads across "
                              f"{', '.join(RESHARDABLE)} only")
    if meta["strategy"] != "deepspeed" and (cfg.strategy.name not in RESHARDABLE or
                                            type(strategy).load_checkpoint_state is Strategy.load_checkpoint_state):
        raise CheckpointError(f"strategy={cfg.strategy.name} cannot load zerolab checkpoints; resume {path} with "
                              f"one of {', '.join(RESHARDABLE)}")
    if meta["optimizer"] != cfg.optim.name:
        raise CheckpointError(f"{where}: optimizer state is for optim={meta['optimizer']}, this run uses "
                              f"optim={cfg.optim.name}; resume with optim={meta['optimizer']}")
    saved, mine = meta["params"], layout["params"]
    problems = [f"{n}: missing from the checkpoint" for n in mine if n not in saved]
    problems += [f"{n}: in the checkpoint but not in this model" for n in saved if n not in mine]
    problems += [f"{n}: shape {saved[n]} in the checkpoint, {mine[n]} in this model"
                 for n in mine if n in saved and saved[n] != mine[n]]
    if problems:
        raise CheckpointError(f"{where}: the checkpoint is for another model (model={meta['config']['model']['name']}): "
                              + "; ".join(problems[:6]) + (f"; ... {len(problems) - 6} more" if len(problems) > 6 else ""))
    if meta["strategy"] == "deepspeed":
        return
    for key, pieces in meta["pieces"].items():
        name = key.split("/", 1)[1]
        at = 0
        for pc in sorted(pieces, key=lambda p: p["start"]):
            if pc["start"] != at:
                raise CheckpointError(f"{where}: pieces of {key!r} leave a gap or overlap at element {at}")
            at = pc["end"]
        if at != math.prod(saved[name]):
            raise CheckpointError(f"{where}: pieces of {key!r} end at element {at} of {math.prod(saved[name])}")
    missing = [n for n in mine if f"master/{n}" not in meta["pieces"]]
    if missing:
        raise CheckpointError(f"{where}: no master weights for {', '.join(missing[:5])}")


def ctx_world(strategy) -> int:
    return strategy.ctx.world_size


DS_TAG = "deepspeed"  # the tag (sub-directory) DeepSpeed's own files go into


def _is_deepspeed(strategy) -> bool:
    return strategy.name == "deepspeed" and getattr(strategy, "engine", None) is not None


def _writes_checkpoints(strategy) -> bool:
    """By name, not by method: torch_zero inherits DDP's methods, but its optimizer state lives
    on the rank that owns each parameter, which DDP's rank-0-writes-all would silently drop."""
    from zerolab.strategies.base import Strategy

    return _is_deepspeed(strategy) or (strategy.name in RESHARDABLE and
                                       type(strategy).checkpoint_state is not Strategy.checkpoint_state)


# ---- save / resume during training -----------------------------------------------------------------
class Checkpointer:
    def __init__(self, cfg, ctx, run_dir: str, layout: dict, strategy=None):
        from zerolab.config import ConfigError

        self.cfg, self.ctx, self.layout = cfg, ctx, layout
        self.dir = os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))
        if cfg.checkpoint.every and strategy is not None and not _writes_checkpoints(strategy):
            # Fail now, not after `every` steps of training.
            raise ConfigError(f"checkpoint.every={cfg.checkpoint.every}: strategy={cfg.strategy.name} cannot write "
                              f"checkpoints yet; use one of {', '.join(RESHARDABLE)} or deepspeed, or checkpoint.every=0")

    def save(self, step: int, strategy, schedule, sampler) -> str:
        """Collective. Every rank writes its pieces; rank 0 writes meta.json and publishes.
        A failure on any rank (disk full, say) fails the save on every rank together: outcomes
        are agreed by the collectives the save needs anyway, the temp directory is removed, the
        previous checkpoint stays as it was, and a CheckpointError says what happened."""
        ctx, name = self.ctx, f"step_{step:08d}"
        tmp, final = os.path.join(self.dir, f".tmp-{name}"), os.path.join(self.dir, name)
        if self.layout["buffers"]:
            raise CheckpointError(f"model buffers {self.layout['buffers']} are not saved by zerolab checkpoints yet")
        failure = None
        if ctx.is_main:
            try:
                os.makedirs(self.dir, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            except OSError as err:
                failure = self._failure(step, err, tmp)
        self._agree(ctx.gather_objects(failure), tmp)
        native = _is_deepspeed(strategy)
        report, where = None, os.path.join(tmp, DS_TAG) if native else os.path.join(tmp, f"rank{ctx.rank}.safetensors")
        try:
            if native:  # DeepSpeed writes its partitioned state itself (torch.save files, see README)
                strategy.engine.save_checkpoint(tmp, tag=DS_TAG, save_latest=False)
            where = os.path.join(tmp, f"rank{ctx.rank}.safetensors")
            report = self._write_rank_file(tmp, step, strategy, native)
        except Exception as err:  # noqa: BLE001  (torch.save reports a full disk as RuntimeError)
            failure = self._failure(step, err, where)
        reports = ctx.gather_objects(report if failure is None else {"failure": failure})
        self._agree([r.get("failure") for r in reports], tmp)
        if ctx.is_main:
            try:
                self._publish(tmp, final, name, step, strategy, schedule, sampler, reports, native)
            except OSError as err:
                failure = self._failure(step, err, os.path.join(tmp, META))
        self._agree([ctx.broadcast_object(failure)], tmp)
        if ctx.is_main:
            log.info("checkpoint: step %d saved to %s", step, final)
        return final

    def _write_rank_file(self, tmp: str, step: int, strategy, native: bool) -> dict:
        ctx = self.ctx
        pieces = {} if native else strategy.checkpoint_state()
        entries, index = [], []
        for key, pc in sorted(pieces.items()):
            tname = f"{key}@{pc.start}:{pc.end}"
            entries.append((tname, pc.tensor.dtype, (pc.end - pc.start,), lambda t=pc.tensor: t.reshape(-1)))
            index.append({"key": key, "tensor": tname, "start": pc.start, "end": pc.end, "shape": list(pc.shape),
                          "dtype": str(pc.tensor.dtype).removeprefix("torch.")})
        for key, t in _rng_tensors(ctx.device).items():
            entries.append((key, t.dtype, tuple(t.shape), lambda t=t: t))
        fname = f"rank{ctx.rank}.safetensors"
        info = write_safetensors(os.path.join(tmp, fname), entries, {"format": FORMAT, "rank": ctx.rank, "step": step})
        return {"file": fname, "rank": ctx.rank, **info, "pieces": index,
                "scalars": {} if native else optimizer_scalars(strategy.optimizer)}

    def _publish(self, tmp, final, name, step, strategy, schedule, sampler, reports, native) -> None:
        meta = self._meta(step, strategy, schedule, sampler, reports)
        if native:
            meta["deepspeed"] = self._deepspeed_files(tmp, meta["files"])
        _write_text_atomic(os.path.join(tmp, META), _meta_text(meta))
        _fsync_dir(tmp)
        if os.path.exists(final):  # the same step saved again (a resumed run): swap it out
            old = os.path.join(self.dir, f".old-{name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        _write_text_atomic(os.path.join(self.dir, LATEST), name + "\n")
        self._prune()

    def _failure(self, step: int, err: Exception, writing: str) -> str:
        """One paragraph: where, what happened, how much space it needs, what to do."""
        import errno

        where = getattr(err, "filename", None) or writing  # a failed write() names no file
        prev = next(iter(list_checkpoints(self.dir)), None)
        try:
            free = f", {shutil.disk_usage(self.dir).free} bytes were free when it failed"
        except OSError:
            free = ""
        if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            what = "no space left on the device" if err.errno == errno.ENOSPC else "disk quota exceeded"
            need = ""
            if prev is not None:
                try:
                    need = f"; the previous checkpoint took {sum(f['bytes'] for f in read_meta(prev)['files'].values())} bytes"
                except CheckpointError:
                    pass
            fix = (f"free space under {self.dir} (or lower checkpoint.keep_last), or point checkpoint.dir at a "
                   f"larger filesystem")
            what += need + free
        else:
            what = getattr(err, "strerror", None) or f"{type(err).__name__}: {err}"
            fix = f"check that {self.dir} is writable and has space{free}"
        kept = (f"The previous checkpoint {prev} is intact: continue from it with checkpoint.resume=auto"
                if prev else "No earlier checkpoint exists")
        return (f"rank {self.ctx.rank}: saving the checkpoint of step {step} failed writing {where}: {what}. "
                f"The unfinished save was removed. To fix: {fix}. {kept}.")

    def _agree(self, failures: list, tmp: str) -> None:
        """Every rank holds the same list of failures (one collective gave it to all): if any rank
        failed, all remove the temp directory and raise together, nobody waits in a collective."""
        failed = [f for f in failures if f]
        if failed:
            shutil.rmtree(tmp, ignore_errors=True)  # shared or node-local: each rank removes what it sees
            raise CheckpointError(failed[0] + (f" ({len(failed) - 1} other rank(s) failed too)" if len(failed) > 1 else ""))

    def _meta(self, step, strategy, schedule, sampler, reports) -> dict:
        import safetensors

        import zerolab
        from zerolab.config import to_dict

        cfg, pieces, shapes = self.cfg, {}, self.layout["params"]
        for r in reports:
            for pc in r["pieces"]:
                name = pc["key"].split("/", 1)[1]
                if shapes.get(name) != pc["shape"]:
                    raise CheckpointError(f"rank {r['rank']} saved {pc['key']} with shape {pc['shape']}, "
                                          f"the model has {shapes.get(name)}")
                pieces.setdefault(pc["key"], []).append(
                    {"file": r["file"], "tensor": pc["tensor"], "start": pc["start"], "end": pc["end"], "dtype": pc["dtype"]})
        scalars = next((r["scalars"] for r in reports if r["scalars"]), {})
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": self.ctx.world_size, "strategy": cfg.strategy.name, "precision": cfg.precision.name,
            "optimizer": cfg.optim.name, "config": to_dict(cfg),
            "versions": {"zerolab": zerolab.__version__, "torch": torch.__version__, "safetensors": safetensors.__version__},
            "lr_schedule": {**asdict(schedule), "next_lr": schedule(step)},
            "loss_scaler": strategy.precision.scaler.state_dict(),
            "sampler": {"next_step": step, "seed": sampler.seed, "global_batch": sampler.global_batch},
            "optimizer_scalars": scalars,
            **self.layout, "pieces": pieces,
            "files": {r["file"]: {"rank": r["rank"], "bytes": r["bytes"], "sha256": r["sha256"]} for r in reports},
        }

    def _deepspeed_files(self, tmp: str, files: dict) -> dict:
        import deepspeed

        for root, _, names in os.walk(os.path.join(tmp, DS_TAG)):
            for n in sorted(names):
                full = os.path.join(root, n)
                files[os.path.relpath(full, tmp)] = {"rank": None, "bytes": os.path.getsize(full), "sha256": _sha256(full)}
        return {"tag": DS_TAG, "stage": self.cfg.strategy.stage, "version": deepspeed.__version__}

    def _prune(self) -> None:
        keep = self.cfg.checkpoint.keep_last
        for path in (list_checkpoints(self.dir)[keep:] if keep > 0 else []):
            shutil.rmtree(path, ignore_errors=True)
        for d in os.listdir(self.dir):  # leftovers of saves a crash interrupted
            if d.startswith((".tmp-", ".old-")):
                shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)

    def resume(self, strategy, schedule, sampler) -> int:
        """Collective. Loads the checkpoint chosen by checkpoint.resume; returns the step to start at.
        Rank 0 picks and verifies it; every rank checks compatibility before any state changes."""
        ctx, cfg, want = self.ctx, self.cfg, self.cfg.checkpoint.resume
        choice = None
        if ctx.is_main:
            try:
                if want == "auto":
                    path = newest_good(self.dir)
                    if path is None:
                        log.info("checkpoint.resume=auto: no checkpoint in %s, starting at step 0", self.dir)
                    else:
                        log.info("checkpoint.resume=auto: resuming from %s", path)
                else:
                    path = resolve(want)
                    verify(path)
                choice = ("ok", path)
            except CheckpointError as err:
                choice = ("error", str(err))
        status, value = ctx.broadcast_object(choice)
        if status == "error":
            raise CheckpointError(value)
        if value is None:
            return 0
        path = value
        meta = read_meta(path)
        _check_compatible(meta, path, cfg, strategy, self.layout)
        step = int(meta["step"])
        schedule.resume_from(meta["lr_schedule"])  # re-derives the peak lr if the global batch changed
        self._note_differences(meta, schedule, sampler)

        reader = PieceReader(path, meta)
        if meta["strategy"] == "deepspeed":
            # DeepSpeed restores its weights, optimizer state and loss scaler; its files were
            # checksummed and scanned by verify(), and it loads them weights_only here.
            with safe_torch_load():
                loaded, _ = strategy.engine.load_checkpoint(path, tag=meta["deepspeed"]["tag"],
                                                            load_optimizer_states=True, load_lr_scheduler_states=False)
            if loaded is None:
                raise CheckpointError(f"{path}: DeepSpeed found no checkpoint under tag {meta['deepspeed']['tag']!r}")
        else:
            strategy.load_checkpoint_state(reader)
            restore_optimizer_scalars(strategy.optimizer, meta["optimizer_scalars"])
            scaler = strategy.precision.scaler
            if scaler.enabled and meta["precision"] == "fp16":
                scaler.load_state_dict(meta["loss_scaler"])
        strategy.step_count = step
        if reader.weights_only and ctx.is_main:
            log.warning("checkpoint: %s holds weights only (imported from %s): the optimizer state starts fresh",
                        path, meta.get("imported_from", {}).get("strategy", "?"))
        rng = reader.rng(ctx.rank) if meta["world_size"] == ctx.world_size else {}
        if "rng/cpu" in rng:
            torch.set_rng_state(rng["rng/cpu"])
            if "rng/cuda" in rng and ctx.device.type == "cuda":
                torch.cuda.set_rng_state(rng["rng/cuda"], ctx.device)
        else:
            torch.manual_seed(cfg.trainer.seed + 1 + ctx.rank + 1_000_003 * step)
            if ctx.is_main:
                log.warning("checkpoint: no RNG state for these ranks (saved with %d ranks, resumed with %d): dropout "
                            "RNG streams are re-seeded, so the run is not bitwise identical to one that never stopped",
                            meta["world_size"], ctx.world_size)
        if ctx.is_main:
            log.info("checkpoint: resumed at step %d from %s (%s, %d ranks -> %s, %d ranks)", step, path,
                     meta["strategy"], meta["world_size"], cfg.strategy.name, ctx.world_size)
        ctx.barrier()
        return step

    def _note_differences(self, meta: dict, schedule, sampler) -> None:
        if not self.ctx.is_main:
            return
        keys = ("warmup_steps", "max_steps", "decay", "min_lr_ratio", "base_lr")  # batch scaling: resume_from
        now, saved = asdict(schedule), meta["lr_schedule"]
        changed = {k: (saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)}
        if changed:
            log.warning("checkpoint: the LR schedule differs from the checkpoint's (saved, now): %s; "
                        "continuing with the new one", changed)
        if meta["sampler"]["global_batch"] != sampler.global_batch or meta["sampler"]["seed"] != sampler.seed:
            log.warning("checkpoint: global batch or seed changed (%s saved); the data order after the resume "
                        "differs from the original run's", meta["sampler"])
        if meta["precision"] != self.cfg.precision.name:
            log.warning("checkpoint: saved in precision=%s, resumed in precision=%s (fp32 master weights carry over)",
                        meta["precision"], self.cfg.precision.name)


# ---- export for inference -------------------------------------------------------------------------
def _weights(path: str, meta: dict):
    """(name, shape, produce) per parameter, in state-dict order, tied aliases once; produce()
    assembles one fp32 tensor. DeepSpeed checkpoints go through DeepSpeed's own consolidation
    (zero_to_fp32, lazy mode: one tensor at a time from memory-mapped partitions)."""
    params = meta["params"]
    names = [k for k in meta["state_dict_keys"] if k in params]
    if meta["strategy"] == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        lazy = get_fp32_state_dict_from_zero_checkpoint(path, tag=meta["deepspeed"]["tag"], lazy_mode=True)
        missing = [n for n in names if n not in lazy]
        if missing:
            raise CheckpointError(f"{path}: DeepSpeed's consolidation returned no {', '.join(missing[:5])}")
        return [(n, params[n], lambda n=n: lazy[n].contiguous().float().reshape(params[n])) for n in names]
    reader = PieceReader(path, meta)
    return [(n, params[n], lambda n=n: reader(f"master/{n}", 0, math.prod(params[n])).view(params[n]))
            for n in names]


def export(ckpt: str, out: str, dtype: str = "fp32") -> dict:
    """Consolidated weights without optimizer state, one tensor in memory at a time."""
    with safe_torch_load():  # DeepSpeed's consolidation opens its .pt files weights_only
        return _export(ckpt, out, dtype)


def _export(ckpt: str, out: str, dtype: str) -> dict:
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {dtype} is not one of {', '.join(EXPORT_DTYPES)}")
    path = resolve(ckpt)
    meta = verify(path)
    target, stats = EXPORT_DTYPES[dtype], {"peak_tensor_bytes": 0}

    def cast(produce):
        def run():
            t = produce()
            c = t.to(target)
            held = t.nbytes + (c.nbytes if c.data_ptr() != t.data_ptr() else 0)
            stats["peak_tensor_bytes"] = max(stats["peak_tensor_bytes"], held)
            return c
        return run

    entries = [(n, target, tuple(shape), cast(produce)) for n, shape, produce in _weights(path, meta)]
    tmp = f"{out}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    info = write_safetensors(tmp, entries, {"format": "zerolab-export", "step": meta["step"], "dtype": dtype,
                                            "tied": json.dumps(meta["aliases"]), "model": meta["config"]["model"]["name"]})
    os.replace(tmp, out)
    largest = max(math.prod(s) for s in meta["params"].values()) * 4
    return {"checkpoint": path, "out": out, "step": meta["step"], "tensors": len(entries), "dtype": dtype,
            "checkpoint_bytes": sum(f["bytes"] for f in meta["files"].values()), "export_bytes": info["bytes"],
            "largest_fp32_tensor_bytes": largest, **stats, "tied": meta["aliases"]}


def import_weights(ckpt: str, out_root: str) -> str:
    """Any checkpoint (a DeepSpeed one included) -> a weights-only zerolab checkpoint in out_root,
    which ddp/zero1/zero2 resume from with a fresh optimizer state. Returns its path."""
    with safe_torch_load():
        return _import_weights(ckpt, out_root)


def _import_weights(ckpt: str, out_root: str) -> str:
    path = resolve(ckpt)
    meta = verify(path)
    name = f"step_{meta['step']:08d}"
    tmp, final = os.path.join(out_root, f".tmp-{name}"), os.path.join(out_root, name)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weights = _weights(path, meta)
    entries = [(f"master/{n}@0:{math.prod(shape)}", torch.float32, (math.prod(shape),),
                lambda p=produce: p().reshape(-1)) for n, shape, produce in weights]
    info = write_safetensors(os.path.join(tmp, "rank0.safetensors"), entries, {"format": FORMAT, "rank": 0})
    new = {k: v for k, v in meta.items() if k != "deepspeed"}
    new.update({
        "strategy": "ddp", "world_size": 1, "optimizer_state": False,
        "optimizer_scalars": {"step": {"value": 0.0, "tensor": True, "dtype": "float32"}},
        "imported_from": {"path": path, "strategy": meta["strategy"], "world_size": meta["world_size"]},
        "pieces": {f"master/{n}": [{"file": "rank0.safetensors", "tensor": e[0], "start": 0, "end": e[2][0],
                                    "dtype": "float32"}] for (n, _, _), e in zip(weights, entries)},
        "files": {"rank0.safetensors": {"rank": 0, **info}},
    })
    _write_text_atomic(os.path.join(tmp, META), _meta_text(new))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(out_root)
    _write_text_atomic(os.path.join(out_root, LATEST), name + "\n")
    return final


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab export",
                                description="consolidate a zerolab checkpoint into one safetensors file for inference")
    p.add_argument("ckpt", help="a step_* checkpoint directory, or a checkpoints directory (newest good one)")
    p.add_argument("--out", required=True, help="output .safetensors path")
    p.add_argument("--dtype", default="fp32", choices=sorted(EXPORT_DTYPES))
    p.add_argument("--as-checkpoint", action="store_true",
                   help="write a weights-only zerolab checkpoint into the directory --out instead (e.g. to "
                        "continue a DeepSpeed run under ddp/zero1/zero2; the optimizer state starts fresh)")
    args = p.parse_args(argv)
    try:
        if args.as_checkpoint:
            print(f"wrote weights-only zerolab checkpoint {import_weights(args.ckpt, args.out)}")
            return 0
        r = export(args.ckpt, args.out, args.dtype)
    except CheckpointError as err:
        print(f"zerolab export: {err}", file=sys.stderr)
        return 1
    print(f"exported step {r['step']} from {r['checkpoint']}: {r['tensors']} tensors ({r['dtype']}) -> {r['out']}")
    print(f"size: checkpoint {r['checkpoint_bytes'] / 2**20:.2f} MiB -> export {r['export_bytes'] / 2**20:.2f} MiB "
          f"({r['checkpoint_bytes'] / max(r['export_bytes'], 1):.1f}x smaller: no optimizer state, no RNG)")
    print(f"largest tensor held at once: {r['peak_tensor_bytes']} bytes "
          f"(largest parameter in fp32: {r['largest_fp32_tensor_bytes']} bytes)")
    if r["tied"]:
        print(f"tied weights written once: {r['tied']} (load with strict=False, or re-tie)")
    print(json.dumps(r))
    return 0
