"""The NaN-safe V clean-up placed under a GEMM (the experiment switches ``FlashAttentionForwardSm90Mixed._CLEAN_AT_PV``,
docs/tuning.md 2.26, and ``_CLEAN_IN_OWN_CALL``, 2.28, both off by default): in FA4's intra-warpgroup overlap consumer
without its scheduler barrier (two consumer warpgroups at head dims > 128), a masked block's V stage is cleaned in the
call that issues its P V, after that call issued the next block's S GEMM (``_CLEAN_AT_PV``), or in the block's own
call after its S and the previous block's P V were issued (``_CLEAN_IN_OWN_CALL``; the tile's first block as with the
other), instead of at the end of the block's own call. Every test below runs for both switches.

* CPU (CI): the switch is off by default and acts only where it is meant to (FA4's overlap consumer without the
  scheduler barrier; never the hd-512 kernels, which place their own clean-up);
  ``compile_check.set_switches`` refuses names that are not an existing experiment attribute; the overrides'
  call sequence with FA4's GEMM calls replaced by recorders: each masked block cleaned once, after the next S issue
  and before its own P V, in the masked blocks' order;
* CPU with the CuTe DSL (not in CI, ~2 min): the bench's hd-256 sliding launch compiles for sm_90a with the switch on
  without spills in its key-block loops and without ptxas serialising a wgmma, and an hd-128 launch (scheduler
  barrier on) compiles to the PTX of the switch off;
* GPU (``python3 -m pytest -m gpu``, on the H200; also run by ``bench/experiments/device/cute_mixed_switch.sh``):
  with the switch on, hd-256 mixed batches (paged 64, contiguous, split-KV with FA4's combine and the cluster merge)
  give the switch off's outputs and LSEs bit for bit into NaN-poisoned outputs, and caches whose V holds NaN / Inf
  inside ``seq_lens`` give exactly the reference's non-finite entries (the NaN-safe V cases of hd 256).
"""
from __future__ import annotations

import inspect
import itertools
import re
from types import SimpleNamespace

import pytest
import torch

from blockdiff.attention import attention
from blockdiff.attention.cute import interface as ca
from blockdiff.attention.testing import poison_v_inside_seq_lens

from cute_helpers import (HAVE_FA4, NAN_SAFE_HD256_CASES, check_nonfinite_v, compile_for_sm90_or_skip, gpu_batch,
                          needs_gpu, nonfinite_cases, run_and_check, switch_runner)

#: the two placements under a GEMM: at the block's P V issue (2.26) and in the block's own call (2.28)
SWITCHES = ["_CLEAN_AT_PV", "_CLEAN_IN_OWN_CALL"]
_FA4 = pytest.mark.skipif(not HAVE_FA4, reason="imports the CuTe DSL kernel classes (flash-attn-4, nvidia-cutlass-dsl)")


@_FA4
def test_clean_at_pv_is_off_by_default_and_acts_only_without_the_scheduler_barrier():
    """Off by default; on, it acts only with NaN-safe V in FA4's overlap consumer without its scheduler barrier (FA4
    sets the barrier at head dims <= 128 with the overlap: there the clean-up keeps its place); the hd-512 kernels
    (split-value, roles) never take it."""
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    from blockdiff.attention.cute.kernel_wide import FlashAttentionForwardSm90WideV as W
    assert M._CLEAN_AT_PV is False and M._CLEAN_IN_OWN_CALL is False
    for nan_safe_v, switch, overlap, barrier, acts in [
            (True, True, True, False, True),     # hd 256 with the overlap: acts
            (True, False, True, False, False),   # the default
            (True, True, True, True, False),     # hd 128 with the overlap: FA4's scheduler barrier
            (True, True, False, True, False),    # no overlap (192 x 128): the clean-up sits before its P V already
            (False, True, True, False, False)]:  # NaN-safe V off
        for (at_pv, own), stages in itertools.product(((switch, False), (False, switch)), (2, 3, 1)):
            k = SimpleNamespace(nan_safe_v=nan_safe_v, _CLEAN_AT_PV=at_pv, _CLEAN_IN_OWN_CALL=own,
                                intra_wg_overlap=overlap, use_scheduler_barrier=barrier, num_stages=stages)
            k._clean_at_pv = lambda k=k: M._clean_at_pv(k)
            assert M._clean_at_pv(k) is acts, (nan_safe_v, switch, overlap, barrier)
            # one K / V stage: the wait for V(j) in its own call would deadlock; _CLEAN_AT_PV's placement instead
            assert M._clean_in_own_call(k) is (acts and own and stages >= 2), (nan_safe_v, switch, overlap, barrier)
    on = SimpleNamespace(nan_safe_v=True, _CLEAN_AT_PV=True, _CLEAN_IN_OWN_CALL=False, intra_wg_overlap=True,
                         use_scheduler_barrier=False)
    assert W._clean_at_pv(on) is False and R._clean_at_pv(on) is False
    both = SimpleNamespace(nan_safe_v=True, _CLEAN_AT_PV=True, _CLEAN_IN_OWN_CALL=True, intra_wg_overlap=True,
                           use_scheduler_barrier=False)
    with pytest.raises(ValueError, match="exclude each other"):
        M._clean_at_pv(both)


@_FA4
def test_set_switches_refuses_what_is_not_an_experiment_attribute():
    """A switch names ``Class._ATTR`` of an existing class attribute of kernel.py / kernel_wide.py / kernel_roles.py;
    a missing class, a missing attribute, a public attribute (a constructor argument's, not a switch), a method or
    a module-level function is a ValueError naming it; ab_roles_switch takes the same names (and bare roles ones)."""
    from blockdiff.attention.cute import compile_check as cchk
    for bad in ("NoSuchClass._CLEAN_AT_PV", "FlashAttentionForwardSm90Mixed._NO_SUCH_SWITCH",
                "FlashAttentionForwardSm90Mixed.V_REFILLS", "_CLEAN_AT_PV",
                "FlashAttentionForwardSm90Mixed._clean_at_pv", "row_key_range.__name__"):
        with pytest.raises(ValueError, match="switch"):
            cchk.set_switches({bad: True})
    from blockdiff.bench.experiments.ab_roles_switch import switch_class
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    assert switch_class("_K_REFILL_ALL_WARPS") == (R, "_K_REFILL_ALL_WARPS")
    assert switch_class("FlashAttentionForwardSm90Roles._K_REFILL_ALL_WARPS") == (R, "_K_REFILL_ALL_WARPS")
    for bad in ("FlashAttentionForwardSm90Mixed._clean_at_pv", "_NO_SUCH_SWITCH"):
        with pytest.raises(ValueError, match="switch"):
            switch_class(bad)


@_FA4
def test_fa4_advances_the_passed_state_in_place_before_the_p_v():
    """What ``_CLEAN_IN_OWN_CALL`` reads in FA4's source (the call-sequence test below fakes it): the overlap call
    clones the passed state for the previous block's V, advances the passed object itself (CUTLASS's
    ``PipelineState.advance`` rebinds its index / phase) before issuing S and the P V, never rebinds it, and
    releases V(j-1) only after the P V; FA4's ``mma`` passes the state positionally (``args[0]`` in the
    override)."""
    from cutlass import pipeline as cutlass_pipeline
    from flash_attn.cute import flash_fwd_sm90 as fa4
    src = inspect.getsource(fa4.FlashAttentionForwardSm90.mma_one_n_block_intrawg_overlap)
    order = ["smem_pipe_read_v = smem_pipe_read.clone()", "smem_pipe_read.advance()",
             "mma_qk_fn(B_idx=smem_pipe_read.index", "pipeline_v.consumer_wait(smem_pipe_read_v",
             "mma_pv_fn(B_idx=smem_pipe_read_v.index", "pipeline_k.consumer_release(smem_pipe_read)",
             "pipeline_v.consumer_release(smem_pipe_read_v)"]
    pos = [src.find(x) for x in order]
    assert -1 not in pos and pos == sorted(pos), list(zip(order, pos))
    assert not re.search(r"\bsmem_pipe_read\s*=[^=]", src)  # the passed object is the one advanced
    assert fa4.pipeline.make_pipeline_state is cutlass_pipeline.make_pipeline_state  # FA4's mma: this state class
    assert "self._index, self._phase = " in inspect.getsource(cutlass_pipeline.PipelineState.advance)
    assert re.search(r"mma_one_n_block\(\s*kv_consumer_state,", inspect.getsource(fa4.FlashAttentionForwardSm90.mma))


@_FA4
def test_ab_switch_settings_name_every_row_and_refuse_bad_ones():
    """``ab_roles_switch``'s several-switch form (cute_mixed_switch.sh's ``SWITCH=all``): an ``off`` row with every
    named switch at its class default, then one row per setting with the switches it leaves out at their defaults;
    a setting named ``off``, an empty one or an unknown switch is a ValueError (before any GPU work)."""
    import json
    from blockdiff.bench.experiments.ab_roles_switch import switch_settings
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    a, o, k = (f"FlashAttentionForwardSm90Mixed.{n}" for n in SWITCHES + ["_SKIP_ALLOWED_FIRST"])
    got = switch_settings(json.dumps({"pv": {a: True}, "own_skip": {o: True, k: True}}))
    assert list(got) == ["off", "pv", "own_skip"]
    flat = {name: {attr: v for (cls, attr), v in row.items()} for name, row in got.items()}
    assert flat["off"] == dict.fromkeys(["_CLEAN_AT_PV", "_CLEAN_IN_OWN_CALL", "_SKIP_ALLOWED_FIRST"], False)
    assert flat["pv"] == dict(flat["off"], _CLEAN_AT_PV=True)
    assert flat["own_skip"] == dict(flat["off"], _CLEAN_IN_OWN_CALL=True, _SKIP_ALLOWED_FIRST=True)
    assert all(cls is M for row in got.values() for cls, _ in row)
    single = switch_settings(a)
    assert {n: list(r.values()) for n, r in single.items()} == {"off": [False], "on": [True]}
    for bad in (json.dumps({"off": {a: True}}), json.dumps({"x": {}}), json.dumps({"x": {"Nope._A": True}}), "{"):
        with pytest.raises(ValueError):
            switch_settings(bad)


class _FakeState:
    """FA4's pipeline state as the overrides see it: the stage index of a key block's K / V."""
    def __init__(self, index):
        self.index = index


def _run_tile_calls(k, events, first, right, interior, left):
    """FA4's consumer calls for one tile with the overlap (``flash_fwd_sm90.py``, ``mma``): the first half block
    (masked), ``right`` right-masked calls, ``interior`` unmasked ones, ``left`` left-masked ones, the last half
    block; key blocks numbered down from ``first``. Returns the masked blocks in call order."""
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    blocks = list(range(first, first - 1 - right - interior - left, -1))
    masked = [blocks[0]] + blocks[1:1 + right] + (blocks[1 + right + interior:] if left else [])
    state = M.first_half_block_overlap(k, n_block=blocks[0], mask_fn=lambda **kw: None)
    for pos, n in enumerate(blocks[1:], 1):
        is_masked = pos <= right or pos > right + interior
        state = M.mma_one_n_block_intrawg_overlap(
            k, state, n_block=n, mma_pv_fn=lambda B_idx, **kw: events.append(("PV", k._stage_block[B_idx])),
            mask_fn=(lambda **kw: None) if is_masked else None)
    M.last_half_block_overlap(k, kv_consumer_state=state, zero_init=False,
                              mma_pv_fn=lambda B_idx, **kw: events.append(("PV", k._stage_block[B_idx])))
    return masked


@_FA4
@pytest.mark.parametrize("shape", [(0, 0, 0), (0, 5, 0), (2, 0, 0), (1, 3, 2), (0, 0, 3), (3, 4, 1), (2, 0, 2)],
                         ids=lambda s: "r{}_i{}_l{}".format(*s))
@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("stages", [2, 1])
def test_clean_at_pv_cleans_each_masked_block_after_the_next_s_and_before_its_p_v(shape, switch, stages, monkeypatch):
    """The overrides' call sequence, with FA4's GEMM calls replaced by recorders (the real ``first_half_block_overlap``
    / ``mma_one_n_block_intrawg_overlap`` / ``last_half_block_overlap`` overrides and ``_clean_pending``'s body):
    over consecutive tiles with right-masked, interior and left-masked blocks, every masked block's V is cleaned
    exactly once, after the next block's S was issued (when there is a next block) and before its own P V; no
    unmasked block is cleaned; the clean-ups come in the masked blocks' order (the tags' counters agree between the
    warpgroups, as at the block's end); the mark is clear after each tile; the old placement's clean is never
    called. ``_CLEAN_IN_OWN_CALL``: every masked block but the first is cleaned in its own call, after its S and
    the previous block's P V were issued (the last block too); with one K / V stage as ``_CLEAN_AT_PV`` (the early
    wait would deadlock)."""
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90 as F
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    events, counter = [], [0]
    k = M.__new__(M)
    k.nan_safe_v, k.intra_wg_overlap, k.use_scheduler_barrier, k.num_stages = True, True, False, stages
    k._CLEAN_AT_PV, k._CLEAN_IN_OWN_CALL = switch == "_CLEAN_AT_PV", switch == "_CLEAN_IN_OWN_CALL"
    own = switch == "_CLEAN_IN_OWN_CALL" and stages >= 2
    k.tile_hdimv, k._nf_sVt, k._nf_pending, k._stage_block = 256, None, [0], {}

    def next_state(n_block):  # FA4's pipeline: consecutive key blocks take consecutive stages (2 here)
        st = _FakeState(counter[0] % 2)
        counter[0] += 1
        k._stage_block[st.index] = n_block
        events.append(("S", n_block))
        return st

    def fake_first(self, n_block, **kw):
        return next_state(n_block)

    def fake_overlap(self, state, n_block, mma_pv_fn, **kw):
        v_index = state.index  # FA4: the previous block's V state cloned, then the state advanced in place
        state.index = next_state(n_block).index  # S(j+1) issued, then the P V of the previous block's stage
        mma_pv_fn(B_idx=v_index, wg_wait=-1)
        return state

    def fake_last(self, kv_consumer_state, mma_pv_fn, zero_init, **kw):
        mma_pv_fn(B_idx=kv_consumer_state.index, zero_init=zero_init, wg_wait=0)
        return kv_consumer_state

    monkeypatch.setattr(F, "first_half_block_overlap", fake_first)
    monkeypatch.setattr(F, "mma_one_n_block_intrawg_overlap", fake_overlap)
    monkeypatch.setattr(F, "last_half_block_overlap", fake_last)
    calls = []  # every _clean_v_stage call (active or not): the tags' counters advance once a call

    def fake_clean(sVt, stage, col0, width, shared_tag=False, active=None):
        calls.append(stage)
        if active is None or int(active):  # a call with trip count 0 scans nothing
            events.append(("clean", k._stage_block[stage], col0, width, shared_tag))
    k._clean_v_stage = fake_clean
    from blockdiff.attention.cute import kernel as K
    monkeypatch.setattr(K.cute.arch, "make_warp_uniform", lambda x: x)  # (a DSL op; plain ints here)
    k._clean_pending = lambda stage: M._clean_pending.__wrapped__(k, stage)
    if own:  # the wrapped P V waits for this block's V (FA4's advanced state) and scans
        k._wait_clean_v = lambda st, col0, width, shared_tag=False: events.append(
            ("clean", k._stage_block[st.index], col0, width, shared_tag))
    else:
        k._wait_clean_v = lambda *a, **kw: pytest.fail("the block-end clean-up ran with the switch on")
    right, interior, left = shape
    for tile, first in enumerate((40, 17, 9)):
        events.clear()
        masked = _run_tile_calls(k, events, first, right, interior, left)
        cleans = [e for e in events if e[0] == "clean"]
        assert [c[1] for c in cleans] == masked, (tile, events)
        assert all(c[2:] == (0, 256, True) for c in cleans)
        last = first - right - interior - left
        for b in masked:
            i = events.index(("clean", b, 0, 256, True))
            assert i < events.index(("PV", b)), (b, events)
            if own and b != first:  # under its own S and the previous block's P V
                assert events.index(("S", b)) < events.index(("PV", b + 1)) < i, (b, events)
            elif b != last:
                assert events.index(("S", b - 1)) < i, (b, events)  # the next block's S was issued first
        assert int(k._nf_pending[0]) == 0


# --- offline sm_90a compiles (the CuTe DSL venv; CI has no CuTe DSL) -------------------------------------------
def _bench_spec(name):
    from blockdiff.bench.experiments.cute_ptx_snapshot import SPECS
    return SPECS[name]["spec"]


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
@pytest.mark.parametrize("switch", SWITCHES)
def test_clean_at_pv_compiles_the_sliding_launch_without_spills_in_its_key_block_loops(switch, tmp_path):
    """The bench's ``mixed_sliding_ctx8k`` launch (hd 256, 128 x 64, 2 stages, P in registers, overlap): the clean-up
    synced by the warpgroup's mbarrier (no ``bar.red.or``), no spill inside a key-block loop (the few bytes ptxas spills hold per-tile
    values: docs/tuning.md 2.26), no wgmma serialised by ptxas, the shared memory of the switch off."""
    spec = _bench_spec("sliding_bench_mixed_ctx8k")
    on = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "on"), switches={
        "FlashAttentionForwardSm90Mixed." + switch: True}, **spec)
    off = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "off"), **spec)
    assert on["ptx_sha256"] != off["ptx_sha256"]  # the switch acts here
    assert on["smem_bytes"] == off["smem_bytes"] and on["wgmma"] == off["wgmma"], (on, off)
    assert not [w for w in on["ptxas_warnings"] if "wgmma" in w], on["ptxas_warnings"]
    assert on["spill_store_bytes"] <= 32 and on["spill_load_bytes"] <= 64, on
    assert [loop["R2UR"] for loop in off["loops"]] == [0, 0, 0], off["loops"]
    assert len(on["loops"]) == 3 and all(loop["STL/LDL"] == 0 for loop in on["loops"]), on["loops"]
    # the wgmma descriptors stay in the uniform datapath (a named barrier under the S GEMM moved them out: 65 R2UR
    # and +120-180 instructions in every key-block loop; the warpgroup's mbarrier does not, docs/tuning.md 2.29)
    assert all(loop["R2UR"] <= 2 for loop in on["loops"]), on["loops"]
    assert on["spill_store_bytes"] <= 8, on
    with open(on["ptx_file"]) as f:  # the clean-up's warpgroup sync is an mbarrier there, not bar.red.or
        assert "bar.red.or.pred" not in f.read()
    with open(off["ptx_file"]) as f:
        assert "bar.red.or.pred" in f.read()


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1")
@pytest.mark.parametrize("switch", SWITCHES)
def test_clean_at_pv_leaves_a_kernel_with_the_scheduler_barrier_unchanged(switch, tmp_path):
    """``canvas_bs4_ctx4k_hd128``'s launch (hd 128, overlap with FA4's scheduler barrier): the same PTX either way."""
    spec = _bench_spec("hd128_bench_canvas_bs4_ctx4k")
    on = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "on"), switches={
        "FlashAttentionForwardSm90Mixed." + switch: True}, **spec)
    off = compile_for_sm90_or_skip(ptx_dir=str(tmp_path / "off"), **spec)
    assert on["ptx_sha256"] == off["ptx_sha256"]


# --- GPU --------------------------------------------------------------------------------------------------------
@pytest.fixture(params=SWITCHES)
def clean_at_pv(request, monkeypatch):
    """Runs ``fn()`` with the switch (each placement in turn) set and a compile cache per setting (the cache key
    does not see it)."""
    from blockdiff.attention.cute.kernel import FlashAttentionForwardSm90Mixed as M
    return switch_runner(monkeypatch, M, request.param)


@needs_gpu
@pytest.mark.parametrize("case", ["p64", "contig", "p64_prefix", "split2_combine", "split2_cluster", "p16"])
def test_gpu_clean_at_pv_equals_the_clean_up_at_the_block_end(case, clean_at_pv):
    """hd 256, 16 / 8 heads, window 127 (masked blocks on both sides of many tiles): a causal prefill, canvases over
    context (one with a partial last block), a commit, a one-token row; outputs and LSEs equal bit for bit (the
    clean-up changes no finite value, only when it runs), the switch-on call checked against the fp64 reference."""
    page, mode, cfg = 64, "symmetric", {}
    if case == "p16":
        page = 16
    elif case == "p64_prefix":
        mode = "prefix"
    elif case.startswith("split2"):
        cfg = dict(num_splits=2, split_merge=case.split("_")[1])
    q, k, v, kw = gpu_batch([700, 256, 256, 129, 1], [0, 3000, 2900, 500, 77], [700, 0, 0, 129, 1], 16, 8, 256,
                            page, seed=31, contiguous=case == "contig")

    def call():
        out = torch.full((q.shape[0], 16, 256), float("nan"), dtype=q.dtype, device=q.device)
        return ca.attention_cute(q, k, v, out=out, return_lse=True, window_size=127, bidirectional_window=mode,
                                 max_seqlen_q=700, config=dict(cfg, nan_safe_v=True), **kw)
    out_off, lse_off = clean_at_pv(False, call)
    out_on, lse_on = clean_at_pv(True, call)
    assert torch.isfinite(out_on).all(), "unwritten (NaN-poisoned) output elements with the switch on"
    assert torch.equal(out_on, out_off), (out_on - out_off).abs().max()
    assert torch.equal(lse_on, lse_off)
    clean_at_pv(True, lambda: run_and_check(q, k, v, kw, 127, mode, max_seqlen_q=700,
                                            config=dict(cfg, nan_safe_v=True)))


@needs_gpu
@pytest.mark.parametrize("page,config,kw", [c[1:] for c in NAN_SAFE_HD256_CASES],
                         ids=[c[0] for c in NAN_SAFE_HD256_CASES])
def test_gpu_clean_at_pv_keys_a_row_may_not_see_contribute_nothing(page, config, kw, clean_at_pv):
    """The hd-256 NaN-safe V cases (test_cute_nan_safe_v.py) with the clean-up at the P V issue: exactly the
    reference's NaN / +Inf / -Inf entries (a clean-up missed before a P V gives extra NaN in every row of the tile;
    a detection missed leaves entries out), and the same output as the clean-up at the block's end (NaN-aware; on
    finite caches the clean-up writes nothing, so only poisoned ones tell the placements apart)."""
    inp = nonfinite_cases(256, 16, 8, page or 64, seed=22, paged=page is not None)
    assert clean_at_pv(True, lambda: check_nonfinite_v(inp, config, seed=3, **kw)) > 0
    bad = poison_v_inside_seq_lens(inp, 3, 6)[0]  # and on equals off on the poisoned caches (NaN-aware)

    def call():
        return attention(**bad, backend="cute", config=dict(config or {}, nan_safe_v=True), **kw)
    off, on = clean_at_pv(False, call), clean_at_pv(True, call)
    assert torch.equal(torch.isnan(on), torch.isnan(off)) and torch.equal(on.nan_to_num(), off.nan_to_num())
