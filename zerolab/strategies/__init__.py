"""Strategy registry: config name -> implementation, imported only when chosen (so a missing
optional dependency such as DeepSpeed only matters to the runs that use it)."""
from __future__ import annotations

import importlib

# Every strategy zerolab knows, in the order `python -m zerolab memory` lists them (its --strategy
# choices and its --sweep-world rows): "module:Class" of its implementation or, for a
# prediction-only entry, of the class holding its memory model.
KNOWN: dict[str, str] = {
    "ddp": "zerolab.strategies.ddp:DDPStrategy",
    "zero1": "zerolab.strategies.zero:Zero1Strategy",
    "zero2": "zerolab.strategies.zero:Zero2Strategy",
    "zero3": "zerolab.strategies.zero3_formula:Zero3Formula",
    "deepspeed": "zerolab.strategies.deepspeed:DeepSpeedStrategy",
    "fsdp": "zerolab.strategies.fsdp:FSDPStrategy",
    "torch_zero": "zerolab.strategies.torch_zero:TorchZeroStrategy",
}
# Predicted, not runnable: zero3's entry prints the ZeRO paper's stage-3 formula until zerolab's
# own ZeRO-3 takes its place in KNOWN (its class then implements predict_memory) and leaves this set.
PREDICTION_ONLY = frozenset({"zero3"})
# What a run may choose as strategy.name.
REGISTRY: dict[str, str] = {name: path for name, path in KNOWN.items() if name not in PREDICTION_ONLY}


def _load(path: str):
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def strategy_class(name: str):
    if name not in REGISTRY:
        raise KeyError(f"unknown strategy {name!r}; known strategies: {', '.join(sorted(REGISTRY))}")
    return _load(REGISTRY[name])


def memory_model(name: str):
    """The class whose `predict_memory` (zerolab.strategies.memory_model.MemoryModel) predicts
    strategy `name`'s bytes per rank; a runnable strategy predicts itself."""
    if name not in KNOWN:
        raise KeyError(f"no memory model for strategy {name!r}; known: {', '.join(KNOWN)}")
    return _load(KNOWN[name])
