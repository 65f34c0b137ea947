"""bench/workloads.py: named workloads match docs/ARCHITECTURE.md; built batches are valid paged caches."""
import pytest
import torch

from blockdiff.bench import workloads as wl
from blockdiff.attention.reference import gather_kv

NAMES = ["mixed_sliding_ctx8k", "mixed_sliding_prefix_ctx8k", "mixed_global_ctx8k", "canvas_bs1_ctx32k_global",
         "canvas_bs1_ctx32k_sliding", "canvas_bs1_ctx32k_hd128", "canvas_bs4_ctx4k_hd128", "prefill16k_hd128"]


def test_named_workloads_full_shapes():
    ws = {w.name: w for w in wl.named_workloads()}
    assert list(ws) == NAMES
    m = ws["mixed_sliding_ctx8k"]
    assert m.q_lens == (4096, 256, 256, 256) and m.seq_lens == (4096, 8448, 8448, 8448)
    assert m.causal == (True, False, False, True) and m.kinds == ("prefill", "denoise", "denoise", "commit")
    assert (m.num_heads, m.num_kv_heads, m.head_dim, m.window_size) == (16, 8, 256, 1023)
    assert ws["mixed_sliding_prefix_ctx8k"].bidirectional_window == "prefix"
    g = ws["canvas_bs1_ctx32k_global"]
    assert (g.num_kv_heads, g.head_dim, g.window_size, g.seq_lens) == (2, 512, None, (33024,))
    assert ws["canvas_bs4_ctx4k_hd128"].seq_lens == (4352,) * 4
    assert ws["prefill16k_hd128"].causal == (True,)
    assert ws["mixed_sliding_ctx8k"].anchors_ms == {"fa4": 0.164, "flex": 0.372}


@pytest.mark.parametrize("w", wl.named_workloads(quick=True), ids=lambda w: w.name)
def test_quick_workloads_keep_structure(w):
    full = {x.name: x for x in wl.named_workloads()}[w.name]
    assert w.causal == full.causal and w.bidirectional_window == full.bidirectional_window
    assert (w.window_size is None) == (full.window_size is None)
    assert w.num_heads % w.num_kv_heads == 0 and w.total_q <= 256 and not w.anchors_ms


def test_build_paged_batch_is_valid_and_permuted():
    w = wl.named_workloads(quick=True)[0]
    b = wl.build(w, "cpu", torch.float32, page_size=16, seed=3)
    assert b.q.shape == (w.total_q, w.num_heads, w.head_dim)
    assert b.block_table.dtype == torch.int32 and b.cu_seqlens_q.tolist()[-1] == w.total_q
    used = torch.cat([b.block_table[i, : -(-s // 16)] for i, s in enumerate(w.seq_lens)])
    assert used.unique().numel() == used.numel()  # no page shared between sequences
    assert not torch.equal(used, torch.arange(used.numel(), dtype=torch.int32))  # permuted
    for i, s in enumerate(w.seq_lens):
        k, v = b.kv_of(i)
        assert torch.equal(k, gather_kv(b.k_cache, b.block_table[i], s))
    k, v, cu = b.contiguous_kv()
    assert k.shape[0] == sum(w.seq_lens) and cu.tolist()[-1] == k.shape[0]
    assert torch.equal(wl.build(w, "cpu", torch.float32, page_size=16, seed=3).q, b.q)


def test_ladders_and_select():
    bl = wl.batch_ladder(layers=("hd128",), sizes=(1, 8))
    assert [w.name for w in bl] == ["canvas_bs1_ctx8k_hd128", "canvas_bs8_ctx8k_hd128"]
    assert bl[1].batch_size == 8 and bl[1].seq_lens == (8448,) * 8
    cl = wl.context_ladder(layers=("global",), contexts=(1024, 131072))
    assert [w.name for w in cl] == ["canvas_bs1_ctx1k_global", "canvas_bs1_ctx128k_global"]
    assert [w.name for w in wl.select(wl.named_workloads(), "canvas_bs1*,prefill*")] == NAMES[3:6] + NAMES[7:]
    with pytest.raises(ValueError, match="matches none"):
        wl.select(wl.named_workloads(), "nope*")
    with pytest.raises(ValueError, match="page_size"):
        wl.build(bl[0], page_size=0)


def test_small_suite_keeps_heads_window_and_canvas():
    small = {w.name: w for w in wl.SUITES["small"]()}
    full = {w.name: w for w in wl.named_workloads()}
    assert list(small) == list(full)
    m = small["mixed_sliding_ctx8k"]
    assert m.q_lens == (512, 256, 256, 256) and m.seq_lens == (512, 1280, 1280, 1280)
    assert (m.num_heads, m.num_kv_heads, m.head_dim, m.window_size) == (16, 8, 256, 1023) and not m.anchors_ms


def test_workload_key_ranges_and_pairs_come_from_the_mask_semantics():
    from blockdiff.attention import build_mask

    w = wl.named_workloads(quick=True)[1]  # mixed, prefix window
    assert w.num_causal_q == tuple(q if c else 0 for q, c in zip(w.q_lens, w.causal))
    dense = sum(int(build_mask(q, s, causal=c, window_size=w.window_size,
                               bidirectional_window=w.bidirectional_window).sum())
                for q, s, c in zip(w.q_lens, w.seq_lens, w.causal))
    assert w.allowed_pairs() == dense
    seq_id, lo, hi = w.key_ranges()
    assert seq_id.shape == lo.shape == hi.shape == (w.total_q,) and int((hi - lo + 1).clamp_min(0).sum()) == dense


def test_build_is_the_public_batch_builder_with_zero_padding():
    from blockdiff.attention.testing import make_batch

    w = wl.named_workloads(quick=True)[0]
    b = wl.build(w, "cpu", torch.float32, page_size=16, seed=5)
    t = make_batch(w.seq_lens, w.q_lens, causal=list(w.causal), num_heads=w.num_heads, num_kv_heads=w.num_kv_heads,
                   head_dim=w.head_dim, page_size=16, dtype=torch.float32, seed=5, extra_columns=0,
                   block_table_pad="zeros")
    for k in ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens", "causal"):
        assert torch.equal(getattr(b, k), t[k]), k
    assert b.block_table.shape[1] == max(-(-s // 16) for s in w.seq_lens)


def test_batch_layouts_give_the_same_attention_in_both_kv_forms():
    from blockdiff.attention import attention

    w = wl.named_workloads(quick=True)[0]
    b = wl.build(w, "cpu", torch.float64, page_size=16, seed=2)
    lay = b.layouts()
    assert set(lay) == {"paged", "contiguous"}
    k, v, kw = lay["paged"]
    kc, vc, kwc = lay["contiguous"]
    assert "block_table" in kw and "cu_seqlens_k" in kwc and "block_table" not in kwc and "causal" not in kw
    assert kw["num_causal_q"].tolist() == list(w.num_causal_q)
    torch.testing.assert_close(attention(b.q, k, v, backend="reference", **kw),
                               attention(b.q, kc, vc, backend="reference", **kwc), rtol=0, atol=0)



@pytest.mark.parametrize("patterns", [",", " ", " , ", ["", " "], ("",)])
def test_select_refuses_patterns_that_name_no_workload_rather_than_measuring_nothing(patterns):
    """``--workloads ","`` (or blanks) passed the "matches none" rule, since no pattern was left to match nothing,
    and selected no workload: the run measured nothing and exited 0. A given ``patterns`` that names no pattern is a
    ValueError; None, "" and [] still mean all, and a non-str pattern is a TypeError."""
    ws = wl.named_workloads(quick=True)
    with pytest.raises(ValueError, match="names no pattern"):
        wl.select(ws, patterns)
    assert wl.select(ws, None) == wl.select(ws, "") == wl.select(ws, []) == ws
    assert [w.name for w in wl.select(ws, " prefill* ,")] == ["prefill16k_hd128"]
    for bad in ([3], 5, ["mixed*", None]):
        with pytest.raises(TypeError, match="patterns"):
            wl.select(ws, bad)


def test_bench_attention_cli_refuses_workloads_naming_no_pattern():
    from blockdiff.bench import bench_attention
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--quick", "--workloads", ","])


def test_triton_sweep_flops_cache_tells_the_quick_shape_from_the_full_one():
    """sweep_triton_attention.w_flops cached FLOPs by workload name, which the --quick and the full shapes share:
    after a quick workload the full one's effective TFLOP/s used the quick FLOPs (and the other way round)."""
    from blockdiff.bench import common
    from blockdiff.bench import sweep_triton_attention as st

    quick = {w.name: w for w in wl.named_workloads(quick=True)}["canvas_bs1_ctx32k_sliding"]
    full = {w.name: w for w in wl.named_workloads()}["canvas_bs1_ctx32k_sliding"]
    st.w_flops(quick)
    assert st.w_flops(full) == common.attention_flops(16, 256, 294784, 256)  # 256 rows x (1279 - r) keys
    assert st.w_flops(quick) == common.attention_flops(quick.num_heads, quick.head_dim, quick.allowed_pairs())
