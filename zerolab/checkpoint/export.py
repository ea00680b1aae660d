"""Export for inference (one safetensors file of consolidated weights) and import of any
checkpoint's weights as a weights-only checkpoint in the pieces format.

A pieces checkpoint is consolidated by reading each tensor whole (PieceReader); a native one by
its writing strategy's class (Strategy.native_weights), inside safe_torch_load with that
strategy's allow-list. One tensor is held in memory at a time either way.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import torch

from zerolab.atomic import atomic_path
from zerolab.checkpoint.format import FORMAT, FORMAT_VERSION, CheckpointError, meta_text, safe_torch_load, \
    write_safetensors, writer_class
from zerolab.checkpoint.reshard import PieceReader
from zerolab.checkpoint.store import publish, resolve, trusted_globals, verify

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _weights(path: str, meta: dict):
    """(name, shape, produce) per parameter, in state-dict order, tied aliases once; produce()
    assembles one fp32 tensor."""
    params = meta["params"]
    names = [k for k in meta["state_dict_keys"] if k in params]
    if meta["checkpoint_format"] == "native":
        produce = writer_class(meta).native_weights(path, meta)
        missing = [n for n in names if n not in produce]
        if missing:
            raise CheckpointError(f"{path}: strategy {meta['strategy']}'s consolidation returned no "
                                  f"{', '.join(missing[:5])}")
        return [(n, params[n], lambda n=n: produce[n]().float().reshape(params[n])) for n in names]
    reader = PieceReader(path, meta)
    return [(n, params[n], lambda n=n: reader(f"master/{n}", 0, math.prod(params[n])).view(params[n]))
            for n in names]


def export(ckpt: str, out: str, dtype: str = "fp32") -> dict:
    """Consolidated weights without optimizer state, one tensor in memory at a time."""
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

    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with safe_torch_load(trusted_globals(meta)):  # a native format's files open weights_only
        entries = [(n, target, tuple(shape), cast(produce)) for n, shape, produce in _weights(path, meta)]
        with atomic_path(out) as tmp:
            info = write_safetensors(tmp, entries, {"format": "zerolab-export", "step": meta["step"], "dtype": dtype,
                                                    "tied": json.dumps(meta["aliases"]),
                                                    "model": meta["config"]["model"]["name"]})
    largest = max(math.prod(s) for s in meta["params"].values()) * 4
    return {"checkpoint": path, "out": out, "step": meta["step"], "tensors": len(entries), "dtype": dtype,
            "checkpoint_bytes": sum(f["bytes"] for f in meta["files"].values()), "export_bytes": info["bytes"],
            "largest_fp32_tensor_bytes": largest, **stats, "tied": meta["aliases"]}


def import_weights(ckpt: str, out_root: str) -> str:
    """Any checkpoint (a native one included) -> a weights-only pieces checkpoint in out_root, as
    the reference strategy on one rank would write it; every pieces-format strategy resumes from
    it with a fresh optimizer state. Returns its path."""
    from zerolab.strategies import reference_strategy

    path = resolve(ckpt)
    meta = verify(path)
    name = f"step_{meta['step']:08d}"
    tmp, final = os.path.join(out_root, f".tmp-{name}"), os.path.join(out_root, name)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with safe_torch_load(trusted_globals(meta)):
        weights = _weights(path, meta)
        entries = [(f"master/{n}@0:{math.prod(shape)}", torch.float32, (math.prod(shape),),
                    lambda p=produce: p().reshape(-1)) for n, shape, produce in weights]
        info = write_safetensors(os.path.join(tmp, "rank0.safetensors"), entries, {"format": FORMAT, "rank": 0})
    new = {k: v for k, v in meta.items() if k != "native"}
    new.update({
        "format_version": FORMAT_VERSION, "checkpoint_format": "pieces",
        "strategy": reference_strategy(), "world_size": 1, "optimizer_state": False,
        "optimizer_scalars": {"step": {"value": 0.0, "tensor": True, "dtype": "float32"}},
        "imported_from": {"path": path, "strategy": meta["strategy"], "world_size": meta["world_size"]},
        "pieces": {f"master/{n}": [{"file": "rank0.safetensors", "tensor": e[0], "start": 0, "end": e[2][0],
                                    "dtype": "float32"}] for (n, _, _), e in zip(weights, entries)},
        "files": {"rank0.safetensors": {"rank": 0, **info}},
    })
    publish(tmp, final, out_root, meta_text(new))
    shutil.rmtree(os.path.join(out_root, f".old-{name}"), ignore_errors=True)  # a previous import of this step
    return final


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab export",
                                description="consolidate a zerolab checkpoint into one safetensors file for inference")
    p.add_argument("ckpt", help="a step_* checkpoint directory, or a checkpoints directory (newest good one)")
    p.add_argument("--out", required=True, help="output .safetensors path")
    p.add_argument("--dtype", default="fp32", choices=sorted(EXPORT_DTYPES))
    p.add_argument("--as-checkpoint", action="store_true",
                   help="write a weights-only zerolab checkpoint into the directory --out instead (e.g. to "
                        "continue a run whose strategy writes its own format under one that reshards; the "
                        "optimizer state starts fresh)")
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
