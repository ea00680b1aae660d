"""Any strategy resumes any other's checkpoint at another world size, with its optimizer state.

The writers: ddp, zero1, zero2, zero3, DeepSpeed stages 1-3, torch_zero and fsdp, each a 2-rank
fp32 run of gpt_tiny that saves at step K and goes on to K + 2; and in bf16 one writer of each
library (zerolab's zero3, DeepSpeed stage 2, torch's fsdp) on 3 ranks. The readers: every
strategy, one launch each (tests/workers/resume_matrix.py), resuming every fp32 checkpoint on 3
ranks and, in another launch, every bf16 one on 2. Beside the matrix: offload and HSDP across
libraries (CROSS), and fp16 with its dynamic loss scale between zerolab's scaler and DeepSpeed's,
both ways (FP16_CELLS). The global batch is 12 sequences at 2 and 3 ranks, so a reader's steps
after K take the data the writer's took.

Two checks per cell:
1. The state the reader holds right after loading, saved by the reader itself at step K in its own
   layout, equals the writer's checkpoint at step K tensor by tensor, bitwise: every master and
   every optimizer state tensor, assembled from either side's pieces; the optimizer's step count,
   the LR schedule's next lr and the data position are equal too. A misplaced element, a lost
   state, a fresh optimizer or a lost counter fails this exactly.
2. The run continues: the reader's weights after steps K+1 and K+2 against the writer's own, per
   tensor as a share of the writer's two steps, ‖w_reader − w_writer‖ / ‖w_writer − w_K‖, the
   largest over tensors (tests/test_checkpoint_reshard.py's measure). From the same state the two
   differ only by the summation order of their reductions (another world size, another library's
   bucketing and kernels): fp32 rounding of the gradients, ~1e-7 relative, carried through two
   updates; in bf16, 16-bit gradients rounded and summed in another order (bf16's ulp 2^-8
   relative). A fresh optimizer's first Adam update is lr·sign(g) where the writer's is
   lr·m/√v: a share of order 1 (tests/test_resume_strategies.py shows it).
   Measured on 2026-12-06 over all 81 fp32 and 27 bf16 cells: fp32 4.3e-7 to 1.8e-6 (the largest
   between DeepSpeed's Adam kernel and torch's: 4.3e-7 to 5.1e-7 within one library), bf16 3.6e-3 to
   4.4e-3; the offload and HSDP cells 5.1e-7 to 1.8e-6; fp16 (gradients rounded to 2^-11 relative)
   3.8e-4 and 4.2e-4. Bounds: fp32 1e-5 (5.5x the largest seen), bf16 4 x 2^-8 = 1.6e-2 (four bf16
   ulps of the gradient, 3.5x the largest seen), fp16 4 x 2^-11 = 2.0e-3 (four fp16 ulps, 4.6x):
   the resharding tests' argument (tests/test_checkpoint_reshard.py), each far below a wrong
   state's order 1.
"""
import json
from pathlib import Path

import pytest
import torch

from conftest import load_weights

pytestmark = pytest.mark.slow  # every test here starts processes (see conftest: tiers)

import deepspeed  # noqa: F401,E402  (pinned: a broken install fails, it does not skip)

K = 3
COMMON = ["model=gpt_tiny", "model.bias=false", "data=text", "trainer.eval_every=0", "optim.warmup_steps=2",
          f"trainer.max_steps={K + 2}"]
STRATEGIES = {"ddp": ["strategy=ddp"], "zero1": ["strategy=zero1"], "zero2": ["strategy=zero2"],
              "zero3": ["strategy=zero3"], "ds1": ["strategy=deepspeed", "strategy.stage=1"],
              "ds2": ["strategy=deepspeed", "strategy.stage=2"], "ds3": ["strategy=deepspeed", "strategy.stage=3"],
              "torch_zero": ["strategy=torch_zero"], "fsdp": ["strategy=fsdp"]}
# Offload and HSDP, across libraries: (writer, reader) cells beside the matrix, fp32, 2 -> 3 ranks.
# HSDP here is one rank per node (dist.ranks_per_node=1): every node a replica, only node 0's rank
# writing pieces.
BOTH = ["strategy.offload_optimizer=true", "strategy.offload_params=true"]
VARIANTS = {"zero3-offload": ["strategy=zero3", *BOTH], "ds3-offload": [*STRATEGIES["ds3"], *BOTH],
            "ds2-offload": [*STRATEGIES["ds2"], "strategy.offload_optimizer=true"],
            "fsdp-offload": ["strategy=fsdp", *BOTH],
            "zero2-offload": ["strategy=zero2", "strategy.offload_optimizer=true"],
            "zero2-hsdp": ["strategy=zero2", "strategy.shard_within=node", "dist.ranks_per_node=1"],
            "zero3-hsdp": ["strategy=zero3", "strategy.shard_within=node", "dist.ranks_per_node=1"]}
STRATEGIES = {**STRATEGIES, **VARIANTS}
CROSS = [("zero3-offload", "ds3-offload"), ("ds2-offload", "fsdp-offload"), ("fsdp-offload", "zero2-offload"),
         ("zero2-hsdp", "ds2"), ("ds3-offload", "zero3-hsdp")]
MATRIX = ["ddp", "zero1", "zero2", "zero3", "ds1", "ds2", "ds3", "torch_zero", "fsdp"]
WRITERS = {"fp32": (2, MATRIX), "bf16": (3, ["zero3", "ds2", "fsdp"]),  # precision: (ranks, writers)
           "fp16": (2, ["zero2", "ds2"])}
READER_RANKS = {"fp32": 3, "bf16": 2, "fp16": 3}
BOUND = {"fp32": 1e-5, "bf16": 4 * 2 ** -8, "fp16": 4 * 2 ** -11}  # see the module docstring
# fp16's dynamic loss scale between the libraries (DeepSpeed keeps its own scaler), both ways: the
# scale doubles every 2 clean steps here, so by step K it has grown and its clean-step count is not 0.
# When it next doubles follows each library's own rule (DeepSpeed's a step after zerolab's), so the
# scale stays far below an overflow (an overflow in one run and not the other skips a step there).
FP16 = ["precision=fp16", "precision.initial_scale=1024", "precision.growth_interval=2"]
FP16_CELLS = [("zero2", "ds2"), ("ds2", "zero2")]


def batch(n: int) -> str:
    return f"data.micro_batch={12 // n}"  # global batch 12 at 2 and 3 ranks


def test_the_matrix_covers_every_strategy_each_library_in_bf16_and_both_world_changes():
    assert set(WRITERS["fp32"][1]) == {name for name in STRATEGIES if name not in VARIANTS}
    assert {"zero3", "ds2", "fsdp"} <= set(WRITERS["bf16"][1])  # zerolab's, DeepSpeed's, torch's
    assert {(WRITERS[p][0], READER_RANKS[p]) for p in WRITERS} == {(2, 3), (3, 2)}


@pytest.fixture(scope="module")
def writers(tmp_path_factory):
    """(precision, writer) -> its run directory, each written once per module."""
    import ranks

    made = {}

    def get(precision: str, name: str) -> Path:
        if (precision, name) not in made:
            n = WRITERS[precision][0]
            run = tmp_path_factory.mktemp(f"w-{name}-{precision}") / "run"
            ranks.call(run, n, "workers.resume_matrix:train", *COMMON, batch(n), *STRATEGIES[name],
                       *precision_overrides(precision), f"checkpoint.every={K}", f"run.dir={run}",
                       "logging.wandb.mode=disabled", "logging.progress=false")
            made[precision, name] = run
        return made[precision, name]
    return get


def precision_overrides(precision: str) -> list[str]:
    return FP16 if precision == "fp16" else [f"precision={precision}"]


def assembled(path: Path) -> dict:
    """Every tensor of a checkpoint's pieces, whole: key -> 1-D tensor."""
    from zerolab.checkpoint import PieceReader, read_meta

    meta = read_meta(str(path))
    read = PieceReader(str(path), meta)
    out = {}
    for key in meta["pieces"]:
        n = int(torch.tensor(meta["params"][key.split("/", 1)[1]]).prod())
        out[key] = read(key, 0, n)
    return out, meta


def state_differences(written: Path, loaded: Path) -> list[str]:
    """Check 1 of the module docstring: what differs between the writer's checkpoint and the
    reader's state right after loading."""
    a, meta_a = assembled(written)
    b, meta_b = assembled(loaded)
    problems = [f"keys only in the writer's: {sorted(set(a) - set(b))[:4]}"] if set(a) - set(b) else []
    problems += [f"keys only in the reader's: {sorted(set(b) - set(a))[:4]}"] if set(b) - set(a) else []
    problems += [f"{k} differs" for k in sorted(set(a) & set(b))
                 if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])][:4]
    for field, get in (("step count", lambda m: m["optimizer_scalars"]["step"]["value"]),
                       ("loss scaler", lambda m: m["loss_scaler"]),
                       ("next lr", lambda m: m["lr_schedule"]["next_lr"]),
                       ("data position", lambda m: m["sampler"]["next_step"])):
        if get(meta_a) != get(meta_b):
            problems.append(f"{field}: {get(meta_a)} written, {get(meta_b)} held")
    return problems


def continuation_share(writer: Path, reader: Path, tmp_path: Path) -> tuple[float, str]:
    """Check 2 of the module docstring: the largest share of the writer's steps after K by which
    the reader's weights differ, and the tensor."""
    from safetensors.torch import load_file

    from zerolab.checkpoint import export

    at_k = tmp_path / f"at_k_{writer.parent.name}.safetensors"
    if not at_k.exists():
        export(str(writer / "checkpoints" / f"step_{K:08d}"), str(at_k))
    before = load_file(str(at_k))
    before["lm_head.weight"] = before["wte.weight"]  # exported once (tied), as the model holds it
    got, expected = load_weights(reader), load_weights(writer)
    shares = {k: ((got[k].double() - expected[k].double()).norm()
                  / (expected[k].double() - before[k].double()).norm()).item() for k in expected}
    worst = max(shares, key=shares.get)
    return shares[worst], worst


def read_all(tmp_path: Path, reader: str, precision: str, sources: dict) -> dict:
    """One launch of `reader` resuming every checkpoint in `sources` (name -> writer run dir):
    name -> (its run dir, its checkpoint directory of the state right after loading)."""
    import ranks

    n, jobs, out = READER_RANKS[precision], [], {}
    for name, run in sources.items():
        job = tmp_path / f"{name}-into-{reader}"
        jobs.append([*COMMON, batch(n), *STRATEGIES[reader], *precision_overrides(precision),
                     f"checkpoint.resume={run / 'checkpoints' / f'step_{K:08d}'}", f"run.dir={job / 'run'}",
                     f"checkpoint.dir={job / 'loaded'}", "logging.wandb.mode=disabled", "logging.progress=false"])
        out[name] = (job / "run", job / "loaded" / f"step_{K:08d}")
    spec = tmp_path / f"{reader}-{precision}.json"
    spec.write_text(json.dumps(jobs))
    ranks.call(tmp_path / f"{reader}-{precision}", n, "workers.resume_matrix:read_each", str(spec), timeout=480)
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("reader", MATRIX)
def test_reader_resumes_every_writer(tmp_path, writers, reader, precision):
    assert_resumes(tmp_path, reader, precision, {name: writers(precision, name) for name in WRITERS[precision][1]})


@pytest.mark.parametrize("writer,reader", CROSS, ids=[f"{w}-into-{r}" for w, r in CROSS])
def test_offload_and_hsdp_resume_across_libraries(tmp_path, writers, writer, reader):
    assert_resumes(tmp_path, reader, "fp32", {writer: writers("fp32", writer)})


@pytest.mark.parametrize("writer,reader", FP16_CELLS, ids=[f"{w}-into-{r}" for w, r in FP16_CELLS])
def test_fp16_loss_scale_carries_between_libraries(tmp_path, writers, writer, reader):
    """zerolab's loss scaler and DeepSpeed's own: the scale and its count of clean steps since the
    last overflow carry over both ways (the reader's save right after loading reads DeepSpeed's
    scaler back out of DeepSpeed), and the run continues within fp16's rounding."""
    assert_resumes(tmp_path, reader, "fp16", {writer: writers("fp16", writer)})
    meta = json.loads((writers("fp16", writer) / "checkpoints" / f"step_{K:08d}" / "meta.json").read_text())
    assert meta["loss_scaler"]["scale"] > 1024 and meta["loss_scaler"]["clean_steps"] == K, meta["loss_scaler"]


def assert_resumes(tmp_path: Path, reader: str, precision: str, sources: dict) -> None:
    """Both checks of the module docstring, for `reader` resuming each of `sources` in one launch."""
    held = read_all(tmp_path, reader, precision, sources)
    failures, shares = [], {}
    for name, run in sources.items():
        reader_run, loaded = held[name]
        problems = state_differences(run / "checkpoints" / f"step_{K:08d}", loaded)
        share, tensor = continuation_share(run, reader_run, tmp_path)
        shares[name] = f"{share:.2g} ({tensor})"
        if share > BOUND[precision]:
            problems.append(f"continues {share:.3g} of the writer's steps away ({tensor}), bound {BOUND[precision]:g}")
        failures += [f"{name} ({WRITERS[precision][0]} ranks) -> {reader} ({READER_RANKS[precision]} ranks): {p}"
                     for p in problems]
    print(f"{reader} {precision} continuation shares:", shares)  # (-s shows the measured spread)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", MATRIX)
def test_export_reads_every_strategys_checkpoint(tmp_path, writers, name):
    """`python -m zerolab export` of each writer's last checkpoint (step K + 2, its final step) gives
    the run's final weights, bitwise: the pieces are the fp32 masters the run consolidated."""
    from safetensors.torch import load_file

    from zerolab.checkpoint import export

    run = writers("fp32", name)
    export(str(run / "checkpoints"), str(tmp_path / "model.safetensors"))  # the newest checkpoint
    got, final = load_file(str(tmp_path / "model.safetensors")), load_weights(run)
    assert set(got) == set(final) - {"lm_head.weight"}  # the tied head is written once
    assert all(torch.equal(got[k], final[k]) for k in got), name


class _Evil:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["fsdp", "torch_zero", "ds3"])
def test_a_pickle_in_place_of_a_rank_file_is_refused_by_the_new_readers(tmp_path, writers, name):
    """The readers that came with format version 5 read rank files through safetensors only: one
    swapped for a pickle (its size and digest re-recorded, as an attacker would) is refused before
    any strategy code runs, naming the file, and its payload never runs."""
    import hashlib
    import shutil

    from conftest import run_train

    from zerolab.checkpoint import meta_text

    marker = tmp_path / "pwned"
    ckpt = tmp_path / f"step_{K:08d}"
    shutil.copytree(writers("fp32", name) / "checkpoints" / f"step_{K:08d}", ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "rank0.safetensors", "rank1.safetensors"]
    torch.save({"w": torch.zeros(2), "payload": _Evil(marker)}, ckpt / "rank1.safetensors")
    meta = json.loads((ckpt / "meta.json").read_text())
    data = (ckpt / "rank1.safetensors").read_bytes()
    meta["files"]["rank1.safetensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "meta.json").write_text(meta_text({k: v for k, v in meta.items() if k != "meta_sha256"}))
    proc = run_train(tmp_path / "run", 3, *COMMON, batch(3), *STRATEGIES[name], f"checkpoint.resume={ckpt}",
                     check=False)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert f"{ckpt / 'rank1.safetensors'}: not a readable safetensors file" in proc.stdout, proc.stdout[-3000:]
    assert not marker.exists(), "the payload ran"
