"""`python -m zerolab dry-run`: rank r of an N-rank job, rehearsed in one process on fake tensors.

What runs is the job's own code (its Trainer, model, strategy, forward, backward, reductions and
optimizer step); what is not real, and why it cannot change what is counted, is said where it is
made:

- fake.py: the fake world (tensors without data, a process group that moves nothing, host reads
  answered in one place);
- run.py: the job's Trainer stepped in it until the step's peak repeats (rehearse, Rehearsal);
- activations.py: any model's activations measured on fake tensors (the planner's);
- cli.py: the dry-run command and its table beside the ledger's;
- timed.py: a finished run's step rehearsed and priced by the time model (the report's).
"""
from zerolab.rehearsal.activations import activation_model
from zerolab.rehearsal.cli import cli_main, format_rehearsal
from zerolab.rehearsal.run import Rehearsal, rehearsal_config, rehearse
from zerolab.rehearsal.timed import predict_run

__all__ = ["Rehearsal", "activation_model", "cli_main", "format_rehearsal", "predict_run", "rehearsal_config",
           "rehearse"]
