"""integration/evaluate.py: evaluation by generation through the harness (what ``blockdiff train`` records as
``"eval"``), and training with it as ``blockdiff.model.train.train``'s ``evaluate`` callback."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from blockdiff.integration.evaluate import evaluate_generation, held_out_prompts
from blockdiff.model import DiffusionGemma
from blockdiff.model.tokenizer import ByteTokenizer
from blockdiff.model.train import TrainArgs, smoke_config, train

TOK = ByteTokenizer()
TEXT = "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n"


def _stream(text: str = TEXT, copies: int = 20) -> np.ndarray:
    return np.asarray(TOK.encode(text * copies, add_bos=True, add_eos=True), dtype=np.int16)


def test_held_out_prompts_start_at_line_starts_and_hold_no_special_id():
    held = _stream()
    prompts = held_out_prompts(TOK, held, 5, 12, seed=3)
    assert len(prompts) == 5 and all(len(p) == 12 for p in prompts)
    text = TOK.decode(held.tolist())
    for p in prompts:
        assert min(p) >= TOK.byte_offset  # no bos / eos / pad
        assert "\n" + TOK.decode(p) in text  # starts at a line start
    assert held_out_prompts(TOK, held, 5, 12, seed=3) == prompts  # deterministic for a seed
    assert held_out_prompts(TOK, _stream("no newline here ", 4), 2, 8) == []


def test_evaluate_generation_reports_the_harness_accounting():
    torch.manual_seed(0)
    model = DiffusionGemma(smoke_config(), seed=4, moe_impl="loop").eval()
    ev = evaluate_generation(model, TOK, _stream(), num_prompts=2, prompt_len=12, canvases=1,
                             max_denoising_steps=3, seed=0)
    assert ev["num_prompts"] == 2 and ev["canvas_length"] == model.config.canvas_length
    assert ev["forward_passes"] > 0 and ev["tokens_emitted"] > 0
    assert 1 <= ev["denoise_steps_per_canvas"] <= 3
    assert ev["tokens_per_forward"] == ev["tokens_emitted"] / ev["forward_passes"]
    assert ev["tokens_per_denoise_step"] == ev["tokens_emitted"] / ev["denoise_passes"]
    assert len(ev["samples"]) == 2 and all(isinstance(s["completion"], str) for s in ev["samples"])
    with pytest.raises(ValueError, match="no held-out prompt"):
        evaluate_generation(model, TOK, _stream("x", 3), num_prompts=1, prompt_len=12)


def test_train_records_the_evaluation_of_the_saved_checkpoint(tmp_path):
    """train(..., evaluate=evaluate_generation) evaluates the checkpoint it saved and records it as "eval"."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    args = TrainArgs(out=str(tmp_path / "out"), max_steps=3, batch_size=4, prefix=16, prefix_min=8, warmup_steps=1,
                     log_every=1, device="cpu", smoke=True, corpus=str(corpus), eval_prompts=1, eval_prompt_len=12,
                     eval_canvases=1, eval_steps=2)
    res = train(args, stream=io.StringIO(), evaluate=evaluate_generation)
    ev = res["eval"]
    assert ev["num_prompts"] == 1 and ev["max_denoising_steps"] == 2 and ev["tokens_emitted"] > 0
    assert 1 <= ev["denoise_steps_per_canvas"] <= 2


@pytest.mark.gpu
def test_default_config_trains_and_evaluates_on_cuda(tmp_path):
    """Pre-flight of the H200 run: 60 steps of the shipped config on the stdlib (bf16 autocast), loss falls,
    the bf16 checkpoint stays under 10 MB and the harness evaluation runs on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = TrainArgs(out=str(tmp_path), max_steps=60, warmup_steps=10, log_every=10, device="cuda", batch_size=256,
                     eval_prompts=4, eval_steps=8)
    res = train(args, stream=io.StringIO(), evaluate=evaluate_generation)
    losses = [r["loss"] for r in res["log"] if "loss" in r]
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5, losses
    assert res["checkpoint_bytes"] <= 10_000_000
    assert res["eval"]["tokens_emitted"] > 0


def test_evaluate_generation_counts_failed_requests_of_a_diverged_checkpoint():
    """A checkpoint whose logits are NaN: every request finishes "error" with an empty completion. The evaluation
    said nothing of it (its rates were computed from the empty outputs as if sound); it now counts them."""
    torch.manual_seed(0)
    model = DiffusionGemma(smoke_config(), seed=4, moe_impl="loop").eval()
    with torch.no_grad():
        model.embed_tokens.weight.fill_(float("nan"))
    ev = evaluate_generation(model, TOK, _stream(), num_prompts=2, prompt_len=12, canvases=1,
                             max_denoising_steps=3, seed=0)
    assert ev["requests_failed"] == 2
    assert [s["finish_reason"] for s in ev["samples"]] == ["error", "error"]
    sound = evaluate_generation(DiffusionGemma(smoke_config(), seed=4, moe_impl="loop").eval(), TOK, _stream(),
                                num_prompts=2, prompt_len=12, canvases=1, max_denoising_steps=3, seed=0)
    assert sound["requests_failed"] == 0 and {s["finish_reason"] for s in sound["samples"]} <= {"eos", "length"}


@pytest.mark.parametrize("kw, err, match", [
    (dict(num_prompts=0), ValueError, "num_prompts must be an int >= 1, got 0"),
    (dict(num_prompts=1.5), TypeError, r"num_prompts must be an int >= 1, got float \(1.5\)"),
    (dict(prompt_len=0), ValueError, "prompt_len must be an int >= 1, got 0"),
    (dict(prompt_len=True), TypeError, r"prompt_len must be an int >= 1, got bool \(True\)"),
    (dict(canvases=0), ValueError, "canvases must be an int >= 1, got 0"),
    (dict(held_out=list(_stream())), TypeError, "held_out must be a 1-D integer token stream .* got list"),
    (dict(held_out=_stream().astype(np.float64)), TypeError, "held_out must be .* got 1-D float64"),
    (dict(held_out=_stream()[:400].reshape(2, -1)), TypeError, "held_out must be .* got 2-D int16"),
    (dict(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*63\), got -1"),
    (dict(seed=1 << 63), ValueError, r"seed must be an int in \[0, 2\*\*63\), got 9223372036854775808"),
    (dict(seed=None), TypeError, r"seed must be an int in \[0, 2\*\*63\), got NoneType"),
    (dict(seed=True), TypeError, r"seed must be an int in \[0, 2\*\*63\), got bool")])
def test_evaluate_generation_arguments_breaking_their_rule_are_named(kw, err, match):
    """Was: num_prompts / prompt_len 0, a 2-D stream: "no held-out prompt found (held-out stream too short)";
    canvases 0: "max_tokens must be in [1, 2**62]"; num_prompts 1.5, prompt_len True, a float stream: evaluated; a
    list: numpy's "Calling nonzero on 0d arrays"; seed -1: numpy's "expected non-negative integer", 2**63: prompts
    drawn, then SamplingParams' error, None: prompts drawn from fresh entropy, then SamplingParams' error."""
    model = DiffusionGemma(smoke_config(), seed=4, moe_impl="loop").eval()
    args = dict(held_out=_stream(), num_prompts=1, prompt_len=12, canvases=1, max_denoising_steps=1)
    args.update(kw)
    with pytest.raises(err, match=match):
        evaluate_generation(model, TOK, args.pop("held_out"), **args)


def test_held_out_prompts_take_a_tensor_stream_as_its_array():
    held = _stream()
    assert held_out_prompts(TOK, torch.from_numpy(held), 3, 12, seed=1) == held_out_prompts(TOK, held, 3, 12, seed=1)
    assert held_out_prompts(TOK, held, 0, 12) == []


@pytest.mark.parametrize("seed, err", [(-1, ValueError), (None, TypeError), (True, TypeError), (1.0, TypeError)])
def test_held_out_prompts_seed_breaking_its_rule_is_named(seed, err):
    """Was: -1 numpy's "expected non-negative integer" (not naming seed), None a different draw on every call,
    True taken as 1."""
    with pytest.raises(err, match="seed must be an int in"):
        held_out_prompts(TOK, _stream(), 2, 12, seed=seed)


@pytest.mark.parametrize("name, value", [("num_prompts", np.int64(1)), ("prompt_len", np.int64(12)),
                                         ("canvases", np.int64(1)), ("seed", np.int64(3))])
def test_evaluate_generation_takes_numpy_int_counts_as_ints(name, value):
    """Was: canvases=np.int64(1) passed evaluate's check, then failed as "max_tokens must be an int or None" (an
    argument the caller never passed); prompt_len=np.int64(12) reached the returned dict as a numpy int, which
    train_log.json's json.dump cannot write."""
    import json

    model = DiffusionGemma(smoke_config(), seed=4, moe_impl="loop").eval()
    args = dict(num_prompts=1, prompt_len=12, canvases=1, max_denoising_steps=1, seed=0)
    args[name] = value
    ev = evaluate_generation(model, TOK, _stream(), **args)
    assert ev["num_prompts"] == 1 and type(ev["prompt_len"]) is int
    json.dumps({k: v for k, v in ev.items()})


@pytest.mark.parametrize("kw", [dict(canvases=1000), dict(prompt_len=100_000)])
def test_evaluate_generation_past_the_model_s_positions_names_prompt_len_and_canvases(kw):
    """Was: the harness's "max_model_len (N) must be <= the model's max_position_embeddings", an argument
    evaluate_generation does not take (after the prompts were drawn); now a ValueError naming prompt_len and
    canvases and the positions they need, before any prompt is drawn."""
    model = DiffusionGemma(smoke_config(), seed=4, moe_impl="loop").eval()
    args = dict(num_prompts=1, prompt_len=12, canvases=1, max_denoising_steps=1)
    args.update(kw)
    with pytest.raises(ValueError, match=r"prompt_len \(\d+\) \+ canvases \(\d+\) .*max_position_embeddings"):
        evaluate_generation(model, TOK, _stream(), **args)
