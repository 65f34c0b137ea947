"""bench/common.py: exact allowed-pair counts (against build_mask), FLOP/s arithmetic, result files."""
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from blockdiff.bench import common
from blockdiff.attention import build_mask


def _dense_pairs(q_lens, seq_lens, causal=None, num_causal_q=None, **kw):
    total = 0
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        flag = dict(causal=bool(causal[b])) if causal is not None else dict(num_causal_q=int(num_causal_q[b]))
        total += int(build_mask(q, s, **flag, **kw).sum())
    return total


@pytest.mark.parametrize("mode", ["symmetric", "prefix"])
@pytest.mark.parametrize("window_size", [None, 0, 1, 3, 15, 1000])
def test_allowed_pairs_equals_build_mask_mixed_batch(mode, window_size):
    q_lens, seq_lens, causal = [64, 16, 16, 16, 1, 0], [64, 144, 144, 144, 9, 5], [1, 0, 0, 1, 0, 1]
    kw = dict(window_size=window_size, bidirectional_window=mode)
    assert common.allowed_pairs(q_lens, seq_lens, causal=causal, **kw) == _dense_pairs(
        q_lens, seq_lens, causal=causal, **kw)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 24), st.integers(0, 40), st.integers(0, 24)), min_size=1, max_size=5),
       st.one_of(st.none(), st.integers(0, 30)), st.sampled_from(["symmetric", "prefix"]))
def test_allowed_pairs_fuzz_num_causal_q(seqs, window_size, mode):
    q_lens = [q for q, _, _ in seqs]
    seq_lens = [q + ctx for q, ctx, _ in seqs]
    ncq = [min(n, q) for q, _, n in seqs]
    kw = dict(window_size=window_size, bidirectional_window=mode)
    assert common.allowed_pairs(q_lens, seq_lens, num_causal_q=ncq, **kw) == _dense_pairs(
        q_lens, seq_lens, num_causal_q=ncq, **kw)


def test_row_key_bounds_rebuild_the_masks():
    q_lens, seq_lens, causal = [5, 3], [5, 11], [True, False]
    seq_id, lo, hi = common.row_key_bounds(q_lens, seq_lens, causal=causal, window_size=2)
    start = 0
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        k = torch.arange(s)
        m = (k[None] >= lo[start:start + q, None]) & (k[None] <= hi[start:start + q, None])
        assert torch.equal(m, build_mask(q, s, causal=causal[b], window_size=2))
        assert bool((seq_id[start:start + q] == b).all())
        start += q


def test_allowed_pairs_32k_context_without_dense_mask():
    # 256 bidirectional rows over 32768 + 256 keys, no window: every row sees every key
    assert common.allowed_pairs([256], [33024], causal=[False]) == 256 * 33024
    # causal prefill of 16384: triangle
    assert common.allowed_pairs([16384], [16384], causal=[True]) == 16384 * 16385 // 2


def test_allowed_pairs_rejects_bad_lengths():
    with pytest.raises(ValueError, match="seq_lens must be >= q_lens"):
        common.allowed_pairs([4], [3], causal=[True])
    with pytest.raises(ValueError, match="same length"):
        common.allowed_pairs([4, 1], [4], causal=[True])
    with pytest.raises(ValueError, match="window_size"):
        common.allowed_pairs([4], [4], causal=[True], window_size=-1)


def test_flops_and_tflops():
    assert common.attention_flops(16, 128, 10) == 4 * 16 * 128 * 10
    assert common.tflops(1e12, 1000.0) == pytest.approx(1.0)
    assert common.tflops(1e12, None) is None
    assert common.share_of_peak(79.0) == pytest.approx(0.1)


def test_write_records_json_and_csv(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKDIFF_COMMIT", "abc123")
    rows = [{"workload": "w", "backend": "sdpa", "eager_ms": 1.5, "config": {"BLOCK_M": 64}},
            {"workload": "w", "backend": "fa4", "status": "skipped", "eager_ms": float("nan")}]
    path = common.write_records("attention-test", rows, env=common.env_record("cpu"), out_dir=tmp_path)
    assert path.name == "attention-test-cpu.json"
    doc = json.loads(path.read_text())
    for key in ("gpu", "driver", "torch", "triton", "flash_attn_4", "commit", "date", "rows"):
        assert key in doc
    assert doc["commit"] == "abc123"
    assert doc["rows"][1]["eager_ms"] is None  # NaN is not JSON
    assert (tmp_path / "attention-test-cpu.csv").read_text().splitlines()[0].startswith("workload,backend")


def test_results_dir_honours_OUT(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert common.results_dir() == tmp_path / "o"
    assert (tmp_path / "o").is_dir()


def test_cpu_timing_and_summary():
    ms = common.time_eager_ms(lambda: sum(range(1000)), "cpu", cpu_reps=3)
    assert ms > 0
    assert common.warm_up_gpu("cpu") == 0.0
    table = common.summary_table([{"a": 1.23456, "b": None}], ["a", "b"])
    assert "1.235" in table and "-" in table
    assert common.gpu_slug("NVIDIA H200") == "h200"
