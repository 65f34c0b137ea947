"""Shared pieces of the cute backend's tests: the GPU marker with a hang guard, the bf16 batch builder and the
checked call (NaN-poisoned output, the fp64 reference with attention.testing's tolerance rule), the experiment
switches' runner and the NaN-safe V check (caches whose V holds NaN / Inf inside ``seq_lens``)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from blockdiff.attention.cute import interface as ca
from blockdiff.attention import attention
from blockdiff.attention.testing import (check_close, check_nonfinite_matches_reference, make_batch,
                                        make_batch_from_rows, poison_v_inside_seq_lens)

HAVE_FA4 = all(importlib.util.find_spec(m) is not None for m in ("flash_attn", "cutlass"))


def skip_without_cuda_driver(message: str) -> None:
    """Skip the test when ``message`` (an exception's or a child's stderr) says the CuTe DSL could not compile for
    want of a CUDA driver (a CPU machine without libcuda); otherwise return."""
    if "cuda" in message.lower() and "driver" in message.lower():
        pytest.skip(f"the CuTe DSL cannot compile without a CUDA driver here: {message[-300:]}")


def compile_for_sm90_or_skip(**spec) -> dict:
    """:func:`blockdiff.attention.cute.compile_check.compile_for_sm90` of ``spec``, skipping the test where the DSL
    cannot compile without a CUDA driver (:func:`skip_without_cuda_driver`); any other error propagates."""
    from blockdiff.attention.cute import compile_check as cchk
    try:
        return cchk.compile_for_sm90(**spec)
    except RuntimeError as e:
        skip_without_cuda_driver(str(e))
        raise


def compile_snapshot_specs(tmp_path, name: str, prefixes) -> dict:
    """``cute_ptx_snapshot``'s specs ``prefix + name`` compiled for sm_90a (:func:`compile_for_sm90_or_skip`, each into
    its own folder under ``tmp_path``), by prefix: the compile reports (loops, spills, PTX file, config)."""
    from blockdiff.bench.experiments.cute_ptx_snapshot import SPECS
    return {pre: compile_for_sm90_or_skip(ptx_dir=str(tmp_path / pre), switches=SPECS[pre + name]["switches"],
                                          **SPECS[pre + name]["spec"]) for pre in prefixes}


#: The SASS counts a NaN-safe V variant's key-block loops must share with NaN-safe V off's (the recompute's claim:
#: its mainloop is off's): wgmma, exp2, FMUL, barrier syncs and global loads.
LOOP_MIX = ("HGMMA", "MUFU.EX2", "FMUL", "SYNCS", "LDG", "BAR.SYNC", "BAR.ARV")


def assert_loops_like_off(off: dict, on: dict, slack: float, label="", r2ur: bool = False) -> None:
    """``on``'s key-block loops (a compile report) against NaN-safe V off's ``off``: as many loops, the same
    :data:`LOOP_MIX` counts, no local memory, each at most ``slack`` times off's instruction count (with ``r2ur``,
    no more ``R2UR`` than off)."""
    assert len(on["loops"]) == len(off["loops"]), label
    for i, (a, b) in enumerate(zip(off["loops"], on["loops"])):
        for k in LOOP_MIX:
            assert b[k] == a[k], (label, i, k, a, b)
        assert b["STL/LDL"] == 0, (label, i, b)
        if r2ur:
            assert b["R2UR"] <= a["R2UR"], (label, i, b)
        assert b["instructions"] <= slack * a["instructions"], (label, i, a["instructions"], b["instructions"])


def needs_gpu(f):
    """GPU test; with pytest-timeout installed, a hang (e.g. a producer/consumer pipeline deadlock) ends the
    process after 300 s with every thread's stack dumped instead of eating the whole GPU session."""
    f = pytest.mark.gpu(f)
    if importlib.util.find_spec("pytest_timeout") is not None:
        f = pytest.mark.timeout(300, method="thread")(f)
    return f


def roles_switch_runner(monkeypatch, switch: str):
    """``with_switch(on, fn)``: runs ``fn()`` with the roles kernel's experiment class attribute ``switch`` at
    ``on`` and a compile cache per setting (the cache key does not see the switch)."""
    from blockdiff.attention.cute.kernel_roles import FlashAttentionForwardSm90Roles as R
    return switch_runner(monkeypatch, R, switch)


def switch_runner(monkeypatch, cls, switch: str):
    """``with_switch(on, fn)``: runs ``fn()`` with the experiment class attribute ``switch`` of kernel class
    ``cls`` at ``on`` and a compile cache per setting (the cache key does not see the switch)."""
    caches = {False: {}, True: {}}

    def with_switch(on: bool, fn):
        monkeypatch.setattr(cls, switch, on)
        monkeypatch.setattr(ca, "_COMPILE_CACHE", caches[on])
        return fn()
    return with_switch


def gpu_batch(q_lens, ctxs, ncqs, H, Hkv, D, page_size, seed=0, contiguous=False, nan_pad_page=False):
    """A bf16 GPU batch of :func:`blockdiff.attention.testing.make_batch_from_rows` unpacked as ``(q, k_cache,
    v_cache, kwargs)``: sequences of ``q_lens`` query tokens after ``ctxs`` context keys, ``ncqs`` causal rows;
    paged (permuted pages, 3 unused ones, block-table slots past a sequence's pages 0, or with ``nan_pad_page``
    an all-NaN page) or contiguous."""
    b = make_batch_from_rows(list(zip(ctxs, q_lens, ncqs)), num_heads=H, num_kv_heads=Hkv, head_dim=D,
                             page_size=page_size, paged=not contiguous, device="cuda", seed=seed, extra_blocks=3,
                             extra_columns=0, block_table_pad="nan_page" if nan_pad_page else "zeros")
    return b.pop("q"), b.pop("k_cache"), b.pop("v_cache"), b


def run_and_check(q, k, v, kw, window, mode, return_lse=True, **extra):
    """One cute call into a NaN-poisoned ``out`` (finite everywhere afterwards), checked against the fp64
    reference (output and LSE) with the tolerance rule; returns check_close's report."""
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    res = ca.attention_cute(q, k, v, out=out, window_size=window, bidirectional_window=mode,
                            return_lse=return_lse, **kw, **extra)
    o, lse = res if return_lse else (res, None)
    assert o is out
    assert torch.isfinite(o).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    return check_close(o, q, k, v, lse=lse, window_size=window, bidirectional_window=mode, **kw)


def capture_graph(step) -> torch.cuda.CUDAGraph:
    """Run ``step`` once (compile, warm-up), once more on a side stream, then capture it in a CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        step()
    return graph


def scan_at_every_head_dim(monkeypatch):
    """``nan_safe_v_method="auto"`` keeps the scan at every head dim in this process (it takes the recompute at hd
    256 since docs/tuning.md 2.35): for the tests of the scan's own switches, which the recompute makes moot. Child
    processes (compile tests) and device scripts name the method instead (switch_lib.sh NO_AUTO_RECOMPUTE)."""
    from blockdiff.attention.cute import config as cc
    monkeypatch.setattr(cc, "AUTO_RECOMPUTE_HEAD_DIMS", frozenset())


def fill_past_seq_lens(k, v, kw, page, value):
    """Write ``value`` into every paged cache row after each sequence's last key, in its last page."""
    seq, bt = kw["seq_lens"].cpu(), kw["block_table"].cpu()
    for b in range(len(seq)):
        s = int(seq[b])
        if s % page:
            k[bt[b, (s - 1) // page].long(), s % page:] = value
            v[bt[b, (s - 1) // page].long(), s % page:] = value


def rows_past_seq_lens_check(q, k, v, kw, page, config, max_seqlen_q=256):
    """Keys after each sequence's end stay out: one cute call, NaN written into every paged cache row after each
    sequence's last key (:func:`fill_past_seq_lens`, in place), the same call again; the output must be
    bit-identical and within the fp64 reference's tolerance."""
    def call():
        return ca.attention_cute(q, k, v, max_seqlen_q=max_seqlen_q, return_lse=True, config=config, **kw)[0]
    clean = call()
    fill_past_seq_lens(k, v, kw, page, float("nan"))
    dirty = call()
    assert torch.equal(dirty, clean)
    check_close(dirty, q, k, v, **kw)


def graph_replay_check(steps, *, H, Hkv, D, page, B, cap_q, max_blocks, **attn_kwargs):
    """Capture one cute call over persistent metadata buffers (``B`` sequences, ``cap_q`` query tokens,
    ``max_blocks`` pages each, a NaN-poisoned ``out``), then replay it for each of ``steps`` = [(q_lens, ctxs,
    num_causal_q, block-table permutation seed), ...] rewritten in place; every replay is finite and matches the
    reference (output and LSE). ``attn_kwargs`` go to every call (window, config, hints)."""
    torch.manual_seed(0)
    k = torch.randn(B * max_blocks, page, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(cap_q, H, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    sl = torch.zeros(B, dtype=torch.int32, device="cuda")
    ncq = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = torch.empty(cap_q, H, D, device="cuda", dtype=torch.bfloat16)
    lse_buf = torch.empty(H, cap_q, device="cuda")

    def set_step(q_lens, ctxs, ncqs, perm_seed):
        if sum(q_lens) != cap_q:  # the contract: cu_seqlens_q[-1] == q.shape[0] (rows past it are never written)
            raise ValueError(f"graph_replay_check: q_lens {q_lens} sum to {sum(q_lens)}, not cap_q={cap_q}")
        cu.copy_(torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32))
        sl.copy_(torch.tensor([c + ql for c, ql in zip(ctxs, q_lens)], dtype=torch.int32))
        ncq.copy_(torch.tensor(ncqs, dtype=torch.int32))
        g = torch.Generator().manual_seed(perm_seed)
        bt.copy_(torch.randperm(B * max_blocks, generator=g).to(torch.int32).view(B, max_blocks))

    def step():
        o, lse = ca.attention_cute(q, k, v, cu_seqlens_q=cu, seq_lens=sl, num_causal_q=ncq, block_table=bt,
                                   out=out, return_lse=True, check_values=False, **attn_kwargs)
        lse_buf.copy_(lse)

    set_step(*steps[0])
    graph = capture_graph(step)
    for st in steps:
        set_step(*st)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close(out, q, k, v, lse=lse_buf, cu_seqlens_q=cu, seq_lens=sl, num_causal_q=ncq, block_table=bt,
                    window_size=attn_kwargs.get("window_size"),
                    bidirectional_window=attn_kwargs.get("bidirectional_window", "symmetric"))


def nonfinite_cases(D, H, Hkv, page_size, seed, paged=True):
    """Mixed batches (a canvas over context, a prefill, a commit + canvas sequence, a short causal one, an empty
    one, a canvas with causal rows) with NaN in the stale cache rows and unused pages too."""
    sl, ql, ncq = [1500, 700, 333, 9, 0, 1300], [256, 700, 64, 9, 0, 300], [0, 700, 64, 4, 0, 40]
    return make_batch(sl, ql, num_causal_q=ncq, num_heads=H, num_kv_heads=Hkv, head_dim=D, page_size=page_size,
                      paged=paged, device="cuda", seed=seed, poison_unused=paged)


def check_nonfinite_v(inp, config, seed, **kw):
    """The cute backend with ``nan_safe_v`` on (``config``: other fields, None: automatic) on caches whose V
    holds NaN / +-Inf entries of keys inside ``seq_lens`` (:func:`poison_v_inside_seq_lens`, 6 a sequence), into a
    NaN-poisoned ``out``: exactly the reference's NaN / +Inf / -Inf entries, every other entry (and the LSE) within
    the tolerance rule of the oracle of the caches with those entries zeroed. Returns the number of non-finite
    entries."""
    bad = poison_v_inside_seq_lens(inp, seed, 6)[0]
    q, vc = bad["q"], bad["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**bad, out=out, return_lse=True, backend="cute", config=dict(config or {}, nan_safe_v=True),
                       **kw)
    assert ca.LAST_LAUNCH["config"].nan_safe_v is True
    return check_nonfinite_matches_reference(o, bad, lse=lse, **kw)


#: hd 256 (FA4's hd-256 tiles, the sliding layers' window) NaN-safe V cases: (id, page size or None, config, call
#: kwargs); test_cute_nan_safe_v.py runs them
NAN_SAFE_HD256_CASES = [
    ("pagebox64", 64, None, {}),
    ("contiguous_window1023_prefix", None, None, dict(window_size=1023, bidirectional_window="prefix")),
    ("pagebox64_split2_window127", 64, dict(num_splits=2, split_merge="combine"), dict(window_size=127)),
    ("pagebox64_split2_cluster_window127", 64, dict(num_splits=2, split_merge="cluster"), dict(window_size=127)),
]


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where finite or infinite, NaN exactly where the other has NaN (two switch settings' outputs
    on a poisoned cache)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def next_sequence_nan_v(head_dim: int, n_keys: int, seed: int) -> dict:
    """A contiguous-K / V GPU batch of two 256-row canvases over 1,300 and 1,280 keys (the first's keys end mid-block,
    so its tiles' last block reaches into the second's keys), with V of the second sequence's first ``n_keys`` keys
    NaN / +Inf / -Inf / NaN in turn, in every head and column: rows of the first canvas see none of them."""
    inp = make_batch([1300, 1280], [256, 256], num_causal_q=[0, 0], num_heads=16, num_kv_heads=8,
                     head_dim=head_dim, paged=False, device="cuda", seed=seed)
    v = inp["v_cache"].clone()
    start = int(inp["cu_seqlens_k"][1])
    vals = (float("nan"), float("inf"), -float("inf"), float("nan"))
    for i in range(n_keys):
        v[start + i] = vals[i % 4]
    return dict(inp, v_cache=v)
