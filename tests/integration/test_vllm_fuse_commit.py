"""Fused commits under vLLM (issue 25's stretch goal; docs/ARCHITECTURE.md "Integration and vLLM accounting"):
the worker flags "commits next, and the commit does not end the request" as ``num_nans_in_logits = -1``, the
plugin's synchronous scheduler gives that request ``2 * CL`` draft tokens (the commit plus the next canvas's first
step), and the model state's attention metadata carries the causal row counts.

The pieces run here without vLLM (stand-ins) and, where vLLM's Python side is installed
(``source tests/integration/vllm_cpu_env.sh 0.26.0`` / ``0.33.0``), against a real vLLM ``Scheduler`` /
``AsyncScheduler`` served with ``num_spec_tokens = 2 * CL``.
"""
from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from integration_helpers import (CL, FAKE_VLLM_TYPES, FakeRequest, FakeScheduler, captured_log, make_batch,
                                 needs_stack, params, vllm_attn_metadata_stubs, vllm_sampler_output_class)

from blockdiff.integration import vllm_scheduler as VS

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (tests/integration/vllm_cpu_env.sh)")


# ------------------------------------------------------------------------------------------ scheduler pieces
def test_split_fuse_flags_collects_negative_ids_and_cleans_the_copy():
    nans = {"a": -1, "b": 0, "c": 3}
    fuse, cleaned = VS.split_fuse_flags(nans)
    assert fuse == {"a"} and cleaned == {"a": 0, "b": 0, "c": 3} and nans["a"] == -1  # the input is not changed
    fuse, same = VS.split_fuse_flags({"b": 0, "c": 2})
    assert fuse == set() and same == {"b": 0, "c": 2}
    assert VS.split_fuse_flags(None) == (set(), None)
    with pytest.raises(TypeError, match="num_nans_in_logits must be a dict"):
        VS.split_fuse_flags([("a", -1)])
    with pytest.raises(TypeError, match=r"num_nans_in_logits\['a'\] must be an int"):
        VS.split_fuse_flags({"a": -1.0})


def test_minus_one_is_not_a_failure():
    """finish_stuck_requests fails a request on n > 0 only (was: any nonzero n, so -1 would have failed it)."""
    s = FakeScheduler([FakeRequest("f", 10), FakeRequest("x", 10)], max_model_len=100, canvas=CL)
    assert VS.finish_stuck_requests(s, {"f": -1, "x": 2}, {}, types=FAKE_VLLM_TYPES) == [("x", "error")]
    assert s.requests["f"].status == "RUNNING"


def _fake_sched(reqs, max_model_len, cl=CL):
    s = FakeScheduler(reqs, max_model_len=max_model_len, canvas=2 * cl)  # num_spec_tokens = 2 * CL
    s.blockdiff_canvas_length = cl
    return s


def test_cut_draft_widths_gives_two_canvases_only_to_a_flagged_request_whose_next_canvas_fits():
    reqs = [FakeRequest("plain", 20), FakeRequest("fuse", 20), FakeRequest("tight", 100 - 2 * CL + 1),
            FakeRequest("edge", 100 - 2 * CL)]
    s = _fake_sched(reqs, 100)
    d = NS(req_ids=["plain", "fuse", "tight", "edge", "gone"], draft_token_ids=[[-1] * (2 * CL) for _ in range(5)])
    VS.cut_draft_widths(s, d, {"fuse", "tight", "edge", "gone"})
    assert [len(x) for x in d.draft_token_ids] == [CL, 2 * CL, CL, 2 * CL, 2 * CL]  # unknown id left alone
    # the served canvas length as the default (not num_spec_tokens), and lists already short stay short
    d = NS(req_ids=["plain"], draft_token_ids=[[-1] * 3])
    VS.cut_draft_widths(s, d, set())
    assert d.draft_token_ids == [[-1] * 3]


def test_cut_spec_tokens_trims_every_running_request_to_one_canvas_with_a_new_list():
    reqs = [FakeRequest("a", 5), FakeRequest("b", 5)]
    shared = [-1] * (2 * CL)  # vLLM's AsyncScheduler shares one placeholder list between requests
    for r in reqs:
        r.spec_token_ids = shared
    s = _fake_sched(reqs, 100)
    VS.cut_spec_tokens(s)
    assert [len(r.spec_token_ids) for r in reqs] == [CL, CL] and len(shared) == 2 * CL


def test_length_check_uses_one_canvas_not_num_spec_tokens():
    """With num_spec_tokens = 2 * CL a request whose next plain canvas fits is not finished for length."""
    s = _fake_sched([FakeRequest("fits", 100 - CL), FakeRequest("over", 100 - CL + 1)], 100)
    assert VS.finish_stuck_requests(s, None, {}, types=FAKE_VLLM_TYPES) == [("over", "length")]


def test_served_canvas_length_and_the_env_switch():
    def cfg(served, ckpt):
        return NS(diffusion_config=NS(canvas_length=served), model_config=NS(hf_config=NS(canvas_length=ckpt)))

    assert VS.served_canvas_length(cfg(512, 256)) == (256, True)
    assert VS.served_canvas_length(cfg(256, 256)) == (256, False)
    assert VS.served_canvas_length(cfg(384, 256)) == (384, False)
    assert VS.served_canvas_length(cfg(None, 256)) == (256, False)
    assert VS.served_canvas_length(NS(diffusion_config=NS(canvas_length=64))) == (64, False)
    assert VS.served_canvas_length(cfg(2, True)) == (2, False)  # a bool is no canvas length
    assert VS.fuse_commit_from_env({}) is False and VS.fuse_commit_from_env({VS.FUSE_COMMIT_ENV: "0"}) is False
    assert VS.fuse_commit_from_env({VS.FUSE_COMMIT_ENV: "1"}) is True
    for bad in ("yes", "true", " 1", "2"):
        with pytest.raises(ValueError, match=VS.FUSE_COMMIT_ENV):
            VS.fuse_commit_from_env({VS.FUSE_COMMIT_ENV: bad})


# ------------------------------------------------------------------------------------------ coverage (the server log)
def _coverage_lines(caplog):
    return [r.getMessage() for r in caplog.records if "fused commits so far" in r.getMessage()]


def test_commit_counts_count_each_row_of_a_step_by_width_and_tokens():
    """FusedCommitCounts.count_step (the synchronous scheduler's count, from the step's scheduler and runner
    outputs): a canvas row that returned tokens is a fused commit at 2 * CL, else plain (a CL row; a fused row the
    budget cut); a canvas row wider than CL that returned none is a miss; denoising rows and prefill chunks (no
    draft tokens, no tokens returned) count nothing."""
    rows = {"fused": 2 * CL, "plain": CL, "cut": CL + 3, "denoise": CL, "missed": 2 * CL, "prefill": 3 * CL,
            "chunk": 5}
    tokens = {"fused": CL, "plain": CL, "cut": CL}
    ids = list(rows)
    so = NS(num_scheduled_tokens=rows, scheduled_spec_decode_tokens={r: [-1] * q for r, q in rows.items()
                                                                     if r not in ("prefill", "chunk")})
    mro = NS(req_ids=ids, sampled_token_ids=[[5] * tokens.get(r, 0) for r in ids])
    c = VS.FusedCommitCounts(CL)
    c.count_step(so, mro)
    assert (c.num_fused, c.num_plain, c.num_missed, c.num_commits) == (1, 2, 1, 3)
    c.count_step(NS(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}), NS(req_ids=[], sampled_token_ids=[]))
    assert (c.num_fused, c.num_plain, c.num_missed, c.num_policy_cuts, c.num_lines) == (1, 2, 1, 0, 0)


def test_commit_counts_log_at_powers_of_two_and_when_no_request_is_left_never_per_step(caplog):
    """The rate rule: one INFO line when the commit count reaches a new power of two, one when the scheduler has no
    unfinished request left (only if the counts changed since the last line; the scheduler is asked only then),
    none otherwise: 100 steps of one commit each under load log 7 lines (1, 2, 4, ..., 64), not 100."""
    c = VS.FusedCommitCounts(CL, "synchronous", "uniform")

    def busy():
        return True

    def unasked():
        raise AssertionError("has_unfinished_requests called although nothing was committed since the last line")

    with captured_log(caplog, VS._log, logging.INFO):
        assert c.after_step(unasked) is False  # nothing committed yet
        logged = []
        for k in range(1, 101):
            c.num_fused += k % 3 != 0
            c.num_plain += k % 3 == 0
            logged.append(c.after_step(busy))
        assert [k for k, yes in enumerate(logged, 1) if yes] == [1, 2, 4, 8, 16, 32, 64]
        assert c.after_step(lambda: False) is True          # the load is done: its exact counts
        assert c.after_step(unasked) is False               # no new commit: no line, no question
        c.num_missed += 1
        c.num_policy_cuts += 2
        assert c.after_step(unasked) is False               # misses and cuts alone log nothing
        c.num_plain += 1
        assert c.after_step(busy) is False and c.after_step(lambda: False) is True
        c.log("at shutdown")
    lines = _coverage_lines(caplog)
    assert len(lines) == c.num_lines == 10 and all(r.levelno == logging.INFO for r in caplog.records)
    assert lines[0] == ("blockdiff: fused commits so far: 1 of 1 commits fused (0 plain, 0 wide rows missed, 0 fused "
                        "rows cut by fuse policy uniform); synchronous scheduler")
    assert lines[7] == ("blockdiff: fused commits so far: 67 of 100 commits fused (33 plain, 0 wide rows missed, 0 "
                        "fused rows cut by fuse policy uniform); synchronous scheduler, no request left")
    assert lines[-1] == ("blockdiff: fused commits so far: 67 of 101 commits fused (34 plain, 1 wide rows missed, 2 "
                         "fused rows cut by fuse policy uniform); synchronous scheduler, at shutdown")
    c.num_fused += 27  # 128 commits: the next power of two after the lines above
    assert c.after_step(busy) is True


# ------------------------------------------------------------------------------------------ sampler: the flag
def _commit_finishes_naive(st, slot: int) -> bool:
    """The commit rule written out on the host, one slot (the reference): a stop id at position h of the committed
    canvas is emitted if h < remaining; else the commit emits min(h + 1, CL) tokens (CL without a stop id) and ends
    the request if that reaches remaining = max_tokens - num_emitted."""
    canvas, eos = st.commit_canvas[slot], st.eos_token_ids[slot]
    eos = eos[eos >= 0]
    hits = torch.isin(canvas, eos).nonzero().flatten().tolist() if eos.numel() else []
    remaining = int(st.max_tokens[slot]) - int(st.num_emitted[slot])
    if hits and hits[0] < remaining:
        return True
    return (min(hits[0] + 1, st.canvas_length) if hits else st.canvas_length) >= remaining


@needs_stack
def test_commit_finishes_vec_equals_the_host_rule_on_random_states(tiny_model):
    """Random commit canvases, stop sets (some empty, some with a stop id inside), max_tokens and emitted counts:
    the device rule and DiffusionModelState.commit_finishes (which uses it) equal the rule written out on the host,
    slot by slot."""
    from blockdiff.integration.batch import NewRequest
    from blockdiff.integration.model_state import DiffusionModelState
    from blockdiff.integration.sampler import commit_finishes_vec
    from blockdiff.sampler import COMMIT

    R = 6
    ms = DiffusionModelState.for_harness(tiny_model, max_num_reqs=R, max_num_tokens=2 * CL, canvas_length=CL,
                                         device="cpu", default_params=params())
    for r in range(R):
        ms.add_request(r, NewRequest(f"r{r}", [3, 4], params()))
    g = torch.Generator().manual_seed(0)
    st = ms.state
    seen = set()
    for _ in range(60):
        st.phase[:] = COMMIT
        st.commit_canvas[:] = torch.randint(3, 12, (R, CL), generator=g)
        st.eos_token_ids[:] = -1
        for r in range(R):
            k = int(torch.randint(0, 4, (1,), generator=g))
            st.eos_token_ids[r, :k] = torch.randint(3, 14, (k,), generator=g)
        st.max_tokens[:] = torch.randint(1, 4 * CL, (R,), generator=g)
        st.num_emitted[:] = (st.max_tokens - torch.randint(-2, 2 * CL, (R,), generator=g)).clamp(min=0)
        slots = torch.randperm(R, generator=g)
        got = commit_finishes_vec(st, slots).tolist()
        want = [ms.commit_finishes(int(s)) for s in slots]
        assert got == want
        assert want == [_commit_finishes_naive(st, int(s)) for s in slots]
        seen.update(want)
    assert seen == {True, False}
    with pytest.raises(TypeError, match="int64"):
        commit_finishes_vec(st, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        commit_finishes_vec(st, torch.zeros(1, 1, dtype=torch.int64))


def _vllm_fuse_state(tiny_monkeypatch, R=3, fuse=True):
    from test_vllm_plugin import _StandInVllmModel

    from blockdiff.integration.model_state import DiffusionModelState

    vllm_sampler_output_class(tiny_monkeypatch)
    model = _StandInVllmModel(64, 8)
    model.embedding_weight = model.emb.weight.detach()
    ms = DiffusionModelState.for_harness(model, max_num_reqs=R, max_num_tokens=6 * CL, canvas_length=CL,
                                         device="cpu", default_params=params(), fuse_commit=fuse)
    ms.mode = "vllm"
    ms.inputs_embeds_buf = torch.zeros(6 * CL, 8)
    ms.causal_buf_i32 = torch.zeros(R, dtype=torch.int32)
    draft = torch.zeros(R, 2 * CL, dtype=torch.int64)
    sampler, _ = ms.custom_sampler(NS(req_states=NS(draft_tokens=draft)), backend="reference")
    return ms, sampler


def _add(ms, slot, rid, **kw):
    from blockdiff.integration.batch import NewRequest

    ms.add_request(slot, NewRequest(rid, [1, 2], params(**kw)))


@needs_stack
def test_vllm_output_flags_a_convergence_whose_commit_does_not_finish(monkeypatch):
    """Step cap 1: every canvas converges at its step. Row "go" (no cap on tokens) reports -1, row "last" (its
    commit reaches max_tokens) reports 0; with fuse_commit off nobody reports -1."""
    from blockdiff.sampler import COMMIT, DENOISE

    for fuse in (True, False):
        ms, sampler = _vllm_fuse_state(monkeypatch, fuse=fuse)
        _add(ms, 0, "go", max_denoising_steps=1)
        _add(ms, 1, "last", max_denoising_steps=1, max_tokens=CL)
        _add(ms, 2, "slow", max_denoising_steps=3)
        ms.state.phase[:3] = DENOISE
        b = make_batch([("go", 0, CL, 2, 2, None), ("last", 1, CL, 2, 2, None), ("slow", 2, CL, 2, 2, None)])
        ms.prepare_inputs(b, None)
        out = sampler(torch.randn(3 * CL, 64, generator=torch.Generator().manual_seed(1)), b)
        assert ms.state.phase[:3].tolist() == [COMMIT, COMMIT, DENOISE]
        assert out.num_nans.tolist() == ([-1, 0, 0] if fuse else [0, 0, 0])


@needs_stack
def test_vllm_fused_row_truncated_by_the_budget_commits_and_rejects_the_rest(monkeypatch):
    """Hardening (a): a COMMIT row the token budget cut to CL < q < 2 * CL commits its canvas (num_sampled CL),
    rejects q - CL drafts and starts the next canvas unstepped (as after a plain commit): no stall, no retry."""
    from blockdiff.sampler import COMMIT, DENOISE

    ms, sampler = _vllm_fuse_state(monkeypatch)
    _add(ms, 0, "c")
    st = ms.state
    st.phase[0] = COMMIT
    st.commit_canvas[0] = torch.arange(CL) + 10
    b = make_batch([("c", 0, CL + 3, 2, 2, None)])
    ms.prepare_inputs(b, None)
    out = sampler(torch.randn(CL + 3, 64, generator=torch.Generator().manual_seed(2)), b)
    assert out.num_sampled.tolist() == [CL] and out.num_rejected.tolist() == [3]
    assert out.sampled_token_ids[0].tolist() == list(range(10, 10 + CL))
    assert st.phase[0] == DENOISE and st.step[0] == 0 and st.canvas_index[0] == 1 and st.num_emitted[0] == CL
    assert out.num_nans.tolist() == [0]


@needs_stack
def test_vllm_two_canvas_row_that_is_no_commit_is_stalled_by_a_device_mask(monkeypatch):
    """Hardening (b): a DENOISE row scheduled 2 * CL tokens (never so by the plugin's scheduler) leaves its state
    exactly as it was and reports num_sampled 0, num_rejected 2 * CL; the fused COMMIT row beside it commits and
    takes the next canvas's first step."""
    from blockdiff.sampler import COMMIT, DENOISE

    ms, sampler = _vllm_fuse_state(monkeypatch)
    _add(ms, 0, "d")
    _add(ms, 1, "c")
    st = ms.state
    st.phase[0], st.phase[1] = DENOISE, COMMIT
    st.canvas[0] = torch.arange(CL) + 30
    st.commit_canvas[1] = torch.arange(CL) + 10
    before = {k: v[0].clone() for k, v in vars(st).items() if torch.is_tensor(v) and v.dim() and v.shape[0] == 3}
    b = make_batch([("d", 0, 2 * CL, 2, 2, None), ("c", 1, 2 * CL, 2, 2, None)])
    ms.prepare_inputs(b, None)
    out = sampler(torch.randn(4 * CL, 64, generator=torch.Generator().manual_seed(3)), b)
    assert out.num_sampled.tolist() == [0, CL] and out.num_rejected.tolist() == [2 * CL, CL]
    assert (out.sampled_token_ids[0] == -1).all() and out.num_nans.tolist() == [0, 0]
    for k, v in before.items():
        assert torch.equal(getattr(st, k)[0], v), k
    assert st.phase[1] == DENOISE and st.step[1] == 1 and st.canvas_index[1] == 1


def _three_row_step(monkeypatch, fuse, commit_q=CL):
    """A vLLM-mode state (4 slots) with a denoise, a commit (``commit_q`` query tokens) and a prefill row in slots
    0-2, the metadata builder stubbed, and the step's batch: (ms, metadata-builder calls, CUDAGraphMode, batch)."""
    from blockdiff.sampler import COMMIT, DENOISE

    ms, _ = _vllm_fuse_state(monkeypatch, R=4, fuse=fuse)
    calls = vllm_attn_metadata_stubs(monkeypatch)
    from vllm.config.compilation import CUDAGraphMode

    ms.model_config = NS(max_model_len=256)
    if "max_model_len" not in dir(type(ms)):
        ms.max_model_len = 256
    for slot, rid in enumerate("dcp"):
        _add(ms, slot, rid)
    ms.state.phase[0], ms.state.phase[1] = DENOISE, COMMIT
    b = make_batch([("d", 0, CL, 2, 2, None), ("c", 1, commit_q, 2, 2, None), ("p", 2, 2, 0, 2, [1, 2])])
    return ms, calls, CUDAGraphMode, b


def _padded_piecewise_step(monkeypatch, fuse):
    """:func:`_three_row_step` plus the runner's query_start_loc with one padding row: (ms, calls, CUDAGraphMode,
    batch, qsl)."""
    ms, calls, CUDAGraphMode, b = _three_row_step(monkeypatch, fuse)
    qsl = np.concatenate([b.query_start_loc_np, [b.num_tokens]]).astype(np.int32)  # the runner's padding row
    return ms, calls, CUDAGraphMode, b, qsl


@needs_stack
def test_vllm_prepare_attn_fills_the_num_causal_q_buffer_in_place(monkeypatch):
    """vLLM mode with fuse_commit: num_causal_q_buf (the same storage each step) holds CL for a fused commit row,
    0 for a denoise row, the prompt chunk for a prefill row and 0 for FULL-graph padding rows; every metadata object
    carries it, during capture too; with fuse_commit off nothing is attached."""
    ms, calls, CUDAGraphMode, b = _three_row_step(monkeypatch, True, commit_q=2 * CL)
    padded = NS(**{k: getattr(b, k) for k in ("num_reqs", "num_tokens", "idx_mapping", "query_start_loc",
                                              "query_start_loc_np", "seq_lens", "num_scheduled_tokens")},
                num_reqs_after_padding=4, num_tokens_after_padding=b.num_tokens)
    ptr = ms.num_causal_q_buf.data_ptr()
    ms.num_causal_q_buf.fill_(7)
    for mode, batch, capture, want in ((None, b, False, [0, CL, 2]), (CUDAGraphMode.FULL, padded, False,
                                                                        [0, CL, 2, 0]),
                                       (CUDAGraphMode.FULL, padded, True, [0, CL, 2, 0])):
        meta = ms.prepare_attn(batch, mode, (b.block_table,), b.slot_mapping, None, None, for_capture=capture)
        ncq = meta["layer.0"]._blockdiff_num_causal_q
        assert ncq.tolist() == want and ncq.data_ptr() == ptr and meta["layer.2"]._blockdiff_num_causal_q is ncq
        assert calls[-1]["for_cudagraph_capture"] is capture
    ms.fuse_commit = False
    meta = ms.prepare_attn(b, None, (b.block_table,), b.slot_mapping, None, None)
    assert not hasattr(meta["layer.0"], "_blockdiff_num_causal_q")
    with pytest.raises(ValueError, match="num_reqs"):
        ms.fill_num_causal_q(b, 2)




@needs_stack
@pytest.mark.parametrize("fuse", [False, True])
def test_vllm_prepare_attn_metadata_rows_agree_when_the_runner_pads_a_piecewise_step(monkeypatch, fuse):
    """vLLM 0.26's runner pads a PIECEWISE step's rows too under VLLM_USE_BREAKABLE_CUDAGRAPH=1 (its mixed
    descriptors then carry num_reqs): query_start_loc has num_reqs_after_padding + 1 entries while the step has
    num_reqs rows. prepare_attn builds metadata for num_reqs rows there (the attention runs eagerly at a break point,
    reading the step's real batch), so its query_start_loc must be cut to num_reqs + 1 as vLLM's own model states
    cut it: was passed whole, so the causal flags (num_reqs) and the row starts (num_reqs_after_padding) disagreed
    and the CUSTOM backend's conversion raised on every such step, stopping the engine."""
    from blockdiff.attention import causal_row_counts

    ms, calls, CUDAGraphMode, b, qsl = _padded_piecewise_step(monkeypatch, fuse)
    padded = NS(**{k: getattr(b, k) for k in ("num_reqs", "num_tokens", "idx_mapping", "seq_lens",
                                              "num_scheduled_tokens")},
                query_start_loc=torch.as_tensor(qsl), query_start_loc_np=qsl, num_reqs_after_padding=4,
                num_tokens_after_padding=b.num_tokens + 5)
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE, None):
        meta = ms.prepare_attn(padded, mode, (b.block_table,), b.slot_mapping, None, None)
        kw = calls[-1]
        assert kw["num_reqs"] == 3 and kw["num_tokens"] == b.num_tokens
        assert kw["query_start_loc_gpu"].tolist() == [0, CL, 2 * CL, 2 * CL + 2]
        assert kw["query_start_loc_cpu"].tolist() == [0, CL, 2 * CL, 2 * CL + 2]
        ncq = causal_row_counts(kw["causal"].bool(), kw["query_start_loc_gpu"])  # what the CUSTOM backend does
        assert ncq.tolist() == [0, CL, 2]
        if fuse:
            assert meta["layer.0"]._blockdiff_num_causal_q.tolist() == [0, CL, 2]
    meta = ms.prepare_attn(padded, CUDAGraphMode.FULL, (b.block_table,), b.slot_mapping, None, None)
    kw = calls[-1]  # FULL: the padded rows, as before
    assert kw["num_reqs"] == 4 and kw["query_start_loc_gpu"].shape[0] == 5 and kw["causal"].tolist() == [0, 1, 1, 0]


@needs_stack
@pytest.mark.parametrize("fuse", [False, True])
def test_vllm_prepare_attn_block_tables_have_the_metadata_rows_on_a_padded_piecewise_step(monkeypatch, fuse):
    """vLLM 0.26's runner gathers the block tables with num_reqs_after_padding rows (``gather_block_tables``:
    ``bt[:num_reqs_padded]``), also on a PIECEWISE step it padded under VLLM_USE_BREAKABLE_CUDAGRAPH=1, and
    FlashAttention's metadata builder keeps them whole. prepare_attn builds that step's metadata for the real rows,
    so its block tables must be cut to them too: were passed whole, so the CUSTOM backend's attention call (row
    starts and seq_lens for 3 rows, a block table of 4) raised "block_table must have B=3 rows" on every such step.
    FULL keeps the padded rows everywhere. Checked the way the CUSTOM backend calls the attention."""
    from blockdiff.attention import attention, causal_row_counts

    ms, calls, CUDAGraphMode, b, qsl = _padded_piecewise_step(monkeypatch, fuse)
    bt = torch.cat([b.block_table, torch.zeros(1, b.block_table.shape[1], dtype=torch.int32)])  # gathered, padded
    seq_lens = torch.cat([b.seq_lens, torch.zeros(1, dtype=b.seq_lens.dtype)])
    padded = NS(**{k: getattr(b, k) for k in ("num_reqs", "num_tokens", "idx_mapping", "num_scheduled_tokens")},
                seq_lens=seq_lens, query_start_loc=torch.as_tensor(qsl), query_start_loc_np=qsl,
                num_reqs_after_padding=4, num_tokens_after_padding=b.num_tokens + 5)
    H, D, page = 2, 8, 16
    kv = torch.randn(1, page, 1, D, generator=torch.Generator().manual_seed(0))
    q = torch.randn(b.num_tokens + 5, H, D, generator=torch.Generator().manual_seed(1))
    for mode, rows in ((CUDAGraphMode.PIECEWISE, 3), (CUDAGraphMode.NONE, 3), (None, 3), (CUDAGraphMode.FULL, 4)):
        meta = ms.prepare_attn(padded, mode, (bt,), b.slot_mapping, None, None)
        kw = calls[-1]
        assert kw["num_reqs"] == rows and [t.shape[0] for t in kw["block_tables"]] == [rows]
        # what build_attn_metadata and the CUSTOM backend (BlockdiffAttentionImpl.forward) then do
        sl = kw["seq_lens"][: kw["num_reqs"]]
        ncq = meta["layer.0"]._blockdiff_num_causal_q if fuse else causal_row_counts(
            kw["causal"][: sl.shape[0]].bool(), kw["query_start_loc_gpu"])
        n = kw["num_tokens"]
        attention(q[:n], kv, kv, cu_seqlens_q=kw["query_start_loc_gpu"], seq_lens=sl, num_causal_q=ncq,
                  block_table=kw["block_tables"][0], backend="reference", check_values=False)


def test_attach_num_causal_q_refuses_what_cannot_carry_it():
    from blockdiff.integration.model_state import attach_num_causal_q

    class Frozen:
        __slots__ = ()

    ncq = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="_blockdiff_num_causal_q"):
        attach_num_causal_q({"l": Frozen()}, ncq)
    with pytest.raises(TypeError, match="int32"):
        attach_num_causal_q({"l": NS()}, ncq.long())
    m = NS()
    attach_num_causal_q([{"a": m, "b": m}], ncq)
    assert m._blockdiff_num_causal_q is ncq


# ------------------------------------------------------------------------------------------ a real vLLM scheduler
@pytest.fixture(scope="module")
def tiny_hf_folder(tmp_path_factory):
    """An exported tiny DiffusionGemma config (canvas_length CL, byte tokenizer): what vLLM's ModelConfig reads."""
    from blockdiff.model import tiny_config
    from blockdiff.model.export import export_hf

    out = tmp_path_factory.mktemp("tiny_hf")
    export_hf(tiny_config(vocab_size=259, canvas_length=CL), out)
    return out


def _real_scheduler(monkeypatch, folder, *, asynchronous, max_model_len=128, served=2 * CL):
    """The plugin's scheduler on vLLM's own classes, served with --diffusion-config canvas_length ``served``."""
    import vllm.config.vllm as config_module
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.config.diffusion import DiffusionConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    monkeypatch.setattr(config_module, "HAS_TRITON", True)  # model runner v2's check (no kernel runs here)
    mc = ModelConfig(model=str(folder), tokenizer=str(folder), dtype="float32", language_model_only=True,
                     max_model_len=max_model_len)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=max_model_len,
                         is_encoder_decoder=False, async_scheduling=asynchronous)
    cc = CacheConfig(block_size=16, enable_prefix_caching=False)  # as the benchmark serves
    cc.num_gpu_blocks = 64
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu"),
                    diffusion_config=DiffusionConfig(canvas_length=served))
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer0"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32))])
    name = "BlockdiffDiffusionAsyncScheduler" if asynchronous else "BlockdiffDiffusionScheduler"
    cls = getattr(VS, name)
    return cls(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
               block_size=16)


def _request(rid, n_prompt, max_tokens=64):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, prompt_token_ids=list(range(3, 3 + n_prompt)), sampling_params=SamplingParams(
        max_tokens=max_tokens), pooling_params=None)


def _step(s, sampled=None, nans=None, *, drafts=True):
    """One engine step of the synchronous engine core: schedule, a ModelRunnerOutput, update_from_output, then
    (post_step) the worker's draft lists, num_spec_tokens long for every scheduled request."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[list((sampled or {}).get(r, [])) for r in ids],
                            num_nans_in_logits=nans)
    out = s.update_from_output(so, mro)
    if drafts:
        s.update_draft_token_ids(DraftTokenIds(ids, [[-1] * s.num_spec_tokens for _ in ids]))
    return so, out


@needs_vllm
def test_real_sync_scheduler_fuses_on_minus_one_and_moves_kv_by_one_canvas(monkeypatch, tiny_hf_folder):
    """vLLM's Scheduler (0.26.0) / DiffusionScheduler (0.33.0) with num_spec_tokens = 2 * CL: canvas rows get CL
    drafts; after a step reporting -1 the request gets 2 * CL; that row returning CL tokens moves its KV position by
    CL (CL accepted, CL rejected); -1 is no error and vLLM never sees it."""
    s = _real_scheduler(monkeypatch, tiny_hf_folder, asynchronous=False)
    assert s.num_spec_tokens == 2 * CL and (s.blockdiff_canvas_length, s.blockdiff_fused_layout) == (CL, True)
    r = _request("a", 10)
    s.add_request(r)
    so, _ = _step(s)  # prefill
    assert so.num_scheduled_tokens == {"a": 10} and len(r.spec_token_ids) == CL
    so, out = _step(s, nans={"a": -1})  # a denoising step whose canvas converged: commit next, not the last
    assert so.num_scheduled_tokens == {"a": CL} and len(so.scheduled_spec_decode_tokens["a"]) == CL
    assert r.num_computed_tokens == 10 and r.num_nans_in_logits == 0 and not r.is_finished()
    assert all(o.finish_reason is None for eco in out.values() for o in eco.outputs)
    assert len(r.spec_token_ids) == 2 * CL
    so, out = _step(s, sampled={"a": list(range(20, 20 + CL))}, nans={"a": 0})  # the fused commit
    assert so.num_scheduled_tokens == {"a": 2 * CL} and len(so.scheduled_spec_decode_tokens["a"]) == 2 * CL
    assert r.num_computed_tokens == 10 + CL and r.num_tokens == 10 + CL and list(r.output_token_ids) == list(range(20, 20 + CL))
    assert len(r.spec_token_ids) == CL  # no flag: one canvas
    so, _ = _step(s)
    assert so.num_scheduled_tokens == {"a": CL} and r.num_computed_tokens == 10 + CL


@needs_vllm
def test_real_sync_scheduler_counts_fused_and_plain_commits_and_logs_them(monkeypatch, tiny_hf_folder, caplog):
    """BLOCKDIFF_FUSE_COMMIT=1, vLLM's Scheduler / DiffusionScheduler in the two-canvas layout: the steps' outcomes
    (a fused commit after a -1 flag, a plain commit without one, denoising steps, a prefill) are counted in
    blockdiff_commit_counts exactly, and the server log's INFO line reports them at the first commit, the second,
    when no request is left, and at shutdown; a step without a commit adds no line."""
    from vllm.v1.request import RequestStatus

    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, "1")
    s = _real_scheduler(monkeypatch, tiny_hf_folder, asynchronous=False)
    c = s.blockdiff_commit_counts
    assert s._blockdiff_counting and c.scheduler == "synchronous" and c.policy == "any"
    a, b = _request("a", 10, max_tokens=64), _request("b", 12, max_tokens=CL)
    s.add_request(a)
    with captured_log(caplog, VS._log, logging.INFO):
        _step(s)                                                     # prefill
        _step(s, nans={"a": -1})                                     # converged, commits next: flagged
        so, _ = _step(s, sampled={"a": list(range(20, 20 + CL))})    # the fused commit
        assert so.num_scheduled_tokens == {"a": 2 * CL} and (c.num_fused, c.num_plain) == (1, 0)
        s.add_request(b)
        for _ in range(3):
            _step(s, nans={"a": 0})                                  # denoising steps (and b's prefill)
        so, _ = _step(s, sampled={"a": list(range(40, 40 + CL))})    # a plain commit: no flag before it
        assert so.num_scheduled_tokens["a"] == CL and (c.num_fused, c.num_plain) == (1, 1)
        assert len(_coverage_lines(caplog)) == 2                     # at 1 and 2 commits
        so, _ = _step(s, sampled={"b": list(range(60, 60 + CL))})    # b's commit ends b (max_tokens): plain
        assert b.is_finished() and (c.num_fused, c.num_plain, c.num_missed) == (1, 2, 0)
        assert len(_coverage_lines(caplog)) == 2                     # 3 commits: no power of two, a is running
        s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)   # the client leaves
        _step(s)                                                     # no request left after it
        s.shutdown()
    lines = _coverage_lines(caplog)
    tail = "(2 plain, 0 wide rows missed, 0 fused rows cut by fuse policy any); synchronous scheduler"
    assert lines == ["blockdiff: fused commits so far: 1 of 1 commits fused (0 plain, 0 wide rows missed, 0 fused "
                     "rows cut by fuse policy any); synchronous scheduler",
                     "blockdiff: fused commits so far: 1 of 2 commits fused (1 plain, 0 wide rows missed, 0 fused "
                     "rows cut by fuse policy any); synchronous scheduler",
                     f"blockdiff: fused commits so far: 1 of 3 commits fused {tail}, no request left",
                     f"blockdiff: fused commits so far: 1 of 3 commits fused {tail}, at shutdown"], lines


@needs_vllm
@pytest.mark.parametrize("served, env", [(CL, "1"), (2 * CL, "0")])
def test_real_sync_scheduler_counts_and_logs_nothing_when_fused_commits_are_not_served(
        monkeypatch, tiny_hf_folder, caplog, served, env):
    """One-canvas layout, or the switch off: no per-step count (count_step never runs) and no coverage line, at
    shutdown neither."""
    monkeypatch.setattr(VS.FusedCommitCounts, "count_step", lambda *a: pytest.fail("counted without fusing"))
    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, env)
    s = _real_scheduler(monkeypatch, tiny_hf_folder, asynchronous=False, served=served)
    assert not s._blockdiff_counting
    s.add_request(_request("a", 10, max_tokens=CL))
    with captured_log(caplog, VS._log, logging.INFO):
        _step(s)
        _step(s, sampled={"a": list(range(20, 20 + CL))})
        s.shutdown()
    assert _coverage_lines(caplog) == [] and s.blockdiff_commit_counts.num_commits == 0


@needs_vllm
def test_real_sync_scheduler_gives_one_canvas_when_the_next_does_not_fit(monkeypatch, tiny_hf_folder):
    """num_tokens + 2 * CL > max_model_len >= num_tokens + CL: a flagged request gets CL drafts (a plain commit),
    and is not finished for length."""
    s = _real_scheduler(monkeypatch, tiny_hf_folder, asynchronous=False, max_model_len=32)
    r = _request("a", 32 - 2 * CL + 1)
    s.add_request(r)
    _step(s)
    so, _ = _step(s, nans={"a": -1})
    assert so.num_scheduled_tokens == {"a": CL} and len(r.spec_token_ids) == CL and not r.is_finished()
    so, _ = _step(s)
    assert so.num_scheduled_tokens == {"a": CL}


@needs_vllm
def test_real_sync_scheduler_with_one_canvas_served_never_fuses(monkeypatch, tiny_hf_folder):
    """--diffusion-config canvas_length = CL (the checkpoint's): no fused layout, a -1 changes nothing: the row stays
    CL and the request is no failure. (blockdiff's worker never sends one in this layout: the model state's
    fuse_commit needs the two-canvas layout, so the scheduler no longer scans num_nans_in_logits for flags there;
    vLLM only records the value and counts values > 0.)"""
    s = _real_scheduler(monkeypatch, tiny_hf_folder, asynchronous=False, served=CL)
    assert (s.blockdiff_canvas_length, s.blockdiff_fused_layout) == (CL, False)
    r = _request("a", 10)
    s.add_request(r)
    _step(s)
    _step(s, nans={"a": -1})
    so, _ = _step(s)
    assert so.num_scheduled_tokens == {"a": CL} and not r.is_finished() and s.blockdiff_fuse_next == set()


@needs_vllm
def test_real_async_scheduler_always_schedules_one_canvas(monkeypatch, tiny_hf_folder):
    """AsyncScheduler (0.26.0) / DiffusionAsyncScheduler (0.33.0) in the two-canvas layout without
    BLOCKDIFF_FUSE_COMMIT (serve_fused.sh's ``layout``): its placeholders are num_spec_tokens = 2 * CL wide; the
    plugin's schedule cuts them to CL, -1 flags or not (it never fuses; with the switch it predicts fused commits
    from the step cap: test_vllm_fuse_commit_async.py)."""
    monkeypatch.delenv(VS.FUSE_COMMIT_ENV, raising=False)
    s = _real_scheduler(monkeypatch, tiny_hf_folder, asynchronous=True)
    assert s.blockdiff_predictor is None
    r = _request("a", 10)
    s.add_request(r)
    _step(s, drafts=False)
    widths = []
    for k in range(4):
        so, _ = _step(s, nans={"a": -1}, drafts=False)
        widths.append(so.num_scheduled_tokens.get("a"))
        assert r.num_nans_in_logits == 0 and not r.is_finished()
    assert widths == [CL] * 4 and s.blockdiff_fuse_next == set()


# ------------------------------------------------------------------------------------------ the model state's switch
@needs_stack
@needs_vllm
@pytest.mark.parametrize("served, env, fused", [(2 * CL, "1", True), (2 * CL, None, False), (CL, "1", False),
                                                (2 * CL, "0", False)])
def test_vllm_model_state_fuses_only_when_asked_and_served_with_two_canvases(monkeypatch, served, env, fused):
    """DiffusionModelState built through vLLM's ModelState.__init__ (configs as namespaces): CL is the checkpoint's
    when --diffusion-config canvas_length is twice it, and fuse_commit is on only then and with
    BLOCKDIFF_FUSE_COMMIT=1; any other value of the variable stops the start with a ValueError naming it."""
    from test_vllm_plugin import _StandInVllmModel

    from blockdiff.integration.model_state import DiffusionModelState

    H = 8
    mc = NS(get_inputs_embeds_size=lambda: H, dtype=torch.float32, hf_text_config=NS(hidden_size=H),
            hf_config=NS(canvas_length=CL), try_get_generation_config=lambda: {}, get_vocab_size=lambda: 64,
            max_model_len=256)
    cfg = NS(model_config=mc, scheduler_config=NS(max_num_seqs=2, max_num_batched_tokens=64, async_scheduling=False),
             diffusion_config=NS(canvas_length=served, max_denoising_steps=2))
    if env is None:
        monkeypatch.delenv(VS.FUSE_COMMIT_ENV, raising=False)
    else:
        monkeypatch.setenv(VS.FUSE_COMMIT_ENV, env)
    ms = DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu"))
    assert ms.canvas_length == CL and ms.fuse_commit is fused and ms.default_params.canvas_length == CL
    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, "on")
    with pytest.raises(ValueError, match=VS.FUSE_COMMIT_ENV):
        DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu"))


@needs_stack
@needs_vllm
def test_vllm_model_state_refuses_fused_commits_when_vllm_raises_on_any_nan_count(monkeypatch):
    """vLLM 0.33.0's runner, with VLLM_RAISE_ON_LOGIT_NANS=1, raises on a num_nans_in_logits with any nonzero value
    (``raise_if_nan_logits``: ``any(values)``), so every -1 flag would stop the engine ("NaNs detected in logits: {}").
    Fused commits and that variable cannot run together: the model state stops the start with a ValueError naming
    both. vLLM 0.26.0 has no such variable (nothing to refuse)."""
    import vllm.envs as envs
    from test_vllm_plugin import _StandInVllmModel

    from blockdiff.integration.model_state import DiffusionModelState

    H = 8
    mc = NS(get_inputs_embeds_size=lambda: H, dtype=torch.float32, hf_text_config=NS(hidden_size=H),
            hf_config=NS(canvas_length=CL), try_get_generation_config=lambda: {}, get_vocab_size=lambda: 64,
            max_model_len=256)
    cfg = NS(model_config=mc, scheduler_config=NS(max_num_seqs=2, max_num_batched_tokens=64, async_scheduling=False),
             diffusion_config=NS(canvas_length=2 * CL, max_denoising_steps=2))
    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, "1")
    monkeypatch.setenv("VLLM_RAISE_ON_LOGIT_NANS", "1")
    try:
        raises = bool(envs.VLLM_RAISE_ON_LOGIT_NANS)
    except AttributeError:  # vLLM 0.26.0
        raises = False
    if raises:
        from vllm.v1.worker.utils import raise_if_nan_logits

        with pytest.raises(RuntimeError, match="NaNs detected"):  # why: the flag alone stops the engine
            raise_if_nan_logits({"a": VS.FUSE_NEXT_FLAG, "b": 0})
        with pytest.raises(ValueError, match=f"{VS.FUSE_COMMIT_ENV}.*VLLM_RAISE_ON_LOGIT_NANS"):
            DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu"))
    else:
        assert DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu")).fuse_commit is True
    # the switch off (or the variable off): no refusal
    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, "0")
    assert DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu")).fuse_commit is False
    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, "1")
    monkeypatch.setenv("VLLM_RAISE_ON_LOGIT_NANS", "0")
    assert DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu")).fuse_commit is True


@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True])
def test_one_canvas_layout_schedulers_do_no_per_request_width_work(monkeypatch, tiny_hf_folder, asynchronous):
    """Served with canvas_length = CL (the default: no fused layout, the switch cannot be on) the plugin's
    schedulers are what they were before fused commits: no per-request loop cutting draft lists or placeholders
    each step, nor the uniform fuse policy's, nor a scan of num_nans_in_logits for -1 flags (num_spec_tokens is CL
    already; vLLM 0.33.0's own DiffusionScheduler trims per-request widths; the worker flags only in the two-canvas
    layout), and the widths stay CL."""
    def boom(*a, **k):
        raise AssertionError("a per-request width loop ran without the fused layout")

    monkeypatch.setattr(VS, "cut_spec_tokens", boom)
    monkeypatch.setattr(VS, "cut_draft_widths", boom)
    monkeypatch.setattr(VS, "keep_uniform_widths", boom)
    monkeypatch.setattr(VS, "split_fuse_flags", boom)  # the worker never flags in this layout: no flag scan either
    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, "1")  # the switch alone (served with CL) adds no work either
    monkeypatch.setenv(VS.FUSE_POLICY_ENV, "uniform")  # nor the uniform policy
    s = _real_scheduler(monkeypatch, tiny_hf_folder, asynchronous=asynchronous, served=CL)
    assert s.blockdiff_fused_layout is False and s.blockdiff_predictor is None
    s.add_request(_request("a", 10))
    _step(s, drafts=not asynchronous)
    widths = [_step(s, nans={"a": 0}, drafts=not asynchronous)[0].num_scheduled_tokens.get("a") for _ in range(3)]
    assert widths == [CL] * 3


@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True])
def test_uniform_policy_pass_runs_only_when_fused_commits_are_served(monkeypatch, tiny_hf_folder, asynchronous):
    """In the two-canvas layout without BLOCKDIFF_FUSE_COMMIT every draft / placeholder list is cut to CL before
    vLLM schedules, so no row can be fused: BLOCKDIFF_FUSE_POLICY=uniform adds no per-step pass there."""
    def boom(*a, **k):
        raise AssertionError("the uniform policy's pass ran without fused commits")

    monkeypatch.setattr(VS, "keep_uniform_widths", boom)
    monkeypatch.delenv(VS.FUSE_COMMIT_ENV, raising=False)
    monkeypatch.setenv(VS.FUSE_POLICY_ENV, "uniform")
    s = _real_scheduler(monkeypatch, tiny_hf_folder, asynchronous=asynchronous)
    assert s.blockdiff_fused_layout is True and s.blockdiff_fuse_policy == "uniform"
    s.add_request(_request("a", 10))
    _step(s, drafts=not asynchronous)
    widths = [_step(s, nans={"a": 0}, drafts=not asynchronous)[0].num_scheduled_tokens.get("a") for _ in range(3)]
    assert widths == [CL] * 3


@needs_stack
@needs_vllm
@pytest.mark.parametrize("env", ["0", "1"])
def test_vllm_model_state_in_the_two_canvas_layout_needs_the_plugins_scheduler(monkeypatch, env):
    """Served with --diffusion-config canvas_length = 2 * CL, vLLM's own schedulers (--scheduler-cls unset: 0.26.0's
    Scheduler / AsyncScheduler, 0.33.0's DiffusionScheduler) schedule every canvas row 2 * CL tokens, which the model
    state (CL from the checkpoint) can only stall: every request would hang with no token, the switch on or off.
    The start stops with a ValueError naming --scheduler-cls; the plugin's schedulers (or a subclass) pass. A
    one-canvas layout needs one of them too (was: served on by vLLM's own, which never finishes a request at
    max_model_len)."""
    from test_vllm_plugin import _StandInVllmModel

    from blockdiff.integration.model_state import DiffusionModelState

    H = 8
    mc = NS(get_inputs_embeds_size=lambda: H, dtype=torch.float32, hf_text_config=NS(hidden_size=H),
            hf_config=NS(canvas_length=CL), try_get_generation_config=lambda: {}, get_vocab_size=lambda: 64,
            max_model_len=256)
    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, env)
    monkeypatch.delenv("VLLM_RAISE_ON_LOGIT_NANS", raising=False)

    def build(served, scheduler_cls, asynchronous=False):
        sc = NS(max_num_seqs=2, max_num_batched_tokens=64, async_scheduling=asynchronous, scheduler_cls=scheduler_cls)
        cfg = NS(model_config=mc, scheduler_config=sc,
                 diffusion_config=NS(canvas_length=served, max_denoising_steps=2))
        return DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu"))

    for cls, asynchronous in ((None, False), (None, True), ("vllm.v1.core.sched.scheduler.Scheduler", False),
                              ("vllm.v1.core.sched.async_scheduler.AsyncScheduler", True)):
        with pytest.raises(ValueError, match="--scheduler-cls"):
            build(2 * CL, cls, asynchronous)
    for name, asynchronous in (("BlockdiffDiffusionScheduler", False), ("BlockdiffDiffusionAsyncScheduler", True)):
        ms = build(2 * CL, f"blockdiff.integration.vllm_scheduler.{name}", asynchronous)
        assert ms.canvas_length == CL and ms.fuse_commit is (env == "1")
    sub = type("Mine", (VS.BlockdiffDiffusionScheduler,), {})
    assert build(2 * CL, sub).canvas_length == CL
    with pytest.raises(ValueError, match="--scheduler-cls"):  # one canvas: needs it too (its own requests at
        build(CL, None)                                        # max_model_len would hang, test_vllm_fuse_commit_async)
