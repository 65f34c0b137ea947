"""Counter-based random numbers of the sampler: Philox4x32-10, defined once, reproduced bit for bit by every backend.

Source: Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC'11) and the Random123
library (philox4x32, 10 rounds; known-answer vectors in Random123's ``kat_vectors``). Every draw is a pure
function of its coordinates, so a request's noise does not depend on its slot, on the other requests in the
batch, on the launch grid or on the backend (batch invariance, docs/ARCHITECTURE.md "Sampler semantics", "Random
numbers").

Arithmetic: uint32 words live in ``int64`` tensors (values in [0, 2**32)); the 32 x 32 -> 64-bit products of a
Philox round are split into 16-bit halves so that no intermediate leaves the int64 range (:func:`_mulhilo`).
The Triton backend uses ``tl.umulhi`` and wrapping uint32 multiplication for the same words.

Key / counter layout (all fields reduced modulo their width; documented limits are checked by
:class:`blockdiff.sampler.params.SamplingParams` and :class:`blockdiff.sampler.state.SamplerState`)::

    key     k0 = seed        & 0xFFFFFFFF            k1 = (seed >> 32) & 0xFFFFFFFF     (seed as uint64)
    counter c0 = token >> 2                          (GUMBEL stream; 0 for the per-position streams)
            c1 = position | stream << 16 | step << 18      position < 2**16, stream < 4, step < 2**14
            c2 = request_id & 0xFFFFFFFF
            c3 = (request_id >> 32) & 0xFFFF | (canvas_index & 0xFFFF) << 16

So a request may use at most 2**16 canvases (16.7 M tokens at canvas_length 256) before its canvas counter wraps,
and request ids are taken modulo 2**48 (the integration hashes vLLM's string ids to int64).

Streams (``stream`` field):

- ``GUMBEL`` (0): one Philox call per (position, group of 4 tokens); token ``t`` uses output word ``t & 3``.
  ``u = ((w >> 9) + 0.5) * 2**-23`` is a float32 in (0, 1), exact (23 bits + the half need 24 significant bits;
  the top 24 bits + 0.5 would need 25 and round ``2**24 - 0.5`` to 1.0), ``g = -log(-log(u))`` in float32
  (``min g = -log(-log(2**-24)) = -2.81``, ``max g = 16.6``, both finite).
- ``RENOISE`` (1): one Philox call per position (c0 = 0), key/counter with the step that renoises.
- ``INITIAL`` (2): one Philox call per position (c0 = 0, step = 0) for the fresh uniform canvas.

Random ids in [0, V) (:func:`ids_from_words`), exact integer method: ``x = w0 | w1 << 32`` (64 uniform bits) and
``id = floor(x * V / 2**64)`` computed exactly in 32-bit limbs ("multiply-shift", Lemire 2019, without the
rejection step): every id has probability ``floor`` or ``ceil`` of ``2**64 / V`` over ``2**64``, a relative bias
below ``V / 2**64`` (1.4e-14 for V = 262144). Requires ``V < 2**31``.
"""
from __future__ import annotations

import torch

__all__ = [
    "GUMBEL", "RENOISE", "INITIAL", "PHILOX_M0", "PHILOX_M1", "PHILOX_W0", "PHILOX_W1", "MASK32",
    "philox4x32_10", "make_key", "make_counter", "uniform_from_word", "gumbel_from_word", "ids_from_words",
    "gumbel_noise", "random_ids", "check_sizes", "as_int_tensor", "check_int_dtype", "COORDINATES",
    "as_int_coordinates", "check_int_coordinates", "num_rows",
]

GUMBEL = 0
RENOISE = 1
INITIAL = 2

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
MASK32 = 0xFFFFFFFF
PHILOX_ROUNDS = 10

#: Limits of the counter layout (see the module docstring).
MAX_POSITIONS = 1 << 16
MAX_STEPS = 1 << 14
MAX_VOCAB = 1 << 31


def as_int_tensor(name: str, v) -> torch.Tensor:
    """``v`` (an integer tensor, or an int / list of ints) as an int64 tensor, for the draws' coordinates (seed,
    request_id, canvas_index, step, position, token group, Philox words). No coercion: ``.to(torch.int64)`` truncated
    a float seed tensor (1.9 and 1.2 drew the same noise as seed 1) and read a bool one as 0 / 1.

    Raises:
        TypeError: ``v`` is a float, complex or bool tensor (or a value torch reads as one), or something torch
            cannot read as a tensor (names ``name``). ValueError: a Python int outside int64 (names ``name``).
    """
    if not isinstance(v, torch.Tensor):
        if isinstance(v, (bool, float, complex, str, bytes)) or v is None:
            raise TypeError(f"{name} must be an int or an integer tensor, got {type(v).__name__} ({v!r})")
        try:
            v = torch.as_tensor(v)
        except (ValueError, OverflowError) as e:  # a Python int beyond int64
            raise ValueError(f"{name} must hold int64 values (|v| < 2**63), got {v!r}") from e
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"{name} must be an int or an integer tensor, got {type(v).__name__}") from e
    check_int_dtype(name, v)
    return v.to(torch.int64)


def check_int_dtype(name: str, t: torch.Tensor) -> None:
    """Raise TypeError (naming ``name``) unless the tensor ``t`` has an integer dtype (not bool, float, complex)."""
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{name} must be an integer tensor (int64; no coercion: a float value is not truncated), got "
                        f"dtype {t.dtype}")


#: The per-row draw coordinates, in the order every draw function takes them.
COORDINATES = ("seed", "request_id", "canvas_index", "step")


def as_int_coordinates(seed, request_id, canvas_index, step) -> tuple[torch.Tensor, ...]:
    """The four per-row coordinates through :func:`as_int_tensor` (int64 tensors; errors name the coordinate)."""
    return tuple(as_int_tensor(n, v) for n, v in zip(COORDINATES, (seed, request_id, canvas_index, step)))


def num_rows(seed, request_id, canvas_index, step) -> int:
    """N, the rows of the four per-row coordinates (int64 tensors, read flattened): each holds N entries or one
    (broadcast to every row). A mismatch was torch's RuntimeError from inside the draw (``shape '[1, 2, 8]' is
    invalid for input of size 48``).

    Raises:
        ValueError: two coordinates with different entry counts, neither of them 1 (names them and the counts).
    """
    sizes = {n: t.numel() for n, t in zip(COORDINATES, (seed, request_id, canvas_index, step))}
    rows = {v for v in sizes.values() if v != 1}
    if len(rows) > 1:
        raise ValueError("seed, request_id, canvas_index and step must hold one entry per row (N each, or 1 for every "
                         "row), got " + ", ".join(f"{n} {v}" for n, v in sizes.items()))
    return rows.pop() if rows else 1


def check_int_coordinates(seed, request_id, canvas_index, step) -> None:
    """Raise TypeError naming the coordinate unless each of the four is an integer tensor: the kernels read them as
    int64 (``.to(tl.int64)``), which would truncate a float value. Host attribute reads only (no sync)."""
    for n, t in zip(COORDINATES, (seed, request_id, canvas_index, step)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be an integer tensor [N], got {type(t).__name__}")
        check_int_dtype(n, t)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product of the constant ``a`` and ``b``; b int64 holding uint32.

    ``a * b = t1 + t2 * 2**16`` with ``t1 = a_lo16 * b``, ``t2 = a_hi16 * b`` (both < 2**48), so every
    intermediate stays far inside int64.
    """
    t1 = b * (a & 0xFFFF)
    t2 = b * (a >> 16)
    mid = t1 + ((t2 & 0xFFFF) << 16)
    lo = mid & MASK32
    hi = (t2 >> 16) + (mid >> 32)
    return hi, lo


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32 with 10 rounds (Random123 ``philox4x32_R(10, ...)``).

    Args:
        c0, c1, c2, c3: counter words, int64 tensors (or Python ints) with values in [0, 2**32); broadcastable.
            Tensors and ints alike are reduced modulo 2**32 (a tensor word of -1 is 0xFFFFFFFF, as the int -1 is).
        k0, k1: key words, same convention.

    Returns:
        Four int64 tensors with values in [0, 2**32): the output words ``(x0, x1, x2, x3)``.

    Known answer (Random123): key (0, 0), counter (0, 0, 0, 0) -> 0x6627e8d5 0xe169c58d 0xbc57ac4c 0x9b00dbd8.
    """
    ts = [x for x in (c0, c1, c2, c3, k0, k1) if isinstance(x, torch.Tensor)]
    device = ts[0].device if ts else None

    def _t(name, x):
        if isinstance(x, torch.Tensor):  # reduced as the ints below: a word outside [0, 2**32) (a negative int64, or
            # one of 2**40) left the 16-bit-limb products' range and gave words outside [0, 2**32) (a negative word is
            # a negative uniform, a NaN Gumbel), where the same Python int was masked
            return as_int_tensor(name, x) & MASK32
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must be an int or an integer tensor, got {type(x).__name__} ({x!r})")
        return torch.tensor(x & MASK32, dtype=torch.int64, device=device)

    c0, c1, c2, c3, k0, k1 = (_t(n, x) for n, x in zip(("c0", "c1", "c2", "c3", "k0", "k1"), (c0, c1, c2, c3, k0, k1)))
    for r in range(PHILOX_ROUNDS):
        if r > 0:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def make_key(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Philox key words from ``seed`` (int64 tensor, read as uint64): ``(seed lo32, seed hi32)``.

    Raises:
        TypeError: ``seed`` not an integer tensor / int (:func:`as_int_tensor`).
    """
    seed = as_int_tensor("seed", seed)
    return seed & MASK32, (seed >> 32) & MASK32


def make_counter(request_id, canvas_index, step, position, stream: int, token_group=0):
    """Counter words ``(c0, c1, c2, c3)`` of the layout in the module docstring (int64 tensors, broadcast).

    Raises:
        TypeError: a coordinate that is not an integer tensor / int (:func:`as_int_tensor`), or a ``stream`` that is
            not an int. ValueError: ``stream`` outside [0, 4) (its 2-bit field: 4 was step + 1's counter of stream 0,
            a negative one a negative counter word).
    """
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(f"stream must be an int, got {type(stream).__name__} ({stream!r})")
    if not 0 <= stream < 4:
        raise ValueError(f"stream must be in [0, 4) (the counter's 2-bit stream field: GUMBEL {GUMBEL}, RENOISE "
                         f"{RENOISE}, INITIAL {INITIAL}), got {stream}")
    request_id = as_int_tensor("request_id", request_id)
    canvas_index = as_int_tensor("canvas_index", canvas_index)
    step = as_int_tensor("step", step)
    position = as_int_tensor("position", position)
    c0 = as_int_tensor("token_group", token_group) & MASK32
    c1 = (position & 0xFFFF) | (stream << 16) | ((step & (MAX_STEPS - 1)) << 18)
    c2 = request_id & MASK32
    c3 = ((request_id >> 32) & 0xFFFF) | ((canvas_index & 0xFFFF) << 16)
    return c0, c1, c2, c3


def uniform_from_word(w: torch.Tensor) -> torch.Tensor:
    """float32 uniform in (0, 1) from a 32-bit word: ``((w >> 9) + 0.5) * 2**-23`` (exact; min 2**-24)."""
    return ((w >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def gumbel_from_word(w: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` in float32 from a 32-bit word (see :func:`uniform_from_word`)."""
    u = uniform_from_word(w)
    return -torch.log(-torch.log(u))


def check_sizes(canvas_length: int | None = None, vocab_size: int | None = None, stream: int | None = None) -> None:
    """The host arguments of the draws (each checked unless None): ``canvas_length`` an int in [0, 2**16) (the
    counter's position field), ``vocab_size`` an int in [1, 2**31), ``stream`` :data:`RENOISE` or :data:`INITIAL`
    (a per-position stream). No coercion: ``int()`` read 2.9 as 2 (ids in [0, 2)), ``"5"`` as 5 and True as 1, and
    a canvas past 2**16 positions silently reused the noise of its first positions.

    Raises:
        TypeError: an argument that is not an int (a bool, a float, a str). ValueError: one out of its range.
    """
    for name, v, lo, hi in (("canvas_length", canvas_length, 0, MAX_POSITIONS), ("vocab_size", vocab_size, 1, MAX_VOCAB)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} ({v!r})")
        if not lo <= v < hi:
            raise ValueError(f"{name} must be in [{lo}, 2**{hi.bit_length() - 1}), got {v}")
    if stream is None:
        return
    if isinstance(stream, bool) or not isinstance(stream, int):  # (1.0 and True were a ValueError, as 0 is)
        raise TypeError(f"stream must be an int, RENOISE ({RENOISE}) or INITIAL ({INITIAL}), got "
                        f"{type(stream).__name__} ({stream!r})")
    if stream not in (RENOISE, INITIAL):
        raise ValueError(f"stream must be RENOISE ({RENOISE}) or INITIAL ({INITIAL}), got {stream!r}")


def ids_from_words(w0: torch.Tensor, w1: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exact ``floor((w0 | w1 << 32) * V / 2**64)`` in [0, V) as int64, for ``1 <= V < 2**31``.

    Limbs: ``(x * V) >> 64 = (w1 * V + ((w0 * V) >> 32)) >> 32``; ``w1 * V < 2**63`` and the sum stays below
    ``2**63 - 2**32``, so int64 never overflows.

    Raises:
        TypeError: ``vocab_size`` is not an int. ValueError: it is outside [1, 2**31) (:func:`check_sizes`).
    """
    check_sizes(vocab_size=vocab_size)
    v = vocab_size
    return (w1 * v + ((w0 * v) >> 32)) >> 32


def gumbel_noise(seed, request_id, canvas_index, step, canvas_length: int, vocab_size: int) -> torch.Tensor:
    """Gumbel noise of the GUMBEL stream for whole canvases: float32 ``[N, canvas_length, vocab_size]``.

    Args:
        seed, request_id, canvas_index, step: int64 tensors ``[N]`` (one entry per canvas row; one entry, or an int,
            is every row's: :func:`num_rows`).
        canvas_length, vocab_size: sizes (tokens).

    Returns:
        g with ``g[i, p, t] = gumbel_from_word(philox(key(seed[i]), counter(..., p, GUMBEL, t >> 2))[t & 3])``.
        Dense: the reference's memory is ``N * CL * V * 4`` bytes (plus int64 temporaries of ~V/4 words per
        position); the Triton backend generates the same numbers in registers.

    Raises:
        TypeError / ValueError: ``canvas_length`` or ``vocab_size`` not an int in its range (:func:`check_sizes`).
        TypeError: ``seed``, ``request_id``, ``canvas_index`` or ``step`` not an integer tensor (a float one is not
            truncated: :func:`as_int_tensor`). ValueError: they disagree on N (:func:`num_rows`).
    """
    check_sizes(canvas_length, vocab_size)
    seed, request_id, canvas_index, step = as_int_coordinates(seed, request_id, canvas_index, step)
    n = num_rows(seed, request_id, canvas_index, step)
    seed = seed.reshape(-1)
    dev = seed.device
    ngroups = (vocab_size + 3) // 4
    k0, k1 = make_key(seed)
    pos = torch.arange(canvas_length, device=dev, dtype=torch.int64)
    grp = torch.arange(ngroups, device=dev, dtype=torch.int64)
    c0, c1, c2, c3 = make_counter(
        torch.as_tensor(request_id, device=dev).reshape(-1, 1, 1),
        torch.as_tensor(canvas_index, device=dev).reshape(-1, 1, 1),
        torch.as_tensor(step, device=dev).reshape(-1, 1, 1),
        pos.view(1, -1, 1), GUMBEL, grp.view(1, 1, -1),
    )
    words = philox4x32_10(c0, c1, c2, c3, k0.view(-1, 1, 1), k1.view(-1, 1, 1))
    w = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(n, canvas_length, ngroups * 4)
    return gumbel_from_word(w[..., :vocab_size])


def random_ids(seed, request_id, canvas_index, step, canvas_length: int, vocab_size: int, stream: int) -> torch.Tensor:
    """Uniform random token ids ``[N, canvas_length]`` int64 in [0, V) of a per-position stream.

    Args:
        seed, request_id, canvas_index, step: int64 tensors ``[N]`` (one entry, or an int, is every row's:
            :func:`num_rows`).
        stream: :data:`RENOISE` or :data:`INITIAL` (for INITIAL, pass ``step = 0``).

    Position ``p`` of row ``i`` uses words 0 and 1 of ``philox(key(seed[i]), counter(..., p, stream, 0))``
    through :func:`ids_from_words`.

    Raises:
        ValueError: for another stream, a size out of range, or coordinates disagreeing on N (:func:`num_rows`).
        TypeError: a size or stream that is not an int (:func:`check_sizes`); ``seed``, ``request_id``,
            ``canvas_index`` or ``step`` not an integer tensor (:func:`as_int_tensor`).
    """
    check_sizes(canvas_length, vocab_size, stream)
    seed, request_id, canvas_index, step = as_int_coordinates(seed, request_id, canvas_index, step)
    num_rows(seed, request_id, canvas_index, step)
    seed = seed.reshape(-1)
    dev = seed.device
    k0, k1 = make_key(seed)
    pos = torch.arange(canvas_length, device=dev, dtype=torch.int64)
    c0, c1, c2, c3 = make_counter(
        torch.as_tensor(request_id, device=dev).reshape(-1, 1),
        torch.as_tensor(canvas_index, device=dev).reshape(-1, 1),
        torch.as_tensor(step, device=dev).reshape(-1, 1),
        pos.view(1, -1), stream, 0,
    )
    w0, w1, _, _ = philox4x32_10(c0, c1, c2, c3, k0.view(-1, 1), k1.view(-1, 1))
    w0, w1 = torch.broadcast_tensors(w0, w1)
    return ids_from_words(w0, w1, vocab_size)
