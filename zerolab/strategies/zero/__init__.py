"""zerolab's own ZeRO (Rajbhandari et al. 2019), with HSDP and ZeRO++ (Wang et al. 2023), in one
package. Read in this order:

  base.py        ZeroBase: the sharder the stages share (buckets, chunks, reduce-scatters launched in
                 one order, the step on the shard, the all-gather of updated chunks)
  stages.py      Zero1Strategy, Zero2Strategy: what each stage does with the gradients
  stage3.py      Zero3Strategy: zero2 plus sharded parameters, gathered unit by unit
  layout.py      the buckets and who shares a shard (HSDP: strategy.shard_within=node), the groups
  shard.py       this rank's shard of a param group (its pieces, segments, master storage) and
                 its gradient shard
  checkpoint.py  the shard as name-keyed checkpoint pieces, and the full weights gathered
  quantized.py   ZeRO++'s quantized collectives (qwZ's int8 all-gather, qgZ's int4 all-to-all)
  offload.py     ZeRO-Offload's optimizer offload and ZeRO-Infinity's parameter offload: the shard,
                 its gradient and state (and zero3's weight chunks) on the host, the copies both ways
  estimate.py    DeepSpeed's own estimator beside the ledger's offload rows (memory --offload)
  memory.py      the memory model: what each stage holds, predicted from the same packing
                 (zerolab/buckets.py); no runtime module imports it but predict_memory's two calls

The registry (zerolab/strategies/__init__.py) names the stage classes.
"""
