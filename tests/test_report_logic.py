"""The comparison report's judgement on synthetic data, in-process (fast tier): which gradient
elements are at rounding-noise level, parity verdicts and their causes, and step-time verdicts
from bootstrap intervals."""
import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from zerolab.config import ModelConfig
from zerolab.digest import gradient_noise, noise_mask
from zerolab.data import Batch
from zerolab.models import build_model
from zerolab.report import Run, bootstrap_ratio, label_runs, merge_rounds, parity, timing_verdict


# ---- noise-level gradients ---------------------------------------------------------------------
def test_noise_mask_marks_what_fp32_cannot_resolve():
    g64 = torch.tensor([0.0, 1e-17, 1e-3, -2e-4], dtype=torch.float64)
    g32 = torch.tensor([3e-10, -2e-10, 1e-3, -2e-4], dtype=torch.float32)  # fp32 rounding of the same sums
    assert noise_mask(g64, g32).tolist() == [True, True, False, False]


def test_probe_finds_exactly_the_key_third_of_the_qkv_bias():
    # The GPT's key bias shifts every score of a query's row by the same amount, which softmax
    # ignores: its true gradient is zero, and only rounding is left of it. Nothing else is.
    cfg = ModelConfig(name="gpt_tiny", bias=True)
    torch.manual_seed(0)
    weights = build_model(cfg).state_dict()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2, cfg.block_size + 1), generator=g)
    batches = [Batch(t[:, :-1], t[:, 1:]) for t in tokens]
    noise = gradient_noise(cfg, weights, batches)
    e = cfg.n_embd
    assert sorted(noise) == [f"blocks.{i}.attn.qkv.bias" for i in range(cfg.n_layer)]
    for idx in noise.values():
        assert idx.tolist() == list(range(e, 2 * e))  # q | k | v: the middle third


# ---- parity verdicts -----------------------------------------------------------------------------
def _run(tmp: Path, name: str, weights: dict, logits: torch.Tensor, noise: dict | None = None,
         strategy: dict | None = None, optim: str = "adamw") -> Run:
    d = tmp / name
    d.mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
    save_file({"logits/0": logits, "loss": torch.tensor([2.0])}, str(d / "eval_logits.safetensors"))
    if noise is not None:
        save_file(noise or {"_none": torch.zeros(0, dtype=torch.int64)}, str(d / "grad_noise.safetensors"))
    cfg = {"strategy": strategy or {"name": "ddp"}, "optim": {"name": optim}, "precision": {"name": "fp32"}}
    summary = {"steps": 10, "global_batch": 8, "model": "gpt_tiny", "optimizer": optim, "world_size": 2}
    (d / "summary.json").write_text(json.dumps(summary))
    run = Run(d, cfg, [], summary)
    label_runs([run])
    return run


def _weights(bias_shift: float = 0.0, weight_shift: float = 0.0) -> dict:
    torch.manual_seed(0)
    w = {"attn.qkv.bias": torch.randn(12), "attn.qkv.weight": torch.randn(12, 4)}
    w["attn.qkv.bias"][4:8] += bias_shift  # the "key third"
    w["attn.qkv.weight"][0, 0] += weight_shift
    return w


LOGITS = torch.linspace(-5, 5, 64).reshape(1, 4, 16)
KEY = {"attn.qkv.bias": torch.arange(4, 8)}


def test_noise_level_drift_is_listed_apart_and_does_not_decide(tmp_path):
    base = _run(tmp_path, "base", _weights(), LOGITS, noise=KEY)
    run = _run(tmp_path, "run", _weights(bias_shift=3e-4), LOGITS + 1e-6, noise=KEY,
               strategy={"name": "deepspeed", "stage": 2})
    p = parity(run, base)
    assert p["status"] == "match"
    assert p["max_rel"] == 0.0  # the rest of the weights are identical
    [row] = p["noise_level"]
    assert row["tensor"] == "attn.qkv.bias" and row["elements"] == 4 and row["of"] == 12
    assert abs(row["max_abs"] - 3e-4) < 1e-6  # float32 storage of the shift
    assert p["max_dlogit"] < 2e-6


def test_the_same_drift_without_a_probe_is_a_mismatch_naming_the_tensor(tmp_path):
    base = _run(tmp_path, "base", _weights(), LOGITS)
    run = _run(tmp_path, "run", _weights(bias_shift=3e-4), LOGITS)
    p = parity(run, base)
    assert p["status"] == "MISMATCH" and "attn.qkv.bias" in p["detail"] and "cause" not in p


def test_function_space_difference_is_a_mismatch_even_with_equal_weights(tmp_path):
    base = _run(tmp_path, "base", _weights(), LOGITS, noise={})
    run = _run(tmp_path, "run", _weights(), LOGITS * 1.01, noise={})
    p = parity(run, base)
    assert p["status"] == "MISMATCH" and p["detail"].startswith("function:")
    assert abs(p["rel_dlogit"] - 0.01) < 1e-6  # 1 % of every logit, the largest is the scale


def test_deepspeed_client_lamb_mismatch_names_the_flat_groups(tmp_path):
    base = _run(tmp_path, "base", _weights(), LOGITS, noise=KEY, optim="lamb")
    run = _run(tmp_path, "run", _weights(weight_shift=0.04), LOGITS * 1.02, noise=KEY, optim="lamb",
               strategy={"name": "deepspeed", "stage": 2, "client_optimizer": True})
    p = parity(run, base)
    assert p["status"] == "MISMATCH"
    assert "attn.qkv.weight" in p["detail"] and "function:" in p["detail"]
    assert "flat parameter groups" in p["cause"] and "stage 2" in p["cause"] and "lamb" in p["cause"]
    # stage 0 keeps per-tensor groups: no cause is claimed there
    run0 = _run(tmp_path, "run0", _weights(weight_shift=0.04), LOGITS, noise=KEY, optim="lamb",
                strategy={"name": "deepspeed", "stage": 0, "client_optimizer": True})
    assert "cause" not in parity(run0, base)


# ---- lossy runs: held within a loss band (zerolab/report/band.py) ----------------------------------
QUANTIZED = {"name": "zero3", "quantize_weights": True, "quantize_grads": True}


def _curve(seed: int, shift: float = 0.0, n: int = 60, sigma: float = 0.02) -> list[dict]:
    """A logged loss curve: a linear trend plus white noise (the noise of seed `seed`)."""
    rng = random.Random(seed)
    return [{"step": s, "loss": 3.0 - 0.005 * s + rng.gauss(0, sigma) + shift * (s > 1), "lr": 1e-3,
             "grad_norm": 1.0} for s in range(1, n + 1)]


def _banded(tmp, run_strategy, base_strategy, shift, weight_shift=0.0, steps=60):
    tmp.mkdir(exist_ok=True)
    base = _run(tmp, "base", _weights(), LOGITS, noise={}, strategy=base_strategy)
    run = _run(tmp, "run", _weights(weight_shift=weight_shift), LOGITS, noise={}, strategy=run_strategy)
    base.metrics, run.metrics = _curve(0, n=steps), _curve(0, shift, n=steps)  # the same batches: the same noise
    return parity(run, base)


def test_a_quantized_run_is_never_a_match(tmp_path):
    p = _banded(tmp_path, QUANTIZED, None, shift=0.0)  # identical weights, logits and losses
    assert p["status"] == "quantized: within band" and p["lossy"]
    assert "int8 weight all-gathers (qwZ)" in p["detail"] and "‖Δw‖/‖w‖ 0.00e+00" in p["detail"]


def test_the_band_holds_a_small_difference_and_refuses_a_large_one(tmp_path):
    # σ = 0.02: the trajectory term alone is 4·√2·σ ≈ 0.11; qwZ's forward term Z·‖g‖·max|w|/127 ≈ 0.06
    inside = _banded(tmp_path / "a", QUANTIZED, None, shift=0.05, weight_shift=0.04)
    assert inside["status"] == "quantized: within band", inside["detail"]
    assert "at all 60 logged steps" in inside["detail"] and "forward" in inside["detail"]
    outside = _banded(tmp_path / "b", QUANTIZED, None, shift=0.5)
    assert outside["status"] == "quantized: OUTSIDE BAND" and "at 59 of 60 logged steps" in outside["detail"]


def test_a_spike_a_step_later_stays_within_and_one_the_baseline_lacks_does_not(tmp_path):
    """The baseline's loss spike widens its band nearby (the burst window): the same spike one step
    later in the other run is inside (as training spikes are, at random steps); a spike of the same
    height where the baseline's curve is quiet is not."""
    base = _run(tmp_path, "base", _weights(), LOGITS, noise={})
    run = _run(tmp_path, "run", _weights(), LOGITS, noise={}, strategy=QUANTIZED)
    spike = lambda curve, at: [{**r, "loss": r["loss"] + 0.6 * (r["step"] == at)} for r in curve]
    base.metrics, run.metrics = spike(_curve(0), 30), spike(_curve(0), 31)
    assert parity(run, base)["status"] == "quantized: within band"
    base.metrics = _curve(0)
    assert parity(run, base)["status"] == "quantized: OUTSIDE BAND"


def test_a_quantized_baseline_bands_an_exact_run_too(tmp_path):
    p = _banded(tmp_path, None, {"name": "zero3", "quantize_grads": True}, shift=0.01)
    assert p["status"] == "quantized: within band" and p["detail"].startswith("the baseline (zero3)")
    assert "forward 0.00e+00" in p["detail"]  # qgZ alone rounds no weight the forward uses


def test_without_a_loss_curve_there_is_no_band(tmp_path):
    p = _banded(tmp_path, QUANTIZED, None, shift=0.0, steps=12)
    assert p["status"] == "quantized: no band" and "12 common logged steps" in p["detail"]


def test_step_noise_recovers_white_noise_around_a_trend():
    from zerolab.report.band import step_noise

    for seed in range(3):  # a curved trend: its second differences (1.5e-6) are far below the noise's
        losses = [r["loss"] - 1e-4 * r["step"] ** 1.5 for r in _curve(seed, n=200, sigma=0.05)]
        got = step_noise(losses)
        assert all(0.7 * 0.05 < g < 1.4 * 0.05 for g in got), (seed, min(got), max(got))


def test_only_zero3s_quantized_collectives_are_lossy():
    from zerolab.strategies import strategy_class

    zero3 = strategy_class("zero3")
    assert zero3.lossy({"strategy": {"name": "zero3"}}) is None
    assert zero3.lossy({"strategy": {"name": "zero3", "hpz": True}}) is None  # the same bytes, other links
    assert zero3.lossy({"strategy": QUANTIZED}).forward_levels == 127
    assert zero3.lossy({"strategy": {"name": "zero3", "quantize_grads": True}}).forward_levels == 0
    assert strategy_class("ddp").lossy({"strategy": {"name": "ddp"}}) is None


# ---- step-time verdicts --------------------------------------------------------------------------
def _steps(rng: random.Random, median_ms: float, n: int = 30, spread: float = 0.08) -> list[float]:
    """Step times with a multiplicative spread and a few slow outliers, as on a shared CPU."""
    return [median_ms * 1e-3 * (1 + rng.gauss(0, spread)) * (1.6 if rng.random() < 0.07 else 1.0) for _ in range(n)]


def _sweep(seed: int, rounds: int = 2) -> dict[str, list[list[float]]]:
    # true ratios: equal, equal, 1.3x slower, 0.75x faster; each round has its own machine-load factor
    rng = random.Random(seed)
    true = {"ddp": 1.0, "zero1": 1.0, "torch_zero": 1.0, "fsdp": 1.3, "zero2": 0.75}
    out: dict[str, list[list[float]]] = {k: [] for k in true}
    for _ in range(rounds):
        load = 1 + abs(rng.gauss(0, 0.03))
        for k, f in true.items():
            out[k].append(_steps(rng, 200 * f * load))
    return out


def _verdicts(sweep: dict) -> dict[str, str]:
    return {k: bootstrap_ratio(v, sweep["ddp"])["verdict"] for k, v in sweep.items() if k != "ddp"}


def test_verdict_is_within_noise_exactly_when_the_interval_holds_one():
    assert timing_verdict(0.97, 1.04) == "within noise"
    assert timing_verdict(1.0, 1.2) == "within noise"  # the edge counts as holding 1.0
    assert timing_verdict(1.01, 1.2) == "slower" and timing_verdict(0.8, 0.99) == "faster"
    for seed in range(10):
        for k, v in _sweep(seed).items():
            t = bootstrap_ratio(v, _sweep(seed)["ddp"])
            assert t["lo"] <= t["ratio"] <= t["hi"]
            assert (t["verdict"] == "within noise") == (t["lo"] <= 1.0 <= t["hi"]), (seed, k, t)


def test_equal_strategies_are_within_noise_and_real_differences_are_not():
    v = _verdicts(_sweep(0))
    assert v == {"zero1": "within noise", "torch_zero": "within noise", "fsdp": "slower", "zero2": "faster"}


def test_the_same_sweep_twice_gives_the_same_verdicts():
    # Two independent samples of the same machine and strategies (different seeds), and the same
    # data twice (the bootstrap is seeded: identical intervals).
    assert _verdicts(_sweep(1)) == _verdicts(_sweep(2))
    assert bootstrap_ratio(_sweep(3)["fsdp"], _sweep(3)["ddp"]) == bootstrap_ratio(_sweep(3)["fsdp"], _sweep(3)["ddp"])


def test_rounds_widen_the_interval_when_rounds_disagree():
    rng = random.Random(5)
    base = [_steps(rng, 200), _steps(rng, 200)]
    steady = [_steps(rng, 200), _steps(rng, 200)]
    drifting = [_steps(rng, 170), _steps(rng, 235)]  # one round on a quiet, one on a busy machine
    a, b = bootstrap_ratio(steady, base), bootstrap_ratio(drifting, base)
    assert b["hi"] - b["lo"] > 2 * (a["hi"] - a["lo"])
    assert b["verdict"] == "within noise"


def test_later_rounds_join_the_first_runs_of_the_same_label(tmp_path):
    runs = []
    for rnd in (0, 1):
        for name in ("ddp", "zero1"):
            r = Run(tmp_path / f"{name}-{rnd}", {"strategy": {"name": name}}, [], {})
            r.round = rnd
            runs.append(r)
    label_runs(runs)
    merged = merge_rounds(runs)
    assert [r.label for r in merged] == ["ddp", "zero1"]
    assert [x.path.name for x in merged[1].repeats] == ["zero1-1"]
