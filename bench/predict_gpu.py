"""The time model against published GPU runs (docs/predict.md, bench/RESULTS.md): torchtitan's Llama 3 8B.

  .venv/bin/python bench/predict_gpu.py [--fit a100|h100]

Two runs from torchtitan's docs (pytorch/torchtitan), mapped onto zerolab's settings:

  a100  torchtitan docs/performance.md (2024-04-22; revised to 2,904 on 2024-04-24): Llama 3 8B, FSDP2 on 64 A100
        80GB, local batch 1, sequence 8192, "selective layer" checkpointing (torchtitan's option 2:
        every second block recomputed) -> strategy=fsdp, precision=bf16 (bf16 weights, fp32
        reduce: torchtitan's defaults), data.micro_batch=1, model.activation_checkpointing=every_k
        with k=2; 8 nodes of 8 (NVLink 3 inside, one HDR InfiniBand NIC per GPU: a DGX A100's; the
        page does not say): 2,876 tokens/s per GPU.
  h100  benchmarks/llama3_h100_202412_torchtitan.md (Table 1, "FSDP", no torch.compile): Llama 3.1 8B,
        FSDP2 on 8 H100 (96GB HBM2e, 2.4 TB/s, 500 W: the h100-hbm2e entry) in one node, local batch 2,
        sequence 8192, selective op checkpointing (recompute every op but SDPA and every second
        matmul) -> the same with data.micro_batch=2 and no checkpointing: zerolab has no op-level
        policy; the recompute it leaves out is 3 of each block's 7 matmuls' forward (+8.4 % of the
        model FLOPs) and the elementwise ops: 5,762 tokens/s per GPU.

The shared factor (hardware.GPU_ACHIEVABLE) is fitted on `--fit` (default a100: the run whose
settings map exactly) by bisection, and the other run is predicted with it. Also printed: the h100
prediction with the H100 NVL's peak (835 TFLOP/s bf16: the page says the 500 W part's peak is between
the NVL's and the SXM's), and with every_k=2 as an upper bound of the op policy's recompute.
Takes about 3 minutes (the rehearsals of 8B at sequence 8192, on fake tensors).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerolab.predict.hardware import DEVICES, GPU_ACHIEVABLE, LINKS  # noqa: E402
from zerolab.predict.model import predict  # noqa: E402
from zerolab.predict.record import Op, StepRecord  # noqa: E402
from zerolab.predict.topology import Network  # noqa: E402
from zerolab.rehearsal import rehearse  # noqa: E402

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False}  # Meta-Llama-3-8B's config.json
RUNS = {  # name: (device, world, published tokens/s per GPU, overrides)
    "a100": ("a100", 64, 2876, ["data.micro_batch=1", "model.activation_checkpointing=every_k",
                                "model.checkpoint_every_k=2"]),
    "h100": ("h100-hbm2e", 8, 5762, ["data.micro_batch=2", "model.activation_checkpointing=blocks"]),
}
SAVED_BY_OP_POLICY = {"_scaled_dot_product_flash_attention_for_cpu"}  # and every odd-numbered mm of a block


def op_policy(record: StepRecord) -> StepRecord:
    """torchtitan's selective op checkpointing applied to a record of checkpointed blocks: of each
    block's recomputation (the ops its modules issue during backward), the ops the policy saves
    in forward instead (SDPA, and the 1st, 3rd, 5th and 7th matmul: torchtitan's _save_list and its
    "every second mm" rule) are not run again."""
    kept, run_block, mm = [], None, 0
    for e in record.events:
        recomputed = isinstance(e, Op) and e.phase == "backward" and e.block >= 0
        if recomputed:
            if e.block != run_block:
                run_block, mm = e.block, 0
            if e.name == "mm":
                mm += 1
                if mm % 2 == 1:
                    continue
            elif e.name in SAVED_BY_OP_POLICY:
                continue
        kept.append(e)
    return dataclasses.replace(record, events=kept)
H100_NVL_BF16 = 835e12  # NVIDIA H100 NVL data sheet: 1,671 TFLOPS bf16 with sparsity, per GPU


def rehearsed(config: Path, world: int, extra: list[str]):
    job = ["model=hf", f"model.config={config}", "model.block_size=8192", "strategy=fsdp", "precision=bf16",
           "optim=adamw", *extra]
    return rehearse(job, world=world, record=True)


def tokens(r, dev, achievable: float, world: int) -> float:
    dev = dataclasses.replace(dev, achievable=achievable)
    topo = Network(world, 8, LINKS[dev.intra], LINKS[dev.inter], dev)
    return predict(r.record, topo, r.tokens_per_rank, r.flops_per_token, "bf16").tokens_per_s_per_device


def fit(r, dev, world: int, target: float) -> float:
    lo, hi = 0.05, 1.0
    for _ in range(40):  # tokens/s rises with the factor: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens(r, dev, mid, world) < target else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", choices=list(RUNS), default="a100")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "config.json"
        config.write_text(json.dumps(LLAMA3_8B))
        recs = {name: rehearsed(config, world, extra) for name, (_, world, _, extra) in RUNS.items()}
        plain = rehearsed(config, 8, ["data.micro_batch=2"])
    recs["h100"].record = op_policy(recs["h100"].record)
    dev_f, world_f, target, _ = RUNS[args.fit]
    a = fit(recs[args.fit], DEVICES[dev_f], world_f, target)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"# commit {sha.strip()}; factor fitted on {args.fit}: {a:.3f} (hardware.GPU_ACHIEVABLE = {GPU_ACHIEVABLE})")
    print("| run | device | GPUs | published tokens/s/GPU | predicted | predicted / published | MFU predicted |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (dev_name, world, published, _) in RUNS.items():
        dev = DEVICES[dev_name]
        got = tokens(recs[name], dev, a, world)
        mfu = got * recs[name].flops_per_token / dev.peak("bf16")
        role = "fitted" if name == args.fit else "predicted"
        print(f"| {name} ({role}) | {dev.label} | {world} | {published:,} | {got:,.0f} | {got / published:.3f} | "
              f"{100 * mfu:.1f} % |")
    h100 = DEVICES["h100-hbm2e"]
    nvl = dataclasses.replace(h100, flops={**h100.flops, "bf16": H100_NVL_BF16})
    print(f"h100 with the H100 NVL's bf16 peak: {tokens(recs['h100'], nvl, a, 8):,.0f}; "
          f"with no recompute at all: {tokens(plain, h100, a, 8):,.0f}")


if __name__ == "__main__":
    main()
