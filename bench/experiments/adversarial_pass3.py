"""Adversarial input pass 3 (issue 26 follow-up): one row per input, ``surface | input | outcome | message``.

New inputs only (pass 2, :mod:`adversarial_pass2`, covered cute configs, BLOCKDIFF_ATTN_BACKEND under vLLM,
bench_serve, export flags, SamplingParams / sampler_step basics and the harness basics): the attention contract
(validate, masks, reference, the triton backend through the interpreter, its configs and launch plans, cache
helpers, tensor parallelism), the sampler (SamplerState, sampler_step shapes, the fused triton step), the model
(config, from_hf, checkpoint loading and export round trip), the harness lifecycle (preempt / abort / run /
vLLM-style params), integration helpers (vllm_plugin, scheduler accounting, model_state helpers) and the CLIs
(bench_attention, bench_sampler, make_tables, demo, export, train).

Outcomes as pass 2: ``clear error`` (ValueError / TypeError / CheckpointError / NotImplementedError /
ImportError whose message names the expected word), ``ok`` (accepted and checked), ``BAD: traceback``,
``BAD: unclear``, ``BAD: silent``, ``BAD: exit code``, ``BAD: hang``.

    python3 bench/experiments/adversarial_pass3.py [SECTION ...]   # attention triton tp sampler model harness
                                                                  # integration cli
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import types

# the triton backends run through the interpreter on the CPU: set before triton is first imported
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# one row per input, the same harness as the second pass (its ROWS list, row, probe, cli)
from blockdiff.bench.experiments.adversarial_pass2 import ROWS, cli, probe, row  # noqa: E402




def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def paged_batch(q_lens=(3, 5), ctx=(4, 0), H=4, Hkv=2, D=16, DV=None, page=4, dtype=torch.float32, seed=0,
                num_causal=None, extra_pages=2):
    """A small paged mixed batch: (q, k_cache, v_cache, kwargs) with causal flags (or num_causal_q)."""
    g = gen(seed)
    DV = DV or D
    seq = [q + c for q, c in zip(q_lens, ctx)]
    nb_per = [-(-s // page) for s in seq]
    nb = sum(nb_per) + extra_pages
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(seq), max(nb_per + [1]), dtype=torch.int32)
    i = 0
    for b, n in enumerate(nb_per):
        bt[b, :n] = perm[i:i + n]
        i += n
    q = torch.randn(sum(q_lens), H, D, generator=g).to(dtype)
    k = torch.randn(nb, page, Hkv, D, generator=g).to(dtype)
    v = torch.randn(nb, page, Hkv, DV, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, seq_lens=torch.tensor(seq, dtype=torch.int32), block_table=bt)
    if num_causal is None:
        kw["causal"] = torch.tensor([b % 2 == 0 for b in range(len(seq))])
    else:
        kw["num_causal_q"] = torch.tensor(num_causal, dtype=torch.int32)
    return q, k, v, kw


def ref(q, k, v, **kw):
    from blockdiff.attention import attention
    return attention(q, k, v, backend="reference", **kw)


def close_to(want, tol=2e-3):
    def check(got):
        a = got[0] if isinstance(got, tuple) else got
        w = want[0] if isinstance(want, tuple) else want
        if a.shape != w.shape:
            return f"shape {tuple(a.shape)} != {tuple(w.shape)}"
        if not torch.isfinite(a).all():
            return "non-finite output"
        err = (a.float() - w.float()).abs().max().item() if a.numel() else 0.0
        return None if err <= tol else f"max err {err:.3g}"
    return check


# ------------------------------------------------------------------------------------------------ attention
def sec_attention():
    from blockdiff.attention import (attention, build_mask, causal_row_counts, count_allowed_pairs, key_range,
                                     write_kv_cache)
    from blockdiff.attention.masks import MAX_SEQ_LEN, batch_key_ranges
    S = "attention.validate"
    q, k, v, kw = paged_batch()
    A = lambda **over: (lambda: ref(q, k, v, **dict(kw, **over)))  # noqa: E731
    good = ref(q, k, v, **kw)
    cases = [
        ("q 2-D", lambda: ref(q[:, 0], k, v, **kw), "q must have 3"),
        ("q numpy array", lambda: attention(q.numpy(), k, v, backend="reference", **kw), "q must"),
        ("k_cache float64 vs q float32", lambda: ref(q, k.double(), v, **kw), "k_cache dtype"),
        ("k_cache a list", lambda: ref(q, [k], v, **kw), "k_cache"),
        ("H=4, Hkv=3", lambda: ref(q, torch.randn(k.shape[0], 4, 3, 16), torch.randn(k.shape[0], 4, 3, 16), **kw),
         "num_kv_heads"),
        ("head_dim 0", lambda: ref(q[..., :0], k[..., :0], v[..., :0], **kw), "head_dim"),
        ("page_size 0", lambda: ref(q, k[:, :0], v[:, :0], **kw), "page_size"),
        ("q on the meta device", lambda: ref(q.to("meta"), k, v, **kw), "meta"),
        ("cu_seqlens_q float", A(cu_seqlens_q=kw["cu_seqlens_q"].float()), "cu_seqlens_q"),
        ("cu_seqlens_q empty", A(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), "cu_seqlens_q"),
        ("cu_seqlens_q starts at 1", A(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)), "start at 0"),
        ("cu_seqlens_q decreasing", A(cu_seqlens_q=torch.tensor([0, 6, 8], dtype=torch.int32)[[0, 2, 1]]),
         "non-decreasing"),
        ("cu_seqlens_q[-1] < total_q", A(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32)), "cu_seqlens_q[-1]"),
        ("seq_lens < q_len", A(seq_lens=torch.tensor([2, 5], dtype=torch.int32)), "seq_lens"),
        ("seq_lens negative (q_len 0 row)", lambda: ref(q[:3], k, v, **dict(
            kw, cu_seqlens_q=torch.tensor([0, 3, 3], dtype=torch.int32), seq_lens=torch.tensor([7, -1],
                                                                                               dtype=torch.int32))),
         "seq_lens"),
        ("seq_lens > MAX_SEQ_LEN", A(seq_lens=torch.tensor([7, MAX_SEQ_LEN + 1], dtype=torch.int64)), "MAX_SEQ_LEN"),
        ("seq_lens int16", A(seq_lens=torch.tensor([7, 5], dtype=torch.int16)), "seq_lens"),
        ("block_table 1 column short", A(block_table=kw["block_table"][:, :1]), "block_table"),
        ("block_table id = num_blocks", A(block_table=kw["block_table"].clone().index_fill_(1, torch.tensor([0]),
                                                                                          k.shape[0])),
         "out of range"),
        ("block_table float", A(block_table=kw["block_table"].float()), "block_table"),
        ("both causal and num_causal_q", A(num_causal_q=torch.tensor([3, 0], dtype=torch.int32)), "exactly one"),
        ("num_causal_q > q_len", lambda: ref(q, k, v, **dict({k_: v_ for k_, v_ in kw.items() if k_ != "causal"},
                                                             num_causal_q=torch.tensor([4, 0], dtype=torch.int32))),
         "num_causal_q"),
        ("causal int tensor", A(causal=torch.tensor([1, 0])), "causal"),
        ("causal 3 entries", A(causal=torch.tensor([True, False, True])), "causal"),
        ("window_size -1", A(window_size=-1), "window_size"),
        ("window_size 2.0", A(window_size=2.0), "window_size"),
        ("window_size tensor(2)", A(window_size=torch.tensor(2)), "window_size"),
        ("bidirectional_window 'Prefix'", A(bidirectional_window="Prefix"), "bidirectional_window"),
        ("bidirectional_window None", A(bidirectional_window=None), "bidirectional_window"),
        ("scale nan", A(scale=math.nan), "scale"),
        ("scale 2**17", A(scale=2.0 ** 17), "scale"),
        ("scale '1'", A(scale="1"), "scale"),
        ("scale tensor(1.0)", A(scale=torch.tensor(1.0)), "scale"),
        ("scale 10**400 (int)", A(scale=10 ** 400), "scale"),
        ("out float64", A(out=torch.empty(8, 4, 16, dtype=torch.float64)), "out"),
        ("out expanded (stride 0)", A(out=torch.empty(1, 4, 16).expand(8, 4, 16)), "out"),
        ("out wrong shape", A(out=torch.empty(8, 4, 8)), "out"),
        ("return_lse 1", A(return_lse=1), "return_lse"),
        ("max_seqlen_q -1", A(max_seqlen_q=-1), "max_seqlen_q"),
        ("max_seqlen_k 1.5", A(max_seqlen_k=1.5), "max_seqlen_k"),
        ("max_seqlen_k float 0-d tensor", A(max_seqlen_k=torch.tensor(4.0)), "max_seqlen_k"),
        ("check_values 'yes'", A(check_values="yes"), "check_values"),
        ("upcast 'no'", A(upcast="no"), "upcast"),
        ("paged without seq_lens", A(seq_lens=None), "seq_lens"),
        ("block_table and cu_seqlens_k", A(cu_seqlens_k=torch.tensor([0, 7, 12], dtype=torch.int32)), "not both"),
        ("backend 'Triton'", lambda: attention(q, k, v, backend="Triton", **kw), "backend"),
        ("backend None", lambda: attention(q, k, v, backend=None, **kw), "backend"),
    ]
    for name, fn, word in cases:
        probe(S, name, fn, word)
    # valid edge inputs: results checked
    probe(S, "window_size 2**40 == None", A(window_size=2 ** 40), check=close_to(good, 0), expect_error=False)
    probe(S, "scale 0 (uniform weights)", A(scale=0.0), check=close_to(ref(q, k, v, **kw, scale=0.0), 0),
          expect_error=False)
    probe(S, "out aliasing q (reference)", lambda: (lambda qq: ref(qq, k, v, **dict(kw, out=qq)))(q.clone()),
          check=close_to(good, 1e-6), expect_error=False)
    probe(S, "block_table -1 in an unused column", lambda: ref(q, k, v, **dict(kw, block_table=torch.cat(
        [kw["block_table"], torch.full((2, 1), -1, dtype=torch.int32)], 1))), check=close_to(good, 0),
        expect_error=False)
    probe(S, "B=0, total_q=0", lambda: ref(q[:0], k, v, cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
                                           seq_lens=torch.zeros(0, dtype=torch.int32),
                                           causal=torch.zeros(0, dtype=torch.bool),
                                           block_table=torch.zeros(0, 1, dtype=torch.int32)),
          check=lambda r: None if r.shape == (0, 4, 16) else f"{r.shape}", expect_error=False)
    probe(S, "a q_len-0 sequence with keys", lambda: ref(q[:3], k, v, **dict(
        kw, cu_seqlens_q=torch.tensor([0, 3, 3], dtype=torch.int32))), check=close_to(good[:3], 1e-6),
        expect_error=False)
    # contiguous form
    kc, vc = torch.randn(12, 2, 16, generator=gen(3)), torch.randn(12, 2, 16, generator=gen(4))
    ckw = dict(cu_seqlens_q=kw["cu_seqlens_q"], cu_seqlens_k=torch.tensor([0, 7, 12], dtype=torch.int32),
               causal=kw["causal"])
    probe(S, "contiguous: cu_seqlens_k beyond the cache", lambda: ref(q, kc[:10], vc[:10], **ckw), "cu_seqlens_k")
    probe(S, "contiguous: seq_lens disagree with cu_seqlens_k",
          lambda: ref(q, kc, vc, **ckw, seq_lens=torch.tensor([7, 6], dtype=torch.int32)), "seq_lens")
    probe(S, "contiguous: k_cache 4-D", lambda: ref(q, k, v, **ckw), "contiguous")

    S = "attention.masks"
    t = torch.tensor
    for name, fn, word in [
        ("key_range row -1", lambda: key_range(t([-1]), t(4), t(6), t(0), None), "row"),
        ("key_range row = q_len", lambda: key_range(t([4]), t(4), t(6), t(0), None), "row"),
        ("key_range row float", lambda: key_range(t([0.0]), t(4), t(6), t(0), None), "row"),
        ("key_range shapes (2,) vs (3,)", lambda: key_range(t([0, 1]), t([4, 4, 4]), t(6), t(0), None), "broadcast"),
        ("build_mask q_len > seq_len", lambda: build_mask(3, 2, causal=True), "seq_len"),
        ("build_mask causal=1", lambda: build_mask(2, 2, causal=1), "causal"),
        ("build_mask device='bogus'", lambda: build_mask(2, 2, causal=True, device="bogus"), "device"),
        ("build_mask device=5", lambda: build_mask(2, 2, causal=True, device=5), "device"),
        ("build_mask q_len numpy int", lambda: build_mask(__import__("numpy").int64(2), 2, causal=True), "q_len"),
        ("count_allowed_pairs 2-D q_lens", lambda: count_allowed_pairs(t([[1]]), t([[1]]), t([[0]]), None), "1-D"),
        ("count_allowed_pairs seq_lens list", lambda: count_allowed_pairs(t([1]), [1], t([0]), None), "seq_lens"),
        ("count_allowed_pairs window True", lambda: count_allowed_pairs(t([1]), t([1]), t([0]), True), "window_size"),
        ("batch_key_ranges num_causal_q > q_len", lambda: batch_key_ranges(t([2]), t([3]), t([3]), None),
         "num_causal_q"),
        ("causal_row_counts causal list", lambda: causal_row_counts([True], t([0, 1], dtype=torch.int32)), "causal"),
        ("causal_row_counts length mismatch", lambda: causal_row_counts(t([True, False]), t([0, 1])), "causal"),
    ]:
        probe(S, name, fn, word)
    probe(S, "count_allowed_pairs empty batch", lambda: count_allowed_pairs(t([], dtype=torch.int64),
                                                                           t([], dtype=torch.int64),
                                                                           t([], dtype=torch.int64), 3),
          check=lambda r: None if r == 0 else f"{r}", expect_error=False)
    probe(S, "count_allowed_pairs == build_mask sum (prefix, W=2, mixed)", lambda: (
        count_allowed_pairs(t([3, 4]), t([7, 9]), t([1, 0]), 2, "prefix"),
        int(build_mask(3, 7, num_causal_q=1, window_size=2, bidirectional_window="prefix").sum()
            + build_mask(4, 9, num_causal_q=0, window_size=2, bidirectional_window="prefix").sum())),
        check=lambda r: None if r[0] == r[1] else f"{r}", expect_error=False)

    S = "attention.cache"
    kc = torch.zeros(3, 4, 2, 8)
    vc = torch.zeros(3, 4, 2, 8)
    kk, vv = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    sm = torch.tensor([0, 5])
    for name, fn, word in [
        ("slot_mapping float", lambda: write_kv_cache(kk, vv, kc, vc, sm.float()), "slot_mapping"),
        ("slot = num_blocks * page_size", lambda: write_kv_cache(kk, vv, kc, vc, torch.tensor([0, 12])),
         "slot_mapping"),
        ("duplicate slots", lambda: write_kv_cache(kk, vv, kc, vc, torch.tensor([5, 5])), "two tokens"),
        ("k int64", lambda: write_kv_cache(kk.long(), vv, kc, vc, sm), "k must"),
        ("k_cache is v_cache", lambda: write_kv_cache(kk, vv, kc, kc, sm), "share memory"),
        ("slot_mapping 2-D", lambda: write_kv_cache(kk, vv, kc, vc, sm[None]), "slot_mapping"),
        ("k / v T differ", lambda: write_kv_cache(kk, vv[:1], kc, vc, sm), "equal T"),
        ("k_cache 3-D", lambda: write_kv_cache(kk, vv, kc[0], vc[0], sm), "k_cache"),
        ("k head_dim 4 vs cache 8", lambda: write_kv_cache(kk[..., :4], vv, kc, vc, sm), "head shapes"),
        ("slot_mapping a list", lambda: write_kv_cache(kk, vv, kc, vc, [0, 5]), "slot_mapping"),
    ]:
        probe(S, name, fn, word)

    def pad():
        a, b = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
        write_kv_cache(kk, vv, a, b, torch.tensor([-1, 5]))
        return a, b
    probe(S, "negative slot = padding (skipped)", pad,
          check=lambda r: None if torch.equal(r[0][1, 1], kk[1]) and int((r[0] != 0).any(-1).any(-1).sum()) == 1
          else "wrong rows written", expect_error=False)


# ------------------------------------------------------------------------------------------------ triton backend
def sec_triton():
    from blockdiff.attention import attention
    S = "attention.triton"
    T = lambda q, k, v, **kw: attention(q, k, v, backend="triton", **kw)  # noqa: E731
    q, k, v, kw = paged_batch()
    good = ref(q, k, v, **kw)
    probe(S, "basic paged mixed batch", lambda: T(q, k, v, **kw), check=close_to(good), expect_error=False)
    for name, over, word in [
        ("config BLOCK_M=24", dict(config=dict(BLOCK_M=24)), "BLOCK_M"),
        ("config BLOCK_N=8", dict(config=dict(BLOCK_N=8)), "BLOCK_N"),
        ("config num_warps=0", dict(config=dict(num_warps=0)), "num_warps"),
        ("config num_stages=True", dict(config=dict(num_stages=True)), "num_stages"),
        ("config num_splits=0", dict(config=dict(num_splits=0)), "num_splits"),
        ("config IMPL='gluon' on the CPU", dict(config=dict(IMPL="gluon")), "gluon"),
        ("config IMPL='cuda'", dict(config=dict(IMPL="cuda")), "IMPL"),
        ("config OVERLAP='x'", dict(config=dict(OVERLAP="x")), "OVERLAP"),
        ("config IMPL=triton + OVERLAP", dict(config=dict(IMPL="triton", OVERLAP=True)), "OVERLAP"),
        ("config LAZY_RESCALE='yes'", dict(config=dict(LAZY_RESCALE="yes")), "LAZY_RESCALE"),
        ("config BLOCK_DV=[64]", dict(config=dict(BLOCK_DV=[64])), "BLOCK_DV"),
        ("config unknown key", dict(config=dict(block_m=64)), "unknown"),
        ("config a list", dict(config=[64, 64]), "config"),
        ("max_seqlen_k 0-d tensor -5", dict(max_seqlen_k=torch.tensor(-5)), "max_seqlen_k"),
    ]:
        probe(S, name, lambda over=over: T(q, k, v, **dict(kw, **over)), word)
    probe(S, "q float64", lambda: T(q.double(), k.double(), v.double(), **kw), "q must")
    probe(S, "q last dim strided", lambda: T(torch.randn(8, 4, 32)[..., ::2], k, v, **kw), "stride")
    for name, over in [("config num_splits=3", dict(config=dict(num_splits=3))),
                       ("max_seqlen_k 0-d tensor 0 (a low hint)", dict(max_seqlen_k=torch.tensor(0))),
                       ("max_seqlen_k 1 (below seq_lens)", dict(max_seqlen_k=1)),
                       ("max_seqlen_k 2**30", dict(max_seqlen_k=2 ** 30)),
                       ("window_size 0", dict(window_size=0)), ("window_size 2, prefix", dict(window_size=2,
                                                                                          bidirectional_window="prefix")),
                       ("scale -1.0", dict(scale=-1.0)), ("return_lse", dict(return_lse=True))]:
        want = ref(q, k, v, **{**kw, **{a: b for a, b in over.items() if a not in ("config", "max_seqlen_k")}})
        probe(S, name, lambda over=over: T(q, k, v, **dict(kw, **over)), check=close_to(want), expect_error=False)
    for name, args in [("GQA group 3 (H 6, Hkv 2)", dict(H=6)), ("head_dim 8", dict(D=8)), ("head_dim 24", dict(D=24)),
                       ("head_dim_v 8 != head_dim 16", dict(DV=8)), ("page_size 1", dict(page=1)),
                       ("page_size 3", dict(page=3)), ("bf16", dict(dtype=torch.bfloat16)),
                       ("num_causal_q mix, prefix", dict(num_causal=[2, 3]))]:
        def run(args=args):
            qq, kk, vv, kw2 = paged_batch(**args)
            extra = dict(window_size=2, bidirectional_window="prefix") if "num_causal" in args else {}
            return T(qq, kk, vv, **kw2, **extra), ref(qq, kk, vv, **kw2, **extra)
        probe(S, name, run, check=lambda r: close_to(r[1], 2e-2)(r[0]), expect_error=False)

    def nan_stale():
        qq, kk, vv, kw2 = paged_batch(q_lens=(3,), ctx=(2,), extra_pages=1)
        vv = vv.clone()
        vv[kw2["block_table"][0, 1], 1:] = math.nan  # rows past seq_len 5 in its second page
        spare = sorted(set(range(vv.shape[0])) - set(kw2["block_table"][0].tolist()))[0]
        vv[spare] = math.inf  # the spare page no sequence uses
        return T(qq, kk, vv, **kw2)
    probe(S, "NaN V in stale rows past seq_len", nan_stale,
          check=lambda r: None if torch.isfinite(r).all() else "NaN leaked", expect_error=False)

    def out_strided():
        buf = torch.zeros(8, 4, 32)
        o = buf[..., ::2]
        T(q, k, v, **kw, out=o)
        return o
    probe(S, "out with a strided last dim", out_strided, check=close_to(good), expect_error=False)

    def out_is_q():
        qq = q.clone()
        return T(qq, k, v, **kw, out=qq)
    probe(S, "out aliasing q", out_is_q, check=close_to(good), expect_error=False)

    def plan_reuse():
        # check_values=False: a plan is made by the first call and reused by the second, new block table values
        qq, kk, vv, kw2 = paged_batch(seed=5)
        T(qq, kk, vv, **kw2, check_values=False)
        kw3 = dict(kw2)
        perm = torch.tensor([1, 0])
        kw3["block_table"] = kw2["block_table"][perm].contiguous()
        kw3["seq_lens"] = kw2["seq_lens"][perm].contiguous()
        kw3["causal"] = kw2["causal"][perm].contiguous()
        qs = torch.cat([qq[3:], qq[:3]])
        kw3["cu_seqlens_q"] = torch.tensor([0, 5, 8], dtype=torch.int32)
        return T(qs, kk, vv, **kw3, check_values=False), ref(qs, kk, vv, **kw3)
    probe(S, "launch plan reused with new lengths / tables", plan_reuse, check=lambda r: close_to(r[1])(r[0]),
          expect_error=False)

    def plan_then_alias():
        qq, kk, vv, kw2 = paged_batch(seed=6)
        want = ref(qq, kk, vv, **kw2)
        T(qq, kk, vv, **kw2, out=torch.empty_like(qq), check_values=False)
        q2 = qq.clone()
        return T(q2, kk, vv, **kw2, out=q2, check_values=False), want
    probe(S, "plan of a separate out, then out=q (same key otherwise)", plan_then_alias,
          check=lambda r: close_to(r[1])(r[0]), expect_error=False)
    probe(S, "total_q 0 with B=2 (return_lse)", lambda: T(q[:0], k, v, **dict(
        kw, cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), return_lse=True),
        check=lambda r: None if r[0].shape == (0, 4, 16) and r[1].shape == (4, 0) else f"{r[0].shape} {r[1].shape}",
        expect_error=False)


# ------------------------------------------------------------------------------------------------ tp
def sec_tp():
    from blockdiff.attention.tp import (HeadShard, attention_head_parallel, attention_tp, gather_heads, head_shard,
                                        shard_heads)
    S = "attention.tp"
    q, k, v, kw = paged_batch(H=8, Hkv=2)
    good = ref(q, k, v, **kw)
    for name, args, word in [("GQA 8 / 3", (8, 3, 2, 0), "num_kv_heads"), ("8 heads on 3 ranks", (8, 2, 3, 0),
                                                                           "world_size"),
                             ("rank -1", (8, 2, 2, -1), "rank"), ("world_size True", (8, 2, True, 0), "world_size"),
                             ("Hkv 2, world 4 / 8 heads, rank 7 of 4", (8, 2, 4, 7), "rank"),
                             ("Hkv 4, world 8, 8 heads: KV replicated", (8, 4, 8, 7), None)]:
        if word is None:
            probe(S, f"head_shard {name}", lambda a=args: head_shard(*a),
                  check=lambda r: None if (r.kv_start, r.kv_end, r.q_start) == (3, 4, 7) else f"{r}",
                  expect_error=False)
        else:
            probe(S, f"head_shard {name}", lambda a=args: head_shard(*a), word)
    probe(S, "attention_head_parallel world 2 == unsharded",
          lambda: attention_head_parallel(q, k, v, world_size=2, backend="reference", **kw), check=close_to(good, 1e-6),
          expect_error=False)
    for name, fn, word in [
        ("attention_head_parallel world_size 0", lambda: attention_head_parallel(q, k, v, world_size=0,
                                                                                 backend="reference", **kw),
         "world_size"),
        ("attention_head_parallel world_size -2", lambda: attention_head_parallel(q, k, v, world_size=-2,
                                                                                  backend="reference", **kw),
         "world_size"),
        ("attention_head_parallel world_size 2.0", lambda: attention_head_parallel(q, k, v, world_size=2.0,
                                                                                   backend="reference", **kw),
         "world_size"),
        ("attention_head_parallel q a list", lambda: attention_head_parallel([q], k, v, world_size=2,
                                                                             backend="reference", **kw), "q"),
        ("shard_heads q None", lambda: shard_heads(None, k, v, head_shard(8, 2, 2, 0)), "q"),
        ("shard_heads shard a str", lambda: shard_heads(q, k, v, "rank0"), "shard"),
        ("attention_tp shard None", lambda: attention_tp(q, k, v, shard=None, backend="reference", **kw), "shard"),
        ("gather_heads []", lambda: gather_heads([]), "outs"),
        ("gather_heads total_q mismatch", lambda: gather_heads([good[:, :4], good[:4, 4:]]), "total_q"),
        ("HeadShard with q_end < q_start", lambda: HeadShard(0, 2, 8, 2, 4, 0, 0, 1), "q_end"),
    ]:
        probe(S, name, fn, word)


# ------------------------------------------------------------------------------------------------ sampler
def sec_sampler():
    from blockdiff.sampler import FINISHED, SamplerState, SamplingParams, sampler_step
    S = "SamplingParams"
    for name, kw, word in [
        ("eos_token_ids={1,'a'}", dict(eos_token_ids={1, "a"}), "eos_token_ids"),
        ("eos_token_ids={1,None}", dict(eos_token_ids={1, None}), "eos_token_ids"),
        ("eos_token_ids=range(3)", dict(eos_token_ids=range(3)), "eos_token_ids"),
        ("eos_token_ids=frozenset()", dict(eos_token_ids=frozenset()), None),
        ("eos_token_ids=[[1]]", dict(eos_token_ids=[[1]]), "eos_token_ids"),
        ("t_min=0, t_max=1e-45", dict(t_min=0.0, t_max=1e-45), "t_"),
        ("t_min=t_max=0.5, steps=1", dict(t_min=0.5, t_max=0.5, max_denoising_steps=1), None),
        ("seed=numpy int64", dict(seed=__import__("numpy").int64(3)), "seed"),
        ("max_tokens=2**62+1", dict(max_tokens=2 ** 62 + 1), "max_tokens"),
        ("max_tokens=2**62", dict(max_tokens=2 ** 62), None),
        ("confidence_threshold=1e39", dict(confidence_threshold=1e39), "confidence_threshold"),
        ("canvas_length=None", dict(canvas_length=None), "canvas_length"),
        ("stability_threshold=2**31", dict(stability_threshold=2 ** 31), "stability_threshold"),
    ]:
        probe(S, name, lambda kw=kw: SamplingParams(**kw), word, check=(lambda r: None) if word is None else None,
              expect_error=word is not None)
    probe(S, "dataclasses.replace(canvas_length=0)", lambda: dataclasses.replace(SamplingParams(), canvas_length=0),
          "canvas_length")

    S = "SamplerState"
    P = SamplingParams(canvas_length=4, max_denoising_steps=3)
    for name, fn, word in [
        ("device='cuda' here", lambda: SamplerState(1, 4, 7, 4, device="cuda:7"), "device"),
        ("max_eos=-1", lambda: SamplerState(1, 4, 7, 4, max_eos=-1), "max_eos"),
        ("vocab 2**31", lambda: SamplerState(1, 4, 2 ** 31, 4), "vocab_size"),
        ("add_request slot=True", lambda: SamplerState(2, 4, 7, 4).add_request(True, 0, P), "slot"),
        ("add_request request_id=2**63", lambda: SamplerState(2, 4, 7, 4).add_request(0, 2 ** 63, P), "request_id"),
        ("add_request num_emitted=-1", lambda: SamplerState(2, 4, 7, 4).add_request(0, 0, P, num_emitted=-1),
         "num_emitted"),
        ("add_request canvas_index=2**31", lambda: SamplerState(2, 4, 7, 4).add_request(0, 0, P, canvas_index=2 ** 31),
         "canvas_index"),
        ("add_request canvas 8 vs 4", lambda: SamplerState(2, 4, 7, 4).add_request(0, 0, SamplingParams(canvas_length=8)),
         "canvas_length"),
        ("add_request 9 eos ids, max_eos 8", lambda: SamplerState(2, 4, 16, 4).add_request(
            0, 0, SamplingParams(canvas_length=4, eos_token_ids=tuple(range(9)))), "max_eos"),
        ("add_request eos 2**70", lambda: SamplerState(2, 4, 7, 4).add_request(
            0, 0, SamplingParams(canvas_length=4, eos_token_ids=(2 ** 70,))), "eos_token_ids"),
        ("add_request params a dict", lambda: SamplerState(2, 4, 7, 4).add_request(0, 0, {"canvas_length": 4}),
         "params"),
        ("reserve_eos(-1)", lambda: SamplerState(2, 4, 7, 4).reserve_eos(-1), "n must"),
        ("remove_request(99)", lambda: SamplerState(2, 4, 7, 4).remove_request(99), "slot"),
    ]:
        probe(S, name, fn, word)

    S = "sampler_step"
    st = SamplerState(2, 4, 7, 4)
    st.add_request(0, 0, P)
    E = torch.randn(7, 4, generator=gen(1))
    one = torch.tensor([0])
    L = torch.zeros(1, 4, 7)
    pd = torch.ones(1, dtype=torch.bool)
    for name, args, kwx, word in [
        ("state None", (None, one, L, pd, E), {}, "state"),
        ("embedding hidden 5 vs 4", (st, one, L, pd, torch.randn(7, 5)), {}, "embedding"),
        ("embedding 1-D", (st, one, L, pd, torch.randn(7)), {}, "embedding"),
        ("logits canvas 5 vs 4", (st, one, torch.zeros(1, 5, 7), pd, E), {}, "logits"),
        ("logits N 2 vs slots 1", (st, one, torch.zeros(2, 4, 7), pd, E), {}, "logits"),
        ("prefill_done 2 vs 1", (st, one, L, torch.ones(2, dtype=torch.bool), E), {}, "prefill_done"),
        ("slots -1", (st, torch.tensor([-1]), L, pd, E), {}, "slot"),
        ("check_values 'no'", (st, one, L, pd, E), dict(check_values="no"), "check_values"),
        ("backend 'fused'", (st, one, L, pd, E), dict(backend="fused"), "backend"),
        ("embedding int64", (st, one, L, pd, torch.zeros(7, 4, dtype=torch.int64)), {}, "embedding"),
    ]:
        probe(S, name, lambda a=args, kx=kwx: sampler_step(*a, **kx), word)

    def run(backend, V=7, CL=4, N=2, dtype=torch.float32, transpose=False, emb_dtype=torch.float32, steps=2,
            params=None):
        st = SamplerState(max(N, 1), CL, V, 4)
        for i in range(N):
            st.add_request(i, 100 + i, params or SamplingParams(canvas_length=CL, max_denoising_steps=4, seed=i))
        slots = torch.arange(N)
        emb = torch.randn(V, 4, generator=gen(2)).to(emb_dtype)
        sampler_step(st, slots, torch.zeros(N, CL, V), torch.ones(N, dtype=torch.bool), emb, backend=backend)
        g = gen(9)
        outs = []
        for _ in range(steps):
            x = torch.randn(N, CL, V, generator=g).to(dtype)
            if transpose:
                x = x.transpose(0, 1).contiguous().transpose(0, 1)
            outs.append(sampler_step(st, slots, x, torch.zeros(N, dtype=torch.bool), emb, backend=backend))
        return st, outs

    def same_as_reference(**kw):
        def fn():
            return run("triton", **kw), run("reference", **kw)
        return fn

    def agree(r, soft_atol=1e-4):
        (st_t, o_t), (st_r, o_r) = r
        for a, b in zip(o_t, o_r):
            for f in ("sampled", "accepted", "finished"):
                if not torch.equal(getattr(a, f), getattr(b, f)):
                    return f"{f} differs: {getattr(a, f).tolist()} vs {getattr(b, f).tolist()}"
        if not torch.equal(st_t.canvas, st_r.canvas):
            return "canvas differs"
        if not torch.allclose(st_t.soft, st_r.soft, atol=soft_atol):
            return f"soft differs by {(st_t.soft - st_r.soft).abs().max().item():.3g}"
        return None
    from blockdiff.sampler.triton.config import SamplerConfig
    for name, kw, word in [("split_k=0", dict(split_k=0), "split_k"), ("block_m=True", dict(block_m=True), "block_m"),
                           ("gemm_warps=-1", dict(gemm_warps=-1), "gemm_warps"), ("split_v=2.0", dict(split_v=2.0),
                                                                                   "split_v")]:
        probe("SamplerConfig", name, lambda kw=kw: SamplerConfig(**kw), word)
    S = "sampler_step triton"
    for name, kw in [("vocab 1", dict(V=1)), ("canvas 1", dict(CL=1)), ("vocab 3, canvas 13", dict(V=3, CL=13)),
                     ("logits fp16", dict(dtype=torch.float16)), ("logits bf16", dict(dtype=torch.bfloat16)),
                     ("logits non-contiguous", dict(transpose=True)), ("embedding bf16", dict(emb_dtype=torch.bfloat16)),
                     ("greedy", dict(params=SamplingParams(canvas_length=4, t_min=0.0, t_max=0.0))),
                     ("one row", dict(N=1)), ("max_denoising_steps 1, 3 steps",
                                              dict(steps=3, params=SamplingParams(canvas_length=4,
                                                                                  max_denoising_steps=1)))]:
        # a bf16 embedding: the soft embedding agrees to bf16 rounding (E's own precision), not fp32's
        probe(S, name, same_as_reference(**kw), expect_error=False,
              check=lambda r, kw=kw: agree(r, 2e-2 if kw.get("emb_dtype") == torch.bfloat16 else 1e-4))

    def empty_slot():
        st = SamplerState(2, 4, 7, 4)
        o = sampler_step(st, torch.tensor([1]), torch.randn(1, 4, 7), torch.zeros(1, dtype=torch.bool), E)
        return st, o
    probe("sampler_step", "step on a never-added (FINISHED) slot", empty_slot,
          check=lambda r: None if int(r[0].phase[1]) == FINISHED and int(r[1].num_sampled.sum()) == 0
          else f"phase {r[0].phase.tolist()} sampled {r[1].num_sampled.tolist()}", expect_error=False)


# ------------------------------------------------------------------------------------------------ model
def sec_model():
    from blockdiff.model import CheckpointError, DiffusionGemma, DiffusionGemmaConfig, geometry_config, tiny_config
    from blockdiff.model.pretrained import load_pretrained, shipped_checkpoint_dir
    S = "model.config"
    for name, kw, word in [
        ("num_hidden_layers=0", dict(num_hidden_layers=0), "num_hidden_layers"),
        ("head_dim=15", dict(head_dim=15), "head_dim"),
        ("all sliding layers", dict(layer_types=["sliding_attention"] * 4), "layer_types"),
        ("layer_types a str", dict(layer_types="full_attention"), "layer_types"),
        ("rope for sliding only", dict(rope_parameters={"sliding_attention": {"rope_theta": 1e4}}), "rope_parameters"),
        ("rope_theta 'abc'", dict(rope_parameters={"sliding_attention": {"rope_theta": "abc"},
                                                   "full_attention": {"rope_theta": 1e6}}), "rope_theta"),
        ("rope_theta inf", dict(rope_parameters={"sliding_attention": {"rope_theta": math.inf},
                                                 "full_attention": {"rope_theta": 1e6}}), "rope_theta"),
        ("partial_rotary_factor 0", dict(rope_parameters={"sliding_attention": {"rope_theta": 1e4},
                                                          "full_attention": {"rope_theta": 1e6,
                                                                             "partial_rotary_factor": 0.0}}),
         "partial_rotary_factor"),
        ("final_logit_softcapping 0", dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
        ("eos_token_id [1, 300]", dict(eos_token_id=[1, 300]), "eos_token_id"),
        ("eos_token_id '1'", dict(eos_token_id="1"), "eos_token_id"),
        ("canvas_length 5000 > max_position_embeddings", dict(canvas_length=5000), "canvas_length"),
        ("hidden_activation relu", dict(hidden_activation="relu"), "hidden_activation"),
        ("vocab_size True", dict(vocab_size=True), "vocab_size"),
        ("sliding_window 0", dict(sliding_window=0), "sliding_window"),
        ("top_k_experts 5 > num_experts 4", dict(top_k_experts=5), "top_k_experts"),
        ("rms_norm_eps 0", dict(rms_norm_eps=0.0), "rms_norm_eps"),
        ("tie_word_embeddings 1", dict(tie_word_embeddings=1), "tie_word_embeddings"),
        ("bidirectional_window 'both'", dict(bidirectional_window="both"), "bidirectional_window"),
    ]:
        probe(S, f"tiny_config({name})", lambda kw=kw: tiny_config(**kw), word)
    probe(S, "tiny_config(eos_token_id=[])", lambda: tiny_config(eos_token_id=[]), check=lambda r: None,
          expect_error=False)
    tmp = tempfile.mkdtemp(prefix="adv3_model_")
    empty_cfg = os.path.join(tmp, "emptycfg")
    os.makedirs(empty_cfg)
    open(os.path.join(empty_cfg, "config.json"), "w").write("{}")
    for name, fn, word in [
        ("from_hf({})", lambda: DiffusionGemmaConfig.from_hf({}), "hidden_size"),
        ("from_hf text_config [1]", lambda: DiffusionGemmaConfig.from_hf({"text_config": [1]}), "text_config"),
        ("from_hf missing path", lambda: DiffusionGemmaConfig.from_hf(os.path.join(tmp, "nope")), "config.json"),
        ("from_hf folder with config.json {}", lambda: DiffusionGemmaConfig.from_hf(empty_cfg), "config.json"),
        ("from_hf override bogus=1", lambda: DiffusionGemmaConfig.from_hf(tiny_config().to_dict(), bogus=1), "bogus"),
        ("from_hf per_layer_config [1]", lambda: DiffusionGemmaConfig.from_hf(
            {**tiny_config().to_dict(), "per_layer_config": [1]}), "per_layer_config"),
        ("from_hf(5)", lambda: DiffusionGemmaConfig.from_hf(5), "hf_config"),
        ("geometry_config('x')", lambda: geometry_config("x"), "geometry"),
        ("DiffusionGemma(dict)", lambda: DiffusionGemma(tiny_config().to_dict()), "config"),
    ]:
        probe(S, name, fn, word)
    probe(S, "from_hf(to_dict()) round trip", lambda: DiffusionGemmaConfig.from_hf(tiny_config().to_dict()),
          check=lambda r: None if r == tiny_config() else "differs", expect_error=False)

    S = "model.checkpoint"
    ship = shipped_checkpoint_dir()

    def mutated(name, fn):
        d = os.path.join(tmp, name)
        shutil.copytree(ship, d)
        fn(d)
        return d

    def edit_weights(d, f):
        from safetensors.torch import load_file, save_file
        p = os.path.join(d, "model.safetensors")
        sd = load_file(p)
        f(sd)
        save_file(sd, p)

    def first_key(sd, pred=lambda k, t: True):
        return next(k for k, t in sorted(sd.items()) if pred(k, t))
    cases = [
        ("a weight missing", lambda d: edit_weights(d, lambda sd: sd.pop(first_key(sd))), None),
        ("an extra weight", lambda d: edit_weights(d, lambda sd: sd.__setitem__("bogus.weight", torch.zeros(2))),
         None),
        ("a weight of the wrong shape", lambda d: edit_weights(d, lambda sd: sd.__setitem__(
            first_key(sd, lambda k, t: t.dim() == 2), torch.zeros(3, 3))), None),
        ("a weight as int32", lambda d: edit_weights(d, lambda sd: sd.__setitem__(
            first_key(sd, lambda k, t: t.dim() == 2), sd[first_key(sd, lambda k, t: t.dim() == 2)].to(torch.int32))),
         None),
        ("truncated safetensors", lambda d: open(os.path.join(d, "model.safetensors"), "r+b").truncate(1000),
         "safetensors"),
        ("tokenizer.json garbage", lambda d: open(os.path.join(d, "tokenizer.json"), "w").write("{"), "tokenizer"),
        ("config.json vocab 300", lambda d: json.dump({**json.load(open(os.path.join(d, "config.json"))),
                                                        "vocab_size": 300}, open(os.path.join(d, "config.json.new"),
                                                                                 "w")) or
         os.replace(os.path.join(d, "config.json.new"), os.path.join(d, "config.json")), None),
        ("generation_config.json max_denoising_steps 0", lambda d: open(os.path.join(
            d, "generation_config.json"), "w").write('{"max_denoising_steps": 0}'), "max_denoising_steps"),
        ("generation_config.json unknown key", lambda d: open(os.path.join(
            d, "generation_config.json"), "w").write('{"temperature": 0.7}'), "temperature"),
        ("generation_config.json eos 'x'", lambda d: open(os.path.join(
            d, "generation_config.json"), "w").write('{"eos_token_id": "x"}'), "eos_token_id"),
    ]
    for name, fn, word in cases:
        d = mutated(name.replace(" ", "_").replace(".", "_"), fn)
        probe(S, f"load_pretrained: {name}", lambda d=d: load_pretrained(d), word)
    probe(S, "load_pretrained(missing folder)", lambda: load_pretrained(os.path.join(tmp, "none")), "does not exist")
    probe(S, "load_pretrained(a file)", lambda: load_pretrained(os.path.join(ship, "config.json")), "folder")
    from blockdiff.model.export import export_hf
    probe(S, "export_hf(dtype='int8')", lambda: export_hf(tiny_config(vocab_size=300), os.path.join(tmp, "e1"),
                                                          dtype="int8"), "dtype")
    probe(S, "export_hf(source=5)", lambda: export_hf(5, os.path.join(tmp, "e2")), "source")
    probe(S, "export_hf(t_min=-1)", lambda: export_hf(tiny_config(vocab_size=300), os.path.join(tmp, "e3"), t_min=-1.0),
          "t_min")
    probe(S, "export_hf(out_dir=source)", lambda: export_hf(mutated("selfsrc", lambda d: None),
                                                            os.path.join(tmp, "selfsrc")), "source")

    def rt():
        torch.manual_seed(0)
        m = DiffusionGemma(tiny_config(vocab_size=300, canvas_length=8)).eval()
        out = os.path.join(tmp, "rt")
        export_hf(m, out, dtype=torch.float32, max_denoising_steps=7, t_min=0.1, t_max=0.3)
        from blockdiff.model import load_generation_config
        b, _ = load_pretrained(out)
        sa, sb = m.state_dict(), b.state_dict()
        diff = [k for k in sa if not torch.equal(sa[k], sb[k])]
        gc = load_generation_config(out)
        return diff, gc
    probe(S, "export a random tiny model, load it back", rt,
          check=lambda r: None if not r[0] and r[1]["max_denoising_steps"] == 7 and abs(r[1]["t_min"] - 0.1) < 1e-7
          else f"differing {r[0][:3]}, {r[1]}", expect_error=False)
    _ = CheckpointError


# ------------------------------------------------------------------------------------------------ harness
def sec_harness():
    import numpy as np

    from blockdiff.integration.harness import HarnessRunner
    from blockdiff.model import DiffusionGemma, tiny_config
    from blockdiff.sampler import SamplingParams

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    CL = 8
    model = DiffusionGemma(tiny_config(canvas_length=CL)).eval()
    P = lambda **kw: SamplingParams(**{"canvas_length": CL, "max_denoising_steps": 3, "seed": 7, **kw})  # noqa: E731

    def R(**kw):
        base = dict(default_params=P(), max_num_reqs=4, max_num_batched_tokens=4 * CL, page_size=4, max_model_len=64)
        base.update(kw)
        return HarnessRunner(model, **base)

    def V(**kw):  # a vLLM-style SamplingParams stand-in
        base = dict(temperature=1.0, seed=None, max_tokens=None, eos_token_id=None, stop_token_ids=None,
                    ignore_eos=False, extra_args=None)
        base.update(kw)
        return types.SimpleNamespace(**base)
    S = "harness"
    for name, fn, word in [
        ("max_model_len 10**6 > max_position_embeddings 4096", lambda: R(max_model_len=10 ** 6, num_blocks=8),
         "max_position_embeddings"),
        ("max_num_batched_tokens < canvas", lambda: R(max_num_batched_tokens=CL - 1), "max_num_batched_tokens"),
        ("device 'cuda:3'", lambda: R(device="cuda:3"), "device"),
        ("kv_dtype float16 vs model float32", lambda: R(kv_dtype=torch.float16), "kv_dtype"),
        ("sampler_backend 'fused'", lambda: R(sampler_backend="fused"), "sampler_backend"),
        ("attn_backend 'flash'", lambda: R(attn_backend="flash"), "attn_backend"),
        ("default_params canvas 64 = max_model_len", lambda: R(default_params=P(canvas_length=64),
                                                              max_num_batched_tokens=256), "max_model_len"),
        ("default_params a dict", lambda: R(default_params={"canvas_length": CL}), "default_params"),
        ("prompt 2-D tensor", lambda: R().add_request("a", torch.zeros(1, 3, dtype=torch.int64)), "prompt"),
        ("prompt float tensor", lambda: R().add_request("a", torch.zeros(3)), "prompt"),
        ("prompt bools", lambda: R().add_request("a", [True, False]), "prompt"),
        ("prompt a str", lambda: R().add_request("a", "hello"), "prompt"),
        ("prompt numpy float array", lambda: R().add_request("a", np.zeros(3)), "prompt"),
        ("params a dict", lambda: R().add_request("a", [5], {"max_tokens": 3}), "params"),
        ("vLLM params stop_token_ids=5 (an int)", lambda: R().add_request("a", [5], V(stop_token_ids=5)),
         "stop_token_ids"),
        ("vLLM params temperature 0.5", lambda: R().add_request("a", [5], V(temperature=0.5)), "temperature"),
        ("vLLM params top_k 5", lambda: R().add_request("a", [5], V(top_k=5)), "top_k"),
        ("vLLM params n 2", lambda: R().add_request("a", [5], V(n=2)), "n=2"),
        ("vLLM params extra_args typo", lambda: R().add_request("a", [5], V(extra_args={"tmax": 1.0})), "tmax"),
        ("vLLM params diffusion_canvas_length 16", lambda: R().add_request(
            "a", [5], V(extra_args={"diffusion_canvas_length": 16})), "canvas_length"),
        ("vLLM params max_tokens 2.0", lambda: R().add_request("a", [5], V(max_tokens=2.0)), "max_tokens"),
        ("vLLM params eos_token_id 300 (>= vocab)", lambda: R().add_request("a", [5], V(eos_token_id=300)), "vocab"),
        ("arrival_step 1.0", lambda: R().add_request("a", [5], arrival_step=1.0), "arrival_step"),
        ("req_id ''", lambda: R().add_request("", [5]), "req_id"),
        ("run(max_steps=0)", lambda: R().run(max_steps=0), "max_steps"),
        ("run(max_steps=True)", lambda: R().run(max_steps=True), "max_steps"),
        ("run(on_step=5)", lambda: R().run(on_step=5), "on_step"),
    ]:
        probe(S, name, fn, word)

    def preempt_waiting():
        r = R()
        r.add_request("a", [5])
        r.preempt("a")
    probe(S, "preempt a waiting request", preempt_waiting, "not running")

    def preempt_twice():
        r = R()
        r.add_request("a", [5, 6], P(max_tokens=2 * CL))
        r.step()
        r.preempt("a")
        r.preempt("a")
    probe(S, "preempt twice between steps", preempt_twice, "not running")

    def abort_preempted():
        r = R()
        r.add_request("a", [5, 6], P(max_tokens=2 * CL))
        r.add_request("b", [7], P(max_tokens=CL))
        r.step()
        r.step()
        r.preempt("a")
        res = r.abort("a")
        out = r.run(max_steps=200)
        return r, res, out
    probe(S, "abort a preempted request", abort_preempted,
          check=lambda x: None if x[1].finish_reason == "aborted" and x[2]["b"].finish_reason in ("length", "eos")
          and x[0].allocator.num_free == x[0].allocator.num_blocks else f"{x[1]} {x[2]}", expect_error=False)

    def abort_finished():
        r = R()
        r.add_request("a", [5], P(max_tokens=CL))
        r.run(max_steps=100)
        r.abort("a")
    probe(S, "abort a finished request", abort_finished, "already finished")

    def idle_steps():
        r = R()
        recs = [r.step() for _ in range(3)]
        return r, recs
    probe(S, "step() with nothing queued", idle_steps,
          check=lambda x: None if x[0].step_index == 3 and not x[0].has_unfinished else f"{x[0].step_index}",
          expect_error=False)
    probe(S, "totals() before any step", lambda: R().totals(), check=lambda t: None if isinstance(t, dict) else f"{t}",
          expect_error=False)

    def one(prompt, params=None, **kw):
        r = R(**kw)
        r.add_request("a", prompt, params or P(max_tokens=CL))
        return r.run(max_steps=300)["a"]
    probe(S, "prompt numpy uint8 array", lambda: one(np.array([5, 6, 7], dtype=np.uint8)),
          check=lambda res: None if len(res.output_token_ids) == CL else f"{res}", expect_error=False)
    probe(S, "prompt list of numpy int64", lambda: one([np.int64(5), np.int64(6)]),
          check=lambda res: None if len(res.output_token_ids) == CL else f"{res}", expect_error=False)
    probe(S, "max_tokens=1", lambda: one([5, 6], P(max_tokens=1)),
          check=lambda res: None if len(res.output_token_ids) == 1 and res.finish_reason == "length" else f"{res}",
          expect_error=False)
    probe(S, "max_tokens=CL+1 (two canvases, trimmed)", lambda: one([5, 6], P(max_tokens=CL + 1)),
          check=lambda res: None if len(res.output_token_ids) == CL + 1 else f"{res}", expect_error=False)
    probe(S, "vLLM params greedy + seed + max_tokens", lambda: one([5, 6], V(temperature=0.0, seed=3, max_tokens=5)),
          check=lambda res: None if len(res.output_token_ids) == 5 else f"{res}", expect_error=False)
    probe(S, "page_size 64 > max_model_len", lambda: one([5], page_size=64),
          check=lambda res: None if len(res.output_token_ids) == CL else f"{res}", expect_error=False)

    def preempt_same():
        a = R()
        for i in range(2):
            a.add_request(f"r{i}", [5 + i, 6], P(max_tokens=2 * CL, seed=i))
        ra = a.run(max_steps=500)
        b = R()
        for i in range(2):
            b.add_request(f"r{i}", [5 + i, 6], P(max_tokens=2 * CL, seed=i))
        for _ in range(5):
            b.step()
        if b.slot_of("r0") is not None:
            b.preempt("r0")
        rb = b.run(max_steps=500)
        return ra, rb
    probe(S, "preempt mid-run: same tokens as unpreempted", preempt_same,
          check=lambda x: None if all(x[0][k].output_token_ids == x[1][k].output_token_ids for k in x[0])
          else "outputs differ", expect_error=False)

    def reuse_runner():
        r = R()
        r.add_request("a", [5], P(max_tokens=CL))
        r.run(max_steps=100)
        r.add_request("b", [5], P(max_tokens=CL))
        return r.run(max_steps=100)
    probe(S, "add after a finished run (runner reused)", reuse_runner,
          check=lambda res: None if set(res) == {"a", "b"} and res["b"].finish_reason == "length" else f"{res}",
          expect_error=False)

    def same_seed_two_ids():
        r = R()
        r.add_request("x", [5, 6], P(max_tokens=CL, seed=1))
        r.add_request("y", [5, 6], P(max_tokens=CL, seed=1))
        res = r.run(max_steps=200)
        return res
    probe(S, "same seed + prompt, two ids: both finish", same_seed_two_ids,
          check=lambda res: None if {res[k].finish_reason for k in res} <= {"length", "eos"} else f"{res}",
          expect_error=False)

    def eos_greedy_list():
        r = R()
        r.add_request("a", [5], V(temperature=0.0, stop_token_ids=list(range(256)), max_tokens=3 * CL))
        return r.run(max_steps=300)["a"]
    probe(S, "vLLM stop_token_ids = every id", eos_greedy_list,
          check=lambda res: None if len(res.output_token_ids) == 1 and res.finish_reason == "eos" else f"{res}",
          expect_error=False)


# ------------------------------------------------------------------------------------------------ integration
def sec_integration():
    from blockdiff.integration import model_state as MS
    from blockdiff.integration.kv_alloc import BlockAllocator
    from blockdiff.integration.sampler import accounting
    from blockdiff.integration.vllm_plugin import attn_backend_from_env, bidirectional_window_of
    from blockdiff.integration.vllm_scheduler import diffusion_canvas_width
    from blockdiff.sampler import SamplingParams

    S = "vllm_plugin"
    old = os.environ.get("BLOCKDIFF_ATTN_BACKEND")
    try:
        for val, ok in [("TRITON", False), ("reference\n", False), ("cute", True), ("triton,reference", False)]:
            os.environ["BLOCKDIFF_ATTN_BACKEND"] = val
            if ok:
                probe(S, f"attn_backend_from_env {val!r}", attn_backend_from_env,
                      check=lambda r, v=val: None if r == v else r, expect_error=False)
            else:
                probe(S, f"attn_backend_from_env {val!r}", attn_backend_from_env, "BLOCKDIFF_ATTN_BACKEND")
    finally:
        if old is None:
            os.environ.pop("BLOCKDIFF_ATTN_BACKEND", None)
        else:
            os.environ["BLOCKDIFF_ATTN_BACKEND"] = old
    for name, cfg, word in [("dict 'Prefix'", {"bidirectional_window": "Prefix"}, "bidirectional_window"),
                            ("attr 5", types.SimpleNamespace(bidirectional_window=5), "bidirectional_window"),
                            ("dict ['prefix']", {"bidirectional_window": ["prefix"]}, "bidirectional_window")]:
        probe(S, f"bidirectional_window_of {name}", lambda c=cfg: bidirectional_window_of(c), word)
    probe(S, "bidirectional_window_of object without the key", lambda: bidirectional_window_of(object()),
          check=lambda r: None if r == "prefix" else r, expect_error=False)

    S = "vllm_scheduler"
    req = lambda w: types.SimpleNamespace(sampling_params=types.SimpleNamespace(  # noqa: E731
        extra_args={"diffusion_canvas_length": w}))
    for name, w, word in [("'abc'", "abc", "diffusion_canvas_length"), ("2.7", 2.7, "diffusion_canvas_length"),
                          ("-4", -4, "diffusion_canvas_length"), ("True", True, "diffusion_canvas_length"),
                          ("0", 0, "diffusion_canvas_length")]:
        probe(S, f"diffusion_canvas_width extra {name}", lambda w=w: diffusion_canvas_width(req(w), 8), word)
    probe(S, "diffusion_canvas_width extra 16", lambda: diffusion_canvas_width(req(16), 8),
          check=lambda r: None if r == 16 else r, expect_error=False)
    probe(S, "diffusion_canvas_width extra_args None", lambda: diffusion_canvas_width(
        types.SimpleNamespace(sampling_params=types.SimpleNamespace(extra_args=None)), 8),
        check=lambda r: None if r == 8 else r, expect_error=False)

    S = "integration helpers"
    z = torch.zeros(2, dtype=torch.int32)
    for name, fn, word in [
        ("accounting fused without canvas_length", lambda: accounting(z, z, z, torch.zeros(2, dtype=torch.bool),
                                                                      torch.zeros(2, 4), fused=torch.ones(2, dtype=torch.bool)),
         "canvas_length"),
        ("request_key(5)", lambda: MS.request_key(5), "req_id"),
        ("rng_request_id extra 5", lambda: MS.rng_request_id(types.SimpleNamespace(extra_args={"rng_request_id": 5}),
                                                              "r"), "rng_request_id"),
        ("rng_request_id extra ''", lambda: MS.rng_request_id(types.SimpleNamespace(extra_args={"rng_request_id": ""}),
                                                               "r"), "rng_request_id"),
        ("stop_token_ids_of eos True", lambda: MS.stop_token_ids_of(types.SimpleNamespace(eos_token_id=True)),
         "stop_token_ids"),
        ("stop_token_ids_of stop_token_ids=7", lambda: MS.stop_token_ids_of(types.SimpleNamespace(stop_token_ids=7)),
         "stop_token_ids"),
        ("to_diffusion_params defaults 'x'", lambda: MS.to_diffusion_params(types.SimpleNamespace(seed=1), "x"),
         "defaults"),
        ("to_diffusion_params canvas mismatch", lambda: MS.to_diffusion_params(SamplingParams(canvas_length=8),
                                                                               canvas_length=16), "canvas_length"),
        ("to_diffusion_params extra_args a list", lambda: MS.to_diffusion_params(types.SimpleNamespace(extra_args=[1])),
         "extra_args"),
        ("to_diffusion_params temperature nan", lambda: MS.to_diffusion_params(
            types.SimpleNamespace(temperature=math.nan)), "temperature"),
        ("to_diffusion_params greedy + t_max 0.5", lambda: MS.to_diffusion_params(
            types.SimpleNamespace(temperature=0.0, extra_args={"t_max": 0.5})), "t_max"),
        ("BlockAllocator(0, 16)", lambda: BlockAllocator(0, 16), "num_blocks"),
        ("BlockAllocator.ensure(owner, 2.5 tokens)", lambda: BlockAllocator(4, 16).ensure("a", 2.5), "num_tokens"),
        ("BlockAllocator.ensure(owner, -3 tokens)", lambda: BlockAllocator(4, 16).ensure("a", -3), "num_tokens"),
    ]:
        probe(S, name, fn, word)
    probe(S, "unsupported_vllm_options top_p 0.9, temperature 'x' (not greedy)", lambda: MS.unsupported_vllm_options(
        types.SimpleNamespace(top_p=0.9, temperature="x")), check=lambda r: None if r == ["top_p=0.9"] else f"{r}",
        expect_error=False)
    probe(S, "to_diffusion_params greedy (temperature 1e-6) + top_p 0.5", lambda: MS.to_diffusion_params(
        types.SimpleNamespace(temperature=1e-6, top_p=0.5)), check=lambda p: None if p.greedy else f"{p}",
        expect_error=False)


# ------------------------------------------------------------------------------------------------ CLIs
def sec_cli():
    tmp = tempfile.mkdtemp(prefix="adv3_cli_")
    env = dict(TRITON_INTERPRET="1")

    def f(name, text):
        p = os.path.join(tmp, name)
        with open(p, "w") as fh:
            fh.write(text)
        return p
    S = "bench_attention"
    ba = ["-m", "blockdiff.bench.bench_attention", "--quick", "--no-plots", "--out", os.path.join(tmp, "ba"),
          "--workloads", "nothing-matches-this"]
    for name, extra, word in [
        ("--tile-configs not JSON", ["--tile-configs", "{bad"], "tile-configs"),
        ("--tile-configs a JSON number", ["--tile-configs", "5"], "tile-configs"),
        ("--cute-configs not JSON", ["--cute-configs", "[{"], "cute-configs"),
        ("--backends bogus", ["--backends", "bogus"], "backends"),
        ("--page-size 0", ["--page-size", "0"], "page-size"),
        ("--page-size -4", ["--page-size", "-4"], "page-size"),
        ("--device bogus", ["--device", "bogus"], "device"),
        ("--workloads matching nothing", [], "workloads"),
        ("--cpu-reps -1", ["--cpu-reps", "-1"], "cpu-reps"),
        ("--budget-s nan", ["--budget-s", "nan"], "budget-s"),
    ]:
        cli(S, name, [*ba, *extra], env=env, word=word, timeout=180)
    S = "bench_sampler"
    bs = ["-m", "blockdiff.bench.bench_sampler", "--quick", "--no-plots", "--out", os.path.join(tmp, "bs")]
    for name, extra, word in [
        ("--split-k abc", ["--split-k", "abc"], "split-k"),
        ("--split-k 0", ["--split-k", "0"], "split-k"),
        ("--gemm-tiles 1x2", ["--gemm-tiles", "1x2"], "gemm-tiles"),
        ("--gemm-tiles axbxcxdxe", ["--gemm-tiles", "axbxcxdxe"], "gemm-tiles"),
        ("--backends bogus", ["--backends", "bogus"], "backends"),
    ]:
        cli(S, name, [*bs, *extra], env=env, word=word, timeout=180)
    S = "make_tables"
    mt = ["-m", "blockdiff.bench.make_tables"]
    readme = f("README.md", "# x\n")
    res = os.path.join(tmp, "res")
    os.makedirs(res)
    cli(S, "--results missing folder", [*mt, "--results", os.path.join(tmp, "nope"), "--readme", readme],
        word="results")
    cli(S, "--results a file", [*mt, "--results", readme, "--readme", readme], word="results")
    r1 = os.path.join(tmp, "r1")
    os.makedirs(r1)
    open(os.path.join(r1, "a.json"), "w").write('{"gpu": "H200", "rows": 5}')
    cli(S, "record rows = 5 (skipped with a note)", [*mt, "--results", r1, "--stdout"], want_rc=0)
    r2 = os.path.join(tmp, "r2")
    os.makedirs(r2)
    open(os.path.join(r2, "a.json"), "w").write('{"gpu": "H200", "rows": [1, "x"]}')
    cli(S, "record rows [1, 'x'] (skipped with a note)", [*mt, "--results", r2, "--stdout"], want_rc=0)
    r3 = os.path.join(tmp, "r3")
    os.makedirs(r3)
    open(os.path.join(r3, "a.json"), "w").write('{"gpu": "H200", "rows": [{"workload": 1, "eager_ms": "fast"}]}')
    cli(S, "record row eager_ms 'fast', no status (rendered '-')", [*mt, "--results", r3, "--stdout"], want_rc=0)
    cli(S, "--readme under /proc", [*mt, "--results", res, "--readme", "/proc/nope/README.md"], word="readme")

    S = "demo"
    dm = ["-m", "blockdiff.integration.cli", "demo", "--no-progress", "--out", os.path.join(tmp, "demo")]
    cli(S, "--max-denoising-steps 0", [*dm, "--max-denoising-steps", "0"], word="max-denoising-steps")
    cli(S, "--device 'cuda:x'", [*dm, "--device", "cuda:x"], word="device")
    cli(S, "--checkpoint a file", [*dm, "--checkpoint", readme], word="checkpoint")
    cli(S, "--out below a file", [*dm[:-2], "--out", os.path.join(readme, "sub")], word="out")
    bad_ck = os.path.join(tmp, "badck")
    os.makedirs(bad_ck)
    open(os.path.join(bad_ck, "config.json"), "w").write("[]")
    cli(S, "--checkpoint with config.json a list", [*dm, "--checkpoint", bad_ck], word="config")
    cli(S, "--embedding-scale without --random-weights", [*dm, "--embedding-scale", "2"], word="random-weights")

    S = "export"
    ex = ["-m", "blockdiff.integration.cli", "export"]
    cli(S, "--checkpoint missing folder", [*ex, os.path.join(tmp, "x1"), "--checkpoint", os.path.join(tmp, "none")],
        word="none")
    cli(S, "--stability-threshold -1", [*ex, os.path.join(tmp, "x2"), "--stability-threshold", "-1"],
        word="stability")
    cli(S, "--confidence-threshold nan", [*ex, os.path.join(tmp, "x3"), "--confidence-threshold", "nan"],
        word="confidence")
    cli(S, "--max-denoising-steps -3", [*ex, os.path.join(tmp, "x4"), "--max-denoising-steps", "-3"], word="steps")

    S = "train"
    tr = ["-m", "blockdiff.integration.cli", "train", "--smoke", "--max-steps", "1", "--eval-prompts", "0",
          "--out", os.path.join(tmp, "train")]
    for name, extra, word in [
        ("--batch-size 0", ["--batch-size", "0"], "batch-size"),
        ("--lr nan", ["--lr", "nan"], "lr"),
        ("--lr -1", ["--lr", "-1"], "lr"),
        ("--minutes -1", ["--minutes", "-1"], "minutes"),
        ("--max-steps 0", ["--max-steps", "0"], "max-steps"),
        ("--prefix-min 20 > --prefix 10", ["--prefix", "10", "--prefix-min", "20"], "prefix"),
        ("--prefix -1", ["--prefix", "-1"], "prefix"),
        ("--self-cond-prob 1.5", ["--self-cond-prob", "1.5"], "self-cond-prob"),
        ("--log-every 0", ["--log-every", "0"], "log-every"),
        ("--eval-prompts -1", ["--eval-prompts", "-1"], "eval-prompts"),
        ("--eval-steps 0", ["--eval-steps", "0"], "eval-steps"),
        ("--warmup-steps -1", ["--warmup-steps", "-1"], "warmup-steps"),
        ("--seed -1", ["--seed", "-1"], "seed"),
        ("--corpus missing", ["--corpus", os.path.join(tmp, "nocorpus")], "corpus"),
        ("--corpus an empty folder", ["--corpus", res], "corpus"),
        ("--out a file", ["--out", readme], "out"),
    ]:
        cli(S, name, [*tr, *extra], word=word, timeout=240)


SECTIONS = {"attention": sec_attention, "triton": sec_triton, "tp": sec_tp, "sampler": sec_sampler,
            "model": sec_model, "harness": sec_harness, "integration": sec_integration, "cli": sec_cli}


def main(argv=None) -> int:
    """Run the named sections (all by default); prints one row per input and the BAD count; exit 1 on any BAD."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sections", nargs="*", metavar="SECTION", help=f"sections to run (default all): {' '.join(SECTIONS)}")
    args = ap.parse_args(argv)
    unknown = [n for n in args.sections if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown SECTION {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    for name in args.sections or SECTIONS:
        try:
            SECTIONS[name]()
        except Exception as e:  # noqa: BLE001  (a section's own setup failing is a finding too, not a crash)
            row(name, "<section setup>", "BAD: traceback", f"{type(e).__name__}: {e}")
    bad = [r for r in ROWS if r[2].startswith("BAD")]
    by = {}
    for s, _, o, _ in ROWS:
        d = by.setdefault(s, {"tried": 0, "bad": 0})
        d["tried"] += 1
        d["bad"] += o.startswith("BAD")
    print("\nby surface: " + "; ".join(f"{s} {d['tried']} ({d['bad']} BAD)" for s, d in by.items()))
    print(f"{len(ROWS)} inputs, {len(bad)} BAD")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
