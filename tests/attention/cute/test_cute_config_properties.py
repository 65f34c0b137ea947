"""Adversarial checks of the cute config resolution (CPU only, no flash-attn-4 needed).

What these tests pin down:

- a dict field set to None (the documented way to say "unset": ``check_config``, "0 is not unset: use None")
  resolves as a missing key, so ``{"tile_n": None}`` and ``CuteConfig(tile_n=None)`` resolve the same (regression
  tests: before the fix, at head dims above 256 a None tile field in a dict raised a bare arithmetic TypeError
  from the stage count, gave the roles kernel the split-value kernel's 32-key tiles, or turned
  ``wide_design="auto"`` to the split-value kernel);
- properties that hold: a CuteConfig resolves as the dict of its fields that differ from ``CuteConfig()``,
  resolution is idempotent (a resolved config resolves to itself, the launch config too), what resolves fits SM90
  shared memory, ``auto_wide_design`` agrees with what ``resolve_config`` picks, an automatic roles pick loads its
  pages by TMA boxes, and every refusal is a ValueError / TypeError naming the field or argument.
"""
from collections import namedtuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockdiff.attention.cute.config as cc

WIDE_HDS = (288, 384, 512)
PAGES = (None, 8, 12, 16, 24, 48, 64, 96, 128, 192, 256)


# ------------------------------------------------------------------ failing regressions: None-valued dict fields
@pytest.mark.parametrize("hd", [384, 512])
@pytest.mark.parametrize("field", ["tile_m", "tile_n"])
def test_a_dict_tile_field_set_to_none_resolves_as_unset_at_wide_head_dims(hd, field):
    """``resolve_config(hd, hd, None, {"tile_n": None})`` raised ``TypeError: unsupported operand type(s) for *:
    'int' and 'NoneType'`` (``_resolve_wide``'s stage count multiplies the merged dict's None tile field,
    config.py:517-521), while ``CuteConfig(tile_n=None)`` resolved; None is documented as "unset"."""
    for max_q in (256, None):
        want = cc.resolve_config(hd, hd, None, cc.CuteConfig(**{field: None}), max_q, page_size=64)
        assert want == cc.resolve_config(hd, hd, None, None, max_q, page_size=64)
        assert cc.resolve_config(hd, hd, None, {field: None}, max_q, page_size=64) == want
        assert cc.resolve_wide_config(hd, hd, {field: None}, max_q) == cc.resolve_wide_config(hd, hd, None, max_q)


def test_explicit_roles_with_a_none_tile_n_keeps_the_roles_tile_n():
    """``{"wide_design": "roles", "tile_n": None, "num_stages": 1}`` resolved to tile_n 32 (the split-value
    kernel's WIDE_CONFIG fallback, config.py:525, after the dict's None overrode ROLES_CONFIG's 64): the roles
    kernel in 32-key tiles, the case the change fixed for CuteConfig objects. The CuteConfig gives 64."""
    d = dict(wide_design="roles", tile_n=None, num_stages=1)
    obj = cc.resolve_config(512, 512, None, cc.CuteConfig(**d), 256)
    assert (obj.wide_design, obj.tile_n, obj.num_stages) == ("roles", 64, 1)
    assert cc.resolve_config(512, 512, None, d, 256) == obj


@pytest.mark.parametrize("field", ["tile_m", "tile_n", "mma_pv_is_rs", "intra_wg_overlap"])
def test_auto_wide_design_reads_a_none_dict_field_as_unset(field):
    """``auto_wide_design(512, 512, {"mma_pv_is_rs": None})`` was "split_v" (``_roles_blocker`` lists the dict's
    keys, config.py:296, so a None value counts as a set tile field) while ``CuteConfig(mma_pv_is_rs=None)`` (==
    ``CuteConfig()``) gives "roles"."""
    assert cc.auto_wide_design(512, 512, cc.CuteConfig(**{field: None}), page_size=64) == "roles"
    assert cc.auto_wide_design(512, 512, {field: None}, page_size=64) == "roles"


@pytest.mark.parametrize("field", ["lpt", "num_splits", "mma_pv_is_rs"])
def test_split_v_default_tiles_do_not_change_with_a_none_dict_field(field):
    """At head dim 384 (split-value kernel) with a long / unknown query hint, ``{"num_splits": None}`` resolved to
    WIDE_CONFIG's 32 x 2 tiles while ``CuteConfig(num_splits=None)`` and None take WIDE_LONG_Q_CONFIG's 64 x 1
    (``_split_switches`` keeps a dict of only None values as a config, config.py:370-371)."""
    want = cc.resolve_config(384, 384, None, None, None)
    assert (want.tile_n, want.num_stages) == (64, 1)
    assert cc.resolve_config(384, 384, None, cc.CuteConfig(**{field: None}), None) == want
    assert cc.resolve_config(384, 384, None, {field: None}, None) == want


_T = namedtuple("_T", "m_block_size n_block_size mma_pv_is_rs intra_wg_overlap")


def test_hd128_tuned_stages_do_not_change_with_a_none_dict_field(monkeypatch):
    """Below head dim 257 too: ``{"tile_m": None}`` at hd 128 got 2 K/V stages (``CuteConfig(**dict)``, FA4's
    heuristic) while ``CuteConfig(tile_m=None)`` (== ``CuteConfig()``: no config) gets HD128_CONFIG's 3. FA4's
    heuristic is stubbed (CPU, no flash-attn-4)."""
    monkeypatch.setattr(cc, "_fa4_tile_size", lambda hd, hdv, local: _T(128, 128, True, True))
    want = cc.resolve_config(128, 128, None, cc.CuteConfig(tile_m=None), 256)
    assert want.num_stages == cc.HD128_CONFIG["num_stages"]
    assert cc.resolve_config(128, 128, None, {"tile_m": None}, 256) == want


# ------------------------------------------------------------------------------------- properties that hold
# Dict fields without None tile values (None tile fields in a dict: the failing tests above).
_FIELDS = dict(
    tile_m=st.sampled_from([64, 128]),
    tile_n=st.sampled_from([16, 32, 40, 48, 64, 128]),
    mma_pv_is_rs=st.sampled_from([None, False, True]),
    intra_wg_overlap=st.sampled_from([None, True, False]),
    num_stages=st.integers(1, 3),
    lpt=st.sampled_from([None, True, False]),
    num_splits=st.sampled_from([None, 1, 2, 3, 8, 9, 16]),
    nan_safe_v=st.booleans(),
    split_merge=st.sampled_from(cc.SPLIT_MERGES),
    wide_design=st.sampled_from(cc.WIDE_DESIGNS),
    batch_order=st.sampled_from(cc.BATCH_ORDERS),
    v_refill=st.sampled_from(cc.V_REFILLS),
    qk_issue=st.sampled_from(cc.QK_ISSUES),
    k_refill=st.sampled_from(cc.K_REFILLS),
    skip_allowed_first=st.sampled_from(cc.SKIP_ALLOWED_FIRST_VALUES),
    nan_safe_v_method=st.sampled_from(cc.NAN_SAFE_V_METHODS),
    exact_weight=st.sampled_from(cc.EXACT_WEIGHTS),
)
_FIELDS_WITH_NONE = dict(_FIELDS, tile_m=st.sampled_from([None, 64, 128]),
                         tile_n=st.sampled_from([None, 16, 32, 48, 64, 128]))


def _res(f, *args, **kwargs):
    try:
        return "ok", f(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)


def _launch(hd, config, page, max_q, num_seqs):
    return _res(cc.resolve_launch_config, hd, hd, None, config, total_q=256, num_seqs=num_seqs, num_kv_heads=2,
                qhead_per_kvhead=4, keys_capacity=40000, max_seqlen_q=max_q or 256, max_seqlen_k=None, num_sms=132,
                page_size=page)


_NAMES = cc._CONFIG_FIELDS + ("head_dim", "page_size", "shared memory")


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(d=st.fixed_dictionaries({}, optional=_FIELDS_WITH_NONE), hd=st.sampled_from(WIDE_HDS),
       page=st.sampled_from(PAGES), max_q=st.sampled_from([None, 256, 4096]), num_seqs=st.sampled_from([1, 3]))
def test_a_cute_config_resolves_as_the_dict_of_its_non_default_fields(d, hd, page, max_q, num_seqs):
    """The documented rule of the change: a CuteConfig resolves as the dict of its fields that differ from
    ``CuteConfig()`` (resolve_config, resolve_launch_config, auto_wide_design), refusals of the same type."""
    obj = cc.CuteConfig(**d)
    nd = {k: v for k, v in d.items() if v != getattr(cc.CuteConfig(), k)}
    a = _res(cc.resolve_config, hd, hd, None, obj, max_q, page_size=page)
    b = _res(cc.resolve_config, hd, hd, None, nd, max_q, page_size=page)
    assert (a if a[0] == "ok" else a[0]) == (b if b[0] == "ok" else b[0]), (d, a, b)
    la, lb = _launch(hd, obj, page, max_q, num_seqs), _launch(hd, nd, page, max_q, num_seqs)
    assert (la if la[0] == "ok" else la[0]) == (lb if lb[0] == "ok" else lb[0]), (d, la, lb)
    wa = _res(cc.auto_wide_design, hd, hd, obj, page_size=page)
    assert wa == _res(cc.auto_wide_design, hd, hd, nd, page_size=page)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(d=st.fixed_dictionaries({}, optional=_FIELDS), hd=st.sampled_from(WIDE_HDS), page=st.sampled_from(PAGES),
       max_q=st.sampled_from([None, 256, 4096]), num_seqs=st.sampled_from([1, 3]))
def test_wide_resolution_is_idempotent_fits_and_refuses_with_named_errors(d, hd, page, max_q, num_seqs):
    r = _res(cc.resolve_config, hd, hd, None, d, max_q, page_size=page)
    if r[0] != "ok":
        assert r[0] == "ValueError", (d, r)  # every field is of its type here: only range / rule violations
        assert any(n in r[1] for n in _NAMES), r
        return
    cfg = r[1]
    assert cfg.wide_design in ("split_v", "roles") and cfg.batch_order in ("given", "work")
    assert cc.config_smem_bytes(cfg, hd, hd) <= cc.SMEM_LIMIT_BYTES
    assert cc.resolve_config(hd, hd, None, cfg, max_q, page_size=page) == cfg  # idempotent
    assert cc.resolve_wide_config(hd, hd, d, max_q, page_size=page) == cfg
    if d.get("wide_design", "auto") == "auto":
        assert cc.auto_wide_design(hd, hd, d, page_size=page) == cfg.wide_design
        if cfg.wide_design == "roles":  # the automatic pick loads its pages by TMA boxes, 64 x 64 in one stage
            assert (cfg.tile_m, cfg.tile_n, cfg.num_stages) == (64, 64, 1) and hd == 512
            assert cc.kv_load_path(page, cfg.tile_n) in ("tma", "tma_boxes")
    if d.get("v_refill") == "halves":
        assert cfg.wide_design == "roles" and cfg.v_refill == "halves" and hd % 128 == 0
    if d.get("qk_issue") == "ahead":
        assert cfg.wide_design == "roles" and cfg.qk_issue == "ahead"
    if d.get("k_refill") == "halves":
        assert cfg.wide_design == "roles" and cfg.k_refill == "halves" and hd % 128 == 0
    k_auto = d.get("k_refill", "auto") == "auto"  # "auto": halves on the roles kernel at head dims divisible by 128
    assert cfg.k_refill == ("halves" if d.get("k_refill") == "halves"
                            or (k_auto and cfg.wide_design == "roles" and hd % 128 == 0) else "whole")
    # the roles kernel's switches resolve ("auto": halves at value head dims divisible by 128, ahead with halves)
    assert cfg.v_refill in ("one_warp", "halves") and cfg.qk_issue in ("serial", "ahead")
    if d.get("v_refill", "auto") == "auto":
        assert cfg.v_refill == ("halves" if cfg.wide_design == "roles" and hd % 128 == 0 else "one_warp")
    if d.get("qk_issue", "auto") == "auto":
        pages_ok = page is None or page >= cc.QK_AHEAD_MIN_PAGE
        assert cfg.qk_issue == ("ahead" if cfg.v_refill == "halves" and pages_ok else "serial")
    if cfg.wide_design == "split_v":
        assert (cfg.v_refill, cfg.qk_issue, cfg.k_refill) == ("one_warp", "serial", "whole")
    for k in ("num_splits", "lpt"):  # given values pass through
        if d.get(k) is not None:
            assert getattr(cfg, k) == d[k]
    launch = _launch(hd, d, page, max_q, num_seqs)
    if launch[0] != "ok":
        assert launch[0] == "ValueError" and "cluster" in launch[1], launch
        return
    lc = launch[1]
    assert lc.split_merge in ("combine", "cluster", "triton") and 1 <= lc.num_splits <= cc.MAX_SPLITS
    assert not (lc.wide_design == "roles" and lc.split_merge == "cluster")
    assert lc.split_merge != "cluster" or 2 <= lc.num_splits <= cc.MAX_CLUSTER_SPLITS
    assert lc.split_merge != "triton" or lc.num_splits >= 2  # by name, or "auto" where the cluster does not act
    assert lc.split_merge != "combine" or lc.num_splits == 1 or d.get("split_merge") == "combine"  # by name only
    assert lc.skip_allowed_first is False  # FA4's consumer's switch: resolves off in the wide kernels
    assert lc.nan_safe_v_method == "scan"  # likewise: the wide kernels keep their own clean-up
    assert cfg.skip_allowed_first == d.get("skip_allowed_first", "auto")  # resolve_config leaves it as given
    assert _launch(hd, lc, page, max_q, num_seqs) == launch  # idempotent


@pytest.mark.parametrize("page", [p for p in PAGES if p is not None] + [1, 4, 40, 320, 512])
def test_auto_roles_at_512_follows_page_box_tma_ok(page):
    """hd 512, switches / num_splits / lpt only: roles iff the page loads by TMA boxes at tile_n 64."""
    for config in (None, dict(num_splits=2), dict(lpt=True, batch_order="given")):
        cfg = cc.resolve_config(512, 512, None, config, 256, page_size=page)
        assert cfg.wide_design == ("roles" if cc.page_box_tma_ok(page, 64) else "split_v"), (page, config)


@pytest.mark.parametrize("bad,err", [(0, ValueError), (17, ValueError), (-1, ValueError), (True, TypeError),
                                     (2.0, TypeError), ("2", TypeError)])
def test_num_splits_out_of_range_is_refused_by_name_with_roles_auto(bad, err):
    for config in (dict(num_splits=bad), dict(num_splits=bad, v_refill="halves")):
        with pytest.raises(err, match="num_splits"):
            cc.resolve_config(512, 512, None, config, 256, page_size=64)
        with pytest.raises(err, match="num_splits"):
            cc.auto_wide_design(512, 512, config)


@pytest.mark.parametrize("bad", [0, 1, "yes", 1.0])
def test_lpt_non_bool_is_a_type_error_naming_lpt(bad):
    for hd in (512, 384):
        with pytest.raises(TypeError, match="lpt"):
            cc.resolve_config(hd, hd, None, dict(lpt=bad), 256)
    with pytest.raises(TypeError, match="lpt"):
        cc.auto_wide_design(512, 512, dict(lpt=bad))


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(d=st.fixed_dictionaries({}, optional=_FIELDS), hd=st.sampled_from([64, 128, 256, 384, 512]),
       page=st.sampled_from(PAGES), num_seqs=st.sampled_from([1, 3]))
def test_nan_safe_v_method_resolves_to_recompute_only_where_it_acts(monkeypatch, d, hd, page, num_seqs):
    """docs/tuning.md 2.34, 2.35: a launch resolves ``nan_safe_v_method`` to ``"recompute"`` iff it was asked for
    (by name, or by ``"auto"`` at hd 256), NaN-safe V is on and FA4's consumer runs (hd <= 256); then
    ``skip_allowed_first`` is False (no scan to skip)."""
    monkeypatch.setattr(cc, "_fa4_tile_size", lambda hd, hdv, local: _T(128, 64, True, True))
    launch = _launch(hd, d, page, 256, num_seqs)
    if launch[0] != "ok":
        return
    lc = launch[1]
    method = d.get("nan_safe_v_method", "auto")  # "auto": the recompute at hd 256 (docs/tuning.md 2.35)
    asked = method == "recompute" or (method == "auto" and hd in cc.AUTO_RECOMPUTE_HEAD_DIMS)
    want = asked and d.get("nan_safe_v", True) and hd <= 256
    assert lc.nan_safe_v_method == ("recompute" if want else "scan"), (d, hd, lc)
    if want:
        assert lc.skip_allowed_first is False
