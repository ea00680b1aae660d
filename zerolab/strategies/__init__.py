"""Strategy registry: config name -> implementation, imported only when chosen (so a missing
optional dependency such as DeepSpeed only matters to the runs that use it). Everything outside
strategies/ that lists strategies asks here (the `make run` default, the memory CLI, tests)."""
from __future__ import annotations

import importlib

# Every strategy zerolab knows, in the order `python -m zerolab memory` lists them (its --strategy
# choices and its --sweep-world rows): "module:Class" of its implementation, which also predicts
# its memory (Strategy.predict_memory).
REGISTRY: dict[str, str] = {
    "ddp": "zerolab.strategies.ddp:DDPStrategy",
    "zero1": "zerolab.strategies.zero.stages:Zero1Strategy",
    "zero2": "zerolab.strategies.zero.stages:Zero2Strategy",
    "zero3": "zerolab.strategies.zero.stage3:Zero3Strategy",
    "deepspeed": "zerolab.strategies.deepspeed:DeepSpeedStrategy",
    "fsdp": "zerolab.strategies.fsdp:FSDPStrategy",
    "torch_zero": "zerolab.strategies.torch_zero:TorchZeroStrategy",
}


def _load(path: str):
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def strategy_class(name: str):
    if name not in REGISTRY:
        raise KeyError(f"unknown strategy {name!r}; known strategies: {', '.join(sorted(REGISTRY))}")
    return _load(REGISTRY[name])


def _declared(cls, key: str):
    """A strategy class's declaration `key`: a field of its traits, else a class attribute."""
    return getattr(cls.traits, key) if hasattr(cls.traits, key) else getattr(cls, key)


def names_where(**declared) -> list[str]:
    """Registered strategy names whose class declares every given value, in registry order, e.g.
    names_where(checkpoint_format="pieces") or names_where(zerolab_sharder=True) (a Traits field).
    Imports every strategy module (none of them imports an optional dependency at module level)."""
    return [n for n in REGISTRY if all(_declared(strategy_class(n), k) == v for k, v in declared.items())]


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
