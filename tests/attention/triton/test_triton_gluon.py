"""The warp-specialised Gluon kernels (attention/triton/gluon.py) on the H200 (``-m gpu``): against the dense
reference on a NaN-poisoned ``out`` and with NaN in every stale cache row (beyond ``seq_lens`` and in unused
pages), over page sizes, the contiguous form, GQA ratios, windows in both modes, mixed causal rows, split counts,
fp16, CUDA-graph replays with changed flags, lengths and block tables, and the automatic kernel choice. CPU checks
of these kernels: test_triton_config.py, test_triton_tma.py, test_triton_compile_check.py."""
import pytest
import torch

from blockdiff.attention import attention
from blockdiff.attention.testing import check_close
from blockdiff.attention.triton import config as tc
from blockdiff.attention.triton import interface as TA

from triton_helpers import GLUON, ROLES, graph_replay_check, make_batch


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
