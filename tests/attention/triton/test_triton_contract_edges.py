"""The triton backend on the contract's edges (issue 26), portable kernel under the interpreter: keys outside a
row's set contribute nothing even with NaN / Inf V, the one window rule, unchecked metadata never leaving the
tensors, the debug switch bypassing launch plans (the sm_90a compile of the kernel with its cold paths:
test_triton_compile_check.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from blockdiff.attention import attention, set_debug_checks
from blockdiff.attention.triton.interface import PLANS, attention_triton

from triton_helpers import DEV, SMALL, make_batch


def _f64(b):
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in b.items()}


def _poison(b, seqs, classes, seed):
    """b with random V entries of keys inside seq_len set to NaN / +Inf / -Inf (``classes`` of them per sequence)."""
    v = b["v_cache"].clone()
    P = v.shape[1]
    g = torch.Generator().manual_seed(seed)
    paged = "block_table" in b and b["block_table"] is not None
    for s, S in enumerate(seqs):
        for c in range(classes):
            key = int(torch.randint(0, S, (1,), generator=g))
            head = int(torch.randint(0, v.shape[-2], (1,), generator=g))
            col = int(torch.randint(0, v.shape[-1], (1,), generator=g))
            val = (float("nan"), float("inf"), -float("inf"))[c % 3]
            if paged:
                v[int(b["block_table"][s, key // P]), key % P, head, col] = val
            else:
                v[int(b["cu_seqlens_k"][s]) + key, head, col] = val
    return dict(b, v_cache=v)


@pytest.mark.parametrize("layout", [dict(page_size=3), dict(page_size=16), dict(paged=False)])
@pytest.mark.parametrize("dtype,config", [(torch.float32, dict(SMALL)), (torch.bfloat16, dict(SMALL, num_splits=2)),
                                          (torch.bfloat16, dict(SMALL, LAZY_RESCALE=True, BT_PREFETCH=False))])
@pytest.mark.parametrize("window_size,mode", [(None, "symmetric"), (1, "symmetric"), (5, "prefix")])
def test_keys_outside_a_rows_set_contribute_nothing_even_nan_or_inf_v(layout, dtype, config, window_size, mode):
    """Was 0 * NaN = NaN in P.V for rows that may not see the key (causal future keys, window edges). Rows that
    do see a non-finite entry get exactly the reference's NaN / +-Inf in exactly its column."""
    seqs = [13, 20, 6]
    b = make_batch(seqs, [9, 5, 6], num_causal_q=[9, 2, 3], dtype=dtype, num_heads=4, num_kv_heads=2, **layout)
    b = _poison(b, seqs, 3, seed=len(layout) * 31 + (window_size or 0))
    kw = dict(window_size=window_size, bidirectional_window=mode)
    ref = attention(**_f64({k: v.cpu() if torch.is_tensor(v) else v for k, v in b.items()}), **kw,
                    backend="reference")
    out = attention(**b, **kw, backend="triton", config=config).cpu().double()
    assert not torch.isfinite(ref).all() and torch.isfinite(ref).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isposinf(out), torch.isposinf(ref))
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(out[fin], ref[fin], atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("W", [2 ** 30, 2 ** 63 - 1, 2 ** 63, 10 ** 30])
@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
def test_huge_window_is_exactly_no_window(W, mode):
    """One rule with the reference and the mask helpers: any W >= WINDOW_NO_BOUND is None (the same kernel)."""
    b = make_batch([9, 13], [9, 4], causal=[True, False], dtype=torch.float32)
    none = attention(**b, bidirectional_window=mode, backend="triton", config=SMALL)
    assert torch.equal(attention(**b, window_size=W, bidirectional_window=mode, backend="triton", config=SMALL), none)


_UNCHECKED = r'''
import json, sys, torch
from blockdiff.attention import attention
from blockdiff.attention.testing import make_batch
res = {}
for case in ("page_big", "page_neg", "seq_big", "cu_q_past_q", "cu_q_negative", "contig_cu_k_past_k", "contig_seq_big"):
    paged = not case.startswith("contig")
    b = make_batch([5, 6], [3, 2], causal=[True, False], dtype=torch.float32, paged=paged)
    if case == "page_big":
        b["block_table"] = b["block_table"].clone(); b["block_table"][1, 1] = 10 ** 6
    elif case == "page_neg":
        b["block_table"] = b["block_table"].clone(); b["block_table"][0, 0] = -10 ** 6
    elif case == "seq_big":
        b["seq_lens"] = torch.tensor([5, 4000], dtype=torch.int32)
    elif case == "cu_q_past_q":
        b["cu_seqlens_q"] = torch.tensor([0, 50, 5], dtype=torch.int32)
    elif case == "cu_q_negative":
        b["cu_seqlens_q"] = torch.tensor([-40, 3, 5], dtype=torch.int32)
    elif case == "contig_cu_k_past_k":
        b["cu_seqlens_k"] = torch.tensor([0, 5, 10 ** 6], dtype=torch.int32)
        b["seq_lens"] = torch.tensor([5, 10 ** 6 - 5], dtype=torch.int32)
    else:
        b["seq_lens"] = torch.tensor([5, 3000], dtype=torch.int32)
    T, H, D = b["q"].shape
    buf = torch.full((T + 2, H, b["v_cache"].shape[-1]), 7.0)
    out = buf[1:-1]
    attention(**b, out=out, check_values=False, backend="triton", config=dict(BLOCK_M=16, BLOCK_N=16))
    res[case] = bool((buf[0] == 7).all() and (buf[-1] == 7).all())
print(json.dumps(res))
'''


@pytest.mark.skipif(DEV != "cpu", reason="the interpreter's bounds are what the test observes")
def test_unchecked_bad_metadata_reads_and_writes_only_inside_the_tensors():
    """check_values=False trusts the metadata; the portable kernel still clamps page ids, seq_lens and query rows
    (was: a segfault under the interpreter for a page id of 10**6). Run in a subprocess: a regression crashes it."""
    r = subprocess.run([sys.executable, "-c", _UNCHECKED], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(res.values()), res  # the rows around ``out`` untouched


_SEQ_LEN_NEAR_INT32_MIN = r"""
import json, torch
from blockdiff.attention import attention
from blockdiff.attention.testing import make_batch
res = {}
for name, sl, dtype, paged, window in (("int32_min", -2 ** 31, torch.int32, True, 0),
                                      ("int64_2_31_wrapped", 2 ** 31, torch.int64, True, 0),
                                      ("int32_min_plus_8", -2 ** 31 + 8, torch.int32, True, None),
                                      ("contiguous", -2 ** 31 + 8, torch.int32, False, 0)):
    b = make_batch([16], [16], causal=True, dtype=torch.float32, page_size=16, num_heads=1, num_kv_heads=1,
                   head_dim=8, paged=paged)
    b["seq_lens"] = torch.tensor([sl], dtype=dtype)
    buf = torch.full((18, 1, 8), 7.0)
    attention(**b, out=buf[1:-1], window_size=window, check_values=False, backend="triton",
              config=dict(BLOCK_M=16, BLOCK_N=16))
    res[name] = bool((buf[0] == 7).all() and (buf[-1] == 7).all() and torch.isfinite(buf).all())
print(json.dumps(res))
"""


@pytest.mark.skipif(DEV != "cpu", reason="the interpreter's bounds are what the test observes")
def test_unchecked_seq_lens_near_int32_min_read_nothing_past_the_block_table_and_end():
    """An unchecked ``seq_lens`` within ``q_len`` of -2^31 (an int32 -2^31, or an int64 2^31 that the launch's int32
    copy wraps there) made the portable kernel's ``seq_len - q_len`` wrap to ~2^31: a key range ~2^31 keys past
    the block table, read unmasked where a page holds whole key blocks (a segfault under the interpreter) or
    walked block by block (~2^27 key blocks a tile: no end in the interpreter's minutes). ``seq_len`` is cut to
    ``[0, kv_cap]`` now, as the docs' guard says; the rows see no key (0). Run in a subprocess: a regression crashes
    or times it out."""
    r = subprocess.run([sys.executable, "-c", _SEQ_LEN_NEAR_INT32_MIN], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(res.values()), res


_CU_Q_NEAR_INT32_MIN = r"""
import json, torch
from blockdiff.attention import attention
from blockdiff.attention.testing import make_batch
res = {}
for name, cu, dtype, splits in (("int32_min", [0, 4, -2 ** 31, 7], torch.int32, 1),
                                ("int32_min_split", [0, 4, -2 ** 31, 7], torch.int32, 2),
                                ("int64_2_31_wrapped", [0, 4, 2 ** 31, 2 ** 31 + 3], torch.int64, 1)):
    b = make_batch([11, 5, 3], [4, 0, 3], num_causal_q=[4, 0, 1], dtype=torch.float32, page_size=16, num_heads=2,
                   num_kv_heads=2, head_dim=8)
    b["cu_seqlens_q"] = torch.tensor(cu, dtype=dtype)
    buf = torch.full((7 + 64, 2, 8), 7.0)  # 32 guard rows on each side of out
    attention(**b, out=buf[32:-32], check_values=False, backend="triton", return_lse=True,
              config=dict(BLOCK_M=16, BLOCK_N=16, num_splits=splits))
    res[name] = bool((buf[:32] == 7).all() and (buf[-32:] == 7).all())
print(json.dumps(res))
"""


@pytest.mark.skipif(DEV != "cpu", reason="the interpreter's bounds are what the test observes")
def test_unchecked_cu_seqlens_q_near_int32_min_writes_no_row_before_out():
    """An unchecked ``cu_seqlens_q`` entry near -2^31 (an int32, or an int64 2^31 that the launch's int32 copy wraps
    there) made the 16-ary tile search count that sequence's start below every tile, so a tile landed on the
    sequence before it with a negative index within it: rows ``q_start - 16 ..`` of ``out`` (before its first row)
    were written, heap corruption under the interpreter. The portable kernel's query-row guard now also exits for a
    negative tile index, so rows stay in ``[0, total_q)`` as the docs say. Run in a subprocess: a regression may
    crash it."""
    r = subprocess.run([sys.executable, "-c", _CU_Q_NEAR_INT32_MIN], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(res.values()), res


def test_debug_switch_makes_planned_unchecked_calls_check_values(debug_on):
    b = make_batch([5, 6], [3, 2], causal=[True, False], dtype=torch.float32)
    set_debug_checks(False)
    PLANS.clear()
    attention_triton(**b, check_values=False, config=SMALL)  # planned
    assert len(PLANS) == 1
    bad = dict(b, block_table=b["block_table"].clone())
    bad["block_table"][1, 1] = 10 ** 6
    set_debug_checks(True)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 1000000 is out of range"):
        attention_triton(**bad, check_values=False, config=SMALL)


@pytest.mark.parametrize("kw,exc,name", [(dict(return_lse="yes"), TypeError, "return_lse"),
                                         (dict(max_seqlen_k="100"), TypeError, "max_seqlen_k"),
                                         (dict(max_seqlen_k=1.5), TypeError, "max_seqlen_k"),
                                         (dict(max_seqlen_k=-5), ValueError, "max_seqlen_k"),
                                         (dict(max_seqlen_q="a"), TypeError, "max_seqlen_q")])
@pytest.mark.parametrize("check_values", [None, False])
def test_non_bool_return_lse_and_bad_length_hints_are_errors_planned_or_not(kw, exc, name, check_values):
    """Were truthiness ('yes' -> (out, lse)) and int() ('100' -> 100, 1.5 -> 1) in the triton backend; a call that
    would be planned (check_values=False) sees the same checks on its first, full-path call."""
    PLANS.clear()
    b = make_batch([5, 6], [3, 2], causal=[True, False], dtype=torch.float32)
    with pytest.raises(exc, match=name):
        attention_triton(**b, config=SMALL, check_values=check_values, **kw)
    assert not PLANS
