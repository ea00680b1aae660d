"""Resharding: a checkpoint saved by N ranks of ddp/zero1/zero2/zero3 resumes under M != N ranks of
any of them, and the next optimizer step equals the step the original run took.

Each source run trains K+1 steps and saves at step K; its final weights are "the step the
original run would take". The target resumes from step K with another world size (uneven
shards: gpt_tiny's tensors straddle rank boundaries at 3 ranks) and takes that one step. The
global batch (12 sequences) is the same at 1, 2 and 3 ranks, so both take the same data.

The cases are the changes to and from one rank (1->2, 1->3, 2->1, 3->1), each strategy once as a
source and once as a target: tests/test_resume_matrix.py covers 2->3 and 3->2 for every pair of
strategies (ddp, zero1-3 and the reference strategies), in fp32 and in bf16 (3->2), with the
reader's state compared bitwise. In bf16 a change to or from one rank also changes how the batch
is split, so every gradient rounds differently, not only its reduction: no bf16 case here. The
ranks run without torchrun (tests/ranks.py): what is tested is what they compute.

The comparison is of the step itself: per tensor, ‖w_target − w_original‖₂ / ‖w_original − w_K‖₂,
the share of the step that differs, the largest over tensors. A misplaced optimizer-state element
or shard makes a tensor's step wrong: a share of order 1. A correct reshard differs only by the
summation order of the step's reductions (bucketed reduce-scatter vs all-reduce over 1, 2 or 3
ranks): fp32 rounding of the gradient (~1e-7 relative) carried into one update, and in bf16 the
16-bit gradients rounded and summed in another order (bf16's ulp 2^-8 = 3.9e-3, relative).
Measured on 2026-12-01 over these and six more cases: fp32 2.9e-7 to 5.5e-7, bf16 4.1e-3 and 4.2e-3. Bounds:
fp32 1e-5 (18x the largest seen, 1e5 below a wrong step); bf16 4 x 2^-8 = 1.6e-2 (four bf16 ulps
of the gradient, 3.7x the largest seen, 60x below a wrong step).
"""
import pytest

from conftest import load_weights, rank_log, run_ranks

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

K = 3
COMMON = ["model=gpt_tiny", "model.bias=false", "data=text", f"trainer.max_steps={K + 1}", "trainer.eval_every=0",
          "optim.warmup_steps=2"]
BOUND = {"fp32": 1e-5, "bf16": 4 * 2 ** -8}  # see the module docstring

# ((source strategy, ranks), (target strategy, ranks), precision)
CASES = [(("ddp", 1), ("zero3", 3), "fp32"), (("zero3", 2), ("zero1", 1), "fp32"),
         (("zero1", 3), ("ddp", 1), "fp32"), (("zero2", 1), ("zero2", 2), "fp32")]


def batch(n: int) -> str:
    return f"data.micro_batch={12 // n}"  # global batch 12 at 1, 2 and 3 ranks


def test_the_cases_cover_every_source_target_and_change_to_or_from_one_rank():
    assert {src[0] for src, _, _ in CASES} == {dst[0] for _, dst, _ in CASES} == {"ddp", "zero1", "zero2", "zero3"}
    assert {(src[1], dst[1]) for src, dst, _ in CASES} == {(1, 2), (1, 3), (2, 1), (3, 1)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = {}

    def get(strategy: str, n: int, precision: str):
        if (strategy, n, precision) not in made:
            run = tmp_path_factory.mktemp(f"src-{strategy}-{n}-{precision}") / "run"
            run_ranks(run, n, *COMMON, batch(n), f"strategy={strategy}", f"precision={precision}",
                      f"checkpoint.every={K}")
            made[strategy, n, precision] = run
        return made[strategy, n, precision]
    return get


def step_shares(got: dict, expected: dict, before: dict) -> dict:
    """Per tensor: ‖got − expected‖ / ‖expected − before‖ (the share of the step that differs)."""
    out = {}
    for k in expected:
        step = (expected[k].double() - before[k].double()).norm()
        assert step > 0, f"{k} did not move in the step: nothing to compare"
        out[k] = ((got[k].double() - expected[k].double()).norm() / step).item()
    return out


@pytest.mark.parametrize("src,dst,precision", CASES, ids=[f"{a}{n}-to-{b}{m}-{p}" for (a, n), (b, m), p in CASES])
def test_reshard_next_step_matches(tmp_path, sources, src, dst, precision):
    from safetensors.torch import load_file

    from zerolab.checkpoint import export

    source = sources(*src, precision)
    ckpt = source / "checkpoints" / f"step_{K:08d}"
    target = tmp_path / "target"
    run_ranks(target, dst[1], *COMMON, batch(dst[1]), f"strategy={dst[0]}", f"precision={precision}",
              f"checkpoint.resume={ckpt}")
    out = rank_log(target)
    assert f"resumed at step {K}" in out and f"{src[0]}, {src[1]} ranks -> {dst[0]}, {dst[1]} ranks" in out
    export(str(ckpt), str(tmp_path / "at_k.safetensors"))
    before = load_file(str(tmp_path / "at_k.safetensors"))
    before["lm_head.weight"] = before["wte.weight"]  # exported once (tied), as the model holds it
    shares = step_shares(load_weights(target), load_weights(source), before)
    worst = max(shares, key=shares.get)
    assert shares[worst] <= BOUND[precision], (f"{src} -> {dst} {precision}: {worst} differs by "
                                               f"{shares[worst]:.3g} of its step")
