"""Issue 26, cute ``nan_safe_v``: a CPU simulation of which NaN / Inf entries the kernel's output gets on the inputs
of ``tests/attention/cute/test_cute_nan_safe_v.py`` (hd-128 cases, the test's seeds) under hypotheses about the
per-warpgroup "a masked block's V held a non-finite entry" flag, against the reference's, counted as the test's
first H200 run counted them (``isnan`` entries that differ; log of 2026-12-02: pagebox64 96, split3 292,
window127 488, split2_prefix100 394, contiguous 250).

Model of the kernel (128 x 128 tiles, PackGQA of 2 heads: warpgroup 1 holds tile rows 0-63, warpgroup 2 rows
64-127): a poisoned key in an interior block reaches every row that sees it (the PV wgmma); one in a masked block
(first, right- or left-masked, FA4's loop order, the split's range) is zeroed in shared memory and comes back only
through the fix-up, i.e. only for rows of a warpgroup whose flag is set. Hypotheses: ``H0`` (the design: a
warpgroup's flag is set when any masked block's V stage held one), ``H1`` (warpgroup 2 never sets it), ``H2``
(warpgroup 2 only from the first block), ``H3`` (warpgroup 1 never), ``H4`` (no fix-up at all). ``--enumerate
M|any``: the set of counts reachable when, per (tile, split), either warpgroup may be the one that cleans the
stage second and so reads it already cleaned (``any``; ``M``: warpgroup 1 always first after the first block).

Split mode (``FlashAttentionForwardSm90Mixed._CLEAN_SPLIT_ACROSS_WG``, docs/tuning.md 2.31) is not simulated, and
need not be: it acts only above head dim 128 (these hd-128 tiles never take it), and there the consumer warpgroups
scan disjoint chunks of the stage and OR their finds at one barrier over all of them, with no tags, so every
warpgroup's flag is "any masked block's stage held one", ``H0`` by construction, with no order to enumerate.

    python3 -m blockdiff.bench.experiments.sim_cute_nan_v_race [--enumerate any]
(CPU, ~20 s; ``--enumerate`` a few minutes; the cute launch config comes from FA4's tile heuristic, so
flash-attn-4 and the CuTe DSL must be importable, ``.[cute]``: with ``.[dev]`` alone it stops with an
ImportError). The values of q / k are drawn on the CPU, not as on the GPU; the
non-finite pattern depends only on which rows see which poisoned key (scores are N(0, 1), no weight underflows),
which the script checks against the reference computed on these inputs.
"""
import itertools
import math

import torch

from blockdiff.attention import attention
from blockdiff.attention.testing import make_batch, poison_v_inside_seq_lens
from blockdiff.attention.cute import config as cc
from blockdiff.bench.experiments.sim_cute_nan_recompute import row_range, split_ranges

TM, TN, QPK = 128, 128, 2

poison_v = poison_v_inside_seq_lens  # the tests' poisoning, with the logical positions

def tile_masked_blocks(m, Lq, S, ncq, W, prefix, nsplit):
    """per split: (n_lo, n_hi, empty, ordered list of (block, kind)): the shared tile / split / block-order model
    (:func:`blockdiff.bench.experiments.sim_cute_nan_recompute.split_ranges`) at this simulation's constants."""
    return split_ranges(m, Lq, S, ncq, W, prefix, nsplit, QPK, TN, TM)

def simulate(inp, pos, W, prefix, nsplit, hyp):
    """Return the simulated isnan/isposinf/isneginf of the kernel output (only positions with a poisoned column)."""
    sl = inp["seq_lens"].tolist(); cu = inp["cu_seqlens_q"].tolist()
    ncq = inp["num_causal_q"].tolist()
    paged = inp.get("block_table") is not None
    total_q, H = inp["q"].shape[:2]; D = inp["v_cache"].shape[-1]
    # accumulate the non-finite terms per (token, head, col): sets of signs
    terms_k = {}; terms_r = {}
    stage_bad = {}  # (b, hk, block) -> the V stage holds a non-finite (in-seq poisons; plus next-seq rows if contiguous)
    for (b, key, hk, col, val) in pos:
        stage_bad[(b, hk, key // TN)] = True
    if not paged:  # rows past seq end of b in its last block: the next sequences' keys (contiguous cache)
        cuk = inp["cu_seqlens_k"].tolist()
        for (b2, key, hk, col, val) in pos:
            gk = cuk[b2] + key
            for b in range(len(sl)):
                if sl[b] == 0 or b == b2: continue
                last = (sl[b] - 1) // TN
                g0 = cuk[b] + last * TN
                if g0 + sl[b] - last * TN <= gk < g0 + TN:
                    stage_bad[(b, hk, last)] = True
    for b in range(len(sl)):
        Lq, S = cu[b + 1] - cu[b], sl[b]
        if Lq == 0: continue
        for hk in range(H // QPK):
            for m in range(-(-(Lq * QPK) // TM)):
                for (lo, hi, empty, blocks) in tile_masked_blocks(m, Lq, S, ncq[b], W, prefix, nsplit):
                    if empty: continue
                    kind = dict(blocks)
                    masked = [n for n, k in blocks if k != "interior"]
                    flags = hyp(b, hk, m, blocks, lambda n: stage_bad.get((b, hk, n), False))
                    for (pb, key, phk, col, val) in pos:
                        if pb != b or phk != hk or not (lo <= key // TN < hi): continue
                        for r in range(TM):
                            prow = m * TM + r; tok = prow // QPK
                            if tok >= Lq: continue
                            l, h_ = row_range(tok, Lq, S, ncq[b], W, prefix)
                            if not (l <= key <= h_): continue
                            head = hk * QPK + prow % QPK
                            idx = (cu[b] + tok, head, col)
                            terms_r.setdefault(idx, []).append(val)
                            wg = r // 64
                            inc = kind[key // TN] == "interior" or flags[wg]
                            if inc: terms_k.setdefault(idx, []).append(val)
    def summ(vs):
        return sum(vs) if vs else 0.0
    return terms_r, terms_k, summ

def counts(terms_r, terms_k, summ):
    diff = {"isnan": [0, 0], "isposinf": [0, 0], "isneginf": [0, 0]}
    keys = set(terms_r) | set(terms_k)
    for k in keys:
        r = summ(terms_r.get(k, [])); o = summ(terms_k.get(k, []))
        for name, f in (("isnan", math.isnan), ("isposinf", lambda x: x == math.inf), ("isneginf", lambda x: x == -math.inf)):
            if f(o) and not f(r): diff[name][0] += 1
            if f(r) and not f(o): diff[name][1] += 1
    return diff


LOG = {"pagebox64": 96, "pagebox64_split3": 292, "pagebox64_window127": 488, "pagebox64_split2_prefix100": 394,
       "contiguous": 250}
CASES = [("pagebox64", 64, None, {}), ("pagebox64_split3", 64, dict(num_splits=3), {}),
         ("pagebox64_window127", 64, None, dict(window_size=127)),
         ("pagebox64_split2_prefix100", 64, dict(num_splits=2), dict(window_size=100, bidirectional_window="prefix")),
         ("contiguous", None, None, {})]
SL, QL, NCQ = [1500, 700, 333, 9, 0, 1300], [256, 700, 64, 9, 0, 300], [0, 700, 64, 4, 0, 40]


def masked(blocks):
    return [n for n, k in blocks if k != "interior"]


HYP = {
    "H0 design": lambda b, hk, m, blocks, bad: [any(bad(n) for n in masked(blocks))] * 2,
    "H1 WG2 never": lambda b, hk, m, blocks, bad: [any(bad(n) for n in masked(blocks)), False],
    "H2 WG2 first only": lambda b, hk, m, blocks, bad: [any(bad(n) for n in masked(blocks)), bad(blocks[0][0])],
    "H3 WG1 never": lambda b, hk, m, blocks, bad: [False, any(bad(n) for n in masked(blocks))],
    "H4 no fixup": lambda b, hk, m, blocks, bad: [False, False],
}


def case_inputs(page, config, kw):
    paged = page is not None
    inp = make_batch(SL, QL, num_causal_q=NCQ, num_heads=16, num_kv_heads=8, head_dim=128, page_size=page or 64,
                     paged=paged, device="cpu", seed=21, poison_unused=paged)
    bad, pos = poison_v(inp, 1 + (page or 0))
    cap = inp["block_table"].shape[1] * inp["k_cache"].shape[1] if paged else inp["k_cache"].shape[0]
    cfg = cc.resolve_launch_config(128, 128, kw.get("window_size"), dict(config or {}, nan_safe_v=True),
                                   total_q=inp["q"].shape[0], num_seqs=6, num_kv_heads=8, qhead_per_kvhead=2,
                                   keys_capacity=cap, max_seqlen_q=inp["q"].shape[0], max_seqlen_k=None, num_sms=132)
    assert (cfg.tile_m, cfg.tile_n) == (TM, TN), cfg
    W = kw.get("window_size")
    prefix = kw.get("bidirectional_window") == "prefix" and W is not None
    return bad, pos, cfg.num_splits, W, prefix


def hypotheses():
    for name, page, config, kw in CASES:
        bad, pos, nsplit, W, prefix = case_inputs(page, config, kw)
        ref = attention(**bad, backend="reference", **kw)
        tr, tk, summ = simulate(bad, pos, W, prefix, nsplit, HYP["H0 design"])
        sim = {f: torch.zeros_like(ref, dtype=torch.bool) for f in ("nan", "pinf", "ninf")}
        for (t, h, c), vs in tr.items():
            s = summ(vs)
            sim["nan"][t, h, c], sim["pinf"][t, h, c], sim["ninf"][t, h, c] = math.isnan(s), s == math.inf, s == -math.inf
        ok = (torch.equal(sim["nan"], ref.isnan()) and torch.equal(sim["pinf"], ref.isposinf())
              and torch.equal(sim["ninf"], ref.isneginf()))
        print(f"{name}: splits {nsplit}, poisoned entries {len(pos)}, reference non-finite "
              f"{int((~ref.isfinite()).sum())}, simulated reference pattern equal: {ok}; H200 log isnan {LOG[name]}")
        for hn, hyp in HYP.items():
            d = counts(*simulate(bad, pos, W, prefix, nsplit, hyp))
            print(f"   {hn:18s} " + "  ".join(f"{k}: {v[0]} only in output, {v[1]} only in reference"
                                             for k, v in d.items()))


def enumerate_counts(model):
    for name, page, config, kw in CASES:
        bad, pos, nsplit, W, prefix = case_inputs(page, config, kw)
        cu = bad["cu_seqlens_q"].tolist()
        units = {}

        def rec(b, hk, m, blocks, badf):
            ms = masked(blocks)
            anyb = any(badf(n) for n in ms)
            if anyb:
                units[(b, hk, m, blocks[0][0])] = (badf(blocks[0][0]), any(badf(n) for n in ms[1:]))
            return [anyb, anyb]
        simulate(bad, pos, W, prefix, nsplit, rec)
        groups = {}
        for k in units:
            groups.setdefault(k[:3], []).append(k)

        def options(k):
            first, later = units[k]
            if model == "M":
                return [(True, True), (True, False), (later, True)] if first else [(True, False)]
            return [(True, True), (True, False), (False, True)]

        def tok_group(t, h):
            b = max(i for i in range(len(cu) - 1) if cu[i] <= t < cu[i + 1])
            return (b, h // 2, ((t - cu[b]) * 2 + h % 2) // TM)
        reach = {0}
        for g, ks in groups.items():
            vals = set()
            for choice in itertools.product(*[options(k) for k in ks]):
                tab = dict(zip(ks, choice))
                tr, tk, summ = simulate(bad, [p for p in pos if p[0] == g[0] and p[2] == g[1]], W, prefix, nsplit,
                                        lambda b, hk, m, blocks, badf: list(tab.get((b, hk, m, blocks[0][0]),
                                                                                   (True, True))))
                vals.add(sum(math.isnan(summ(tr.get(key, []))) != math.isnan(summ(tk.get(key, [])))
                             for key in set(tr) | set(tk) if tok_group(key[0], key[1]) == g))
            reach = {a + v for a in reach for v in vals}
        print(f"{name}: model {model}: {len(groups)} tiles, reachable isnan counts {min(reach)}..{max(reach)} "
              f"({len(reach)} values); H200 log {LOG[name]} reachable: {LOG[name] in reach}", flush=True)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--enumerate", choices=["M", "any"], default=None,
                    help="the isnan counts reachable per case under a flag model (default: the hypotheses table)")
    a = ap.parse_args(argv)
    enumerate_counts(a.enumerate) if a.enumerate else hypotheses()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
