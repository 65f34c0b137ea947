"""The warp-specialised Gluon kernel of the Triton backend (``config["IMPL"] = "gluon"``).

CPU (CI): config and eligibility errors, and an offline sm_90a compile of the kernel (Triton compiles for a
``GPUTarget`` without a GPU; ptxas reports registers and spills). GPU (``-m gpu``, H200): the kernel against the
dense reference on a NaN-poisoned ``out`` and with NaN in every stale cache row (beyond ``seq_lens`` and in unused
pages), over page sizes, the contiguous form, GQA ratios, windows in both modes, mixed causal rows, split counts,
fp16, and a CUDA-graph replay with changed flags, lengths and block tables.
"""
import json
import os
import re
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from blockdiff.attention import attention  # noqa: E402
from blockdiff.attention.triton import config as tc  # noqa: E402
from blockdiff.attention.triton import interface as TA  # noqa: E402
from blockdiff.attention.triton import tma  # noqa: E402
from blockdiff.attention.testing import check_close  # noqa: E402

from test_triton_attention import graph_replay_check, make_batch  # noqa: E402  (pytest prepends this folder to sys.path)

GLUON = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def poison_stale_rows(inp):
    """NaN in every cache row a sequence does not own: beyond seq_len in its last page, and in unused pages."""
    kc, vc = inp["k_cache"], inp["v_cache"]
    if "block_table" not in inp:
        return inp
    P = kc.shape[1]
    used = torch.zeros(kc.shape[0], P, dtype=torch.bool, device=kc.device)
    bt = inp["block_table"].tolist()
    for b, n in enumerate(inp["seq_lens"].tolist()):
        for pos in range(n):
            used[bt[b][pos // P], pos % P] = True
    kc[~used] = float("nan")
    vc[~used] = float("nan")
    return inp


# ---------------------------------------------------------------- CPU: errors and the offline compile


def test_gluon_on_a_cpu_tensor_is_a_clear_error_not_a_fallback():
    inp = make_batch([9, 5], [4, 5], causal=[False, True], D=64, page_size=64, device="cpu")
    with pytest.raises(ValueError, match="IMPL.*gluon.*CUDA"):
        attention(**inp, backend="triton", config=GLUON)


@pytest.mark.parametrize("bad,match", [
    (dict(num_warps=2), "num_warps"), (dict(BLOCK_M=32), "BLOCK_M"), (dict(BLOCK_M=64, num_warps=8), "BLOCK_M"),
    (dict(BLOCK_N=16), "BLOCK_N"), (dict(num_stages=5), "num_stages"), (dict(BLOCK_DV=32), "BLOCK_DV"),
    (dict(IMPL="cuda"), "IMPL"), (dict(OVERLAP=1), "OVERLAP"), (dict(OVERLAP="pv"), "OVERLAP"),
    (dict(OVERLAP="Chain"), "OVERLAP"), (dict(V_STAGES=0), "V_STAGES"), (dict(V_STAGES=5), "V_STAGES"),
    (dict(V_STAGES=True), "V_STAGES"),
    (dict(V_STAGES=2.0), "V_STAGES"), (dict(IMPL="triton", V_STAGES=1), "V_STAGES"),
    (dict(IMPL="triton", OVERLAP=False), "OVERLAP"), (dict(IMPL="cuda", V_STAGES=1), "IMPL"),
])
def test_bad_gluon_configs_name_the_field(bad, match):
    inp = make_batch([9], [4], causal=[False], D=64, page_size=64, device="cpu")
    with pytest.raises(ValueError, match=match):
        attention(**inp, backend="triton", config=dict(GLUON, **bad))


WIDE = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, BLOCK_DV=512, OVERLAP=False)


@pytest.mark.parametrize("bad,match", [
    (dict(num_warps=4), "num_warps=8 and BLOCK_M=64"), (dict(BLOCK_M=128), "num_warps=8 and BLOCK_M=64"),
    (dict(OVERLAP=True), "OVERLAP=False"), (dict(OVERLAP="chain"), "OVERLAP=False"),
    (dict(num_stages=2), "shared memory"), (dict(BLOCK_N=32, num_stages=3), "shared memory"),
    (dict(BLOCK_DV=256), "BLOCK_DV"),
    (dict(V_STAGES="2"), "V_STAGES"), (dict(num_stages="1"), "num_stages"),
])
def test_bad_wide_gluon_configs_name_the_rule(bad, match):
    # hd 512 (Gemma 4 global layers): two consumer warpgroups of 64 rows, Q + K / V rings + the partial-S
    # exchange within 227 KB of shared memory
    inp = make_batch([9], [4], causal=[False], H=16, Hkv=2, D=512, page_size=64, device="cpu")
    with pytest.raises(ValueError, match=match):
        attention(**inp, backend="triton", config=dict(WIDE, **bad))
    tc.check_gluon_config(tc.TritonConfig(**dict(WIDE, V_STAGES=None)), 512, 512)            # the automatic hd-512 choice fits
    tc.check_gluon_config(tc.TritonConfig(**dict(WIDE, BLOCK_N=32, num_stages=2, V_STAGES=2)),
                          512, 512)


def test_hd512_configs_resolve_to_the_kernel_that_can_take_them():
    # the H200 tables (not the interpreter's): the portable kernel's hd-512 entry splits V (BLOCK_DV 256); an
    # explicit IMPL="gluon" holds all of V without being told
    from blockdiff.attention.triton import interface as TA

    kern = tc.TritonAttention(tc.StaticKey(512, 512, 8, torch.bfloat16, True, 64, False, False, False))
    assert kern.base["BLOCK_DV"] == 256 and kern.gluon_base is not None
    cfg = kern.config(dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, OVERLAP=False))
    assert cfg.BLOCK_DV == 512
    # the automatic hd-512 choice is the roles kernel, in both regimes
    assert kern.gluon_base["OVERLAP"] == kern.gluon_split["OVERLAP"] == "roles"
    assert kern.config(kern.gluon_base).num_warps == 12


def test_layout_rules_name_what_tma_needs():
    kc = torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16)
    assert tma.layout_ineligible(kc, kc, paged=True, page_size=64, block_n=64) is None
    assert tma.layout_ineligible(kc, kc, paged=True, page_size=64, block_n=128) is None  # two pages, two boxes
    assert tma.tma_box_rows(True, 64, 128) == 64 and tma.tma_box_rows(True, 256, 128) == 128
    assert tma.tma_box_rows(False, None, 128) == 128
    for page in (4, 12, 48):  # not a multiple of 8 (swizzle atom), or neither divides the other
        kp = torch.zeros(4, page, 2, 128, dtype=torch.bfloat16)
        assert "BLOCK_N" in tma.layout_ineligible(kp, kp, paged=True, page_size=page, block_n=64)
    both = torch.zeros(4, 2, 64, 2, 128, dtype=torch.bfloat16)  # [blocks, K/V, page, heads, dim]: pages strided
    assert "stride(0)" in tma.layout_ineligible(both[:, 0], both[:, 1], paged=True, page_size=64, block_n=64)
    heads_strided = torch.zeros(4, 64, 128, 4, dtype=torch.bfloat16).transpose(2, 3)[..., :2, :]
    assert "contiguous" in tma.layout_ineligible(heads_strided, heads_strided, paged=True, page_size=64, block_n=64)
    flat = torch.zeros(100, 2, 128, dtype=torch.bfloat16)
    assert tma.layout_ineligible(flat, flat, paged=False, page_size=None, block_n=128) is None


def test_overlap_defaults_follow_the_measured_consumers():
    # the QK^T / softmax overlap where its consumer fits the registers (64-key blocks, hd <= 128), else the chained
    # consumer up to hd 256, and the wide hd-512 kernel sequential (it takes nothing else)
    from blockdiff.attention.triton.interface import get_kernel
    for D, bn, want in [(128, 64, True), (128, 128, "chain"), (256, 64, "chain"), (64, 32, True)]:
        kern = get_kernel(D, D, 2, torch.bfloat16, True, 64, False, False)
        assert kern.config(dict(GLUON, BLOCK_N=bn)).OVERLAP == want, (D, bn)
        assert type(kern.config(dict(GLUON, BLOCK_N=bn)).OVERLAP) is type(want)
    assert kern.config(dict(GLUON, OVERLAP=False)).OVERLAP is False
    wide = get_kernel(512, 512, 8, torch.bfloat16, True, 64, False, False)
    assert wide.config({k: v for k, v in WIDE.items() if k != "OVERLAP"}).OVERLAP is False
    with pytest.raises(ValueError, match="OVERLAP"):
        tc.overlap_mode("pv")
    assert [tc.overlap_mode(v) for v in (False, True, "chain")] == [0, 1, 2]
    assert kern.config({"V_STAGES": 1}).V_STAGES == 1  # IMPL unset: applies if the Gluon kernel is chosen


def test_resident_programs_per_sm_follow_shared_memory_and_the_launch_register_budget():
    # 64x128 hd 128 with 2 K + 1 V buffers: 115 KB, two programs per SM (the automatic hd-128 choice)
    assert tc.gluon_ctas_per_sm(64, 128, 4, 2, 128, 128, 2, v_stages=1) == 2
    assert tc.gluon_ctas_per_sm(64, 128, 4, 2, 128, 128, 2) == 1          # 2 + 2 buffers: 148 KB
    # hd 256 fits twice by shared memory with one stage, but its PV wgmma needs > 128 registers at launch
    assert tc.gluon_ctas_per_sm(64, 64, 4, 1, 256, 256, 2) == 1
    assert tc.gluon_max_regs(4, 2) == 128 and tc.gluon_max_regs(4, 1) is None


def test_cached_kv_descriptors_are_reused_and_do_not_keep_the_cache_alive():
    import gc
    import weakref

    kc = torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    first = tma.make_kv_descriptors(kc, vc, 64)
    assert tma.make_kv_descriptors(kc, vc, 64) is first
    assert tma.make_kv_descriptors(kc, vc, 32) is not first  # the box rows are part of the key
    assert first[0].base.data_ptr() == kc.data_ptr() and first[1].base.data_ptr() == vc.data_ptr()
    assert first[0].shape == [256, 256] and first[0].strides == [256, 1] and first[0].block_shape == [64, 128]
    ref = weakref.ref(kc)
    del kc, vc
    gc.collect()
    assert ref() is None


def _compile_offline(kw):
    """compile_for_sm90(**kw) in a fresh process without TRITON_INTERPRET (the interpreter replaces the
    @triton.jit helpers Gluon calls); asserts it built with wgmma, TMA and setmaxnreg; returns (report, spill
    bytes per function)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from blockdiff.attention.triton.compile_check import compile_for_sm90; "
            "print(json.dumps(compile_for_sm90(**json.loads(sys.argv[1]))))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(kw)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["wgmma"] and rep["tma"] and rep["setmaxnreg"]
    return rep, [int(x) for x in re.findall(r"(\d+) bytes spill stores", rep["ptxas"])]


@pytest.mark.parametrize("bm,bn,nw,stages,D,paged,split,window,overlap,extra", [
    # the automatic hd-128 choice: 128-key blocks of two 64-token pages, 2 K + 1 V buffers, split and not
    (64, 128, 4, 2, 128, True, True, False, False, dict(page_size=64, v_stages=1)),
    (64, 128, 4, 2, 128, True, False, False, False, dict(page_size=64, v_stages=1, causal_flags=True)),
    (64, 64, 4, 2, 128, True, True, False, True, {}),     # the overlapped consumer, split
    (128, 128, 8, 2, 128, True, True, False, False, {}),  # one consumer partition of two warpgroups, no overlap
    (64, 64, 4, 3, 128, False, False, True, True, {}),    # contiguous, windowed
    (64, 64, 4, 2, 256, True, False, True, False, {}),    # hd 256 sliding layers (the overlap spills ~100 B there)
    (64, 64, 4, 2, 64, True, True, True, True, dict(lazy=True)),  # conditional rescaling in the overlapped consumer
    # the wide hd-512 kernel (two consumer partitions): 64x32 with 2 K + 2 V buffers compiles without spills;
    # the automatic 64x64 / one buffer each spills ~116 B (checked below, on the GPU it is the faster one)
    (64, 32, 8, 2, 512, True, True, True, False, dict(group=8, num_kv_heads=2, page_size=64)),
    # the chained consumer (PV of block j and QK^T of block j + 1 back to back): hd 256 and contiguous hd 128
    (64, 64, 4, 2, 256, True, True, True, "chain", dict(page_size=64)),
    (64, 128, 4, 2, 128, False, False, True, "chain", dict(v_stages=1)),
])
def test_gluon_kernel_compiles_for_sm90_without_spills(bm, bn, nw, stages, D, paged, split, window, overlap, extra):
    rep, spills = _compile_offline(dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=stages, head_dim=D,
                                        paged=paged, split=split, window=window, overlap=overlap, **extra))
    assert spills and max(spills) == 0, rep["ptxas"]  # (a substring test would also pass "120 bytes ...")
    assert "C751" not in rep["ptxas"], rep["ptxas"]  # C7512 / C7514: ptxas serialised the wgmma pipeline
    assert rep["shared"] <= 227 * 1024


@pytest.mark.parametrize("split", [False, True])
def test_chained_hd128_consumer_compiles_for_sm90_at_the_automatic_tile(split):
    # the automatic hd-128 choice: 64x128, 2 K + 1 V buffers, OVERLAP="chain", paged with 64-token pages; ptxas
    # spills one register (4 B) there, outside the wgmma pipeline
    rep, spills = _compile_offline(dict(block_m=64, block_n=128, num_warps=4, num_stages=2, v_stages=1, head_dim=128,
                                        paged=True, split=split, window=False, overlap="chain", page_size=64,
                                        causal_flags=True))
    assert "C751" not in rep["ptxas"], rep["ptxas"]
    assert max(spills) <= 8, rep["ptxas"]
    assert rep["shared"] <= 227 * 1024 // 2  # two programs per SM


@pytest.mark.parametrize("lazy", [False, True])
def test_wide_gluon_kernel_compiles_for_sm90_at_the_automatic_tile(lazy):
    rep, spills = _compile_offline(dict(block_m=64, block_n=64, num_warps=8, num_stages=1, head_dim=512, paged=True,
                                        split=True, window=False, overlap=False, group=8, num_kv_heads=2,
                                        page_size=64, lazy=lazy))
    assert "C751" not in rep["ptxas"], rep["ptxas"]
    assert max(spills) <= 256, rep["ptxas"]
    assert 224 * 1024 <= rep["shared"] <= tc.WIDE_SMEM_LIMIT


ROLES = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=12, num_stages=1, OVERLAP="roles")


@pytest.mark.parametrize("bad,match", [
    (dict(num_warps=8), "num_warps=12"), (dict(BLOCK_M=128), "BLOCK_M=64"), (dict(LAZY_RESCALE=True), "LAZY"),
    (dict(num_stages=2), "shared memory"), (dict(OVERLAP="Roles"), "OVERLAP"),
])
def test_bad_roles_configs_name_the_rule(bad, match):
    # OVERLAP="roles" at hd 512: a softmax warpgroup + two PV warpgroups (12 warps), 64 rows, no lazy rescale,
    # Q + K / V rings + the P ring within 227 KB
    kern = TA.get_kernel(512, 512, 8, torch.bfloat16, True, 64, False, False)
    with pytest.raises(ValueError, match=match):
        kern.config(dict(ROLES, **bad))
    assert kern.config(ROLES).OVERLAP == "roles"
    assert kern.config(dict(ROLES, BLOCK_N=32, num_stages=2, V_STAGES=2)).num_warps == 12
    hd256 = TA.get_kernel(256, 256, 2, torch.bfloat16, True, 64, True, False)
    assert hd256.config(dict(ROLES, num_warps=8, num_stages=2)).OVERLAP == "roles"  # one PV warpgroup
    with pytest.raises(ValueError, match="num_warps=8"):
        hd256.config(ROLES)
    assert tc.overlap_mode("roles") == 3
    assert [tc.roles_pv_warpgroups(d) for d in (128, 256, 512)] == [1, 1, 2]
    assert tc.roles_max_regs(512) == 168 and tc.roles_max_regs(256) is None
    # two PV warpgroups at their setmaxnreg leave >= 96 registers a thread for the softmax warpgroup
    assert 4 * tc.roles_max_regs(512) * 3 // 4 - 2 * tc.roles_pv_regs(512) >= 96


def test_hd512_automatic_choice_gives_way_to_the_wide_kernel_for_the_keys_only_it_takes():
    # regression (review of the roles switch): the automatic hd-512 entry is the roles kernel; a caller's
    # OVERLAP=False or LAZY_RESCALE=True used to run the wide kernel and then raised about num_warps / OVERLAP keys
    # the caller never set. They resolve against the wide kernel's tiles again; OVERLAP=True / "chain" still raise,
    # naming the caller's key; other keys keep the roles kernel
    kern = tc.TritonAttention(tc.StaticKey(512, 512, 8, torch.bfloat16, True, 64, False, False, False))
    for entry in (kern.gluon_base, kern.gluon_split):
        wide = kern.config(tc.gluon_auto(entry, {"OVERLAP": False}))
        assert wide.OVERLAP is False and wide.num_warps == 8 and wide.BLOCK_DV == 512
        lazy = kern.config(tc.gluon_auto(entry, {"LAZY_RESCALE": True}))
        assert lazy.LAZY_RESCALE is True and lazy.OVERLAP is False and lazy.num_warps == 8
        for bad in (True, "chain"):
            with pytest.raises(ValueError, match="OVERLAP=False"):
                kern.config(tc.gluon_auto(entry, {"OVERLAP": bad}))
        for keep in ({}, None, {"num_splits": 2}, {"OVERLAP": "roles"}, {"V_STAGES": 1}):
            cfg = kern.config(tc.gluon_auto(entry, keep))
            assert cfg.OVERLAP == "roles" and cfg.num_warps == 12, keep
    # entries below hd 512 merge as before
    k128 = tc.TritonAttention(tc.StaticKey(128, 128, 2, torch.bfloat16, True, 64, False, False, False))
    assert tc.gluon_auto(k128.gluon_base, {"OVERLAP": False}) == dict(k128.gluon_base, OVERLAP=False)


@pytest.mark.parametrize("kw,max_spill", [
    (dict(block_n=64, num_stages=1, head_dim=512, group=8, num_kv_heads=2, page_size=64, causal_flags=True), 0),
    (dict(block_n=64, num_stages=1, head_dim=512, group=8, num_kv_heads=2, window=True), 0),
    (dict(block_n=32, num_stages=2, v_stages=2, head_dim=512, group=8, num_kv_heads=2, page_size=32), 8),
    (dict(block_n=64, num_stages=2, head_dim=256, page_size=64, causal_flags=True, window=True), 0),
    (dict(block_n=128, num_stages=2, v_stages=1, head_dim=128, paged=False), 0),
])
def test_roles_kernel_compiles_for_sm90(kw, max_spill):
    # the softmax warpgroup loads Q in 64-column pieces: whole 256-column loads spilled ~700 B at its 104 registers
    kw = dict(dict(block_m=64, paged=True, split=True, window=False, overlap="roles"), **kw)
    kw["num_warps"] = 4 * (1 + tc.roles_pv_warpgroups(kw["head_dim"]))
    rep, spills = _compile_offline(kw)
    assert "C751" not in rep["ptxas"], rep["ptxas"]
    assert max(spills) <= max_spill, rep["ptxas"]
    assert rep["shared"] <= tc.WIDE_SMEM_LIMIT


# ---------------------------------------------------------------- GPU (H200)


def _check(inp, config, **kw):
    q, vc = inp["q"], inp["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**inp, out=out, return_lse=True, backend="triton", config=config, **kw)
    from blockdiff.attention.triton import interface as TA
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
    inp = poison_stale_rows(make_batch(sl, ql, num_causal_q=ncq, H=H, Hkv=Hkv, D=D, page_size=page_size,
                                       device="cuda", seed=D + page_size + case))
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
    inp = poison_stale_rows(make_batch(sl, ql, num_causal_q=ncq, H=H, Hkv=Hkv, D=D, page_size=page_size,
                                       device="cuda", seed=7 * D + page_size))
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
    inp = poison_stale_rows(make_batch(sl, ql, num_causal_q=ncq, H=16, Hkv=2, D=512, page_size=page_size,
                                       device="cuda", seed=512 + page_size + case))
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
    inp = poison_stale_rows(make_batch(sl, ql, num_causal_q=ncq, H=H, Hkv=Hkv, D=D, page_size=page_size,
                                       device="cuda", seed=3 * D + page_size + case))
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
    inp = poison_stale_rows(make_batch(sl, ql, num_causal_q=ncq, H=H, Hkv=Hkv, D=D, page_size=page_size,
                                       device="cuda", seed=11 * D + page_size + case))
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
    inp = make_batch(sl, ql, num_causal_q=ncq, H=16, Hkv=2, D=512, paged=False, dtype=dtype, device="cuda")
    _check(inp, cfg)
    _check(inp, dict(cfg, num_splits=3), window_size=0)
    # 32-token pages (two TMA boxes per 64-key block), the block table exactly cdiv(seq_len, 32) wide
    inp = poison_stale_rows(make_batch(sl, ql, num_causal_q=ncq, H=16, Hkv=2, D=512, page_size=32, dtype=dtype,
                                       device="cuda", seed=5))
    inp["block_table"] = inp["block_table"][:, :-(-max(sl) // 32)].contiguous()
    _check(inp, cfg, window_size=127)
    clean = dict(inp, k_cache=torch.nan_to_num(inp["k_cache"]), v_cache=torch.nan_to_num(inp["v_cache"]))
    o_only = attention(**inp, backend="triton", config=cfg, window_size=127)  # no LSE stored
    check_close(o_only, **clean, window_size=127)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_contiguous_form_and_dtypes(dtype):
    sl, ql, ncq = GPU_CASES[0]
    inp = make_batch(sl, ql, num_causal_q=ncq, H=16, Hkv=8, D=128, paged=False, dtype=dtype, device="cuda")
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
    inp = make_batch(sl, ql, num_causal_q=ncq, H=H, Hkv=Hkv, D=D, paged=False, dtype=dtype, device="cuda")
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
def test_gpu_automatic_choice_takes_gluon_only_where_tuned_and_tma_can_read_the_cache():
    from blockdiff.attention.triton import interface as TA

    sl, ql, ncq = GPU_CASES[1]
    # page 16: eligible explicitly (one TMA box per page) but not chosen automatically (not measured)
    for page_size, dtype, want in [(64, torch.bfloat16, "gluon"), (16, torch.bfloat16, "triton"),
                                   (64, torch.float32, "triton")]:
        inp = poison_stale_rows(make_batch(sl, ql, num_causal_q=ncq, H=16, Hkv=8, D=128, page_size=page_size,
                                           dtype=dtype, device="cuda"))
        q, vc = inp["q"], inp["v_cache"]
        out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
        o, lse = attention(**inp, out=out, return_lse=True, backend="triton")
        assert TA.LAST_LAUNCH["impl"] == want, (page_size, dtype)
        clean = dict(inp, k_cache=torch.nan_to_num(inp["k_cache"]), v_cache=torch.nan_to_num(inp["v_cache"]))
        check_close(o, **clean, lse=lse)
    # hd 256 without a window (no tuned Gluon entry) stays on the portable kernel
    inp = make_batch(sl, ql, num_causal_q=ncq, H=16, Hkv=8, D=256, page_size=64, device="cuda")
    attention(**inp, backend="triton")
    assert TA.LAST_LAUNCH["impl"] == "triton"
    # hd 512 (Gemma 4 global layers): the roles kernel
    inp = poison_stale_rows(make_batch(sl, ql, num_causal_q=ncq, H=16, Hkv=2, D=512, page_size=64, device="cuda"))
    clean = dict(inp, k_cache=torch.nan_to_num(inp["k_cache"]), v_cache=torch.nan_to_num(inp["v_cache"]))
    o = attention(**inp, backend="triton")
    assert TA.LAST_LAUNCH["impl"] == "gluon" and TA.LAST_LAUNCH["config"]["OVERLAP"] == "roles"
    check_close(o, **clean)
    # a caller's OVERLAP=False / LAZY_RESCALE=True runs the wide kernel (keys the roles kernel refuses)
    for user in ({"OVERLAP": False}, {"LAZY_RESCALE": True}):
        o = attention(**inp, backend="triton", config=user)
        assert TA.LAST_LAUNCH["impl"] == "gluon" and TA.LAST_LAUNCH["config"]["OVERLAP"] is False, user
        check_close(o, **clean)


@pytest.mark.parametrize("key", sorted(TA.TUNED_GLUON_CONFIGS, key=str))
def test_automatic_gluon_configs_do_not_inherit_the_portable_kernels_lazy_rescale(key):
    # regression: the hd-256 sliding Gluon split config inherited LAZY_RESCALE=True from the portable kernel's
    # tuned table (canvas_bs1_ctx32k_sliding 30.2 us against 26.8 without it); the automatic Gluon configs resolve
    # to exactly their table entries, LAZY_RESCALE off unless the caller asks for it
    D, group, has_window, prefix = key
    kern = tc.TritonAttention(tc.StaticKey(D, D, group, torch.bfloat16, True, 64, has_window, prefix, False))
    for entry in (kern.gluon_base, kern.gluon_split):
        if entry is None:
            continue
        cfg = kern.config(dict(entry))
        assert {k: getattr(cfg, k) for k in entry} == entry
        assert cfg.LAZY_RESCALE is False and cfg.BLOCK_DV == D
        if entry["OVERLAP"] == "roles":  # its PV warpgroups rescale every block: lazy rescaling is refused
            with pytest.raises(ValueError, match="LAZY_RESCALE"):
                kern.config(dict(entry, LAZY_RESCALE=True))
        else:
            assert kern.config(dict(entry, LAZY_RESCALE=True)).LAZY_RESCALE is True
    if key == (256, 2, True, False):
        assert kern.config(None).LAZY_RESCALE is True  # the portable kernel keeps its tuned setting
