"""The public entry point (attention/triton/interface.py): metadata layouts, ``out`` aliasing and views, input
and config errors, the causal flags read on the device; on the H200 (``-m gpu``) the named workloads, head dims,
windows, page sizes, tile grids and a CUDA-graph replay, whichever kernel the automatic choice runs."""
import pytest
import torch

from blockdiff.attention import attention, validate
from blockdiff.attention.testing import check_close
from blockdiff.attention.triton.interface import attention_triton

from triton_helpers import GPU_BATCH, GPU_HEADS, MIXED, SMALL, graph_replay_check, make_batch, run_and_check


def _strided(t):
    """The same values as a non-contiguous view (every other element of a twice-as-long buffer)."""
    if t.dim() == 2:
        return t.t().contiguous().t()
    buf = torch.zeros(t.shape[0] * 2, dtype=t.dtype, device=t.device)
    buf[::2] = t
    return buf[::2]


@pytest.mark.parametrize("name", ["cu_seqlens_q", "seq_lens", "block_table", "num_causal_q", "cu_seqlens_k"])
def test_non_contiguous_metadata_is_read_by_value_not_by_layout(name):
    """Strided metadata views (cu_seqlens_q, seq_lens, num_causal_q, a column-major block_table,
    cu_seqlens_k) give the same result as dense ones (the kernel indexed them as dense arrays)."""
    kw = dict(MIXED)
    if name == "num_causal_q":
        kw.pop("causal")
        kw["num_causal_q"] = [9, 0, 3, 1, 0, 5]
    inp = make_batch(**kw, paged=name != "cu_seqlens_k")
    inp[name] = _strided(inp[name])
    assert not inp[name].is_contiguous()
    run_and_check(inp, config=SMALL, window_size=3)


@pytest.mark.parametrize("config", [dict(SMALL, BLOCK_DV=16), dict(SMALL, num_splits=2), SMALL])
def test_out_aliasing_q_gives_the_unaliased_result(config):
    """out=q (or any out overlapping an input): V head-dim slices re-read Q after another slice wrote out."""
    inp = make_batch(**MIXED, head_dim=32)
    ref = attention_triton(**inp, config=config, window_size=3)
    o = attention_triton(**inp, config=config, window_size=3, out=inp["q"])
    assert o.data_ptr() == inp["q"].data_ptr()
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


def test_out_with_rows_sharing_memory_is_rejected():
    """An expand()ed out (every row the same memory) was silently written by all rows (last writer wins)."""
    inp = make_batch(**MIXED)
    out = torch.zeros(1, 4, 16, dtype=inp["q"].dtype, device=inp["q"].device).expand(inp["q"].shape[0], 4, 16)
    with pytest.raises(ValueError, match="out must not have elements sharing memory"):
        attention_triton(**inp, config=SMALL, out=out)


def test_out_views_are_written_in_place():
    inp = make_batch(**MIXED)
    total_q = inp["q"].shape[0]
    ref = attention_triton(**inp, config=SMALL, window_size=3)
    big = torch.full((total_q, 4, 40), float("nan"), dtype=ref.dtype, device=ref.device)
    view = big[:, :, 8:24]  # strided rows, unit last stride
    attention_triton(**inp, config=SMALL, window_size=3, out=view)
    torch.testing.assert_close(view, ref, rtol=0, atol=0)
    assert torch.isnan(big[:, :, :8]).all() and torch.isnan(big[:, :, 24:]).all()
    tr = torch.full((16, 4, total_q), float("nan"), dtype=ref.dtype, device=ref.device).permute(2, 1, 0)
    attention_triton(**inp, config=SMALL, window_size=3, out=tr)  # non-unit last stride: written via a copy
    torch.testing.assert_close(tr, ref, rtol=0, atol=0)


def test_bad_config_and_dtype_raise_clear_errors():
    inp = make_batch(**MIXED)
    with pytest.raises(ValueError, match="BLOCK_N"):
        attention_triton(**inp, config=dict(BLOCK_N=8))
    with pytest.raises(ValueError, match="unknown keys"):
        attention_triton(**inp, config=dict(BLOCK_K=16))
    with pytest.raises(ValueError, match="num_splits"):
        attention_triton(**inp, config=dict(num_splits=0))
    with pytest.raises(TypeError, match="LAZY_RESCALE"):  # an int for a bool: the wrong type
        attention_triton(**inp, config=dict(LAZY_RESCALE=1))
    with pytest.raises(ValueError, match="BLOCK_M"):
        attention_triton(**make_batch(**MIXED, num_heads=32, num_kv_heads=1), config=dict(BLOCK_M=16))
    with pytest.raises(TypeError, match="q must be"):
        attention_triton(**make_batch(**MIXED, dtype=torch.float64))
    with pytest.raises(ValueError, match="include the query"):
        bad = make_batch(**MIXED)
        bad["seq_lens"] = bad["seq_lens"] - 1
        attention_triton(**bad)


def test_causal_flags_reach_the_kernel_without_a_conversion_op(monkeypatch):
    """``causal`` [B] bool is read by the kernel itself (q_len if set, else 0): no num_causal_q conversion op per
    call; the result equals the reference (which converts) and the num_causal_q form."""
    inp = make_batch(seq_lens=[20, 17, 9, 0], q_lens=[11, 9, 9, 0], causal=[True, False, True, False], num_heads=4,
                     num_kv_heads=2)
    ncq = validate.causal_row_counts(inp["causal"], inp["cu_seqlens_q"])

    def forbidden(*a, **k):
        raise AssertionError("the Triton backend converted causal flags to num_causal_q")

    monkeypatch.setattr(validate, "causal_row_counts", forbidden)
    out = attention(**inp, backend="triton", config=SMALL)
    monkeypatch.undo()
    check_close(out, **inp)
    by_count = dict(inp, num_causal_q=ncq)
    del by_count["causal"]
    torch.testing.assert_close(attention(**by_count, backend="triton", config=SMALL), out, rtol=0, atol=0)


def _named(name, dtype=torch.bfloat16, page_size=64, seed=0):
    """A named workload of docs/ARCHITECTURE.md as a batch on the GPU."""
    layers = {"sliding": (16, 8, 256, 1023, "symmetric"), "sliding_prefix": (16, 8, 256, 1023, "prefix"),
              "global": (16, 2, 512, None, "symmetric"), "hd128": (16, 8, 128, None, "symmetric")}
    mixed = ([4096, 256, 256, 256], [4096, 8448, 8448, 8448], [True, False, False, True])
    shapes = {
        "mixed_sliding_ctx8k": ("sliding", mixed), "mixed_sliding_prefix_ctx8k": ("sliding_prefix", mixed),
        "mixed_global_ctx8k": ("global", mixed),
        "canvas_bs1_ctx32k_global": ("global", ([256], [33024], [False])),
        "canvas_bs1_ctx32k_sliding": ("sliding", ([256], [33024], [False])),
        "canvas_bs1_ctx32k_hd128": ("hd128", ([256], [33024], [False])),
        "canvas_bs4_ctx4k_hd128": ("hd128", ([256] * 4, [4352] * 4, [False] * 4)),
        "prefill16k_hd128": ("hd128", ([16384], [16384], [True])),
    }
    layer, (ql, sl, c) = shapes[name]
    H, Hkv, D, W, mode = layers[layer]
    inp = make_batch(sl, ql, causal=c, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page_size, dtype=dtype,
                     seed=seed, device="cuda")
    return inp, dict(window_size=W, bidirectional_window=mode, scale=1.0 if D == 512 else None)


NAMED = ["mixed_sliding_ctx8k", "mixed_sliding_prefix_ctx8k", "mixed_global_ctx8k", "canvas_bs1_ctx32k_global",
         "canvas_bs1_ctx32k_sliding", "canvas_bs1_ctx32k_hd128", "canvas_bs4_ctx4k_hd128", "prefill16k_hd128"]


def _check_gpu(inp, tail=None, **kw):
    """Kernel on the whole batch (NaN-poisoned out) vs the fp64 oracle; with ``tail``, the oracle runs on the
    last ``tail`` query rows of each sequence only (same keys, rows and flags: valid for causal sequences and
    the symmetric window; keeps the dense fp64 reference of a 16k prefill in memory)."""
    q, vc = inp["q"], inp["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**inp, out=out, return_lse=True, backend="triton", **kw)
    kw.pop("config", None)
    if tail is None:
        return check_close(o, **inp, lse=lse, **kw)
    assert kw.get("bidirectional_window", "symmetric") == "symmetric" or bool(inp["causal"].all())
    cu = inp["cu_seqlens_q"].tolist()
    rows = torch.cat([torch.arange(max(cu[b], cu[b + 1] - tail), cu[b + 1]) for b in range(len(cu) - 1)])
    lens = [min(tail, cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    sub = dict(inp, q=q[rows.to(q.device)],
               cu_seqlens_q=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                                         device=q.device),
               causal=inp["causal"])
    return check_close(o[rows.to(q.device)], **sub, lse=lse[:, rows.to(q.device)], **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMED)
def test_gpu_named_workloads_bf16(name):
    inp, kw = _named(name)
    _check_gpu(inp, tail=2048 if name.startswith("prefill") else None, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_dims_and_dtypes(D, dtype):
    H, Hkv = GPU_HEADS[D]
    sl, ql, ncq = GPU_BATCH
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dtype, page_size=64,
                     device="cuda", seed=D)
    _check_gpu(inp)
    _check_gpu(inp, window_size=127)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_gpu_prefix_window_and_split(D):
    H, Hkv = GPU_HEADS[D]
    sl, ql, ncq = GPU_BATCH
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=16, device="cuda",
                     seed=D)
    _check_gpu(inp, window_size=127, bidirectional_window="prefix")
    _check_gpu(inp, window_size=100, config=dict(num_splits=4))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 128, 256])
def test_gpu_page_sizes_and_splits(page_size):
    inp = make_batch([5000, 300], [256, 300], causal=[False, True], num_heads=16, num_kv_heads=8, head_dim=128,
                     page_size=page_size, device="cuda")
    for ns in (1, 3, 8):
        _check_gpu(inp, window_size=1023, config=dict(num_splits=ns))
    _check_gpu(inp)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_gpu_config_grid_is_correct(D):
    H, Hkv = GPU_HEADS[D]
    inp = make_batch([2000, 600], [512, 600], num_causal_q=[100, 600], num_heads=H, num_kv_heads=Hkv, head_dim=D,
                     device="cuda")
    grid = [(32, 16), (64, 64), (128, 32)] if D < 512 else [(32, 16), (64, 32), (128, 16)]
    for bm, bn in grid:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=2)
        if D == 512 and bm == 128:
            cfg["BLOCK_DV"] = 256
        _check_gpu(inp, window_size=300, config=cfg)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_changed_flags_lengths_and_block_tables():
    graph_replay_check([([300, 256, 100, 44], [300, 1800, 2000, 44], [300, 0, 50, 44]),
                        ([256, 256, 0, 188], [1024, 2000, 7, 188], [0, 256, 0, 100]),
                        ([0, 0, 0, 700], [0, 0, 0, 1999], [0, 0, 0, 0])],
                       page_size=16, max_k=2000, window_size=511, max_q=300)
