"""The shared device helpers and the split-KV merge (attention/triton/common.py): the 16-ary tile -> sequence
search against a Python scan, the merge against a logsumexp merge of the partials, and where the merge waits
with programmatic dependent launch (offline sm_80 / sm_90 compiles)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from blockdiff.attention.triton import plans
from blockdiff.attention.triton.common import _merge_kernel, tile_sequence
from blockdiff.attention.triton.config import merge_constexprs


@triton.jit
def _tile_search_probe(CU_Q, OUT, num_seqs, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    t = tl.program_id(0)
    b, q_start, q_len, tile = tile_sequence(CU_Q, t, num_seqs, tl.arange(0, 16), BLOCK_Q, SEARCH_STEPS)
    tl.store(OUT + 2 * t, b)
    tl.store(OUT + 2 * t + 1, tile)


@pytest.mark.parametrize("num_seqs", [1, 2, 15, 16, 17, 255, 256, 300])
def test_tile_to_sequence_search_finds_every_tile_across_16_ary_search_steps(num_seqs):
    """The 16-ary tile -> sequence search (one step per 4 bits of the batch size) against a Python scan, with
    empty sequences and sequences of one tile and of several."""
    g = torch.Generator().manual_seed(num_seqs)
    q_lens = torch.randint(0, 40, (num_seqs,), generator=g)
    q_lens[::7] = 0
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    BQ = 8
    n_tiles = int(cu[-1]) // BQ + num_seqs
    out = torch.full((n_tiles, 2), -7, dtype=torch.int32)
    steps = -(-max(1, num_seqs.bit_length()) // 4)
    _tile_search_probe[(n_tiles,)](cu, out, num_seqs, BLOCK_Q=BQ, SEARCH_STEPS=steps)
    starts = [int(cu[b]) // BQ + b for b in range(num_seqs)]
    for t in range(n_tiles):
        b = max(i for i in range(num_seqs) if starts[i] <= t)
        assert out[t].tolist() == [b, t - starts[b]], t


def _merge_oracle(opart, lsepart):
    """out = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s (rows whose splits are all empty: 0, -inf)."""
    lse = torch.logsumexp(lsepart, 0)                                     # [H, T]
    w = torch.exp(lsepart - torch.where(torch.isinf(lse), 0.0, lse))     # [S, H, T]; 0 for empty splits
    return (opart * w.permute(0, 2, 1)[..., None]).sum(0), lse


@pytest.mark.parametrize("ns,T,H,DV,dtype", [(3, 7, 3, 40, torch.float32), (64, 5, 2, 24, torch.bfloat16),
                                              (2, 33, 1, 16, torch.float16), (5, 3, 1, 600, torch.float32)])
def test_split_merge_equals_a_logsumexp_merge_of_the_partials(ns, T, H, DV, dtype):
    """The split-KV merge (BLOCK_R rows per program, two passes over the splits) against torch.logsumexp: empty
    splits (lse -inf, o 0), rows empty in every split (out 0, lse -inf), a row count that is not a multiple of
    BLOCK_R, head_dim_v not a power of two, an out view with strided rows (columns around it stay untouched)."""
    g = torch.Generator().manual_seed(ns * 1000 + DV)
    opart = torch.randn(ns, T, H, DV, generator=g)
    lsepart = torch.randn(ns, H, T, generator=g) * 4
    empty = torch.rand(ns, H, T, generator=g) < 0.4
    empty[:, 0, T - 1] = True                                             # a row with no key in any split
    lsepart[empty] = float("-inf")
    opart[empty.permute(0, 2, 1)] = 0.0
    big = torch.full((T, H, DV + 9), float("nan"), dtype=dtype)
    out = big[:, :, 3:3 + DV]
    lse = torch.full((H, T), float("nan"))
    consts = merge_constexprs(ns, DV, store_lse=True, pdl=False, interpret=True)  # as attention_triton launches it
    block_r = consts["BLOCK_R"]
    assert (T * H) % block_r != 0
    _merge_kernel[(triton.cdiv(T * H, block_r),)](
        opart, lsepart, out, lse, T, H, T * H, out.stride(0), out.stride(1), **consts)
    ref_o, ref_lse = _merge_oracle(opart, lsepart)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), ref_o, rtol=tol, atol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and not torch.isnan(lse).any()
    torch.testing.assert_close(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], rtol=0, atol=1e-5)
    assert (out[T - 1, 0] == 0).all()
    assert torch.isnan(big[:, :, :3]).all() and torch.isnan(big[:, :, 3 + DV:]).all()


def test_split_merge_uses_pdl_only_where_griddepcontrol_compiles():
    """Regression: the split-KV merge waits with griddepcontrol (programmatic dependent launch), which ptxas rejects
    below sm_90; the wait is a constexpr the host sets only on sm_90+ (an unconditional wait broke every split
    launch on sm_80). Offline compiles for sm_80 without it and sm_90 with it (fresh process, no interpreter)."""
    assert plans._capability(torch.device("cpu")) == (0, 0)
    # the host's decision: PDL on sm_90+ only, never under the interpreter or with the switch off
    for cap, interp, switch, want in (((9, 0), False, True, True), ((10, 0), False, True, True),
                                      ((8, 0), False, True, False), ((9, 0), True, True, False),
                                      ((9, 0), False, False, False)):
        saved = plans._capability, plans.interpreting
        plans._capability, plans.interpreting = (lambda d, c=cap: c), (lambda i=interp: i)
        try:
            assert plans.merge_pdl(torch.device("cuda", 0), switch) is want, (cap, interp, switch)
        finally:
            plans._capability, plans.interpreting = saved
    code = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from blockdiff.attention.triton.common import _merge_kernel as fn
sig = dict(OPART="*fp32", LSEPART="*fp32", O="*bf16", LSE="*fp32", total_q="i32", num_heads="i32", n_rows="i32",
           stride_ot="i32", stride_oh="i32")
res = {}
for cap, pdl in ((80, False), (90, True)):
    consts = dict(NUM_SPLITS=2, DV=256, BLOCK_DV=256, BLOCK_R=16, STORE_LSE=True, INTERPRET=False, PDL=pdl)
    full = {n: "constexpr" if n in consts else sig[n] for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=full, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=dict(num_warps=4))
    res[cap] = "griddepcontrol.wait" in ck.asm["ptx"] and ck.asm.get("cubin") is not None
print(json.dumps(res))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"80": False, "90": True}
