"""`python -m zerolab memory --offload`: the device and the host bytes of zerolab's ZeRO in every
offload mode (strategy.offload_optimizer: ZeRO-Offload, Ren et al., USENIX ATC 2021; strategy.offload_params:
ZeRO-Infinity's parameter offload, Rajbhandari et al., SC 2021), beside DeepSpeed's own estimator.

DeepSpeed's figures are what `estimate_zero2_model_states_mem_needs_all_cold` and
`estimate_zero3_model_states_mem_needs_all_cold` print (their helpers, which return the numbers:
plain arithmetic, run on a CPU): mixed precision with Adam, a host figure per node multiplied by a
1.5 buffer factor, and for stage 3 four bytes per element of the largest layer on the device.
zerolab's figures are the ledger's, exact for its own packing (padding included), no factor.
"""
from __future__ import annotations

from zerolab.accounting import GB, ModelShape, host_per_node
from zerolab.memory.prediction import predict

# (label, strategy, offload settings, DeepSpeed's (stage, offload_optimizer, offload_param) or None)
MODES = (("zero1", "zero1", {}, None),
         ("zero1 +opt", "zero1", {"offload_optimizer": True}, None),
         ("zero2", "zero2", {}, (2, False, False)),
         ("zero2 +opt", "zero2", {"offload_optimizer": True}, (2, True, False)),
         ("zero3", "zero3", {}, (3, False, False)),
         ("zero3 +opt", "zero3", {"offload_optimizer": True}, (3, True, False)),
         ("zero3 +opt +params", "zero3", {"offload_optimizer": True, "offload_params": True}, (3, True, True)))
DS_BUFFER_FACTOR = 1.5  # DeepSpeed's estimators' default additional_buffer_factor


def deepspeed_estimate(n_params: int, largest_layer: int, gpus: int, stage: int, optimizer: bool,
                       params: bool) -> tuple[int, int]:
    """(host bytes per node, device bytes per GPU) as DeepSpeed's estimator gives them, one node of
    `gpus` GPUs; None for the largest layer where it is unknown (a bare parameter count)."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(n_params, gpus, 1, cpu_offload=optimizer,
                                                     additional_buffer_factor=DS_BUFFER_FACTOR)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(n_params, largest_layer, gpus, 1, cpu_offload=optimizer,
                                                        cpu_offload_params=params, zero_init=True,
                                                        additional_buffer_factor=DS_BUFFER_FACTOR)
    return cpu, gpu


def offload_rows(shape: ModelShape, world: int, precision: str, optim: str, bucket_mb: float) -> list[dict]:
    """One row per offload mode: the ledger's device and host bytes on rank 0 and the host bytes of
    its node (every rank on one node), and DeepSpeed's estimate where it has the mode."""
    largest = max(n for n in (_numel(s) for s in shape.shapes)) if shape.exact else 0
    rows = []
    for label, strategy, settings, ds in MODES:
        pred = predict(shape, strategy, world, precision, optim, bucket_mb=bucket_mb, settings=settings)
        by = pred.by_place()
        row = {"mode": label, "device_bytes": by["device"]["total"], "host_bytes": by["host"]["total"],
               "host_per_node_bytes": host_per_node([pred] * world, world)[0]}
        if ds is not None and (ds[0] == 2 or largest):
            row["deepspeed_host_per_node_bytes"], row["deepspeed_device_bytes"] = \
                deepspeed_estimate(shape.n_params, largest, world, *ds)
        rows.append(row)
    return rows


def _numel(shape: tuple) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def format_offload(shape: ModelShape, world: int, precision: str, optim: str, bucket_mb: float) -> str:
    rows = offload_rows(shape, world, precision, optim, bucket_mb)
    gb = lambda v: f"{v / GB:>10.3f}" if v is not None else f"{'-':>10}"
    lines = [f"{shape.name}: {shape.n_params:,} parameters | N = {world} on one node | {precision} | {optim} | "
             "GB, model states and buffers (the ledger), beside DeepSpeed's estimator", "",
             f"{'':<20}{'zerolab':>30}{'DeepSpeed':>22}",
             f"{'mode':<20}{'device':>10}{'host':>10}{'host/node':>10}{'device':>11}{'host/node':>11}"]
    for r in rows:
        lines.append(f"{r['mode']:<20}{gb(r['device_bytes'])}{gb(r['host_bytes'])}{gb(r['host_per_node_bytes'])} "
                     f"{gb(r.get('deepspeed_device_bytes'))} {gb(r.get('deepspeed_host_per_node_bytes'))}")
    lines += ["", "device and host: per rank; host/node: the node's ranks together (they share its memory).",
              "+opt: strategy.offload_optimizer=true (ZeRO-Offload: master, optimizer state, gradient shard and the "
              "step on the host); +params: strategy.offload_params=true (zero3's weight shards on the host).",
              f"DeepSpeed: its estimator's arithmetic (mixed precision, Adam), host figures times its "
              f"{DS_BUFFER_FACTOR} buffer factor, stage 3's device figure with 4 bytes per element of the largest "
              "layer (here the largest tensor); '-' where it has no such mode or the largest layer is unknown. "
              "Neither counts activations or transients."]
    return "\n".join(lines)
