"""The roles kernel's switches as one kind (``config._ROLES_ONLY``: ``v_refill``, ``qk_issue``, ``k_refill``), CPU only:
each is validated by name (ValueError for a wrong string, TypeError for another type), its roles-only value is
refused with ``wide_design="split_v"`` naming the plain value, each is moot below head dim 257 (FA4's kernel: one compile key whatever it says) and part of the compile key of the
roles kernel and of its split-KV subclass, where ``"auto"`` compiles the key of the value it resolves to; a
refusal's suggested fixes resolve when applied. A switch
added to ``_ROLES_ONLY`` is covered here without a new test (its own file keeps what only it does)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from blockdiff.attention.cute import config as cc

from test_cute_kernel_roles import _fake_run

ROLES = dict(wide_design="roles")
SWITCHES = [pytest.param(field, roles_value, plain, id=field) for field, roles_value, plain in cc._ROLES_ONLY]
CHOICES = {"v_refill": cc.V_REFILLS, "qk_issue": cc.QK_ISSUES, "k_refill": cc.K_REFILLS}


def test_every_roles_switch_has_its_choices_here():
    assert {field for field, _, _ in cc._ROLES_ONLY} == set(CHOICES)


@pytest.mark.parametrize("field,roles_value,plain", SWITCHES)
def test_roles_switch_is_moot_below_head_dim_257(monkeypatch, field, roles_value, plain):
    """FA4's kernel runs below head dim 257: the switch resolves to its plain value and every value (with or
    without wide_design "roles", at any page size) gives the default's config, so one compile key."""
    monkeypatch.setattr(cc, "_fa4_tile_size", lambda *a: SimpleNamespace(
        m_block_size=128, n_block_size=128, mma_pv_is_rs=True, intra_wg_overlap=True))
    base = cc.resolve_config(128, 128, None, None, 256)
    assert getattr(base, field) == plain
    for value in CHOICES[field]:
        for config in (dict(**{field: value}), dict(ROLES, **{field: value})):
            for page in (None, 48, 64):
                assert cc.resolve_config(128, 128, None, config, 256, page_size=page) == \
                    cc.resolve_config(128, 128, None, None, 256, page_size=page), (config, page)


@pytest.mark.parametrize("field,roles_value,plain", SWITCHES)
def test_roles_switch_is_part_of_the_compile_key(monkeypatch, field, roles_value, plain):
    keys_r, names = _fake_run(monkeypatch, dict(ROLES, **{field: roles_value}))
    keys_p, _ = _fake_run(monkeypatch, dict(ROLES, **{field: plain}))
    assert names == ["blockdiff:cute_compile FlashAttentionForwardSm90Roles 64x64 s1"]
    assert (getattr(keys_r[0][5], field), getattr(keys_p[0][5], field)) == (roles_value, plain)
    assert keys_r[0] != keys_p[0]
    # "auto" (page 64, hd 512): the key of the value it resolves to
    auto = getattr(cc.resolve_config(512, 512, None, ROLES, 256, page_size=64), field)
    keys_a, _ = _fake_run(monkeypatch, ROLES)
    assert keys_a[0] == {roles_value: keys_r[0], plain: keys_p[0]}[auto]
    # split-KV: the roles split kernel inherits the switch
    keys_s, names_s = _fake_run(monkeypatch, dict(ROLES, num_splits=2, **{field: roles_value}))
    assert names_s == ["blockdiff:cute_compile FlashAttentionForwardSm90RolesSplit 64x64 s2"]
    assert getattr(keys_s[0][5], field) == roles_value


def _bad_values(field, roles_value):
    """Strings the switch must refuse by name (a near miss, an empty string, the other switches' values) and values
    of other types."""
    others = {v for choices in CHOICES.values() for v in choices} - set(CHOICES[field])
    strings = [roles_value.capitalize(), roles_value[:-1], roles_value.replace("_", "-") + "x", "", *sorted(others)]
    return [(s, ValueError) for s in strings] + [(v, TypeError) for v in (2, 1.5, None, True)]


@pytest.mark.parametrize("field,roles_value,plain", SWITCHES)
def test_roles_switch_is_validated_by_name(field, roles_value, plain):
    for value, err in _bad_values(field, roles_value):
        with pytest.raises(err, match=field):
            cc.check_config(dict(ROLES, **{field: value}))
        with pytest.raises(err, match=field):
            cc.resolve_config(512, 512, None, dict(ROLES, **{field: value}), 256)


@pytest.mark.parametrize("field,roles_value,plain", SWITCHES)
def test_roles_switch_needs_the_roles_kernel(field, roles_value, plain):
    """The roles-only value with wide_design "split_v" is refused by name, naming the plain value that runs; the
    plain value runs there and is what "auto" resolves to."""
    for config in (dict(wide_design="split_v", **{field: roles_value}),
                   cc.CuteConfig(wide_design="split_v", **{field: roles_value})):
        with pytest.raises(ValueError, match=f"{field} '{roles_value}' is built for the roles kernel only.*'{plain}'"):
            cc.check_config(config)
        with pytest.raises(ValueError, match=f"{field} '{roles_value}' is built for the roles kernel only"):
            cc.resolve_config(512, 512, None, config, 256)
    cc.check_config(dict(wide_design="split_v", **{field: plain}))
    assert getattr(cc.resolve_config(512, 512, None, dict(wide_design="split_v"), 256), field) == plain


# (config, page or None, why): where wide_design "auto" resolves to the split-value kernel, each roles-only value
# set explicitly (the first field of the config) is refused naming the reason, at resolve and at launch
AUTO_REFUSALS = [
    pytest.param(dict(qk_issue="ahead"), 48, "page size 48", id="qk_page48"),
    pytest.param(dict(qk_issue="ahead", tile_n=64), None, "tile_n", id="qk_tile_n"),
    pytest.param(dict(qk_issue="ahead", split_merge="cluster"), None, "cluster", id="qk_cluster"),
    pytest.param(dict(qk_issue="ahead", v_refill="halves"), 12, "page size 12", id="qk_v_page12"),
    pytest.param(dict(k_refill="halves"), 48, "page size 48", id="k_page48"),
    pytest.param(dict(k_refill="halves", tile_n=64), None, "tile_n", id="k_tile_n"),
    pytest.param(dict(k_refill="halves", split_merge="cluster"), None, "cluster", id="k_cluster"),
    pytest.param(dict(k_refill="halves", qk_issue="ahead"), 12, "page size 12", id="k_qk_page12"),
]


@pytest.mark.parametrize("config,page,why", AUTO_REFUSALS)
def test_auto_with_a_roles_only_value_is_a_value_error_naming_why_auto_did_not_pick_roles(config, page, why):
    """Never silently dropped (as v_refill's "halves", whose refusal names its own rule: test_cute_v_refill.py)."""
    field, value = next(iter(config.items()))
    with pytest.raises(ValueError, match=f"{field} '{value}'.*the roles kernel.*'auto'.*{why}"):
        cc.resolve_config(512, 512, None, config, 256, page_size=page)
    kw = dict(total_q=256, num_seqs=2, num_kv_heads=2, qhead_per_kvhead=8, keys_capacity=8192, max_seqlen_q=256,
              max_seqlen_k=None, num_sms=132, page_size=page)
    with pytest.raises(ValueError, match=f"{field} '{value}'"):
        cc.resolve_launch_config(512, 512, None, config, **kw)


# (head dim, page or None, config): refusals of roles-only values whose suggested fixes must resolve when applied
# (reviews of 2.20's qk_issue and 2.22's k_refill changes)
REFUSALS = [
    pytest.param(384, 12, dict(qk_issue="ahead"), id="qk_page12"),  # roles cannot load 12-token pages: not offered
    pytest.param(384, None, dict(qk_issue="ahead", split_merge="cluster"), id="qk_cluster"),  # no roles cluster merge
    pytest.param(512, 16, dict(qk_issue="ahead", v_refill="halves", tile_n=32, num_stages=2),
                 id="qk_v_tiles32"),  # 16 divides 32: roles runs
    pytest.param(384, 64, dict(qk_issue="ahead"), id="qk_page64_384"),
    pytest.param(288, None, dict(qk_issue="ahead", v_refill="halves"), id="qk_v_288"),  # both plain values needed
    pytest.param(512, 48, dict(k_refill="halves"), id="k_page48"),  # roles cannot load 48-token pages: not offered
    pytest.param(384, None, dict(k_refill="halves"), id="k_384"),  # roles runs at 384 (halves allowed): offered
    pytest.param(288, None, dict(k_refill="halves"), id="k_288"),  # halves impossible at 288: only the plain value
    pytest.param(288, None, dict(k_refill="halves", qk_issue="ahead"), id="k_qk_288"),
    pytest.param(512, None, dict(k_refill="halves", split_merge="cluster"), id="k_cluster"),
]


@pytest.mark.parametrize("hd,page,config", REFUSALS)
def test_roles_switch_refusals_suggest_only_fixes_that_resolve(hd, page, config):
    """The refusal names the plain value of every roles-only field set (which always resolves) and offers "set
    wide_design 'roles'" exactly where the roles kernel would run with the given values."""
    with pytest.raises(ValueError) as e:
        cc.resolve_config(hd, hd, None, config, 256, page_size=page)
    msg = str(e.value)
    plain = dict(config, **{name: p for name, value, p in cc._ROLES_ONLY if config.get(name) == value})
    assert " and ".join(f"{n} {plain[n]!r}" for n, v, _ in cc._ROLES_ONLY if config.get(n) == v) in msg, msg
    cc.resolve_config(hd, hd, None, plain, 256, page_size=page)  # the plain values always resolve
    roles = dict(config, wide_design="roles")
    if "set wide_design 'roles'" in msg:  # offered only where the roles kernel runs with the given values
        r = cc.resolve_config(hd, hd, None, roles, 256, page_size=page)
        assert page is None or cc.kv_load_path(page, r.tile_n) in ("tma", "tma_boxes")
    else:
        try:
            r = cc.resolve_config(hd, hd, None, roles, 256, page_size=page)
            bad = page is not None and cc.kv_load_path(page, r.tile_n) not in ("tma", "tma_boxes")
        except ValueError:
            bad = True
        assert bad, f"'roles' would have worked here but was not offered: {msg}"
