"""Host mirror of the cute kernel's key-block plan (blockdiff.attention.cute.blocks.tile_plan): it covers exactly
the blocks that intersect each tile's allowed region (blockdiff.attention.masks.key_range) and runs unmasked only on
fully allowed blocks."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiff.attention.cute.blocks import tile_plan
from blockdiff.attention.masks import key_range


def _check_plan(q_len, ctx, ncq, window, mode, tile_m, tile_n, qpk):
    seq_len = ctx + q_len
    plan = tile_plan(q_len, seq_len, ncq, window, mode, tile_m=tile_m, tile_n=tile_n, qhead_per_kvhead=qpk)
    assert len(plan) == -(-q_len * qpk // tile_m)
    rows = torch.arange(q_len)
    t = lambda v: torch.tensor(v)  # noqa: E731
    lo, hi = key_range(rows, t(q_len), t(seq_len), t(ncq), window, mode)
    for p in plan:
        r0, r1 = p["rows"]
        m_rows = torch.arange(p["m_block"] * tile_m, (p["m_block"] + 1) * tile_m) // qpk
        m_rows = m_rows[m_rows < q_len]
        assert (r0, r1) == (int(m_rows.min()), int(m_rows.max()))
        tlo, thi = lo[r0:r1 + 1], hi[r0:r1 + 1]
        assert bool((thi >= tlo).all()), "every row allows at least its own key"
        n_min, n_max = p["n_block_min"], p["n_block_max"]
        # exact: first and last loaded block hold the tile's extreme allowed keys (cost follows the mask)
        assert n_min == int(tlo.min()) // tile_n
        assert n_max - 1 == int(thi.max()) // tile_n
        # unmasked blocks are fully allowed for every row of the tile
        for n in range(max(n_min, p["left_mask_below"]), min(n_max, p["right_mask_from"])):
            k0, k1 = n * tile_n, (n + 1) * tile_n - 1
            assert bool((tlo <= k0).all()) and bool((thi >= k1).all()), (p, n)
        # masked ranges are a prefix / suffix of [n_min, n_max): the three loops partition it
        assert n_min <= p["left_mask_below"] and p["right_mask_from"] >= n_min


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    q_len=st.integers(1, 600),
    ctx=st.one_of(st.just(0), st.integers(0, 1500)),
    ncq_frac=st.sampled_from([0.0, 1.0, 0.5, 0.01, 0.99]),
    window=st.one_of(st.none(), st.sampled_from([0, 1, 15, 63, 64, 127, 128, 129, 1023]), st.integers(0, 3000)),
    mode=st.sampled_from(["symmetric", "prefix"]),
    tiles=st.sampled_from([(128, 128), (128, 64), (128, 80), (64, 128)]),
    qpk=st.sampled_from([1, 2, 3, 8]),
)
def test_tile_plan_covers_exactly_the_allowed_blocks(q_len, ctx, ncq_frac, window, mode, tiles, qpk):
    _check_plan(q_len, ctx, int(round(ncq_frac * q_len)), window, mode, tiles[0], tiles[1], qpk)


@pytest.mark.parametrize("q_len,ctx,ncq,window,mode", [
    (1, 0, 1, None, "symmetric"), (1, 0, 0, 0, "prefix"), (1, 8191, 0, 1023, "symmetric"),
    (256, 8192, 0, 1023, "prefix"), (256, 8192, 256, 1023, "symmetric"), (4096, 0, 4096, 1023, "symmetric"),
    (300, 10, 150, 0, "symmetric"), (300, 10, 150, 5, "prefix"), (129, 127, 1, 128, "prefix"),
])
def test_tile_plan_edges(q_len, ctx, ncq, window, mode):
    for tiles in ((128, 128), (128, 64), (128, 80)):
        for qpk in (1, 2):
            _check_plan(q_len, ctx, ncq, window, mode, tiles[0], tiles[1], qpk)


def test_tile_plan_of_an_empty_sequence_is_empty_and_bad_modes_are_errors():
    assert tile_plan(0, 100, 0, 63, "prefix") == []
    with pytest.raises(ValueError, match="bidirectional_window"):
        tile_plan(16, 100, 0, 63, "sliding")
    with pytest.raises(TypeError, match="window_size"):
        tile_plan(16, 100, 0, 63.0)
