"""The cute backend's split-KV merges on the H200 (GPU only): ``split_merge="triton"`` (the shared Triton merge,
:mod:`blockdiff.attention.split_merge`) against the reference and the tolerance rule, every head-dim family and
both KV layouts, and the behaviour FA4's combine kernel misses (docs/tuning.md 2.33): a non-finite V entry of a key
a row sees, in a split whose weight underflows to 0, reaches the output as in the dense reference (``0 * NaN``),
as it does at one split and through the cluster merge. The merge kernel itself and the triton backend's whole calls
are tested on the CPU in tests/attention/test_split_merge.py; the cute interface's wiring of it (workspace in, out
and LSE written, one compile key with the combine) on the CPU here, with a stub in place of the compiled kernel."""
import pytest
import torch

from blockdiff.attention import attention
from blockdiff.attention.cute import config as cc
from blockdiff.attention.cute import interface as ca
from blockdiff.attention.testing import make_underflow_batch

from cute_helpers import check_nonfinite_v, gpu_batch, needs_gpu, nonfinite_cases, run_and_check


def _underflow_batch(head_dim, paged, S=1024):
    """:func:`blockdiff.attention.testing.make_underflow_batch` on the GPU: key 600, which every row sees, weighs
    exp(-512) = 0 in fp32 and holds NaN at column 3, +Inf at 4 and -Inf at 5 (the reference: those three columns
    NaN in every row, the rest finite). Key 600 lies in a block no NaN-V scan cleans at these shapes (interior, or a
    split's first block that skip_allowed_first leaves alone): a cleaned block's fix-up would add the raw +-Inf back
    for p = 0, the kernels' documented exception (config skip_allowed_first), not the merge under test."""
    return make_underflow_batch(head_dim, S, 600, (float("nan"), float("inf"), float("-inf")),
                                page_size=64 if paged else None, device="cuda", seed=1)


_FA4_COMBINE_SKIPS = pytest.mark.xfail(
    strict=True, reason="FA4's combine kernel skips a split whose weight is 0 (flash_fwd_combine.py: scale > 0), "
    "dropping its non-finite entries; split_merge='triton' is the fix (docs/tuning.md 2.33)")


@needs_gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("split_merge,num_splits", [
    ("triton", 2), ("triton", 4), ("cluster", 2), (None, 1),
    pytest.param("combine", 2, marks=_FA4_COMBINE_SKIPS), pytest.param("combine", 4, marks=_FA4_COMBINE_SKIPS)])
def test_gpu_cute_nonfinite_v_of_a_seen_key_with_an_underflowing_split_weight_reaches_the_output(
        paged, head_dim, split_merge, num_splits):
    q, k, v, kw = _underflow_batch(head_dim, paged)
    ref = attention(q.cpu(), k.cpu(), v.cpu(), backend="reference",
                    **{n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()})
    assert ref[..., 3:6].isnan().all() and ref[..., 6:].isfinite().all()
    config = {"num_splits": num_splits} if split_merge is None else {"num_splits": num_splits,
                                                                      "split_merge": split_merge}
    out = torch.full((q.shape[0], q.shape[1], head_dim), float("nan"), dtype=q.dtype, device=q.device)
    out = attention(q, k, v, backend="cute", out=out, config=config, **kw)
    cfg = ca.LAST_LAUNCH["config"]
    assert cfg.num_splits == num_splits and (split_merge is None or cfg.split_merge == split_merge)
    out = out.cpu()
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    torch.testing.assert_close(out[ref.isfinite()].float(), ref[ref.isfinite()].float(), atol=2e-2, rtol=2e-2)


@needs_gpu
@pytest.mark.parametrize("contiguous", [False, True], ids=["paged64", "contiguous"])
@pytest.mark.parametrize("D,H,Hkv,num_splits,window,design", [
    (128, 16, 8, 4, None, None), (256, 16, 8, 2, 1023, None), (256, 16, 8, 3, None, None),
    (512, 16, 2, 2, None, None), (512, 16, 2, 3, None, None), (512, 16, 2, 2, None, "split_v")])
def test_gpu_cute_triton_merge_matches_the_reference_on_canvases_over_context(contiguous, D, H, Hkv, num_splits,
                                                                               window, design):
    """Two canvases and a commit over contexts of 3-6k keys (a sequence shorter than a split's share included),
    every head-dim family (hd 512: the roles kernel by default in both layouts, the split-value kernel asked for by
    name), the output and the LSE within the tolerance rule, every element written (NaN-poisoned ``out``)."""
    q, k, v, kw = gpu_batch([256, 256, 256], [6000, 3000, 64], [0, 0, 256], H, Hkv, D, 64, seed=D + num_splits,
                            contiguous=contiguous)
    config = {"num_splits": num_splits, "split_merge": "triton"}
    if design is not None:
        config["wide_design"] = design
    run_and_check(q, k, v, kw, window, "symmetric", config=config)
    assert ca.LAST_LAUNCH["config"].split_merge == "triton"
    assert design is None or ca.LAST_LAUNCH["config"].wide_design == design


@needs_gpu
@pytest.mark.parametrize("D,H,Hkv", [(128, 16, 8), (256, 16, 8)])
def test_gpu_cute_triton_merge_keeps_the_nan_safe_v_contract(D, H, Hkv):
    """NaN / +-Inf V entries inside seq_lens (the issue-26 cases) with 3 splits merged by the Triton merge: exactly
    the reference's non-finite entries, the rest within the tolerance rule."""
    inp = nonfinite_cases(D, H, Hkv, 64, seed=7)
    check_nonfinite_v(inp, {"num_splits": 3, "split_merge": "triton"}, seed=7)
    assert ca.LAST_LAUNCH["config"].split_merge == "triton"


def _split_partials(q, k, v, scale, num_splits):
    """Per-split normalised fp32 outputs ``[S, T, H, Dv]`` and LSEs ``[S, H, T]`` of one bidirectional sequence
    (GQA by repeat), contiguous key chunks, the last split empty (LSE -inf, output 0); and the whole result."""
    T, H, _ = q.shape
    g = H // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q.float(), kf) * scale
    n = k.shape[0]
    bounds = [n * i // (num_splits - 1) for i in range(num_splits)] + [n]
    o_part = torch.zeros(num_splits, T, H, v.shape[-1])
    lse_part = torch.full((num_splits, H, T), float("-inf"))
    for i in range(num_splits):
        a, b = bounds[i], bounds[i + 1]
        if b > a:
            lse = torch.logsumexp(s[..., a:b], -1)
            o_part[i] = torch.einsum("hts,shd->thd", torch.exp(s[..., a:b] - lse[..., None]), vf[a:b])
            lse_part[i] = lse
    return o_part, lse_part, torch.einsum("hts,shd->thd", torch.softmax(s, -1), vf), torch.logsumexp(s, -1)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("contiguous_out", [True, False])
def test_cute_interface_merges_the_split_workspace_with_the_triton_merge(monkeypatch, num_splits, contiguous_out):
    """CPU: the cute interface's split path with ``split_merge="triton"`` and a stub compiled kernel that writes
    known per-split partials into the workspace it is handed: the workspace has the merge's layout, ``out`` (a
    caller's, contiguous or a strided view written back) and the LSE are the exact merge, and "triton" and
    "combine" ask the compile cache for one key (the same split kernel)."""
    def tiles(head_dim, head_dim_v, is_local):
        from types import SimpleNamespace
        return SimpleNamespace(m_block_size=128, n_block_size=128, mma_pv_is_rs=True, intra_wg_overlap=True)
    monkeypatch.setattr(cc, "_fa4_tile_size", tiles)
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    T, H, Hk, D, S = 6, 4, 2, 32, 300
    g = torch.Generator().manual_seed(num_splits)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    k = torch.randn(S, Hk, D, generator=g).to(torch.bfloat16)
    v = torch.randn(S, Hk, D, generator=g).to(torch.bfloat16)
    scale = D ** -0.5
    o_part, lse_part, want_o, want_lse = _split_partials(q, k, v, scale, num_splits)
    keys = []

    def stub(*args):  # the compiled kernel's call: (q, k, v, out, lse, scale, cu_q, cu_k, ..., aux, ...)
        aux = args[15]
        assert tuple(aux[1].shape) == tuple(o_part.shape) and tuple(aux[2].shape) == tuple(lse_part.shape)
        aux[1].copy_(o_part)
        aux[2].copy_(lse_part)

    class Cache(dict):
        def __getitem__(self, key):
            keys.append(key)
            return stub
    monkeypatch.setattr(ca, "_COMPILE_CACHE", Cache())
    fa = {"maybe_contiguous": lambda t, **kw: t, "is_fake_mode": lambda: False, "AuxData": lambda aux, x: aux}
    call = dict(cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32), num_causal_q=torch.tensor([0], dtype=torch.int32),
                seq_lens=torch.tensor([S], dtype=torch.int32), block_table=None,
                cu_seqlens_k=torch.tensor([0, S], dtype=torch.int32), window_size=None,
                bidirectional_window="symmetric", scale=scale, arch=90, max_seqlen_q=T)
    out = (torch.full((T, H, D), float("nan"), dtype=torch.bfloat16) if contiguous_out
           else torch.full((H, T, D), float("nan"), dtype=torch.bfloat16).transpose(0, 1))
    o, lse = ca._run(fa, q, k, v, out=out, return_lse=True,
                     config={"num_splits": num_splits, "split_merge": "triton"}, **call)
    assert o is out and ca.LAST_LAUNCH["config"].split_merge == "triton"
    torch.testing.assert_close(o.float(), want_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    fa["combine"] = lambda *a, **kw: (None, torch.zeros(T, H))  # FA4's combine: only the key matters here
    ca._run(fa, q, k, v, out=None, return_lse=False, config={"num_splits": num_splits, "split_merge": "combine"},
            **call)
    assert len(keys) == 2 and keys[0] == keys[1]  # one compiled split kernel for both merges
