"""The cute backend's roles kernel (blockdiff.attention.cute.kernel_roles; ``CuteConfig.wide_design="roles"``, head
dims above 256: a softmax warpgroup that also loads Q / K feeding two P V warpgroups through shared memory).

* CPU (CI, no flash-attn-4): the ``wide_design`` field's validation, its tiles and shared-memory budget, the
  ``"auto"`` rule (the default: roles at hd 512 with the automatic tiles where its TMA page boxes load the pages,
  with ``batch_order`` "auto" resolving to the work order) and the dispatch (kernel class, compile key, profiler
  range name, the permutation aux tensor) with ``_compile`` monkeypatched;
* compile-only for sm_90a without a GPU (where flash-attn-4 and nvidia-cutlass-dsl are installed, skipped in CI):
  contiguous and paged (pages of 64, 16, 8: 1, 4, 8 TMA boxes per stage) K/V, both window modes, LSE, no spills;
* GPU (``python3 -m pytest -m gpu``, on the H200): the split-value kernel's tests (test_cute_kernel_wide.py) for
  ``wide_design="roles"``: a hypothesis fuzz against the fp64 reference (page sizes 8/16/64/256 and contiguous;
  48 is refused with NotImplementedError: no TMA page box), window modes, GQA, keys outside the allowed range
  never loaded, split-KV, CUDA-graph replay with the metadata changed in place.
"""
from __future__ import annotations

import re
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiff.attention.cute import compile_check as cchk
from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca

from cute_helpers import (HAVE_FA4, compile_for_sm90_or_skip, gpu_batch, graph_replay_check, needs_gpu,
                          rows_past_seq_lens_check, run_and_check)

H, HKV, D = 16, 2, 512
ROLES = dict(wide_design="roles")


# --- CPU: config ----------------------------------------------------------------------------------------------
def test_wide_design_defaults_to_auto_and_resolves_the_roles_tiles():
    assert cc.CuteConfig().wide_design == "auto" and cc.WIDE_DESIGNS == ("auto", "split_v", "roles")
    r = cc.resolve_config(512, 512, None, ROLES, 256)
    assert (r.tile_m, r.tile_n, r.num_stages, r.wide_design, r.batch_order) == (64, 64, 1, "roles", "work")
    assert cc.resolve_config(512, 512, None, None, 256) == r  # "auto" at hd 512: the roles kernel, its tiles
    assert cc.resolve_config(512, 512, None, ROLES, 8192) == r.__class__(**{**r.__dict__, "lpt": True})
    # a dict override keeps the roles base; num_stages: the most that fit (two at 32-key tiles)
    r32 = cc.resolve_config(512, 512, 1023, dict(ROLES, tile_n=32), 256)
    assert (r32.tile_n, r32.num_stages, r32.wide_design) == (32, 2, "roles")
    # the CuteConfig form: only the switch set, the automatic roles tiles
    assert cc.resolve_config(512, 512, None, cc.CuteConfig(wide_design="roles"), 256) == r
    # the split-value kernel stays one explicit switch away
    v = cc.resolve_config(512, 512, None, dict(wide_design="split_v"), 256)
    assert (v.tile_n, v.num_stages, v.wide_design, v.batch_order) == (32, 2, "split_v", "given")


# --- CPU: wide_design "auto" (docs/tuning.md 2.17: the roles kernel measured faster at hd 512) --------------------
@pytest.mark.parametrize("page", [None, 64, 16, 8, 128, 256])
def test_auto_picks_roles_at_head_dim_512_where_its_tiles_load_the_pages(page):
    """Contiguous K/V (None) and pages that tile the 64-key stage by TMA boxes (8 / 16 / 64: 8 / 4 / 1 boxes; 128 /
    256: one box per stage of a larger page): the roles kernel with its automatic tiles and the work order."""
    for hint in (256, 8192):
        cfg = cc.resolve_config(512, 512, None, None, hint, page_size=page)
        assert (cfg.wide_design, cfg.batch_order, cfg.tile_n, cfg.num_stages) == ("roles", "work", 64, 1), cfg
        assert cfg == cc.resolve_config(512, 512, None, ROLES, hint, page_size=page)
        assert cc.kv_load_path(page, cfg.tile_n) == ("tma" if page is None else "tma_boxes")
    assert cc.resolve_wide_config(512, 512, None, 256, page_size=page).wide_design == "roles"
    assert cc.auto_wide_design(512, 512, page_size=page) == "roles"


@pytest.mark.parametrize("page", [48, 96, 12, 4, 1, 100])
def test_auto_picks_split_v_at_page_sizes_the_roles_boxes_cannot_load(page):
    """Pages that are no multiple of 8, or neither divide 64 nor are a multiple of it: the roles kernel has no
    cp.async path, so "auto" takes the split-value kernel (its automatic tiles, the given order) and never raises."""
    cfg = cc.resolve_config(512, 512, None, None, 256, page_size=page)
    assert cfg == cc.resolve_config(512, 512, None, dict(wide_design="split_v"), 256)
    assert (cfg.wide_design, cfg.batch_order) == ("split_v", "given")
    assert cc.resolve_wide_config(512, 512, None, 256, page_size=page).wide_design == "split_v"
    assert cc.auto_wide_design(512, 512, page_size=page) == "split_v"


@pytest.mark.parametrize("hd", [288, 320, 384, 448, 480])
def test_auto_picks_split_v_at_wide_head_dims_other_than_512(hd):
    """Only hd 512 was measured with the roles kernel: the other wide head dims keep the split-value kernel."""
    for page in (None, 64):
        cfg = cc.resolve_config(hd, hd, None, None, 256, page_size=page)
        assert (cfg.wide_design, cfg.batch_order) == ("split_v", "given")
        assert cfg == cc.resolve_config(hd, hd, None, dict(wide_design="split_v"), 256)
    assert cc.resolve_config(hd, hd, None, ROLES, 256).wide_design == "roles"  # explicit: as asked


@pytest.mark.parametrize("config", [dict(tile_n=64), dict(tile_n=32), dict(num_stages=1), dict(tile_m=64),
                                    dict(tile_n=64, lpt=True), dict(num_splits=2, tile_n=64),
                                    cc.CuteConfig(tile_n=64, num_stages=1), dict(tile_n=64, batch_order="work")])
def test_auto_picks_split_v_when_the_config_sets_a_tile_field(config):
    """The roles kernel is the automatic choice with its automatic tiles only (with 32-key tiles it was 35 % slower,
    docs/tuning.md 2.9): any tile field keeps the split-value kernel, which gets that field."""
    cfg = cc.resolve_config(512, 512, None, config, 256, page_size=64)
    assert cfg.wide_design == "split_v"
    explicit = dict(config) if isinstance(config, dict) else {f: getattr(config, f) for f in cc._CONFIG_FIELDS}
    assert cfg == cc.resolve_config(512, 512, None, dict(explicit, wide_design="split_v"), 256)
    assert cfg.batch_order == (config["batch_order"] if isinstance(config, dict) and "batch_order" in config
                               else "given")


@pytest.mark.parametrize("switches", [dict(nan_safe_v=False), dict(split_merge="combine"), dict(batch_order="given"),
                                      dict(batch_order="work"), dict(v_refill="halves"), dict(split_merge="auto")])
def test_auto_picks_roles_when_the_config_sets_switches_only(switches):
    cfg = cc.resolve_config(512, 512, None, switches, 256, page_size=64)
    assert cfg.wide_design == "roles"
    assert cfg.batch_order == switches.get("batch_order", "work")  # an explicit order is kept


@pytest.mark.parametrize("config", [dict(num_splits=2), dict(lpt=True), dict(lpt=False, num_splits=1),
                                    cc.CuteConfig(num_splits=3), cc.CuteConfig(lpt=True, batch_order="given"),
                                    dict(num_splits=4, v_refill="halves")])
def test_auto_keeps_roles_when_the_config_sets_only_num_splits_or_lpt(config):
    """``num_splits`` and ``lpt`` schedule the tiles without changing them: "auto" stays on the roles kernel with its
    automatic 64 x 64 one-stage tiles and takes the values as given, a dict and a CuteConfig alike."""
    cfg = cc.resolve_config(512, 512, None, config, 256, page_size=64)
    get = config.get if isinstance(config, dict) else lambda f, d=None: getattr(config, f)
    assert (cfg.wide_design, cfg.tile_m, cfg.tile_n, cfg.num_stages) == ("roles", 64, 64, 1)
    assert cfg.num_splits == get("num_splits", None)
    assert cfg.lpt == (get("lpt", None) if get("lpt", None) is not None else cc.longest_first_tiles(256))
    assert cfg.batch_order == (get("batch_order", "auto") if get("batch_order", "auto") != "auto" else "work")
    launch = cc.resolve_launch_config(512, 512, None, config, total_q=256, num_seqs=1, num_kv_heads=2,
                                      qhead_per_kvhead=8, keys_capacity=33024, max_seqlen_q=256, max_seqlen_k=None,
                                      num_sms=132, page_size=64)
    assert launch.wide_design == "roles" and launch.tile_n == 64
    assert launch.num_splits == (get("num_splits", None) or launch.num_splits)
    assert launch.split_merge == ("triton" if launch.num_splits > 1 else "combine")  # no cluster for roles


@pytest.mark.parametrize("fields", [dict(num_splits=2), dict(lpt=True), dict(num_splits=2, lpt=False),
                                    dict(tile_n=32), dict(tile_n=64, num_splits=3), dict(num_stages=1)])
@pytest.mark.parametrize("wide_design", ["roles", "split_v"])
def test_a_cute_config_object_resolves_as_the_dict_of_its_fields(fields, wide_design):
    """Regression: ``CuteConfig(wide_design="roles", num_splits=2)`` resolved to 32-key tiles in two stages (the
    split-value kernel's tile_n and the dataclass's num_stages default) while the same dict took the roles kernel's
    64 x 1; a CuteConfig's fields at their defaults are unset, as a dict's missing keys."""
    d = dict(fields, wide_design=wide_design)
    for max_q in (256, None):
        assert (cc.resolve_config(512, 512, None, cc.CuteConfig(**d), max_q, page_size=64)
                == cc.resolve_config(512, 512, None, d, max_q, page_size=64))
        assert (cc.resolve_wide_config(512, 512, cc.CuteConfig(**d), max_q)
                == cc.resolve_wide_config(512, 512, d, max_q))


def test_auto_picks_split_v_with_an_explicit_cluster_merge():
    """The cluster merge is not built for the roles kernel: an explicit "cluster" keeps the split-value kernel."""
    cfg = cc.resolve_config(512, 512, None, dict(split_merge="cluster"), 256, page_size=64)
    assert (cfg.wide_design, cfg.batch_order, cfg.split_merge) == ("split_v", "given", "cluster")
    launch = cc.resolve_launch_config(512, 512, None, dict(split_merge="cluster"), total_q=256, num_seqs=2,
                                      num_kv_heads=2, qhead_per_kvhead=8, keys_capacity=32768, max_seqlen_q=256,
                                      max_seqlen_k=None, num_sms=132, page_size=64)
    assert launch.wide_design == "split_v" and launch.batch_order == "given"


def test_auto_is_the_split_value_design_below_head_dim_257(monkeypatch):
    """FA4's kernel runs there: "auto" resolves to "split_v" and the given order (one compile key for all)."""
    from types import SimpleNamespace
    monkeypatch.setattr(cc, "_fa4_tile_size", lambda hd, hdv, local: SimpleNamespace(
        m_block_size=128, n_block_size=128 if hd <= 128 else 64, mma_pv_is_rs=True, intra_wg_overlap=True))
    for hd in (128, 256):
        for page in (None, 64, 48):
            cfg = cc.resolve_config(hd, hd, None, None, 256, page_size=page)
            assert (cfg.wide_design, cfg.batch_order, cfg.v_refill) == ("split_v", "given", "one_warp")
        assert cc.auto_wide_design(hd, hd, page_size=64) == "split_v"
    # an explicit work order is kept there (its cost on the hd-256 windowed kernel: docs/tuning.md 2.17)
    assert cc.resolve_config(256, 256, 1023, dict(batch_order="work"), 256).batch_order == "work"


@pytest.mark.parametrize("num_seqs,want", [(1, "given"), (2, "work"), (40, "work")])
def test_batch_order_auto_is_work_for_roles_with_two_or_more_sequences(num_seqs, want):
    for page in (None, 64, 16):
        cfg = cc.resolve_launch_config(512, 512, None, None, total_q=256 * num_seqs, num_seqs=num_seqs,
                                       num_kv_heads=2, qhead_per_kvhead=8, keys_capacity=8192, max_seqlen_q=256,
                                       max_seqlen_k=None, num_sms=132, page_size=page)
        assert (cfg.wide_design, cfg.batch_order) == ("roles", want)
        assert cfg.split_merge in ("combine", "cluster", "triton")
    # the split-value kernel (page 48, or asked for) keeps the given order whatever the batch
    for config, page in ((None, 48), (dict(wide_design="split_v"), 64)):
        cfg = cc.resolve_launch_config(512, 512, None, config, total_q=256 * num_seqs, num_seqs=num_seqs,
                                       num_kv_heads=2, qhead_per_kvhead=8, keys_capacity=8192, max_seqlen_q=256,
                                       max_seqlen_k=None, num_sms=132, page_size=page)
        assert (cfg.wide_design, cfg.batch_order) == ("split_v", "given")


@pytest.mark.parametrize("page_size,err", [(True, TypeError), (False, TypeError), (64.0, TypeError),
                                           ("64", TypeError), (0, ValueError), (-1, ValueError),
                                           (-64, ValueError)])
def test_bad_page_size_is_refused_by_name(page_size, err):
    kw = dict(total_q=256, num_seqs=2, num_kv_heads=2, qhead_per_kvhead=8, keys_capacity=8192, max_seqlen_q=256,
              max_seqlen_k=None, num_sms=132)
    for call in (lambda: cc.resolve_config(512, 512, None, None, 256, page_size=page_size),
                 lambda: cc.resolve_launch_config(512, 512, None, None, page_size=page_size, **kw),
                 lambda: cc.resolve_wide_config(512, 512, None, 256, page_size=page_size),
                 lambda: cc.auto_wide_design(512, 512, page_size=page_size)):
        with pytest.raises(err, match="page_size"):
            call()
    with pytest.raises(err, match="page_size"):  # checked below head dim 257 too, before FA4's import
        cc.resolve_config(128, 128, None, None, 256, page_size=page_size)


_SWITCH_VALUES = dict(nan_safe_v=st.booleans(), split_merge=st.sampled_from(cc.SPLIT_MERGES),
                      wide_design=st.sampled_from(cc.WIDE_DESIGNS), batch_order=st.sampled_from(cc.BATCH_ORDERS),
                      v_refill=st.sampled_from(cc.V_REFILLS))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(switches=st.fixed_dictionaries({}, optional=_SWITCH_VALUES),
       tiles=st.sampled_from([{}, dict(tile_n=64), dict(tile_n=32), dict(num_splits=2), dict(lpt=True),
                              dict(num_splits=2, tile_n=64)]),
       hd=st.sampled_from([384, 512]), page=st.sampled_from([None, 8, 16, 48, 64, 96, 128, 256]),
       num_seqs=st.sampled_from([1, 3]))
def test_the_resolved_config_never_holds_auto(switches, tiles, hd, page, num_seqs):
    """Over switch combinations: each resolution either raises a ValueError naming its rule or gives a config whose
    wide_design / batch_order are concrete, roles exactly where the rule says, the work order exactly for roles
    (with more than one sequence at launch)."""
    config = dict(switches, **tiles)
    kw = dict(total_q=256 * num_seqs, num_seqs=num_seqs, num_kv_heads=2, qhead_per_kvhead=8, keys_capacity=8192,
              max_seqlen_q=256, max_seqlen_k=None, num_sms=132, page_size=page)
    try:
        cfg = cc.resolve_config(hd, hd, None, config, 256, page_size=page)
        launch = cc.resolve_launch_config(hd, hd, None, config, **kw)
    except ValueError as e:
        assert re.search(r"cluster|v_refill|shared memory", str(e)), e
        return
    for c in (cfg, launch):
        assert c.wide_design in ("split_v", "roles") and c.batch_order in ("given", "work"), c
    assert launch.split_merge in ("combine", "cluster", "triton")
    design = switches.get("wide_design", "auto")
    roles_ok = (hd == 512 and not set(tiles) - {"num_splits", "lpt"} and switches.get("split_merge") != "cluster"
                and (page is None or cc.page_box_tma_ok(page, 64)))
    assert cfg.wide_design == (design if design != "auto" else "roles" if roles_ok else "split_v")
    order = switches.get("batch_order", "auto")
    assert cfg.batch_order == (order if order != "auto" else "work" if cfg.wide_design == "roles" else "given")
    assert launch.batch_order == ("given" if num_seqs == 1 else cfg.batch_order)


@pytest.mark.parametrize("value,err", [("roles ", ValueError), ("wide", ValueError), (1, TypeError),
                                       (None, TypeError), (True, TypeError)])
def test_wide_design_is_validated_by_name(value, err):
    with pytest.raises(err, match="wide_design"):
        cc.check_config(dict(wide_design=value))
    with pytest.raises(err, match="wide_design"):
        cc.resolve_config(512, 512, None, dict(wide_design=value), 256)


def test_roles_refuses_the_cluster_merge_and_takes_the_triton_merge():
    with pytest.raises(ValueError, match="cluster.*roles"):
        cc.check_config(dict(wide_design="roles", split_merge="cluster"))
    cfg = cc.resolve_launch_config(512, 512, None, ROLES, total_q=256, num_seqs=1, num_kv_heads=2,
                                   qhead_per_kvhead=8, keys_capacity=32768, max_seqlen_q=256, max_seqlen_k=None,
                                   num_sms=132)
    assert (cfg.wide_design, cfg.num_splits, cfg.split_merge) == ("roles", 2, "triton")


def test_wide_design_is_moot_below_head_dim_257(monkeypatch):
    """FA4's kernel runs either way: the design resolves to the default, so both share one compile key."""
    from types import SimpleNamespace
    monkeypatch.setattr(cc, "_fa4_tile_size", lambda *a: SimpleNamespace(
        m_block_size=128, n_block_size=128, mma_pv_is_rs=True, intra_wg_overlap=True))
    assert cc.resolve_config(128, 128, None, ROLES, 256) == cc.resolve_config(128, 128, None, None, 256)


def test_roles_shared_memory_budget():
    """kernel_roles.py's table: Q 64 KB + (K + V) stages + two P slots + 4 KB of factors + 1 KB."""
    roles = lambda **kw: cc.CuteConfig(tile_m=64, wide_design="roles", **kw)  # noqa: E731
    assert cc.config_smem_bytes(roles(tile_n=64, num_stages=1), 512, 512) == 218_112
    assert cc.config_smem_bytes(roles(tile_n=32, num_stages=2), 512, 512) == 209_920
    # one factor slot (1 KB) more than the split-value kernel's
    split_v = cc.CuteConfig(tile_m=64, tile_n=64, num_stages=1)
    assert cc.config_smem_bytes(roles(tile_n=64, num_stages=1), 512, 512) == cc.config_smem_bytes(
        split_v, 512, 512) + 1024
    for tile_n, stages in ((64, 2), (48, 2)):
        assert cc.config_smem_bytes(roles(tile_n=tile_n, num_stages=stages), 512, 512) > cc.SMEM_LIMIT_BYTES
        with pytest.raises(ValueError, match="shared memory"):
            cc.resolve_config(512, 512, None, dict(ROLES, tile_n=tile_n, num_stages=stages), 256)


# --- CPU: dispatch ---------------------------------------------------------------------------------------------
def _fake_run(monkeypatch, config, page=64, H_=16, Hkv=2, seqs=1, auxes=None):
    """``ca._run`` on CPU tensors with ``_compile`` replaced: returns (compile keys, profiler range names).
    ``seqs`` sequences share the 256 query rows (each over the same 512 keys); ``auxes`` (a list) collects the aux
    tensors of each compile."""
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    compiles = []
    monkeypatch.setattr(ca, "_compile", lambda fa, key, *a: compiles.append(key) or (
        auxes is not None and auxes.append(a[-1])) or (lambda *x: None))
    fa = {"maybe_contiguous": lambda t, align_bytes=None: t, "is_fake_mode": lambda: True,
          "combine": lambda *a, **k: (None, None)}  # split-KV: FA4's combine (not run here)
    q = torch.zeros(256, H_, 512, dtype=torch.bfloat16)
    pages = -(-512 // page)
    k = torch.zeros(pages, page, Hkv, 512, dtype=torch.bfloat16)
    cu = torch.tensor([256 * i // seqs for i in range(seqs + 1)], dtype=torch.int32)
    kw = dict(out=None, return_lse=False, cu_seqlens_q=cu, num_causal_q=torch.zeros(seqs, dtype=torch.int32),
              seq_lens=torch.full((seqs,), 512, dtype=torch.int32),
              block_table=torch.arange(pages, dtype=torch.int32)[None].repeat(seqs, 1), cu_seqlens_k=None,
              window_size=None, bidirectional_window="symmetric", scale=512 ** -0.5, arch=90, config=config,
              max_seqlen_q=256 // seqs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ca._run(fa, q, k, k, **kw)
    return compiles, [e.name for e in prof.events() if e.name.startswith("blockdiff:cute_compile")]


def test_roles_dispatch_kernel_name_and_compile_key(monkeypatch):
    keys, names = _fake_run(monkeypatch, ROLES)
    assert names == ["blockdiff:cute_compile FlashAttentionForwardSm90Roles 64x64 s1"]
    assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90Roles"
    assert ca.LAST_LAUNCH["kv_path"] == "tma_boxes"
    (key,) = keys
    cfg = key[5]
    assert cfg.wide_design == "roles"
    # the default ("auto") is the same kernel and compile key at hd 512 on 64-token pages
    keys_a, names_a = _fake_run(monkeypatch, None)
    assert keys_a == keys and names_a == names
    # the split-value kernel, asked for: another compile key
    keys_v, names_v = _fake_run(monkeypatch, dict(wide_design="split_v"))
    assert keys_v[0][5].wide_design == "split_v" and keys_v[0] != key
    assert names_v == ["blockdiff:cute_compile FlashAttentionForwardSm90WideV 64x32 s1"]
    assert ca._KERNEL_KEYS[ca.LAST_LAUNCH["kernel"]] == "KernelWide"


@pytest.mark.parametrize("page", [64, 16, 8, 128, 256])
def test_default_call_at_hd_512_dispatches_roles_with_the_permutation_appended(monkeypatch, page):
    """The default config on paged K/V its tiles load by TMA boxes, two sequences: the roles kernel, the work
    order, its permutation (int32, one entry a sequence) the last aux tensor, after the V cache of NaN-safe V."""
    auxes = []
    keys, names = _fake_run(monkeypatch, None, page=page, seqs=2, auxes=auxes)
    assert names == ["blockdiff:cute_compile FlashAttentionForwardSm90Roles 64x64 s1"]
    assert ca.LAST_LAUNCH["kv_path"] == "tma_boxes"
    cfg = keys[0][5]
    assert (cfg.wide_design, cfg.batch_order) == ("roles", "work") and ca.LAST_LAUNCH["config"] == cfg
    (aux,) = auxes
    given = []
    _fake_run(monkeypatch, dict(batch_order="given"), page=page, seqs=2, auxes=given)
    assert len(aux) == len(given[0]) + 1
    assert aux[-1].dtype == torch.int32 and tuple(aux[-1].shape) == (2,)
    assert aux[-2].shape[-1] == 512 and aux[-2].dim() == 4  # the V cache (NaN-safe V) stays before it
    # one sequence: nothing to order, no permutation
    one = []
    keys_1, _ = _fake_run(monkeypatch, None, page=page, seqs=1, auxes=one)
    assert keys_1[0][5].batch_order == "given" and len(one[0]) == len(given[0])


@pytest.mark.parametrize("page", [48, 96, 12])
def test_default_call_at_hd_512_on_pages_the_roles_boxes_cannot_load_runs_split_v(monkeypatch, page):
    """Page sizes the roles kernel's 64-key TMA boxes cannot load: the default call takes the split-value kernel
    (no NotImplementedError, which stays for an explicit "roles"), the given order, no permutation."""
    auxes = []
    keys, names = _fake_run(monkeypatch, None, page=page, seqs=2, auxes=auxes)
    assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90WideV"
    cfg = keys[0][5]
    assert (cfg.wide_design, cfg.batch_order) == ("split_v", "given")
    assert auxes[0][-1].dim() == 4  # the V cache last: no permutation
    with pytest.raises(NotImplementedError, match=f"roles.*page size {page}"):
        _fake_run(monkeypatch, ROLES, page=page, seqs=2)


def test_roles_page_boxes_of_any_count_and_split_kv_dispatch(monkeypatch):
    """Pages of 16 are four TMA boxes per 64-key stage for the roles kernel (the split-value kernel sends more
    than two to cp.async); an explicit split count runs the roles split-KV kernel."""
    _fake_run(monkeypatch, ROLES, page=16)
    assert ca.LAST_LAUNCH["kv_path"] == "tma_boxes"
    _fake_run(monkeypatch, dict(tile_n=64, wide_design="split_v"), page=16)
    assert ca.LAST_LAUNCH["kv_path"] == "cp.async"
    _, names = _fake_run(monkeypatch, dict(ROLES, num_splits=2))
    assert names == ["blockdiff:cute_compile FlashAttentionForwardSm90RolesSplit 64x64 s2"]
    assert ca._KERNEL_KEYS[ca.LAST_LAUNCH["kernel"]] == "KernelRolesSplit"


def test_roles_refuses_pages_without_a_tma_box(monkeypatch):
    """Page 48 does not tile a 64-key stage: FA4's cp.async path is not built for the roles kernel."""
    with pytest.raises(NotImplementedError, match="roles.*page size 48"):
        _fake_run(monkeypatch, ROLES, page=48)


def test_roles_config_is_refused_before_the_cute_dsl_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setattr(ca, "_FA4", None)
    q = torch.zeros(4, 16, 512, dtype=torch.bfloat16)
    k = torch.zeros(4, 2, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="wide_design"):
        ca.attention_cute(q, k, k, cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                          cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32),
                          seq_lens=torch.tensor([4], dtype=torch.int32), causal=torch.tensor([True]),
                          config=dict(wide_design="rolez"))


def test_roles_compile_matrix_names_the_design():
    specs = cchk._with_design(cchk.ROLES_MATRIX, "roles")
    assert all(s["config"]["wide_design"] == "roles" for s in specs)
    assert {s["page_size"] for s in specs} >= {None, 64, 16, 8}
    assert cchk._with_design(cchk.WIDE_MATRIX, None) is cchk.WIDE_MATRIX


# --- compile only (flash-attn-4 and the CuTe DSL, no GPU) -------------------------------------------------------
# (spec, spill bound in bytes) of the default roles kernel (V refill by halves; S ahead from 16-token pages): one TMA
# page box per stage (contiguous / page 64) spills nothing, except 4 B in the P V warpgroups with a window and the
# LSE (the halves' pipelines; 0 with the one-warp refill); the page-box loads of 4 / 8 boxes per stage and the NaN-safe
# window clean-up on contiguous K/V spill a little (the report of ``python -m blockdiff.attention.cute.compile_check
# --report-roles``; docs/tuning.md 2.20).
COMPILE_SPECS = [
    (dict(page_size=None, window_size=None), 0),
    (dict(page_size=None, window_size=1023, bidirectional_window="prefix"), 32),
    (dict(page_size=64, window_size=1023), 8),
    (dict(page_size=16, window_size=1023, bidirectional_window="prefix"), 320),
    (dict(page_size=8, window_size=None), 192),
]


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1 "
                    "(not installed here)")
@pytest.mark.parametrize("extra,spill_bound", COMPILE_SPECS,
                         ids=["contiguous", "contiguous_prefix", "page64_symmetric", "page16_prefix", "page8"])
def test_roles_kernel_compiles_for_sm90(extra, spill_bound):
    """hd 512, 16 q / 2 KV heads, LSE: 384 threads at 168 registers, setmaxnreg 152 (softmax + Q / K loads) /
    176 (P V), the shared memory config_smem_bytes computes, spills within the bound (none with one page box)."""
    spec = dict(head_dim=512, num_heads=16, num_kv_heads=2, return_lse=True, max_seqlen_q=256,
                config=dict(ROLES), **extra)
    r = compile_for_sm90_or_skip(**spec)
    assert "FlashAttentionForwardSm90Roles" in r["kernel"]
    assert r["registers"] == 168
    assert [tuple(x) for x in r["setmaxreg"]] == [("producer", 152), ("consumer", 176)]
    assert r["spill_store_bytes"] <= spill_bound, r
    if spill_bound == 0:
        assert sum(r["sass_spills"].values()) == 0, r
    cfg = cc.resolve_config(512, 512, extra["window_size"], spec["config"], 256)
    assert r["smem_bytes"] == cc.config_smem_bytes(cfg, 512, 512) == 218_112
    assert r["wgmma"] > 0


# --- GPU ---------------------------------------------------------------------------------------------------------
# (page size or None = contiguous, window mode or None = no window, config): one compile each. Pages of 64 and 256
# load by one TMA box per K / V stage, 16 by four, 8 by eight; 32-key tiles with two stages in the last row.
ROLES_CONFIGS = [
    (64, None, ROLES),
    (64, "symmetric", ROLES),
    (None, "prefix", ROLES),
    (16, "prefix", ROLES),
    (8, "symmetric", ROLES),
    (256, None, ROLES),
    (64, "prefix", dict(ROLES, tile_n=32)),
]


def _kinds_to_ncq(q_lens, kinds):
    return [ql if kd == "causal" else 0 if kd == "bidir" else ql // 2 for ql, kd in zip(q_lens, kinds)]


@needs_gpu
@pytest.mark.parametrize("k_refill", ["auto", "whole"], ids=["k_auto", "k_whole"])
@pytest.mark.parametrize("page,mode,config", ROLES_CONFIGS)
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_gpu_roles_fuzz_matches_reference(page, mode, config, k_refill, data):
    """Mixed batches (causal prefills, bidirectional canvases, split causal/bidirectional sequences, empty and
    one-token sequences; contexts from 0 to past 2k) against the reference, windows drawn per example.
    ``k_refill`` "auto" (the K stage refilled by head-dim halves at head dim 512) and "whole" (``-k "fuzz and
    k_whole"``), the latter also bit for bit against "auto" on the same inputs (the "auto" variant's compile when
    run in the same process; docs/tuning.md 2.23: the run of this fuzz with halves that made them the default)."""
    B = data.draw(st.integers(1, 4), label="B")
    q_lens = data.draw(st.lists(st.sampled_from([0, 1, 7, 64, 129, 256]), min_size=B, max_size=B), label="q_lens")
    ctxs = data.draw(st.lists(st.sampled_from([0, 1, 31, 100, 1024, 2100]), min_size=B, max_size=B), label="ctx")
    kinds = data.draw(st.lists(st.sampled_from(["causal", "bidir", "split"]), min_size=B, max_size=B),
                      label="kinds")
    window = None if mode is None else data.draw(st.sampled_from([0, 1, 33, 100, 1023]), label="window")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    q, k, v, kw = gpu_batch(q_lens, ctxs, _kinds_to_ncq(q_lens, kinds), H, HKV, D, page or 64, seed=seed,
                            contiguous=page is None)
    config = dict(config, k_refill=k_refill)
    run_and_check(q, k, v, kw, window, mode or "symmetric", config=config, max_seqlen_q=256)
    if not sum(q_lens):  # an empty batch launches nothing (H200, 2026-12-03: the record was the previous call's)
        assert ca.LAST_LAUNCH["kernel"] is None
        return
    assert ca.LAST_LAUNCH["kernel"].startswith("FlashAttentionForwardSm90Roles")
    assert ca.LAST_LAUNCH["config"].k_refill == ("whole" if k_refill == "whole" else "halves")
    if k_refill == "whole":  # bit for bit against the halves refill (same wgmma k-steps)
        call = lambda kr: ca.attention_cute(  # noqa: E731
            q, k, v, window_size=window, bidirectional_window=mode or "symmetric", max_seqlen_q=256,
            return_lse=True, config=dict(config, k_refill=kr), **kw)
        (got_o, got_l), (ref_o, ref_l) = call("whole"), call("auto")
        assert torch.equal(got_o, ref_o), (got_o - ref_o).abs().max()
        assert torch.equal(got_l, ref_l), (got_l - ref_l).abs().max()


@needs_gpu
@pytest.mark.parametrize("page", [64, 48])
def test_gpu_default_config_at_hd_512_matches_reference(page):
    """No config: the roles kernel in the work order on pages of 64, the split-value kernel in the given order on
    pages of 48 (no TMA page box for the roles kernel), both against the fp64 reference."""
    q, k, v, kw = gpu_batch([256, 129, 1], [2100, 0, 77], [0, 129, 1], H, HKV, D, page, seed=page)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=256)
    roles = page == 64
    assert ca.LAST_LAUNCH["kernel"] == ("FlashAttentionForwardSm90Roles" if roles else "FlashAttentionForwardSm90WideV")
    assert ca.LAST_LAUNCH["config"].batch_order == ("work" if roles else "given")


@needs_gpu
def test_gpu_roles_page_48_is_refused():
    q, k, v, kw = gpu_batch([64], [100], [0], H, HKV, D, 48, seed=1)
    with pytest.raises(NotImplementedError, match="roles"):
        ca.attention_cute(q, k, v, config=ROLES, max_seqlen_q=64, **kw)


@needs_gpu
@pytest.mark.parametrize("nan_safe_v", [True, False])
def test_gpu_roles_long_prefill_and_many_blocks(nan_safe_v):
    """A 1000-token causal prefill (longest-first order), a canvas over 3000 keys (about 50 key blocks: P slots
    and the single K / V stages reused many times) and a one-token commit, in one launch."""
    q, k, v, kw = gpu_batch([1000, 256, 1], [0, 3000, 77], [1000, 0, 1], H, HKV, D, 64, seed=7)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=1000, config=dict(ROLES, nan_safe_v=nan_safe_v))


@needs_gpu
def test_gpu_roles_gqa_3_loads_q_without_tma():
    """12 query heads on 4 KV heads: 64-row PackGQA tiles are not a multiple of 3, so the softmax warpgroup loads
    Q by cp.async (all its 128 threads) and O is stored without TMA."""
    q, k, v, kw = gpu_batch([300, 256, 1], [0, 1500, 77], [300, 0, 1], 12, 4, D, 64, seed=3)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=300, config=ROLES)


@needs_gpu
@pytest.mark.parametrize("num_splits", [2, 3])
def test_gpu_roles_split_kv_matches_reference(num_splits):
    """Split-KV (the default merge) over a long canvas and short sequences (empty splits)."""
    q, k, v, kw = gpu_batch([256, 7, 1], [5000, 10, 300], [0, 7, 1], H, HKV, D, 64, seed=11)
    run_and_check(q, k, v, kw, 1023, "prefix", max_seqlen_q=256, config=dict(ROLES, num_splits=num_splits))
    assert ca.LAST_LAUNCH["kernel"] == "FlashAttentionForwardSm90RolesSplit"


@needs_gpu
@pytest.mark.parametrize("page", [64, 16])
def test_gpu_roles_keys_left_of_the_window_are_never_loaded(page):
    """K/V left of every row's window are NaN: loading one of those blocks would turn the output NaN (0 * NaN in
    P V), so an unchanged finite output shows the left tile skipping for causal, bidirectional and split rows."""
    W, ctx = 1023, 4096
    q, k, v, kw = gpu_batch([256, 256, 256], [ctx, ctx, ctx], [0, 256, 128], H, HKV, D, page, seed=5)
    call = lambda: ca.attention_cute(q, k, v, window_size=W, bidirectional_window="prefix",  # noqa: E731
                                     max_seqlen_q=256, return_lse=True, config=ROLES, **kw)[0]
    clean = call()
    bt = kw["block_table"].cpu()
    poison_below = (ctx - W) // 64 * 64  # first key any tile loads: (ctx - W) rounded down to a 64-key block
    for b in range(3):
        pos = torch.arange(poison_below)
        pages, offs = bt[b, pos // page].long().cuda(), (pos % page).cuda()
        k[pages, offs] = float("nan")
        v[pages, offs] = float("nan")
    poisoned = call()
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@needs_gpu
@pytest.mark.parametrize("page", [64, 16, 8])
def test_gpu_roles_cache_rows_past_seq_lens_and_unused_table_slots_stay_out(page):
    """NaN after each sequence's last key (its last page) and an all-NaN page behind every unused block-table
    slot: the page-box loads (one / four / eight boxes, V's tail zeroed by the P V warpgroup that loads it) keep
    both out; the output equals the clean one."""
    q, k, v, kw = gpu_batch([256, 100, 5], [1000, 5, 300], [0, 0, 5], H, HKV, D, page, seed=page,
                            nan_pad_page=True)
    rows_past_seq_lens_check(q, k, v, kw, page, ROLES)


@needs_gpu
def test_gpu_roles_cuda_graph_replay_with_metadata_changed_in_place():
    """One capture, replayed with other lengths, causal row counts and a permuted block table written in place:
    each replay matches the reference (output poisoned before each replay)."""
    steps = [([512, 128, 128], [0, 2000, 100], [512, 0, 64], 1),
             ([256, 256, 256], [2800, 1000, 0], [0, 256, 100], 2)]
    graph_replay_check(steps, H=H, Hkv=HKV, D=D, page=64, B=3, cap_q=768, max_blocks=48, max_seqlen_q=512,
                       config=ROLES)
