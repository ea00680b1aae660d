"""The fp32 master as the bf16 weight plus a 16-bit remainder (zerolab/master.py), and the optimizer
step over state stored in other dtypes (zerolab/optim/stored.py): exact where it says exact, the
same arithmetic as an fp32-master run where it says lossy, and the modes refused where they do not
apply (zerolab/precision_modes.py)."""
from types import SimpleNamespace

import pytest
import torch

from zerolab.errors import ConfigError
from zerolab.master import MasterStorage, rebuild, round_to_bf16_, split_, stand_in
from zerolab.optim import build_optimizer
from zerolab.optim.segments import ShardMap, Segment
from zerolab.precision import MasterCopy, Precision
from zerolab.memory import predict, shape_from_params
from zerolab.memory.cli import format_modes, mode_rows
from zerolab.strategies import strategy_class
from zerolab.precision_modes import TABLE_MODES, Mode, check_precision_modes, model_state_bytes
from zerolab.schema import OptimConfig, PrecisionConfig

# Low halves sampled against every high half: the edges of the rounding (0, 1, just below, at and
# above the tie 0x8000, the top) and 56 others spread over the range, 4M patterns in all.
_EDGES = [0, 1, 2, 0x3FFF, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0x8002, 0xBFFF, 0xFFFE, 0xFFFF]
LOWS = torch.tensor(_EDGES + torch.randint(0, 1 << 16, (56,), generator=torch.Generator().manual_seed(0)).tolist())


def _patterns(lows=LOWS) -> torch.Tensor:
    """fp32 tensors of every high half with each of `lows`."""
    high = torch.arange(1 << 16, dtype=torch.int64)
    bits = ((high[:, None] << 16) | lows[None, :].long()).reshape(-1)
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # as signed 32-bit patterns


def _split(m: torch.Tensor):
    w, r = torch.empty(m.shape, dtype=torch.bfloat16), torch.empty(m.shape, dtype=torch.int16)
    split_(m, w, r)
    return w, r


def test_every_high_half_with_a_dense_sample_of_low_halves_comes_back_bit_for_bit():
    m = _patterns()
    w, r = _split(m)
    back = rebuild(w, r)
    nan = torch.isnan(m)
    assert torch.equal(back.view(torch.int32)[~nan], m.view(torch.int32)[~nan])
    # a NaN master gets a NaN weight and rebuilds to a NaN (master.py: no 16+16 pairing keeps every NaN)
    assert torch.isnan(w[nan]).all() and torch.isnan(back[nan]).all()
    assert int(nan.sum()) == 2 * 127 * len(LOWS) + 2 * int((LOWS > 0).sum())  # all of them were sampled


def test_the_weight_is_torch_rounding_except_at_even_ties_where_it_goes_away_from_zero():
    m = _patterns()
    w, _ = _split(m)
    ours, rne = w.view(torch.int16).long() & 0xFFFF, m.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    bits = m.view(torch.int32).long() & 0xFFFFFFFF
    high, low = bits >> 16, bits & 0xFFFF
    finite_or_inf = ~torch.isnan(m)
    even_tie = (low == 0x8000) & (high % 2 == 0)
    assert torch.equal((ours != rne) & finite_or_inf, even_tie & finite_or_inf)
    # there the weight is torch's plus one ulp in magnitude: away from zero, the sign kept
    assert torch.equal(ours[even_tie & finite_or_inf], rne[even_tie & finite_or_inf] + 1)
    # and an fp32-master run can derive its weights the same way
    w2 = torch.empty_like(w)
    round_to_bf16_(m, w2, "nearest_away")
    assert torch.equal(w2.view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("value, weight, remainder", [
    (0.0, 0x0000, 0), (-0.0, 0x8000, 0), (float("inf"), 0x7F80, 0), (float("-inf"), 0xFF80, 0),
    (1.0, 0x3F80, 0), (-2.5, 0xC020, 0),
    # the largest finite fp32: past bf16's largest value plus half its ulp, so its weight is inf
    # (as torch's rounding gives), and the remainder still rebuilds it
    (3.4028234663852886e38, 0x7F80, -1),
])
def test_special_values(value, weight, remainder):
    m = torch.tensor([value], dtype=torch.float32)
    w, r = _split(m)
    assert w.view(torch.int16).item() & 0xFFFF == weight and r.item() == remainder
    assert torch.equal(rebuild(w, r).view(torch.int32), m.view(torch.int32))


def test_subnormals_and_the_binade_boundaries_carry_correctly():
    """Rounding on the bit pattern carries out of the mantissa into the exponent: the largest
    subnormal rounds up to the smallest normal, 1.99999 up to 2."""
    for bits, expected in ((0x007FFFFF, 0x0080), (0x3FFFFFFF, 0x4000), (0x00008000, 0x0001), (0x80008000, 0x8001)):
        m = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
        w, r = _split(m)
        assert w.view(torch.int16).item() & 0xFFFF == expected
        assert torch.equal(rebuild(w, r).view(torch.int32), m.view(torch.int32))


def test_ties_to_even_cannot_pair_with_16_bits():
    """The counting master.py rests on: under round-to-nearest-even an even bf16 value is the
    rounding of 2^16 + 1 fp32 patterns, an odd one of 2^16 - 1 (around 1.0: 0x3F80 and 0x3F81)."""
    bits = torch.arange((0x3F7F << 16), (0x3F83 << 16), dtype=torch.int64).to(torch.int32)
    rounded = bits.view(torch.float32).to(torch.bfloat16).view(torch.int16).long()
    counts = {h: int((rounded == h).sum()) for h in (0x3F80, 0x3F81, 0x3F82)}
    assert counts == {0x3F80: (1 << 16) + 1, 0x3F81: (1 << 16) - 1, 0x3F82: (1 << 16) + 1}
    w, _ = _split(bits.view(torch.float32))
    ours = w.view(torch.int16).long()
    assert all(int((ours == h).sum()) == 1 << 16 for h in (0x3F80, 0x3F81, 0x3F82))


# ---- the optimizer over stored state -------------------------------------------------------------------
OPTIMS = [("adamw", {}), ("adam", {"weight_decay": 0.01}), ("sgd_momentum", {}), ("lamb", {}), ("lars", {}),
          ("adamw", {"impl": "foreach"})]
SIZES = (37, 164, 200)  # three tensors; the flat layout below puts one across two pieces and chunks


def _groups(params, flat: bool, extra: dict | None = None) -> list[dict]:
    """Whole tensors (ddp's groups), or a flat group of two pieces (167 and 234 elements) holding
    three tensors, the second of which straddles the pieces (a zero1/zero2 shard), chunked every
    64 elements (stored.ALIGN), so chunks cut tensors too."""
    extra = extra or {}
    if not flat:
        return [{"params": params, "names": ["a", "b", "c"], "weight_decay": 0.1, **extra}]
    segs = [Segment(0, 0, 37, 0, slab=0), Segment(1, 37, 167, 0, slab=0), Segment(1, 0, 34, 130, slab=1),
            Segment(2, 34, 234, 0, slab=1)]
    return [{"params": params, "shard": ShardMap(segs, 3, lambda t: None), "names": ["a", "b", "c"],
             "weight_decay": 0.1, "stored_slice": 64, **extra}]


def _start(flat: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sizes = (167, 234) if flat else SIZES
    # masters that start as bf16 values, as zerolab's do (the model is placed in bf16 first)
    return [torch.randn(n, generator=gen).to(torch.bfloat16).float() for n in sizes]


def _grads(flat: bool, steps: int):
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(p.numel(), generator=gen) for p in _start(flat)] for _ in range(steps)]


def _reference(name, kw, flat, steps, after=None):
    """The fp32-master run: fp32 params updated in place; `after(opt, params)` models a lossy storage."""
    params = [torch.nn.Parameter(p.clone()) for p in _start(flat)]
    opt = build_optimizer(OptimConfig(name=name, **kw), _groups(params, flat))
    for grads in _grads(flat, steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        if after:
            after(opt, params)
    return params, opt


def _stored(name, kw, flat, steps, master="remainder", states=None, track=False):
    start = _start(flat)
    stand_ins = [stand_in(p.shape, p.device) for p in start]
    weights = [p.to(torch.bfloat16) for p in start]
    keys = {}  # where the test reads the storage back
    if master != "fp32":
        keys["weights"] = weights
    if master == "remainder":
        keys["remainders"] = [torch.zeros(p.shape, dtype=torch.int16) for p in start]
    if master == "fp32":
        stand_ins = [torch.nn.Parameter(p.clone()) for p in start]
    group = {"state_dtype": states} if states else {}
    if master != "fp32":
        group["master"] = MasterStorage(master, stand_ins, keys["weights"], keys.get("remainders", []))
    opt = build_optimizer(OptimConfig(name=name, **kw), _groups(stand_ins, flat, group))
    records = []
    for grads in _grads(flat, steps):
        for p, g in zip(stand_ins, grads):
            p.grad = g.clone()
        opt.track_updates = track
        opt.step()
        records += opt.pop_update_stats()
    return stand_ins, keys, opt, records


@pytest.mark.parametrize("flat", [False, True], ids=["whole", "flat"])
@pytest.mark.parametrize("name, kw", OPTIMS, ids=[n + ("-" + "-".join(kw) if kw else "") for n, kw in OPTIMS])
def test_a_remainder_run_rebuilds_the_fp32_master_runs_weights_bit_for_bit(name, kw, flat):
    ref, ref_opt = _reference(name, kw, flat, steps=12)
    _, keys, opt, _ = _stored(name, kw, flat, steps=12)
    for want, w, r in zip(ref, keys["weights"], keys["remainders"]):
        assert torch.equal(rebuild(w, r).view(torch.int32), want.detach().view(torch.int32))
        expect = torch.empty_like(w)
        round_to_bf16_(want.detach(), expect, "nearest_away")
        assert torch.equal(w.view(torch.int16), expect.view(torch.int16))
    # the state is the fp32 run's too, stored in fp32
    ref_state = [v for p in ref for k, v in ref_opt.state[p].items() if k != "step"]
    state = [v for g in opt.param_groups for p in g["params"] for k, v in opt.state[p].items() if k != "step"]
    assert len(state) == len(ref_state) and all(torch.equal(a, b) for a, b in zip(state, ref_state))


def _round_master(opt, params):
    for p in params:
        p.data.copy_(p.data.to(torch.bfloat16).float())


def _round_states(opt, params):
    for p in params:
        for k, v in opt.state[p].items():
            if k != "step":
                v.copy_(v.to(torch.bfloat16).float())


@pytest.mark.parametrize("flat", [False, True], ids=["whole", "flat"])
@pytest.mark.parametrize("master, states", [("bf16", None), ("fp32", torch.bfloat16), ("bf16", torch.bfloat16),
                                            ("remainder", torch.bfloat16)])
@pytest.mark.parametrize("name", ["adamw", "lamb", "lars"])
def test_a_lossy_mode_is_the_fp32_arithmetic_with_its_storage_rounded(name, master, states, flat):
    """The same code path: the lossy modes equal the fp32 run in which the master and/or the state
    are rounded to bf16 after every update (to nearest even, as the stored copy rounds)."""
    def after(opt, params):
        if master == "bf16":
            _round_master(opt, params)
        if states is not None:
            _round_states(opt, params)

    ref, ref_opt = _reference(name, {}, flat, steps=8, after=after)
    stand_ins, keys, opt, _ = _stored(name, {}, flat, steps=8, master=master, states=states)
    for i, want in enumerate(ref):
        got = {"fp32": lambda: stand_ins[i].detach(), "bf16": lambda: keys["weights"][i].float(),
               "remainder": lambda: rebuild(keys["weights"][i], keys["remainders"][i])}[master]()
        assert torch.equal(got, want.detach())
        for k, v in ref_opt.state[want].items():
            if k != "step":
                stored = opt.state[stand_ins[i]][k]
                assert stored.dtype == (states or torch.float32) and torch.equal(stored.float(), v)


def test_the_device_side_skip_leaves_a_stored_group_untouched():
    stand_ins, keys, opt, _ = _stored("adamw", {}, True, steps=2, states=torch.bfloat16)
    assert opt.skips_on_device()  # AdamW's fused kernel runs on the fp32 pieces
    before = ([w.clone() for w in keys["weights"]], [r.clone() for r in keys["remainders"]],
              {k: v.clone() for p in stand_ins for k, v in opt.state[p].items()})
    for p in stand_ins:
        p.grad = torch.full(p.shape, 3.0)
    opt.step_unless(torch.tensor(True))
    assert all(torch.equal(a, b) for a, b in zip(before[0], keys["weights"]))
    assert all(torch.equal(a, b) for a, b in zip(before[1], keys["remainders"]))
    after = {k: v for p in stand_ins for k, v in opt.state[p].items()}
    assert all(torch.equal(before[2][k], after[k]) for k in after)
    _, _, lamb, _ = _stored("lamb", {}, True, steps=1)
    assert not lamb.skips_on_device()  # LAMB's composed path decides on the host


def test_the_recorded_update_is_what_landed_in_the_storage():
    for master in ("remainder", "bf16"):
        stand_ins, keys, opt, _ = _stored("adamw", {}, True, steps=1, master=master)
        before = [rebuild(w, r) if master == "remainder" else w.float()
                  for w, r in zip(keys["weights"], keys.get("remainders", keys["weights"]))]
        for p in stand_ins:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(5))
        opt.track_updates = True
        opt.step()
        (rec,) = opt.pop_update_stats()
        after = [rebuild(w, r) if master == "remainder" else w.float()
                 for w, r in zip(keys["weights"], keys.get("remainders", keys["weights"]))]
        landed = sum((a - b).pow(2).sum() for a, b in zip(after, before))
        # the record sums the same squares over segments and chunks in another order: fp32
        # summation of ~200 terms, relative 1e-6 is a hundred times its rounding
        assert rec["partial"] and rec["update_sq"].sum().item() == pytest.approx(landed.item(), rel=1e-6)
        assert opt.last_working_bytes > 0


def test_the_working_copies_are_one_chunk_for_elementwise_updates_and_the_shard_for_lamb():
    _, _, adamw, _ = _stored("adamw", {}, True, steps=1, states=torch.bfloat16)
    # a chunk of 64 elements: fp32 master 4 + two fp32 moments 8, plus the split's int16 and flag 3
    assert adamw.last_working_bytes == 64 * (4 + 8) + 64 * 3
    _, _, lamb, _ = _stored("lamb", {}, True, steps=1, states=torch.bfloat16)
    assert lamb.last_working_bytes == 401 * (4 + 8) + 234 * 3  # both pieces at once; the split is per piece


# ---- MasterCopy (ddp's master) in each mode --------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fp32", "remainder", "bf16"])
def test_master_copy_modes_round_trip_an_fp32_master(mode):
    params = [torch.nn.Parameter(torch.randn(5, 3).to(torch.bfloat16)), torch.nn.Parameter(torch.zeros(4,
                                                                                          dtype=torch.bfloat16))]
    prec = Precision.from_config(PrecisionConfig(name="bf16", master=mode))
    mc = MasterCopy(params, prec)
    groups = mc.groups([{"params": params, "names": ["w", "b"]}])
    assert [tuple(m.shape) for m in groups[0]["params"]] == [(5, 3), (4,)]
    assert all(m.untyped_storage().nbytes() == 0 for m in groups[0]["params"]) == (mode != "fp32")
    value = torch.randn(5, 3)
    mc.load_fp32(0, value)
    want = value if mode != "bf16" else value.to(torch.bfloat16).float()
    assert torch.equal(mc.fp32(0), want if mode != "fp32" else want)
    expect_w = torch.empty(5, 3, dtype=torch.bfloat16)
    round_to_bf16_(value, expect_w, prec.weight_rounding)
    assert torch.equal(params[0].detach(), expect_w)
    assert prec.weight_rounding == ("nearest_away" if mode == "remainder" else "nearest_even")


# ---- refused where they do not apply ---------------------------------------------------------------------
class _Strategy:
    def __init__(self, name, reads=()):
        self.name, self._reads = name, set(reads)

    def reads(self, key, cfg):
        return key in self._reads


MODE_READERS = {"zero2": _Strategy("zero2", ("precision.master", "precision.optim_states", "precision.grad_shard",
                                             "precision.weight_rounding")), "fsdp": _Strategy("fsdp")}


def _cfg(strategy="zero2", **precision):
    return SimpleNamespace(precision=PrecisionConfig(**{"name": "bf16", **precision}),
                           strategy=SimpleNamespace(name=strategy))


@pytest.mark.parametrize("precision, match", [
    ({"name": "fp32", "master": "remainder"}, "needs precision=bf16: under precision=fp32 the fp32 weights"),
    ({"name": "fp16", "master": "remainder"}, "not the top half"),
    ({"name": "fp32", "master": "bf16"}, "round every update"),
    ({"name": "fp16", "master": "bf16"}, "fewer than the fp16 weights"),
    ({"name": "fp16", "grad_shard": "bf16"}, "unscaled in fp32"),
    ({"master": "remainder", "weight_rounding": "nearest_even"}, "ties away from zero"),
    ({"master": "half"}, "allowed values: fp32, remainder, bf16"),
    ({"name": "bf16_pure", "optim_states": "bf16"}, "in bf16 already"),
])
def test_a_mode_that_does_not_apply_is_refused_with_the_fix(precision, match):
    with pytest.raises(ConfigError, match=match):
        check_precision_modes(_cfg(**precision), MODE_READERS["zero2"], MODE_READERS)


def test_a_strategy_that_does_not_keep_its_master_that_way_is_refused_naming_those_that_do():
    with pytest.raises(ConfigError, match="strategy=fsdp does not keep its master that way; zero2 does.*deepspeed"):
        check_precision_modes(_cfg("fsdp", master="remainder"), MODE_READERS["fsdp"], MODE_READERS)
    check_precision_modes(_cfg("zero2", master="remainder", optim_states="bf16"), MODE_READERS["zero2"], MODE_READERS)
    check_precision_modes(_cfg("fsdp"), MODE_READERS["fsdp"], MODE_READERS)  # the defaults need nobody


# ---- bytes per parameter, and the verdict ----------------------------------------------------------------
def test_bytes_per_parameter_of_the_remainder_modes_are_the_issues_figures():
    N = 8
    b = lambda stage, **m: sum(model_state_bytes(stage, N, Mode(**m)).values())
    assert b(0) == 16 and b(0, master="remainder") == 14
    assert b(1) == 4 + 16 / N and b(1, master="remainder") == 4 + 14 / N
    assert b(1, master="remainder", grad_shard="bf16") == 4 + 10 / N
    assert b(2) == 2 + 16 / N and b(2, master="remainder", grad_shard="bf16") == 2 + 12 / N
    assert b(3) == 16 / N and b(3, master="remainder") == 14 / N
    assert b(3, master="bf16", optim_states="bf16") == 8 / N  # DeepSpeed's bf16 master and states
    paper = lambda stage: sum(model_state_bytes(stage, N, Mode(), zerolab=False).values())
    assert (paper(0), paper(1), paper(2), paper(3)) == (16, 4 + 12 / N, 2 + 14 / N, 16 / N)


@pytest.mark.parametrize("mode", TABLE_MODES, ids=lambda m: m.label)
def test_the_ledger_holds_every_mode_to_its_closed_form(mode):
    """The ledger's terms (the sharder's own packing, padding included) against the closed forms
    above, for a 7B shape at 64 ranks: equal up to the buckets' padding (the bound's argument is beside it)."""
    shape = shape_from_params(6.74e9)
    for name, stage in mode_rows():
        if not all(strategy_class(name).reads(key, None) for key in mode.keys):
            continue
        ledger = predict(shape, name, 64, "bf16", "adamw", mode=mode).bytes()["model_states"] / shape.n_params
        # rel=1e-6: a bucket is padded by fewer than N = 64 elements, and a bare parameter count packs
        # into one bucket (buckets.zero_buckets), so the padding is < 64 / 6.74e9 ≈ 1e-8 of Ψ: 100x room
        assert ledger == pytest.approx(sum(model_state_bytes(stage, 64, mode).values()), rel=1e-6), (name, mode)


def test_memory_shows_a_column_per_mode_beside_the_papers():
    table = format_modes(shape_from_params(6.74e9), 64, "adamw")
    zero3 = next(line for line in table.splitlines() if line.startswith("zero3"))
    assert zero3.split()[1:4] == ["0.25", "0.25", "0.2188"]  # paper, fp32 master (16/N), remainder (14/N)
    assert "(lossy)" in table and "master remainder" in table


def test_a_lossy_mode_is_named_for_the_reports_band_and_the_remainder_is_not():
    from zerolab.strategies.ddp import DDPStrategy
    from zerolab.strategies.zero.stage3 import Zero3Strategy

    run = lambda accum=1, **p: {"precision": {"name": "bf16", **p}, "trainer": {"grad_accum_steps": accum}}
    assert DDPStrategy.lossy(run(master="remainder")) is None  # exact: the usual match/MISMATCH verdict
    assert strategy_class("zero2").lossy(run(grad_shard="bf16")) is None  # nothing summed in bf16
    assert "summing 4 micro-batches" in strategy_class("zero2").lossy(run(4, grad_shard="bf16")).what
    lossy = DDPStrategy.lossy(run(master="bf16", optim_states="bf16"))
    assert lossy.kind == "lossy" and "precision.master=bf16, precision.optim_states=bf16" in lossy.what
    both = Zero3Strategy.lossy({**run(master="bf16"), "strategy": {"quantize_grads": True}})
    assert both.kind == "quantized" and "qgZ" in both.what and "precision.master=bf16" in both.what


@pytest.mark.parametrize("overrides, match", [
    (["precision=fp16", "precision.master=bf16"], "fewer than the fp16 weights"),
    (["strategy=fsdp", "precision=bf16", "precision.master=remainder"], "ddp, zero1, zero2, zero3 do"),
    (["strategy=zero3", "precision=bf16", "precision.grad_shard=bf16"], "zero1, zero2 do"),
])
def test_the_checked_config_refuses_a_mode_that_does_not_apply(overrides, match):
    """The same checks through zerolab.config.validate, which train.py runs before any rank trains
    (a ConfigError is its exit 2: tests/test_config.py runs one through train.py)."""
    from zerolab.config import compose

    with pytest.raises(ConfigError, match=match):
        compose(["model=gpt_tiny", *overrides])
