"""The recompute's two exact switches of docs/tuning.md 2.38: ``FlashAttentionForwardSm90Mixed._NR_FFMA_TEST`` (the
epilogue test as ``fma(x, 0, s)`` chains instead of an AND with the exponent mask and an integer max) and
``_NR_COLD_NOINLINE`` (the cold path as a function that is not inlined: an ``llvm.func`` marked ``no_inline``, PTX
``.func`` + ``call``). Both off by default, so the default kernels' PTX is the one built without them (checked with
``cute_ptx_snapshot compare`` against the commit before, 2.38).

* CPU: both off, inherited by the split / cluster classes; the FFMA test's arithmetic is exact (the chain is NaN iff
  an entry is NaN / +-Inf, never for a finite one however large or small; torch's fp32 stands in for ``fma.rn.f32``:
  ``x * 0`` is exact, so the fused and unfused forms agree); the device script's A/B settings and shards; with the
  CuTe DSL the unsplit hd-256 bench launch compiled with each switch (no spill; the loops' instruction mix of NaN-safe
  V off; the FFMA test's 128 ``fma.rn.f32 ..., 0f00000000`` a thread in the PTX; the cold path a ``.func`` called
  once) and both switches on launch kinds of the GPU tests' cases that the bench does not compile (PackGQA with
  padded rows, a padded head dim, a split with FA4's combine, a cluster merge with a prefix window).
* GPU: ``cute_mixed_switch.sh SWITCH=_NR_FFMA_TEST`` runs the recompute's own tests (test_cute_nan_recompute.py: the
  reference's exact non-finite entries, finite caches bit for bit against NaN-safe V off with a counter of 0) and the
  hd-256 NaN-safe V tests with both switches on in every call (switch_lib.sh's ``switch_run``).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from cute_helpers import HAVE_FA4

M = "FlashAttentionForwardSm90Mixed"
SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "experiments" / "device" / "cute_mixed_switch.sh"
_FA4 = pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, "
                          "nvidia-cutlass-dsl)")


@_FA4
def test_the_switches_are_off_by_default_and_reach_the_split_classes():
    from blockdiff.attention.cute import compile_check as cchk
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as Mixed
    from blockdiff.attention.cute.kernel_cluster import FlashAttentionForwardSm90MixedCluster
    from blockdiff.attention.cute.kernel_split import FlashAttentionForwardSm90MixedSplit
    for attr in ("_NR_FFMA_TEST", "_NR_COLD_NOINLINE"):
        assert getattr(Mixed, attr) is False
        assert cchk.switch_target(f"{M}.{attr}") == (Mixed, attr)
        for cls in (FlashAttentionForwardSm90MixedSplit, FlashAttentionForwardSm90MixedCluster):
            assert attr not in vars(cls) and getattr(cls, attr) is False, (cls, attr)
    from blockdiff.attention.cute.kernel import NR_FFMA_CHAINS
    assert NR_FFMA_CHAINS == 4  # the chain counts test_the_ffma_chain_is_nan_exactly_when_an_entry_is_nonfinite covers


def _chain(xs: torch.Tensor, chains: int) -> torch.Tensor:
    """The FFMA test of one row as kernel._nr_ffma_test computes it: ``chains`` chains ``s = x * 0 + s`` from +0
    over the entries ``c % chains == j``, then their sum."""
    sums = [torch.zeros((), dtype=torch.float32) for _ in range(chains)]
    for c, x in enumerate(xs):
        sums[c % chains] = x * torch.tensor(0.0) + sums[c % chains]
    s = sums[0]
    for t in sums[1:]:
        s = s + t
    return s


@pytest.mark.parametrize("chains", [1, 4])
def test_the_ffma_chain_is_nan_exactly_when_an_entry_is_nonfinite(chains):
    """Exactness of the test's arithmetic: every fp32 class (zeros of both signs, the smallest subnormal, the largest
    finite, both infinities, NaN) alone and among 64 finite entries at every position: the row's sum is NaN iff an
    entry is NaN / +-Inf, and otherwise a zero (never Inf: a finite ``x * 0`` is a zero, whatever ``x``'s size)."""
    tiny, big = torch.finfo(torch.float32).tiny / 2 ** 23, torch.finfo(torch.float32).max
    specials = [0.0, -0.0, tiny, -tiny, big, -big, 1.0, -3e38, math.inf, -math.inf, math.nan]
    g = torch.Generator().manual_seed(5)
    base = (torch.rand(64, generator=g, dtype=torch.float64) * 2 - 1) * 3e38
    for v in specials:
        for pos in (0, 1, 5, 62, 63):
            xs = base.to(torch.float32).clone()
            xs[pos] = v
            s = _chain(xs, chains)
            if math.isfinite(v):
                assert s.item() == 0.0, (v, pos, s)
            else:
                assert math.isnan(s.item()), (v, pos, s)


def _ab_setting(script: str) -> str:
    m = re.search(r"^\s*AB_SWITCH='(\{\"ffma\".*\})'$", script, re.M)
    assert m, "cute_mixed_switch.sh has no _NR_FFMA_TEST case"
    return m.group(1).replace("'$M'", M)


@_FA4
def test_the_device_scripts_ab_settings_time_off_ffma_noinline_and_trivial():
    """``cute_mixed_switch.sh SWITCH=_NR_FFMA_TEST``'s switch argument as ``ab_roles_switch`` reads it: the off row
    (the default recompute: all three switches at their defaults), one row per exact switch, and 2.37's trivial cold
    path (tests/bench/experiments/test_mixed_switch_ab_args.py checks the rest of the A/B call and the shards)."""
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as Mixed
    from blockdiff.bench.experiments.ab_roles_switch import switch_settings
    text = _ab_setting(SCRIPT.read_text())
    json.loads(text)
    got = switch_settings(text)
    f, n, t = (Mixed, "_NR_FFMA_TEST"), (Mixed, "_NR_COLD_NOINLINE"), (Mixed, "_NR_TRIVIAL_COLD_PATH")
    assert got == {"off": {f: False, n: False, t: False}, "ffma": {f: True, n: False, t: False},
                   "noinline": {f: False, n: True, t: False}, "trivial": {f: False, n: False, t: True}}


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
def test_the_unsplit_hd256_launch_compiles_with_either_switch(tmp_path):
    """``mixed_sliding_ctx8k``'s launch with the recompute (``cute_ptx_snapshot``'s ``ffmatest_`` / ``noinline_``)
    against NaN-safe V off: no spill; the same loops with the same wgmma / exp2 / FMUL / barrier / load counts, no
    local memory; the FFMA test's loops within 3 % of off's length, the out-of-line cold path's within 6 % (ptxas
    keeps fewer values in the uniform registers across the call: docs/tuning.md 2.38); the FFMA test: one
    ``fma.rn.f32 ..., 0f00000000`` per accumulator entry of a thread (2 rows x 64 columns) and, in SASS, no AND with
    the exponent mask before the epilogue's vote; the cold path: a ``.func`` with one ``call`` of it."""
    from cute_helpers import assert_loops_like_off, compile_snapshot_specs
    r = compile_snapshot_specs(tmp_path, "sliding_bench_mixed_ctx8k", ("nanoff_", "ffmatest_", "noinline_"))
    off = r["nanoff_"]
    ptx = {pre: Path(r[pre]["ptx_file"]).read_text() for pre in r}
    for pre, slack in (("ffmatest_", 1.03), ("noinline_", 1.06)):
        on = r[pre]
        assert on["config"]["nan_safe_v_method"] == "recompute", on["config"]
        assert on["spill_store_bytes"] == 0 and on["spill_load_bytes"] == 0, on
        assert_loops_like_off(off, on, slack, label=pre)
    assert off["epilogue_test"] is None
    test_fma = re.compile(r"fma\.rn\.f32 %[rf]\d+, %[rf]\d+, 0f00000000, %[rf]\d+;")  # _fma_zero's inline asm
    assert len(test_fma.findall(ptx["ffmatest_"])) == 128
    assert r["ffmatest_"]["epilogue_test"]["LOP3 exponent mask"] == 0
    assert r["ffmatest_"]["epilogue_test"]["FFMA x*0"] == 128
    assert r["noinline_"]["epilogue_test"]["LOP3 exponent mask"] == 128  # the default test
    assert not test_fma.search(ptx["noinline_"])
    funcs = re.findall(r"^\.visible \.func .*?(blockdiff_nr_cold_path_\d+)\(", ptx["noinline_"], re.M)
    assert funcs == ["blockdiff_nr_cold_path_1"], funcs
    assert len(re.findall(r"call\.uni[^;]*blockdiff_nr_cold_path_1,", ptx["noinline_"])) == 1
    assert "blockdiff_nr_cold_path" not in ptx["ffmatest_"]


#: GPU-test launch kinds the bench's specs do not compile (test_cute_nan_recompute.py CASES): compile_only keywords
_OTHER_KINDS = {
    "hd128_gqa3_padded_rows": dict(head_dim=128, num_heads=12, num_kv_heads=4, page_size=64),
    "hd72_padded_head_dim_contiguous": dict(head_dim=72, num_heads=8, num_kv_heads=8, page_size=None),
    "hd128_split3_combine": dict(head_dim=128, num_heads=16, num_kv_heads=8, page_size=64,
                                 config=dict(num_splits=3, split_merge="combine")),
    "hd128_split2_cluster_prefix100": dict(head_dim=128, num_heads=16, num_kv_heads=8, page_size=64,
                                           window_size=100, bidirectional_window="prefix",
                                           config=dict(num_splits=2, split_merge="cluster")),
}


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
@pytest.mark.parametrize("kind", list(_OTHER_KINDS))
def test_both_switches_compile_on_the_gpu_tests_other_launch_kinds(kind, tmp_path):
    """Both switches on (as the device script's shards run them): the launch compiles with the recompute, the FFMA
    test and the called cold path (its trace-time check that the coordinates partitioned inside are laid out as the
    caller's holds), without spills."""
    from cute_helpers import compile_for_sm90_or_skip
    spec = dict(_OTHER_KINDS[kind])
    spec["config"] = dict(spec.get("config", {}), nan_safe_v=True, nan_safe_v_method="recompute")
    rep = compile_for_sm90_or_skip(ptx_dir=str(tmp_path), switches={f"{M}._NR_FFMA_TEST": True,
                                                                    f"{M}._NR_COLD_NOINLINE": True}, **spec)
    assert rep["config"]["nan_safe_v_method"] == "recompute", rep["config"]
    ptx = Path(rep["ptx_file"]).read_text()
    assert len(re.findall(r"call\.uni[^;]*blockdiff_nr_cold_path_\d+,", ptx)) == 1
    assert "0f00000000" in ptx
    assert rep["spill_store_bytes"] == 0, rep
