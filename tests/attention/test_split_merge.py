"""The shared split-KV merge (``blockdiff.attention.split_merge``), on the CPU through the Triton interpreter, in
both of its formats (LSE partials, the cute backend's; each split's raw max and sum, the triton backend's): the
kernel as the backends launch it and the launcher, against a logsumexp merge of the partials; a split whose weight
underflows to 0 still passing on its non-finite entries (as the dense reference does for a key the row sees); empty
splits; the raw-stats format's weights carrying no ulp of a large LSE; the launcher's argument checks. The triton backend's own regression test on whole attention
calls is
``test_nonfinite_v_of_a_seen_key_with_an_underflowing_split_weight_reaches_the_output_at_every_split_count``."""
import math

import pytest
import torch

import triton

from blockdiff.attention import attention
from blockdiff.attention.testing import make_underflow_batch
from blockdiff.attention.split_merge import _merge_kernel, merge_constexprs, merge_split_partials
from blockdiff.attention.triton import interface as triton_interface


def _merge_oracle(opart, lsepart):
    """out = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s (rows whose splits are all empty: 0, -inf)."""
    lse = torch.logsumexp(lsepart, 0)                                     # [H, T]
    w = torch.exp(lsepart - torch.where(torch.isinf(lse), 0.0, lse))     # [S, H, T]; 0 for empty splits
    return (opart * w.permute(0, 2, 1)[..., None]).sum(0), lse


def _raw_stats(lsepart, g, scale_log2):
    """Raw-stats partials ``[S, 2, H, T]`` (a max ``m`` and a sum ``l >= 1`` per split and row) whose LSEs
    ``(m * c + log2(l)) * ln 2`` are ``lsepart`` up to fp32 rounding, ``m = -inf``, ``l = 0`` where it is ``-inf``;
    and those LSEs (float64)."""
    l = 1 + 30 * torch.rand(lsepart.shape, generator=g)
    m = ((lsepart.double() / math.log(2) - torch.log2(l.double())) / scale_log2).float()
    empty = torch.isinf(lsepart)
    m[empty], l[empty] = float("-inf"), 0.0
    lse = torch.where(empty, float("-inf"), (m.double() * scale_log2 + torch.log2(l.double())) * math.log(2))
    return torch.stack([m, l], 1), lse


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("ns,T,H,DV,dtype", [(3, 7, 3, 40, torch.float32), (64, 5, 2, 24, torch.bfloat16),
                                              (2, 33, 1, 16, torch.float16), (5, 3, 1, 600, torch.float32)])
def test_split_merge_equals_a_logsumexp_merge_of_the_partials(ns, T, H, DV, dtype, raw):
    """The split-KV merge (BLOCK_R rows per program, two passes over the splits) against torch.logsumexp, in both
    formats (``raw``: each split's max and sum, at a log2 scale that is not a power of two): empty splits (lse
    -inf, or m -inf and l 0; o 0), rows empty in every split (out 0, lse -inf), a row count that is not a multiple
    of BLOCK_R, head_dim_v not a power of two, an out view with strided rows (columns around it stay untouched)."""
    g = torch.Generator().manual_seed(ns * 1000 + DV)
    opart = torch.randn(ns, T, H, DV, generator=g)
    lsepart = torch.randn(ns, H, T, generator=g) * 4
    empty = torch.rand(ns, H, T, generator=g) < 0.4
    empty[:, 0, T - 1] = True                                             # a row with no key in any split
    lsepart[empty] = float("-inf")
    opart[empty.permute(0, 2, 1)] = 0.0
    scale_log2 = 0.3 * 1.4426950408889634
    stats = lsepart
    if raw:  # the same partials as each split's raw max and sum
        stats, lse64 = _raw_stats(lsepart, g, scale_log2)
        lsepart = lse64.float()
    big = torch.full((T, H, DV + 9), float("nan"), dtype=dtype)
    out = big[:, :, 3:3 + DV]
    lse = torch.full((H, T), float("nan"))
    # as the backends launch it (triton: raw stats; cute: LSEs)
    consts = merge_constexprs(ns, DV, store_lse=True, pdl=False, interpret=True, raw_stats=raw)
    block_r = consts["BLOCK_R"]
    assert (T * H) % block_r != 0
    _merge_kernel[(triton.cdiv(T * H, block_r),)](
        opart, stats, out, lse, T, H, T * H, out.stride(0), out.stride(1), scale_log2, **consts)
    ref_o, ref_lse = _merge_oracle(opart, lsepart)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), ref_o, rtol=tol, atol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and not torch.isnan(lse).any()
    torch.testing.assert_close(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], rtol=0, atol=1e-5)
    assert (out[T - 1, 0] == 0).all()
    assert torch.isnan(big[:, :, :3]).all() and torch.isnan(big[:, :, 3 + DV:]).all()


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("num_splits,dv,dtype", [(1, 16, torch.float32), (2, 24, torch.bfloat16),
                                                 (4, 64, torch.float32)])
def test_merge_split_partials_matches_the_lse_merge(num_splits, dv, dtype, raw):
    g = torch.Generator().manual_seed(num_splits)
    total_q, H = 5, 3
    o_part = torch.randn(num_splits, total_q, H, dv, generator=g)
    lse_part = torch.randn(num_splits, H, total_q, generator=g) * 4
    if num_splits > 1:  # an empty split for some rows: LSE -inf, partial 0 (the backends' contract)
        lse_part[-1, 0, :2] = float("-inf")
        o_part[-1, :2, 0] = 0
    out = torch.full((total_q, H, dv), float("nan"), dtype=dtype)  # poisoned: every element is written
    lse = torch.full((H, total_q), float("nan"))
    if raw:
        stats, lse64 = _raw_stats(lse_part, g, 1.0)
        lse_part = lse64.float()
        merge_split_partials(o_part, stats, out, lse, scale_log2=1.0)
    else:
        merge_split_partials(o_part, lse_part, out, lse)
    ref_o, ref_lse = _merge_oracle(o_part, lse_part)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("raw", [False, True])
def test_merge_split_partials_passes_on_nonfinite_entries_of_a_split_whose_weight_underflows(raw):
    """Split 0 holds NaN / +Inf / -Inf at three columns and is 200 nats below split 1: its weight is exactly 0,
    and 0 * NaN = 0 * Inf = NaN, so those three columns are NaN (the reference's p * v with p underflowed to 0),
    the others are split 1's values, and the LSE is split 1's. ``raw``: the same as raw stats (split 1's max 200 /
    ln 2 above split 0's at ``scale_log2`` 1, both sums 1)."""
    total_q, H, dv = 2, 2, 16
    o_part = torch.randn(2, total_q, H, dv, generator=torch.Generator().manual_seed(0))
    o_part[0, :, :, 3] = float("nan")
    o_part[0, :, :, 4] = float("inf")
    o_part[0, :, :, 5] = float("-inf")
    out = torch.empty(total_q, H, dv)
    lse = torch.empty(H, total_q)
    if raw:
        stats = torch.zeros(2, 2, H, total_q)
        stats[1, 0] = 200.0 / math.log(2)
        stats[:, 1] = 1.0
        merge_split_partials(o_part, stats, out, lse, scale_log2=1.0)
    else:
        lse_part = torch.zeros(2, H, total_q)
        lse_part[1] = 200.0
        merge_split_partials(o_part, lse_part, out, lse)
    assert out[..., 3:6].isnan().all()
    keep = [c for c in range(dv) if c not in (3, 4, 5)]
    torch.testing.assert_close(out[..., keep], o_part[1][..., keep])
    torch.testing.assert_close(lse, torch.full((H, total_q), 200.0))


@pytest.mark.parametrize("raw", [False, True])
def test_merge_split_partials_gives_zero_and_minus_inf_for_a_row_with_every_split_empty(raw):
    o_part = torch.zeros(3, 1, 1, 16)
    out = torch.full((1, 1, 16), float("nan"))
    lse = torch.zeros(1, 1)
    if raw:  # every split: m -inf, l 0
        stats = torch.stack([torch.full((3, 1, 1), float("-inf")), torch.zeros(3, 1, 1)], 1)
        merge_split_partials(o_part, stats, out, lse, scale_log2=0.5)
    else:
        merge_split_partials(o_part, torch.full((3, 1, 1), float("-inf")), out, lse)
    assert (out == 0).all() and lse.item() == float("-inf")


def test_raw_stats_merge_at_lses_near_1000_carries_no_ulp_of_the_lse():
    """Three splits whose LSEs lie near 993 (raw maxima near 3960 at scale 0.25, sums 1 to 40): the raw-stats merge
    weighs them ``l_s * exp2((m_s - M) * c)`` from exact fp32 maxima, 2.2e-7 off the float64 merge of the same
    partials; the LSE format, given the correctly rounded fp32 LSEs, is 4.4e-5 off, since an fp32 LSE near 993
    carries an ulp of 6.1e-5 (docs/ARCHITECTURE.md section 4, "Known precision limit of split-KV"). The merged LSE
    is rounded once in either format, as a one-split launch's is."""
    g = torch.Generator().manual_seed(5)
    S, T, H, DV = 3, 64, 2, 16
    c = float(torch.tensor(0.25 * 1.4426950408889634, dtype=torch.float32))  # the fp32 the kernel computes with
    m = 3960 + torch.randint(-16, 17, (S, H, T), generator=g).float() / 8
    l = 1 + 39 * torch.rand(S, H, T, generator=g)
    o = torch.randn(S, T, H, DV, generator=g)
    m64, l64 = m.double(), l.double()
    M = m64.amax(0)
    w = l64 * torch.exp2((m64 - M) * c)
    ref = (o.double() * w.permute(0, 2, 1)[..., None]).sum(0) / w.sum(0).permute(1, 0)[..., None]
    ref_lse = (M * c + torch.log2(w.sum(0))) * math.log(2)
    out, lse = torch.empty(T, H, DV), torch.empty(H, T)
    merge_split_partials(o, torch.stack([m, l], 1), out, lse, scale_log2=c)
    assert (out.double() - ref).abs().max().item() < 1e-6
    assert (lse.double() - ref_lse).abs().max().item() < 2.5e-4  # (4 ulps near 993)
    lse_part = ((m64 * c + torch.log2(l64)) * math.log(2)).float()
    merge_split_partials(o, lse_part, out, lse)
    assert (out.double() - ref).abs().max().item() > 1e-5  # the LSE format's limit, which the cute backend keeps


def _args():
    return torch.zeros(2, 3, 2, 16), torch.zeros(2, 2, 3), torch.zeros(3, 2, 16), torch.zeros(2, 3)


@pytest.mark.parametrize("change,err,match", [
    (dict(o_part=[0.0]), TypeError, "o_part must be a torch.Tensor"),
    (dict(o_part=torch.zeros(2, 3, 2, 16, dtype=torch.bfloat16)), TypeError, "o_part must be float32"),
    (dict(lse_part=torch.zeros(2, 3, 2)), ValueError, "lse_part must be"),
    (dict(out=torch.zeros(3, 2, 8)), ValueError, "out must be"),
    (dict(lse=torch.zeros(3, 2)), ValueError, "lse must be"),
    (dict(o_part=torch.zeros(2, 3, 16, 2).transpose(2, 3)), ValueError, "o_part must be contiguous"),
    (dict(out=torch.zeros(3, 16, 2).transpose(1, 2)), ValueError, "last dimension must be contiguous"),
    (dict(o_part=torch.zeros(3, 2, 16)), ValueError, "o_part must be"),
    (dict(o_part=torch.zeros(0, 3, 2, 16), lse_part=torch.zeros(0, 2, 3)), ValueError, "at least one split"),
    (dict(lse=torch.zeros(2, 3, dtype=torch.float64)), TypeError, "lse must be float32"),
    (dict(lse_part=torch.zeros(2, 2, 3, dtype=torch.bfloat16)), TypeError, "lse_part must be float32"),
    (dict(out=torch.zeros(3, 2, 16, dtype=torch.int32)), TypeError, "out must be bfloat16, float16 or float32"),
    (dict(out=torch.zeros(3, 2, 16, dtype=torch.float64)), TypeError, "out must be bfloat16, float16 or float32"),
    (dict(pdl=1), TypeError, "pdl must be a bool"),
    (dict(pdl=True), ValueError, "pdl=True needs a GPU launch"),
    (dict(out=torch.zeros(1, 2, 16).expand(3, 2, 16)), ValueError, "must not share memory"),
    (dict(lse=torch.zeros(2, 3, device="meta")), ValueError, "on one device"),
    (dict(scale_log2=True), TypeError, "scale_log2 must be None or a real number"),
    (dict(scale_log2="1"), TypeError, "scale_log2 must be None or a real number"),
    (dict(scale_log2=0.0, lse_part=torch.zeros(2, 2, 2, 3)), ValueError, "scale_log2 must be a positive normal"),
    (dict(scale_log2=-1.0, lse_part=torch.zeros(2, 2, 2, 3)), ValueError, "scale_log2 must be a positive normal"),
    (dict(scale_log2=float("nan"), lse_part=torch.zeros(2, 2, 2, 3)), ValueError, "scale_log2 must be a positive"),
    (dict(scale_log2=1e39, lse_part=torch.zeros(2, 2, 2, 3)), ValueError, "scale_log2 must be a positive normal"),
    (dict(scale_log2=2.0 ** -127, lse_part=torch.zeros(2, 2, 2, 3)), ValueError, "scale_log2 must be a positive"),
    (dict(scale_log2=1.0), ValueError, r"lse_part must be \(2, 2, 2, 3\)"),  # raw stats: [S, 2, H, T]
])
def test_merge_split_partials_refuses_bad_arguments_by_name(change, err, match):
    o_part, lse_part, out, lse = _args()
    kw = dict(o_part=o_part, lse_part=lse_part, out=out, lse=lse)
    kw.update(change)
    with pytest.raises(err, match=match):
        merge_split_partials(**kw)


def test_merge_split_partials_refuses_an_out_whose_rows_overlap_through_nonzero_strides():
    """Only a stride 0 was refused: an out whose rows overlap (strides (16, 8, 1) for [3, 2, 16]: each row's second
    head is the next row's first) was accepted and written over itself, a silent wrong result (2.2 off at 4 rows);
    now the rule of attention's out and the KV cache (validate.self_overlapping)."""
    o_part, lse_part, _, lse = _args()
    out = torch.zeros(200).as_strided((3, 2, 16), (16, 8, 1))
    with pytest.raises(ValueError, match=r"must not share memory .*strides \(16, 8, 1\)"):
        merge_split_partials(o_part, lse_part, out, lse)
    padded = torch.zeros(3, 4, 16)[:, ::2]  # disjoint rows with a gap: accepted
    merge_split_partials(o_part, lse_part, padded, lse)


def _shifted_into(t, shape, by):
    """A view of ``t``'s memory of ``shape``, starting ``by`` elements in."""
    return t.view(-1)[by:by + shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)].view(shape)


@pytest.mark.parametrize("case", ["out_in_o_part", "lse_in_lse_part", "lse_in_out", "out_is_o_part_split"])
def test_merge_split_partials_refuses_outputs_sharing_memory_with_its_inputs_or_each_other(case):
    """Was: accepted, and a silent wrong result (out 2.8 off, lse 1.8 off at 160 rows, 3 programs): a program writes
    its rows while later programs still read theirs, so an output one token into split 0's partials (or into the
    partial LSEs, or an lse inside out) was read back overwritten. An out that is exactly one split's partials
    (each row read before its program writes it) is refused by the same rule: no element in common."""
    S, T, H, DV = 2, 40, 4, 16
    o_part, lse_part = torch.randn(S, T, H, DV), torch.randn(S, H, T)
    out, lse = torch.empty(T, H, DV), torch.empty(H, T)
    name = {"out_in_o_part": ("out", "o_part"), "lse_in_lse_part": ("lse", "lse_part"), "lse_in_out": ("lse", "out"),
            "out_is_o_part_split": ("out", "o_part")}[case]
    if case == "out_in_o_part":
        out = _shifted_into(o_part, (T, H, DV), H * DV)
    elif case == "out_is_o_part_split":
        out = o_part[1]
    elif case == "lse_in_lse_part":
        lse = _shifted_into(lse_part, (H, T), 1)
    else:
        lse = _shifted_into(out, (H, T), 4)
    before = (o_part.clone(), lse_part.clone())
    with pytest.raises(ValueError, match=f"{name[0]} must not share memory with {name[1]}"):
        merge_split_partials(o_part, lse_part, out, lse)
    assert torch.equal(o_part, before[0]) and torch.equal(lse_part, before[1])


def test_merge_split_partials_on_the_meta_device_is_a_value_error_saying_so():
    """Was: 'out must not share memory with o_part' (meta tensors' data pointers are all 0, so the sharing check saw
    one memory); before that check, torch's / Triton's RuntimeError naming no argument. (One tensor on meta beside
    real ones is the 'one device' error.)"""
    S, T, H, DV = 2, 4, 2, 8
    with pytest.raises(ValueError, match="^o_part is on the meta device"):
        merge_split_partials(torch.empty(S, T, H, DV, device="meta"), torch.empty(S, H, T, device="meta"),
                             torch.empty(T, H, DV, device="meta"), torch.empty(H, T, device="meta"))


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_nonfinite_v_of_a_seen_key_with_an_underflowing_split_weight_reaches_the_output_at_every_split_count(
        num_splits):
    """The dense reference gives p * v = 0 * NaN = NaN in column 3 of every row (the key is seen, its weight
    underflows); the triton backend gives the same at one split and through its merge at 2 and 4 splits, where the
    key's split weighs exactly 0 against the split holding key 5 (docs/tuning.md 2.33)."""
    q, k, v, kw = make_underflow_batch(16, 512, 400)  # key 400: NaN at column 3
    ref, ref_lse = attention(q, k, v, backend="reference", return_lse=True, **kw)
    assert ref[..., 3].isnan().all() and ref[..., [0, 1, 2, 4]].isfinite().all()
    out, lse = attention(q, k, v, backend="triton", return_lse=True, config={"num_splits": num_splits}, **kw)
    assert triton_interface.LAST_LAUNCH["num_splits"] == num_splits
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    torch.testing.assert_close(out[ref.isfinite()].float(), ref[ref.isfinite()].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)
