"""Same seed, same weights? The final weights of short 2-rank runs, as sha256 digests, for every
strategy x precision x accumulation, from the zerolab tree at --root (this one by default).

A refactor that must not change what is computed is checked by running this on the commit
before and the commit after and comparing the two lists line by line (bench/RESULTS.md records
such a comparison):

    git worktree add /tmp/before <commit>
    python bench/same_weights.py --root /tmp/before > before.txt
    python bench/same_weights.py > after.txt && diff before.txt after.txt

Each run is a real torchrun job of train.py (gpt_tiny, 8 steps, the embedded corpus, fixed seed);
a configuration the machine cannot run (DeepSpeed's fp16 without AVX512-FP16) prints its refusal
instead of a digest, the same on both commits.

--variants adds the settings of zerolab's ZeRO beyond the plain matrix (VARIANTS: offload, HSDP,
the stored masters, ZeRO++, LAMB's flat path), each on the strategies and precisions it applies to
(intersected with --strategies and --precisions); a variant's lines name it after the strategy:

    python bench/same_weights.py --strategies zero1,zero2,zero3 --variants plain,offload,hsdp,remainder
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "deepspeed", "fsdp", "torch_zero")
PRECISIONS = ("fp32", "bf16", "fp16")
ZERO = ("zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Variant:
    overrides: tuple = ()  # Hydra overrides beside the plain run's
    strategies: tuple = STRATEGIES  # where the settings apply
    precisions: tuple = PRECISIONS
    ranks: int = 2  # torchrun's processes (HSDP and ZeRO++ lay out 2 nodes x 2 ranks)


NODES = ("dist.ranks_per_node=2",)
VARIANTS = {
    "plain": Variant(),
    "offload": Variant(("strategy.offload_optimizer=true",), ZERO),
    "offload_params": Variant(("strategy.offload_optimizer=true", "strategy.offload_params=true"), ("zero3",)),
    "hsdp": Variant(("strategy.shard_within=node", *NODES), ZERO, ranks=4),
    "remainder": Variant(("precision.master=remainder",), ("ddp", *ZERO), ("bf16",)),
    "master_bf16": Variant(("precision.master=bf16",), ("ddp", *ZERO), ("bf16",)),
    "grad_shard_bf16": Variant(("precision.grad_shard=bf16",), ("zero1", "zero2"), ("bf16",)),
    "hpz": Variant(("strategy.hpz=true", *NODES), ("zero3",), ranks=4),
    "quantized": Variant(("strategy.quantize_weights=true", "strategy.quantize_grads=true", *NODES), ("zero3",),
                         ranks=4),
    "lamb": Variant(("optim=lamb",), ("ddp", *ZERO), ("fp32", "bf16")),
}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run(root: Path, strategy: str, precision: str, accum: int, out: Path, variant: Variant = VARIANTS["plain"]) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={variant.ranks}",
           str(root / "train.py"), f"strategy={strategy}", f"precision={precision}", "model=gpt_tiny",
           "trainer.max_steps=8", "trainer.eval_every=0", "trainer.eval_batches=1", "data.micro_batch=4",
           f"trainer.grad_accum_steps={accum}", "logging.wandb.mode=disabled", "logging.progress=false",
           f"run.dir={out}", *variant.overrides]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    weights = out / "model.safetensors"
    if done.returncode == 0 and weights.exists():
        return digest(weights)
    lines = [ln for ln in (done.stderr + done.stdout).splitlines() if "zerolab:" in ln]
    return f"refused: {lines[0][:100] if lines else 'exit ' + str(done.returncode)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=HERE, help="the zerolab tree to run (default: this one)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--variants", default="plain", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory(prefix="zerolab-same-weights-") as tmp:
        for name in args.variants.split(","):
            v = VARIANTS[name]
            strategies = [s for s in args.strategies.split(",") if s in v.strategies]
            precisions = [p for p in args.precisions.split(",") if p in v.precisions]
            for strategy, precision, accum in itertools.product(strategies, precisions, (1, 2)):
                out = Path(tmp) / f"{name}-{strategy}-{precision}-{accum}"
                result = run(args.root.resolve(), strategy, precision, accum, out, v)
                label = strategy if name == "plain" else f"{strategy}+{name}"
                print(f"{label:<11} {precision:<5} accum {accum}  {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
