"""The parts zerolab's ZeRO sharder is composed of (zerolab/strategies/zero/), each on its own, in
one process (fast tier): the storage and its place (storage.py, host.py), the gradient reduction
(reduce.py), zero3's units (units.py), the collectives in flight (zerolab/comm.py); and that a step
without offload never enters the host's code (host.py).

Every figure here is exact (copies, views, sums of a handful of small integers or of one rank's
own values), so the checks are equalities."""
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import fixed_corpus
from zerolab.comm import CommCounter, InFlight
from zerolab.config import compose
from zerolab.models import build_model
from zerolab.precision import Precision
from zerolab.strategies.transient import TransientPeak
from zerolab.strategies.zero.host import Host
from zerolab.strategies.zero.layout import pack
from zerolab.strategies.zero.reduce import BucketCopies, WholeGrads
from zerolab.strategies.zero.storage import CopyShard, Device, StoredShard, WeightsShard, shard_for
from zerolab.strategies.zero.units import make_units, unit_buckets
from zerolab.topology import Topology
from zerolab.trainer import Trainer

CPU = SimpleNamespace(device=torch.device("cpu"))


def model_and_groups():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    return model, [{"params": list(model.parameters()), "names": [n for n, _ in model.named_parameters()]}]


def precision(name: str = "fp32", *modes: str) -> Precision:
    return Precision.from_config(compose(["strategy=zero2", f"precision={name}", *modes]).precision)


def storage(name="fp32", *modes, shards=2, rank=1, whole_grads=False, offload=(), persistent=False, grad_dtype=None):
    """A shard of a two-layer model (32 parameters) in buckets of at least 8 elements, `shards` chunks
    each: zero1/2's packing, or (`persistent`) zero3's, one slab per group (its model has no blocks:
    one unit, the root)."""
    model, groups = model_and_groups()
    p = precision(name, *modes)
    model.to(p.compute_dtype)
    buckets = unit_buckets(make_units(model, groups, ""), groups, shards, 8) if persistent else \
        pack(model, groups, shards, 8, whole_grads=whole_grads)
    settings = SimpleNamespace(**{k: True for k in offload})
    shard = shard_for(buckets, groups, ctx=CPU, settings=settings, precision=p, rank=rank, transient=TransientPeak(),
                      persistent=persistent, grad_dtype=grad_dtype)
    return model, groups, buckets, shard


# ---- storage.py: what holds the shard, and where -------------------------------------------------------
def test_the_kind_and_the_place_follow_the_settings():
    for args, kind, place in ((("fp32",), WeightsShard, "device"), (("bf16",), CopyShard, "device"),
                              (("bf16", "precision.master=remainder"), StoredShard, "device"),
                              (("bf16", "precision.master=bf16"), StoredShard, "device"),
                              (("bf16_pure",), WeightsShard, "device")):
        shard = storage(*args)[3]
        assert (type(shard), shard.place.name) == (kind, place), args
    # off the device the shard is a copy of its own even where its dtype is the weights'
    shard = storage("fp32", offload=("offload_optimizer",))[3]
    assert (type(shard), shard.place.name, shard.weights_place.name) == (CopyShard, "host", "device")
    # zero3 with both offloads: its persistent chunks are the shard, on the host
    shard = storage("fp32", offload=("offload_optimizer", "offload_params"), persistent=True)[3]
    assert (type(shard), shard.weights_place.name) == (WeightsShard, "host")
    assert [w.untyped_storage()._cdata for w in shard.persistent()] == \
        [s.untyped_storage()._cdata for g in shard.groups for s in g.slabs]


def test_a_shard_that_is_the_weights_is_a_view_of_this_ranks_chunks():
    _, _, buckets, shard = storage("fp32")
    for b in buckets:
        slab = shard.groups[b.group].slabs[b.slab]
        slab.data.add_(1.0)  # an update in place shows in the model's weights
        assert torch.equal(b.flat_params[b.chunk:2 * b.chunk], slab.data)
        chunk, copied = shard.gather_input(b)
        assert chunk.untyped_storage()._cdata == b.flat_params.untyped_storage()._cdata and copied == 0


def test_a_copy_rounds_its_weights_on_the_device_and_into_them_on_the_host():
    _, _, buckets, shard = storage("bf16")
    b = buckets[0]
    slab = shard.groups[b.group].slabs[b.slab]
    assert slab.dtype == torch.float32 and torch.equal(slab.data, b.flat_params[b.chunk:2 * b.chunk].float())
    slab.data.add_(1 / 3)
    chunk, copied = shard.gather_input(b)  # a copy of its own, until the all-gather is waited for
    assert torch.equal(chunk, slab.data.to(torch.bfloat16)) and copied == 2 * b.chunk
    assert chunk.untyped_storage()._cdata != b.flat_params.untyped_storage()._cdata
    _, _, buckets, shard = storage("bf16", offload=("offload_optimizer",))
    b = buckets[0]
    slab = shard.groups[b.group].slabs[b.slab]
    slab.data.add_(1 / 3)
    chunk, copied = shard.gather_input(b)  # rounded on the host, into the device's own chunk
    assert torch.equal(b.flat_params[b.chunk:2 * b.chunk], slab.data.to(torch.bfloat16)) and copied == 0


def test_the_remainder_shard_holds_the_fp32_master_in_the_weights():
    _, _, buckets, shard = storage("bf16", "precision.master=remainder")
    g = shard.groups[0]
    assert all(s.untyped_storage().nbytes() == 0 for s in g.slabs)  # stand-ins
    value = torch.linspace(-1, 1, g.slabs[0].numel()) / 3
    g.master.store(0, value.clone())
    assert torch.equal(g.master.fp32(0), value)  # exact: weight and remainder
    assert torch.equal(buckets[0].flat_params[buckets[0].chunk:2 * buckets[0].chunk], g.master.weights[0])


def test_segments_tile_every_tensor_once_over_the_ranks():
    model, groups = model_and_groups()
    covered = {n: torch.zeros(p.numel(), dtype=torch.int64) for n, p in model.named_parameters()}
    for rank in (0, 1):
        _, groups, _, shard = storage("fp32", rank=rank)
        g = shard.groups[0]
        for s in g.segments:
            name = g.names[s.tensor]
            covered[name][s.offset:s.offset + s.end - s.start] += 1
            flat = dict(zip(g.names, groups[0]["params"]))[name].detach().view(-1)
            assert torch.equal(g.slabs[s.slab].data[s.start:s.end], flat[s.offset:s.offset + s.end - s.start])
    assert all(bool((c == 1).all()) for c in covered.values())


def test_the_gradient_shard_is_a_view_where_it_can_be_and_copied_to_fp32_where_it_is_16_bits():
    _, _, buckets, shard = storage("fp32", whole_grads=True)  # zero1, fp32: its chunk of the whole gradients
    for b, landing in zip(buckets, shard.landings):
        landing.fill_(b.index + 1.0)
        assert bool((b.flat_grads[b.chunk:2 * b.chunk] == b.index + 1).all())
        grad = shard.groups[b.group].slabs[b.slab].grad  # what the optimizer reads, in place
        assert torch.equal(grad, landing) and grad.untyped_storage()._cdata == b.flat_grads.untyped_storage()._cdata
    _, _, buckets, shard = storage("bf16", "precision.grad_shard=bf16")  # zero2: 16-bit, its own
    for landing in shard.landings:
        landing.fill_(0.5)
    assert all(g.dtype == torch.bfloat16 for g in shard.grads) and all(s.grad is None for s in shard.groups[0].slabs)
    with shard.fp32_grads() as grads:
        assert all(g.dtype == torch.float32 and bool((g == 0.5).all()) for g in grads)
        assert shard.transient.live == 4 * sum(g.numel() for g in grads)  # on the device: a step transient
    assert all(s.grad is None for s in shard.groups[0].slabs) and shard.transient.live == 0


def test_zero3_keeps_persistent_chunks_that_follow_the_shard():
    _, _, buckets, shard = storage("bf16", persistent=True, grad_dtype=torch.bfloat16)
    g = shard.groups[0]
    (slab,), (weights,) = g.slabs, g.weights
    assert weights.dtype == torch.bfloat16 and torch.equal(weights, slab.data.to(torch.bfloat16))
    slab.data.add_(1 / 3)
    shard.refresh()
    assert torch.equal(weights, slab.data.to(torch.bfloat16))
    assert torch.equal(shard.persistent_chunk(buckets[0]), weights[:buckets[0].chunk])


# ---- host.py: the copies between the host and the device ---------------------------------------------
def test_the_host_lands_reduced_chunks_in_order_through_copies_of_its_own():
    host, landed = Host(Device(torch.device("cpu"))), []
    deliver = host.delivery(lambda i, chunk: landed.append((i, chunk)))
    outs = [torch.full((4,), float(i)) for i in range(3)]
    for i, out in enumerate(outs):
        deliver(i, out)
    host.settle()
    assert [i for i, _ in landed] == [0, 1, 2]
    assert all(torch.equal(c, o) and c.untyped_storage()._cdata != o.untyped_storage()._cdata
               for (_, c), o in zip(landed, outs))
    staged, copied = host.for_gather(torch.ones(4, dtype=torch.bfloat16))  # offload_params: a device copy
    assert copied == 8 and torch.equal(staged, torch.ones(4, dtype=torch.bfloat16))
    device = Device(torch.device("cpu"))
    assert device.delivery(print) is print and device.for_gather(outs[0]) == (outs[0], 0)


# ---- reduce.py: gradients into the shard ----------------------------------------------------------------
def reduction(cls, name="fp32"):
    model, groups, buckets, shard = storage(name, shards=1, rank=0, whole_grads=cls is WholeGrads)
    red = cls(buckets, shard, group=None, comm=CommCounter(Topology(world=1, per_node=1)), transient=shard.transient,
              world=1, reduce_dtype=torch.float32, device=torch.device("cpu"))
    return list(model.parameters()), buckets, shard, red


def test_buckets_launch_in_order_and_every_micro_batch_is_summed(one_rank):
    params, buckets, shard, red = reduction(BucketCopies)
    assert len(buckets) > 1
    later = [p for p, _, _ in buckets[1].params]
    for micro in (1.0, 2.0):
        for p in later:  # bucket 1 complete first: it waits for bucket 0
            p.grad = torch.full_like(p, micro)
            red.grad_ready(p)
        assert red.next_launch == 0 and not red.pending
        for p, _, _ in buckets[0].params:
            p.grad = torch.full_like(p, micro)
            red.grad_ready(p)
        red.finish_backward()
    for b, landing in zip(buckets, shard.landings):
        used = sum(p.numel() for p, _, _ in b.params)
        assert bool((landing[:used] == 3.0).all()) and bool((landing[used:] == 0).all())  # padding stays 0
    assert shard.transient.live == 0 and all(b.comm_buf is None for b in buckets)


def test_zero1_sends_nothing_under_no_sync_and_copies_the_reduced_chunk_once(one_rank):
    params, buckets, shard, red = reduction(WholeGrads, "bf16")  # an fp32 gradient shard of its own
    with red.no_sync():
        for p in params:
            p.grad.fill_(1.0)
            red.grad_ready(p)
        red.finish_backward()
    assert not red.pending and red.next_launch == 0 and not red.comm.pop_step()["total"]
    for p in params:
        p.grad.add_(1.0)
        red.grad_ready(p)
    red.finish_backward()
    assert red.comm.pop_step()["reduce_scatter"] == 0  # recorded: one rank sends nothing
    for b, landing in zip(buckets, shard.landings):
        # world 1: the reduced chunk is the whole bucket (2.0 each, / 1), copied into the fp32 shard
        used = sum(p.numel() for p, _, _ in b.params)
        assert landing.dtype == torch.float32 and torch.equal(landing, b.flat_grads.float())
        assert bool((landing[:used] == 2.0).all())
    assert shard.transient.live == 0  # the fp32 send buffers (strategy.reduce_dtype) were freed
    red.clear()
    assert all(bool((b.flat_grads == 0).all()) for b in buckets)


# ---- comm.py: collectives in flight ----------------------------------------------------------------------
def test_in_flight_waits_by_key_finishes_once_and_gives_back_the_bytes(one_rank):
    flight, finished = InFlight(), []
    for key in (3, 1):
        t = torch.ones(2)
        flight.add(key, dist.all_reduce(t, async_op=True), t, nbytes=10 * key, finish=lambda k=key: finished.append(k))
    assert flight.wait([1]) == 10 and finished == [1]
    assert flight.wait([1]) == 0 and flight.wait() == 30 and finished == [1, 3] and not flight.running


# ---- units.py: zero3's units and their buckets -----------------------------------------------------------
def test_units_own_whole_buckets_and_the_root_is_reduced_last():
    model = build_model(compose(["model=gpt_tiny", "model.bias=false"]).model)
    groups = [{"params": list(model.parameters()), "names": [n for n, _ in model.named_parameters()]}]
    units = make_units(model, groups, "")
    buckets = unit_buckets(units, groups, shards=2, cap=4096)
    assert [u.name for u in units] == ["root", "blocks.0", "blocks.1"]
    for unit in units:
        own = {id(p) for p in unit.params}
        assert all(id(p) in own for i in unit.buckets for p, _, _ in buckets[i].params)
    assert units[0].buckets[-1] == len(buckets) - 1 and units[2].buckets[0] == 0  # last block first, root last
    assert [b.shard_pos for b in buckets] == [sum(b.chunk for b in buckets[:i]) for i in range(len(buckets))]


# ---- a step without offload never enters host.py ----------------------------------------------------------
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_step_without_offload_never_enters_the_hosts_code(one_rank, tmp_path, strategy):
    entered = {}
    for offload in ("false", "true"):
        cfg = compose([f"strategy={strategy}", "model=gpt_tiny", "trainer.eval_every=0", "data.micro_batch=2",
                       f"data.path={fixed_corpus()}", f"run.dir={tmp_path / offload}", "logging.wandb.mode=disabled",
                       "logging.progress=false", "run.save_model=false", f"strategy.offload_optimizer={offload}"])
        trainer = Trainer(cfg, one_rank)
        trainer.train_step(0)
        calls = []
        sys.setprofile(lambda frame, event, _: calls.append(frame.f_code.co_filename)
                       if event == "call" and frame.f_code.co_filename.endswith("zero/host.py") else None)
        try:
            trainer.train_step(1)
        finally:
            sys.setprofile(None)
        trainer.close()
        entered[offload] = len(calls)
    assert entered["false"] == 0 and entered["true"] > 0
