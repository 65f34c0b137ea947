"""Tensor-parallel sampler step: the denoising step on vocabulary shards, exactly the single-GPU decisions.

Under tensor parallelism (vLLM TP) rank r of W holds the logits of a contiguous vocabulary slice
``[vocab_start_r, vocab_end_r)`` (the LM head is column-parallel) and the same rows of the tied embedding E.
Gathering the logits would move ``N * CL * V * 4`` bytes per step (1 GiB for 4 canvases at V = 262144);
this module moves only per-position statistics and one hidden-sized vector per position:

1. Local pass (per rank, per canvas position, over the shard only) of ``z = float32(logits) / T``:
   ``m_r = max z``, ``s_r = sum exp(z - m_r)``, ``u_r = sum exp(z - m_r) (z - m_r)``, the argmax of z with its
   GLOBAL id (first maximum), the Gumbel-max candidate ``max(z + g)`` with its GLOBAL id — the noise g is drawn
   by :mod:`blockdiff.sampler.rng` at the global token id, so it is bit-identical to the single-GPU noise —
   and a non-finite flag. Plus the locally normalised soft-embedding partial
   ``q_r = (exp(z - m_r) / s_r) @ E_r`` ([N, CL, hidden] fp32; one-hot(argmax_r) for T = 0 rows).
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
   transitions — is the sampler's own shared code (:func:`blockdiff.sampler.common.accept_by_entropy`,
   :func:`~blockdiff.sampler.common.convergence`, :func:`~blockdiff.sampler.common.apply_step`), run on the
   replicated :class:`~blockdiff.sampler.state.SamplerState` of every rank with identical inputs, so every rank
   reaches identical decisions and state.

On 2 GPUs (one process per GPU, NCCL; every process sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 first): ``source bench/device_env.sh; python3 -m pytest -m gpu tests/sampler/test_tp.py -s``
(decisions identical to one GPU at V = 262144, canvas 256) and ``python3 bench/bench_sampler_tp.py`` (2 GPUs vs 1).
Not yet run on GPUs (issue 10): CI runs the same combine over 2 gloo processes on the CPU.

Communication per step (N rows, CL positions, W ranks, payload sizes): all_gather of ``N * CL * 56`` bytes per
rank into ``W * N * CL * 56`` (56 KiB sent / 112 KiB gathered at N = 4, CL = 256, W = 2) and one all_reduce of
``N * CL * hidden * 4`` bytes (11.5 MB at hidden 2816; a ring moves ~``2 (W - 1) / W`` of it per rank),
independent of the vocabulary size (gathering the logits instead: ``N * CL * V * 4`` = 1 GiB at V = 262144).
No host synchronisation on the step path.

Exactness (vs :func:`blockdiff.sampler.reference.sampler_step` on the unsharded logits): argmax, Gumbel sample,
renoise ids, failure flags are bit-identical (elementwise float32 z and z + g are computed by the same
operations; maxima and first-index ties combine exactly). Entropies agree to float32 rounding (summation
order differs), hence acceptance and convergence are identical unless an entropy sum lies within rounding of
a threshold. Soft embeddings: p is rounded to E's dtype as in the reference, the
partial GEMMs keep fp32 outputs (the reference rounds its output to E's dtype once), so the error is at most
the reference's.

Backends of the local pass (explicit; no fallback): ``"reference"`` (dense torch over the shard, this module)
and ``"triton"`` (:mod:`blockdiff.sampler.tp.triton`: a streaming statistics kernel with a vocabulary offset,
plus the fused soft-embedding GEMM of :mod:`blockdiff.sampler.triton.kernels`).

Sources: online softmax (Milakov & Gimelshein 2018, arXiv:1805.02867); Gumbel-max; vocabulary-parallel
LM head / embedding (Megatron-LM, Shoeybi et al. 2019; vLLM ``VocabParallelEmbedding``); sampler semantics:
ARCHITECTURE.md "Sampler semantics".
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .. import rng
from ..common import DenoiseResult, accept_by_entropy, apply_step, convergence, temperature
from ..state import SamplerState, StepOutput

__all__ = [
    "VocabShard", "vocab_shard_bounds", "make_shards", "gumbel_noise_shard", "local_statistics",
    "soft_partial", "combine_statistics", "CombinedStats", "finish_step", "sampler_step_tp",
    "sampler_step_sharded", "check_shards_consistent", "set_safe_nccl_env", "NUM_FIELDS", "STATS_BACKENDS",
    "communication_bytes",
]

#: Fields of the per-position statistics exchanged between ranks (float64 [N, CL, NUM_FIELDS]).
F_MAX, F_SUM, F_U, F_ARGMAX, F_GVAL, F_GID, F_BAD = range(7)
NUM_FIELDS = 7
STATS_BACKENDS = ("reference", "triton")


def set_safe_nccl_env() -> None:
    """Disable NVLink SHARP / multicast paths (NVLS, symmetric-memory multicast, NVSHMEM NVLS).

    Sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1`` in
    ``os.environ``; call in every process BEFORE ``torch.distributed.init_process_group("nccl")``.
    """
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


# ---------------------------------------------------------------------------------------------- shards
@dataclass(frozen=True)
class VocabShard:
    """The vocabulary slice ``[start, end)`` of ``rank`` among ``world_size`` ranks (global ``vocab_size``).

    ``end - start`` may be 0 (a rank holding only vocabulary padding). Raises ValueError on bad bounds.
    """

    vocab_size: int
    start: int
    end: int
    rank: int = 0
    world_size: int = 1

    def __post_init__(self):
        for name in ("vocab_size", "start", "end", "rank", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"VocabShard.{name} must be an int, got {type(v).__name__}")
        if not 1 <= self.vocab_size < rng.MAX_VOCAB:
            raise ValueError(f"vocab_size must be in [1, 2**31), got {self.vocab_size}")
        if not 0 <= self.start <= self.end <= self.vocab_size:
            raise ValueError(f"shard bounds must satisfy 0 <= start <= end <= vocab_size={self.vocab_size}, "
                             f"got [{self.start}, {self.end})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")

    @property
    def size(self) -> int:
        """Tokens in this shard."""
        return self.end - self.start


def vocab_shard_bounds(vocab_size: int, world_size: int, *, pad_to: int = 1) -> tuple[int, ...]:
    """Boundaries ``(b_0 = 0, ..., b_W = vocab_size)`` of vLLM's vocabulary-parallel split.

    The vocabulary is padded to a multiple of ``pad_to`` (vLLM: 64) and split into ``W`` equal parts of
    ``ceil(V_pad / W)``; rank r holds the real tokens ``[b_r, b_{r+1})`` (the last ranks may hold fewer, or 0).

    Raises:
        ValueError: vocab_size < 1, world_size < 1 or pad_to < 1.
    """
    if vocab_size < 1 or world_size < 1 or pad_to < 1:
        raise ValueError(f"vocab_size, world_size and pad_to must be >= 1, got {vocab_size}, {world_size}, {pad_to}")
    v_pad = -(-vocab_size // pad_to) * pad_to
    per = -(-v_pad // world_size)
    return tuple(min(r * per, vocab_size) for r in range(world_size)) + (vocab_size,)


def make_shards(vocab_size: int, bounds: Sequence[int]) -> list[VocabShard]:
    """One :class:`VocabShard` per rank from boundaries ``(0, b_1, ..., vocab_size)`` (non-decreasing).

    Raises:
        ValueError: bounds not starting at 0, not ending at vocab_size, or decreasing.
    """
    b = [int(x) for x in bounds]
    if len(b) < 2 or b[0] != 0 or b[-1] != vocab_size or any(b[i] > b[i + 1] for i in range(len(b) - 1)):
        raise ValueError(f"bounds must be non-decreasing from 0 to vocab_size={vocab_size}, got {tuple(b)}")
    W = len(b) - 1
    return [VocabShard(vocab_size, b[r], b[r + 1], r, W) for r in range(W)]


def communication_bytes(num_rows: int, canvas_length: int, hidden_size: int, world_size: int) -> dict:
    """Bytes one rank sends/receives per step: ``{"all_gather_bytes", "all_reduce_bytes"}`` (payload sizes).

    all_gather: ``W * N * CL * NUM_FIELDS * 8`` (the gathered tensor); all_reduce: ``N * CL * hidden * 4``
    (the reduced tensor; a ring moves about ``2 (W - 1) / W`` of it per rank).
    """
    return {"all_gather_bytes": world_size * num_rows * canvas_length * NUM_FIELDS * 8,
            "all_reduce_bytes": num_rows * canvas_length * hidden_size * 4}


# ---------------------------------------------------------------------------------------------- local pass
def gumbel_noise_shard(seed, request_id, canvas_index, step, canvas_length: int, vocab_start: int,
                       vocab_end: int) -> torch.Tensor:
    """Gumbel noise of the GUMBEL stream for global token ids ``[vocab_start, vocab_end)``.

    Equals ``rng.gumbel_noise(seed, request_id, canvas_index, step, CL, V)[..., vocab_start:vocab_end]``
    bit for bit (same Philox counters: the group of 4 of the GLOBAL id, word ``id & 3``) without generating
    the other tokens. Returns float32 ``[N, canvas_length, vocab_end - vocab_start]``.

    Raises:
        ValueError: ``vocab_start > vocab_end`` or negative bounds.
    """
    if not 0 <= vocab_start <= vocab_end:
        raise ValueError(f"need 0 <= vocab_start <= vocab_end, got [{vocab_start}, {vocab_end})")
    seed = torch.as_tensor(seed).to(torch.int64).reshape(-1)
    dev = seed.device
    n = seed.shape[0]
    if vocab_end == vocab_start:
        return torch.empty(n, canvas_length, 0, dtype=torch.float32, device=dev)
    g0, g1 = vocab_start >> 2, ((vocab_end - 1) >> 2) + 1
    k0, k1 = rng.make_key(seed)
    pos = torch.arange(canvas_length, device=dev, dtype=torch.int64)
    grp = torch.arange(g0, g1, device=dev, dtype=torch.int64)
    c0, c1, c2, c3 = rng.make_counter(
        torch.as_tensor(request_id, device=dev).reshape(-1, 1, 1),
        torch.as_tensor(canvas_index, device=dev).reshape(-1, 1, 1),
        torch.as_tensor(step, device=dev).reshape(-1, 1, 1),
        pos.view(1, -1, 1), rng.GUMBEL, grp.view(1, 1, -1),
    )
    words = rng.philox4x32_10(c0, c1, c2, c3, k0.view(-1, 1, 1), k1.view(-1, 1, 1))
    w = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(n, canvas_length, (g1 - g0) * 4)
    off = vocab_start - 4 * g0
    return rng.gumbel_from_word(w[..., off:off + vocab_end - vocab_start])


@dataclass
class LocalStats:
    """Result of a rank's local pass over its shard.

    packed: float64 [N, CL, NUM_FIELDS] — m (max z), s (sum exp(z - m)), u (sum exp(z - m)(z - m)), global id of
    the argmax, max(z + g), its global id, non-finite flag (1.0 / 0.0). Empty shard: m = max(z+g) = -inf,
    s = u = 0, ids = vocab_size (never chosen). m, inv_s: float32 [N, CL] (local softmax normalisers);
    local_argmax: int64 [N, CL] (shard-local id of the argmax, 0 for an empty shard).
    """

    packed: torch.Tensor
    m: torch.Tensor
    inv_s: torch.Tensor
    local_argmax: torch.Tensor


def _scaled_logits(logits: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """``z = float32(logits) / T`` ([N, CL, Vs] float32), T = 0 rows divided by 1 — as the reference."""
    greedy = T == 0
    return logits.to(torch.float32) / torch.where(greedy, torch.ones_like(T), T)[:, None, None]


def local_statistics(logits: torch.Tensor, T: torch.Tensor, seed: torch.Tensor, request_id: torch.Tensor,
                     canvas_index: torch.Tensor, step: torch.Tensor, shard: VocabShard) -> LocalStats:
    """Dense torch local pass (backend ``"reference"``) over a shard's logits.

    Args:
        logits: float [N, CL, shard.size] (the shard's logits, already soft-capped). T: float32 [N] (0 = greedy).
        seed, request_id, canvas_index, step: integer [N] RNG coordinates of the rows.
        shard: the :class:`VocabShard` (its ``start`` turns local ids into global ids).

    Returns:
        :class:`LocalStats`. Memory: a few ``[N, CL, shard.size]`` float32 temporaries (and the Philox int64
        temporaries of :func:`gumbel_noise_shard`).
    """
    N, CL, Vs = logits.shape
    dev = logits.device
    f64 = torch.float64
    if Vs == 0:
        packed = torch.zeros(N, CL, NUM_FIELDS, dtype=f64, device=dev)
        packed[..., F_MAX] = float("-inf")
        packed[..., F_GVAL] = float("-inf")
        packed[..., F_ARGMAX] = shard.vocab_size
        packed[..., F_GID] = shard.vocab_size
        zf = torch.zeros(N, CL, dtype=torch.float32, device=dev)
        return LocalStats(packed, zf, zf, torch.zeros(N, CL, dtype=torch.int64, device=dev))
    x = logits.to(torch.float32)
    bad = ~torch.isfinite(x).all(-1)        # on the logits, as the reference (not on z, which may overflow)
    z = x / torch.where(T == 0, torch.ones_like(T), T)[:, None, None]
    amax = z.argmax(-1)                                          # first maximum: ties to the lowest id
    m = z.gather(-1, amax[..., None]).squeeze(-1)
    d = z - m[..., None]
    e = torch.exp(d)
    s = e.sum(-1)
    u = torch.where(e == 0, 0.0, e * d).sum(-1)       # p = 0 adds nothing: z = -inf (x / T overflow) gives 0 * -inf
    g = gumbel_noise_shard(seed, request_id, canvas_index, step, CL, shard.start, shard.end)
    y = z + g
    gi = y.argmax(-1)
    gv = y.gather(-1, gi[..., None]).squeeze(-1)
    packed = torch.stack([m.to(f64), s.to(f64), u.to(f64), (amax + shard.start).to(f64), gv.to(f64),
                          (gi + shard.start).to(f64), bad.to(f64)], dim=-1)
    return LocalStats(packed, m, 1.0 / s, amax)


def soft_partial(logits: torch.Tensor, embedding: torch.Tensor, T: torch.Tensor, local: LocalStats) -> torch.Tensor:
    """Locally normalised soft-embedding partial ``q_r = p_r @ E_r``, float32 [N, CL, hidden] (dense torch).

    ``p_r = exp(z - m_r) / s_r`` over the shard (one-hot(local argmax) on T = 0 rows), cast to E's dtype (as
    :func:`blockdiff.sampler.reference.soft_embedding_reference`), products accumulated and returned in fp32.
    Unscaled (no ``sqrt(hidden)``). An empty shard gives zeros.
    """
    N, CL, Vs = logits.shape
    hidden = embedding.shape[-1]
    if Vs == 0:
        return torch.zeros(N, CL, hidden, dtype=torch.float32, device=logits.device)
    z = _scaled_logits(logits, T)
    p = torch.exp(z - local.m[..., None]) * local.inv_s[..., None]
    onehot = torch.nn.functional.one_hot(local.local_argmax, Vs).to(torch.float32)
    p = torch.where((T == 0)[:, None, None], onehot, p)
    return _matmul_fp32_out(p.to(embedding.dtype), embedding)


_MM_OUT_DTYPE_OK: bool | None = None


def _matmul_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with float32 output for a, b of one dtype: products of the (bf16/fp16) values accumulated in fp32,
    never rounded back to the narrow dtype (the shards' partials are summed afterwards, so rounding each one
    would double the reference's single output rounding). CUDA: ``torch.mm(..., out_dtype=torch.float32)``
    (tensor cores) where this torch has it, else the inputs widened to fp32; CPU: inputs widened to fp32."""
    global _MM_OUT_DTYPE_OK
    if b.dtype == torch.float32:
        return torch.matmul(a, b)
    a2 = a.reshape(-1, a.shape[-1])
    if a.is_cuda:
        if _MM_OUT_DTYPE_OK is None:
            try:
                torch.mm(a2[:1], b[:, :1], out_dtype=torch.float32)
                _MM_OUT_DTYPE_OK = True
            except (TypeError, RuntimeError, NotImplementedError):
                _MM_OUT_DTYPE_OK = False
        if _MM_OUT_DTYPE_OK:
            return torch.mm(a2, b, out_dtype=torch.float32).reshape(*a.shape[:-1], b.shape[-1])
    return torch.matmul(a2.to(torch.float32), b.to(torch.float32)).reshape(*a.shape[:-1], b.shape[-1])


# ---------------------------------------------------------------------------------------------- combine
@dataclass
class CombinedStats:
    """Global per-position results combined from every rank's statistics (identical on every rank).

    argmax, sampled: int64 [N, CL] global ids (sampled = argmax on T = 0 rows). entropy: float32 [N, CL] nats
    (0 on T = 0 rows, NaN where any logit of the position is non-finite). bad: bool [N, CL] non-finite.
    soft_weight: float32 [W, N, CL] — rank r's locally normalised partial times ``soft_weight[r]`` summed over
    ranks is ``softmax(z) @ E`` (one-hot on the owner of the argmax for T = 0 rows).
    """

    argmax: torch.Tensor
    sampled: torch.Tensor
    entropy: torch.Tensor
    bad: torch.Tensor
    soft_weight: torch.Tensor


def combine_statistics(gathered: torch.Tensor, T: torch.Tensor, vocab_size: int) -> CombinedStats:
    """Exact merge of the per-rank statistics (ARCHITECTURE.md sampler steps 2-3 over the whole vocabulary).

    Args:
        gathered: float64 [W, N, CL, NUM_FIELDS], rank-major (see :class:`LocalStats`.packed).
        T: float32 [N] temperatures (0 = greedy).
        vocab_size: global V (ids >= V are "no candidate").

    Returns:
        :class:`CombinedStats`. Ties of the maximum across ranks go to the lowest global id, which is what
        ``argmax`` over the unsharded vocabulary returns. Entropy: ``log Z - sum_r w_r (u_r + (m_r - M) s_r) / Z``
        with ``w_r = exp(m_r - M)``, ``Z = sum_r w_r s_r``, in float64, then float32.
    """
    m, s, u, aid, gv, gid, badf = gathered.unbind(-1)             # each [W, N, CL]
    bad = (badf != 0).any(0)
    M = m.max(0).values
    none = torch.full_like(aid, float(vocab_size))
    argmax = torch.where(m == M, aid, none).min(0).values
    G = gv.max(0).values
    sampled = torch.where(gv == G, gid, none).min(0).values
    found = argmax < vocab_size
    argmax = torch.where(found, argmax, 0.0).to(torch.int64)
    sampled = torch.where(sampled < vocab_size, sampled, 0.0).to(torch.int64)
    w = torch.exp(m - M)                                          # 0 for empty shards (m = -inf)
    live = w > 0
    ws = torch.where(live, w * s, 0.0)
    Z = ws.sum(0)
    A = torch.where(live, w * (u + (m - M) * s), 0.0).sum(0)
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
    # as the reference: non-finite logits, or a softmax left undefined by z = x / T overflowing (NaN entropy)
    row_failed = comb.bad.any(-1) | torch.isnan(comb.entropy).any(-1)
    accepted = accept_by_entropy(comb.entropy, state.entropy_bound[slots]) & ~row_failed[:, None]
    renoise = rng.random_ids(seed, rid, cidx, step, CL, V, rng.RENOISE)
    next_canvas = torch.where(accepted, comb.sampled, renoise)
    mean_entropy = comb.entropy.mean(-1)
    converged, stable_count = convergence(state, slots, comb.argmax, mean_entropy)
    res = DenoiseResult(accepted=accepted, entropy=comb.entropy, argmax=comb.argmax, sampled=comb.sampled,
                        next_canvas=next_canvas, row_failed=row_failed, converged=converged,
                        stable_count=stable_count, mean_entropy=mean_entropy, temperature=T, soft=soft)
    return apply_step(state, slots, prefill_done, res, phase)


# ---------------------------------------------------------------------------------------------- backends
def _local_pass(backend: str, logits, embedding, T, seed, rid, cidx, step, active, shard: VocabShard,
                config=None) -> tuple[LocalStats, Callable[[], torch.Tensor]]:
    """(LocalStats, a thunk computing the unscaled soft partial) of one shard with the chosen backend."""
    if backend == "reference":
        local = local_statistics(logits, T, seed, rid, cidx, step, shard)
        return local, lambda: soft_partial(logits, embedding, T, local)
    if backend == "triton":
        from . import triton as tp_triton
        local = tp_triton.local_statistics_triton(logits, T, seed, rid, cidx, step, active, shard, config)
        return local, lambda: tp_triton.soft_partial_triton(logits, embedding, T, local, active, config)
    raise ValueError(f"backend must be one of {STATS_BACKENDS}, got {backend!r}")


def _check_tp_args(state, slots, logits, prefill_done, embedding, shard: VocabShard) -> None:
    """Shapes/dtypes of a sharded step (host metadata only). Raises TypeError / ValueError naming the argument."""
    if not isinstance(state, SamplerState):
        raise TypeError(f"state must be a SamplerState, got {type(state).__name__}")
    if not isinstance(shard, VocabShard):
        raise TypeError(f"shard must be a VocabShard, got {type(shard).__name__}")
    for name, t in (("slots", slots), ("logits", logits), ("prefill_done", prefill_done), ("embedding", embedding)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != state.device.type:
            raise ValueError(f"{name} is on {t.device}, the state on {state.device}")
    if shard.vocab_size != state.vocab_size:
        raise ValueError(f"shard.vocab_size ({shard.vocab_size}) must equal state.vocab_size ({state.vocab_size})")
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise TypeError(f"slots must be a 1-D int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}")
    n = slots.shape[0]
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if logits.dim() != 3 or tuple(logits.shape) != (n, state.canvas_length, shard.size):
        raise ValueError(f"logits must have shape [N={n}, canvas_length={state.canvas_length}, shard size="
                         f"{shard.size}] (this rank's vocabulary slice [{shard.start}, {shard.end})), "
                         f"got {tuple(logits.shape)}")
    if prefill_done.dtype != torch.bool or tuple(prefill_done.shape) != (n,):
        raise ValueError(f"prefill_done must be a bool tensor of shape [{n}], got {prefill_done.dtype} "
                         f"{tuple(prefill_done.shape)}")
    if not embedding.is_floating_point():
        raise TypeError(f"embedding must be floating point, got {embedding.dtype}")
    if embedding.dim() != 2 or tuple(embedding.shape) != (shard.size, state.hidden_size):
        raise ValueError(f"embedding must have shape [shard size={shard.size}, hidden_size={state.hidden_size}] "
                         f"(rows [{shard.start}, {shard.end}) of E), got {tuple(embedding.shape)}")


def _row_inputs(state: SamplerState, slots: torch.Tensor):
    from ..state import DENOISE
    phase = state.phase[slots].clone()
    T = temperature(state, slots)
    return (phase, T, state.seed[slots], state.request_id[slots], state.canvas_index[slots], state.step[slots],
            phase == DENOISE)


def sampler_step_tp(state: SamplerState, slots: torch.Tensor, logits: torch.Tensor, prefill_done: torch.Tensor,
                    embedding: torch.Tensor, *, shard: VocabShard, group=None, backend: str = "reference",
                    config=None) -> StepOutput:
    """One sampler step on this rank's vocabulary shard; every rank of ``group`` calls it with its own shard.

    Collective: issues one ``all_gather`` (float64 ``[N, CL, 7]`` per rank) and one ``all_reduce(SUM)``
    (float32 ``[N, CL, hidden]``) on ``group``; no host sync. Every rank must pass the same ``slots`` /
    ``prefill_done`` and hold an identical replicated ``state`` (as all ranks do when they all run this step
    from the same start); every rank's state and returned :class:`StepOutput` are then identical.

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
        config: optional ``blockdiff.sampler.triton.kernels.SamplerConfig`` for the triton backend.

    Returns:
        :class:`blockdiff.sampler.StepOutput` — identical to ``reference.sampler_step`` on the unsharded logits
        up to the rounding notes in the module docstring.

    Raises:
        TypeError / ValueError: bad arguments; a shard whose rank/world size disagrees with ``group``.
        RuntimeError: torch.distributed not initialised.
    """
    import torch.distributed as dist

    _check_tp_args(state, slots, logits, prefill_done, embedding, shard)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sampler_step_tp needs an initialised torch.distributed process group")
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    if (shard.rank, shard.world_size) != (rank, W):
        raise ValueError(f"shard is rank {shard.rank} of {shard.world_size}, the group says rank {rank} of {W}")
    phase, T, seed, rid, cidx, step, active = _row_inputs(state, slots)
    local, partial_fn = _local_pass(backend, logits, embedding, T, seed, rid, cidx, step, active, shard, config)
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
                         backend: str = "reference", config=None) -> StepOutput:
    """All shards of a TP step in ONE process (no torch.distributed): the same local passes, the same combine,
    the all_gather replaced by a stack and the all_reduce by a rank-ordered sum. For tests and debugging.

    Args:
        logits: float [N, CL, V] and embedding [V, hidden] UNSHARDED; ``bounds`` (0, b_1, ..., V) split them.
        Others: as :func:`sampler_step_tp`.

    Raises:
        TypeError / ValueError: bad arguments or bounds.
    """
    shards = make_shards(state.vocab_size, bounds)
    for sh in shards:
        _check_tp_args(state, slots, logits[..., sh.start:sh.end], prefill_done, embedding[sh.start:sh.end], sh)
    phase, T, seed, rid, cidx, step, active = _row_inputs(state, slots)
    locals_, partials = [], []
    for sh in shards:
        lg, em = logits[..., sh.start:sh.end], embedding[sh.start:sh.end]
        loc, pf = _local_pass(backend, lg, em, T, seed, rid, cidx, step, active, sh, config)
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

    Raises:
        ValueError: shards overlap, leave gaps, disagree on V, or disagree with the group's rank/size.
    """
    import torch.distributed as dist

    W, rank = dist.get_world_size(group), dist.get_rank(group)
    if (shard.rank, shard.world_size) != (rank, W):
        raise ValueError(f"shard is rank {shard.rank} of {shard.world_size}, the group says rank {rank} of {W}")
    mine = torch.tensor([shard.vocab_size, shard.start, shard.end], dtype=torch.int64, device=device)
    allb = torch.empty(W * 3, dtype=torch.int64, device=device)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ag(allb, mine, group=group)
    rows = allb.view(W, 3).tolist()
    if any(r[0] != shard.vocab_size for r in rows):
        raise ValueError(f"ranks disagree on vocab_size: {[r[0] for r in rows]}")
    if rows[0][1] != 0 or rows[-1][2] != shard.vocab_size or any(rows[i][2] != rows[i + 1][1] for i in range(W - 1)):
        raise ValueError(f"shards must tile [0, {shard.vocab_size}) in rank order, got {[(r[1], r[2]) for r in rows]}")
