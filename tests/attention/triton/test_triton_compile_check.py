"""The offline sm_90a compile check (attention/triton/compile_check.py): every Gluon configuration the automatic
choice and the tests use compiles with wgmma, TMA and setmaxnreg, within shared memory, without serialised
wgmma pipelines (ptxas C7512 / C7514) and without spills beyond the stated bounds (ptxas -v, no GPU needed); the
portable kernel's tuned tiles compile without spills in the kernel (its cold paths included); the split-KV merge
in both of its formats compiles without spills. In every one, no
``exp2`` takes an FMA's result: each key's weight is ``exp2((s - m) * c)`` (``compile_check.exp2_operands_from_fma``;
the one-FMA form gave NaN rows for scores near -2e31, compiled only: docs/tuning.md 7.63)."""
import json
import os
import re
import subprocess
import sys

import pytest

from blockdiff.attention.triton import config as tc


def _run_offline(fn: str, kw: dict) -> dict:
    """``compile_check.<fn>(**kw)`` in a fresh process without TRITON_INTERPRET (the interpreter replaces the
    @triton.jit helpers the kernels call); its report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import json, sys; from blockdiff.attention.triton.compile_check import {fn}; "
            f"print(json.dumps({fn}(**json.loads(sys.argv[1]))))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(kw)], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _compile_offline(kw):
    """compile_for_sm90(**kw) offline; asserts it built with wgmma, TMA and setmaxnreg; returns (report, spill
    bytes per function)."""
    rep = _run_offline("compile_for_sm90", kw)
    assert rep["wgmma"] and rep["tma"] and rep["setmaxnreg"]
    assert rep["exp2_from_fma"] == 0, "a key weighed by exp2 of an FMA against a rounded row max (tuning 7.63)"
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


# config["NAN_SAFE_V"] (on by default since its H200 test run; off, every configuration above compiles to the PTX
# of the kernels without the switch: bench/experiments/ptx_snapshot.py): the NaN / Inf V clean-up of masked key
# blocks and the cold fix-up after the epilogue (gluon._clean_v / _nonfinite_fixup) for the automatic configs and
# the consumers its GPU tests run, with spill bounds of their own (ptxas -v, Triton 3.6; the switch-off bound of the
# same tile in brackets). The spills sit in the prologue, the epilogue, masked blocks and the fix-up, none on a full
# key block's path (docs/tuning.md 1.11).
_GLUON_AUTO = dict(block_m=64, num_warps=4, num_stages=2, paged=True, page_size=64)
_ROLES_AUTO = dict(block_m=64, block_n=64, num_warps=12, num_stages=1, head_dim=512, group=8, num_kv_heads=2,
                   paged=True, page_size=64, window=False, overlap="roles")
_WIDE_AUTO = dict(block_m=64, block_n=64, num_warps=8, num_stages=1, head_dim=512, group=8, num_kv_heads=2,
                  paged=True, page_size=64, split=True, window=False, overlap=False)


@pytest.mark.parametrize("kw,max_spill", [
    # hd 128, the automatic chain 64x128 (causal flags, split and not): 0 (4 B off)
    (dict(_GLUON_AUTO, block_n=128, v_stages=1, head_dim=128, split=False, window=False, overlap="chain",
          causal_flags=True), 0),
    (dict(_GLUON_AUTO, block_n=128, v_stages=1, head_dim=128, split=True, window=False, overlap="chain",
          causal_flags=True), 0),
    (dict(_GLUON_AUTO, block_n=128, v_stages=1, head_dim=128, paged=False, split=True, window=True,
          overlap="chain"), 0),
    # hd 512, the automatic roles kernel (split and not; 32-token pages: two TMA boxes a block): 32 / 40 B (0 off)
    (dict(_ROLES_AUTO, split=False), 32),
    (dict(_ROLES_AUTO, split=True), 32),
    (dict(_ROLES_AUTO, split=False, page_size=32), 40),
    # hd 512, the wide kernel at its automatic tile: 16 / 24 B (116 / 248 B off)
    (dict(_WIDE_AUTO, lazy=False), 16),
    (dict(_WIDE_AUTO, lazy=True), 24),
    # hd 256 sliding, the automatic split-regime tile (the sequential consumer): 0 (0 off)
    (dict(_GLUON_AUTO, block_n=64, head_dim=256, split=True, window=True, overlap=False, causal_flags=True), 0),
    # the overlapped consumer and two sequential warpgroups with lazy rescaling (hd 128): 0 (0 off)
    (dict(_GLUON_AUTO, block_n=64, head_dim=128, split=True, window=True, overlap=True), 0),
    (dict(_GLUON_AUTO, block_m=128, num_warps=8, block_n=64, head_dim=128, split=True, window=True, overlap=False,
          lazy=True), 0),
])
def test_nan_safe_v_gluon_kernels_compile_for_sm90(kw, max_spill):
    rep, spills = _compile_offline(dict(kw, nan_safe_v=True))
    assert spills and max(spills) <= max_spill, rep["ptxas"]
    assert "C751" not in rep["ptxas"], rep["ptxas"]  # C7512 / C7514: ptxas serialised the wgmma pipeline
    assert rep["shared"] <= (tc.WIDE_SMEM_LIMIT if kw["head_dim"] > 256 else 227 * 1024)


@pytest.mark.parametrize("kw,max_spill", [
    # the tuned hd-128 tiles (base and split regime) and a small-page layout: the NaN / Inf scan of ragged blocks,
    # the page-id clamps and the cold pass (not inlined) leave the kernel without spills
    (dict(block_m=128, block_n=64, num_warps=8, num_stages=4, head_dim=128, paged=True, page_size=64), 0),
    (dict(block_m=64, block_n=64, num_warps=4, num_stages=3, head_dim=128, paged=True, page_size=64, split=True), 0),
    (dict(block_m=128, block_n=64, num_warps=8, num_stages=3, head_dim=128, paged=True, page_size=16), 0),
    (dict(block_m=128, block_n=64, num_warps=4, num_stages=3, head_dim=64, paged=False, window=True, prefix=True,
          split=True, group=1), 0),
    # the tuned hd-256 sliding tile (lazy rescaling) spilled ~100 B before the hardening too
    (dict(block_m=128, block_n=64, num_warps=8, num_stages=2, head_dim=256, paged=True, page_size=64, window=True,
          lazy=True), 128),
])
def test_portable_kernel_compiles_for_sm90_without_new_spills(kw, max_spill):
    rep = _run_offline("compile_portable_for_sm90", kw)
    assert rep["kernel_spills"] <= max_spill, rep["ptxas"]
    assert rep["exp2_from_fma"] == 0, "a key weighed by exp2 of an FMA against a rounded row max (tuning 7.63)"
    assert rep["registers"] <= 255


@pytest.mark.parametrize("raw_stats", [False, True])
@pytest.mark.parametrize("num_splits,head_dim_v", [(3, 128), (2, 256), (8, 512)])
def test_split_merge_compiles_for_sm90_without_spills_or_an_exp2_of_an_fma(num_splits, head_dim_v, raw_stats):
    """The split-KV merge in both formats (``raw_stats``: the triton backend's raw max and sum, weighed
    ``l_s * exp2((m_s - M) * c)``; else the cute backend's LSEs), with PDL's wait: no spills and no ``exp2`` fed by
    an FMA (offline, Triton 3.6: 254 / 168 / 102 registers in the LSE format, 254 / 168 / 100 with raw stats)."""
    rep = _run_offline("compile_merge_for_sm90", dict(num_splits=num_splits, head_dim_v=head_dim_v,
                                                      raw_stats=raw_stats))
    assert rep["spills"] == 0, rep["ptxas"]
    assert rep["exp2_from_fma"] == 0, "a split weighed by exp2 of an FMA against a rounded max (tuning 7.63)"
    assert rep["griddepcontrol"] and rep["registers"] <= 255


def test_an_exp2_of_an_fma_against_a_rounded_row_max_is_counted_and_a_subtraction_then_multiply_is_not():
    """The PTX check the compile tests assert on: Triton 3.6 contracted ``exp2(s * c - m)`` into
    ``ex2(fma(s, c, -m))`` (96 of the portable kernel's 102 ``ex2`` at 9e1e22d), whose rounding error made the
    best key of a row with scores near -2e31 weigh inf or 0 on the GPU (the interpreter has no FMA)."""
    from blockdiff.attention.triton.compile_check import exp2_operands_from_fma

    fused = ("\tmax.f32 \t%r1, %r2, %r3;\n\tfma.rn.f32 \t%r4, %r5, %r6, %r7;\n"
             "\tex2.approx.ftz.f32 \t%r8, %r4;\n\t@%p1 ex2.approx.ftz.f32 \t%r9, %r4;\n")
    split = "\tsub.f32 \t%r4, %r5, %r7;\n\tmul.f32 \t%r10, %r4, %r6;\n\tex2.approx.ftz.f32 \t%r8, %r10;\n"
    assert exp2_operands_from_fma(fused) == 2
    assert exp2_operands_from_fma(split) == 0
    # a register an FMA wrote and a later multiply rewrote is the multiply's
    assert exp2_operands_from_fma("\tfma.rn.f32 \t%r4, %r5, %r6, %r7;\n\tmul.f32 \t%r4, %r4, %r6;\n"
                                  "\tex2.approx.f32 \t%r8, %r4;\n") == 0
    # an FMA's result copied by a register move before the exp2 still counts; a move of an immediate does not
    assert exp2_operands_from_fma("\tfma.rn.f32 \t%r4, %r5, %r6, %r7;\n\tmov.b32 \t%r9, %r4;\n"
                                  "\tmov.f32 \t%r10, %r9;\n\tex2.approx.f32 \t%r8, %r10;\n"
                                  "\tmov.f32 \t%r11, 0f3F800000;\n\tex2.approx.f32 \t%r12, %r11;\n") == 1
