"""The recompute's exact experiment switch ``FlashAttentionForwardSm90Mixed._NR_LEAN_COLD_PATH`` (docs/tuning.md 2.40):
the cold path takes the sequence info's tensors (cu_seqlens, seqused, num_causal_q) from the shared-memory stash
instead of the kernel parameters, and runs its Q . K chunk loop rolled, where ``_NR_FRESH_TILE_VALUES`` acts (the
unsplit class above hd 128; elsewhere the rolled loop alone lengthened the key-block loops, so it does not act). Aim:
the hot path compiles as with the timing-only trivial cold path (``_NR_TRIVIAL_COLD_PATH``), whose build was 0.9-1.3 %
faster on the H100 (docs/tuning.md 2.37, 2.39). Off by default: the default kernels' PTX is HEAD's (checked with
``cute_ptx_snapshot compare`` for ``recompute_`` / ``nanoff_`` / ``scan_`` / ``trivialcold_``).

* CPU with the CuTe DSL: off by default, inherited by the split / cluster classes; the device script's A/B settings
  (off / lean / trivial) and its shards with the switch on; the unsplit hd-256 bench launch (``leancold_``) compiles
  without spills, with off's loop mix, no longer loops than the trivial build's and none of the QK GEMM's Q-descriptor
  adds that the default rebuilds in its loops, the same FFMA test, and the sequence info's slots written at the
  consumers' entry; on the other launches (the sliding canvas's cluster kernel, the hd-128 ones, the GPU tests' other
  launch kinds) the switch does not act: the same PTX as without it.
* GPU (cute_mixed_switch.sh SWITCH=_NR_LEAN_COLD_PATH): the recompute's own tests and the hd-256 NaN-safe V tests with
  the switch on in every call.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cute_helpers import HAVE_FA4

_FA4 = pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, "
                          "nvidia-cutlass-dsl)")
_COMPILE = pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and "
                              "nvidia-cutlass-dsl==4.8.1")
M = "FlashAttentionForwardSm90Mixed"
SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "experiments" / "device" / "cute_mixed_switch.sh"
#: the QK GEMM's Q-operand descriptor advanced by one / two K slices (0x4000004000000002 / ...04), as LLVM emits it
Q_DESC_ADD = re.compile(r"add\.s64\s+%rd\d+, %rd\d+, 461168629330536141[024];")
#: the FFMA test's inline asm (ptx.fma_zero)
TEST_FMA = re.compile(r"fma\.rn\.f32 %[rf]\d+, %[rf]\d+, 0f00000000, %[rf]\d+;")
#: a 64-bit shared-memory store (the stash's slots)
STASH_STORE = re.compile(r"st\.shared(?:\.v2)?\.b64")


@_FA4
def test_the_switch_is_off_by_default_and_reaches_the_split_classes():
    from blockdiff.attention.cute import compile_check as cchk
    from blockdiff.attention.cute.kernel import NR_SEQLEN_SLOTS
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as Mixed
    from blockdiff.attention.cute.kernel_cluster import FlashAttentionForwardSm90MixedCluster
    from blockdiff.attention.cute.kernel_split import FlashAttentionForwardSm90MixedSplit
    assert Mixed._NR_LEAN_COLD_PATH is False
    for cls in (FlashAttentionForwardSm90MixedSplit, FlashAttentionForwardSm90MixedCluster):
        assert "_NR_LEAN_COLD_PATH" not in vars(cls) and cls._NR_LEAN_COLD_PATH is False, cls
    assert cchk.switch_target(f"{M}._NR_LEAN_COLD_PATH") == (Mixed, "_NR_LEAN_COLD_PATH")
    # cu_seqlens q / k, seqused q / k and num_causal_q, each an address and a stride, fit
    assert NR_SEQLEN_SLOTS >= 5 * 2 - 2


@_FA4
def test_the_device_scripts_ab_times_off_lean_and_trivial_and_its_shards_set_the_switch():
    """``cute_mixed_switch.sh SWITCH=_NR_LEAN_COLD_PATH``'s switch argument, as ``ab_roles_switch`` reads it: the off
    row at the defaults (the full recompute), then the switch, then the trivial cold path (timing only); its shards are
    the recompute's own file (both halves) and the hd-256 NaN-safe V tests, run with the switch on
    (tests/bench/experiments/test_mixed_switch_ab_args.py checks the rest of the A/B call)."""
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as Mixed
    from blockdiff.bench.experiments.ab_roles_switch import switch_settings
    text = SCRIPT.read_text()
    case = re.search(r"^\s*_NR_LEAN_COLD_PATH\) field=0; shards=\"([^\"]+)\".*?;;", text, re.M | re.S)
    assert case, "cute_mixed_switch.sh has no _NR_LEAN_COLD_PATH case"
    assert case.group(1).split() == ["own_recompute_a", "own_recompute_b", "nan256"]
    m = re.search(r"AB_SWITCH='(\{\"lean\".*\})'$", case.group(0), re.M)
    got = switch_settings(m.group(1).replace("'$M'", M))
    lean, trivial = (Mixed, "_NR_LEAN_COLD_PATH"), (Mixed, "_NR_TRIVIAL_COLD_PATH")
    assert got == {"off": {lean: False, trivial: False}, "lean": {lean: True, trivial: False},
                   "trivial": {lean: False, trivial: True}}
    json.loads(m.group(1).replace("'$M'", M))
    for half in ("own_recompute_a", "own_recompute_b"):
        assert re.search(rf"^\s*{half}\) run 1 sw_{half} tests/attention/cute/test_cute_nan_recompute\.py -k ", text,
                         re.M), half


@_COMPILE
def test_the_unsplit_hd256_launch_compiles_as_the_trivial_cold_path_builds_it(tmp_path):
    """``mixed_sliding_ctx8k``'s launch with the recompute and the switch (``leancold_``) against NaN-safe V off, the
    trivial cold path (``trivialcold_``) and the default (``recompute_``): no spill; off's loop mix (wgmma, exp2, FMUL,
    barriers, loads), no local memory; each key-block loop no longer than the trivial build's (CPU, sm_90a: 490 / 441 /
    517 against trivial's 490 / 442 / 518, the default's 496 / 448 / 524) and none of the Q-descriptor adds that the
    default's loops rebuild (the PTX has only the prologue's three); the same FFMA test; the stash's 64-bit stores plus
    the sequence info's."""
    from cute_helpers import assert_loops_like_off, compile_snapshot_specs
    r = compile_snapshot_specs(tmp_path, "sliding_bench_mixed_ctx8k",
                               ("nanoff_", "trivialcold_", "recompute_", "leancold_"))
    off, trivial, full, lean = r["nanoff_"], r["trivialcold_"], r["recompute_"], r["leancold_"]
    ptx = {pre: Path(r[pre]["ptx_file"]).read_text() for pre in r}
    assert lean["config"]["nan_safe_v_method"] == "recompute", lean["config"]
    assert lean["spill_store_bytes"] == 0 and lean["spill_load_bytes"] == 0, lean
    assert_loops_like_off(off, lean, 1.01, label="lean", r2ur=True)
    for i, (t, f, n) in enumerate(zip(trivial["loops"], full["loops"], lean["loops"])):
        assert n["instructions"] <= t["instructions"] < f["instructions"], (i, t, f, n)
    # the default rebuilds the Q descriptors in each key-block loop; the switch leaves only the prologue's
    assert len(Q_DESC_ADD.findall(ptx["recompute_"])) > len(Q_DESC_ADD.findall(ptx["leancold_"]))
    assert len(Q_DESC_ADD.findall(ptx["leancold_"])) <= len(Q_DESC_ADD.findall(ptx["trivialcold_"]))
    assert len(TEST_FMA.findall(ptx["leancold_"])) == len(TEST_FMA.findall(ptx["recompute_"])) == 128
    assert lean["epilogue_test"]["FFMA x*0"] == 128, lean["epilogue_test"]
    assert ptx["leancold_"].count("vote.sync.any") == ptx["recompute_"].count("vote.sync.any")
    # the sequence info's slots: cu_seqlens q / k, seqused k, num_causal_q (an address each) beside the stash's stores
    assert len(STASH_STORE.findall(ptx["leancold_"])) > len(STASH_STORE.findall(ptx["recompute_"]))


@_COMPILE
@pytest.mark.parametrize("spec_name", ["sliding_bench_canvas_ctx32k", "hd128_bench_prefill16k"])
def test_the_switch_leaves_the_other_launches_as_they_are(spec_name, tmp_path):
    """The split / cluster classes and hd 128 (``_NR_FRESH_TILE_VALUES`` off): the same PTX with the switch as without
    (there its rolled chunk loop alone lengthened the key-block loops)."""
    from cute_helpers import compile_snapshot_specs
    r = compile_snapshot_specs(tmp_path, spec_name, ("recompute_", "leancold_"))
    assert r["leancold_"]["ptx_sha256"] == r["recompute_"]["ptx_sha256"]
