"""Tests of backend "cute" (blockdiff.attention.cute.interface, FA4 SM90 kernel extended).

CPU (CI): the module imports without flash-attn-4 / the CuTe DSL and names them when called; a compile-only build
for sm_90a when the packages are installed (skipped otherwise); the smoke script's plumbing. GPU (H200,
``python3 -m pytest -m gpu``): fuzz against the fp64 reference with the check_close rule on bf16 mixed batches
(hd 128/256, both window modes, paged with page sizes 8-256 through all three K/V load paths: TMA page boxes,
FA4's paged TMA, cp.async; contiguous KV, GQA), NaN-poisoned outputs, LSE, cache rows past seq_lens (finite or
NaN: no effect), and a CUDA-graph replay with metadata changed in place. Batches come from the public builder
(blockdiff.attention.testing.make_batch_from_rows).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiff.attention import get_backend
from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca
from blockdiff.attention.testing import check_close

from cute_helpers import HAVE_FA4, capture_graph, fill_past_seq_lens, needs_gpu, skip_without_cuda_driver
from cute_helpers import gpu_batch as _batch
from cute_helpers import run_and_check as _run_and_check



# ----------------------------------------------------------------------------------------------- CPU tests
@pytest.mark.parametrize("scale", [-0.7, 0.0, -2.0 ** 16, 1e-300, -1e-300])
def test_zero_and_negative_scales_run_as_a_positive_scale_with_the_same_scores(scale):
    """FA4's online softmax scales after the raw row max, so the kernel gets scale > 0: -q with |scale|, or q * 0
    with 1. The reference on what the kernel gets equals the reference on the call, output and LSE bit for bit
    (masked keys and a NaN K entry of a key no row sees included). Was: scale passed through, so a masked score
    (-inf) times 0 was NaN and times a negative scale +inf (the contract suite's scale cases, GPU only). A scale
    whose fp32 ``|scale| * log2(e)`` is below 2**-126 (1e-300: 0 in FA4's fp32 scale_log2) runs as scale 0: it was
    passed through as positive, the same NaN."""
    from blockdiff.attention.reference import attention_reference
    from blockdiff.attention.testing import make_batch
    inp = make_batch([9, 13], [9, 4], num_causal_q=[9, 1], dtype=torch.bfloat16, head_dim=16, page_size=4,
                     poison_unused=True, seed=70)
    q = inp.pop("q")
    q2, s2 = ca.positive_scale(q, scale)
    assert s2 * 1.4426950408889634 >= 2.0 ** -126 and q2.dtype == q.dtype and q2.shape == q.shape
    want = attention_reference(q, **inp, scale=scale, window_size=3, return_lse=True)
    got = attention_reference(q2, **inp, scale=s2, window_size=3, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("scale", [2.0 ** -127, -2.0 ** -127, 5e-39, 1e-40, 1e-44, 1.1e-38])
def test_a_scale_subnormal_in_fp32_keeps_the_scores_of_large_bf16_inputs(scale):
    """A scale whose fp32 value is a subnormal is not 0 in the contract's scores ``(q . k) * scale``: with bf16 q
    and K entries near 2**62, ``q . k`` is near 2**126 and the scores of order 1. The reference on what the kernel
    gets equals the reference on the call, bit for bit, and both fp32 scale and scale * log2(e) are normal. Was: run
    as scale 0 (``q * 0``), the mean of the keys a row sees (0.9 off at 2**-127), or (1.1e-38, just above the old
    bound on scale * log2(e)) passed on as a subnormal fp32 scale."""
    from blockdiff.attention.reference import attention_reference
    from blockdiff.attention.testing import make_batch
    inp = make_batch([9, 13], [9, 4], num_causal_q=[9, 1], dtype=torch.bfloat16, head_dim=16, page_size=4, seed=70)
    q = inp.pop("q") * 2.0 ** 62
    inp["k_cache"] = inp["k_cache"] * 2.0 ** 62
    q2, s2 = ca.positive_scale(q, scale)
    assert s2 >= 2.0 ** -126 and s2 * 1.4426950408889634 >= 2.0 ** -126 and q2.dtype == q.dtype
    want = attention_reference(q, **inp, scale=scale, window_size=3, return_lse=True)
    got = attention_reference(q2, **inp, scale=s2, window_size=3, return_lse=True)
    mean = attention_reference(q * 0, **inp, scale=1.0, window_size=3, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    if abs(scale) >= 2.0 ** -130:  # scores of order 1: not the mean of the keys
        assert not torch.equal(want[0], mean[0])


def test_a_positive_scale_keeps_q_itself():
    q = torch.randn(3, 2, 8)
    assert ca.positive_scale(q, 0.25) == (q, 0.25) and ca.positive_scale(q, 0.25)[0] is q


def test_module_imports_without_flash_attn_and_names_it_when_called(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setattr(ca, "_FA4", None)
    assert get_backend("cute") is ca.attention_cute
    q = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ImportError, match="flash-attn-4") as e:
        ca.attention_cute(q, q, q, cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32),
                          causal=torch.tensor([True]))
    assert "nvidia-cutlass-dsl" in str(e.value)


@pytest.mark.parametrize("dtype,hd", [(torch.float32, 64), (torch.bfloat16, 576), (torch.float16, 12),
                                      (torch.bfloat16, 336)])
def test_valid_inputs_outside_the_backend_raise_not_implemented(dtype, hd):
    """fp32, head dims FA4 SM90 cannot tile and head dims above 256 the split-value kernel does not take (576:
    above 512; 336: not a multiple of 32) are contract-valid: the backend says NotImplementedError (benchmarks
    record a skip), before needing the GPU packages."""
    q = torch.zeros(4, 2, hd, dtype=dtype)
    with pytest.raises(NotImplementedError, match="cute"):
        ca.attention_cute(q, q, q, cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32), causal=torch.tensor([True]))


@pytest.mark.parametrize("hd", [512, 384])
def test_head_dim_512_is_inside_the_backend(monkeypatch, hd):
    """Gemma 4's global layers (hd 512, 16 q / 2 KV heads) pass the backend's own checks and only then need the
    GPU packages (ImportError naming them here, where they are blocked)."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setattr(ca, "_FA4", None)
    q = torch.zeros(4, 16, hd, dtype=torch.bfloat16)
    k = torch.zeros(4, 2, hd, dtype=torch.bfloat16)
    with pytest.raises(ImportError, match="flash-attn-4"):
        ca.attention_cute(q, k, k, cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32), causal=torch.tensor([True]))


def test_bad_input_is_a_value_error_before_anything_else():
    q = torch.zeros(4, 3, 64, dtype=torch.bfloat16)
    k = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ca.attention_cute(q, k, k, cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32), causal=torch.tensor([True]))


@pytest.mark.parametrize("hd", [128, 512])
@pytest.mark.parametrize("config,err,match", [(dict(tile_n=17), ValueError, "tile_n"),
                                              (dict(num_stages=0), ValueError, "num_stages"),
                                              (dict(num_splits=True), TypeError, "num_splits"),
                                              (dict(lpt="no"), TypeError, "lpt"), ("fast", TypeError, "config")])
def test_bad_config_is_refused_before_the_cute_dsl_import(monkeypatch, hd, config, err, match):
    """Was: the config was first read inside the launch, after the CuTe DSL import and the CUDA checks (here an
    ImportError hid it; on a GPU an odd hd-128 tile reached FA4's compiler)."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setattr(ca, "_FA4", None)
    q = torch.zeros(4, 2, hd, dtype=torch.bfloat16)
    with pytest.raises(err, match=match):
        ca.attention_cute(q, q, q, cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32), causal=torch.tensor([True]),
                          config=config)


def test_module_import_in_fresh_interpreter_does_not_import_flash_attn():
    code = ("import sys; import blockdiff.attention.cute.interface as m; "
            "assert 'flash_attn' not in sys.modules and 'cutlass' not in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


COMPILE_SCRIPT = textwrap.dedent("""
    import os, time
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
    from blockdiff.attention.cute import interface as ca
    t0 = time.time()
    ca.compile_only(head_dim=128, num_heads=16, num_kv_heads=8, page_size=64, window_size=1023,
                    bidirectional_window="prefix", return_lse=True)
    for hint in (256, 4096):  # canvas tiles + plain tile order (the scheduler-args swap); long-prefill + LPT
        ca.compile_only(head_dim=128, num_heads=16, num_kv_heads=8, page_size=64, max_seqlen_q=hint)
    print("compiled in", round(time.time() - t0, 1), "s")
""")


@pytest.mark.skipif(not HAVE_FA4, reason="compile-only check needs flash-attn-4==4.0.0b36 and "
                    "nvidia-cutlass-dsl==4.8.1 (not installed here)")
def test_compile_only_for_sm90_without_gpu():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, timeout=600,
                       env=env)
    if r.returncode != 0:
        skip_without_cuda_driver(r.stderr)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compiled in" in r.stdout


GPU_CONFIGS = [
    # (head_dim, H, Hkv, page_size or None=contiguous, window, mode)
    (128, 16, 8, 128, None, "symmetric"),
    (128, 16, 8, 64, None, "symmetric"),
    (128, 16, 2, 16, 100, "symmetric"),
    (128, 8, 8, 256, 63, "prefix"),
    (128, 16, 8, None, 1023, "symmetric"),
    (256, 16, 8, 64, 1023, "symmetric"),
    (256, 16, 8, 64, 1023, "prefix"),
    (256, 16, 8, 16, None, "symmetric"),
    (256, 16, 8, 64, None, "prefix"),  # key tile 80: pages of 64 straddle tiles (cp.async paged path)
    (256, 16, 8, 128, 31, "prefix"),
    (256, 4, 4, 256, 0, "symmetric"),
]


@needs_gpu
@pytest.mark.parametrize("hd,H,Hkv,page,window,mode", GPU_CONFIGS)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gpu_fuzz_mixed_batch_matches_reference(hd, H, Hkv, page, window, mode, data):
    B = data.draw(st.integers(1, 5), label="B")
    q_lens = data.draw(st.lists(st.sampled_from([0, 1, 7, 64, 129, 256, 300]), min_size=B, max_size=B))
    ctxs = data.draw(st.lists(st.sampled_from([0, 1, 100, 255, 1024, 2100]), min_size=B, max_size=B))
    kinds = data.draw(st.lists(st.sampled_from(["causal", "bidir", "split"]), min_size=B, max_size=B))
    ncqs = [ql if kd == "causal" else 0 if kd == "bidir" else ql // 2 for ql, kd in zip(q_lens, kinds)]
    seed = data.draw(st.integers(0, 2 ** 16))
    # the true max_seqlen_q (<= 300 here: plain tile order) or none (total_q: longest-first from 512 rows on)
    hint = data.draw(st.sampled_from([None, max(q_lens)]), label="max_seqlen_q")
    q, k, v, kw = _batch(q_lens, ctxs, ncqs, H, Hkv, hd, page or 64, seed=seed, contiguous=page is None)
    _run_and_check(q, k, v, kw, window, mode, max_seqlen_q=hint)


@needs_gpu
@pytest.mark.parametrize("lpt", [False, True])
@pytest.mark.parametrize("hd,page,window", [(128, 64, None), (128, None, None), (128, 48, None), (256, 64, 1023)])
def test_gpu_plain_and_longest_first_tile_orders_match_reference(lpt, hd, page, window):
    """Both tile orders of FA4's varlen scheduler (lpt False: FA4's non-causal order, the canvas default; True:
    longest-first in L2 head sections) cover every tile of a batch mixing causal, bidirectional and split
    sequences, with page-box TMA, contiguous and cp.async K/V."""
    q, k, v, kw = _batch([700, 256, 256, 3, 0], [0, 4000, 1000, 77, 5], [700, 0, 100, 1, 0], 16, 8, hd,
                         page or 64, seed=5, contiguous=page is None)
    _run_and_check(q, k, v, kw, window, "symmetric", config=dict(lpt=lpt))


@needs_gpu
def test_gpu_causal_bool_flag_form_and_scale():
    q, k, v, kw = _batch([256, 256, 1, 40], [0, 4096, 300, 0], [0, 0, 0, 0], 16, 8, 128, 64, seed=3)
    ncq = kw.pop("num_causal_q")
    kw["causal"] = torch.tensor([True, False, True, False], device="cuda")
    out = ca.attention_cute(q, k, v, scale=1.0, **kw)
    check_close(out, q, k, v, scale=1.0, **kw)
    assert ncq.dtype == torch.int32


@needs_gpu
def test_gpu_negative_tensor_length_hints_are_refused_by_name():
    """A 0-d tensor ``max_seqlen_q`` / ``max_seqlen_k`` is read where the launch uses it and checked like the int
    form: a negative one is a ValueError naming it (the int form is refused earlier, by validate)."""
    q, k, v, kw = _batch([64], [128], [0], 16, 8, 128, 64, seed=4)
    for name in ("max_seqlen_q", "max_seqlen_k"):
        with pytest.raises(ValueError, match=name):
            ca.attention_cute(q, k, v, **kw, **{name: torch.tensor(-5)})


@needs_gpu
def test_gpu_strided_q_and_noncontiguous_out_through_dispatcher():
    from blockdiff.attention import attention
    q0, k, v, kw = _batch([256, 100], [1000, 0], [0, 100], 16, 8, 128, 64, seed=11)
    qkv = torch.randn(q0.shape[0], 16 + 2 * 8, 128, device="cuda", dtype=q0.dtype)
    qkv[:, :16] = q0
    q = qkv[:, :16]  # strided view, as from a fused QKV projection
    assert not q.is_contiguous()
    out_buf = torch.full((q.shape[0], 16, 2 * 128), float("nan"), device="cuda", dtype=q.dtype)
    out = out_buf[:, :, :128]  # non-contiguous destination
    res = attention(q, k, v, out=out, window_size=300, backend="cute", **kw)
    assert res is out
    check_close(out, q0, k, v, window_size=300, **kw)
    assert torch.isnan(out_buf[:, :, 128:]).all(), "wrote outside out"


@needs_gpu
@pytest.mark.parametrize("hd,page,mode", [(128, 64, "symmetric"), (256, 64, "prefix"), (256, 16, "symmetric")])
def test_gpu_tile_skipping_never_reads_keys_left_of_the_window(hd, page, mode):
    """K/V left of every row's window are NaN: a kernel that loaded those blocks would turn out NaN
    (0 * NaN in P @ V), so a finite, unchanged output shows the left tile skipping for every row type."""
    W, ctx = 1023, 4096
    q, k, v, kw = _batch([256, 256, 256], [ctx, ctx, ctx], [0, 256, 128], 16, 8, hd, page, seed=5)
    clean = ca.attention_cute(q, k, v, window_size=W, bidirectional_window=mode, **kw)
    bt = kw["block_table"].cpu()
    # Every row allows keys >= ctx - W = 3073 (causal and bidirectional, both modes); the first key block
    # any tile loads starts at 3073 // tile_n * tile_n = 3072 for the windowed key tiles (64 and 128).
    poison_below = (ctx - W) // 128 * 128
    for b in range(3):
        pos = torch.arange(poison_below)
        pages, offs = bt[b, pos // page].long().cuda(), (pos % page).cuda()
        k[pages, offs] = float("nan")
        v[pages, offs] = float("nan")
    poisoned = ca.attention_cute(q, k, v, window_size=W, bidirectional_window=mode, **kw)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@needs_gpu
@pytest.mark.parametrize("lpt", [False, True])
def test_gpu_more_than_31_sequences_in_one_launch(lpt):
    """FA4's varlen scheduler finds a tile's sequence 31 sequences per warp-wide step: 70 sequences (canvases,
    commits, prefills, empty and one-token ones) cross two step boundaries, in both tile orders."""
    B = 70
    q_lens = [[256, 256, 0, 1, 130, 33, 7][b % 7] for b in range(B)]
    ctxs = [[300, 40, 5, 0, 1000, 64, 2][b % 7] for b in range(B)]
    ncqs = [[0, 256, 0, 1, 65, 33, 0][b % 7] for b in range(B)]
    q, k, v, kw = _batch(q_lens, ctxs, ncqs, 16, 8, 128, 64, seed=70)
    _run_and_check(q, k, v, kw, None, "symmetric", config=dict(lpt=lpt))


@needs_gpu
@pytest.mark.parametrize("page", [8, 16, 32, 48, 64, 128, 256])
def test_gpu_page_sizes_hd128(page):
    """128-key tiles: pages 8-256 load by TMA page boxes (one box per stage at 128), 48 by cp.async."""
    q, k, v, kw = _batch([512, 256, 256, 3], [0, 3000, 3001, 77], [512, 0, 256, 1], 16, 8, 128, page, seed=page)
    _run_and_check(q, k, v, kw, None, "symmetric")


@needs_gpu
@pytest.mark.parametrize("page,window", [(64, None), (16, 200), (256, None)])
def test_gpu_page_boxes_with_the_long_prefill_tiles(page, window):
    """192 x 128 tiles without intra-warpgroup overlap: the page-box producer's other K/V stage order."""
    q, k, v, kw = _batch([700, 256, 1], [0, 2000, 64], [700, 0, 1], 16, 8, 128, page, seed=page + 1)
    out = ca.attention_cute(q, k, v, window_size=window, return_lse=True, config=cc.LONG_PREFILL_CONFIG, **kw)
    check_close(out[0], q, k, v, lse=out[1], window_size=window, **kw)


@needs_gpu
@pytest.mark.parametrize("page", [16, 64, 48])
@pytest.mark.parametrize("long_prefill", [False, True])
def test_gpu_gqa_3_packs_q_without_tma_and_pages_load_by_boxes(page, long_prefill):
    """12 q heads on 4 KV heads: PackGQA tiles of 128 / 192 rows are not a multiple of 3, so FA4 loads Q with
    all four producer warps (no TMA) while warp 0 alone loads K/V (page boxes at 16 / 64, cp.async at 48)."""
    q, k, v, kw = _batch([300, 256, 1], [0, 1500, 77], [300, 0, 1], 12, 4, 128, page, seed=page)
    cfg = cc.LONG_PREFILL_CONFIG if long_prefill else None
    out, lse = ca.attention_cute(q, k, v, return_lse=True, config=cfg, **kw)
    check_close(out, q, k, v, lse=lse, **kw)


@needs_gpu
@pytest.mark.parametrize("hd,page", [(128, 16), (128, 64), (128, 256), (128, 48), (256, 64)])
def test_gpu_block_table_slots_past_a_sequence_are_never_read(hd, page):
    """Unused block-table slots point at a page full of NaN: no load path may touch them."""
    window = 1023 if hd == 256 else None
    q, k, v, kw = _batch([256, 100, 5], [1000, 5, 3000], [0, 0, 5], 16, 8, hd, page, seed=hd + page,
                         nan_pad_page=True)
    _run_and_check(q, k, v, kw, window, "symmetric")


def _outputs_before_and_after_filling_past_seq_lens(hd, page, value):
    """The cute output of one mixed batch, then again after ``value`` went into the cache rows past seq_lens."""
    window = 1023 if hd == 256 else None
    q, k, v, kw = _batch([256, 100, 5], [1000, 5, 300], [0, 0, 5], 16, 8, hd, page, seed=hd + page)
    clean = ca.attention_cute(q, k, v, window_size=window, **kw)
    fill_past_seq_lens(k, v, kw, page, value)
    return clean, ca.attention_cute(q, k, v, window_size=window, **kw)


# (head_dim, page): hd 128 uses 128-key tiles, hd 256 with a window 64-key tiles at page 64.
_TAIL_CASES = [(128, 64), (128, 16), (128, 256), (128, 128), (256, 64), (128, 48)]


@needs_gpu
@pytest.mark.parametrize("hd,page", _TAIL_CASES)
def test_gpu_finite_garbage_past_seq_lens_does_not_change_the_output(hd, page):
    """Rows after a sequence's last key are outside every row's allowed range: with finite values there
    (stale K/V of an earlier request) the output is bit-identical for every K/V load path."""
    clean, dirty = _outputs_before_and_after_filling_past_seq_lens(hd, page, 3.0e4)
    assert torch.equal(dirty, clean)


@needs_gpu
@pytest.mark.parametrize("hd,page", _TAIL_CASES)
def test_gpu_nonfinite_cache_rows_past_seq_lens_stay_out_of_the_output(hd, page):
    """NaN in the rows after each sequence's last key (its last page): the output is the clean one. The TMA
    paths zero those V rows in shared memory before the consumers read them (was NaN before 2026-11-29)."""
    clean, dirty = _outputs_before_and_after_filling_past_seq_lens(hd, page, float("nan"))
    assert torch.equal(dirty, clean)


@needs_gpu
def test_gpu_cuda_graph_replay_with_metadata_changed_in_place():
    H, Hkv, D, page = 16, 8, 128, 64
    cap_q, max_blocks, B = 1024, 80, 4
    torch.manual_seed(0)
    k = torch.randn(B * max_blocks, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(cap_q, H, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(B * max_blocks, device="cuda").to(torch.int32).view(B, max_blocks)
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    sl = torch.zeros(B, dtype=torch.int32, device="cuda")
    causal = torch.zeros(B, dtype=torch.bool, device="cuda")
    out = torch.empty(cap_q, H, D, device="cuda", dtype=torch.bfloat16)
    lse_buf = torch.empty(H, cap_q, device="cuda")

    def set_step(q_lens, ctxs, flags):
        cu.copy_(torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32))
        sl.copy_(torch.tensor([c + ql for c, ql in zip(ctxs, q_lens)], dtype=torch.int32))
        causal.copy_(torch.tensor(flags))

    def step():
        o, lse = ca.attention_cute(q, k, v, cu_seqlens_q=cu, seq_lens=sl, causal=causal, block_table=bt,
                                   window_size=1023, out=out, return_lse=True, check_values=False)
        lse_buf.copy_(lse)

    # static capacity: cu_seqlens_q[-1] must equal q.shape[0]; pad with a last sequence absorbing the rest
    steps = [([512, 256, 128, 128], [0, 4096, 4096, 100], [True, False, True, False]),
             ([256, 256, 256, 256], [4096, 4096, 4096, 0], [False, False, True, True])]
    set_step(*steps[0])
    graph = capture_graph(step)  # compiles and warms up outside the capture first
    for q_lens, ctxs, flags in steps:
        set_step(q_lens, ctxs, flags)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close(out, q, k, v, lse=lse_buf, cu_seqlens_q=cu, seq_lens=sl, causal=causal, block_table=bt,
                    window_size=1023)


def test_a_first_use_compile_is_a_named_profiler_range_and_a_cached_launch_opens_none(monkeypatch):
    """A serving profile's idle gaps were first-use JIT compiles (docs/tuning.md 7.10) that only their length told
    apart: the compile path now opens ``blockdiff:cute_compile <kernel> <tiles> s<splits>``; the cached path none."""
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    compiles = []
    monkeypatch.setattr(ca, "_compile", lambda fa, key, *a: compiles.append(key) or (lambda *x: None))
    fa = {"maybe_contiguous": lambda t, align_bytes=None: t, "is_fake_mode": lambda: True}
    q = torch.zeros(256, 16, 512, dtype=torch.bfloat16)  # hd 512 resolves its tiles without flash-attn-4
    k = torch.zeros(8, 64, 2, 512, dtype=torch.bfloat16)
    kw = dict(out=None, return_lse=False, cu_seqlens_q=torch.tensor([0, 256], dtype=torch.int32),
              num_causal_q=torch.zeros(1, dtype=torch.int32), seq_lens=torch.tensor([512], dtype=torch.int32),
              block_table=torch.arange(8, dtype=torch.int32)[None], cu_seqlens_k=None, window_size=None,
              bidirectional_window="symmetric", scale=512 ** -0.5, arch=90, config=None, max_seqlen_q=256)

    def names():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ca._run(fa, q, k, k, **kw)
        return [e.name for e in prof.events() if e.name.startswith("blockdiff:cute_compile")]

    first = names()
    assert len(compiles) == 1 and len(first) == 1, first
    assert first[0] == "blockdiff:cute_compile FlashAttentionForwardSm90Roles 64x64 s1"  # the hd-512 default
    assert names() == [] and len(compiles) == 1  # cached: no compile, no range


def test_an_empty_call_records_that_nothing_launched(monkeypatch):
    """``LAST_LAUNCH`` after a call with no query rows is ``kernel`` None, not the previous call's record (H200,
    2026-12-03: the roles fuzz read a stale or missing record after an empty batch)."""
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    monkeypatch.setattr(ca, "_compile", lambda fa, key, *a: (lambda *x: None))
    fa = {"maybe_contiguous": lambda t, align_bytes=None: t, "is_fake_mode": lambda: True}
    k = torch.zeros(8, 64, 2, 512, dtype=torch.bfloat16)
    kw = dict(out=None, return_lse=False, num_causal_q=torch.zeros(1, dtype=torch.int32),
              seq_lens=torch.tensor([512], dtype=torch.int32), block_table=torch.arange(8, dtype=torch.int32)[None],
              cu_seqlens_k=None, window_size=None, bidirectional_window="symmetric", scale=512 ** -0.5, arch=90,
              config=None)
    ca._run(fa, torch.zeros(256, 16, 512, dtype=torch.bfloat16), k, k,
            cu_seqlens_q=torch.tensor([0, 256], dtype=torch.int32), max_seqlen_q=256, **kw)
    assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90Roles"  # the hd-512 default on 64-token pages
    out = ca._run(fa, torch.zeros(0, 16, 512, dtype=torch.bfloat16), k, k,
                  cu_seqlens_q=torch.tensor([0, 0], dtype=torch.int32), max_seqlen_q=0, **kw)
    assert out.shape == (0, 16, 512)
    assert ca.LAST_LAUNCH == {"kernel": None, "config": None, "kv_path": None}


@pytest.mark.parametrize("alias", ["q", "k_cache", "v_cache", None])
def test_out_aliasing_an_input_is_written_through_a_private_buffer(monkeypatch, alias):
    """``out`` may alias an input (the contract): the kernel wrote such an ``out`` in place, so a tile's output
    could land on K / V rows (or Q rows) another tile still reads; it now gets a private buffer, copied back (as the
    triton backend and the reference do). A separate dense ``out`` is still written in place."""
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    written = []

    def kernel(q, k, v, out_k, *rest):
        written.append(out_k)
        out_k.fill_(7)

    monkeypatch.setattr(ca, "_compile", lambda fa, key, *a: kernel)
    fa = {"maybe_contiguous": lambda t, align_bytes=None: t, "is_fake_mode": lambda: False,
          "AuxData": lambda *a: None}
    q = torch.zeros(64, 16, 512, dtype=torch.bfloat16)
    k = torch.zeros(2, 64, 16, 512, dtype=torch.bfloat16)  # 16 KV heads: a page is q's shape
    v = torch.zeros(2, 64, 16, 512, dtype=torch.bfloat16)
    out = {"q": q, "k_cache": k[1], "v_cache": v[1], None: torch.empty_like(q)}[alias]
    ca._run(fa, q, k, v, out=out, return_lse=False, cu_seqlens_q=torch.tensor([0, 64], dtype=torch.int32),
            num_causal_q=torch.zeros(1, dtype=torch.int32), seq_lens=torch.tensor([128], dtype=torch.int32),
            block_table=torch.arange(2, dtype=torch.int32)[None], cu_seqlens_k=None, window_size=None,
            bidirectional_window="symmetric", scale=512 ** -0.5, arch=90, config=None, max_seqlen_q=64)
    assert (written[0] is out) == (alias is None)
    assert bool((out == 7).all())


def test_a_fresh_out_is_never_checked_for_overlap(monkeypatch):
    """Only a caller's ``out`` can overlap an input: with ``out=None`` the launch allocates a fresh one and does no
    per-call pointer math on it (three memory_overlaps calls, ~6 us a layer, were spent on the fresh tensor)."""
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    monkeypatch.setattr(ca, "_compile", lambda fa, key, *a: lambda q, k, v, out_k, *rest: out_k.fill_(7))
    calls = []
    monkeypatch.setattr(ca, "memory_overlaps", lambda a, b: calls.append(1) or False)
    fa = {"maybe_contiguous": lambda t, align_bytes=None: t, "is_fake_mode": lambda: False,
          "AuxData": lambda *a: None}
    q = torch.zeros(64, 16, 512, dtype=torch.bfloat16)
    k = torch.zeros(2, 64, 16, 512, dtype=torch.bfloat16)
    kw = dict(return_lse=False, cu_seqlens_q=torch.tensor([0, 64], dtype=torch.int32),
              num_causal_q=torch.zeros(1, dtype=torch.int32), seq_lens=torch.tensor([128], dtype=torch.int32),
              block_table=torch.arange(2, dtype=torch.int32)[None], cu_seqlens_k=None, window_size=None,
              bidirectional_window="symmetric", scale=512 ** -0.5, arch=90, config=None, max_seqlen_q=64)
    out = ca._run(fa, q, k, k.clone(), out=None, **kw)
    assert bool((out == 7).all()) and calls == []
    ca._run(fa, q, k, k.clone(), out=torch.empty_like(q), **kw)
    assert len(calls) == 3  # a caller's out: checked against q, k_cache, v_cache


@pytest.mark.parametrize("which, config", [("q", None), ("k_cache", None), ("v_cache", None), ("block_table", None),
                                            ("out", None), ("v_cache", {"nan_safe_v": False})])
def test_a_broadcast_input_never_shares_a_compiled_kernel_with_a_dense_one(monkeypatch, which, config):
    """The CuTe DSL keeps a stride of 0 static in a dynamic layout (flash-attn-4 keys its own kernels on
    ``get_broadcast_dims``), so a kernel compiled for an ``expand()``ed tensor reads element 0 of every head / row of a
    dense one, silently. The compile key missed it: an expanded Q, K cache or block table (valid input: the contract
    asks only for a dense last dim) and a dense one of the same shape shared one compiled kernel (only V differed, by
    the NaN-safe fix-up's static strides). Now the stride-0 dims of every tensor the kernel takes are in the key."""
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    keys = []
    monkeypatch.setattr(ca, "_compile", lambda fa, key, *a: keys.append(key) or (lambda *x: None))
    fa = {"maybe_contiguous": lambda t, align_bytes=None: t, "is_fake_mode": lambda: True}
    dense = dict(q=torch.zeros(64, 16, 512, dtype=torch.bfloat16), k_cache=torch.zeros(4, 64, 2, 512, dtype=torch.bfloat16),
                 v_cache=torch.zeros(4, 64, 2, 512, dtype=torch.bfloat16),
                 block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), out=None)
    wide = dict(q=torch.zeros(64, 1, 512, dtype=torch.bfloat16).expand(64, 16, 512),
                k_cache=torch.zeros(4, 64, 1, 512, dtype=torch.bfloat16).expand(4, 64, 2, 512),
                v_cache=torch.zeros(4, 64, 1, 512, dtype=torch.bfloat16).expand(4, 64, 2, 512),
                block_table=torch.tensor([[0, 1]], dtype=torch.int32).expand(2, 2),
                out=torch.zeros(64, 16, 1, dtype=torch.bfloat16).expand(64, 16, 512))
    kw = dict(return_lse=False, cu_seqlens_q=torch.tensor([0, 32, 64], dtype=torch.int32),
              num_causal_q=torch.zeros(2, dtype=torch.int32), seq_lens=torch.tensor([128, 128], dtype=torch.int32),
              cu_seqlens_k=None, window_size=None, bidirectional_window="symmetric", scale=512 ** -0.5, arch=90,
              config=config, max_seqlen_q=32)  # (V without NaN-safe V: no static V strides told them apart)
    ca._run(fa, **dense, **kw)
    ca._run(fa, **dict(dense, **{which: wide[which]}), **kw)
    ca._run(fa, **dense, **kw)  # the dense call again: its own kernel, cached
    assert len(keys) == 2 or which == "out", keys  # an expanded out is written through a dense private buffer
    if which != "out":
        assert keys[0] != keys[1]
    assert ca.broadcast_dims(wide["k_cache"], None) == ((False, False, True, False), None)


@needs_gpu
@pytest.mark.parametrize("which,hd,hkv", [("q", 128, 8), ("k_cache", 128, 8), ("k_cache", 512, 2)])
def test_gpu_a_broadcast_input_and_then_a_dense_one_each_give_the_reference_output(monkeypatch, which, hd, hkv):
    """The compile key's stride-0 part on the GPU (the CPU test above checks the keys): with an empty compile cache,
    an ``expand()``ed Q (one head's rows for every head) or K cache (one KV head's keys for every KV head) first,
    then the dense tensor of the same shape; each output is finite and within the tolerance of the reference on
    what it was given. Before the key held the stride-0 dims, the dense call reused the kernel compiled with a
    static stride of 0 and read head 0 for every head."""
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    q, k, v, kw = _batch([256, 100], [1000, 0], [0, 100], 16, hkv, hd, 64, seed=hd + len(which))
    if which == "q":
        wide = dict(q=q[:, :1].expand_as(q), k=k)
    else:
        wide = dict(q=q, k=k[:, :, :1].expand_as(k))
    assert 0 in wide["q"].stride() or 0 in wide["k"].stride()
    _run_and_check(wide["q"], wide["k"], v, kw, None, "symmetric")
    _run_and_check(q, k, v, kw, None, "symmetric")


def test_arch_and_sm_count_overrides_are_parsed_strictly(monkeypatch):
    """``FLASH_ATTENTION_ARCH`` was read as its first two digits (``sm_100a`` was sm_10, ``sm_90,sm_100`` and ``x9y0``
    were sm_90, ``""`` an int() error naming nothing) and ``FLASH_ATTENTION_NUM_SMS`` by int() (``1_32`` was 132,
    ``0`` used unchecked when the config sets ``num_splits``). Both take flash-attn-4's formats only now, else a
    ValueError naming the variable."""
    for env, arch in (("sm_90", 90), ("sm_90a", 90), ("SM90", 90), ("90", 90), ("sm_100a", 100), ("sm_120f", 120)):
        monkeypatch.setenv("FLASH_ATTENTION_ARCH", env)
        assert ca._arch(None) == arch, env
    for env in ("", "sm_9", "sm_90,sm_100", "x9y0", "9.0", " sm_90", "sm_90b"):
        monkeypatch.setenv("FLASH_ATTENTION_ARCH", env)
        with pytest.raises(ValueError, match="FLASH_ATTENTION_ARCH"):
            ca._arch(None)
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    assert ca._num_sms("cpu") == 132
    for env in ("", "0", "-4", "1_32", " 132", "132.0", "abc", "+132"):
        monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", env)
        with pytest.raises(ValueError, match="FLASH_ATTENTION_NUM_SMS"):
            ca._num_sms("cpu")


def test_broadcast_dims_is_false_for_a_tensor_without_a_zero_stride():
    """The compile key's broadcast part costs host time on every call (nine tensors): a tensor without a stride of 0,
    the common case, is one ``False`` (review25: the per-dim tuples of ``False`` cost ~5x more per call), while any
    stride of 0, a size-1 dim's included, still gives its per-dim pattern."""
    dense, col = torch.zeros(8, 4, 16), torch.zeros(8, 1)
    assert ca.broadcast_dims(dense, None, col) == (False, None, False)
    assert ca.broadcast_dims(col.expand(8, 4), torch.zeros(()).expand(1)) == ((False, True), (True,))
    assert ca.broadcast_dims(dense) != ca.broadcast_dims(torch.zeros(8, 1, 16).expand(8, 4, 16))
