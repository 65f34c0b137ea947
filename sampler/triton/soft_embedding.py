"""Stage (c) of the Triton sampler step: the self-conditioning soft embedding ``soft = softmax(z) @ E * sqrt(hidden)``
for the M = N * CL canvas positions of a step, from the logits and the row statistics of stage (a)
(:func:`blockdiff.sampler.triton.stats.row_stats`: ``m`` = max z, ``inv_s`` = 1 / sum exp(z - m)). Two paths
(``SamplerConfig.soft_impl``; :func:`blockdiff.sampler.triton.config.default_soft_impl` picks one), both writing an
fp32 workspace that :func:`write_soft` reduces into ``state.soft`` in place:

``"triton_gemm"`` (:func:`soft_embedding`, :func:`_soft_embedding_kernel`): a split-K GEMM over the vocabulary,
M = N * CL, N = hidden. Its A operand ``exp2(((x - c) / T - m) * log2e) * inv_s`` is computed on the fly from the
fp32 logits (a subtraction, an IEEE division, a subtraction, ex2 and a mul per element, recomputed once per column
tile; z = (x - c) / T as in stage (a), c the stats' shift of docs/ARCHITECTURE.md "Sampler semantics" rule 1, 0
unless the position's max z overflows, so z - m does not cancel at small T) and rounded to E's dtype (bf16 wgmma,
fp32 accumulation).
Logits ([N * CL, V] view) and E are read through TMA tensor descriptors when their rows are 16-byte aligned
(pointer loads otherwise). No [CL, V] probability buffer: partial sums go to a ``[SPLIT_K, N * CL, hidden]`` fp32
workspace, and :func:`_soft_reduce_kernel` adds them in a fixed order (deterministic, batch invariant) and writes
``state.soft`` rows (continuing rows: the sum; T = 0 rows: ``E[argmax]``, exact; fresh canvases: 0; others
untouched). M tiles with no continuing row return at once. p is zeroed outside the split's vocabulary range and
on skipped rows (TMA zero-fills x past V, and exp(0 - m) overflows for m < -88). Each iteration waits for its
wgmma: the accumulator is used in the loop, so Triton makes the dot synchronous and stages the bf16 A tile in
shared memory (an "SS" wgmma); left to itself, Triton 3.6 kept A in registers with wgmmas in flight while the
next iteration overwrote them (a RAW hazard, NaN soft embeddings; triton-lang/triton#9433). TMA loads stay
multi-buffered; the MMA of one CTA / warpgroup overlaps the exp2 of the others only.

``"chunked"`` (:func:`soft_embedding_chunked`): for each chunk ``[v0, v0 + Vc)`` of the vocabulary (the buffer
``[M, Vc]``, both buffers together with ``overlap``, stays <= :data:`MAX_CHUNK_BYTES`, or at large batches <=
:data:`LARGE_BATCH_CHUNK_BYTES` so that a chunk keeps :data:`LARGE_BATCH_CHUNK` tokens: :func:`chunk_size`):

1. :func:`_prob_chunk_kernel` writes ``P_c[r, j] = exp2(((x - c) / T - m) * log2e) * inv_s`` rounded to E's dtype into
   one reusable buffer [M, Vc] (the same formula as the Triton GEMM's A operand). P is 0 past V, on rows not
   computed (inactive / converged / failed requests: whatever their logits hold, even NaN) and, unless
   ``greedy_onehot``, on T = 0 rows (their soft row is gathered as ``E[argmax]`` exactly by the reduce kernel);
   with ``greedy_onehot`` T = 0 rows get one-hot(argmax).
2. ``acc = acc + P_c @ E_c`` with fp32 accumulation and fp32 output on cuBLAS:
   ``torch.addmm(acc, P_c, E_c, out_dtype=torch.float32, out=acc)`` (the ``aten::addmm.dtype`` overload, in
   place). torch's CPU build has no CPU kernel for ``addmm.dtype``, so on the CPU (tests, Triton interpreter) P is
   kept in fp32 holding E-dtype-rounded values and the product is an fp32 ``addmm`` of the upcast chunk (the same
   products, fp32 sums). A bf16-output matmul is never used: it would round every chunk's partial sum to bf16.
3. :func:`write_soft` writes ``state.soft[slot] = acc * sqrt(hidden)`` (``acc`` is returned as a [1, M, hidden]
   workspace, the shape of the split-K workspace with SPLIT_K = 1).

Ordering: one stream, one buffer: the P kernel of chunk c + 1 waits for the GEMM of chunk c. ``overlap=True``
(``SamplerConfig.soft_overlap``): two buffers sharing the one buffer's budget (half-size chunks: 2 x 8,192 tokens
for sampler_n4), P of chunk c + 1 on a side stream during the GEMM of chunk c (fork / join with events; CUDA-graph
capture tested); off by default (no gain while cuBLAS fills the SMs). No host sync, fixed buffer shapes (all from
static shapes): capturable in a CUDA graph. The GEMM runs over all rows (cuBLAS cannot skip the greedy / finished
requests' rows without data-dependent shapes; their P rows are zero).

Extra memory: split-K workspace ``SPLIT_K * N * CL * hidden * 4`` bytes (34.6 MB for sampler_n4 at SPLIT_K = 3);
chunked: the P buffer(s), one or (``overlap``) two, together <= 32 MiB, <= 256 MiB from 1,025 bf16 rows up (the
automatic chunk; fp32 on the CPU) + acc [M, hidden] fp32 (11.5 MB for sampler_n4): 32 + 11 MiB for sampler_n4, with
or without ``overlap``.
Semantics: docs/ARCHITECTURE.md "Sampler semantics", rule 7.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..state import SamplerState
from .common import check_int32_index, interpret_mode, round_to, side_stream
from .config import SamplerConfig, check_config, plan_key

__all__ = ["soft_embedding", "soft_embedding_chunked", "write_soft", "check_soft_indices", "chunk_size",
           "MAX_CHUNK_BYTES", "LARGE_BATCH_CHUNK", "LARGE_BATCH_CHUNK_BYTES"]


# ---------------------------------------------------------------------------------------------- split-K GEMM
@triton.jit
def _soft_embedding_kernel(
    x_ptr, stride_xn, stride_xp,
    e_ptr, stride_ev, stride_eh,
    x_desc, e_desc,
    ws_ptr,
    t_ptr, active_ptr, m_ptr, inv_s_ptr, shift_ptr, amax_ptr,
    M, CL, V, HID, UNIT,
    K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EXACT_FP32: tl.constexpr, INTERPRET: tl.constexpr, USE_TMA: tl.constexpr, GREEDY_ONEHOT: tl.constexpr,
):
    """Grid (cdiv(M, BM), cdiv(HID, BN), SPLIT_K). ws[split, row, col] = sum_{v in split} p[row, v] E[v, col].

    USE_TMA: logits viewed as [M, V] and E [V, HID] are read through tensor descriptors (TMA on Hopper; no
    per-element 64-bit address registers, which spill at 128 x 256 tiles); else masked pointer loads.
    GREEDY_ONEHOT: T = 0 rows use p = one-hot(argmax) here; else they are skipped (the reduce kernel gathers
    E[argmax] for them, cheaper and exact).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    n = rows // CL
    p = rows % CL
    act = tl.load(active_ptr + n, mask=rmask, other=0)
    T = tl.load(t_ptr + n, mask=rmask, other=0.0)
    greedy = T == 0.0
    if GREEDY_ONEHOT:
        rvalid = rmask & (act != 0)
    else:
        rvalid = rmask & (act != 0) & (T != 0.0)       # T = 0 rows: E[argmax] gathered by the reduce kernel
    if tl.max(rvalid.to(tl.int32), 0) == 0:
        return
    # p = exp(z - m) / s = exp2((z - m) * log2e) * inv_s with z = x / T rounded as in the stats pass and the
    # reference (IEEE division): z - m is exact for the entries that matter, whatever T
    # (exp2(x * log2e / T - m log2e) would cancel two values of size |x| / T).
    # Rows not computed: T -> 1, m = inv_s = 0, and p is zeroed below.
    tdiv = tl.where(rvalid & ~greedy, T, 1.0)
    mrow = tl.load(m_ptr + rows, mask=rvalid, other=0.0)
    inv_s = tl.load(inv_s_ptr + rows, mask=rvalid, other=0.0)
    shift = tl.load(shift_ptr + rows, mask=rvalid, other=0.0)[:, None]   # rule 1: 0 unless max z overflows
    amax = tl.load(amax_ptr + rows, mask=rvalid, other=-1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < HID
    kk = tl.arange(0, BLOCK_K)
    xrow = x_ptr + n.to(tl.int64) * stride_xn + p.to(tl.int64) * stride_xp      # [BM] row bases
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(V, k_start + K_PER_SPLIT)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if USE_TMA:
            # no masks: K_PER_SPLIT is a multiple of BLOCK_K, so a tile never straddles two splits, and past V
            # both x (-> finite p) and E (-> 0) come back as zeros
            x = x_desc.load([pid_m * BLOCK_M, k_start + k]).to(tl.float32)
            prob = tl.exp2((tl.math.div_rn(x - shift, tdiv[:, None]) - mrow[:, None]) * 1.4426950408889634) * \
                inv_s[:, None]
            ev = e_desc.load([k_start + k, pid_n * BLOCK_N])
            if GREEDY_ONEHOT:
                onehot = ((k_start + k + kk)[None, :] == amax[:, None]).to(tl.float32)
                prob = tl.where(greedy[:, None], onehot, prob)
            # p = 0 outside [k_start, k_end) and on rows not computed, whatever x is there: past V the zero-filled
            # x gives p = exp(-m) / s, which overflows to inf for rows with m < -88 (inf * 0 = NaN in the dot),
            # and garbage / non-finite logits of skipped rows would put NaN in their workspace rows
            prob = tl.where(rvalid[:, None] & ((k_start + k + kk) < k_end)[None, :], prob, 0.0)
        else:
            tok = k_start + k + kk
            kmask = tok < k_end
            lmask = rvalid[:, None] & kmask[None, :]
            x = tl.load(xrow[:, None] + tok[None, :], mask=lmask, other=0.0).to(tl.float32)
            prob = tl.exp2((tl.math.div_rn(x - shift, tdiv[:, None]) - mrow[:, None]) * 1.4426950408889634) * \
                inv_s[:, None]
            if GREEDY_ONEHOT:
                prob = tl.where(greedy[:, None], (tok[None, :] == amax[:, None]).to(tl.float32), prob)
            prob = tl.where(lmask, prob, 0.0)
            ev = tl.load(e_ptr + tok[:, None].to(tl.int64) * stride_ev + cols[None, :] * stride_eh,
                         mask=kmask[:, None] & cmask[None, :], other=0.0)
        if EXACT_FP32:
            acc += tl.dot(prob, ev.to(tl.float32), input_precision="ieee")
        elif INTERPRET:  # the interpreter truncates fp32 -> bf16 and multiplies bf16 as raw bits: round by hand
            acc += tl.dot(round_to(prob, ev.dtype), ev.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(prob.to(ev.dtype), ev)
            # UNIT = 1.0 at run time (exact). Using the accumulator inside the loop makes Triton's pipeliner wait
            # for this wgmma (wait_group 0; A then goes through shared memory) before the next iteration writes
            # the next A operand: Triton 3.6 otherwise splits the register-A dot into K = 16 wgmmas with 3 left in
            # flight, and the next iteration's loads/exp2 overwrite their A registers while they still read them
            # (a RAW hazard: garbage A fragments, NaN soft embeddings at 128 x 256 tiles; triton-lang/triton#9433).
            acc = acc * UNIT
    out = ws_ptr + (pid_k.to(tl.int64) * M + rows[:, None].to(tl.int64)) * HID + cols[None, :]
    tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _soft_reduce_kernel(
    ws_ptr, soft_ptr, slots_ptr, mode_ptr, amax_ptr, e_ptr, stride_ev, stride_eh,
    M, CL, HID, SCALE, NUM_SLOTS,
    SPLIT_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid (M, cdiv(HID, BH)). Per row n, mode[n]: 1 -> soft[slot] = SCALE * sum_k ws[k] (fixed order),
    3 -> soft[slot] = SCALE * E[argmax] (T = 0: p is one-hot), 2 -> 0 (fresh canvas), 0 -> untouched. A slot id
    outside [0, NUM_SLOTS) (unchecked ids: the step kernel already made its row inert) is never written."""
    row = tl.program_id(0)
    hb = tl.program_id(1)
    n = row // CL
    p = row % CL
    mode = tl.load(mode_ptr + n)
    slot = tl.load(slots_ptr + n)
    if (mode == 0) | (slot < 0) | (slot >= NUM_SLOTS):
        return
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < HID
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if mode == 1:
        for k in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + (k * M + row).to(tl.int64) * HID + cols, mask=cmask, other=0.0)
        acc = acc * SCALE
    if mode == 3:
        tok = tl.load(amax_ptr + row).to(tl.int64)
        acc = tl.load(e_ptr + tok * stride_ev + cols * stride_eh, mask=cmask, other=0.0).to(tl.float32) * SCALE
    tl.store(soft_ptr + (slot * CL + p).to(tl.int64) * HID + cols, acc, mask=cmask)


def soft_embedding(logits: torch.Tensor, embedding: torch.Tensor, T: torch.Tensor, m: torch.Tensor,
                   inv_s: torch.Tensor, argmax: torch.Tensor, active: torch.Tensor,
                   config: SamplerConfig | None = None, greedy_onehot: bool = True, *,
                   shift: torch.Tensor | None = None) -> torch.Tensor:
    """Stage (c) partial sums: fp32 workspace ``[SPLIT_K, N * CL, hidden]`` of ``p @ E`` (unscaled).

    The path is ``config.soft_impl_for(device, E dtype)``: ``"triton_gemm"`` the split-K :func:`_soft_embedding_kernel`
    here, ``"chunked"`` :func:`soft_embedding_chunked` (workspace [1, N * CL, hidden]; inactive rows 0).

    ``p = exp((logits - shift) / T - m) * inv_s`` (one-hot(argmax) where T = 0), rows of inactive requests skipped
    (their workspace rows are left unwritten). Args: logits [N, CL, V]; embedding [V, hidden] (bf16/fp16: p is
    rounded to it, fp32 accumulation; fp32: exact fp32 products); T [N] float32; m, inv_s float32 [N, CL]; argmax
    int [N, CL]; active [N] bool/int32; shift float32 [N, CL], the stats' c of docs/ARCHITECTURE.md "Sampler
    semantics" rule 1 (None: 0, z = logits / T).

    Raises:
        ValueError: an int32 index of the launches would pass 2**31 - 1 (:func:`check_soft_indices`).
    """
    N, CL, V = logits.shape
    hidden = embedding.shape[1]
    cfg = check_config(config)
    if cfg.soft_impl_for(logits.device, embedding.dtype) == "chunked":
        return soft_embedding_chunked(logits, embedding, T, m, inv_s, argmax, active, chunk=cfg.soft_chunk,
                                      greedy_onehot=greedy_onehot, overlap=bool(cfg.soft_overlap), shift=shift)
    cfg, k_per, split_k = _gemm_plan(N, CL, V, hidden, logits.device, embedding.dtype, cfg)   # before a copy
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    M = N * CL
    ws = torch.empty(split_k, M, hidden, dtype=torch.float32, device=logits.device)
    if M > 0:
        grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(hidden, cfg.block_n), split_k)
        x_desc = e_desc = None
        use_tma = _tma_ok(logits, embedding, cfg)
        if use_tma:
            x_desc = TensorDescriptor.from_tensor(logits.view(M, V), [cfg.block_m, cfg.block_k])
            e_desc = TensorDescriptor.from_tensor(embedding, [cfg.block_k, cfg.block_n])
        args = (logits, logits.stride(0), logits.stride(1), embedding, embedding.stride(0), embedding.stride(1),
                x_desc, e_desc, ws,
                T.contiguous(), active.to(torch.int32).contiguous(), m.contiguous(), inv_s.contiguous(),
                _shift_or_zeros(shift, m), argmax.to(torch.int32).contiguous(), M, CL, V, hidden, 1.0)
        meta = dict(K_PER_SPLIT=k_per, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    EXACT_FP32=embedding.dtype == torch.float32, INTERPRET=interpret_mode(), USE_TMA=use_tma,
                    GREEDY_ONEHOT=greedy_onehot,
                    num_warps=cfg.gemm_warps)
        key = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.gemm_warps, cfg.gemm_stages, embedding.dtype, use_tma,
               greedy_onehot)
        stages = _STAGES_THAT_FIT.get(key, cfg.gemm_stages)
        while True:
            try:
                _soft_embedding_kernel[grid](*args, **meta, num_stages=stages)
                break
            except triton.runtime.errors.OutOfResources:
                # shared memory of the software pipeline: same kernel with one buffer less (same results)
                if stages <= 1:
                    raise
                stages -= 1
        _STAGES_THAT_FIT[key] = stages
    return ws


@functools.lru_cache(maxsize=4096)  # pure in its (hashable) arguments (cost: docs/tuning.md 7.62)
def _gemm_plan(N: int, CL: int, V: int, hidden: int, device: torch.device, embedding_dtype: torch.dtype,
               cfg: SamplerConfig) -> tuple[SamplerConfig, int, int]:
    """``(resolved config, K_PER_SPLIT, SPLIT_K)`` of :func:`soft_embedding`'s split-K GEMM, after the int32 index
    checks of it and of :func:`write_soft` (:func:`~.common.check_int32_index`: the end of the last K split,
    ``SPLIT_K * K_PER_SPLIT`` (``k_start + K_PER_SPLIT`` and the token ids below it, in int32), the padded rows, and
    the reduce kernel's workspace row ``SPLIT_K * M``)."""
    cfg = cfg.resolve(N * CL, V, hidden, device, embedding_dtype)   # fp32 E: the exact-products tiles
    k_per = triton.cdiv(triton.cdiv(V, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(V, k_per)
    M = N * CL
    check_int32_index(split_k * k_per, f"vocab_size={V} in {split_k} K split(s) of {k_per} tokens (SamplerConfig "
                      f"split_k={cfg.split_k}, block_k={cfg.block_k})",
                      "use fewer K splits (split_k) or the reference backend")
    check_int32_index(triton.cdiv(M, cfg.block_m) * cfg.block_m - 1, f"N * canvas_length = {N} * {CL} positions",
                      "step fewer rows at a time")
    check_int32_index(split_k * M - 1, f"{split_k} K split(s) of N * canvas_length = {N} * {CL} positions",
                      "use fewer K splits (split_k) or step fewer rows at a time")
    return cfg, k_per, split_k


def _chunk_tiles(M: int, vc: int, cuda: bool) -> tuple[int, int]:
    """(rows, tokens) per program of :func:`_prob_chunk_kernel` (GPU: 4 x 1024; interpreter: sized to the problem)."""
    return (4, 1024) if cuda else (min(32, triton.next_power_of_2(M)), min(64, triton.next_power_of_2(vc)))


@functools.lru_cache(maxsize=4096)  # pure in its arguments (cost: docs/tuning.md 7.62)
def _check_chunk_indices(N: int, CL: int, V: int, vc: int, cuda: bool) -> None:
    """The int32 index checks of :func:`soft_embedding_chunked` with chunks of ``vc`` tokens: the token ids
    ``v0 + j`` of the last chunk over its padded tiles (``j`` up to ``cdiv(vc, BLOCK_V) * BLOCK_V - 1``: a
    non-power-of-two ``soft_chunk`` pads past V) and the padded rows; :func:`write_soft`'s workspace row M."""
    M = N * CL
    block_r, block_v = _chunk_tiles(M, vc, cuda)
    last = (triton.cdiv(V, vc) - 1) * vc
    check_int32_index(last + triton.cdiv(vc, block_v) * block_v - 1,
                      f"vocab_size={V} in chunks of {vc} tokens (SamplerConfig soft_chunk)",
                      "use a power-of-two soft_chunk or the reference backend")
    check_int32_index(triton.cdiv(M, block_r) * block_r - 1, f"N * canvas_length = {N} * {CL} positions",
                      "step fewer rows at a time")


def check_soft_indices(N: int, CL: int, V: int, hidden: int, device: torch.device, embedding_dtype: torch.dtype,
                       config: SamplerConfig | None, chunked: bool | None = None) -> None:
    """The int32 index checks of the soft embedding of logits [N, CL, V] and E [V, hidden] of ``embedding_dtype``
    (the path ``config.soft_impl_for`` picks, or the chunked one where ``chunked``) and of :func:`write_soft`, from
    shapes only, before anything runs: the Triton step calls it at entry, as a refusal after stage (b) would leave
    the state rows half written. ``device``: a str or ``torch.device`` (an index-less ``"cuda"`` is the current
    device, :func:`~.config.plan_key`).

    Raises:
        ValueError: an index would pass 2**31 - 1 (:func:`~.common.check_int32_index`).
    """
    cfg = check_config(config)
    (N, CL, V, hidden), device = plan_key((N, CL, V, hidden), device)  # ints and an indexed device: the cache's key
    cuda = device.type == "cuda"
    if chunked is None:
        chunked = cfg.soft_impl_for(device, embedding_dtype) == "chunked"
    if chunked:
        vc, _, _ = _p_buffer_plan(N * CL, V, cfg.soft_chunk, embedding_dtype, device,
                                  bool(cfg.soft_overlap) and cuda)
        _check_chunk_indices(N, CL, V, vc, cuda)
    else:
        _gemm_plan(N, CL, V, hidden, device, embedding_dtype, cfg)


def _shift_or_zeros(shift: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor:
    """The shift operand of the soft kernels: ``shift`` (contiguous float32), or zeros shaped as ``m``."""
    return torch.zeros_like(m, dtype=torch.float32) if shift is None else shift.to(torch.float32).contiguous()


def _tma_ok(logits: torch.Tensor, embedding: torch.Tensor, cfg: SamplerConfig) -> bool:
    """Tensor descriptors apply: logits viewable as a row-major [N*CL, V], E row-major, 16-byte aligned rows and
    bases (TMA's rules), and the config allows it (``use_tma`` None = wherever it applies, the interpreter too)."""
    if cfg.use_tma is False:
        return False
    N, CL, V = logits.shape
    ok = (logits.stride(2) == 1 and logits.stride(1) == V and logits.stride(0) == CL * V
          and embedding.stride(1) == 1 and embedding.stride(0) == embedding.shape[1]
          and (V * logits.element_size()) % 16 == 0 and (embedding.shape[1] * embedding.element_size()) % 16 == 0
          and logits.data_ptr() % 16 == 0 and embedding.data_ptr() % 16 == 0)
    if cfg.use_tma and not ok:
        raise ValueError("SamplerConfig(use_tma=True) needs row-major logits/E with 16-byte aligned rows")
    return ok


#: Pipeline depth that fitted in shared memory per GEMM tile configuration (filled at the first launch).
_STAGES_THAT_FIT: dict = {}


def write_soft(state: SamplerState, slots: torch.Tensor, ws: torch.Tensor, mode: torch.Tensor,
               argmax: torch.Tensor, embedding: torch.Tensor) -> None:
    """Write ``state.soft[slots]`` in place from a workspace ``ws`` [SPLIT_K, N * CL, hidden] (fp32), one launch of
    :func:`_soft_reduce_kernel`. ``mode`` int32 [N] per row (the step kernel's output): 1 = the workspace sum times
    ``sqrt(hidden)``, 3 = ``E[argmax] * sqrt(hidden)`` (T = 0, exact), 2 = zeros (fresh canvas), 0 = untouched."""
    split_k, M, hidden = ws.shape
    CL = state.canvas_length
    block_h = min(1024, triton.next_power_of_2(hidden))
    if M > 0:
        _soft_reduce_kernel[(M, triton.cdiv(hidden, block_h))](
            ws, state.soft, slots.contiguous(), mode.to(torch.int32).contiguous(), argmax.contiguous(),
            embedding, embedding.stride(0), embedding.stride(1), M, CL, hidden,
            math.sqrt(hidden), state.max_num_reqs, SPLIT_K=split_k, BLOCK_H=block_h, num_warps=4,
        )


# ---------------------------------------------------------------------------------------------- chunked
#: Upper bound of the bf16 probability buffer [M, Vc] in bytes.
MAX_CHUNK_BYTES = 32 * 2**20
#: Large batches: the automatic chunk is raised towards LARGE_BATCH_CHUNK tokens while the buffer stays within
#: LARGE_BATCH_CHUNK_BYTES. A chunk's cuBLAS GEMM reads and writes the fp32 accumulator [M, hidden] once, so its
#: traffic per FLOP falls with the chunk (K) (measured at 8,192 rows, docs/tuning.md 7.13).
LARGE_BATCH_CHUNK = 16384
LARGE_BATCH_CHUNK_BYTES = 256 * 2**20


@triton.jit
def _prob_chunk_kernel(
    x_ptr, stride_xn, stride_xp, p_ptr,
    t_ptr, active_ptr, m_ptr, inv_s_ptr, shift_ptr, amax_ptr,
    M, CL, V, v0, VC,
    GREEDY_ONEHOT: tl.constexpr, ROUND_TO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid (cdiv(M, BLOCK_R), cdiv(VC, BLOCK_V)): p[r, j] (row-major [M, VC]) for token v0 + j of row r."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < M
    n = rows // CL
    p = rows % CL
    act = tl.load(active_ptr + n, mask=rmask, other=0) != 0
    T = tl.load(t_ptr + n, mask=rmask, other=0.0)
    greedy = T == 0.0
    if GREEDY_ONEHOT:
        rvalid = rmask & act
    else:
        rvalid = rmask & act & ~greedy
    soft_rows = rvalid & ~greedy
    # z = x / T rounded as the stats pass and the reference compute it, then exp(z - m): z - m is exact for
    # the entries that matter (Sterbenz), whatever T (exp2(x * log2e / T - m log2e) would cancel two values of
    # size |x| / T).
    tdiv = tl.where(soft_rows, T, 1.0)
    mrow = tl.load(m_ptr + rows, mask=soft_rows, other=0.0)
    inv_s = tl.load(inv_s_ptr + rows, mask=soft_rows, other=0.0)
    shift = tl.load(shift_ptr + rows, mask=soft_rows, other=0.0)    # rule 1: 0 unless the max z overflows
    tok = v0 + j
    lmask = soft_rows[:, None] & (tok < V)[None, :]
    xrow = x_ptr + n.to(tl.int64) * stride_xn + p.to(tl.int64) * stride_xp
    x = tl.load(xrow[:, None] + tok[None, :], mask=lmask, other=0.0).to(tl.float32)
    z = tl.math.div_rn(x - shift[:, None], tdiv[:, None])                # x - 0.0 == x: z = x / T bit for bit
    prob = tl.exp2((z - mrow[:, None]) * 1.4426950408889634) * inv_s[:, None]
    prob = tl.where(lmask, prob, 0.0)        # 0 past V, on skipped rows (even for NaN logits) and T = 0 rows
    if GREEDY_ONEHOT:
        amax = tl.load(amax_ptr + rows, mask=rvalid, other=-1)
        onehot = (tok[None, :] == amax[:, None]) & (rvalid & greedy)[:, None]
        prob = tl.where(onehot, 1.0, prob)
    if ROUND_TO is not None:                 # CPU: fp32 buffer holding E-dtype-rounded values
        prob = round_to(prob, ROUND_TO)
    omask = rmask[:, None] & (j < VC)[None, :]
    tl.store(p_ptr + rows[:, None].to(tl.int64) * VC + j[None, :], prob.to(p_ptr.dtype.element_ty), mask=omask)


def chunk_size(M: int, V: int, requested: int | None = None, itemsize: int = 2, buffers: int = 1) -> int:
    """Vocabulary chunk Vc of ``buffers`` probability buffers [M, Vc] of ``itemsize``-byte elements: ``requested``
    (clipped to V; each buffer then holds it, no budget), else the largest power of two in [64, 65536] such that the
    buffers together fit :data:`MAX_CHUNK_BYTES` (64 if none does); at large batches, where one [M,
    LARGE_BATCH_CHUNK] buffer would not fit MAX_CHUNK_BYTES (from 1,025 bf16 rows, 513 fp32), it is then doubled
    while it is below :data:`LARGE_BATCH_CHUNK` tokens and the buffers together still fit
    :data:`LARGE_BATCH_CHUNK_BYTES` (one bf16 buffer: 8,192 rows get 16,384-token chunks, 16,384 rows 8,192);
    clipped to V.

    Whether a batch is large depends on M and ``itemsize`` only, never on ``buffers``: the two buffers of the
    overlapped path (``buffers=2``) share the one buffer's budget at every M (sampler_n4, 1,024 bf16 rows: 2 x
    8,192 tokens = 32 MiB, the serial path 1 x 16,384).

    Raises:
        ValueError: ``requested`` < 1, ``buffers`` < 1.
    """
    if int(buffers) < 1:
        raise ValueError(f"buffers must be >= 1, got {buffers}")
    if requested is not None:
        if int(requested) < 1:
            raise ValueError(f"soft_chunk must be >= 1 tokens, got {requested}")
        return min(int(requested), V)
    rows = max(M, 1)
    vc = 64
    while buffers * vc * 2 * rows * itemsize <= MAX_CHUNK_BYTES and vc * 2 <= 65536:
        vc *= 2
    if LARGE_BATCH_CHUNK * rows * itemsize > MAX_CHUNK_BYTES:        # a large batch: decided for one buffer
        while vc < LARGE_BATCH_CHUNK and buffers * vc * 2 * rows * itemsize <= LARGE_BATCH_CHUNK_BYTES:
            vc *= 2
    return max(1, min(vc, V))


def _p_buffer_plan(M: int, V: int, chunk: int | None, embedding_dtype: torch.dtype, device: torch.device,
                   overlap: bool) -> tuple[int, int, torch.dtype]:
    """(Vc, number of P buffers, their dtype) of :func:`soft_embedding_chunked`: E's dtype on CUDA, fp32 elsewhere
    (holding E-dtype-rounded values); two buffers with ``overlap`` on CUDA (ignored elsewhere), else one; Vc from
    :func:`chunk_size` for all of them together."""
    cuda = (device if isinstance(device, torch.device) else torch.device(device)).type == "cuda"
    buffers = 2 if overlap and cuda else 1
    buf_dtype = embedding_dtype if cuda else torch.float32
    itemsize = buf_dtype.itemsize  # (no 0-d tensor allocated per call for its element_size)
    return chunk_size(M, V, chunk, itemsize, buffers=buffers), buffers, buf_dtype


def soft_embedding_chunked(logits: torch.Tensor, embedding: torch.Tensor, T: torch.Tensor, m: torch.Tensor,
                           inv_s: torch.Tensor, argmax: torch.Tensor, active: torch.Tensor,
                           chunk: int | None = None, greedy_onehot: bool = True,
                           overlap: bool = False, out: torch.Tensor | None = None, *,
                           shift: torch.Tensor | None = None) -> torch.Tensor:
    """``p @ E`` (unscaled) of the rows of active requests, float32 workspace [1, N * CL, hidden].

    Args:
        logits: float [N, CL, V] (contiguous last dim). embedding: E [V, hidden] bf16/fp16 (P rounded to it, fp32
            accumulation) or fp32. T: float32 [N] (0 = greedy). m, inv_s: float32 [N, CL] row max of z and
            1 / sum exp(z - m) from the stats pass, z = (logits - shift) / T. argmax: int [N, CL].
            active: bool/int [N]. shift: float32 [N, CL], the stats' c of docs/ARCHITECTURE.md "Sampler semantics"
            rule 1 (None: 0).
        chunk: vocabulary chunk Vc in tokens (None: :func:`chunk_size`). greedy_onehot: T = 0 rows use
            p = one-hot(argmax) (else their rows are 0 and the caller gathers E[argmax]).
        out: optional float32 [1, N * CL, hidden] workspace to accumulate into (zeroed here on the current stream),
            e.g. allocated by a caller's stream when this runs on a side stream; None: allocated here.
        overlap: CUDA only: two P buffers that share the one buffer's budget (:func:`chunk_size` with
            ``buffers=2``: half-size chunks); the P kernel of chunk c + 1 runs on a side stream while the GEMM of
            chunk c runs on the current stream (fork / join through events: capturable in a CUDA graph; same
            results, the sums stay in chunk order on one stream).

    Rows of inactive requests are 0 (P is zeroed there whatever their logits hold).

    Working memory besides the result: the P buffer(s) [M, Vc], with the automatic chunk together <=
    :data:`MAX_CHUNK_BYTES` (32 MiB), or <= :data:`LARGE_BATCH_CHUNK_BYTES` (256 MiB) where one [M, 16,384] buffer
    would exceed 32 MiB (from 1,025 bf16 rows up), overlap or not (an explicit ``chunk``: buffers x M x chunk
    elements), and a few [N, CL] / [N] vectors; the result ``acc`` [1, M, hidden] fp32 is allocated here unless
    ``out`` is given (sampler_n4: 32 MiB of P + 11 MiB of acc, overlap or not).

    Raises:
        ValueError: ``out`` of the wrong shape / dtype / device; an int32 index of the launches would pass
            2**31 - 1 (a non-power-of-two ``chunk`` pads the last chunk's tiles past V: :func:`check_soft_indices`).
    """
    N, CL, V = logits.shape
    hidden = embedding.shape[1]
    M = N * CL
    dev = logits.device
    cuda = dev.type == "cuda"
    lowp = embedding.dtype in (torch.bfloat16, torch.float16)
    overlap = bool(overlap) and cuda
    vc, nbuf, buf_dtype = _p_buffer_plan(M, V, chunk, embedding.dtype, dev, overlap)
    _check_chunk_indices(N, CL, V, vc, cuda)                        # before anything is copied, allocated or zeroed
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if out is not None:
        if out.shape != (1, M, hidden) or out.dtype != torch.float32 or out.device != dev or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 [1, {M}, {hidden}] tensor on {dev}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        acc = out.zero_()
    else:
        acc = torch.zeros(1, M, hidden, dtype=torch.float32, device=dev)
    if M == 0 or V == 0:
        return acc
    pbufs = [torch.empty(M, vc, dtype=buf_dtype, device=dev) for _ in range(nbuf)]
    a2 = acc[0]
    block_r, block_v = _chunk_tiles(M, vc, cuda)
    round_dtype = None
    if not cuda and lowp:
        round_dtype = tl.bfloat16 if embedding.dtype == torch.bfloat16 else tl.float16
    args = (T.contiguous(), active.to(torch.int32).contiguous(), m.contiguous(), inv_s.contiguous(),
            _shift_or_zeros(shift, m), argmax.to(torch.int32).contiguous())
    grid = (triton.cdiv(M, block_r), triton.cdiv(vc, block_v))

    def write_p(pbuf, v0):
        _prob_chunk_kernel[grid](logits, logits.stride(0), logits.stride(1), pbuf, *args, M, CL, V, v0, vc,
                                 GREEDY_ONEHOT=greedy_onehot, ROUND_TO=round_dtype, BLOCK_R=block_r, BLOCK_V=block_v,
                                 num_warps=4)

    def gemm(pbuf, v0):
        w = min(vc, V - v0)
        pc = pbuf if w == vc else pbuf[:, :w]
        ec = embedding[v0:v0 + w]
        if cuda and lowp:
            torch.addmm(a2, pc, ec, out_dtype=torch.float32, out=a2)
        else:
            torch.addmm(a2, pc, ec.to(torch.float32), out=a2)

    starts = list(range(0, V, vc))
    if not overlap:
        for v0 in starts:
            write_p(pbufs[0], v0)
            gemm(pbufs[0], v0)
        return acc
    main = torch.cuda.current_stream(dev)
    side = side_stream(dev)
    p_ready = [torch.cuda.Event(), torch.cuda.Event()]
    p_free = [torch.cuda.Event(), torch.cuda.Event()]
    side.wait_stream(main)                    # fork: stats, acc = 0 and the logits are ready
    for c, v0 in enumerate(starts):
        b = c & 1
        with torch.cuda.stream(side):
            if c >= 2:
                side.wait_event(p_free[b])    # the GEMM of chunk c - 2 has read this buffer
            write_p(pbufs[b], v0)
            p_ready[b].record(side)
        main.wait_event(p_ready[b])
        gemm(pbufs[b], v0)
        p_free[b].record(main)
    main.wait_stream(side)                    # join (the buffers are freed in the current stream's order)
    return acc
