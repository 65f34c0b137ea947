"""The warp-specialised Gluon kernels (attention/triton/gluon.py) on the H200 (``-m gpu``): against the dense
reference on a NaN-poisoned ``out`` and with NaN in every stale cache row (beyond ``seq_lens`` and in unused
pages), over page sizes, the contiguous form, GQA ratios, windows in both modes, mixed causal rows, split counts,
fp16, CUDA-graph replays with changed flags, lengths and block tables, the automatic kernel choice, and NaN / Inf V
of keys a row may not see (``config["NAN_SAFE_V"]``, separate caches and vLLM's packed layout). CPU checks of these
kernels: test_triton_config.py, test_triton_tma.py, test_triton_compile_check.py, and here the NaN / Inf V checks
themselves with the portable kernel as a stand-in."""
import sys

import pytest
import torch

from blockdiff.attention import attention
from blockdiff.attention.testing import check_close, check_nonfinite_matches_reference, poison_v_inside_seq_lens
from blockdiff.attention.triton import config as tc
from blockdiff.attention.triton import interface as TA

from triton_helpers import (GLUON, ROLES, WIDE, graph_replay_check, make_batch, scores_near_1000_batch,
                            very_negative_scores_batch)


def _check(inp, config, **kw):
    q, vc = inp["q"], inp["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**inp, out=out, return_lse=True, backend="triton", config=config, **kw)
    assert TA.LAST_LAUNCH["impl"] == "gluon"
    clean = dict(inp, k_cache=torch.nan_to_num(inp["k_cache"]), v_cache=torch.nan_to_num(inp["v_cache"]))
    return check_close(o, **clean, lse=lse, **kw)


def _check_splits_and_windows(inp, cfgs, splits, window_0=False):
    """Each config at the automatic and the given split counts, then windowed: symmetric 127, prefix 100 (and 0)."""
    for cfg in cfgs:
        for ns in splits:
            _check(inp, dict(cfg, num_splits=ns))
        _check(inp, cfg, window_size=127)
        _check(inp, cfg, window_size=100, bidirectional_window="prefix")
        if window_0:
            _check(inp, cfg, window_size=0)


GPU_CASES = [
    # seq_lens, q_lens, num_causal_q: canvases over context, prefill, commit, a mixed-row sequence, empty, 1 token
    ([1500, 700, 333, 9, 0, 1], [256, 700, 0, 9, 0, 1], [0, 700, 0, 4, 0, 1]),
    ([5000, 300, 4352], [256, 300, 256], [0, 300, 0]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("D,H,Hkv", [(128, 16, 8), (64, 8, 8), (128, 32, 4), (256, 16, 8), (128, 16, 2)])
@pytest.mark.parametrize("page_size", [64, 128, 256])
@pytest.mark.parametrize("case", [0, 1])
def test_gpu_gluon_paged_matches_reference_with_nan_in_stale_rows(D, H, Hkv, page_size, case):
    sl, ql, ncq = GPU_CASES[case]
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page_size,
                     device="cuda", seed=D + page_size + case, poison_unused=True)
    cfgs = [GLUON, dict(GLUON, BLOCK_M=128, num_warps=8, BLOCK_N=64, num_stages=3 if D <= 128 else 2,
                        OVERLAP=case == 0)]
    if D <= 128:
        cfgs.append(dict(GLUON, BLOCK_M=128, num_warps=8, BLOCK_N=128 if page_size % 128 == 0 else 64))
    _check_splits_and_windows(inp, cfgs, (None, 1, 3, 8), window_0=True)


@pytest.mark.gpu
@pytest.mark.parametrize("D,H,Hkv", [(128, 16, 8), (64, 8, 2)])
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_gpu_gluon_key_blocks_spanning_several_pages(D, H, Hkv, page_size):
    # BLOCK_N > page_size: one TMA box per page into slices of one ring buffer, pages permuted; the block table
    # exactly as wide as the longest sequence needs (boxes past seq_len re-read the last page, never a column
    # beyond the table)
    sl, ql, ncq = GPU_CASES[0]
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page_size,
                     device="cuda", seed=7 * D + page_size, poison_unused=True)
    inp["block_table"] = inp["block_table"][:, :-(-max(sl) // page_size)].contiguous()
    cfgs = (dict(GLUON, BLOCK_N=128, num_stages=1), dict(GLUON, BLOCK_N=128, V_STAGES=1),
            dict(GLUON, BLOCK_N=128, OVERLAP=True), dict(GLUON, BLOCK_M=128, num_warps=8, BLOCK_N=128),
            dict(GLUON, BLOCK_N=64))
    _check_splits_and_windows(inp, cfgs, (None, 1, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [32, 64, 256])
@pytest.mark.parametrize("case", [0, 1])
def test_gpu_gluon_head_dim_512_two_warpgroups_split_the_head_dim(page_size, case):
    # Gemma 4 global layers: hd 512, 16 query heads on 2 KV heads; the wide kernel's two consumer warpgroups split
    # the head dim (partial S summed through shared memory, each warpgroup half of the V columns)
    sl, ql, ncq = GPU_CASES[case]
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=16, num_kv_heads=2, head_dim=512, page_size=page_size,
                     device="cuda", seed=512 + page_size + case, poison_unused=True)
    base = dict(IMPL="gluon", BLOCK_M=64, num_warps=8, OVERLAP=False, BLOCK_DV=512)
    cfgs = (dict(base, BLOCK_N=32, num_stages=2), dict(base, BLOCK_N=32, num_stages=3, V_STAGES=1),
            dict(base, BLOCK_N=64, num_stages=1, LAZY_RESCALE=case == 1))
    _check_splits_and_windows(inp, cfgs, (None, 1, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("D,H,Hkv,page_size", [(64, 8, 2, 32), (128, 16, 8, 64), (128, 32, 4, 128),
                                               (256, 16, 8, 64)])
@pytest.mark.parametrize("case", [0, 1])
def test_gpu_gluon_chained_consumer_matches_reference(D, H, Hkv, page_size, case):
    # OVERLAP="chain": PV of block j and QK^T of block j + 1 issued back to back and retired together, the last
    # block's PV alone; programs with 0, 1 and many key blocks (splits, windows), NaN in stale cache rows
    sl, ql, ncq = GPU_CASES[case]
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page_size,
                     device="cuda", seed=3 * D + page_size + case, poison_unused=True)
    cfgs = [dict(GLUON, OVERLAP="chain"), dict(GLUON, OVERLAP="chain", num_stages=1, V_STAGES=1),
            dict(GLUON, OVERLAP="chain", BLOCK_M=128, num_warps=8, LAZY_RESCALE=True)]
    if D <= 128:
        cfgs.append(dict(GLUON, OVERLAP="chain", BLOCK_N=128, V_STAGES=1))
    _check_splits_and_windows(inp, cfgs, (None, 1, 3, 8), window_0=True)


@pytest.mark.gpu
@pytest.mark.parametrize("D,H,Hkv,page_size", [(512, 16, 2, 64), (512, 16, 2, 32), (256, 16, 8, 64),
                                               (128, 16, 8, 128), (128, 32, 4, 16)])
@pytest.mark.parametrize("case", [0, 1])
def test_gpu_gluon_roles_kernel_matches_reference(D, H, Hkv, page_size, case):
    # OVERLAP="roles": the softmax warpgroup hands P and the row rescale factors through a shared-memory ring to the
    # PV warpgroups, each warpgroup refilling its own K / V ring; programs with 0, 1 and many key blocks (splits,
    # windows), NaN in stale cache rows, key blocks of several pages
    sl, ql, ncq = GPU_CASES[case]
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page_size,
                     device="cuda", seed=11 * D + page_size + case, poison_unused=True)
    base = dict(ROLES, num_warps=4 * (1 + tc.roles_pv_warpgroups(D)))
    if D > 256:
        cfgs = [base, dict(base, BLOCK_N=32, num_stages=2, V_STAGES=2)]
    else:
        cfgs = [dict(base, num_stages=2), dict(base, BLOCK_N=128, num_stages=1 if D > 128 else 2, V_STAGES=1)]
    _check_splits_and_windows(inp, cfgs, (None, 1, 3), window_0=case == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_head_dim_512_contiguous_fp16_window_0_and_an_exact_block_table(dtype):
    sl, ql, ncq = GPU_CASES[0]
    cfg = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, OVERLAP=False)  # BLOCK_DV: all of V
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=16, num_kv_heads=2, head_dim=512, paged=False, dtype=dtype,
                     device="cuda")
    _check(inp, cfg)
    _check(inp, dict(cfg, num_splits=3), window_size=0)
    # 32-token pages (two TMA boxes per 64-key block), the block table exactly cdiv(seq_len, 32) wide
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=16, num_kv_heads=2, head_dim=512, page_size=32, dtype=dtype,
                     device="cuda", seed=5, poison_unused=True)
    inp["block_table"] = inp["block_table"][:, :-(-max(sl) // 32)].contiguous()
    _check(inp, cfg, window_size=127)
    clean = dict(inp, k_cache=torch.nan_to_num(inp["k_cache"]), v_cache=torch.nan_to_num(inp["v_cache"]))
    o_only = attention(**inp, backend="triton", config=cfg, window_size=127)  # no LSE stored
    check_close(o_only, **clean, window_size=127)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_contiguous_form_and_dtypes(dtype):
    sl, ql, ncq = GPU_CASES[0]
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=16, num_kv_heads=8, head_dim=128, paged=False, dtype=dtype,
                     device="cuda")
    for cfg in (GLUON, dict(GLUON, BLOCK_M=128, num_warps=8, BLOCK_N=128), dict(GLUON, OVERLAP=False),
                dict(GLUON, LAZY_RESCALE=True), dict(GLUON, BLOCK_N=128, OVERLAP=False, LAZY_RESCALE=True)):
        _check(inp, cfg)
        _check(inp, dict(cfg, num_splits=4), window_size=300)



@pytest.mark.gpu
@pytest.mark.parametrize("D,cfg", [(128, dict(GLUON, LAZY_RESCALE=True)),
                                   (128, dict(GLUON, BLOCK_N=128, OVERLAP=False, LAZY_RESCALE=True)),
                                   (512, dict(WIDE, LAZY_RESCALE=True))])
def test_gpu_gluon_lazy_rescaling_keeps_rows_whose_scores_all_lie_below_minus_1e30(D, cfg):
    # the portable kernel's regression (test_triton_portable.py) in the Gluon kernels' _softmax_step: a row whose
    # scores (log2 units) all lay below -1e30 never "grew" against max(m_i, -1e30), so it came out NaN / 0
    inp = very_negative_scores_batch(torch.bfloat16, head_dim=D, page_size=64, device="cuda")
    for splits in (1, 3):
        c = dict(cfg, num_splits=splits)
        _check(inp, c, scale=1.0)
        o = attention(**inp, backend="triton", config=c, scale=1.0)
        ref = attention(**inp, backend="reference", scale=1.0)
        torch.testing.assert_close(o.float(), ref.float(), rtol=0, atol=2 ** -7)

@pytest.mark.gpu
@pytest.mark.parametrize("D,cfg", [(128, GLUON), (128, dict(GLUON, OVERLAP="chain", LAZY_RESCALE=True)),
                                   (256, dict(GLUON, OVERLAP=False)), (512, WIDE), (512, ROLES),
                                   (256, dict(ROLES, num_warps=8))])
def test_gpu_gluon_split_kv_at_scores_near_1000_gives_the_one_split_result(D, cfg):
    """The portable kernel's fp32 regression (``test_split_kv_output_at_scores_near_1000_is_within_the_eager_bound``)
    in bf16 on every Gluon kernel: each split's epilogue stores its raw max and sum (the roles kernel's through the
    softmax warpgroup's shared memory) and the merge weighs them at ``qk_scale``; three splits give the one-split
    output and LSE (bf16 hides the old LSE format's error in the output: the LSE is the sharper check here)."""
    H, Hkv = {128: (16, 8), 256: (16, 8), 512: (16, 2)}[D]
    inp = scores_near_1000_batch(torch.bfloat16, head_dim=D, num_heads=H, num_kv_heads=Hkv, page_size=64,
                                 seq_lens=[700, 333], q_lens=[64, 33], device="cuda")
    for c in (cfg, dict(cfg, NAN_SAFE_V=False)):
        _check(inp, dict(c, num_splits=3), scale=0.25)
        assert TA.LAST_LAUNCH["num_splits"] == 3
        o3, lse3 = attention(**inp, backend="triton", config=dict(c, num_splits=3), scale=0.25,
                             return_lse=True)
        o1, lse1 = attention(**inp, backend="triton", config=dict(c, num_splits=1), scale=0.25,
                             return_lse=True)
        # P enters the PV product in bf16, rounded against each split's own (or, lazily, a stale) max: splits and
        # one split round differently, so outputs agree to bf16 P's rounding (H100, 2026-12-07: 0.0044 at most
        # with LAZY_RESCALE; each is checked against the reference above), the LSEs to a few fp32 ulps
        torch.testing.assert_close(o3.float(), o1.float(), rtol=2 ** -7, atol=2 ** -6)
        torch.testing.assert_close(lse3, lse1, rtol=0, atol=2.5e-4)  # (4 fp32 ulps near 993)


# (q_lens, seq_lens, num_causal_q) per replay: mixed rows, then a commit + denoise step, then one long sequence
GRAPH_METAS = [([300, 256, 100, 44], [300, 1800, 4096, 44], [300, 0, 50, 44]),
               ([256, 256, 0, 188], [1024, 4000, 7, 188], [0, 256, 0, 100]),
               ([0, 0, 0, 700], [0, 0, 0, 3999], [0, 0, 0, 0])]


@pytest.mark.gpu
def test_gpu_gluon_cuda_graph_replay_with_changed_flags_lengths_and_block_tables():
    graph_replay_check(GRAPH_METAS,
                       page_size=64, max_k=4096, window_size=1023,
                       config=dict(GLUON, BLOCK_M=128, num_warps=8, num_splits=4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,H,Hkv", [(512, 16, 2), (256, 16, 8)])
def test_gpu_roles_kernel_contiguous_form_and_dtypes(dtype, D, H, Hkv):
    sl, ql, ncq = GPU_CASES[0]
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, paged=False, dtype=dtype,
                     device="cuda")
    cfg = dict(ROLES, num_warps=4 * (1 + tc.roles_pv_warpgroups(D)), num_stages=1 if D > 256 else 2)
    _check(inp, cfg)
    _check(inp, dict(cfg, num_splits=3), window_size=127)


@pytest.mark.gpu
def test_gpu_roles_kernel_cuda_graph_replay_with_changed_flags_lengths_and_block_tables():
    # hd 512 (the automatic choice there): one capture, replays with new flags, lengths and block tables
    graph_replay_check(GRAPH_METAS,
                       page_size=64, max_k=4096, window_size=None, config=dict(ROLES, num_splits=3), H=16, Hkv=2,
                       D=512)


@pytest.mark.gpu
@pytest.mark.parametrize("D,H,Hkv,cfg", [(512, 16, 2, ROLES), (512, 16, 2, tc._GLUON_HD512_WIDE),
                                         (256, 16, 8, dict(GLUON, OVERLAP=False)), (128, 16, 8, GLUON)])
def test_gpu_gluon_reads_vllms_packed_kv_layout(D, H, Hkv, cfg):
    """vLLM's FlashAttention layout packs a token's K and V of one head into one [num_kv_heads, 2 * head_dim] row:
    the K / V views have a head column stride of 2 * head_dim (KS / VS). Same results as separate caches, with NaN
    in the stale rows of both halves, every split count and window mode."""
    sl, ql, ncq = GPU_CASES[1]
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=64,
                     device="cuda", seed=7 * D + Hkv, poison_unused=True)
    k, v = torch.cat([inp["k_cache"], inp["v_cache"]], dim=-1).split(D, dim=-1)
    assert k.stride(-2) == 2 * D
    _check_splits_and_windows(dict(inp, k_cache=k, v_cache=v), [cfg], (None, 1, 3))


@pytest.mark.gpu
def test_gpu_automatic_choice_takes_gluon_only_where_tuned_and_tma_can_read_the_cache():
    sl, ql, ncq = GPU_CASES[1]
    # page 16: eligible explicitly (one TMA box per page) but not chosen automatically (not measured)
    for page_size, dtype, want in [(64, torch.bfloat16, "gluon"), (16, torch.bfloat16, "triton"),
                                   (64, torch.float32, "triton")]:
        inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=16, num_kv_heads=8, head_dim=128, page_size=page_size,
                         dtype=dtype, device="cuda", poison_unused=True)
        q, vc = inp["q"], inp["v_cache"]
        out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
        o, lse = attention(**inp, out=out, return_lse=True, backend="triton")
        assert TA.LAST_LAUNCH["impl"] == want, (page_size, dtype)
        clean = dict(inp, k_cache=torch.nan_to_num(inp["k_cache"]), v_cache=torch.nan_to_num(inp["v_cache"]))
        check_close(o, **clean, lse=lse)
    # hd 256 without a window (no tuned Gluon entry) stays on the portable kernel
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=16, num_kv_heads=8, head_dim=256, page_size=64, device="cuda")
    attention(**inp, backend="triton")
    assert TA.LAST_LAUNCH["impl"] == "triton"
    # hd 512 (Gemma 4 global layers): the roles kernel
    inp = make_batch(sl, ql, num_causal_q=ncq, num_heads=16, num_kv_heads=2, head_dim=512, page_size=64, device="cuda",
                     poison_unused=True)
    clean = dict(inp, k_cache=torch.nan_to_num(inp["k_cache"]), v_cache=torch.nan_to_num(inp["v_cache"]))
    o = attention(**inp, backend="triton")
    assert TA.LAST_LAUNCH["impl"] == "gluon" and TA.LAST_LAUNCH["config"]["OVERLAP"] == "roles"
    check_close(o, **clean)
    # a caller's OVERLAP=False / LAZY_RESCALE=True runs the wide kernel (keys the roles kernel refuses)
    for user in ({"OVERLAP": False}, {"LAZY_RESCALE": True}):
        o = attention(**inp, backend="triton", config=user)
        assert TA.LAST_LAUNCH["impl"] == "gluon" and TA.LAST_LAUNCH["config"]["OVERLAP"] is False, user
        check_close(o, **clean)


# ------------------------------------------------- NaN / Inf V of keys a row may not see (issue 26, the contract)
# The Gluon kernels keep them out with config["NAN_SAFE_V"] (on by default since these tests passed on the H200,
# docs/tuning.md 1.11): every check below sets it explicitly. On the CPU, test_nonfinite_v_checks_hold_for_the_portable_kernel runs
# the same helpers with the portable kernel (which always keeps them out) as a stand-in.
def _nan_safe(config):
    """``config`` with the Gluon kernels' NaN / Inf V clean-up switched on (the portable kernel ignores it)."""
    return dict(config, NAN_SAFE_V=True)


def _packed(inp):
    """``inp`` with K and V in vLLM's FlashAttention layout: one ``[..., num_kv_heads, 2 * head_dim]`` cache, K
    and V its two halves (views with a head column stride of ``2 * head_dim``; V starts ``head_dim`` elements into
    a token row)."""
    D = inp["k_cache"].shape[-1]
    k, v = torch.cat([inp["k_cache"], inp["v_cache"]], dim=-1).split(D, dim=-1)
    assert k.stride(-2) == v.stride(-2) == 2 * D and v.storage_offset() == D
    return dict(inp, k_cache=k, v_cache=v)


def _poison_v(inp, seed, per_seq=6):
    """``inp`` with NaN / +-Inf V entries of keys inside ``seq_lens`` (:func:`poison_v_inside_seq_lens`)."""
    return poison_v_inside_seq_lens(inp, seed, per_seq)[0]


def _check_nonfinite_v(inp, config, seed, packed=False, impl="gluon", **kw):
    """The Gluon kernel (``config`` with ``NAN_SAFE_V``) on caches whose V holds NaN / +-Inf entries of keys
    inside ``seq_lens`` (``packed``: in vLLM's packed KV layout, :func:`_packed`), into a NaN-poisoned ``out``:
    exactly the reference's NaN / +Inf / -Inf entries (the rows that allow a poisoned key, in its column: a key a
    row may not see contributes nothing), every other entry (and the LSE) within the tolerance rule of the oracle
    of the caches with those entries zeroed. ``impl``: the kernel that must run (``"triton"``: the portable
    kernel, the CPU stand-in). Returns the number of non-finite entries."""
    bad = _poison_v(inp, seed)
    if packed:
        bad = _packed(bad)
    q, vc = bad["q"], bad["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**bad, out=out, return_lse=True, backend="triton", config=_nan_safe(config), **kw)
    assert TA.LAST_LAUNCH["impl"] == impl and TA.LAST_LAUNCH["config"]["NAN_SAFE_V"] is True
    return check_nonfinite_matches_reference(o, bad, lse=lse, **kw)


def _nonfinite_cases(D, H, Hkv, page_size, seed, paged=True, small=False):
    """Mixed batches (canvases over context, a prefill, a commit + canvas sequence, a short causal one, an empty
    one) with NaN in the stale cache rows too; ``small``: the same shape of batch at interpreter sizes, on the
    CPU."""
    sl, ql, ncq = [1500, 700, 333, 9, 0, 1300], [256, 700, 64, 9, 0, 300], [0, 700, 64, 4, 0, 40]
    if small:
        sl, ql, ncq = [70, 21, 40, 9, 0, 52], [16, 21, 8, 9, 0, 20], [0, 21, 8, 4, 0, 5]
    return make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page_size,
                      paged=paged, device="cpu" if small else "cuda", seed=seed, poison_unused=paged)


@pytest.mark.gpu
def test_gpu_gluon_hd128_keys_a_row_may_not_see_contribute_nothing_even_nan_or_inf_v():
    """The automatic hd-128 Gluon config (the chained consumer, 64 x 128): causal diagonals, mixed rows, splits,
    both window modes, paged and contiguous: NaN / Inf V of a key a row may not see never reaches that row (was
    0 * NaN = NaN in every row of the tile whose masked block held it)."""
    cfg = dict(tc.TUNED_GLUON_CONFIGS[(128, 2, False, False)][0])
    inp = _nonfinite_cases(128, 16, 8, 64, seed=21)
    nf = _check_nonfinite_v(inp, cfg, seed=1)
    nf += _check_nonfinite_v(inp, dict(cfg, num_splits=3), seed=2)
    nf += _check_nonfinite_v(inp, cfg, seed=3, window_size=127)
    nf += _check_nonfinite_v(inp, dict(cfg, num_splits=2), seed=4, window_size=100, bidirectional_window="prefix")
    nf += _check_nonfinite_v(_nonfinite_cases(128, 16, 8, 64, seed=27, paged=False), cfg, seed=14)
    assert nf > 0  # some rows do see a poisoned key


@pytest.mark.gpu
def test_gpu_gluon_roles_hd512_keys_a_row_may_not_see_contribute_nothing_even_nan_or_inf_v():
    """The automatic hd-512 config (the roles kernel: the PV warpgroups clean V and run the fix-up, each on its
    256 columns; 64-token pages, then 32-token pages: two TMA boxes a block), and the wide kernel (two consumer
    warpgroups, each on its V half)."""
    cfg = dict(tc.TUNED_GLUON_CONFIGS[(512, 8, False, False)][0])
    inp = _nonfinite_cases(512, 16, 2, 64, seed=22)
    _check_nonfinite_v(inp, cfg, seed=5)
    _check_nonfinite_v(inp, dict(cfg, num_splits=3), seed=6, window_size=127)
    _check_nonfinite_v(inp, dict(cfg, num_splits=2), seed=7, window_size=100, bidirectional_window="prefix")
    _check_nonfinite_v(inp, WIDE, seed=8)
    _check_nonfinite_v(inp, dict(WIDE, num_splits=3), seed=9, window_size=127)
    _check_nonfinite_v(_nonfinite_cases(512, 16, 2, 32, seed=26), cfg, seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_gpu_gluon_sliding_canvas_keys_a_row_may_not_see_contribute_nothing_even_nan_or_inf_v(mode):
    """The automatic sliding-layer Gluon config (hd 256, W 1023, split regime: the sequential consumer): one canvas
    over 8k of context, and the mixed batch; then keys no row of the batch may see (just outside the window, in the
    key block the window edge falls in): the output is finite everywhere."""
    cfg = dict(tc.TUNED_GLUON_CONFIGS[(256, 2, True, False)][1])
    S, W = 8423, 1023  # ctx - W = 7144: 40 keys into key block 111 (7104..7167), which the first tile visits
    canvas = make_batch([S], [256], causal=[False], num_heads=16, num_kv_heads=8, head_dim=256, page_size=64,
                        device="cuda", seed=23, poison_unused=True)
    _check_nonfinite_v(canvas, cfg, seed=10, window_size=W, bidirectional_window=mode)
    _check_nonfinite_v(canvas, dict(cfg, num_splits=4), seed=11, window_size=W, bidirectional_window=mode)
    mixed = _nonfinite_cases(256, 16, 8, 64, seed=24)
    _check_nonfinite_v(mixed, cfg, seed=12, window_size=W, bidirectional_window=mode)
    # every V entry of keys 7104..7143 (before every row's window, inside seq_len) NaN / +Inf / -Inf
    v = canvas["v_cache"].clone()
    lo = S - 256 - W
    bt = canvas["block_table"][0].tolist()
    for key in range(lo // 64 * 64, lo):
        v[bt[key // 64], key % 64] = (float("nan"), float("inf"), -float("inf"))[key % 3]
    bad = dict(canvas, v_cache=v)
    clean = dict(canvas, v_cache=torch.nan_to_num(canvas["v_cache"]), k_cache=torch.nan_to_num(canvas["k_cache"]))
    for c in (_nan_safe(cfg), _nan_safe(dict(cfg, num_splits=4))):
        q = bad["q"]
        out = torch.full((q.shape[0], q.shape[1], 256), float("nan"), dtype=q.dtype, device=q.device)
        o = attention(**bad, out=out, backend="triton", config=c, window_size=W, bidirectional_window=mode)
        assert TA.LAST_LAUNCH["impl"] == "gluon"
        assert torch.isfinite(o).all()
        check_close(o, **clean, window_size=W, bidirectional_window=mode)


@pytest.mark.gpu
def test_gpu_gluon_overlapped_and_sequential_consumers_keep_nan_v_of_disallowed_keys_out():
    """The other consumers of the producer-warp kernel (OVERLAP True / False, 64 x 64, 128 x 64 of 8 warps)."""
    inp = _nonfinite_cases(128, 16, 8, 64, seed=25)
    for i, cfg in enumerate((GLUON, dict(GLUON, OVERLAP=False, BLOCK_M=128, num_warps=8, LAZY_RESCALE=True))):
        _check_nonfinite_v(inp, cfg, seed=30 + i)
        _check_nonfinite_v(inp, dict(cfg, num_splits=3), seed=40 + i, window_size=127)


@pytest.mark.gpu
@pytest.mark.parametrize("D,H,Hkv,cfg,page_size", [
    (128, 16, 8, tc.TUNED_GLUON_CONFIGS[(128, 2, False, False)][0], 64),  # the automatic hd-128 chain
    (512, 16, 2, tc.TUNED_GLUON_CONFIGS[(512, 8, False, False)][0], 64),  # the automatic hd-512 roles kernel
    (512, 16, 2, tc.TUNED_GLUON_CONFIGS[(512, 8, False, False)][0], 32),  # two TMA boxes a key block
    (512, 16, 2, WIDE, 64),
    (128, 16, 8, GLUON, 64),  # the overlapped consumer
])
def test_gpu_gluon_packed_kv_layout_keys_a_row_may_not_see_contribute_nothing_even_nan_or_inf_v(D, H, Hkv, cfg,
                                                                                                 page_size):
    """vLLM's packed KV layout (``torch.cat([k, v], -1).split(D, -1)``: KV head h of V at column h * 2D of a row
    that starts D elements into the cache row): the cold fix-up reads the V entries the TMA loads read (head
    column stride VS, as the descriptors), so a NaN / Inf of KV head h > 0 reaches exactly the rows that allow its
    key (with the separate caches' head stride D it would read another head's K or V and miss it)."""
    inp = _nonfinite_cases(D, H, Hkv, page_size, seed=50 + D + page_size)
    nf = _check_nonfinite_v(inp, cfg, seed=51, packed=True)
    nf += _check_nonfinite_v(inp, dict(cfg, num_splits=3), seed=52, packed=True, window_size=127)
    nf += _check_nonfinite_v(inp, dict(cfg, num_splits=2), seed=53, packed=True, window_size=100,
                             bidirectional_window="prefix")
    assert nf > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_gpu_gluon_sliding_packed_kv_layout_keeps_nan_v_of_disallowed_keys_out(mode):
    """The automatic sliding-layer config (hd 256, W 1023, the sequential consumer) on vLLM's packed layout."""
    cfg = dict(tc.TUNED_GLUON_CONFIGS[(256, 2, True, False)][1])
    mixed = _nonfinite_cases(256, 16, 8, 64, seed=54)
    _check_nonfinite_v(mixed, cfg, seed=55, packed=True, window_size=1023, bidirectional_window=mode)
    _check_nonfinite_v(mixed, dict(cfg, num_splits=3), seed=56, packed=True, window_size=127,
                       bidirectional_window=mode)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("paged", [True, False])
def test_nonfinite_v_checks_hold_for_the_portable_kernel(packed, paged):
    """CPU stand-in for the GPU tests above: the same batch construction, poisoning and reference checks, with the
    portable kernel (which keeps NaN / Inf V of keys a row may not see out whatever NAN_SAFE_V says) at
    interpreter sizes, separate caches and vLLM's packed layout, splits and both window modes. Checks the checks:
    poisoned keys inside and outside rows' intervals, some rows seeing one."""
    inp = _nonfinite_cases(32, 4, 2, 8, seed=60, paged=paged, small=True)
    cfg = dict(IMPL="triton", BLOCK_M=16, BLOCK_N=16)
    nf = _check_nonfinite_v(inp, cfg, seed=61, packed=packed, impl="triton")
    nf += _check_nonfinite_v(inp, dict(cfg, num_splits=2), seed=62, packed=packed, impl="triton", window_size=7)
    nf += _check_nonfinite_v(inp, cfg, seed=63, packed=packed, impl="triton", window_size=5,
                             bidirectional_window="prefix")
    assert nf > 0


@pytest.mark.parametrize("mutation", ["leak", "drop"])
def test_nonfinite_v_checks_catch_a_kernel_that_leaks_or_drops_nonfinite_v(monkeypatch, mutation):
    """The checks fail for a kernel whose output has a NaN where the reference has a finite entry (``0 * NaN`` of a
    key a row may not see) or a finite entry where the reference has NaN / Inf (an allowed key's entry lost)."""
    real = attention

    def faulty(**kw):
        res = real(**kw)
        if kw["backend"] == "triton":
            o = res[0]
            fin = torch.isfinite(o)
            if mutation == "leak":
                o.view(-1)[int(fin.view(-1).nonzero()[0])] = float("nan")
            else:
                o[~fin] = 0.0
        return res

    monkeypatch.setattr(sys.modules[__name__], "attention", faulty)
    inp = _nonfinite_cases(32, 4, 2, 8, seed=60, small=True)
    which = r"is(nan|posinf|neginf): [1-9]\d* entries only in the output" if mutation == "leak" else \
        r"is(nan|posinf|neginf): 0 entries only in the output .* [1-9]\d* only in the reference"
    with pytest.raises(AssertionError, match=which):
        _check_nonfinite_v(inp, dict(IMPL="triton", BLOCK_M=16, BLOCK_N=16), seed=61, impl="triton")
