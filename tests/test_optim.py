"""zerolab's optimizers: equal to torch's where torch has one, to the papers' formulas where not."""
import math

import pytest
import torch

from zerolab.config import OPTIMIZERS, OptimConfig
from zerolab.optim import SGD, Adam, AdamW, Lamb, Lars, build_optimizer, state_elements_per_param


def _params(seed=0, shapes=((16, 8), (8,), (3, 5, 2))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def _run(make, init, steps=20, seed=1):
    """Apply `steps` steps of random gradients (the same sequence for every optimizer)."""
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    opt = make(ps)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in ps], opt


def _rel(a, b):
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


@pytest.mark.parametrize("impl", ["auto", "foreach", "for_loop"])
def test_adamw_matches_torch(impl):
    init = _params()
    ours, _ = _run(lambda ps: AdamW(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, impl=impl), init)
    ref, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1), init)
    # same formula, same op order as torch: fp32 rounding only (4e-8 measured after 200 steps)
    assert _rel(ours, ref) < 1e-6
    assert _rel(ours, init) > 1e-2  # it moved


@pytest.mark.parametrize("impl", ["auto", "foreach", "for_loop"])
def test_adam_coupled_l2_matches_torch(impl):
    init = _params()
    ours, _ = _run(lambda ps: Adam(ps, lr=1e-2, weight_decay=0.1, impl=impl), init)
    ref, _ = _run(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1), init)
    # Same formula, ops fused or ordered differently: fp32 rounding (~6e-8 per op) over the few
    # steps of _run stays near 1e-7 (the fused path measured 3.5e-8); a wrong L2 term is ~lr off.
    assert _rel(ours, ref) < 1e-6


@pytest.mark.parametrize("cls,torch_cls", [(AdamW, torch.optim.AdamW), (Adam, torch.optim.Adam)])
def test_adam_auto_is_torchs_fused_kernel(cls, torch_cls):
    """impl=auto on fp32 CPU tensors runs torch's fused kernel: bitwise torch's fused Adam(W), and
    within fp32 rounding of zerolab's composed foreach ops (the old default)."""
    init = _params()
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours, _ = _run(lambda ps: cls(ps, **hp), init)
    fused, _ = _run(lambda ps: torch_cls(ps, **hp, fused=True), init)
    composed, _ = _run(lambda ps: cls(ps, **hp, impl="foreach"), init)
    assert all(torch.equal(a, b) for a, b in zip(ours, fused))
    # One kernel vs seven ops: each rounds the same quantities in a different order, ~1 ulp (6e-8)
    # per step on the update; measured 1.7e-8 / 3.5e-8 after 20 steps, 1e-6 leaves ~30x.
    assert _rel(ours, composed) < 1e-6


def _flat_group(tensors, names):
    """One contiguous tensor holding `tensors`, as zerolab's ZeRO sharder hands it at world size 1."""
    from zerolab.optim.segments import ShardMap, Segment

    segs, off = [], 0
    for i, t in enumerate(tensors):
        segs.append(Segment(tensor=i, start=off, end=off + t.numel(), offset=0))
        off += t.numel()
    flat = torch.nn.Parameter(torch.cat([t.flatten() for t in tensors]))
    return flat, {"params": [flat], "names": names, "shard": ShardMap(segs, len(tensors), lambda t: None)}


@pytest.mark.parametrize("impl", ["auto", "foreach"])
def test_adamw_flat_shard_equals_whole_tensors(impl):
    """The ZeRO shape (one flat tensor) and ddp's (whole tensors) take the same kernel: the fused one
    is elementwise, so they agree bitwise, logged update norms included (to summation order)."""
    init, names = _params(), ["a", "b", "c"]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, impl=impl)
    whole = [torch.nn.Parameter(t.clone()) for t in init]
    flat, group = _flat_group(init, names)
    opts = [AdamW([{"params": whole, "names": names}], **hp), AdamW([group], **hp)]
    g = torch.Generator().manual_seed(1)
    for step in range(10):
        grads = [torch.randn(t.shape, generator=g) for t in init]
        for p, gr in zip(whole, grads):
            p.grad = gr
        flat.grad = torch.cat([gr.flatten() for gr in grads])
        for opt in opts:
            opt.track_updates = step == 9
            opt.step()
    got = torch.cat([p.detach().flatten() for p in whole])
    if impl == "auto":
        assert torch.equal(flat.detach(), got)
    else:  # the composed ops over one tensor vs many: same elementwise math, fp32 rounding only
        assert ((flat.detach() - got).abs().max() / got.abs().max()).item() < 1e-6
    (a,), (b,) = (opt.pop_update_stats() for opt in opts)
    assert b["partial"] and not a["partial"] and a["names"] == b["names"] == names
    # the same per-tensor sums, added in a different order (segments vs whole tensors): fp32 rounding
    assert torch.allclose(a["update_sq"], b["update_sq"], rtol=1e-5)
    assert torch.allclose(a["weight_sq"], b["weight_sq"], rtol=1e-5)


@pytest.mark.parametrize("case", ["bf16", "no_bias_correction"])
def test_adamw_keeps_composed_ops_where_fused_would_differ(case):
    """16-bit weights (bf16_pure) and bias_correction=False keep the composed ops: auto equals
    impl=foreach bitwise (the fused kernel would round bf16 once instead of per op)."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    init = [t.to(dtype) for t in _params()]
    hp = dict(lr=1e-2, weight_decay=0.1, bias_correction=case != "no_bias_correction")

    def run(impl):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = AdamW(ps, **hp, impl=impl)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            opt.step()
        return ps

    assert all(torch.equal(a, b) for a, b in zip(run("auto"), run("foreach")))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("impl", ["foreach", "for_loop"])
def test_sgd_matches_torch(momentum, impl):
    init = _params()
    ours, _ = _run(lambda ps: SGD(ps, lr=0.05, momentum=momentum, weight_decay=0.01, impl=impl), init)
    ref, _ = _run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=momentum, weight_decay=0.01), init)
    # both fp32, the same formula in another order: a few ulps (fp32's 6e-8) per step; 1e-6 is ~10x that
    assert _rel(ours, ref) < 1e-6


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_auto_is_torchs_fused_kernel_for_whole_tensors_and_a_flat_shard(momentum):
    """impl=auto on fp32 CPU tensors runs torch's fused SGD: bitwise torch.optim.SGD(fused=True),
    and bitwise the same for the ZeRO shape (one flat tensor) as for whole tensors."""
    init, names = _params(), ["a", "b", "c"]
    hp = dict(lr=0.05, momentum=momentum, weight_decay=0.01)
    ours, _ = _run(lambda ps: SGD(ps, **hp), init)
    fused, _ = _run(lambda ps: torch.optim.SGD(ps, **hp, fused=True), init)
    assert all(torch.equal(a, b) for a, b in zip(ours, fused))
    flat, group = _flat_group(init, names)
    opt, g = SGD([group], **hp), torch.Generator().manual_seed(1)
    for _ in range(20):  # _run's gradient sequence, concatenated
        flat.grad = torch.cat([torch.randn(t.shape, generator=g).flatten() for t in init])
        opt.step()
    assert torch.equal(flat.detach(), torch.cat([p.flatten() for p in ours]))


def test_adamw_worked_first_step():
    """The course's example: lr 0.01, betas (0.9, 0.999), eps 1e-8, wd 0.01."""
    w = torch.nn.Parameter(torch.tensor([0.4, 0.0]))
    w.grad = torch.tensor([-0.8265, 0.2326])
    AdamW([w], lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).step()
    assert w[0].item() == pytest.approx(0.40996, abs=1e-7)
    assert w[1].item() == pytest.approx(-0.01, abs=1e-7)
    # Without bias correction the first m/√v is (0.1·g)/√(0.001·g²) = ±3.16 instead of ±1.
    w = torch.nn.Parameter(torch.tensor([0.4]))
    w.grad = torch.tensor([-0.8265])
    AdamW([w], lr=1.0, eps=0.0, weight_decay=0.0, bias_correction=False).step()
    m_over_sqrt_v = -(w.item() - 0.4)  # Δw = −lr·m/√v
    assert m_over_sqrt_v == pytest.approx(-3.16, abs=5e-3)
    assert m_over_sqrt_v == pytest.approx(-0.1 / math.sqrt(0.001), rel=1e-5)


def _lamb_reference(init, steps, lr, betas, eps, wd, max_ratio=None, seed=1):
    """LAMB written out per tensor from the paper, in float64."""
    b1, b2 = betas
    ws = [t.double().clone() for t in init]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    g = torch.Generator().manual_seed(seed)
    for t in range(1, steps + 1):
        for i, w in enumerate(ws):
            grad = torch.randn(w.shape, generator=g).double()
            ms[i] = b1 * ms[i] + (1 - b1) * grad
            vs[i] = b2 * vs[i] + (1 - b2) * grad * grad
            u = (ms[i] / (1 - b1 ** t)) / ((vs[i] / (1 - b2 ** t)).sqrt() + eps) + wd * w
            wn, un = w.norm(), u.norm()
            r = (wn / un).item() if wn > 0 and un > 0 else 1.0
            if max_ratio is not None:
                r = min(r, max_ratio)
            ws[i] = w - lr * r * u
    return ws


@pytest.mark.parametrize("impl", ["foreach", "for_loop"])
def test_lamb_matches_paper_formula(impl):
    init = _params()
    ours, opt = _run(lambda ps: Lamb(ps, lr=0.02, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, impl=impl),
                     init, steps=10)
    ref = _lamb_reference(init, 10, 0.02, (0.9, 0.999), 1e-6, 0.01)
    # fp32 against an fp64 reference: ~10 roundings of 6e-8 per step over 10 steps (~6e-6 if they all
    # added up, far less as they do not); 1e-5 bounds even the sum
    assert _rel(ours, [r.float() for r in ref]) < 1e-5
    stats = opt.step_stats()
    assert 0 < stats["trust_ratio_min"] <= stats["trust_ratio_median"] <= stats["trust_ratio_max"]


def test_lamb_trust_ratio_rules():
    # A zero tensor has ‖w‖ = 0: ratio 1 (it can leave zero); the clamp bounds large ratios.
    init = [torch.zeros(4, 4), 100 * torch.ones(3)]
    _, opt = _run(lambda ps: Lamb(ps, lr=0.01, max_trust_ratio=10.0), init, steps=1)
    assert opt.step_stats()["trust_ratio_max"] == pytest.approx(10.0)  # ‖w‖/‖u‖ ≈ 100, clamped
    assert opt.step_stats()["trust_ratio_min"] == pytest.approx(1.0)  # the zero tensor
    ours, opt = _run(lambda ps: Lamb(ps, lr=0.01, max_trust_ratio=10.0), init, steps=3)
    ref = _lamb_reference(init, 3, 0.01, (0.9, 0.999), 1e-6, 0.0, max_ratio=10.0)
    assert _rel(ours, [r.float() for r in ref]) < 1e-5  # fp32 against fp64: the bound argued above
    # trust_ratio=False is AdamW (LAMB's λ·w term inside u, times lr, is AdamW's decoupled decay).
    init = _params()
    off, opt = _run(lambda ps: Lamb([{"params": ps, "trust_ratio": False}], lr=0.01, weight_decay=0.1), init)
    adamw, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=0.01, eps=1e-6, weight_decay=0.1), init)
    # both fp32, one step, the same formula in another order: a few ulps (6e-8); 1e-6 is ~10x that
    assert _rel(off, adamw) < 1e-6 and opt.step_stats() == {}


@pytest.mark.parametrize("impl", ["foreach", "for_loop"])
def test_lars_matches_paper_formula(impl):
    init = _params()
    lr, mu, wd, tc, eps = 2.0, 0.9, 1e-4, 0.001, 1e-8
    ours, _ = _run(lambda ps: Lars(ps, lr=lr, momentum=mu, weight_decay=wd, trust_coefficient=tc, eps=eps,
                                   impl=impl), init, 10)
    ws = [t.double().clone() for t in init]
    bufs = [torch.zeros_like(w) for w in ws]
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        for i, w in enumerate(ws):
            grad = torch.randn(w.shape, generator=g).double()
            local = tc * w.norm() / (grad.norm() + wd * w.norm() + eps)
            bufs[i] = mu * bufs[i] + lr * local * (grad + wd * w)
            ws[i] = w - bufs[i]
    # fp32 against fp64 over 10 steps: as LAMB's above, ~10 roundings of 6e-8 a step at most
    assert _rel(ours, [w.float() for w in ws]) < 1e-5


def test_build_optimizer_every_name_and_group_rules():
    w, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.zeros(4))
    groups = [{"params": [w], "names": ["fc.weight"], "weight_decay": 0.1},
              {"params": [b], "names": ["fc.bias"], "weight_decay": 0.0}]
    classes = {"adamw": AdamW, "adam": Adam, "sgd": SGD, "sgd_momentum": SGD, "lamb": Lamb, "lars": Lars}
    for name in OPTIMIZERS:
        opt = build_optimizer(OptimConfig(name=name, lr=0.01, weight_decay=0.1), groups)
        assert type(opt) is classes[name]
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        if name in ("lamb", "lars"):
            assert [g["trust_ratio"] for g in opt.param_groups] == [True, False]
    assert build_optimizer(OptimConfig(name="sgd_momentum", momentum=0.8), groups).param_groups[0]["momentum"] == 0.8
    with pytest.raises(ValueError, match="allowed values"):
        build_optimizer(OptimConfig(name="adagrad"), groups)


def test_state_elements_per_param_measured():
    assert {n: state_elements_per_param(n) for n in OPTIMIZERS} == {
        "adamw": 2.0, "adam": 2.0, "sgd": 0.0, "sgd_momentum": 1.0, "lamb": 2.0, "lars": 1.0}


@pytest.mark.parametrize("name", ["adamw", "lamb", "lars", "sgd_momentum"])
def test_tracked_update_norms_equal_measured_change(name):
    """‖Δw‖ and ‖w‖ recorded by the optimizer are those of the change it actually made."""
    ps = [torch.nn.Parameter(t) for t in _params()]
    opt = build_optimizer(OptimConfig(name=name, lr=0.05), [{"params": ps, "names": ["a", "b", "c"]}])
    for p in ps:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in ps]
    opt.track_updates = True
    opt.step()
    (rec,) = opt.pop_update_stats()
    assert rec["names"] == ["a", "b", "c"] and not rec["partial"]
    measured = torch.stack([(p.detach() - b).pow(2).sum() for p, b in zip(ps, before)])
    assert torch.allclose(rec["update_sq"], measured, rtol=1e-4)
    assert torch.allclose(rec["weight_sq"], torch.stack([b.pow(2).sum() for b in before]), rtol=1e-5)
    opt.track_updates = False
    opt.step()
    assert opt.pop_update_stats() == []


@pytest.mark.parametrize("name", ["adamw", "lamb", "lars", "sgd_momentum"])
def test_float64_norms_stay_float64(name):
    """Norms of fp64 weights are computed in fp64 (only 16-bit tensors are upcast, to fp32).
    1 + k·2^-40 rounds to 1.0 in fp32, so an fp32 sum of squares of these weights would read
    exactly 1000, and LAMB/LARS trust ratios computed from it would be off."""
    w = torch.nn.Parameter(1 + torch.arange(1000, dtype=torch.float64) * 2.0 ** -40)
    exact = (w.detach() * w.detach()).sum()
    assert w.detach().float().pow(2).sum().item() == 1000.0 != exact.item()  # fp32 loses it
    opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=0.0), [{"params": [w], "names": ["w"]}])
    w.grad = torch.full_like(w, 0.5)
    opt.track_updates = True
    opt.step()
    (rec,) = opt.pop_update_stats()
    assert rec["weight_sq"].dtype == torch.float64 and rec["weight_sq"].item() == exact.item()
    assert w.dtype == torch.float64


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="impl='fast'"):
        AdamW([torch.nn.Parameter(torch.zeros(2))], impl="fast")
    with pytest.raises(ValueError, match="max_trust_ratio"):
        Lamb([torch.nn.Parameter(torch.zeros(2))], max_trust_ratio=0)


def test_optim_state_command(capsys):
    from zerolab.memory.cli import optim_state_main

    assert optim_state_main(["--optim", "sgd", "sgd_momentum", "lamb", "--model", "mlp"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert {k: float(v[1]) for k, v in rows.items()} == {"sgd": 0.0, "sgd_momentum": 1.0, "lamb": 2.0}
    assert int(rows["lamb"][2].replace(",", "")) == 2 * 4 * int(rows["lamb"][3].replace(",", ""))  # fp32 m, v
