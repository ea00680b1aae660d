"""Export for inference (one safetensors file of consolidated weights, or a directory that
transformers' from_pretrained loads) and import of any checkpoint's weights as a weights-only
checkpoint in the pieces format.

What is exported is a finished run's final weights (its run directory's model.safetensors, which
every run writes when it ends: no checkpoint needed) or a checkpoint (a step_* directory, or the
newest good one of a checkpoints directory: only runs with checkpoint.every=N write them). A
pieces checkpoint is consolidated by reading each tensor whole (PieceReader); a native one by its
writing strategy's class (Strategy.native_weights), inside safe_torch_load with that strategy's
allow-list. One tensor is held in memory at a time in every case.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from typing import Optional

import torch

from zerolab.atomic import atomic_path
from zerolab.checkpoint.format import FORMAT, FORMAT_VERSION, META, STEP_RE, CheckpointError, meta_text, \
    safe_torch_load, write_safetensors, writer_class
from zerolab.checkpoint.reshard import PieceReader, model_layout
from zerolab.checkpoint.store import list_checkpoints, publish, resolve, trusted_globals, verify
from zerolab.errors import ConfigError

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FINAL_WEIGHTS = "model.safetensors"  # a finished run's consolidated weights, in its run directory
HOW_TO_CHECKPOINT = ("a run writes checkpoints only with checkpoint.every=N or when a preemption stops it; the "
                     "default, checkpoint.every=0, writes none")


# ---- what a path names ---------------------------------------------------------------------------
def source(path: str) -> tuple[str, str]:
    """What `path` names for an export: ("weights", FILE) for a run directory holding its final
    weights or that file itself, ("checkpoint", STEP_DIR) for a checkpoint or a directory of them
    (a run directory without final weights: its checkpoints/). A CheckpointError that says what
    is there, and how to get what is not, otherwise."""
    p = os.path.normpath(path)
    if not os.path.exists(p):
        raise CheckpointError(_missing(p))
    if os.path.isfile(p):
        if p.endswith(".safetensors"):
            return "weights", p
        raise CheckpointError(f"{p} is a file but not safetensors weights: give a run directory, its "
                              f"{FINAL_WEIGHTS}, a checkpoints directory or one step_* checkpoint")
    if os.path.exists(os.path.join(p, META)) or STEP_RE.match(os.path.basename(p)):
        return "checkpoint", p
    if os.path.isfile(os.path.join(p, FINAL_WEIGHTS)):
        return "weights", os.path.join(p, FINAL_WEIGHTS)
    for root in (p, os.path.join(p, "checkpoints")):
        if list_checkpoints(root):
            return "checkpoint", resolve(root)  # the newest good one (its own error when none verifies)
    raise CheckpointError(_nothing(p, f"{p} holds no checkpoint (no {META}, no step_* directories, none in "
                                      f"{p}/checkpoints)"))


def _nothing(p: str, what: str) -> str:
    """The message for a checkpoints directory that is missing or empty (`what` says which)."""
    run = os.path.dirname(p)
    if os.path.basename(p) == "checkpoints" and os.path.isfile(os.path.join(run, FINAL_WEIGHTS)):
        return (f"{what}: that run wrote no checkpoints ({HOW_TO_CHECKPOINT}). Its final weights are in "
                f"{os.path.join(run, FINAL_WEIGHTS)}: export the run directory instead (python -m zerolab export "
                f"{run} ...)")
    if os.path.basename(p) == "checkpoints":
        return (f"{what}: the run in {run or '.'} wrote no checkpoints ({HOW_TO_CHECKPOINT}), and it has no final "
                f"weights ({FINAL_WEIGHTS}, written when a run finishes)")
    return (f"{what}, and no final weights ({FINAL_WEIGHTS}, written when a run finishes): give the directory of a "
            f"finished run, or the checkpoints directory of a run that wrote some ({HOW_TO_CHECKPOINT})")


def _missing(p: str) -> str:
    if os.path.basename(p) == "checkpoints" and os.path.isdir(os.path.dirname(p) or "."):
        return _nothing(p, f"{p} does not exist")
    return (f"{p}: no such file or directory. Give a finished run's directory (its final weights, {FINAL_WEIGHTS}), "
            f"a run's checkpoints directory or one step_* checkpoint of it ({HOW_TO_CHECKPOINT})")


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


def _casting(target: torch.dtype, stats: dict):
    """produce -> produce of the tensor cast to `target`, noting the most bytes held at once."""
    def cast(produce):
        def run():
            t = produce()
            c = t.to(target)
            held = t.nbytes + (c.nbytes if c.data_ptr() != t.data_ptr() else 0)
            stats["peak_tensor_bytes"] = max(stats["peak_tensor_bytes"], held)
            return c
        return run
    return cast


def _check_dtype(dtype: str) -> None:
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {dtype} is not one of {', '.join(EXPORT_DTYPES)}")


def export(ckpt: str, out: str, dtype: str = "fp32") -> dict:
    """Consolidated weights without optimizer state, one tensor in memory at a time: a finished
    run's final weights, or a checkpoint's (source)."""
    _check_dtype(dtype)
    kind, path = source(ckpt)
    if kind == "weights":
        return _export_final(path, out, dtype)
    meta = verify(path)
    target, stats = EXPORT_DTYPES[dtype], {"peak_tensor_bytes": 0}
    cast = _casting(target, stats)
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
    save_pretrained writes it, and from_pretrained ties it again), and config.json. From a
    finished run's directory (its final weights and config.json) or from a checkpoint (source)."""
    _check_dtype(dtype)
    kind, path = source(ckpt)
    if kind == "weights":
        return _export_final_hf(path, out, dtype)
    meta = verify(path)
    kind = meta["config"]["model"].get("kind")
    if kind != "hf":
        raise CheckpointError(f"--format hf writes a transformers model: {path} is a checkpoint of model.kind={kind}; "
                              "export it with --format safetensors")
    config = _hf_config(path, meta, dtype)
    target = EXPORT_DTYPES[dtype]
    os.makedirs(out, exist_ok=True)
    with safe_torch_load(trusted_globals(meta)):
        entries = [(n, target, tuple(shape), lambda p=produce: p().to(target))
                   for n, shape, produce in _weights(path, meta)]
        with atomic_path(os.path.join(out, FINAL_WEIGHTS)) as tmp:
            info = write_safetensors(tmp, entries, {"format": "pt"})
    _write_json(os.path.join(out, "config.json"), config)
    return {"checkpoint": path, "out": out, "step": meta["step"], "tensors": len(entries), "dtype": dtype,
            "export_bytes": info["bytes"], "tied": meta["aliases"], "architectures": config.get("architectures")}


def _write_json(path: str, obj: dict) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            json.dump(obj, fh, indent=2)


# ---- a finished run's final weights --------------------------------------------------------------
def _open_weights(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from None


def _final_step(weights: str) -> Optional[int]:
    """The step of a run directory's final weights: summary.json's steps (None if it says none)."""
    try:
        with open(os.path.join(os.path.dirname(weights), "summary.json")) as fh:
            return json.load(fh).get("steps")
    except (OSError, ValueError):
        return None


def _entries(st, target: torch.dtype, cast, skip=()) -> list:
    """(name, dtype, shape, produce) for each tensor of an open safetensors file but `skip`."""
    return [(n, target, tuple(st.get_slice(n).get_shape()), cast(lambda n=n: st.get_tensor(n)))
            for n in st.keys() if n not in skip]


def _export_final(weights: str, out: str, dtype: str) -> dict:
    """A run's model.safetensors as it is (every state-dict key: a tied weight under each of its
    names, as the run wrote it), cast to `dtype`."""
    target, stats = EXPORT_DTYPES[dtype], {"peak_tensor_bytes": 0}
    step = _final_step(weights)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with _open_weights(weights) as st:
        entries = _entries(st, target, _casting(target, stats))
        with atomic_path(out) as tmp:
            info = write_safetensors(tmp, entries, {"format": "zerolab-export", "step": step, "dtype": dtype,
                                                    "source": "final weights"})
    return {"weights": weights, "out": out, "step": step, "tensors": len(entries), "dtype": dtype,
            "source_bytes": os.path.getsize(weights), "export_bytes": info["bytes"], **stats, "tied": {}}


def _tied_aliases(config_json: str) -> dict:
    """The second names of tied weights ({"lm_head.weight": "transformer.wte.weight"}) of the
    transformers model that `config_json` builds, on the meta device (no memory)."""
    from zerolab.models import build_model
    from zerolab.schema import ModelConfig

    try:
        model = build_model(ModelConfig(name="hf", kind="hf", config=config_json, block_size=1), device="meta")
    except ConfigError as err:
        raise CheckpointError(f"{config_json} does not build a transformers model here: {err}") from None
    return model_layout(model)["aliases"]


def _export_final_hf(weights: str, out: str, dtype: str) -> dict:
    """A model=hf run's final weights and config.json as a from_pretrained directory, a tied
    weight written once under the name of the weight it shares."""
    run = os.path.dirname(weights)
    config_json = os.path.join(run, "config.json")
    if not os.path.isfile(config_json):
        raise CheckpointError(f"--format hf writes a transformers model: {run} holds no config.json (a model=hf run "
                              f"writes one beside its {FINAL_WEIGHTS}); export it with --format safetensors")
    with open(config_json) as fh:
        config = {**json.load(fh), "dtype": HF_DTYPES[dtype]}
    aliases = _tied_aliases(config_json)
    target, stats = EXPORT_DTYPES[dtype], {"peak_tensor_bytes": 0}
    os.makedirs(out, exist_ok=True)
    with _open_weights(weights) as st:
        entries = _entries(st, target, _casting(target, stats), skip=aliases)
        with atomic_path(os.path.join(out, FINAL_WEIGHTS)) as tmp:
            info = write_safetensors(tmp, entries, {"format": "pt"})
    _write_json(os.path.join(out, "config.json"), config)
    return {"weights": weights, "out": out, "step": _final_step(weights), "tensors": len(entries), "dtype": dtype,
            "export_bytes": info["bytes"], "tied": aliases, "architectures": config.get("architectures")}


def import_weights(ckpt: str, out_root: str) -> str:
    """Any checkpoint (a native one included) -> a weights-only pieces checkpoint in out_root, as
    the reference strategy on one rank would write it; every pieces-format strategy resumes from
    it with a fresh optimizer state. Returns its path."""
    from zerolab.strategies import reference_strategy

    kind, path = source(ckpt)
    if kind == "weights":
        raise CheckpointError(f"--as-checkpoint writes a zerolab checkpoint from a checkpoint (its layout and "
                              f"strategy); {path} is a run's final weights: export them, or give the run's "
                              f"checkpoints ({HOW_TO_CHECKPOINT})")
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


def _said(r: dict, hf: bool) -> list[str]:
    """What the command prints about an export (before its JSON line)."""
    what = (f"the final weights of {os.path.dirname(r['weights']) or '.'} (step {r['step']})" if "weights" in r
            else f"step {r['step']} from {r['checkpoint']}")
    if hf:
        return [f"exported {what}: {r['tensors']} tensors ({r['dtype']}) and config.json -> {r['out']} "
                "(AutoModelForCausalLM.from_pretrained loads it)"]
    lines = [f"exported {what}: {r['tensors']} tensors ({r['dtype']}) -> {r['out']}"]
    if "weights" in r:
        lines.append(f"size: {r['source_bytes'] / 2**20:.2f} MiB -> {r['export_bytes'] / 2**20:.2f} MiB; every "
                     "state-dict key as the run wrote it (a tied weight under each of its names: loads strict)")
        return lines
    lines += [f"size: checkpoint {r['checkpoint_bytes'] / 2**20:.2f} MiB -> export {r['export_bytes'] / 2**20:.2f} "
              f"MiB ({r['checkpoint_bytes'] / max(r['export_bytes'], 1):.1f}x smaller: no optimizer state, no RNG)",
              f"largest tensor held at once: {r['peak_tensor_bytes']} bytes "
              f"(largest parameter in fp32: {r['largest_fp32_tensor_bytes']} bytes)"]
    if r["tied"]:
        lines.append(f"tied weights written once: {r['tied']} (load with strict=False, or re-tie)")
    return lines


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m zerolab export",
                                description="consolidated weights for inference, from a finished run's directory "
                                            "(its final weights) or from a checkpoint")
    p.add_argument("ckpt", metavar="RUN_OR_CHECKPOINT",
                   help="a finished run's directory (its model.safetensors: no checkpoint needed), that file, a "
                        "checkpoints directory (its newest good step) or one step_* checkpoint (checkpoints exist "
                        "only for runs with checkpoint.every=N)")
    p.add_argument("--out", required=True, help="output .safetensors path (--format hf: a directory)")
    p.add_argument("--dtype", default="fp32", choices=sorted(EXPORT_DTYPES))
    p.add_argument("--format", default="safetensors", choices=["safetensors", "hf"],
                   help="hf: a model=hf run or checkpoint as a directory (model.safetensors + config.json) that "
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
        hf = args.format == "hf"
        r = (export_hf if hf else export)(args.ckpt, args.out, args.dtype)
    except CheckpointError as err:
        print(f"zerolab export: {err}", file=sys.stderr)
        return 1
    print("\n".join(_said(r, hf)))
    print(json.dumps(r))
    return 0
