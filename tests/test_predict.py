"""The time model's pieces (zerolab.predict): the roofline, the ring and tree formulas, the overlap
rule, the topology and its refusals, on hand-made records and hand-computed values (fast tier).

The recorder on real dry runs, and the ZeRO paper's volumes: tests/test_predict_record.py. How
the model compares with real runs is a benchmark (bench/predict_check.py), not a test."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from zerolab.errors import ConfigError
from zerolab.predict.hardware import BASE_LATENCY_S, DEVICES, LINKS, Device, Link, apply_overrides, cpu_device, device
from zerolab.predict.model import op_seconds, predict
from zerolab.predict.record import Collective, Op, StepRecord, Sync, Wait
from zerolab.predict.report import format_prediction
from zerolab.predict.timeline import replay
from zerolab.predict.topology import Network

# A device and links with round figures, so that every expected time below is a hand calculation.
DEV = Device("test", "a round device", {"bf16": 100e12, "fp32": 10e12}, 1e12, 80 * 10**9, "made up", achievable=1.0)
FAST = Link("fast", "intra", 100e9, 1e-6, "made up")
SLOW = Link("slow", "inter", 10e9, 5e-6, "made up")
REL = 1e-12  # the model is closed-form arithmetic: only float rounding separates it from the hand values


def op(name="mm", phase="forward", flops=0.0, nbytes=0, kernels=1, stream=0, dtype="bf16", priced=True):
    return Op(name, phase, stream, flops, nbytes, kernels, priced, dtype, -1)


# ---- the roofline ----------------------------------------------------------------------------------
def test_an_op_costs_the_larger_of_its_compute_and_its_memory_time():
    assert math.isclose(op_seconds(op(flops=2e12, nbytes=1e9), DEV), 2e12 / 100e12, rel_tol=REL)  # 20 ms > 1 ms
    assert math.isclose(op_seconds(op(flops=1e9, nbytes=5e9), DEV), 5e9 / 1e12, rel_tol=REL)  # 5 ms > 10 us
    assert math.isclose(op_seconds(op(flops=1e12, dtype="fp32"), DEV), 1e12 / 10e12, rel_tol=REL)  # its dtype's peak
    slower = dataclasses.replace(DEV, achievable=0.5, op_overhead_s=2e-6)
    # half of each peak, plus 2 us for each of the op's 3 kernels
    assert math.isclose(op_seconds(op(flops=2e12, kernels=3), slower), 2e12 / 50e12 + 3 * 2e-6, rel_tol=REL)


def test_an_op_reads_its_inputs_and_writes_its_outputs_once():
    """Bytes as zerolab.predict.ops counts them, on real 1,000-element fp32 tensors (4,000 bytes):
    an out= argument and the destination of copy_ / zero_ are written, not read; an in-place op's
    self is both; div(m, d, out=d) reads d as its divisor; a view moves nothing."""
    import torch

    from zerolab.predict.ops import cost

    aten, n = torch.ops.aten, 4000
    a, b, c = torch.randn(1000), torch.randn(1000), torch.empty(1000)
    moved = lambda func, args, kwargs, out: cost(func, args, kwargs, out)[1]
    assert moved(aten.add.Tensor, (a, b), {}, a + b) == 3 * n
    assert moved(aten.add.out, (a, b), {"out": c}, c) == 3 * n
    assert moved(aten.div.out, (a, b), {"out": b}, b) == 3 * n
    assert moved(aten.mul_.Scalar, (a, 2.0), {}, a) == 2 * n
    assert moved(aten.copy_.default, (c, a), {}, c) == 2 * n
    assert moved(aten.zero_.default, (a,), {}, a) == n
    assert moved(aten._foreach_zero_.default, ([a, b],), {}, None) == 2 * n
    assert moved(aten.view.default, (a, [10, 100]), {}, a.view(10, 100)) == 0


# ---- collectives on links --------------------------------------------------------------------------
def topo(world: int, gpn: int = 8) -> Network:
    return Network(world, gpn, FAST, SLOW, DEV)


def test_ring_all_gather_across_two_nodes_by_hand():
    """16 ranks, 2 nodes of 8: each rank sends 15/16 of S; 1/8 of it leaves the node on its own NIC."""
    s = 1.6e9
    p = topo(16).price("all_gather", s, tuple(range(16)))
    sent = 15 / 16 * s
    assert p.algorithm == "ring"
    assert math.isclose(p.intra_bytes, sent * 7 / 8, rel_tol=REL) and math.isclose(p.inter_bytes, sent / 8, rel_tol=REL)
    # the network's share is the slower: 0.1875 GB at 10 GB/s; 14 steps inside a node, 1 across
    expected = BASE_LATENCY_S + 14 * 1e-6 + 1 * 5e-6 + (sent / 8) / 10e9
    assert math.isclose(p.seconds, expected, rel_tol=REL)


def test_ring_all_reduce_inside_a_node_and_groups_of_one_link():
    s = 8e8
    inside = topo(8).price("all_reduce", s, tuple(range(8)))
    assert inside.inter_bytes == 0 and math.isclose(inside.intra_bytes, 2 * 7 / 8 * s, rel_tol=REL)
    assert math.isclose(inside.seconds, BASE_LATENCY_S + 14 * 1e-6 + 2 * 7 / 8 * s / 100e9, rel_tol=REL)
    # a node group of a 64-rank job is priced on the intra-node link alone, a cross-node group
    # (one rank per node) on the network alone: what hierarchical sharding is priced on
    t = topo(64)
    node = t.price("reduce_scatter", s, tuple(range(8)))
    across = t.price("reduce_scatter", s, tuple(range(0, 64, 8)))
    assert node.inter_bytes == 0 and across.intra_bytes == 0
    assert math.isclose(across.seconds, BASE_LATENCY_S + 7 * 5e-6 + 7 / 8 * s / 10e9, rel_tol=REL)


def test_a_small_all_reduce_on_many_nodes_takes_the_tree():
    """64 ranks on 8 nodes, 1 kB: the ring's 126 steps (14 across nodes) cost more than the tree's
    2 x (7 intra + log2 8 network) steps; a large buffer goes back to the ring."""
    t = topo(64)
    small = t.price("all_reduce", 1000, tuple(range(64)))
    assert small.algorithm == "tree"
    tree_latency = BASE_LATENCY_S + 2 * (7 * 1e-6 + 3 * 5e-6)
    assert math.isclose(small.seconds, tree_latency + max(2 * 1000 * 7 / 8 / 100e9, 2 * 1000 / 8 / 10e9), rel_tol=REL)
    assert t.price("all_reduce", 4e9, tuple(range(64))).algorithm == "ring"


def test_nothing_to_send_costs_nothing():
    assert topo(8).price("all_gather", 1e6, (3,)).seconds == 0
    assert topo(8).price("all_gather", 0, tuple(range(8))).seconds == 0


# ---- the overlap rule --------------------------------------------------------------------------------
def coll(index, kind="all_gather", phase="forward", stream=0, ranks=(0, 1)):
    return Collective(index, kind, 1, ranks, phase, stream)


def run(events, seconds: dict, streams=True, overlap_rate=1.0, meeting_s=0.0, queued_s=0.0):
    rec = StepRecord(events=events, collectives=[e for e in events if isinstance(e, Collective)])
    return replay(rec, lambda o: o.bytes, lambda c: seconds[c.index], streams, overlap_rate, meeting_s, queued_s)


def test_a_collective_hides_behind_the_compute_issued_between_it_and_its_wait():
    # 1 s of gather behind 2 s of compute: hidden; 3 s behind 1 s: 2 s exposed
    events = [coll(0), op(nbytes=2), Wait(0, False, "forward", 0), coll(1, phase="backward"),
              op(phase="backward", nbytes=1), Wait(1, False, "backward", 0), op(phase="optimizer", nbytes=0.5)]
    r = run(events, {0: 1.0, 1: 3.0})
    assert r.parts == {"compute": 3.0, "optimizer": 0.5, "comm_exposed": 2.0, "other": 0.0}
    assert r.step_s == sum(r.parts.values()) == 5.5
    assert r.comm_s == 4.0 and r.exposed_by_kind == {"all_gather": 2.0}


def test_what_a_step_leaves_in_flight_is_waited_for_by_the_next():
    """zero1/2's shape: an all-gather launched by the optimizer (2 s), waited for after the next
    step's first op (0.5 s): 1.5 s exposed in the next forward, every step."""
    events = [op(nbytes=0.5), Wait(0, True, "forward", 0), op(nbytes=1), op(phase="optimizer", nbytes=0.25),
              coll(0, phase="optimizer")]
    r = run(events, {0: 2.0})
    assert math.isclose(r.parts["comm_exposed"], 1.5) and math.isclose(r.step_s, 3.25)


def test_side_streams_on_a_gpu_and_one_timeline_on_a_cpu():
    """FSDP2's shape: a gather issued on stream 1 before the compute stream's 1 s op; the compute
    stream waits for it by an event (after 0.5 s more). On a GPU the 2 s gather overlaps both ops:
    0.5 s exposed. On a CPU a wait on any stream holds the host: the gather's wait (inside its own
    stream context) comes before the ops, so all 2 s are exposed."""
    events = [Sync("wait_stream", 1, 0), coll(0, stream=1), Wait(0, False, "forward", 1), Sync("record", 1, 1),
              op(nbytes=1), op(nbytes=0.5), Sync("wait_event", 0, 1), op(nbytes=0.25)]
    gpu = run(events, {0: 2.0}, streams=True)
    cpu = run(events, {0: 2.0}, streams=False)
    assert math.isclose(gpu.parts["comm_exposed"], 0.5) and math.isclose(gpu.step_s, 2.25)
    assert math.isclose(cpu.parts["comm_exposed"], 2.0) and math.isclose(cpu.step_s, 3.75)


def test_on_shared_cores_a_hidden_collective_still_lengthens_the_compute():
    """The first test's step on a CPU whose cores compute and gloo share (rate 1/2 while both
    run). Forward: the 1 s gather runs beside the 2 s op: 1 s of both at half speed (2 s), then
    the op's last 1 s alone: 3 s, nothing exposed. Backward: the 3 s gather beside the 1 s op: 2 s
    at half speed, 2 s of the gather left for the wait: exposed. At rate 1 it is the free overlap."""
    events = [coll(0), op(nbytes=2), Wait(0, False, "forward", 0), coll(1, phase="backward"),
              op(phase="backward", nbytes=1), Wait(1, False, "backward", 0), op(phase="optimizer", nbytes=0.5)]
    shared = run(events, {0: 1.0, 1: 3.0}, streams=False, overlap_rate=0.5)
    assert shared.parts == {"compute": 5.0, "optimizer": 0.5, "comm_exposed": 2.0, "other": 0.0}
    assert shared.step_s == 7.5 == 2 + 1 + 0.5 + 1 + 3  # every second of compute and collective, one after another
    free = run(events, {0: 1.0, 1: 3.0}, streams=False, overlap_rate=1.0)
    assert free.step_s == 5.5 and free.parts["comm_exposed"] == 2.0


def test_ranks_that_meet_late_delay_a_collective_without_taking_the_cores():
    """A 0.5 s meeting (ranks sharing cores reach a collective apart). A 1 s gather waited for at
    once: its end moves from 1 s to 1.5 s, all exposed. The same gather with 2 s of compute after
    it on free cores: it ends at 1.5 s, hidden, and the compute is not slowed (those who wait sleep).
    On shared cores (rate 1/2) the gather's 1 s of work runs beside the op as before; the meeting
    adds nothing there: the op ends at 3 s, after the gather's earliest end (1.5 s)."""
    at_once = [coll(0), Wait(0, False, "forward", 0), op(nbytes=1)]
    r = run(at_once, {0: 1.0}, streams=False, overlap_rate=1.0, meeting_s=0.5)
    assert r.parts["comm_exposed"] == 1.5 and r.step_s == 2.5
    behind = [coll(0), op(nbytes=2), Wait(0, False, "forward", 0)]
    assert run(behind, {0: 1.0}, streams=False, meeting_s=0.5).step_s == 2.0
    shared = run(behind, {0: 1.0}, streams=False, overlap_rate=0.5, meeting_s=0.5)
    assert shared.step_s == 3.0 and shared.parts["comm_exposed"] == 0.0
    short = [coll(0), op(nbytes=0.25), Wait(0, False, "forward", 0)]  # shared cores, 0.25 s of compute
    # the op's 0.25 s runs beside 0.25 s of the gather (0.5 s); 0.75 s of work left: 1.25 s; the
    # earliest end is 1.5 s: 0.25 s more exposed, 1.0 s in all
    r = run(short, {0: 1.0}, streams=False, overlap_rate=0.5, meeting_s=0.5)
    assert math.isclose(r.parts["comm_exposed"], 1.0) and math.isclose(r.step_s, 1.5)


def test_the_cores_are_shared_when_ranks_and_gloo_threads_outnumber_them():
    from zerolab.predict.hardware import overlap_rate

    assert overlap_rate(cores=2, ranks=2) == 0.5  # 4 threads on 2 cores, against 2 on 2
    assert overlap_rate(cores=2, ranks=3) == 0.5  # 6 on 2, against 3 on 2 (the calibration's share)
    assert overlap_rate(cores=3, ranks=2) == 0.75
    assert overlap_rate(cores=4, ranks=2) == 1.0 and overlap_rate(cores=16, ranks=1) == 1.0


def test_collectives_of_one_group_run_one_after_another():
    # two 1 s gathers issued together, waited together after 0.5 s: the second ends at 2 s
    events = [coll(0), coll(1), op(nbytes=0.5), Wait(0, False, "forward", 0), Wait(1, False, "forward", 0)]
    assert math.isclose(run(events, {0: 1.0, 1: 1.0}).parts["comm_exposed"], 1.5)
    other_group = [coll(0), coll(1, ranks=(0, 2)), op(nbytes=0.5), Wait(0, False, "forward", 0),
                   Wait(1, False, "forward", 0)]
    assert math.isclose(run(other_group, {0: 1.0, 1: 1.0}).parts["comm_exposed"], 0.5)


def test_a_collective_issued_behind_others_in_flight_costs_the_queued_time_more():
    """gloo's many small collectives in a row (queued_s = 0.25 s): two 1 s gathers issued together;
    the second is behind the first: 1.25 s. Issued after the first has ended, it costs 1 s."""
    together = [coll(0), coll(1), op(nbytes=0.5), Wait(0, False, "forward", 0), Wait(1, False, "forward", 0)]
    assert math.isclose(run(together, {0: 1.0, 1: 1.0}, queued_s=0.25).parts["comm_exposed"], 1.75)
    apart = [coll(0), Wait(0, False, "forward", 0), coll(1), Wait(1, False, "forward", 0)]
    assert math.isclose(run(apart, {0: 1.0, 1: 1.0}, queued_s=0.25).parts["comm_exposed"], 2.0)
    # on shared cores the second joins the queue of collective work while the first is in it
    shared = run(together, {0: 1.0, 1: 1.0}, streams=False, overlap_rate=0.5, queued_s=0.25)
    assert math.isclose(shared.step_s, 1.0 + 1.75)  # the op's 0.5 s beside 0.5 s of the gathers, then 1.75 s


# ---- the prediction and what it says ------------------------------------------------------------------
def test_tokens_mfu_and_an_op_without_a_formula_named():
    events = [op(flops=1e12, nbytes=0), op(name="my_kernel", nbytes=1e9, priced=False, dtype=""),
              op(phase="optimizer", name="_foreach_add_", nbytes=1e9, dtype="")]
    rec = StepRecord(events=events)
    rec.unpriced["my_kernel"] = 1
    p = predict(rec, topo(8), tokens_per_rank=1000, flops_per_token=1e9, dtype="bf16")
    assert math.isclose(p.step_s, 0.01 + 0.001 + 0.001, rel_tol=REL)  # 10 ms of FLOPs, 1 ms of bytes each
    assert math.isclose(p.tokens_per_s_per_device, 1000 / 0.012, rel_tol=REL)
    assert math.isclose(p.mfu, 1000 / 0.012 * 1e9 / 100e12, rel_tol=REL)
    assert p.unpriced[0][:2] == ("my_kernel", 1) and math.isclose(p.unpriced[0][2], 0.001 / 0.012, rel_tol=REL)
    text = format_prediction(p)
    assert "a prediction is a model, not a measurement" in text
    assert "priced by their bytes alone (no FLOP formula): my_kernel x1" in text
    assert "achievable: x1" in text and "100 TFLOP/s bf16 peak" in text


# ---- hardware and topology: data, overrides, refusals -------------------------------------------------
def test_every_device_and_link_says_where_its_figures_come_from():
    for name in ("a100", "h100", "h200"):
        d = DEVICES[name]
        assert d.flops["bf16"] > d.flops["fp32"] > 0 and d.memory_bandwidth > 0 and d.memory > 0 and d.source
        assert d.intra in LINKS and d.inter in LINKS
    assert all(k.bandwidth > 0 and k.latency_s > 0 and k.source for k in LINKS.values())
    assert {"nvlink3", "nvlink4", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "roce-400"} <= set(LINKS)


def test_refusals_name_the_problem_and_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"unknown hardware 'h900'; known: a100, h100, h200"):
        device("h900")
    with pytest.raises(ConfigError, match="--gpus-per-node 8 does not divide --world 12"):
        topo(12)
    topo(4)  # fewer ranks than a node holds: one node, partly used
    with pytest.raises(ConfigError, match="--hw 'flops=1': give KEY=VALUE with KEY one of bf16_flops"):
        apply_overrides(DEV, FAST, SLOW, ["flops=1"])
    with pytest.raises(ConfigError, match="achievable: in"):
        apply_overrides(DEV, FAST, SLOW, ["achievable=2"])
    monkeypatch.setenv("ZEROLAB_CPU_CALIBRATION", str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match="run `python -m zerolab.predict calibrate` first"):
        device("cpu", 2)


def test_overrides_change_the_figure_they_name():
    dev, intra, inter = apply_overrides(DEVICES["h100"], LINKS["nvlink4"], LINKS["ib-ndr"],
                                        ["memory_bandwidth=2.4e12", "bf16_flops=8e14", "inter_bandwidth=25e9",
                                         "op_overhead_us=3", "achievable=0.5"])
    assert (dev.memory_bandwidth, dev.flops["bf16"], inter.bandwidth, intra.bandwidth) == (2.4e12, 8e14, 25e9, 450e9)
    assert math.isclose(dev.op_overhead_s, 3e-6) and dev.achievable == 0.5


CALIBRATION = {"machine": "test", "date": "2026-12-03", "cores": 2, "ranks": {
    str(n): {"matmul_fp32": 50e9 / n, "matmul_bf16": 1e9, "attention_fp32": 20e9, "memory_bandwidth": 10e9,
             "op_overhead_s": 1e-5, "fused_adamw_bandwidth": 4e9, "meeting_s": 2e-3 * (n > 1),
             "gloo": {"all_reduce": {"2": {"latency_s": 1e-4, "bandwidth": 1e9},
                                     "3": {"latency_s": 2e-4, "bandwidth": 5e8}},
                      "all_gather": {"2": {"latency_s": 0.0, "bandwidth": 4e8}}}} for n in (1, 2, 3)}}


def test_gloo_latency_comes_from_the_small_sizes_and_bandwidth_from_the_large():
    from zerolab.predict.calibrate import _fit

    # measured: 4, 16, 64 kB at 0.2 ms, but 16 kB disturbed (3.6 ms); 1, 4, 16 MB at 1 GB/s beyond 1 ms
    points = [(4 << 10, 2e-4), (16 << 10, 3.6e-3), (64 << 10, 2e-4), (1 << 20, 1e-3 + (1 << 20) / 1e9),
              (4 << 20, 1e-3 + (4 << 20) / 1e9), (16 << 20, 1e-3 + (16 << 20) / 1e9)]
    fit = _fit(points)
    assert fit["latency_s"] == 2e-4  # the median of the three small sizes: the disturbed one does not count
    assert math.isclose(fit["bandwidth"], 1e9, rel_tol=1e-9) and len(fit["points"]) == 6


def test_an_op_of_a_measured_name_costs_its_nearest_measured_rate():
    from zerolab.predict.kernels import table_seconds

    table = {"mm": [[[1, 128, 128, 128], 4.0e6, 1e-4], [[1, 1024, 1024, 1024], 2.0e9, 1e-2]],  # 40 and 200 GFLOP/s
             "gelu": [[[1e6, 1], 1e6, 1e-4], [[1e8, 1], 1e8, 2e-3]],  # 10 and 50 GB/s by size
             "fill_": [[[0, 1], 0, 3e-6]]}
    # a matmul of the big one's shape costs its FLOPs at its rate; one near the small one mostly at the small's
    # (weights: 1 / squared log-distance; the far one's is 1/43 of the near one's, so its rate moves the price
    # by under 3 %)
    assert math.isclose(table_seconds("mm", 4e9, 0, 1, (1, 1024, 1024, 2048), table), 4e9 / 2e11, rel_tol=0.03)
    assert 4.0e6 / 4.1e10 < table_seconds("mm", 4.0e6, 0, 1, (1, 128, 128, 130), table) < 4.0e6 / 4e10
    assert math.isclose(table_seconds("gelu", 0, 1e8, 1, (), table), 2e-3, rel_tol=1e-3)  # by its bytes
    assert table_seconds("fill_", 0, 0, 1, (), table) == 3e-6  # nothing measurable moved: the measured time
    assert table_seconds("softmax", 0, 1e6, 1, (), table) is None  # never measured: the roofline prices it
    assert table_seconds("mm", 1e6, 0, 1, (), table) is None  # no dims to place it among the matmuls


def test_the_reference_steps_time_the_kernels_of_a_training_step_and_a_sharders_bookkeeping():
    from zerolab.predict.kernels import merge_tables, reference_rows

    rows, walls = reference_rows("gpt", 32, 2, 16, 16)  # (the calibration's shapes are wider: this is its structure)
    names = {r[0] for r in rows}
    # the step's two halves, timed apart: the model's pass, then the bookkeeping and the optimizer
    halves = [{r[0] for r in rows if r[6] == half} for half in (0, 1)]
    assert {"native_layer_norm_backward", "_scaled_dot_product_flash_attention_for_cpu"} <= halves[0]
    assert {"_fused_adamw_", "_foreach_lerp_", "_chunk_cat"} <= halves[1]
    assert "_fused_adamw_" not in halves[0] and "native_layer_norm" not in halves[1]
    assert [r[6] for r in rows] == sorted(r[6] for r in rows)  # the model's ops all come first
    model = {"mm", "addmm", "gelu", "native_layer_norm", "native_layer_norm_backward",
             "_scaled_dot_product_flash_attention_for_cpu", "_fused_adamw_"}
    sharder = {"div", "add_", "copy_", "_foreach_mul_", "_foreach_lerp_", "split_with_sizes_copy", "_chunk_cat",
               "zero_"}
    assert model | sharder <= names, (model | sharder) - names
    assert all(r[3] >= 1 and r[5] >= 0 for r in rows) and len(walls) == 2 and min(walls) > 0
    assert all(len(r[4]) == 4 for r in rows if r[0] in ("mm", "addmm"))  # matmuls keep their dims
    a = {"kernels": {"mm": [[[1, 2, 3, 4], 48, 1.0]]}, "host_s_per_kernel": 1e-6, "host_s_per_kernel_step": 4e-6}
    b = {"kernels": {"mm": [[[1, 2, 3, 4], 48, 3.0]], "add": [[[8, 1], 8, 2.0]]}, "host_s_per_kernel": 3e-6,
         "host_s_per_kernel_step": 8e-6}
    assert merge_tables([a, b]) == {"kernels": {"mm": [[[1, 2, 3, 4], 48, 2.0]], "add": [[[8, 1], 8, 2.0]]},
                                    "host_s_per_kernel": 2e-6, "host_s_per_kernel_step": 6e-6}


def test_the_cpu_entry_is_this_machines_calibration(tmp_path, monkeypatch):
    """The rank count picks the entry measured with that many ranks at once; gloo's figures are
    looked up per kind and group size (a group of 4 takes the nearest measured: 3)."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(CALIBRATION))
    monkeypatch.setenv("ZEROLAB_CPU_CALIBRATION", str(path))
    cpu = device("cpu", 2)
    assert cpu.host_sync and cpu.flops["fp32"] == 25e9 and cpu.op_overhead_s == 1e-5 and cpu.meeting_s == 2e-3
    # the fused AdamW kernel at its own measured rate, every other memory-bound op at the bandwidth's
    fused, plain = op("_fused_adamw_", nbytes=4e8, kernels=0), op("add", nbytes=4e8, kernels=0)
    assert op_seconds(fused, cpu) == 4e8 / 4e9 and op_seconds(plain, cpu) == 4e8 / 10e9
    assert cpu_device(7, str(path)).flops["fp32"] == 50e9 / 3  # more ranks than measured: the largest count
    t = Network(2, 2, LINKS["pcie4"], LINKS["pcie4"], cpu)
    assert math.isclose(t.price("all_reduce", 1e8, (0, 1)).seconds, 1e-4 + 1e8 / 1e9, rel_tol=REL)
    assert math.isclose(t.price("all_gather", 1e8, (0, 1)).seconds, 1e8 / 4e8, rel_tol=REL)
    four = Network(4, 4, LINKS["pcie4"], LINKS["pcie4"], cpu).price("all_reduce", 1e8, (0, 1, 2, 3))
    assert math.isclose(four.seconds, 2e-4 + 1e8 / 5e8, rel_tol=REL)
    # a calibration with measured kernels prices an op of a measured name by them, plus the host time per kernel
    tabled = {**CALIBRATION, "ranks": {n: {**c, "queued_s": 3e-4, "host_s_per_kernel": 2e-6,
                                           "kernels": {"add": [[[4e8, 1], 4e8, 0.02]]}}
                                       for n, c in CALIBRATION["ranks"].items()}}
    path.write_text(json.dumps(tabled))
    cpu = device("cpu", 2)
    assert cpu.queued_s == 3e-4 and op_seconds(op("add", nbytes=4e8, kernels=1), cpu) == 0.02 + 2e-6
    # (a calibration without the step's own figure prices the optimizer's kernels alike)
    assert math.isclose(op_seconds(op("add", nbytes=4e8, kernels=3, phase="optimizer"), cpu), 0.02 + 3 * 2e-6)
    # the host time per kernel of the half of the step an op runs in: the model's pass, or after it
    for c in tabled["ranks"].values():
        c["host_s_per_kernel_step"] = 5e-7
    path.write_text(json.dumps(tabled))
    cpu = device("cpu", 2)
    assert op_seconds(op("add", nbytes=4e8, kernels=1, phase="backward"), cpu) == 0.02 + 2e-6
    assert op_seconds(op("add", nbytes=4e8, kernels=1, phase="optimizer"), cpu) == 0.02 + 5e-7
    assert op_seconds(op("sub", nbytes=4e8, kernels=1), cpu) == 4e8 / 10e9 + 1e-5  # not measured: the roofline
