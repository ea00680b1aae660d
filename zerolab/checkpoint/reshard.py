"""The "pieces" format: name-keyed slices of flattened tensors, read back in any other slicing.

A rank's checkpoint state is a set of pieces "<kind>/<param name>" -> ShardPiece (elements
[start, end) of the flattened tensor; kind = master | exp_avg | ...). Loading asks the strategy
which element ranges it owns now and assembles each from whatever pieces were saved, so N ranks
of one pieces-format strategy load into M ranks of any other.
"""
from __future__ import annotations

import math
import os
from typing import Iterable

import torch

from zerolab.checkpoint.format import CheckpointError


# ---- what a model and an optimizer look like ------------------------------------------------------
def model_layout(model: torch.nn.Module) -> dict:
    """Parameter names and shapes, tied aliases (a second name of one parameter), state-dict order,
    and the persistent buffers (BatchNorm's running statistics, a register_buffer'd scale: model
    state that is not a parameter) with their shapes."""
    params = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    by_id = {id(p): n for n, p in model.named_parameters()}
    aliases, buffers = {}, {}
    keys = list(model.state_dict(keep_vars=True).keys())
    for key, t in model.state_dict(keep_vars=True).items():
        if key in params:
            continue
        if id(t) in by_id:
            aliases[key] = by_id[id(t)]
        else:
            buffers[key] = list(t.shape)
    return {"params": params, "aliases": aliases, "state_dict_keys": keys, "buffers": list(buffers),
            "buffer_shapes": buffers}


# ---- model buffers: each rank's own ------------------------------------------------------------------
# A buffer is updated by each rank's forward on its own micro-batches (BatchNorm's running mean and
# variance, its count of batches; a custom running scale): ranks may hold different values, and
# under DDP (which broadcasts rank 0's buffers at every forward) they differ between steps too.
# Every rank writes its own into its rank file; a resume at the same world size gives each rank its
# own back (bitwise the run that never stopped). At another world size the rank numbers no longer
# name the same data shards, so every rank loads rank 0's, the ones the run's final weights and an
# export carry.
BUFFER_PREFIX = "buffer/"


def module_buffers(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The live tensors of the persistent buffers `names` (model_layout's) of the module a strategy
    trains; a module that lost one (a strategy that replaced it) is a CheckpointError."""
    found = dict(model.named_buffers(remove_duplicate=False))
    missing = [n for n in names if n not in found]
    if missing:
        raise CheckpointError(f"model buffers {missing[:5]} are not on the trained module any more: they cannot be "
                              "saved; checkpoints of this model need a strategy that keeps the module's buffers")
    return {n: found[n] for n in names}


def buffer_source(meta: dict, rank: int, world_size: int) -> int:
    """The saving rank whose buffers rank `rank` of a run of `world_size` ranks loads."""
    return rank if meta["world_size"] == world_size else 0


def optimizer_scalars(states: Iterable[dict]) -> dict:
    """Per-parameter scalar state (Adam's `step`) of a strategy's optimizer states
    (Strategy.optimizer_states); it must agree across parameters. Recorded as the value with the
    writer's type beside it (format 5: a reader restores it in its own optimizer's type)."""
    found: dict[str, dict] = {}
    for state in states:
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


def restore_optimizer_scalars(states: Iterable[dict], scalars: dict) -> None:
    """Each saved counter into every state dict, in the type the reader's optimizer keeps it: a
    tensor of its own dtype and device (torch's and zerolab's Adam), a Python int (DeepSpeed's), so
    a counter written by one library is the one another library counts on from. Where the reader
    has no such entry yet, the writer's type."""
    for state in states:
        for key, rec in scalars.items():
            mine = state.get(key)
            if isinstance(mine, torch.Tensor):
                state[key] = torch.tensor(rec["value"], dtype=mine.dtype, device=mine.device)
            elif isinstance(mine, (int, float)) and not isinstance(mine, bool):
                state[key] = type(mine)(rec["value"])
            elif rec["tensor"]:
                state[key] = torch.tensor(rec["value"], dtype=getattr(torch, rec["dtype"]))
            else:
                state[key] = int(rec["value"]) if rec["dtype"] == "int" else rec["value"]


def rng_tensors(device: torch.device) -> dict[str, torch.Tensor]:
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
            piece = self.file(pc["file"]).get_slice(pc["tensor"])
            out[lo - start:hi - start] = piece[lo - pc["start"]:hi - pc["start"]]
            covered += hi - lo
        if covered != end - start:
            raise CheckpointError(f"{self.path}: elements [{start}, {end}) of {key!r} are not all in the checkpoint")
        return out

    def buffers(self, rank: int, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Rank `rank`'s saved buffers `names`; None when its file holds none (an imported,
        weights-only checkpoint); CheckpointError when it holds some but not all."""
        f = self.file(f"rank{rank}.safetensors")
        held = {k[len(BUFFER_PREFIX):] for k in f.keys() if k.startswith(BUFFER_PREFIX)}
        if not held and self.weights_only:
            return None
        missing = [n for n in names if n not in held]
        if missing:
            raise CheckpointError(f"{os.path.join(self.path, f'rank{rank}.safetensors')} holds no model buffer "
                                  f"{', '.join(missing[:5])}: the checkpoint is incomplete")
        return {n: f.get_tensor(BUFFER_PREFIX + n) for n in names}

    def rng(self, rank: int) -> dict[str, torch.Tensor]:
        f = self.file(f"rank{rank}.safetensors")
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}


def check_pieces_cover(meta: dict, where: str, layout: dict) -> None:
    """Every saved tensor's pieces tile it exactly, and every parameter has master weights."""
    saved = meta["params"]
    for key, pieces in meta["pieces"].items():
        name = key.split("/", 1)[1]
        at = 0
        for pc in sorted(pieces, key=lambda p: p["start"]):
            if pc["start"] != at:
                raise CheckpointError(f"{where}: pieces of {key!r} leave a gap or overlap at element {at}")
            at = pc["end"]
        if at != math.prod(saved[name]):
            raise CheckpointError(f"{where}: pieces of {key!r} end at element {at} of {math.prod(saved[name])}")
    missing = [n for n in layout["params"] if f"master/{n}" not in meta["pieces"]]
    if missing:
        raise CheckpointError(f"{where}: no master weights for {', '.join(missing[:5])}")
