"""The fp32 master weight held as the bf16 weight plus a 16-bit remainder, exactly.

bf16 mixed precision keeps an fp32 master m (4 bytes) beside the bf16 weight w (2 bytes) the
model computes with. bf16 is fp32's top half, so w already holds most of m: keeping the other 16
bits beside it rebuilds m exactly, and the master costs 2 bytes instead of 4 (Megatron-Core's
precision-aware optimizer, `store_param_remainders`, keeps the same pair).

The pairing. Write m's 32 bits as a high half h and a low half l (m = h·2^16 + l):
  weight     w = h + (l >> 15)   mod 2^16     h rounded by the first bit it drops
  remainder  r = l                            kept verbatim, as an int16
  rebuild    h = w - (r >> 15)   mod 2^16,    m = h·2^16 + r
It is exact because the rebuild subtracts what the weight added: w - (r >> 15) = h. So every fp32
bit pattern but the NaNs (below) gives one pair and comes back from it bit for bit
(tests/test_master.py: every high half against a dense sample of low halves; bench/master_exhaustive.py:
all 2^32 patterns).

What w is. fp32 and bf16 are sign and magnitude, exponent above mantissa, so adding the dropped
bit to h rounds |m| to the nearest bf16 value with ties away from zero: a carry out of the
mantissa lands on the next binade's first value, which is the right next value, across the
subnormal/normal boundary too and, from |m| >= 3.3961e38 (the largest bf16 value plus half its
ulp), onto inf, where round-to-nearest-even goes as well. ±0 and ±inf pair with r = 0. torch
rounds to nearest with ties to even: the two differ only where l = 0x8000 exactly and h is even
(torch keeps h, w is one ulp further from zero), 2^-17 of uniformly spread bit patterns.

Why not ties to even: no 16-bit remainder can make it exact. Under it an even h is the rounding of
2^16 + 1 fp32 patterns (from l = -2^15 below it to +2^15 above, both ties included) and an odd one
of 2^16 - 1; 16 bits tell 2^16 apart, so one pattern next to every even weight would be lost. A
rounding pairs exactly with a 16-bit remainder when every weight is the rounding of exactly 2^16
patterns: ties away from zero (this one) and truncation (w = h, a plain bit split) are two such.
Truncation moves every weight whose dropped half is >= 2^15 one ulp toward zero (about half of
them, a bias); ties away only the even ties (bench/master_modes.py --exact counts them in a real run).

NaN. fp32 has 2·(2^23 - 1) NaN patterns and bf16's 2·127 NaN weights take 2^16 patterns each, so
2·(2^16 - 1) NaN masters must pair with a weight that is not NaN if every pattern is to come back
(by the rule above they would round to ±inf or wrap to ∓0, and CUDA's canonical NaN, 0x7FFFFFFF,
is among those that wrap). A silent zero weight is worse than an inexact NaN, so split_ gives
every NaN master a NaN weight: its rebuild is a NaN again, not the same payload.
"""
from __future__ import annotations

import torch

ROUNDINGS = ("nearest_even", "nearest_away")  # how a bf16 weight is derived from its fp32 master
_QUIET_NAN = 0x7FC0  # bf16's canonical quiet NaN, as an int16 bit pattern


def _halves(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) int16 views of a contiguous fp32 tensor's halves (little-endian: low first)."""
    if master.dtype != torch.float32 or not master.is_contiguous():
        raise ValueError(f"a master must be a contiguous fp32 tensor (got {master.dtype}, "
                         f"contiguous={master.is_contiguous()})")
    pairs = master.view(-1).view(torch.int16).view(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def _bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"expected a contiguous {dtype} tensor (got {t.dtype}, contiguous={t.is_contiguous()})")
    return t.view(-1).view(torch.int16)


def _rounded_high(low: torch.Tensor, high: torch.Tensor, out: torch.Tensor) -> None:
    """out = high + (low >> 15): the high half rounded by the first bit it drops (mod 2^16)."""
    torch.sub(high, torch.bitwise_right_shift(low, 15), out=out)  # low >> 15 is -1 where the bit is set


def split_(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write fp32 `master` as its bf16 `weight` (rounded to nearest, ties away from zero) and
    int16 `remainder` (its low half), in place; rebuild() gives `master` back bit for bit, except
    that a NaN master gets a NaN weight and rebuilds to a NaN (module docstring)."""
    low, high = _halves(master)
    w = _bits(weight, torch.bfloat16)
    _rounded_high(low, high, w)
    w.masked_fill_(torch.isnan(master.view(-1)), _QUIET_NAN)
    _bits(remainder, torch.int16).copy_(low)


def rebuild(weight: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 master of a (bf16 weight, int16 remainder) pair, into `out` if given."""
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    low, high = _halves(out)
    r = _bits(remainder, torch.int16)
    low.copy_(r)
    torch.add(_bits(weight, torch.bfloat16), torch.bitwise_right_shift(r, 15), out=high)  # h = w - (r >> 15)
    return out


def round_to_bf16_(master: torch.Tensor, weight: torch.Tensor, rounding: str = "nearest_even") -> None:
    """weight <- master rounded to bf16: to nearest with ties to even (torch's cast) or ties away
    from zero (the remainder pairing's weight, so that an fp32-master run can derive its weights
    exactly as a remainder run does, and the two can be compared bit for bit)."""
    if rounding == "nearest_even":
        weight.copy_(master)
    elif rounding == "nearest_away":
        low, high = _halves(master)
        w = _bits(weight, torch.bfloat16)
        _rounded_high(low, high, w)
        w.masked_fill_(torch.isnan(master.view(-1)), _QUIET_NAN)
    else:
        raise ValueError(f"rounding={rounding!r}; known: {', '.join(ROUNDINGS)}")


# ---- deriving the weight, and where the master is stored ---------------------------------------
STORAGES = ("fp32", "remainder", "bf16")  # precision.master: how a bf16 run stores its fp32 master


def derived_weight(master: torch.Tensor, dtype: torch.dtype, rounding: str) -> torch.Tensor:
    """The weight of fp32 `master` in `dtype`, rounded as precision.weight_rounding says (ties away
    from zero derives the weight as a remainder run does); `master` itself where the dtype is its own."""
    if dtype != torch.bfloat16 or rounding == "nearest_even":
        return master.to(dtype)
    out = torch.empty(master.shape, dtype=dtype, device=master.device)
    round_to_bf16_(master.contiguous(), out, rounding)
    return out


def derive_weight_(master: torch.Tensor, weight: torch.Tensor, rounding: str) -> None:
    """weight <- its fp32 `master`, in place: rounded as derived_weight rounds it (bf16), or copied."""
    if weight.dtype == torch.bfloat16:
        round_to_bf16_(master, weight, rounding)
    else:
        weight.copy_(master)


def stand_in(shape, device) -> torch.nn.Parameter:
    """An fp32 parameter of `shape` that holds no memory, standing in for a master stored elsewhere:
    what the optimizer updates then (zerolab/optim/stored.py reads and writes the storage); it
    carries the fp32 gradient and keys the optimizer state."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device).expand(shape))
    p.untyped_storage().resize_(0)  # (after wrapping: on fake tensors the parameter gets a storage of its own)
    return p


def span(t: torch.Tensor, lo: int, hi: int | None) -> torch.Tensor:
    """Elements [lo, hi) of t's flat view; t itself (its shape) when they are all of it (a master's
    span here, an optimizer state's or gradient's in zerolab/optim/stored.py)."""
    if lo == 0 and (hi is None or hi == t.numel()):
        return t
    return t.view(-1)[lo:hi]


class MasterStorage:
    """Where the fp32 masters of a list of tensors live (a bf16 run's precision.master): the one
    place that reads a master as fp32, writes it back, and loads it.

      fp32       masters[i] is the fp32 master itself (an fp32 copy, or the fp32 weights)
      remainder  weights[i] (bf16, the model's weight) and remainders[i] (int16) hold it exactly
      bf16       weights[i] alone holds it (lossy: rounded to bf16 on every store)

    masters[i] is what the optimizer updates: the master itself under fp32, a stand-in (an fp32
    parameter of the master's shape that holds no memory: stand_in) otherwise. An entry
    is a whole tensor (ddp) or a slab of a shard (zerolab's ZeRO); lo and hi select a span of
    its flat view, the whole entry in its own shape by default. `held_in` makes the storage of a
    master the weights hold."""

    def __init__(self, mode: str, masters: list, weights: list = (), remainders: list = ()):
        if mode not in STORAGES:
            raise ValueError(f"master storage {mode!r}; known: {', '.join(STORAGES)}")
        self.mode, self.masters = mode, masters
        self.weights, self.remainders = list(weights), list(remainders)

    @classmethod
    def held_in(cls, mode: str, weights: list[torch.Tensor]) -> "MasterStorage":
        """The masters of bf16 `weights` stored in them (mode remainder or bf16): fp32 stand-ins of
        their shapes for the optimizer, and for remainder an int16 remainder each, 0: the master
        starts as the weight, as an fp32 master copied from the weights does."""
        stand_ins = [stand_in(w.shape, w.device) for w in weights]
        remainders = [torch.zeros(w.shape, dtype=torch.int16, device=w.device) for w in weights] \
            if mode == "remainder" else []
        return cls(mode, stand_ins, weights, remainders)

    def fp32(self, i: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of master i in fp32: a view of it, or a copy rebuilt from its storage."""
        if self.mode == "fp32":
            return span(self.masters[i].detach(), lo, hi)
        w = span(self.weights[i].detach(), lo, hi)
        if self.mode == "remainder":
            return rebuild(w, span(self.remainders[i], lo, hi))
        return w.float()

    def store(self, i: int, value: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Write back fp32 `value`, taken from fp32(i, lo, hi) and changed in place (nothing to do
        under fp32: `value` is a view of the master)."""
        if self.mode == "fp32":
            return
        w = span(self.weights[i].detach(), lo, hi)
        if self.mode == "remainder":
            split_(value.contiguous(), w, span(self.remainders[i], lo, hi))
        else:
            w.copy_(value)  # round to nearest even: the lossy bf16 master

    def load(self, i: int, value: torch.Tensor) -> None:
        """Set master i from fp32 `value` (a checkpoint's), shaped like it."""
        if self.mode == "fp32":
            self.masters[i].detach().copy_(value)
        else:
            self.store(i, value)
