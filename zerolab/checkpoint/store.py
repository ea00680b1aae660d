"""Checkpoint directories: verify one, list them, pick the newest good one, check that one fits
the run about to load it, publish a finished one."""
from __future__ import annotations

import logging
import os
import shutil
from typing import Callable, Optional

from zerolab.atomic import atomic_write_text, fsync_dir, sha256_file
from zerolab.errors import ConfigError
from zerolab.checkpoint.format import (FORMATS, LATEST, META, STEP_RE, CheckpointError, check_torch_file, read_meta,
                                       safetensors_header, writer_class)
from zerolab.checkpoint.reshard import check_pieces_cover

log = logging.getLogger("zerolab")


def trusted_globals(meta: dict) -> tuple:
    """The pickle globals the writing strategy's own files may name (none for the pieces format)."""
    cls = writer_class(meta)
    return tuple(cls.checkpoint_globals) if cls is not None and meta["checkpoint_format"] == "native" else ()


def verify(path: str, checksums: bool = True) -> dict:
    """Metadata readable, every recorded file present with its recorded size and sha256, every
    torch.save file free of pickled code."""
    meta = read_meta(path)
    allowed, owner = trusted_globals(meta), f"strategy {meta['strategy']}"
    for fname, info in meta["files"].items():
        full = os.path.join(path, fname)
        if not os.path.exists(full):
            whose = (f"shard of rank {info['rank']} of {meta['world_size']}" if info.get("rank") is not None
                     else f"a file of {owner}'s own checkpoint format")
            raise CheckpointError(f"{full} is missing ({whose})")
        size = os.path.getsize(full)
        if size != info["bytes"]:
            raise CheckpointError(f"{full} has {size} bytes, the checkpoint recorded {info['bytes']}: truncated or "
                                  "corrupt")
        if checksums and sha256_file(full) != info["sha256"]:
            raise CheckpointError(f"{full}: sha256 does not match the one recorded in {META}: corrupt")
        if fname.endswith(".safetensors"):
            # A safetensors file in fact (not a pickle under its name), written at this step: a meta.json
            # rewritten to another step, digest and all, still has rank files saying which step they hold.
            written = safetensors_header(full).get("__metadata__", {}).get("step")
            if written is not None and written != str(meta["step"]):
                raise CheckpointError(f"{full} was written at step {written}, but {META} says step {meta['step']}: "
                                      f"the metadata was rewritten; the checkpoint is not usable")
        else:
            check_torch_file(full, allowed, owner)  # torch.save files: refused before anything opens them
    # A native loader finds its files by name pattern in the directories they are in: no file
    # there may be unrecorded. (Format 2 left DeepSpeed's unrecorded script at the top level.)
    native_dirs = {f.split("/")[0] for f, info in meta["files"].items() if info.get("rank") is None and "/" in f}
    for top in sorted(native_dirs):
        for root, _, names in os.walk(os.path.join(path, top)):
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
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := STEP_RE.match(d))]
    return [p for _, p in sorted(found, reverse=True)]


def newest_good(root: str, say: Callable[[str], None] = log.warning) -> Optional[str]:
    """The newest checkpoint under root that verifies. Falling back past refused ones is said in
    one message naming each and why; when none is usable, the CheckpointError lists every
    checkpoint tried, why each was refused, and what to do."""
    refused = []
    for path in list_checkpoints(root):
        try:
            verify(path)
        except CheckpointError as err:
            refused.append((path, str(err)))
            continue
        if refused:
            say(f"falling back to {path}, the newest good checkpoint; refused: {_reasons(refused)}")
        return path
    if refused:
        raise CheckpointError(
            f"no usable checkpoint in {root}: all {len(refused)} failed verification: {_reasons(refused)}. To go on: "
            f"resume from a good copy of one (checkpoint.resume=PATH), or start fresh in another run.dir (or here "
            f"with run.overwrite=true, which removes these checkpoints and the run's record)")
    return None


def _reasons(refused: list[tuple[str, str]]) -> str:
    return "; ".join(f"[{os.path.basename(path)}] {why}" for path, why in refused)


def resolve(path: str) -> str:
    """A step directory as given, or the newest good one in a checkpoints directory."""
    if os.path.exists(os.path.join(path, META)) or STEP_RE.match(os.path.basename(os.path.normpath(path))):
        return path
    if os.path.isdir(path):
        found = newest_good(path)
        if found:
            return found
    raise CheckpointError(f"{path} is neither a checkpoint (no {META}) nor a directory holding step_* checkpoints")


def check_resume_path(path: str) -> None:
    """checkpoint.resume=PATH must name a checkpoint or a directory of them: refused with a
    ConfigError (exit 2) before any process group exists or anything is written, when it does not
    (verification of what it holds comes later, in the ranks)."""
    if path in ("", "auto"):
        return
    what = (f"Give a checkpoint (a step_... directory holding {META}), a directory holding step_* checkpoints "
            f"(such as <run dir>/checkpoints), or checkpoint.resume=auto to continue the run in run.dir")
    if not os.path.exists(path):
        raise ConfigError(f"checkpoint.resume={path}: no such file or directory. {what}.")
    if os.path.exists(os.path.join(path, META)) or STEP_RE.match(os.path.basename(os.path.normpath(path))):
        return
    if os.path.isdir(path) and any(STEP_RE.match(d) for d in os.listdir(path)):
        return
    raise ConfigError(f"checkpoint.resume={path} is neither a checkpoint (it has no {META}) nor a directory holding "
                      f"step_* checkpoints. {what}.")


def check_compatible(meta: dict, path: str, cfg, strategy, layout: dict) -> None:
    """Everything that can be checked before a single tensor is touched: the format is one this
    run's strategy loads, the optimizer and the model are the same."""
    from zerolab.strategies import names_where

    where = os.path.join(path, META)
    writer, fmt = writer_class(meta), meta["checkpoint_format"]
    pieces = ", ".join(names_where(checkpoint_format="pieces"))
    if writer is None or fmt not in FORMATS:
        raise CheckpointError(f"{where}: written by strategy {meta['strategy']!r}, whose checkpoint format this "
                              f"zerolab does not read; zerolab's pieces format loads across {pieces}")
    if fmt == "native":
        writer.check_native_compatible(meta, path, cfg, strategy.ctx.world_size)
    elif type(strategy).checkpoint_format != "pieces":
        raise CheckpointError(f"strategy={cfg.strategy.name} cannot load zerolab checkpoints; resume {path} with "
                              f"one of {pieces}")
    if meta["optimizer"] != cfg.optim.name:
        raise CheckpointError(f"{where}: optimizer state is for optim={meta['optimizer']}, this run uses "
                              f"optim={cfg.optim.name}; resume with optim={meta['optimizer']}")
    problems = _differences(meta["params"], layout["params"], "")
    # persistent buffers (a checkpoint written before they were saved has only their names)
    saved_buffers = meta.get("buffer_shapes") or {n: None for n in meta["buffers"]}
    mine_buffers = layout.get("buffer_shapes") or {n: None for n in layout["buffers"]}
    problems += _differences(saved_buffers, mine_buffers, "buffer ")
    if problems:
        model = meta["config"]["model"]["name"]
        more = f"; ... {len(problems) - 6} more" if len(problems) > 6 else ""
        raise CheckpointError(f"{where}: the checkpoint is for another model (model={model}): "
                              + "; ".join(problems[:6]) + more)
    if fmt == "pieces":
        check_pieces_cover(meta, where, layout)


def _differences(saved: dict, mine: dict, what: str) -> list[str]:
    """Names -> shapes of a checkpoint against this model's: what is missing, extra or reshaped
    (a shape of None is not compared)."""
    problems = [f"{what}{n}: missing from the checkpoint" for n in mine if n not in saved]
    problems += [f"{what}{n}: in the checkpoint but not in this model" for n in saved if n not in mine]
    problems += [f"{what}{n}: shape {saved[n]} in the checkpoint, {mine[n]} in this model" for n in mine
                 if n in saved and None not in (saved[n], mine[n]) and saved[n] != mine[n]]
    return problems


def publish(tmp: str, final: str, root: str, meta_text: str) -> None:
    """meta.json into the finished temp directory, the directory into place, then `latest`: a crash
    at any point leaves the previous checkpoint (and `latest` naming it) intact."""
    name = os.path.basename(final)
    atomic_write_text(os.path.join(tmp, META), meta_text)
    fsync_dir(tmp)
    if os.path.exists(final):  # the same step saved again (a resumed run): swap it out
        old = os.path.join(root, f".old-{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, LATEST), name + "\n")


def make_room(root: str, keep: int) -> list[str]:
    """Before a save: prune down to the checkpoints that must survive it, so that the save needs
    room for one more and no more. With keep_last=K those are the newest K-1, and always the
    newest one that verifies (cheaply: structure, not checksums), so a failed save never costs
    the last good checkpoint. keep <= 0 keeps everything. Returns what was removed."""
    if keep <= 0:
        return []
    found = list_checkpoints(root)
    keep_set = set(found[:max(keep - 1, 1)])
    for path in found:
        try:
            verify(path, checksums=False)
        except CheckpointError:
            continue
        keep_set.add(path)
        break
    removed = [p for p in found if p not in keep_set]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def bytes_of(path: str) -> int:
    """Disk space the files under `path` take (a checkpoint, or a save in progress): allocated
    blocks, not file sizes, since that is what a full filesystem runs out of."""
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.stat(os.path.join(root, n)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def prune(root: str, keep: int) -> None:
    """All but the newest `keep` checkpoints (none when keep <= 0), and leftovers of saves a crash interrupted."""
    for path in (list_checkpoints(root)[keep:] if keep > 0 else []):
        shutil.rmtree(path, ignore_errors=True)
    for d in os.listdir(root):
        if d.startswith((".tmp-", ".old-")):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        elif d.startswith(LATEST + ".tmp."):  # an atomic write of `latest` a crash interrupted
            os.remove(os.path.join(root, d))
