"""Fused commits under vLLM's ASYNCHRONOUS scheduler (docs/tuning.md 7.37 "Fix 2", 7.38): the plugin's
``BlockdiffDiffusionAsyncScheduler`` counts each request's denoising steps (``FusedCommitPredictor``) and schedules
the row after a canvas's step-capped last denoising step ``2 * CL`` wide (the commit plus the next canvas's first
step), without waiting for that step's output.

The end-to-end tests drive vLLM's real ``AsyncScheduler`` (0.26.0) / ``DiffusionAsyncScheduler`` (0.33.0) subclass,
in the engine core's batch-queue order (``EngineCore.step_with_batch_queue``, a queue of two: step S is scheduled
while step S - 1 runs, and S - 1's output reaches ``update_from_output`` after S is scheduled), over a CPU
stand-in of model runner v2 that runs blockdiff's model state (vLLM mode), the tiny model and the sampler:
:class:`CpuRunner`. They need vLLM's Python side (``source tests/integration/vllm_cpu_env.sh 0.26.0`` / ``0.33.0``)
and skip without it; the predictor's own tests need no vLLM.
"""
from __future__ import annotations

import importlib.util
import logging
from collections import deque
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from integration_helpers import CL, captured_log, needs_stack, params, prompt, vllm_sampler_output_class

from blockdiff.attention import AttentionMetadata
from blockdiff.integration import vllm_scheduler as VS
from blockdiff.integration.batch import HarnessInputBatch

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (tests/integration/vllm_cpu_env.sh)")
GREEDY = dict(t_min=0.0, t_max=0.0)
STEPS = 3  # the served step cap (--diffusion-config max_denoising_steps)


# ------------------------------------------------------------------------------------------ the predictor alone
def _req(rid="a", *, out=0, max_tokens=100, computed=20, steps=None, extra=None):
    ea = dict(extra or {})
    if steps is not None:
        ea["diffusion_max_steps"] = steps
    return NS(request_id=rid, num_output_tokens=out, max_tokens=max_tokens, num_computed_tokens=computed,
              sampling_params=NS(extra_args=ea or None))


def _so(rows, finished=()):
    """A scheduled step: rows {req_id: tokens}, all canvas rows (draft tokens)."""
    return NS(num_scheduled_tokens=dict(rows), scheduled_spec_decode_tokens={r: [-1] * q for r, q in rows.items()},
              finished_req_ids=set(finished))


def _mro(tokens=None, flags=()):
    """The step's output: ``tokens`` {req_id: n tokens returned}; the -1 flags' ids."""
    tokens = tokens or {}
    ids = sorted(tokens)
    return NS(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
              sampled_token_ids=[[7] * tokens[r] for r in ids]), set(flags)


def test_predictor_counts_steps_in_flight_and_fuses_the_row_after_the_capped_step():
    """Cap 3: rows 1-3 denoise (plain CL), row 4 is predicted the commit while row 3 is still in flight, so it is
    scheduled 2 * CL; after the fused row the next canvas needs 2 more steps (the fused row took step 0)."""
    p = VS.FusedCommitPredictor(CL, 3)
    r = _req()
    reqs = {"a": r}
    widths, outs = [], deque()
    # the worker's truth for the rows: (tokens returned) - denoise 0, commit CL
    truth = deque([0, 0, 0, CL, 0, 0, CL, 0, 0, CL])
    for _ in range(10):
        w = p.width(r, 1000)
        widths.append(w)
        so = _so({"a": w})
        p.record(so)
        outs.append(so)
        if len(outs) == 2:  # the batch queue: the older step's output arrives after the newer is scheduled
            done = outs.popleft()
            n = truth.popleft()
            p.observe(done, *_mro({"a": n}), reqs)
            r.num_output_tokens += n
    assert widths == [CL, CL, CL, 2 * CL, CL, CL, 2 * CL, CL, CL, 2 * CL]
    assert p.num_wide == 3 and p.num_missed == 0


def test_predictor_early_convergence_commits_plain_and_the_count_restarts():
    """A canvas that converges at its 1st step (the -1 flag, one step late): the row in flight is the commit (plain
    CL), the next canvas counts from step 0, and nothing is scheduled wide by mistake."""
    p = VS.FusedCommitPredictor(CL, 3)
    r = _req()
    so1 = _so({"a": CL})
    p.record(so1)                       # step 1: the worker's step 0 converges (flag)
    assert p.width(r, 1000) == CL
    so2 = _so({"a": CL})
    p.record(so2)                       # step 2: the commit (plain), scheduled before step 1's flag is known
    p.observe(so1, *_mro({"a": 0}, {"a"}), {"a": r})
    assert p.state("a") == ("COMMIT", 1, 1)
    assert p.width(r, 1000) == CL       # the row in flight is the commit: the next canvas starts at step 0
    so3 = _so({"a": CL})
    p.record(so3)
    p.observe(so2, *_mro({"a": CL}), {"a": r})
    assert p.state("a") == ("DENOISE", 0, 1)


def test_predictor_width_conditions():
    """2 * CL only when the predicted row commits, the commit does not end the request (max_tokens), the whole row
    fits max_model_len (num_computed_tokens counts the row in flight), the request's cap is valid and it never
    missed; a request's own cap (extra_args diffusion_max_steps) overrides the served one."""
    p = VS.FusedCommitPredictor(CL, 1)   # cap 1: every canvas row is its canvas's last step
    assert p.width(_req(), 1000) == CL   # nothing in flight: the next row is the first denoising step
    for rid in "abcdef":
        p.record(_so({rid: CL}))
    assert p.width(_req("a"), 1000) == 2 * CL
    assert p.width(_req("b", out=100 - CL - 1), 1000) == 2 * CL
    assert p.width(_req("c", out=100 - CL), 1000) == CL           # the commit reaches max_tokens
    assert p.width(_req("d", computed=100), 100 + 2 * CL) == 2 * CL
    assert p.width(_req("d", computed=100), 100 + 2 * CL - 1) == CL  # vLLM would cut the row
    assert p.width(_req("e", steps=2), 1000) == CL                 # its own cap: one more step first
    assert p.width(_req("f", steps=0), 1000) == CL                 # no valid cap: the model state fails it
    assert p.width(_req("f", steps="3"), 1000) == CL


def test_predictor_misses_turn_fusion_off_and_preemption_restarts_the_count():
    p = VS.FusedCommitPredictor(CL, 1)
    r = _req()
    so1 = _so({"a": CL})
    p.record(so1)
    assert p.width(r, 1000) == 2 * CL
    so2 = _so({"a": 2 * CL})
    p.record(so2)
    p.observe(so1, *_mro({"a": 0}), {"a": r})     # step 1 converged (cap): COMMIT
    p.observe(so2, *_mro({"a": 0}), {"a": r})     # but the wide row committed nothing (e.g. a worker not fusing)
    assert p.num_missed == 1 and p.width(r, 1000) == CL
    q = VS.FusedCommitPredictor(CL, 1)
    so = _so({"b": CL})
    q.record(so)
    q.reset("b")                                   # preempted with its row in flight
    q.observe(so, *_mro({"b": 0}, {"b"}), {"b": _req("b")})  # the stale output is not counted
    assert q.state("b") == ("DENOISE", 0, 0) and q.width(_req("b"), 1000) == CL
    q.record(_so({"b": CL}, finished={"b"}))       # finished ids are forgotten first
    q.drop("b")
    assert q.state("b") == ("DENOISE", 0, 0)


def test_predictor_counts_each_observed_rows_commit_into_the_schedulers_counts():
    """observe adds each row's outcome to the FusedCommitCounts it was given (the scheduler's): a 2 * CL row that
    returned tokens is a fused commit, a CL row that did a plain one, a wide row that returned none a miss
    (num_missed reads the same count); denoising rows and rows not yet observed count nothing. A predictor built
    alone has counts of its own."""
    counts = VS.FusedCommitCounts(CL, "asynchronous")
    p = VS.FusedCommitPredictor(CL, 1, counts)
    assert p.counts is counts and VS.FusedCommitPredictor(CL, 1).counts is not counts
    r = _req()
    reqs = {"a": r}
    for q, n in ((CL, 0), (2 * CL, CL), (CL, CL), (CL, 0), (2 * CL, 0)):  # denoise, fused, plain, denoise, missed
        so = _so({"a": q})
        p.record(so)
        p.observe(so, *_mro({"a": n}), reqs)
        r.num_output_tokens += n
    p.record(_so({"a": CL}))                                           # in flight: not counted
    assert (counts.num_fused, counts.num_plain, counts.num_missed, counts.num_commits) == (1, 1, 1, 2)
    assert p.num_missed == 1 and p.num_wide == 2 and counts.num_lines == 0  # the predictor itself never logs


def test_predictor_and_cap_helpers_refuse_bad_arguments():
    for bad in ((0, 3), (CL, 0), (True, 3), (CL, 2.0), (CL, 1 << 14)):
        with pytest.raises(ValueError, match="canvas_length|default_max_denoising_steps"):
            VS.FusedCommitPredictor(*bad)
    cfg = lambda d, g=None: NS(diffusion_config=NS(max_denoising_steps=d),  # noqa: E731
                               model_config=NS(try_get_generation_config=lambda: g or {}))
    assert VS.served_max_denoising_steps(cfg(16)) == 16
    assert VS.served_max_denoising_steps(cfg(None, {"max_denoising_steps": 12})) == 12
    assert VS.served_max_denoising_steps(cfg(None, {"max_denoising_steps": 12.0})) == 12
    assert VS.served_max_denoising_steps(cfg(None)) is None and VS.served_max_denoising_steps(NS()) is None
    assert VS.served_max_denoising_steps(cfg(None), {"max_denoising_steps": 5}) == 5
    for bad in ("16", 2.5, -1, 1 << 14, True):
        with pytest.raises(ValueError, match="max_denoising_steps"):
            VS.served_max_denoising_steps(cfg(None, {"max_denoising_steps": bad}))
    assert VS.default_max_denoising_steps() == params().__class__().max_denoising_steps
    assert VS.request_max_denoising_steps(_req(), 9) == 9
    assert VS.request_max_denoising_steps(_req(steps=4), 9) == 4
    assert VS.request_max_denoising_steps(_req(steps=True), 9) is None


# ------------------------------------------------------------------------------------------ vLLM end to end
@pytest.fixture(scope="module")
def tiny_hf_folder(tmp_path_factory):
    """An exported tiny DiffusionGemma config (canvas_length CL): what vLLM's ModelConfig reads."""
    from blockdiff.model import tiny_config
    from blockdiff.model.export import export_hf

    out = tmp_path_factory.mktemp("tiny_hf_async")
    export_hf(tiny_config(vocab_size=259, canvas_length=CL), out)
    return out


def _scheduler(monkeypatch, folder, *, served, fuse, max_model_len=256, num_blocks=64, max_num_seqs=4,
               budget=256, asynchronous=True, policy=None, **scheduler_kw):
    """The plugin's scheduler on vLLM's own classes: --diffusion-config canvas_length ``served`` and
    max_denoising_steps :data:`STEPS`, BLOCKDIFF_FUSE_COMMIT ``fuse``, BLOCKDIFF_FUSE_POLICY ``policy`` (None:
    unset), ``num_blocks`` KV pages of 16 tokens; ``scheduler_kw``: more SchedulerConfig fields."""
    import vllm.config.vllm as config_module
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.config.diffusion import DiffusionConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    if fuse:
        monkeypatch.setenv(VS.FUSE_COMMIT_ENV, "1")
    else:
        monkeypatch.delenv(VS.FUSE_COMMIT_ENV, raising=False)
    if policy is None:
        monkeypatch.delenv(VS.FUSE_POLICY_ENV, raising=False)
    else:
        monkeypatch.setenv(VS.FUSE_POLICY_ENV, policy)
    monkeypatch.setattr(config_module, "HAS_TRITON", True)  # model runner v2's check (no kernel runs here)
    mc = ModelConfig(model=str(folder), tokenizer=str(folder), dtype="float32", language_model_only=True,
                     max_model_len=max_model_len)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                         is_encoder_decoder=False, async_scheduling=asynchronous, **scheduler_kw)
    cc = CacheConfig(block_size=16, enable_prefix_caching=False)
    cc.num_gpu_blocks = num_blocks
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu"),
                    diffusion_config=DiffusionConfig(canvas_length=served, max_denoising_steps=STEPS))
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer0"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32))])
    cls = VS.BlockdiffDiffusionAsyncScheduler if asynchronous else VS.BlockdiffDiffusionScheduler
    return cls(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
               block_size=16)


class CpuRunner:
    """Model runner v2's part of a step (vLLM 0.26.0 ``GPUModelRunner.execute_model`` / ``sample_tokens``) on the
    CPU, around blockdiff's model state in vLLM mode and the tiny model: it removes finished and preempted requests,
    adds new / resumed ones (``add_request`` with ``prefill_token_ids``), keeps its own ``num_computed_tokens`` per
    request (advanced by ``query_len - num_rejected`` after each step: what asynchronous scheduling relies on; the
    scheduler's count runs ahead), builds the step's batch (logits at every draft token of a canvas row, the last
    token of a prefill chunk), runs ``prepare_inputs`` -> causal flags / row counts -> the model -> the sampler, and
    returns vLLM's ``ModelRunnerOutput`` (``num_sampled`` tokens a row, ``num_nans_in_logits``).

    Counts per request: ``rows`` (the widths of its canvas rows), ``fused`` (rows of ``2 * CL`` that committed: fused
    commits, and wide rows whose commit ended the request), ``plain`` (rows narrower than ``2 * CL`` that committed:
    plain commits), ``stalled_wide`` (rows wider than CL that committed nothing: stalled by the sampler), ``adds``
    (``add_request`` calls: > 1 after a preemption). Per step: ``canvas_steps`` (the widths of the step's canvas
    rows, {req_id: tokens}; steps without one are left out)."""

    def __init__(self, model, default_params, *, fuse, max_num_reqs=4, max_model_len=256, page=16):
        from blockdiff.integration.model_state import DiffusionModelState

        self.model, self.page, self.max_model_len = model, page, max_model_len
        self.maxb = -(-max_model_len // page)
        self.R = max_num_reqs
        T = max_num_reqs * max(2 * CL, 64)
        ms = DiffusionModelState.for_harness(model, max_num_reqs=max_num_reqs, max_num_tokens=T, canvas_length=CL,
                                             device="cpu", default_params=default_params, fuse_commit=fuse)
        ms.mode = "vllm"
        ms.causal_buf_i32 = torch.zeros(max_num_reqs, dtype=torch.int32)
        ms.inputs_embeds_buf = torch.zeros(T, model.config.hidden_size)
        self.ms = ms
        self.draft = torch.zeros(max_num_reqs, 2 * CL, dtype=torch.int64)
        self.sampler, _ = ms.custom_sampler(NS(req_states=NS(draft_tokens=self.draft)), backend="reference")
        self.kv = model.allocate_kv_caches(max_num_reqs * self.maxb, page)
        self.reqs: dict[str, dict] = {}
        self.num_forward = 0
        self.rows: dict[str, list[int]] = {}
        self.fused: dict[str, int] = {}
        self.plain: dict[str, int] = {}
        self.stalled_wide: dict[str, int] = {}
        self.adds: dict[str, int] = {}  # add_request calls per request (> 1: resumed after a preemption)
        self.canvas_steps: list[dict[str, int]] = []

    def execute(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        from test_vllm_greedy_parity import forward_from_embeds

        for rid in set(so.finished_req_ids) | set(so.preempted_req_ids or ()):
            if rid in self.reqs:
                self.ms.remove_request(rid)
                del self.reqs[rid]
        for nr in so.scheduled_new_reqs:
            slot = min(set(range(self.R)) - {r["slot"] for r in self.reqs.values()})
            self.ms.add_request(slot, nr)
            self.adds[nr.req_id] = self.adds.get(nr.req_id, 0) + 1
            self.reqs[nr.req_id] = dict(slot=slot, computed=nr.num_computed_tokens, ids=list(nr.prefill_token_ids))
        ids = list(so.num_scheduled_tokens)
        if not ids:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        q = np.array([so.num_scheduled_tokens[r] for r in ids], dtype=np.int32)
        canvas = {r: int(so.num_scheduled_tokens[r]) for r in ids if so.scheduled_spec_decode_tokens.get(r)}
        if canvas:
            self.canvas_steps.append(canvas)
        ctx = np.array([self.reqs[r]["computed"] for r in ids], dtype=np.int32)
        plen = np.array([len(self.reqs[r]["ids"]) for r in ids], dtype=np.int32)
        slots = np.array([self.reqs[r]["slot"] for r in ids], dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        T = int(qsl[-1])
        tok = np.zeros(T, dtype=np.int64)
        pos = np.zeros(T, dtype=np.int64)
        nlog = np.zeros(len(ids), dtype=np.int32)
        logits_idx = []
        for i, r in enumerate(ids):
            pos[qsl[i]:qsl[i + 1]] = np.arange(ctx[i], ctx[i] + q[i])
            if ctx[i] < plen[i]:
                tok[qsl[i]:qsl[i + 1]] = self.reqs[r]["ids"][ctx[i]:ctx[i] + q[i]]
            nd = len(so.scheduled_spec_decode_tokens.get(r, ()))
            nlog[i] = nd or 1  # 0.26: one logits row without draft tokens, else one per draft token
            logits_idx.extend(range(qsl[i + 1] - nlog[i], qsl[i + 1]))
            if nd:
                self.rows.setdefault(r, []).append(int(q[i]))
        pages = slots[:, None] * self.maxb + np.arange(self.maxb)[None, :]
        row = np.repeat(np.arange(len(ids)), q)
        slot_mapping = pages[row, pos // self.page] * self.page + pos % self.page
        t = torch.as_tensor
        b = HarnessInputBatch(
            req_ids=ids, num_reqs=len(ids), num_tokens=T, idx_mapping=t(slots), idx_mapping_np=slots,
            num_scheduled_tokens=q, query_start_loc=t(qsl), query_start_loc_np=qsl, seq_lens=t(ctx + q),
            seq_lens_np=ctx + q, num_computed_tokens_np=ctx, prefill_len_np=plen,
            num_computed_prefill_tokens_np=np.minimum(ctx, plen), is_prefilling_np=ctx < plen, input_ids=t(tok),
            positions=t(pos), slot_mapping=t(slot_mapping), block_table=t(pages.astype(np.int32)),
            logits_indices=t(np.array(logits_idx, dtype=np.int64)),
            cu_num_logits_np=np.concatenate([[0], np.cumsum(nlog)]).astype(np.int32),
            num_draft_tokens=int(sum(len(so.scheduled_spec_decode_tokens.get(r, ())) for r in ids)),
            max_query_len=int(q.max()), max_seq_len=int((ctx + q).max()))
        with torch.inference_mode():
            embeds = self.ms.prepare_inputs(b, None)["inputs_embeds"]
            causal = self.ms.fill_causal(b).clone()
            ncq = self.ms.num_causal_q(b) if self.ms.fuse_commit else None
            meta = AttentionMetadata(cu_seqlens_q=b.query_start_loc, seq_lens=b.seq_lens, causal=causal,
                                     block_table=b.block_table, slot_mapping=b.slot_mapping,
                                     max_seqlen_q=int(q.max()), max_seqlen_k=self.max_model_len, num_causal_q=ncq)
            logits = forward_from_embeds(self.model, embeds, b.positions, meta, self.kv,
                                         self.model.config.bidirectional_window)[b.logits_indices]
            out = self.sampler(logits, b)
        self.num_forward += 1
        ns, nr = out.num_sampled.tolist(), out.num_rejected.tolist()
        nans = out.num_nans.tolist()
        sampled = []
        for i, r in enumerate(ids):
            self.reqs[r]["computed"] += int(q[i]) - nr[i]
            sampled.append(out.sampled_token_ids[i, : ns[i]].tolist())
            if q[i] == 2 * CL and ns[i] == CL:
                self.fused[r] = self.fused.get(r, 0) + 1
            elif ns[i] > 0:
                self.plain[r] = self.plain.get(r, 0) + 1
            if q[i] > CL and ctx[i] >= plen[i] and ns[i] == 0:
                self.stalled_wide[r] = self.stalled_wide.get(r, 0) + 1
        self.ms.postprocess_state(b.idx_mapping, out.num_sampled, None)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, num_nans_in_logits=dict(zip(ids, nans)))


def _vllm_request(rid, ids, *, max_tokens, stop=None, extra=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, prompt_token_ids=list(ids), sampling_params=SamplingParams(
        max_tokens=max_tokens, temperature=0.0, stop_token_ids=list(stop or []), extra_args=extra or None),
        pooling_params=None)


def engine_core_step(s, runner, queue: deque, size: int, update) -> None:
    """One step of vLLM's engine-core loop over scheduler ``s`` and a CPU ``runner``: synchronous (``size`` 1, vLLM's
    ``step``): schedule, execute, ``update(scheduler_output, runner_output)``, then the draft-token lists a
    speculative engine hands back (-1 each); asynchronous (``size`` 2, ``step_with_batch_queue``): the step is
    queued and the oldest one updated once the queue is full or nothing is left to schedule."""
    from vllm.v1.outputs import DraftTokenIds

    if s.has_requests():
        so = s.schedule()
        mro = runner.execute(so)
        if size == 1:
            update(so, mro)
            ids = list(so.num_scheduled_tokens)
            s.update_draft_token_ids(DraftTokenIds(ids, [[-1] * s.num_spec_tokens for _ in ids]))
            return
        queue.appendleft((so, mro))
        if len(queue) < size and s.has_requests():
            return
    elif not queue:
        return
    update(*queue.pop())


def serve(monkeypatch, folder, model, reqs, *, served, fuse, asynchronous=True, max_steps=2000, aborts=None, **kw):
    """Run ``reqs`` [(req_id, prompt ids, max_tokens, stop ids, extra_args, arrival step)] through the scheduler and
    :class:`CpuRunner` in the engine core's order (asynchronous: ``step_with_batch_queue`` with a queue of two;
    synchronous: schedule, execute, update, draft lists). ``aborts`` {req_id: engine step}: the client aborts the
    request then (``finish_requests``, FINISHED_ABORTED; its reason reads "abort") if it is still unfinished.
    Returns ``(outputs, scheduler, runner, engine steps)``, ``outputs`` {req_id: (finish reason, token ids)} as the
    client sees them."""
    max_model_len = kw.get("max_model_len", 256)
    s = _scheduler(monkeypatch, folder, served=served, fuse=fuse, asynchronous=asynchronous, **kw)
    runner = CpuRunner(model, params(**GREEDY, max_denoising_steps=STEPS), fuse=fuse and served == 2 * CL,
                       max_num_reqs=kw.get("max_num_seqs", 4), max_model_len=max_model_len)
    pending = sorted(reqs, key=lambda r: r[5])
    toks: dict[str, list[int]] = {r[0]: [] for r in reqs}
    reasons: dict[str, str] = {}
    queue: deque = deque()
    size = 2 if asynchronous else 1

    def update(so, mro):
        for eco in s.update_from_output(so, mro).values():
            for o in eco.outputs:
                toks[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    reasons[o.request_id] = str(o.finish_reason)

    step = 0
    while pending or s.has_requests() or queue:
        assert step < max_steps, f"no progress after {max_steps} steps: {reasons}"
        while pending and pending[0][5] <= step:
            rid, ids, mt, stop, extra, _ = pending.pop(0)
            s.add_request(_vllm_request(rid, ids, max_tokens=mt, stop=stop, extra=extra))
        for rid, at in (aborts or {}).items():
            req = s.requests.get(rid)
            if at == step and req is not None and not req.is_finished():
                from vllm.v1.request import RequestStatus

                s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                reasons[rid] = "abort"
        step += 1
        engine_core_step(s, runner, queue, size, update)
    outputs = {rid: (reasons.get(rid), toks[rid]) for rid in toks}
    return outputs, s, runner, step


def harness(make_runner, reqs):
    """The harness's greedy run of the same requests (unfused), as the served outputs' reference."""
    from blockdiff.integration.batch import NewRequest  # noqa: F401  (the harness API takes plain args)

    r = make_runner(max_num_batched_tokens=256, max_model_len=256, default_params=params(**GREEDY))
    for rid, ids, mt, stop, extra, _ in reqs:
        kw = dict(max_tokens=mt, eos_token_ids=tuple(stop or ()), max_denoising_steps=STEPS, **GREEDY)
        for k, v in (extra or {}).items():
            kw[{"diffusion_max_steps": "max_denoising_steps"}.get(k, k)] = v
        r.add_request(rid, ids, params(**kw))
    res = r.run(max_steps=2000)
    named = {"eos": "stop"}  # the harness's name of vLLM's finish reason "stop"
    return {k: (named.get(v.finish_reason, v.finish_reason), list(v.output_token_ids)) for k, v in res.items()}


def _canvas_rows(runner, rid):
    return len(runner.rows.get(rid, []))


@pytest.fixture
def vllm_env(monkeypatch, tiny_model):
    vllm_sampler_output_class(monkeypatch)
    vllm_logger = logging.getLogger("vllm")
    old = vllm_logger.level
    vllm_logger.setLevel(logging.WARNING)
    yield monkeypatch
    vllm_logger.setLevel(old)  # the plugin's loggers sit under it (7.50): no muted INFO for later tests


@needs_stack
@needs_vllm
@pytest.mark.parametrize("plen, max_tokens", [(10, 3 * CL), (3, 4 * CL + 3)])
def test_async_fused_equals_unfused_and_harness_with_one_step_fewer_per_non_final_canvas(
        vllm_env, tiny_hf_folder, tiny_model, make_runner, plen, max_tokens):
    """One request (c1): the async fused server's tokens equal the async unfused server's (served CL) and the
    harness's, greedy; it runs exactly one forward pass fewer per non-final canvas (every non-final commit fused,
    every wide row a fused commit, nothing stalled); a canvas costs STEPS rows after the first (STEPS + 1 unfused)."""
    reqs = [("a", prompt(plen, 3), max_tokens, None, None, 0)]
    want = harness(make_runner, reqs)
    fused, sf, rf, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True)
    plain, sp, rp, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False)
    assert fused == plain == want and want["a"][0] == "length" and len(want["a"][1]) == max_tokens
    canvases = -(-max_tokens // CL)
    assert rp.num_forward - rf.num_forward == canvases - 1 == rf.fused["a"] == sf.blockdiff_predictor.num_wide
    assert rf.rows["a"].count(2 * CL) == canvases - 1 and not rf.stalled_wide
    assert _canvas_rows(rp, "a") - _canvas_rows(rf, "a") == canvases - 1
    assert sp.blockdiff_predictor is None and 2 * CL not in rp.rows["a"]
    # rows per canvas: the first STEPS + 1, the others STEPS (plus at most one row after the last commit, scheduled
    # while that commit was in flight: a no-op for a finished request, as unfused)
    assert _canvas_rows(rf, "a") in (STEPS + 1 + (canvases - 1) * STEPS, STEPS + 2 + (canvases - 1) * STEPS)


@needs_stack
@needs_vllm
def test_async_fused_mixed_batch_early_convergence_eos_and_max_tokens(vllm_env, tiny_hf_folder, tiny_model,
                                                                      make_runner):
    """Four requests arriving at different steps, mixed in batches: a request's own cap (extra_args), one whose
    canvases converge at their first step (stability 0, confidence above any entropy: learnt one step late, they
    commit plain), one with a stop id
    inside a later canvas (a predicted fused commit that ends the request: its tail is wasted), max_tokens not a
    multiple of CL. Tokens and finish reasons equal the async unfused server's and the harness's; nobody is lost;
    fused rows save steps."""
    # a stop id that first appears in the request's 3rd canvas (found from the unstopped greedy output)
    probe = [("e", prompt(6, 9), 4 * CL, None, None, 0)]
    out = harness(make_runner, probe)["e"][1]
    first = {}
    for i, t in enumerate(out):
        first.setdefault(t, i)
    stop = next(t for t, i in sorted(first.items(), key=lambda kv: kv[1]) if 2 * CL <= i < 3 * CL)
    reqs = [("cap2", prompt(5, 1), 3 * CL, None, {"diffusion_max_steps": 2}, 0),
            ("early", prompt(9, 2), 3 * CL + 1, None, {"confidence_threshold": 1e9, "stability_threshold": 0}, 1),
            ("e", prompt(6, 9), 4 * CL, [stop], None, 2),
            ("odd", prompt(12, 4), 2 * CL + 5, None, None, 4)]
    want = harness(make_runner, reqs)
    fused, sf, rf, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True)
    plain, _, rp, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False)
    assert fused == plain == want
    assert want["e"][0] == "stop" and want["e"][1][-1] == stop and {want[r][0] for r in want} <= {"stop", "length"}
    # canvases 1-2 fused; "e"'s 3rd commit was predicted wide too and ended the request (its tail ran for nothing)
    assert rf.fused.get("cap2", 0) == 2 and rf.fused.get("odd", 0) == 2 and rf.fused.get("e", 0) == 3
    # "early": every canvas converges at its first step, learnt one step late: plain commits, as unfused
    assert 2 * CL not in rf.rows["early"] and rf.rows["early"] == rp.rows["early"]
    assert not rf.stalled_wide and sf.blockdiff_predictor.num_missed == 0
    assert rf.num_forward < rp.num_forward
    assert sum(map(len, rf.rows.values())) < sum(map(len, rp.rows.values()))


@needs_stack
@needs_vllm
def test_async_fused_at_the_max_model_len_edge(vllm_env, tiny_hf_folder, tiny_model):
    """max_model_len leaves room for the last canvases but not for a whole fused row: those commit plain (the
    predictor requires num_computed_tokens + 2 * CL <= max_model_len), the request is capped for length exactly as
    the unfused async server caps it, with the same tokens."""
    for mml in (48, 52, 56):
        reqs = [("a", prompt(10, 5), 200, None, None, 0)]
        fused, sf, rf, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True,
                                 max_model_len=mml)
        plain, _, rp, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, max_model_len=mml)
        assert fused == plain and fused["a"][0] == "length", (mml, fused, plain)
        assert not rf.stalled_wide and sf.blockdiff_predictor.num_missed == 0
        assert rf.num_forward <= rp.num_forward


@needs_stack
@needs_vllm
def test_async_fused_under_preemption(vllm_env, tiny_hf_folder, tiny_model, make_runner):
    """A KV cache too small for four requests at once: vLLM preempts (the request re-prefills its prompt and
    tokens and restarts its canvas at step 0; the predictor restarts its count). Every request finishes with the
    tokens of the unfused async server and the harness."""
    reqs = [(f"r{i}", prompt(9 + i, 20 + i), 3 * CL + i, None, None, i) for i in range(4)]
    want = harness(make_runner, reqs)
    fused, sf, rf, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True, num_blocks=7)
    plain, sp, rp, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, num_blocks=7)
    assert fused == plain == want
    assert max(rf.adds.values()) > 1 and max(rp.adds.values()) > 1  # preempted and resumed
    assert not rf.stalled_wide and sum(rf.fused.values()) > 0


@needs_stack
@needs_vllm
def test_vllm_model_state_fuses_under_the_async_plugin_scheduler_with_the_schedulers_step_cap(monkeypatch, caplog):
    """BLOCKDIFF_FUSE_COMMIT=1 with --async-scheduling and BlockdiffDiffusionAsyncScheduler: fuse_commit is on (was: a
    warning that the asynchronous scheduler never fuses), and the model state's default step cap is the one the
    scheduler predicts with (served_max_denoising_steps: the diffusion config's, else the generation config's)."""
    from test_vllm_plugin import _StandInVllmModel

    from blockdiff.integration import model_state as MS
    from blockdiff.integration.model_state import DiffusionModelState

    H = 8
    monkeypatch.setenv(VS.FUSE_COMMIT_ENV, "1")
    monkeypatch.delenv("VLLM_RAISE_ON_LOGIT_NANS", raising=False)
    for dsteps, gen in ((5, {"max_denoising_steps": 9}), (None, {"max_denoising_steps": 9}), (None, {})):
        mc = NS(get_inputs_embeds_size=lambda: H, dtype=torch.float32, hf_text_config=NS(hidden_size=H),
                hf_config=NS(canvas_length=CL), try_get_generation_config=lambda g=gen: g,
                get_vocab_size=lambda: 64, max_model_len=256)
        sc = NS(max_num_seqs=2, max_num_batched_tokens=64, async_scheduling=True,
                scheduler_cls="blockdiff.integration.vllm_scheduler.BlockdiffDiffusionAsyncScheduler")
        cfg = NS(model_config=mc, scheduler_config=sc,
                 diffusion_config=NS(canvas_length=2 * CL, max_denoising_steps=dsteps))
        caplog.clear()
        with captured_log(caplog, MS._log, logging.INFO):
            ms = DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu"))
        assert ms.fuse_commit is True and not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert "fused commits under the asynchronous scheduler" in caplog.text  # the server log's line (7.50)
        served = VS.served_max_denoising_steps(cfg)
        want = served if served is not None else VS.default_max_denoising_steps()
        assert ms.default_params.max_denoising_steps == want == (dsteps or gen.get("max_denoising_steps") or 48)


@needs_stack
@needs_vllm
def test_async_mispredicted_wide_rows_lose_nothing(vllm_env, tiny_hf_folder, tiny_model, make_runner):
    """Wide rows the worker cannot fuse (the predictor forced to answer 2 * CL at random, also for rows that are
    denoising steps): the worker stalls such a row (state untouched, every draft rejected: vLLM's KV position does
    not move) or, on a COMMIT, commits it; the predictor sees the miss and never schedules that request wide again.
    Every request finishes with the unfused tokens; nothing hangs."""
    rng = np.random.default_rng(0)
    orig = VS.FusedCommitPredictor.width

    def chaos(self, request, max_model_len):
        w = orig(self, request, max_model_len)
        if request.request_id not in self._no_fuse and request.num_computed_tokens + 2 * CL <= max_model_len \
                and rng.random() < 0.4:
            return 2 * CL
        return w

    vllm_env.setattr(VS.FusedCommitPredictor, "width", chaos)
    reqs = [(f"r{i}", prompt(5 + 3 * i, 60 + i), 3 * CL + 2 * i, None, None, i) for i in range(3)]
    want = harness(make_runner, reqs)
    fused, sf, rf, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True)
    assert fused == want
    assert sum(rf.stalled_wide.values()) == sf.blockdiff_predictor.num_missed >= 1
    # at most two misses a request: the first, and a row scheduled while the first was in flight; then never wide
    assert all(n <= 2 for n in rf.stalled_wide.values()), rf.stalled_wide


# ------------------------------------------------------------------------------------------ review (tuning 7.38)
def test_cap_helpers_and_predictor_width_name_their_bad_arguments():
    """The new public helpers refuse bad inputs with an error naming the argument (they used to take a served cap
    of 0 / -1 / "3" / True, a generation config that is no mapping, or a max_model_len of None, silently)."""
    for bad in (0, -1, "3", None, True, 2.0, 1 << 14):
        with pytest.raises(ValueError, match="default"):
            VS.request_max_denoising_steps(_req(), bad)
    for bad in ("abc", [("max_denoising_steps", 3)], 5):
        with pytest.raises(TypeError, match="generation_config"):
            VS.served_max_denoising_steps(NS(), bad)
    p = VS.FusedCommitPredictor(CL, 1)
    for bad in (None, True, "100", 1.5, 0):
        with pytest.raises(ValueError, match="max_model_len"):
            p.width(_req(), bad)


def test_async_row_that_max_model_len_would_cut_below_a_canvas_is_deferred_one_schedule():
    """finish_stuck_requests under asynchronous scheduling: a request with a row in flight (num_computed_tokens >
    num_tokens) whose next row vLLM would cut below a canvas (num_computed_tokens + CL > max_model_len) while its
    next canvas still fits is skipped by the next schedule call (next_decode_eligible_step = current_step + 2, as
    vLLM 0.33.0's read-only diffusion requests); not a request with nothing in flight, one re-prefilling
    (num_computed_tokens < num_tokens), one whose row fits, nor under a scheduler without current_step (sync
    stand-ins); a larger eligibility step (pipeline parallel) is kept."""
    from integration_helpers import FAKE_VLLM_TYPES, FakeRequest, FakeScheduler

    def req(rid, num_tokens, computed, eligible=0):
        r = FakeRequest(rid, num_tokens)
        r.num_computed_tokens, r.next_decode_eligible_step = computed, eligible
        return r

    mml = 100
    reqs = [req("cut", 90, 90 + CL), req("idle", 90, 90), req("refill", 90, 40), req("fits", 80, 80 + CL),
            req("pp", 90, 90 + CL, eligible=50), req("edge", 92, 92 + CL)]
    s = FakeScheduler(reqs, max_model_len=mml, canvas=CL)
    s.current_step = 10
    assert VS.finish_stuck_requests(s, None, {}, types=FAKE_VLLM_TYPES) == []
    assert {r.request_id: r.next_decode_eligible_step for r in reqs} == dict(
        cut=12, idle=0, refill=0, fits=0, pp=50, edge=12)
    del s.current_step
    r = req("sync", 90, 90 + CL)
    s2 = FakeScheduler([r], max_model_len=mml, canvas=CL)
    assert VS.finish_stuck_requests(s2, None, {}, types=FAKE_VLLM_TYPES) == [] and r.next_decode_eligible_step == 0


@needs_stack
@needs_vllm
def test_async_near_max_model_len_no_row_is_cut_below_a_canvas(vllm_env, tiny_hf_folder, tiny_model):
    """Near max_model_len vLLM's row cap (max_model_len - num_computed_tokens, which counts the row in flight) cut
    every other row of the async server below a canvas ([8, 6, 8, 6, ...]: stalled, a forward pass for nothing).
    Now the request skips that schedule call: no canvas row narrower than CL, the synchronous server's tokens and
    finish reason, the async unfused server runs at most one forward more than the synchronous one (a row after
    the last commit), and the fused one fewer than the unfused."""
    for mml in (48, 52, 56):
        reqs = [("a", prompt(10, 5), 200, None, None, 0)]
        sync, _, rs, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False,
                               asynchronous=False, max_model_len=mml)
        plain, _, rp, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, max_model_len=mml)
        fused, _, rf, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True,
                                max_model_len=mml)
        assert fused == plain == sync and sync["a"][0] == "length", mml
        assert min(rp.rows["a"]) == CL and min(rf.rows["a"]) == CL, (mml, rp.rows, rf.rows)
        assert rp.num_forward <= rs.num_forward + 1 and rf.num_forward < rp.num_forward, mml


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    given = None

if given is not None:
    _REQ = st.tuples(st.sampled_from([1, 3, 8, 16, 17, 32]),                            # prompt length
                     st.sampled_from([1, CL - 1, CL, CL + 1, 2 * CL, 3 * CL + 3, 4 * CL]),  # max_tokens
                     st.sampled_from([None, 1, 2, 4]),                                  # extra_args diffusion_max_steps
                     st.booleans(),                                                     # canvases converge at step 0/1
                     st.lists(st.integers(3, 255), max_size=2),                         # stop ids
                     st.integers(0, 4),                                                 # arrival step
                     st.one_of(st.none(), st.integers(0, 20)))                          # client abort step
    _SERVER = st.fixed_dictionaries(dict(num_blocks=st.sampled_from([64, 9]), max_num_seqs=st.sampled_from([4, 2]),
                                         budget=st.sampled_from([256, 3 * CL, CL + 4])))

    @needs_stack
    @needs_vllm
    @settings(max_examples=4, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(rows=st.lists(_REQ, min_size=1, max_size=4), server=_SERVER)
    def test_async_fused_random_batches_equal_unfused_lose_nothing_and_forget_finished_requests(
            vllm_env, tiny_hf_folder, tiny_model, make_runner, rows, server):
        """Random batches (prompt lengths at and around a KV block, max_tokens below / at / around multiples of
        CL, per-request caps, early convergence, stop ids, staggered arrivals, client aborts) on random servers
        (small KV caches: preemption; a token budget of 3 * CL: wide rows cut; one below 2 * CL: nothing fused,
        the budget guard; fewer sequences): the fused async server answers every request with the async unfused
        server's tokens and reasons; without aborts both equal the harness, with one the tokens are a prefix of
        the harness's; after a last schedule call the predictor holds nothing of any request (finished and aborted
        ids forgotten)."""
        reqs, aborts = [], {}
        for i, (plen, mt, cap, early, stop, at, abort) in enumerate(rows):
            extra = {} if cap is None else {"diffusion_max_steps": cap}
            if early:
                extra.update(confidence_threshold=1e9, stability_threshold=i % 2)
            reqs.append((f"r{i}", prompt(plen, 40 + i), mt, stop or None, extra or None, at))
            if abort is not None:
                aborts[f"r{i}"] = abort
        want = harness(make_runner, reqs)
        fused, sf, _, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True,
                                aborts=aborts, **server)
        plain, _, _, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, aborts=aborts,
                               **server)
        for rid, (reason, toks) in fused.items():
            assert reason is not None and plain[rid][0] is not None, (rid, fused, plain)
            if rid in aborts and "abort" in (reason, plain[rid][0]):
                assert toks == want[rid][1][:len(toks)] and plain[rid][1] == want[rid][1][:len(plain[rid][1])]
            else:
                assert (reason, toks) == plain[rid] == want[rid], rid
        sf.schedule()  # reports the last finished ids
        p = sf.blockdiff_predictor
        if server["budget"] < 2 * CL:  # the budget guard: a fused row would never fit, nothing is fused
            assert p is None and sf.blockdiff_wide_fits is False
            return
        assert not (p._known or p._pending or p._caps or p._no_fuse), (p._known, p._pending, p._caps, p._no_fuse)


# ------------------------------------------------------------------------------------------ fuse policy (tuning 7.40)
def test_fuse_policy_is_any_unless_the_variable_says_uniform_and_a_bad_value_names_the_variable():
    assert VS.fuse_policy_from_env({}) == "any" and VS.fuse_policy_from_env({VS.FUSE_POLICY_ENV: ""}) == "any"
    for v in VS.FUSE_POLICIES:
        assert VS.fuse_policy_from_env({VS.FUSE_POLICY_ENV: v}) == v
    for bad in ("Uniform", " any", "all", "1", "none"):
        with pytest.raises(ValueError, match=f"{VS.FUSE_POLICY_ENV} must be one of any, uniform"):
            VS.fuse_policy_from_env({VS.FUSE_POLICY_ENV: bad})


def test_wide_rows_fit_only_when_the_budget_and_the_long_prefill_threshold_hold_a_whole_fused_row():
    def sched(budget, threshold=0):
        return NS(blockdiff_canvas_length=CL, num_spec_tokens=2 * CL, max_num_scheduled_tokens=budget,
                  scheduler_config=NS(long_prefill_token_threshold=threshold))

    assert VS.wide_rows_fit(sched(2 * CL)) and VS.wide_rows_fit(sched(256))
    assert not VS.wide_rows_fit(sched(2 * CL - 1)) and not VS.wide_rows_fit(sched(CL + 4))
    assert VS.wide_rows_fit(sched(256, 2 * CL)) and not VS.wide_rows_fit(sched(256, 2 * CL - 1))
    assert VS.wide_rows_fit(NS(num_spec_tokens=CL))  # no budget known: no limit


def _running(rid, spec, *, tokens=40, computed=None, placeholders=0, eligible=0, prompt_len=10, max_tokens=1000):
    """A running request as vLLM's running loop reads it: ``spec`` draft tokens (0: a prefill chunk of
    ``tokens - computed`` tokens)."""
    return NS(request_id=rid, spec_token_ids=[-1] * spec, num_tokens=tokens,
              num_computed_tokens=tokens + placeholders if computed is None else computed,
              num_output_placeholders=placeholders, next_decode_eligible_step=eligible, num_prompt_tokens=prompt_len,
              max_tokens=max_tokens)


def test_uniform_policy_keeps_fused_lists_only_when_every_canvas_row_the_next_call_schedules_is_fused():
    """keep_uniform_widths, before vLLM's schedule call: fused (2 * CL) lists stay when every canvas row vLLM will
    size is a whole 2 * CL row and all those rows fit the token budget; otherwise every fused list is cut to CL
    (new lists: vLLM's shared placeholder list is never changed). Requests vLLM passes over (not yet
    decode-eligible; async rows in flight that reach max_tokens) neither block nor lose their fused list; a prefill
    chunk is no canvas row but counts against the budget. The same whether the fused requests are found in the scan
    (synchronous scheduler) or passed in (asynchronous: the scan may stop at the first plain canvas row)."""
    W = 2 * CL

    def run(reqs, budget=1000, mml=1000, step=5):
        s = NS(blockdiff_canvas_length=CL, num_spec_tokens=W, running=reqs, max_model_len=mml,
               max_num_scheduled_tokens=budget, current_step=step)
        before = [r.spec_token_ids for r in reqs]
        known = [r for r in reqs if len(r.spec_token_ids) == W]
        got = VS.keep_uniform_widths(s), [len(r.spec_token_ids) for r in reqs]
        for r, spec in zip(reqs, before):
            r.spec_token_ids = spec
        assert (VS.keep_uniform_widths(s, known), [len(r.spec_token_ids) for r in reqs]) == got
        return got

    assert run([_running("a", W)]) == (0, [W])                                    # one request alone
    assert run([_running("a", W), _running("b", W)]) == (0, [W, W])               # all fused
    assert run([_running("a", W), _running("b", CL)]) == (1, [CL, CL])            # mixed: cut
    assert run([_running("a", CL), _running("b", CL)]) == (0, [CL, CL])           # nothing fused
    shared = [-1] * W
    a, b = _running("a", 0), _running("b", CL)
    a.spec_token_ids = shared
    assert run([a, b]) == (1, [CL, CL]) and len(shared) == W                      # vLLM's list left as it was
    # the plain request sits this call out (decode eligibility, or its rows in flight reach max_tokens)
    assert run([_running("a", W), _running("b", CL, eligible=7)]) == (0, [W, CL])
    assert run([_running("a", W), _running("b", CL, eligible=6)]) == (1, [CL, CL])  # schedule() advances first
    done = _running("b", CL, tokens=30, placeholders=CL, prompt_len=10, max_tokens=21)
    assert run([_running("a", W), done]) == (0, [W, CL])
    # ... and a fused request that sits out keeps its list for the call it runs in
    assert run([_running("a", W, eligible=9), _running("b", CL)]) == (0, [W, CL])
    # a prefill chunk of a running request: no canvas row, its tokens count against the budget
    chunk = _running("p", 0, tokens=100, computed=60)
    assert run([_running("a", W), chunk], budget=W + 40) == (0, [W, 0])
    assert run([_running("a", W), chunk], budget=W + 39) == (1, [CL, 0])          # vLLM would cut a row
    assert run([_running("a", W), _running("b", W)], budget=2 * W - 1) == (2, [CL, CL])
    # a row vLLM would cut at max_model_len, or one that is not whole (rows in flight), is no whole fused row
    assert run([_running("a", W, tokens=100)], mml=100 + W - 1) == (1, [CL])
    assert run([_running("a", W, tokens=100, computed=101)]) == (1, [CL])
    assert run([_running("a", W, tokens=100)], step=None) == (0, [W])             # no current_step: no deferral


def test_predictor_counts_a_fused_row_a_policy_cut_as_a_plain_commit_never_a_miss():
    """The predictor gave 2 * CL but the uniform policy cut the row to CL: record sees the CL row vLLM scheduled
    (num_wide not counted), the row commits plain (its CL tokens), the next canvas restarts at step 0, and the
    request is not marked as a miss (fusion stays on for it: its next capped commit is wide again)."""
    p = VS.FusedCommitPredictor(CL, 1)
    r = _req()
    reqs = {"a": r}
    so1 = _so({"a": CL})
    p.record(so1)
    assert p.width(r, 1000) == 2 * CL
    so2 = _so({"a": CL})                 # cut by the policy
    p.record(so2)
    assert p.num_wide == 0 and p.state("a") == ("DENOISE", 0, 2)
    p.observe(so1, *_mro({"a": 0}), reqs)
    p.observe(so2, *_mro({"a": CL}), reqs)
    r.num_output_tokens += CL
    assert p.state("a") == ("DENOISE", 0, 0) and p.num_missed == 0
    p.record(_so({"a": CL}))             # the next canvas's step (cap 1): the row after it is a commit
    assert p.width(r, 1000) == 2 * CL


def _one_width_each_step(runner):
    """Whether every step's canvas rows had a single width (the uniform policy's promise)."""
    return all(len(set(step.values())) == 1 for step in runner.canvas_steps)


_MIXED_PHASES = [("in1", prompt(7, 11), 4 * CL, None, None, 0),     # two requests in phase: they fuse together
                 ("in2", prompt(7, 12), 4 * CL, None, None, 0),
                 ("late", prompt(9, 13), 6 * CL + 2, None, None, 5),  # out of phase with them; alone at the end
                 ("cap2", prompt(5, 14), 3 * CL, None, {"diffusion_max_steps": 2}, 7),
                 ("early", prompt(6, 15), CL + 3, None, {"confidence_threshold": 1e9, "stability_threshold": 0},
                  6)]


@needs_stack
@needs_vllm
def test_async_uniform_policy_keeps_every_steps_canvas_rows_one_width_with_the_unfused_tokens(
        vllm_env, tiny_hf_folder, tiny_model, make_runner):
    """BLOCKDIFF_FUSE_POLICY=uniform under the asynchronous scheduler, requests in and out of phase (arrivals at
    different steps, a request's own cap, canvases converging at their first step, a stop id inside a later
    canvas): in every engine step the scheduled canvas rows all have one width (vLLM's scheduler output), the
    tokens and finish reasons equal the async unfused server's and the harness's, nobody is lost; where the batch
    allows it the policy still fuses (two requests in phase before the others arrive, a request alone at the end),
    it cut other fused rows, no wide row missed, and the predictor counts only the rows scheduled wide. Policy
    ``any`` on the same batch mixes widths in some step (what the policy prevents) and fuses more."""
    probe = harness(make_runner, [_MIXED_PHASES[0]])["in1"][1]
    stop = probe[2 * CL + 1]  # a stop id inside in1's 3rd canvas
    reqs = [(r[0], r[1], r[2], [stop] if r[0] == "in1" else r[3], r[4], r[5]) for r in _MIXED_PHASES]
    want = harness(make_runner, reqs)
    uni, su, ru, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True, policy="uniform")
    plain, _, rp, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False)
    anyp, sa, ra, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True, policy="any")
    assert uni == plain == anyp == want and all(reason is not None for reason, _ in uni.values())
    assert want["in1"][0] == "stop"
    assert su.blockdiff_fuse_policy == "uniform" and sa.blockdiff_fuse_policy == "any"
    assert _one_width_each_step(ru), [s for s in ru.canvas_steps if len(set(s.values())) > 1]
    assert not _one_width_each_step(ra)
    assert sum(ru.fused.values()) > 0 and su.blockdiff_num_policy_cuts > 0
    assert not ru.stalled_wide and su.blockdiff_predictor.num_missed == 0
    assert su.blockdiff_predictor.num_wide == sum(1 for s in ru.canvas_steps for q in s.values() if q == 2 * CL)
    assert sum(ra.fused.values()) > sum(ru.fused.values()) and sa.blockdiff_num_policy_cuts == 0
    assert ra.num_forward <= ru.num_forward <= rp.num_forward


@needs_stack
@needs_vllm
def test_uniform_policy_under_preemption_and_the_synchronous_scheduler_keeps_one_width_and_the_tokens(
        vllm_env, tiny_hf_folder, tiny_model, make_runner):
    """The uniform policy with a KV cache too small for four requests (vLLM preempts; resumed requests re-prefill
    and restart their canvas) and under the synchronous scheduler (BlockdiffDiffusionScheduler: fused rows after
    the worker's -1 flag): every step's canvas rows have one width, the tokens and finish reasons are the unfused
    server's and the harness's, every request is answered."""
    reqs = [(f"r{i}", prompt(9 + i, 20 + i), 3 * CL + i, None, None, i) for i in range(4)]
    want = harness(make_runner, reqs)
    pre, sp, rpre, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True, num_blocks=7,
                             policy="uniform")
    assert pre == want and max(rpre.adds.values()) > 1 and _one_width_each_step(rpre)
    assert not rpre.stalled_wide and sp.blockdiff_predictor.num_missed == 0
    reqs = _MIXED_PHASES
    want = harness(make_runner, reqs)
    sync_u, ss, rs, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True,
                              asynchronous=False, policy="uniform")
    sync_a, sa, ra, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True,
                              asynchronous=False, policy="any")
    assert sync_u == sync_a == want
    assert _one_width_each_step(rs) and not _one_width_each_step(ra)
    assert sum(rs.fused.values()) > 0 and ss.blockdiff_num_policy_cuts > 0 and sa.blockdiff_num_policy_cuts == 0
    assert not rs.stalled_wide and ss.blockdiff_predictor is None  # sync: no predictor, the worker's flags


@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous", [True, False])
def test_no_fused_row_when_the_token_budget_cannot_hold_one_whole(vllm_env, tiny_hf_folder, tiny_model, make_runner,
                                                                  asynchronous):
    """The budget guard: a token budget below 2 * CL (max_num_scheduled_tokens) would cut every fused row to
    CL < q < 2 * CL (a plain commit paying for discarded tokens), so neither scheduler keeps one: no canvas row is
    wider than CL, the tokens are the harness's. A budget of exactly 2 * CL fuses (one request: the row fits)."""
    reqs = [("a", prompt(4, 30), 3 * CL, None, None, 0)]
    want = harness(make_runner, reqs)
    for budget, fused in ((2 * CL - 1, False), (CL + 4, False), (2 * CL, True)):
        out, s, r, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True, budget=budget,
                             asynchronous=asynchronous)
        assert out == want, budget
        assert s.blockdiff_wide_fits is fused and (s.blockdiff_predictor is not None) is (fused and asynchronous)
        widths = [q for step in r.canvas_steps for q in step.values()]
        assert (max(widths) == 2 * CL) is fused and all(q in (CL, 2 * CL) for q in widths), (budget, widths)


@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous, policy", [(True, "any"), (True, "uniform"), (False, "any")])
def test_fused_commit_coverage_equals_what_the_runner_did_and_reaches_the_server_log(
        vllm_env, tiny_hf_folder, tiny_model, caplog, asynchronous, policy):
    """The coverage counts of either scheduler (blockdiff_commit_counts) on a mixed batch (requests in and out of
    phase, a request's own cap, canvases converging at their first step: fused and plain commits): fused commits,
    plain commits and wide rows that committed nothing equal what the CPU runner ran (rows 2 * CL wide that
    committed, narrower rows that committed, wide rows stalled), the commits are the answers' canvases, the uniform
    policy's cuts are counted. The server log gets the INFO line at commit counts reaching a power of two and once
    more when no request is left, with the final counts (far fewer lines than steps), and once at shutdown."""
    with captured_log(caplog, VS._log, logging.INFO):
        out, s, r, steps = serve(vllm_env, tiny_hf_folder, tiny_model, _MIXED_PHASES, served=2 * CL, fuse=True,
                                 asynchronous=asynchronous, policy=policy)
        c = s.blockdiff_commit_counts
        s.shutdown()
    assert all(reason is not None for reason, _ in out.values())
    fused, plain = sum(r.fused.values()), sum(r.plain.values())
    assert (c.num_fused, c.num_plain, c.num_missed) == (fused, plain, sum(r.stalled_wide.values())) == (
        c.num_fused, c.num_plain, 0)
    assert fused > 0 and plain > 0 and c.num_commits == sum(-(-len(toks) // CL) for _, toks in out.values())
    assert c.num_policy_cuts == s.blockdiff_num_policy_cuts and (c.num_policy_cuts > 0) is (policy == "uniform")
    assert (s.blockdiff_predictor is not None) is asynchronous
    if asynchronous:
        assert s.blockdiff_predictor.counts is c and s.blockdiff_predictor.num_missed == c.num_missed
    lines = [m.getMessage() for m in caplog.records if "fused commits so far" in m.getMessage()]
    assert len(lines) == c.num_lines and all(m.levelno == logging.INFO for m in caplog.records)
    assert len(lines) - 1 <= c.num_commits.bit_length() + 1 < steps // 4, (lines, steps)
    final = (f"blockdiff: fused commits so far: {fused} of {fused + plain} commits fused ({plain} plain, 0 wide rows "
             f"missed, {c.num_policy_cuts} fused rows cut by fuse policy {policy}); "
             f"{'asynchronous' if asynchronous else 'synchronous'} scheduler")
    assert lines[-2:] == [final + ", no request left", final + ", at shutdown"], lines
    # the lines before: each at a commit count past a new power of two (a step may commit several canvases)
    counts = [int(m.split(" of ")[1].split()[0]) for m in lines[:-2]]
    assert counts and all(a.bit_length() < b.bit_length() for a, b in zip([0] + counts, counts)), lines


@needs_vllm
@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_bad_fuse_policy_stops_the_scheduler_at_start(monkeypatch, tiny_hf_folder, asynchronous):
    """BLOCKDIFF_FUSE_POLICY other than any / uniform: the scheduler's construction raises a ValueError naming the
    variable and the allowed values, in the fused layout and in the default one (a typo is never ignored)."""
    for served in (2 * CL, CL):
        with pytest.raises(ValueError, match=f"{VS.FUSE_POLICY_ENV} must be one of any, uniform"):
            _scheduler(monkeypatch, tiny_hf_folder, served=served, fuse=True, asynchronous=asynchronous,
                       policy="uniformly")
    s = _scheduler(monkeypatch, tiny_hf_folder, served=2 * CL, fuse=True, asynchronous=asynchronous)
    assert s.blockdiff_fuse_policy == "any" and s.blockdiff_num_policy_cuts == 0


if given is not None:
    @needs_stack
    @needs_vllm
    @settings(max_examples=4, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(rows=st.lists(_REQ.filter(lambda r: r[6] is None), min_size=2, max_size=4),
           server=_SERVER.filter(lambda s: s["budget"] >= 2 * CL))
    def test_uniform_policy_random_batches_keep_one_canvas_width_a_step_and_the_unfused_tokens(
            vllm_env, tiny_hf_folder, tiny_model, make_runner, rows, server):
        """Random batches of 2-4 requests (prompt lengths, max_tokens, per-request caps, early convergence, stop
        ids, staggered arrivals) on random servers (small KV caches: preemption; fewer sequences; budgets of
        3 * CL and 256) under BLOCKDIFF_FUSE_POLICY=uniform: no step schedules a fused row beside a narrower canvas
        row, no wide row misses, and every request gets the async unfused server's tokens and reason, which are the
        harness's. (A wide row that commits nothing is allowed only once, for a request a stop id ended: the row
        scheduled while that commit was in flight, a no-op on a finished request, as under policy ``any``.)"""
        reqs = []
        for i, (plen, mt, cap, early, stop, at, _) in enumerate(rows):
            extra = {} if cap is None else {"diffusion_max_steps": cap}
            if early:
                extra.update(confidence_threshold=1e9, stability_threshold=i % 2)
            reqs.append((f"r{i}", prompt(plen, 60 + i), mt, stop or None, extra or None, at))
        want = harness(make_runner, reqs)
        uni, su, ru, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=2 * CL, fuse=True,
                               policy="uniform", **server)
        plain, _, _, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, **server)
        assert uni == plain == want
        mixed = [s for s in ru.canvas_steps if 2 * CL in s.values() and min(s.values()) < 2 * CL]
        assert not mixed and su.blockdiff_predictor.num_missed == 0
        stopped = {rid for rid, (reason, _) in uni.items() if reason == "stop"}
        assert set(ru.stalled_wide) <= stopped and max(ru.stalled_wide.values(), default=0) <= 1, ru.stalled_wide


# ------------------------------------------------------------------------------------------ vLLM's own scheduler
@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True])
def test_vllm_model_state_refuses_vllms_own_scheduler_which_never_finishes_a_request_at_max_model_len(
        vllm_env, tiny_hf_folder, tiny_model, asynchronous):
    """Why: served in the one-canvas layout with vLLM's own scheduler (--scheduler-cls unset: 0.26.0's Scheduler /
    AsyncScheduler, 0.33.0's DiffusionScheduler / DiffusionAsyncScheduler), a request whose next canvas passes
    max_model_len (vLLM's default max_tokens, max_model_len - prompt, gets every request without a stop id there)
    is scheduled a truncated canvas the sampler can only stall, forever: a lost request (so is one whose logits
    failed, reported in num_nans, which vLLM only counts). The plugin's scheduler finishes it with 'length'. So the
    model state stops the start with a ValueError naming --scheduler-cls in every layout (was: only the two-canvas
    one; the one-canvas layout served on and hung such requests)."""
    from test_vllm_plugin import _StandInVllmModel

    from blockdiff.integration.model_state import DiffusionModelState
    from blockdiff.integration.vllm_compat import scheduler_base_classes

    reqs = [("a", prompt(10, 1), 500, None, None, 0)]
    out, _, _, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False,
                         asynchronous=asynchronous, max_model_len=64)
    assert out["a"][0] == "length" and len(out["a"][1]) == (64 - 10) // CL * CL  # the plugin's: answered
    name = "BlockdiffDiffusionAsyncScheduler" if asynchronous else "BlockdiffDiffusionScheduler"
    plugin = getattr(VS, name)  # the classes built, so the stand-in below replaces the plugin's one
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(VS._classes, name, scheduler_base_classes()[int(asynchronous)])
        with pytest.raises(AssertionError, match="no progress after 200 steps"):  # vLLM's own: never answered
            serve(mp, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, asynchronous=asynchronous,
                  max_model_len=64, max_steps=200)

    H = 8
    mc = NS(get_inputs_embeds_size=lambda: H, dtype=torch.float32, hf_text_config=NS(hidden_size=H),
            hf_config=NS(canvas_length=CL), try_get_generation_config=lambda: {}, get_vocab_size=lambda: 64,
            max_model_len=256)
    vllm_env.delenv(VS.FUSE_COMMIT_ENV, raising=False)

    def build(scheduler_cls):
        sc = NS(max_num_seqs=2, max_num_batched_tokens=64, async_scheduling=asynchronous, scheduler_cls=scheduler_cls)
        cfg = NS(model_config=mc, scheduler_config=sc, diffusion_config=NS(canvas_length=CL, max_denoising_steps=2))
        return DiffusionModelState(cfg, _StandInVllmModel(64, H), None, torch.device("cpu"))

    for cls in (None, scheduler_base_classes()[int(asynchronous)],
                "vllm.v1.core.sched.async_scheduler.AsyncScheduler" if asynchronous else
                "vllm.v1.core.sched.scheduler.Scheduler"):
        with pytest.raises(ValueError, match="--scheduler-cls blockdiff.integration.vllm_scheduler"):
            build(cls)
    assert build(f"blockdiff.integration.vllm_scheduler.{name}").canvas_length == CL
    assert build(type("Mine", (plugin,), {})).canvas_length == CL  # a subclass of the plugin's


@needs_stack
@needs_vllm
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_long_prefill_token_threshold_below_a_canvas_stops_the_start_instead_of_hanging_every_request(
        vllm_env, tiny_hf_folder, tiny_model, asynchronous):
    """Why: vLLM (0.26.0 and 0.33.0; 0.33.0 while more than one request is eligible) cuts every running row to
    ``long_prefill_token_threshold`` tokens, canvas rows included, so with a threshold in (0, CL) no canvas is ever
    scheduled whole and the sampler stalls every one: every request hangs without a token. vLLM 0.26.0 sets such a threshold itself: ``--max-num-partial-prefills 2``
    with the threshold unset gives 4 % of max_model_len (163 at 4096, below a 256-token canvas). The plugin's schedulers
    now stop the start with a ValueError naming the threshold and the canvas length (was: served, every request
    lost); a threshold of at least CL, or 0 (off), serves as before."""
    import sys

    mod = sys.modules[__name__]
    # two requests: vLLM 0.33.0 lifts the threshold while a single request is eligible (nobody to starve)
    reqs = [("a", prompt(10, 1), 3 * CL, None, None, 0), ("b", prompt(5, 2), 2 * CL, None, None, 0)]
    plain = _scheduler

    def after_start(*a, **k):  # the threshold set behind the start's check: what a served request would meet
        s = plain(*a, **k)
        s.scheduler_config.long_prefill_token_threshold = CL - 1
        return s

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "_scheduler", after_start)
        with pytest.raises(AssertionError, match="no progress after 200 steps"):
            serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, asynchronous=asynchronous,
                  max_steps=200)
    from vllm.config import SchedulerConfig

    cases = [dict(long_prefill_token_threshold=CL - 1), dict(long_prefill_token_threshold=1)]
    if "max_num_partial_prefills" in SchedulerConfig.__dataclass_fields__:  # 0.26.0: 4 % of max_model_len 100: 4
        cases.append(dict(max_num_partial_prefills=2, enable_chunked_prefill=True))
    for kw in cases:
        with pytest.raises(ValueError, match=rf"long_prefill_token_threshold \(\d+\) .*canvas_length {CL}"):
            _scheduler(vllm_env, tiny_hf_folder, served=CL, fuse=False, asynchronous=asynchronous,
                       max_model_len=100, **kw)
    for threshold in (0, CL, 2 * CL):
        s = _scheduler(vllm_env, tiny_hf_folder, served=CL, fuse=False, asynchronous=asynchronous,
                       long_prefill_token_threshold=threshold)
        assert s.scheduler_config.long_prefill_token_threshold == threshold
    out, _, _, _ = serve(vllm_env, tiny_hf_folder, tiny_model, reqs, served=CL, fuse=False, asynchronous=asynchronous,
                         long_prefill_token_threshold=CL)
    assert out["a"] == ("length", out["a"][1]) and len(out["a"][1]) == 3 * CL and len(out["b"][1]) == 2 * CL
