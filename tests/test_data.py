"""The sampler: disjoint and complete coverage across ranks, the same global batch whatever the
world size, exact mid-epoch resume; token files round-trip."""
import numpy as np
import pytest

from zerolab.data import TokenData, WindowSampler, prepare


def epoch_windows(n, world, micro, accum, seed=3):
    s = WindowSampler(n, seed, micro, accum, world)
    steps = n // s.global_batch
    seen = []
    for step in range(steps):
        for rank in range(world):
            for m in range(accum):
                seen.append((step, rank, tuple(s.windows(step, rank, m))))
    return s, seen


@pytest.mark.parametrize("world, micro, accum", [(1, 4, 1), (2, 3, 2), (3, 2, 1), (4, 1, 3)])
def test_one_epoch_is_disjoint_and_complete(world, micro, accum):
    n = 2 * 3 * 4 * 6  # divisible by every global batch above
    s, seen = epoch_windows(n, world, micro, accum)
    flat = [w for _, _, ws in seen for w in ws]
    assert sorted(flat) == list(range(n))  # complete, and no window twice
    per_rank = [{w for _, r, ws in seen if r == rank for w in ws} for rank in range(world)]
    for a in range(world):
        for b in range(a + 1, world):
            assert not per_rank[a] & per_rank[b]


def test_global_batch_is_independent_of_world_size():
    one = WindowSampler(100, 7, micro_batch=8, grad_accum=1, world_size=1)
    two = WindowSampler(100, 7, micro_batch=2, grad_accum=2, world_size=2)
    for step in range(5):
        a = sorted(one.windows(step, 0, 0))
        b = sorted(w for r in range(2) for m in range(2) for w in two.windows(step, r, m))
        assert a == b


def test_resume_mid_epoch_is_exact():
    full = WindowSampler(50, 11, 3, 1, 2)
    seq = [full.windows(step, r, 0) for step in range(30) for r in range(2)]  # crosses epochs
    resumed = WindowSampler(50, 11, 3, 1, 2)  # fresh object: no state carried over
    assert [resumed.windows(step, r, 0) for step in range(13, 30) for r in range(2)] == seq[26:]


def test_epochs_are_reshuffled():
    s = WindowSampler(20, 1, 20, 1, 1)
    assert s.windows(0, 0, 0) != s.windows(1, 0, 0)
    assert sorted(s.windows(0, 0, 0)) == sorted(s.windows(1, 0, 0))


def test_prepare_and_split(tmp_path):
    src = tmp_path / "a.txt"
    src.write_bytes(bytes(range(256)) * 40)
    out = tmp_path / "tok.bin"
    n = prepare([str(src)], str(out))
    assert n == 256 * 40
    data = TokenData(str(out), block_size=15, val_fraction=0.1)
    assert data.tokens.dtype == np.uint16 and data.tokens[:256].tolist() == list(range(256))
    s = WindowSampler(data.n_windows("train"), 0, 4, 1, 1)
    b = data.train_batch(s, 0, 0, 0, "cpu")
    assert b.x.shape == (4, 15) and (b.y[:, :-1] == b.x[:, 1:]).all()


def test_truncated_token_file_is_reported(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        TokenData(str(bad), 8, 0.1)


def test_generated_test_corpus_is_the_same_bytes_everywhere():
    """The tests' numeric bounds were measured on this corpus (tests/conftest.py): if the generator
    changed, they would silently be checked on other text."""
    import hashlib

    from conftest import generated_corpus_bytes

    data = generated_corpus_bytes()
    assert len(data) == 1 << 20
    assert hashlib.sha256(data).hexdigest() == "a89cba689e2fa10e268c0e3e9de9abc7f8af04a85cae8594d7991ef60cba1ab2"
