"""A transformers Llama under the sharding strategies: step time as a ratio to ddp, and model states.

  OMP_NUM_THREADS=1 .venv/bin/python bench/models.py [--rounds 2] [--steps 20] [--warmup 5]

Writes a ~10M-parameter Llama config (hidden 384, 6 layers, 6 heads with 2 KV heads, SwiGLU 896,
vocabulary 512, untied head) and trains it with `model=hf` under ddp, zero3, fsdp and DeepSpeed
stage 3 (one 2-rank torchrun job of train.py each, fp32, AdamW, 4 × 128 tokens per rank per step),
`--rounds` times, alternating the order between rounds, all in this one invocation. Prints, per
strategy, the step times pooled over the rounds after the warm-up: p50 and p95, each as a ratio to
ddp's, and the model states per rank that the run measured (Strategy.memory(), beside ddp's), as a
markdown table for bench/RESULTS.md. Timing on a shared machine varies between runs: compare
ratios within one run only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerolab.run.metrics import read_jsonl  # noqa: E402
from zerolab.stats import percentile  # noqa: E402

STRATEGIES = {"ddp": ["strategy=ddp"], "zero3": ["strategy=zero3"], "fsdp": ["strategy=fsdp"],
              "deepspeed3": ["strategy=deepspeed", "strategy.stage=3"]}


def write_config(path: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=384, intermediate_size=896, num_hidden_layers=6, num_attention_heads=6,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2).to_json_file(str(path))
    return path


def run(name: str, config: Path, run_dir: Path, steps: int, nproc: int, extra: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), "model=hf", f"model.config={config}", "model.block_size=128", *STRATEGIES[name],
           "precision=fp32", "optim=adamw", "data.micro_batch=4", f"trainer.max_steps={steps}", "trainer.eval_every=0",
           "trainer.eval_batches=1", "logging.wandb.mode=disabled", "logging.progress=false", f"run.dir={run_dir}",
           *extra]
    print(" ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def summarise(root: Path, names: list[str], rounds: int, warmup: int) -> list[dict]:
    rows = []
    for name in names:
        times, states, n_params = [], [], None
        for k in range(rounds):
            run_dir = root / f"r{k}-{name}"
            records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step_time_s" in r]
            times += [r["step_time_s"] for r in records if r["step"] > warmup]
            last = records[-1]
            states = [last[key] for key in sorted(last) if key.endswith("/mem/model_states_bytes")]
            n_params = json.loads((run_dir / "summary.json").read_text())["n_params"]
        rows.append({"strategy": name, "p50": statistics.median(times), "p95": percentile(times, 95),
                     "steps": len(times), "states": states, "n_params": n_params})
    base = rows[0]
    for r in rows:
        r["p50_ratio"], r["p95_ratio"] = r["p50"] / base["p50"], r["p95"] / base["p95"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| strategy | p50 s/step | p50 ÷ ddp | p95 s/step | p95 ÷ ddp | model states per rank, MiB | ÷ ddp |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = rows[0]["states"][0]
    for r in rows:
        mib = " / ".join(f"{s / 2**20:.2f}" for s in r["states"])
        lines.append(f"| {r['strategy']} | {r['p50']:.3f} | {r['p50_ratio']:.3f} | {r['p95']:.3f} | "
                     f"{r['p95_ratio']:.3f} | {mib} | {r['states'][0] / base:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="runs of every strategy, in alternating order")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--root", default=str(ROOT / "bench" / "runs"))
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job")
    args = p.parse_args()
    root = Path(args.root) / f"models-{time.strftime('%Y%m%d-%H%M%S')}"
    root.mkdir(parents=True)
    config = write_config(root / "llama10m.json")
    names, load_before, start = list(STRATEGIES), os.getloadavg(), time.monotonic()
    for k in range(args.rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            if run(name, config, root / f"r{k}-{name}", args.steps, args.nproc, args.overrides):
                print(f"{name} failed (round {k})", file=sys.stderr)
                return 1
    rows = summarise(root, names, args.rounds, args.warmup)
    print(f"\n{rows[0]['n_params']:,} parameters, {args.nproc} ranks, {args.rounds} rounds x {args.steps} steps "
          f"({rows[0]['steps']} timed per strategy), wall {time.monotonic() - start:.0f} s, load average "
          f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
