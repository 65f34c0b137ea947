"""HarnessRunner: replays vLLM model runner v2's call order for a block-diffusion model, without vLLM.

Per step (docs/ARCHITECTURE.md "Integration and vLLM accounting"):

1. arrivals: requests whose ``arrival_step`` has come get a free slot -> ``model_state.add_request``;
2. schedule, under a token budget (``max_num_batched_tokens``): every denoise / commit row (a whole canvas of
   ``canvas_length`` tokens each; rows that waited longest first), then prompt chunks (chunked prefill: a long
   prompt is split over several steps); pages of the paged KV cache are allocated as rows grow;
3. ``prepare_inputs_embeds`` -> ``prepare_inputs`` -> ``prepare_attn`` -> model forward -> sampler step
   (the ``DiffusionSampler`` from ``custom_sampler``);
4. accounting: ``num_computed_tokens += query_len - num_rejected`` (a prompt chunk or a commit advances the KV
   position, a denoise row does not), tokens emitted by commit rows appended to the request's output;
5. ``postprocess_state``; finished / failed requests are removed and their slots and pages freed for reuse.

Preemption is explicit (:meth:`HarnessRunner.preempt`) and replays vLLM's: the request is removed (slot and KV
pages freed) and queued first; when readmitted, ``add_request`` gets ``prefill_token_ids`` = prompt + the tokens
it already emitted, which are prefilled again (causally, as their commit wrote them) before the next canvas.

It is a test and demo harness, not a serving engine: no prefix caching, no automatic preemption, one process.
A request is never dropped silently: one that cannot be scheduled makes :meth:`HarnessRunner.run` raise.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from blockdiff.sampler import COMMIT, DENOISE, PHASE_NAMES, PREFILL, SamplingParams

from .batch import HarnessInputBatch, NewRequest
from .checks import AttentionChecker
from .kv_alloc import BlockAllocator, OutOfBlocks
from .model_state import DiffusionModelState


@dataclass
class RequestResult:
    """Outcome of one request.

    Attributes:
        req_id, prompt_len (tokens), output_token_ids (emitted tokens, trimmed after the first EOS and at
        max_tokens), finish_reason ("eos", "length" = max_tokens or max_model_len, "failed"), num_canvases
        committed, num_denoise_steps (forward passes in denoise mode), arrival_step / admit_step (the last
        admission) / finish_step, num_preemptions.
    """

    req_id: str
    prompt_len: int
    output_token_ids: list[int]
    finish_reason: str
    num_canvases: int
    num_denoise_steps: int
    arrival_step: int
    admit_step: int
    finish_step: int
    num_preemptions: int = 0


@dataclass
class RowRecord:
    """One row of a step: request, phase at entry (``"prefill"``, ``"denoise"`` or ``"commit"``: the lower-case
    :data:`blockdiff.sampler.PHASE_NAMES`), query tokens, keys (incl. the query), causal flag, and the sampler's
    accounting for it."""

    req_id: str
    slot: int
    phase: str
    q_len: int
    seq_len: int
    causal: bool
    num_sampled: int = 0
    num_rejected: int = 0
    num_emitted: int = 0
    accepted: int = 0  # denoise rows: canvas positions accepted in this step (not newly fixed ones)
    mean_entropy: float | None = None
    converged: bool = False


@dataclass
class StepRecord:
    """What one harness step did (one forward pass, or none when nothing was runnable yet)."""

    step: int
    rows: list[RowRecord] = field(default_factory=list)
    arrived: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    forward: bool = False
    wall_ms: float = 0.0

    def count(self, phase: str) -> int:
        return sum(r.phase == phase for r in self.rows)

    @property
    def positions_accepted(self) -> int:
        """Canvas positions the entropy bound accepted in this step, summed over the denoise rows. Each denoise
        step samples every position again (accepted ones keep their sample, the rest are renoised), so this
        counts acceptances per step, not newly fixed positions."""
        return sum(r.accepted for r in self.rows if r.phase == "denoise")

    @property
    def mean_entropy(self) -> float | None:
        v = [r.mean_entropy for r in self.rows if r.phase == "denoise" and r.mean_entropy is not None]
        return float(np.mean(v)) if v else None

    @property
    def canvases_committed(self) -> int:
        return self.count("commit")

    @property
    def tokens_emitted(self) -> int:
        return sum(r.num_emitted for r in self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(r.q_len for r in self.rows)


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: Any
    arrival_step: int
    slot: int | None = None
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    num_canvases: int = 0
    num_denoise_steps: int = 0
    admit_step: int = -1
    last_scheduled: int = -1
    prefill: list[int] = field(default_factory=list)  # tokens to prefill: the prompt, + output after preemption
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prefill:
            self.prefill = list(self.prompt)


class HarnessRunner:
    """Drives a :class:`blockdiff.model.DiffusionGemma` through :class:`DiffusionModelState` and
    :class:`~blockdiff.integration.sampler.DiffusionSampler` in model runner v2's call order.

    Args:
        model: the model (forward ``model(input_ids, positions, meta, kv_caches, self_cond, *, attn_backend)``,
            ``allocate_kv_caches``, ``embedding_weight``, ``config.vocab_size`` / ``hidden_size``).
        default_params: :class:`blockdiff.sampler.SamplingParams` for requests added without params; its
            ``canvas_length`` is the served canvas length.
        max_num_reqs: request slots (>= 1).
        max_num_batched_tokens: token budget of one step (>= canvas_length).
        page_size: KV page size in tokens. num_blocks: KV pages (default: enough for every slot at
            ``max_model_len``). max_model_len: longest sequence in tokens (prompt + emitted + one canvas).
        device: torch device (default: the model's). kv_dtype: cache dtype (default: the model's).
        attn_backend: ``"reference"``, ``"triton"`` or ``"cute"`` (passed to the model; no fallback).
        sampler_backend: ``"reference"`` or ``"triton"``.
        check: compare every attention call and every sampler step with the references; a mismatch raises.

    Raises:
        ValueError: bad capacities.
    """

    def __init__(self, model: torch.nn.Module, *, default_params: Any = None, max_num_reqs: int = 4,
                 max_num_batched_tokens: int = 256, page_size: int = 16, num_blocks: int | None = None,
                 max_model_len: int = 512, device: torch.device | str | None = None,
                 kv_dtype: torch.dtype | None = None, attn_backend: str = "reference",
                 sampler_backend: str = "reference", check: bool = False) -> None:
        self.default_params = default_params if default_params is not None else SamplingParams()
        cl = self.default_params.canvas_length
        for name, v in (("max_num_reqs", max_num_reqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("page_size", page_size), ("max_model_len", max_model_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if max_num_batched_tokens < cl:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= canvas_length ({cl})")
        if max_model_len < cl + 1:
            raise ValueError(f"max_model_len ({max_model_len}) must leave room for a prompt and a canvas ({cl})")
        p0 = next(iter(model.parameters()), None)
        self.device = torch.device(device) if device is not None else (p0.device if p0 is not None else
                                                                         torch.device("cpu"))
        self.model = model
        self.canvas_length = cl
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.max_blocks_per_req = -(-max_model_len // page_size)
        if num_blocks is None:
            num_blocks = max_num_reqs * self.max_blocks_per_req
        self.allocator = BlockAllocator(num_blocks, page_size)
        self.attn_backend = attn_backend
        self.sampler_backend = sampler_backend
        self.check = check
        kv_dtype = kv_dtype if kv_dtype is not None else (p0.dtype if p0 is not None else torch.float32)
        self.kv_caches = model.allocate_kv_caches(num_blocks, page_size, self.device, kv_dtype)
        self.model_state = DiffusionModelState.for_harness(
            model, max_num_reqs=max_num_reqs, max_num_tokens=max_num_batched_tokens, canvas_length=cl,
            device=self.device, default_params=self.default_params)
        self.sampler, rejection = self.model_state.custom_sampler(None, backend=sampler_backend)
        assert rejection is None
        self.sampler.check = check
        self.attention_checker = None
        if check:
            self.attention_checker = AttentionChecker()
        self.step_index = 0
        self.num_forward = 0
        self.wall_s = 0.0
        self.history: list[StepRecord] = []
        self.results: dict[str, RequestResult] = {}
        self._waiting: list[_Req] = []
        self._running: dict[str, _Req] = {}
        self._free_slots = list(range(max_num_reqs))
        self._ids: set[str] = set()
        self.last_batch: HarnessInputBatch | None = None
        self.last_output = None

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt_token_ids, params: Any = None, *, arrival_step: int | None = None
                    ) -> None:
        """Queue a request; it is admitted (gets a slot) at step ``arrival_step`` (default: the next step) or
        later if no slot is free.

        Raises:
            ValueError: duplicate id, empty prompt, token id outside [0, vocab), prompt too long for
                ``max_model_len``, or a canvas length other than the served one.
        """
        if not isinstance(req_id, str) or not req_id:
            raise ValueError(f"req_id must be a non-empty str, got {req_id!r}")
        if req_id in self._ids:
            raise ValueError(f"duplicate req_id {req_id!r}")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request {req_id!r}: prompt_token_ids must not be empty")
        V = self.model_state.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"request {req_id!r}: token ids must be in [0, {V})")
        if len(prompt) + self.canvas_length > self.max_model_len:
            raise ValueError(f"request {req_id!r}: prompt ({len(prompt)}) + canvas ({self.canvas_length}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        params = params if params is not None else self.default_params
        if params.canvas_length != self.canvas_length:
            raise ValueError(f"request {req_id!r}: canvas_length {params.canvas_length} != served "
                             f"{self.canvas_length}")
        try:  # everything the slot's add_request checks (eos ids vs vocab, ...): refuse it now, not at admission,
            self.model_state.check_params(params)  # where the request would be lost mid-step
        except ValueError as e:
            raise ValueError(f"request {req_id!r}: {e}") from None
        arrival = self.step_index if arrival_step is None else int(arrival_step)
        self._ids.add(req_id)
        self._waiting.append(_Req(req_id, prompt, params, arrival))
        self._waiting.sort(key=lambda r: r.arrival_step)

    def slot_of(self, req_id: str) -> int | None:
        r = self._running.get(req_id)
        return None if r is None else r.slot

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    # ------------------------------------------------------------------ one step
    def _admit(self, rec: StepRecord) -> None:
        while self._waiting and self._waiting[0].arrival_step <= self.step_index and self._free_slots:
            r = self._waiting[0]
            self._free_slots.sort()
            slot = self._free_slots[0]
            # claim the slot only once the model state accepted the request: if add_request raises, the request
            # stays queued and the slot free (nothing lost or leaked) and the error reaches the caller
            self.model_state.add_request(slot, NewRequest(r.req_id, r.prompt, r.params, prefill_token_ids=r.prefill))
            self._waiting.pop(0)
            self._free_slots.pop(0)
            r.slot = slot
            r.admit_step = self.step_index
            self._running[r.req_id] = r
            rec.arrived.append(r.req_id)

    def _schedule(self, phases: list[int]) -> list[tuple[_Req, int, int]]:
        """Rows ``(req, phase, q_len)`` within the token budget; allocates KV pages."""
        budget = self.max_num_batched_tokens
        rows: list[tuple[_Req, int, int]] = []
        CL = self.canvas_length
        canvas = [r for r in self._running.values() if phases[r.slot] in (DENOISE, COMMIT)]
        canvas.sort(key=lambda r: (r.last_scheduled, r.admit_step, r.slot))
        for r in canvas:
            if budget < CL:
                break
            try:
                self.allocator.ensure(r.req_id, r.num_computed + CL)
            except OutOfBlocks:
                continue
            rows.append((r, phases[r.slot], CL))
            budget -= CL
        prefills = [r for r in self._running.values() if phases[r.slot] == PREFILL]
        prefills.sort(key=lambda r: (r.admit_step, r.slot))
        for r in prefills:
            chunk = min(len(r.prefill) - r.num_computed, budget)
            if chunk <= 0:
                continue
            pages_free = self.allocator.num_free + len(self.allocator.blocks(r.req_id))
            chunk = min(chunk, pages_free * self.page_size - r.num_computed)
            if chunk <= 0:
                continue
            self.allocator.ensure(r.req_id, r.num_computed + chunk)
            rows.append((r, PREFILL, chunk))
            budget -= chunk
        return rows

    def _build_batch(self, rows) -> HarnessInputBatch:
        dev = self.device
        N = len(rows)
        q_lens = np.array([q for _, _, q in rows], dtype=np.int32)
        ctx = np.array([r.num_computed for r, _, _ in rows], dtype=np.int32)
        qsl = np.zeros(N + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        T = int(qsl[-1])
        seq_lens = ctx + q_lens
        slots = np.array([r.slot for r, _, _ in rows], dtype=np.int64)
        input_ids = np.zeros(T, dtype=np.int64)
        positions = np.zeros(T, dtype=np.int64)
        slot_mapping = np.zeros(T, dtype=np.int64)
        block_table = np.zeros((N, self.max_blocks_per_req), dtype=np.int32)
        is_prefill = np.zeros(N, dtype=bool)
        for i, (r, ph, q) in enumerate(rows):
            s, e = qsl[i], qsl[i + 1]
            pos = np.arange(r.num_computed, r.num_computed + q, dtype=np.int64)
            positions[s:e] = pos
            pages = np.array(self.allocator.blocks(r.req_id), dtype=np.int64)
            block_table[i, : len(pages)] = pages
            slot_mapping[s:e] = pages[pos // self.page_size] * self.page_size + pos % self.page_size
            if ph == PREFILL:
                input_ids[s:e] = r.prefill[r.num_computed: r.num_computed + q]
                is_prefill[i] = True
        t = lambda a, dt: torch.as_tensor(a, dtype=dt).to(dev)  # noqa: E731
        prefill_len = np.array([len(r.prefill) for r, _, _ in rows], dtype=np.int32)
        return HarnessInputBatch(
            req_ids=[r.req_id for r, _, _ in rows], num_reqs=N, num_tokens=T,
            idx_mapping=t(slots, torch.int64), idx_mapping_np=slots, num_scheduled_tokens=q_lens,
            query_start_loc=t(qsl, torch.int32), query_start_loc_np=qsl,
            seq_lens=t(seq_lens, torch.int32), seq_lens_np=seq_lens.astype(np.int32),
            num_computed_tokens_np=ctx, prefill_len_np=prefill_len,
            num_computed_prefill_tokens_np=np.minimum(ctx, prefill_len), is_prefilling_np=is_prefill,
            input_ids=t(input_ids, torch.int64), positions=t(positions, torch.int64),
            slot_mapping=t(slot_mapping, torch.int64), block_table=t(block_table, torch.int32),
            logits_indices=torch.arange(T, device=dev), cu_num_logits_np=qsl.copy(),
            num_draft_tokens=int(q_lens[~is_prefill].sum()), max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()))

    def schedule_batch(self) -> HarnessInputBatch | None:
        """Admit arrivals and build the batch the next :meth:`step` would run, without running it (for tests
        and CUDA-graph capture; :meth:`step` schedules again, to the same rows while nothing changed).
        Returns None when nothing is runnable."""
        self._admit(StepRecord(step=self.step_index))
        if not self._running:
            return None
        rows = self._schedule(self.model_state.state.phase.tolist())
        return self._build_batch(rows) if rows else None

    def _forward(self, batch: HarnessInputBatch, inputs: dict, meta) -> torch.Tensor:
        kw = dict(attn_backend=self.attn_backend)
        if self.attention_checker is not None:
            with self.attention_checker:
                return self.model(inputs["input_ids"], inputs["positions"], meta, self.kv_caches,
                                  inputs["self_cond"], **kw)
        return self.model(inputs["input_ids"], inputs["positions"], meta, self.kv_caches, inputs["self_cond"], **kw)

    def step(self) -> StepRecord:
        """Run one scheduler step (admit, schedule, one forward pass, sampler, accounting, removals).

        Returns:
            the :class:`StepRecord` (also appended to ``history``).

        Raises:
            RuntimeError: requests are runnable but none could be scheduled (KV pool too small).
            blockdiff.integration.sampler.SamplerMismatch / checks.AttentionMismatch: ``check`` found a
                backend disagreeing with the reference.
        """
        t0 = time.perf_counter()
        rec = StepRecord(step=self.step_index)
        self._admit(rec)
        ms = self.model_state
        st = ms.state
        if not self._running:
            self.step_index += 1
            self.history.append(rec)
            return rec
        phases = st.phase.tolist()
        rows = self._schedule(phases)
        if not rows:
            raise RuntimeError(
                f"step {self.step_index}: {len(self._running)} running request(s) but none could be scheduled "
                f"({self.allocator.num_free} free KV pages of {self.page_size} tokens): enlarge num_blocks")
        batch = self._build_batch(rows)
        with torch.inference_mode():
            ms.prepare_inputs_embeds({}, batch, None)
            inputs = ms.prepare_inputs(batch, None)
            meta = ms.prepare_attn(batch, None, (batch.block_table,), batch.slot_mapping, None, None)
            logits = self._forward(batch, inputs, meta)
            out = self.sampler(logits, batch)
        self.num_forward += 1
        rec.forward = True
        self.last_batch, self.last_output = batch, out

        causal = meta.causal.tolist()
        n_s, n_r = out.num_sampled.tolist(), out.num_rejected.tolist()
        n_e = out.num_emitted.tolist()
        emitted = out.sampled_token_ids.tolist()
        so = out.step
        finished, failed = so.finished.tolist(), so.failed.tolist()
        den = [ph == DENOISE for _, ph, _ in rows]
        acc = so.accepted.sum(-1).tolist() if any(den) else [0] * len(rows)
        ment = so.mean_entropy.tolist() if any(den) else [None] * len(rows)
        conv = so.converged.tolist() if any(den) else [False] * len(rows)
        num_computed = ms.num_computed_tokens.clone()
        done: list[tuple[_Req, str]] = []
        for i, (r, ph, q) in enumerate(rows):
            r.last_scheduled = self.step_index
            seq_len = r.num_computed + q
            r.num_computed += q - n_r[i]
            num_computed[r.slot] = r.num_computed
            r.output.extend(emitted[i][: n_e[i]])
            row = RowRecord(r.req_id, r.slot, PHASE_NAMES[ph].lower(), q, seq_len, bool(causal[i]), n_s[i], n_r[i],
                            n_e[i])
            if ph == DENOISE:
                r.num_denoise_steps += 1
                row.accepted, row.mean_entropy, row.converged = int(acc[i]), float(ment[i]), bool(conv[i])
            if ph == COMMIT:
                r.num_canvases += 1
            rec.rows.append(row)
            if failed[i]:
                done.append((r, "failed"))
            elif finished[i]:
                hit_eos = bool(r.params.eos_token_ids) and bool(r.output) and r.output[-1] in r.params.eos_token_ids
                done.append((r, "eos" if hit_eos else "length"))
            elif ph == COMMIT and r.num_computed + self.canvas_length > self.max_model_len:
                done.append((r, "length"))
        ms.postprocess_state(batch.idx_mapping, out.num_sampled, num_computed)
        for r, reason in done:
            self._finish(r, reason)
            rec.finished.append(r.req_id)
        rec.wall_ms = (time.perf_counter() - t0) * 1e3
        self.wall_s += rec.wall_ms / 1e3
        self.step_index += 1
        self.history.append(rec)
        return rec

    def _finish(self, r: _Req, reason: str) -> None:
        self.results[r.req_id] = RequestResult(
            r.req_id, len(r.prompt), list(r.output), reason, r.num_canvases, r.num_denoise_steps, r.arrival_step,
            r.admit_step, self.step_index, r.num_preemptions)
        self.model_state.remove_request(r.req_id)
        self.allocator.free(r.req_id)
        self._free_slots.append(r.slot)
        del self._running[r.req_id]

    def preempt(self, req_id: str) -> None:
        """Preempt a running request as vLLM's scheduler does: ``remove_request``, its slot and KV pages freed,
        and the request queued first, to be readmitted with ``prefill_token_ids`` = prompt + its emitted tokens
        (re-prefilled; those tokens count toward max_tokens and the next canvas continues after them). Call it
        between steps.

        Raises:
            ValueError: ``req_id`` is not running.
        """
        r = self._running.get(req_id)
        if r is None:
            raise ValueError(f"request {req_id!r} is not running (waiting, finished or unknown)")
        self.model_state.remove_request(req_id)
        self.allocator.free(req_id)
        self._free_slots.append(r.slot)
        del self._running[req_id]
        r.slot = None
        r.num_computed = 0
        r.prefill = list(r.prompt) + list(r.output)
        r.num_preemptions += 1
        r.arrival_step = min(r.arrival_step, self.step_index)
        self._waiting.insert(0, r)

    # ------------------------------------------------------------------ whole runs
    def run(self, max_steps: int = 100_000, on_step: Callable[[StepRecord], None] | None = None
            ) -> dict[str, RequestResult]:
        """Step until every request has finished.

        Args:
            max_steps: safety cap on steps (>= 1).
            on_step: called with each :class:`StepRecord`.

        Returns:
            ``{req_id: RequestResult}`` for every request added.

        Raises:
            RuntimeError: unfinished requests after ``max_steps`` steps (none is dropped silently).
        """
        start = self.step_index
        while self.has_unfinished:
            if self.step_index - start >= max_steps:
                left = [r.req_id for r in self._waiting] + list(self._running)
                raise RuntimeError(f"{len(left)} request(s) unfinished after {max_steps} steps: {left[:8]}")
            rec = self.step()
            if on_step is not None:
                on_step(rec)
        return dict(self.results)

    def totals(self) -> dict[str, Any]:
        """Run totals (the figures ``blockdiff demo`` and ``blockdiff train``'s evaluation, :mod:`.evaluate`, report).

        Returns:
            dict: ``steps``; ``forward_passes`` (harness steps that ran the model: one pass serves every
            scheduled row); ``tokens_emitted`` (tokens committed, after EOS / max_tokens trimming);
            ``tokens_per_forward`` (tokens emitted / forward passes); ``wall_s``; ``request_rows`` (rows of all
            passes: prefill chunks, denoise and commit rows); ``tokens_per_request_pass`` (tokens emitted /
            request rows); ``denoise_rows``; ``tokens_per_denoise_step`` (tokens emitted / denoise rows);
            ``canvases_committed``; ``denoise_steps_per_canvas`` (mean denoise rows of the committed canvases;
            a canvas still being denoised, or of a failed request, is not counted, nor are the rows of a canvas
            a preemption interrupted: the resumed request denoises that canvas again from step 0) and
            ``max_denoise_steps_per_canvas`` (0 when none committed). A ratio with a zero denominator is NaN
            (undefined: nothing ran).
        """
        emitted = sum(len(r.output_token_ids) for r in self.results.values()) + sum(
            len(r.output) for r in self._running.values())
        rows = sum(len(h.rows) for h in self.history)
        denoise_rows = sum(h.count("denoise") for h in self.history)
        per_canvas: list[int] = []  # denoise rows of each committed canvas, in commit order
        pending: dict[str, int] = {}
        for h in self.history:
            for row in h.rows:
                if row.phase == "prefill":  # (re)admission: a canvas interrupted by preemption restarts at step 0
                    pending.pop(row.req_id, None)
                elif row.phase == "denoise":
                    pending[row.req_id] = pending.get(row.req_id, 0) + 1
                elif row.phase == "commit":
                    per_canvas.append(pending.pop(row.req_id, 0))
        ratio = lambda a, b: a / b if b else math.nan  # noqa: E731
        return {
            "steps": self.step_index, "forward_passes": self.num_forward, "tokens_emitted": emitted,
            "tokens_per_forward": ratio(emitted, self.num_forward),
            "wall_s": self.wall_s,
            "request_rows": rows, "tokens_per_request_pass": ratio(emitted, rows),
            "denoise_rows": denoise_rows, "tokens_per_denoise_step": ratio(emitted, denoise_rows),
            "canvases_committed": sum(h.canvases_committed for h in self.history),
            "denoise_steps_per_canvas": ratio(sum(per_canvas), len(per_canvas)),
            "max_denoise_steps_per_canvas": max(per_canvas, default=0),
        }
