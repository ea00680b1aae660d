"""One job of a run: validate the config, join the process group, check the data, claim the run
directory, train, and say a failure once.

Before any process group exists every rank finds the same configuration problems, and rank 0
alone says them (zerolab.errors.exit_for). After it, a failure every rank shares is said by rank
0 after a barrier; a collective that fails because a peer stopped names that peer
(zerolab.run.fault.ProgressBoard) and ends the job at once.
"""
from __future__ import annotations

import logging
from typing import Optional

from omegaconf import DictConfig

from zerolab import dist as zdist
from zerolab.run import directory as rundir
from zerolab.checkpoint import check_resume_path
from zerolab.config import Config, ConfigError, validate
from zerolab.data import check_data
from zerolab.errors import ZerolabError, report
from zerolab.run.fault import RankStopped, stop_now
from zerolab.models import preflight
from zerolab.models.sources import vocab_fix
from zerolab.run.results import save_model_config
from zerolab.strategies import strategy_class
from zerolab.trainer import Trainer

log = logging.getLogger("zerolab")


def model_preflight(cfg: Config) -> None:
    """A user's model (model=hf, model=custom) is resolved, built on the meta device and checked
    against what the strategy needs (zerolab.models.preflight); model.vocab_size becomes model=hf's
    own, before the data is checked against it. ConfigError otherwise. Also launch/run_dir.py's."""
    needs = strategy_class(cfg.strategy.name).traits.needs_blocks
    preflight(cfg.model, needed_by=f"strategy={cfg.strategy.name}" if needs else "")


def run(dcfg: DictConfig | Config) -> Optional[dict]:
    try:  # before any process group exists: every rank finds the same, and rank 0 alone says it
        cfg = validate(dcfg)
        check_resume_path(cfg.checkpoint.resume)
        model_preflight(cfg)  # the user's model: its config, code, window, blocks and weights
    except ConfigError as err:
        err.before_ranks_meet = True  # zerolab.errors.exit_for
        raise
    ctx = zdist.init(cfg.dist)
    if not ctx.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    trainer, lock = None, None
    try:
        # User input that would only fail later (in the first batch or the final eval) fails now,
        # on every rank alike, before the run directory is touched.
        zdist.agree(ctx, lambda: check_data(cfg.data, cfg.model.block_size, cfg.model.vocab_size,
                                            vocab_fix(cfg.model)))
        run_dir, lock = rundir.claim(cfg, ctx)
        try:
            trainer = Trainer(cfg, ctx, run_dir=run_dir)
            if ctx.is_main:  # config.json beside the weights and checkpoints: from_pretrained(run_dir)
                save_model_config(cfg.model, run_dir)
        except BaseException:
            # A start that fails leaves nothing behind: the directory goes if this job created it
            # (a run.dir that existed before, with its checkpoints, is kept).
            if lock is not None and lock.remove_created():
                log.info("setup failed: removed %s, which this job had created", run_dir)
            raise
        return trainer.fit()
    except (ConfigError, ZerolabError) as err:
        if err.same_on_every_rank:
            # One message, from rank 0. The other ranks leave only after it is printed: torchrun
            # stops the whole job as soon as one rank exits, and rank 0 could lose its message.
            report(err, quiet=not ctx.is_main)
            ctx.barrier()
        raise
    except RuntimeError as err:
        if trainer is not None:
            try:
                trainer.watch.board.blame(err)  # raises naming the rank that stopped, if one did
            except RankStopped as named:
                stop_now(named)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if lock is not None:
            lock.release()  # after the last write into the directory
        zdist.shutdown(ctx)
