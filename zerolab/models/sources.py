"""The user's models: a Hugging Face transformers causal LM (model=hf) and any importable
nn.Module (model=custom), built so that the strategies see what they see of zerolab's GPT: a
module mapping token ids [B, T] to logits [B, T, V], parameters under the model's own names.

- model=hf: `model.config` is a config.json, a directory holding one, the name of a shape zerolab
  ships (zerolab/models/shapes/NAME.json: published open models' configs, no weights; a local
  path of that name wins), or a hub id looked up in the local Hugging Face cache only
  (huggingface_hub.try_to_load_from_cache: no network call, whatever HF_HUB_OFFLINE says). The
  model is AutoModelForCausalLM.from_config in fp32, with its KV cache off (training keeps no
  cache) and no remote code. transformers is imported here only, and only when such a model is
  resolved: runs of zerolab's own models never import it.
- model=custom: `model.target=pkg.module:Name` is imported from the Python path and called with
  `model.kwargs`; it must return an nn.Module.
- Either may start from `model.weights` (safetensors, keyed by the model's own names); without
  them the model is what its constructor draws from torch's RNG, which the trainer seeds with
  trainer.seed before building, on every rank alike.

Two things are added to the module, neither of which renames anything: a forward hook that
returns `output.logits` when the model returns an object (transformers' CausalLMOutputWithPast),
so that the loss, the strategies' output hooks and the digest all get the logits tensor; and,
for model=hf, float buffers that keep their dtype (keep_buffer_dtypes).
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import re
from typing import Callable, Optional

import torch
import torch.nn as nn

from zerolab.errors import ConfigError
from zerolab.schema import ModelConfig, default_of

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # "gpt2", "org/name"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes")  # NAME.json, sources in README.md


def shipped_shapes() -> list[str]:
    """The names `model.config=NAME` takes for a shape zerolab ships (zerolab/models/shapes/)."""
    return sorted(f[:-len(".json")] for f in os.listdir(SHAPES) if f.endswith(".json"))


def shipped_shape(spec: str) -> Optional[str]:
    """The shipped config.json that `spec` names, or None."""
    path = os.path.join(SHAPES, f"{spec}.json")
    return path if "/" not in spec and os.sep not in spec and os.path.isfile(path) else None


# ---- where a config or weights are --------------------------------------------------------------
def _from_cache(spec: str, filename: str) -> Optional[str]:
    """`filename` of hub repo `spec` from the local Hugging Face cache, or None. Never downloads."""
    if not HUB_ID.match(spec) or spec.endswith((".json", ".safetensors")):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(spec, filename)
    return found if isinstance(found, str) else None


def _not_found(key: str, spec: str, what: str) -> ConfigError:
    if HUB_ID.match(spec) and not spec.endswith((".json", ".safetensors")):  # a name: which names there are
        shipped = (f"; or a shape zerolab ships, by name: {', '.join(shipped_shapes())} (zerolab/models/shapes/)"
                   if key == "model.config" else "")
        from huggingface_hub import constants

        return ConfigError(f"{key}={spec}: no such file or directory, no shipped shape of that name, and no hub id "
                           f"{spec!r} with {what} in the local Hugging Face cache ({constants.HF_HUB_CACHE}). zerolab "
                           f"never downloads: fetch it where there is network (`hf download {spec}`) into that cache, "
                           f"or give a local path{shipped}")
    return ConfigError(f"{key}={spec}: no such file or directory")


def config_file(spec: str) -> str:
    """The config.json that model.config=spec means: the file, the one in the directory, the
    shipped shape of that name, or the cached one of a hub id."""
    if os.path.isfile(spec):
        return spec
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model.config={spec}: the directory holds no config.json (a saved model's "
                              "directory has one; or give the config file itself)")
        return path
    found = shipped_shape(spec) or _from_cache(spec, "config.json")
    if found is None:
        raise _not_found("model.config", spec, "a config.json")
    return found


def weight_files(spec: str) -> list[str]:
    """The safetensors files model.weights=spec means: the file, or a saved-model directory's
    model.safetensors or the shards its model.safetensors.index.json lists (a cached hub id's too)."""
    if os.path.isfile(spec):
        if spec.endswith(".index.json"):
            return _shards(spec)
        return [spec]
    base = spec if os.path.isdir(spec) else None
    for name in WEIGHT_FILES:
        path = os.path.join(base, name) if base else _from_cache(spec, name)
        if path and os.path.isfile(path):
            return _shards(path) if name.endswith(".json") else [path]
    if base:
        raise ConfigError(f"model.weights={spec}: the directory holds neither {' nor '.join(WEIGHT_FILES)}")
    raise _not_found("model.weights", spec, "model.safetensors")


def _shards(index: str) -> list[str]:
    with open(index) as fh:
        weight_map = json.load(fh).get("weight_map", {})
    files = [os.path.join(os.path.dirname(index), f) for f in dict.fromkeys(weight_map.values())]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise ConfigError(f"model.weights={index}: the index lists {'no shards' if not files else 'missing shards'} "
                          f"{', '.join(missing[:3])}")
    return files


# ---- model=hf ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _config_dict(path: str, _mtime: float) -> dict:
    try:
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.config: {path} is not a readable JSON config ({err})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise ConfigError(f"model.config: {path} has no model_type: not a transformers config.json")
    return d


def hf_config(m: ModelConfig, training: bool = True):
    """A fresh transformers config for model=hf (with training=True: no KV cache)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = config_file(m.config)
    d = dict(_config_dict(path, os.path.getmtime(path)))
    kind = d["model_type"]
    if kind not in CONFIG_MAPPING or kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        import transformers

        raise ConfigError(f"model.config={m.config}: model_type {kind!r} is no causal LM that transformers "
                          f"{transformers.__version__} has (zerolab runs no remote code)")
    config = CONFIG_MAPPING[kind].from_dict(d)
    if training:
        config.use_cache = False  # a training forward keeps no KV cache
    return config


def vocab_fix(m: ModelConfig) -> Optional[Callable[[int], str]]:
    """For the data check's refusal of a token the model's vocabulary lacks: need -> the fix that
    gives the model `need` embedding rows, where that is not model.vocab_size (the data check's
    own advice); None where it is. Under model=hf the vocabulary is the transformers config's
    vocab_size (model.vocab_size is refused there: resolve_hf), so that is what it names, in the
    config.json it was read from."""
    if m.kind != "hf":
        return None
    path = config_file(m.config)
    local = os.path.isdir(m.config) or os.path.abspath(path) == os.path.abspath(m.config)
    what = "the shipped shape" if path == shipped_shape(m.config) else "the cached config"
    where = path if local else f"a copy of {path} ({what} {m.config}), given as model.config"

    def fix(need: int) -> str:
        return (f"Under model=hf the vocabulary is the transformers config's vocab_size (model.vocab_size cannot "
                f"change it): set \"vocab_size\": {need} or more in {where}, or give model.config a config whose "
                f"vocab_size is at least {need}; or prepare the data with a tokenizer whose vocabulary is at most "
                f"{m.vocab_size}.")
    return fix


def position_limit(config) -> Optional[int]:
    """The longest window the config's position embeddings cover (None: not stated)."""
    limit = getattr(config, "max_position_embeddings", None)  # GPT-2 maps it to n_positions
    return limit if isinstance(limit, int) and limit > 0 else None


def resolve_hf(m: ModelConfig) -> None:
    """Read model=hf's config: model.vocab_size becomes its vocabulary (one number for the data
    check, the eval baseline and the memory ledger), and the window must fit its positions."""
    config = hf_config(m)
    vocab = config.get_text_config().vocab_size
    if m.vocab_size not in (vocab, default_of("model.vocab_size")):
        raise ConfigError(f"model.vocab_size={m.vocab_size}, but model.config={m.config} has vocab_size {vocab}: "
                          "a model=hf vocabulary is its config's; leave model.vocab_size unset (a larger vocabulary: "
                          f"set \"vocab_size\" in {config_file(m.config)}, or give a config that has it)")
    m.vocab_size = vocab
    limit = position_limit(config.get_text_config())
    if limit is not None and m.block_size > limit:
        raise ConfigError(f"model.block_size={m.block_size} is longer than model.config={m.config} allows "
                          f"(max_position_embeddings {limit}): use model.block_size<={limit}")


def build_hf(m: ModelConfig, device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = hf_config(m)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    keep_buffer_dtypes(model)
    return model


def hf_config_json(m: ModelConfig, dtype: str = "float32") -> dict:
    """config.json as save_pretrained writes it, for the weights zerolab writes (fp32 unless
    exported otherwise): AutoModelForCausalLM.from_pretrained(dir) reads it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = hf_config(m, training=False)
    d = json.loads(config.to_json_string(use_diff=True))
    d["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    d["dtype"] = dtype
    return d


def keep_buffer_dtypes(model: nn.Module) -> None:
    """The model's floating-point buffers keep the dtype (and values) its constructor gave them when
    a strategy casts the model (`model.to(dtype=bf16)`, DeepSpeed's `module.bfloat16()`); moves
    to a device still apply. RoPE's inv_freq is fp32 in a transformers model built in bf16
    (from_config(dtype=bf16) keeps it so); a cast would round it to bf16 under ddp, zero1-3 and
    DeepSpeed but not under FSDP2 (which casts parameters only), and the strategies would compute
    different positions. Non-persistent buffers are in no checkpoint: they are what the model's
    constructor made them, on every rank."""
    for module in model.modules():
        floats = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_floating_point()]
        if floats:
            setattr(module, KEPT_BUFFERS_ATTR, floats)  # read by zerolab.models.place
            module._apply = _keeping(module, module._apply, floats)


KEPT_BUFFERS_ATTR = "_zerolab_kept_buffer_dtypes"


def _keeping(module: nn.Module, apply, names: list[str]):
    def _apply(fn, recurse=True):
        before = {n: module._buffers[n] for n in names}
        out = apply(fn, recurse)
        for n, old in before.items():
            new = module._buffers.get(n)
            if new is not None and new.dtype != old.dtype:
                module._buffers[n] = old.to(new.device)  # the original values, on the new device
        return out
    return _apply


# ---- model=custom ------------------------------------------------------------------------------
def import_target(target: str):
    """The class or factory model.target=pkg.module:Name names (ConfigError if it does not import)."""
    module_name, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # the user's module may raise anything while importing
        raise ConfigError(f"model.target={target}: importing {module_name} failed ({type(err).__name__}: {err}); "
                          "it must be importable from the Python path (PYTHONPATH)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"model.target={target}: {module_name} ({getattr(obj, '__file__', '')}) has no {attr}")
        obj = getattr(obj, part)
    if isinstance(obj, type) and not issubclass(obj, nn.Module):
        raise ConfigError(f"model.target={target} is a class that is not an nn.Module ({obj.__mro__[1].__name__} "
                          "subclass): name a torch.nn.Module subclass or a function returning one")
    if not callable(obj):
        raise ConfigError(f"model.target={target} is a {type(obj).__name__}, not an nn.Module class or factory")
    return obj


def build_custom(m: ModelConfig, device) -> nn.Module:
    make = import_target(m.target)
    with torch.device(device):
        try:
            model = make(**dict(m.kwargs))
        except TypeError as err:
            raise ConfigError(f"model.target={m.target}(**model.kwargs) failed: {err}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.target={m.target} returned a {type(model).__name__}, not an nn.Module")
    return model


# ---- both ----------------------------------------------------------------------------------------
def logits_only(model: nn.Module) -> None:
    """model(ids) returns the logits tensor even where the module returns an object holding them
    (transformers' CausalLMOutputWithPast). A forward hook, registered before any strategy's, so
    the strategies' own hooks on the root see the tensor; no wrapper module, so no name prefix."""
    model.register_forward_hook(_logits)


def _logits(_module, _args, output):
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) and not isinstance(output, torch.Tensor) else None


def _header(files: list[str]) -> dict[str, tuple]:
    from safetensors import safe_open

    shapes = {}
    for f in files:
        try:
            with safe_open(f, framework="pt", device="cpu") as st:
                shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except Exception as err:  # safetensors raises its own error types for a bad header
            raise ConfigError(f"model.weights: {f} is not a readable safetensors file ({err})") from None
    return shapes


def check_weights(model: nn.Module, spec: str) -> None:
    """model.weights fits the model (read from the files' headers; the model may be on meta): every
    state-dict key is there with its shape, except a tied alias (the head that is the embedding,
    which save_pretrained writes once), and nothing else is."""
    saved = _header(weight_files(spec))
    state = model.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    for name, t in state.items():
        names_of.setdefault(id(t), []).append(name)  # a tied weight: two names, one tensor
    missing = [names[0] for names in names_of.values() if not any(n in saved for n in names)]
    unexpected = [k for k in saved if k not in state]
    wrong = [f"{k} {saved[k]} (the model's: {tuple(state[k].shape)})" for k in saved
             if k in state and saved[k] != tuple(state[k].shape)]
    for what, keys in (("lacks", missing), ("holds keys the model has not:", unexpected), ("has shapes", wrong)):
        if keys:
            raise ConfigError(f"model.weights={spec} {what} {', '.join(keys[:5])}"
                              f"{f' and {len(keys) - 5} more' if len(keys) > 5 else ''}: they are keyed by the model's "
                              "own parameter names (model.state_dict(), as save_pretrained writes them)")


def load_weights(model: nn.Module, spec: str) -> None:
    from safetensors.torch import load_file

    check_weights(model, spec)
    state = {}
    for f in weight_files(spec):
        state.update(load_file(f))
    with torch.no_grad():
        model.load_state_dict(state, strict=False)  # a tied alias written once fills both names
