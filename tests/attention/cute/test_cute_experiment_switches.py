"""The experiment switches' machinery (class attributes of the kernel classes read at compile time), CPU with the
CuTe DSL (the kernel modules import it): ``compile_check.set_switches`` / ``switch_target`` accept only an existing
experiment class attribute, and ``bench/experiments/ab_roles_switch.py`` names its rows from them and from boolean
config fields (``skip_allowed_first`` since docs/tuning.md 2.30), which it puts into each row's config."""
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


def test_ab_switch_settings_take_boolean_config_fields():
    """A boolean config field (``skip_allowed_first``, ``nan_safe_v``) is a switch of ``ab_roles_switch`` too
    (cute_mixed_switch.sh's A/B since docs/tuning.md 2.30): off / on set it False / True in the config (targets are the
    field names), alone or beside class switches (the off row: class defaults, config fields False); a field that is
    not boolean (``k_refill``) or not a field is refused as a switch, as is a class switch written like a field."""
    from blockdiff.bench.experiments.ab_roles_switch import config_field, switch_settings
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    assert switch_settings("skip_allowed_first") == {"off": {"skip_allowed_first": False},
                                                     "on": {"skip_allowed_first": True}}
    both = switch_settings(json.dumps({"skip": {"skip_allowed_first": True},
                                       "skip_warps": {"skip_allowed_first": True, "_K_REFILL_ALL_WARPS": True}}))
    assert both == {"off": {"skip_allowed_first": False, (R, "_K_REFILL_ALL_WARPS"): False},
                    "skip": {"skip_allowed_first": True, (R, "_K_REFILL_ALL_WARPS"): False},
                    "skip_warps": {"skip_allowed_first": True, (R, "_K_REFILL_ALL_WARPS"): True}}
    assert config_field("nan_safe_v") and config_field("skip_allowed_first")
    for bad in ("k_refill", "tile_n", "split_merge", "SKIP_ALLOWED_FIRST", "_SKIP_ALLOWED_FIRST",
                "FlashAttentionForwardSm90Mixed._SKIP_ALLOWED_FIRST"):
        assert not config_field(bad)
        with pytest.raises(ValueError, match="switch"):
            switch_settings(bad)


def test_ab_switch_settings_take_nan_safe_v_method_as_scan_against_recompute():
    """``nan_safe_v_method`` (a field of named values, docs/tuning.md 2.34) is a switch whose off / on rows are
    ``"scan"`` / ``"recompute"``, alone or in a JSON object (its off value ``"scan"``, not False)."""
    from blockdiff.bench.experiments.ab_roles_switch import config_field, switch_settings
    assert config_field("nan_safe_v_method")
    assert switch_settings("nan_safe_v_method") == {"off": {"nan_safe_v_method": "scan"},
                                                    "on": {"nan_safe_v_method": "recompute"}}
    got = switch_settings(json.dumps({"rc": {"nan_safe_v_method": "recompute"},
                                      "rc_skip": {"nan_safe_v_method": "recompute", "skip_allowed_first": True}}))
    assert got == {"off": {"nan_safe_v_method": "scan", "skip_allowed_first": False},
                   "rc": {"nan_safe_v_method": "recompute", "skip_allowed_first": False},
                   "rc_skip": {"nan_safe_v_method": "recompute", "skip_allowed_first": True}}


def test_ab_rows_put_config_fields_into_the_config_and_set_class_switches(monkeypatch):
    """``_row`` (CPU, the call replaced): a setting's config fields join the variant's config, its class switches are
    set on their class before the call, and each row compiles into a cache of its own."""
    from types import SimpleNamespace

    import torch

    from blockdiff.bench.experiments import ab_roles_switch as ab
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    calls = []
    monkeypatch.setattr(ab, "attention_cute", lambda q, k, v, out, check_values, config, **a: calls.append(
        (config, R._K_REFILL_ALL_WARPS, id(ab.cute_interface._COMPILE_CACHE))))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: None)
    monkeypatch.setattr(ab.cute_interface, "_COMPILE_CACHE", {})
    monkeypatch.setattr(R, "_K_REFILL_ALL_WARPS", False)
    b = SimpleNamespace(q=SimpleNamespace(shape=(4,), dtype=None), layouts=lambda: {"paged": (None, None, {})})
    w = SimpleNamespace(num_heads=1, head_dim_v=8)
    cfg = {"nan_safe_v": True}
    ab._row(b, w, cfg, {"skip_allowed_first": True, (R, "_K_REFILL_ALL_WARPS"): True})()
    ab._row(b, w, cfg, {"skip_allowed_first": False})()
    assert calls[0][:2] == ({"nan_safe_v": True, "skip_allowed_first": True}, True)
    assert calls[1][0] == {"nan_safe_v": True, "skip_allowed_first": False} and calls[0][2] != calls[1][2]
    assert cfg == {"nan_safe_v": True}  # the variant's own dict is not changed


def test_ab_rows_report_what_they_launched(monkeypatch):
    """``launch_info``: the kernel class, the resolved ``nan_safe_v`` / ``nan_safe_v_method`` of the row's last call
    (``interface.LAST_LAUNCH``) and its class switches by name, so the log shows e.g. that a recompute switch's rows
    ran the recompute (docs/tuning.md 2.37)."""
    from blockdiff.attention.cute import config as cc
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as Mixed
    from blockdiff.bench.experiments import ab_roles_switch as ab
    cfg = cc.CuteConfig(nan_safe_v=True, nan_safe_v_method="recompute")
    monkeypatch.setattr(ab.cute_interface, "LAST_LAUNCH", dict(kernel="FlashAttentionForwardSm90Mixed", config=cfg))
    got = ab.launch_info({(Mixed, "_NR_TRIVIAL_COLD_PATH"): True, "skip_allowed_first": False})
    assert got == dict(kernel="FlashAttentionForwardSm90Mixed", nan_safe_v=True, nan_safe_v_method="recompute",
                       switches={"FlashAttentionForwardSm90Mixed._NR_TRIVIAL_COLD_PATH": True})
    json.dumps(got)  # recorded in the A/B's JSON
