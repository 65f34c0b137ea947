"""The roles kernel's epilogue warp index computed where it is used (the experiment switch
``FlashAttentionForwardSm90Roles._EPILOGUE_LOCAL_WARP``, off by default; docs/tuning.md 2.25): FA4's epilogue picks
the warp that stores O by TMA with ``cute.arch.warp_idx() == 4``, which the compile merges with the kernel entry's
warp index, held (and on sm_90a spilled) across every key-block loop; on, the roles kernel's epilogue computes it
from the consumer's ``tidx``.

* CPU (CI): the switch is off by default;
* GPU (``python3 -m pytest -m gpu``, on the H200; also run with the switch on by
  ``bench/experiments/device/cute_roles_switch.sh`` with ``SWITCH=_EPILOGUE_LOCAL_WARP`` and this file as ``TESTS``):
  with the switch on, outputs and LSEs equal the switch off's bit for bit into a NaN-poisoned ``out`` (a wrong warp
  would leave O unstored, or make the epilogue's barrier wait for the wrong count and hang), over a mixed batch of
  many tiles per CTA (the persistent loop's epilogue repeats) with masked blocks on both sides (the NaN-safe
  clean-up holding the spill), paged 64 / 16 and contiguous, and the paths the switch leaves alone (split-KV's
  epilogue, O without TMA under GQA 3), each against the fp64 reference.
"""
from __future__ import annotations

import pytest
import torch

from blockdiff.attention.cute import interface as ca

from cute_helpers import HAVE_FA4, gpu_batch, needs_gpu, roles_switch_runner, run_and_check

H, HKV, D = 16, 2, 512
ROLES = dict(wide_design="roles")  # the default refills ("auto": V and K by halves, S ahead at pages >= 32)


@pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel class (flash-attn-4, nvidia-cutlass-dsl)")
def test_epilogue_local_warp_is_off_by_default():
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90RolesSplit as RS
    assert R._EPILOGUE_LOCAL_WARP is False
    assert RS._EPILOGUE_LOCAL_WARP is False


@pytest.fixture
def local_warp_switch(monkeypatch):
    """Runs ``fn()`` with the switch set and a compile cache per setting (the cache key does not see it)."""
    return roles_switch_runner(monkeypatch, "_EPILOGUE_LOCAL_WARP")


def _on_equals_off(switch, call):
    out_off, lse_off = switch(False, call)
    out_on, lse_on = switch(True, call)
    assert torch.isfinite(out_on).all(), "unwritten (NaN-poisoned) output elements with the switch on"
    assert torch.equal(out_on, out_off), (out_on - out_off).abs().max()
    assert torch.equal(lse_on, lse_off)


@needs_gpu
@pytest.mark.parametrize("page", [64, 16, None], ids=["p64", "p16", "contig"])
def test_gpu_epilogue_local_warp_equals_the_entry_warp_on_a_mixed_batch(page, local_warp_switch):
    """The bench's mixed shape, shrunk: a 1000-token causal prefill (16 tiles), two canvases of 256 over 3000 keys
    (a partial last block: masked on the right), a 129-token commit and a one-token row; batch order "work"."""
    q, k, v, kw = gpu_batch([1000, 256, 256, 129, 1], [0, 3000, 2900, 500, 77], [1000, 0, 0, 129, 1], H, HKV, D,
                            page or 64, seed=5, contiguous=page is None)
    cfg = dict(ROLES, batch_order="work")

    def call():
        out = torch.full((q.shape[0], H, D), float("nan"), dtype=q.dtype, device=q.device)
        return ca.attention_cute(q, k, v, out=out, return_lse=True, max_seqlen_q=1000, config=cfg, **kw)
    _on_equals_off(local_warp_switch, call)
    local_warp_switch(True, lambda: run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=1000, config=cfg))


@needs_gpu
@pytest.mark.parametrize("case", ["window_prefix", "split2", "gqa3_p32_no_tma_o"])
def test_gpu_epilogue_local_warp_other_paths_equal(case, local_warp_switch):
    """A prefix window (masked blocks on the left too); split-KV (its own epilogue: the switch changes nothing);
    GQA 3 at page 32 (O without TMA: the switch does not apply)."""
    hq, hkv, page, window, mode, cfg = H, HKV, 64, None, "symmetric", dict(ROLES)
    if case == "window_prefix":
        window, mode = 1023, "prefix"
    elif case == "split2":
        cfg["num_splits"] = 2
    else:
        hq, hkv, page = 12, 4, 32
    q, k, v, kw = gpu_batch([600, 256, 7], [0, 2500, 10], [600, 0, 7], hq, hkv, D, page, seed=9)

    def call():
        out = torch.full((q.shape[0], hq, D), float("nan"), dtype=q.dtype, device=q.device)
        return ca.attention_cute(q, k, v, out=out, return_lse=True, window_size=window, bidirectional_window=mode,
                                 max_seqlen_q=600, config=cfg, **kw)
    _on_equals_off(local_warp_switch, call)
    local_warp_switch(True, lambda: run_and_check(q, k, v, kw, window, mode, max_seqlen_q=600, config=cfg))
