"""HarnessRunner: model runner v2's call order replayed without vLLM (accounting, isolation, slot reuse,
chunked prefill, arrivals, EOS / max_tokens trimming, per-request params, batch invariance)."""
from __future__ import annotations

import pytest
import torch

from blockdiff.sampler import COMMIT, DENOISE, FINISHED
from integration_helpers import CL, needs_stack, params, prompt

pytestmark = needs_stack


def _solo(make_runner, req_id, toks, p, **kw):
    r = make_runner(**kw)
    r.add_request(req_id, toks, p)
    return r.run(max_steps=500)[req_id]


def test_accounting_invariants_per_row(make_runner):
    r = make_runner()
    r.add_request("a", prompt(11, 1), params(max_tokens=2 * CL))
    r.add_request("b", prompt(40, 2), params(max_tokens=CL), arrival_step=1)  # chunked: budget 32
    r.run(max_steps=200)
    seen = set()
    for h in r.history:
        for row in h.rows:
            seen.add(row.phase)
            if row.phase == "prefill":
                assert (row.num_sampled, row.num_rejected, row.num_emitted) == (0, 0, 0)
                assert row.causal
            elif row.phase == "denoise":
                assert row.num_sampled == 0 and row.num_rejected == row.q_len == CL
                assert not row.causal and row.num_emitted == 0
            else:
                assert row.phase == "commit" and row.causal
                assert row.num_sampled == CL and row.num_rejected == 0
    assert seen == {"prefill", "denoise", "commit"}


def test_kv_position_moves_by_prefill_chunk_and_commit_only(make_runner):
    r = make_runner()
    toks = prompt(13, 3)
    r.add_request("a", toks, params(max_tokens=3 * CL))
    r.run(max_steps=200)
    pos = len(toks)  # after the prompt
    canvases = 0
    for h in r.history:
        for row in h.rows:
            if row.phase == "prefill":
                continue
            # every canvas row (denoise or commit) sits right after the KV written so far
            assert row.seq_len - row.q_len == pos
            if row.phase == "commit":
                pos += CL
                canvases += 1
    assert canvases == 3 and r.results["a"].num_canvases == 3
    assert len(r.results["a"].output_token_ids) == 3 * CL


def test_mixed_batches_and_arrivals_mid_run(make_runner):
    r = make_runner()
    r.add_request("early", prompt(9, 4), params(max_tokens=CL))
    r.add_request("late", prompt(6, 5), params(max_tokens=CL), arrival_step=2)
    res = r.run(max_steps=200)
    assert set(res) == {"early", "late"}
    assert res["late"].admit_step == 2 and res["early"].admit_step == 0
    assert res["early"].finish_step < res["late"].finish_step
    mixed = [h for h in r.history if len({row.phase for row in h.rows}) >= 2]
    assert mixed, "prefill and denoise rows should share a batch"
    # once finished, a request never appears again
    for rid, rr in res.items():
        assert all(row.req_id != rid for h in r.history[rr.finish_step + 1:] for row in h.rows)


def test_batched_generation_equals_each_request_alone(make_runner):
    reqs = [("r0", prompt(21, 10), params(max_tokens=2 * CL, seed=1), 0),
            ("r1", prompt(5, 11), params(max_tokens=CL, seed=2), 0),
            ("r2", prompt(37, 12), params(max_tokens=2 * CL, seed=3), 2),
            ("r3", prompt(8, 13), params(max_tokens=CL + 3, seed=4), 4)]
    r = make_runner(max_num_reqs=3)  # r3 waits for a slot
    for rid, toks, p, arr in reqs:
        r.add_request(rid, toks, p, arrival_step=arr)
    batched = r.run(max_steps=500)
    for rid, toks, p, _ in reqs:
        alone = _solo(make_runner, rid, toks, p)
        assert batched[rid].output_token_ids == alone.output_token_ids, rid
        assert batched[rid].num_denoise_steps == alone.num_denoise_steps
    assert len(batched["r3"].output_token_ids) == CL + 3


def test_chunked_prefill_matches_one_chunk(make_runner):
    toks = prompt(70, 20)
    r = make_runner(max_num_batched_tokens=2 * CL)  # 16-token chunks
    r.add_request("long", toks, params(max_tokens=CL))
    res = r.run(max_steps=200)
    chunks = [row for h in r.history for row in h.rows if row.phase == "prefill"]
    assert [c.q_len for c in chunks] == [16, 16, 16, 16, 6]
    assert [c.seq_len for c in chunks] == [16, 32, 48, 64, 70]
    assert all(c.causal for c in chunks)
    big = make_runner(max_num_batched_tokens=128)
    big.add_request("long", toks, params(max_tokens=CL))
    res_big = big.run(max_steps=200)
    assert [row.q_len for h in big.history for row in h.rows if row.phase == "prefill"] == [70]
    assert res["long"].output_token_ids == res_big["long"].output_token_ids


def test_slot_and_page_reuse_after_removal(make_runner):
    r = make_runner(max_num_reqs=2)
    total_pages = r.allocator.num_blocks
    names = [f"q{i}" for i in range(5)]
    for i, n in enumerate(names):
        r.add_request(n, prompt(7 + 3 * i, 30 + i), params(max_tokens=CL, seed=i))
    res = r.run(max_steps=500)
    assert set(res) == set(names)
    slots_used = {row.slot for h in r.history for row in h.rows}
    assert slots_used == {0, 1}
    assert r.allocator.num_free == total_pages  # every page back in the pool
    assert not r.model_state.req_id_to_index
    assert (r.model_state.state.phase == FINISHED).all()
    # a request that reused a slot behaves as if alone (no stale state or KV)
    for i, n in enumerate(names):
        alone = _solo(make_runner, n, prompt(7 + 3 * i, 30 + i), params(max_tokens=CL, seed=i))
        assert res[n].output_token_ids == alone.output_token_ids, n


def test_eos_and_max_tokens_trimming(make_runner):
    toks = prompt(10, 40)
    full = _solo(make_runner, "e", toks, params(max_tokens=2 * CL)).output_token_ids
    assert len(full) == 2 * CL
    # max_tokens mid-canvas: the second canvas is cut
    cut = _solo(make_runner, "e", toks, params(max_tokens=CL + 5))
    assert cut.output_token_ids == full[: CL + 5] and cut.finish_reason == "length"
    # EOS: pick a token of the second canvas that does not occur before it; output ends right after it (kept)
    k = next(i for i in range(CL, 2 * CL) if full[i] not in full[:i])
    eos = _solo(make_runner, "e", toks, params(max_tokens=2 * CL, eos_token_ids=(full[k],)))
    assert eos.output_token_ids == full[: k + 1]
    assert eos.finish_reason == "eos" and eos.num_canvases == 2


def test_per_request_sampling_params(make_runner):
    r = make_runner()
    toks_a, toks_b = prompt(12, 50), prompt(12, 51)
    pa = params(max_tokens=2 * CL, t_min=0.0, t_max=0.0, max_denoising_steps=5)  # greedy: T = 0
    pb = params(max_tokens=2 * CL, max_denoising_steps=2, seed=99)
    r.add_request("greedy", toks_a, pa)
    r.add_request("noisy", toks_b, pb)
    res = r.run(max_steps=300)
    rows = {k: [row for h in r.history for row in h.rows if row.req_id == k and row.phase == "denoise"]
            for k in ("greedy", "noisy")}
    # T = 0: no noise, every entropy 0, every position accepted; at most its own cap of 5 steps per canvas
    assert all(row.mean_entropy == 0.0 and row.accepted == CL for row in rows["greedy"])
    assert 2 <= res["greedy"].num_denoise_steps <= 2 * 5
    # T > 0 on random weights: high entropy, few positions accepted, runs to its own cap of 2 steps
    assert all(row.mean_entropy > 1.0 and row.accepted < CL for row in rows["noisy"])
    assert res["noisy"].num_denoise_steps == 2 * 2
    assert res["greedy"].output_token_ids == _solo(make_runner, "greedy", toks_a, pa).output_token_ids
    assert res["noisy"].output_token_ids == _solo(make_runner, "noisy", toks_b, pb).output_token_ids


def test_isolation_commit_and_converge_in_one_step(make_runner):
    """A step where one request commits while another converges: rows not in the batch are untouched, and the
    converging request's state equals its state when run alone."""
    greedy = params(max_tokens=2 * CL, t_min=0.0, t_max=0.0, max_denoising_steps=6)
    r = make_runner(max_num_batched_tokens=2 * CL)
    r.add_request("c", prompt(6, 60), greedy)
    r.add_request("d", prompt(6, 61), greedy, arrival_step=1)
    r.add_request("idle", prompt(6, 62), greedy, arrival_step=1)  # budget 2 canvases: someone sits out
    st = r.model_state.state
    tensors = [k for k, v in vars(st).items() if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == st.max_num_reqs]
    found = False
    while r.has_unfinished:
        before = {k: getattr(st, k).clone() for k in tensors}
        phases = st.phase.tolist()
        rec = r.step()
        in_batch = {row.slot for row in rec.rows}
        for s in set(r.model_state.req_id_to_index.values()) - in_batch:
            for k in tensors:
                assert torch.equal(getattr(st, k)[s], before[k][s]), f"slot {s} ({k}) changed without a row"
        rows = {row.phase: row for row in rec.rows}
        if "commit" in rows and any(row.phase == "denoise" and row.converged for row in rec.rows):
            conv = next(row for row in rec.rows if row.phase == "denoise" and row.converged)
            assert phases[conv.slot] == DENOISE and st.phase[conv.slot].item() == COMMIT
            found = True
            snap = {k: getattr(st, k)[conv.slot].clone() for k in ("commit_canvas", "canvas_index", "step")}
            # the same request alone, stopped at the same point
            alone = make_runner()
            alone.add_request(conv.req_id, prompt(6, 60 if conv.req_id == "c" else 61 if conv.req_id == "d" else 62),
                              greedy)
            target = (int(snap["canvas_index"]),)
            while True:
                alone.step()
                s = alone.slot_of(conv.req_id)
                ast = alone.model_state.state
                if ast.phase[s].item() == COMMIT and (int(ast.canvas_index[s]),) == target:
                    break
            assert torch.equal(ast.commit_canvas[s], snap["commit_canvas"])
            assert int(ast.step[s]) == int(snap["step"])
    assert found, "no step mixed a commit with a converging denoise row"


def test_failed_request_is_reported_not_lost(make_runner):
    """Non-finite logits fail that request (reported, slot freed); the request beside it is unaffected."""
    r = make_runner()
    r.add_request("ok", prompt(5, 70), params(max_tokens=CL))
    r.add_request("bad", prompt(5, 71), params(max_tokens=CL))
    inner = r.sampler

    def poisoned(logits, batch):
        logits = logits.clone()
        for i, rid in enumerate(batch.req_ids):
            if rid == "bad":
                logits[batch.query_start_loc_np[i]: batch.query_start_loc_np[i + 1]] = float("nan")
        return inner(logits, batch)

    r.sampler = poisoned
    res = r.run(max_steps=200)
    assert res["bad"].finish_reason == "error" and res["bad"].output_token_ids == []
    assert res["ok"].finish_reason == "length" and len(res["ok"].output_token_ids) == CL
    assert r.allocator.num_free == r.allocator.num_blocks


@pytest.mark.parametrize("fuse", [False, True])
def test_a_failed_row_leaves_the_step_s_mean_entropy_a_number(make_runner, fuse):
    """A denoise row that fails (NaN logits) has no mean entropy: its RowRecord holds None, and the step's
    mean_entropy is the mean over the rows that have one (was: the failed row's NaN made the whole step's mean NaN,
    printed as "nan" in blockdiff demo's table, though the other rows' entropies were defined)."""
    import math

    r = make_runner(fuse_commit=fuse)
    r.add_request("ok", prompt(5, 70), params(max_tokens=3 * CL))
    r.add_request("bad", prompt(5, 71), params(max_tokens=3 * CL))
    inner = r.sampler

    def poisoned(logits, batch):
        logits = logits.clone()
        for i, rid in enumerate(batch.req_ids):
            if rid == "bad" and r.step_index >= 4:
                logits[batch.query_start_loc_np[i]: batch.query_start_loc_np[i + 1]] = float("nan")
        return inner(logits, batch)

    r.sampler = poisoned
    res = r.run(max_steps=200)
    assert res["bad"].finish_reason == "error" and res["ok"].finish_reason == "length"
    failed_step = next(h for h in r.history if "bad" in h.finished)
    rows = {x.req_id: x for x in failed_step.rows if x.phase == "denoise"}
    assert rows["bad"].mean_entropy is None and math.isfinite(rows["ok"].mean_entropy)
    for h in r.history:
        assert h.mean_entropy is None or math.isfinite(h.mean_entropy), h
    assert failed_step.mean_entropy == rows["ok"].mean_entropy


def test_bad_requests_raise(make_runner):
    r = make_runner()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        r.add_request("x", [], params())
    with pytest.raises(ValueError, match="token ids"):
        r.add_request("x", [300], params())
    with pytest.raises(ValueError, match="max_model_len"):
        r.add_request("x", [5] * 200, params())
    with pytest.raises(ValueError, match="canvas_length"):
        r.add_request("x", [5], params(canvas_length=CL * 2))
    r.add_request("x", [5], params())
    with pytest.raises(ValueError, match="duplicate"):
        r.add_request("x", [5], params())


def test_request_larger_than_the_kv_pool_is_refused_at_submission(make_runner):
    """A request whose KV footprint (prompt + every canvas it may commit, up to max_tokens or max_model_len)
    exceeds the pool could never finish: add_request refuses it naming num_blocks (was: accepted, then run()
    raised 'none could be scheduled'). One that fits finishes."""
    r = make_runner(num_blocks=3)  # 12 tokens of KV in pages of 4
    with pytest.raises(ValueError, match="num_blocks=3"):
        r.add_request("a", prompt(6, 80), params(max_tokens=CL))  # 6 + 8 tokens: 4 pages
    with pytest.raises(ValueError, match="max_tokens"):
        r.add_request("a", prompt(4, 80), params())  # no max_tokens: canvases up to max_model_len 160
    r.add_request("a", prompt(4, 80), params(max_tokens=CL))  # 4 + 8 tokens: 3 pages
    res = r.run(max_steps=50)
    assert len(res["a"].output_token_ids) == CL and r.allocator.num_free == 3


def test_request_the_slot_would_refuse_is_rejected_at_submission_not_lost(make_runner):
    """An eos id >= vocab: add_request raises at submission. (Was accepted, then raised mid-step at admission:
    the request vanished from the queue and its slot leaked.)"""
    r = make_runner(max_num_reqs=2)
    V = r.model_state.vocab_size
    r.add_request("good", prompt(3), params(max_tokens=4))
    with pytest.raises(ValueError, match="vocab_size"):
        r.add_request("big_eos", prompt(2), params(eos_token_ids=(V + 3,)))
    r.add_request("big_eos", prompt(2), params(eos_token_ids=(1, 2), max_tokens=4))  # the id is still free
    res = r.run(max_steps=200)
    assert sorted(res) == ["big_eos", "good"]
    assert sorted(r._free_slots) == [0, 1]


def test_more_stop_token_ids_than_the_initial_buffer_are_supported(make_runner):
    """40 stop ids (the per-slot buffer starts at 16; was: more than 8 raised in add_request): the request stops
    at the first emitted one, here the last id of the list, and a request with few ids beside it is unaffected."""
    toks = prompt(10, 41)
    full = _solo(make_runner, "s", toks, params(max_tokens=2 * CL)).output_token_ids
    k = next(i for i in range(CL, 2 * CL) if full[i] not in full[:i])
    V = make_runner().model_state.vocab_size
    others = [t for t in range(V) if t not in full][:39]
    assert len(others) == 39
    r = make_runner()
    r.add_request("s", toks, params(max_tokens=2 * CL, eos_token_ids=tuple(others) + (full[k],)))
    r.add_request("few", prompt(6, 42), params(max_tokens=CL, eos_token_ids=(V - 1,)))
    res = r.run(max_steps=500)
    assert r.model_state.state.max_eos >= 40
    assert res["s"].output_token_ids == full[: k + 1] and res["s"].finish_reason == "eos"
    assert res["few"].output_token_ids == _solo(make_runner, "few", prompt(6, 42),
                                                params(max_tokens=CL, eos_token_ids=(V - 1,))).output_token_ids


def _run_with_preemption(make_runner, reqs, victim, when, **kw):
    """Run ``reqs`` and preempt ``victim`` (once) before the first step at which ``when(runner)`` holds."""
    r = make_runner(**kw)
    for rid, toks, p in reqs:
        r.add_request(rid, toks, p)
    at = None
    for _ in range(500):
        if not r.has_unfinished:
            break
        if at is None and victim in r._running and when(r):
            r.preempt(victim)
            at = r.step_index
        r.step()
    assert at is not None, "the preemption point was never reached"
    assert not r.has_unfinished
    return r, r.results, at


@pytest.mark.parametrize("point", ["prefill", "denoise_canvas_1", "after_first_commit"])
def test_preempted_request_resumes_with_the_output_of_an_unpreempted_run(make_runner, point):
    """vLLM preempts a request (remove_request) and re-adds it with prefill_token_ids = prompt + output: the
    committed tokens count toward max_tokens and the next canvas continues the request's RNG stream after them.
    (Was: add_request reset the canvas index and the emitted count, so a resumed request restarted canvas 0's
    noise and could emit max_tokens more tokens.) Output, finish reason and length equal an unpreempted run."""
    reqs = [("a", prompt(13, 60), params(max_tokens=2 * CL + CL // 2, seed=11)),
            ("b", prompt(6, 61), params(max_tokens=2 * CL, seed=12))]
    ref = make_runner()
    for rid, toks, p in reqs:
        ref.add_request(rid, toks, p)
    ref_res = ref.run(max_steps=500)

    def when(r):
        st, s = r.model_state.state, r.slot_of("a")
        out = len(r._running["a"].output)
        if point == "prefill":
            return r._running["a"].num_computed > 0 and st.phase[s].item() != DENOISE
        if point == "denoise_canvas_1":
            return out == CL and st.phase[s].item() == DENOISE and st.step[s].item() >= 1
        return out == CL and st.step[s].item() == 0  # right after the first commit

    kw = {"max_num_batched_tokens": 2 * CL} if point == "prefill" else {}  # chunked prompt: preempt mid-prefill
    r, res, at = _run_with_preemption(make_runner, reqs, "a", when, **kw)
    for rid, _, _ in reqs:
        assert res[rid].output_token_ids == ref_res[rid].output_token_ids, rid
        assert res[rid].finish_reason == ref_res[rid].finish_reason
    assert len(res["a"].output_token_ids) == 2 * CL + CL // 2 and res["a"].num_preemptions == 1
    assert res["a"].num_canvases == ref_res["a"].num_canvases
    assert r.allocator.num_free == r.allocator.num_blocks and sorted(r._free_slots) == [0, 1, 2, 3]
    first = next(row for h in r.history if h.step >= at for row in h.rows if row.req_id == "a")
    assert first.phase == "prefill" and first.causal and first.seq_len <= 13 + len(ref.results["a"].output_token_ids)
    if point != "prefill":  # the readmitted request prefills prompt + its CL emitted tokens again, causally
        prefill_rows = [row for h in r.history if h.step >= at for row in h.rows
                        if row.req_id == "a" and row.phase == "prefill"]
        assert sum(row.q_len for row in prefill_rows) == 13 + CL


def test_resumed_request_counts_its_output_toward_max_tokens(make_runner):
    """max_tokens = CL + 3: preempted after its first canvas, the resumed request emits only 3 more tokens."""
    toks = prompt(9, 62)
    p = params(max_tokens=CL + 3, seed=5)
    ref = _solo(make_runner, "m", toks, p)

    def when(r):
        return len(r._running["m"].output) == CL

    _, res, _ = _run_with_preemption(make_runner, [("m", toks, p)], "m", when)
    assert res["m"].output_token_ids == ref.output_token_ids and len(ref.output_token_ids) == CL + 3
    assert res["m"].finish_reason == "length"


def test_denoise_steps_per_canvas_do_not_count_a_canvas_interrupted_by_preemption(make_runner):
    """totals(): a request preempted while its canvas was converged (about to commit) denoises that canvas again
    from step 0 after readmission; the interrupted attempt's rows are not added to the committed canvas (was: they
    were, so max denoise steps per canvas exceeded the step cap). The per-canvas figures equal an unpreempted
    run's, while denoise_rows still counts every pass."""
    cap = 5
    reqs = [("a", prompt(13, 70), params(max_tokens=2 * CL, seed=11, max_denoising_steps=cap)),
            ("b", prompt(6, 71), params(max_tokens=CL, seed=12, max_denoising_steps=cap))]
    ref = make_runner()
    for rid, toks, p in reqs:
        ref.add_request(rid, toks, p)
    ref_res = ref.run(max_steps=500)

    def when(r):
        return r.model_state.state.phase[r.slot_of("a")].item() == COMMIT

    r, res, _ = _run_with_preemption(make_runner, reqs, "a", when)
    assert all(res[k].output_token_ids == ref_res[k].output_token_ids for k in ref_res)
    t, t_ref = r.totals(), ref.totals()
    assert t["canvases_committed"] == t_ref["canvases_committed"] == 3
    assert t["max_denoise_steps_per_canvas"] <= cap
    assert t["max_denoise_steps_per_canvas"] == t_ref["max_denoise_steps_per_canvas"]
    assert t["denoise_steps_per_canvas"] == t_ref["denoise_steps_per_canvas"]
    assert t["denoise_rows"] > t_ref["denoise_rows"]  # the interrupted attempt still cost forward passes


def test_preempt_rejects_a_request_that_is_not_running(make_runner):
    r = make_runner()
    r.add_request("w", prompt(4), params(max_tokens=2), arrival_step=5)
    with pytest.raises(ValueError, match="not running"):
        r.preempt("w")
    with pytest.raises(ValueError, match="not running"):
        r.preempt("nobody")


def test_admission_that_raises_keeps_the_request_queued_and_the_slot_free(make_runner):
    """If the model state refuses a request at admission, the error reaches the caller with the request still
    queued and no slot claimed; the next step admits it."""
    r = make_runner(max_num_reqs=2)
    r.add_request("a", prompt(3), params(max_tokens=4))
    orig = r.model_state.add_request
    calls = []

    def flaky(slot, data):
        calls.append(slot)
        if len(calls) == 1:
            raise ValueError("transient")
        return orig(slot, data)

    r.model_state.add_request = flaky
    with pytest.raises(ValueError, match="transient"):
        r.step()
    assert [w.req_id for w in r._waiting] == ["a"] and sorted(r._free_slots) == [0, 1] and not r._running
    res = r.run(max_steps=200)
    assert list(res) == ["a"] and len(res["a"].output_token_ids) == 4 and sorted(r._free_slots) == [0, 1]


def test_totals_count_denoise_steps_of_committed_canvases_only(make_runner):
    """totals(): tokens per forward / per row / per denoise row, and denoise steps per *committed* canvas (a
    canvas still being denoised when totals() is read is not counted), consistent with the per-request results."""
    r = make_runner()
    r.add_request("a", prompt(11, 1), params(max_tokens=2 * CL))
    r.add_request("b", prompt(5, 2), params(max_tokens=CL, max_denoising_steps=2), arrival_step=1)
    empty = r.totals()
    assert empty["forward_passes"] == 0 and empty["max_denoise_steps_per_canvas"] == 0
    res = r.run(max_steps=200)
    t = r.totals()
    den = sum(x.num_denoise_steps for x in res.values())
    can = sum(x.num_canvases for x in res.values())
    assert t["denoise_rows"] == den and t["canvases_committed"] == can == 3
    assert t["denoise_steps_per_canvas"] == pytest.approx(den / can)
    assert 1 <= t["max_denoise_steps_per_canvas"] <= 3
    assert t["request_rows"] == sum(len(h.rows) for h in r.history)
    assert t["tokens_per_forward"] == t["tokens_emitted"] / t["forward_passes"]
    assert t["tokens_per_request_pass"] == t["tokens_emitted"] / t["request_rows"]
    assert t["tokens_per_denoise_step"] == t["tokens_emitted"] / den
    # mid-canvas: denoise rows of the open canvas are left out of the per-canvas mean
    r2 = make_runner()
    r2.add_request("a", prompt(4, 3), params(max_tokens=2 * CL, max_denoising_steps=3))
    while r2.totals()["canvases_committed"] == 0:
        r2.step()
    first = r2.totals()["denoise_steps_per_canvas"]
    r2.step()  # the first denoise row of the second canvas
    assert r2.history[-1].rows[0].phase == "denoise"
    assert r2.totals()["denoise_steps_per_canvas"] == first
    assert r2.totals()["denoise_rows"] == first + 1


def _outputs(res):
    return {k: (v.finish_reason, v.output_token_ids) for k, v in res.items()}


@pytest.mark.parametrize("plen,max_tokens", [(4, 2 * CL), (5, CL)])
def test_more_requests_than_the_kv_pool_holds_all_finish_none_lost(make_runner, plen, max_tokens):
    """8 slots and a pool of 9 pages of 4 tokens, 8 requests that each fit alone (was: all 8 admitted, the pool
    ran dry and run() stopped with 'enlarge num_blocks'). Admission waits for free pages and the scheduler
    preempts lower-priority requests when a row cannot grow; every request finishes with the output it has in
    a roomy pool, and every page and slot comes back."""
    reqs = [(f"r{i}", prompt(plen, 90 + i), params(max_tokens=max_tokens, max_denoising_steps=2, seed=i))
            for i in range(8)]
    roomy = make_runner(max_num_reqs=8)
    tight = make_runner(max_num_reqs=8, num_blocks=9)
    for r in (roomy, tight):
        for rid, toks, p in reqs:
            r.add_request(rid, toks, p)
    want, got = _outputs(roomy.run(max_steps=500)), _outputs(tight.run(max_steps=500))
    assert got == want and len(got) == 8
    assert all(len(out) == max_tokens for _, out in got.values())
    assert tight.allocator.num_free == 9 and sorted(tight._free_slots) == list(range(8))
    assert max(len({row.req_id for row in h.rows}) for h in tight.history) < 8  # the pool, not the slots, limits


def test_scheduler_preempts_the_lowest_priority_request_and_resumes_it(make_runner):
    """Two requests that each fit the pool alone but not together once their KV grows: the later one is preempted
    (never the earlier), readmitted with prompt + output, and yields the output of an unpreempted run."""
    reqs = [("first", prompt(4, 95), params(max_tokens=3 * CL, seed=1)),
            ("second", prompt(4, 96), params(max_tokens=3 * CL, seed=2))]
    roomy, tight = make_runner(max_num_reqs=2), make_runner(max_num_reqs=2, num_blocks=10)  # 28 tokens each: 7 pages
    for r in (roomy, tight):
        for rid, toks, p in reqs:
            r.add_request(rid, toks, p)
    want, res = roomy.run(max_steps=500), tight.run(max_steps=500)
    assert _outputs(res) == _outputs(want)
    preempted = [x for h in tight.history for x in h.preempted]
    assert preempted and set(preempted) == {"second"} and res["first"].num_preemptions == 0
    assert res["second"].num_preemptions == len(preempted)


def test_abort_frees_the_slot_and_pages_of_a_running_request(make_runner):
    """abort(): the request leaves the model state, its slot and KV pages return to the pool, and it is recorded
    with finish_reason 'aborted' and the tokens emitted so far; the request beside it is unaffected."""
    r = make_runner(max_num_reqs=2)
    r.add_request("a", prompt(5, 97), params(max_tokens=3 * CL))
    r.add_request("b", prompt(6, 98), params(max_tokens=CL))
    while "a" not in r._running or len(r._running["a"].output) < CL:
        r.step()
    res_a = r.abort("a")
    assert res_a.finish_reason == "aborted" and len(res_a.output_token_ids) == CL
    assert "a" not in r.model_state.req_id_to_index and not r.allocator.blocks("a")
    res = r.run(max_steps=200)
    assert res["a"].finish_reason == "aborted" and res["b"].finish_reason == "length"
    assert res["b"].output_token_ids == _solo(make_runner, "b", prompt(6, 98), params(max_tokens=CL)).output_token_ids
    assert r.allocator.num_free == r.allocator.num_blocks and sorted(r._free_slots) == [0, 1]


def test_abort_of_a_waiting_request_and_of_unknown_or_finished_ones(make_runner):
    r = make_runner()
    r.add_request("later", prompt(4), params(max_tokens=2), arrival_step=5)
    assert r.abort("later").admit_step == -1 and not r.has_unfinished
    with pytest.raises(ValueError, match="unknown"):
        r.abort("nobody")
    r.add_request("done", prompt(4), params(max_tokens=2))
    r.run(max_steps=100)
    with pytest.raises(ValueError, match="already finished"):
        r.abort("done")


def test_slot_removed_behind_the_harness_is_a_clear_error_not_a_page_pool_error(make_runner):
    """model_state.remove_request() of a running request (instead of HarnessRunner.abort): the next step names the
    request and abort (was: 'none could be scheduled ... enlarge num_blocks')."""
    r = make_runner()
    r.add_request("a", prompt(3), params(max_tokens=CL))
    r.add_request("b", prompt(2), params(max_tokens=CL))
    r.step()
    r.model_state.remove_request("a")
    with pytest.raises(RuntimeError, match=r"\['a'\].*abort") as e:
        r.run(max_steps=100)
    assert "num_blocks" not in str(e.value)


def test_requests_admitted_by_schedule_batch_are_reported_in_the_next_step_s_arrivals(make_runner):
    """schedule_batch admits arrivals (they get slots and are scheduled) but recorded them in a throwaway
    StepRecord, so no StepRecord ever listed them in ``arrived`` (the demo's event line showed nothing)."""
    r = make_runner()
    r.add_request("a", prompt(5, 0), params(max_tokens=CL))
    r.add_request("b", prompt(3, 1), params(max_tokens=CL), arrival_step=1)
    assert r.schedule_batch().req_ids == ["a"]
    assert r.step().arrived == ["a"]
    assert r.step().arrived == ["b"]                    # admitted by the step itself, as before
    r.run()
    assert sorted(x for h in r.history for x in h.arrived) == ["a", "b"]
