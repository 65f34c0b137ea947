"""The roles kernel's K refill by all four SM warps (the experiment switch
``FlashAttentionForwardSm90Roles._K_REFILL_ALL_WARPS``, off by default; docs/tuning.md 2.17): each SM warp waits
for the K stage to be empty and loads a quarter of its columns, warp 0 arriving with the whole stage's bytes.

* CPU (CI): the switch is off by default and reaches only head dims divisible by 256;
* GPU (``python3 -m pytest -m gpu``, on the H200; also run with the switch on by
  ``bench/experiments/device/cute_roles_switch.sh`` with ``SWITCH=_K_REFILL_ALL_WARPS`` and this file as
  ``TESTS``): with the switch on, outputs equal to warp 0's refill bit for bit
  over many key blocks (the bug of 2.17's first run: warps 1-3's producer state missed the tile prologue's K loads,
  so they waited on the wrong phase of the empty barrier and the kernel hung), paged 64 / 16 / 8 and contiguous,
  split-KV, and the fp64 reference.
"""
from __future__ import annotations

import pytest
import torch

from blockdiff.attention.cute import interface as ca

from cute_helpers import HAVE_FA4, gpu_batch, needs_gpu, roles_switch_runner, run_and_check

H, HKV, D = 16, 2, 512
ROLES = dict(wide_design="roles", k_refill="whole")  # the experiment refills the whole stage ("auto": halves)


@pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel class (flash-attn-4, nvidia-cutlass-dsl)")
def test_k_refill_by_all_warps_is_off_by_default_and_needs_quarters_of_whole_swizzle_atoms():
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    assert R._K_REFILL_ALL_WARPS is False
    probe = R.__new__(R)
    probe.k_refill = "halves"  # halves refill from warp 0: never shared, whatever the switch
    probe.tile_hdim, probe._K_REFILL_ALL_WARPS = 512, True
    assert probe._k_refill_all_warps() is False
    probe.k_refill = "whole"
    for hd, on in ((512, True), (256, True), (384, False), (288, False)):
        probe.tile_hdim = hd
        probe._K_REFILL_ALL_WARPS = True
        assert probe._k_refill_all_warps() is on, hd
        probe._K_REFILL_ALL_WARPS = False
        assert probe._k_refill_all_warps() is False


@pytest.fixture
def all_warps_switch(monkeypatch):
    """Runs ``fn(all_warps)`` with the switch set and a compile cache per setting (the cache key does not see it)."""
    return roles_switch_runner(monkeypatch, "_K_REFILL_ALL_WARPS")


@needs_gpu
@pytest.mark.parametrize("page", [64, 16, 8, None], ids=["p64", "p16", "p8", "contig"])
def test_gpu_k_refill_by_all_warps_equals_warp_0s_over_many_key_blocks(page, all_warps_switch):
    """A 1000-token causal prefill, a canvas over 3000 keys (~50 K refills of the one stage: every warp's producer
    phase must track the stage's) and a one-token commit in one launch: bit-identical to warp 0's refill, and
    within the reference's tolerance."""
    q, k, v, kw = gpu_batch([1000, 256, 1], [0, 3000, 77], [1000, 0, 1], H, HKV, D, page or 64, seed=7,
                            contiguous=page is None)
    ref = all_warps_switch(False, lambda: ca.attention_cute(q, k, v, max_seqlen_q=1000, config=ROLES, **kw))
    got = all_warps_switch(True, lambda: ca.attention_cute(q, k, v, max_seqlen_q=1000, config=ROLES, **kw))
    assert torch.equal(got, ref), (got - ref).abs().max()
    all_warps_switch(True, lambda: run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=1000, config=ROLES))


@needs_gpu
@pytest.mark.parametrize("num_splits", [2, 3])
def test_gpu_k_refill_by_all_warps_split_kv_equals_warp_0s(num_splits, all_warps_switch):
    """Split-KV with a prefix window (each split's first K loads in its own prologue; empty splits load nothing)."""
    q, k, v, kw = gpu_batch([256, 7, 1], [5000, 10, 300], [0, 7, 1], H, HKV, D, 64, seed=11)
    cfg = dict(ROLES, num_splits=num_splits)
    call = lambda: ca.attention_cute(q, k, v, window_size=1023, bidirectional_window="prefix",  # noqa: E731
                                     max_seqlen_q=256, config=cfg, **kw)
    ref = all_warps_switch(False, call)
    got = all_warps_switch(True, call)
    assert torch.equal(got, ref), (got - ref).abs().max()
