"""DiffusionModelState hooks: inputs from the device state, causal flags from the phase, request slots,
parameter conversion, and conformance to vLLM 0.33.0's ModelState interface."""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from integration_helpers import CL, make_batch, needs_stack, params

from blockdiff.integration import model_state as MS
from blockdiff.integration.batch import NewRequest
from blockdiff.integration.model_state import DiffusionModelState
from blockdiff.integration.sampler import DiffusionSampler
from blockdiff.sampler import COMMIT, DENOISE, FINISHED, PREFILL, SamplingParams

HERE = os.path.dirname(__file__)
with open(os.path.join(HERE, "vllm_0_33_0_model_state_interface.json")) as f:
    IFACE = json.load(f)


def _check_signature(cls, name, spec):
    fn = getattr(cls, name)
    sig = inspect.signature(fn)
    ps = list(sig.parameters.values())
    positional = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [p.name for p in positional] == spec["params"], f"{name}: {[p.name for p in positional]}"
    n_def = sum(p.default is not p.empty for p in positional)
    assert n_def == spec["num_defaults"], f"{name}: {n_def} defaults, vLLM has {spec['num_defaults']}"
    # anything extra must be keyword-only with a default, so vLLM's calls still bind
    for p in ps:
        if p.kind == p.KEYWORD_ONLY:
            assert p.default is not p.empty, f"{name}: extra keyword {p.name} needs a default"


@pytest.mark.parametrize("name", sorted(IFACE["methods"]))
def test_hooks_match_recorded_vllm_0_33_0_signatures(name):
    _check_signature(DiffusionModelState, name, IFACE["methods"][name])
    if not MS.VLLM_AVAILABLE:
        _check_signature(MS.ModelStateBase, name, IFACE["methods"][name])


def test_diffusion_accounting_attributes():
    assert DiffusionModelState.num_new_sampled_tokens_per_step == 0
    assert DiffusionModelState.supports_prompt_embeds is False
    # every hook vLLM marks abstract is implemented here
    for name, spec in IFACE["methods"].items():
        if spec.get("abstract"):
            assert getattr(DiffusionModelState, name) is not getattr(MS.ModelStateBase, name), name


@pytest.mark.skipif(not MS.VLLM_AVAILABLE,
                    reason=f"vLLM is not importable here ({MS.VLLM_IMPORT_ERROR}); conformance against the "
                           "recorded 0.33.0 signatures runs above")
def test_conformance_with_installed_vllm_model_state():
    from vllm.v1.worker.gpu.model_states.interface import ModelState  # vLLM is optional: this test skips without it

    assert issubclass(DiffusionModelState, ModelState)
    assert not getattr(DiffusionModelState, "__abstractmethods__", frozenset())
    for name, fn in inspect.getmembers(ModelState, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        ours = inspect.signature(getattr(DiffusionModelState, name))
        theirs = inspect.signature(fn)
        tp = [p.name for p in theirs.parameters.values() if p.kind != p.KEYWORD_ONLY]
        ops = [p for p in ours.parameters.values() if p.kind != p.KEYWORD_ONLY]
        op = [p.name for p in ops]
        # ours may take more trailing parameters, with defaults (prepare_attn's ubatch_idx: 0.33.0 has it, 0.26.0 not)
        assert op[:len(tp)] == tp, f"{name}: ours {op}, vLLM {tp}"
        assert all(p.default is not p.empty for p in ops[len(tp):]), f"{name}: extra parameters need defaults"


# ---------------------------------------------------------------------------------------------- hooks
@pytest.fixture
def ms(tiny_model):
    return DiffusionModelState.for_harness(tiny_model, max_num_reqs=4, max_num_tokens=64, canvas_length=CL,
                                           device="cpu", default_params=params())


@needs_stack
def test_prepare_inputs_reads_canvas_commit_prompt_and_self_conditioning(ms):
    st = ms.state
    for slot, rid in ((2, "den"), (0, "com"), (1, "pre")):
        ms.add_request(slot, NewRequest(rid, [5, 6, 7], params()))
    st.phase[2], st.phase[0] = DENOISE, COMMIT
    st.canvas[2] = torch.arange(100, 100 + CL)
    st.commit_canvas[0] = torch.arange(200, 200 + CL)
    st.canvas[0] = 999  # must not leak into the commit row
    st.soft[2] = torch.randn(CL, ms.hidden_size)
    st.soft[0] = 3.0  # a commit row's self-conditioning must be exactly zero
    b = make_batch([("den", 2, CL, 20, 3, None), ("com", 0, CL, 12, 3, None), ("pre", 1, 3, 0, 3, [5, 6, 7])])
    out = ms.prepare_inputs(b, None)
    ids, sc = out["input_ids"], out["self_cond"]
    assert ids.tolist() == list(range(100, 100 + CL)) + list(range(200, 200 + CL)) + [5, 6, 7]
    assert torch.equal(sc[:CL], st.soft[2])
    assert torch.count_nonzero(sc[CL:]) == 0
    assert torch.equal(out["positions"], b.positions)
    # persistent buffers: the same storage every step (CUDA-graph friendly), and prepare_dummy_inputs aliases it
    dummy = ms.prepare_dummy_inputs(3, b.num_tokens)
    assert dummy["input_ids"].data_ptr() == ids.data_ptr() and dummy["self_cond"].data_ptr() == sc.data_ptr()
    assert ms.prepare_inputs_embeds({}, b, None) is None


@needs_stack
def test_prepare_attn_causal_flags_from_phase_in_persistent_buffer(ms):
    for slot, rid in ((3, "a"), (1, "b"), (0, "c")):
        ms.add_request(slot, NewRequest(rid, [1, 2], params()))
    ms.state.phase[3], ms.state.phase[1] = DENOISE, COMMIT
    b = make_batch([("a", 3, CL, 10, 2, None), ("b", 1, CL, 10, 2, None), ("c", 0, 2, 0, 2, [1, 2])])
    meta = ms.prepare_attn(b, None, (b.block_table,), b.slot_mapping, None, None)
    assert meta.causal.tolist() == [False, True, True]
    assert meta.causal.data_ptr() == ms.causal_buf.data_ptr()
    assert meta.cu_seqlens_q.tolist() == [0, CL, 2 * CL, 2 * CL + 2]
    assert meta.seq_lens.tolist() == [10 + CL, 10 + CL, 2]
    ms.state.phase[3] = COMMIT  # phase changes -> same buffer, new flags
    meta2 = ms.prepare_attn(b, None, (b.block_table,), b.slot_mapping, None, None)
    assert meta2.causal.data_ptr() == meta.causal.data_ptr() and meta2.causal.tolist() == [True, True, True]
    with pytest.raises(ValueError, match="ubatch_idx"):
        ms.prepare_attn(b, None, (b.block_table,), b.slot_mapping, None, None, ubatch_idx=1)


@needs_stack
def test_fill_causal_refuses_a_row_count_outside_the_batch_and_the_buffer(ms):
    """fill_causal's ``num_reqs`` (the padded row count of a FULL CUDA-graph step) must cover the batch's rows and
    fit the persistent buffer, as fill_num_causal_q's: was a silently shorter flag tensor (the last rows' flags cut
    off, or the padding rows missing), which the attention would read against longer metadata."""
    for slot, rid in ((3, "a"), (1, "b")):
        ms.add_request(slot, NewRequest(rid, [1, 2], params()))
    ms.state.phase[3] = DENOISE
    b = make_batch([("a", 3, CL, 10, 2, None), ("b", 1, 2, 0, 2, [1, 2])])
    cap = ms.causal_buf.shape[0]
    assert ms.fill_causal(b, cap).tolist() == [False, True] + [False] * (cap - 2)  # padding rows bidirectional
    for bad in (1, cap + 1):
        with pytest.raises(ValueError, match=rf"num_reqs must be in \[2, {cap}\], got {bad}"):
            ms.fill_causal(b, bad)
        with pytest.raises(ValueError, match=rf"num_reqs must be in \[2, {cap}\], got {bad}"):
            ms.fill_num_causal_q(b, bad)


@needs_stack
def test_add_remove_request_slots(ms):
    ms.add_request(2, NewRequest("x", [1], params()))
    assert ms.state.phase[2].item() == PREFILL and ms.req_id_to_index == {"x": 2}
    with pytest.raises(ValueError, match="already"):
        ms.add_request(3, NewRequest("x", [1], params()))
    with pytest.raises(ValueError, match="held"):
        ms.add_request(2, NewRequest("y", [1], params()))
    with pytest.raises(ValueError, match="req_index"):
        ms.add_request(4, NewRequest("y", [1], params()))
    with pytest.raises(ValueError, match="empty"):
        ms.add_request(1, NewRequest("y", [], params()))
    with pytest.raises(ValueError, match="canvas_length"):
        ms.add_request(1, NewRequest("y", [1], params(canvas_length=CL + 1)))
    ms.remove_request("nope")  # unknown ids are ignored, as vLLM removes any finished id
    ms.remove_request("x")
    assert ms.state.phase[2].item() == FINISHED and not ms.req_id_to_index
    ms.add_request(2, NewRequest("y", [1], params()))  # the slot is reusable


@needs_stack
def test_request_rng_key_is_stable_and_not_the_slot(ms):
    ms.add_request(0, NewRequest("same-id", [1], params()))
    k0 = int(ms.state.request_id[0])
    ms.remove_request("same-id")
    ms.add_request(3, NewRequest("same-id", [1], params()))
    assert int(ms.state.request_id[3]) == k0 == MS.request_key("same-id")
    assert MS.request_key("a") != MS.request_key("b")


@needs_stack
def test_postprocess_state_records_kv_length(ms):
    ms.add_request(1, NewRequest("a", [1], params()))
    nct = torch.zeros(4, dtype=torch.int32)
    nct[1] = 37
    ms.postprocess_state(torch.tensor([1]), torch.tensor([0], dtype=torch.int32), nct)
    assert ms.num_computed_tokens.tolist() == [0, 37, 0, 0]
    ms.postprocess_state(torch.tensor([-1]), torch.tensor([0], dtype=torch.int32), torch.full((4,), 9))
    assert ms.num_computed_tokens.tolist() == [0, 37, 0, 0]  # masked (-1) entries are skipped


@needs_stack
def test_postprocess_state_masked_entries_never_overwrite_a_live_slot(ms):
    """vLLM passes -1 for masked entries of idx_mapping. A step whose rows are [slot 0, masked] (or [masked, slot 0],
    or several masked) records slot 0's KV length; the masked entries touch no slot (was: they were redirected to
    slot 0 with its old value, and index_copy_ kept the stale write: [0, -1] left slot 0 at 0)."""
    ms.add_request(0, NewRequest("a", [1], params()))
    ms.add_request(2, NewRequest("b", [1], params()))
    nct = torch.tensor([37, 5, 11, 9], dtype=torch.int32)
    none = torch.zeros(2, dtype=torch.int32)
    ms.postprocess_state(torch.tensor([0, -1]), none, nct)
    assert ms.num_computed_tokens.tolist() == [37, 0, 0, 0]
    nct[0] = 40
    ms.postprocess_state(torch.tensor([-1, -1, 0, 2]), torch.zeros(4, dtype=torch.int32), nct)
    assert ms.num_computed_tokens.tolist() == [40, 0, 11, 0]
    ms.remove_request("a")
    assert ms.num_computed_tokens.tolist() == [0, 0, 11, 0]


@needs_stack
def test_custom_sampler_replaces_sampler_and_rejection_sampler(ms):
    s, rej = ms.custom_sampler(object())
    assert isinstance(s, DiffusionSampler) and rej is None
    assert s.embedding is ms.model.embedding_weight


@needs_stack
def test_vllm_style_sampling_params_conversion():
    defaults = SamplingParams(canvas_length=CL, max_denoising_steps=9, entropy_bound=0.2)
    sp = SimpleNamespace(seed=None, max_tokens=40, ignore_eos=False, eos_token_id=1, stop_token_ids=[106],
                         extra_args={"diffusion_max_steps": 4, "t_min": 0.1})
    p = MS.to_diffusion_params(sp, defaults, canvas_length=CL)
    assert (p.seed, p.max_tokens, p.max_denoising_steps, p.t_min, p.entropy_bound) == (0, 40, 4, 0.1, 0.2)
    assert p.eos_token_ids == (1, 106)
    sp.extra_args = {"diffusion_canvas_length": CL * 2}
    with pytest.raises(ValueError, match="canvas_length"):
        MS.to_diffusion_params(sp, defaults, canvas_length=CL)


def test_vllm_extra_args_int_beyond_float_range_is_refused_with_a_value_error_naming_the_field():
    """extra_args t_max = an int beyond float's range (what a JSON body's 1 and 400 zeros decodes to) raised
    OverflowError, which the refusal path (ParamsRefusals, the model state's backstop: TypeError / ValueError) did not
    catch, so the engine's add_request raised instead of failing the request."""
    sp = SimpleNamespace(seed=None, max_tokens=8, ignore_eos=True, eos_token_id=1, stop_token_ids=None,
                         extra_args={"t_max": 10 ** 400})
    with pytest.raises(ValueError, match=r"t_max must be finite, got an int of 1329 bits"):
        MS.to_diffusion_params(sp, params(), canvas_length=CL)


def test_unsupported_vllm_options_are_refused_not_silently_ignored():
    """Options the diffusion sampler does not implement (penalties, top-k/p, min-p, min_tokens, logprobs,
    logit_bias, allowed / bad words, structured outputs, n > 1) raise a ValueError naming them when set; their
    vLLM defaults (and empty containers) pass. temperature 0 means greedy; 1.0 (the default) leaves the
    schedule alone; other values and greedy with a nonzero extra_args schedule are refused."""
    defaults = params()
    base = dict(seed=1, max_tokens=None, ignore_eos=False, eos_token_id=1, stop_token_ids=None, extra_args=None,
                n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0,
                top_p=1.0, top_k=0, min_p=0.0, min_tokens=0, logprobs=None, prompt_logprobs=None, logit_bias=None,
                allowed_token_ids=[], bad_words=None, structured_outputs=None, logprob_token_ids=None)
    p = MS.to_diffusion_params(SimpleNamespace(**base), defaults, canvas_length=CL)
    assert (p.t_min, p.t_max) == (defaults.t_min, defaults.t_max)
    assert MS.unsupported_vllm_options(SimpleNamespace(**base)) == []
    for name, value in (("n", 2), ("presence_penalty", 0.5), ("frequency_penalty", 0.1),
                        ("repetition_penalty", 1.1), ("top_k", 5), ("min_p", 0.1), ("min_tokens", 4),
                        ("logprobs", 0), ("prompt_logprobs", 1), ("logit_bias", {3: 1.0}),
                        ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]), ("structured_outputs", object()),
                        ("top_p", 0.9)):
        with pytest.raises(ValueError, match=name):
            MS.to_diffusion_params(SimpleNamespace(**dict(base, **{name: value})), defaults, canvas_length=CL)
    greedy = MS.to_diffusion_params(SimpleNamespace(**dict(base, temperature=0.0, top_p=0.5)), defaults,
                                    canvas_length=CL)          # vLLM resets top_p for greedy requests
    assert (greedy.t_min, greedy.t_max) == (0.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        MS.to_diffusion_params(SimpleNamespace(**dict(base, temperature=0.7)), defaults, canvas_length=CL)
    with pytest.raises(ValueError, match="conflicts"):
        MS.to_diffusion_params(SimpleNamespace(**dict(base, temperature=0.0, extra_args={"t_max": 0.8})),
                               defaults, canvas_length=CL)
    ok = MS.to_diffusion_params(SimpleNamespace(**dict(base, extra_args={"t_min": 0.2, "t_max": 0.6})), defaults,
                                canvas_length=CL)
    assert (ok.t_min, ok.t_max) == (0.2, 0.6)


@needs_stack
@pytest.mark.parametrize("field,value,err,name", [
    ("temperature", -1.0, ValueError, "temperature"),        # was: greedy
    ("temperature", float("inf"), ValueError, "temperature"),
    ("temperature", "1.0", TypeError, "temperature"),
    ("temperature", True, TypeError, "temperature"),
    ("extra_args", {"tmin": 0.1}, ValueError, "tmin"),      # was: the misspelled key ignored
    ("extra_args", {"t_min": 0.1, "diffusion_steps": 3}, ValueError, "diffusion_steps"),
    ("extra_args", ["t_min"], TypeError, "extra_args"),     # was: "list indices must be integers"
    ("extra_args", "t_min=0.1", TypeError, "extra_args"),
    ("max_tokens", 4.5, TypeError, "max_tokens"),           # was: truncated to 4
    ("max_tokens", True, TypeError, "max_tokens"),
    ("max_tokens", "8", TypeError, "max_tokens"),
    ("seed", 1.5, TypeError, "seed"),                       # was: int(1.5)
    ("seed", "3", TypeError, "seed"),
])
def test_vllm_style_params_are_not_coerced(field, value, err, name):
    defaults = params()
    base = dict(temperature=1.0, seed=None, max_tokens=None, eos_token_id=None, stop_token_ids=None, extra_args=None,
                ignore_eos=False)
    with pytest.raises(err, match=name):
        MS.to_diffusion_params(SimpleNamespace(**dict(base, **{field: value})), defaults, canvas_length=CL)


@needs_stack
@pytest.mark.parametrize("bad", [{"temperature": 1.0}, "greedy", 0, [1.0], (1.0,)])
def test_sampling_params_of_neither_kind_are_a_type_error(bad):
    with pytest.raises(TypeError, match="sampling_params"):
        MS.to_diffusion_params(bad, params(), canvas_length=CL)
    with pytest.raises(TypeError, match="defaults"):
        MS.to_diffusion_params(SimpleNamespace(temperature=1.0), {"canvas_length": CL})


@needs_stack
def test_every_documented_extra_args_key_is_read():
    sp = SimpleNamespace(temperature=1.0, seed=np.int64(4), max_tokens=np.int64(9), extra_args={
        "diffusion_max_steps": 5, "t_min": 0.1, "t_max": 0.7, "entropy_bound": 0.3, "confidence_threshold": 0.02,
        "stability_threshold": 2, "diffusion_canvas_length": CL})
    p = MS.to_diffusion_params(sp, params(), canvas_length=CL)
    assert sorted(MS.VLLM_EXTRA_ARGS) == sorted(sp.extra_args)
    assert (p.max_denoising_steps, p.t_min, p.t_max, p.entropy_bound, p.confidence_threshold, p.stability_threshold,
            p.canvas_length, p.seed, p.max_tokens) == (5, 0.1, 0.7, 0.3, 0.02, 2, CL, 4, 9)


@pytest.mark.skipif(not MS.VLLM_AVAILABLE, reason=f"vLLM is not importable here ({MS.VLLM_IMPORT_ERROR})")
def test_unsupported_option_check_passes_vllm_default_sampling_params():
    """vLLM's own SamplingParams with defaults (and greedy) are accepted; a set option is refused by name."""
    from vllm import SamplingParams as VllmSP  # vLLM is optional: this test skips without it

    assert MS.unsupported_vllm_options(VllmSP()) == []
    assert MS.unsupported_vllm_options(VllmSP(temperature=0.0)) == []
    assert MS.unsupported_vllm_options(VllmSP(min_tokens=3, top_k=4)) == ["top_k=4", "min_tokens=3"]


@needs_stack
def test_ignore_eos_drops_only_the_eos_token_and_keeps_explicit_stop_token_ids():
    """vLLM's check_stop stops on ``eos_token_id`` (None under ignore_eos) or any ``stop_token_ids`` entry;
    ``all_stop_token_ids`` keeps the EOS even with ignore_eos (it serves min_tokens) and is not the stop set.
    (Was: ignore_eos dropped the user's stop_token_ids too, and the stop set came from all_stop_token_ids.)"""
    defaults = params()
    sp = SimpleNamespace(seed=1, max_tokens=None, ignore_eos=True, eos_token_id=None, stop_token_ids=[7, 3],
                         all_stop_token_ids={1, 3, 7}, extra_args=None)
    assert MS.to_diffusion_params(sp, defaults, canvas_length=CL).eos_token_ids == (3, 7)
    sp.eos_token_id = 1  # even if an EOS id is present, ignore_eos drops it
    assert MS.to_diffusion_params(sp, defaults, canvas_length=CL).eos_token_ids == (3, 7)
    sp.ignore_eos, sp.stop_token_ids = False, None
    assert MS.to_diffusion_params(sp, defaults, canvas_length=CL).eos_token_ids == (1,)
    sp.ignore_eos = True
    assert MS.to_diffusion_params(sp, defaults, canvas_length=CL).eos_token_ids == ()


@needs_stack
@pytest.mark.skipif(not MS.VLLM_AVAILABLE, reason=f"vLLM is not importable here ({MS.VLLM_IMPORT_ERROR})")
def test_stop_set_matches_vllm_sampling_params_after_generation_config():
    """With vLLM's own SamplingParams, as its input processor prepares them (update_from_generation_config with
    the tokenizer's EOS and the generation config's extra EOS ids): our stop set is exactly what check_stop
    stops on."""
    from vllm import SamplingParams as VllmSP  # vLLM is optional: this test skips without it

    for ignore_eos in (False, True):
        sp = VllmSP(max_tokens=32, stop_token_ids=[50, 60], ignore_eos=ignore_eos)
        sp.update_from_generation_config({"eos_token_id": [1, 106]}, eos_token_id=1)
        expect = set(sp.stop_token_ids or ()) | ({sp.eos_token_id} if sp.eos_token_id is not None else set())
        got = MS.to_diffusion_params(sp, params(), canvas_length=CL).eos_token_ids
        assert set(got) == expect
        assert set(got) == ({50, 60} if ignore_eos else {1, 50, 60, 106})


@needs_stack
def test_add_request_grows_the_stop_id_buffer(ms):
    """More stop ids than the buffer holds (was: > 8 raised in add_request, under vLLM a crash of the engine):
    the buffer grows, the other slots keep theirs."""
    ms.add_request(0, NewRequest("x", [1, 2], params(eos_token_ids=(5, 6))))
    w0 = ms.state.max_eos
    ids = tuple(range(10, 10 + w0 + 5))
    sp = SimpleNamespace(seed=1, max_tokens=None, ignore_eos=False, eos_token_id=None, stop_token_ids=list(ids),
                         extra_args={"diffusion_max_steps": 3})
    ms.add_request(1, NewRequest("y", [1, 2], sp))
    assert ms.state.max_eos >= len(ids)
    assert ms.state.eos_token_ids[1, : len(ids)].tolist() == list(ids)
    assert ms.state.eos_token_ids[0, :3].tolist() == [5, 6, -1]
    with pytest.raises(ValueError, match="max_stop_token_ids"):
        DiffusionModelState.for_harness(ms.model, max_num_reqs=1, max_num_tokens=CL, canvas_length=CL, device="cpu",
                                        max_stop_token_ids=0)


@needs_stack
def test_resumed_request_keeps_its_emitted_count_and_canvas_index(ms):
    """add_request of a preempted request (prefill_token_ids = prompt + generated): the generated tokens count as
    emitted and the next canvas index follows the committed canvases; a malformed prefill is a ValueError."""
    gen = list(range(20, 20 + 2 * CL))
    ms.add_request(2, NewRequest("r", [1, 2, 3], params(max_tokens=5 * CL), prefill_token_ids=[1, 2, 3] + gen))
    assert ms.state.num_emitted[2].item() == 2 * CL and ms.state.canvas_index[2].item() == 2
    with pytest.raises(ValueError, match="prefill_token_ids"):
        ms.add_request(3, NewRequest("q", [1, 2, 3], params(), prefill_token_ids=[9, 2, 3, 4]))
    assert "q" not in ms.req_id_to_index


def test_harness_construction_rejects_bad_capacities(tiny_model):
    with pytest.raises(ValueError, match="max_num_tokens"):
        DiffusionModelState.for_harness(tiny_model, max_num_reqs=2, max_num_tokens=CL - 1, canvas_length=CL,
                                        device="cpu")
    with pytest.raises(ValueError, match="max_num_reqs"):
        DiffusionModelState.for_harness(tiny_model, max_num_reqs=0, max_num_tokens=64, canvas_length=CL,
                                        device="cpu")


def test_stop_token_ids_that_is_not_a_list_and_a_non_number_temperature_are_handled():
    """stop_token_ids=7 was "TypeError: 'int' object is not iterable"; unsupported_vllm_options with top_p set and a
    str temperature was "'<' not supported between 'str' and 'float'" (a temperature that is no number is not
    greedy: top_p is reported)."""
    with pytest.raises(TypeError, match="stop_token_ids must be a list of ints or None, got int"):
        MS.stop_token_ids_of(SimpleNamespace(stop_token_ids=7))
    assert MS.stop_token_ids_of(SimpleNamespace(stop_token_ids=(3, 1), eos_token_id=2)) == (1, 2, 3)
    assert MS.unsupported_vllm_options(SimpleNamespace(top_p=0.9, temperature="x")) == ["top_p=0.9"]


@needs_stack
@pytest.mark.parametrize("name,value", [
    ("thinking_token_budget", 5), ("thinking_token_budget", 0), ("trace_decode_token_ids", [1, 2, 3]),
    ("prompt_logprob_token_ids", [[1, 2], [3, 4]]), ("prompt_logprob_token_ids", np.array([[1, 2]])),
])
def test_vllm_0_33_sampler_side_options_are_refused_not_silently_ignored(name, value):
    """vLLM 0.33.0's own Sampler (which custom_sampler replaces) applies thinking_token_budget and
    trace_decode_token_ids, and its prompt-logprobs worker scores prompt_logprob_token_ids as it does
    prompt_logprobs: a request setting one was served with it silently ignored. Now refused by name."""
    base = dict(temperature=1.0, seed=None, max_tokens=None, eos_token_id=None, stop_token_ids=None,
                extra_args=None, ignore_eos=False)
    assert MS.unsupported_vllm_options(SimpleNamespace(**base, **{name: None})) == []
    with pytest.raises(ValueError, match=name):
        MS.to_diffusion_params(SimpleNamespace(**base, **{name: value}), params(), canvas_length=CL)


def test_unsupported_option_message_is_short_for_a_long_value():
    bad = MS.unsupported_vllm_options(SimpleNamespace(trace_decode_token_ids=list(range(10_000))))
    assert len(bad) == 1 and bad[0].startswith("trace_decode_token_ids=[0, 1, 2") and len(bad[0]) < 120


#: Fields of vLLM's SamplingParams (0.26.0, 0.33.0) blockdiff neither reads nor refuses, and why that is right:
#: output-side options (vLLM's detokenizer / output processor), the scheduler's own checks, values vLLM derives
#: itself, and watermarking (vLLM refuses a custom sampler under a watermark config at start-up).
_VLLM_FIELDS_APPLIED_OUTSIDE_THE_SAMPLER = {
    "stop", "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length", "_eos_token_id",
    "_all_stop_token_ids", "_watermarking_skipped", "_bad_words_token_ids", "watermarking", "flat_logprobs",
    "skip_reading_prefix_cache", "repetition_detection", "routed_experts_prompt_start", "prompt_logprob_start",
}


@pytest.mark.skipif(not MS.VLLM_AVAILABLE, reason=f"vLLM is not importable here ({MS.VLLM_IMPORT_ERROR})")
def test_every_vllm_sampling_params_field_is_read_refused_or_applied_outside_the_sampler():
    """A field vLLM adds (0.33.0 added thinking-budget, trace-replay and prompt-token-id scoring options that its
    own sampler applies) must be classified here, or a request setting it is served with it silently ignored."""
    from vllm import SamplingParams as VllmSP  # vLLM is optional: this test skips without it

    read = {*MS._VLLM_PARAM_ATTRS, "top_p"}
    known = read | set(MS.UNSUPPORTED_VLLM_OPTIONS) | _VLLM_FIELDS_APPLIED_OUTSIDE_THE_SAMPLER
    fields = getattr(VllmSP, "__struct_fields__", None) or tuple(VllmSP.__dataclass_fields__)
    assert sorted(set(fields) - known) == []
    for name in set(fields) & {"thinking_token_budget", "trace_decode_token_ids", "prompt_logprob_token_ids"}:
        value = {"thinking_token_budget": 4, "trace_decode_token_ids": [1, 2],
                 "prompt_logprob_token_ids": [[1, 2]]}[name]
        assert [b.split("=")[0] for b in MS.unsupported_vllm_options(VllmSP(**{name: value}))] == [name]


def test_request_key_hashes_a_lone_surrogate_and_keeps_every_other_key():
    """A str with a lone surrogate (json.loads('"\\ud800"')) raised UnicodeEncodeError in request_key, which
    add_request calls outside its refusal path: under vLLM the engine went down. Keys of valid strs are unchanged."""
    import hashlib

    s = json.loads('"a\\ud800b"')
    assert isinstance(MS.request_key(s), int) and MS.request_key(s) != MS.request_key("ab")
    for rid in ("cmpl-1", "é漢字🙂", ""):
        old = int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") & (2 ** 63 - 1)
        assert MS.request_key(rid) == old


@needs_stack
def test_vllm_mode_serves_a_request_whose_ids_hold_a_lone_surrogate(ms):
    s = json.loads('"r\\udc80"')
    sp = SimpleNamespace(temperature=1.0, seed=None, max_tokens=8, eos_token_id=1, stop_token_ids=None,
                         ignore_eos=False, extra_args={MS.VLLM_RNG_REQUEST_ID: s})
    ms.mode = "vllm"
    ms.add_request(0, NewRequest(s, [5, 6], sp))      # the request's own id, and its rng_request_id
    assert ms.state.phase[0].item() == PREFILL and s not in ms.failed_reasons
    assert ms.state.request_id[0].item() == MS.request_key(s)


@needs_stack
@pytest.mark.parametrize("attr", [123, "", "other"])
def test_vllm_mode_keys_the_noise_by_extra_args_whatever_rng_request_id_attribute_vllm_s_request_data_has(ms, attr):
    """Under vLLM the worker keys a request as the plugin's scheduler checked it: ``extra_args`` rng_request_id, else
    req_id. add_request read ``new_req_data.rng_request_id`` in both modes (the harness's NewRequest field), so a
    vLLM NewRequestData with an attribute of that name of its own (an int, an empty str: the request FAILED, though
    the scheduler accepted it; a str: other noise than the scheduler's and the README's key) changed the request.
    Now only the harness reads it."""
    @dataclasses.dataclass
    class NewRequestData:  # a vLLM-like object that happens to have the attribute
        req_id: str
        prompt_token_ids: list
        sampling_params: object
        rng_request_id: object = None

    sp = SimpleNamespace(temperature=1.0, seed=None, max_tokens=8, eos_token_id=1, stop_token_ids=None,
                         ignore_eos=False, extra_args={MS.VLLM_RNG_REQUEST_ID: "req-0"})
    ms.mode = "vllm"
    ms.add_request(0, NewRequestData("cmpl-x", [5, 6], sp, rng_request_id=attr))
    assert ms.state.phase[0].item() == PREFILL and "cmpl-x" not in ms.failed_reasons
    assert ms.state.request_id[0].item() == MS.request_key("req-0")
    sp.extra_args = None
    ms.add_request(1, NewRequestData("cmpl-y", [5, 6], sp, rng_request_id=attr))
    assert ms.state.request_id[1].item() == MS.request_key("cmpl-y")


@needs_stack
@pytest.mark.parametrize("key,value,err", [
    ("diffusion_max_steps", 0, ValueError), ("diffusion_max_steps", 2 ** 40, ValueError),
    ("diffusion_max_steps", 3.0, TypeError), ("diffusion_canvas_length", 0, ValueError),
    ("diffusion_canvas_length", "8", TypeError), ("diffusion_canvas_length", CL * 2, ValueError),
])
def test_a_bad_renamed_extra_args_value_names_the_key_the_request_set(key, value, err):
    """extra_args diffusion_max_steps / diffusion_canvas_length set blockdiff fields of other names; a bad value
    was refused as "max_denoising_steps must be in [1, 16384)", naming a field the request never set."""
    sp = SimpleNamespace(temperature=1.0, seed=None, max_tokens=None, eos_token_id=None, stop_token_ids=None,
                         ignore_eos=False, extra_args={key: value})
    with pytest.raises(err, match=rf"extra_args\['{key}'\]"):
        MS.to_diffusion_params(sp, params(), canvas_length=CL)
