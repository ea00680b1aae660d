"""Will a 7B Llama fit? The dry run beside the ledger, DeepSpeed's estimator and the ZeRO paper.

  .venv/bin/python bench/fit.py [--worlds 8,64] [--seq 4096] [--micro-batch 1]

For Llama-2-7B's shape (its config.json, written here: hidden 4096, 32 layers, vocabulary 32000)
under zero3, bf16, AdamW, checkpointed blocks, at each world size: rank 0 rehearsed by
`python -m zerolab dry-run` (model states and the step's peak, as a real run counts them); the
ledger's prediction (`python -m zerolab memory`'s, model states); DeepSpeed's
estimate_zero3_model_states_mem_needs (no offload: 18 bytes per parameter over N plus 4 bytes per
parameter of the largest layer); and the paper's (2 + 2 + 12)Ψ/N (Rajbhandari et al. 2019, §5.3).
Prints a markdown table for bench/RESULTS.md and the README, with what each column counts, and
the time and RSS each dry run took.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def dry_run(config: Path, world: int, seq: int, micro_batch: int) -> dict:
    cmd = [sys.executable, "-m", "zerolab", "dry-run", "--world", str(world), "--json", "model=hf",
           f"model.config={config}", f"model.block_size={seq}", "strategy=zero3", "precision=bf16", "optim=adamw",
           f"data.micro_batch={micro_batch}", "model.activation_checkpointing=blocks"]
    print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
    return json.loads(subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout)


def deepspeed_estimate(total: int, largest: int, world: int) -> int | None:
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except ImportError:
        return None
    nodes, per_node = (world // 8, 8) if world % 8 == 0 else (1, world)
    _, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=per_node, num_nodes=nodes,
                                                      cpu_offload=False, cpu_offload_params=False, zero_init=True)
    return gpu


def largest_layer(config: Path) -> int:
    """The parameters of the largest module holding parameters directly (DeepSpeed's
    'largest layer'): the embedding or the head, 32000 × 4096, for this model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config.parent)))
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="8,64")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    args = ap.parse_args()
    gb = 1e9
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "config.json"
        config.write_text(json.dumps(LLAMA_7B))
        largest = largest_layer(config)
        rows = []
        for world in (int(w) for w in args.worlds.split(",")):
            r = dry_run(config, world, args.seq, args.micro_batch)
            psi = r["n_params"]
            rows.append((world, r, deepspeed_estimate(psi, largest, world), 16 * psi / world))
    print(f"Llama-2-7B shape ({rows[0][1]['n_params']:,} parameters), zero3, bf16, AdamW, sequence {args.seq}, "
          f"micro-batch {args.micro_batch}, checkpointed blocks; per rank, GB (1e9 bytes):\n")
    print("| GPUs | paper (2+2+12)Ψ/N | DeepSpeed's estimator | ledger: model states | dry run: model states "
          "| dry run: peak of the step (activations, transient) |")
    print("|---:|---:|---:|---:|---:|---|")
    for world, r, ds, paper in rows:
        m, p = r["measured"], r["predicted"]
        ds_text = f"{ds / gb:.2f}" if ds is not None else "(DeepSpeed not installed)"
        print(f"| {world} | {paper / gb:.2f} | {ds_text} | {p['mem/model_states_bytes'] / gb:.2f} | "
              f"{m['mem/model_states_bytes'] / gb:.2f} | {m['mem/peak_bytes'] / gb:.2f} "
              f"({m['mem/peak_activations_bytes'] / gb:.2f}, {m['mem/peak_transient_bytes'] / gb:.2f}) |")
    print()
    for world, r, _, _ in rows:
        print(f"- world {world}: {r['steps']} steps rehearsed in {r['seconds']:.1f} s, this process's peak RSS "
              f"{r['rss_peak_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
