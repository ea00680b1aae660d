"""Bytes per category, counted and predicted: the vocabulary that strategies write in and the
memory ledger (zerolab/memory/) reads, below both.

  storage.py  the measured side: StorageCounter, the categories, process_memory
  terms.py    the predicted side: Prediction and its terms, and the notation they share
  shape.py    what predictions start from: ModelShape
  saved.py    the bytes a forward saves for backward, measured (ActivationMeter)
"""
from zerolab.accounting.saved import ActivationMeter, keep_for_backward
from zerolab.accounting.shape import ModelShape, shape_from_params
from zerolab.accounting.storage import (CATEGORIES, MODEL_STATES, PLACES, StorageCounter, device_part,
                                        element_states, is_element_state, placed, process_memory)
from zerolab.accounting.terms import (GB, GIB, MIXED, NotPredicted, Prediction, Term, ceil_div, dtype_name, fmt_n,
                                      host_per_node, human_bytes, state_bytes)

__all__ = ["ActivationMeter", "keep_for_backward", "CATEGORIES", "GB", "GIB", "MIXED", "MODEL_STATES", "ModelShape",
           "NotPredicted", "PLACES", "Prediction", "StorageCounter", "Term", "ceil_div", "device_part", "dtype_name",
           "element_states", "fmt_n", "host_per_node", "human_bytes", "is_element_state", "placed",
           "process_memory", "shape_from_params", "state_bytes"]
