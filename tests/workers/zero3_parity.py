"""Worker for tests/test_zero3.py, run under torchrun: trains the same short gpt_tiny job under ddp
and zero3 (and zero3 with strategy.reshard_after_forward=false) for a list of cases, in one
process group, and writes (rank 0) the final fp32 weights, and per rank and per step: the comm
bytes by collective, the grad norm and skip flag, and the memory by category after the last step.

A case is "accum:optim:precision", e.g. "4:lamb:fp32"; "+noreshard" adds the
reshard_after_forward=false run, "+inf" injects an inf gradient on rank 0 at step 3 (fp16)."""
import json
import os
import sys

import torch
from safetensors.torch import save_file

from zerolab import dist as zdist
from zerolab.config import compose
from zerolab.trainer import Trainer

CLIP = 0.1  # optim.grad_clip: below gpt_tiny's gradient norm (~0.3-2.6 here), so every step clips


def runs_of(case: str) -> list[tuple[str, list[str]]]:
    out = [("ddp", ["strategy=ddp"]), ("zero3", ["strategy=zero3"])]
    if "+noreshard" in case:
        out.append(("zero3_noreshard", ["strategy=zero3", "strategy.reshard_after_forward=false"]))
    return out


def main(out_dir: str, steps: int, cases: list[str], corpus: str) -> None:
    os.environ.setdefault("WANDB_MODE", "disabled")
    ctx = zdist.init(compose([]).dist)
    results = {}
    for case in cases:
        accum, optim, precision = case.split("+")[0].split(":")
        accum = int(accum)
        micro = max(1, 12 // (ctx.world_size * accum))
        for label, strategy in runs_of(case):
            overrides = ["model=gpt_tiny", "model.bias=false",  # see tests/test_ddp.py: the key bias has no gradient
                         *strategy, f"optim={optim}", f"precision={precision}",
                         f"trainer.grad_accum_steps={accum}", f"data.micro_batch={micro}",
                         f"trainer.max_steps={steps}", "trainer.eval_every=0", f"optim.grad_clip={CLIP}",
                         "optim.warmup_steps=2", "logging.wandb.mode=disabled", "logging.progress=false",
                         "run.save_model=false", "strategy.bucket_mb=0.05",  # several buckets per unit
                         f"data.path={corpus}", f"run.dir={out_dir}/runs/{case.replace(':', '_')}_{label}"]
            if "+inf" in case:
                overrides += ["fault.inf_grad_step=4", "fault.inf_grad_rank=0", "precision.initial_scale=1024"]
            cfg = compose(overrides)
            torch.manual_seed(cfg.trainer.seed)
            trainer = Trainer(cfg, ctx)
            comm, norms, skipped = [], [], []
            for step in range(steps):
                _, _, info = trainer.train_step(step)
                comm.append(trainer.strategy.comm.pop_step())
                norms.append(info.grad_norm)
                skipped.append(info.skipped)
            live = len(getattr(trainer.strategy, "live", ()))  # zero3: buckets gathered between steps
            memory = trainer.strategy.memory()
            weights = trainer.strategy.consolidated_state_dict()
            eval_loss = trainer.evaluate()  # eval runs forward through the same hooks
            live_after_eval = len(getattr(trainer.strategy, "live", ()))
            per_rank = ctx.gather_objects({"memory": memory, "comm": comm, "live": live,
                                           "live_after_eval": live_after_eval})
            trainer.close()
            if ctx.is_main:
                key = f"{case}/{label}"
                save_file(weights, os.path.join(out_dir, key.replace("/", "__").replace(":", "_") + ".safetensors"))
                results[key] = {"per_rank": per_rank, "n_params": trainer.n_params, "grad_norms": norms,
                                "skipped": skipped, "eval_loss": eval_loss}
    if ctx.is_main:
        with open(os.path.join(out_dir, "results.json"), "w") as fh:
            json.dump({"world_size": ctx.world_size, "clip": CLIP, "results": results}, fh)
    zdist.shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4])
