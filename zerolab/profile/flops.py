"""FLOPs per token of any model, and the device's peak FLOP/s: the two halves of MFU."""
from __future__ import annotations

import math
import statistics
import time
from typing import Optional

import torch
import torch.nn as nn

from zerolab.models import find_blocks


# ---- FLOPs per token --------------------------------------------------------------------------
def hidden_size(model: nn.Module, blocks: Optional[nn.Module] = None) -> int:
    """d: the in_features of the first Linear of the first block, else an embedding's width."""
    for m in (next(iter(blocks)).modules() if blocks is not None and len(blocks) else ()):
        if isinstance(m, nn.Linear):
            return m.in_features
    return next((m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)), 0)


def flops_per_token(model: nn.Module, seq_len: int) -> dict:
    """Model FLOPs per trained token, forward and backward: 6·N + 12·L·d·T (Chowdhery et al. 2022,
    PaLM, appendix B; nanoGPT's estimate_mfu; causal masking not discounted, recomputation not
    counted: model FLOPs, not hardware FLOPs).

    N counts every parameter a matmul uses, once: all parameters except embedding tables that are
    only looked up (a position table, an untied input embedding). A token embedding tied to the
    output head counts, as the head's weight: nanoGPT's count (PaLM leaves every embedding out).
    L is the number of repeated blocks (zerolab.models.find_blocks, the blocks zero3 and fsdp
    work on; 0 for a model without: no attention term), d their width (hidden_size), T the
    sequence length trained on. Any nn.Module: zerolab's models and the user's (model=hf/custom)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) not in linear}
    n = sum(p.numel() for p in model.parameters() if id(p) not in lookup)
    found = find_blocks(model)
    blocks = found.modules if found is not None else None
    layers, width = (len(blocks) if blocks is not None else 0), hidden_size(model, blocks)
    return {"flops_per_token": 6 * n + 12 * layers * width * seq_len, "n": n, "layers": layers, "width": width,
            "seq": seq_len}


# ---- the device's peak ------------------------------------------------------------------------
# Dense (no structured sparsity) peak FLOP/s by device and compute dtype, from NVIDIA's data sheets:
# "NVIDIA H100 Tensor Core GPU" (H100 SXM: BF16/FP16 989.4 TFLOPS, FP32 66.9; H100 PCIe: 756.5 and
# 51.2; the sheet's headline figures, 1979 and 1513, are with sparsity), "NVIDIA H200 Tensor Core GPU"
# (the H100 SXM's figures), "NVIDIA A100 Tensor Core GPU" (BF16/FP16 312, FP32 19.5), "NVIDIA L4"
# (BF16/FP16 121, FP32 30.3). Matched on torch.cuda.get_device_name(), most specific first.
GPU_PEAKS = [("H100 PCIe", "H100 PCIe", 756.5e12, 51.2e12), ("H200", "H200 SXM", 989.4e12, 66.9e12),
             ("H100", "H100 SXM", 989.4e12, 66.9e12), ("A100", "A100", 312e12, 19.5e12), ("L4", "L4", 121e12, 30.3e12)]


def table_peak(device_name: str, dtype: torch.dtype) -> Optional[tuple[float, str]]:
    for key, label, half, single in GPU_PEAKS:
        if key in device_name:
            kind = "fp32" if dtype == torch.float32 else "bf16/fp16"
            return (single if dtype == torch.float32 else half), f"table: NVIDIA {label} {kind} dense (data sheet)"
    return None


def measure_matmul(device: torch.device, dtype: torch.dtype, budget_s: float = 0.1) -> tuple[float, str]:
    """The best FLOP/s of a square matmul in `dtype` on `device`, in about `budget_s`: the largest
    of 512/256/128 (4096 on CUDA) whose first product takes under 20 ms, best of >= 3 products."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = torch.Generator(device=device).manual_seed(0)  # its own: the run's random streams stay as they were
    for n in ((4096,) if device.type == "cuda" else (512, 256, 128)):
        a, b = (torch.randn(n, n, device=device, generator=rng).to(dtype) for _ in range(2))
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        if time.perf_counter() - t0 < 0.02:
            break
    best, reps, start = math.inf, 0, time.perf_counter()
    while reps < 3 or (time.perf_counter() - start < budget_s and reps < 50):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best, reps = min(best, time.perf_counter() - t0), reps + 1
    dt = str(dtype).replace("torch.", "")
    return 2 * n ** 3 / best, (f"measured: {n}x{n} {dt} matmul on {device.type}, best of {reps}, "
                               f"{torch.get_num_threads()} thread(s)")


def peak_flops(configured: float, ctx, dtype: torch.dtype) -> dict:
    """trainer.peak_flops when set; on CUDA the table, when it knows the device; else measured on
    every rank at once (each rank's own device, while the others measure theirs) and averaged."""
    if configured > 0:
        return {"peak_flops": configured, "peak_flops_source": "trainer.peak_flops"}
    if ctx.device.type == "cuda":
        known = table_peak(torch.cuda.get_device_name(ctx.device), dtype)
        if known:
            return {"peak_flops": known[0], "peak_flops_source": known[1]}
    value, how = measure_matmul(ctx.device, dtype)
    per_rank = ctx.gather_objects(value) if ctx.world_size > 1 else [value]
    return {"peak_flops": statistics.mean(per_rank), "peak_flops_source": f"{how}, mean of {len(per_rank)} rank(s)",
            "peak_flops_per_rank": per_rank}

