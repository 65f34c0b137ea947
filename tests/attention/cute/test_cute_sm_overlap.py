"""The roles kernel's S issued one block ahead (the experiment switch ``FlashAttentionForwardSm90Roles._SM_OVERLAP``,
off by default; docs/tuning.md 2.18): SM issues S(i + 1)'s wgmma after block i's softmax and P's conversion, before
P's hand-off, and retires it at the top of the next iteration; the tile's first key block issues nothing.

* CPU (CI): the switch is off by default;
* GPU (``python3 -m pytest -m gpu``, on the H200; also run with the switch on by
  ``bench/experiments/device/cute_sm_overlap.sh``): with the switch on, outputs equal to the default kernel's bit for
  bit (same wgmma on the same operands, same softmax order; the tile's first key block masked whatever its kind,
  a no-op on an interior block) over one-block tiles, many key blocks, windows (the left-masked loop), 32-key tiles
  in two stages, paged 64 / 16 / 8 and contiguous, split-KV and the V refill by halves, and the fp64 reference.
"""
from __future__ import annotations

import pytest
import torch

from blockdiff.attention.cute import interface as ca

from cute_helpers import HAVE_FA4, gpu_batch, needs_gpu, roles_switch_runner, run_and_check

H, HKV, D = 16, 2, 512
ROLES = dict(wide_design="roles")


@pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel class (flash-attn-4, nvidia-cutlass-dsl)")
def test_sm_overlap_is_off_by_default():
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    assert R._SM_OVERLAP is False


@pytest.fixture
def overlap_switch(monkeypatch):
    """Runs ``fn()`` with the switch set and a compile cache per setting (the cache key does not see it)."""
    return roles_switch_runner(monkeypatch, "_SM_OVERLAP")


def _same(overlap_switch, call):
    ref = overlap_switch(False, call)
    got = overlap_switch(True, call)
    assert torch.equal(got, ref), (got - ref).abs().max()


@needs_gpu
@pytest.mark.parametrize("page", [64, 16, 8, None], ids=["p64", "p16", "p8", "contig"])
def test_gpu_sm_overlap_equals_the_default_over_one_and_many_key_blocks(page, overlap_switch):
    """A 1000-token causal prefill, a canvas over 3000 keys (~50 blocks issued ahead), a one-token commit over 77 keys
    (two blocks) and a one-token row over one key (a one-block tile: the branch that issues nothing ahead) in one
    launch: bit-identical to the default, and within the reference's tolerance."""
    q, k, v, kw = gpu_batch([1000, 256, 1, 1], [0, 3000, 77, 0], [1000, 0, 1, 1], H, HKV, D, page or 64, seed=7,
                            contiguous=page is None)
    _same(overlap_switch, lambda: ca.attention_cute(q, k, v, max_seqlen_q=1000, config=ROLES, **kw))
    overlap_switch(True, lambda: run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=1000, config=ROLES))


@needs_gpu
@pytest.mark.parametrize("mode", ["prefix", "symmetric"])
@pytest.mark.parametrize("cfg", [dict(ROLES), dict(ROLES, tile_n=32), dict(ROLES, v_refill="halves")],
                         ids=["tiles64", "tiles32x2", "halves"])
def test_gpu_sm_overlap_equals_the_default_with_windows(mode, cfg, overlap_switch):
    """A 1023-key window: right-masked, interior and left-masked loops all run, each stopping above the tile's
    first key block; 32-key tiles keep two K stages (the issued S reads the stage loaded by the prologue)."""
    q, k, v, kw = gpu_batch([700, 256, 5], [0, 2500, 130], [700, 0, 5], H, HKV, D, 64, seed=3)
    call = lambda: ca.attention_cute(q, k, v, window_size=1023, bidirectional_window=mode,  # noqa: E731
                                     max_seqlen_q=700, config=cfg, **kw)
    _same(overlap_switch, call)
    overlap_switch(True, lambda: run_and_check(q, k, v, kw, 1023, mode, max_seqlen_q=700, config=cfg))


@needs_gpu
@pytest.mark.parametrize("num_splits", [2, 3])
def test_gpu_sm_overlap_split_kv_equals_the_default(num_splits, overlap_switch):
    """Split-KV with a prefix window (a split of one block, empty splits, each split's own prologue)."""
    q, k, v, kw = gpu_batch([256, 7, 1], [5000, 10, 300], [0, 7, 1], H, HKV, D, 64, seed=11)
    cfg = dict(ROLES, num_splits=num_splits)
    _same(overlap_switch, lambda: ca.attention_cute(q, k, v, window_size=1023, bidirectional_window="prefix",
                                                    max_seqlen_q=256, config=cfg, **kw))
