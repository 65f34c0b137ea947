"""Fused commit (issue 25's stretch goal, ``HarnessRunner(fuse_commit=True)`` /
``DiffusionModelState.fuse_commit``): a converged canvas is committed (CL causal rows) and the next canvas's first
denoising step (CL bidirectional rows) runs in the same forward pass.

The key property: in float32 the fused run's outputs equal the unfused run's token for token (greedy and sampled:
the noise is keyed by request, canvas and step, not by the forward pass), with exactly one forward pass fewer per
non-final canvas of a request.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from integration_helpers import (CL, make_batch, needs_stack, params, prompt, vllm_attn_metadata_stubs,
                                 vllm_sampler_output_class)

pytestmark = needs_stack

GREEDY = dict(t_min=0.0, t_max=0.0)


def _outputs(res):
    return {k: (v.finish_reason, v.output_token_ids) for k, v in res.items()}


def _run(make_runner, reqs, *, fuse, **kw):
    """``reqs``: (req_id, prompt ids, params, arrival_step). Returns (runner, results)."""
    kw.setdefault("max_num_batched_tokens", 2 * CL * max(len(reqs), 1) + 32)
    r = make_runner(fuse_commit=fuse, **kw)
    for rid, toks, p, arrival in reqs:
        r.add_request(rid, toks, p, arrival_step=arrival)
    return r, r.run(max_steps=1000)


def _non_final_canvases(res):
    return sum(max(v.num_canvases - 1, 0) for v in res.values())


def _span(res):
    return {k: v.finish_step - v.admit_step for k, v in res.items()}


# ------------------------------------------------------------------------------------------ the key property
@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("i", range(3))
def test_fused_greedy_run_equals_unfused_with_one_forward_fewer_per_non_final_canvas(make_runner, i, steps):
    """One request (prompt lengths 3 / 11 / 20, 1..4 canvases): tokens equal, and the fused run takes exactly
    ``num_canvases - 1`` forward passes fewer; every non-final canvas was committed fused; denoising steps per
    canvas unchanged (the fused step is step 0 of the next canvas, so the step cap counts it)."""
    plen, max_tokens = [(3, 3 * CL), (11, 2 * CL + 3), (20, 4 * CL)][i]
    reqs = [("r", prompt(plen, 40 + i), params(max_tokens=max_tokens, max_denoising_steps=steps, **GREEDY), None)]
    a, ra = _run(make_runner, reqs, fuse=False)
    b, rb = _run(make_runner, reqs, fuse=True)
    assert _outputs(rb) == _outputs(ra) and len(rb["r"].output_token_ids) == max_tokens
    n = ra["r"].num_canvases - 1
    assert n >= 1
    assert a.num_forward - b.num_forward == n == b.totals()["fused_commits"]
    assert rb["r"].num_canvases == ra["r"].num_canvases
    assert rb["r"].num_denoise_steps == ra["r"].num_denoise_steps
    ta, tb = a.totals(), b.totals()
    for k in ("tokens_emitted", "canvases_committed", "denoise_rows", "denoise_steps_per_canvas",
              "max_denoise_steps_per_canvas"):
        assert tb[k] == ta[k], k
    assert ta["fused_commits"] == 0 and tb["request_rows"] == ta["request_rows"] - n
    if steps == 1:  # every canvas converges at its first step (the cap): 2 passes per canvas unfused, 1 fused
        assert all(v.num_denoise_steps == v.num_canvases for v in rb.values())


def test_fused_mixed_batch_equals_unfused_greedy_and_sampled(make_runner):
    """A batch of mixed requests (prompt lengths, max_tokens, step caps, arrivals mid-run, one sampled with the
    temperature schedule): every output equals the unfused run's, every request finishes
    ``num_canvases - 1`` steps sooner (the budget holds every row, fused ones included), and the fused commits
    are exactly the non-final canvases."""
    reqs = [("a", prompt(5, 1), params(max_tokens=3 * CL, **GREEDY), None),
            ("b", prompt(17, 2), params(max_tokens=2 * CL + 5, max_denoising_steps=2, seed=3, **GREEDY), 2),
            ("c", prompt(3, 3), params(max_tokens=CL, **GREEDY), 1),
            ("d", prompt(9, 4), params(max_tokens=2 * CL, max_denoising_steps=4, seed=11), 0)]  # sampled
    a, ra = _run(make_runner, reqs, fuse=False)
    b, rb = _run(make_runner, reqs, fuse=True)
    assert _outputs(rb) == _outputs(ra)
    assert b.totals()["fused_commits"] == _non_final_canvases(ra) == 2 + 2 + 0 + 1
    sa, sb = _span(ra), _span(rb)
    assert {k: sa[k] - sb[k] for k in sa} == {k: ra[k].num_canvases - 1 for k in ra}
    assert a.num_forward > b.num_forward
    fused_rows = [x for h in b.history for x in h.rows if x.fused]
    assert {x.req_id for x in fused_rows} == {"a", "b", "d"}
    assert not b.has_unfinished and b.allocator.num_free == b.allocator.num_blocks


def test_fused_run_of_the_shipped_checkpoint_equals_unfused(tmp_path):
    """The trained stdlib-byte checkpoint (MoE, CL 32, sliding window 64 < 2 * CL: the next canvas's prefix window
    starts ``W`` keys before it in both runs) in float32, greedy, three prompts in one batch: token for token."""
    from blockdiff.integration.harness import HarnessRunner, checkpoint_sampling_params
    from blockdiff.model.pretrained import load_pretrained, shipped_checkpoint_dir

    model, tok = load_pretrained(shipped_checkpoint_dir(), dtype=torch.float32)
    p = checkpoint_sampling_params(model, max_tokens=96, **GREEDY)
    cl = p.canvas_length
    runs = []
    for fuse in (False, True):
        r = HarnessRunner(model, default_params=p, max_num_reqs=3, max_num_batched_tokens=6 * cl, page_size=16,
                          max_model_len=256, fuse_commit=fuse)
        for i, s in enumerate(["def fib(n):\n", "import os\n\nclass ", "for i in range("]):
            r.add_request(f"r{i}", tok.encode(s), p)
        runs.append((r, r.run(max_steps=500)))
    (a, ra), (b, rb) = runs
    assert _outputs(rb) == _outputs(ra) and all(len(v.output_token_ids) == 96 for v in rb.values())
    assert b.totals()["fused_commits"] == _non_final_canvases(ra) == 6
    assert a.num_forward - b.num_forward == 2  # 3 canvases each, all in one batch: 2 non-final canvases per row


# ------------------------------------------------------------------------------------------ last canvas, EOS, limits
def test_last_canvas_of_a_request_is_a_plain_commit(make_runner):
    """max_tokens reached at a commit: that commit is not fused (no next canvas starts, no KV beyond it)."""
    reqs = [("r", prompt(6, 5), params(max_tokens=2 * CL + 3, **GREEDY), None)]
    b, rb = _run(make_runner, reqs, fuse=True)
    commits = [x for h in b.history for x in h.rows if x.phase == "commit"]
    assert [x.fused for x in commits] == [True, True, False]
    last = commits[-1]
    assert last.q_len == CL and last.num_emitted == 3 and rb["r"].finish_reason == "length"
    assert b.history[-1].num_tokens == CL  # the final pass holds the plain commit only


def test_eos_inside_the_committed_canvas_makes_it_the_last_plain_commit(make_runner):
    """A stop id inside the second canvas: the fused run emits what the unfused one does (cut after the EOS),
    fuses the first commit only, and starts no canvas after the EOS."""
    base = params(max_tokens=4 * CL, **GREEDY)
    toks = prompt(7, 6)
    _, ref = _run(make_runner, [("r", toks, base, None)], fuse=False)
    out = ref["r"].output_token_ids
    j = next(j for j in range(CL, 2 * CL) if out[j] not in out[:j])  # first occurrence inside canvas 2
    p = params(max_tokens=4 * CL, eos_token_ids=(out[j],), **GREEDY)
    a, ra = _run(make_runner, [("r", toks, p, None)], fuse=False)
    b, rb = _run(make_runner, [("r", toks, p, None)], fuse=True)
    assert _outputs(rb) == _outputs(ra) == {"r": ("eos", out[: j + 1])}
    commits = [x for h in b.history for x in h.rows if x.phase == "commit"]
    assert [x.fused for x in commits] == [True, False]
    assert a.num_forward - b.num_forward == 1


def test_eos_in_the_first_canvas_fuses_nothing(make_runner):
    toks = prompt(8, 7)
    _, ref = _run(make_runner, [("r", toks, params(max_tokens=3 * CL, **GREEDY), None)], fuse=False)
    p = params(max_tokens=3 * CL, eos_token_ids=(ref["r"].output_token_ids[2],), **GREEDY)
    a, ra = _run(make_runner, [("r", toks, p, None)], fuse=False)
    b, rb = _run(make_runner, [("r", toks, p, None)], fuse=True)
    assert _outputs(rb) == _outputs(ra) and rb["r"].finish_reason == "eos"
    assert b.totals()["fused_commits"] == 0 and a.num_forward == b.num_forward


def test_next_canvas_past_max_model_len_is_a_plain_commit(make_runner):
    """max_model_len 160, prompt 140: the first commit is fused (its next canvas ends at 156), the second is not
    (the next canvas would end at 164); the request then finishes with 'length', as unfused."""
    reqs = [("r", prompt(140, 8), params(**GREEDY), None)]
    a, ra = _run(make_runner, reqs, fuse=False)
    b, rb = _run(make_runner, reqs, fuse=True)
    assert _outputs(rb) == _outputs(ra) and rb["r"].finish_reason == "length"
    assert [x.fused for h in b.history for x in h.rows if x.phase == "commit"] == [True, False]
    assert max(x.seq_len for h in b.history for x in h.rows) <= 160


def test_no_fusing_without_budget_and_a_tight_pool_loses_nothing(make_runner):
    """A budget of one canvas never fuses (the tail needs budget left after every other row); a tight KV pool
    (fused tails take free pages only, never preempt) still finishes every request with the roomy run's output."""
    reqs = [(f"r{i}", prompt(4, 90 + i), params(max_tokens=2 * CL, max_denoising_steps=2, seed=i, **GREEDY), None)
            for i in range(6)]
    _, want = _run(make_runner, reqs, fuse=False, max_num_reqs=6)
    one, r_one = _run(make_runner, reqs, fuse=True, max_num_reqs=6, max_num_batched_tokens=CL)
    assert _outputs(r_one) == _outputs(want) and one.totals()["fused_commits"] == 0
    tight, r_tight = _run(make_runner, reqs, fuse=True, max_num_reqs=6, num_blocks=9)
    assert _outputs(r_tight) == _outputs(want)
    assert tight.allocator.num_free == 9 and sorted(tight._free_slots) == list(range(6))


# ------------------------------------------------------------------------------------------ abort / preempt
def _step_until_fused(r, rid):
    while True:
        rec = r.step()
        if any(x.fused and x.req_id == rid for x in rec.rows):
            return rec


def test_preempt_right_after_a_fused_step_resumes_with_the_unfused_output(make_runner):
    reqs = [("a", prompt(5, 20), params(max_tokens=3 * CL, **GREEDY), None),
            ("b", prompt(9, 21), params(max_tokens=2 * CL, seed=5, **GREEDY), None)]
    _, want = _run(make_runner, reqs, fuse=False)
    r = make_runner(fuse_commit=True, max_num_batched_tokens=6 * CL)
    for rid, toks, p, _ in reqs:
        r.add_request(rid, toks, p)
    _step_until_fused(r, "a")
    assert len(r._running["a"].output) == CL  # the fused pass committed canvas 1 and denoised canvas 2 once
    r.preempt("a")
    res = r.run(max_steps=500)
    assert _outputs(res) == _outputs(want) and res["a"].num_preemptions == 1
    assert not r.has_unfinished and r.allocator.num_free == r.allocator.num_blocks


def test_abort_right_after_a_fused_step_keeps_the_committed_tokens(make_runner):
    reqs = [("a", prompt(5, 22), params(max_tokens=3 * CL, **GREEDY), None),
            ("b", prompt(6, 23), params(max_tokens=2 * CL, **GREEDY), None)]
    _, want = _run(make_runner, reqs, fuse=False)
    r = make_runner(fuse_commit=True, max_num_batched_tokens=6 * CL)
    for rid, toks, p, _ in reqs:
        r.add_request(rid, toks, p)
    _step_until_fused(r, "a")
    got = r.abort("a")
    assert got.finish_reason == "aborted" and got.output_token_ids == want["a"].output_token_ids[:CL]
    assert "a" not in r.model_state.req_id_to_index and not r.allocator.blocks("a")
    res = r.run(max_steps=500)
    assert set(res) == {"a", "b"} and not r.has_unfinished
    assert _outputs(res)["b"] == _outputs(want)["b"]
    assert r.allocator.num_free == r.allocator.num_blocks and sorted(r._free_slots) == list(range(4))


# ------------------------------------------------------------------------------------------ the switch
@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0, np.bool_(True)])
def test_bad_fuse_commit_values_raise_naming_the_argument(make_runner, tiny_model, bad):
    from blockdiff.integration.model_state import DiffusionModelState

    with pytest.raises(TypeError, match="fuse_commit must be a bool"):
        make_runner(fuse_commit=bad)
    with pytest.raises(TypeError, match="fuse_commit must be a bool"):
        DiffusionModelState.for_harness(tiny_model, max_num_reqs=2, max_num_tokens=2 * CL, canvas_length=CL,
                                        device="cpu", fuse_commit=bad)
    ms = DiffusionModelState.for_harness(tiny_model, max_num_reqs=2, max_num_tokens=2 * CL, canvas_length=CL,
                                         device="cpu")
    assert ms.fuse_commit is False
    with pytest.raises(TypeError, match="fuse_commit must be a bool"):
        ms.fuse_commit = bad
    assert ms.fuse_commit is False


def _commit_state(tiny_model, *, fuse):
    from blockdiff.integration.batch import NewRequest
    from blockdiff.integration.model_state import DiffusionModelState
    from blockdiff.sampler import COMMIT

    ms = DiffusionModelState.for_harness(tiny_model, max_num_reqs=3, max_num_tokens=4 * CL, canvas_length=CL,
                                         device="cpu", default_params=params(), fuse_commit=fuse)
    ms.add_request(1, NewRequest("c", [3, 4, 5], params()))
    ms.state.phase[1] = COMMIT
    ms.state.commit_canvas[1] = torch.arange(CL) + 20
    return ms


def test_a_two_canvas_row_needs_the_switch_and_a_commit(tiny_model):
    """Unfused, a 2 * CL canvas row is refused as before; fused, only a COMMIT row may carry 2 * CL tokens."""
    from blockdiff.sampler import DENOISE

    V = tiny_model.config.vocab_size
    b = make_batch([("c", 1, 2 * CL, 3, 3, None)])
    ms = _commit_state(tiny_model, fuse=False)
    sampler, _ = ms.custom_sampler(None)
    with pytest.raises(ValueError, match="must schedule canvas_length"):
        sampler(torch.zeros(2 * CL, V), b)
    ms = _commit_state(tiny_model, fuse=True)
    ms.state.phase[1] = DENOISE
    sampler, _ = ms.custom_sampler(None)
    with pytest.raises(ValueError, match="not a commit row"):
        sampler(torch.zeros(2 * CL, V), b)


def test_model_state_inputs_and_causal_rows_of_a_fused_commit_row(tiny_model):
    """prepare_inputs: commit canvas, then the fresh canvas of canvas_index + 1 (the canvas the sampler's commit
    starts), self_cond 0 on both halves; prepare_attn: num_causal_q = CL for the fused row; commit_finishes."""
    from blockdiff.integration.batch import NewRequest
    from blockdiff.sampler import DENOISE
    from blockdiff.sampler.common import fresh_canvas

    ms = _commit_state(tiny_model, fuse=True)
    ms.add_request(0, NewRequest("d", [1, 2], params()))
    ms.state.phase[0] = DENOISE
    ms.state.canvas[0] = torch.arange(CL) + 40
    ms.state.soft[0] = 1.0
    ms.add_request(2, NewRequest("p", [6, 7, 8], params()))
    b = make_batch([("d", 0, CL, 2, 2, None), ("c", 1, 2 * CL, 3, 3, None), ("p", 2, 3, 0, 3, [6, 7, 8])])
    inp = ms.prepare_inputs(b, None)
    nxt = fresh_canvas(ms.state, torch.tensor([1]), ms.state.canvas_index[[1]] + 1)[0]
    ids = inp["input_ids"]
    assert torch.equal(ids[:CL], torch.arange(CL) + 40)
    assert torch.equal(ids[CL: 2 * CL], torch.arange(CL) + 20) and torch.equal(ids[2 * CL: 3 * CL], nxt)
    assert ids[3 * CL:].tolist() == [6, 7, 8]
    assert (inp["self_cond"][:CL] == 1).all() and (inp["self_cond"][CL:] == 0).all()
    meta = ms.prepare_attn(b, None, (b.block_table,), b.slot_mapping, None, None)
    assert meta.num_causal_q.tolist() == [0, CL, 3] and meta.num_causal_q.dtype == torch.int32
    assert not ms.commit_finishes(1)
    ms.state.max_tokens[1] = CL  # the commit reaches max_tokens: the request's last canvas
    assert ms.commit_finishes(1)
    with pytest.raises(ValueError, match="not in phase COMMIT"):
        ms.commit_finishes(0)
    off = _commit_state(tiny_model, fuse=False)
    b1 = make_batch([("c", 1, CL, 3, 3, None)])
    assert off.prepare_attn(b1, None, (b1.block_table,), b1.slot_mapping, None, None).num_causal_q is None


# ------------------------------------------------------------------------------------------ vLLM-facing accounting
def test_vllm_mode_fused_row_is_cl_accepted_and_cl_rejected_drafts(monkeypatch):
    """vLLM mode (CPU stand-ins for vLLM's model and SamplerOutput): the fused row's embeddings carry the
    self-conditioning MLP on its last CL tokens only (decoder rows), and its SamplerOutput reports the committed
    canvas with num_sampled = CL and num_rejected = CL (the KV position moves by CL); the draft tokens vLLM
    schedules next are the canvas after the next canvas's first step; a plain denoise row beside it is unchanged.
    prepare_attn attaches the causal row counts (CL for the fused row, 0 for the denoise row) to every metadata
    object, in the persistent buffer."""
    from test_vllm_plugin import _StandInVllmModel

    from blockdiff.integration.batch import NewRequest
    from blockdiff.integration.model_state import DiffusionModelState
    from blockdiff.sampler import COMMIT, DENOISE

    vllm_sampler_output_class(monkeypatch)
    V, H = 64, 8
    model = _StandInVllmModel(V, H)
    model.embedding_weight = model.emb.weight.detach()
    ms = DiffusionModelState.for_harness(model, max_num_reqs=2, max_num_tokens=4 * CL, canvas_length=CL,
                                         device="cpu", default_params=params(), fuse_commit=True)
    ms.mode = "vllm"
    ms.inputs_embeds_buf = torch.zeros(4 * CL, H)
    ms.causal_buf_i32 = torch.zeros(2, dtype=torch.int32)
    ms.model_config = NS(max_model_len=256)  # vLLM 0.33.0's ModelState.max_model_len is a property reading it
    if "max_model_len" not in dir(type(ms)):
        ms.max_model_len = 256
    draft = torch.zeros(2, CL, dtype=torch.int64)
    sampler, _ = ms.custom_sampler(NS(req_states=NS(draft_tokens=draft)), backend="reference")
    ms.add_request(0, NewRequest("c", [1, 2], params(max_denoising_steps=3)))
    ms.add_request(1, NewRequest("d", [3, 4], params(max_denoising_steps=3)))
    ms.state.phase[0], ms.state.phase[1] = COMMIT, DENOISE
    ms.state.commit_canvas[0] = torch.arange(CL) + 10
    ms.state.canvas[1] = torch.arange(CL) + 30
    b = make_batch([("c", 0, 2 * CL, 2, 2, None), ("d", 1, CL, 2, 2, None)])
    emb = ms.prepare_inputs(b, None)["inputs_embeds"]
    with torch.no_grad():
        base = model.emb(ms.input_ids_buf[: 3 * CL])
    assert torch.equal(emb[:CL], base[:CL]) and torch.allclose(emb[CL:], base[CL:] + 100.0)
    calls = vllm_attn_metadata_stubs(monkeypatch)
    meta = ms.prepare_attn(b, None, (b.block_table,), b.slot_mapping, None, None)
    ncq = meta["layer.0"]._blockdiff_num_causal_q
    assert ncq.tolist() == [CL, 0] and ncq.dtype == torch.int32 and ncq.data_ptr() == ms.num_causal_q_buf.data_ptr()
    assert meta["layer.2"]._blockdiff_num_causal_q is ncq and calls[0]["causal"].tolist() == [1, 0]
    out = sampler(torch.randn(3 * CL, V, generator=torch.Generator().manual_seed(0)), b)
    assert out.num_sampled.tolist() == [CL, 0] and out.num_rejected.tolist() == [CL, CL]
    assert out.sampled_token_ids[0].tolist() == list(range(10, 10 + CL))
    assert (out.sampled_token_ids[1] == -1).all() and out.num_nans.tolist() == [0, 0]
    st = ms.state
    assert st.phase.tolist()[:2] == [DENOISE, DENOISE] and st.step.tolist()[:2] == [1, 1]
    assert st.canvas_index[0] == 1 and st.num_emitted[0] == CL
    assert torch.equal(draft[0], st.canvas[0]) and torch.equal(draft[1], st.canvas[1])


def test_non_finite_logits_in_the_fused_step_fail_the_request_after_its_commit(make_runner):
    """NaN logits on the next canvas's rows of a fused row: the commit's tokens are emitted, then the request
    fails (reported, slot and pages freed, num_nans > 0); the request beside it is unaffected."""
    r = make_runner(fuse_commit=True, max_num_batched_tokens=6 * CL)
    r.add_request("ok", prompt(5, 72), params(max_tokens=2 * CL, **GREEDY))
    r.add_request("bad", prompt(5, 73), params(max_tokens=3 * CL, **GREEDY))
    inner = r.sampler
    nans = []

    def poisoned(logits, batch):
        logits = logits.clone()
        for i, rid in enumerate(batch.req_ids):
            if rid == "bad" and batch.num_scheduled_tokens[i] == 2 * CL:  # the fused row's next-canvas half
                logits[batch.query_start_loc_np[i] + CL: batch.query_start_loc_np[i + 1]] = float("nan")
        out = inner(logits, batch)
        nans.append(dict(zip(batch.req_ids, out.num_nans.tolist())))
        return out

    r.sampler = poisoned
    res = r.run(max_steps=200)
    assert res["bad"].finish_reason == "error" and len(res["bad"].output_token_ids) == CL
    assert any(n.get("bad", 0) > 0 for n in nans)
    _, ref = _run(make_runner, [("ok", prompt(5, 72), params(max_tokens=2 * CL, **GREEDY), None)], fuse=False)
    assert _outputs(res)["ok"] == _outputs(ref)["ok"]
    assert not r.has_unfinished and r.allocator.num_free == r.allocator.num_blocks
