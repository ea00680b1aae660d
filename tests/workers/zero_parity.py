"""Worker for tests/test_zero.py, run under torchrun: trains the same short job under ddp,
zero1 and zero2 for a matrix of models / accumulation / precision, in one process group, and
writes (rank 0) the final fp32 master weights, per-rank memory and comm bytes to OUT_DIR."""
import json
import os
import sys

import torch
import torch.nn as nn
from safetensors.torch import save_file

from zerolab import dist as zdist
from zerolab.config import compose
from zerolab.models import build_model
from zerolab.trainer import Trainer


class WithUnusedBranch(nn.Module):
    """The GPT plus a layer that never takes part in forward: it never gets a gradient."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.unused = nn.Linear(16, 16)

    def forward(self, idx):
        return self.inner(idx)


def main(out_dir: str, steps: int, cases: list[str], corpus: str) -> None:
    os.environ.setdefault("WANDB_MODE", "disabled")
    ctx = zdist.init(compose([]).dist)
    results = {}
    for case in cases:
        model_name, accum, precision, unused = case.split(":")
        accum, unused = int(accum), unused == "unused"
        micro = max(1, 12 // (ctx.world_size * accum))
        for strategy in ("ddp", "zero1", "zero2"):
            overrides = [f"model={model_name}", f"strategy={strategy}", f"precision={precision}",
                         f"trainer.grad_accum_steps={accum}", f"data.micro_batch={micro}",
                         f"trainer.max_steps={steps}", "trainer.eval_every=0", "optim.grad_clip=0.5",
                         "optim.warmup_steps=2", "logging.wandb.mode=disabled", "logging.progress=false",
                         "run.save_model=false", "strategy.bucket_mb=0.05",  # several buckets
                         f"data.path={corpus}",  # the fixed test corpus (tests/conftest.py)
                         f"run.dir={out_dir}/runs/{case.replace(':', '_')}_{strategy}"]
            if model_name == "gpt_tiny":
                overrides.append("model.bias=false")  # see tests/test_ddp.py: the key bias has no gradient
            if unused and strategy == "ddp":
                overrides.append("strategy.find_unused_parameters=true")
            cfg = compose(overrides)
            torch.manual_seed(cfg.trainer.seed)
            model = WithUnusedBranch(build_model(cfg.model)) if unused else None
            trainer = Trainer(cfg, ctx, model=model)
            comm = []
            for step in range(steps):
                _, _, info = trainer.train_step(step)
                comm.append(trainer.strategy.comm.pop_step()["total"])
            weights = trainer.strategy.consolidated_state_dict()
            per_rank = ctx.gather_objects({"memory": trainer.strategy.memory(), "comm": comm})
            trainer.close()
            if ctx.is_main:
                key = f"{case}/{strategy}"
                save_file(weights, os.path.join(out_dir, key.replace("/", "__").replace(":", "_") + ".safetensors"))
                results[key] = {"per_rank": per_rank, "n_params": trainer.n_params, "grad_norm": info.grad_norm}
    if ctx.is_main:
        with open(os.path.join(out_dir, "results.json"), "w") as fh:
            json.dump({"world_size": ctx.world_size, "results": results}, fh)
    zdist.shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4])
