"""The recompute's timing-only experiment switches (docs/tuning.md 2.37): ``FlashAttentionForwardSm90Mixed.
_NR_TRIVIAL_COLD_PATH`` (the cold path replaced by a counter increment: the epilogue test and its vote stay, the
recompute's code goes; WRONG results on a cache with non-finite V) and ``_NR_NO_STASH`` (with it: no stash writes at
the consumers' entry). Both off by default, so the default kernels' PTX is the one built without them (checked with
``cute_ptx_snapshot compare`` against the commit before, 2.37).

* CPU with the CuTe DSL: both off; the split / cluster classes inherit them (the A/B sets them on the base class);
  ``_NR_NO_STASH`` alone is refused at trace time; the device script's A/B settings give the rows off / trivial /
  nostash; the unsplit hd-256 bench launch compiles with either switch: no spill, the key-block loops' instruction mix
  of NaN-safe V off within 3 % of its length, one ``vote.sync.any`` (the epilogue's) and the counter's atomic, no
  stash store with ``_NR_NO_STASH``.
* No GPU test: the switches are for timing only (``cute_mixed_switch.sh SWITCH=_NR_TRIVIAL_COLD_PATH``, whose A/B
  checks every row bit for bit against the full recompute on the bench's finite caches).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from cute_helpers import HAVE_FA4

pytestmark = pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, "
                                "nvidia-cutlass-dsl)")
M = "FlashAttentionForwardSm90Mixed"
SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "experiments" / "device" / "cute_mixed_switch.sh"


def test_the_switches_are_off_by_default_reach_the_split_classes_and_no_stash_needs_the_trivial_path():
    from blockdiff.attention.cute import compile_check as cchk
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as Mixed
    from blockdiff.attention.cute.kernel_cluster import FlashAttentionForwardSm90MixedCluster
    from blockdiff.attention.cute.kernel_split import FlashAttentionForwardSm90MixedSplit
    assert Mixed._NR_TRIVIAL_COLD_PATH is False and Mixed._NR_NO_STASH is False
    for cls in (FlashAttentionForwardSm90MixedSplit, FlashAttentionForwardSm90MixedCluster):
        for attr in ("_NR_TRIVIAL_COLD_PATH", "_NR_NO_STASH"):
            assert attr not in vars(cls) and getattr(cls, attr) is False, (cls, attr)
    for attr in ("_NR_TRIVIAL_COLD_PATH", "_NR_NO_STASH"):
        assert cchk.switch_target(f"{M}.{attr}") == (Mixed, attr)

    def no_stash(trivial, no):
        return Mixed._nr_no_stash(SimpleNamespace(_NR_TRIVIAL_COLD_PATH=trivial, _NR_NO_STASH=no))
    assert no_stash(False, False) is False and no_stash(True, False) is False and no_stash(True, True) is True
    with pytest.raises(ValueError, match="_NR_NO_STASH needs _NR_TRIVIAL_COLD_PATH"):
        no_stash(False, True)


def test_the_device_scripts_ab_settings_time_off_trivial_and_nostash():
    """``cute_mixed_switch.sh SWITCH=_NR_TRIVIAL_COLD_PATH``'s switch argument, as ``ab_roles_switch`` reads it: the
    off row with both switches at their defaults (the full recompute), then trivial, then trivial without the stash
    (tests/bench/experiments/test_mixed_switch_ab_args.py checks the rest of its A/B call)."""
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as Mixed
    from blockdiff.bench.experiments.ab_roles_switch import switch_settings
    m = re.search(r"^\s*AB_SWITCH='(\{\"trivial\".*\})'$", SCRIPT.read_text(), re.M)
    assert m, "cute_mixed_switch.sh has no _NR_TRIVIAL_COLD_PATH case"
    got = switch_settings(m.group(1).replace("'$M'", M))
    t, n = (Mixed, "_NR_TRIVIAL_COLD_PATH"), (Mixed, "_NR_NO_STASH")
    assert got == {"off": {t: False, n: False}, "trivial": {t: True, n: False}, "nostash": {t: True, n: True}}
    json.loads(m.group(1).replace("'$M'", M))  # valid JSON as the script passes it


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
def test_the_unsplit_hd256_launch_compiles_with_the_trivial_cold_path_and_without_the_stash(tmp_path):
    """``mixed_sliding_ctx8k``'s launch with the recompute (``cute_ptx_snapshot``'s ``trivialcold_`` / ``nostash_``
    specs) against NaN-safe V off: no spill, the same loops with the same wgmma / exp2 / FMUL / barrier / load counts,
    no local memory, within 3 % of off's length; the PTX keeps the epilogue's vote and the counter's atomic (the
    branch is not deleted) and has no other vote (the recompute's per-row votes are gone); without the stash, no
    64-bit shared-memory store (the stash's)."""
    from cute_helpers import assert_loops_like_off, compile_snapshot_specs
    from blockdiff.bench.experiments.cute_ptx_snapshot import SPECS
    name = "sliding_bench_mixed_ctx8k"
    r = compile_snapshot_specs(tmp_path, name, ("nanoff_", "trivialcold_", "nostash_"))
    assert SPECS["trivialcold_" + name]["spec"]["config"]["nan_safe_v_method"] == "recompute"
    off = r["nanoff_"]
    ptx = {pre: Path(r[pre]["ptx_file"]).read_text() for pre in r}
    for pre in ("trivialcold_", "nostash_"):
        on = r[pre]
        assert on["config"]["nan_safe_v_method"] == "recompute", on["config"]
        assert on["spill_store_bytes"] == 0 and on["spill_load_bytes"] == 0, on
        assert_loops_like_off(off, on, 1.03, label=pre, r2ur=True)
        assert ptx[pre].count("vote.sync.any") == 1, pre
        assert re.search(r"vote\.sync\.any[^\n]*\n(?:[^\n]*\n){0,6}[^\n]*atom\.global\.add", ptx[pre]), pre
    stash = re.compile(r"st\.shared(?:\.v2)?\.b64")
    assert stash.search(ptx["trivialcold_"]) and not stash.search(ptx["nostash_"])
    assert not stash.search(ptx["nanoff_"])  # the pattern is the stash's alone
