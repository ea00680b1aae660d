"""The memory ledger: bytes per rank by category, measured from the tensors that exist, and
predicted from the model's shapes for any strategy, precision, optimizer and world size
(`predict`, `python -m zerolab memory`). The trainer holds one against the other at the first
optimizer step (`ledger_for_run`, `check_against`).

  storage.py     the measured side: StorageCounter, process_memory, the categories
  shapes.py      what predictions start from: ModelShape, the optimizer's state per parameter
  prediction.py  Prediction and its terms; predict() asks the strategy for its own terms
                 (each strategy's predict_memory lives beside its code, in zerolab/strategies/)
  paper.py       the ZeRO paper's formula and figure beside each prediction
  cli.py         python -m zerolab memory: tables, JSON, sweeps over world sizes, plots
  peak.py        the step's peak: model states + activations + transients, one composition
                 for the planner, the ledger and the trainer's measured accounting
  ledger.py      in every run: this run's prediction against what each rank measured
"""
from zerolab.buckets import zero_buckets
from zerolab.memory.cli import cli_main, format_sweep, format_table, plot_sweep, sweep, sweep_predictions
from zerolab.memory.ledger import (PROCESS_KEYS, WARN_RATIO, check_against, check_peak, ledger_for_run,
                                   peak_for_run, peak_keys, process_summary)
from zerolab.memory.peak import PARTS, Peak, logits_buffer_bytes, peak_of, predicted_peak, recompute_bytes
from zerolab.memory.paper import (PAPER_FORMULA, format_paper, paper_bytes, paper_formula, paper_k,
                                  paper_k_text, paper_split, vs_paper)
from zerolab.memory.prediction import (GB, GIB, MIXED, NotPredicted, Prediction, Term, human_bytes, predict,
                                       predicted_strategies)
from zerolab.memory.shapes import (ModelShape, load_model_config, optimizer_state_elements, shape_from_model,
                                   shape_from_model_config, shape_from_params)
from zerolab.memory.storage import CATEGORIES, MODEL_STATES, StorageCounter, process_memory
from zerolab.precision import COMPUTE_BYTES
