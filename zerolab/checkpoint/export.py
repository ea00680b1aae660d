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
from zerolab.errors import ConfigError

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model_config(meta: dict):
    """The run's ModelConfig, from the checkpoint's saved config."""
    from zerolab.schema import ModelConfig

    model = meta["config"]["model"]
    return ModelConfig(**{k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__})


def _true_shapes(path: str, meta: dict) -> dict:
    """Parameter shapes where the layout recorded none: checkpoints written before zerolab recorded
    the layout ahead of the strategy's setup (DeepSpeed stage 3 partitions the parameters, each
    shape becomes [0]). The model, rebuilt from the run's config on the meta device (no memory),
    has them; without them an export would be empty."""
    params = meta["params"]
    if all(math.prod(s) for s in params.values()):
        return params
    from zerolab.models import build_model

    try:
        shapes = {n: list(p.shape) for n, p in build_model(_model_config(meta), device="meta").named_parameters()}
    except ConfigError as err:
        raise CheckpointError(f"{path}: its layout records partitioned (empty) shapes, and the run's model does not "
                              f"build here to find the real ones: {err}") from None
    return {n: s if math.prod(s) else shapes[n] for n, s in params.items()}


def _weights(path: str, meta: dict):
    """(name, shape, produce) per parameter, in state-dict order, tied aliases once; produce()
    assembles one fp32 tensor."""
    params = _true_shapes(path, meta)
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
    largest = max(math.prod(s) for s in _true_shapes(path, meta).values()) * 4
    return {"checkpoint": path, "out": out, "step": meta["step"], "tensors": len(entries), "dtype": dtype,
            "checkpoint_bytes": sum(f["bytes"] for f in meta["files"].values()), "export_bytes": info["bytes"],
            "largest_fp32_tensor_bytes": largest, **stats, "tied": meta["aliases"]}


HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # config.json's "dtype"


def _hf_config(path: str, meta: dict, dtype: str) -> dict:
    """config.json for a model=hf checkpoint: the one its run wrote beside its checkpoints
    (zerolab.run.results.save_model_config), else the saved run config's model.config resolved again."""
    from zerolab.models.sources import hf_config_json

    written = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.json")
    if os.path.isfile(written):
        with open(written) as fh:
            config = json.load(fh)
    else:
        try:
            config = hf_config_json(_model_config(meta))
        except ConfigError as err:
            raise CheckpointError(f"{path}: no config.json beside the checkpoints ({written}), and the run's "
                                  f"model.config does not resolve here: {err}") from None
    return {**config, "dtype": HF_DTYPES[dtype]}


def export_hf(ckpt: str, out: str, dtype: str = "fp32") -> dict:
    """A model=hf checkpoint (of any strategy: pieces or DeepSpeed's own) as a directory that
    transformers' AutoModelForCausalLM.from_pretrained loads: model.safetensors under the model's
    own parameter names, a tied head written once under the name of the weight it shares (as
    save_pretrained writes it, and from_pretrained ties it again), and config.json."""
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {dtype} is not one of {', '.join(EXPORT_DTYPES)}")
    path = resolve(ckpt)
    meta = verify(path)
    kind = meta["config"]["model"].get("kind")
    if kind != "hf":
        raise CheckpointError(f"--format hf writes a transformers model: {path} is a checkpoint of model.kind={kind}; "
                              "export it with --format safetensors")
    config = _hf_config(path, meta, dtype)
    target = EXPORT_DTYPES[dtype]
    os.makedirs(out, exist_ok=True)
    with safe_torch_load(trusted_globals(meta)):
        entries = [(n, target, tuple(shape), lambda p=produce: p().to(target)) for n, shape, produce in _weights(path, meta)]
        with atomic_path(os.path.join(out, "model.safetensors")) as tmp:
            info = write_safetensors(tmp, entries, {"format": "pt"})
    with atomic_path(os.path.join(out, "config.json")) as tmp:
        with open(tmp, "w") as fh:
            json.dump(config, fh, indent=2)
    return {"checkpoint": path, "out": out, "step": meta["step"], "tensors": len(entries), "dtype": dtype,
            "export_bytes": info["bytes"], "tied": meta["aliases"], "architectures": config.get("architectures")}


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
        "params": {n: list(shape) for n, shape, _ in weights},  # true shapes (a DeepSpeed stage-3 layout has none)
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
    p.add_argument("--out", required=True, help="output .safetensors path (--format hf: a directory)")
    p.add_argument("--dtype", default="fp32", choices=sorted(EXPORT_DTYPES))
    p.add_argument("--format", default="safetensors", choices=["safetensors", "hf"],
                   help="hf: a model=hf checkpoint as a directory (model.safetensors + config.json) that "
                        "transformers' AutoModelForCausalLM.from_pretrained loads")
    p.add_argument("--as-checkpoint", action="store_true",
                   help="write a weights-only zerolab checkpoint into the directory --out instead (e.g. to "
                        "continue a run whose strategy writes its own format under one that reshards; the "
                        "optimizer state starts fresh)")
    args = p.parse_args(argv)
    try:
        if args.as_checkpoint:
            print(f"wrote weights-only zerolab checkpoint {import_weights(args.ckpt, args.out)}")
            return 0
        if args.format == "hf":
            r = export_hf(args.ckpt, args.out, args.dtype)
            print(f"exported step {r['step']} from {r['checkpoint']}: {r['tensors']} tensors ({r['dtype']}) and "
                  f"config.json -> {r['out']} (AutoModelForCausalLM.from_pretrained loads it)")
            print(json.dumps(r))
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
