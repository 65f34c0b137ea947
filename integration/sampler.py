"""DiffusionSampler: the sampler ``DiffusionModelState.custom_sampler`` hands to model runner v2.

It replaces vLLM's sampler *and* its rejection sampler (``custom_sampler`` returns ``(DiffusionSampler, None)``)
and maps one :func:`blockdiff.sampler.sampler_step` per forward pass onto vLLM's spec-decode accounting
(docs/ARCHITECTURE.md "Integration and vLLM accounting"): prefill rows ``num_sampled = 0``,
``num_rejected = 0``; denoise rows ``num_sampled = 0``, ``num_rejected = query_len`` (the canvas is rejected, the
KV position does not move); commit rows ``num_sampled = canvas_length``, ``num_rejected = 0``. A canvas row that
does not progress (its request FAILED or FINISHED in an earlier step, or, under vLLM, a canvas vLLM truncated)
also reports ``num_sampled = 0``, ``num_rejected = query_len``.

Failed requests under vLLM: a request whose logits have no softmax at some canvas position (a NaN or +inf logit,
or every logit -inf; a -inf logit alone is p = 0, vLLM's token mask) goes to phase FAILED. The vLLM-mode output
reports it in ``SamplerOutput.num_nans`` (vLLM's per-request NaN channel: the runner forwards it as
``ModelRunnerOutput.num_nans_in_logits``), on the failing step and on every later step the request is still
scheduled. vLLM's own scheduler only records that count, so the plugin's scheduler
(:mod:`blockdiff.integration.vllm_scheduler`, ``--scheduler-cls``) finishes such a request with
``FINISHED_ERROR`` (finish reason ``error``); vLLM then calls ``remove_request``, freeing the slot. Without
that scheduler the request would never be finished, so the model state refuses to start under another one.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from blockdiff.sampler import COMMIT, FAILED, FINISHED, PREFILL, sampler_step

from .annotate import annotated
from .vllm_scheduler import FUSE_NEXT_FLAG


@dataclass
class DiffusionSamplerOutput:
    """Field names of vLLM's ``SamplerOutput`` plus the sampler's diagnostics.

    Attributes:
        sampled_token_ids: ``[N, CL]`` int64, tokens emitted this step (commit rows, trimmed after the first
            EOS and at max_tokens), padded with -1.
        num_sampled: ``[N]`` int32 (commit: CL, else 0).
        num_rejected: ``[N]`` int32 (denoise: query_len, else 0).
        num_emitted: ``[N]`` int32, valid entries of ``sampled_token_ids`` per row.
        phase: ``[N]`` int32, each row's phase at entry.
        step: the :class:`blockdiff.sampler.StepOutput` (accepted, entropy, converged, finished, failed, ...).
        num_nans: ``[N]`` int32, see :func:`accounting` (> 0: the request failed: a NaN / +inf logit, or a position
            whose every logit is -inf).
        logprobs_tensors: None (not produced).
        fused: ``[N]`` bool, the fused commit rows (``DiffusionModelState.fuse_commit``), or None when the step
            had none.
        fused_step: the :class:`blockdiff.sampler.StepOutput` of the next canvas's first denoising step on the
            fused rows (other rows: a no-op step), or None; ``step`` holds their commit.
    """

    sampled_token_ids: torch.Tensor
    num_sampled: torch.Tensor
    num_rejected: torch.Tensor
    num_emitted: torch.Tensor
    phase: torch.Tensor
    step: Any
    logprobs_tensors: Any = None
    num_nans: Any = None
    fused: Any = None
    fused_step: Any = None


def accounting(phase: torch.Tensor, q_lens: torch.Tensor, num_sampled: torch.Tensor, failed: torch.Tensor,
               entropy: torch.Tensor, stalled: torch.Tensor | None = None, *, fused: torch.Tensor | None = None,
               canvas_length: int | None = None) -> dict[str, torch.Tensor]:
    """vLLM's per-row accounting of one step (no host sync).

    Args:
        phase: ``[N]`` int32, each row's phase at entry. q_lens: ``[N]`` int32 query tokens (tokens).
        num_sampled: ``[N]`` from the sampler step (commit rows CL, else 0). failed: ``[N]`` bool, rows that
            failed in this step. entropy: ``[N, CL]`` float32 (NaN where the position's softmax is undefined: a NaN
            or +inf logit, or every logit -inf; finite beside -inf logits, which are p = 0).
        stalled: ``[N]`` bool, rows the sampler skipped (a truncated canvas under vLLM), or None.
        fused: ``[N]`` bool, fused commit rows (a commit and the next canvas's first step, ``2 * canvas_length``
            query tokens), or None. canvas_length: CL, required with ``fused``.

    Returns:
        ``num_sampled`` ``[N]`` int32 (0 on stalled rows); ``num_rejected`` ``[N]`` int32: 0 for prefill and
        commit rows, ``q_len - canvas_length`` (CL: the next canvas's drafts) for fused commit rows (which sample
        CL: the committed canvas is accepted, so the KV position moves by CL), ``q_len`` for every other row
        (denoise, FAILED, FINISHED, stalled: the KV position does not move); ``num_nans`` ``[N]`` int32:
        canvas positions without a softmax (NaN entropy; >= 1) on a row that failed now, 1 on a row already FAILED
        at entry, else 0 (-inf-masked logits alone report 0).

    Raises:
        ValueError: ``fused`` given without ``canvas_length``.
    """
    moves = (phase == PREFILL) | (phase == COMMIT)
    if stalled is not None:
        moves = moves & ~stalled
        num_sampled = torch.where(stalled, torch.zeros_like(num_sampled), num_sampled)
    num_rejected = torch.where(moves, torch.zeros_like(q_lens), q_lens).to(torch.int32)
    if fused is not None:
        if canvas_length is None:
            raise ValueError("accounting: canvas_length is required with fused")
        num_rejected = torch.where(fused & moves, (q_lens - canvas_length).to(torch.int32), num_rejected)
    n_bad = torch.isnan(entropy).sum(-1).clamp(min=1).to(torch.int32)
    num_nans = torch.where(failed, n_bad, (phase == FAILED).to(torch.int32)).to(torch.int32)
    return {"num_sampled": num_sampled.to(torch.int32), "num_rejected": num_rejected, "num_nans": num_nans}


def commit_finishes_vec(state, slots: torch.Tensor) -> torch.Tensor:
    """Whether committing each slot's converged canvas (``state.commit_canvas``) ends its request, on the device
    (no host sync): the vectorised ``DiffusionModelState.commit_finishes``, the sampler's commit rule. With ``h``
    the first position of the canvas holding one of the slot's stop ids (CL if none) and ``remaining =
    max_tokens - num_emitted``: True iff ``h < remaining`` (a stop id is emitted) or ``min(h + 1, CL) >=
    remaining`` (``max_tokens`` reached). Meaningful for slots in phase COMMIT only (the phase is not read).

    Args:
        state: a :class:`blockdiff.sampler.SamplerState` (reads ``commit_canvas`` ``[R, CL]`` int64,
            ``eos_token_ids`` ``[R, E]`` int64 padded with -1, ``max_tokens`` / ``num_emitted`` ``[R]`` int64).
        slots: ``[N]`` int64 slot ids on the state's device (values not checked: no host read).

    Returns:
        ``[N]`` bool on the state's device.

    Raises:
        TypeError: ``slots`` is not an int64 tensor. ValueError: ``slots`` is not 1-D or not on the state's device.
    """
    if not torch.is_tensor(slots) or slots.dtype != torch.int64:
        raise TypeError(f"slots must be an int64 tensor, got {getattr(slots, 'dtype', type(slots).__name__)}")
    if slots.dim() != 1 or slots.device != state.commit_canvas.device:
        raise ValueError(f"slots must be 1-D on {state.commit_canvas.device}, got shape {tuple(slots.shape)} on "
                         f"{slots.device}")
    CL = state.canvas_length
    canvas = state.commit_canvas[slots]                                          # [N, CL]
    eos = state.eos_token_ids[slots]                                             # [N, E]
    hit = ((canvas[:, :, None] == eos[:, None, :]) & (eos[:, None, :] >= 0)).any(-1)
    has = hit.any(-1)
    first = torch.where(has, hit.to(torch.int32).argmax(-1).to(torch.int64), torch.full_like(has, CL, dtype=torch.int64))
    remaining = state.max_tokens[slots] - state.num_emitted[slots]
    return (has & (first < remaining)) | ((first + 1).clamp(max=CL) >= remaining)


class _StallRows:
    """Context: the rows ``mask`` of ``slots`` read phase FINISHED while a sampler step runs (a no-op step for them:
    state untouched), then get their phase back. A device mask, no host sync."""

    def __init__(self, state, slots: torch.Tensor, mask: torch.Tensor | None) -> None:
        self.state, self.slots, self.mask = state, slots, mask

    def __enter__(self):
        if self.mask is not None:
            self.saved = self.state.phase[self.slots]
            self.state.phase[self.slots] = torch.where(self.mask, torch.full_like(self.saved, FINISHED), self.saved)
        return self

    def __exit__(self, *exc):
        if self.mask is not None:
            self.state.phase[self.slots] = torch.where(self.mask, self.saved, self.state.phase[self.slots])
        return False


class HostStaging:
    """Per-step host metadata (numpy rows) to the device without a host sync.

    ``torch.as_tensor(numpy_array, device="cuda")`` copies from pageable memory, and CUDA synchronizes the stream
    before such a copy: the host waits for the whole forward pass, then launches the sampler's kernels one wait
    at a time. Here the rows go through page-locked (pinned) host buffers with ``non_blocking`` copies into one
    persistent device buffer, in stream order. Two pinned buffers alternate; a buffer is rewritten only after
    the copy that last read it has run (its CUDA event, two steps old, is normally done already), so the host may
    run one step ahead of the GPU (vLLM's async scheduling). On a CPU device it is a plain copy.

    Args:
        num_fields: rows per call (int64 each). max_len: longest row (``max_num_reqs``).
        device: the device the rows go to.
    """

    def __init__(self, num_fields: int, max_len: int, device: torch.device) -> None:
        self.num_fields, self.max_len, self.device = num_fields, max_len, torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._dev = torch.zeros(num_fields, max_len, dtype=torch.int64, device=self.device)
        self._host = [torch.zeros(num_fields, max_len, dtype=torch.int64, pin_memory=self._cuda)
                      for _ in range(2 if self._cuda else 1)]
        self._events: list = [None] * len(self._host)
        self._next = 0

    def to_device(self, *rows: np.ndarray) -> torch.Tensor:
        """``[num_fields, n]`` int64 device view of ``rows`` (each ``[n]``, n <= max_len), valid in stream order
        until the next call.

        Raises:
            ValueError: a row count other than ``num_fields``, rows of different lengths, or n > max_len.
        """
        n = len(rows[0]) if rows else 0
        if len(rows) != self.num_fields or any(len(r) != n for r in rows) or n > self.max_len:
            raise ValueError(f"to_device needs {self.num_fields} rows of one length <= {self.max_len}, got "
                             f"lengths {[len(r) for r in rows]}")
        i = self._next
        self._next = (i + 1) % len(self._host)
        if self._events[i] is not None:
            self._events[i].synchronize()
        host = self._host[i]
        hn = host.numpy()
        for k, r in enumerate(rows):
            hn[k, :n] = r
        dev = self._dev[:, :n]
        dev.copy_(host[:, :n], non_blocking=self._cuda)
        if self._cuda:
            ev = self._events[i] or torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._events[i] = ev
        return dev


class SamplerMismatch(AssertionError):
    """A sampler backend disagreed with the reference (``--check``)."""


def _state_tensors(state) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(state).items() if torch.is_tensor(v)}


def compare_sampler(state_ref, state_out, out_ref, out_test, *, atol: float = 1e-4,
                    embedding: torch.Tensor | None = None) -> None:
    """Compare two sampler runs from the same state: integer/bool tensors exactly, float tensors within
    ``atol`` (nats / embedding units). Raises :class:`SamplerMismatch` naming the first differing field.

    ``embedding``: E ``[V, hidden]`` of the step. The reference casts p to E's dtype and multiplies in it
    (``sampler.reference.soft_embedding_reference``, as transformers does); a fused backend may keep p and the
    product in float32. The reference's own error in hidden column j is then at most ``eps x sqrt(hidden) x
    max_i |E[i, j]|`` (p's rounding, relative eps / 2 a term, over probabilities that sum to 1, plus the product's
    rounding; eps = ``torch.finfo(E.dtype).eps``, 2**-7 for bf16), so with E below float32 ``state.soft`` is held to
    ``atol`` plus twice that, column by column. Float32 E (or None) keeps ``atol`` alone, as every other field.
    """
    soft_tol = None
    if embedding is not None and embedding.is_floating_point() and \
            torch.finfo(embedding.dtype).eps > torch.finfo(torch.float32).eps:
        eps = torch.finfo(embedding.dtype).eps
        col_max = embedding.detach().abs().amax(dim=0).double()
        soft_tol = atol + 2 * eps * math.sqrt(embedding.shape[-1]) * col_max  # [hidden]
    pairs = [(f"state.{k}", v, getattr(state_out, k)) for k, v in _state_tensors(state_ref).items()]
    for k in ("num_sampled", "num_rejected", "emitted", "num_emitted_now", "finished", "failed", "accepted",
              "entropy", "argmax", "sampled", "converged", "mean_entropy"):
        a, b = getattr(out_ref, k, None), getattr(out_test, k, None)
        if torch.is_tensor(a) and torch.is_tensor(b):
            pairs.append((f"out.{k}", a, b))
    for name, a, b in pairs:
        if a.shape != b.shape:
            raise SamplerMismatch(f"sampler check: {name} shape {tuple(b.shape)} != reference {tuple(a.shape)}")
        if a.is_floating_point():
            fa, fb = torch.isfinite(a), torch.isfinite(b)
            if not torch.equal(fa, fb):
                raise SamplerMismatch(f"sampler check: {name} finiteness differs from the reference")
            if not (a.numel() and fa.any()):
                continue
            if name == "state.soft" and soft_tol is not None and a.shape[-1] == soft_tol.numel():
                diff = torch.where(fa, a.double() - b.double(), 0.0).abs()
                tol = soft_tol.to(diff.device)
                excess = diff - tol
                if excess.max().item() > 0:
                    i = int(excess.argmax())
                    j = i % a.shape[-1]
                    raise SamplerMismatch(
                        f"sampler check: {name} error {diff.flatten()[i].item():.3e} in hidden column {j} > "
                        f"{tol[j].item():.3e} ({atol:.0e} + twice the reference's rounding of p @ E in "
                        f"{str(embedding.dtype).replace('torch.', '')})")
                continue
            err = (a[fa].double() - b[fb].double()).abs().max().item()
            if err > atol:
                raise SamplerMismatch(f"sampler check: {name} max abs error {err:.3e} > {atol:.1e}")
        elif not torch.equal(a, b):
            n = int((a != b).sum())
            raise SamplerMismatch(f"sampler check: {name} differs from the reference in {n} element(s)")


class DiffusionSampler:
    """Callable ``(logits, input_batch) -> DiffusionSamplerOutput``, one diffusion step for every row.

    Args:
        model_state: the :class:`~blockdiff.integration.model_state.DiffusionModelState` whose ``state``
            (a :class:`blockdiff.sampler.SamplerState`) is updated in place.
        embedding: tied embedding E ``[V, hidden]`` (self-conditioning ``softmax(z) @ E * sqrt(hidden)``).
        backend: :func:`blockdiff.sampler.sampler_step` backend (``"reference"``, ``"triton"``).
        base_sampler: vLLM's sampler (kept for reference; unused in the harness).
        check: also run the reference on a copy of the state and raise :class:`SamplerMismatch` on any
            difference (``blockdiff demo --check``).
        on_check: optional callback ``(ok: bool)`` counting checked steps.
    """

    def __init__(self, model_state, *, embedding: torch.Tensor, backend: str = "reference",
                 base_sampler: Any = None, check: bool = False, on_check: Callable | None = None) -> None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        self.model_state = model_state
        self.embedding = embedding
        self.backend = backend
        self.base_sampler = base_sampler
        self.check = check
        self.on_check = on_check
        self.num_checked = 0
        self._staging = None  # HostStaging of (logit starts, prefill_done, q_lens), built on the first step

    @property
    def penalties_state(self):  # vLLM's post_update reads .output_bin_counts; no penalties here
        class _NoPenalties:
            output_bin_counts = None
        return _NoPenalties()

    def add_request(self, req_idx: int, *args: Any) -> None:
        """vLLM calls this after ModelState.add_request, with ``(req_idx, sampling_params)`` (0.33.0) or
        ``(req_idx, prompt_len, sampling_params)`` (0.26.0); the params already live in the SamplerState."""
        return None

    def apply_staged_writes(self) -> None:
        return None

    def _canvas_logits(self, logits: torch.Tensor, N: int, starts: torch.Tensor) -> torch.Tensor:
        """``[N, CL, V]`` gather of each row's canvas logits from the rows' first logit indices ``starts`` (``[N]``
        int64 on the device; rows without logits read row 0: ignored by the sampler, which reads DENOISE rows
        only)."""
        CL = self.model_state.canvas_length
        V = self.model_state.vocab_size
        if logits.shape[0] == 0:
            return logits.new_zeros(1, 1, V).expand(N, CL, V)
        idx = (starts[:, None] + torch.arange(CL, device=logits.device)[None, :]).clamp_(max=logits.shape[0] - 1)
        return logits[idx.reshape(-1)].view(N, CL, V)

    @annotated("blockdiff:sampler")
    def __call__(self, logits: torch.Tensor, input_batch, draft_logits: torch.Tensor | None = None
                 ) -> DiffusionSamplerOutput:
        """One sampler step.

        Args:
            logits: ``[num_logits, V]`` float (the harness: every token, ``cu_num_logits = query_start_loc``).
            input_batch: the step's batch (``num_reqs``, ``idx_mapping``, ``cu_num_logits_np``,
                ``num_scheduled_tokens``, ``prefill_len_np``, ``num_computed_prefill_tokens_np``).
            draft_logits: unused (vLLM's rejection-sampler argument).

        Raises:
            ValueError: logits shape wrong; harness mode: a denoise/commit row without ``canvas_length`` query
                tokens (vLLM mode skips such a row: vLLM truncates canvases near max_model_len), or one of
                ``2 * canvas_length`` (a fused commit, :attr:`DiffusionModelState.fuse_commit`) that is not a commit.
            SamplerMismatch: ``check`` is on and the backend differs from the reference.

        Under vLLM with :attr:`DiffusionModelState.fuse_commit` a canvas row wider than CL is decided on the device
        (no host read of the phases): a COMMIT row commits on its first CL logits rows and reports ``num_rejected =
        q_len - CL``; with exactly ``2 * CL`` tokens it then takes the next canvas's first denoising step on the last
        CL (a fused commit), with fewer (the token budget cut the row) the next canvas starts unstepped, as after a
        plain commit. A wide row that is not a COMMIT (never scheduled so by the plugin's scheduler) is stalled:
        its state untouched, ``num_sampled = 0``, ``num_rejected = q_len``.
        """
        ms = self.model_state
        st = ms.state
        N = input_batch.num_reqs
        CL = ms.canvas_length
        dev = st.phase.device
        slots = input_batch.idx_mapping[:N].to(torch.int64)
        phase = st.phase[slots].clone()
        q_lens_np = np.asarray(input_batch.num_scheduled_tokens[:N], dtype=np.int64)
        done_np = np.asarray(input_batch.num_computed_prefill_tokens_np[:N], dtype=np.int64)
        plen_np = np.asarray(input_batch.prefill_len_np[:N], dtype=np.int64)
        prefill_done_np = done_np + q_lens_np >= plen_np
        canvas_np = done_np >= plen_np  # prompt prefilled before this step: a canvas row (denoise / commit)
        # a canvas row must carry the whole canvas, or _canvas_logits would read the next row's logits for its tail
        # (host data only, no sync)
        fused_np = ms.fused_rows_np(input_batch)  # fused commit rows (2 * CL tokens); all False unless fuse_commit
        vllm_fuse = ms.mode == "vllm" and ms.fuse_commit
        if vllm_fuse:  # wider rows are decided on the device by phase (docstring); narrower ones cannot be denoised
            short = canvas_np & (q_lens_np < CL)
        else:
            short = canvas_np & (q_lens_np != CL) & ~fused_np
        stalled_np = None
        if short.any():
            if ms.mode == "vllm":
                # vLLM truncates a canvas near max_model_len (or under a short token budget): it cannot be denoised
                # as a whole canvas. The row is skipped (state untouched, KV position kept); the plugin's scheduler
                # finishes a request whose next canvas does not fit (length), so it is not scheduled forever.
                stalled_np = short
            else:
                i = int(np.flatnonzero(short)[0])
                rid = getattr(input_batch, "req_ids", None)
                name = f" ({rid[i]!r})" if rid is not None and i < len(rid) else ""
                raise ValueError(f"row {i}{name} is a denoise/commit row (prompt fully prefilled) with "
                                 f"{int(q_lens_np[i])} query tokens; it must schedule canvas_length="
                                 f"{CL} tokens")
        V = ms.vocab_size
        if logits.dim() != 2 or logits.shape[-1] != V:
            raise ValueError(f"logits must be [num_logits, vocab_size={V}], got {tuple(logits.shape)}")
        if self._staging is None or self._staging.max_len < N:
            self._staging = HostStaging(5, max(N, st.max_num_reqs), dev)
        starts_np = np.asarray(input_batch.cu_num_logits_np[:N], dtype=np.int64)
        fused_idx = np.flatnonzero(fused_np)
        fused_rows_np = np.zeros(N, dtype=np.int64)
        fused_rows_np[: fused_idx.size] = fused_idx
        # no host sync (pinned, in stream order): logit starts, prefill done after the step, query lengths, canvas
        # rows, the fused rows' indices (first fused_idx.size entries)
        rows = self._staging.to_device(starts_np, prefill_done_np, q_lens_np, canvas_np, fused_rows_np)
        starts, prefill_done, q_lens = rows[0], rows[1].bool(), rows[2].to(torch.int32)
        logits3 = self._canvas_logits(logits, N, starts)
        if fused_idx.size and ms.mode != "vllm":
            # harness: a 2 * CL canvas row must be a commit (one host read of the phases; under vLLM a device mask
            # stalls such a row instead, below)
            ph = phase.tolist()
            bad = [int(i) for i in fused_idx if ph[i] != COMMIT]
            if bad:
                raise ValueError(f"row {bad[0]} has 2 * canvas_length = {2 * CL} query tokens but is "
                                 f"not a commit row: only a fused commit (fuse_commit) schedules 2 * canvas_length")
        wide = wrong = None
        if vllm_fuse:
            wide = rows[3].bool() & (q_lens > CL)  # [N] canvas rows wider than a canvas
            wrong = wide & (phase != COMMIT)       # never scheduled so by the plugin's scheduler: stalled
        elif fused_idx.size:  # harness: the wide rows are the fused rows, all commits (checked above)
            wide = rows[3].bool() & (q_lens == 2 * CL)

        commit_in = st.commit_canvas[slots].clone() if ms.mode == "vllm" else None
        stalled = None
        if stalled_np is not None:
            keep = torch.as_tensor(np.flatnonzero(~stalled_np), dtype=torch.int64, device=dev)
            with _StallRows(st, slots[keep], None if wrong is None else wrong[keep]):
                out = self._step(st, slots[keep], logits3[keep], prefill_done[keep])
            out = _expand_step_output(out, keep, N)
            stalled = torch.as_tensor(stalled_np, dtype=torch.bool, device=dev)
        else:
            with _StallRows(st, slots, wrong):
                out = self._step(st, slots, logits3, prefill_done)
        if wrong is not None:
            stalled = wrong if stalled is None else stalled | wrong

        fused = fused_step = None
        failed, entropy = out.failed, out.entropy
        if fused_idx.size:
            # fused commit rows: the step above committed them and started their next canvas (phase DENOISE, step
            # 0, the fresh canvas prepare_inputs fed to the last CL rows); now that canvas's first denoising step
            # on the last CL logits rows of each such row (a row whose commit ended its request is FINISHED: no-op)
            keep = rows[4, : fused_idx.size]
            tail = self._canvas_logits(logits, len(fused_idx), starts[keep] + CL)  # fused rows only
            with _StallRows(st, slots[keep], None if wrong is None else wrong[keep]):
                fused_step = _expand_step_output(
                    self._step(st, slots[keep], tail, torch.zeros_like(prefill_done[keep])), keep, N)
            fused = rows[3].bool() & (q_lens == 2 * CL)  # [N] the fused rows (= fused_np), on the device
            failed = failed | fused_step.failed
            entropy = torch.where(fused[:, None], fused_step.entropy, entropy)
        acc = accounting(phase, q_lens, out.num_sampled, failed, entropy, stalled, fused=wide, canvas_length=CL)
        if ms.mode == "vllm":
            return self._vllm_output(slots, phase, commit_in, acc, stalled)
        return DiffusionSamplerOutput(
            sampled_token_ids=out.emitted, num_sampled=acc["num_sampled"], num_rejected=acc["num_rejected"],
            num_emitted=out.num_emitted_now.to(torch.int32), phase=phase, step=out, num_nans=acc["num_nans"],
            fused=fused, fused_step=fused_step)

    def _step(self, st, slots, logits3, prefill_done):
        snapshot = copy.deepcopy(st) if self.check else None
        # vLLM pads the embedding table's rows to a multiple of 64 (its vocab padding); the logits carry the real
        # vocabulary, and the soft embedding takes exactly those rows
        embedding = self.embedding[: logits3.shape[-1]] if self.embedding.shape[0] > logits3.shape[-1] else \
            self.embedding
        # On a GPU the slots (DiffusionModelState's own slot table: distinct, in range) are not read back every step
        # (a host sync); the triton kernels still mask an out-of-range id. On the CPU and under --check they are.
        trusted = slots.device.type == "cuda" and not self.check
        out = sampler_step(st, slots, logits3, prefill_done, embedding, backend=self.backend,
                           check_values=False if trusted else None)
        if self.check:
            ref_out = sampler_step(snapshot, slots, logits3, prefill_done, embedding, backend="reference")
            compare_sampler(snapshot, st, ref_out, out, embedding=embedding)
            self.num_checked += 1
            if self.on_check is not None:
                self.on_check(True)
        return out

    def _vllm_output(self, slots, phase, commit_in, acc, stalled):
        """vLLM: the runner appends ``num_sampled`` tokens per row and its scheduler applies EOS / max_tokens,
        so a commit row returns the whole committed canvas; the next step's draft tokens (the canvas vLLM
        schedules) are the renoised / fresh canvas, or the argmax canvas of a row about to commit.
        ``num_nans`` > 0 marks a failed request (see the module docstring). With
        :attr:`DiffusionModelState.fuse_commit`, ``num_nans`` = -1 (:data:`~blockdiff.integration.vllm_scheduler.FUSE_NEXT_FLAG`) marks a
        request whose next row may be a fused commit: phase COMMIT after this step and a commit that does not end
        it (:func:`commit_finishes_vec`), computed on the device (the runner copies ``num_nans`` to the host
        asynchronously, as it does anyway)."""
        # vLLM is optional: imported only in vLLM mode
        from vllm.v1.worker.gpu.sample.output import SamplerOutput  # type: ignore

        st = self.model_state.state
        CL = self.model_state.canvas_length
        is_com = (phase == COMMIT)
        if stalled is not None:
            is_com = is_com & ~stalled
        sampled = torch.where(is_com[:, None], commit_in, torch.full_like(commit_in, -1))
        req_states = getattr(self.base_sampler, "req_states", None)
        if req_states is not None and getattr(req_states, "draft_tokens", None) is not None:
            now = st.phase[slots]
            nxt = torch.where((now == COMMIT)[:, None], st.commit_canvas[slots], st.canvas[slots])
            req_states.draft_tokens[slots, :CL] = nxt.to(req_states.draft_tokens.dtype)
        num_nans = acc["num_nans"]
        if self.model_state.fuse_commit:
            fuse_next = (st.phase[slots] == COMMIT) & ~commit_finishes_vec(st, slots)
            num_nans = torch.where(fuse_next & (num_nans == 0), torch.full_like(num_nans, FUSE_NEXT_FLAG), num_nans)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None, num_nans=num_nans,
                             num_sampled=acc["num_sampled"], num_rejected=acc["num_rejected"])


def _expand_step_output(out, keep: torch.Tensor, n: int):
    """Scatter a StepOutput over the kept rows back to ``n`` rows; skipped rows read as a no-op step (nothing
    sampled, emitted, finished or failed; tokens -1, entropies 0)."""
    fields = {}
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        if not torch.is_tensor(v):
            fields[f.name] = v
            continue
        fill = -1 if (v.dtype == torch.int64 and v.dim() == 2) else 0
        full = torch.full((n,) + tuple(v.shape[1:]), fill, dtype=v.dtype, device=v.device)
        full[keep] = v
        fields[f.name] = full
    return type(out)(**fields)
