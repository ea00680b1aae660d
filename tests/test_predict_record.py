"""The recorder on real dry runs (zerolab.predict.record, in process, fake tensors: fast tier): it
sees each strategy's own collectives, where they are issued and waited for, and the step's
FLOPs; the volumes it records are the ZeRO paper's; the dry-run and plan CLIs carry the prediction."""
from __future__ import annotations

import functools
import json
import logging

import pytest

from zerolab.predict import cli as predict_cli
from zerolab.predict.record import Op, Sync, Wait
from zerolab.predict.topology import FACTOR, Network
from zerolab.predict.hardware import DEVICES, LINKS
from zerolab.config import compose
from zerolab.models import build_model
from zerolab.rehearsal import cli_main, rehearse

TINY = ["model=gpt_tiny", "data.micro_batch=2", "optim=adamw"]


@functools.lru_cache(maxsize=None)  # a rehearsal is read, never changed: the tests that ask for the same one share it
def recorded(strategy: str, world: int = 4, precision: str = "fp32", *extra: str):
    r = rehearse([*TINY, f"strategy={strategy}", f"precision={precision}", *extra], world=world, record=True)
    assert r.record is not None and r.previous is not None
    return r


def where(r, kind: str) -> set:
    return {c.phase for c in r.record.collectives if c.kind == kind}


def waits(r) -> list:
    return [e for e in r.record.events if isinstance(e, Wait)]


def test_ddp_all_reduces_its_buckets_in_backward_and_its_reducer_waits_at_the_end():
    r = recorded("ddp")
    assert where(r, "all_reduce") == {"backward"} and {w.phase for w in waits(r)} == {"backward"}
    last_op = max(i for i, e in enumerate(r.record.events) if isinstance(e, Op) and e.phase == "backward")
    first_wait = min(i for i, e in enumerate(r.record.events) if isinstance(e, Wait))
    assert first_wait > last_op  # the reducer waits after backward's last kernel (its future was handed over)


def test_zero2_reduces_in_backward_and_its_gathers_are_waited_for_by_the_next_forward():
    r = recorded("zero2")
    assert where(r, "reduce_scatter") == {"backward"} and where(r, "all_gather") == {"optimizer"}
    carried = [w for w in waits(r) if w.carried]
    gathers = [c.index for c in r.previous.collectives if c.kind == "all_gather"]
    assert sorted(w.index for w in carried) == gathers and {w.phase for w in carried} == {"forward"}


def test_zero3_gathers_in_forward_and_backward_and_reduces_in_backward():
    r = recorded("zero3")
    assert where(r, "all_gather") == {"forward", "backward"} and where(r, "reduce_scatter") == {"backward"}


def test_fsdp_runs_its_collectives_on_its_own_streams():
    """FSDP2 issues its all-gathers and reduce-scatters on side streams and the compute stream
    waits for them by events: what a GPU overlaps (torch.cpu's streams, recorded)."""
    r = recorded("fsdp")
    assert r.record.streams > 1 and {c.stream for c in r.record.collectives if c.kind == "all_gather"} != {0}
    kinds = {e.what for e in r.record.events if isinstance(e, Sync)}
    assert {"record", "wait_event", "wait_stream"} <= kinds
    assert any(isinstance(e, Sync) and e.what == "wait_event" and e.stream == 0 for e in r.record.events)


def test_the_optimizer_runs_the_kernel_the_real_run_runs():
    """zerolab's AdamW runs torch's fused kernel on plain fp32 tensors: the dry run's fake tensors
    take that path too (one pass over memory), and FSDP2's DTensors the composed one, as in a real run."""
    names = lambda r: {e.name for e in r.record.ops() if e.phase == "optimizer"}
    for strategy in ("ddp", "zero2"):
        assert "_fused_adamw_" in names(recorded(strategy, 2)), strategy
    fsdp = names(recorded("fsdp", 2))
    assert "_fused_adamw_" not in fsdp and "_foreach_lerp_" in fsdp


def test_the_strategys_own_python_is_timed_as_host_sections_where_it_runs():
    """Each hook on the model's parameters and modules, the strategy's step and the trainer's Python
    between phases become "host:" ops without kernels, in their phase; a GPU prices them at nothing
    (the host runs ahead), this machine at their time (zerolab.predict.record.HostSections)."""
    from zerolab.predict.model import op_seconds

    host = lambda r: [e for e in r.record.ops() if e.name.startswith("host:")]
    zero2 = host(recorded("zero2", 2))
    hooks = [e for e in zero2 if e.name == "host:ZeroBase._grad_ready"]
    tensors = len(list(build_model(compose(TINY).model, device="meta").parameters()))
    assert len(hooks) == tensors and {e.phase for e in hooks} == {"backward"}  # one per gradient, in backward
    assert all(e.host_s >= 0 for e in zero2) and sum(e.host_s for e in hooks) > 0
    assert {(e.name, e.phase) for e in zero2} >= {("host:strategy.step", "optimizer"), ("host:other", "other")}
    assert all(e.kernels == 0 and e.bytes == 0 and e.flops == 0 for e in zero2)
    ddp = {e.name for e in host(recorded("ddp", 2))}
    assert "host:ZeroBase._grad_ready" not in ddp and "host:strategy.step" in ddp  # DDP's reducer hooks are C++
    assert op_seconds(hooks[0], DEVICES["h100"]) == 0.0


def test_dtensor_ops_are_recorded_as_what_dtensor_runs():
    """An op on DTensors is recorded as DTensor runs it: the local op on this rank's shard, and the
    all-reduce its redistribution issues (a Partial sum made whole), waited for at once."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from zerolab import dist as zdist
    from zerolab.predict.record import Collective, Recorder, StepRecord, _OpMode
    from zerolab.rehearsal.fake import join_fake_world

    ctx = join_fake_world(3, 0)
    try:
        mesh = init_device_mesh("cpu", (3,))
        rec = Recorder(strategy=None, model=None)
        with FakeTensorMode():
            x = distribute_tensor(torch.randn(30, 4), mesh, [Shard(0)])
            with _OpMode(rec):
                x.pow(2).sum().full_tensor()  # unrecorded: DTensor's sharding cache warms, as in a step before
                rec.step = StepRecord()
                x.pow(2).sum().full_tensor()
        ops = [e for e in rec.step.events if isinstance(e, Op)]
        colls = [e for e in rec.step.events if isinstance(e, Collective)]
        assert [(o.name, o.bytes) for o in ops if o.name == "pow"] == [("pow", 2 * 10 * 4 * 4)]  # the 10-row shard
        assert [(c.kind, c.bytes, c.ranks) for c in colls] == [("all_reduce", 4, (0, 1, 2))]
        assert [e.index for e in rec.step.events if isinstance(e, Wait)] == [0]
    finally:
        zdist.shutdown(ctx)


def test_the_recorded_flops_are_the_models_matmuls():
    """gpt_tiny's forward: 2 FLOPs per weight of each matmul per token, plus attention's
    2 x 2 x T x d per layer per token, halved (causal: a flash kernel skips half); backward twice
    the matmuls' and 2.5 x the attention's. Tolerance: exact counts, float sums only."""
    from zerolab.config import compose

    r = recorded("ddp", 1)
    m = compose(["model=gpt_tiny"]).model
    tokens, L, d, T, V = 2 * m.block_size, m.n_layer, m.n_embd, m.block_size, m.vocab_size
    matmul = L * 12 * d * d + d * V  # per layer q, k, v, o (4 d²) and the MLP (8 d²); the tied head
    attention = L * 2 * 2 * T * d / 2
    forward = sum(e.flops for e in r.record.ops() if e.phase == "forward")
    backward = sum(e.flops for e in r.record.ops() if e.phase == "backward")
    assert forward == pytest.approx(tokens * (2 * matmul + attention), rel=1e-9)
    assert backward == pytest.approx(tokens * (4 * matmul + 2.5 * attention), rel=1e-9)


@pytest.mark.slow  # in-process, but several seconds: kept out of the 2-minute fast tier
def test_recomputation_is_recorded_and_priced_selective_between_none_and_blocks():
    """The recorder sees the ops that run, recomputation included (2 FLOPs per weight per token
    per matmul). Torch's non-reentrant checkpoint stops a recomputation as soon as the tensors its
    backward reads exist, and autograd saves an op's inputs before running it: the MLP's proj
    (4d²), whose output no backward reads (the residual add saves nothing; no dropout), is never
    recomputed. So `blocks` recomputes qkv, attention, proj and fc (8d² and attention), and
    `selective`, which kept qkv, fc and attention's outputs, recomputes attention's proj alone
    (d²). Exact counts. Priced on an h100, compute orders the same way."""
    from zerolab.config import compose

    m = compose(["model=gpt_tiny"]).model
    tokens, L, d, T = 2 * m.block_size, m.n_layer, m.n_embd, m.block_size
    backward, compute = {}, {}
    for mode in ("none", "selective", "blocks"):
        r = recorded("ddp", 1, "fp32", f"model.activation_checkpointing={mode}")
        backward[mode] = sum(e.flops for e in r.record.ops() if e.phase == "backward")
        compute[mode] = predict_cli.priced(r, predict_cli.topology(predict_cli.arguments("h100"), 1)).parts["compute"]
    attention = L * 2 * 2 * T * d / 2
    assert backward["selective"] - backward["none"] == pytest.approx(tokens * 2 * L * d * d, rel=1e-9)
    assert backward["blocks"] - backward["none"] == pytest.approx(tokens * (2 * L * 8 * d * d + attention), rel=1e-9)
    assert compute["none"] < compute["selective"] < compute["blocks"]


# ---- the ZeRO paper's volumes (Rajbhandari et al. 2019, section 7) ---------------------------------------
def ring_volume(r) -> float:
    """Bytes one rank sends per step over a ring: f x S per collective (zerolab.predict.topology)."""
    return sum(FACTOR[c.kind](len(c.ranks)) * c.bytes for c in r.record.collectives)


@pytest.mark.parametrize("strategy, psis", [("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 3)])
def test_volumes_per_rank_are_the_papers(strategy, psis):
    """ddp 2Ψ (its all-reduce), zero1/zero2 2Ψ (reduce-scatter + all-gather), zero3 3Ψ (a second
    all-gather, in backward), in the communicated dtype (fp32 here: 4 bytes), times (N-1)/N for a
    ring; at 64 GPUs on 8 nodes one eighth of it crosses nodes (each rank's share of its node's 8 rings
    leaves on its own NIC). Tolerance: each bucket is padded to a multiple of N (fewer than N
    elements per bucket) and the gradient-norm all-reduce adds a few bytes."""
    world = 64
    r = recorded(strategy, world, "fp32")
    expected = psis * r.n_params * 4 * (world - 1) / world
    slack = 4 * world * (len(r.record.collectives) + 1) * 2  # padding per bucket and the norm, both ways
    assert expected <= ring_volume(r) <= expected + slack, (strategy, ring_volume(r), expected)
    topo = Network(world, 8, LINKS["nvlink4"], LINKS["ib-ndr"], DEVICES["h100"])
    priced = [topo.price(c.kind, c.bytes, c.ranks) for c in r.record.collectives]
    inside, across = sum(p.intra_bytes for p in priced), sum(p.inter_bytes for p in priced)
    assert topo.nodes == 8 and across == pytest.approx((inside + across) / 8, rel=1e-12)


def test_zero3_in_bf16_moves_its_bytes_in_bf16():
    r = recorded("zero3", 8, "bf16")
    per_kind = {}
    for c in r.record.collectives:
        per_kind[c.kind] = per_kind.get(c.kind, 0) + c.bytes
    # buffers: the gathers carry bf16 weights twice (2 x 2Ψ), the reduce-scatters bf16 gradients (2Ψ)
    assert 4 * r.n_params <= per_kind["all_gather"] <= 4 * r.n_params + 2 * 8 * 2 * len(r.record.collectives)
    assert 2 * r.n_params <= per_kind["reduce_scatter"] <= 2 * r.n_params + 2 * 8 * len(r.record.collectives)


# ---- the CLIs --------------------------------------------------------------------------------------------
def test_dry_run_prints_the_prediction_beside_the_memory(capsys):
    assert cli_main(["--world", "16", "--hardware", "h100", "--gpus-per-node", "8", *TINY, "strategy=zero3"]) == 0
    out = capsys.readouterr().out
    assert "dry run of rank 0 of 16" in out and "predicted step on 16 x h100" in out
    assert "a prediction is a model, not a measurement" in out and "assumptions:" in out
    assert "across nodes InfiniBand NDR" in out and "all_gather" in out


def test_dry_run_json_carries_the_prediction(capsys):
    assert cli_main(["--world", "8", "--json", "--hardware", "a100", *TINY, "strategy=zero2"]) == 0
    p = json.loads(capsys.readouterr().out)["prediction"]
    assert set(p["parts"]) == {"compute", "optimizer", "comm_exposed", "other"}
    assert p["step_s"] == pytest.approx(sum(p["parts"].values()), rel=1e-9)
    assert p["tokens_per_s_per_device"] > 0 and 0 < p["mfu"] < 1 and p["assumptions"]
    assert {c["kind"] for c in p["collectives"]} >= {"reduce_scatter", "all_gather"}


@pytest.mark.parametrize("argv, message", [
    (["--world", "8", "--hardware", "tpu"], "unknown hardware 'tpu'; known: a100, h100, h200"),
    (["--world", "12", "--hardware", "h100"], "--gpus-per-node 8 does not divide --world 12"),
    (["--world", "8", "--hardware", "h100", "--inter-link", "carrier-pigeon"], "unknown link 'carrier-pigeon'"),
])
def test_bad_hardware_is_refused_before_anything_is_rehearsed(capsys, argv, message):
    assert cli_main([*argv, *TINY]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow  # in-process, but several seconds: kept out of the 2-minute fast tier
def test_the_dry_runs_nodes_are_the_predictions(capsys):
    """--gpus-per-node gives the fake process group its nodes (dist.ranks_per_node): the strategy's
    comm counter splits its bytes by link as a 2-node job's does (zerolab.comm: a group spanning
    nodes counts every byte across), and a layout on node groups (zero3's HSDP) is priced on the
    groups the record shows, with no case of its own: its reduce-scatters and all-gathers inside a
    node, its replicas' all-reduce on the network alone."""
    argv = ["--world", "16", "--json", "--hardware", "h100", "--gpus-per-node", "8", *TINY]
    assert cli_main([*argv, "strategy=zero2"]) == 0
    comm = json.loads(capsys.readouterr().out)["comm"]
    assert comm["comm_across_bytes"] == comm["comm_bytes"] > 0 and comm["comm_inside_bytes"] == 0
    assert cli_main([*argv, "strategy=zero3", "strategy.shard_within=node"]) == 0
    hsdp = json.loads(capsys.readouterr().out)["comm"]
    assert 0 < hsdp["comm_inside_bytes"] < hsdp["comm_bytes"]
    r = recorded("zero3", 16, "fp32", "strategy.shard_within=node", "dist.ranks_per_node=8")
    topo = Network(16, 8, LINKS["nvlink4"], LINKS["ib-ndr"], DEVICES["h100"])
    groups = {(c.kind, c.ranks) for c in r.record.collectives}
    assert {("reduce_scatter", tuple(range(8))), ("all_gather", tuple(range(8))), ("all_reduce", (0, 8))} <= groups
    for kind, ranks in groups:
        p = topo.price(kind, 1 << 20, ranks)
        inside, across = (p.intra_bytes > 0, p.inter_bytes > 0)
        assert (inside, across) == {8: (True, False), 2: (False, True), 16: (True, True)}[len(ranks)], (kind, ranks)


def test_a_node_size_given_twice_must_agree(capsys):
    """dist.ranks_per_node alone sets the prediction's nodes; with --gpus-per-node it must agree."""
    assert cli_main(["--world", "16", "--json", "--hardware", "h100", *TINY, "dist.ranks_per_node=4"]) == 0
    assert json.loads(capsys.readouterr().out)["prediction"]["topology"].startswith("4 node(s) x 4 GPUs")
    assert cli_main(["--world", "16", "--hardware", "h100", "--gpus-per-node", "8", *TINY,
                     "dist.ranks_per_node=4"]) == 2
    assert "--gpus-per-node 8 and dist.ranks_per_node=4 disagree" in capsys.readouterr().err


def test_deepspeed_has_no_step_to_price(capsys):
    assert cli_main(["--world", "8", "--hardware", "h100", *TINY, "strategy=deepspeed", "strategy.stage=2"]) == 0
    assert "no time predicted: deepspeed is not rehearsed" in capsys.readouterr().out


def test_a_dry_run_warns_about_the_rank_it_rehearses_only(caplog):
    """The other ranks' figures in a dry run are copies of the rehearsed rank's (issue 35, item 4):
    torch_zero's optimizer state differs per rank, so copies of rank 0's would be 'above' ranks
    1-3's predictions; nothing is said about them."""
    with caplog.at_level(logging.WARNING, logger="zerolab.memory"):
        rehearse([*TINY, "strategy=torch_zero"], world=4)
    named = [rec.getMessage() for rec in caplog.records if "memory ledger: rank" in rec.getMessage()]
    assert all("rank 0:" in m for m in named), named


@pytest.mark.slow  # in-process, but several seconds: kept out of the 2-minute fast tier
def test_plan_ranks_what_fits_by_predicted_tokens_per_second(capsys):
    from zerolab.plan import cli_main as plan_main, format_speed

    argv = ["--model", "gpt_tiny", "--gpu-mem", "80GB", "--world", "16", "--precision", "bf16", "--hardware", "h100",
            "--micro-batches", "1,2", "--strategies", "zero2,zero3,deepspeed-2"]
    assert plan_main([*argv, "--json"]) == 0
    speed = json.loads(capsys.readouterr().out)["speed"]
    rows = speed["rows"]
    assert {(r["strategy"], r["checkpointing"], r["micro_batch"]) for r in rows} == {
        (s, ck, mb) for s in ("zero2", "zero3") for ck in ("none", "blocks", "selective") for mb in (1, 2)}
    rates = [r["tokens_per_s_per_device"] for r in rows]
    assert rates == sorted(rates, reverse=True) and all(r["peak_bytes"] > 0 for r in rows)
    assert [s["strategy"] for s in speed["not_rehearsed"]] == ["deepspeed-2"]
    text = format_speed(speed)  # the table the command prints without --json (planning again costs 6 s)
    assert "predicted speed on 16 x h100, fastest first (a prediction is a model, not a measurement)" in text
    assert "not rehearsed, no time predicted: deepspeed-2" in text and "assumptions:" in text


def test_plan_refuses_a_row_it_does_not_have(capsys):
    from zerolab.plan import cli_main as plan_main

    assert plan_main(["--model", "gpt_tiny", "--gpu-mem", "80GB", "--strategies", "zero4"]) == 2
    assert "--strategies: no row zero4; the rows: ddp" in capsys.readouterr().err
