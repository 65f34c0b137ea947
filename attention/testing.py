"""Test support shared by every backend's tests, the benchmarks, the notebooks and ``blockdiff demo --check``.

- :func:`make_batch` / :func:`make_batch_from_rows`: the one random batch builder (paged or contiguous K/V).
- :func:`check_close`: the tolerance rule, below (:func:`reference_pair`: the oracle and the eager baseline;
  :func:`lse_magnitude`: the scores' magnitude behind the LSE bound).
- :func:`make_underflow_batch`: a seen key whose weight underflows to 0 with non-finite V (the split merges' case).
- :func:`make_very_negative_scores_batch`: scores near -2e31 (a one-FMA key weight against a rounded max fails there).
- :func:`scale_v_per_sequence`: a batch's V scaled per sequence (mixed output magnitudes, for the per-sequence eager
  term).
- :func:`poison_v_inside_seq_lens` / :func:`check_nonfinite_matches_reference`: NaN / Inf V at keys inside
  ``seq_lens`` and the check of a backend's output on them against the reference (keys a row may not see
  contribute nothing).

``tests/attention/test_backends_contract.py`` runs every name of ``blockdiff.attention.BACKENDS`` through these (how
each runs on a machine: ``tests/attention/backend_matrix.py``); a backend's own tests add what only it has.

A backend output is accepted when its error against the high-precision oracle (fp64 on the same inputs) is at
most ``2 x`` the error of the same-precision eager PyTorch computation plus a representation tolerance
(FlashAttention-4's test rule), the eager error taken per sequence: an element of sequence ``i`` (its rows of
``cu_seqlens_q``) is held to ``2 x`` the eager computation's largest error over sequence ``i``'s rows (every head
and column), not over the batch, where one sequence of large outputs (V x 1000) lent its error to all the others.
A sequence whose eager error is 0 (one key: eager returns V exactly) keeps the representation term. The
representation term of an element is :data:`REPRESENTATION_ATOL` of the dtype, or ``eps(dtype) * |oracle|`` where
that is larger (outputs beyond 0.5 in bf16 / fp16): one rounding of an intermediate to the dtype, which a kernel
that feeds P to its P.V product in bf16 / fp16 makes, moves a large output by up to that even where eager PyTorch
is exact (a one-hot softmax at ``|scale|`` near ``MAX_SCALE``: FA4's online softmax scales after the raw row max, so
the top key's P is ``exp2`` of an fp32 rounding residual, not 1, and rounds; docs/tuning.md 7.54).
Non-finite values never pass. Elements where the eager baseline itself overflows
(fp16 scores beyond 65504) are compared as if eager had returned the oracle rounded to the dtype.

The LSE (float32 in every backend, whatever q's dtype) is accepted when it has the oracle's finiteness and its
error is at most an absolute floor (:data:`LSE_ATOL`: 1e-2 for bf16 / fp16 inputs, 1e-4 otherwise) plus the fp32
rounding of the scores behind it, ``sqrt(head_dim) * eps(float32) * M``, with
``M = logsumexp_j(|scale| |q| . |k_j|)`` over the row's keys (:func:`lse_magnitude`). Each score is a
``head_dim``-term fp32 dot product times ``scale``, whose rounding error is of the order
``sqrt(head_dim) * u * |scale| |q| . |k_j|`` (Higham and Mary's probabilistic bound, ``u = eps / 2``; the factor 2
as in the output rule). ``M`` bounds that magnitude over the keys the row sees, and ``|lse|`` too, so the term also
covers the fp32 rounding of the oracle's LSE (the reference returns it in float32) and of the backend's. At the
default scale with N(0, 1) q and k, ``M`` is about ``0.64 sqrt(head_dim) + log(keys)`` and the term is small against
the floor (3e-6 at head dim 16, 5e-5 at 512). At ``|scale|`` up to ``MAX_SCALE`` the LSE reaches ~1e5 (fp32 spacing
1/32 to 1/16), where the absolute floor alone failed the fp32 reference itself. A bound relative to ``|lse|`` is not
enough: the scores can cancel (a negative scale, a row whose keys score near 0), leaving ``|lse|`` small and the
scores' rounding large.
"""
from __future__ import annotations

import torch

from .reference import attention_reference

REPRESENTATION_ATOL = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6,
                       torch.float64: 1e-12}
#: The LSE's absolute floor by q's dtype (the LSE itself is float32 in every backend).
LSE_ATOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-4}


def _to64(x):
    return None if x is None else x.to(torch.float64)


def reference_pair(q, k_cache, v_cache, **kw):
    """``(oracle_out, oracle_lse, eager_out)``: fp64 oracle and same-precision eager reference."""
    kw = {k: v for k, v in kw.items() if k not in ("out", "return_lse", "upcast")}
    o64, lse64 = attention_reference(_to64(q), _to64(k_cache), _to64(v_cache), return_lse=True, **kw)
    eager = attention_reference(q, k_cache, v_cache, upcast=False, **kw)
    return o64, lse64, eager


def lse_magnitude(q, k_cache, v_cache, **kw) -> torch.Tensor:
    """``M [num_heads, total_q]`` float32: ``logsumexp_j(|scale| * |q| . |k_j|)`` over each row's keys, the
    magnitude of the fp32 scores behind the row's LSE (at least the largest ``|scale| sum_d |q_d k_jd|`` of a key
    the row sees, at most that plus ``log(keys)``; ``-inf`` for a row with no key). :func:`check_close`'s LSE bound
    is ``LSE_ATOL + sqrt(head_dim) * eps(float32) * M``. One fp64 reference call on ``|q|``, ``|k|``."""
    kw = {k: v for k, v in kw.items() if k not in ("out", "return_lse", "upcast")}
    scale = kw.pop("scale", None)
    scale = q.shape[-1] ** -0.5 if scale is None else abs(float(scale))
    _, m = attention_reference(_to64(q).abs(), _to64(k_cache).abs(), _to64(v_cache), scale=scale, return_lse=True,
                               **kw)
    return m


def _row_sequence(cu_seqlens_q, total_q: int, device) -> torch.Tensor:
    """``[total_q]`` int64: the sequence of each query row (rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``)."""
    lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(device=device, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens, output_size=total_q)


def check_close(out, q, k_cache, v_cache, *, lse=None, factor: float = 2.0, **kw) -> dict:
    """Assert ``out`` (and ``lse``) match the oracle within the tolerance rule; return the error numbers.

    The eager term is per sequence: an element of sequence ``i`` (its rows of ``cu_seqlens_q``) is bounded by
    ``factor * eager_err_i`` plus its representation term, ``eager_err_i`` the eager computation's largest error
    over sequence ``i``'s rows (every head and column), so a large-magnitude sequence no longer lends its error
    to a small one (one wrong by 0.05 beside a sequence of V x 1000 passed the batch-wide bound). Per sequence,
    not per (sequence, head), because a sequence is the unit a backend can mix up (pages, offsets, lengths) while a
    head's group of as few as ``head_dim_v`` elements makes the eager maximum a noisier yardstick (the measured
    ratios of both choices: docs/tuning.md 7.55). Each element's bound is at most the batch-wide one
    (``eager_err_i <= eager_err``).

    Returns:
        ``err``, ``eager_err`` (the batch's largest eager error) and ``bound`` (the largest element's bound) of the
        output; ``seq_err``, ``seq_eager_err`` and ``seq_bound`` (per sequence: the largest error, the eager
        error, the largest element's bound; 0.0, 0.0 and ``atol`` for a sequence of no rows) and
        ``excess`` (the largest ``error / its bound``, at most 1); with ``lse``, also ``lse_err`` and
        ``lse_excess`` (the largest ``lse error / its bound``, at most 1; see the module docstring for the LSE's
        bound).

    Raises:
        AssertionError: non-finite output, or an element's error above ``factor * eager_err_i`` (its sequence's)
            plus its representation term ``max(atol, eps(dtype) * |oracle|)``, the message naming the sequence,
            its eager error and the element's error; the LSE's finiteness unlike the oracle's, or its error above
            ``LSE_ATOL + sqrt(head_dim) * eps(float32) * M``.
    """
    assert torch.isfinite(out).all(), "output has non-finite values (unwritten or NaN)"
    o64, lse64, eager = reference_pair(q, k_cache, v_cache, **kw)
    atol = REPRESENTATION_ATOL[q.dtype]
    diff = (out.to(torch.float64) - o64).abs()
    err = diff.max().item() if out.numel() else 0.0
    # Where the eager baseline overflows (fp16 QK^T beyond 65504, e.g. scale 1.0 with large head_dim) its error
    # is undefined (NaN would reject every backend): count those elements as the oracle rounded to the dtype.
    eager = torch.where(torch.isfinite(eager), eager, o64.to(eager.dtype))
    eager_diff = (eager.to(torch.float64) - o64).abs()
    eager_err = eager_diff.max().item() if out.numel() else 0.0
    # the eager term per sequence: the largest eager error over the sequence's rows (all heads and columns)
    cu = kw["cu_seqlens_q"]
    seq_of_row = _row_sequence(cu, out.shape[0], o64.device)
    zeros = torch.zeros(cu.shape[0] - 1, dtype=torch.float64, device=o64.device)

    def per_seq(x, init=zeros):  # [total_q, ...] -> [B]: the largest entry of each sequence's rows (init: none)
        return init.scatter_reduce(0, seq_of_row, x.flatten(1).amax(1), "amax")

    seq_eager = per_seq(eager_diff)
    # the representation term per element: atol, or eps(dtype) |oracle| where that is larger (module docstring)
    rep = torch.clamp(o64.abs() * torch.finfo(q.dtype).eps, min=atol)
    elem_bound = factor * seq_eager[seq_of_row][:, None, None] + rep
    over = diff > elem_bound
    if over.any():
        ratio = torch.where(over, diff / elem_bound, torch.zeros_like(diff))
        i = int(ratio.flatten().argmax())
        r_, h_, c_ = (int(x) for x in torch.unravel_index(torch.tensor(i), diff.shape))
        s = int(seq_of_row[r_])
        bad_seqs = sorted(set(seq_of_row[over.flatten(1).any(1)].tolist()))
        raise AssertionError(
            f"sequence {s} (rows {int(cu[s])}:{int(cu[s + 1])}): error {diff[r_, h_, c_].item():.3e} at row {r_}, head "
            f"{h_}, column {c_} (oracle value {o64[r_, h_, c_].item():.4g}) > {factor} x the sequence's eager error "
            f"{seq_eager[s].item():.3e} + representation {rep[r_, h_, c_].item():.1e} (atol {atol:.1e}); "
            f"{int(over.sum())} elements over in sequences {bad_seqs[:8]}; max abs error {err:.3e}, batch eager error "
            f"{eager_err:.3e}")
    bound = elem_bound.max().item() if out.numel() else factor * eager_err + atol
    res = {"err": err, "eager_err": eager_err, "bound": bound, "seq_err": per_seq(diff).tolist(),
           "seq_eager_err": seq_eager.tolist(), "seq_bound": per_seq(elem_bound, torch.full_like(zeros, atol)).tolist(),
           "excess": (diff / elem_bound).max().item() if out.numel() else 0.0}
    if lse is not None:
        l64 = lse64.to(torch.float64)
        fin = torch.isfinite(l64)
        assert torch.equal(torch.isfinite(lse), fin), "lse finiteness differs from the oracle (-inf = no key)"
        lerr, excess = 0.0, 0.0
        if fin.any():
            diff = (lse.to(torch.float64)[fin] - l64[fin]).abs()
            # the fp32 rounding of the scores (module docstring); NaN in diff (a NaN lse) fails the comparison
            lbound = LSE_ATOL[q.dtype] + q.shape[-1] ** 0.5 * torch.finfo(torch.float32).eps * \
                lse_magnitude(q, k_cache, v_cache, **kw)[fin]
            lerr, excess = diff.max().item(), (diff / lbound).max().item()
            i = int((diff / lbound).argmax())
            assert (diff <= lbound).all(), (f"lse error {diff[i].item():.3e} > bound {lbound[i].item():.3e} "
                                            f"(oracle lse {l64[fin][i].item():.6g}); largest error {lerr:.3e}")
        res["lse_err"], res["lse_excess"] = lerr, excess
    return res


# ----------------------------------------------------------------------------------------------- batch builder
BLOCK_TABLE_PADS = ("garbage", "zeros", "nan_page")


def _int_list(name: str, values, n: int | None = None) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        out = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}") from None
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints, got {type(v).__name__} ({v!r})")
    if n is not None and len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries, expected one per sequence ({n})")
    return out


def _int_at_least(name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def make_batch(
    seq_lens,
    q_lens,
    *,
    causal=None,
    num_causal_q=None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    head_dim_v: int | None = None,
    page_size: int = 4,
    paged: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    extra_blocks: int = 1,
    extra_columns: int = 1,
    block_table_pad: str = "garbage",
    permute: bool = True,
    poison_unused: bool = False,
) -> dict:
    """Random batch in the attention contract's layout: the keyword arguments of ``attention(**batch)``.

    The one batch builder of tests, benchmarks and notebooks (docs/ARCHITECTURE.md, "The attention contract").
    The K/V of every query token is already in the cache (``seq_lens`` include the query tokens), as vLLM
    writes it before attention. Values are N(0, 1), drawn in float32 and rounded to ``dtype``.

    Args:
        seq_lens: per sequence, keys including its query tokens (ints >= q_len; a list or a 1-D tensor).
        q_lens: per sequence, query tokens (ints >= 0).
        causal: bool, or one bool per sequence: every row of the sequence causal (prefill, commit) or
            bidirectional (denoise canvas). Give this or ``num_causal_q``.
        num_causal_q: int, or one int per sequence in ``[0, q_len]``: the first rows causal, the rest
            bidirectional (commit rows then the next canvas in one sequence).
        num_heads, num_kv_heads: query and KV heads (>= 1; not checked for divisibility, so error paths of
            the backends stay testable).
        head_dim, head_dim_v: head dimension of q/k and of v (``head_dim_v=None``: ``head_dim``).
        page_size: tokens per cache page (>= 1); also the row unit of ``extra_blocks`` in the contiguous form.
        paged: paged cache with ``block_table`` (True) or contiguous varlen K/V with ``cu_seqlens_k`` (False).
        dtype: dtype of q, k_cache and v_cache.
        device: where every tensor lives.
        seed: same seed, device and arguments -> the same tensors. Page ids and padding come from a CPU
            generator seeded ``seed``; q, k, v (in that order) from a generator on ``device`` seeded
            ``seed + 1`` (drawing on the device keeps 100k-token benchmark caches fast to build).
        extra_blocks: unused pages in the pool beyond the sequences' own (paged), or unused trailing rows
            ``extra_blocks * page_size`` (contiguous): a kernel that reads past its keys reads real numbers.
        extra_columns: block-table columns beyond the longest sequence's pages.
        block_table_pad: what fills each block-table row past the sequence's pages: ``"garbage"`` (random
            valid page ids: a kernel that follows them computes a wrong, detectable result), ``"zeros"``
            (page 0, vLLM's padding) or ``"nan_page"`` (one more all-NaN page appended to the pool).
        permute: page ids of a sequence are a random permutation of the pool (a long-running serving
            cache) rather than consecutive.
        poison_unused: NaN in every K/V cache row no sequence owns (past ``seq_len`` in its last page,
            unused pages, unused contiguous rows): reading one poisons the output.

    Returns:
        dict with ``q`` [total_q, num_heads, head_dim]; ``k_cache`` [num_blocks, page_size, num_kv_heads,
        head_dim] and ``v_cache`` [..., head_dim_v] with ``block_table`` [B, max_blocks] int32 (paged), or
        ``k_cache`` [total_k, num_kv_heads, head_dim] / ``v_cache`` with ``cu_seqlens_k`` [B + 1] int32
        (contiguous); ``cu_seqlens_q`` [B + 1] int32; ``seq_lens`` [B] int32; and ``causal`` [B] bool or
        ``num_causal_q`` [B] int32 (whichever was given). Everything on ``device``.

    Raises:
        TypeError: a length, count or size is not an int (bool is rejected), ``dtype`` is not a torch dtype.
        ValueError: ``seq_lens`` / ``q_lens`` / the causal spec differ in length; ``q_len < 0`` or
            ``seq_len < q_len``; both or neither of ``causal`` / ``num_causal_q``; ``num_causal_q`` outside
            ``[0, q_len]``; a size < 1; ``extra_blocks`` / ``extra_columns`` < 0; an unknown
            ``block_table_pad``.
    """
    q_lens = _int_list("q_lens", q_lens)
    B = len(q_lens)
    seq_lens = _int_list("seq_lens", seq_lens, B)
    for b, (s, ql) in enumerate(zip(seq_lens, q_lens)):
        if ql < 0 or s < ql:
            raise ValueError(f"sequence {b}: need 0 <= q_len <= seq_len (seq_lens include the query tokens), "
                             f"got q_len {ql}, seq_len {s}")
    if (causal is None) == (num_causal_q is None):
        raise ValueError("give exactly one of causal (bool per sequence) or num_causal_q (int per sequence)")
    if causal is not None:
        flags = [causal] * B if isinstance(causal, bool) else (
            causal.tolist() if isinstance(causal, torch.Tensor) else list(causal))
        if len(flags) != B:
            raise ValueError(f"causal has {len(flags)} entries, expected one per sequence ({B})")
        if not all(isinstance(c, bool) for c in flags):
            raise TypeError(f"causal must be a bool or bools per sequence, got {flags!r}")
    else:
        counts = [num_causal_q] * B if isinstance(num_causal_q, int) and not isinstance(num_causal_q, bool) \
            else _int_list("num_causal_q", num_causal_q, B)
        for b, (n, ql) in enumerate(zip(counts, q_lens)):
            if not 0 <= n <= ql:
                raise ValueError(f"num_causal_q[{b}] must be in [0, q_len={ql}], got {n}")
    num_heads, num_kv_heads, head_dim, page_size = (
        _int_at_least(k, v, 1) for k, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                                            ("head_dim", head_dim), ("page_size", page_size)))
    head_dim_v = head_dim if head_dim_v is None else _int_at_least("head_dim_v", head_dim_v, 1)
    extra_blocks = _int_at_least("extra_blocks", extra_blocks, 0)
    extra_columns = _int_at_least("extra_columns", extra_columns, 0)
    if block_table_pad not in BLOCK_TABLE_PADS:
        raise ValueError(f"block_table_pad must be one of {BLOCK_TABLE_PADS}, got {block_table_pad!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    device = torch.device(device)

    index_gen = torch.Generator(device="cpu").manual_seed(seed)
    data_gen = torch.Generator(device=device).manual_seed(seed + 1)

    def randn(*shape):
        return torch.randn(*shape, generator=data_gen, device=device, dtype=torch.float32).to(dtype)

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    cu_q = [0]
    for ql in q_lens:
        cu_q.append(cu_q[-1] + ql)
    out = {"q": randn(cu_q[-1], num_heads, head_dim)}
    if paged:
        pages = [-(-s // page_size) for s in seq_lens]
        used = sum(pages)
        num_blocks = used + extra_blocks
        ids = torch.randperm(num_blocks, generator=index_gen) if permute else torch.arange(num_blocks)
        width = max(1, max(pages, default=0) + extra_columns)
        if block_table_pad == "garbage" and num_blocks > 0:
            table = torch.randint(0, num_blocks, (B, width), generator=index_gen, dtype=torch.int32)
        else:  # "zeros"; "nan_page" fills below once the page exists
            table = torch.zeros(B, width, dtype=torch.int32)
        off = 0
        for b, n in enumerate(pages):
            table[b, :n] = ids[off:off + n].to(torch.int32)
            if block_table_pad == "nan_page":
                table[b, n:] = num_blocks
            off += n
        k = randn(num_blocks, page_size, num_kv_heads, head_dim)
        v = randn(num_blocks, page_size, num_kv_heads, head_dim_v)
        if block_table_pad == "nan_page":
            k = torch.cat([k, torch.full_like(k[:1], float("nan"))])
            v = torch.cat([v, torch.full_like(v[:1], float("nan"))])
        if poison_unused:
            owned = torch.zeros(k.shape[0], page_size, dtype=torch.bool)
            for b, s in enumerate(seq_lens):
                pos = torch.arange(s)
                owned[table[b, pos // page_size].long(), pos % page_size] = True
            owned = owned.to(device)
            k[~owned] = float("nan")
            v[~owned] = float("nan")
        out.update(k_cache=k, v_cache=v, block_table=table.to(device))
    else:
        cu_k = [0]
        for s in seq_lens:
            cu_k.append(cu_k[-1] + s)
        rows = cu_k[-1] + extra_blocks * page_size
        k = randn(rows, num_kv_heads, head_dim)
        v = randn(rows, num_kv_heads, head_dim_v)
        if poison_unused:
            k[cu_k[-1]:] = float("nan")
            v[cu_k[-1]:] = float("nan")
        out.update(k_cache=k, v_cache=v, cu_seqlens_k=int32(cu_k))
    out.update(cu_seqlens_q=int32(cu_q), seq_lens=int32(seq_lens))
    if causal is not None:
        out["causal"] = torch.tensor(flags, dtype=torch.bool, device=device)
    else:
        out["num_causal_q"] = int32(counts)
    return out


def make_batch_from_rows(rows, **kwargs) -> dict:
    """:func:`make_batch` from ``(context_len, q_len, num_causal_q)`` triples, one per sequence.

    ``seq_len = context_len + q_len`` (the context is the keys before the first query token). Every other
    keyword goes to :func:`make_batch` (``causal`` / ``num_causal_q`` must not be given: the triples carry it).

    Raises:
        TypeError / ValueError: a row is not a triple of ints, plus whatever :func:`make_batch` raises.
    """
    if "causal" in kwargs or "num_causal_q" in kwargs or "seq_lens" in kwargs or "q_lens" in kwargs:
        raise TypeError("make_batch_from_rows takes lengths and causal row counts from the rows only")
    ctxs, q_lens, counts = [], [], []
    for i, row in enumerate(rows):
        if not isinstance(row, (tuple, list)) or len(row) != 3:
            raise TypeError(f"rows[{i}] must be a (context_len, q_len, num_causal_q) triple, got {row!r}")
        c, ql, n = _int_list(f"rows[{i}]", row)
        if c < 0:
            raise ValueError(f"rows[{i}]: context_len must be >= 0, got {c}")
        ctxs.append(c)
        q_lens.append(ql)
        counts.append(n)
    return make_batch([c + ql for c, ql in zip(ctxs, q_lens)], q_lens, num_causal_q=counts, **kwargs)


def scale_v_per_sequence(inp: dict, factors) -> dict:
    """A copy of a :func:`make_batch` batch whose V of sequence ``b`` is multiplied by ``factors[b]``: sequences of
    mixed output magnitudes in one batch (:func:`check_close` bounds each by its own eager error).

    Paged: every page of the sequence's ``block_table`` row that holds its keys (make_batch gives each sequence pages
    of its own); contiguous: its ``cu_seqlens_k`` rows. Multiplied in float32 (float64 for a float64 cache), rounded
    to the cache's dtype; NaN stays NaN. Other tensors are shared with ``inp``.

    Raises:
        ValueError: not one factor per sequence.
    """
    seq_lens = inp["seq_lens"].tolist()
    factors = [float(f) for f in factors]
    if len(factors) != len(seq_lens):
        raise ValueError(f"factors has {len(factors)} entries, expected one per sequence ({len(seq_lens)})")
    v = inp["v_cache"].clone()
    for b, (S, f) in enumerate(zip(seq_lens, factors)):
        if inp.get("block_table") is not None:
            idx = inp["block_table"][b, :-(-S // v.shape[1])].long()
        else:
            k0 = int(inp["cu_seqlens_k"][b])
            idx = torch.arange(k0, k0 + S, device=v.device)
        v[idx] = (v[idx].to(torch.promote_types(v.dtype, torch.float32)) * f).to(v.dtype)
    return dict(inp, v_cache=v)


def make_underflow_batch(head_dim: int, seq_len: int, key: int, values=(float("nan"),), *, page_size: int | None = None,
                         device="cpu", seed: int = 1):
    """A batch whose seen key ``key`` carries non-finite V entries while its softmax weight underflows to exactly 0
    in fp32: the split-KV merges' zero-weight case (docs/tuning.md 2.33).

    One bidirectional sequence of 4 query tokens over ``seq_len`` keys, 2 query heads on 1 KV head, bf16, scale 8:
    every query is ``e_0``; key 5 is ``64 e_0`` (score 512), every other key scores 0, so every key but 5 weighs
    ``exp(-512) = 0``. V is random (``seed``) except ``V[key, 0, 3 + i] = values[i]``. The reference gives NaN in
    those columns of every row (``p * v`` with ``p = 0``).

    Args:
        head_dim: q / k / v head dim (>= 3 + len(values)). seq_len: keys (a multiple of ``page_size`` when paged).
        key: the poisoned key, in ``[0, seq_len)``, not 5. values: the entries for columns 3, 4, ...
        page_size: None for contiguous K/V (``cu_seqlens_k``), else pages in a permuted ``block_table``.
        device: where the tensors live.

    Returns:
        ``(q [4, 2, head_dim], k_cache, v_cache, kwargs)``: the caches ``[seq_len, 1, head_dim]`` or ``[pages,
        page_size, 1, head_dim]``; kwargs ``cu_seqlens_q``, ``seq_lens``, ``causal``, ``scale`` and
        ``cu_seqlens_k`` or ``block_table``, for :func:`blockdiff.attention.attention`.

    Raises:
        ValueError: ``key`` out of range or 5, too few columns, or ``seq_len`` not a multiple of ``page_size``.
    """
    if not 0 <= key < seq_len or key == 5 or seq_len <= 5:
        raise ValueError(f"key must be in [0, seq_len) and not 5 (the dominant key), got key {key}, seq_len {seq_len}")
    if head_dim < 3 + len(values):
        raise ValueError(f"head_dim must be >= {3 + len(values)} for {len(values)} values, got {head_dim}")
    if page_size is not None and seq_len % page_size:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of page_size ({page_size})")
    H, Hk, Lq = 2, 1, 4
    q = torch.zeros(Lq, H, head_dim, dtype=torch.bfloat16)
    q[:, :, 0] = 1.0
    k = torch.zeros(seq_len, Hk, head_dim, dtype=torch.bfloat16)
    k[5, :, 0] = 64.0
    v = torch.randn(seq_len, Hk, head_dim, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    for i, x in enumerate(values):
        v[key, 0, 3 + i] = x
    kw = dict(cu_seqlens_q=torch.tensor([0, Lq], dtype=torch.int32),
              seq_lens=torch.tensor([seq_len], dtype=torch.int32), causal=torch.tensor([False]), scale=8.0)
    if page_size is None:
        kw["cu_seqlens_k"] = torch.tensor([0, seq_len], dtype=torch.int32)
    else:
        n = seq_len // page_size
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
        kp, vp = torch.empty(n, page_size, Hk, head_dim, dtype=k.dtype), torch.empty(n, page_size, Hk, head_dim,
                                                                                  dtype=v.dtype)
        kp[perm], vp[perm] = k.view(n, page_size, Hk, head_dim), v.view(n, page_size, Hk, head_dim)
        k, v = kp, vp
        kw["block_table"] = perm.to(torch.int32)[None]
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return q.to(device), k.to(device), v.to(device), {n: move(t) for n, t in kw.items()}


def make_very_negative_scores_batch(seq_lens, q_lens, *, q_sign: int = 1, seed: int = 0, **kwargs) -> dict:
    """:func:`make_batch` with every score near -2e31: q = ``q_sign`` * 1e15, k = -1e15 (1 + u / 2), u uniform in
    [0, 1) (seeded by ``seed``, as the batch is). Scores of ~1e31-1e32 are finite and inside the contract; each row's
    softmax is one-hot on its least negative key (at scale ``q_sign``: ``q_sign = -1`` with scale -1 gives the same
    scores). A kernel weighing keys ``exp2(fma(s, c, -round(max * c)))`` gives NaN rows here (docs/ARCHITECTURE.md
    section 4, "Scores beyond ~2^31 in log2 units").

    Args:
        seq_lens, q_lens: as :func:`make_batch`. q_sign: 1 or -1. seed: the batch's and the keys' noise seed.
        kwargs: more :func:`make_batch` arguments (``dtype`` bf16 or fp32: entries of 1e15 need their range).

    Raises:
        ValueError: ``q_sign`` not 1 or -1, or a ``dtype`` whose largest value is below 1e16 (fp16), plus whatever
            :func:`make_batch` raises.
    """
    if q_sign not in (1, -1):
        raise ValueError(f"q_sign must be 1 or -1, got {q_sign!r}")
    dtype = kwargs.get("dtype", torch.bfloat16)
    if torch.finfo(dtype).max < 1e16:
        raise ValueError(f"dtype must hold entries of 1e15 (bf16 or fp32), got {dtype}")
    inp = make_batch(seq_lens, q_lens, seed=seed, **kwargs)
    u = torch.rand(inp["k_cache"].shape, generator=torch.Generator().manual_seed(seed))
    inp["q"] = torch.full_like(inp["q"], 1e15 * q_sign)
    inp["k_cache"] = (-1e15 * (1 + 0.5 * u)).to(dtype).to(inp["k_cache"].device)
    return inp


def poison_v_inside_seq_lens(inp: dict, seed: int, per_seq: int = 6) -> tuple[dict, list[tuple]]:
    """A copy of a :func:`make_batch` batch whose V cache holds NaN / +Inf / -Inf at keys *inside* ``seq_lens``
    (the contract's "keys a row may not see contribute nothing" checks, docs/ARCHITECTURE.md section 4).

    Per non-empty sequence, ``per_seq`` entries, cycling over three key spans: among its query rows (a causal
    row's future keys, on the diagonal key blocks), up to 300 keys before its first query row (window edges) and
    anywhere in ``[0, seq_len)``; each at a random KV head and column, the values cycling NaN, +Inf, -Inf.
    Paged (``block_table``) or contiguous (``cu_seqlens_k``) caches; deterministic for a ``seed`` (a CPU
    ``torch.Generator``).

    Returns:
        ``(batch, positions)``: the batch with a poisoned clone of ``v_cache`` (other tensors shared), and one
        ``(sequence, key, kv_head, column, value)`` per entry, keys relative to the sequence.
    """
    v = inp["v_cache"].clone()
    g = torch.Generator().manual_seed(seed)
    paged = inp.get("block_table") is not None
    seq_lens = inp["seq_lens"].tolist()
    cu_q = inp["cu_seqlens_q"].tolist()
    vals = (float("nan"), float("inf"), -float("inf"))
    positions = []
    for b, S in enumerate(seq_lens):
        if S == 0:
            continue
        ctx = S - (cu_q[b + 1] - cu_q[b])
        spans = [(ctx, S), (max(0, ctx - 300), max(ctx, 1)), (0, S)]
        for i in range(per_seq):
            lo, hi = spans[i % 3]
            key = min(S - 1, lo + int(torch.randint(0, max(1, hi - lo), (1,), generator=g)))
            head = int(torch.randint(0, v.shape[-2], (1,), generator=g))
            col = int(torch.randint(0, v.shape[-1], (1,), generator=g))
            val = vals[len(positions) % 3]
            if paged:
                P = v.shape[1]
                v[int(inp["block_table"][b, key // P]), key % P, head, col] = val
            else:
                v[int(inp["cu_seqlens_k"][b]) + key, head, col] = val
            positions.append((b, key, head, col, val))
    return dict(inp, v_cache=v), positions


def check_nonfinite_matches_reference(out, bad: dict, *, lse=None, **kw) -> int:
    """Check a backend's ``out`` on a batch ``bad`` whose V holds NaN / +-Inf (:func:`poison_v_inside_seq_lens`)
    against the reference of the contract (docs/ARCHITECTURE.md section 4: a key outside a row's interval contributes
    nothing, NaN / Inf V included): exactly the reference's NaN, +Inf and -Inf entries, and every other entry (and
    ``lse``, when given) within :func:`check_close`'s tolerance rule of the reference of the caches with the
    non-finite V entries zeroed (and K's NaN stale rows, where a batch has them, made finite).

    Args:
        out: ``[total_q, num_heads, head_dim_v]``, the backend's output on ``bad``.
        bad: the batch (:func:`make_batch`'s keys) the backend ran on.
        lse: ``[num_heads, total_q]`` float32 or None.
        **kw: the call's other keywords (``window_size``, ``bidirectional_window``, ...), passed to the reference.

    Returns:
        The number of non-finite reference entries (callers assert that some row did see a poisoned key).

    Raises:
        AssertionError: an entry non-finite in only one of the two (the counts and the first rows / heads named:
            a poisoned output entry left unwritten shows as an extra NaN), or the finite part out of tolerance.
    """
    from . import attention  # the public dispatcher (this module is imported by the package)
    ref = attention(**bad, backend="reference", **kw)
    for f in (torch.isnan, torch.isposinf, torch.isneginf):
        extra, missing = f(out) & ~f(ref), f(ref) & ~f(out)
        assert not extra.any() and not missing.any(), (
            f"{f.__name__}: {int(extra.sum())} entries only in the output (rows "
            f"{extra.any(-1).nonzero()[:8, 0].tolist()}, heads {extra.any(-1).nonzero()[:8, 1].tolist()}), "
            f"{int(missing.sum())} only in the reference (rows {missing.any(-1).nonzero()[:8, 0].tolist()}); "
            "poisoned output entries left unwritten show as extra NaN")
    fin = torch.isfinite(ref)
    assert fin.any(), "the reference has no finite entry"
    vc = bad["v_cache"]
    clean = dict(bad, v_cache=torch.where(torch.isfinite(vc), vc, torch.zeros_like(vc)),
                 k_cache=torch.nan_to_num(bad["k_cache"]))
    o_clean = attention(**clean, backend="reference", **kw).to(out.dtype)
    check_close(torch.where(fin, out, o_clean), **clean, lse=lse, **kw)
    return int((~fin).sum())

