"""The flat-shard path (what zerolab's ZeRO sharder hands the optimizer) equals the optimizer on
whole tensors: flat groups are built here by hand from a few tensors (concatenated, padded, split
into one slice per rank, tensors straddling slice boundaries) and stepped in real gloo
processes with dist.all_reduce as the group's ShardMap.allreduce."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerolab.config import OptimConfig
from zerolab.optim import build_optimizer
from zerolab.optim.segments import ShardMap, Segment


# mp.spawn starts processes (multiprocessing, which conftest's Popen guard does not see): slow tier.
pytestmark = pytest.mark.slow

SHAPES = [[(7, 5), (13,), (4, 3, 2)], [(5,), (11,)]]  # group 0 decays (trust ratio), group 1 not
NAMES = [["a.weight", "b.weight", "c.weight"], ["a.bias", "b.bias"]]
STEPS = 5


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in shapes] for shapes in SHAPES]


def _grads(step):
    return _tensors(100 + step)


def _cfg(name):
    return OptimConfig(name=name, lr=0.05 if name != "lars" else 2.0, betas=[0.9, 0.999], eps=1e-6,
                       weight_decay=0.01, max_trust_ratio=None)


def _flat_layout(shapes, world, rank):
    """(start, end) of this rank's slice of the padded concatenation, and its segments."""
    sizes = [torch.Size(s).numel() for s in shapes]
    total = sum(sizes)
    chunk = -(-total // world)
    lo, hi = rank * chunk, (rank + 1) * chunk
    segs, off = [], 0
    for ti, n in enumerate(sizes):
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            segs.append(Segment(tensor=ti, start=a - lo, end=b - lo, offset=a - off))
        off += n
    return lo, hi, chunk, segs


def _flatten(tensors, chunk, world):
    flat = torch.cat([t.flatten() for t in tensors])
    return torch.cat([flat, flat.new_zeros(chunk * world - flat.numel())])


def _worker(rank, world, init_file, names, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name in names:
            _run_flat(rank, world, name, out_dir)
    finally:
        dist.destroy_process_group()


def _run_flat(rank, world, name, out_dir):
    groups, shards = [], []
    for gi, (shapes, tensors) in enumerate(zip(SHAPES, _tensors(0))):
        lo, hi, chunk, segs = _flat_layout(shapes, world, rank)
        shard = torch.nn.Parameter(_flatten(tensors, chunk, world)[lo:hi].clone())
        shards.append((shard, lo, hi, chunk))
        groups.append({"params": [shard], "names": NAMES[gi], "weight_decay": 0.01 if gi == 0 else 0.0,
                       "shard": ShardMap(segs, len(shapes), dist.all_reduce)})
    opt = build_optimizer(_cfg(name), groups)
    for step in range(STEPS):
        for (shard, lo, hi, chunk), grads in zip(shards, _grads(step)):
            shard.grad = _flatten(grads, chunk, world)[lo:hi].clone()
        opt.track_updates = step == STEPS - 1
        opt.step()
    stats = opt.pop_update_stats()
    sums = torch.cat([torch.cat([r["update_sq"], r["weight_sq"]]) for r in stats])
    dist.all_reduce(sums)
    torch.save({"shards": [s[0].detach() for s in shards], "trust": opt.step_stats(), "sums": sums},
               os.path.join(out_dir, f"{name}.rank{rank}.pt"))


def _unsharded(name):
    params = [[torch.nn.Parameter(t.clone()) for t in ts] for ts in _tensors(0)]
    groups = [{"params": ps, "names": NAMES[gi], "weight_decay": 0.01 if gi == 0 else 0.0}
              for gi, ps in enumerate(params)]
    opt = build_optimizer(_cfg(name), groups)
    for step in range(STEPS):
        for ps, grads in zip(params, _grads(step)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        opt.track_updates = step == STEPS - 1
        opt.step()
    sums = torch.cat([torch.cat([r["update_sq"], r["weight_sq"]]) for r in opt.pop_update_stats()])
    return params, opt.step_stats(), sums


OPTIMS = ["lamb", "lars", "adamw", "sgd_momentum"]
WORLD = 3


@pytest.fixture(scope="module")
def flat_runs(tmp_path_factory):
    """One set of 3 gloo processes runs every optimizer (process start-up dominates the cost)."""
    out = tmp_path_factory.mktemp("flat")
    mp.spawn(_worker, args=(WORLD, str(out / "init"), OPTIMS, str(out)), nprocs=WORLD, join=True)
    return out


@pytest.mark.parametrize("name", OPTIMS)
def test_flat_shards_equal_whole_tensors(flat_runs, name):
    results = [torch.load(flat_runs / f"{name}.rank{r}.pt", weights_only=True) for r in range(WORLD)]
    params, trust, sums = _unsharded(name)
    for gi, ps in enumerate(params):
        full = torch.cat([r["shards"][gi] for r in results])
        ref = torch.cat([p.detach().flatten() for p in ps])
        got = full[:ref.numel()]
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        # Same math on the same numbers; only the slicing and the norms' partial sums are reordered,
        # i.e. fp32 rounding (~1e-7 per step, few steps); a wrong segment would be off by ~lr.
        assert rel < 1e-6, f"{name} group {gi}: flat vs whole tensors differ by {rel:.3g} (relative)"
        assert torch.equal(full[ref.numel():], torch.zeros_like(full[ref.numel():])), "padding must stay 0"
        init = torch.cat([t.flatten() for t in _tensors(0)[gi]])
        assert (ref - init).abs().max() > 1e-3  # the optimizer moved the weights
    for r in results:  # every rank reports the same, global, statistics
        assert r["trust"].keys() == trust.keys()
        for k in trust:
            assert r["trust"][k] == pytest.approx(trust[k], rel=1e-6)
        assert torch.allclose(r["sums"], sums, rtol=1e-5)
    if name in ("lamb", "lars"):
        assert set(trust) == {"trust_ratio_min", "trust_ratio_median", "trust_ratio_max"}
