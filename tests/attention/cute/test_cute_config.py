"""Static configuration of backend "cute" (blockdiff.attention.cute.config), on the CPU without flash-attn-4:
the K/V load path, the tile order, the SM90 shared-memory check and resolve_config's errors."""
import sys

import pytest

from blockdiff.attention.cute import config as cc


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
