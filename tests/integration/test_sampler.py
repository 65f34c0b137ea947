"""DiffusionSampler (integration/sampler.py): argument checks of the per-step call."""
from __future__ import annotations

import pytest
import torch
from integration_helpers import CL, make_batch, needs_stack, params

from blockdiff.integration.batch import NewRequest
from blockdiff.integration.model_state import DiffusionModelState
from blockdiff.sampler import DENOISE

pytestmark = needs_stack


def test_canvas_row_with_fewer_than_canvas_length_tokens_raises(tiny_model):
    """A denoise/commit row (prompt already prefilled) scheduled with q_len != canvas_length raises ValueError
    naming the row. (Was silent: the row's missing canvas positions read the next row's logits.)"""
    ms = DiffusionModelState.for_harness(tiny_model, max_num_reqs=4, max_num_tokens=64, canvas_length=CL,
                                         device="cpu", default_params=params())
    ms.add_request(0, NewRequest("den", [5, 6, 7], params()))
    ms.add_request(1, NewRequest("pre", [5, 6, 7], params()))
    ms.state.phase[0] = DENOISE
    sampler, _ = ms.custom_sampler(None)
    V = ms.vocab_size
    phase_before = ms.state.phase.clone()
    b = make_batch([("den", 0, CL - 2, 3, 3, None), ("pre", 1, 3, 0, 3, [5, 6, 7])])
    with pytest.raises(ValueError, match=r"row 0 \('den'\).*canvas_length"):
        sampler(torch.randn(b.num_tokens, V), b)
    assert torch.equal(ms.state.phase, phase_before)  # nothing applied
    # the same rows with a whole canvas run
    b = make_batch([("den", 0, CL, 3, 3, None), ("pre", 1, 3, 0, 3, [5, 6, 7])])
    out = sampler(torch.randn(b.num_tokens, V), b)
    assert out.num_rejected.tolist() == [CL, 0]


def test_embedding_rows_padded_past_the_vocabulary_are_ignored(tiny_model):
    """Regression (first vLLM serve on the H200): vLLM pads the embedding table's rows to a multiple of 64 while
    the logits carry the real vocabulary; the sampler rejected the step ("embedding must have shape"). The soft
    embedding now takes the first vocab_size rows: the step equals the unpadded one."""
    outs = []
    for pad in (0, 61):
        ms = DiffusionModelState.for_harness(tiny_model, max_num_reqs=2, max_num_tokens=64, canvas_length=CL,
                                             device="cpu", default_params=params())
        ms.add_request(0, NewRequest("den", [5, 6, 7], params()))
        ms.state.phase[0] = DENOISE
        sampler, _ = ms.custom_sampler(None)
        E = sampler.embedding
        sampler.embedding = torch.cat([E, torch.full((pad, E.shape[1]), float("nan"), dtype=E.dtype)]) if pad else E
        b = make_batch([("den", 0, CL, 3, 3, None)])
        logits = torch.randn(b.num_tokens, ms.vocab_size, generator=torch.Generator().manual_seed(0))
        sampler(logits, b)
        outs.append((ms.state.canvas.clone(), ms.state.soft.clone() if hasattr(ms.state, "soft") else None))
    assert torch.equal(outs[0][0], outs[1][0])
