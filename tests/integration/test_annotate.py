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
