"""Builders and checks shared by the Triton backend's tests (tests/attention/triton/test_*.py import this module;
no test file imports another).

On the CPU the kernels run through the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before
triton is imported) on tiny shapes; GPU tests use the same builders on the H200. Every checked launch writes into
an output poisoned with NaN, so an unwritten element fails ``check_close``.
"""
import torch
from hypothesis import strategies as st

from blockdiff.attention import attention
from blockdiff.attention import testing
from blockdiff.attention.testing import check_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(BLOCK_M=16, BLOCK_N=16)  # interpreter-sized tiles (tl.dot minimum)
MIXED = dict(seq_lens=[9, 13, 6, 1, 5, 30], q_lens=[9, 4, 6, 1, 0, 12],
             causal=[True, False, True, False, False, False])
#: Gluon configs: the producer-warp kernel at 64 rows, the wide hd-512 kernel, the roles kernel (hd 512)
GLUON = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
WIDE = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, BLOCK_DV=512, OVERLAP=False)
ROLES = dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=12, num_stages=1, OVERLAP="roles")
GPU_BATCH = ([1500, 700, 333, 9], [700, 256, 0, 9], [700, 0, 0, 4])  # seq_lens, q_lens, num_causal_q
GPU_HEADS = {64: (8, 8), 128: (16, 8), 256: (16, 8), 512: (16, 2)}  # head_dim: (num_heads, num_kv_heads)


def make_batch(seq_lens, q_lens, *, device=DEV, **kwargs):
    """:func:`blockdiff.attention.testing.make_batch` on the tests' device (the GPU when there is one, where the
    kernels run compiled; else the CPU, through the interpreter)."""
    return testing.make_batch(seq_lens, q_lens, device=device, **kwargs)


def run_and_check(inp, *, config=None, window_size=None, bidirectional_window="symmetric", scale=None,
                  check_lse=True):
    """Launch into a NaN-poisoned ``out``; compare out and lse with the oracle; return (out, lse)."""
    q, vc = inp["q"], inp["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**inp, window_size=window_size, bidirectional_window=bidirectional_window, scale=scale,
                       out=out, return_lse=True, backend="triton", config=config)
    assert o.data_ptr() == out.data_ptr()
    check_close(o.cpu(), **{k: v.cpu() for k, v in inp.items()}, lse=lse.cpu() if check_lse else None,
                window_size=window_size, bidirectional_window=bidirectional_window, scale=scale)
    return o, lse


def very_negative_scores_batch(dtype=torch.float32, *, device=DEV, **kwargs):
    """The contract's mixed batch with every score near -2e31, at scale 1
    (:func:`blockdiff.attention.testing.make_very_negative_scores_batch`) on the tests' device. ``kwargs``: more
    :func:`make_batch` arguments (head dims, heads, page size)."""
    return testing.make_very_negative_scores_batch([40, 13, 30], [9, 13, 30], num_causal_q=[0, 13, 11], num_heads=4,
                                                   num_kv_heads=2, dtype=dtype, device=device, **kwargs)


def scores_near_1000_batch(dtype=torch.float32, *, scale=0.25, seed=0, **kwargs):
    """A batch (two sequences of 200 and 150 keys, a bidirectional and a causal one; ``kwargs`` override the
    :func:`make_batch` arguments) whose scores ``q . k * scale`` are all 990 plus a spread of about one, each computed
    exactly: K's column 0 is 1 and Q's is ``990 / scale`` (in ``dtype``), their other entries multiples of 1/8, so
    every partial sum of ``q . k`` is exact in fp32 and the eager computation's error is its softmax's alone. A
    split's natural-log LSE near 993 carries an fp32 ulp of 6.1e-5 (the merge weights' error before the raw-stats
    merge, docs/ARCHITECTURE.md section 4)."""
    args = dict(seq_lens=[200, 150], q_lens=[3, 2], causal=[False, True], num_heads=4, num_kv_heads=2, head_dim=16,
                page_size=16, dtype=dtype, seed=seed)
    args.update(kwargs)
    inp = make_batch(**args)
    q = (inp["q"].float() * 8).round() / 8
    k = (inp["k_cache"].float() * 8).round() / 8
    k[..., 0] = 1.0
    q[..., 0] = 990.0 / scale
    inp["q"], inp["k_cache"] = q.to(dtype), k.to(dtype)
    return inp


@st.composite
def batches(draw):
    B = draw(st.integers(0, 4))
    q_lens, seq_lens, ncq = [], [], []
    for _ in range(B):
        ql = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 17]))
        ctx = draw(st.sampled_from([0, 1, 2, 4, 9, 16, 23]))
        q_lens.append(ql)
        seq_lens.append(ql + ctx)
        kind = draw(st.sampled_from(["causal", "bidir", "mixed"]))
        ncq.append(ql if kind == "causal" else 0 if kind == "bidir" else draw(st.integers(0, ql)))
    Hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(
        seq_lens=seq_lens, q_lens=q_lens, num_causal_q=ncq, num_heads=Hkv * group, num_kv_heads=Hkv,
        head_dim=draw(st.sampled_from([16, 32])), page_size=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 32])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        paged=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
    ), dict(
        window_size=draw(st.sampled_from([None, 0, 1, 2, 3, 5, 8, 16, 40])),
        bidirectional_window=draw(st.sampled_from(["symmetric", "prefix"])),
        config=dict(BLOCK_M=max(16, group) * draw(st.sampled_from([1, 2])),
                    BLOCK_N=draw(st.sampled_from([16, 32])),
                    num_splits=draw(st.sampled_from([None, 1, 2, 3])),
                    LAZY_RESCALE=draw(st.booleans()), BT_PREFETCH=draw(st.booleans())),
    )


def graph_replay_check(metas, *, page_size, max_k, window_size, config=None, max_q=None, H=16, Hkv=8, D=128):
    """Capture one launch in a CUDA graph over persistent metadata buffers (static capacities: 700 query tokens,
    4 sequences, ``max_k`` keys each), then replay it after rewriting flags, lengths and block tables with each of
    ``metas`` = [(q_lens, seq_lens, num_causal_q), ...]; every replay is checked against the oracle."""
    torch.manual_seed(0)
    P = page_size
    B, total_q = 4, 700
    nblk = B * (max_k // P) + 8
    kc = torch.randn(nblk, P, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(total_q, H, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    sl = torch.zeros(B, dtype=torch.int32, device="cuda")
    ncq = torch.zeros(B, dtype=torch.int32, device="cuda")
    bt = torch.zeros(B, max_k // P, dtype=torch.int32, device="cuda")
    out = torch.empty(total_q, H, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(H, total_q, device="cuda")

    def set_meta(q_lens, seq_lens, n_causal, seed):
        g = torch.Generator().manual_seed(seed)
        cu.copy_(torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32))
        sl.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        ncq.copy_(torch.tensor(n_causal, dtype=torch.int32))
        bt.copy_(torch.randperm(nblk, generator=g)[:bt.numel()].view_as(bt).to(torch.int32))

    kw = dict(cu_seqlens_q=cu, seq_lens=sl, num_causal_q=ncq, block_table=bt, window_size=window_size)

    def launch():
        o, lv = attention(q, kc, vc, **kw, out=out, return_lse=True, check_values=False, backend="triton",
                          config=config, max_seqlen_q=max_q, max_seqlen_k=max_k)
        lse.copy_(lv)

    set_meta(*metas[0], 1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launch()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    for step, meta in enumerate(metas):
        set_meta(*meta, seed=10 + step)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check_close(out, q, kc, vc, lse=lse, **kw)
