"""The Triton backends driven through the harness under ``check`` (every attention call and sampler step
compared with the references). On CPU they run through the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py), so the run is kept tiny."""
from __future__ import annotations

import os

import pytest
import torch
from integration_helpers import CL, needs_stack, params, prompt

import blockdiff.attention as A
import blockdiff.sampler as S

pytestmark = needs_stack


def _available(kind, backend):
    try:
        (A if kind == "attention" else S).get_backend(backend)
        return None
    except ImportError as e:
        return str(e)


def _interpreter_ok():
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _interpreter_ok(), reason="no GPU and TRITON_INTERPRET is not 1")
@pytest.mark.parametrize("attn_backend,sampler_backend", [("reference", "triton"), ("triton", "triton")])
def test_triton_backends_match_references_through_the_harness(make_runner, attn_backend, sampler_backend):
    for kind, b in (("attention", attn_backend), ("sampler", sampler_backend)):
        why = _available(kind, b)
        if why:
            pytest.skip(f"{kind} backend {b!r} not available: {why}")
    r = make_runner(attn_backend=attn_backend, sampler_backend=sampler_backend, check=True)
    r.add_request("a", prompt(11, 90), params(max_tokens=CL, max_denoising_steps=2))
    r.add_request("b", prompt(5, 91), params(max_tokens=CL, max_denoising_steps=2), arrival_step=1)
    res = r.run(max_steps=50)
    assert all(len(x.output_token_ids) == CL for x in res.values())
    assert r.attention_checker.num_checked == 4 * r.num_forward  # 4 layers per forward
    assert r.sampler.num_checked == r.num_forward
    # the same requests on the reference backends give the same tokens
    ref = make_runner()
    ref.add_request("a", prompt(11, 90), params(max_tokens=CL, max_denoising_steps=2))
    ref.add_request("b", prompt(5, 91), params(max_tokens=CL, max_denoising_steps=2), arrival_step=1)
    res_ref = ref.run(max_steps=50)
    for k in res:
        assert res[k].output_token_ids == res_ref[k].output_token_ids, k
