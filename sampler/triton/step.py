"""Stage (b) of the Triton sampler step and the step itself: :func:`sampler_step` runs the three stages,
(a) the streaming statistics (:mod:`blockdiff.sampler.triton.stats`), (b) the decisions and bookkeeping here, (c)
the self-conditioning soft embedding (:mod:`blockdiff.sampler.triton.soft_embedding`). None of them syncs with the
host, and every grid is sized from shapes only, so a whole step is capturable in a CUDA graph.

Stage (b): the stable sort by entropy and its float32 cumsum run in torch
(:func:`blockdiff.sampler.common.entropy_order`, shared with the reference: its summation order defines the
decisions), then ONE :func:`_step_kernel` launch, grid (N,): the inclusive entropy bound, renoise / fresh-canvas
ids (Philox, bit for bit :mod:`blockdiff.sampler.rng`), argmax stability, convergence and every transition of
:func:`blockdiff.sampler.common.apply_step` (EOS trimming, max_tokens, counters, phases), written in place into
the state rows and into preallocated StepOutput buffers. The row coordinates of the stats pass come from one
:func:`_gather_rows_kernel` launch. Torch ops left on the step path: :func:`~blockdiff.sampler.common.temperature`
(kept in torch: bit-identical across backends), the sort, the cumsum and the soft embedding's int32 cast of the
argmax. The reference runs the torch code, and the tests compare every decision and state field with it, so
given equal entropies the decisions are identical. Semantics: docs/ARCHITECTURE.md "Sampler semantics".

Extra memory of a step (N rows): the stats pass's split statistics, the soft embedding's workspace and [N, CL]
decision tensors.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ..common import check_step_args, entropy_order, saturate_logits, temperature
from ..state import COMMIT, DENOISE, FAILED, FINISHED, PREFILL, SamplerState, StepOutput
from .common import position_ids, side_stream
from .config import SamplerConfig, check_config
from .soft_embedding import check_soft_indices, soft_embedding, soft_embedding_chunked, write_soft
from .stats import check_moments_indices, row_moments, row_stats, stats_plan

__all__ = ["sampler_step"]

# phase codes of blockdiff.sampler.state, as compile-time constants of the step kernel
_PREFILL = tl.constexpr(PREFILL)
_DENOISE = tl.constexpr(DENOISE)
_COMMIT = tl.constexpr(COMMIT)
_FINISHED = tl.constexpr(FINISHED)
_FAILED = tl.constexpr(FAILED)


@triton.jit(do_not_specialize=["N"])
def _gather_rows_kernel(slots_ptr, phase_ptr, seed_ptr, rid_ptr, cidx_ptr, step_ptr,
                        o_active, o_seed, o_rid, o_cidx, o_step, N, NUM_SLOTS, BLOCK: tl.constexpr):
    """Grid (cdiv(N, BLOCK),): the per-row inputs of the stats pass from the state rows ``slots`` in one launch:
    active = (phase == DENOISE) int32, seed / request_id int64,
    canvas_index / step int32. A slot id outside [0, NUM_SLOTS) is never read (an inactive row of zeros)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + i, mask=i < N, other=0)
    msk = (i < N) & (slot >= 0) & (slot < NUM_SLOTS)
    row = i < N
    tl.store(o_active + i, (tl.load(phase_ptr + slot, mask=msk, other=0) == _DENOISE).to(tl.int32), mask=row)
    tl.store(o_seed + i, tl.load(seed_ptr + slot, mask=msk, other=0), mask=row)
    tl.store(o_rid + i, tl.load(rid_ptr + slot, mask=msk, other=0), mask=row)
    tl.store(o_cidx + i, tl.load(cidx_ptr + slot, mask=msk, other=0), mask=row)
    tl.store(o_step + i, tl.load(step_ptr + slot, mask=msk, other=0), mask=row)


@triton.jit
def _step_kernel(
    slots_ptr, pd_ptr, t_ptr,
    h_ptr, amax_ptr, sampled_ptr, sorted_h_ptr, order_ptr, cum_ptr,
    phase_ptr, canvas_ptr, commit_ptr, prev_ptr, stable_ptr, step_ptr, cidx_ptr, nemit_ptr,
    seed_ptr, rid_ptr, bound_ptr, conf_ptr, max_steps_ptr, k_ptr, eos_ptr, stride_eos, max_tok_ptr,
    o_emitted, o_argmax, o_sampled, o_next, o_accepted, o_entropy,
    o_num_sampled, o_num_rejected, o_num_now, o_finished, o_failed, o_converged, o_mean, o_temp,
    o_cont, o_mode,
    CL, CLF, V, E, NUM_SLOTS,
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, EOS_TILES: tl.constexpr,
):
    """Grid (N,): the bookkeeping of one request per program after the stats pass and the entropy sort (stage b).

    Exactly :func:`blockdiff.sampler.common.apply_step` with :func:`~blockdiff.sampler.common.convergence` and the
    decisions of the torch path (``accept_by_entropy``'s comparison, renoise ids, next canvas): reads the
    state row ``slots[n]`` at entry, writes its new canvas / commit canvas / prev_argmax / counters / phase in
    place and the StepOutput row n; ``cont`` (int32: the row continues denoising, the soft embedding's rows) and
    ``mode`` (int32: the write mode of :func:`blockdiff.sampler.triton.soft_embedding.write_soft`). No host sync,
    shapes from N and CL only.

    Inputs [N, CL]: ``h`` the step entropies (greedy rows: 0 / NaN), ``amax`` / ``sampled`` int64, and
    ``sorted_h`` / ``order`` / ``cum`` of :func:`~blockdiff.sampler.common.entropy_order` (torch: its float32 cumsum
    defines the decisions). Lane j of the BLOCK >= CL lanes works on position ``q = order[n, j]`` (the j-th lowest
    entropy): it owns that position's acceptance ``cum_j - H_j <= bound`` and every load / store of position q, so
    the sorted decision needs no cross-lane scatter (no barrier, no shared memory); row reductions (failure,
    argmax stability, first EOS as the minimum EOS position) do not depend on the lane order.
    Random ids: RENOISE stream with the row's step, INITIAL with step 0 and the new canvas index (fresh canvases),
    bit for bit :mod:`blockdiff.sampler.rng` (:func:`position_ids`). ``mean_entropy`` is ``cum[n, CL - 1] / CL``
    (:func:`~blockdiff.sampler.common.entropy_mean`).

    A slot id outside [0, NUM_SLOTS) (one the host did not check: CUDA-graph capture, ``check_values=False``)
    makes the row inert: no state is read or written there (the loads go to slot 0, the stores are masked), and
    its StepOutput row is that of a FINISHED slot.
    """
    n = tl.program_id(0)
    slot_id = tl.load(slots_ptr + n).to(tl.int64)
    in_range = (slot_id >= 0) & (slot_id < NUM_SLOTS)
    slot = tl.where(in_range, slot_id, 0)
    j = tl.arange(0, BLOCK)
    jm = j < CL
    row = n.to(tl.int64) * CL
    srow = slot * CL
    q = tl.load(order_ptr + row + j, mask=jm, other=0).to(tl.int64)     # position of the j-th lowest entropy

    # ---- the row at entry
    phase = tl.where(in_range, tl.load(phase_ptr + slot), _FINISHED)
    pd = tl.load(pd_ptr + n) != 0
    T = tl.load(t_ptr + n)
    step = tl.load(step_ptr + slot)
    cidx = tl.load(cidx_ptr + slot)
    sc = tl.load(stable_ptr + slot)
    nem = tl.load(nemit_ptr + slot)
    max_tok = tl.load(max_tok_ptr + slot)
    seed = tl.load(seed_ptr + slot)
    rid = tl.load(rid_ptr + slot)
    bound = tl.load(bound_ptr + slot)
    conf = tl.load(conf_ptr + slot)
    S = tl.load(max_steps_ptr + slot)
    k = tl.load(k_ptr + slot)
    is_prefill = phase == _PREFILL
    is_den = phase == _DENOISE
    is_commit = phase == _COMMIT
    h = tl.load(h_ptr + row + q, mask=jm, other=0.0)
    amax = tl.load(amax_ptr + row + q, mask=jm, other=0)
    smp = tl.load(sampled_ptr + row + q, mask=jm, other=0)
    sh = tl.load(sorted_h_ptr + row + j, mask=jm, other=0.0)
    cum = tl.load(cum_ptr + row + j, mask=jm, other=0.0)
    canvas_old = tl.load(canvas_ptr + srow + q, mask=jm, other=0)
    cc_old = tl.load(commit_ptr + srow + q, mask=jm, other=0)
    prev_old = tl.load(prev_ptr + srow + q, mask=jm, other=0)

    # ---- decisions of a DENOISE row (entropy bound, renoise, convergence)
    row_failed = tl.max((jm & (h != h)).to(tl.int32), 0) != 0     # a NaN entropy: an undefined softmax
    sel = ((cum - sh) <= bound) & (sh == sh)                         # accept_by_entropy, inclusive, NaN never
    accepted = sel & ~row_failed
    renoise = position_ids(seed, rid, cidx.to(tl.int64), step.to(tl.int64), q, V, 1)     # rng.RENOISE
    nc = tl.where(accepted, smp, renoise)
    # common.entropy_mean: the sorted cumsum's last entry over CL (IEEE division; CLF = float(CL): CL = 1 is a
    # constexpr), the reference's bits for equal entropies (a tl.sum of h was a tree sum, an ulp from its mean)
    mean = tl.math.div_rn(tl.load(cum_ptr + row + CL - 1), CLF)
    same = tl.max((jm & (amax != prev_old)).to(tl.int32), 0) == 0
    sc_res = tl.where(same, sc + 1, 0)
    converged = ((sc_res >= k) & (mean < conf)) | ((step + 1) >= S)

    # ---- apply_step: DENOISE rows
    failed = is_den & row_failed
    ok = is_den & ~row_failed
    conv = ok & converged
    cont = ok & ~converged
    new_canvas = tl.where(cont, nc, canvas_old)
    prev_new = tl.where(ok, amax, prev_old)
    sc_new = tl.where(ok, sc_res, sc)
    step_new = tl.where(ok, step + 1, step)
    cc_new = tl.where(conv, amax, cc_old)
    new_phase = tl.where(failed, _FAILED, tl.where(conv, _COMMIT, phase))

    # ---- COMMIT rows: emit the commit canvas trimmed after the first EOS (kept) and at max_tokens
    # the E eos ids in tiles of BLOCK_E (the [BLOCK, BLOCK_E] compare stays <= EOS_TILE elements whatever E is)
    hit = tl.zeros((BLOCK,), tl.int32)
    for t in range(0, EOS_TILES):                 # EOS_TILES = cdiv(E, BLOCK_E) (a runtime bound fails the interpreter)
        e = t * BLOCK_E + tl.arange(0, BLOCK_E)
        eos = tl.load(eos_ptr + slot * stride_eos + e, mask=e < E, other=-1)
        hit = tl.maximum(hit, tl.max(((cc_new[:, None] == eos[None, :]) & (eos[None, :] >= 0)).to(tl.int32), 1))
    is_eos = hit != 0
    first_eos = tl.min(tl.where(jm & is_eos, q, CL), 0).to(tl.int64)     # CL: none
    has_eos = first_eos < CL
    remaining = max_tok - nem
    n_now = tl.minimum(tl.minimum(first_eos + 1, CL), remaining)
    n_now = tl.where(is_commit, tl.maximum(n_now, 0), 0)
    emitted = tl.where(q < n_now, cc_new, -1)
    eos_emitted = has_eos & (first_eos < remaining)
    nem_new = nem + n_now
    finished = is_commit & (eos_emitted | (nem_new >= max_tok))
    new_phase = tl.where(is_commit, tl.where(finished, _FINISHED, _DENOISE), new_phase)

    # ---- fresh canvases: PREFILL -> DENOISE (the index add_request set), COMMIT -> DENOISE (index + 1)
    start0 = is_prefill & pd
    nextc = is_commit & ~finished
    fresh = start0 | nextc
    cidx_new = tl.where(nextc, cidx + 1, cidx)
    new_phase = tl.where(start0, _DENOISE, new_phase)
    init = position_ids(seed, rid, cidx_new.to(tl.int64), 0, q, V, 2)          # rng.INITIAL, step 0
    new_canvas = tl.where(fresh, init, new_canvas)
    prev_new = tl.where(fresh, -1, prev_new)
    sc_new = tl.where(fresh, 0, sc_new)
    step_new = tl.where(fresh, 0, step_new)

    # every load of the state row precedes its writes (a lane's loads and stores share addresses; the barrier
    # keeps that true whatever thread a layout gives an element)
    tl.debug_barrier()
    jw = jm & in_range
    tl.store(canvas_ptr + srow + q, new_canvas, mask=jw)
    tl.store(prev_ptr + srow + q, prev_new, mask=jw)
    tl.store(commit_ptr + srow + q, cc_new, mask=jw)
    tl.store(stable_ptr + slot, sc_new.to(tl.int32), mask=in_range)
    tl.store(step_ptr + slot, step_new.to(tl.int32), mask=in_range)
    tl.store(cidx_ptr + slot, cidx_new.to(tl.int32), mask=in_range)
    tl.store(nemit_ptr + slot, nem_new.to(tl.int64), mask=in_range)
    tl.store(phase_ptr + slot, new_phase.to(tl.int32), mask=in_range)

    # ---- StepOutput row n (apply_step's masks: diagnostics only on DENOISE rows, -1 / 0 / False elsewhere)
    tl.store(o_emitted + row + q, emitted, mask=jm)
    tl.store(o_argmax + row + q, tl.where(ok, amax, -1), mask=jm)
    tl.store(o_sampled + row + q, tl.where(ok, smp, -1), mask=jm)
    tl.store(o_next + row + q, tl.where(ok, nc, -1), mask=jm)
    tl.store(o_accepted + row + q, (accepted & ok).to(tl.uint8), mask=jm)
    tl.store(o_entropy + row + q, tl.where(is_den, h, 0.0), mask=jm)
    tl.store(o_num_sampled + n, tl.where(is_commit, CL, 0).to(tl.int32))
    tl.store(o_num_rejected + n, tl.where(is_den, CL, 0).to(tl.int32))
    tl.store(o_num_now + n, n_now.to(tl.int32))
    tl.store(o_finished + n, finished.to(tl.uint8))
    tl.store(o_failed + n, failed.to(tl.uint8))
    tl.store(o_converged + n, conv.to(tl.uint8))
    tl.store(o_mean + n, tl.where(is_den, mean, 0.0))
    tl.store(o_temp + n, tl.where(is_den, T, 0.0))
    tl.store(o_cont + n, cont.to(tl.int32))
    # write_soft's reduce kernel: 1 = the GEMM sum, 3 = E[argmax] (T = 0), 2 = zeros (fresh canvas), 0 = untouched
    tl.store(o_mode + n, tl.where(cont, tl.where(T == 0.0, 3, 1), tl.where(fresh, 2, 0)).to(tl.int32))


#: Largest [BLOCK, BLOCK_E] tile of the step kernel's EOS compare (elements): the eos ids are read in tiles of
#: BLOCK_E <= EOS_TILE / BLOCK. One tile of all E ids (BLOCK_E = next_power_of_2(E)) passed Triton's 2**20-element
#: limit at valid shapes (canvas 256 with 8,192 stop-id columns, canvas 2,048 with 1,024: the step failed to
#: compile) and held up to 2**20 compares in registers below it.
EOS_TILE = 2**14


def _eos_block(CL: int, E: int) -> int:
    """BLOCK_E of :func:`_step_kernel`: the eos ids per tile, a power of two, all E of them (E <= 8 at canvas 256)
    while the [next_power_of_2(CL), BLOCK_E] compare fits :data:`EOS_TILE` elements, at least 1."""
    return max(1, min(triton.next_power_of_2(E), EOS_TILE // triton.next_power_of_2(CL)))


@functools.lru_cache(maxsize=4096)  # (a key per batch size N: vLLM's N runs over 1..max_num_seqs)
def _check_int32_indices(N: int, CL: int, V: int, hidden: int, device: torch.device, embedding_dtype: torch.dtype,
                         cfg: SamplerConfig, overlap: bool) -> None:
    """:func:`sampler_step`'s entry checks of every launch's int32 indices (:func:`~.stats.stats_plan`,
    :func:`~.stats.check_moments_indices` with ``overlap``, :func:`~.soft_embedding.check_soft_indices`), cached per
    shapes, device, dtype and (frozen, hashable) config: they are pure functions of them, and uncached they cost
    ~70-110 us of host time a step (two ``resolve`` calls and ~26 of ``triton.cdiv``, a constexpr function with
    argument unwrapping) on a path vLLM runs outside its CUDA graphs. A refusal (ValueError) is not cached: it is
    raised again on every call.

    Raises:
        ValueError: an index would pass 2**31 - 1.
    """
    stats_plan(N, CL, V, cfg, device)
    if overlap:
        check_moments_indices(N, CL, V, device)
    check_soft_indices(N, CL, V, hidden, device, embedding_dtype, cfg, chunked=overlap or None)


#: Rows per program of :func:`_gather_rows_kernel`: fixed, so one compiled variant serves every batch size.
GATHER_BLOCK = 128


def _pad16(n: int) -> int:
    """``n`` rounded up to a multiple of 16 elements. The step's output buffers place each segment at such an
    offset, so every pointer argument is 16-byte aligned for any row count: Triton specializes a kernel on each
    pointer's 16-byte alignment (and an int argument on == 1 / % 16), and offsets of ``k * N`` elements made every
    residue class of N a new compile mid-serving (docs/tuning.md 7.11)."""
    return (n + 15) // 16 * 16


def _gather_rows(state: SamplerState, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(active, seed, request_id, canvas_index, step)`` of the rows ``slots`` ([N]; active = phase is DENOISE,
    int32; seed / request_id int64; canvas_index / step int32) in one launch of :func:`_gather_rows_kernel`."""
    N = slots.shape[0]
    Np = _pad16(N)  # every output row starts 16-byte aligned whatever N is (one compiled variant, see _pad16)
    i64 = torch.empty(2, Np, dtype=torch.int64, device=state.device)
    i32 = torch.empty(3, Np, dtype=torch.int32, device=state.device)
    if N > 0:
        _gather_rows_kernel[(triton.cdiv(N, GATHER_BLOCK),)](
            slots.contiguous(), state.phase, state.seed, state.request_id, state.canvas_index, state.step,
            i32[0], i64[0], i64[1], i32[1], i32[2], N, state.max_num_reqs, BLOCK=GATHER_BLOCK, num_warps=1)
    return i32[0, :N], i64[0, :N], i64[1, :N], i32[1, :N], i32[2, :N]


def _apply_step(state: SamplerState, slots: torch.Tensor, prefill_done: torch.Tensor, T: torch.Tensor,
                st: dict) -> tuple[StepOutput, torch.Tensor, torch.Tensor]:
    """Stage (b): the entropy sort (torch) and :func:`_step_kernel` (one launch, grid (N,)).

    Writes the state rows of ``slots`` in place (not ``soft``) and returns ``(StepOutput, cont, mode)``: cont int32
    [N] (rows that continue denoising: the soft embedding's rows), mode int32 [N] (:func:`write_soft`).
    StepOutput tensors are views of four buffers (one allocation per dtype), dtypes / shapes as
    :func:`blockdiff.sampler.common.apply_step` returns them.
    """
    N, CL = slots.shape[0], state.canvas_length
    dev = state.device
    sorted_h, order, cum = entropy_order(st["step_entropy"])   # torch: the float32 cumsum defines the decisions
    # segments at multiples of 16 elements (_pad16): the kernel's pointers are aligned for every N
    R0, Rp, Np = N * CL, _pad16(N * CL), _pad16(N)
    i64 = torch.empty(4, Rp, dtype=torch.int64, device=dev)         # emitted, argmax, sampled, next_canvas
    f32 = torch.empty(Rp + 2 * Np, dtype=torch.float32, device=dev)  # entropy, mean_entropy, temperature
    i32 = torch.empty(5, Np, dtype=torch.int32, device=dev)         # num_sampled, num_rejected, num_now, cont, mode
    b = torch.empty(Rp + 3 * Np, dtype=torch.bool, device=dev)      # accepted, finished, failed, converged
    entropy, mean_entropy, temp = f32[:R0].view(N, CL), f32[Rp:Rp + N], f32[Rp + Np:Rp + Np + N]
    accepted, finished, failed, converged = (b[:R0].view(N, CL), b[Rp:Rp + N], b[Rp + Np:Rp + Np + N],
                                             b[Rp + 2 * Np:Rp + 2 * Np + N])
    i64 = i64[:, :R0].view(4, N, CL)
    i32 = i32[:, :N]
    if N > 0:
        u8 = b.view(torch.uint8)
        eos = state.eos_token_ids
        _step_kernel[(N,)](
            slots.contiguous(), prefill_done.contiguous().view(torch.uint8), T.contiguous(),   # read at stride 1
            st["step_entropy"], st["argmax"], st["sampled"], sorted_h, order, cum,
            state.phase, state.canvas, state.commit_canvas, state.prev_argmax, state.stable_count, state.step,
            state.canvas_index, state.num_emitted, state.seed, state.request_id, state.entropy_bound,
            state.confidence_threshold, state.max_denoising_steps, state.stability_threshold, eos, eos.stride(0),
            state.max_tokens,
            i64[0], i64[1], i64[2], i64[3], u8[:R0], entropy,
            i32[0], i32[1], i32[2], u8[Rp:Rp + N], u8[Rp + Np:Rp + Np + N], u8[Rp + 2 * Np:Rp + 2 * Np + N],
            mean_entropy, temp, i32[3], i32[4],
            CL, float(CL), state.vocab_size, eos.shape[1], state.max_num_reqs,
            BLOCK=triton.next_power_of_2(CL), BLOCK_E=_eos_block(CL, eos.shape[1]),
            EOS_TILES=triton.cdiv(eos.shape[1], _eos_block(CL, eos.shape[1])),
            num_warps=4 if CL >= 128 else 1,
        )
    out = StepOutput(num_sampled=i32[0], num_rejected=i32[1], emitted=i64[0], num_emitted_now=i32[2],
                     finished=finished, failed=failed, accepted=accepted, entropy=entropy, argmax=i64[1],
                     sampled=i64[2], next_canvas=i64[3], converged=converged, mean_entropy=mean_entropy,
                     temperature=temp)
    return out, i32[3], i32[4]


def sampler_step(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor, prefill_done: torch.Tensor,
                 embedding: torch.Tensor, config: SamplerConfig | None = None, *,
                 check_values: bool | None = None) -> StepOutput:
    """One sampler step with the fused Triton kernels (same contract as ``reference.sampler_step``).

    Args:
        state, slots, logits, prefill_done, embedding: see :func:`blockdiff.sampler.sampler_step`. logits may be
            fp32/bf16/fp16 with a contiguous last dim; E bf16/fp16 (tensor cores) or fp32 (exact products).
        config: optional :class:`SamplerConfig` (tile shapes, splits).
        check_values: check the slot ids (one host read; None: unless a CUDA graph is being captured). Unchecked
            ids never index the state out of bounds: the kernels make a row whose id is outside
            [0, max_num_reqs) inert (its StepOutput row is that of a FINISHED slot, no state touched; the torch
            gathers read slot ids clamped into range). Duplicated unchecked ids leave that slot's state unspecified.

    Returns:
        :class:`blockdiff.sampler.StepOutput`. ``state.soft`` is written in place by the reduce kernel.

    Raises:
        TypeError / ValueError: bad arguments (as the reference); ``config`` neither a :class:`SamplerConfig`
            nor None (TypeError, :func:`~blockdiff.sampler.triton.config.check_config`).
        ValueError: ``config.stats_overlap`` where the soft embedding resolves to the Triton GEMM path; shapes and a
            config whose launches would form an int32 index past 2**31 - 1 (a vocab_size within the vocabulary
            splits' padding of 2**31, N * canvas_length positions as many: the kernels' token ids and positions are
            int32; :func:`~blockdiff.sampler.triton.stats.stats_plan`,
            :func:`~blockdiff.sampler.triton.soft_embedding.check_soft_indices`), before any state is written.
    """
    checked = check_step_args(state, slots, logits, prefill_done, embedding, check_values=check_values)
    cfg = check_config(config)                                      # before anything runs (TypeError)
    logits = saturate_logits(logits)                                # float64 only: finite stays finite in float32
    is_den, seed, rid, cidx, step = _gather_rows(state, slots)      # is_den: int32 (1 = DENOISE)
    # torch indexing (the shared temperature) needs ids in range: unchecked ones are clamped for it, the kernels
    # mask them
    T = temperature(state, slots if checked else slots.clamp(0, state.max_num_reqs - 1))

    cfg.check_stats_overlap(logits.device, embedding.dtype)        # no silent no-op on the Triton GEMM path
    overlap = bool(cfg.stats_overlap)
    # every launch's int32 indices (token ids, positions, split ends) in range, before anything is written: a refusal
    # in stage (c) would leave the state rows of stage (b) written
    N, CL, V = logits.shape
    _check_int32_indices(N, CL, V, embedding.shape[1], logits.device, embedding.dtype, cfg, overlap)
    if overlap:
        # (c) beside (a): normalisers from a memory-bound pre-pass, then the GEMMs over every denoising row on a
        # high-priority side stream (rows that turn out converged / failed are computed and never written: the
        # reduce kernel's mode skips them; NaN logits stay in their own rows) while the stats pass runs on this
        # stream and fills the SMs the GEMMs leave free. Every tensor used on both streams (the workspace, the
        # normalisers, T) is allocated on this stream; the side stream's own buffers (the P chunks) are used and
        # freed there only.
        m2, inv_s2, shift2 = row_moments(logits, T, is_den)
        amax0 = torch.zeros_like(m2, dtype=torch.int32)
        ws = torch.empty(1, m2.numel(), embedding.shape[1], dtype=torch.float32, device=logits.device)
        cuda = logits.is_cuda
        if cuda:
            main = torch.cuda.current_stream(logits.device)
            side = side_stream(logits.device, priority=-1)   # GEMMs first on freed SMs
            side.wait_stream(main)
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            soft_embedding_chunked(logits, embedding, T, m2, inv_s2, amax0, is_den, chunk=cfg.soft_chunk,
                                   greedy_onehot=False, overlap=bool(cfg.soft_overlap), out=ws, shift=shift2)  # (c)
        st = row_stats(logits, T, seed, rid, cidx, step, is_den, config)                      # (a)
        if cuda:
            main.wait_stream(side)
    else:
        st = row_stats(logits, T, seed, rid, cidx, step, is_den, config)                  # (a)
    # (b) decisions and phase bookkeeping: the state rows (not soft) are written here; the soft embedding reads
    # only logits and the stats, so it may run after
    out, cont, mode = _apply_step(state, slots, prefill_done, T, st)
    argmax = st["argmax"]
    if not overlap:
        ws = soft_embedding(logits, embedding, T, st["m"], st["inv_s"], argmax, cont, config,
                            greedy_onehot=False, shift=st["shift"])                             # (c)
    write_soft(state, slots, ws, mode, argmax, embedding)
    return out
