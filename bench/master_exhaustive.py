"""Every one of the 2^32 fp32 bit patterns through zerolab/master.py's pairing, once.

  python bench/master_exhaustive.py            (about a minute on one core)

For each pattern m: split_ into (bf16 weight w, int16 remainder r), rebuild, and check that
  - the rebuild is m bit for bit (every pattern that is not a NaN),
  - a NaN m has a NaN w and rebuilds to a NaN,
  - w is torch's bf16 rounding of m (to nearest, ties to even) except exactly where m's low half
    is 0x8000 and its high half even, where w is one ulp further from zero,
  - round_to_bf16_(m, "nearest_away") gives w (so an fp32-master run can round as a remainder run does),
  - every bf16 weight that is not a NaN is the weight of exactly 2^16 patterns, but for ±inf
    (2^15 + 1: the 2^15 - 1 NaN patterns next to inf keep a NaN weight) and ±0 (2^15: the 2^15 NaN
    patterns that would wrap onto zero keep a NaN weight), master.py's NaN rule.
Prints the counts and exits 1 on any failure. tests/test_master.py checks every high half against a
dense sample of low halves on every run; this is the whole space.
"""
from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from zerolab.master import rebuild, round_to_bf16_, split_  # noqa: E402

BLOCK = 256  # high halves per block: 2^24 patterns


def main() -> int:
    t0 = time.time()
    torch.set_num_threads(1)
    low = torch.arange(1 << 16, dtype=torch.int64)
    counts = torch.zeros(1 << 16, dtype=torch.int64)  # how many patterns each weight is the rounding of
    bad = nan = differ = 0
    for h0 in range(0, 1 << 16, BLOCK):
        high = torch.arange(h0, h0 + BLOCK, dtype=torch.int64)
        bits = ((high[:, None] << 16) | low[None, :]).reshape(-1)
        m = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
        w, r = torch.empty(m.shape, dtype=torch.bfloat16), torch.empty(m.shape, dtype=torch.int16)
        split_(m, w, r)
        back = rebuild(w, r)
        is_nan = torch.isnan(m)
        bad += int((back.view(torch.int32) != m.view(torch.int32))[~is_nan].sum())
        bad += int((~torch.isnan(w[is_nan])).sum() + (~torch.isnan(back[is_nan])).sum())
        ours, rne = w.view(torch.int16).long() & 0xFFFF, m.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
        even_tie = ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) % 2 == 0) & ~is_nan
        off = (ours != rne) & ~is_nan
        bad += int((off != even_tie).sum()) + int((ours[even_tie] != rne[even_tie] + 1).sum())
        away = torch.empty_like(w)
        round_to_bf16_(m, away, "nearest_away")
        bad += int((away.view(torch.int16) != w.view(torch.int16)).sum())
        counts += torch.bincount(ours[~is_nan], minlength=1 << 16)
        nan += int(is_nan.sum())
        differ += int(off.sum())
    weight_bits = torch.arange(1 << 16)
    is_nan_weight = ((weight_bits & 0x7F80) == 0x7F80) & ((weight_bits & 0x7F) != 0)
    expected = torch.full((1 << 16,), 1 << 16, dtype=torch.int64)
    expected[[0x7F80, 0xFF80]] = (1 << 15) + 1
    expected[[0x0000, 0x8000]] = 1 << 15
    not_2_16 = int((counts[~is_nan_weight] != expected[~is_nan_weight]).sum())
    even_nan_highs = 2 * 64  # even high halves 0x7F80..0x7FFE (and negative): with low 0x8000 a NaN
    print(f"patterns: {1 << 32:,}; NaN patterns: {nan:,} (expected {2 * ((1 << 23) - 1):,})")
    print(f"failures (rebuild not bit for bit, NaN not kept NaN, weight not torch's rounding outside the even "
          f"ties, nearest_away not the split's weight): {bad}")
    print(f"weights differing from torch's ties-to-even rounding: {differ:,} (expected the even ties that are not "
          f"NaN: {(1 << 15) - even_nan_highs:,})")
    print(f"non-NaN bf16 weights not the rounding of exactly 2^16 patterns (±inf 2^15 + 1, ±0 2^15): {not_2_16}")
    print(f"time {time.time() - t0:.1f} s")
    wrong = bad or not_2_16 or nan != 2 * ((1 << 23) - 1) or differ != (1 << 15) - even_nan_highs
    print("PASS" if not wrong else "FAIL")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
