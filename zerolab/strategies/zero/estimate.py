"""DeepSpeed's own estimate of ZeRO's model states with and without offload, beside the ledger's
rows of `python -m zerolab memory --offload` (zerolab/memory/offload.py asks the stage classes
through ZeroBase.offload_reference; their memory_reference names DeepSpeed).

The figures are what `estimate_zero2_model_states_mem_needs_all_cold` and
`estimate_zero3_model_states_mem_needs_all_cold` print (deepspeed.runtime.zero), from the helpers
that return them: plain arithmetic that runs on a CPU, for mixed precision with Adam, the host
figure per node multiplied by a 1.5 buffer factor, and for stage 3 four bytes per element of the
largest layer on the device. DeepSpeed's stage 1 has no estimator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DS_BUFFER_FACTOR = 1.5  # the estimators' default additional_buffer_factor


@dataclass(frozen=True)
class Estimate:
    host_per_node: int
    device: int
    source: str  # what gave the figures, for the table's note


def offload_modes(shards_params: bool) -> list[dict]:
    """The strategy.* offload settings zerolab's sharder runs (host.py refuses the others): none,
    the optimizer's, and with sharded parameters (zero3) the parameters' too."""
    modes = [{}, {"offload_optimizer": True}]
    return modes + ([{"offload_optimizer": True, "offload_params": True}] if shards_params else [])


def deepspeed_estimate(shape, gpus: int, stage: int, settings: dict) -> Optional[Estimate]:
    """DeepSpeed's figures for its stage `stage` on one node of `gpus` GPUs with these offload
    settings; None where it has no estimator (stage 1) or needs the largest layer, which a bare
    parameter count does not give (stage 3)."""
    optimizer, params = bool(settings.get("offload_optimizer")), bool(settings.get("offload_params"))
    source = (f"DeepSpeed's estimate_zero{stage}_model_states_mem_needs_all_cold (host figures times its "
              f"{DS_BUFFER_FACTOR} buffer factor)")
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(shape.n_params, gpus, 1, cpu_offload=optimizer,
                                                         additional_buffer_factor=DS_BUFFER_FACTOR)
        return Estimate(cpu, gpu, source)
    if stage != 3 or not shape.exact:
        return None
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    largest = max(math.prod(s) for s in shape.shapes)  # DeepSpeed takes a module's; the largest tensor here
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(shape.n_params, largest, gpus, 1, cpu_offload=optimizer,
                                                        cpu_offload_params=params, zero_init=True,
                                                        additional_buffer_factor=DS_BUFFER_FACTOR)
    return Estimate(cpu, gpu, source + "; 4 bytes per element of the largest layer (here its largest tensor) "
                                      "on the device")
