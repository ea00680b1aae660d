"""Each rank's model buffers right after a resume: the Trainer resumes while it is built
(checkpoint.resume=...), and every rank saves what its module's buffers hold then.

  torchrun ... tests/workers/buffers_after_resume.py OUT_DIR <train.py overrides>
"""
import sys

import torch

from zerolab import dist as zdist
from zerolab.config import compose
from zerolab.trainer import Trainer

out, overrides = sys.argv[1], sys.argv[2:]
cfg = compose(overrides)
ctx = zdist.init(cfg.dist)
try:
    trainer = Trainer(cfg, ctx)
    buffers = {n: b.detach().cpu().clone() for n, b in trainer.checkpointer.model.named_buffers()}
    torch.save(buffers, f"{out}/rank{ctx.rank}.pt")
    trainer.close()
finally:
    zdist.shutdown(ctx)
