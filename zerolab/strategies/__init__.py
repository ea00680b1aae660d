"""Strategy registry: config name -> implementation, imported only when chosen (so a missing
optional dependency such as DeepSpeed only matters to the runs that use it)."""
from __future__ import annotations

import importlib

REGISTRY: dict[str, str] = {
    "ddp": "zerolab.strategies.ddp:DDPStrategy",
    "zero1": "zerolab.strategies.zero:Zero1Strategy",
    "zero2": "zerolab.strategies.zero:Zero2Strategy",
    "zero3": "zerolab.strategies.zero3:Zero3Strategy",
    "deepspeed": "zerolab.strategies.deepspeed:DeepSpeedStrategy",
    "torch_zero": "zerolab.strategies.torch_zero:TorchZeroStrategy",
    "fsdp": "zerolab.strategies.fsdp:FSDPStrategy",
}


def strategy_class(name: str):
    if name not in REGISTRY:
        raise KeyError(f"unknown strategy {name!r}; known strategies: {', '.join(sorted(REGISTRY))}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
