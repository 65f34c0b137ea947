"""Static configuration of backend "cute" (blockdiff.attention.cute.config), on the CPU without flash-attn-4:
the K/V load path, the tile order, the SM90 shared-memory check and resolve_config's errors."""
import sys

import pytest

from blockdiff.attention.cute import config as cc

#: The split-value kernel, asked for by name (the hd-512 default, wide_design "auto", is the roles kernel).
SPLIT_V = dict(wide_design="split_v")

@pytest.mark.parametrize("page,tile_n,path", [
    (None, 128, "tma"), (None, 64, "tma"), (128, 128, "tma_boxes"), (64, 64, "tma_boxes"),
    (64, 128, "tma_boxes"), (16, 128, "tma_boxes"), (8, 64, "tma_boxes"), (256, 128, "tma_boxes"),
    (128, 64, "tma_boxes"), (4, 128, "cp.async"), (1, 128, "cp.async"), (48, 128, "cp.async"),
    (64, 80, "cp.async"), (160, 80, "tma_boxes"), (24, 48, "tma_boxes"), (12, 48, "cp.async"),
])
def test_kv_load_path_uses_tma_boxes_only_where_boxes_tile_page_and_key_tile(page, tile_n, path):
    """Pages that are multiples of 8 rows and divide (or are multiples of) the key tile load by TMA boxes;
    everything else keeps FA4's cp.async paged loads."""
    assert cc.kv_load_path(page, tile_n) == path


def test_longest_first_tile_order_only_from_512_query_tokens_on():
    """Canvas and commit batches (max_seqlen_q < 512) take FA4's plain tile order; long prefills, and an unknown
    length (None; attention_cute itself falls back to total tokens), its longest-first order."""
    assert cc.longest_first_tiles(256) is False and cc.longest_first_tiles(511) is False
    assert cc.longest_first_tiles(512) is True and cc.longest_first_tiles(16384) is True
    assert cc.longest_first_tiles(None) is True


def test_configs_that_overflow_sm90_shared_memory_are_a_value_error():
    """hd 128 with 128 x 128 tiles: 3 K/V stages fit (the default canvas config), 4 would need ~290 KB and
    failed at launch with a CUDA invalid-configuration error after compiling."""
    fits = cc.CuteConfig(tile_m=128, tile_n=128, mma_pv_is_rs=True, intra_wg_overlap=True, num_stages=3)
    cc.check_config_fits(fits, 128, 128)
    cc.check_config_fits(cc.CuteConfig(tile_m=128, tile_n=64, mma_pv_is_rs=True, intra_wg_overlap=True), 256, 256)
    cc.check_config_fits(cc.CuteConfig(tile_m=192, tile_n=128, mma_pv_is_rs=True, intra_wg_overlap=False), 128, 128)
    with pytest.raises(ValueError, match="num_stages"):
        cc.check_config_fits(cc.CuteConfig(tile_m=128, tile_n=128, mma_pv_is_rs=True, intra_wg_overlap=True,
                                           num_stages=4), 128, 128)
    with pytest.raises(ValueError, match="shared memory"):
        cc.check_config_fits(cc.CuteConfig(tile_m=128, tile_n=128, mma_pv_is_rs=False, intra_wg_overlap=True,
                                           num_stages=2), 256, 256)


def test_resolve_config_rejects_bad_config_types_and_names_the_missing_package(monkeypatch):
    """A config that is not a CuteConfig / dict / None is a TypeError; without flash-attn-4 (its tile heuristic
    fills the unset fields) the ImportError names the packages to install."""
    with pytest.raises(TypeError, match="CuteConfig"):
        cc.resolve_config(128, 128, None, config=(128, 128))
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    with pytest.raises(ImportError, match="flash-attn-4==4.0.0b36"):
        cc.resolve_config(128, 128, None)


def test_page_boxes_need_multiples_of_8_rows_that_tile_the_key_tile():
    assert cc.page_box_tma_ok(64, 128) and cc.page_box_tma_ok(256, 128) and cc.page_box_tma_ok(128, 128)
    assert not cc.page_box_tma_ok(4, 128) and not cc.page_box_tma_ok(48, 128) and not cc.page_box_tma_ok(64, 80)


# ----------------------------------------------------------------------------- head dims above 256 (kernel_wide)
def test_head_dims_above_256_take_the_split_value_kernel_with_equal_multiples_of_32():
    """FA4's kernel covers 8..256 (multiples of 8); above that only equal head dims that split into two
    16-aligned value halves of <= 256 run (Gemma 4's global layers: 512)."""
    assert not cc.is_wide(256, 256) and cc.is_wide(512, 512) and cc.is_wide(128, 512)
    assert cc.unsupported_head_dims(128, 128) is None and cc.unsupported_head_dims(256, 256) is None
    assert cc.unsupported_head_dims(512, 512) is None and cc.unsupported_head_dims(384, 384) is None
    for hd, hdv in ((12, 12), (576, 576), (512, 256), (256, 512), (320 + 16, 320 + 16), (1024, 1024)):
        assert cc.unsupported_head_dims(hd, hdv) is not None, (hd, hdv)
    assert "head_dim" in cc.unsupported_head_dims(12, 12)


def test_wide_config_resolves_without_flash_attn(monkeypatch):
    """The wide tiles come from this module alone (no FA4 heuristic): the split-value kernel's 64 x 32 with two
    K/V stages without tile fields at a canvas hint, the roles kernel's 64 x 64 in one stage by default (hd 512);
    a dict asking for 64-key blocks gets the one stage that fits; lpt follows the query-length hint."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    cfg = cc.resolve_config(512, 512, None, SPLIT_V, max_seqlen_q=256)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.lpt) == (64, 32, 2, False)
    assert (cfg.mma_pv_is_rs, cfg.intra_wg_overlap) == (False, True)
    auto = cc.resolve_config(512, 512, None, None, max_seqlen_q=256)
    assert (auto.tile_m, auto.tile_n, auto.num_stages, auto.lpt, auto.wide_design) == (64, 64, 1, False, "roles")
    cfg64 = cc.resolve_config(512, 512, 1023, dict(tile_n=64), max_seqlen_q=4096)
    assert (cfg64.tile_n, cfg64.num_stages, cfg64.lpt) == (64, 1, True)
    assert cc.resolve_config(512, 512, None, cc.CuteConfig(tile_m=64, tile_n=16, num_stages=3)).num_stages == 3


@pytest.mark.parametrize("max_seqlen_q,tiles", [(256, (32, 2, False)), (511, (32, 2, False)), (512, (64, 1, True)),
                                                 (8192, (64, 1, True)), (None, (64, 1, True))])
def test_wide_default_tiles_follow_the_query_length_hint(max_seqlen_q, tiles):
    """The split-value kernel without tile fields: long (or unknown) query lengths take 64-key blocks in one
    stage, canvases 32-key blocks in two (the H200 record of 2026-12-02); an explicit config is kept as given. The
    roles kernel (the hd-512 default) takes 64-key blocks in one stage whatever the hint."""
    cfg = cc.resolve_wide_config(512, 512, SPLIT_V, max_seqlen_q)
    assert (cfg.tile_n, cfg.num_stages, cfg.lpt) == tiles
    cc.check_config_fits(cfg, 512, 512)
    assert cc.resolve_wide_config(512, 512, dict(tile_n=32), 8192).tile_n == 32
    roles = cc.resolve_wide_config(512, 512, None, max_seqlen_q)
    assert (roles.wide_design, roles.tile_n, roles.num_stages, roles.lpt) == ("roles", 64, 1, tiles[2])


def test_wide_shared_memory_arithmetic():
    """Q 64 KB + stages x (K + V) + two P slots + 3 KB of row factors + 1 KB (equal to the CuTe DSL's
    allocation for these tiles, checked by the compile test): 32-key blocks fit twice, 64-key blocks once."""
    c32 = cc.CuteConfig(tile_m=64, tile_n=32, mma_pv_is_rs=False, intra_wg_overlap=True, num_stages=2)
    c64 = cc.CuteConfig(tile_m=64, tile_n=64, mma_pv_is_rs=False, intra_wg_overlap=True, num_stages=1)
    assert cc.config_smem_bytes(c32, 512, 512) == 2 * (64 * 512 + 2 * 32 * 1024 + 2 * 64 * 32) + 3072 + 1024
    assert cc.config_smem_bytes(c32, 512, 512) == 208896
    assert cc.config_smem_bytes(c64, 512, 512) == 217088
    cc.check_config_fits(c64, 512, 512)
    with pytest.raises(ValueError, match="num_stages"):
        cc.check_config_fits(cc.CuteConfig(tile_m=64, tile_n=64, num_stages=2), 512, 512)


@pytest.mark.parametrize("config,match", [
    (dict(tile_m=128), "tile_m"), (dict(tile_n=40), "tile_n"), (dict(mma_pv_is_rs=True), "mma_pv_is_rs"),
    (dict(intra_wg_overlap=False), "intra_wg_overlap"), (dict(tile_n=64, num_stages=2), "shared memory"),
    (dict(num_stages=0), "num_stages"),
])
def test_wide_config_errors_name_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        cc.resolve_config(512, 512, None, config)
    with pytest.raises(TypeError, match="CuteConfig"):
        cc.resolve_wide_config(512, 512, [64, 32])


@pytest.mark.parametrize("page,tile_n,path", [
    (64, 32, "tma_boxes"), (16, 32, "tma_boxes"), (8, 32, "cp.async"), (32, 64, "tma_boxes"), (16, 64, "cp.async"),
    (256, 32, "tma_boxes"), (48, 32, "cp.async"), (None, 32, "tma"),
])
def test_split_value_kernel_takes_at_most_two_page_boxes_per_stage(page, tile_n, path):
    """At hd 512 each page box is eight 64-column TMA copies; the producer's registers hold two boxes' worth."""
    assert cc.kv_load_path(page, tile_n, cc.WIDE_MAX_PAGE_BOXES) == path
    assert cc.kv_load_path(8, 32) == "tma_boxes"  # no cap for the other kernels


# ----------------------------------------------------------------------------------------- split-KV (kernel_split)
def test_grid_tiles_is_fa4s_varlen_grid():
    """Packed rows plus one partial tile per sequence, times the KV heads: one 256-token canvas is 32 tiles at hd
    512 (8 query heads per KV head in 64-row tiles, 2 KV heads) and 32 at hd 128 (2 per KV head, 128 rows, 8)."""
    assert cc.grid_tiles(256, 1, 2, 8, 64) == 64
    assert cc.grid_tiles(256, 1, 8, 2, 128) == 32
    assert cc.grid_tiles(4 * 256, 4, 8, 2, 128) == 152


@pytest.mark.parametrize("tiles,keys,sms,want", [
    (64, 32768, 132, 2),     # canvas_bs1_ctx32k_global: 2 x 64 = 128 CTAs, one wave
    (32, 32768, 132, 4),     # canvas_bs1_ctx32k_hd128
    (32, 2303, 132, 2),      # canvas_bs1_ctx32k_sliding: the window bounds the keys (2 x 1023 + 256 + 1)
    (152, 4096, 132, 1),     # canvas_bs4_ctx4k_hd128 fills more than half a wave: no split
    (66, 32768, 132, 2), (67, 32768, 132, 1),
    (32, 1500, 132, 1),      # fewer than 2 x 1024 keys: a split would not pay for itself
    (1, 10 ** 6, 132, 16),   # at most MAX_SPLITS
])
def test_split_count_from_host_shapes(tiles, keys, sms, want):
    assert cc.choose_num_splits(tiles, keys, sms) == want


def test_split_count_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_tiles"):
        cc.choose_num_splits(0, 100, 132)
    with pytest.raises(ValueError, match="max_keys"):
        cc.choose_num_splits(4, -1, 132)


def test_key_bound_takes_capacity_hint_and_window():
    assert cc.key_bound(33024, None, None, 256) == 33024
    assert cc.key_bound(33024, 20000, None, 256) == 20000
    assert cc.key_bound(33024, None, 1023, 256) == 2 * 1023 + 256 + 1
    assert cc.key_bound(100, None, 1023, 256) == 100


@pytest.mark.parametrize("bad", [0, 17])
def test_config_num_splits_is_validated(bad):
    with pytest.raises(ValueError, match="num_splits"):
        cc.resolve_wide_config(512, 512, dict(num_splits=bad))


@pytest.mark.parametrize("bad", [True, False, 2.0, "2"])
def test_config_num_splits_of_the_wrong_type_is_a_type_error(bad):
    """num_splits=True was a ValueError: a bool (or a float, a str) where an int is required is a TypeError."""
    with pytest.raises(TypeError, match="num_splits must be None or an int"):
        cc.resolve_wide_config(512, 512, dict(num_splits=bad))
    with pytest.raises(TypeError, match="num_splits"):
        cc.check_config(dict(num_splits=bad))
    with pytest.raises(TypeError, match="num_splits"):
        cc.check_config(cc.CuteConfig(num_splits=bad))


def test_config_num_splits_passes_through_resolution(monkeypatch):
    assert cc.resolve_wide_config(512, 512, dict(num_splits=3)).num_splits == 3
    assert cc.resolve_wide_config(512, 512, None).num_splits is None  # chosen per call from host shapes


def test_launch_config_splits_a_batch_1_canvas_over_a_long_context_only():
    """hd 512: one canvas over 32k keys (64 tiles) takes 2 splits, four canvases over 8k (>= half a wave of
    tiles) none; an explicit count wins; a window bounds the keys."""
    kw = dict(num_kv_heads=2, qhead_per_kvhead=8, max_seqlen_q=256, max_seqlen_k=None, num_sms=132)
    one = cc.resolve_launch_config(512, 512, None, SPLIT_V, total_q=256, num_seqs=1, keys_capacity=33024, **kw)
    assert one.num_splits == 2 and one.tile_n == 32
    # the default (the roles kernel at hd 512): the same 64-row tiles, so the same split count
    one_roles = cc.resolve_launch_config(512, 512, None, None, total_q=256, num_seqs=1, keys_capacity=33024, **kw)
    assert (one_roles.num_splits, one_roles.tile_n, one_roles.wide_design) == (2, 64, "roles")
    four = cc.resolve_launch_config(512, 512, None, None, total_q=1024, num_seqs=4, keys_capacity=8448, **kw)
    assert four.num_splits == 1
    forced = cc.resolve_launch_config(512, 512, None, dict(num_splits=5), total_q=1024, num_seqs=4,
                                      keys_capacity=8448, **kw)
    assert forced.num_splits == 5
    short = cc.resolve_launch_config(512, 512, 100, None, total_q=256, num_seqs=1, keys_capacity=33024, **kw)
    assert short.num_splits == 1  # 2 x 100 + 256 + 1 keys at most


@pytest.mark.parametrize("config,err,match", [
    (dict(tile_n=0), ValueError, "tile_n"), (dict(tile_m=0), ValueError, "tile_m"),
    (dict(tile_n=16.0), TypeError, "tile_n"), (dict(tile_m=-64), ValueError, "tile_m"),
    (dict(tile_n=17), ValueError, "tile_n"), (dict(tile_m=96), ValueError, "tile_m"),
    (dict(num_stages=True), TypeError, "num_stages"), (dict(num_stages=1.5), TypeError, "num_stages"),
    (dict(num_stages="2"), TypeError, "num_stages"), (dict(num_stages=None), TypeError, "num_stages"),
    (dict(num_stages=0), ValueError, "num_stages"),
    (dict(lpt="no"), TypeError, "lpt"), (dict(lpt=2), TypeError, "lpt"),
    (dict(intra_wg_overlap="yes"), TypeError, "intra_wg_overlap"), (dict(mma_pv_is_rs=1), TypeError, "mma_pv_is_rs"),
    (dict(num_splits=True), TypeError, "num_splits"), (dict(num_splits=0), ValueError, "num_splits"),
    (dict(bogus=1), TypeError, "bogus"),
    (cc.CuteConfig(tile_n=0), ValueError, "tile_n"), (cc.CuteConfig(lpt="x"), TypeError, "lpt"),
])
@pytest.mark.parametrize("hd", [128, 512])
def test_config_fields_are_checked_before_resolution_without_coercion(monkeypatch, config, err, match, hd):
    """Was: 0 tiles silently took the default (``config.tile_n or ...``), float tiles / bool or float stages
    passed through to the kernel, lpt='no' became True, num_stages='2' a bare '<' TypeError; at hd 128 every
    field went unchecked behind FA4's import. Now every field is checked first, at both head-dim ranges, with
    flash-attn-4 absent."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    with pytest.raises(err, match=match):
        cc.resolve_config(hd, hd, None, config)
    with pytest.raises(err, match=match):
        cc.check_config(config)


def test_valid_configs_pass_check_config_unchanged():
    for cfg in (None, {}, dict(tile_m=192, tile_n=128, intra_wg_overlap=False), dict(num_stages=3, lpt=False),
                cc.CuteConfig(tile_m=64, tile_n=48, num_stages=1), dict(tile_n=40), dict(num_splits=16)):
        assert cc.check_config(cfg) is cfg


@pytest.mark.parametrize("hd,hv", [(264, 264), (520, 520), (288, 256), (4, 4), (136, 12)])
def test_resolve_config_refuses_head_dims_the_backend_does_not_run(hd, hv):
    """Was: resolve_config(264, 264) / (520, 520) returned a split-value config for head dims no kernel runs."""
    with pytest.raises(ValueError, match="head_dim"):
        cc.resolve_config(hd, hv, None)
    with pytest.raises(ValueError, match="head_dim"):
        cc.resolve_wide_config(hd, hv)


@pytest.mark.parametrize("args,match", [((1.5, 1024, 132), "num_tiles"), ((True, 4096, 132), "num_tiles"),
                                        ((None, 10, 132), "num_tiles"), ((1, 10.0, 132), "max_keys"),
                                        ((1, 10, "132"), "num_sms")])
def test_split_count_takes_ints_only(args, match):
    """Was: choose_num_splits(True, 4096, 132) returned 4, (1.5, ...) returned 1, None a bare '<' TypeError."""
    with pytest.raises(TypeError, match=match):
        cc.choose_num_splits(*args)


@pytest.mark.parametrize("config,err,match", [
    (dict(split_merge="dsmem"), ValueError, "split_merge"), (dict(split_merge=1), TypeError, "split_merge"),
    (dict(split_merge=None), TypeError, "split_merge"),
    (dict(split_merge="cluster", num_splits=9), ValueError, "at most 8"),
    (cc.CuteConfig(split_merge="cluster", num_splits=16), ValueError, "at most 8"),
])
def test_split_merge_is_validated(config, err, match):
    with pytest.raises(err, match=match):
        cc.check_config(config)


def test_split_merge_is_a_switch_not_a_tile_field():
    """Setting only split_merge keeps the automatic tiles (as nan_safe_v); the value resolves through."""
    wide = cc.resolve_wide_config(512, 512, dict(split_merge="cluster"), max_seqlen_q=256)
    assert wide.split_merge == "cluster" and (wide.tile_m, wide.tile_n, wide.num_stages) == (64, 32, 2)
    assert cc.resolve_wide_config(512, 512, None).split_merge == "auto"
    assert cc.check_config(dict(split_merge="cluster", num_splits=8)) is not None


def test_cluster_merge_split_count_is_capped_at_8_and_one_split_is_the_plain_kernel():
    """hd 512, one canvas: the automatic count (2) passes; a tiny grid that would take 16 splits takes 8 with
    the cluster merge; one split resolves to 'combine' (the plain kernel, one compile key)."""
    kw = dict(num_kv_heads=2, qhead_per_kvhead=8, max_seqlen_q=256, max_seqlen_k=None, num_sms=132)
    one = cc.resolve_launch_config(512, 512, None, dict(split_merge="cluster"), total_q=256, num_seqs=1,
                                   keys_capacity=33024, **kw)
    assert (one.num_splits, one.split_merge) == (2, "cluster")
    tiny = dict(kw, num_kv_heads=1, qhead_per_kvhead=1)
    capped = cc.resolve_launch_config(512, 512, None, dict(split_merge="cluster"), total_q=64, num_seqs=1,
                                      keys_capacity=1 << 20, **tiny)
    assert (capped.num_splits, capped.split_merge) == (8, "cluster")
    combine = cc.resolve_launch_config(512, 512, None, None, total_q=64, num_seqs=1, keys_capacity=1 << 20, **tiny)
    assert combine.num_splits == 16
    four = cc.resolve_launch_config(512, 512, None, dict(split_merge="cluster"), total_q=1024, num_seqs=4,
                                    keys_capacity=8448, **kw)
    assert (four.num_splits, four.split_merge) == (1, "combine")


def _fa4_tiles(monkeypatch):
    """FA4's SM90 tile heuristic as it answers for these head dims (128 x 64 local at hd 256, 128 x 128 at hd
    128), so the automatic merge resolves on a CPU without flash-attn-4."""
    from types import SimpleNamespace

    def tiles(head_dim, head_dim_v, is_local):
        return SimpleNamespace(m_block_size=128, n_block_size=64 if head_dim > 128 else 128, mma_pv_is_rs=True,
                               intra_wg_overlap=True)
    monkeypatch.setattr(cc, "_fa4_tile_size", tiles)


def test_auto_merge_takes_the_cluster_at_two_splits_where_it_was_measured_faster(monkeypatch):
    """split_merge "auto" (the default): the cluster merge at exactly 2 splits with head dims <= 256 (the
    sliding canvas over 32k keys: 22 % faster than the combine, docs/tuning.md 2.7), the shared Triton merge at 4
    splits (hd-128 canvas: clusters of 4 lost 1.6x) and for the hd-512 kernels (the split-value kernel's cluster
    lost 5-9 % at 2; the Triton merge keeps an underflowed split's non-finite V and was no slower than FA4's combine,
    docs/tuning.md 2.35), the plain kernel at one split; an explicit merge always wins."""
    _fa4_tiles(monkeypatch)
    kw = dict(total_q=256, num_seqs=1, max_seqlen_q=256, max_seqlen_k=None, num_sms=132)
    sliding = cc.resolve_launch_config(256, 256, 1023, None, num_kv_heads=8, qhead_per_kvhead=2,
                                       keys_capacity=33024, **kw)
    assert (sliding.num_splits, sliding.split_merge) == (2, "cluster")
    hd128 = cc.resolve_launch_config(128, 128, None, None, num_kv_heads=8, qhead_per_kvhead=2, keys_capacity=33024,
                                     **kw)
    assert (hd128.num_splits, hd128.split_merge) == (4, "triton")
    two = cc.resolve_launch_config(128, 128, None, dict(num_splits=2), num_kv_heads=8, qhead_per_kvhead=2,
                                   keys_capacity=33024, **kw)
    assert (two.num_splits, two.split_merge) == (2, "cluster")
    wide = cc.resolve_launch_config(512, 512, None, SPLIT_V, num_kv_heads=2, qhead_per_kvhead=8,
                                    keys_capacity=33024, **kw)
    assert (wide.num_splits, wide.split_merge) == (2, "triton")
    roles = cc.resolve_launch_config(512, 512, None, None, num_kv_heads=2, qhead_per_kvhead=8, keys_capacity=33024,
                                     **kw)  # the hd-512 default: no cluster variant
    assert (roles.wide_design, roles.num_splits, roles.split_merge) == ("roles", 2, "triton")
    short = cc.resolve_launch_config(256, 256, 1023, None, num_kv_heads=8, qhead_per_kvhead=2, keys_capacity=1024,
                                     **kw)
    assert (short.num_splits, short.split_merge) == (1, "combine")
    forced = cc.resolve_launch_config(256, 256, 1023, dict(split_merge="combine"), num_kv_heads=8,
                                      qhead_per_kvhead=2, keys_capacity=33024, **kw)
    assert (forced.num_splits, forced.split_merge) == (2, "combine")


def test_the_triton_merge_is_taken_by_name_on_every_split_launch_and_one_split_is_the_plain_kernel(monkeypatch):
    """split_merge "triton" (the shared Triton merge, docs/tuning.md 2.33): kept at any split count (the hd-128
    canvas at 4, the sliding canvas at 2, both hd-512 kernels at 2), never capped as the cluster is; one split
    resolves to "combine" (the plain kernel, one compile key for all merges)."""
    _fa4_tiles(monkeypatch)
    kw = dict(total_q=256, num_seqs=1, max_seqlen_q=256, max_seqlen_k=None, num_sms=132)
    tri = dict(split_merge="triton")
    hd128 = cc.resolve_launch_config(128, 128, None, tri, num_kv_heads=8, qhead_per_kvhead=2, keys_capacity=33024,
                                     **kw)
    assert (hd128.num_splits, hd128.split_merge) == (4, "triton")
    sliding = cc.resolve_launch_config(256, 256, 1023, tri, num_kv_heads=8, qhead_per_kvhead=2,
                                       keys_capacity=33024, **kw)
    assert (sliding.num_splits, sliding.split_merge) == (2, "triton")
    for config in (dict(SPLIT_V, **tri), tri):
        wide = cc.resolve_launch_config(512, 512, None, config, num_kv_heads=2, qhead_per_kvhead=8,
                                        keys_capacity=33024, **kw)
        assert (wide.num_splits, wide.split_merge) == (2, "triton")
    many = cc.resolve_launch_config(128, 128, None, dict(tri, num_splits=16), num_kv_heads=8, qhead_per_kvhead=2,
                                    keys_capacity=33024, **kw)
    assert (many.num_splits, many.split_merge) == (16, "triton")
    one = cc.resolve_launch_config(256, 256, 1023, tri, num_kv_heads=8, qhead_per_kvhead=2, keys_capacity=1024,
                                   **kw)
    assert (one.num_splits, one.split_merge) == (1, "combine")
    assert "triton" in cc.SPLIT_MERGES and cc.check_config(tri) is not None
    assert cc.CuteConfig().split_merge == "auto" and "auto" in cc.SPLIT_MERGES


def test_auto_merge_takes_the_triton_merge_where_the_cluster_tile_does_not_fit():
    """A 64-row hd-256 tile with one 16-key stage cannot hold the fp32 merge tile: "auto" falls back to the
    shared Triton merge there instead of raising as an explicit "cluster" does; one split is the plain kernel."""
    C = cc.CuteConfig
    rs = dict(mma_pv_is_rs=True)
    assert cc.auto_split_merge(C(tile_m=64, tile_n=16, num_stages=1, num_splits=2, **rs), 256, 256) == "triton"
    assert cc.auto_split_merge(C(tile_m=128, tile_n=64, num_stages=2, num_splits=2, **rs), 256, 256) == "cluster"
    assert cc.auto_split_merge(C(tile_m=128, tile_n=64, num_stages=2, num_splits=3, **rs), 256, 256) == "triton"
    assert cc.auto_split_merge(C(tile_m=128, tile_n=64, num_stages=2, num_splits=1, **rs), 256, 256) == "combine"


def test_auto_merge_takes_the_triton_merge_when_p_goes_through_shared_memory():
    """With P in shared memory (mma_pv_is_rs False) its buffer may lie inside the Q / K / V span the merge reuses,
    which the kernel refuses at trace time: "auto" never picks the cluster there (no measured config has it)."""
    C = cc.CuteConfig
    cfg = C(tile_m=128, tile_n=64, num_stages=2, num_splits=2, mma_pv_is_rs=False)
    assert cc.auto_split_merge(cfg, 256, 256) == "triton"


def test_auto_merge_of_an_unresolved_config_is_a_type_error():
    with pytest.raises(TypeError, match="resolved config"):
        cc.auto_split_merge(cc.CuteConfig(num_splits=2, mma_pv_is_rs=True), 256, 256)


def test_cluster_merge_tile_fits_the_qkv_buffers():
    """The fp32 output tile plus LSEs against Q + K + V (docs/tuning.md 2.5): the tuned configs fit; a 64-row
    hd-256 tile with one 16-key stage does not, and the launch config refuses it by name."""
    C = cc.CuteConfig
    assert cc.cluster_merge_fits(C(tile_m=128, tile_n=128, num_stages=3), 128, 128)
    assert cc.cluster_merge_fits(C(tile_m=128, tile_n=64, num_stages=2), 256, 256)
    assert cc.cluster_merge_fits(C(tile_m=64, tile_n=32, num_stages=2), 512, 512)
    assert cc.cluster_merge_fits(C(tile_m=64, tile_n=64, num_stages=1), 512, 512)
    assert not cc.cluster_merge_fits(C(tile_m=64, tile_n=16, num_stages=1), 256, 256)
    kw = dict(num_kv_heads=2, qhead_per_kvhead=8, max_seqlen_q=256, max_seqlen_k=None, num_sms=132)
    with pytest.raises(ValueError, match="cluster merge"):
        cc.resolve_launch_config(512, 512, None, dict(tile_n=16, num_stages=1, num_splits=2, split_merge="cluster"),
                                 total_q=256, num_seqs=1, keys_capacity=33024, **kw)
