"""GPU tests of the cute backend's split-value kernel (blockdiff.attention.cute.kernel_wide; head dims above 256,
Gemma 4's global layers: hd 512, 16 query / 2 KV heads), on the H200 (``python3 -m pytest -m gpu``).

Every call writes into a NaN-poisoned output and is checked against the fp64 reference with the project's
tolerance rule (attention.testing.check_close: error <= 2x the same-precision eager error of the sequence +
representation tolerance), output and LSE. Static configurations (each one compile) are parametrised and kept few; the batch
compositions, window sizes and seeds are drawn by hypothesis (derandomised). The CPU side of this kernel
(config, heuristics, compile for sm_90a) is in test_cute_config.py and test_cute_compile_check.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiff.attention.cute import interface as ca

from cute_helpers import gpu_batch, graph_replay_check, needs_gpu, rows_past_seq_lens_check, run_and_check

H, HKV, D = 16, 2, 512
#: The split-value kernel, asked for by name (the hd-512 default, wide_design "auto", is the roles kernel wherever
#: its TMA page boxes load the pages: test_cute_kernel_roles.py).
SPLIT_V = dict(wide_design="split_v")

# (page size or None = contiguous, window mode or None = no window, config): one compile each. Page 64 and 256
# load by one TMA box per K/V stage, 16 by two, 8 and 48 by FA4's cp.async path; 64-key tiles with one stage.
WIDE_CONFIGS = [
    (64, None, SPLIT_V),
    (64, "symmetric", SPLIT_V),
    (None, "prefix", SPLIT_V),
    (16, "prefix", SPLIT_V),
    (8, "symmetric", SPLIT_V),
    (256, None, SPLIT_V),
    (48, None, SPLIT_V),
    (64, "prefix", dict(SPLIT_V, tile_n=64)),
]


def _kinds_to_ncq(q_lens, kinds):
    return [ql if kd == "causal" else 0 if kd == "bidir" else ql // 2 for ql, kd in zip(q_lens, kinds)]


@needs_gpu
@pytest.mark.parametrize("page,mode,config", WIDE_CONFIGS)
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_gpu_wide_fuzz_matches_reference(page, mode, config, data):
    """Mixed batches (causal prefills, bidirectional canvases, split causal/bidirectional sequences, empty and
    one-token sequences; contexts from 0 to past 2k) against the reference, windows drawn per example."""
    B = data.draw(st.integers(1, 4), label="B")
    q_lens = data.draw(st.lists(st.sampled_from([0, 1, 7, 64, 129, 256]), min_size=B, max_size=B), label="q_lens")
    ctxs = data.draw(st.lists(st.sampled_from([0, 1, 31, 100, 1024, 2100]), min_size=B, max_size=B), label="ctx")
    kinds = data.draw(st.lists(st.sampled_from(["causal", "bidir", "split"]), min_size=B, max_size=B),
                      label="kinds")
    window = None if mode is None else data.draw(st.sampled_from([0, 1, 33, 100, 1023]), label="window")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    q, k, v, kw = gpu_batch(q_lens, ctxs, _kinds_to_ncq(q_lens, kinds), H, HKV, D, page or 64, seed=seed,
                            contiguous=page is None)
    run_and_check(q, k, v, kw, window, mode or "symmetric", config=config, max_seqlen_q=256)
    if sum(q_lens):
        assert ca.LAST_LAUNCH["kernel"].startswith("FlashAttentionForwardSm90WideV")


@needs_gpu
def test_gpu_wide_long_prefill_longest_first_order_and_many_blocks():
    """A 1000-token causal prefill (longest-first tile order, from max_seqlen_q >= 512), a canvas over 3000 keys
    (about 100 key blocks: P slots reused many times) and a one-token commit, in one launch."""
    q, k, v, kw = gpu_batch([1000, 256, 1], [0, 3000, 77], [1000, 0, 1], H, HKV, D, 64, seed=7)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=1000, config=SPLIT_V)


@needs_gpu
def test_gpu_wide_gqa_3_loads_q_without_tma():
    """12 query heads on 4 KV heads: 64-row PackGQA tiles are not a multiple of 3, so Q loads by cp.async (all
    four producer warps) and O is stored without TMA."""
    q, k, v, kw = gpu_batch([300, 256, 1], [0, 1500, 77], [300, 0, 1], 12, 4, D, 64, seed=3)
    run_and_check(q, k, v, kw, None, "symmetric", max_seqlen_q=300, config=SPLIT_V)


@needs_gpu
@pytest.mark.parametrize("page", [64, 16])
def test_gpu_wide_keys_left_of_the_window_are_never_loaded(page):
    """K/V left of every row's window are NaN: loading one of those blocks would turn the output NaN (0 * NaN in
    P V), so an unchanged finite output shows the left tile skipping for causal, bidirectional and split rows."""
    W, ctx = 1023, 4096
    q, k, v, kw = gpu_batch([256, 256, 256], [ctx, ctx, ctx], [0, 256, 128], H, HKV, D, page, seed=5)
    call = lambda: ca.attention_cute(q, k, v, window_size=W, bidirectional_window="prefix",  # noqa: E731
                                     max_seqlen_q=256, return_lse=True, config=SPLIT_V, **kw)[0]
    clean = call()
    bt = kw["block_table"].cpu()
    poison_below = (ctx - W) // 64 * 64  # first key any tile loads: (ctx - W) rounded down to a 32/64-key block
    for b in range(3):
        pos = torch.arange(poison_below)
        pages, offs = bt[b, pos // page].long().cuda(), (pos % page).cuda()
        k[pages, offs] = float("nan")
        v[pages, offs] = float("nan")
    poisoned = call()
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@needs_gpu
@pytest.mark.parametrize("page", [64, 16, 48])
def test_gpu_wide_cache_rows_past_seq_lens_and_unused_table_slots_stay_out(page):
    """NaN after each sequence's last key (its last page) and an all-NaN page behind every unused block-table
    slot: page-box (one / two boxes) and cp.async loads keep both out; the output equals the clean one."""
    q, k, v, kw = gpu_batch([256, 100, 5], [1000, 5, 300], [0, 0, 5], H, HKV, D, page, seed=page,
                            nan_pad_page=True)
    rows_past_seq_lens_check(q, k, v, kw, page, SPLIT_V)


@needs_gpu
def test_gpu_wide_cuda_graph_replay_with_metadata_changed_in_place():
    """One capture, replayed with other lengths, causal row counts and a permuted block table written in place:
    each replay matches the reference (output poisoned before each replay)."""
    steps = [([512, 128, 128], [0, 2000, 100], [512, 0, 64], 1),
             ([256, 256, 256], [2800, 1000, 0], [0, 256, 100], 2)]
    graph_replay_check(steps, H=H, Hkv=HKV, D=D, page=64, B=3, cap_q=768, max_blocks=48, max_seqlen_q=512,
                       config=SPLIT_V)
