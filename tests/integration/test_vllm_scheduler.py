"""blockdiff.integration.vllm_scheduler: the requests vLLM's diffusion scheduler would never finish (failed on
non-finite logits; next canvas past max_model_len) are finished, freed and answered, and vLLM's streaming-input
requests are refused (each fails alone with an error). Logic checked with stand-ins for vLLM's scheduler everywhere,
and with vLLM's own types where vLLM is importable (end to end: test_vllm_streaming_input.py)."""
from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace as NS

import pytest
from integration_helpers import FAKE_VLLM_TYPES, FakeRequest, FakeScheduler, captured_log

from blockdiff.integration import vllm_scheduler as VS

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
CL = 8


def test_failed_request_is_finished_with_error_and_its_client_answered():
    s = FakeScheduler([FakeRequest("a", 10), FakeRequest("b", 10)], max_model_len=100, canvas=CL)
    outputs = {}
    done = VS.finish_stuck_requests(s, {"a": 0, "b": 3}, outputs, types=FAKE_VLLM_TYPES)
    assert done == [("b", "error")]
    assert s.requests["b"].status == "FINISHED_ERROR" and s.finished_req_ids == {"b"}
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs[0].outputs] == [("b", "error", [])]
    assert [r.request_id for r in s.running] == ["a"]
    # reported again on a later step (still scheduled while the finish was in flight): nothing twice
    assert VS.finish_stuck_requests(s, {"b": 1}, outputs, types=FAKE_VLLM_TYPES) == []
    assert len(outputs[0].outputs) == 1


def test_request_whose_next_canvas_does_not_fit_is_finished_with_length():
    """num_tokens + canvas > max_model_len: vLLM would only schedule truncated canvases, which the sampler skips,
    so the request would never emit again. Per-request canvas widths (extra_args) are honoured."""
    reqs = [FakeRequest("fits", 100 - CL), FakeRequest("over", 100 - CL + 1), FakeRequest("narrow", 97, width=3)]
    s = FakeScheduler(reqs, max_model_len=100, canvas=CL)
    outputs = {0: FAKE_VLLM_TYPES.EngineCoreOutputs(outputs=["existing"])}
    done = VS.finish_stuck_requests(s, None, outputs, types=FAKE_VLLM_TYPES)
    assert done == [("over", "length")]
    assert outputs[0].outputs[0] == "existing" and outputs[0].outputs[1].finish_reason == "length"
    assert {r.request_id for r in s.running} == {"fits", "narrow"}


def test_unknown_and_finished_ids_are_ignored():
    r = FakeRequest("x", 5)
    r.status = "FINISHED_STOPPED"
    s = FakeScheduler([FakeRequest("y", 5)], max_model_len=100, canvas=CL)
    s.requests["x"] = r
    assert VS.finish_stuck_requests(s, {"x": 2, "ghost": 4}, {}, types=FAKE_VLLM_TYPES) == []


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_scheduler_classes_without_vllm_raise_clear_import_error():
    with pytest.raises(ImportError, match="need vLLM"):
        VS.BlockdiffDiffusionScheduler  # noqa: B018


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (pip install -e '.[vllm]' on a GPU host)")
def test_scheduler_classes_with_vllm():
    """The classes resolve by the --scheduler-cls path, subclass the schedulers the installed vLLM runs a
    diffusion model with (0.33.0: DiffusionScheduler / DiffusionAsyncScheduler; 0.26.0: Scheduler /
    AsyncScheduler), and the helper builds vLLM's own EngineCoreOutput with the error / length finish reasons."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.request import RequestStatus

    from blockdiff.integration import vllm_compat, vllm_plugin

    sync = resolve_obj_by_qualname(vllm_plugin.SCHEDULER_CLASS)
    asyn = resolve_obj_by_qualname(vllm_plugin.ASYNC_SCHEDULER_CLASS)
    sync_base, async_base = vllm_compat.scheduler_base_classes()
    assert sync.__bases__ == (sync_base,) and asyn.__bases__ == (async_base,)
    assert issubclass(asyn, AsyncScheduler) and not issubclass(sync, AsyncScheduler)
    if vllm_compat.current().diffusion_scheduler:
        from vllm.v1.core.sched.diffusion_scheduler import DiffusionAsyncScheduler, DiffusionScheduler

        assert issubclass(sync, DiffusionScheduler) and issubclass(asyn, DiffusionAsyncScheduler)
    assert "update_from_output" in vars(sync) and "update_from_output" in vars(asyn)

    class Req(FakeRequest):
        def get_finished_reason(self):
            return RequestStatus.get_finished_reason(self.status)

    s = FakeScheduler([Req("n", 10), Req("l", 99)], max_model_len=100, canvas=CL)
    outputs = {}
    done = VS.finish_stuck_requests(s, {"n": 2}, outputs, types=VS._vllm_types())
    assert done == [("n", "error"), ("l", "length")]
    outs = outputs[0].outputs
    assert all(isinstance(o, EngineCoreOutput) for o in outs)
    assert [o.finish_reason for o in outs] == [FinishReason.ERROR, FinishReason.LENGTH]
    assert s.requests["n"].status == RequestStatus.FINISHED_ERROR


@pytest.mark.parametrize("width", ["abc", 2.7, -4, True, 0, 1 << 16])
def test_bad_canvas_width_extra_arg_is_refused_and_the_request_finished_with_error(width):
    """extra_args diffusion_canvas_length that is no canvas width: a ValueError naming it (no truncation of 2.7,
    no 0 read as unset), and finish_stuck_requests answers that request with an error instead of crashing."""
    bad = FakeRequest("bad", 5)
    bad.sampling_params.extra_args = {"diffusion_canvas_length": width}
    with pytest.raises(ValueError, match="diffusion_canvas_length"):
        VS.diffusion_canvas_width(bad, CL)
    s = FakeScheduler([bad, FakeRequest("ok", 5)], max_model_len=100, canvas=CL)
    outputs = {}
    assert VS.finish_stuck_requests(s, None, outputs, types=FAKE_VLLM_TYPES) == [("bad", "error")]
    assert s.requests["ok"].status == "RUNNING" and [o.request_id for o in outputs[0].outputs] == ["bad"]


def test_check_canvas_rows_fit_names_a_limit_that_would_cut_every_canvas_row():
    """vLLM cuts every running row to long_prefill_token_threshold (when > 0) and to the token budget: below a canvas
    no canvas row is ever whole, and every request would hang. The plugin's schedulers refuse such a start
    (check_canvas_rows_fit, from their __init__; end to end in test_vllm_fuse_commit_async)."""

    def sched(threshold, budget):
        return NS(blockdiff_canvas_length=CL, max_num_scheduled_tokens=budget,
                  scheduler_config=NS(long_prefill_token_threshold=threshold))

    for threshold, budget in ((0, CL), (CL, CL), (None, None), (3 * CL, 100 * CL)):
        VS.check_canvas_rows_fit(sched(threshold, budget))
    VS.check_canvas_rows_fit(NS(num_spec_tokens=CL))  # no limits known: nothing to refuse
    for threshold in (1, CL - 1):
        with pytest.raises(ValueError, match=rf"long_prefill_token_threshold \({threshold}\) .*canvas_length {CL}"):
            VS.check_canvas_rows_fit(sched(threshold, 100 * CL))
    with pytest.raises(ValueError, match=rf"max_num_scheduled_tokens \({CL - 1}\) .*canvas_length {CL}"):
        VS.check_canvas_rows_fit(sched(0, CL - 1))


def test_a_served_step_cap_of_zero_is_refused_not_read_as_unset():
    """--diffusion-config '{"max_denoising_steps": 0}' (vLLM's DiffusionConfig takes any int there, and pydantic turns
    false into 0) and a generation config's 0 / false are bad caps: a ValueError naming max_denoising_steps (the
    start stops), never the generation config's cap or the default served in their place (was: ``if not steps``
    read 0 as unset). None and a missing key stay unset."""
    def cfg(d, g=None):
        return NS(diffusion_config=NS(max_denoising_steps=d), model_config=NS(try_get_generation_config=lambda: g or {}))

    for d, g in ((0, None), (0, {"max_denoising_steps": 12}), (None, {"max_denoising_steps": 0}),
                 (None, {"max_denoising_steps": False}), (False, None)):
        with pytest.raises(ValueError, match=r"max_denoising_steps .*\[1, 2\*\*14\)"):
            VS.served_max_denoising_steps(cfg(d, g))
        with pytest.raises(ValueError, match="max_denoising_steps"):
            VS.served_default_params(cfg(d, g))
    assert VS.served_max_denoising_steps(cfg(None, {"max_denoising_steps": None})) is None
    assert VS.served_max_denoising_steps(cfg(None, {"max_denoising_steps": 12})) == 12
    assert VS.served_max_denoising_steps(NS(diffusion_config=NS(canvas_length=CL))) is None
    # the same kind: a canvas_length of 0 is no canvas, never the default 256 (vLLM's DiffusionConfig refuses it too)
    assert VS.served_canvas_length(NS(diffusion_config=NS(canvas_length=None))) == (VS.DEFAULT_CANVAS_LENGTH, False)
    with pytest.raises(ValueError, match="canvas_length"):
        VS.served_default_params(NS(diffusion_config=NS(canvas_length=0)))


def test_a_generation_config_sampler_config_that_is_no_object_is_a_type_error_naming_it():
    """The served defaults read the checkpoint's sampler_config.entropy_bound: a sampler_config that is a string or a
    list stops the start with a TypeError naming sampler_config (was: AttributeError "'str' object has no attribute
    'get'", from the scheduler's and the model state's construction alike). null / absent keep the default."""
    for sc in ("EntropyBoundSampler", ["entropy_bound", 0.1], 0.1, "", []):
        with pytest.raises(TypeError, match=r"sampler_config must be an object .* got (str|list|float)"):
            VS.served_default_params(NS(), {"sampler_config": sc})
    dflt = VS.served_default_params(NS(), {}).entropy_bound
    assert VS.served_default_params(NS(), {"sampler_config": None}).entropy_bound == dflt
    assert VS.served_default_params(NS(), {"sampler_config": {"entropy_bound": 0.25}}).entropy_bound == 0.25



def test_a_generation_config_sampler_config_naming_another_sampler_class_stops_the_start():
    """vLLM's own DiffusionGemma refuses a sampler_config whose _cls_name names no EntropyBound sampler; blockdiff
    served it as the entropy-bound sampler (was: accepted, its entropy_bound read). An EntropyBound name (transformers'
    'EntropyBoundSamplerConfig', or 'EntropyBoundSampler') and an absent one are served; extra keys are ignored."""
    for name in ("TopKSamplerConfig", "", 3, ["EntropyBound"]):
        with pytest.raises(ValueError, match=r"sampler_config\._cls_name must name an EntropyBound sampler"):
            VS.served_default_params(NS(), {"sampler_config": {"entropy_bound": 0.25, "_cls_name": name}})
    for name in ("EntropyBoundSamplerConfig", "EntropyBoundSampler", None):
        sc = {"entropy_bound": 0.25, "other": 1} | ({"_cls_name": name} if name else {})
        assert VS.served_default_params(NS(), {"sampler_config": sc}).entropy_bound == 0.25

# ------------------------------------------------------------------------------------------ streaming input
def _chunk(rid, resumable=True, ids=(5, 6, 7), arrival=1.0):
    """A request as vLLM's streaming input sends it: an input chunk (resumable), arriving at ``arrival``."""
    r = FakeRequest(rid, 5)
    r.resumable, r.prompt_token_ids, r.arrival_time = resumable, list(ids), arrival
    return r


def _end(rid, arrival=0.0):
    """A session's end-of-input request as AsyncLLM builds it: prompt [0], made before the first chunk."""
    return _chunk(rid, resumable=False, ids=[0], arrival=arrival)


def _adder(s, added):
    """vLLM's add_request as the fake scheduler needs it: the request becomes live (and running, so that
    finish_requests finds it)."""
    def add(r):
        added.append(r.request_id)
        s.requests[r.request_id] = r
        s.running.append(r)
    return add


def test_streaming_input_request_fails_alone_with_error_before_it_is_scheduled(caplog):
    """A resumable request (vLLM's streaming input) goes through vLLM's add_request (its bookkeeping) and is finished
    at once with FINISHED_ERROR, so it is never scheduled; the next flush answers its client once (finish reason
    error, no token) and the log names the feature. Other requests pass through untouched."""
    s = FakeScheduler([FakeRequest("a", 10)], max_model_len=100, canvas=CL)
    ref, added = VS.StreamingInputRefusals(), []
    with captured_log(caplog, VS._log, logging.DEBUG):
        assert ref.intercept(s, _chunk("s"), _adder(s, added), types=FAKE_VLLM_TYPES) is True
    assert added == ["s"] and s.requests["s"].status == "FINISHED_ERROR" and s.finished_req_ids == {"s"}
    assert [r.request_id for r in s.running] == ["a"] and s.requests["a"].status == "RUNNING"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "request s refused: streaming input" in warnings[0] and "'error'" in warnings[0]
    outputs = {0: FAKE_VLLM_TYPES.EngineCoreOutputs(outputs=["existing"])}
    assert ref.flush(outputs, FAKE_VLLM_TYPES) == 1
    assert outputs[0].outputs[0] == "existing"
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs[0].outputs[1:]] == [("s", "error", [])]
    assert ref.flush(outputs, FAKE_VLLM_TYPES) == 0 and len(outputs[0].outputs) == 2  # answered once
    assert ref.intercept(s, FakeRequest("b", 5), _adder(s, added), types=FAKE_VLLM_TYPES) is False  # not streaming
    assert ref.intercept(s, _chunk("c", resumable=False), _adder(s, added), types=FAKE_VLLM_TYPES) is False
    assert added == ["s"] and (ref.num_refused, ref.num_dropped) == (1, 0)


def test_streaming_input_later_chunks_fail_too_and_the_end_of_input_request_is_dropped(caplog):
    """Every further input chunk of a refused session is refused the same way (one error each, logged at DEBUG
    only); the session's end-of-input request (resumable=False, the same id), which vLLM would run as a new
    request of prompt [0], is dropped and the id forgotten, so a later request of that id reaches vLLM."""
    s = FakeScheduler([], max_model_len=100, canvas=CL)
    ref, added = VS.StreamingInputRefusals(), []
    with captured_log(caplog, VS._log, logging.DEBUG):
        ref.intercept(s, _chunk("s"), _adder(s, added), types=FAKE_VLLM_TYPES)
        del s.requests["s"]  # vLLM freed it
        assert ref.intercept(s, _chunk("s"), _adder(s, added), types=FAKE_VLLM_TYPES) is True
    assert added == ["s", "s"] and s.requests["s"].status == "FINISHED_ERROR"
    assert [r.levelname for r in caplog.records if "streaming" in r.getMessage()] == ["WARNING", "DEBUG"]
    outputs = {}
    assert ref.flush(outputs, FAKE_VLLM_TYPES) == 2
    assert [(o.request_id, o.finish_reason) for o in outputs[0].outputs] == [("s", "error"), ("s", "error")]
    del s.requests["s"]
    assert "s" in ref
    assert ref.intercept(s, _end("s"), _adder(s, added), types=FAKE_VLLM_TYPES) is True
    assert added == ["s", "s"] and "s" not in s.requests and "s" not in ref and ref.flush({}, FAKE_VLLM_TYPES) == 0
    assert (ref.num_refused, ref.num_dropped) == (2, 1)
    assert ref.intercept(s, _end("s"), _adder(s, added), types=FAKE_VLLM_TYPES) is False


def test_new_request_reusing_a_refused_session_id_is_served_not_dropped():
    """A non-resumable request whose id is a remembered refused session but that is no end-of-input request (a new
    request reusing the id after the session was abandoned: vLLM 0.33's client aborts a refused session and never
    ends its input) reaches vLLM, and the session is forgotten: another prompt, or prompt [0] arriving after the
    session's latest chunk. Only prompt [0] arriving no later than the latest chunk (AsyncLLM's end-of-input, built
    before the first) is dropped, also when a new session reuses an abandoned session's id (its end-of-input is built
    after the old chunks); an unknown arrival time leaves the prompt to decide."""
    s = FakeScheduler([], max_model_len=100, canvas=CL)
    ref, added = VS.StreamingInputRefusals(), []
    for rid, new in (("p", _chunk("p", resumable=False, arrival=5.0)),
                     ("q", _chunk("q", resumable=False, ids=[0], arrival=5.0)),
                     ("r", _chunk("r", resumable=False, ids=[0, 0], arrival=0.0)),
                     ("t", _chunk("t", resumable=False, ids=[3], arrival=0.0))):
        ref.intercept(s, _chunk(rid, arrival=2.0), _adder(s, added), types=FAKE_VLLM_TYPES)
        del s.requests[rid]  # vLLM freed the refused chunk
        assert ref.intercept(s, new, _adder(s, added), types=FAKE_VLLM_TYPES) is False, rid
        assert rid not in ref, rid
        assert ref.intercept(s, _end(rid), _adder(s, added), types=FAKE_VLLM_TYPES) is False, rid  # forgotten
    assert ref.num_dropped == 0
    ref.intercept(s, _chunk("u", arrival=2.0), _adder(s, added), types=FAKE_VLLM_TYPES)
    ref.intercept(s, _chunk("u", arrival=3.0), _adder(s, added), types=FAKE_VLLM_TYPES)  # a later chunk
    assert ref.intercept(s, _end("u", arrival=2.0), _adder(s, added), types=FAKE_VLLM_TYPES) is True
    ref.intercept(s, _chunk("v", arrival=None), _adder(s, added), types=FAKE_VLLM_TYPES)
    assert ref.intercept(s, _end("v", arrival=9.0), _adder(s, added), types=FAKE_VLLM_TYPES) is True
    assert ref.num_dropped == 2 and not VS.is_end_of_input(_chunk("w", resumable=False, ids=[]), None)
    # a new session reusing an abandoned session's id: its end-of-input is built after the old chunk, before its own
    ref.intercept(s, _chunk("n", arrival=1.0), _adder(s, added), types=FAKE_VLLM_TYPES)  # abandoned
    del s.requests["n"]
    ref.intercept(s, _chunk("n", arrival=5.0), _adder(s, added), types=FAKE_VLLM_TYPES)  # the new session's chunk
    assert ref.intercept(s, _end("n", arrival=4.5), _adder(s, added), types=FAKE_VLLM_TYPES) is True
    no_prompt = _end("x")
    no_prompt.prompt_token_ids = None  # prompt embeddings
    assert not VS.is_end_of_input(no_prompt, None)


def test_streaming_chunk_naming_a_live_request_fails_that_request_instead_of_crashing():
    """A streaming input chunk whose id is a live plain request (vLLM asserts "duplicate request id"): that request
    fails with an error, nothing new is added; one whose id is a request vLLM finished but still holds (a KV
    connector's delayed free) is answered from the chunk itself."""
    s = FakeScheduler([FakeRequest("a", 10), FakeRequest("b", 10)], max_model_len=100, canvas=CL)
    done = FakeRequest("f", 10)
    done.status = "FINISHED_STOPPED"
    s.requests["f"] = done
    ref, added = VS.StreamingInputRefusals(), []
    assert ref.intercept(s, _chunk("a"), _adder(s, added), types=FAKE_VLLM_TYPES) is True
    late = _chunk("f")
    assert ref.intercept(s, late, _adder(s, added), types=FAKE_VLLM_TYPES) is True
    assert added == [] and s.requests["a"].status == "FINISHED_ERROR" and done.status == "FINISHED_STOPPED"
    assert late.status == "FINISHED_ERROR" and [r.request_id for r in s.running] == ["b"]
    outputs = {}
    ref.flush(outputs, FAKE_VLLM_TYPES)
    assert [(o.request_id, o.finish_reason) for o in outputs[0].outputs] == [("a", "error"), ("f", "error")]


def test_streaming_refusals_remember_a_bounded_number_of_sessions_and_leave_abort_markers_to_vllm():
    """At most ``capacity`` refused sessions are remembered, the least recently active forgotten first (a later chunk
    makes its session the most recent); vLLM 0.33's ``abort_immediately`` markers (prompt [0], added and aborted by
    the engine core itself) pass through untouched; a capacity that is no int >= 1 is a ValueError."""
    s = FakeScheduler([], max_model_len=100, canvas=CL)
    ref, added = VS.StreamingInputRefusals(capacity=2), []
    for rid in ("x", "y", "z"):
        ref.intercept(s, _chunk(rid), _adder(s, added), types=FAKE_VLLM_TYPES)
    assert "x" not in ref and "y" in ref and "z" in ref  # the oldest forgotten
    ref.intercept(s, _chunk("y", arrival=2.0), _adder(s, added), types=FAKE_VLLM_TYPES)  # y active again
    ref.intercept(s, _chunk("w"), _adder(s, added), types=FAKE_VLLM_TYPES)
    assert "z" not in ref and "y" in ref and "w" in ref  # the least recently active forgotten, not the oldest
    marker = _chunk("m")
    marker.abort_immediately = True  # vLLM 0.33 adds such a request and aborts it itself
    assert ref.intercept(s, marker, _adder(s, added), types=FAKE_VLLM_TYPES) is False and "m" not in ref
    assert VS.StreamingInputRefusals().capacity == VS.MAX_REFUSED_SESSIONS
    for bad in (0, -1, True, 1.5, "4"):
        with pytest.raises(ValueError, match="capacity must be an int >= 1"):
            VS.StreamingInputRefusals(bad)


# ------------------------------------------------------------------------------------------ refused sampling params
def _sp(**kw):
    """A vLLM SamplingParams stand-in at vLLM's defaults, greedy through extra_args, ``kw`` on top."""
    base = dict(temperature=1.0, top_p=1.0, seed=None, max_tokens=2 * CL, eos_token_id=None, stop_token_ids=[],
                ignore_eos=False, extra_args={"t_min": 0.0, "t_max": 0.0})
    return NS(**{**base, **kw})


def _req(rid, sp):
    r = FakeRequest(rid, 5)
    r.sampling_params = sp
    return r


#: Refused requests: (sampling params, a piece of the message naming the option and the rule).
REFUSED = {
    "k": (_sp(top_k=5), "top_k=5"),
    "lp": (_sp(logprobs=2), "logprobs=2"),
    "n": (_sp(n=2), "n=2"),
    "x": (_sp(extra_args={"t_mni": 0.0}), "unknown key(s) 't_mni'"),
    "t": (_sp(temperature=0.5), "temperature must be 0 (greedy) or 1.0"),
    "c": (_sp(extra_args={"diffusion_canvas_length": 2 * CL}), "must equal the served canvas_length"),
    "r": (_sp(extra_args={"rng_request_id": 7}), "rng_request_id"),
    "v": (_sp(stop_token_ids=[3, 99]), "vocab_size=50"),
    "tmax": (_sp(extra_args={"t_max": 0.1}), "t_max"),  # below the served t_min 0.3: depends on the defaults
}


def _types_with_request_error():
    return NS(**vars(FAKE_VLLM_TYPES), RequestError=lambda **kw: NS(**kw))


def test_refused_sampling_params_fail_at_add_request_with_the_reason_in_the_output(caplog):
    """A request whose sampling parameters blockdiff refuses goes through vLLM's add_request and is finished at once
    with FINISHED_ERROR (never scheduled); the next flush answers it once with finish reason error and, where vLLM's
    output carries a request error (0.33.0), RequestError(code="validation_error", message=<why, naming the
    option>); the reason is logged at WARNING once. A good request, vLLM's warm-up ids, a request without
    sampling params (pooling) and a live id pass through to vLLM."""
    from blockdiff.sampler import SamplingParams

    s = FakeScheduler([FakeRequest("live", 10)], max_model_len=100, canvas=CL)
    ref, added = VS.ParamsRefusals(SamplingParams(canvas_length=CL, t_min=0.3, t_max=0.8), CL, vocab_size=50), []
    types = _types_with_request_error()
    with captured_log(caplog, VS._log, logging.DEBUG):
        for rid, (sp, _) in REFUSED.items():
            assert ref.intercept(s, _req(rid, sp), _adder(s, added), types=types) is True, rid
    assert added == list(REFUSED) and s.finished_req_ids == set(REFUSED) and ref.num_refused == len(REFUSED)
    assert all(s.requests[rid].status == "FINISHED_ERROR" for rid in REFUSED)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == len(REFUSED)
    for rid, (_, why) in REFUSED.items():
        assert sum(f"request {rid} refused: " in w and why in w and "'error'" in w for w in warnings) == 1, rid
    outputs = {}
    assert ref.flush(outputs, types) == len(REFUSED) and ref.flush(outputs, types) == 0  # answered once
    got = {o.request_id: o for o in outputs[0].outputs}
    assert list(got) == list(REFUSED)
    for rid, (_, why) in REFUSED.items():
        o = got[rid]
        assert (o.finish_reason, o.new_token_ids, o.error.code) == ("error", [], "validation_error") and \
            why in o.error.message, rid
    for r in (_req("ok", _sp()), _req("ok2", _sp(extra_args={"t_max": 0.5})), _req("_warmup_0_", _sp(top_k=5)),
              _req("pool", None), _req("live", _sp(top_k=5))):
        assert ref.intercept(s, r, _adder(s, added), types=types) is False, r.request_id
    assert added == list(REFUSED) and ref.num_refused == len(REFUSED)


def test_an_empty_prompt_is_refused_at_add_request_naming_it():
    """Was passed to vLLM, whose schedule() asserted num_new_tokens > 0 in the engine core (the engine died)."""
    from blockdiff.sampler import SamplingParams

    s = FakeScheduler([], max_model_len=100, canvas=CL)
    ref, added = VS.ParamsRefusals(SamplingParams(canvas_length=CL), CL), []
    empty, one = _req("e", _sp()), _req("one", _sp())
    empty.num_prompt_tokens, one.num_prompt_tokens = 0, 1
    assert ref.reason(empty) == VS.EMPTY_PROMPT_REFUSED and "prompt is empty" in VS.EMPTY_PROMPT_REFUSED
    assert ref.intercept(s, empty, _adder(s, added), types=FAKE_VLLM_TYPES) is True
    assert ref.intercept(s, one, _adder(s, added), types=FAKE_VLLM_TYPES) is False
    assert added == ["e"] and s.requests["e"].status == "FINISHED_ERROR"


def test_refused_request_output_has_no_error_field_where_vllm_has_none():
    """vLLM 0.26.0's EngineCoreOutput has no ``error``: the output is finish reason error alone (the reason is in
    the log), built without the keyword."""
    s = FakeScheduler([], max_model_len=100, canvas=CL)
    ref = VS.ParamsRefusals(VS.served_default_params(NS()), CL)
    assert ref.intercept(s, _req("k", _sp(top_k=5)), _adder(s, []), types=FAKE_VLLM_TYPES) is True
    outputs = {}
    assert ref.flush(outputs, FAKE_VLLM_TYPES) == 1
    (o,) = outputs[0].outputs
    assert (o.request_id, o.finish_reason) == ("k", "error") and not hasattr(o, "error")


def test_scheduler_refuses_exactly_what_the_model_state_refuses_with_the_same_reason():
    """The scheduler's check is the model state's: for each request, refused by ParamsRefusals (with the defaults
    the served config gives) iff the model state in vLLM mode (the same defaults, as served_default_params builds
    them for both) fails it, and with the same text."""
    import torch

    from blockdiff.integration.batch import NewRequest
    from blockdiff.integration.model_state import DiffusionModelState
    from blockdiff.model import DiffusionGemma, tiny_config

    gen = {"t_min": 0.3, "t_max": 0.8, "sampler_config": {"entropy_bound": 0.5}}
    vc = NS(diffusion_config=NS(canvas_length=CL, max_denoising_steps=5),
            model_config=NS(hf_config=NS(canvas_length=CL), try_get_generation_config=lambda: gen))
    defaults = VS.served_default_params(vc)
    assert (defaults.canvas_length, defaults.t_min, defaults.t_max, defaults.entropy_bound,
            defaults.max_denoising_steps) == (CL, 0.3, 0.8, 0.5, 5)
    torch.manual_seed(0)
    model = DiffusionGemma(tiny_config(vocab_size=50, canvas_length=CL)).eval()
    cases = {**{rid: sp for rid, (sp, _) in REFUSED.items()}, "ok": _sp(), "ok2": _sp(extra_args={"t_max": 0.5})}
    ms = DiffusionModelState.for_harness(model, max_num_reqs=len(cases), max_num_tokens=4 * CL, canvas_length=CL,
                                         device="cpu", default_params=defaults)
    ms.mode = "vllm"
    ref = VS.ParamsRefusals(defaults, CL, vocab_size=50)
    for slot, (rid, sp) in enumerate(cases.items()):
        ms.add_request(slot, NewRequest(rid, [5, 6, 7], sp))
        why = ref.reason(_req(rid, sp))
        worker = ms.failed_reasons.get(rid)
        assert (why is None) == (worker is None) == rid.startswith("ok"), rid
        assert why is None or worker.endswith(f": {why}"), (rid, why, worker)


def test_streaming_refusal_output_carries_its_reason_where_vllm_has_request_errors():
    """The streaming-input refusal answers with the same kind of output: under vLLM 0.33.0's types a validation_error
    whose message is STREAMING_INPUT_REFUSED."""
    s = FakeScheduler([], max_model_len=100, canvas=CL)
    ref, types = VS.StreamingInputRefusals(), _types_with_request_error()
    assert ref.intercept(s, _chunk("s"), _adder(s, []), types=types) is True
    outputs = {}
    assert ref.flush(outputs, types) == 1
    (o,) = outputs[0].outputs
    assert (o.finish_reason, o.error.code, o.error.message) == ("error", "validation_error", VS.STREAMING_INPUT_REFUSED)
