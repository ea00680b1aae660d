"""Offload (ZeRO-Offload, Ren et al. USENIX ATC 2021; ZeRO-Infinity's parameter offload,
Rajbhandari et al. SC 2021) in zerolab's own ZeRO, and the host as a place in every memory figure.

Fast tier: the ledger's places (zerolab.accounting), the refusals. Slow tier: one torchrun launch
of 2 ranks runs several jobs (tests/workers/offload_runs.py) whose results the checks share."""
from __future__ import annotations

import torch

from zerolab.accounting import Prediction, StorageCounter, device_part, host_per_node


def test_a_counter_keeps_each_storage_once_and_says_its_place():
    a, b = torch.zeros(10), torch.zeros(6, dtype=torch.float64)
    c = StorageCounter().add("params", [a, a[:3]]).add("master", [b], place="host").add("grads", [b])
    out = c.result()
    assert (out["params"], out["master"], out["grads"], out["total"]) == (40, 48, 0, 88)
    assert (out["device"], out["host"], out["host/master"]) == (40, 48, 48)
    assert device_part(out)["master"] == 0 and device_part(out)["params"] == 40
    assert "host/params" not in out  # only the categories with host bytes get a host/ key


def test_a_prediction_splits_its_terms_by_place_and_sums_a_node():
    p = Prediction("zero2", "fp32", "adamw", 4, "m", 10, 2.0)
    p.add("params", 40, "weights")
    p.add("master", 40, "master", place="host")
    p.add("optim_state", 80, "m, v", place="host")
    p.add("transient", 8, "staged chunk", place="host")
    p.add("transient", 16, "bucket")
    by = p.by_place()
    assert (by["device"]["total"], by["host"]["total"], p.bytes()["total"]) == (40, 120, 160)
    assert p.placed()["host/optim_state"] == 80 and p.placed()["device"] == 40
    assert (p.transient_bytes_at("device"), p.transient_bytes_at("host")) == (16, 8)
    assert host_per_node([p] * 4, 2) == [240, 240]
