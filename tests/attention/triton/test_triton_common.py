"""The shared device helpers and the split-KV merge (attention/triton/common.py): the 16-ary tile -> sequence
search against a Python scan, and where the merge waits with programmatic dependent launch (offline sm_80 / sm_90
compiles). The merge against a logsumexp merge of the partials is in tests/attention/test_split_merge.py, beside
the kernel's module (attention/split_merge.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from blockdiff.attention.triton import plans
from blockdiff.attention.triton.common import tile_sequence


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
sig = dict(OPART="*fp32", STATS="*fp32", O="*bf16", LSE="*fp32", total_q="i32", num_heads="i32", n_rows="i32",
           stride_ot="i32", stride_oh="i32", scale_log2="fp32")
res = {}
for cap, pdl in ((80, False), (90, True)):
    consts = dict(NUM_SPLITS=2, DV=256, BLOCK_DV=256, BLOCK_R=16, STORE_LSE=True, INTERPRET=False, PDL=pdl,
                  RAW_STATS=True)
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
