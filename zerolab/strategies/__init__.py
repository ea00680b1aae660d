"""Strategy registry: config name -> implementation, imported only when chosen (so a missing
optional dependency such as DeepSpeed only matters to the runs that use it)."""
from __future__ import annotations

import importlib

# Every strategy zerolab knows, in the order `python -m zerolab memory` lists them (its --strategy
# choices and its --sweep-world rows): "module:Class" of its implementation, which also predicts
# its memory (zerolab.strategies.memory_protocol).
REGISTRY: dict[str, str] = {
    "ddp": "zerolab.strategies.ddp:DDPStrategy",
    "zero1": "zerolab.strategies.zero:Zero1Strategy",
    "zero2": "zerolab.strategies.zero:Zero2Strategy",
    "zero3": "zerolab.strategies.zero3:Zero3Strategy",
    "deepspeed": "zerolab.strategies.deepspeed:DeepSpeedStrategy",
    "fsdp": "zerolab.strategies.fsdp:FSDPStrategy",
    "torch_zero": "zerolab.strategies.torch_zero:TorchZeroStrategy",
}
KNOWN = REGISTRY  # the name the memory code reads it by


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
