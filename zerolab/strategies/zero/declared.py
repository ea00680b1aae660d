"""What zerolab's ZeRO stages say without an instance (the Strategy protocol's class side): their
traits, their memory prediction (memory.py), the offloads they run and DeepSpeed's estimate beside
them (estimate.py), what makes a run lossy, and the settings they refuse before any rank starts.
ZeroBase (base.py), the sharder that runs, derives from it; the stage classes set what differs.
"""
from __future__ import annotations

from zerolab.schema import ZeroSettings
from zerolab.strategies.base import PRECISION_MODE_SETTINGS, ZEROLAB_STEP_SETTINGS, Strategy, Traits, \
    precision_lossy
from zerolab.strategies.zero.estimate import deepspeed_estimate, offload_modes
from zerolab.strategies.zero.host import check_offload
from zerolab.strategies.zero.layout import check_node_settings, shards_for
from zerolab.strategies.zero.memory import predict_zero12


class ZeroDeclared(Strategy):
    """The class side of zerolab's ZeRO; registered only through a stage class."""
    traits = Traits(settings=ZeroSettings, stage=1, sharded_grads=True, zerolab_sharder=True,
                    also_reads=ZEROLAB_STEP_SETTINGS | PRECISION_MODE_SETTINGS | {"precision.grad_shard"})
    checkpoint_format = "pieces"
    shards_params = False  # zero3: only the owned chunks of the weights persist between uses
    keeps_whole_grads = False  # zero1: the whole gradients persist between steps (layout.py keeps them)

    @classmethod
    def predict_memory(cls, p, shape, *, world, precision, k, bucket_mb, reduce_dtype, ranks_per_node, settings,
                       mode, **_) -> None:
        """memory.predict_zero12: the owned chunks' shard, gradient and optimizer state, the
        whole weights (and zero1's whole gradients), measured at the end of a step as memory() sees it."""
        predict_zero12(p, shape, whole_grads=cls.keeps_whole_grads, shards=shards_for(world, ranks_per_node, settings),
                       precision=precision, k=k, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype,
                       hsdp=settings.get("shard_within") == "node" and ranks_per_node < world, mode=mode,
                       offload=bool(settings.get("offload_optimizer")))

    @classmethod
    def offload_modes(cls) -> list[dict]:
        """The strategy.* offload settings this stage runs, none first (python -m zerolab memory --offload)."""
        return offload_modes(cls.shards_params)

    @classmethod
    def offload_reference(cls, shape, world: int, settings: dict):
        """memory_reference's own estimate for these offload settings (estimate.py), or None."""
        return deepspeed_estimate(shape, world, cls.traits.memory_reference[1], settings)

    @classmethod
    def lossy(cls, cfg: dict):
        return precision_lossy(cfg)  # precision.master=bf16, optim_states=bf16, ... (strategies/base.py)

    @classmethod
    def check_config(cls, cfg, world_size: int) -> None:
        super().check_config(cfg, world_size)
        check_node_settings(cfg, world_size, cls.traits.stage)  # shard_within, ZeRO++ (layout.py)
        check_offload(cfg, cls.traits.stage)  # host.py
