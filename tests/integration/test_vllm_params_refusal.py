"""A request whose sampling parameters blockdiff refuses, under the plugin's schedulers on vLLM's real ones: it fails
alone at ``add_request`` with finish reason ``error``, before it is scheduled (never reaches the worker, no KV block),
its client learns why (vLLM 0.33.0: the output's ``error``, ``RequestError(code="validation_error", message=...)``,
raised by vLLM's ``AsyncLLM`` client as ``VLLMValidationError``; vLLM 0.26.0: the server log, at WARNING once per
request), and the requests beside it are served as without it (``blockdiff.integration.vllm_scheduler.ParamsRefusals``;
docs/ARCHITECTURE.md "Integration and vLLM accounting").

The engine core's loop over the CPU stand-in of model runner v2 (``test_vllm_streaming_input.engine``); needs vLLM's
Python side (``source tests/integration/vllm_cpu_env.sh 0.26.0`` / ``0.33.0``). The refusal's own logic, and that it
refuses exactly what the model state refuses, are tested without vLLM in ``test_vllm_scheduler.py``.
"""
from __future__ import annotations

import logging

import pytest
from integration_helpers import CL, captured_log, needs_stack, prompt
from test_vllm_fuse_commit_async import GREEDY, _scheduler, tiny_hf_folder, vllm_env  # noqa: F401
from test_vllm_streaming_input import (_AsyncClient, _engine_core_request, _finished, _request, engine,
                                       needs_vllm, request_errors_supported)

#: Refused requests: their vLLM SamplingParams options, and a piece of the message (the option and the rule).
BAD = {
    "k": (dict(top_k=5), "top_k=5"),
    "lp": (dict(logprobs=2), "logprobs=2"),
    "x": (dict(extra_args={**GREEDY, "t_mni": 0.0}), "unknown key(s) 't_mni'"),
    "t": (dict(temperature=0.5), "temperature must be 0 (greedy) or 1.0"),
    "c": (dict(extra_args={**GREEDY, "diffusion_canvas_length": 2 * CL}), "must equal the served canvas_length"),
}


def _bad(rid, max_tokens=CL):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    kw, _ = BAD[rid]
    return Request(rid, prompt_token_ids=prompt(6, 5), sampling_params=SamplingParams(
        max_tokens=max_tokens, **{"extra_args": dict(GREEDY), **kw}), pooling_params=None)


class _Recorder:
    """The engine's ``EngineCoreOutput``s as sent (their ``error`` included)."""

    def __init__(self):
        self.outputs: list = []

    def process(self, scheduler, engine_outputs):
        self.outputs.extend(engine_outputs)


@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_refused_params_fail_alone_at_add_request_and_the_engine_serves_on(vllm_env, tiny_hf_folder, tiny_model,
                                                                          caplog, asynchronous):
    """Requests setting top_k, logprobs, an unknown extra_args key, temperature 0.5 or another canvas length, beside
    two plain requests (one arriving later): each refused one is answered once, finish reason error, no token,
    never scheduled nor seen by the worker; its output's ``error`` carries the message naming the option (0.33.0)
    or the server log does (0.26.0, WARNING, once per request); the plain requests get exactly the tokens of a run
    without them, and every KV block is free at the end."""
    def plain():
        return {0: [_request("a", prompt(10, 1), 2 * CL, resumable=False)],
                6: [_request("b", prompt(7, 2), CL + 3, resumable=False)]}

    s = _scheduler(vllm_env, tiny_hf_folder, served=CL, fuse=False, asynchronous=asynchronous)
    pool = s.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    script = plain()
    script[0] += [_bad("lp"), _bad("x")]
    script[3] = [_bad("t")]
    script[6].append(_bad("c"))
    rec = _Recorder()
    with captured_log(caplog, logging.getLogger("vllm.blockdiff.integration.vllm_scheduler"), logging.WARNING):
        s.add_request(_bad("k"))  # refused before any schedule: nothing allocated, finished at once
        assert pool.get_num_free_blocks() == free and "k" not in s.requests and not s.has_unfinished_requests()
        assert s.finished_req_ids == {"k"} and s.blockdiff_params_refusals.num_refused == 1
        answers, s, runner = engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=asynchronous,
                                    scheduler=s, client=rec)
    want, _, _ = engine(vllm_env, tiny_hf_folder, tiny_model, plain(), asynchronous=asynchronous)
    assert s.blockdiff_params_refusals.num_refused == len(BAD) and s.blockdiff_streaming_refusals.num_refused == 0
    errors = request_errors_supported()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for rid, (_, why) in BAD.items():
        assert _finished(answers, rid) == (["error"], []), rid
        assert rid not in runner.seen and rid not in runner.scheduled and rid not in s.requests, rid
        (out,) = [o for o in rec.outputs if o.request_id == rid]
        if errors:
            assert out.error.code == "validation_error" and why in out.error.message, (rid, out.error)
            assert not out.error.retryable
        else:
            assert getattr(out, "error", None) is None
        assert sum(f"request {rid} refused: " in w and why in w for w in warnings) == 1, (rid, warnings)
    for rid, n in (("a", 2 * CL), ("b", CL + 3)):
        reasons, tokens = _finished(answers, rid)
        assert reasons == ["length"] and len(tokens) == n and _finished(want, rid) == (reasons, tokens), rid
    assert not s.has_unfinished_requests() and not s.requests and pool.get_num_free_blocks() == free


@needs_stack
@needs_vllm
def test_async_llm_caller_gets_a_validation_error_naming_the_option(vllm_env, tiny_hf_folder, tiny_model):
    """What an ``AsyncLLM`` caller (vLLM's API server) gets for a refused request, through vLLM's own
    OutputProcessor: vLLM 0.33.0 raises ``VLLMValidationError`` with the message (which its OpenAI server answers
    with HTTP 400), vLLM 0.26.0 yields one finished output with finish reason ``error``. The plain request beside
    it is answered either way and nothing is left in the engine or the client."""
    script = {0: [_engine_core_request("k-1", prompt(6, 3), CL, resumable=False),
                  _engine_core_request("a-1", prompt(10, 1), 2 * CL, resumable=False)]}
    script[0][0].sampling_params.top_k = 5
    client = _AsyncClient()
    answers, s, runner = engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=False, client=client)
    if request_errors_supported():
        (got,) = client.got["k-1"]
        assert got[0] == "VLLMValidationError" and "top_k=5" in got[1], got
    else:
        assert client.got["k-1"] == [("error", 0, True)]
    assert client.aborted == [] and "k-1" not in runner.seen and "k-1" not in s.requests
    assert client.got["a-1"][-1] == ("length", 2 * CL, True)
    assert not client.op.request_states and not s.has_unfinished_requests()


@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_empty_prompt_fails_alone_at_add_request_instead_of_killing_the_engine(vllm_env, tiny_hf_folder, tiny_model,
                                                                              asynchronous):
    """Was: a request with no prompt token (vLLM's front end refuses one; an EngineCoreRequest passed by hand does
    not) reached vLLM's ``schedule``, whose ``assert num_new_tokens > 0`` failed in the engine core (0.26.0 and
    0.33.0): the engine died with every request in it. Now it is refused at add_request, finish reason error, and the
    request beside it gets the tokens of a run without it. A prompt longer than max_model_len is answered
    (finish reason length), as before."""
    def plain():
        return {0: [_request("a", prompt(10, 1), 2 * CL, resumable=False)]}

    script = plain()
    script[0] += [_request("e", [], CL, resumable=False), _request("long", prompt(300, 3), CL, resumable=False)]
    answers, s, runner = engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=asynchronous)
    want, _, _ = engine(vllm_env, tiny_hf_folder, tiny_model, plain(), asynchronous=asynchronous)
    assert _finished(answers, "e") == (["error"], []) and "e" not in runner.seen
    assert s.blockdiff_params_refusals.num_refused == 1
    assert _finished(answers, "long") == (["length"], [])
    assert _finished(answers, "a") == _finished(want, "a") and len(_finished(answers, "a")[1]) == 2 * CL
    assert not s.has_unfinished_requests() and not s.requests
