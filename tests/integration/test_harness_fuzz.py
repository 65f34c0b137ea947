"""Hypothesis fuzz of the harness scheduler: random arrivals, prompt lengths (including 1), token budgets, page
sizes that do not divide the canvas, slot counts. Every request finishes with the tokens it asked for, the
accounting invariants hold on every row, and every slot and KV page is returned."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as stg
from integration_helpers import CL, needs_stack, params, prompt

pytestmark = needs_stack

requests = stg.lists(
    stg.tuples(stg.integers(1, 40), stg.integers(0, 6), stg.integers(1, 2 * CL + 3)),  # prompt, arrival, max_tokens
    min_size=1, max_size=5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests, max_num_reqs=stg.integers(1, 3), budget_canvases=stg.integers(1, 3),
       page_size=stg.sampled_from([3, 5, 8, 16]))
def test_random_workloads_finish_with_invariants(make_runner, reqs, max_num_reqs, budget_canvases, page_size):
    r = make_runner(max_num_reqs=max_num_reqs, max_num_batched_tokens=budget_canvases * CL + 3,
                    page_size=page_size, default_params=params(max_denoising_steps=2))
    _run_to_completion(r, reqs, steps=2, max_steps=400)
    for h in r.history:
        assert h.num_tokens <= r.max_num_batched_tokens
        assert len({row.slot for row in h.rows}) == len(h.rows) <= max_num_reqs
        for row in h.rows:
            if row.phase == "denoise":
                assert (row.num_sampled, row.num_rejected, row.causal) == (0, CL, False)
            elif row.phase == "commit":
                assert (row.num_sampled, row.num_rejected, row.causal) == (CL, 0, True)
            else:
                assert (row.num_sampled, row.num_rejected, row.causal) == (0, 0, True)
    assert r.allocator.num_free == r.allocator.num_blocks
    assert not r.model_state.req_id_to_index and not r.has_unfinished


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=stg.data(), max_num_reqs=stg.integers(1, 8), page_size=stg.sampled_from([2, 3, 4, 8]),
       budget_canvases=stg.integers(1, 4),
       reqs=stg.lists(stg.tuples(stg.integers(1, 24), stg.integers(0, 4), stg.integers(1, 2 * CL + 3)),
                      min_size=1, max_size=8))  # prompt, arrival, max_tokens
def test_every_request_that_fits_the_kv_pool_alone_finishes(make_runner, data, max_num_reqs, page_size,
                                                              budget_canvases, reqs):
    """Random pools no larger than a few pages beyond the largest request's footprint (prompt + every canvas it
    commits), random slots, budgets, prompt lengths and arrivals (was: a pool smaller than the slots' demand
    stopped with 'enlarge num_blocks'): every request finishes with the tokens it asked for (admission waits for
    free pages, the scheduler preempts lower-priority requests and resumes them from prompt + output), none is
    lost, and every page and slot comes back. (Outputs are compared with an unpreempted run in the deterministic
    preemption tests of test_harness.py: here a different batch composition changes fp32 rounding, which can flip
    a near-tie of a random-weight model.)"""
    footprint = max(-(-(plen + -(-mt // CL) * CL) // page_size) for plen, _, mt in reqs)
    num_blocks = data.draw(stg.integers(footprint, footprint + 4), label="num_blocks")
    tight = make_runner(num_blocks=num_blocks, max_num_reqs=max_num_reqs, page_size=page_size,
                        max_num_batched_tokens=budget_canvases * CL + 3, default_params=params(max_denoising_steps=1))
    _run_to_completion(tight, reqs, steps=1, max_steps=3000)
    for h in tight.history:
        assert h.num_tokens <= tight.max_num_batched_tokens
    assert tight.allocator.num_free == num_blocks and sorted(tight._free_slots) == list(range(max_num_reqs))
    assert not tight.model_state.req_id_to_index and not tight.has_unfinished


def _run_to_completion(r, reqs, *, steps, max_steps):
    """Add ``reqs`` ((prompt_len, arrival, max_tokens) each) to runner ``r``, run it, and check every request
    finished with its max_tokens tokens, canvases and an admission no earlier than its arrival."""
    for i, (plen, arrival, max_tokens) in enumerate(reqs):
        r.add_request(f"r{i}", prompt(plen, i), params(max_denoising_steps=steps, max_tokens=max_tokens, seed=i),
                      arrival_step=arrival)
    res = r.run(max_steps=max_steps)
    assert set(res) == {f"r{i}" for i in range(len(reqs))}
    for i, (plen, arrival, max_tokens) in enumerate(reqs):
        x = res[f"r{i}"]
        assert len(x.output_token_ids) == max_tokens and x.finish_reason == "length"
        assert x.num_canvases == -(-max_tokens // CL) and x.admit_step >= arrival
