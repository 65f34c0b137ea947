"""Issue 25's served greedy check on the CPU: DiffusionModelState in vLLM mode, driven in vLLM 0.26.0's call order,
gives the harness's greedy tokens for the demo prompts on the shipped checkpoint, token for token.

The first H200 serve (vLLM 0.26.0 + the plugin, ``bench/results/serve_smoke-h200.json``) answered every prompt, but
its greedy text differed from the harness's from the first tokens on. Two causes in the plugin, each reproduced
here without a GPU:

1. RNG identity: a request's noise (its initial canvases) is keyed by ``request_key(req_id)``; vLLM's request ids
   are ``cmpl-<uuid>-<i>-<8 random chars>``, so a served greedy request started from other random canvases than the
   harness's ``req-0``. Now ``vllm_xargs["rng_request_id"]`` names the identity (``model_state.rng_request_id``).
2. Window rule: the CUSTOM attention backend ran bidirectional rows with a symmetric sliding window; the checkpoint
   (as transformers' DiffusionGemma) uses ``"prefix"``. Now the backend takes the model's rule
   (``vllm_plugin.bidirectional_window_of``, set on every layer by the plugin's model class).

The model forward here is blockdiff's model on its reference backends (vLLM's Gemma 4 layers need a GPU): what is
checked is everything the plugin adds around vLLM's model (request params, ids, inputs, causal flags, logits
layout, sampler, accounting, draft tokens). vLLM's own layers round differently in bf16; that part is the GPU check
(``bench/experiments/serve_smoke.py``, float32).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import uuid
from types import SimpleNamespace as NS

import numpy as np
import pytest
import snapshot_vllm_interface as SV
import torch
from integration_helpers import make_batch, needs_stack, vllm_sampler_output_class

from blockdiff.attention import AttentionMetadata
from blockdiff.bench.experiments import serve_smoke
from blockdiff.integration import HarnessRunner, vllm_compat, vllm_plugin
from blockdiff.integration.batch import HarnessInputBatch, NewRequest
from blockdiff.integration.model_state import (VLLM_EXTRA_ARGS, VLLM_RNG_REQUEST_ID, DiffusionModelState,
                                               request_key, rng_request_id, to_diffusion_params)
from blockdiff.model import DiffusionGemmaConfig
from blockdiff.model.export import export_hf
from blockdiff.model.generation import load_generation_config
from blockdiff.model.pretrained import load_pretrained, shipped_checkpoint_dir
from blockdiff.sampler import FAILED, PREFILL, SamplingParams

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """``blockdiff export`` of the shipped checkpoint (what ``vllm serve`` loaded on the H200)."""
    out = tmp_path_factory.mktemp("export")
    export_hf(shipped_checkpoint_dir(), out, max_denoising_steps=serve_smoke.STEP_CAP)
    return out


@pytest.fixture(scope="module")
def served(export_dir):
    """``(model, tokenizer)`` loaded from the export folder (bf16, as served)."""
    return load_pretrained(export_dir)


@pytest.fixture
def sampler_output_class(monkeypatch):
    """vLLM's SamplerOutput (a stand-in module without vLLM)."""
    return vllm_sampler_output_class(monkeypatch)


# ------------------------------------------------------------------------------------------ vLLM 0.26 replay
def vllm_request_id(i: int, run: int = 0) -> str:
    """An id of the form vLLM 0.26's completions endpoint and ``InputProcessor.assign_request_id`` make (their
    random parts drawn from a generator seeded by ``(run, i)``, so a test sees the same ids every time)."""
    r = np.random.default_rng([run, i])
    hexes = [uuid.UUID(bytes=r.bytes(16)).hex for _ in range(2)]
    return f"cmpl-{hexes[0]}-{i}-{hexes[1][:8]}"


def vllm_sampling_params(extra_args: dict, max_tokens: int, eos_token_id: int):
    """The vLLM SamplingParams fields a completion request with ``vllm_xargs`` gets (vLLM's defaults elsewhere)."""
    return NS(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, n=1, presence_penalty=0.0,
              frequency_penalty=0.0, repetition_penalty=1.0, max_tokens=max_tokens, eos_token_id=eos_token_id,
              stop_token_ids=[], ignore_eos=False, extra_args=dict(extra_args))


def served_default_params(export_dir, canvas_length: int):
    """``DiffusionModelState.__init__``'s defaults: the served folder's generation_config.json (t_min, t_max,
    entropy bound, confidence / stability thresholds, step cap)."""
    gen = load_generation_config(export_dir)
    keys = ("t_min", "t_max", "entropy_bound", "confidence_threshold", "stability_threshold", "max_denoising_steps")
    return SamplingParams(canvas_length=canvas_length, **{k: gen[k] for k in keys})


def forward_from_embeds(model, inputs_embeds, positions, meta, kv_caches, bidirectional_window):
    """blockdiff's model as vLLM's model runs under the plugin: from ``inputs_embeds`` (the ModelState built them,
    self-conditioning included), attention with the CUSTOM backend's window rule. Returns ``[T, V]`` logits."""
    T = inputs_embeds.shape[0]
    post_norm = model.self_conditioning.post_norm
    model.embed_input_ids = lambda _ids: inputs_embeds
    model.self_conditioning.post_norm = torch.nn.Identity()  # already applied by the ModelState
    try:
        return model(torch.zeros(T, dtype=torch.int64), positions, meta, kv_caches, None, attn_backend="reference",
                     bidirectional_window=bidirectional_window)
    finally:
        del model.embed_input_ids
        model.self_conditioning.post_norm = post_norm


class Vllm026Replay:
    """vLLM 0.26.0's main ``Scheduler`` and model runner v2 around :class:`DiffusionModelState` (vLLM mode), one
    request at a time as ``serve_smoke client`` sends them (one row per step). Per step, as
    ``GPUModelRunner.execute_model`` / ``sample_tokens`` (``vllm/v1/worker/gpu/model_runner.py``) and
    ``Scheduler.schedule`` / ``update_from_output`` do:

    * scheduled tokens = prompt + output + spec tokens - computed (a canvas: CL draft tokens at positions
      computed .. computed + CL - 1);
    * ``add_requests``: ``model_state.add_request``, then ``sampler.add_request(idx, prompt_len, params)``;
    * ``cu_num_logits``: one row when no draft token is scheduled, else one per draft token; logits only at those
      rows (``combine_sampled_and_draft_tokens``: the last ``num_logits`` query tokens);
    * ``get_mm_embeddings`` -> ``prepare_inputs`` -> causal flags (``prepare_attn``) -> forward -> sampler;
    * ``post_update``: computed += query_len - num_rejected, the sampled tokens appended; the draft tokens
      (``req_states.draft_tokens``) become the next spec tokens unless the prompt is still being prefilled;
    * stop: EOS (kept) or max_tokens, checked per emitted token (``check_stop``); then ``remove_request``.
    """

    def __init__(self, model, default_params, *, bidirectional_window, max_num_reqs=8, page_size=16,
                 max_model_len=512, max_num_tokens=4096):
        self.model, self.bw = model, bidirectional_window
        self.CL = model.config.canvas_length
        self.page, self.max_model_len = page_size, max_model_len
        self.maxb = -(-max_model_len // page_size)
        ms = DiffusionModelState.for_harness(model, max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
                                             canvas_length=self.CL, device="cpu", default_params=default_params)
        ms.mode = "vllm"  # what DiffusionModelState.__init__ sets up under vLLM
        ms.causal_buf_i32 = torch.zeros(max_num_reqs, dtype=torch.int32)
        ms.inputs_embeds_buf = torch.zeros(max_num_tokens, model.config.hidden_size,
                                           dtype=model.embed_tokens.weight.dtype)
        self.ms = ms
        self.draft_tokens = torch.zeros(max_num_reqs, self.CL, dtype=torch.int64)  # RequestState.draft_tokens
        self.sampler, rejection = ms.custom_sampler(NS(req_states=NS(draft_tokens=self.draft_tokens)),
                                                    backend="reference")
        assert rejection is None
        self.kv = model.allocate_kv_caches(max_num_reqs * self.maxb, page_size)

    def generate(self, req_id: str, prompt: list[int], sampling_params) -> list[int]:
        """Serve one request alone, from admission to its stop; returns its output token ids."""
        r = dict(out=[], spec=[], computed=0, slot=0)
        self.ms.add_request(0, NS(req_id=req_id, prompt_token_ids=prompt, prefill_token_ids=prompt,
                                  sampling_params=sampling_params))
        self.sampler.add_request(0, len(prompt), sampling_params)
        while True:
            stop = self._step(req_id, r, prompt, sampling_params)
            if stop:
                self.ms.remove_request(req_id)
                return r["out"]

    def _step(self, req_id, r, prompt, sp) -> bool:
        CL, page = self.CL, self.page
        q = len(prompt) + len(r["out"]) + len(r["spec"]) - r["computed"]
        ctx = r["computed"]
        pos = np.arange(ctx, ctx + q, dtype=np.int64)
        pages = np.arange(r["slot"] * self.maxb, (r["slot"] + 1) * self.maxb)
        ids = np.asarray((prompt + r["out"])[ctx: ctx + q] if ctx < len(prompt) else r["spec"], dtype=np.int64)
        num_logits = len(r["spec"]) or 1  # 0.26: one logits row per request in a step without draft tokens
        qsl = np.array([0, q], dtype=np.int32)
        t = torch.as_tensor
        b = HarnessInputBatch(
            req_ids=[req_id], num_reqs=1, num_tokens=q, idx_mapping=t([r["slot"]]),
            idx_mapping_np=np.array([r["slot"]]),
            num_scheduled_tokens=np.array([q], dtype=np.int32), query_start_loc=t(qsl), query_start_loc_np=qsl,
            seq_lens=t([ctx + q], dtype=torch.int32), seq_lens_np=np.array([ctx + q], dtype=np.int32),
            num_computed_tokens_np=np.array([ctx], dtype=np.int32),
            prefill_len_np=np.array([len(prompt)], dtype=np.int32),
            num_computed_prefill_tokens_np=np.array([min(ctx, len(prompt))], dtype=np.int32),
            is_prefilling_np=np.array([ctx < len(prompt)]), input_ids=t(ids), positions=t(pos),
            slot_mapping=t(pages[pos // page] * page + pos % page), block_table=t(pages[None].astype(np.int32)),
            logits_indices=t(np.arange(q - num_logits, q)), cu_num_logits_np=np.array([0, num_logits], np.int32),
            num_draft_tokens=len(r["spec"]), max_query_len=q, max_seq_len=ctx + q)
        with torch.inference_mode():
            self.ms.get_mm_embeddings({}, b, None)
            embeds = self.ms.prepare_inputs(b, None)["inputs_embeds"]
            causal = self.ms.fill_causal(b).clone()
            meta = AttentionMetadata(cu_seqlens_q=b.query_start_loc, seq_lens=b.seq_lens, causal=causal,
                                     block_table=b.block_table, slot_mapping=b.slot_mapping, max_seqlen_q=q,
                                     max_seqlen_k=self.max_model_len)
            logits = forward_from_embeds(self.model, embeds, b.positions, meta, self.kv, self.bw)[b.logits_indices]
            out = self.sampler(logits, b)
        n_sampled, n_rejected = int(out.num_sampled[0]), int(out.num_rejected[0])
        r["computed"] += q - n_rejected
        self.ms.postprocess_state(b.idx_mapping, out.num_sampled, None)
        for tok in out.sampled_token_ids[0, :n_sampled].tolist():
            r["out"].append(tok)
            if (tok == sp.eos_token_id and not sp.ignore_eos) or len(r["out"]) >= sp.max_tokens:
                return True
        r["spec"] = [] if r["computed"] < len(prompt) else self.draft_tokens[r["slot"], :CL].tolist()
        return False


def harness_greedy(model, tok, prompts):
    """``serve_smoke harness``'s greedy outputs (all prompts in one run) on the reference backends."""
    cl = model.config.canvas_length
    params = SamplingParams(canvas_length=cl, eos_token_ids=(tok.eos_token_id,), max_tokens=serve_smoke.MAX_TOKENS,
                            **serve_smoke.diffusion_params(sampled=False))
    runner = HarnessRunner(model, default_params=params, max_num_reqs=len(prompts),
                           max_num_batched_tokens=len(prompts) * max(cl, 64), page_size=16,
                           max_model_len=256 + serve_smoke.MAX_TOKENS + cl)
    for rid, ids in prompts:
        runner.add_request(rid, ids, params)
    return {rid: list(r.output_token_ids) for rid, r in runner.run().items()}, params


# ------------------------------------------------------------------------------------------ tests
def replay_vs_harness(export_dir, served, *, rng_request_ids=True, bidirectional_window=None) -> dict:
    """The demo prompts, one request at a time with vLLM-style request ids and serve_smoke's vllm_xargs, through
    the 0.26 replay on the served folder, against the harness's greedy run: serve_smoke's per-prompt comparison.
    ``rng_request_ids=False`` drops ``rng_request_id`` from the xargs; ``bidirectional_window`` overrides the
    backend's rule (the two behaviours of the first H200 serve)."""
    model, tok = served
    prompts = [(rid, tok.encode(text)) for rid, text in serve_smoke._prompts()]
    want, _ = harness_greedy(model, tok, prompts)
    text_config = json.load(open(export_dir / "config.json"))["text_config"]
    bw = bidirectional_window or vllm_plugin.bidirectional_window_of(text_config)
    replay = Vllm026Replay(model, served_default_params(export_dir, model.config.canvas_length),
                           bidirectional_window=bw)
    got = {}
    for i, (rid, ids) in enumerate(prompts):
        xargs = serve_smoke.vllm_xargs(rid, sampled=False)
        if not rng_request_ids:
            del xargs[VLLM_RNG_REQUEST_ID]
        sp = vllm_sampling_params(xargs, serve_smoke.MAX_TOKENS, tok.eos_token_id)
        got[rid] = replay.generate(vllm_request_id(i), ids, sp)
    assert all(len(v) == serve_smoke.MAX_TOKENS for v in got.values())
    rows = lambda outs: {r: {"text": "", "token_ids": v} for r, v in outs.items()}  # noqa: E731
    return serve_smoke.compare_rows(rows(want), rows(got))


@needs_stack
@pytest.mark.slow
def test_vllm_026_greedy_equals_the_harness_token_for_token(export_dir, served, sampler_output_class):
    """With the plugin as it is (rng_request_id sent, the model's "prefix" window rule), every served greedy
    output equals the harness's, token for token."""
    diff = replay_vs_harness(export_dir, served)
    assert all(d["equal"] for d in diff.values()), diff


@needs_stack
@pytest.mark.slow
def test_vllm_026_greedy_differs_when_keyed_by_vllms_request_ids(export_dir, served, sampler_output_class):
    """The first H200 serve's result, reproduced: keyed by vLLM's request ids, every output differs from the
    harness's within its first canvas. (The other cause, the symmetric window, changes the shipped model's logits,
    test_window_rule_of_the_export_is_prefix_and_changes_the_shipped_models_logits; whether that flips a greedy
    token of the demo prompts depends on rounding: it did with one attention reference and not with another, on
    the same machine, so greedy outputs are not asserted for it.)"""
    diff = replay_vs_harness(export_dir, served, rng_request_ids=False)
    # every output differs; most within the first canvas (a confident model can draw the same first canvas from
    # other noise, so not every one: with uuid4 ids this flaked, now the ids are fixed)
    assert all(d["first_diff_token"] is not None for d in diff.values()), diff
    assert sum(d["first_diff_token"] < 32 for d in diff.values()) >= len(diff) // 2, diff


@needs_stack
def test_vllm_request_id_keys_the_noise_unless_rng_request_id_is_sent(served, sampler_output_class):
    """Cause 1: under vLLM a request's RNG key came from vLLM's request id (random suffix), so its first canvas
    differed from the harness request's; with ``rng_request_id`` it is the harness request's key and canvas."""
    model, tok = served
    ids = tok.encode(serve_smoke._prompts()[0][1])
    cl, P = model.config.canvas_length, len(ids)
    ms = DiffusionModelState.for_harness(model, max_num_reqs=3, max_num_tokens=256, canvas_length=cl, device="cpu",
                                         default_params=SamplingParams(canvas_length=cl))
    ms.mode = "vllm"
    sampler, _ = ms.custom_sampler(None, backend="reference")
    xargs = serve_smoke.vllm_xargs("req-0", sampled=False)
    no_id = {k: v for k, v in xargs.items() if k != VLLM_RNG_REQUEST_ID}
    ms.add_request(0, NewRequest("req-0", ids, SamplingParams(canvas_length=cl)))  # as the harness adds it
    ms.add_request(1, NS(req_id=vllm_request_id(0), prompt_token_ids=ids,
                         sampling_params=vllm_sampling_params(xargs, 64, 1)))
    ms.add_request(2, NS(req_id=vllm_request_id(1), prompt_token_ids=ids,
                         sampling_params=vllm_sampling_params(no_id, 64, 1)))
    keys = ms.state.request_id[:3].tolist()
    assert keys[0] == keys[1] == request_key("req-0") != keys[2]
    b = make_batch([(f"r{s}", s, P, 0, P, ids) for s in range(3)])  # the prefill step draws the first canvases
    b.cu_num_logits_np = np.arange(4, dtype=np.int32)  # vLLM 0.26: one logits row per request, no draft tokens
    sampler(torch.zeros(3, model.config.vocab_size), b)
    canvas = ms.state.canvas[:3]
    assert torch.equal(canvas[0], canvas[1]) and not torch.equal(canvas[0], canvas[2])


def test_rng_request_id_reads_extra_args_and_refuses_bad_values():
    assert rng_request_id(NS(extra_args={VLLM_RNG_REQUEST_ID: "req-3"}), "cmpl-x") == "req-3"
    assert rng_request_id(NS(extra_args=None), "cmpl-x") == "cmpl-x"
    assert rng_request_id(NS(extra_args={"t_min": 0.0}), "cmpl-x") == "cmpl-x"
    with pytest.raises(TypeError, match="rng_request_id.*must be a str"):
        rng_request_id(NS(extra_args={VLLM_RNG_REQUEST_ID: 3}), "cmpl-x")
    with pytest.raises(ValueError, match="must not be empty"):
        rng_request_id(NS(extra_args={VLLM_RNG_REQUEST_ID: ""}), "cmpl-x")


@needs_stack
def test_vllm_mode_refuses_a_bad_rng_request_id_as_a_failed_request(served, sampler_output_class):
    """A bad ``rng_request_id`` fails the request (finish reason error), never the engine; the harness raises."""
    model, _ = served
    ms = DiffusionModelState.for_harness(model, max_num_reqs=1, max_num_tokens=64, canvas_length=32, device="cpu",
                                         default_params=SamplingParams(canvas_length=32))
    sp = vllm_sampling_params({VLLM_RNG_REQUEST_ID: 7}, 64, 1)
    with pytest.raises(TypeError, match="rng_request_id"):
        ms.add_request(0, NS(req_id="a", prompt_token_ids=[5, 6], sampling_params=sp))
    ms.mode = "vllm"
    ms.add_request(0, NS(req_id="a", prompt_token_ids=[5, 6], sampling_params=sp))
    assert ms.state.phase[0].item() == FAILED and "rng_request_id" in ms.failed_reasons["a"]


def test_vllm_start_up_warmup_requests_run_with_the_served_defaults(served, sampler_output_class):
    """Regression (26B serve on the H200): vLLM 0.26's start-up warm-up sends requests ``_warmup_<i>_`` with
    ``SamplingParams.for_sampler_warmup()`` (penalties, top-k, logprobs, logit bias); each was refused and failed
    with a warning. Under vLLM they now run with the served defaults; a user request with those options still fails,
    and the harness still raises."""
    model, _ = served
    defaults = SamplingParams(canvas_length=32, max_denoising_steps=5)
    ms = DiffusionModelState.for_harness(model, max_num_reqs=3, max_num_tokens=64, canvas_length=32, device="cpu",
                                         default_params=defaults)
    sp = vllm_sampling_params({}, 64, 1)
    sp.top_k, sp.presence_penalty = 50, 0.5
    ms.mode = "vllm"
    ms.add_request(0, NS(req_id="_warmup_0_", prompt_token_ids=[5, 6], sampling_params=sp))
    ms.add_request(1, NS(req_id="_v2_mixed_warmup_decode_", prompt_token_ids=[5, 6], sampling_params=sp))
    ms.add_request(2, NS(req_id="user", prompt_token_ids=[5, 6], sampling_params=sp))
    assert ms.state.phase[:2].tolist() == [PREFILL, PREFILL] and not {"_warmup_0_", "_v2_mixed_warmup_decode_"} & set(
        ms.failed_reasons)
    assert ms.state.max_denoising_steps[0].item() == 5 and ms.state.phase[2].item() == FAILED
    ms.mode = "harness"
    ms.remove_request("_warmup_0_")
    with pytest.raises(ValueError, match="top_k"):
        ms.add_request(0, NS(req_id="_warmup_0_", prompt_token_ids=[5, 6], sampling_params=sp))


def test_user_request_whose_id_starts_like_a_warmup_id_keeps_its_own_params(served, sampler_output_class):
    """Only vLLM's own warm-up ids (``_warmup_<i>_``, ``_v2_mixed_warmup_decode_`` / ``_prefill_``, exactly) run
    with the served defaults. A user request whose id merely starts like one (vLLM appends 8 random characters to
    every external id: ``_warmup_0_-1a2b3c4d``) keeps its own parameters: greedy stays greedy, its step cap and
    max_tokens hold, and an option blockdiff does not implement fails it (was: served with the defaults, its
    params silently ignored)."""
    model, _ = served
    defaults = SamplingParams(canvas_length=32, max_denoising_steps=5)
    ms = DiffusionModelState.for_harness(model, max_num_reqs=4, max_num_tokens=64, canvas_length=32, device="cpu",
                                         default_params=defaults)
    ms.mode = "vllm"
    greedy = vllm_sampling_params({"diffusion_max_steps": 3}, 40, 1)
    greedy.temperature = 0.0
    ms.add_request(0, NS(req_id="_warmup_0_-1a2b3c4d", prompt_token_ids=[5, 6], sampling_params=greedy))
    ms.add_request(1, NS(req_id="_v2_mixed_warmup_user-1a2b3c4d", prompt_token_ids=[5, 6], sampling_params=greedy))
    assert ms.state.phase[:2].tolist() == [PREFILL, PREFILL]
    assert ms.state.t_max[:2].tolist() == [0.0, 0.0] and ms.state.max_denoising_steps[:2].tolist() == [3, 3]
    assert ms.state.max_tokens[:2].tolist() == [40, 40]
    bad = vllm_sampling_params({}, 64, 1)
    bad.logprobs = 5
    ms.add_request(2, NS(req_id="_warmup_7_-1a2b3c4d", prompt_token_ids=[5, 6], sampling_params=bad))
    assert ms.state.phase[2].item() == FAILED and "logprobs" in ms.failed_reasons["_warmup_7_-1a2b3c4d"]
    ms.add_request(3, NS(req_id="_warmup_7_", prompt_token_ids=[5, 6], sampling_params=bad))  # vLLM's own
    assert ms.state.phase[3].item() == PREFILL and ms.state.max_denoising_steps[3].item() == 5


@needs_stack
def test_served_request_params_equal_the_harness_params(export_dir, served):
    """serve_smoke's vllm_xargs, converted by the plugin over the served folder's defaults, give exactly the
    SamplingParams the harness side uses (greedy and sampled): no parameter comes from generation_config.json."""
    model, tok = served
    cl = model.config.canvas_length
    assert {serve_smoke.XARGS_KEYS[k]: k for k in serve_smoke.PARAMS} == {
        k: v for k, v in VLLM_EXTRA_ARGS.items() if v in serve_smoke.PARAMS}
    assert serve_smoke.RNG_REQUEST_ID == VLLM_RNG_REQUEST_ID
    for sampled in (False, True):
        sp = vllm_sampling_params(serve_smoke.vllm_xargs("req-1", sampled), serve_smoke.MAX_TOKENS, tok.eos_token_id)
        got = to_diffusion_params(sp, served_default_params(export_dir, cl), canvas_length=cl)
        want = SamplingParams(canvas_length=cl, eos_token_ids=(tok.eos_token_id,), max_tokens=serve_smoke.MAX_TOKENS,
                              **serve_smoke.diffusion_params(sampled))
        assert got == want and want.greedy is not sampled


@needs_stack
def test_window_rule_of_the_export_is_prefix_and_changes_the_shipped_models_logits(export_dir, served):
    """Cause 2: the exported config names transformers' "prefix" rule (the backend used "symmetric"), and on the
    shipped checkpoint the two rules give different canvas logits for a demo prompt (63 tokens of context, a 64-key
    sliding window: canvas rows past the first see fewer context keys under "symmetric")."""
    text_config = json.load(open(export_dir / "config.json"))["text_config"]
    assert vllm_plugin.bidirectional_window_of(text_config) == "prefix"
    assert vllm_plugin.bidirectional_window_of({}) == vllm_plugin.bidirectional_window_of(None) == "prefix"
    # a checkpoint without the key: the served rule is the harness's (blockdiff's config default)
    assert DiffusionGemmaConfig.__dataclass_fields__["bidirectional_window"].default == \
        vllm_plugin.DEFAULT_BIDIRECTIONAL_WINDOW
    assert vllm_plugin.bidirectional_window_of(NS(bidirectional_window="symmetric")) == "symmetric"
    with pytest.raises(ValueError, match="bidirectional_window"):
        vllm_plugin.bidirectional_window_of({"bidirectional_window": "left"})
    model, tok = served
    ids = tok.encode(serve_smoke._prompts()[0][1])
    P, cl = len(ids), model.config.canvas_length
    assert P + cl > model.config.sliding_window
    kv = model.allocate_kv_caches(8, 16)
    bt = torch.arange(8, dtype=torch.int32)[None]

    def run(tokens, ctx, causal, bw):
        q = len(tokens)
        pos = torch.arange(ctx, ctx + q)
        meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, q], dtype=torch.int32),
                                 seq_lens=torch.tensor([ctx + q], dtype=torch.int32),
                                 causal=torch.tensor([causal]), block_table=bt, slot_mapping=pos)
        with torch.inference_mode():
            return model(torch.tensor(tokens), pos, meta, kv, None, attn_backend="reference", bidirectional_window=bw)

    run(ids, 0, True, "prefix")  # prefill: causal rows, the rule does not apply
    canvas = torch.randint(3, 259, (cl,), generator=torch.Generator().manual_seed(0)).tolist()
    prefix, symmetric = run(canvas, P, False, "prefix"), run(canvas, P, False, "symmetric")
    # every canvas row but the first loses context keys under "symmetric" (and the first attends to them)
    assert bool(((prefix - symmetric).abs().amax(-1) > 0).all())
    assert (prefix - symmetric).abs().max().item() > 0.05


def test_compare_rows_reports_tokens_prompts_and_errors():
    a = {"x": {"text": "ab", "token_ids": [1, 2], "prompt_token_ids": [5]},
         "y": {"text": "ab", "token_ids": [1, 2], "prompt_token_ids": [5]}, "z": {"text": "a"}}
    b = {"x": {"text": "ab", "token_ids": [1, 2], "prompt_token_ids": [5]},
         "y": {"text": "ac", "token_ids": [1, 3], "prompt_token_ids": [2, 5]}, "z": {"error": "HTTPError: 500"}}
    out = serve_smoke.compare_rows(a, b)
    assert out["x"]["equal"] and out["x"]["first_diff_token"] is None and out["x"]["prompt_equal"]
    assert not out["y"]["equal"] and out["y"]["first_diff_token"] == 1 and out["y"]["prompt_equal"] is False
    assert out["z"] == {"equal": False, "error": "HTTPError: 500"}



@pytest.mark.parametrize("concurrent", [False, True])
def test_serve_smoke_client_sends_every_prompt_and_keeps_failures(tmp_path, concurrent):
    """The client (sequential, or every prompt at once for mixed batches) records one row per demo prompt in the
    prompts' order, with the request's vllm_xargs, and a failed request as a row with its error."""
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            rid = body["vllm_xargs"]["rng_request_id"]
            if rid == "req-1":
                self.send_response(500)
                self.end_headers()
                return
            out = json.dumps({"choices": [{"text": rid, "token_ids": [1, 2], "prompt_token_ids": [3],
                                           "finish_reason": "length"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        rec = serve_smoke.run_client(f"http://127.0.0.1:{srv.server_address[1]}", "m", str(tmp_path / "c.json"),
                                     sampled=False, timeout=10, concurrent=concurrent)
    finally:
        srv.shutdown()
    rids = [rid for rid, _ in serve_smoke._prompts()]
    assert list(rec["rows"]) == rids and len(seen) == len(rids) and rec["concurrent"] is concurrent
    assert "error" in rec["rows"]["req-1"]
    assert all(rec["rows"][r]["text"] == r for r in rids if r != "req-1")
    assert json.load(open(tmp_path / "c.json"))["rows"].keys() == rec["rows"].keys()

# ------------------------------------------------------------------------------------------ with vLLM installed
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (source tests/integration/vllm_cpu_env.sh VERSION)")
def test_vllm_custom_backend_window_rule_and_dtypes(monkeypatch):
    """The CUSTOM impl defaults to "prefix" and passes its rule to attention(); the model class sets it on every
    blockdiff impl of the model; float32 is accepted with the triton backend, not with cute."""
    import blockdiff.attention as A
    from blockdiff.integration import vllm_attention as va
    from blockdiff.integration.vllm_model import set_bidirectional_window

    seen = []
    monkeypatch.setattr(A, "attention", lambda *a, **kw: seen.append(kw["bidirectional_window"]))
    impl = object.__new__(va.BlockdiffAttentionImpl)
    assert impl.bidirectional_window == "prefix"
    impl.blockdiff_backend, impl.num_heads, impl.head_size = "reference", 2, 8
    impl.sliding_window, impl.scale = (3, 0), 1.0
    meta = NS(num_actual_tokens=4, causal=torch.tensor([0, 0], dtype=torch.int32),
              seq_lens=torch.tensor([4], dtype=torch.int32), query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
              block_table=torch.zeros(1, 1, dtype=torch.int32), max_query_len=4, max_seq_len=4)
    kv = torch.zeros(1, 2, 16, 16)
    impl.forward(None, torch.zeros(4, 16), None, None, kv, meta, torch.zeros(4, 16))
    other = object.__new__(va.BlockdiffAttentionImpl)
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    model[0].impl, model[1].impl = impl, object()
    assert set_bidirectional_window(model, "symmetric") == 1
    impl.forward(None, torch.zeros(4, 16), None, None, kv, meta, torch.zeros(4, 16))
    assert seen == ["prefix", "symmetric"] and other.bidirectional_window == "prefix"
    monkeypatch.setenv(vllm_plugin.ATTN_BACKEND_ENV, "triton")
    assert va.BlockdiffAttentionBackend.supports_dtype(torch.float32)
    assert va.BlockdiffAttentionBackend.supports_dtype(torch.bfloat16)
    monkeypatch.setenv(vllm_plugin.ATTN_BACKEND_ENV, "cute")
    assert not va.BlockdiffAttentionBackend.supports_dtype(torch.float32)


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_vllm_model_class_and_backend_fit_the_recorded_interface(version):
    """The plugin's model class __init__ takes vLLM's (keyword-only vllm_config, prefix) and the backend's
    supports_dtype overrides AttentionBackend's (cls, dtype), in both checked versions (ast, no vLLM)."""
    snap = json.load(open(os.path.join(SV.HERE, vllm_compat.PROFILES[version].snapshot)))
    classes = snap["classes"]
    src = os.path.join(os.path.dirname(vllm_plugin.__file__))
    tree = {n: ast.parse(open(os.path.join(src, n)).read()) for n in ("vllm_model.py", "vllm_attention.py")}

    def method(module, cls, name):
        c = next(n for n in tree[module].body if isinstance(n, ast.ClassDef) and n.name == cls)
        return SV.signature(next(m for m in c.body if isinstance(m, ast.FunctionDef) and m.name == name))

    dg = classes["vllm.model_executor.models.diffusion_gemma:DiffusionGemmaForConditionalGeneration"]["methods"]
    assert method("vllm_model.py", "BlockdiffDiffusionGemmaForConditionalGeneration", "__init__") == dg["__init__"]
    base = classes["vllm.v1.attention.backend:AttentionBackend"]["methods"]
    assert method("vllm_attention.py", "BlockdiffAttentionBackend", "supports_dtype") == base["supports_dtype"]
