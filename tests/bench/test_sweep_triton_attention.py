"""bench/sweep_triton_attention.py on the CPU: what it does without a GPU."""
import pytest
import torch

from blockdiff.bench import sweep_triton_attention as sw


def test_full_shape_sweep_without_a_gpu_stops_with_a_message_naming_quick(tmp_path, monkeypatch):
    """Regression: without CUDA and without ``--quick`` the sweep built the named workloads' full shapes (16k
    prefills, 32k contexts) and ran the triton candidates through the interpreter until its 330 s budget ran out,
    measuring nothing a record could use. It now stops at once naming ``--quick``, as bench_attention does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        sw.main(["--workloads", "canvas_bs4_ctx4k_hd128", "--budget-s", "1"])
    msg = str(e.value.code)
    assert "no CUDA GPU" in msg and "--quick" in msg, msg
    assert not any(tmp_path.iterdir())
