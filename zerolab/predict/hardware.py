"""Hardware as data: devices and links, each figure with its source.

A device's figures are its data sheet's peaks (dense, no structured sparsity); a link's bandwidth
is per GPU and per direction. What a GPU's kernels reach of those peaks, by kind of kernel, is
zerolab.predict.gpu's (matmuls by shape, attention, memory-bound ops). `achievable` is the share of
its bandwidth a link reaches (every GPU's, GPU_ACHIEVABLE), and the share of every peak for a
device without kernel rates (one made by hand). The `cpu` entry is this machine's, measured by
`python -m zerolab.predict calibrate` (zerolab.predict.calibrate), with its own figures per number
of ranks sharing the host.

Latency per collective and per ring step are NCCL's tuning constants for its Simple protocol
(NVIDIA/nccl src/graph/tuning.cc, baseLat and hwLat, as torch._inductor.comm_analysis ports them):
8.4 us per collective, 3.4 us per step over NVLink, 5.7 over PCIe, 14.0 across the network.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from zerolab.errors import ConfigError

# The share of a link's bandwidth NCCL reaches, and of every peak for a GPU without kernel rates:
# the one factor of the earlier model, fitted by bisection on torchtitan's Llama 3 8B on 64 A100
# 80GB (bench/RESULTS.md, 2026-12-04). Communication is hidden behind compute in every published
# run of bench/predict_gpu.py (its exposed share is under 2 % of the step), so they do not test it.
GPU_ACHIEVABLE = 0.68


@dataclass(frozen=True)
class Device:
    name: str
    label: str
    flops: dict  # compute dtype ("fp32", "bf16", "fp16") -> peak dense FLOP/s
    memory_bandwidth: float  # bytes/s
    memory: int  # bytes
    source: str
    intra: str = ""  # default links: inside a node, and across nodes (per GPU)
    inter: str = ""
    achievable: float = GPU_ACHIEVABLE
    op_overhead_s: float = 0.0  # per kernel launched; 0 on a GPU (the host runs ahead of the device)
    host_sync: bool = False  # a CPU: one timeline, waits block the host (no streams)
    gloo: dict = field(default_factory=dict)  # cpu: calibrated collectives, kind -> group size -> latency, bandwidth
    kernel_flops: dict = field(default_factory=dict)  # cpu: op name -> measured FLOP/s where it is not a matmul's
    kernel_bandwidth: dict = field(default_factory=dict)  # cpu: op name -> measured bytes/s where it is not memory's
    meeting_s: float = 0.0  # cpu: what a collective adds because the ranks must meet for it (calibrate.meeting_cost)
    overlap_rate: float = 1.0  # cpu: the speed of compute and of a collective while both run (overlap_rate())
    queued_s: float = 0.0  # cpu: what a collective adds behind others in flight (calibrate.queued_cost)
    kernel_table: dict = field(default_factory=dict)  # cpu: op name -> its measured ops (zerolab.predict.kernels)
    host_s_per_kernel: float = 0.0  # cpu: host time beyond the measured ops, per kernel (kernels.measure_table)
    host_s_per_kernel_step: float = 0.0  # cpu: the same after the backward alone (prices the optimizer phase)

    def peak(self, dtype: str) -> float:
        return self.flops.get(dtype) or self.flops["fp32"]


@dataclass(frozen=True)
class Link:
    name: str
    label: str
    bandwidth: float  # bytes/s per GPU, each direction
    latency_s: float  # per ring step
    source: str


NVIDIA = "NVIDIA data sheet"
DEVICES = {d.name: d for d in (
    Device("a100", "NVIDIA A100 80GB SXM", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 2039e9, 80 * 10**9,
           f"{NVIDIA} 'NVIDIA A100 Tensor Core GPU' (2021): BF16/FP16 312 TFLOPS dense, FP32 19.5, HBM2e 2,039 GB/s",
           "nvlink3", "ib-hdr"),
    Device("h100", "NVIDIA H100 SXM5 80GB", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}, 3.35e12,
           80 * 10**9, f"{NVIDIA} 'NVIDIA H100 Tensor Core GPU' (2023): BF16/FP16 989.4 TFLOPS dense (1,979 with "
           "sparsity), FP32 66.9, HBM3 3.35 TB/s", "nvlink4", "ib-ndr"),
    Device("h200", "NVIDIA H200 SXM 141GB", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}, 4.8e12,
           141 * 10**9, f"{NVIDIA} 'NVIDIA H200 Tensor Core GPU' (2024): H100 SXM's compute, HBM3e 4.8 TB/s, 141 GB",
           "nvlink4", "ib-ndr"),
    Device("h100-hbm2e", "NVIDIA H100 96GB HBM2e at 500 W (Meta's Grand Teton)",
           {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}, 2.4e12, 96 * 10**9,
           "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96GB HBM2e, 2.4 TB/s, 400 Gb/s RDMA per GPU, "
           "500 W; its peak FLOP/s is not published ('between SXM and NVL'): the H100 SXM's is used, as torchtitan's "
           "MFU does", "nvlink4", "roce-400"),
    # The 24 GB card of a one-GPU job (README's 13B-with-offload plan). No kernel rates of its own
    # (zerolab.predict.gpu.KERNELS): priced at `achievable` of each peak. Training accumulates in
    # fp32, and on this GeForce part fp32 accumulation runs at half the fp16-accumulate rate.
    Device("rtx4090", "NVIDIA GeForce RTX 4090 24GB", {"bf16": 165.2e12, "fp16": 165.2e12, "fp32": 82.6e12},
           1008e9, 24 * 10**9, "NVIDIA 'NVIDIA Ada GPU Architecture' whitepaper (2023), Appendix A, GeForce RTX "
           "4090: BF16/FP16 tensor 165.2 TFLOPS dense with FP32 accumulate (330.3 with FP16 accumulate), FP32 82.6, "
           "GDDR6X 1,008 GB/s, 24 GB, PCIe 4.0 x16, no NVLink", "pcie4", "eth-100"),
)}

LINKS = {k.name: k for k in (
    Link("nvlink3", "NVLink 3 (A100)", 300e9, 3.4e-6, f"{NVIDIA} A100: 600 GB/s per GPU, both directions"),
    Link("nvlink4", "NVLink 4 (H100/H200 SXM)", 450e9, 3.4e-6, f"{NVIDIA} H100: 900 GB/s per GPU, both directions"),
    Link("pcie4", "PCIe 4.0 x16", 31.5e9, 5.7e-6, "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b"),
    Link("pcie5", "PCIe 5.0 x16", 63e9, 5.7e-6, "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b"),
    Link("ib-hdr", "InfiniBand HDR, 200 Gb/s per GPU", 25e9, 14.0e-6, "InfiniBand HDR: 200 Gb/s per port"),
    Link("ib-ndr", "InfiniBand NDR, 400 Gb/s per GPU", 50e9, 14.0e-6, "InfiniBand NDR: 400 Gb/s per port"),
    Link("roce-400", "RoCE, 400 Gb/s per GPU", 50e9, 14.0e-6, "400 Gb Ethernet (RDMA) per GPU"),
    Link("eth-100", "Ethernet, 100 Gb/s per GPU", 12.5e9, 14.0e-6, "100 Gb Ethernet per GPU"),
)}
BASE_LATENCY_S = 8.4e-6  # per collective (module docstring)
FUSED_ADAM_KERNELS = ("_fused_adamw_", "_fused_adam_")  # one kernel (Adam's decay is a flag)
ATTENTION_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_flash_attention_for_cpu_backward")

# `--hw KEY=VALUE`: what a command line may change, and where it lands
OVERRIDES = {"bf16_flops": "flops.bf16", "fp16_flops": "flops.fp16", "fp32_flops": "flops.fp32",
             "memory_bandwidth": "memory_bandwidth", "memory": "memory", "achievable": "achievable",
             "op_overhead_us": "op_overhead_s", "intra_bandwidth": "intra.bandwidth",
             "inter_bandwidth": "inter.bandwidth", "intra_latency_us": "intra.latency_s",
             "inter_latency_us": "inter.latency_s"}


def calibration_path() -> str:
    """Where `python -m zerolab.predict calibrate` writes this machine's figures (and `cpu` reads them):
    ZEROLAB_CPU_CALIBRATION, else cpu-calibration.json in zerolab's cache (ZEROLAB_CACHE, as
    run.cache_dir, else ~/.cache/zerolab)."""
    cache = os.environ.get("ZEROLAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zerolab")
    return os.environ.get("ZEROLAB_CPU_CALIBRATION", os.path.join(cache, "cpu-calibration.json"))


def cpu_device(ranks: int, path: str = "") -> Device:
    """This machine as `ranks` ranks sharing it see it, from the calibration file (the entry measured
    with that many ranks running at once, else the nearest below)."""
    path = path or calibration_path()
    if not os.path.exists(path):
        raise ConfigError(f"--hardware cpu needs this machine's figures: run `python -m zerolab.predict calibrate` "
                          f"first (it writes {path}; ZEROLAB_CPU_CALIBRATION names another file)")
    with open(path) as f:
        cal = json.load(f)
    have = sorted(int(n) for n in cal["ranks"])
    n = max([k for k in have if k <= ranks] or have[:1])
    c = cal["ranks"][str(n)]
    return Device("cpu", f"this machine's CPU, {n} rank(s) at once ({cal.get('machine', '')})",
                  {"fp32": c["matmul_fp32"], "bf16": c.get("matmul_bf16", c["matmul_fp32"])},
                  c["memory_bandwidth"], cal.get("memory", 0),
                  f"measured here by python -m zerolab.predict calibrate, {cal.get('date', '?')} ({path})",
                  achievable=1.0, op_overhead_s=c["op_overhead_s"], host_sync=True, gloo=c.get("gloo", {}),
                  kernel_flops={name: c["attention_fp32"] for name in ATTENTION_KERNELS},
                  kernel_bandwidth={name: c["fused_adamw_bandwidth"] for name in FUSED_ADAM_KERNELS
                                    if "fused_adamw_bandwidth" in c},  # (an older calibration file lacks it)
                  meeting_s=c.get("meeting_s", 0.0), queued_s=c.get("queued_s", 0.0), kernel_table=c.get("kernels", {}),
                  host_s_per_kernel=c.get("host_s_per_kernel", 0.0),  # (an older calibration file lacks both)
                  host_s_per_kernel_step=c.get("host_s_per_kernel_step", c.get("host_s_per_kernel", 0.0)),
                  overlap_rate=overlap_rate(int(cal.get("cores") or os.cpu_count() or 1), ranks))


def overlap_rate(cores: int, ranks: int) -> float:
    """How fast compute and a collective each run, against running alone, while both run on a host
    of `cores` cores shared by `ranks` ranks. Each rank computes on one thread (OMP_NUM_THREADS=1)
    and gloo moves and sums a collective's bytes on a thread of its own, so while a collective is in
    flight 2 x ranks threads want the cores: each gets min(1, cores / (2 ranks)) of one, against
    min(1, cores / ranks) with compute alone (what the calibration measured). 2 ranks on 2 cores: 1/2,
    the collective is not hidden but shares the cores; 2 ranks on 4 cores: 1, free overlap."""
    alone, both = min(1.0, cores / ranks), min(1.0, cores / (2 * ranks))
    return both / alone


def device(name: str, ranks_per_host: int = 1) -> Device:
    if name == "cpu":
        return cpu_device(ranks_per_host)
    if name not in DEVICES:
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join([*DEVICES, 'cpu'])} "
                          f"(or give the figures with --hw, e.g. --hardware h100 --hw memory_bandwidth=2.4e12)")
    return DEVICES[name]


def link(name: str) -> Link:
    if name not in LINKS:
        raise ConfigError(f"unknown link {name!r}; known: {', '.join(LINKS)}")
    return LINKS[name]


def apply_overrides(dev: Device, intra: Link, inter: Link, items: list[str]) -> tuple[Device, Link, Link]:
    """`KEY=VALUE` overrides (OVERRIDES' keys) on a device and its links."""
    for item in items:
        key, _, value = item.partition("=")
        if key not in OVERRIDES or not value:
            raise ConfigError(f"--hw {item!r}: give KEY=VALUE with KEY one of {', '.join(OVERRIDES)}")
        try:
            number = float(value) * (1e-6 if key.endswith("_us") else 1.0)
        except ValueError:
            raise ConfigError(f"--hw {item!r}: {value!r} is not a number") from None
        if number < 0 or (key == "achievable" and not 0 < number <= 1):
            raise ConfigError(f"--hw {item!r}: must be positive (achievable: in (0, 1])")
        target, _, attr = OVERRIDES[key].partition(".")
        if target == "flops":
            dev = dataclasses.replace(dev, flops={**dev.flops, attr: number})
        elif target in ("intra", "inter"):
            changed = dataclasses.replace(intra if target == "intra" else inter, **{attr: number})
            intra, inter = (changed, inter) if target == "intra" else (intra, changed)
        else:
            dev = dataclasses.replace(dev, **{target: int(number) if target == "memory" else number})
    return dev, intra, inter
