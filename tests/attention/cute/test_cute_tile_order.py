"""The cute backend's batch order (blockdiff.attention.cute.tile_order; ``CuteConfig.batch_order="work"``: FA4's
varlen tile scheduler takes the sequences longest tiles first through its ``virtual_batch_idx_ptr``).

* CPU (CI, no flash-attn-4): the permutation function (a permutation, int32, ordered by its key, ties and empty
  sequences in batch order, the key equal to the mean spans of ``masks.key_range``, no host read); the one-launch
  Triton kernel (``tile_order_triton``, under the Triton interpreter) equal to the torch reference exactly on fuzzed
  metadata (ties, empty and one-row sequences, every window kind, both modes, batches beyond one block, lengths at
  the exact rule's bounds, out-of-domain garbage) and both equal to a host sort on exact fractions, and compiled for
  sm_90a offline without spills; the config field (validation, a switch not a tile field, ``"auto"``: the work order
  for the roles kernel only, part of the compile key, one sequence resolves to ``"given"``) and the launch (the
  permutation is the last aux tensor);
* compile-only for sm_90a (where flash-attn-4 and nvidia-cutlass-dsl are installed, skipped in CI): the default
  and roles kernels with the permutation keep the given order's registers, spills and shared memory;
* GPU (``python3 -m pytest -m gpu``, on the H200): outputs and LSEs bit-identical to ``"given"`` on random mixed
  batches (more than 31 sequences, empty ones, both tile orders) for the default kernels (hd 128, hd 256 with a
  window) and the hd-512 kernels (split-value, roles), split-KV (the default merge, cluster) included; the function in a CUDA
  graph; a captured call replayed with the metadata changed in place, equal to an eager ``"given"`` call each time;
  the Triton kernel one launch, captured in a CUDA graph and replayed with new metadata (several programs).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca
from blockdiff.attention.cute import tile_order as to
from blockdiff.attention.cute import tile_order_triton as tot
from blockdiff.attention.masks import key_range
from blockdiff.attention.testing import check_close

from fractions import Fraction

from cute_helpers import HAVE_FA4, capture_graph, compile_for_sm90_or_skip, gpu_batch, needs_gpu

WORK = dict(batch_order="work")
GIVEN = dict(batch_order="given")


def _meta(rows):
    """``(cu_seqlens_q, seq_lens, num_causal_q)`` int32 from ``(ctx, q_len, ncq)`` rows."""
    q_lens = [ql for _, ql, _ in rows]
    cu = torch.tensor([0] + list(torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()), dtype=torch.int32)
    return (cu, torch.tensor([c + ql for c, ql, _ in rows], dtype=torch.int32),
            torch.tensor([n for _, _, n in rows], dtype=torch.int32))


# --- CPU: the permutation --------------------------------------------------------------------------------------
def test_mixed_batch_runs_canvases_then_the_commit_then_the_prefill():
    """``mixed_global_ctx8k``'s batch (docs/ARCHITECTURE.md section 8; prefill first in batch order): the two
    canvases over 8k keys, then the commit (causal over 8k), then the 4,096-token causal prefill (half its longest
    tile on average). With the sliding window the same order."""
    rows = [(0, 4096, 4096), (8192, 256, 0), (8192, 256, 0), (8192, 256, 256)]
    for window, mode in ((None, "symmetric"), (1023, "symmetric"), (1023, "prefix")):
        order = to.batch_work_order(*_meta(rows), window, mode)
        assert order.dtype == torch.int32 and order.tolist() == [1, 2, 3, 0], (window, mode)
    key = to.sequence_work_key(*_meta(rows))
    assert key.dtype == torch.float64
    assert key.tolist() == [4097 / 2, 8448, 8448, 8192 + 257 / 2]
    # sliding: the prefill's rows see min(q_abs, W) + 1 keys (896 on average), the commit's all 1024
    key = to.sequence_work_key(*_meta(rows), 1023)
    assert key.tolist() == [(1023 * 1024 / 2 + 3072 * 1023 + 4096) / 4096, 1151, 1151, 1024]


def test_ties_keep_batch_order_and_empty_sequences_go_last():
    """Equal canvases keep their order (a stable sort: the identity, FA4's own schedule); sequences without query
    rows (key 0) come last, in batch order; a lone sequence is the identity."""
    assert to.batch_work_order(*_meta([(8192, 256, 0)] * 16)).tolist() == list(range(16))
    rows = [(0, 0, 0), (100, 64, 0), (5, 0, 0), (100, 64, 0), (3000, 1, 1), (7, 0, 0)]
    assert to.batch_work_order(*_meta(rows)).tolist() == [4, 1, 3, 0, 2, 5]
    assert to.batch_work_order(*_meta([(0, 0, 0)])).tolist() == [0]
    assert to.batch_work_order(*_meta([])).tolist() == []


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 600), st.floats(0, 1)), max_size=40),
       window=st.sampled_from([None, 0, 1, 63, 1023, 1 << 30]), mode=st.sampled_from(["symmetric", "prefix"]))
def test_a_stable_permutation_by_the_key_of_the_middle_rows(rows, window, mode):
    """Any batch: an int32 permutation whose keys never increase, equal keys in batch order; each key is the mean
    allowed span (``masks.key_range``, the one host implementation of the row rule) over the causal rows and the
    bidirectional rows (with the symmetric window: the span at their midpoint); ``W >= 2^30`` is no window."""
    rows = [(c, ql, int(f * ql)) for c, ql, f in rows]
    meta = _meta(rows)
    order = to.batch_work_order(*meta, window, mode)
    key = to.sequence_work_key(*meta, window, mode)
    twice = to.sequence_work_twice_total(*meta, window, mode)
    assert twice.dtype == torch.int64
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(len(rows)))
    k = key[order.long()].tolist()
    o = order.tolist()
    assert all(k[i] > k[i + 1] or (k[i] == k[i + 1] and o[i] < o[i + 1]) for i in range(len(o) - 1))
    for b, (c, ql, n) in enumerate(rows):
        m = ql - n
        pairs = 0
        if ql:
            lo, hi = key_range(torch.arange(ql), torch.tensor(ql), torch.tensor(c + ql), torch.tensor(n), window,
                               mode)
            spans = hi - lo + 1
            pairs = int(spans[:n].sum())
            if m:
                if window is not None and window < 1 << 30 and mode == "symmetric":
                    a = c + n + m / 2
                    pairs += m * (min(c + ql - a, window + 1) + min(a, window))
                else:
                    pairs += int(spans[n:].sum())
        assert key[b].item() == pytest.approx(pairs / max(ql, 1), rel=1e-12, abs=0), (rows[b], window, mode)
        assert twice[b].item() == 2 * pairs, (rows[b], window, mode)  # exact (pairs is a half-integer at most)
    if window == 1 << 30:
        assert torch.equal(key, to.sequence_work_key(*meta, None, mode))


def test_no_host_read(monkeypatch):
    """Nothing is read on the host (as under CUDA-graph capture): ``.item()``, ``.tolist()``, ``bool()`` / ``int()``
    / ``float()`` of a tensor and ``nonzero`` (a data-dependent shape) all fail during the call."""
    def host_read(*a, **k):
        raise AssertionError("host read")

    meta = _meta([(0, 4096, 4096), (8192, 256, 0), (8192, 256, 256)])
    orders = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"):
            m.setattr(torch.Tensor, name, host_read)
        for window, mode in ((None, "symmetric"), (1023, "symmetric"), (1023, "prefix")):
            orders.append(to.batch_work_order(*meta, window, mode))
    assert all(o.dtype == torch.int32 and o.tolist() == [1, 2, 0] for o in orders)


def test_int64_metadata_and_a_bad_window_or_mode():
    rows = [(10, 5, 5), (1000, 256, 0)]
    assert to.batch_work_order(*(t.long() for t in _meta(rows))).tolist() == [1, 0]
    with pytest.raises(ValueError, match="window_size"):
        to.batch_work_order(*_meta(rows), -1)
    with pytest.raises(TypeError, match="window_size"):
        to.batch_work_order(*_meta(rows), True)
    with pytest.raises(ValueError, match="bidirectional_window"):
        to.batch_work_order(*_meta(rows), 64, "both")


# --- CPU: the one-launch Triton kernel (the interpreter) against the torch reference and exact fractions -----------
def _meta_dtype(rows, dtype=None):
    """``_meta`` as int64 where the offsets or lengths need it (or as ``dtype``)."""
    meta = _meta(rows) if sum(ql for _, ql, _ in rows) < 1 << 31 else None
    if meta is None or dtype == torch.int64:
        q_lens = [ql for _, ql, _ in rows]
        cu = torch.tensor([0] + list(torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()), dtype=torch.int64)
        meta = (cu, torch.tensor([c + ql for c, ql, _ in rows], dtype=torch.int64),
                torch.tensor([n for _, _, n in rows], dtype=torch.int64))
    return meta


def _exact_order(cu, sl, ncq, window, mode):
    """The order on the host with Python integers and fractions (no overflow, no rounding), from the key's
    definition (sequence_work_key's docstring) after the documented clamp into the domain: an oracle independent of
    the closed forms' int64 arithmetic."""
    w = None if window is None or window >= 1 << 30 else window
    cu, sl, ncq = cu.tolist(), sl.tolist(), ncq.tolist()
    keys = []
    for b in range(len(sl)):
        L = min(max(cu[b + 1] - cu[b], 0), to.META_MAX)
        S = max(min(sl[b], to.META_MAX), L)
        n = min(max(ncq[b], 0), L)
        m, ctx = L - n, S - L

        def below(x):  # sum_{a < x} min(a, W)
            if w is None or x <= w + 1:
                return x * (x - 1) // 2
            return w * (w + 1) // 2 + (x - w - 1) * w

        total = Fraction(below(ctx + n) - below(ctx) + n)
        if w is None:
            total += m * S
        elif mode == "prefix":
            total += m * (S - max(0, ctx + n - w))
        else:
            a = Fraction(ctx + n) + Fraction(m, 2)
            total += m * (min(S - a, w + 1) + min(a, w))
        keys.append(total / max(L, 1))
    return sorted(range(len(sl)), key=lambda b: (-keys[b], b))


#: Where the kernel runs in the CPU tests: the interpreter without a GPU (tests/conftest.py), the GPU where there is one
_KDEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check_kernel(meta, window, mode):
    """Kernel (interpreter) == reference == the exact host order, an int32 permutation."""
    got = tot.batch_work_order_triton(*(t.to(_KDEV) for t in meta), window, mode).cpu()
    ref = to.batch_work_order(*meta, window, mode)
    assert got.dtype == torch.int32 and ref.dtype == torch.int32
    assert got.tolist() == ref.tolist() == _exact_order(*meta, window, mode), (window, mode)
    return got


_LEN = st.one_of(st.integers(0, 40), st.integers(0, 3000), st.integers(0, 1 << 30), st.just(to.META_MAX))
_ROW = st.tuples(_LEN, st.one_of(st.just(0), st.just(1), st.integers(0, 600), _LEN),
                 st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1)))
_WINDOW = st.sampled_from([None, 0, 1, 2, 63, 1023, (1 << 29) + 7, (1 << 30) - 1, 1 << 30, 1 << 31])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(templates=st.lists(_ROW, min_size=1, max_size=4),
       picks=st.lists(st.one_of(st.integers(0, 3), _ROW), min_size=1, max_size=70),
       window=_WINDOW, mode=st.sampled_from(["symmetric", "prefix"]), wide=st.booleans())
def test_triton_kernel_equals_the_reference_exactly(templates, picks, window, mode, wide):
    """Fuzzed batches (1-70 sequences: up to three blocks of 32; rows repeated from a few templates, so many exact
    ties; q_len 0, 1, short and up to the bounds; num_causal_q from 0 to q_len; seq_len up to 2^31 - 1; windows
    none, 0, 1, small, large, 2^30 - 1 and no-bound ones; int32 or int64 metadata): the kernel's permutation is the
    reference's and the exact host order's."""
    rows = []
    for p in picks:
        c, ql, f = templates[p % len(templates)] if isinstance(p, int) else p
        ql = min(ql, to.META_MAX)
        rows.append((min(c, to.META_MAX - ql), ql, int(f * ql)))
    _check_kernel(_meta_dtype(rows, torch.int64 if wide else None), window, mode)


@pytest.mark.parametrize("B,window,mode", [(33, None, "symmetric"), (100, 63, "prefix"), (300, 1023, "symmetric")])
def test_triton_kernel_beyond_one_block(B, window, mode):
    """Batches over several programs and loop steps (32 a block; 300 is ten): serving-like rows, a third of them
    copies of earlier ones (ties across blocks), empty sequences among them."""
    rng = random.Random(B)
    rows = []
    for _ in range(B):
        if rows and rng.random() < 0.33:
            rows.append(rng.choice(rows))
        else:
            ql = rng.choice([0, 1, 256, rng.randrange(1, 1200)])
            rows.append((rng.randrange(0, 9000), ql, rng.choice([0, ql, rng.randrange(0, ql + 1)])))
    _check_kernel(_meta(rows), window, mode)


def test_triton_kernel_reads_strided_and_expanded_metadata_as_the_reference():
    """A review found the kernel reading ``seq_lens`` at ``pointer + i`` whatever its stride: a column of a wider
    tensor gave another order than the reference's, and an expanded (stride-0) view would be read past its storage.
    Strided, expanded and offset views of every argument now give the reference's order."""
    rows = [(0, 4096, 4096), (8192, 256, 0), (100, 7, 3), (8192, 256, 256), (5, 0, 0), (8192, 256, 0)]
    cu, sl, ncq = _meta(rows)
    wide_sl = torch.stack([sl, torch.arange(len(rows), dtype=torch.int32) * 1000], dim=1)[:, 0]  # stride 2
    wide_ncq = torch.stack([ncq, ncq + 1], dim=1)[:, 0]
    off_cu = torch.cat([torch.tensor([7], dtype=torch.int32), cu])[1:]  # an offset view (alignment differs)
    assert wide_sl.stride() == (2,) and not wide_sl.is_contiguous()
    for window, mode in ((None, "symmetric"), (1023, "prefix")):
        _check_kernel((off_cu, wide_sl, wide_ncq), window, mode)
    one = _meta([(8192, 256, 0)] * 5)
    expanded = (one[0], one[1][:1].expand(5), one[2][:1].expand(5))  # stride 0: one sequence's length, five times
    assert expanded[1].stride() == (0,)
    assert _check_kernel(expanded, None, "symmetric").tolist() == [0, 1, 2, 3, 4]


def test_triton_kernel_exact_ties_and_bounds():
    """Equal fractions over different row counts tie (batch order); keys that differ by less than float64
    resolves still order exactly; lengths at 2^31 - 1 (the domain's edge) and the largest window do not overflow;
    one sequence, B = 0 (no launch)."""
    # bidirectional rows without a window: key = S, whatever the row count
    rows = [(100, 10, 0), (105, 5, 0), (109, 1, 0), (0, 110, 0), (50, 60, 0)]
    assert _check_kernel(_meta(rows), None, "symmetric").tolist() == [0, 1, 2, 3, 4]
    # S = 2^31 - 1 keys, 2^30 query rows of which one causal: key S - 1 + 2^-30, which float64 rounds to S - 1 (its
    # ulp there is 2^-22), the key of a one-row bidirectional sequence over S - 1 keys: exact says the first goes first
    big = to.META_MAX
    rows = [(big - 2, 1, 0), (big - (1 << 30), 1 << 30, 1)]
    meta = _meta_dtype(rows, torch.int64)
    float_order = torch.sort(to.sequence_work_key(*meta), descending=True, stable=True).indices
    assert float_order.tolist() == [0, 1] and _check_kernel(meta, None, "symmetric").tolist() == [1, 0]
    # the domain's edge (q_len = seq_len = 2^31 - 1, all causal or none) with the largest windows: no overflow
    rows += [(big - 3, 3, 3), (big - 6, 6, 6), (big - 1, 1, 1), (0, big, big), (0, big, 0), (big - 2, 2, 1),
             (1 << 30, big - (1 << 30), 7)]
    for window in (None, (1 << 30) - 1, 1 << 29, 1, 0):
        for mode in ("symmetric", "prefix"):
            _check_kernel(_meta_dtype(rows, torch.int64), window, mode)
    _check_kernel(_meta([(5, 3, 1)]), 1, "symmetric")
    empty = tot.batch_work_order_triton(*(t.to(_KDEV) for t in _meta([])))
    assert empty.dtype == torch.int32 and empty.shape == (0,)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(vals=st.lists(st.tuples(*[st.integers(-(1 << 31), (1 << 31) - 1)] * 3), min_size=1, max_size=40),
       wide=st.booleans(), window=_WINDOW, mode=st.sampled_from(["symmetric", "prefix"]))
def test_triton_kernel_on_garbage_metadata_is_a_permutation(vals, wide, window, mode):
    """Metadata outside the contract (offsets not monotone, q_len > seq_len, negative or too many causal rows,
    int64 values beyond 2^31): clamped into the domain, still a permutation, kernel == reference == host order (the
    scheduler never gets an index out of range)."""
    scale = (1 << 31) if wide else 1  # int64: values up to 2^62 (no wrap in the offsets' differences)
    dtype = torch.int64 if wide else torch.int32
    cu = torch.tensor([0] + [v[0] * scale for v in vals], dtype=dtype)
    sl = torch.tensor([v[1] * scale for v in vals], dtype=dtype)
    ncq = torch.tensor([v[2] for v in vals], dtype=dtype)
    got = _check_kernel((cu, sl, ncq), window, mode)
    assert sorted(got.tolist()) == list(range(len(vals)))


def test_triton_kernel_bad_arguments(monkeypatch):
    meta = _meta([(10, 5, 5), (1000, 256, 0)])
    with pytest.raises(ValueError, match="window_size"):
        tot.batch_work_order_triton(*meta, -1)
    with pytest.raises(TypeError, match="window_size"):
        tot.batch_work_order_triton(*meta, 2.0)
    with pytest.raises(ValueError, match="bidirectional_window"):
        tot.batch_work_order_triton(*meta, 64, "both")
    for fn in (tot.batch_work_order_triton, to.batch_work_order, to.sequence_work_key):
        with pytest.raises(TypeError, match="seq_lens"):
            fn(meta[0], meta[1].float(), meta[2])
        with pytest.raises(TypeError, match="num_causal_q"):
            fn(meta[0], meta[1], [5, 0])
        with pytest.raises(ValueError, match="num_causal_q"):
            fn(meta[0], meta[1], meta[2][:1])
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            fn(meta[0].view(1, -1), meta[1], meta[2])
        with pytest.raises(ValueError, match="seq_lens"):
            fn(meta[0][:2], meta[1], meta[2][:1])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        tot.batch_work_order_triton(*meta)


_SM90_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockdiff.attention.cute import tile_order_triton as tot
fn = tot._batch_work_order_kernel
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
out = []
for has_window, symmetric in ((False, True), (True, True), (True, False)):
    consts = dict(HAS_WINDOW=has_window, SYMMETRIC=symmetric, META_MAX=tot.META_MAX, BLOCK=tot.MAX_BLOCK)
    sig = {n: "constexpr" if n in consts else ("*i32" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    assert r.returncode == 0, r.stderr
    out.append([int(re.search(r"Used (\d+) registers", r.stderr).group(1)),
                sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", r.stderr))])
print(json.dumps(out))
"""


def test_triton_kernel_compiles_for_sm90_without_spills():
    """The kernel at its largest block (int32 metadata; no window, symmetric and prefix windows) compiles for sm_90a
    offline (Triton's ``GPUTarget``, ptxas -v, in a process without the interpreter): no spills, under 128
    registers (MAX_BLOCK's bound; 64 spills)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _SM90_COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for regs, spills in json.loads(r.stdout.strip().splitlines()[-1]):
        assert spills == 0 and regs < 128, (regs, spills)


# --- CPU: the config field and the launch -----------------------------------------------------------------------
@pytest.mark.parametrize("value,err", [("Work", ValueError), ("lpt", ValueError), (1, TypeError), (None, TypeError),
                                       (True, TypeError)])
def test_batch_order_is_validated_by_name(value, err):
    with pytest.raises(err, match="batch_order"):
        cc.check_config(dict(batch_order=value))
    with pytest.raises(err, match="batch_order"):
        cc.resolve_config(512, 512, None, dict(batch_order=value), 256)


def test_batch_order_is_a_switch_not_a_tile_field():
    """Setting only it keeps the automatic tiles (split-value and roles kernels alike); the default is "auto": the
    work order for the roles kernel (the hd-512 default), the given order for every other kernel."""
    assert cc.CuteConfig().batch_order == "auto" and cc.BATCH_ORDERS == ("auto", "given", "work")
    for design in ("split_v", "roles"):
        base = cc.resolve_config(512, 512, None, dict(wide_design=design, **GIVEN), 4096)
        work = cc.resolve_config(512, 512, None, dict(wide_design=design, **WORK), 4096)
        assert base.batch_order == "given" and work.batch_order == "work"
        assert work == cc.CuteConfig(**{**base.__dict__, "batch_order": "work"})
        auto = cc.resolve_config(512, 512, None, dict(wide_design=design), 4096)
        assert auto == (work if design == "roles" else base)
    assert cc.resolve_config(512, 512, None, cc.CuteConfig(batch_order="given"), 256) == cc.CuteConfig(
        **{**cc.resolve_config(512, 512, None, None, 256).__dict__, "batch_order": "given"})


@pytest.mark.parametrize("num_seqs,want", [(1, "given"), (2, "work"), (40, "work")])
def test_one_sequence_resolves_to_the_given_order(num_seqs, want):
    """Nothing to order with one sequence: the launch config (and so the compiled kernel) is the given order's."""
    cfg = cc.resolve_launch_config(512, 512, None, WORK, total_q=256 * num_seqs, num_seqs=num_seqs, num_kv_heads=2,
                                   qhead_per_kvhead=8, keys_capacity=8192, max_seqlen_q=256, max_seqlen_k=None,
                                   num_sms=132)
    assert cfg.batch_order == want


def _launch(monkeypatch, config, rows, hd=512, Hkv=2, page=64):
    """``ca._run`` on CPU tensors, ``_compile`` replaced by a recorder: returns ([compile key], [aux at launch], the
    V cache passed)."""
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    monkeypatch.setattr(ca, "_COMPILE_CACHE", {})
    keys, launches = [], []
    monkeypatch.setattr(ca, "_compile", lambda fa, key, *a: keys.append(key) or (
        lambda *x: launches.append(x[15])))
    fa = {"maybe_contiguous": lambda t, align_bytes=None: t, "is_fake_mode": lambda: False,
          "AuxData": lambda tensors, scalars: list(tensors)}
    cu, sl, ncq = _meta(rows)
    blocks = -(-max(int(s) for s in sl) // page)
    q = torch.zeros(int(cu[-1]), 16, hd, dtype=torch.bfloat16)
    k = torch.zeros(len(rows) * blocks, page, Hkv, hd, dtype=torch.bfloat16)
    bt = torch.arange(len(rows) * blocks, dtype=torch.int32).view(len(rows), blocks)
    ca._run(fa, q, k, k, out=None, return_lse=False, cu_seqlens_q=cu, num_causal_q=ncq, seq_lens=sl,
            block_table=bt, cu_seqlens_k=None, window_size=None, bidirectional_window="symmetric",
            scale=hd ** -0.5, arch=90, config=config, max_seqlen_q=max(ql for _, ql, _ in rows))
    return keys, launches, k


@pytest.mark.parametrize("design", ["split_v", "roles"])
def test_the_permutation_is_the_last_aux_tensor_and_part_of_the_compile_key(monkeypatch, design):
    rows = [(0, 512, 512), (2048, 256, 0), (2048, 64, 64)]
    keys_g, (aux_g,), _ = _launch(monkeypatch, dict(wide_design=design, num_splits=1, **GIVEN), rows)
    keys_a, _, _ = _launch(monkeypatch, dict(wide_design=design, num_splits=1), rows)  # "auto"
    keys_w, (aux_w,), v = _launch(monkeypatch, dict(wide_design=design, num_splits=1, **WORK), rows)
    assert keys_g[0][5].batch_order == "given" and keys_w[0][5].batch_order == "work"
    assert keys_a == (keys_w if design == "roles" else keys_g)  # "auto": the work order for the roles kernel only
    assert keys_g[0] != keys_w[0] and keys_g[0][:5] + keys_g[0][6:] == keys_w[0][:5] + keys_w[0][6:]
    assert ca.LAST_LAUNCH["config"].batch_order == "work"
    assert len(aux_w) == len(aux_g) + 1
    assert [t.shape for t in aux_w[:-1]] == [t.shape for t in aux_g] and aux_w[-2] is v  # V stays where it was
    assert aux_w[-1].dtype == torch.int32 and aux_w[-1].tolist() == [1, 2, 0]
    # one sequence: the given order's kernel, no permutation
    keys_1, (aux_1,), _ = _launch(monkeypatch, dict(wide_design=design, num_splits=1, **WORK), rows[1:2])
    assert keys_1[0][5].batch_order == "given" and len(aux_1) == len(aux_g)


# --- compile only (flash-attn-4 and the CuTe DSL, no GPU) -------------------------------------------------------
@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1 "
                    "(not installed here)")
@pytest.mark.parametrize("spec,setmaxreg", [
    (dict(head_dim=128, num_kv_heads=8, max_seqlen_q=256), [("producer", 24), ("consumer", 240)]),
    (dict(head_dim=512, num_kv_heads=2, max_seqlen_q=4096, config=dict(wide_design="roles")),
     [("producer", 152), ("consumer", 176)]),
], ids=["hd128", "hd512_roles"])
def test_work_order_kernels_compile_for_sm90_with_the_given_orders_resources(spec, setmaxreg, tmp_path):
    """The permutation only adds the scheduler's loads through it (FA4's decoder): no spills, the register split and
    the shared memory of the given order's kernel (its figures: test_cute_compile_check.py, test_cute_kernel_roles.py;
    docs/tuning.md 2.13 compared the two reports and the given order's PTX with the tree before the field)."""
    spec = dict(dict(num_heads=16, page_size=64, return_lse=True), **spec)
    spec["config"] = dict(spec.get("config") or {}, **WORK)
    r = compile_for_sm90_or_skip(**spec)
    hd = spec["head_dim"]
    assert r["config"]["batch_order"] == "work"
    cfg = cc.resolve_config(hd, hd, None, spec["config"], spec["max_seqlen_q"])
    assert r["smem_bytes"] == cc.config_smem_bytes(cfg, hd, hd)
    # hd 512 roles with the LPT order of a 4096-token hint: 16 B (7 spill instructions in SM, 1 in set-up), the same
    # with the whole K stage (docs/tuning.md 2.24); hd 128: none
    bound = 16 if hd == 512 else 0
    assert r["spill_store_bytes"] <= bound, r
    assert bound or sum(r["sass_spills"].values()) == 0, r
    assert [tuple(x) for x in r["setmaxreg"]] == setmaxreg


# --- GPU ------------------------------------------------------------------------------------------------------------
# (head_dim, q heads, KV heads, page or None (contiguous), window, mode, config, max_seqlen_q hint): the default
# kernels at hd 128 (the long hint: 192 x 128 tiles, longest-first; the canvas hint: 128 x 128, plain order) and hd
# 256 (windowed, both modes), the hd-512 split-value and roles kernels, split-KV with the default merge (the Triton
# merge since docs/tuning.md 2.35) and with the cluster merge. One split unless the case says otherwise (the automatic count would add compiles), the tiles the
# hint would give without a config spelled out; two compiles a case (given, work).
GPU_CASES = [
    pytest.param(128, 16, 8, 64, None, "symmetric", dict(num_splits=1, **cc.LONG_PREFILL_CONFIG), 4096,
                 id="hd128_long"),
    pytest.param(128, 16, 8, 64, None, "symmetric", dict(num_splits=1, **cc.HD128_CONFIG), 256, id="hd128_canvas"),
    pytest.param(256, 16, 8, 64, 1023, "symmetric", dict(num_splits=1), 4096, id="hd256_sym"),
    pytest.param(256, 16, 8, None, 1023, "prefix", dict(num_splits=1), 256, id="hd256_prefix_contig"),
    pytest.param(512, 16, 2, 64, None, "symmetric", dict(num_splits=1, tile_n=64, wide_design="split_v"), 4096,
                 id="hd512_split_v"),
    pytest.param(512, 16, 2, 64, None, "symmetric", dict(num_splits=1, wide_design="roles"), 4096,
                 id="hd512_roles_long"),
    pytest.param(512, 16, 2, 64, None, "symmetric", dict(num_splits=1, wide_design="roles"), 256,
                 id="hd512_roles_canvas"),
    pytest.param(128, 16, 8, 64, None, "symmetric", dict(num_splits=3), 256, id="hd128_split3"),
    pytest.param(128, 16, 8, 64, None, "symmetric", dict(num_splits=2, split_merge="cluster"), 256,
                 id="hd128_cluster2"),
]


def _random_rows(rng, n):
    """``n`` sequences of a serving batch: canvases, causal prefills and commits, mixed rows and empty ones."""
    rows = []
    for _ in range(n):
        kind = rng.choice(["canvas", "prefill", "commit", "mixed", "empty"])
        ctx = rng.randrange(0, 3000)
        ql = {"canvas": 256, "prefill": rng.randrange(1, 1200), "commit": 256, "mixed": rng.randrange(2, 400),
              "empty": 0}[kind]
        ncq = {"canvas": 0, "prefill": ql, "commit": ql, "mixed": rng.randrange(0, ql + 1), "empty": 0}[kind]
        rows.append((0 if kind == "prefill" else ctx, ql, ncq))
    if sum(ql for _, ql, _ in rows) == 0:
        rows[0] = (100, 64, 64)
    return rows


def _call(q, k, v, kw, window, mode, config, max_seqlen_q):
    """One checked-shape call into a NaN-poisoned ``out``: ``(out, lse)``."""
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    res = ca.attention_cute(q, k, v, out=out, window_size=window, bidirectional_window=mode, return_lse=True,
                            max_seqlen_q=max_seqlen_q, config=config, **kw)
    assert res[0] is out
    return res


@needs_gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hd,H,Hkv,page,window,mode,config,hint", GPU_CASES)
def test_gpu_work_order_is_bit_identical_to_the_given_order(hd, H, Hkv, page, window, mode, config, hint, seed):
    """Random mixed batches (4 / 40 / 12 sequences: more than one of the decoder's 31-sequence groups, empty
    sequences among them): the work order's output and LSE equal the given order's bit for bit (NaN-poisoned
    outputs, finite after), and match the fp64 reference."""
    rng = random.Random(seed * 1000 + hd + hint)
    rows = _random_rows(rng, [4, 40, 12][seed])
    q, k, v, kw = gpu_batch([ql for _, ql, _ in rows], [c for c, _, _ in rows], [n for _, _, n in rows], H, Hkv,
                            hd, page or 64, seed=seed, contiguous=page is None)
    ref = _call(q, k, v, kw, window, mode, dict(config, **GIVEN), hint)
    assert ca.LAST_LAUNCH["config"].batch_order == "given"
    got = _call(q, k, v, kw, window, mode, dict(config, **WORK), hint)
    assert ca.LAST_LAUNCH["config"].batch_order == "work"
    cluster = config.get("split_merge") == "cluster"
    name = ca.LAST_LAUNCH["kernel"]
    assert ("Cluster" in name, "Split" in name) == (cluster, config["num_splits"] > 1 and not cluster), name
    assert torch.isfinite(got[0]).all()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), rows
    check_close(got[0], q, k, v, lse=got[1], window_size=window, bidirectional_window=mode, **kw)


@needs_gpu
def test_gpu_the_permutation_replays_in_a_cuda_graph_with_new_metadata():
    """batch_work_order captured once on persistent buffers, replayed after the metadata changed in place: equal to
    the eager result each time (no host read, nothing baked in at capture)."""
    B = 6
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    sl = torch.zeros(B, dtype=torch.int32, device="cuda")
    ncq = torch.zeros(B, dtype=torch.int32, device="cuda")
    order = torch.empty(B, dtype=torch.int32, device="cuda")
    steps = [[(0, 4096, 4096), (8192, 256, 0), (8192, 256, 0), (8192, 256, 256), (0, 0, 0), (64, 1, 1)],
             [(8192, 256, 0), (0, 0, 0), (0, 4096, 4096), (100, 64, 10), (8192, 256, 256), (3000, 256, 0)]]

    def set_step(rows):
        for dst, src in zip((cu, sl, ncq), _meta(rows)):
            dst.copy_(src)

    def step():
        order.copy_(to.batch_work_order(cu, sl, ncq, 1023, "symmetric"))

    set_step(steps[0])
    graph = capture_graph(step)
    for rows in steps:
        set_step(rows)
        order.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert order.cpu().tolist() == to.batch_work_order(*_meta(rows), 1023, "symmetric").tolist()


@needs_gpu
@pytest.mark.parametrize("B", [6, 100])
def test_gpu_the_triton_kernel_is_one_launch_and_replays_in_a_cuda_graph(B):
    """batch_work_order_triton: one CUDA kernel (the profiler's count of an eager call; the interface's path for
    CUDA tensors); captured once on persistent buffers (100 sequences: four programs, four loop steps each) and
    replayed after the metadata changed in place, windows of both modes: each replay equals the torch reference on
    the CPU (no host read, nothing baked in at capture but B)."""
    rng = random.Random(B)
    steps = [_random_rows(rng, B) for _ in range(3)]
    steps[2] = [steps[1][0]] * B  # all equal: the identity
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    sl = torch.zeros(B, dtype=torch.int32, device="cuda")
    ncq = torch.zeros(B, dtype=torch.int32, device="cuda")

    def set_step(rows):
        for dst, src in zip((cu, sl, ncq), _meta(rows)):
            dst.copy_(src)

    set_step(steps[0])
    assert ca._work_order(cu, sl, ncq, None, "symmetric").tolist() == to.batch_work_order(*_meta(steps[0])).tolist()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ca._work_order(cu, sl, ncq, 1023, "symmetric")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if kernels:  # none: the profiler records no kernels here (CUPTI unavailable), nothing to count
        assert len(kernels) == 1 and "batch_work_order" in kernels[0], kernels
    for window, mode in ((1023, "symmetric"), (63, "prefix"), (None, "symmetric")):
        orders = {}

        def step():
            orders["out"] = tot.batch_work_order_triton(cu, sl, ncq, window, mode)

        set_step(steps[0])
        graph = capture_graph(step)
        for rows in steps:
            set_step(rows)
            orders["out"].fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            assert orders["out"].cpu().tolist() == to.batch_work_order(*_meta(rows), window, mode).tolist(), rows


@needs_gpu
@pytest.mark.parametrize("hd,Hkv,config", [(128, 8, None), (512, 2, dict(wide_design="roles"))])
def test_gpu_cuda_graph_replay_with_metadata_changed_in_place_equals_the_given_order(hd, Hkv, config):
    """One capture of a work-order call, replayed with other lengths, causal row counts (the order of the sequences
    by work reversed between steps) and a permuted block table written in place: each replay equals an eager
    given-order call bit for bit (output and LSE; output poisoned before each replay) and the reference."""
    H, page, B, cap_q, max_blocks = 16, 64, 4, 1024, 80
    torch.manual_seed(0)
    k = torch.randn(B * max_blocks, page, Hkv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(cap_q, H, hd, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    sl = torch.zeros(B, dtype=torch.int32, device="cuda")
    ncq = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = torch.empty(cap_q, H, hd, device="cuda", dtype=torch.bfloat16)
    lse_buf = torch.empty(H, cap_q, device="cuda")
    kw = dict(cu_seqlens_q=cu, seq_lens=sl, num_causal_q=ncq, block_table=bt)
    # static capacity: cu_seqlens_q[-1] == q.shape[0]
    steps = [([(0, 512, 512), (4096, 256, 0), (4096, 128, 0), (100, 128, 128)], 1),
             ([(4096, 256, 256), (0, 0, 0), (0, 512, 512), (4800, 256, 0)], 2)]

    def set_step(rows, seed):
        for dst, src in zip((cu, sl, ncq), _meta(rows)):
            dst.copy_(src)
        g = torch.Generator().manual_seed(seed)
        bt.copy_(torch.randperm(B * max_blocks, generator=g).to(torch.int32).view(B, max_blocks))

    def step():
        o, lse = ca.attention_cute(q, k, v, out=out, return_lse=True, check_values=False, max_seqlen_q=512,
                                   config=dict(config or {}, **WORK), **kw)
        lse_buf.copy_(lse)

    set_step(*steps[0])
    graph = capture_graph(step)
    for rows, seed in steps:
        set_step(rows, seed)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = ca.attention_cute(q, k, v, return_lse=True, max_seqlen_q=512,
                                         config=dict(config or {}, **GIVEN), **kw)
        assert torch.equal(out, ref) and torch.equal(lse_buf, ref_lse), rows
        check_close(out, q, k, v, lse=lse_buf, **kw)
