"""Tensor-parallel sampler step: the denoising step on vocabulary shards, exactly the single-GPU decisions; the
combine of the ranks' statistics, the driver, and the choice of the local-pass backend.

Under tensor parallelism (vLLM TP) rank r of W holds the logits of a contiguous vocabulary slice
``[vocab_start_r, vocab_end_r)`` (the LM head is column-parallel) and the same rows of the tied embedding E.
Gathering the logits would move ``N * CL * V * 4`` bytes per step; a step moves only per-position statistics and
one hidden-sized vector per position:

1. Local pass (per rank, per canvas position, over the shard only) of ``z = float32(logits) / T`` (where the
   shard's max z overflows, z = (x - c) / T with c the shard's max logit and a status saying so: rule 1):
   ``m_r = max z``, ``s_r = sum exp(z - m_r)``, ``u_r = sum exp(z - m_r) (z - m_r)``, the argmax of z with its
   GLOBAL id (first maximum), the Gumbel-max candidate ``max(z + g)`` with its GLOBAL id — the noise g is drawn
   by :mod:`blockdiff.sampler.rng` at the global token id, so it is bit-identical to the single-GPU noise —
   and a bad-logit flag (NaN / +inf; a -inf logit is p = 0, and a shard whose every logit of a position is -inf
   holds that position's statistics of an empty shard) (:class:`~blockdiff.sampler.tp.common.LocalStats`). Plus
   the locally normalised
   soft-embedding partial ``q_r = (exp(z - m_r) / s_r) @ E_r`` ([N, CL, hidden] fp32; one-hot(argmax_r) for
   T = 0 rows). Backends (explicit; no fallback, :data:`STATS_BACKENDS`): ``"reference"`` (dense torch,
   :mod:`blockdiff.sampler.tp.reference`) and ``"triton"`` (:mod:`blockdiff.sampler.tp.triton`: a streaming
   statistics kernel with a vocabulary offset, plus the soft embedding of
   :mod:`blockdiff.sampler.triton.soft_embedding`).
2. ``all_gather`` of the 7 statistics (float64, 56 bytes per position and rank), overlapped with the partial
   GEMM of step 1.
3. Combine, identically on every rank (:func:`combine_statistics`): ``M = max_r m_r``; argmax and Gumbel
   winner = the lowest global id among the ranks holding the maximum (= ``argmax`` over the full vocabulary,
   ties to the lowest id); with ``w_r = exp(m_r - M)``: ``Z = sum_r w_r s_r`` and the exact entropy
   ``H = log Z - E_p[z - M] = log Z - sum_r w_r (u_r + (m_r - M) s_r) / Z`` (nats, combined in float64).
4. Soft embedding: ``softmax(z) @ E = sum_r (w_r s_r / Z) q_r`` — the global-max/global-sum softmax applied to
   each shard, written as a per-position rescale of the local partial so the GEMM need not wait for step 2 —
   ``all_reduce(SUM)`` of ``[N, CL, hidden]`` fp32, times ``sqrt(hidden)``. T = 0 rows: weight 1 on the rank
   owning the global argmax, 0 elsewhere (exact: one-hot(argmax) @ E).
5. The rest of the step — entropy-bound acceptance, RENOISE ids, argmax stability, convergence, phase
   transitions — is the sampler's own shared code (:func:`blockdiff.sampler.common.entropy_decisions`,
   :func:`~blockdiff.sampler.common.convergence`, :func:`~blockdiff.sampler.common.apply_step`), run on the
   replicated :class:`~blockdiff.sampler.state.SamplerState` of every rank with identical inputs, so every rank
   reaches identical decisions and state.

On 2 GPUs (one process per GPU, NCCL; every process sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 first, :func:`set_safe_nccl_env`): ``python3 -m pytest -m gpu tests/sampler/tp -s``
(decisions identical to one GPU at V = 262144, canvas 256) and ``python3 -m blockdiff.bench.bench_sampler_tp`` (2 GPUs
vs 1). CI runs the combine over 2 gloo processes on the CPU.

Communication per step (N rows, CL positions, W ranks, payload sizes;
:func:`~blockdiff.sampler.tp.common.communication_bytes`): all_gather of ``N * CL * 56`` bytes per rank into
``W * N * CL * 56`` (56 KiB sent / 112 KiB gathered at N = 4, CL = 256, W = 2) and one all_reduce of
``N * CL * hidden * 4`` bytes (11.5 MB at hidden 2816; a ring moves ~``2 (W - 1) / W`` of it per rank),
independent of the vocabulary size (gathering the logits instead: ``N * CL * V * 4`` = 1 GiB at V = 262144).
No host synchronisation on the step path unless the values are checked (``check_values``, the default outside
CUDA-graph capture): then the slot ids are read and, before the step's collectives, the ranks exchange a fixed-size
agreement record (:func:`sampler_step_tp`), so a rank refusing its arguments or ranks disagreeing on the step raise
on every rank instead of leaving the others waiting in a collective.

Exactness (vs :func:`blockdiff.sampler.reference.sampler_step` on the unsharded logits): argmax, Gumbel sample,
renoise ids, failure flags are bit-identical (elementwise float32 z and z + g are computed by the same
operations; maxima and first-index ties combine exactly). Entropies agree to float32 rounding (summation
order differs), hence acceptance and convergence are identical unless an entropy sum lies within rounding of
a threshold. Soft embeddings: p is rounded to E's dtype as in the reference, the partial GEMMs keep fp32 outputs
(the reference rounds its output to E's dtype once), so the error is at most the reference's.

Sources: online softmax (Milakov & Gimelshein 2018, arXiv:1805.02867); Gumbel-max; vocabulary-parallel
LM head / embedding (Megatron-LM, Shoeybi et al. 2019; vLLM ``VocabParallelEmbedding``); sampler semantics:
docs/ARCHITECTURE.md "Sampler semantics".
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .. import rng
from ..common import (DenoiseResult, apply_step, capturing, check_step_args, convergence, entropy_decisions,
                      saturate_logits, temperature)
from ..state import DENOISE, SamplerState, StepOutput
from .common import (NUM_FIELDS, STATUS_BAD, STATUS_FINITE, STATUS_ZMAX_INF, STATUS_ZMAX_NEG_INF, LocalStats,
                     VocabShard, make_shards)
from ..triton.config import check_config
from .reference import local_statistics, soft_partial
from .triton import local_statistics_triton, soft_partial_triton

__all__ = ["STATS_BACKENDS", "set_safe_nccl_env", "CombinedStats", "combine_statistics", "finish_step",
           "local_pass", "row_inputs", "sampler_step_tp", "sampler_step_sharded", "check_shards_consistent"]


STATS_BACKENDS = ("reference", "triton")


def set_safe_nccl_env() -> None:
    """Disable NVLink SHARP / multicast paths (NVLS, symmetric-memory multicast, NVSHMEM NVLS).

    Sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1`` in
    ``os.environ``; call in every process BEFORE ``torch.distributed.init_process_group("nccl")``.
    """
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


# ---------------------------------------------------------------------------------------------- combine
@dataclass
class CombinedStats:
    """Global per-position results combined from every rank's statistics (identical on every rank).

    argmax, sampled: int64 [N, CL] global ids (sampled = argmax on T = 0 rows). entropy: float32 [N, CL] nats
    (0 on T = 0 rows, NaN where ``bad``). bad: bool [N, CL], the position's softmax is undefined: a NaN / +inf
    logit on some rank, or every logit -inf (every rank's shard empty of probability).
    soft_weight: float32 [W, N, CL] — rank r's locally normalised partial times ``soft_weight[r]`` summed over
    ranks is ``softmax(z) @ E`` (one-hot on the owner of the argmax for T = 0 rows).
    """

    argmax: torch.Tensor
    sampled: torch.Tensor
    entropy: torch.Tensor
    bad: torch.Tensor
    soft_weight: torch.Tensor


def combine_statistics(gathered: torch.Tensor, T: torch.Tensor, vocab_size: int) -> CombinedStats:
    """Exact merge of the per-rank statistics (docs/ARCHITECTURE.md "Sampler semantics", rules 2-3, over the whole
    vocabulary).

    Args:
        gathered: float64 [W, N, CL, NUM_FIELDS], rank-major (see :class:`LocalStats`.packed).
        T: float32 [N] temperatures (0 = greedy).
        vocab_size: global V (ids >= V are "no candidate").

    Returns:
        :class:`CombinedStats`. Ties of the maximum across ranks go to the lowest global id, which is what
        ``argmax`` over the unsharded vocabulary returns. Entropy: ``log Z - sum_r w_r (u_r + (m_r - M) s_r) / Z``
        with ``w_r = exp(m_r - M)``, ``Z = sum_r w_r s_r``, in float64, then float32. Where the position's max z
        overflows (rule 1; the ranks' ``F_STATUS``), the ranks' shifted statistics combine with ``w_r = 1`` on the
        ranks whose shift is the global max logit and 0 elsewhere (exactly the shifted z of the whole vocabulary).
        A rank whose logits of a position are all -inf holds an empty shard's statistics (max -inf, s = 0): it
        takes no part; where every rank does, the position is ``bad`` (no softmax, entropy NaN, greedy rows too).
    """
    m, s, u, aid, gv, gid, status = gathered.unbind(-1)          # each [W, N, CL]
    bad = (status == STATUS_BAD).any(0)
    # rule 1: the position's max z overflows to +inf where a rank's does, to -inf where every rank's is -inf; then
    # z = (x - c) / T with c = max x, and the ranks holding the shifted statistics take part, with their own c in
    # F_MAX: those whose c is the global max logit hold the ties, p = 0 elsewhere
    up = (status == STATUS_ZMAX_INF).any(0)
    shifted = ~bad & (up | (status == STATUS_ZMAX_NEG_INF).all(0))
    part = torch.where(shifted, status == torch.where(up, STATUS_ZMAX_INF, STATUS_ZMAX_NEG_INF),
                       (status == STATUS_FINITE) | (status == STATUS_BAD))
    m = torch.where(part, m, float("-inf"))
    M = m.max(0).values
    bad = bad | (shifted & (M == float("-inf")))              # every logit -inf (every rank empty): no softmax
    top = part & (m == M)
    none = torch.full_like(aid, float(vocab_size))
    argmax = torch.where(top, aid, none).min(0).values
    gv = torch.where(torch.where(shifted, top, part), gv, float("-inf"))   # shifted: only the ties' g compare
    G = gv.max(0).values
    sampled = torch.where(gv == G, gid, none).min(0).values
    found = argmax < vocab_size
    argmax = torch.where(found, argmax, 0.0).to(torch.int64)
    sampled = torch.where(sampled < vocab_size, sampled, 0.0).to(torch.int64)
    w = torch.where(shifted, top.to(m.dtype), torch.exp(m - M))    # 0 for ranks not taking part (m = -inf)
    d = torch.where(shifted, 0.0, m - M)
    live = w > 0
    ws = torch.where(live, w * s, 0.0)
    Z = ws.sum(0)
    A = torch.where(live, w * (u + d * s), 0.0).sum(0)
    H = (torch.log(Z) - A / Z).to(torch.float32)
    greedy = (T == 0)[:, None]
    entropy = torch.where(greedy, 0.0, H)
    entropy = torch.where(bad, float("nan"), entropy)
    sampled = torch.where(greedy, argmax, sampled)
    owner = (aid == argmax.to(torch.float64)[None]).to(torch.float64)
    weight = torch.where(greedy[None], owner, ws / Z[None]).to(torch.float32)
    return CombinedStats(argmax=argmax, sampled=sampled, entropy=entropy, bad=bad, soft_weight=weight)


def finish_step(state: SamplerState, slots: torch.Tensor, prefill_done: torch.Tensor, phase: torch.Tensor,
                T: torch.Tensor, comb: CombinedStats, soft: torch.Tensor) -> StepOutput:
    """Steps 4-7 and the phase machine from combined statistics, with the sampler's shared code.

    Args:
        phase: int32 [N] phases read at entry. T: float32 [N]. comb: :class:`CombinedStats`.
        soft: float32 [N, CL, hidden], the full soft embedding (already times ``sqrt(hidden)``).
    """
    CL, V = state.canvas_length, state.vocab_size
    seed, rid = state.seed[slots], state.request_id[slots]
    cidx, step = state.canvas_index[slots], state.step[slots]
    # as the reference: an undefined softmax (a NaN / +inf logit, every logit -inf: comb.bad) or a NaN entropy
    row_failed = comb.bad.any(-1) | torch.isnan(comb.entropy).any(-1)
    accepted, mean_entropy = entropy_decisions(comb.entropy, state.entropy_bound[slots])
    accepted = accepted & ~row_failed[:, None]
    renoise = rng.random_ids(seed, rid, cidx, step, CL, V, rng.RENOISE)
    next_canvas = torch.where(accepted, comb.sampled, renoise)
    converged, stable_count = convergence(state, slots, comb.argmax, mean_entropy)
    res = DenoiseResult(accepted=accepted, entropy=comb.entropy, argmax=comb.argmax, sampled=comb.sampled,
                        next_canvas=next_canvas, row_failed=row_failed, converged=converged,
                        stable_count=stable_count, mean_entropy=mean_entropy, temperature=T, soft=soft)
    return apply_step(state, slots, prefill_done, res, phase)


# ---------------------------------------------------------------------------------------------- backends
def local_pass(backend: str, logits, embedding, T, seed, rid, cidx, step, active, shard: VocabShard,
               config=None) -> tuple[LocalStats, Callable[[], torch.Tensor]]:
    """One rank's local pass (step 1 of the module docstring) with the chosen backend: ``(LocalStats, thunk)``,
    the thunk computing the unscaled soft partial float32 [N, CL, hidden] (run it while the all_gather is in
    flight).

    Args:
        backend: ``"reference"`` or ``"triton"`` (:data:`STATS_BACKENDS`).
        logits: float [N, CL, shard.size]; embedding: [shard.size, hidden]; T, seed, rid, cidx, step, active:
            the [N] per-row inputs of :func:`row_inputs`; shard: :class:`~blockdiff.sampler.tp.common.VocabShard`;
            config: optional ``SamplerConfig`` (triton only).

    Raises:
        ValueError: unknown backend. TypeError: ``config`` neither a ``SamplerConfig`` nor None.
    """
    check_config(config)
    logits = saturate_logits(logits)  # float64 only: a finite logit stays finite in float32 (the reference's rule)
    if backend == "reference":
        local = local_statistics(logits, T, seed, rid, cidx, step, shard)
        return local, lambda: soft_partial(logits, embedding, T, local)
    if backend == "triton":
        local = local_statistics_triton(logits, T, seed, rid, cidx, step, active, shard, config)
        return local, lambda: soft_partial_triton(logits, embedding, T, local, active, config)
    raise ValueError(f"backend must be one of {STATS_BACKENDS}, got {backend!r}")


def _check_tp_args(state, slots, logits, prefill_done, embedding, shard: VocabShard, check_values=None) -> bool:
    """Arguments of a sharded step: :func:`blockdiff.sampler.common.check_step_args` on the shard's vocabulary slice
    (shapes / dtypes from host metadata; the slot ids when ``check_values`` holds). Returns whether the ids were
    checked. Raises TypeError / ValueError naming the argument."""
    if not isinstance(state, SamplerState):
        raise TypeError(f"state must be a SamplerState, got {type(state).__name__}")
    if not isinstance(shard, VocabShard):
        raise TypeError(f"shard must be a VocabShard, got {type(shard).__name__}")
    if shard.vocab_size != state.vocab_size:
        raise ValueError(f"shard.vocab_size ({shard.vocab_size}) must equal state.vocab_size ({state.vocab_size})")
    return check_step_args(state, slots, logits, prefill_done, embedding, vocab_slice=(shard.start, shard.end),
                           check_values=check_values)


def row_inputs(state: SamplerState, slots: torch.Tensor):
    """Per-row inputs of the local passes, read from the state rows ``slots`` [N]: ``(phase, T, seed, request_id,
    canvas_index, step, active)`` — phase int32 (a copy, at entry), T float32, seed / request_id int64,
    canvas_index / step int32, active bool (phase == DENOISE)."""
    phase = state.phase[slots].clone()
    T = temperature(state, slots)
    return (phase, T, state.seed[slots], state.request_id[slots], state.canvas_index[slots], state.step[slots],
            phase == DENOISE)


#: Fields of the per-step agreement record (:func:`_agree`): int64, one row per rank.
_A_REFUSED, _A_RANK, _A_WORLD, _A_VOCAB, _A_START, _A_END, _A_ROWS, _A_CL, _A_HIDDEN, _A_INPUTS, _A_STATE = range(11)
_A_FIELDS = 11
_DIGEST_M = 2147483647                               # 2**31 - 1 (prime): every term and product below fits int64


def _digest(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    """A position-weighted checksum of the tensors' values (int64 scalar on ``device``, no host read): equal on
    every rank for equal values (integer arithmetic only, exact on any device in any order). Each value (float
    tensors by their bits, read as ints) is folded to ``r = (lo + 2**30 hi) mod p`` of its 32-bit halves (p the prime
    2**31 - 1) and weighted by a weight invertible mod p at its position. One changed value therefore always changes
    it when its old and new values both lie in (-2**29, 2**29) (phases, steps, counts, token ids, slots: such values
    fold to distinct residues), and otherwise unless the two fold to one residue (e.g. a half changing by a multiple
    of p), a chance of ~2**-31 for unrelated values; several changed values could cancel, by chance. (The halves
    used to enter with equal weights at position 0, where -1 and 2 digested alike.)"""
    parts = []
    for t in tensors:
        t = t.reshape(-1)
        if t.dtype == torch.float32:
            t = t.view(torch.int32)
        elif t.dtype == torch.float64:
            t = t.view(torch.int64)
        parts.append(t.to(device=device, dtype=torch.int64))
    v = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    M = _DIGEST_M
    lo, hi = v & 0xFFFFFFFF, (v >> 32) & 0xFFFFFFFF
    r = (lo % M + (hi % M) * (1 << 30)) % M                  # < 2**31 + 2**61 before the mod
    i = torch.arange(v.numel(), dtype=torch.int64, device=device) % M
    w = i * 48271 % (M - 1) + 1                              # in [1, M - 1]: never 0 mod M
    return (r * w % M).sum()                                 # terms < 2**31: no overflow below 2**32 values


def _record_device(group, state, logits) -> torch.device:
    """The device of the agreement record, one every rank's all_gather takes whatever that rank's own arguments
    (a refusing rank's logits may be a CPU tensor, or no tensor): under NCCL a CUDA device (the logits', else the
    state's, else the current one; a CPU record there raised on its rank alone and left the others waiting in the
    all_gather), under any other backend (gloo) the CPU."""
    if "nccl" not in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    for dev in (logits.device if isinstance(logits, torch.Tensor) else None,
                state.device if isinstance(state, SamplerState) else None):
        if dev is not None and dev.type == "cuda":
            return dev
    return torch.device("cuda", torch.cuda.current_device())


def _agree(group, W: int, rank: int, device, record: torch.Tensor | None, error: Exception | None,
           what: str) -> list[list[int]]:
    """Collective (one fixed-size all_gather of int64 ``[W, _A_FIELDS]`` and one host read): every rank's record,
    after every rank learnt whether some rank refused its arguments. A refusing rank raises its own ``error``; every
    other rank a ValueError naming the refusing ranks, so no rank is left waiting in a collective of the step
    (a deadlock under NCCL / gloo, or a size mismatch that aborts the process) and none goes on alone."""
    mine = torch.zeros(_A_FIELDS, dtype=torch.int64, device=device)
    if error is not None or record is None:
        mine[_A_REFUSED] = 1
    else:
        mine.copy_(record)
    allr = torch.empty(W * _A_FIELDS, dtype=torch.int64, device=device)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ag(allr, mine, group=group)
    rows = allr.view(W, _A_FIELDS).tolist()
    if error is not None:
        raise error
    refused = [r for r in range(W) if rows[r][_A_REFUSED]]
    if refused:
        many = len(refused) > 1
        raise ValueError(f"{what}: rank{'s' if many else ''} {', '.join(map(str, refused))} of {W} refused "
                         f"{'their' if many else 'its'} arguments (the error on {'those ranks' if many else 'that rank'} "
                         f"names them); rank {rank} raises too, so that no rank is left waiting in a collective")
    return rows


def _check_tiling(rows: list[list[int]], what: str) -> None:
    """The records' shards tile ``[0, V)`` in rank order (V of rank 0's record); else a ValueError naming them."""
    V = rows[0][_A_VOCAB]
    spans = [(r[_A_START], r[_A_END]) for r in rows]
    if spans[0][0] != 0 or spans[-1][1] != V or any(spans[i][1] != spans[i + 1][0] for i in range(len(rows) - 1)):
        raise ValueError(f"{what}: the ranks' shards must tile [0, {V}) in rank order, got {spans}")


def _check_agreement(rows: list[list[int]], what: str) -> None:
    """Every rank's agreement record names one step: the same vocabulary, rows, canvas length and hidden size,
    shards tiling ``[0, V)`` in rank order, and the same slot ids / prefill flags and replicated state rows.

    Raises:
        ValueError: naming the field and every rank's value."""
    W = len(rows)
    for f, name in ((_A_VOCAB, "state.vocab_size"), (_A_ROWS, "the number of rows N (len(slots))"),
                    (_A_CL, "state.canvas_length"), (_A_HIDDEN, "state.hidden_size")):
        vals = [r[f] for r in rows]
        if len(set(vals)) != 1:
            raise ValueError(f"{what}: ranks disagree on {name}: {vals} (rank 0 first); every rank must run the same "
                             "step")
    _check_tiling(rows, what)
    for f, name in ((_A_INPUTS, "slots / prefill_done"), (_A_STATE, "the replicated SamplerState rows of slots "
                                                                      "(phase, step, canvases, params, ...)")):
        if len({r[f] for r in rows}) != 1:
            differ = [r for r in range(W) if rows[r][f] != rows[0][f]]
            raise ValueError(f"{what}: rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                             f"disagree{'' if len(differ) > 1 else 's'} "
                             f"with rank 0 on {name}; every rank must pass the same slots and prefill_done and hold an "
                             "identical replicated state")


#: SamplerState tensors a step reads or writes for its rows (the agreement digest; ``soft`` is the all_reduce's
#: output, equal on every rank by construction, and not digested).
_STATE_ROWS = ("phase", "step", "canvas_index", "stable_count", "num_emitted", "request_id", "seed", "t_min", "t_max",
               "entropy_bound", "confidence_threshold", "max_denoising_steps", "stability_threshold", "max_tokens",
               "eos_token_ids", "canvas", "commit_canvas", "prev_argmax")


def _agreement_record(state: SamplerState, slots, prefill_done, shard: VocabShard, device) -> torch.Tensor:
    """This rank's int64 agreement record (arguments already checked) on ``device``; the checksums are computed on
    the state's device (only the record moves)."""
    sdev = state.device
    idx = slots.to(sdev)
    rec = torch.tensor([0, shard.rank, shard.world_size, shard.vocab_size, shard.start, shard.end, slots.shape[0],
                        state.canvas_length, state.hidden_size, 0, 0], dtype=torch.int64, device=sdev)
    rec[_A_INPUTS] = _digest([slots, prefill_done], sdev)
    rec[_A_STATE] = _digest([getattr(state, k)[idx] for k in _STATE_ROWS], sdev)
    return rec.to(device)


def sampler_step_tp(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor, prefill_done: torch.Tensor,
                    embedding: torch.Tensor, *, shard: VocabShard, group=None, backend: str = "reference",
                    config=None, check_values: bool | None = None) -> StepOutput:
    """One sampler step on this rank's vocabulary shard; every rank of ``group`` calls it with its own shard.

    Collective: issues one ``all_gather`` (float64 ``[N, CL, 7]`` per rank) and one ``all_reduce(SUM)``
    (float32 ``[N, CL, hidden]``) on ``group``; no host sync. Every rank must pass the same ``slots`` /
    ``prefill_done`` / ``check_values`` and hold an identical replicated ``state`` (as all ranks do when they all
    run this step from the same start); every rank's state and returned :class:`StepOutput` are then identical.
    While the values are checked (``check_values``), that is checked too: first one small ``all_gather`` of a
    fixed-size int64 agreement record per rank (whether it refused its arguments, its shard, N, CL, hidden, and
    checksums of ``slots`` / ``prefill_done`` and of the state rows the step reads) and one host read, so a rank
    whose arguments are refused, or ranks that disagree, raise on EVERY rank before any collective of the step
    (unchecked, such a rank raised alone and the others waited in the all_gather: a deadlock until the group's
    timeout, or under gloo a size mismatch that aborted the process; under NCCL, silently different decisions).

    Args:
        state: :class:`SamplerState` replicated on every rank (``vocab_size`` = the GLOBAL V), mutated in place.
        slots: int64 [N]. prefill_done: bool [N].
        logits: float [N, CL, shard.size] — the logits of global ids ``[shard.start, shard.end)`` (soft-capped;
            vLLM's vocabulary padding columns removed).
        embedding: [shard.size, hidden] — the same rows of the tied embedding E.
        shard: this rank's :class:`VocabShard` (``shard.rank`` / ``world_size`` must match the group).
        group: ``torch.distributed`` process group (None: the default group).
        backend: local pass, ``"reference"`` (dense torch) or ``"triton"`` (streaming kernels; CUDA or the
            Triton interpreter).
        config: optional :class:`blockdiff.sampler.triton.config.SamplerConfig` for the triton backend.
        check_values: check the slot ids and the ranks' agreement (host reads and one small collective; None:
            unless a CUDA graph is being captured), the same on every rank. Unchecked ids are trusted, as in
            ``reference.sampler_step`` (the state is indexed with them by torch), and so is the agreement: a rank
            refusing its arguments then raises alone.

    Returns:
        :class:`blockdiff.sampler.StepOutput` — identical to ``reference.sampler_step`` on the unsharded logits
        up to the rounding notes in the module docstring.

    Raises:
        TypeError / ValueError: bad arguments (``config`` neither a ``SamplerConfig`` nor None: TypeError; an
            unknown ``backend``; a shard whose rank/world size disagrees with ``group``), raised by the rank whose
            arguments they are; while checking, every other rank then raises a ValueError naming that rank. Ranks
            that disagree on V, N, CL, hidden, the shards' tiling of ``[0, V)``, ``slots`` / ``prefill_done`` or
            the state rows: a ValueError on every rank naming the field (checking only).
        RuntimeError: torch.distributed not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sampler_step_tp needs an initialised torch.distributed process group")
    what = "sampler_step_tp"
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    error = None
    # (a non-bool check_values, refused below, still takes part in the agreement exchange)
    checking = check_values is not False and not (check_values is None and capturing())
    try:
        if check_values is not None and not isinstance(check_values, bool):
            raise TypeError(f"check_values must be a bool or None, got {type(check_values).__name__}")
        _check_tp_args(state, slots, logits, prefill_done, embedding, shard, checking)
        check_config(config)
        if backend not in STATS_BACKENDS:
            raise ValueError(f"backend must be one of {STATS_BACKENDS}, got {backend!r}")
        if (shard.rank, shard.world_size) != (rank, W):
            raise ValueError(f"shard is rank {shard.rank} of {shard.world_size}, the group says rank {rank} of {W}")
    except (TypeError, ValueError) as e:
        error = e
    if checking:
        dev = _record_device(group, state, logits)
        rec = None if error is not None else _agreement_record(state, slots, prefill_done, shard, dev)
        _check_agreement(_agree(group, W, rank, dev, rec, error, what), what)
    elif error is not None:
        raise error
    phase, T, seed, rid, cidx, step, active = row_inputs(state, slots)
    local, partial_fn = local_pass(backend, logits, embedding, T, seed, rid, cidx, step, active, shard, config)
    N, CL = slots.shape[0], state.canvas_length
    gathered = torch.empty(W * N, CL, NUM_FIELDS, dtype=torch.float64, device=logits.device)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = ag(gathered, local.packed.contiguous(), group=group, async_op=True)
    partial = partial_fn()                                        # overlaps the all_gather
    work.wait()
    comb = combine_statistics(gathered.view(W, N, CL, NUM_FIELDS), T, state.vocab_size)
    soft = (partial * comb.soft_weight[rank][..., None]).contiguous()
    dist.all_reduce(soft, op=dist.ReduceOp.SUM, group=group)
    soft = soft * math.sqrt(state.hidden_size)
    return finish_step(state, slots, prefill_done, phase, T, comb, soft)


def sampler_step_sharded(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor,
                         prefill_done: torch.Tensor, embedding: torch.Tensor, *, bounds: Sequence[int],
                         backend: str = "reference", config=None, check_values: bool | None = None) -> StepOutput:
    """All shards of a TP step in ONE process (no torch.distributed): the same local passes, the same combine,
    the all_gather replaced by a stack and the all_reduce by a rank-ordered sum. For tests and debugging.

    Args:
        logits: float [N, CL, V] and embedding [V, hidden] UNSHARDED; ``bounds`` (0, b_1, ..., V) split them.
        Others: as :func:`sampler_step_tp`.

    Raises:
        TypeError / ValueError: bad arguments or bounds (``config`` neither a ``SamplerConfig`` nor None: TypeError).
    """
    check_step_args(state, slots, logits, prefill_done, embedding, check_values=check_values)   # the whole V
    check_config(config)
    shards = make_shards(state.vocab_size, bounds)
    phase, T, seed, rid, cidx, step, active = row_inputs(state, slots)
    locals_, partials = [], []
    for sh in shards:
        lg, em = logits[..., sh.start:sh.end], embedding[sh.start:sh.end]
        loc, pf = local_pass(backend, lg, em, T, seed, rid, cidx, step, active, sh, config)
        locals_.append(loc)
        partials.append(pf())
    comb = combine_statistics(torch.stack([lo.packed for lo in locals_]), T, state.vocab_size)
    soft = partials[0] * comb.soft_weight[0][..., None]
    for r in range(1, len(shards)):
        soft = soft + partials[r] * comb.soft_weight[r][..., None]
    soft = soft * math.sqrt(state.hidden_size)
    return finish_step(state, slots, prefill_done, phase, T, comb, soft)


def check_shards_consistent(shard: VocabShard, group=None, device: torch.device | str = "cpu") -> None:
    """Collective, once at start-up (host sync): every rank's shard tiles ``[0, V)`` in rank order.

    A rank whose own shard is refused (not a :class:`VocabShard`, or naming another rank / world size than the
    group) raises its error after the exchange, and every other rank a ValueError naming it (it used to raise alone,
    before the collective, leaving the others waiting in it).

    Raises:
        TypeError: ``shard`` is not a VocabShard (on its rank). ValueError: shards overlap, leave gaps, disagree on V,
            or disagree with the group's rank/size (on every rank).
    """
    what = "check_shards_consistent"
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    error = rec = None
    try:
        if not isinstance(shard, VocabShard):
            raise TypeError(f"shard must be a VocabShard, got {type(shard).__name__}")
        if (shard.rank, shard.world_size) != (rank, W):
            raise ValueError(f"shard is rank {shard.rank} of {shard.world_size}, the group says rank {rank} of {W}")
        rec = torch.tensor([0, shard.rank, shard.world_size, shard.vocab_size, shard.start, shard.end]
                           + [0] * (_A_FIELDS - 6), dtype=torch.int64, device=device)
    except (TypeError, ValueError) as e:
        error = e
    rows = _agree(group, W, rank, device, rec, error, what)
    vs = [r[_A_VOCAB] for r in rows]
    if len(set(vs)) != 1:
        raise ValueError(f"ranks disagree on vocab_size: {vs}")
    _check_tiling(rows, what)
