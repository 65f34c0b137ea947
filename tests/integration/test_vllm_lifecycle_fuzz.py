"""Request lifecycles under the plugin's schedulers on vLLM's real ones, fuzzed: every request is answered once,
with the harness's tokens, and nothing of it is left behind.

Hypothesis draws request mixes (prompt lengths around a KV block, max_tokens below / at / around multiples of the
canvas length CL, per-request step caps, canvases converging at their first step, stop ids, staggered arrivals,
client aborts) and servers (KV caches small enough to preempt, fewer sequences, token budgets down to one canvas,
max_model_len 40 / 49 / 256, synchronous and asynchronous scheduling), and runs them through the plugin's
``BlockdiffDiffusionScheduler`` / ``BlockdiffDiffusionAsyncScheduler`` (on vLLM 0.26.0's ``Scheduler`` /
``AsyncScheduler``, 0.33.0's ``DiffusionScheduler`` / ``DiffusionAsyncScheduler``) in the engine core's step order
over the CPU stand-in of model runner v2 (``test_vllm_fuse_commit_async.serve`` / ``CpuRunner``: blockdiff's model
state in vLLM mode, the tiny model, the sampler). The properties:

- no request is lost: each gets a finish reason;
- no request is duplicated or corrupted across preemption (re-prefill and a restarted canvas), aborts, stop ids and
  length caps: its tokens are the harness's greedy ones; an aborted request's are a prefix of them; one that
  max_model_len caps ends with ``length`` after the whole canvases that fit (the harness's tokens up to there);
- nothing leaks: once the last finished ids have reached the worker (one more schedule and execute), the model state
  holds no request and no failure, the scheduler no request, the KV cache every block, the fused-commit predictor
  nothing;
- in the fused layout (served canvas 2 * CL, ``BLOCKDIFF_FUSE_COMMIT=1``), NaN logits injected into one request's
  canvas row fail that request alone (finish reason ``error``, tokens a prefix of the harness's); the requests
  batched beside it are served unchanged.

The hand-written cases of these paths are in ``test_vllm_fuse_commit_async.py`` and ``test_vllm_scheduler.py``;
this file guards their combinations. The examples are derandomized (tests/conftest.py's profile) and their count
fixed; explicit ``@example`` cases make sure preemption, max_model_len cuts and a failure after preemption run
whatever the draws (``--hypothesis-show-statistics`` lists what the drawn examples exercised). Needs vLLM's Python
side (``source tests/integration/vllm_cpu_env.sh 0.26.0`` / ``0.33.0``) and skips without it.
"""
from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from integration_helpers import CL, needs_stack, prompt
from test_vllm_fuse_commit_async import harness, needs_vllm, serve, tiny_hf_folder  # noqa: F401

import test_vllm_fuse_commit_async as A

pytestmark = [needs_stack, needs_vllm]

_REQ = st.tuples(st.sampled_from([1, 3, 8, 16, 17, 32]),                             # prompt length
                 st.sampled_from([3 * CL + 3, 1, 2, CL - 1, CL, CL + 1, 2 * CL, 4 * CL]),  # max_tokens
                 st.sampled_from([None, 1, 2]),                                     # extra_args diffusion_max_steps
                 st.booleans(),                                                     # canvases converge at step 0/1
                 st.lists(st.integers(0, 3 * CL + 2), max_size=2),                 # stop ids: answer positions
                 st.integers(0, 4),                                                 # arrival step
                 st.one_of(st.none(), st.none(), st.integers(0, 20)))             # client abort step
_SERVER = st.fixed_dictionaries(dict(num_blocks=st.sampled_from([6, 64, 9, 5]),  # 5-9: preemption
                                     max_num_seqs=st.sampled_from([4, 2]),
                                     budget=st.sampled_from([256, 3 * CL, 2 * CL, CL + 4, CL]),
                                     max_model_len=st.sampled_from([256, 40, 49]),
                                     asynchronous=st.booleans()))
#: Explicit examples, so that the paths below run whatever the draws: four long requests on a KV cache of 5 blocks
#: (4 usable, 64 tokens; preemption), and a max_model_len of 40 that cuts answers, beside a stop id, a request's own
#: cap, early convergence and an abort.
_PREEMPT = [(17, 4 * CL, None, False, [], i, None) for i in range(4)]
_CUT = [(32, 3 * CL + 3, None, False, [], 0, None), (17, 4 * CL, 2, True, [5], 1, None),
        (8, 2 * CL, None, False, [], 0, 3), (1, 3 * CL + 3, 1, False, [20], 2, None)]
_SMALL_KV = dict(num_blocks=5, max_num_seqs=4, budget=256, max_model_len=256)
_SHORT = dict(num_blocks=9, max_num_seqs=2, budget=CL + 4, max_model_len=40)
_SETTINGS = dict(deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def _quiet_vllm():
    """vLLM's INFO lines (one scheduler per example) at WARNING, for this module only."""
    log = logging.getLogger("vllm")
    old = log.level
    log.setLevel(logging.WARNING)
    yield
    log.setLevel(old)


def _requests(rows, make_runner):
    """Hypothesis rows -> (serve's requests [(req_id, prompt, max_tokens, stop ids, extra_args, arrival)],
    aborts {req_id: engine step}, the harness's answers {req_id: (reason, tokens)}). A stop id is the token at a drawn
    position of the request's answer without stop ids (random ids would hardly ever stop a request)."""
    reqs, aborts = [], {}
    for i, (plen, mt, cap, early, _, at, abort) in enumerate(rows):
        extra = {} if cap is None else {"diffusion_max_steps": cap}
        if early:
            extra.update(confidence_threshold=1e9, stability_threshold=i % 2)
        reqs.append((f"r{i}", prompt(plen, 40 + i), mt, None, extra or None, at))
        if abort is not None:
            aborts[f"r{i}"] = abort
    want = harness(make_runner, reqs)
    stops = {rid: sorted({want[rid][1][k] for k in row[4] if k < len(want[rid][1])})
             for (rid, *_), row in zip(reqs, rows)}
    if any(stops.values()):
        reqs = [(rid, ids, mt, stops[rid] or None, extra, at) for rid, ids, mt, _, extra, at in reqs]
        want = harness(make_runner, reqs)
    return reqs, aborts, want


def _expected(want, prompt_len, max_model_len):
    """The harness's (reason, tokens) as a server of ``max_model_len`` answers it: the whole canvases that fit
    (prompt + k * CL <= max_model_len), finish reason ``length`` where that cuts the harness's answer."""
    reason, toks = want
    room = (max_model_len - prompt_len) // CL * CL
    return ("length", toks[:room]) if len(toks) > room else (reason, toks)


def _events(got, want, runner, server):
    """What the example exercised (--hypothesis-show-statistics lists it)."""
    for reason in sorted({reason for reason, _ in got.values()}):
        event(f"a request finished with {reason}")
    if any(reason == "length" and len(toks) < len(want[rid][1]) for rid, (reason, toks) in got.items()):
        event("max_model_len cut an answer")
    if max(runner.adds.values(), default=0) > 1:
        event("a request was preempted and resumed")
    if sum(runner.fused.values()):
        event("a fused commit")
    event("asynchronous" if server["asynchronous"] else "synchronous")


def _check_drained(s, runner, num_blocks):
    """One more step reports the last finished ids to the worker; then nothing of any request is left."""
    runner.execute(s.schedule())
    assert runner.ms.req_id_to_index == {} and runner.reqs == {}, (runner.ms.req_id_to_index, runner.reqs)
    assert runner.ms.failed_reasons == {}, runner.ms.failed_reasons
    assert not s.requests and not s.running and not s.waiting, (list(s.requests), s.running, s.waiting)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1  # all but vLLM's null block
    p = getattr(s, "blockdiff_predictor", None)
    if p is not None:
        assert not (p._known or p._pending or p._caps or p._no_fuse), (p._known, p._pending, p._caps, p._no_fuse)


@settings(max_examples=50, **_SETTINGS)
@example(rows=_PREEMPT, server=dict(_SMALL_KV, asynchronous=True))
@example(rows=_CUT, server=dict(_SHORT, asynchronous=False))
@given(rows=st.lists(_REQ, min_size=1, max_size=5), server=_SERVER)
def test_random_request_mixes_under_vllms_schedulers_finish_every_request_with_the_harness_tokens_and_leak_nothing(
        tiny_hf_folder, tiny_model, make_runner, rows, server):
    """The one-canvas layout (served CL, no fused commits); see the module docstring for the properties."""
    reqs, aborts, want = _requests(rows, make_runner)
    plens = {rid: len(ids) for rid, ids, *_ in reqs}
    mml = server["max_model_len"]
    with pytest.MonkeyPatch.context() as mp:  # one per example: a function-scoped fixture spans every example
        got, s, runner, _ = serve(mp, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, aborts=aborts,
                                  **server)
        for rid, (reason, toks) in got.items():
            exp = _expected(want[rid], plens[rid], mml)
            assert reason is not None, (rid, got)
            if reason == "abort":
                assert rid in aborts and toks == exp[1][:len(toks)], (rid, toks, exp)
            else:
                assert (reason, toks) == exp, (rid, reason, toks, exp)
        _events(got, want, runner, server)
        _check_drained(s, runner, server["num_blocks"])


@settings(max_examples=40, **_SETTINGS)
@example(rows=_PREEMPT, server=dict(_SMALL_KV, num_blocks=6, asynchronous=True), nan_at=(1, 14))
@example(rows=_CUT, server=dict(_SHORT, budget=256, max_model_len=49, asynchronous=False), nan_at=(3, 6))
@example(rows=_CUT, server=dict(_SHORT, budget=256, max_model_len=256, asynchronous=True), nan_at=None)
@given(rows=st.lists(_REQ, min_size=1, max_size=5), server=_SERVER,
       nan_at=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(1, 12))))
def test_random_request_mixes_with_fused_commits_and_nan_logits_fail_only_the_poisoned_request_and_leak_nothing(
        tiny_hf_folder, tiny_model, make_runner, rows, server, nan_at):
    """The fused layout (served 2 * CL, BLOCKDIFF_FUSE_COMMIT=1: fused rows under the asynchronous scheduler's
    predictor, the worker's flags under the synchronous one). ``nan_at`` (request, engine step): the logits of that
    request's first canvas row scheduled at or after that step are NaN; the request may end with ``error`` (or be
    aborted, or have finished before the row ran), its tokens a prefix of the harness's; every other request is
    answered as without it."""
    reqs, aborts, want = _requests(rows, make_runner)
    plens = {rid: len(ids) for rid, ids, *_ in reqs}
    mml = server["max_model_len"]
    bad = None if nan_at is None else f"r{nan_at[0] % len(reqs)}"
    poison = {"row": None, "done": False}

    class PoisoningRunner(A.CpuRunner):
        calls = 0

        def execute(self, so):
            self.calls += 1
            if bad is not None and not poison["done"] and self.calls >= nan_at[1] \
                    and so.scheduled_spec_decode_tokens.get(bad):
                poison.update(row=list(so.num_scheduled_tokens).index(bad), done=True)
            try:
                return super().execute(so)
            finally:
                poison["row"] = None

    def forward(model, embeds, positions, meta, kv, window):
        out = real_forward(model, embeds, positions, meta, kv, window)
        if poison["row"] is not None:
            i = poison["row"]
            out[int(meta.cu_seqlens_q[i]):int(meta.cu_seqlens_q[i + 1])] = float("nan")
        return out

    import test_vllm_greedy_parity as G  # CpuRunner.execute imports forward_from_embeds from it at each call

    real_forward = G.forward_from_embeds
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "CpuRunner", PoisoningRunner)
        mp.setattr(G, "forward_from_embeds", forward)
        got, s, runner, _ = serve(mp, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True, aborts=aborts,
                                  **server)
        for rid, (reason, toks) in got.items():
            exp = _expected(want[rid], plens[rid], mml)
            assert reason is not None, (rid, got)
            if reason == "abort":
                assert rid in aborts and toks == exp[1][:len(toks)], (rid, toks, exp)
            elif rid == bad and poison["done"] and reason == "error":
                assert toks == exp[1][:len(toks)], (rid, toks, exp)
            else:
                assert (reason, toks) == exp, (rid, reason, toks, exp)
        _events(got, want, runner, server)
        _check_drained(s, runner, server["num_blocks"])
