"""The memory ledger: bytes per rank by category and place (device or host), measured from the tensors that exist, and
predicted from the model's shapes for any strategy, precision, optimizer and world size
(`predict`, `python -m zerolab memory`). The trainer holds one against the other at the first
optimizer step (`ledger_for_run`, `check_against`).

  ../accounting  below the strategies: StorageCounter and the categories (the measured side),
                 Prediction and its terms, ModelShape (what strategies and this package share)
  shapes.py      ModelShape from a live model or a config; the optimizer's state per parameter
  prediction.py  predict() asks the strategy for its own terms (each strategy's
                 predict_memory lives beside its code, in zerolab/strategies/)
  paper.py       the ZeRO paper's formula and figure beside each prediction
  cli.py         python -m zerolab memory: tables, JSON, sweeps over world sizes, plots
  offload.py     python -m zerolab memory --offload: device and host bytes of every offload mode
  peak.py        the step's peak: model states + activations + transients, one composition
                 for the planner, the ledger and the trainer's measured accounting
  ledger.py      in every run: this run's prediction against what each rank measured
"""
from zerolab.accounting import (CATEGORIES, GB, GIB, MIXED, MODEL_STATES, ModelShape, NotPredicted, Prediction,
                                StorageCounter, Term, human_bytes, process_memory, shape_from_params)
from zerolab.memory.cli import cli_main, format_sweep, format_table, plot_sweep, sweep_predictions
from zerolab.memory.ledger import (PROCESS_KEYS, WARN_RATIO, check_against, check_peak, ledger_for_run,
                                   peak_for_run, peak_keys, process_summary)
from zerolab.memory.peak import PARTS, Peak, logits_buffer_bytes, peak_of, predicted_peak, recompute_bytes
from zerolab.memory.paper import (PAPER_FORMULA, format_paper, paper_bytes, paper_formula, paper_k,
                                  paper_k_text, paper_split, vs_paper)
from zerolab.memory.prediction import predict, predicted_strategies, prediction_dict
from zerolab.memory.shapes import load_model_config, optimizer_state_elements, shape_from_model, shape_from_model_config

__all__ = ["CATEGORIES", "GB", "GIB", "MIXED", "MODEL_STATES", "ModelShape", "NotPredicted", "PAPER_FORMULA",
           "PARTS", "PROCESS_KEYS", "Peak", "Prediction", "StorageCounter", "Term", "WARN_RATIO", "check_against",
           "check_peak", "cli_main", "format_paper", "format_sweep", "format_table", "human_bytes", "ledger_for_run",
           "load_model_config", "logits_buffer_bytes", "optimizer_state_elements", "paper_bytes", "paper_formula",
           "paper_k", "paper_k_text", "paper_split", "peak_for_run", "peak_keys", "peak_of", "plot_sweep", "predict",
           "predicted_peak", "predicted_strategies", "prediction_dict", "process_memory", "process_summary",
           "recompute_bytes", "shape_from_model", "shape_from_model_config", "shape_from_params",
           "sweep_predictions", "vs_paper"]
