"""The experiment switches' machinery (class attributes of the kernel classes read at compile time), CPU with the
CuTe DSL (the kernel modules import it): ``compile_check.set_switches`` / ``switch_target`` accept only an existing
experiment class attribute, and ``bench/experiments/ab_roles_switch.py`` names its rows from them."""
from __future__ import annotations

import json

import pytest

from cute_helpers import HAVE_FA4

pytestmark = pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, "
                                "nvidia-cutlass-dsl)")


def test_set_switches_refuses_what_is_not_an_experiment_attribute():
    """A switch names ``Class._ATTR`` of an existing class attribute of kernel.py / kernel_wide.py / kernel_roles.py;
    a missing class, a missing attribute, a public attribute (a constructor argument's, not a switch), a bare name,
    a method or a module-level function is a ValueError naming it; ab_roles_switch takes the same names (and bare
    roles ones)."""
    from blockdiff.attention.cute import compile_check as cchk
    for bad in ("NoSuchClass._K_REFILL_ALL_WARPS", "FlashAttentionForwardSm90Roles._NO_SUCH_SWITCH",
                "FlashAttentionForwardSm90Mixed.V_REFILLS", "_K_REFILL_ALL_WARPS",
                "FlashAttentionForwardSm90Roles._k_refill_all_warps", "row_key_range.__name__"):
        with pytest.raises(ValueError, match="switch"):
            cchk.set_switches({bad: True})
    from blockdiff.bench.experiments.ab_roles_switch import switch_class
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    assert switch_class("_K_REFILL_ALL_WARPS") == (R, "_K_REFILL_ALL_WARPS")
    assert switch_class("FlashAttentionForwardSm90Roles._K_REFILL_ALL_WARPS") == (R, "_K_REFILL_ALL_WARPS")
    for bad in ("FlashAttentionForwardSm90Roles._k_refill_all_warps", "_NO_SUCH_SWITCH"):
        with pytest.raises(ValueError, match="switch"):
            switch_class(bad)


def test_ab_switch_settings_name_every_row_and_refuse_bad_ones():
    """``ab_roles_switch``'s several-switch form: an ``off`` row with every named switch at its class default, then
    one row per setting with the switches it leaves out at their defaults; a setting named ``off``, an empty one or
    an unknown switch is a ValueError (before any GPU work)."""
    from blockdiff.bench.experiments.ab_roles_switch import switch_settings
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    a, e = "FlashAttentionForwardSm90Roles._K_REFILL_ALL_WARPS", "_EPILOGUE_LOCAL_WARP"
    got = switch_settings(json.dumps({"all_warps": {a: True}, "both": {a: True, e: True}}))
    assert list(got) == ["off", "all_warps", "both"]
    flat = {name: {attr: v for (cls, attr), v in row.items()} for name, row in got.items()}
    assert flat["off"] == dict.fromkeys(["_K_REFILL_ALL_WARPS", "_EPILOGUE_LOCAL_WARP"], False)
    assert flat["all_warps"] == dict(flat["off"], _K_REFILL_ALL_WARPS=True)
    assert flat["both"] == dict(flat["off"], _K_REFILL_ALL_WARPS=True, _EPILOGUE_LOCAL_WARP=True)
    assert all(cls is R for row in got.values() for cls, _ in row)
    single = switch_settings(a)
    assert {n: list(r.values()) for n, r in single.items()} == {"off": [False], "on": [True]}
    for bad in (json.dumps({"off": {a: True}}), json.dumps({"x": {}}), json.dumps({"x": {"Nope._A": True}}), "{"):
        with pytest.raises(ValueError):
            switch_settings(bad)
