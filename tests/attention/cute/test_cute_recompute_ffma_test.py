"""The recompute's epilogue test as ``fma(x, 0, s)`` chains (``FlashAttentionForwardSm90Mixed._nr_ffma_test``):
docs/tuning.md 2.38 built it as a switch beside a cold path out of line; 2.39 made it the only test (faster on the
H100, bit-identical outputs) and removed the out-of-line cold path (refuted). The default kernels' PTX at hd <= 256
with the recompute is the switch's PTX of before (checked with ``cute_ptx_snapshot`` against the commit before, 2.39).

* CPU: the FFMA test's arithmetic is exact (the chain is NaN iff an entry is NaN / +-Inf, never for a finite one
  however large or small; torch's fp32 stands in for ``fma.rn.f32``: ``x * 0`` is exact, so the fused and unfused
  forms agree); with the CuTe DSL the split / cluster classes share the test, and the unsplit hd-256 bench launch at
  the defaults compiles with the recompute: no spill; the loops' instruction mix of NaN-safe V off; 128
  ``fma.rn.f32 ..., 0f00000000`` a thread in the PTX, and in SASS 128 FFMA tests and no AND with the exponent mask
  before the epilogue's vote; no ``.func`` and no ``call`` (the cold path inline); and the recompute at the defaults
  compiles on launch kinds of the GPU tests' cases that the bench does not compile (PackGQA with padded rows, a padded
  head dim, a split with FA4's combine, a cluster merge with a prefix window).
* GPU: the recompute's own tests (test_cute_nan_recompute.py: the reference's exact non-finite entries, finite caches
  bit for bit against NaN-safe V off with a counter of 0) and the hd-256 NaN-safe V tests run the FFMA test, the
  default.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from cute_helpers import HAVE_FA4

_FA4 = pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, "
                          "nvidia-cutlass-dsl)")
_COMPILE = pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and "
                              "nvidia-cutlass-dsl==4.8.1")
#: the FFMA test's inline asm (ptx.fma_zero) as it appears in the PTX
TEST_FMA = re.compile(r"fma\.rn\.f32 %[rf]\d+, %[rf]\d+, 0f00000000, %[rf]\d+;")
#: a PTX function other than the kernel (``.func``) or a call of one
FUNC_OR_CALL = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.func\b|^\s*(?:@!?%p\d+\s+)?call(?:\.uni)?\b", re.M)


@_FA4
def test_the_split_classes_share_the_ffma_test():
    from blockdiff.attention.cute.kernel import NR_FFMA_CHAINS, FlashAttentionForwardSm90Mixed as Mixed
    from blockdiff.attention.cute.kernel_cluster import FlashAttentionForwardSm90MixedCluster
    from blockdiff.attention.cute.kernel_split import FlashAttentionForwardSm90MixedSplit
    assert NR_FFMA_CHAINS == 4  # the chain counts test_the_ffma_chain_is_nan_exactly_when_an_entry_is_nonfinite covers
    for cls in (FlashAttentionForwardSm90MixedSplit, FlashAttentionForwardSm90MixedCluster):
        for attr in ("_nonfinite_recompute", "_nr_ffma_test"):
            assert getattr(cls, attr) is getattr(Mixed, attr), (cls, attr)


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


def test_the_func_or_call_pattern_finds_a_called_function():
    """:data:`FUNC_OR_CALL`, which the compile tests require to find nothing, finds a PTX ``.func`` and its call."""
    ptx = ".visible .func (.param .b32 r) f_1(\n.param .b32 a\n)\n{\n}\n\tcall.uni (retval0), f_1, (param0);\n"
    assert len(FUNC_OR_CALL.findall(ptx)) == 2
    assert not FUNC_OR_CALL.findall("\tfma.rn.f32 %f1, %f2, 0f00000000, %f3;\n.entry kernel_call_x(\n")


@_COMPILE
def test_the_unsplit_hd256_launch_compiles_with_the_ffma_test_at_the_defaults(tmp_path):
    """``mixed_sliding_ctx8k``'s launch at the defaults (``cute_ptx_snapshot``'s spec without a prefix: "auto" takes
    the recompute at hd 256) against NaN-safe V off: no spill; the same loops with the same wgmma / exp2 / FMUL /
    barrier / load counts, no local memory, within 3 % of off's length; one ``fma.rn.f32 ..., 0f00000000`` per
    accumulator entry of a thread (2 rows x 64 columns) and, in SASS, 128 FFMA tests and no AND with the exponent
    mask nor an integer max before the epilogue's vote; the cold path inline (no ``.func``, no ``call``)."""
    from cute_helpers import assert_loops_like_off, compile_snapshot_specs
    r = compile_snapshot_specs(tmp_path, "sliding_bench_mixed_ctx8k", ("nanoff_", ""))
    off, on = r["nanoff_"], r[""]
    ptx = Path(on["ptx_file"]).read_text()
    assert on["config"]["nan_safe_v_method"] == "recompute", on["config"]
    assert on["spill_store_bytes"] == 0 and on["spill_load_bytes"] == 0, on
    assert_loops_like_off(off, on, 1.03, label="default")
    assert off["epilogue_test"] is None
    assert len(TEST_FMA.findall(ptx)) == 128
    test = on["epilogue_test"]
    assert test["FFMA x*0"] == 128 and test["LOP3 exponent mask"] == 0 and test["integer max"] == 0, test
    assert not FUNC_OR_CALL.findall(ptx)


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


@_COMPILE
@pytest.mark.parametrize("kind", list(_OTHER_KINDS))
def test_the_recompute_compiles_on_the_gpu_tests_other_launch_kinds(kind, tmp_path):
    """The recompute (the FFMA test, the cold path inline) compiles on each launch kind, without spills: the FFMA
    test's inline asm in the PTX, no AND with the exponent mask in the epilogue's SASS, no ``.func`` / ``call``."""
    from cute_helpers import compile_for_sm90_or_skip
    spec = dict(_OTHER_KINDS[kind])
    spec["config"] = dict(spec.get("config", {}), nan_safe_v=True, nan_safe_v_method="recompute")
    rep = compile_for_sm90_or_skip(ptx_dir=str(tmp_path), **spec)
    assert rep["config"]["nan_safe_v_method"] == "recompute", rep["config"]
    ptx = Path(rep["ptx_file"]).read_text()
    assert TEST_FMA.search(ptx)
    assert not FUNC_OR_CALL.findall(ptx)
    assert rep["epilogue_test"]["FFMA x*0"] > 0 and rep["epilogue_test"]["LOP3 exponent mask"] == 0, rep
    assert rep["spill_store_bytes"] == 0, rep
