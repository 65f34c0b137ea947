"""Records shared by the tensor-parallel sampler's backends and its driver: a rank's vocabulary shard, the
split of the vocabulary over ranks, the per-position statistics a rank exchanges (:class:`LocalStats`, field
indices ``F_*``) and the communication volume of a step.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import rng

__all__ = ["VocabShard", "vocab_shard_bounds", "make_shards", "communication_bytes", "LocalStats", "NUM_FIELDS",
           "F_MAX", "F_SUM", "F_U", "F_ARGMAX", "F_GVAL", "F_GID", "F_STATUS", "STATUS_FINITE", "STATUS_BAD",
           "STATUS_ZMAX_INF", "STATUS_ZMAX_NEG_INF"]

#: Fields of the per-position statistics exchanged between ranks (float64 [N, CL, NUM_FIELDS]).
F_MAX, F_SUM, F_U, F_ARGMAX, F_GVAL, F_GID, F_STATUS = range(7)
NUM_FIELDS = 7

#: F_STATUS values: which statistics a rank holds for a position (docs/ARCHITECTURE.md "Sampler semantics", rule 1).
#: FINITE: of z = x / T, whose shard max is finite. BAD: a NaN / +inf logit in the shard (-inf is p = 0). ZMAX_INF: the
#: shard's max z = x / T is +inf; ZMAX_NEG_INF: it is -inf (every z is -inf, or no tokens, or every logit -inf). For
#: ZMAX_INF / ZMAX_NEG_INF the fields are of the shard's shifted z = (x - c) / T with c = the shard's max logit (F_MAX
#: holds c; m = 0, s = the ties at c, u = 0), which the combine compares across ranks; where every logit is -inf,
#: those of an empty shard (:meth:`LocalStats.empty`: c = -inf, s = 0, ids vocab_size).
STATUS_FINITE, STATUS_BAD, STATUS_ZMAX_INF, STATUS_ZMAX_NEG_INF = 0, 1, 2, 3


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



def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def vocab_shard_bounds(vocab_size: int, world_size: int, *, pad_to: int = 1) -> tuple[int, ...]:
    """Boundaries ``(b_0 = 0, ..., b_W = vocab_size)`` of vLLM's vocabulary-parallel split.

    The vocabulary is padded to a multiple of ``pad_to`` (vLLM: 64) and split into ``W`` equal parts of
    ``ceil(V_pad / W)``; rank r holds the real tokens ``[b_r, b_{r+1})`` (the last ranks may hold fewer, or 0).

    Raises:
        TypeError: an argument is not an int (a bool, a float: never truncated).
        ValueError: vocab_size < 1, world_size < 1 or pad_to < 1.
    """
    for name, v in (("vocab_size", vocab_size), ("world_size", world_size), ("pad_to", pad_to)):
        if not _is_int(v):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
    if vocab_size < 1 or world_size < 1 or pad_to < 1:
        raise ValueError(f"vocab_size, world_size and pad_to must be >= 1, got {vocab_size}, {world_size}, {pad_to}")
    v_pad = -(-vocab_size // pad_to) * pad_to
    per = -(-v_pad // world_size)
    return tuple(min(r * per, vocab_size) for r in range(world_size)) + (vocab_size,)


def make_shards(vocab_size: int, bounds: Sequence[int]) -> list[VocabShard]:
    """One :class:`VocabShard` per rank from boundaries ``(0, b_1, ..., vocab_size)`` (non-decreasing).

    Raises:
        TypeError: a bound is not an int (a bool, a float or a str: never truncated or parsed).
        ValueError: bounds not starting at 0, not ending at vocab_size, or decreasing.
    """
    b = list(bounds)
    for x in b:
        if not _is_int(x):
            raise TypeError(f"bounds must hold ints, got {type(x).__name__} ({x!r})")
    b = [int(x) for x in b]
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


@dataclass
class LocalStats:
    """Result of a rank's local pass over its shard.

    packed: float64 [N, CL, NUM_FIELDS] — m (max z; ZMAX_INF / ZMAX_NEG_INF: the shift c, the shard's max logit),
    s (sum exp(z - m)), u (sum exp(z - m)(z - m)), global id of the argmax, max(z + g), its global id, the status
    (``STATUS_*``). Empty shard: m = max(z+g) = -inf, s = u = 0, ids = vocab_size (never chosen), ZMAX_NEG_INF.
    m, inv_s: float32 [N, CL] (local softmax normalisers of z: 0 and 1 / ties where shifted); local_argmax: int64
    [N, CL] (shard-local id of the argmax, 0 for an empty shard); shift: float32 [N, CL], c of z = (x - c) / T
    (0 unless the shard's max z overflows).
    """

    packed: torch.Tensor
    m: torch.Tensor
    inv_s: torch.Tensor
    local_argmax: torch.Tensor
    shift: torch.Tensor

    @classmethod
    def empty(cls, N: int, CL: int, vocab_size: int, device: torch.device | str) -> "LocalStats":
        """The statistics of a shard without tokens (or of a step without positions): m = max(z + g) = -inf,
        s = u = 0, ids = ``vocab_size`` (never chosen by the combine), status ZMAX_NEG_INF (max z over no tokens), zero
        normalisers, shift and local argmax."""
        packed = torch.zeros(N, CL, NUM_FIELDS, dtype=torch.float64, device=device)
        packed[..., F_MAX] = float("-inf")
        packed[..., F_GVAL] = float("-inf")
        packed[..., F_ARGMAX] = vocab_size
        packed[..., F_GID] = vocab_size
        packed[..., F_STATUS] = STATUS_ZMAX_NEG_INF
        zf = torch.zeros(N, CL, dtype=torch.float32, device=device)
        return cls(packed, zf, zf, torch.zeros(N, CL, dtype=torch.int64, device=device), zf)
