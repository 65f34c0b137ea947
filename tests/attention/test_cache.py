"""write_kv_cache (attention/cache.py): slot semantics and bad-input errors."""
import pytest
import torch

from blockdiff.attention import write_kv_cache


def _caches(num_blocks=2, page_size=4, Hkv=1, D=2):
    return torch.zeros(num_blocks, page_size, Hkv, D), torch.zeros(num_blocks, page_size, Hkv, D)


def test_writes_at_slots_and_skips_negative_slots():
    kc, vc = _caches()
    k = torch.arange(6.).reshape(3, 1, 2)
    write_kv_cache(k, -k, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc.view(8, 1, 2)[5], k[0]) and torch.equal(kc.view(8, 1, 2)[0], k[2])
    assert torch.equal(vc.view(8, 1, 2)[5], -k[0])
    assert kc.view(8, 1, 2)[[1, 2, 3, 4, 6, 7]].eq(0).all()


def test_duplicate_slots_are_an_error_not_an_unspecified_write():
    kc, vc = _caches()
    k = torch.arange(6.).reshape(3, 1, 2)
    with pytest.raises(ValueError, match="slot_mapping.*two tokens"):
        write_kv_cache(k, k, kc, vc, torch.tensor([1, 1, 2]))
    write_kv_cache(k, k, kc, vc, torch.tensor([-1, -1, 2]))  # repeated padding (-1) is fine


@pytest.mark.parametrize("slots", [torch.tensor([1.0, 0.0, 2.0]), torch.tensor([True, False, True])])
def test_non_integer_slot_mapping_is_a_type_error(slots):
    kc, vc = _caches()
    k = torch.zeros(3, 1, 2)
    with pytest.raises(TypeError, match="slot_mapping"):
        write_kv_cache(k, k, kc, vc, slots)


def test_k_and_v_caches_with_different_pages_are_a_value_error():
    kc, _ = _caches()
    vc = torch.zeros(1, 4, 1, 2)
    k = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        write_kv_cache(k, k, kc, vc, torch.tensor([7]))


def test_out_of_range_slot_and_empty_write():
    kc, vc = _caches()
    k = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="slot_mapping has a slot >="):
        write_kv_cache(k, k, kc, vc, torch.tensor([8]))
    write_kv_cache(k[:0], k[:0], kc, vc, torch.zeros(0, dtype=torch.int64))


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_k_or_v_is_a_type_error_not_a_silent_cast(which, dtype):
    kc, vc = _caches()
    k = torch.zeros(2, 1, 2)
    kw = dict(k=k, v=k)
    kw[which] = torch.ones(2, 1, 2, dtype=dtype)
    with pytest.raises(TypeError, match=f"{which} must be a floating-point tensor"):
        write_kv_cache(kw["k"], kw["v"], kc, vc, torch.tensor([0, 1]))


def test_float_k_is_rounded_to_the_cache_dtype():
    kc, vc = (c.bfloat16() for c in _caches())
    k = torch.full((1, 1, 2), 1.0 + 2 ** -12, dtype=torch.float64)
    write_kv_cache(k, k, kc, vc, torch.tensor([3]))
    assert kc.view(8, 1, 2)[3].eq(1.0).all()


def test_k_cache_and_v_cache_sharing_memory_is_a_value_error():
    """Was: v written over k silently (the same tensor passed twice)."""
    kc, _ = _caches()
    k = torch.ones(1, 1, 2)
    with pytest.raises(ValueError, match="must not share memory"):
        write_kv_cache(k, k, kc, kc, torch.tensor([0]))
    flat = torch.zeros(17, 1, 2)
    with pytest.raises(ValueError, match="must not share memory"):  # overlapping contiguous views
        write_kv_cache(k, k, flat[:8].view(2, 4, 1, 2), flat[1:9].view(2, 4, 1, 2), torch.tensor([0]))



@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_a_cache_with_elements_sharing_memory_is_a_value_error_naming_it(which):
    """Was: an ``expand()``ed page pool accepted, and a write to slot 5 (page 1) also landed in page 0's row 1."""
    kc, vc = _caches()
    caches = {"k_cache": kc, "v_cache": vc}
    caches[which] = torch.zeros(1, 4, 1, 2).expand(2, 4, 1, 2)
    with pytest.raises(ValueError, match=f"{which} must not have elements sharing memory"):
        write_kv_cache(torch.ones(1, 1, 2), torch.ones(1, 1, 2), caches["k_cache"], caches["v_cache"],
                       torch.tensor([5]))

def test_strided_k_and_v_cache_views_sharing_some_elements_are_a_value_error():
    """Was: accepted (only the same start address or overlapping *contiguous* views were refused), and v's write
    landed in k's last columns: ``x[..., :2]`` and ``x[..., 1:3]`` share column 1."""
    x = torch.zeros(2, 4, 1, 3)
    with pytest.raises(ValueError, match="must not share memory"):
        write_kv_cache(torch.ones(1, 1, 2), torch.full((1, 1, 2), 2.0), x[..., :2], x[..., 1:], torch.tensor([0]))
    assert x.eq(0).all()
    pool = torch.zeros(2, 2, 4, 1, 2)  # [num_blocks, k | v, page_size, ...]: interleaved by page, sharing nothing
    k = torch.ones(1, 1, 2)
    write_kv_cache(k, -k, pool[:, 0], pool[:, 1], torch.tensor([5]))
    assert pool[1, 0, 1].eq(1).all() and pool[1, 1, 1].eq(-1).all() and pool.abs().sum() == 4


def test_share_elements_agrees_with_the_elements_of_random_strided_views():
    import random
    from blockdiff.attention.validate import share_elements
    rng = random.Random(0)
    buf = torch.zeros(400)

    def addresses(t):
        idx = torch.cartesian_prod(*(torch.arange(n) for n in t.shape)).reshape(-1, t.dim())
        return set((idx * torch.tensor(t.stride())).sum(1).add(t.storage_offset()).tolist())

    for _ in range(300):
        nd = rng.randint(1, 3)
        a, b = (buf.as_strided([rng.randint(1, 4) for _ in range(nd)],
                               [rng.choice([0, 1, 2, 3, 5, 7, 12]) for _ in range(nd)], rng.randint(0, 40))
                for _ in range(2))
        assert share_elements(a, b) == bool(addresses(a) & addresses(b)), (a.shape, a.stride(), b.shape, b.stride())


def test_interleaved_k_and_v_halves_of_one_tensor_are_fine():
    kv = torch.zeros(2, 4, 1, 4)  # [..., k | v] in the last dim: strided views that never share an element
    kc, vc = kv[..., :2], kv[..., 2:]
    k = torch.arange(2.).reshape(1, 1, 2)
    write_kv_cache(k, -k, kc, vc, torch.tensor([5]))
    assert kv.view(8, 1, 4)[5].tolist() == [[0.0, 1.0, -0.0, -1.0]]


def test_debug_switch_checks_slots_of_check_values_false_calls(debug_on):
    kc, vc = _caches()
    k = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="slot_mapping has a slot >="):
        write_kv_cache(k, k, kc, vc, torch.tensor([8]), check_values=False)


def _kv(T=3, H=2, D=4, NB=3, P=4):
    return torch.randn(T, H, D), torch.randn(T, H, D), torch.tensor([0, 5, 11])[:T]


@pytest.mark.parametrize("which", ["k", "v", "slot_mapping", "caches"])
def test_tensors_on_another_device_or_without_data_are_a_value_error_naming_them(which):
    """Were torch RuntimeErrors from index_copy / .item() (the meta device stands in for another device)."""
    k, v, sm = _kv()
    kc, vc = torch.zeros(3, 4, 2, 4), torch.zeros(3, 4, 2, 4)
    if which == "caches":
        kc, vc = kc.to("meta"), vc.to("meta")
    else:
        k, v, sm = (x.to("meta") if name == which else x for name, x in (("k", k), ("v", v), ("slot_mapping", sm)))
    with pytest.raises(ValueError, match="meta"):
        write_kv_cache(k, v, kc, vc, sm)


@pytest.mark.parametrize("layout", ["transposed", "reversed_pages", "strided_rows"])
def test_caches_whose_pages_are_not_one_row_stride_apart_are_written_at_the_right_rows(layout):
    """Was a RuntimeError of view() for caches whose pages cannot be viewed as [num_blocks * page_size] rows."""
    k, v, sm = _kv()
    if layout == "transposed":
        kc, vc = torch.zeros(4, 3, 2, 4).transpose(0, 1), torch.zeros(4, 3, 2, 4).transpose(0, 1)
    elif layout == "reversed_pages":
        kc, vc = torch.zeros(3, 4, 2, 4).flip(0), torch.zeros(3, 4, 2, 4).flip(0)
    else:
        kc, vc = torch.zeros(3, 8, 2, 4)[:, ::2], torch.zeros(3, 8, 2, 4)[:, ::2]
    write_kv_cache(k, v, kc, vc, sm)
    for i, slot in enumerate(sm.tolist()):
        assert torch.equal(kc[slot // 4, slot % 4], k[i]) and torch.equal(vc[slot // 4, slot % 4], v[i])
    assert int(kc.ne(0).any(-1).any(-1).sum()) == 3


def test_k_and_v_that_are_views_of_the_caches_are_written_as_copies():
    """Keys / values read out of the caches themselves (rows moved to other slots) were torch's RuntimeError
    'some elements of the input tensor and the written-to tensor refer to a single memory location'; the sources
    are copied first now, and the write equals that of detached copies."""
    kc = torch.arange(2 * 4 * 1 * 2, dtype=torch.float32).reshape(2, 4, 1, 2)
    vc = -torch.arange(2 * 4 * 1 * 2, dtype=torch.float32).reshape(2, 4, 1, 2)
    k, v = kc.view(8, 1, 2)[0:3], kc.view(8, 1, 2)[4:7]  # v read from k_cache: overlaps the other cache
    want_k, want_v = kc.clone(), vc.clone()
    write_kv_cache(k.clone(), v.clone(), want_k, want_v, torch.tensor([1, 2, 3]))
    write_kv_cache(k, v, kc, vc, torch.tensor([1, 2, 3]))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
