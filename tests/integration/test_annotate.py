"""integration/annotate.py: the plugin's hooks are named ranges in a torch-profiler trace, and cost nothing
recorded when no profiler runs."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

from blockdiff.integration.annotate import annotated, profiling
from blockdiff.integration.model_state import DiffusionModelState
from blockdiff.integration.sampler import DiffusionSampler


def test_annotated_hooks_are_named_ranges_only_while_a_profiler_records(tmp_path):
    calls = []

    @annotated("blockdiff:hook")
    def hook(x, *, y=1):
        calls.append(profiling())
        return x + y

    assert hook(torch.ones(2), y=2).tolist() == [3.0, 3.0] and calls == [False]
    p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    p.start()
    hook(torch.ones(2))
    p.stop()
    assert calls == [False, True]
    p.export_chrome_trace(str(tmp_path / "t.json"))
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["cat"] for e in ev if e.get("name") == "blockdiff:hook"] == ["user_annotation"]


def test_annotated_keeps_the_signature_vllm_checks():
    for cls, name in ((DiffusionModelState, "prepare_inputs"), (DiffusionModelState, "prepare_attn"),
                      (DiffusionModelState, "postprocess_state"), (DiffusionModelState, "add_request"),
                      (DiffusionModelState, "remove_request"), (DiffusionSampler, "__call__")):
        fn = getattr(cls, name)
        assert fn.__wrapped__ is not None and fn.__name__ == name
        assert list(inspect.signature(fn).parameters)[0] == "self"


@pytest.mark.parametrize("label", ["", None, 3])
def test_annotated_refuses_a_label_that_is_not_a_non_empty_str(label):
    with pytest.raises(TypeError, match="label must be a non-empty str"):
        annotated(label)


def test_triton_compiles_are_named_ranges_and_earlier_hooks_still_run(tmp_path, monkeypatch):
    """A first-use Triton compile opens ``triton_compile:<kernel>`` between Triton's pre- and post-compile hooks
    (docs/tuning.md 7.10: idle gaps that were compiles); hooks set before are chained, a skip is honoured, a
    second install changes nothing, and a range left open by a compile that raised is closed by the next one."""
    knobs = pytest.importorskip("triton").knobs
    from blockdiff.integration import annotate

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *, fn, **kw: seen.append(("pre", fn.name)) or None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda *, fn, **kw: seen.append(("post", fn.name)))
    assert annotate.install_triton_compile_ranges() is True
    pre = knobs.runtime.jit_cache_hook
    assert annotate.install_triton_compile_ranges() is True and knobs.runtime.jit_cache_hook is pre

    class Fn:
        def __init__(self, name):
            self.name = name

    p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    p.start()
    assert knobs.runtime.jit_cache_hook(fn=Fn("_stats_kernel"), key=None) is None  # compile goes ahead
    torch.ones(3).sum()  # inside the range
    knobs.runtime.jit_post_compile_hook(fn=Fn("_stats_kernel"), key=None)
    knobs.runtime.jit_cache_hook(fn=Fn("_raised_kernel"), key=None)  # its compile raises: no post hook
    knobs.runtime.jit_cache_hook(fn=Fn("_next_kernel"), key=None)
    knobs.runtime.jit_post_compile_hook(fn=Fn("_next_kernel"), key=None)
    p.stop()
    assert not annotate._open_compiles()
    assert seen == [("pre", "_stats_kernel"), ("post", "_stats_kernel"), ("pre", "_raised_kernel"),
                    ("pre", "_next_kernel"), ("post", "_next_kernel")]
    p.export_chrome_trace(str(tmp_path / "t.json"))
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = sorted(e["name"] for e in ev if str(e.get("name", "")).startswith("triton_compile:"))
    assert names == ["triton_compile:_next_kernel", "triton_compile:_raised_kernel", "triton_compile:_stats_kernel"]
    assert knobs.runtime.jit_cache_hook(fn=Fn("k"), key=None) is None and annotate._open_compiles() == [None]
    knobs.runtime.jit_post_compile_hook(fn=Fn("k"), key=None)  # no profiler: nothing opened, nothing recorded
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *, fn, **kw: True)  # an earlier hook skips
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert annotate.install_triton_compile_ranges() and knobs.runtime.jit_cache_hook(fn=Fn("k"), key=None) is True
    assert annotate._open_compiles() == []
