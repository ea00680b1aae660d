"""zerolab's own ZeRO (Rajbhandari et al. 2019), with HSDP and ZeRO++ (Wang et al. 2023), in one
package. A stage class composes parts; read in this order:

  base.py        ZeroBase: setup composes the parts, then one step (backward, step) drives them;
                 WholeWeights, zero1/2's all-gather of updated chunks into the whole weights
  stages.py      Zero1Strategy, Zero2Strategy: which gradient reduction each stage runs
  stage3.py      Zero3Strategy: the base with zero3's buckets, persistent chunks and units
the parts:
  layout.py      the buckets (packed, padded, flattened) and who shares a shard (HSDP: shard_within=node)
  storage.py     this rank's shard: what holds it (the weights, a copy, the bf16 weights with
                 remainders) and where (its place: the device here, the host in host.py)
  host.py        offload: the host as a place, and every copy between it and the device
  reduce.py      the gradient reduction into the shard (zero1's whole gradients, zero2/3's bucket copies)
  units.py       zero3's weights: units gathered before they run and freed after, with prefetch, hpZ
  checkpoint.py  the shard as name-keyed checkpoint pieces, and the full weights gathered
  quantized.py   ZeRO++'s quantized collectives (qwZ's int8 all-gather, qgZ's int4 all-to-all)
the class side:
  declared.py    what the stages say without an instance: traits, memory prediction, offload modes,
                 config checks
  estimate.py    DeepSpeed's own estimator beside the ledger's offload rows (memory --offload)
  memory.py      the memory model: what each stage holds, predicted from the same packing
                 (zerolab/buckets.py); no runtime module imports it but predict_memory's two calls

The registry (zerolab/strategies/__init__.py) names the stage classes.
"""
