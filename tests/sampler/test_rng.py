"""Philox4x32-10 known answers, exact integer helpers, key/counter layout and stream determinism."""
import math
import random

import pytest
import torch

from blockdiff.sampler import rng

M = 0xFFFFFFFF

# Random123 kat_vectors, philox4x32 10 rounds: (counter, key, expected output)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M), (M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers(ctr, key, expected):
    out = rng.philox4x32_10(*[torch.tensor([c]) for c in ctr], *[torch.tensor([k]) for k in key])
    assert tuple(int(x) for x in out) == expected


def _philox_py(c, k):
    c, k = list(c), list(k)
    for r in range(10):
        if r:
            k = [(k[0] + rng.PHILOX_W0) & M, (k[1] + rng.PHILOX_W1) & M]
        p0, p1 = rng.PHILOX_M0 * c[0], rng.PHILOX_M1 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M, (p0 >> 32) ^ c[3] ^ k[1], p0 & M]
    return tuple(c)


def test_philox_matches_python_bigint_on_random_words():
    g = random.Random(0)
    cs = [[g.getrandbits(32) for _ in range(6)] for _ in range(64)]
    t = torch.tensor(cs, dtype=torch.int64)
    out = torch.stack(rng.philox4x32_10(*t.unbind(1)), 1)
    for row, o in zip(cs, out.tolist()):
        assert tuple(o) == _philox_py(row[:4], row[4:])


def test_uniform_is_exact_and_open_interval():
    w = torch.tensor([0, M, 1 << 31, 511, 512], dtype=torch.int64)
    u = rng.uniform_from_word(w)
    assert u.dtype == torch.float32
    assert u[0].item() == 2.0 ** -24 and u[1].item() == 1.0 - 2.0 ** -24
    assert u[3].item() == u[0].item() and u[4].item() == 3 * 2.0 ** -24
    g = rng.gumbel_from_word(w)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("V", [1, 2, 3, 7, 1000, 262144, (1 << 31) - 1])
def test_ids_from_words_exact_multiply_shift(V):
    g = random.Random(V)
    w0 = [g.getrandbits(32) for _ in range(200)] + [0, M, M, 0]
    w1 = [g.getrandbits(32) for _ in range(200)] + [0, M, 0, M]
    ids = rng.ids_from_words(torch.tensor(w0), torch.tensor(w1), V).tolist()
    for a, b, i in zip(w0, w1, ids):
        assert i == ((a | (b << 32)) * V) >> 64
        assert 0 <= i < V


def test_ids_from_words_rejects_bad_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        rng.ids_from_words(torch.tensor([0]), torch.tensor([0]), 0)


def test_counter_layout():
    c = rng.make_counter(torch.tensor(0x123456789ABC), torch.tensor(5), torch.tensor(7), torch.tensor(300),
                         rng.RENOISE, torch.tensor(9))
    assert [int(x) for x in c] == [9, 300 | (1 << 16) | (7 << 18), 0x56789ABC, 0x1234 | (5 << 16)]
    k0, k1 = rng.make_key(torch.tensor(0x0102030405060708))
    assert (int(k0), int(k1)) == (0x05060708, 0x01020304)


def _args(n=1, seed=1, rid=5, ci=0, step=0):
    t = lambda v: torch.full((n,), v, dtype=torch.int64)
    return t(seed), t(rid), t(ci), t(step)


def test_gumbel_noise_word_mapping():
    seed, rid, ci, step = _args(seed=11, rid=22, ci=3, step=4)
    g = rng.gumbel_noise(seed, rid, ci, step, 3, 10)
    k0, k1 = rng.make_key(seed)
    for p in range(3):
        for t in range(10):
            c = rng.make_counter(rid, ci, step, torch.tensor(p), rng.GUMBEL, torch.tensor(t >> 2))
            w = rng.philox4x32_10(*c, k0, k1)[t & 3]
            assert g[0, p, t].item() == rng.gumbel_from_word(w).item()


def test_streams_and_coordinates_are_independent():
    base = rng.random_ids(*_args(), 64, 1000, rng.RENOISE)
    assert torch.equal(base, rng.random_ids(*_args(), 64, 1000, rng.RENOISE))  # deterministic
    for other in (rng.random_ids(*_args(), 64, 1000, rng.INITIAL),
                  rng.random_ids(*_args(seed=2), 64, 1000, rng.RENOISE),
                  rng.random_ids(*_args(rid=6), 64, 1000, rng.RENOISE),
                  rng.random_ids(*_args(ci=1), 64, 1000, rng.RENOISE),
                  rng.random_ids(*_args(step=1), 64, 1000, rng.RENOISE)):
        assert (other != base).float().mean() > 0.9


def test_noise_of_a_row_does_not_depend_on_the_batch():
    alone = rng.gumbel_noise(*_args(seed=3, rid=9, ci=1, step=2), 4, 37)
    seed = torch.tensor([1, 3, 4]); rid = torch.tensor([0, 9, 9]); ci = torch.tensor([0, 1, 1]); st = torch.tensor([0, 2, 3])
    batch = rng.gumbel_noise(seed, rid, ci, st, 4, 37)
    assert torch.equal(batch[1], alone[0])
    ids_alone = rng.random_ids(*_args(seed=3, rid=9, ci=1, step=2), 4, 37, rng.RENOISE)
    assert torch.equal(rng.random_ids(seed, rid, ci, st, 4, 37, rng.RENOISE)[1], ids_alone[0])


def test_gumbel_and_ids_statistics():
    g = rng.gumbel_noise(*_args(), 64, 1024)
    assert abs(g.mean().item() - 0.5772156649) < 0.02
    assert abs(g.std().item() - math.pi / math.sqrt(6)) < 0.02
    ids = rng.random_ids(*_args(), 60000, 6, rng.INITIAL)
    counts = torch.bincount(ids.flatten(), minlength=6).float()
    assert ((counts - 10000).abs() < 500).all()


def test_random_ids_rejects_gumbel_stream():
    with pytest.raises(ValueError, match="stream"):
        rng.random_ids(*_args(), 4, 10, rng.GUMBEL)


@pytest.mark.parametrize("name,kw,exc", [
    ("vocab_size", dict(vocab_size=2.9), TypeError), ("vocab_size", dict(vocab_size=True), TypeError),
    ("vocab_size", dict(vocab_size="5"), TypeError), ("vocab_size", dict(vocab_size=2**31), ValueError),
    ("canvas_length", dict(canvas_length=2.5), TypeError), ("canvas_length", dict(canvas_length=2**16), ValueError),
    ("canvas_length", dict(canvas_length=-1), ValueError), ("stream", dict(stream=True), TypeError),
    ("stream", dict(stream=1.0), TypeError), ("stream", dict(stream=0), ValueError),
    ("stream", dict(stream=3), ValueError)])
def test_draws_refuse_sizes_that_are_not_ints_in_range(name, kw, exc):
    """Regression: random_ids (torch and Triton) and ids_from_words took int(vocab_size), so 2.9 drew ids in
    [0, 2), "5" was parsed and True read as 1; canvas_length was never checked (2**16 + 1 positions silently reused
    the first positions' noise, 2.5 drew 3 positions) and gumbel_noise checked nothing. Now a TypeError / ValueError
    names the argument in every draw function."""
    from blockdiff.sampler.triton.common import random_ids as triton_random_ids
    args = dict(canvas_length=4, vocab_size=10, stream=rng.RENOISE)
    args.update(kw)
    draws = [lambda: rng.random_ids(*_args(), args["canvas_length"], args["vocab_size"], args["stream"]),
             lambda: triton_random_ids(*_args(), args["canvas_length"], args["vocab_size"], args["stream"])]
    if name != "stream":
        draws.append(lambda: rng.gumbel_noise(*_args(), args["canvas_length"], args["vocab_size"]))
    if name == "vocab_size":
        draws.append(lambda: rng.ids_from_words(torch.tensor([0]), torch.tensor([0]), args["vocab_size"]))
    for draw in draws:
        with pytest.raises(exc, match=name):
            draw()


def test_stream_that_is_not_an_int_is_a_type_error_naming_stream():
    """Regression: check_sizes(stream=1.0) and stream=True were a ValueError, though its docstring (and the project's
    rule) make an argument that is not an int a TypeError; an int that is not a per-position stream stays a
    ValueError."""
    for bad in (1.0, True, "1"):
        with pytest.raises(TypeError, match="stream"):
            rng.check_sizes(stream=bad)
    for bad in (0, 3, -1):
        with pytest.raises(ValueError, match="stream"):
            rng.check_sizes(stream=bad)
    rng.check_sizes(stream=rng.RENOISE)
    rng.check_sizes(stream=rng.INITIAL)


@pytest.mark.parametrize("name", ["seed", "request_id", "canvas_index", "step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_float_seed_tensor_is_refused_naming_seed(name, dtype):
    """Regression: gumbel_noise, random_ids (torch and Triton) and make_key / make_counter ran ``.to(torch.int64)``
    on their coordinates, so a float seed tensor was truncated (seeds 1.2 and 1.9 drew seed 1's noise) and a bool one
    read as 0 / 1; the Triton kernel's ``.to(tl.int64)`` did the same. Now a float / bool / complex coordinate is a
    TypeError naming it, in every draw function."""
    from blockdiff.sampler.triton.common import random_ids as triton_random_ids
    args = dict(zip(("seed", "request_id", "canvas_index", "step"), _args()))
    args[name] = torch.ones(1, dtype=dtype)
    a = (args["seed"], args["request_id"], args["canvas_index"], args["step"])
    draws = [lambda: rng.gumbel_noise(*a, 4, 10), lambda: rng.random_ids(*a, 4, 10, rng.RENOISE),
             lambda: triton_random_ids(*a, 4, 10, rng.RENOISE)]
    if name == "seed":
        draws.append(lambda: rng.make_key(a[0]))
    else:
        draws.append(lambda: rng.make_counter(a[1], a[2], a[3], torch.arange(4), rng.RENOISE))
    for draw in draws:
        with pytest.raises(TypeError, match=name):
            draw()


def test_draw_coordinates_refuse_floats_but_take_every_integer_dtype():
    """Python floats (a seed of 1.5) and float Philox words are refused by name; int32 / int64 tensors and Python
    ints keep drawing the same numbers as before (int32 canvas indices are what SamplerState holds)."""
    with pytest.raises(TypeError, match="seed"):
        rng.make_key(1.5)
    with pytest.raises(TypeError, match="k0"):
        rng.philox4x32_10(0, 0, 0, 0, 0.5, 0)
    with pytest.raises(TypeError, match="c2"):
        rng.philox4x32_10(0, 0, torch.tensor([1.0]), 0, 0, 0)
    with pytest.raises(ValueError, match="request_id"):
        rng.make_counter(2**64, 0, 0, 0, rng.RENOISE)
    seed, rid, ci, step = _args(seed=7, rid=9, ci=2, step=3)
    ref = rng.random_ids(seed, rid, ci, step, 8, 100, rng.RENOISE)
    same = rng.random_ids(seed.to(torch.int32), rid.to(torch.int32), ci.to(torch.int32), step.to(torch.int32), 8, 100,
                          rng.RENOISE)
    assert torch.equal(ref, same)
    assert torch.equal(rng.random_ids(7, 9, 2, 3, 8, 100, rng.RENOISE), ref)
    g = rng.gumbel_noise(seed, rid, ci, step, 4, 10)
    assert torch.equal(rng.gumbel_noise([7], [9], [2], [3], 4, 10), g)


@pytest.mark.parametrize("word", [-1, -(2**40) + 3, 2**32, 2**40 + 5, 2**62 + 7])
def test_philox_reduces_tensor_words_modulo_2_32_as_it_does_python_ints(word):
    """A tensor word outside [0, 2**32) went into the rounds unreduced: tensor(-1) gave a negative output word (a
    negative uniform, a NaN Gumbel) and tensor(2**40 + 5) one above 2**32, while the Python int of the same value
    was masked. Both are now reduced modulo 2**32, so a tensor and an int word give the same, in-range words."""
    for i in range(6):
        args_int = [0] * 6
        args_int[i] = word
        args_t = [0] * 6
        args_t[i] = torch.tensor([word])
        want = tuple(int(x) for x in rng.philox4x32_10(*args_int))
        got = tuple(int(x) for x in rng.philox4x32_10(*args_t))
        assert got == want
        args_int[i] = word & M
        assert want == tuple(int(x) for x in rng.philox4x32_10(*args_int))
        assert all(0 <= x <= M for x in got)


@pytest.mark.parametrize("stream", [4, 5, -1, 1 << 20])
def test_make_counter_refuses_a_stream_outside_its_2_bit_field(stream):
    """stream was shifted into c1 unchecked: stream 4 at step 0 gave the very counter of stream 0 at step 1 (the same
    noise for two draws meant to be independent), and stream -1 a negative counter word. Now a ValueError naming
    stream; streams 0..3 keep their counters."""
    assert int(rng.make_counter(1, 0, 1, 3, rng.GUMBEL)[1]) == 3 | (1 << 18)  # what stream 4 at step 0 collided with
    with pytest.raises(ValueError, match=r"stream must be in \[0, 4\)"):
        rng.make_counter(1, 0, 0, 3, stream)
    for s in range(4):
        assert int(rng.make_counter(1, 0, 2, 3, s)[1]) == 3 | (s << 16) | (2 << 18)


def test_draws_refuse_coordinates_of_different_row_counts_naming_them_and_broadcast_one_entry():
    """gumbel_noise with a one-entry seed beside three request ids raised torch's RuntimeError ("shape '[1, 2, 8]' is
    invalid for input of size 48") where random_ids broadcast the seed; two and three entries failed in both with a
    RuntimeError from inside the draw. Now a ValueError naming the coordinates and their counts, and one entry (or an
    int) is every row's in both draws."""
    rid = torch.tensor([1, 2, 3])
    z = torch.zeros(3, dtype=torch.int64)
    g = rng.gumbel_noise(torch.tensor([7]), rid, z, z, 2, 5)
    assert torch.equal(g, rng.gumbel_noise(torch.full((3,), 7), rid, z, z, 2, 5))
    assert torch.equal(rng.gumbel_noise(7, rid, 0, 0, 2, 5), g)
    ids = rng.random_ids(torch.tensor([7]), rid, z, z, 2, 5, rng.RENOISE)
    assert torch.equal(ids, rng.random_ids(torch.full((3,), 7), rid, z, z, 2, 5, rng.RENOISE))
    for draw in (lambda s: rng.gumbel_noise(s, rid, z, z, 2, 5), lambda s: rng.random_ids(s, rid, z, z, 2, 5, 1)):
        with pytest.raises(ValueError, match="one entry per row.*seed 2, request_id 3, canvas_index 3, step 3"):
            draw(torch.tensor([7, 8]))
    assert rng.num_rows(torch.zeros(0), torch.zeros(1), torch.zeros(0), torch.zeros(())) == 0
