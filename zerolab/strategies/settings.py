"""The strategy.* settings: the schema of the `strategy` config group, owned by the strategies.

A strategy that needs a setting of its own adds a field here (with a comment naming who reads
it) and lists it in its class's `uses`; nothing outside zerolab/strategies changes. The config
schema (zerolab.config) embeds this dataclass, so unknown keys are still refused, and
zerolab.config.warn_unused_settings warns once when a set value has no effect under the chosen
strategy (a fast test checks that every field here is used by some strategy)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from omegaconf import MISSING


@dataclass
class StrategyConfig:
    name: str = MISSING  # a key of zerolab.strategies.REGISTRY
    bucket_mb: float = 25.0  # DDP bucket cap / ZeRO reduce-scatter and all-gather bucket size
    find_unused_parameters: bool = False  # ddp: parameters that may get no gradient
    stage: int = 0  # deepspeed ZeRO stage
    overlap_comm: bool = True  # deepspeed: overlap its reductions with backward
    client_optimizer: bool = False  # deepspeed: allow zerolab's LAMB/LARS as a client optimizer
    ds_config_overrides: Dict[str, Any] = field(default_factory=dict)  # deepspeed: merged into its JSON config
    # zero1/2/3: the dtype gradients are reduce-scattered in. auto (= gradient dtype) | fp32; zero3
    # also keeps its gradient shard in it (16-bit under bf16/fp16 with auto)
    reduce_dtype: str = "auto"
    # zero3: free a unit's all-gathered weights after its forward and gather them again for its
    # backward (3Ψ(N-1)/N sent per rank per micro-batch, one unit's weights alive at a time);
    # false keeps them from forward until the unit's backward is done (2Ψ(N-1)/N, more memory).
    reshard_after_forward: bool = True


def check_strategy_settings(s) -> None:
    """Values no strategy can use, refused with the key, the value and the choices."""
    from zerolab.config import _choice, _positive  # lazy: zerolab.config imports this module

    _positive("strategy.bucket_mb", s.bucket_mb)
    _choice("strategy.reduce_dtype", s.reduce_dtype, ("auto", "fp32"))
