"""zerolab's own ZeRO-3: ZeRO-2 plus sharded parameters (Rajbhandari et al. 2019, P_os+g+p), on
ZeroBase (base.py) with zero2's gradient reduction (reduce.py's BucketCopies) and weights that are
gathered unit by unit (units.py: the units, the gather, prefetch and free, hpZ's secondary copy).
What stage 3 changes is that a rank no longer keeps the whole model between uses: only this rank's
chunks persist (storage.py: the shard itself in fp32 and bf16_pure, else a compute-dtype twin of
it, or the bf16 chunks where they hold the master).

The gradient shard is kept in the dtype the reduce-scatter delivers (strategy.reduce_dtype):
with bf16/fp16 mixed precision and reduce_dtype=auto that is 16-bit, the paper's 2Ψ/N, so the
model states are its (2 + 2 + K)Ψ/N (1.9 GB per GPU for 7.5B parameters on 64 GPUs). The step
converts it to fp32 for the optimizer (unscale, clip norm and update all run in fp32), a copy
that lives only during the step. The price: with gradient accumulation the micro-batches are
summed in 16-bit. strategy.reduce_dtype=fp32 reduces and sums in fp32 instead, as zero1/2 always
do (4Ψ/N: 2.1 GB in the example). Without mixed precision nothing changes: the shard is fp32
(bf16 for bf16_pure), the dtype the optimizer updates.

So a micro-batch moves 2Ψ all-gathered (Ψ with reshard_after_forward=false) and Ψ reduce-scattered
elements: 3Ψ(N-1)/N per rank (2Ψ(N-1)/N), the paper's 1.5x of DDP. With gradient accumulation
every micro-batch does this (as zero2, gradients accumulate in the shard; nothing is ever whole).

Across nodes (layout.py, docs/nodes.md). strategy.shard_within=node is HSDP: the chunks
are cut over a node's ranks, the gathers and reduce-scatters run over the node, the gradient
shard is all-reduced across nodes once per step (base.py). ZeRO++ (Wang et al. 2023) keeps the
world-wide chunks: hpZ's secondary copy and qwZ's int8 all-gathers are units.py's, qgZ's int4
reduce-scatter through a two-hop all-to-all quantized.py's.
"""
from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from zerolab.buckets import bucket_cap
from zerolab.schema import Zero3Settings
from zerolab.strategies.base import PRECISION_MODE_SETTINGS, ZEROLAB_STEP_SETTINGS
from zerolab.strategies.zero.base import ZeroBase
from zerolab.strategies.zero.layout import shards_for
from zerolab.strategies.zero.memory import predict_zero3
from zerolab.strategies.zero.quantized import quantized_scatter
from zerolab.strategies.zero.reduce import BucketCopies
from zerolab.strategies.zero.units import Units, make_units, unit_buckets


class Zero3Strategy(ZeroBase):
    name = "zero3"
    # a model without repeated blocks is refused before any rank trains (needs_blocks)
    traits = replace(ZeroBase.traits, settings=Zero3Settings, stage=3, needs_blocks=True,
                     memory_reference=("deepspeed", 3),
                     # its gradient shard is in the reduce dtype already (16-bit under bf16): no gradient-shard setting
                     also_reads=ZEROLAB_STEP_SETTINGS | PRECISION_MODE_SETTINGS)
    shards_params = True  # only the owned chunks of the weights persist
    reduction_class = BucketCopies  # zero2's gradient path: bucket copies, a reduce-scatter per micro-batch
    # checkpoint_format "pieces" (declared.py): the fp32 master shard and optimizer state by parameter
    # name and element range, exactly zero2's, so zero3 reshards to and from ddp/zero1/zero2.

    # ---- the steps of ZeroBase.setup zero3 changes ----------------------------------------------
    def _make_buckets(self, model: nn.Module, param_groups: list[dict]):
        """Buckets packed unit by unit (units.py), one slab per param group."""
        self.units = make_units(model, param_groups, self.cfg.model.blocks)
        cap = bucket_cap(self.settings.bucket_mb, self.precision.compute_dtype.itemsize)
        return unit_buckets(self.units, param_groups, self.layout.shards, cap)

    def _shard_options(self) -> dict:
        """Only this rank's chunks of the weights persist; the gradient shard is in the reduce dtype."""
        return {"persistent": True, "grad_dtype": self.reduce_dtype}

    def _make_reduction(self, scatter=None):
        """qgZ replaces the reduce-scatter by quantized.py's two all-to-all hops."""
        if self.settings.quantize_grads:
            scatter = quantized_scatter(self.layout, self.settings.quant_block, self.comm, self.transient)
        return super()._make_reduction(scatter)

    def _make_weights(self, model: nn.Module) -> Units:
        return Units(self.units, self.buckets, self.shard, layout=self.layout, settings=self.settings, comm=self.comm,
                     transient=self.transient, compute_dtype=self.precision.compute_dtype, device=self.ctx.device)

    # ---- memory prediction (zerolab.memory asks it; Strategy.predict_memory says how) ----------
    @classmethod
    def predict_memory(cls, p, shape, *, world, precision, k, bucket_mb, reduce_dtype, ranks_per_node, settings,
                       mode, **_) -> None:
        """memory.predict_zero3: the persistent chunks and shards packed unit by unit, hpZ's
        secondary copy, the quantized collectives' buffers."""
        predict_zero3(p, shape, shards=shards_for(world, ranks_per_node, settings), per_node=ranks_per_node,
                      precision=precision, k=k, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, settings=settings,
                      mode=mode)

    @classmethod
    def known_cause(cls, cfg: dict) -> str:
        s = cfg.get("strategy", {})
        quantized = [what for key, what in (("quantize_weights", "int8 weight all-gathers (qwZ)"),
                                            ("quantize_grads", "int4 gradient reduce-scatters (qgZ)")) if s.get(key)]
        return (f"ZeRO++'s {' and '.join(quantized)} round what they send: the run follows another trajectory "
                "(docs/nodes.md: the loss band)") if quantized else ""

    @classmethod
    def lossy(cls, cfg: dict):
        """qwZ and qgZ round what they send: the report holds the run within its loss band. qwZ's
        forward computes with int8-rounded weights (L = 127); qgZ rounds only the gradients. A stored
        mode that rounds (declared.py) is named beside them."""
        from zerolab.strategies.base import Lossy
        from zerolab.strategies.zero.quantized import LEVELS

        cause = cls.known_cause(cfg)
        weights = cfg.get("strategy", {}).get("quantize_weights")
        stored = super().lossy(cfg)  # declared.py
        if not cause:
            return stored
        what = cause + (f"; {stored.what}" if stored else "")
        return Lossy("quantized", what, forward_levels=LEVELS[8] if weights else 0)
