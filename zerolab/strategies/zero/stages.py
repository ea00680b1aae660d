"""zerolab's ZeRO-1 and ZeRO-2: ZeroBase (base.py) with the gradient reduction of each stage
(reduce.py).

  zero1  P_os: the gradients stay whole, views into per-bucket flat buffers (so a bucket is
         reduce-scattered in place), accumulated locally over micro-batches (no_sync) and
         reduce-scattered once, during the last micro-batch's backward; the reduced chunk is
         copied into the gradient shard (WholeGrads).
  zero2  P_os+g: each finished gradient is copied, averaged, into its bucket's send buffer and
         freed; every micro-batch is reduce-scattered and summed into the gradient shard, so no
         full gradient is ever held, only the shard and the buckets in flight (BucketCopies).
"""
from __future__ import annotations

from dataclasses import replace

from zerolab.strategies.zero.base import ZeroBase
from zerolab.strategies.zero.reduce import BucketCopies, WholeGrads


class Zero1Strategy(ZeroBase):
    name = "zero1"
    traits = replace(ZeroBase.traits, stage=1, memory_reference=("deepspeed", 1))  # memory: beside DeepSpeed's
    keeps_whole_grads = True
    reduction_class = WholeGrads


class Zero2Strategy(ZeroBase):
    name = "zero2"
    traits = replace(ZeroBase.traits, stage=2, memory_reference=("deepspeed", 2))
    reduction_class = BucketCopies
