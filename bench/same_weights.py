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
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "deepspeed", "fsdp", "torch_zero")
PRECISIONS = ("fp32", "bf16", "fp16")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run(root: Path, strategy: str, precision: str, accum: int, out: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(root / "train.py"), f"strategy={strategy}", f"precision={precision}", "model=gpt_tiny",
           "trainer.max_steps=8", "trainer.eval_every=0", "trainer.eval_batches=1", "data.micro_batch=4",
           f"trainer.grad_accum_steps={accum}", "logging.wandb.mode=disabled", "logging.progress=false",
           f"run.dir={out}"]
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zerolab-same-weights-") as tmp:
        for strategy, precision, accum in itertools.product(args.strategies.split(","), args.precisions.split(","),
                                                            (1, 2)):
            out = Path(tmp) / f"{strategy}-{precision}-{accum}"
            result = run(args.root.resolve(), strategy, precision, accum, out)
            print(f"{strategy:<11} {precision:<5} accum {accum}  {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
