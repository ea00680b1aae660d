"""Nodes, continued (docs/nodes.md; tests/test_nodes.py holds the rest): HSDP
(strategy.shard_within=node) with LAMB, with a transformers Llama, and its checkpoints resharded
to another world size. The layout and settings are test_nodes.py's (imported): 4 gloo ranks as
2 nodes x 2 (dist.ranks_per_node=2), gpt_tiny without biases and n_embd = 62,
strategy.bucket_mb=0.05, optim.grad_clip=0.1 (every step clips), fp32, 8 steps. Jobs are trained
once per pytest invocation (conftest.shared_run): the AdamW runs of ddp, zero2 and zero3 with
shard_within=node are test_nodes.py's own when both files run.

  a. HSDP equals ddp at 4 ranks with LAMB as with AdamW (zero2 and zero3, shard_within=node):
     per tensor ‖w − w_ddp‖₂/‖w_ddp‖₂ <= 1e-6, test_nodes.py's bound and argument (the same
     additions in another order: a reduce-scatter over the node, an all-reduce across nodes; fp32
     rounding, 6e-8 per operation, barely amplified over 8 clipped steps). LAMB adds per-tensor
     norms of w and of the update from this rank's partial sums, completed over the node's group
     (ZeroBase._all_reduce): another summation order, one more rounding in each trust ratio
     and so in each step's length, and its lr is 10x AdamW's (1e-2, conf/optim/lamb.yaml).
     Measured 1.1e-7 (zero2, zero3) against AdamW's 6.2e-8 and 5.8e-8: the bound is 9x the
     largest. With the completion left out (each rank's ratio from its own shard's partial norms)
     the LAMB runs measured 1.3e-2: what a. catches. (Norms summed over both nodes would scale
     ‖w‖ and ‖u‖ alike and leave every ratio as it is; test_nodes.py's clip norm, completed over
     the same group, catches that.) The trust ratios each run logs (min/median/max over tensors)
     agree to 1e-5.
  b. The models compute the same function: the final model's logits on the fixed held-out digest
     batches (zerolab.digest: eval_logits.safetensors, the same windows at every world size),
     max |Δlogit| / max |logit_ddp| <= 1e-5, and the digest losses to 1e-5. The forward is the
     same arithmetic on weights δ <= 1.1e-7 apart per tensor (relative): to first order each of the
     T tensors on the path (15 in gpt_tiny, 21 in the Llama) moves its layer's output by about
     its own δ, and the residual stream and the norms carry that with O(1) gain, so the logits
     move by about T·δ <= 2.3e-6 of their scale; the forward's own rounding adds ~1e-7. Measured
     2.4e-7 to 3.8e-7 (gpt_tiny with AdamW and LAMB, the Llama); the bound is 4x the estimate,
     26x the largest measured, and 700x below what the broken LAMB completion above gave (7.4e-3).
  c. A tiny transformers Llama (tests/test_models.py's: grouped-query attention, untied head, a
     padding row; model=hf from a config.json written here, HF_HUB_OFFLINE=1: nothing downloads),
     AdamW, zero3 with shard_within=node vs ddp at 4 ranks: the bounds of a. and b. (measured
     weights 5.0e-8, logits 3.7e-7).
  d. Resharding: the HSDP zero3 run's checkpoint at step 4 (4 ranks, 2 x 2; only node 0 wrote
     pieces) resumed at 2 ranks under zero2 and under ddp, and a 2-rank zero3 run's checkpoint at
     step 4 resumed as 4-rank HSDP zero3, each ends at step 8 where an uninterrupted run of the
     target layout ends (its strategy and world size from step 0; the global batch is 8 sequences
     at 2 and 4 ranks: the same data). The target's first step is K + 1 (it did resume). Bound
     1e-6 per tensor, a.'s argument (the steps before and after the checkpoint add in other
     orders: rounding only); measured 5.8e-8, 5.4e-8, 5.3e-8. With Adam's first moment left out
     of the load (zero/checkpoint.py), the zero2 and zero3 targets measured 8.2e-2.
  e. A quantized run in the report (zerolab/report/band.py): zero3 with qwZ and qgZ and ddp, 24
     steps each (the band needs 20 logged steps), through `python -m zerolab compare`: the
     quantized run's parity line says "quantized: within band", never "match" nor "MISMATCH",
     and names what it rounds and the final weights' distance (measured: worst |Δloss|/band 0.36,
     ‖Δw‖/‖w‖ 3.6e-2).
  f. A checkpoint of the quantized run (qwZ and qgZ at 4 ranks as 2 x 2, step 4) holds the exact
     state (the fp32 master and Adam's moments: only what travels is rounded): resumed in the
     same layout it ends bitwise equal to the uninterrupted run (the same rounding of the same
     bytes), and resumed unquantized at 2 ranks as zero3 and as ddp the two end within 1e-6 of
     each other (a.'s argument: the same exact steps from the same loaded state, in another
     summation order), and away from the quantized run's own end (they did step unquantized).
     Measured 1.0e-8 between the two, 1.1e-2 from the quantized run's end.
  g. bf16 mixed precision (precision=bf16: bf16 weights and gradients, fp32 master and Adam
     states). hpZ equals zero3 bitwise (b.'s argument: the secondary copy holds the same bf16
     bytes the forward gathered). HSDP (zero2 and zero3 with shard_within=node) against ddp: the
     gradients are summed in bf16 in another order (the node's reduce-scatter, then across nodes,
     against one all-reduce over 4), each partial sum rounded at u = 2^-8, so each step's gradient,
     and through Adam's normalised step each update, moves by a relative ρ of a few u. Those errors
     reach the fp32 master only through the steps, whose total movement the logged update ratios
     give: Σ_t ‖Δw_t‖/‖w‖ = 0.067 here, so ‖w − w_ddp‖/‖w‖ <= ρ·0.067, under u itself for any ρ up to
     15u. The bound is u = 3.9e-3 per tensor; measured 1.2e-3 (zero2, zero3), and zero3 without
     HSDP, the same kind of reordering, 1.6e-3 against ddp: HSDP is held to at most twice that too.
     A gradient shard combined with another chunk's (an unrelated gradient: ρ ~ 1) would move them by
     ~0.067, 17 times the bound.

Measured on 2026-12-03; about a minute on 2 cores, alone or beside test_nodes.py (whose AdamW
runs it reads).
"""
from __future__ import annotations

import pytest

from conftest import assert_same_weights, load_weights, rank_log, read_metrics, rel_l2_diff, run_python, run_ranks
from test_nodes import COMMON, FP32_TOL, K, MODEL, RUNS, STEPS, WORLD

pytestmark = pytest.mark.slow  # every test here reads multi-rank jobs

LOGIT_TOL = 1e-5  # module docstring, b.
GLOBAL_BATCH = 8  # sequences per step: micro_batch 2 at 4 ranks (COMMON), 4 at 2 ranks
LAMB = ["optim=lamb"]


def at(nproc: int) -> list[str]:
    """COMMON with the micro-batch that keeps the global batch at GLOBAL_BATCH on nproc ranks."""
    return [f"data.micro_batch={GLOBAL_BATCH // nproc}" if o.startswith("data.micro_batch=") else o for o in COMMON]


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory):
    import transformers  # noqa: F401  (pinned in pyproject.toml: a broken install fails, it does not skip)

    from test_models import write_configs

    return write_configs(tmp_path_factory.mktemp("node-configs"))["llama"]


@pytest.fixture(scope="module")
def job(shared_run, tmp_path_factory, llama_config):
    """job(label, *extra, llama=False): the run directory of test_nodes.RUNS[label] at 4 ranks, or of
    LAYOUTS[label] at its ranks, with `extra`; llama: model=hf with the tiny Llama instead of
    gpt_tiny (trained here, offline)."""
    llamas: dict = {}

    def get(label: str, *extra: str, llama: bool = False):
        _, nproc, run_overrides = LAYOUTS[label] if label in LAYOUTS else (None, WORLD, RUNS[label])
        overrides = [*at(nproc), *run_overrides, *extra]
        if not llama:
            return shared_run(nproc, *overrides)
        key = (label, *extra)
        if key not in llamas:
            run = tmp_path_factory.mktemp(f"llama-{label}") / "run"
            run_ranks(run, nproc, *[o for o in overrides if o not in MODEL], "model=hf",
                      f"model.config={llama_config}", env={"HF_HUB_OFFLINE": "1"})
            llamas[key] = run
        return llamas[key]
    return get


def logit_gap(run, base) -> tuple[float, float]:
    """(max |Δlogit| / max |logit_base|, max |Δ loss|) over the digest batches (the figures of
    zerolab.report.parity.function_parity, from the files each run saved)."""
    from safetensors.torch import load_file

    a, b = load_file(str(run / "eval_logits.safetensors")), load_file(str(base / "eval_logits.safetensors"))
    keys = [k for k in b if k.startswith("logits/")]
    assert keys and a.keys() == b.keys()
    d = max((a[k].double() - b[k].double()).abs().max().item() for k in keys)
    scale = max(b[k].double().abs().max().item() for k in keys)
    return d / scale, (a["loss"].double() - b["loss"].double()).abs().max().item()


def trust_ratios(run) -> list[list[float]]:
    return [[r[k] for k in sorted(r) if "trust" in k] for r in read_metrics(run) if "grad_norm" in r]


# ---- a, b. HSDP equals ddp: AdamW and LAMB, weights and logits -----------------------------------
@pytest.mark.parametrize("optim", ["adamw", "lamb"])
@pytest.mark.parametrize("label", ["zero2_node", "zero3_node"])
def test_hsdp_equals_ddp_in_weights_and_logits(job, label, optim):
    extra = LAMB if optim == "lamb" else []
    got, ddp = job(label, *extra), job("ddp", *extra)
    diff = rel_l2_diff(load_weights(got), load_weights(ddp))
    rel_logit, d_loss = logit_gap(got, ddp)
    print(f"{label} {optim} vs ddp: weights rel L2 {diff:.3g}, logits {rel_logit:.3g}, loss {d_loss:.3g}")
    assert diff <= FP32_TOL, (label, optim, diff)
    assert rel_logit <= LOGIT_TOL and d_loss <= 1e-5, (label, optim, rel_logit, d_loss)
    if optim == "lamb":
        ratios, ref = trust_ratios(got), trust_ratios(ddp)
        assert len(ref) == STEPS and all(ref) and ratios == [pytest.approx(r, rel=1e-5) for r in ref]


# ---- c. a transformers Llama ---------------------------------------------------------------------
def test_hsdp_zero3_llama_equals_ddp(job):
    got, ddp = job("zero3_node", llama=True), job("ddp", llama=True)
    weights, ref = load_weights(got), load_weights(ddp)
    assert "lm_head.weight" in ref and "model.embed_tokens.weight" in ref  # the Llama's names, untied head
    diff = rel_l2_diff(weights, ref)
    rel_logit, d_loss = logit_gap(got, ddp)
    print(f"llama zero3_node vs ddp: weights rel L2 {diff:.3g}, logits {rel_logit:.3g}, loss {d_loss:.3g}")
    assert diff <= FP32_TOL and rel_logit <= LOGIT_TOL and d_loss <= 1e-5, (diff, rel_logit, d_loss)


# ---- d. resharding an HSDP checkpoint --------------------------------------------------------------
# label -> (strategy as the resume line names it, ranks, overrides); the sources save at step K
LAYOUTS = {"zero3_node@4": ("zero3", 4, RUNS["zero3_node"]),
           "zero3@2": ("zero3", 2, ["strategy=zero3", f"checkpoint.every={K}"]),
           "zero2@2": ("zero2", 2, ["strategy=zero2"]), "ddp@2": ("ddp", 2, ["strategy=ddp"])}
RESHARDS = [("zero3_node@4", "zero2@2"), ("zero3_node@4", "ddp@2"), ("zero3@2", "zero3_node@4")]


@pytest.mark.parametrize("src,dst", RESHARDS, ids=[f"{a}-to-{b}" for a, b in RESHARDS])
def test_hsdp_checkpoint_reshards_to_another_world_size(job, tmp_path, src, dst):
    """The target resumes from the source's step-K checkpoint and ends where the target layout's
    uninterrupted run ends (module docstring, d.)."""
    (src_name, src_n, _), (dst_name, dst_n, dst_overrides) = LAYOUTS[src], LAYOUTS[dst]
    ckpt = job(src) / "checkpoints" / f"step_{K:08d}"
    target = tmp_path / "target"
    run_ranks(target, dst_n, *at(dst_n), *dst_overrides, f"checkpoint.resume={ckpt}")
    log = rank_log(target)
    assert f"resumed at step {K}" in log and f"{src_name}, {src_n} ranks -> {dst_name}, {dst_n} ranks" in log
    assert [r["step"] for r in read_metrics(target) if "loss" in r][0] == K + 1
    diff = rel_l2_diff(load_weights(target), load_weights(job(dst)))
    print(f"{src} step {K} -> {dst}, vs {dst} uninterrupted: rel L2 {diff:.3g}")
    assert diff <= FP32_TOL, (src, dst, diff)


# ---- e. a quantized run in the report --------------------------------------------------------------
QUANTIZED = ["strategy=zero3", "strategy.quantize_weights=true", "strategy.quantize_grads=true"]
BAND_STEPS = 24  # the band needs 20 common logged steps (zerolab/report/band.py, MIN_STEPS)


def test_a_quantized_runs_parity_line_says_quantized(shared_run, tmp_path):
    longer = [o if not o.startswith("trainer.max_steps=") else f"trainer.max_steps={BAND_STEPS}" for o in COMMON]
    base, run = shared_run(WORLD, *longer, "strategy=ddp"), shared_run(WORLD, *longer, *QUANTIZED)
    out = tmp_path / "report"
    run_python("-m", "zerolab", "compare", str(base), str(run), "--out", str(out), "--wandb", "disabled",
               "--fail-on-mismatch")  # within its band: not a failure
    parity = (out / "report.md").read_text().split("## Parity")[1].split("\n## ")[0]
    [row] = [line for line in parity.splitlines() if line.startswith("| zero3 ")]
    [note] = [line for line in parity.splitlines() if line.startswith("- **zero3**")]
    print(row, note, sep="\n")
    assert "**quantized: within band**" in row and "match" not in row.lower()
    assert "int8 weight all-gathers (qwZ)" in note and f"at all {BAND_STEPS} logged steps" in note
    assert "final weights ‖Δw‖/‖w‖" in note


# ---- f. a quantized run's checkpoint, resumed --------------------------------------------------------
def test_a_quantized_checkpoint_resumes_exactly_and_unquantized_at_two_ranks(shared_run, tmp_path):
    source = shared_run(WORLD, *at(WORLD), *QUANTIZED, f"checkpoint.every={K}")
    ckpt = source / "checkpoints" / f"step_{K:08d}"
    same = tmp_path / "same"
    run_ranks(same, WORLD, *at(WORLD), *QUANTIZED, f"checkpoint.resume={ckpt}")
    assert f"resumed at step {K}" in rank_log(same)
    assert_same_weights(load_weights(same), load_weights(source), "quantized zero3 resumed vs uninterrupted")
    ends = {}
    for name in ("zero3", "ddp"):
        target = tmp_path / name
        run_ranks(target, 2, *at(2), f"strategy={name}", f"checkpoint.resume={ckpt}")
        assert f"zero3, {WORLD} ranks -> {name}, 2 ranks" in rank_log(target)
        ends[name] = load_weights(target)
    diff, away = rel_l2_diff(ends["zero3"], ends["ddp"]), rel_l2_diff(ends["ddp"], load_weights(source))
    print(f"quantized step {K} -> zero3@2 vs ddp@2: rel L2 {diff:.3g}; ddp@2 vs the quantized run's end {away:.3g}")
    assert diff <= FP32_TOL and away > 100 * FP32_TOL, (diff, away)


# ---- g. bf16 mixed precision -----------------------------------------------------------------------
BF16_TOL = 2.0 ** -8  # module docstring, g.: bf16's unit roundoff


def test_bf16_hpz_is_bitwise_zero3_and_hsdp_within_bf16_rounding_of_ddp(shared_run):
    bf16 = lambda label: load_weights(shared_run(WORLD, *COMMON, *RUNS[label], "precision=bf16"))
    ddp, zero3 = bf16("ddp"), bf16("zero3")
    assert_same_weights(bf16("zero3_hpz"), zero3, "bf16 hpz vs zero3")
    flat = rel_l2_diff(zero3, ddp)
    ratios = [r["update_ratio"] for r in read_metrics(shared_run(WORLD, *COMMON, *RUNS["ddp"], "precision=bf16"))
              if "update_ratio" in r]
    print(f"bf16 zero3 vs ddp {flat:.3g}; Σ update ratios {sum(ratios):.3g}")
    assert len(ratios) == STEPS and sum(ratios) < 0.1  # the movement the bound's argument takes
    for label in ("zero2_node", "zero3_node"):
        diff = rel_l2_diff(bf16(label), ddp)
        print(f"bf16 {label} vs ddp: rel L2 {diff:.3g}")
        assert diff <= BF16_TOL and diff <= 2 * flat, (label, diff, flat)
