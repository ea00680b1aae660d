"""What each kind of kernel reaches on a GPU: the time model's rates by kind and shape, sourced.

A GPU step is not one fraction of every peak. Its kernels are of three kinds, each at its own
rate (two published, one fitted), and the mix differs between models and between GPU kinds:

- **matmuls** (mm, addmm, bmm, baddbmm) run at the device's maximum achievable matmul FLOP/s
  (MAMF: the best of a brute-force search over shapes, torch.matmul in bf16; Stas Bekman,
  stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
  comparison table": A100 SXM 271.2 of 312 TFLOPS, 86.9 %; H100 SXM 794.5 of 989, 80.3 %, "H200 is
  the same"), times the product's wave efficiency: cuBLAS computes an output tile per SM at a
  time, 256 x 128 elements for a large 16-bit GEMM, so a product of T tiles takes ceil(T / SMs)
  waves and the last one runs partly idle (NVIDIA, "Matrix Multiplication Background User's
  Guide", Deep Learning Performance docs: tile and wave quantization; SMs: 108 on the A100, 132
  on the H100 and H200 SXM, NVIDIA's A100 and H100 architecture whitepapers). MAMF's best shape
  has no such loss, so the efficiency multiplies it;
- **attention** (SDPA's flash kernels, forward and backward: FlashAttention-2 in torch) at
  FlashAttention-2's published share of the peak: on the A100 50-73 % (Dao 2023,
  "FlashAttention-2", arXiv:2307.08691: the forward reaches the top of that range at long
  sequences, the backward is the slower pass: 73 % and 50 % here); on the H100 35 % (Shah et al.
  2024, "FlashAttention-3", arXiv:2407.08608: FlashAttention-2 "achiev[es] only 35 % utilization on
  the H100"; its Figure 5 puts its causal forward at 298-335 TFLOP/s for sequences of 2k-16k, head
  dimension 128): written for the A100, it does not use the H100's asynchronous tensor-core
  instructions. This, not the matmuls, is why an H100 step reaches a smaller share of its peak
  than an A100 step: an H100 has 3.2x the A100's matmul peak but 1.6x its memory bandwidth and
  attention at half the share;
- **everything else** (elementwise ops, norms, softmax, copies, the optimizer's foreach kernels)
  is memory-bound: its bytes (zerolab.predict.ops: each input read once, each output written
  once) at MEMORY_SHARE of the memory bandwidth. This is the one figure fitted, on one published
  run (FITTED_ON; bench/predict_gpu.py --fit), and every other run is a prediction. It is about
  half of what one streaming kernel reaches (a read kernel on an A100 80GB SXM at 1.80 of
  2.04 TB/s, 88 %: NVIDIA developer forums, "Trouble to reach peak bandwidth of A100", 2025):
  an eager step's memory-bound kernels are short, strided (transposes, RoPE's halves), read
  some inputs twice (softmax and norms reduce, then scale), scatter (the embedding's backward)
  and share the memory with NCCL's kernels; and the launch gaps between many small kernels, for
  which no published figure for eager PyTorch was found to cite, are paid here too.

Matmuls and attention also take at least their bytes at the memory rate (the roofline). A device
without an entry in KERNELS (a `--hardware` entry added by hand) is priced as before: its
`achievable` share of every peak. Communication is priced by zerolab.predict.topology, on each
link's bandwidth times the device's `achievable` factor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MAMF = "stas00/ml-engineering compute/accelerator/README.md, Maximum Achievable Matmul FLOPS table"
FA2_A100 = "Dao 2023, FlashAttention-2 (arXiv:2307.08691): 50-73 % of the A100's peak"
FA2_H100 = "Shah et al. 2024, FlashAttention-3 (arXiv:2407.08608): FlashAttention-2 at 35 % of the H100's peak"
HBM = "memory-bound kernels at a share fitted on one published run"
TILE = (256, 128)  # cuBLAS's output tile for large 16-bit GEMMs (NVIDIA's Matrix Multiplication Background guide)
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})
# The share of the memory bandwidth an eager step's memory-bound kernels reach, fitted by
# bisection on FITTED_ON (bench/predict_gpu.py --fit; bench/RESULTS.md has the fit).
MEMORY_SHARE = 0.465
FITTED_ON = "llama3-8b-a100-layer"


@dataclass(frozen=True)
class Kernels:
    """One GPU kind's achievable shares of its data-sheet peaks, by kind of kernel."""
    matmul: float  # MAMF / peak
    sms: int
    attention_forward: float  # share of the 16-bit peak
    attention_backward: float
    source: str
    memory: float = MEMORY_SHARE  # share of the memory bandwidth (fitted: the module docstring)

    def describe(self) -> str:
        return (f"matmuls at {100 * self.matmul:.1f} % of peak (MAMF) x wave efficiency ({self.sms} SMs, "
                f"{TILE[0]}x{TILE[1]} tiles); attention at {100 * self.attention_forward:g} % forward, "
                f"{100 * self.attention_backward:g} % backward; other kernels at {100 * self.memory:.1f} % of "
                f"memory bandwidth, fitted on {FITTED_ON} ({self.source})")


_A100 = Kernels(271.2 / 312, 108, 0.73, 0.50, f"{MAMF}: A100 SXM 271.2 TFLOPS; {FA2_A100}; {HBM}")
_H100 = Kernels(794.5 / 989, 132, 0.35, 0.35, f"{MAMF}: H100 SXM 794.5 TFLOPS; {FA2_H100}; {HBM}")
# h100-hbm2e: the 500 W part's peak is not published; the SXM's peak and shares are used (hardware.py)
KERNELS = {"a100": _A100, "h100": _H100, "h200": _H100, "h100-hbm2e": _H100}


def wave_efficiency(dims: tuple, sms: int) -> float:
    """The share of a GEMM's scheduled tile work that is useful: a (batch, m, n, k) product in
    TILE-sized output tiles (either orientation, the better), ceil(tiles / sms) waves."""
    if not dims:
        return 1.0
    batch, m, n = dims[0], dims[1], dims[2]
    best = 0.0
    for tm, tn in (TILE, TILE[::-1]):
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        best = max(best, batch * m * n / (tm * tn) / (math.ceil(tiles / sms) * sms))
    return best


def kernel_seconds(op, dev, k: Kernels) -> float:
    """One recorded op (zerolab.predict.record.Op) on a GPU of kind `k`: its roofline at that
    kind's achievable rates (module docstring)."""
    memory = op.bytes / (dev.memory_bandwidth * k.memory)
    compute = 0.0
    if op.flops:
        peak = dev.peak(op.dtype)
        if "attention" in op.name:
            share = k.attention_backward if "backward" in op.name else k.attention_forward
            compute = op.flops / (peak * share)
        else:
            wave = wave_efficiency(op.dims, k.sms) if op.name in MATMULS else 1.0
            compute = op.flops / (peak * k.matmul * wave)
    return max(compute, memory)
