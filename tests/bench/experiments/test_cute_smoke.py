"""bench/experiments/cute_smoke.py end to end on the CPU, with the reference standing in for the cute kernel and
for FA4: batch building, the FA4 causal/bidirectional split and re-gather, check_close, the JSON record."""
import json
import sys
import types

import torch

from blockdiff.attention.cute.config import CuteConfig
from blockdiff.attention.reference import attention_reference
from blockdiff.bench.experiments import cute_smoke as sm


def _fake_cute(q, k, v, out=None, return_lse=False, check_values=None, **kw):
    o, lse = attention_reference(q, k, v, return_lse=True, **kw)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o


def _fake_fa4(q, k, v, cu_seqlens_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
              window_size=(None, None), **unused):
    ql = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    return attention_reference(q, k, v, cu_seqlens_q=cu_seqlens_q, seq_lens=seqused_k, block_table=page_table,
                               num_causal_q=ql if causal else torch.zeros_like(ql), window_size=window_size[0],
                               scale=softmax_scale, return_lse=True)


def test_smoke_script_plumbing_dry_run_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(sm, "DEVICE", "cpu")
    monkeypatch.setattr(sm, "RESULTS", {"cases": []})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(sm, "attention_cute", _fake_cute)
    monkeypatch.setattr(sm, "resolve_config", lambda D, Dv, w, c=None: CuteConfig(128, 128, True, True))
    fa_mod, fa_cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    fa_cute.flash_attn_varlen_func = _fake_fa4
    fa_mod.cute = fa_cute
    monkeypatch.setitem(sys.modules, "flash_attn", fa_mod)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fa_cute)

    sm.correctness_case("dry_corr", [30, 16, 9, 0], [0, 100, 5, 3], [30, 0, 4, 0], 4, 2, 32, 16, 7, "prefix")
    sm.correctness_case("dry_contig", [20, 9], [0, 40], [20, 0], 4, 4, 32, 16, None, "symmetric", True)
    sm.workload_case("dry_workload", [64, 16, 16, 5], [0, 200, 200, 0], [True, False, True, False], 4, 2, 32, 15,
                     "symmetric", rep_ms=1)
    cases = {c["case"]: c for c in sm.RESULTS["cases"]}
    assert [c["status"] for c in cases.values()] == ["PASS"] * 3, cases
    assert cases["dry_workload"]["max_abs_diff_vs_fa4"] == 0.0
    assert cases["dry_workload"]["allowed_pairs"] > 0
    path = sm._json_path(str(tmp_path))
    sm._write_json(path)
    assert json.loads(open(path).read())["cases"][0]["case"] == "dry_corr"


def test_default_output_is_the_local_folder_not_a_record(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert "/results/local/" in sm._json_path()


def test_case_batch_is_the_public_builder(monkeypatch):
    monkeypatch.setattr(sm, "DEVICE", "cpu")
    b = sm.make_case_batch([5, 3], [0, 4], [5, 0], 4, 2, 16, page_size=4)
    assert set(b) >= {"q", "k_cache", "v_cache", "block_table", "num_causal_q"}
    assert sm.host_lengths(b) == ([5, 3], [5, 7], [5, 0])
    c = sm.make_case_batch([5, 3], [0, 4], [5, 0], 4, 2, 16, page_size=4, contiguous=True)
    assert "cu_seqlens_k" in c and "block_table" not in c
