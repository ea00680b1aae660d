"""zerolab's training entry point.

  python train.py [key=value ...]                                  # one process
  torchrun --standalone --nproc_per_node=2 train.py strategy=zero2 # two ranks

A configuration problem (unknown key, unknown group option, bad value, batch that does not
divide, unusable data, a run directory another job holds) exits with code 2, the config checks
before any process group is created. A failure zerolab can explain (zerolab.errors.ZerolabError)
is printed as one paragraph without a traceback (ZEROLAB_DEBUG=1 shows it) and exits with its
code. Under torchrun only rank 0 prints a message every rank shares (zerolab.errors.exit_for).

Under bare torchrun that code is the worker's, not the command's: torchrun's launcher raises
ChildFailedError for any worker that exits non-zero (torch/distributed/launcher/api.py), so the
command exits 1 after torchrun's own traceback and failure block, whatever the ranks do. What a
rank can do is tell that block why: the rank that says the message also writes it into the
error file torchrun gives each worker (TORCHELASTIC_ERROR_FILE), and the block's "Root Cause"
shows it beside exitcode 2, at the foot of the output. launch/torchrun.sh checks the config
before torchrun starts and exits 2 with the paragraph alone (docs/launch.md).
"""
import json
import os
import sys
import time
import traceback

import hydra
from omegaconf import DictConfig

from zerolab.config import ConfigError, check_overrides, config_groups, free_dicts_merge
from zerolab.errors import ZerolabError, debug_enabled, exit_for, launch_rank

_task_started = False


def _exit(err: BaseException, every_rank_alike: bool = False) -> None:
    """zerolab.errors.exit_for, after the rank that says the message has written it where torchrun
    shows it (the module's docstring). Without torchrun there is no such file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not (every_rank_alike and launch_rank() != 0):
        code = 2 if isinstance(err, ConfigError) else getattr(err, "exit_code", 1)
        # The paragraph as printed, under a head of its own: the printed one stays the only line that
        # starts "zerolab: configuration error:" (or "zerolab: error:"), the block says the code.
        body = str(err).removeprefix("zerolab: ")
        text = f"zerolab exited {code}: {body}"
        try:
            with open(path, "w") as fh:  # torchelastic's format: its py_callstack is what the block shows
                json.dump({"message": {"message": text, "extraInfo": {"py_callstack": text,
                                                                      "timestamp": str(int(time.time()))}}}, fh)
        except OSError:
            pass  # the message is printed all the same; only torchrun's summary lacks it
    # A rank that got a stop signal does not wait for another (zerolab.errors.exit_for). Read without
    # importing: before the training code is imported no handler exists, and nothing was received.
    preempt = sys.modules.get("zerolab.run.preempt")
    signalled = preempt is not None and preempt.StopRequest.signal_name is not None
    exit_for(err, every_rank_alike=every_rank_alike, signalled=signalled)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    from zerolab.job import run

    try:
        run(cfg)
    except (ConfigError, ZerolabError) as err:
        # Every rank met it alike: before the process group (configuration), or shared after it
        # (rank 0 has said it): the other ranks then leave when the launcher stops the job.
        _exit(err, every_rank_alike=getattr(err, "before_ranks_meet", False) or err.same_on_every_rank)


def _check_command_line() -> None:
    """Unknown keys and unknown group options, before Hydra sees them: Hydra would advise
    `+key=...` (which zerolab refuses too: the schema is closed) or print a block listing the
    search path; zerolab's one line suggests the nearest valid key or lists the options."""
    overrides = [a for a in sys.argv[1:] if not a.startswith("-") and "=" in a]
    try:
        check_overrides(overrides, config_groups())
    except ConfigError as err:
        _exit(err, every_rank_alike=True)
    # model.kwargs={...} and strategy.ds_config_overrides={...} as written: Hydra takes them as ++
    sys.argv[1:] = free_dicts_merge(sys.argv[1:])


if __name__ == "__main__":
    # Composition errors (a value of the wrong type) raise instead of Hydra printing them on every
    # rank: zerolab says them once, in one line, below.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    _check_command_line()
    try:
        main()
    except SystemExit as exit_:
        # Hydra exits with 1 when composing the config fails (wrong type, unknown group option);
        # before the task started that is a configuration error: exit 2.
        if exit_.code == 1 and not _task_started:
            sys.exit(2)
        raise
    except ZerolabError as err:  # a failed job of a sweep (hydra_plugins/zerolab_torchrun): said, exit 1
        _exit(err)
    except Exception as err:  # with HYDRA_FULL_ERROR=1 Hydra re-raises instead of exiting
        if _task_started:
            raise
        # Composing the config failed: the user's input, so the message, not a traceback.
        if debug_enabled():
            traceback.print_exc()
        cause = f"\n{err.__cause__}" if err.__cause__ is not None and str(err.__cause__) not in str(err) else ""
        # Hydra's message, without its internals (the full_key, reference_type, object_type lines)
        text = "\n".join(line for line in f"{err}{cause}".splitlines()
                         if not line.strip().startswith(("full_key:", "reference_type=", "object_type=")))
        _exit(ConfigError(text), every_rank_alike=True)
