"""model/train.py: the dense training path equals the served forward, the smoke run learns, the checkpoint
round-trips through the project's loader, and the byte tokenizer round-trips text. The evaluation by generation
and the ``blockdiff train`` command are integration's (tests/integration/test_evaluate.py, test_cli.py)."""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from blockdiff.model import DiffusionGemma, tiny_config
from blockdiff.model.tokenizer import ByteTokenizer
from blockdiff.model.train import (TrainArgs, add_uniform_noise, default_train_config, dense_forward, hf_state_dict,
                                   is_held_out, load_corpus, save_checkpoint, smoke_args, smoke_config, stdlib_files,
                                   train)
from model_testutils import build_meta, randomize_

PS = 4


@pytest.mark.parametrize("bidirectional_window", ["prefix", "symmetric"])
@torch.no_grad()
def test_dense_training_forward_equals_served_prefill_then_denoise(bidirectional_window):
    """dense_forward (one masked SDPA pass over prefix + canvas) == the served forward: a causal prefill of the
    prefix (writes the paged KV cache) then a bidirectional decoder pass over the canvas with self-conditioning,
    reference attention backend; prefix longer than the sliding window so the window rule matters."""
    cfg = tiny_config(vocab_size=259, canvas_length=8, bidirectional_window=bidirectional_window)
    model = randomize_(DiffusionGemma(cfg, moe_impl="loop"), seed=3).double().eval()
    P, CL, B = 13, cfg.canvas_length, 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, P + CL), generator=g)
    soft = torch.randn(B, CL, cfg.hidden_size, generator=g, dtype=torch.float64)
    dense = dense_forward(model, ids, P, soft)
    for b in range(B):
        caches = model.allocate_kv_caches(16, PS)
        meta, pos = build_meta([P], [P], [True], PS)
        model(ids[b, :P], pos, meta, caches, attn_backend="reference")
        meta, pos = build_meta([CL], [P + CL], [False], PS)
        served = model(ids[b, P:], pos, meta, caches, soft[b], attn_backend="reference")
        torch.testing.assert_close(dense[b], served, rtol=1e-9, atol=1e-9)
    # zero self-conditioning == None
    torch.testing.assert_close(dense_forward(model, ids, P, torch.zeros_like(soft)), dense_forward(model, ids, P))


def test_dense_forward_rejects_bad_shapes():
    model = DiffusionGemma(smoke_config(), moe_impl="loop")
    ids = torch.zeros(2, 12, dtype=torch.int64)
    with pytest.raises(ValueError, match="prefix_len"):
        dense_forward(model, ids, 12)
    with pytest.raises(ValueError, match="self_cond"):
        dense_forward(model, ids, 4, torch.zeros(2, 3, model.config.hidden_size))
    with pytest.raises(ValueError, match="ids"):
        dense_forward(model, ids.int(), 4)


def test_dense_forward_refuses_positions_past_max_position_embeddings():
    """dense_forward ran RoPE at positions [0, P + CL) with no bound: a training window past the config's
    max_position_embeddings trained positions the saved checkpoint never serves (DiffusionGemma.forward refuses them),
    silently."""
    model = DiffusionGemma(smoke_config(max_position_embeddings=16), moe_impl="loop")
    assert dense_forward(model, torch.zeros(1, 16, dtype=torch.int64), 8).shape == (1, 8, 259)
    with pytest.raises(ValueError, match=r"ids: P \+ CL = 17 positions exceed the config's max_position_embeddings "
                                         r"\(16\)"):
        dense_forward(model, torch.zeros(1, 17, dtype=torch.int64), 9)


@pytest.mark.parametrize("kw, match", [
    (dict(prefix=5000, eval_prompts=0), r"prefix \(5000\) \+ canvas_length \(8\) = 5008 training positions exceed "
                                        r"the config's max_position_embeddings \(4096\)"),
    (dict(eval_prompts=1, eval_prompt_len=5000), r"eval_prompt_len \(5000\) \+ \(eval_canvases \(2\) \+ 1\) x "
                                                 r"canvas_length \(8\) = 5024 evaluation positions exceed")])
def test_train_refuses_positions_past_max_position_embeddings_before_training(tmp_path, kw, match):
    """Was: a prefix past the config's positions trained silently (dense_forward had no bound), and an evaluation
    prompt too long for them trained the whole run, then failed in the evaluation's HarnessRunner (max_model_len
    > max_position_embeddings) before train_log.json was written: the run's record lost."""
    from blockdiff.integration.evaluate import evaluate_generation

    args = TrainArgs(out=str(tmp_path / "out"), max_steps=1, batch_size=2, smoke=True, **kw)
    with pytest.raises(ValueError, match=match):
        train(args, stream=io.StringIO(), evaluate=evaluate_generation)
    assert not (tmp_path / "out").exists()  # nothing ran


def test_uniform_noise_rate():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, 259, (4, 4096), generator=g)
    noisy, _ = add_uniform_noise(clean, 259, g, torch.tensor([0.0, 0.25, 0.5, 1.0]))
    changed = (noisy != clean).float().mean(1)
    assert changed[0] == 0
    # a replaced token equals the clean one with probability 1/V
    for i, t in enumerate([0.25, 0.5, 1.0]):
        assert abs(changed[i + 1].item() - t * (1 - 1 / 259)) < 0.03
    assert noisy.min() >= 0 and noisy.max() < 259


def test_corpus_split_is_deterministic_by_file(tmp_path):
    for name, body in (("a.py", "x = 1\n"), ("b.py", "y = 2\n"), ("pkg/c.py", "z = 3\n")):
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        (tmp_path / name).write_text(body)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "d.py").write_text("no = 1\n")
    files = stdlib_files(str(tmp_path))
    assert files == ["a.py", "b.py", os.path.join("pkg", "c.py")]
    tr, ho = load_corpus(str(tmp_path))
    assert len(tr) + len(ho) == sum(len(open(tmp_path / f, "rb").read()) + 2 for f in files)
    assert [is_held_out(f) for f in files] == [is_held_out(f) for f in files]
    assert sum(is_held_out(f"f{i}.py") for i in range(2000)) in range(60, 140)  # ~5 %


def test_tokenizer_round_trips_text(tmp_path):
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # é, ∑, 🐍\n"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.vocab_size == 259
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("ab") + [tok.eos_token_id] + tok.encode("cd"), stop_at_eos=True) == "ab"
    assert list(tok.encode_bytes(text.encode())) == tok.encode(text)
    tok.save(tmp_path)
    assert ByteTokenizer.load(tmp_path).encode(text) == ids[1:-1]
    with pytest.raises(ValueError, match="outside"):
        tok.decode([259])


@pytest.mark.parametrize("ids", [[3.9], [3 + ord("H"), 75.5], [True, 75], torch.tensor([75.7]), np.array([75.0]),
                                 "KL", b"KL", 75, [None], np.array([[75]])])
def test_tokenizer_decode_refuses_ids_that_are_not_ints_instead_of_truncating_them(ids):
    """decode([3.9]) was '\\x00' (int() truncated it to byte 0), [True] read as id 1, a float tensor truncated; a str
    was int()'s 'invalid literal' ValueError. Now a TypeError naming ids."""
    with pytest.raises(TypeError, match="ids must"):
        ByteTokenizer().decode(ids)


def test_tokenizer_decode_takes_int_sequences_tensors_and_arrays():
    tok, want = ByteTokenizer(), [3 + ord("H"), 3 + ord("I")]
    for ids in (want, tuple(want), iter(want), [np.int64(want[0]), want[1]], torch.tensor(want),
                np.array(want, dtype=np.int16)):
        assert tok.decode(ids) == "HI"
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_tokenizer_encode_of_a_lone_surrogate_is_a_value_error_naming_text_and_flags_must_be_bools():
    """Was the codec's bare UnicodeEncodeError ("'utf-8' codec can't encode character '\\udc80' in position 1"), naming
    no argument; add_bos="no" / stop_at_eos="yes" were read by truthiness (a bos added, the text cut at eos)."""
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match=r"text must be valid Unicode text .*lone surrogate U\+DC80 at position 1"):
        tok.encode(json.loads('"a\\udc80b"'))
    for kw in (dict(add_bos="no"), dict(add_eos=1)):
        with pytest.raises(TypeError, match=f"{next(iter(kw))} must be a bool"):
            tok.encode("x", **kw)
    with pytest.raises(TypeError, match="stop_at_eos must be a bool"):
        tok.decode([3, 1, 3], stop_at_eos="yes")
    for text in ("", "\x00", "e\u0301", "\U0010ffff", "\ufeff\u200d"):  # empty, NUL, combining, the last code point
        assert tok.decode(tok.encode(text, add_bos=True, add_eos=np.bool_(True))) == text


def test_checkpoint_round_trips_through_the_loader(tmp_path):
    model = randomize_(DiffusionGemma(smoke_config(), moe_impl="loop"), seed=2)
    with torch.no_grad():
        model.layers[0].encoder_layer_scalar.fill_(0.75)  # untied buffer: must survive under its HF name
    save_checkpoint(model, str(tmp_path), ByteTokenizer(), dtype=torch.float32)
    loaded = DiffusionGemma.load_safetensors(str(tmp_path))
    assert loaded.config == model.config
    sd, ld = model.state_dict(), loaded.state_dict()
    assert sd.keys() == ld.keys()
    for k in sd:
        assert torch.equal(sd[k], ld[k]), k
    bf = hf_state_dict(model)  # default bf16 for shipping
    assert all(t.dtype == torch.bfloat16 for t in bf.values())
    assert "model.encoder.language_model.layers.0.layer_scalar" in bf


def test_saved_checkpoint_weights_get_the_umask_mode_not_0600(tmp_path):
    """Regression: safetensors writes its file 0600 whatever the umask, so a checkpoint ``blockdiff train`` wrote
    held a ``model.safetensors`` that only its owner could read (config.json, tokenizer.json: the umask's 0644),
    where ``blockdiff export`` already gave its weights the JSON files' mode."""
    old = os.umask(0o022)
    try:
        save_checkpoint(DiffusionGemma(smoke_config(), moe_impl="loop"), str(tmp_path / "ck"), ByteTokenizer())
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ck").iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644, "tokenizer.json": 0o644}, modes


def test_default_config_fits_the_size_budget():
    cfg = default_train_config()
    model = DiffusionGemma(cfg, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert 2e6 < n and 2 * n < 9.5e6, n  # <= 10 MB of bf16 safetensors with header room
    assert cfg.vocab_size == ByteTokenizer.vocab_size


def test_smoke_training_decreases_loss(tmp_path):
    """20 CPU steps on a tiny repeated corpus (fixed seed): the loss goes down, the outputs are written and the
    checkpoint loads; no evaluation by generation without an ``evaluate`` callback (eval_prompts = 0)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    args = TrainArgs(out=str(tmp_path / "out"), max_steps=20, batch_size=8, prefix=16, prefix_min=8, lr=3e-3,
                     warmup_steps=2, log_every=1, seed=0, device="cpu", smoke=True, corpus=str(corpus),
                     eval_prompts=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    try:
        res = train(args, stream=io.StringIO())
    finally:
        torch.set_num_threads(threads)  # not left to the tests after this one
    losses = [r["loss"] for r in res["log"] if "loss" in r]
    assert len(losses) == 20 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    out = tmp_path / "out"
    for f in ("model.safetensors", "config.json", "tokenizer.json", "loss.png", "train_log.json"):
        assert (out / f).exists(), f
    loaded = DiffusionGemma.load_safetensors(str(out))
    assert loaded.config.vocab_size == 259
    assert "eval" not in res
    assert json.load(open(out / "train_log.json"))["steps"] == 20


def test_train_refuses_eval_prompts_without_evaluate_before_training(tmp_path):
    args = TrainArgs(out=str(tmp_path / "out"), max_steps=1, device="cpu", eval_prompts=2)
    with pytest.raises(ValueError, match="eval_prompts = 2 needs evaluate="):
        train(args, stream=io.StringIO())
    assert not (tmp_path / "out").exists()  # nothing ran


@pytest.mark.parametrize("device, match", [("cuda:7", "device 'cuda:7'"), ("bogus", "device 'bogus' is not a torch device")])
def test_train_refuses_a_device_that_is_not_here_before_training(tmp_path, monkeypatch, device, match):
    """Was: TrainArgs(device='cuda') on a machine without CUDA loaded the corpus, then died in its first .to(dev)
    with torch's AssertionError ('bogus': RuntimeError); train() now refuses it with the other checks, before any
    work."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = dataclasses.replace(TrainArgs(out=str(tmp_path / "out"), max_steps=1, eval_prompts=0), device=device)
    with pytest.raises(ValueError, match=match):
        train(args, stream=io.StringIO())
    assert not (tmp_path / "out").exists()  # nothing ran


def test_smoke_args_cut_the_run_down_for_the_cpu(tmp_path):
    a = smoke_args(TrainArgs(out=str(tmp_path), device="cuda"))
    assert (a.smoke, a.device, a.max_steps, a.batch_size, a.prefix, a.prefix_min) == (True, "cpu", 20, 8, 16, 8)
    assert (a.eval_prompts, a.eval_prompt_len, a.eval_canvases, a.eval_steps) == (2, 12, 1, 4)
    assert a.corpus.endswith("json") and os.path.isdir(a.corpus)
    kept = smoke_args(TrainArgs(out=str(tmp_path), max_steps=3, eval_prompts=1, corpus="x.txt"))
    assert (kept.max_steps, kept.eval_prompts, kept.corpus) == (3, 1, "x.txt")


def test_running_the_library_module_points_to_the_command():
    """``python3 -m blockdiff.model.train`` (the command before the move) says where the command lives."""
    r = subprocess.run([sys.executable, "-m", "blockdiff.model.train", "--smoke"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and "blockdiff train" in r.stderr


@pytest.mark.parametrize("field, value, exc", [
    ("batch_size", 0, ValueError), ("lr", float("nan"), ValueError), ("lr", -1.0, ValueError),
    ("minutes", -1.0, ValueError), ("max_steps", 0, ValueError), ("log_every", 0, ValueError),
    ("self_cond_prob", 1.5, ValueError), ("eval_prompts", -1, ValueError), ("eval_steps", 0, ValueError),
    ("warmup_steps", -1, ValueError), ("seed", -1, ValueError), ("prefix_min", -1, ValueError),
    ("batch_size", 8.0, TypeError), ("smoke", 1, TypeError), ("attn_backend", "flash", ValueError)])
def test_train_args_refuse_a_field_breaking_its_rule(tmp_path, field, value, exc):
    """Were trained with silently (batch 0, lr NaN, --max-steps 0 read as 20 by smoke_args) or failed deep inside
    (log_every 0: ZeroDivisionError; prefix < prefix_min: torch.randint's RuntimeError)."""
    with pytest.raises(exc, match=f"^{field} must be"):
        TrainArgs(out=str(tmp_path), **{field: value})
    with pytest.raises(ValueError, match="prefix must be >= prefix_min"):
        TrainArgs(out=str(tmp_path), prefix=10, prefix_min=20)


def test_train_refuses_a_missing_empty_or_tiny_corpus_and_an_out_file(tmp_path):
    from blockdiff.model.train import CorpusError, train
    empty = tmp_path / "empty"
    empty.mkdir()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x = 1\n")
    for corpus, match in ((tmp_path / "none", "corpus must be"), (empty, "no .py text"), (tiny, "fewer than one")):
        with pytest.raises(CorpusError, match=match):
            train(smoke_args(TrainArgs(out=str(tmp_path / "o"), corpus=str(corpus), eval_prompts=0)))
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="out must be a folder"):
        train(smoke_args(TrainArgs(out=str(afile), eval_prompts=0)))


def test_train_log_writes_non_finite_numbers_as_null_not_nan_tokens():
    """train_log.json is standard JSON: a diverged loss or an undefined rate (NaN / inf) is written as null (json.dump
    wrote the NaN / Infinity tokens that strict parsers refuse); the nested structure is kept."""
    from blockdiff.model.train import json_finite

    doc = {"log": [{"loss": float("nan")}, {"loss": 1.5}], "eval": {"rate": float("inf"), "n": 3, "t": (1.0, -float("inf"))}}
    out = json.dumps(json_finite(doc), allow_nan=False)
    assert json.loads(out) == {"log": [{"loss": None}, {"loss": 1.5}], "eval": {"rate": None, "n": 3, "t": [1.0, None]}}
    assert math.isnan(doc["log"][0]["loss"])  # the caller's dict is untouched


def test_train_writes_a_diverged_held_out_loss_as_null_in_train_log_json(tmp_path, monkeypatch):
    """train() itself writes standard JSON (the test above checks only the helper): a NaN held-out loss, as a
    diverged run gives, is ``null`` in train_log.json (was: the ``NaN`` token), and the returned dict keeps the NaN.
    (review25: reverting train's json.dump line left the helper's test passing.)"""
    import blockdiff.model.train as T

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    monkeypatch.setattr(T, "held_out_loss", lambda *a, **k: float("nan"))
    args = TrainArgs(out=str(tmp_path / "out"), max_steps=1, batch_size=2, prefix=8, prefix_min=8, warmup_steps=1,
                     log_every=1, seed=0, device="cpu", smoke=True, corpus=str(corpus), eval_prompts=0)
    res = train(args, stream=io.StringIO())
    assert math.isnan(res["final_held_out_loss"])
    text = (tmp_path / "out" / "train_log.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON token {c} in train_log.json"))
    assert doc["final_held_out_loss"] is None and doc["log"][-1]["held_out_loss"] is None


def test_train_writes_train_log_json_when_out_and_corpus_are_pathlike(tmp_path):
    """TrainArgs takes ``out`` / ``corpus`` as os.PathLike (train_args_problems: "a non-empty path"); train() put
    ``vars(args)`` in train_log.json as is, so json.dump raised ``TypeError: Object of type PosixPath is not JSON
    serializable`` after the whole run and left a truncated train_log.json. The file now holds the paths as str."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    out = tmp_path / "out"
    args = TrainArgs(out=out, max_steps=1, batch_size=2, prefix=8, prefix_min=8, warmup_steps=1, log_every=1,
                     seed=0, device="cpu", smoke=True, corpus=corpus, eval_prompts=0)
    res = train(args, stream=io.StringIO())
    doc = json.loads((out / "train_log.json").read_text())
    assert doc["args"]["out"] == str(out) and doc["args"]["corpus"] == str(corpus)
    assert res["args"]["out"] == str(out) and doc["steps"] == 1


@pytest.mark.parametrize("prefix_len", [4.5, 4.0, True, "4"])
def test_dense_forward_and_diffusion_loss_refuse_a_prefix_len_that_is_not_an_int(prefix_len):
    """prefix_len went through int(): 4.5 trained with P = 4 and True with P = 1, silently (another prefix / canvas
    split than asked for); now a TypeError naming prefix_len. numpy ints stay accepted."""
    from blockdiff.model.train import diffusion_loss

    model = DiffusionGemma(smoke_config(), moe_impl="loop")
    ids = torch.zeros(1, 12, dtype=torch.int64)
    with pytest.raises(TypeError, match="prefix_len must be an int"):
        dense_forward(model, ids, prefix_len)
    with pytest.raises(TypeError, match="prefix_len must be an int"):
        diffusion_loss(model, ids, prefix_len, torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(dense_forward(model, ids, np.int64(4)), dense_forward(model, ids, 4))


@pytest.mark.parametrize("t", [torch.full((3, 1), 0.5), torch.tensor([0.5]), torch.full((2,), 0.5), torch.tensor(0.5),
                               [0.5, 0.5, 0.5]])
def test_add_uniform_noise_refuses_a_t_that_is_not_one_rate_per_row(t):
    """t [B, 1] broadcast the [B, CL] canvas to a [B, B, CL] result, silently; t [1] noised every row at row 0's
    rate and returned a one-entry t; [2] / 0-d / a list failed inside torch. Now a ValueError naming t and B."""
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 259, (3, 4), generator=g)
    with pytest.raises(ValueError, match=r"t must be a \[B=3\] tensor"):
        add_uniform_noise(clean, 259, g, t)
    noisy, tt = add_uniform_noise(clean, 259, g, torch.full((3,), 0.5))
    assert noisy.shape == (3, 4) and tt.shape == (3,)
