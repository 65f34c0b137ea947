"""The cute backend's exact key weight (``CuteConfig.exact_weight``, default True; kernel.ExactWeightSoftmax) and
its ``"auto"`` (FA4's FFMA weight where every row of a warp has ``|max * scale_log2| < 2**8``, the exact one elsewhere).

FA4's online softmax weighs each key ``exp2(s * scale_log2 - max * scale_log2)``, one FFMA against the rounded
product ``max * scale_log2``: it keeps that product's rounding error, up to half an ulp of it, so for scores near
-2e31 (2^80 in log2 units and beyond) the row's best key weighs inf or 0 and the row is NaN (docs/ARCHITECTURE.md
section 4, "Scores beyond ~2^31 in log2 units"; the contract case
``test_scores_near_2e31_in_magnitude_give_the_one_hot_softmax_not_nan``, FA4's gap, which ``exact_weight=False``
keeps). With the switch the weight is ``exp2((s - max) * scale_log2)``, and NaN-safe V's recompute weighs its keys
the same way.

- CPU, always: the config switch (type, default, part of the compile key, kept by every resolve), the SASS reader
  :func:`blockdiff.attention.cute.compile_check.sass_ex2_operands` on hand-written SASS, and ``"auto"``'s
  arithmetic in an fp32 emulation (:func:`_auto_online_softmax`: against the fp64 softmax, against True under
  hypothesis, its worst case at the threshold), and that the GPU crossing batch crosses the threshold;
- CPU, where flash-attn-4 and nvidia-cutlass-dsl are installed (not in CI): each kernel family compiled for sm_90a
  with the switch off and on: on, no ``MUFU.EX2`` takes an FFMA's result (off, FA4's weights do), the same exp2
  count, and no new spills; ``"auto"``: a ``VOTE.ALL`` and both weights in every softmax loop;
- GPU (``-m gpu``): the very-negative-scores batch through the backend with True and ``"auto"``, against the
  reference, unsplit and split (each merge), every kernel family; ``"auto"`` on rows that cross the threshold; the
  recompute keeps the best key's +Inf V.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from blockdiff.attention import attention
from blockdiff.attention.cute import compile_check as cchk
from blockdiff.attention.cute import config as cc
from blockdiff.attention.testing import (check_close, check_nonfinite_matches_reference, make_batch,
                                        make_very_negative_scores_batch)

from cute_helpers import HAVE_FA4, compile_for_sm90_or_skip, needs_gpu


# ---------------------------------------------------------------- the switch (CPU, no CuTe DSL)
def test_exact_weight_is_a_bool_switch_on_by_default():
    """On by default since its GPU run (H100, 2026-12-07: the very-negative-scores batch NaN with it off, exact with
    it on; docs/tuning.md 7.64); False stays for A/B runs."""
    assert cc.CuteConfig().exact_weight is True
    assert cc._split_switches(None)[1]["exact_weight"] is True
    assert cc.check_config(dict(exact_weight=True)) == dict(exact_weight=True)
    assert cc.check_config(dict(exact_weight="auto")) == dict(exact_weight="auto")
    for bad in (1, None, 0.0):
        with pytest.raises(TypeError, match="config exact_weight must be 'auto' or a bool"):
            cc.check_config(dict(exact_weight=bad))
    for bad in ("on", "AUTO", ""):
        with pytest.raises(ValueError, match="config exact_weight must be 'auto', True or False"):
            cc.check_config(dict(exact_weight=bad))


@pytest.mark.parametrize("hd", [64, 128, 256, 512])
@pytest.mark.parametrize("on", [False, True, "auto"])
def test_exact_weight_survives_every_resolve_and_changes_the_compile_key(monkeypatch, hd, on):
    """A switch, not a tile field: setting only it keeps the automatic tiles, every resolve keeps its value, and the
    resolved configs (the interface's compile key holds the whole config) differ only in it."""
    monkeypatch.setattr(cc, "_fa4_tile_size", lambda d, dv, local: _FakeTiles(128, 64 if d > 128 else 128))
    launch = dict(total_q=300, num_seqs=3, num_kv_heads=2, qhead_per_kvhead=4, keys_capacity=4096,
                  max_seqlen_q=256, max_seqlen_k=None, num_sms=132, page_size=64)
    base = cc.resolve_launch_config(hd, hd, None, None, **launch)
    got = cc.resolve_launch_config(hd, hd, None, dict(exact_weight=on), **launch)
    assert got.exact_weight is on
    assert got == dataclasses.replace(base, exact_weight=on)
    assert (got == base) is (on is True)  # True is the default
    assert cc.resolve_config(hd, hd, 5, cc.CuteConfig(exact_weight=on), 256, page_size=64).exact_weight is on


@dataclasses.dataclass
class _FakeTiles:
    """FA4's SM90 tile heuristic's answer (config._fa4_tile_size) without flash-attn-4."""
    m_block_size: int
    n_block_size: int
    mma_pv_is_rs: bool = True
    intra_wg_overlap: bool = True


def _exact_weight_softmax(q, k, v, scale):
    """ExactWeightSoftmax's arithmetic on one query row in fp32 (the kernel's scores, its ``scale_log2``): the raw
    max ``m``, each key ``exp2((s - m) * scale_log2)``, the output and the natural-log LSE."""
    c = torch.tensor(scale, dtype=torch.float32) * torch.tensor(1.4426950408889634, dtype=torch.float32)
    s = (k.float() @ q.float()).float()
    m = s.max()
    p = torch.exp2((s - m) * c)
    return (p @ v.float()) / p.sum(), (m * c + torch.log2(p.sum())) * 0.6931471805599453


def _auto_online_softmax(s: torch.Tensor, v: torch.Tensor, c: float, ffma_below: float, block: int = 128,
                         exact_blocks=()):
    """``ExactWeightSoftmax.online_softmax`` with ``ffma_below`` on one row in fp32 (an emulation: FA4's FFMA
    ``fma(s, c, -round(m * c))`` rounded once, its product exact in fp64), key block by key block: the weights of a
    block whose ``|m * c|`` is below ``ffma_below`` are the FFMA's, else ``exp2((s - m) * c)``; the rescale
    ``exp2((m_prev - m) * c)`` either way. As the kernel: the running max ignores NaN scores (``fmax``) unless a
    block's are all NaN; a max of ``-inf`` (every key so far masked) weighs against 0 (``check_inf``); a NaN or
    infinite ``m * c`` takes the exact weight; ``exact_blocks`` (block indices) take the exact weight whatever their
    max (another row of the warp voted against the FFMA); a zero or NaN sum normalises by 1 (FA4's ``finalize``).
    Returns the normalised output (fp64)."""
    f32 = torch.float32
    c32 = torch.tensor(c, dtype=f32)
    m = None
    l = torch.zeros((), dtype=torch.float64)
    o = torch.zeros(v.shape[1], dtype=torch.float64)
    for i, j in enumerate(range(0, s.numel(), block)):
        sb, vb = s[j:j + block], v[j:j + block].double()
        finite = sb[~sb.isnan()]
        bm = finite.max() if finite.numel() else torch.tensor(float("nan"))
        m_new = bm if m is None else (m if bm.isnan() else bm if m.isnan() else torch.maximum(m, bm))
        cur = torch.zeros((), dtype=f32) if m_new == -float("inf") else m_new  # check_inf
        mc = (cur * c32).to(f32)
        if mc.abs() < ffma_below and i not in exact_blocks:  # FA4's FFMA: s * c exact, minus the rounded m * c
            x = (sb.double() * c32.double() - mc.double()).to(f32)
        else:
            x = ((sb - cur).to(f32) * c32).to(f32)
        w = torch.exp2(x).double()
        r = torch.exp2(((m - cur) * c32).to(f32)).double() if m is not None else torch.ones((), dtype=torch.float64)
        l, o, m = l * r + w.sum(), o * r + w @ vb, m_new
    return o / (l if l != 0 and not l.isnan() else 1.0)


@pytest.mark.parametrize("offset", [0.0, 170.0, 1e6, -3e31])
def test_ffma_weight_below_the_auto_threshold_errs_like_fp32_not_like_bf16(offset):
    """``exact_weight="auto"``'s threshold (config.EXACT_WEIGHT_FFMA_BELOW, 2**8), on one row of scores ``offset``
    plus a ramp and noise of order 1 (its running max climbs from key block to key block): below the threshold
    (``|offset| * log2(e)`` < 2**8) FA4's FFMA weight, half an ulp of ``m * c`` off (at most 2**-17 in log2 units;
    two key blocks' weights relative to each other 2**-16), gives an output within 2**-16 of the fp64 softmax relative to the largest |V| (bf16's output rounding is
    2**-9); at ``m * c`` near 2**20 the FFMA alone errs by more than 2**-12 and near 2**105 gives a NaN or zero row,
    where the threshold takes the exact weight, within the same 2**-16."""
    g = torch.Generator().manual_seed(1)
    n = 1024
    s = (offset + torch.linspace(0.0, 3.0, n) + torch.randn(n, generator=g)).to(torch.float32)
    v = torch.randn(n, 8, generator=g).to(torch.float32)
    c = 1.4426950408889634
    ref = torch.softmax((s.double() - s.double().max()) * c * 0.6931471805599453, 0) @ v.double()
    bound = 2 ** -16 * v.abs().max().item()
    for below in (cc.EXACT_WEIGHT_FFMA_BELOW, 0.0):  # "auto", then always exact
        assert (_auto_online_softmax(s, v, c, below) - ref).abs().max().item() <= bound, below
    ffma = _auto_online_softmax(s, v, c, float("inf"))  # FA4's FFMA everywhere
    if abs(offset) * c < cc.EXACT_WEIGHT_FFMA_BELOW:
        assert (ffma - ref).abs().max().item() <= bound
    elif abs(offset) < 1e30:
        assert (ffma - ref).abs().max().item() > 2 ** -12 * v.abs().max().item()
    else:  # the best key weighs inf (a NaN row) or 0 (every key 0: FA4's finalize gives a zero row)
        assert ffma.isnan().any() or not ffma.any()


@st.composite
def _auto_rows(draw):
    """One row of fp32 scores for :func:`_auto_online_softmax`: ``scale_log2`` from 2**-120 (the least the kernel
    takes: ``interface.positive_scale``) to 2**10, the row's max times it near the threshold (on both sides, within
    an ulp), at 0, or anywhere up to 1e6; spreads from 0 to 100 in log2 units, a ramp (the running max climbs from
    key block to key block) or not; masked keys (-inf): none, some, the first blocks (every key so far masked) or
    all; one key +inf, NaN or 3.3e38 or none; key blocks of 16 to 128; key blocks another row of the warp votes to
    the exact weight."""
    n = draw(st.integers(1, 300))
    block = draw(st.sampled_from([16, 32, 64, 128]))
    c = float(torch.tensor(draw(st.one_of(st.floats(2.0 ** -120, 2.0 ** 10), st.sampled_from(
        [1.4426950408889634, 0.12751743082459868, 2.0 ** -120, 2.0 ** -60]))), dtype=torch.float32))
    target = draw(st.one_of(st.sampled_from([256.0, -256.0, 255.99998, -255.99998, 256.00003, 128.0, 0.0]),
                            st.floats(-300, 300), st.floats(-2.0 ** 14, 2.0 ** 14), st.floats(-1e6, 1e6)))
    offset = target / c
    assume(abs(offset) < 3e38)
    spread = draw(st.sampled_from([0.0, 1e-3, 1.0, 3.0, 10.0, 100.0])) / c
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    s = offset + spread * torch.randn(n, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        s = s + torch.linspace(-3, 3, n, dtype=torch.float64) * (spread or 1.0 / c)
    s = s.clamp(-3.3e38, 3.3e38).to(torch.float32)
    mask = draw(st.sampled_from(["none", "some", "first", "all"]))
    if mask == "some":
        s[torch.rand(n, generator=g) < 0.3] = -float("inf")
    elif mask == "first":
        s[:draw(st.integers(0, n))] = -float("inf")
    elif mask == "all":
        s[:] = -float("inf")
    odd = draw(st.sampled_from([None, float("inf"), float("nan"), 3.3e38]))
    if odd is not None:
        s[draw(st.integers(0, n - 1))] = odd
    v = torch.randn(n, 8, generator=g)
    if draw(st.booleans()):  # V of one sign per key block: a shift of one block's weights moves the output most
        v = v.abs() * (torch.arange(n) // block % 2 * 2 - 1)[:, None]
    exact_blocks = {i for i in range(-(-n // block)) if draw(st.booleans())}
    return s, v, c, block, exact_blocks


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_auto_rows())
def test_auto_weight_is_the_exact_weight_within_2_pow_minus_16_and_adds_no_nonfinite_output(row):
    """``exact_weight="auto"`` against True on one row (:func:`_auto_online_softmax`, hypothesis): the same NaN and
    inf entries (masked rows, +inf / NaN scores, maxima whose ``m * c`` overflows: the exact side), and elsewhere
    within ``2**-18 * (max V - min V)`` of True's output per column: each FFMA weight is half an ulp of ``|m * c| <
    2**8`` off, at most 2**-17 in log2 units, so two key blocks' weights relative to each other at most 2**-16
    (``delta``), which moves the weighted mean of V by at most ``delta * ln 2 / 4`` times V's range (a covariance:
    :func:`test_auto_weight_on_two_key_blocks_rounded_apart_reaches_its_bound`)."""
    s, v, c, block, exact_blocks = row
    auto = _auto_online_softmax(s, v, c, cc.EXACT_WEIGHT_FFMA_BELOW, block, exact_blocks)
    exact = _auto_online_softmax(s, v, c, 0.0, block)
    assert torch.equal(auto.isnan(), exact.isnan()) and torch.equal(auto.isinf(), exact.isinf()), (auto, exact)
    both = auto.isfinite() & exact.isfinite()
    bound = 2 ** -18 * (v.max(0).values - v.min(0).values).double() + 1e-12
    assert ((auto - exact).abs() <= bound)[both].all(), (auto - exact, bound)


def _rounded_apart(below: float, c: float) -> tuple[float, float]:
    """Two fp32 maxima ``m`` with ``m * c`` just below ``below`` whose products round (fp32) down and up by nearly
    half an ulp: ``(m_down, m_up)``, the first's ``m * c - round(m * c)`` near +half an ulp, the second's near -half."""
    from fractions import Fraction

    c32 = torch.tensor(c, dtype=torch.float32)
    x = torch.tensor(below / c, dtype=torch.float32)
    best = {1: (0.0, None), -1: (0.0, None)}
    for _ in range(2000):
        x = torch.nextafter(x, torch.tensor(0.0))
        if x.item() * c >= below:
            continue
        e = float(Fraction(x.item()) * Fraction(c32.item()) - Fraction((x * c32).item()))
        side = 1 if e > 0 else -1
        if abs(e) > abs(best[side][0]):
            best[side] = (e, x.item())
    return best[1][1], best[-1][1]


@pytest.mark.parametrize("below", [cc.EXACT_WEIGHT_FFMA_BELOW, 2 * cc.EXACT_WEIGHT_FFMA_BELOW])
def test_auto_weight_on_two_key_blocks_rounded_apart_reaches_its_bound(below):
    """The worst case of the FFMA side: two key blocks of one key value each, the first's ``m * c`` rounded up by
    nearly half an ulp, the second's (a larger max) down by nearly as much, V +1 on the first and -1 on the second:
    their weights, equal in exact arithmetic, are 2**-16 in log2 units apart below 2**8 (half an ulp each way), the
    output ``delta * ln 2 / 4 * range`` off True's, 0.173 * 2**-16 * 2: within the property's ``2**-18 * range``
    (:func:`test_auto_weight_is_the_exact_weight_within_2_pow_minus_16_and_adds_no_nonfinite_output`), and a
    threshold twice as high (2**9: 2**-15 apart) exceeds it."""
    c = 1.4426950408889634
    m_down, m_up = _rounded_apart(below, c)
    s = torch.tensor([m_up] * 128 + [m_down] * 128, dtype=torch.float32)
    assert m_down > m_up  # the second block raises the running max
    v = torch.cat([torch.ones(128, 1), -torch.ones(128, 1)])
    off = (_auto_online_softmax(s, v, c, below) - _auto_online_softmax(s, v, c, 0.0)).abs().item() / (2 ** -16 * 2)
    assert 0.15 * below / cc.EXACT_WEIGHT_FFMA_BELOW < off < 0.18 * below / cc.EXACT_WEIGHT_FFMA_BELOW, off
    assert (off <= 0.25) is (below == cc.EXACT_WEIGHT_FFMA_BELOW)


@pytest.mark.parametrize("scale", [1.2e-38, -1.2e-38, 2.0 ** -121, 4e-37])
def test_exact_weight_runs_a_scale_below_2_pow_minus_120_in_log2_units_on_q_times_2_pow_minus_24(scale, monkeypatch):
    """Raw scores q . k of 3.2e38 (the best key) and -2e38 (99 keys), bf16 q and K, at scale +-1.2e-38 (a normal
    fp32, as is its ``scale * log2(e)``): with the exact weight the raw difference s - m (-5.2e38) overflowed to
    -inf, so every key but the best weighed 0 where each weighs e^-6.2 (out 1.0 for the reference's 0.67; the
    triton backend's break29a). The interface now runs such scales (``|scale| * log2(e)`` below 2**-120) on
    ``q * 2**-24`` with ``|scale| * 2**24``: the same scores bit for bit (a power of two), raw ones below 2**104.
    Without the switch (FA4's weight multiplies first) q is passed as given."""
    from blockdiff.attention.cute import interface as ca
    from blockdiff.attention.reference import attention_reference

    q = torch.full((1, 1, 16), 1e19 if scale > 0 else -1e19, dtype=torch.bfloat16)
    k = torch.full((100, 1, 16), -1.25e18, dtype=torch.bfloat16)
    k[0] = 2e18
    v = torch.where(k[..., :8] > 0, 1.0, -1.0).to(torch.bfloat16)
    inp = dict(k_cache=k, v_cache=v, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
               seq_lens=torch.tensor([100], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 100], dtype=torch.int32),
               num_causal_q=torch.tensor([0], dtype=torch.int32))
    want = attention_reference(q, **inp, scale=scale, return_lse=True)
    assert ca.positive_scale(q, abs(scale))[0] is q  # the switch off: as given (FA4's weight multiplies first)
    # attention_cute reads the switch from the call's config (None, a dict or a CuteConfig; CuteConfig's default,
    # on, where unset)
    assert [ca._exact_weight_of(c) for c in (None, {}, dict(exact_weight=False), cc.CuteConfig(exact_weight=False))] \
        == [True, True, False, False]
    monkeypatch.setattr(cc.CuteConfig, "exact_weight", False)
    assert not ca._exact_weight_of(None) and not ca._exact_weight_of({})
    assert ca._exact_weight_of(dict(exact_weight=True))
    q2, s2 = ca.positive_scale(q, scale, exact_weight=True)
    assert s2 > 0 and s2 * 1.4426950408889634 >= ca.MIN_EXACT_WEIGHT_SCALE_LOG2 and q2.dtype == q.dtype
    got = attention_reference(q2, **inp, scale=s2, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    out, lse = _exact_weight_softmax(q2[0, 0], k[:, 0], v[:, 0], s2)  # the kernel's arithmetic on what it gets
    assert torch.allclose(out.double(), want[0][0, 0].double(), atol=2e-3), (out, want[0][0, 0])
    assert abs(lse.item() - want[1][0, 0].item()) < 1e-3
    if abs(scale) < 2e-38:  # the call before the fix (q and |scale| as given): 99 keys dropped
        bad, _ = _exact_weight_softmax(q[0, 0] * (1 if scale > 0 else -1), k[:, 0], v[:, 0], abs(scale))
        assert (bad - want[0][0, 0].float()).abs().max() > 0.1


# ---------------------------------------------------------------- the SASS reader (CPU)
SASS = """
        Function : kernel_a
        /*0100*/                   FFMA R12, R4.reuse, R2, -R3 ;
        /*0110*/                   MUFU.EX2 R12, R12 ;
        /*0120*/                   FADD R13, R5, -R3 ;
        /*0130*/                   FMUL R13, R13, R2 ;
        /*0140*/                   MUFU.EX2 R13, R13 ;
        /*0150*/                   FFMA R14, R6, R2, -R7 ;
        /*0160*/                   FSETP.GEU.AND P0, PT, R14, -126, PT ;
        /*0170*/              @!P0 FMUL R14, R14, 0.5 ;
        /*0180*/                   MUFU.EX2 R15, R14 ;
        /*0190*/                   MOV R16, R17 ;
        /*01a0*/                   MUFU.EX2 R16, R16 ;
        Function : kernel_b
        /*0000*/                   MUFU.EX2 R12, R12 ;
"""


def test_sass_ex2_operands_names_the_writer_of_each_exp2_through_a_predicated_fixup():
    """FFMA then exp2: FA4's weight; FADD, FMUL, exp2: the exact one; an FFMA behind ptxas' predicated range fix-up
    of an exp2 without flush-to-zero (the recompute's) still counts as an FFMA; the writers reset at a function."""
    assert cchk.sass_ex2_operands(SASS) == dict(ex2=5, from_ffma=2, from_fmul=1, from_other=2)
    assert cchk.sass_ex2_operands("") == dict(ex2=0, from_ffma=0, from_fmul=0, from_other=0)
    with pytest.raises(TypeError, match="sass must be a str"):
        cchk.sass_ex2_operands(b"MUFU.EX2")


def test_sass_ex2_operands_follows_an_ffma_copied_into_an_exp2_through_a_move():
    """An FFMA's result copied by ``MOV`` or by ptxas' ``IMAD.MOV.U32 Rd, RZ, RZ, Rs`` before the exp2 is still an
    FFMA-fed exp2 (the reader followed only an operand's direct writer before); a copy of an FMUL stays an FMUL."""
    sass = """
        Function : kernel_c
        /*0000*/                   FFMA R20, R4, R2, -R3 ;
        /*0010*/                   MOV R21, R20 ;
        /*0020*/                   MUFU.EX2 R22, R21 ;
        /*0030*/                   IMAD.MOV.U32 R23, RZ, RZ, R20 ;
        /*0040*/                   MUFU.EX2 R24, R23 ;
        /*0050*/                   FMUL R25, R5, R2 ;
        /*0060*/                   MOV R26, R25 ;
        /*0070*/                   MUFU.EX2 R27, R26 ;
        /*0080*/                   IMAD.MOV.U32 R28, RZ, RZ, 0x3f800000 ;
        /*0090*/                   MUFU.EX2 R29, R28 ;
"""
    assert cchk.sass_ex2_operands(sass) == dict(ex2=4, from_ffma=2, from_fmul=1, from_other=1)


# ---------------------------------------------------------------- offline sm_90a compiles (CPU, FA4 installed)
#: (id, compile_only spec): FA4's consumer at hd 64 / 128 / 256 unsplit and split (cluster, Triton merge), the
#: recompute (which the switch changes too), the split-value and roles kernels at hd 512, the roles kernel split.
COMPILE_SPECS = [
    ("hd64", dict(head_dim=64, num_heads=16, num_kv_heads=8)),
    ("hd128", dict(head_dim=128, num_heads=16, num_kv_heads=8)),
    ("hd128_split2_cluster", dict(head_dim=128, num_heads=16, num_kv_heads=8,
                                  config=dict(num_splits=2, split_merge="cluster"))),
    ("hd128_split3_triton_window", dict(head_dim=128, num_heads=16, num_kv_heads=8, window_size=1023,
                                        config=dict(num_splits=3, split_merge="triton"))),
    ("hd128_recompute", dict(head_dim=128, num_heads=16, num_kv_heads=8, config=dict(nan_safe_v_method="recompute"))),
    ("hd256_window_recompute", dict(head_dim=256, num_heads=16, num_kv_heads=8, window_size=1023)),
    ("hd256_split2", dict(head_dim=256, num_heads=16, num_kv_heads=8, config=dict(num_splits=2, split_merge="triton"))),
    ("hd512_split_v", dict(head_dim=512, num_heads=16, num_kv_heads=2, page_size=64, max_seqlen_q=256,
                           config=dict(wide_design="split_v"))),
    ("hd512_roles", dict(head_dim=512, num_heads=16, num_kv_heads=2, page_size=64, max_seqlen_q=256,
                         config=dict(wide_design="roles"))),
    ("hd512_roles_split2", dict(head_dim=512, num_heads=16, num_kv_heads=2, page_size=64, max_seqlen_q=256,
                                config=dict(wide_design="roles", num_splits=2))),
]


def _compile(spec: dict, on: bool) -> dict:
    return compile_for_sm90_or_skip(**dict(spec, config=dict(spec.get("config") or {}, exact_weight=on)))


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1 "
                    "(not installed here)")
@pytest.mark.parametrize("spec", [s for _, s in COMPILE_SPECS], ids=[n for n, _ in COMPILE_SPECS])
def test_exact_weight_compiles_with_no_exp2_fed_by_an_ffma(spec):
    """Off, FA4's weights are exp2s of FFMAs (the gap, seen in the SASS); on, no exp2 of the attention kernel takes
    an FFMA's result, the kernel has as many exp2s, the key-block loops as many as off's and no local memory where
    off's have none, the consumers no more spill instructions than off's, and no spills where off has none (ptxas'
    report; a kernel that spills already may spill a few bytes more: the split hd-256 launch, 4 bytes outside its
    loops)."""
    off, on = _compile(spec, False), _compile(spec, True)
    assert off["config"]["exact_weight"] is False and on["config"]["exact_weight"] is True
    assert off["ex2_operands"]["from_ffma"] > 0, off["ex2_operands"]
    assert on["ex2_operands"]["from_ffma"] == 0, on["ex2_operands"]
    assert on["ex2_operands"]["ex2"] == off["ex2_operands"]["ex2"], (off["ex2_operands"], on["ex2_operands"])
    assert [lp["MUFU.EX2"] for lp in on["loops"]] == [lp["MUFU.EX2"] for lp in off["loops"]]
    assert [lp["STL/LDL"] for lp in on["loops"]] == [lp["STL/LDL"] for lp in off["loops"]]
    for key in ("spill_store_bytes", "spill_load_bytes"):
        if off[key] == 0:
            assert on[key] == 0, (key, off[key], on[key])
    assert on["sass_spills"]["consumer"] <= off["sass_spills"]["consumer"], (off["sass_spills"], on["sass_spills"])
    assert on["setmaxreg"] == off["setmaxreg"]


@pytest.mark.skipif(not HAVE_FA4, reason="compiling needs flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1 "
                    "(not installed here)")
@pytest.mark.parametrize("spec", [s for _, s in COMPILE_SPECS], ids=[n for n, _ in COMPILE_SPECS])
def test_exact_weight_auto_compiles_both_weights_behind_one_warp_vote_per_key_block(spec):
    """``"auto"``: every key-block loop with the softmax's exp2s holds a ``VOTE.ALL`` (the warp's choice for all of
    its rows at once, :meth:`ExactWeightSoftmax._online_softmax_voted`) and both sides whole, each with its own exp2s
    (more than True's), FA4's FFMAs on one and the exact weight's FMULs (at least True's) on the other; no local
    memory in the loops, no spills where True has none, and the same register split."""
    exact, auto = _compile(spec, True), _compile(spec, "auto")
    assert auto["config"]["exact_weight"] == "auto"
    assert auto["ex2_operands"]["ex2"] > exact["ex2_operands"]["ex2"], (exact["ex2_operands"], auto["ex2_operands"])
    assert auto["ex2_operands"]["from_ffma"] > 0, auto["ex2_operands"]
    assert len(auto["loops"]) == len(exact["loops"]) > 0
    softmax_loops = 0
    for a, e in zip(auto["loops"], exact["loops"]):
        assert a["STL/LDL"] == e["STL/LDL"] == 0, (a, e)
        if e["MUFU.EX2"] == 0:  # a loop without the softmax (the wide kernels' value-only warpgroups)
            assert a["VOTE.ALL"] == 0 and a["MUFU.EX2"] == 0, (a, e)
            continue
        softmax_loops += 1
        assert a["VOTE.ALL"] >= 1 and e["VOTE.ALL"] == 0, (a, e)
        assert a["MUFU.EX2"] > e["MUFU.EX2"], (a, e)
        assert a["FFMA"] > e["FFMA"] and a["FMUL"] >= e["FMUL"], (a, e)
    assert softmax_loops > 0
    for key in ("spill_store_bytes", "spill_load_bytes"):
        if exact[key] == 0:
            assert auto[key] == 0, (key, exact[key], auto[key])
    assert auto["setmaxreg"] == exact["setmaxreg"]


# ---------------------------------------------------------------- GPU
def very_negative_scores_batch(head_dim: int, page_size: int, scale: float, seed: int = 73) -> dict:
    """The contract case's batch on the GPU, plus a longer canvas (so that split-KV ranges hold several key
    blocks): scores near -2e31 and below in magnitude (q = +-1e15, k = -1e15 (1 + u / 2), bf16), finite and inside
    the contract, every row's softmax one-hot on its least negative key. ``scale`` -1 takes -q: the same scores."""
    return make_very_negative_scores_batch([40, 13, 30, 700], [9, 13, 30, 64], num_causal_q=[0, 13, 11, 0],
                                           num_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
                                           dtype=torch.bfloat16, q_sign=int(scale), seed=seed, device="cuda")


def _merges(hd: int):
    """(num_splits, split_merge) of the GPU cases: unsplit, and each merge of split-KV where the head dim builds it
    (the cluster merge: head dims <= 256, its fp32 tile in the Q / K / V buffers)."""
    cases = [(1, "auto"), (3, "triton")]
    if hd <= 256:
        cases.append((2, "cluster"))
    return cases


#: (head dim, page size, config): FA4's consumer at hd 64 / 128 / 256, the split-value and the roles kernel at hd 512.
GPU_CASES = [(64, 16, {}), (128, 128, {}), (256, 64, {}), (512, 64, dict(wide_design="split_v")),
             (512, 64, dict(wide_design="roles"))]


@needs_gpu
@pytest.mark.parametrize("hd,page,config", GPU_CASES, ids=["hd64", "hd128", "hd256", "hd512_split_v", "hd512_roles"])
@pytest.mark.parametrize("scale", [1.0, -1.0])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("exact", [True, "auto"], ids=["exact", "auto"])
def test_gpu_scores_near_2e31_give_the_one_hot_softmax_with_exact_weight(hd, page, config, scale, window, exact):
    """With ``exact_weight`` (True, or ``"auto"``, which takes the exact weight at these maxima) every row's output
    is its least negative key's V and its LSE finite, unsplit and split (Triton and cluster merges), against the
    fp64 reference (the contract case, which FA4's weight fails)."""
    inp = very_negative_scores_batch(hd, page, scale)
    for splits, merge in _merges(hd):
        cfg = dict(config, exact_weight=exact, num_splits=splits, split_merge=merge)
        q, vc = inp["q"], inp["v_cache"]
        out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
        o, lse = attention(**inp, out=out, return_lse=True, backend="cute", config=cfg, scale=scale,
                           window_size=window)
        assert o.isfinite().all() and lse.isfinite().all(), (hd, config, splits, merge)
        check_close(o, **inp, lse=lse, scale=scale, window_size=window)


def crossing_scores_batch(head_dim: int, page_size: int, seed: int = 5, device="cuda") -> dict:
    """A batch whose rows take both of ``exact_weight="auto"``'s weights: N(0, 1) q and k at scale 1 (scores of
    order ``sqrt(head_dim)``, ``|max * scale * log2(e)|`` well below 2**8: FA4's FFMA) where the keys of every
    sequence before its last 256 (whole pages) are 12x larger (maxima near 40 sqrt(head_dim) and beyond 2**8 in
    log2 units: the exact weight). The kernels take a tile's key blocks from the last to the first (FA4's order), so
    a row's running max crosses the threshold from one key block to a later one: its first key blocks take the
    FFMA, the rest the exact weight (:func:`test_crossing_scores_batch_takes_the_ffma_then_the_exact_weight`; the
    12x keys were the ones past the 256th before, the blocks a tile takes first, so every row took the exact weight
    from its first key block on at head dims >= 128). A sequence of at most 256 keys stays below it throughout.
    Bidirectional and causal rows, GQA 2."""
    inp = make_batch([700, 90, 420, 1], [40, 90, 64, 1], num_causal_q=[0, 90, 20, 1], num_heads=4, num_kv_heads=2,
                     head_dim=head_dim, page_size=page_size, dtype=torch.bfloat16, seed=seed, device=device)
    k, table = inp["k_cache"].clone(), inp["block_table"]
    for b, n in enumerate(inp["seq_lens"].tolist()):
        for j in range(max(0, n - 256) // page_size):
            k[int(table[b, j])] *= 12
    return dict(inp, k_cache=k)


def _processing_order_weights(inp: dict, b: int, tile_n: int, c: float = 1.4426950408889634) -> str:
    """The weight ``exact_weight="auto"`` takes for sequence ``b``'s first query row (head 0, which sees every key
    of the sequence here), key block by key block in the kernels' order (the last block first): ``"F"`` where the
    running ``|max * c|`` is below config.EXACT_WEIGHT_FFMA_BELOW (FA4's FFMA), ``"E"`` elsewhere (exact)."""
    n, page = int(inp["seq_lens"][b]), inp["k_cache"].shape[1]
    keys = torch.cat([inp["k_cache"][int(inp["block_table"][b, j])] for j in range(-(-n // page))])[:n, 0].float()
    q = inp["q"][int(inp["cu_seqlens_q"][b]), 0].float()
    s = (keys @ q) * c
    run, out = -float("inf"), ""
    for j in reversed(range(-(-n // tile_n))):
        run = max(run, s[j * tile_n:(j + 1) * tile_n].max().item())
        out += "F" if abs(run) < cc.EXACT_WEIGHT_FFMA_BELOW else "E"
    return out


@pytest.mark.parametrize("hd,page", sorted({(hd, page) for hd, page, _ in GPU_CASES}))
def test_crossing_scores_batch_takes_the_ffma_then_the_exact_weight(hd, page):
    """The GPU batch of :func:`test_gpu_exact_weight_auto_matches_the_reference_where_rows_cross_the_ffma_threshold`
    (built on the CPU) does what it is for, for any key block size the kernels take: the long sequences' rows take
    FA4's FFMA on their first key blocks (in the kernels' order, the last block first) and the exact weight from a
    later one on; the short ones keep the FFMA."""
    inp = crossing_scores_batch(hd, page, device="cpu")
    for tile_n in (64, 80, 96, 112, 128, 176):
        for b in (0, 2):  # 700 and 420 keys
            got = _processing_order_weights(inp, b, tile_n)
            assert re.fullmatch(r"F+E+", got), (hd, page, tile_n, b, got)
        assert _processing_order_weights(inp, 1, tile_n) == "F" * -(-90 // tile_n)


@needs_gpu
@pytest.mark.parametrize("hd,page,config", GPU_CASES, ids=["hd64", "hd128", "hd256", "hd512_split_v", "hd512_roles"])
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_exact_weight_auto_matches_the_reference_where_rows_cross_the_ffma_threshold(hd, page, config, window):
    """``exact_weight="auto"`` on :func:`crossing_scores_batch` (rows whose key blocks take FA4's FFMA, then the exact
    weight, and rows that keep the FFMA), unsplit and split (each merge the head dim builds): finite, every output
    element written (poisoned with NaN before the launch), within the contract's tolerance of the fp64 reference,
    and within the same tolerance of ``exact_weight=True`` on the same batch."""
    inp = crossing_scores_batch(hd, page)
    q, vc = inp["q"], inp["v_cache"]
    for splits, merge in _merges(hd):
        outs = {}
        for exact in (True, "auto"):
            cfg = dict(config, exact_weight=exact, num_splits=splits, split_merge=merge)
            out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
            o, lse = attention(**inp, out=out, return_lse=True, backend="cute", config=cfg, scale=1.0,
                               window_size=window)
            assert o.isfinite().all() and lse.isfinite().all(), (hd, config, splits, merge, exact)
            check_close(o, **inp, lse=lse, scale=1.0, window_size=window)
            outs[exact] = (o.float(), lse)
        (o_t, lse_t), (o_a, lse_a) = outs[True], outs["auto"]
        # FA4's FFMA errs by at most 2**-17 in log2 units per weight below 2**8: bf16's rounding of the outputs
        # dominates
        assert (o_a - o_t).abs().max().item() <= 2 ** -6 * max(1.0, o_t.abs().max().item()), (splits, merge)
        assert torch.allclose(lse_a, lse_t, rtol=2 ** -14, atol=2 ** -10), (splits, merge)


@needs_gpu
@pytest.mark.xfail(strict=False, reason="FA4's combine kernel (split_merge 'combine') weighs each split "
                   "exp2(lse * log2(e) - max(lse) * log2(e)), the same FFMA against a rounded max, on LSEs near "
                   "-1e32: expected NaN rows from its source (flash_attn/cute/flash_fwd_combine.py), not yet run")
def test_gpu_scores_near_2e31_with_fa4_combine_merge():
    inp = very_negative_scores_batch(128, 128, 1.0)
    q, vc = inp["q"], inp["v_cache"]
    out = torch.full((q.shape[0], q.shape[1], vc.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**inp, out=out, return_lse=True, backend="cute",
                       config=dict(exact_weight=True, num_splits=3, split_merge="combine"))
    assert o.isfinite().all() and lse.isfinite().all()
    check_close(o, **inp, lse=lse)


@needs_gpu
@pytest.mark.parametrize("hd,page", [(128, 128), (256, 64)], ids=["hd128", "hd256"])
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_recompute_keeps_the_best_keys_inf_with_exact_weight(hd, page, splits):
    """NaN-safe V by recompute on the very-negative-scores batch: key 0 of every sequence is made every row's best
    (the least negative k) and its V column 0 +Inf, so every row's column 0 is +Inf in the reference (weight 1),
    and a NaN entry of a key a row sees with weight 0 is NaN (0 * NaN). The recompute weighs keys exactly
    (``exp2((s - m) * scale_log2) / l``); from the rounded LSE the best key weighed inf or 0 there."""
    inp = very_negative_scores_batch(hd, page, 1.0)
    k, v, table = inp["k_cache"].clone(), inp["v_cache"].clone(), inp["block_table"]
    for b in range(table.shape[0]):
        page_idx = int(table[b, 0])
        k[page_idx, 0] = -0.9e15  # key 0: the largest score of every row (scores ~ -1e30 * head_dim)
        v[page_idx, 0, :, 0] = float("inf")
    bad = dict(inp, k_cache=k, v_cache=v)
    q = bad["q"]
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    o, lse = attention(**bad, out=out, return_lse=True, backend="cute",
                       config=dict(exact_weight=True, nan_safe_v=True, nan_safe_v_method="recompute",
                                   num_splits=splits, split_merge="triton" if splits > 1 else "auto"))
    assert o[:, :, 0].eq(float("inf")).all(), "the best key's +Inf V must reach every row"
    assert check_nonfinite_matches_reference(o, bad, lse=lse) > 0

