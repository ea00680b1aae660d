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


def names_where(**attributes) -> list[str]:
    """Registered strategy names whose class has every given class attribute value, in registry
    order, e.g. names_where(checkpoint_format="pieces"). Imports every strategy module (none of
    them imports an optional dependency at module level)."""
    return [n for n in REGISTRY if all(getattr(strategy_class(n), k) == v for k, v in attributes.items())]


def all_names() -> str:
    """Every registered strategy, comma-separated in registry order: the default of `make run`
    and bench/compare.py, so a new strategy joins the comparison by registering."""
    return ",".join(REGISTRY)


def reference_strategy() -> str:
    """The strategy others are measured against (its class says `reference = True`)."""
    found = names_where(reference=True)
    if len(found) != 1:
        raise RuntimeError(f"exactly one strategy must declare reference = True, found {found}")
    return found[0]
