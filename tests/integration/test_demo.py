"""``blockdiff demo`` with a trained-checkpoint folder (--checkpoint, the shipped default, the random-weight
fallback and its printed notice), the printed generation metrics, and checkpoint errors naming the argument.

The checkpoint here is a tiny untrained one written by ``model/train.py``'s ``save_checkpoint`` (the same files as
a trained run, smoke config): these tests check the plumbing, not the quality of the text.
"""
from __future__ import annotations

import io
import json
import os
import re

import pytest
import torch
from integration_helpers import needs_stack

import blockdiff.model.pretrained as pretrained
from blockdiff.integration import cli
from blockdiff.integration.demo import TEXT_REQUESTS, DemoInputError, run_demo
from blockdiff.integration.harness import HarnessRunner
from blockdiff.model import DiffusionGemma
from blockdiff.model.pretrained import load_pretrained
from blockdiff.model.tokenizer import ByteTokenizer
from blockdiff.model.train import save_checkpoint, smoke_config

pytestmark = needs_stack

METRIC_LINES = ("tokens committed per forward pass: ", "denoising steps per canvas: mean ", "generated text")


@pytest.fixture(scope="session")
def smoke_checkpoint(tmp_path_factory):
    """A checkpoint folder as ``blockdiff train --smoke`` writes it (smoke config, bf16,
    byte tokenizer), without the training steps."""
    folder = tmp_path_factory.mktemp("ckpt") / "smoke-byte"
    save_checkpoint(DiffusionGemma(smoke_config(), seed=5, moe_impl="loop"), str(folder), ByteTokenizer())
    return str(folder)


def _record_params(monkeypatch) -> list:
    """The SamplingParams of every HarnessRunner.add_request from now on (appended to the returned list)."""
    added = []
    real_add = HarnessRunner.add_request

    def add_request(self, req_id, prompt, params=None, **kw):
        added.append(params)
        return real_add(self, req_id, prompt, params, **kw)
    monkeypatch.setattr(HarnessRunner, "add_request", add_request)
    return added


def _run(args, capsys):
    rc = cli.main(["demo", "--no-progress", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_demo_serves_a_checkpoint_folder_and_prints_the_metrics_and_text(smoke_checkpoint, tmp_path, capsys):
    rc, out, err = _run(["--checkpoint", smoke_checkpoint, "--out", str(tmp_path), "--max-denoising-steps", "3"],
                        capsys)
    assert rc == 0, err
    assert f"trained DiffusionGemma from {smoke_checkpoint}" in out and "eos id 1" in out
    assert "canvas 8, step cap 3" in out  # the checkpoint's trained canvas length
    assert "random" not in out.lower()
    for line in METRIC_LINES:
        assert line in out, line
    tpf = re.search(r"tokens committed per forward pass: ([\d.]+) \((\d+) tokens in (\d+) forward passes", out)
    assert tpf and float(tpf[1]) == pytest.approx(int(tpf[2]) / int(tpf[3]), abs=1e-3) and int(tpf[2]) > 0
    steps = re.search(r"denoising steps per canvas: mean ([\d.]+), max (\d+) over (\d+) committed canvases "
                      r"\(step cap 3\)", out)
    assert steps and 1 <= float(steps[1]) <= int(steps[2]) <= 3 and int(steps[3]) >= len(TEXT_REQUESTS)
    for rid, text, *_ in TEXT_REQUESTS:  # decoded prompt + completion of every request
        assert f"  {rid}: {text!r} | " in out
    assert (tmp_path / "attention_pattern.png").exists()


def test_checkpoint_weights_are_served_as_trained_with_the_tokenizer_eos(smoke_checkpoint, tmp_path, monkeypatch):
    """No random-weight embedding scaling on a checkpoint; eos from the tokenizer; text prompts encoded by it."""
    added = _record_params(monkeypatch)
    res = run_demo(checkpoint=smoke_checkpoint, out=str(tmp_path), max_denoising_steps=2, progress=False,
                   stream=io.StringIO())
    assert len(added) == len(TEXT_REQUESTS) and all(p.eos_token_ids == (1,) for p in added)
    assert [p.max_tokens for p in added] == [n * 8 for *_, n, _ in TEXT_REQUESTS]  # canvases x canvas 8
    ref, tok = load_pretrained(smoke_checkpoint, dtype=torch.float32)
    assert torch.equal(res.runner.model.embed_tokens.weight, ref.embed_tokens.weight)
    assert [r.prompt_len for _, r in sorted(res.results.items())] == [len(tok.encode(t)) for _, t, *_ in
                                                                       TEXT_REQUESTS]
    for s in res.samples:
        assert s["prompt"] == dict((r[0], r[1]) for r in TEXT_REQUESTS)[s["req_id"]]
        out_ids = res.results[s["req_id"]].output_token_ids
        assert tok.eos_token_id not in out_ids[:-1]  # trimmed after the first eos (kept)
    assert res.totals["max_denoising_steps"] == 2
    with pytest.raises(ValueError, match="embedding_scale"):
        run_demo(checkpoint=smoke_checkpoint, embedding_scale=30.0, out=str(tmp_path), progress=False)


def test_random_weights_flag_keeps_the_old_demo(tmp_path, capsys):
    rc, out, err = _run(["--random-weights", "--out", str(tmp_path), "--canvas-length", "8",
                         "--max-denoising-steps", "2"], capsys)
    assert rc == 0, err
    assert "tiny random-weight DiffusionGemma" in out and "tied embedding x30" in out
    assert "no trained checkpoint" not in out  # chosen explicitly: no notice
    for line in METRIC_LINES:
        assert line in out, line
    assert "(step cap 2)" in out and "generated text: none" in out


def test_fuse_commit_flag_serves_the_same_tokens_in_fewer_forward_passes(tmp_path, capsys):
    """``blockdiff demo --fuse-commit``: the header says so, and run_demo(fuse_commit=True) emits every request's
    tokens of the unfused demo in fewer forward passes (one fewer per commit the step budget had room to fuse)."""
    rc, out, err = _run(["--random-weights", "--out", str(tmp_path), "--canvas-length", "8",
                         "--max-denoising-steps", "2", "--fuse-commit"], capsys)
    assert rc == 0, err
    assert "fused commits: on" in out
    runs = [run_demo(checkpoint=None, out=str(tmp_path), canvas_length=8, max_denoising_steps=2, progress=False,
                     stream=io.StringIO(), fuse_commit=f) for f in (False, True)]
    outputs = [{k: v.output_token_ids for k, v in r.results.items()} for r in runs]
    assert outputs[0] == outputs[1]
    fused = runs[1].totals["fused_commits"]
    assert fused > 0 and runs[0].totals["forward_passes"] > runs[1].totals["forward_passes"]
    with pytest.raises(TypeError, match="fuse_commit must be a bool"):
        run_demo(checkpoint=None, out=str(tmp_path), canvas_length=8, max_denoising_steps=2, progress=False,
                 stream=io.StringIO(), fuse_commit="yes")


def test_default_is_the_shipped_checkpoint_else_random_weights_with_a_notice(smoke_checkpoint, tmp_path, capsys,
                                                                                 monkeypatch):
    monkeypatch.setattr(pretrained, "shipped_checkpoint_dir", lambda *a: smoke_checkpoint)
    rc, out, err = _run(["--out", str(tmp_path), "--max-denoising-steps", "2"], capsys)
    assert rc == 0, err
    assert f"trained DiffusionGemma from {smoke_checkpoint}" in out

    missing = str(tmp_path / "not-shipped")
    monkeypatch.setattr(pretrained, "shipped_checkpoint_dir", lambda *a: missing)
    rc, out, err = _run(["--out", str(tmp_path), "--canvas-length", "8", "--max-denoising-steps", "2"], capsys)
    assert rc == 0, err
    first = out.splitlines()[0]
    assert f"no trained checkpoint shipped at {missing}" in first and "RANDOM weights" in first
    assert "tiny random-weight DiffusionGemma" in out


def test_bad_checkpoint_is_a_clear_error_naming_the_argument(smoke_checkpoint, tmp_path, capsys):
    nowhere = str(tmp_path / "no-such-folder")
    rc, out, err = _run(["--checkpoint", nowhere, "--out", str(tmp_path)], capsys)
    assert rc == 2 and "--checkpoint" in err and nowhere in err and "not a folder" in err
    assert "blockdiff demo:" not in out  # nothing ran

    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = _run(["--checkpoint", str(empty), "--out", str(tmp_path)], capsys)
    assert rc == 2 and "--checkpoint" in err and "lacks model.safetensors, config.json, tokenizer.json" in err

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in os.listdir(smoke_checkpoint):
        (broken / f).write_bytes(open(os.path.join(smoke_checkpoint, f), "rb").read())
    (broken / "tokenizer.json").write_text('{"type": "sentencepiece"}')
    rc, out, err = _run(["--checkpoint", str(broken), "--out", str(tmp_path)], capsys)
    assert rc == 2 and "--checkpoint" in err and "not the byte tokenizer" in err

    rc, out, err = _run(["--checkpoint", smoke_checkpoint, "--embedding-scale", "3", "--out", str(tmp_path)], capsys)
    assert rc == 2 and "--embedding-scale" in err and "--checkpoint" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--checkpoint", smoke_checkpoint, "--random-weights"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_text_prompts_need_a_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="text prompt needs a checkpoint"):
        run_demo(out=str(tmp_path), progress=False, requests=(("r", "def f():", 0, 1, False),))


@pytest.mark.parametrize("requests,error,match", [
    ((), ValueError, r"requests must hold at least one request"),  # was 'max() arg is an empty sequence'
    ((("r", -3, 0, 4, False),), ValueError, r"requests\[0\]: prompt must be >= 1, got -3"),  # torch's RuntimeError
    ((("r", 2.7, 0, 4, False),), TypeError, r"requests\[0\]: prompt must be a str or an int"),  # ran 2 random ids
    ((("r", True, 0, 4, False),), TypeError, r"requests\[0\]: prompt .* got bool"),  # ran 1 random id
    ((("r", 5, 0, 4, "no"),), TypeError, r"requests\[0\]: greedy must be a bool"),  # "int + str" from a sum
    ((("r", 5, 0, 4),), ValueError, r"requests\[0\] must be a tuple \(req_id, prompt, arrival_step, n, greedy\)"),
    ((("r", 5, 0, 0, False),), ValueError, r"requests\[0\]: n must be >= 1"),
    ("abc", TypeError, r"requests must be a tuple or list"),
], ids=["empty", "negative-length", "float-length", "bool-length", "str-greedy", "four-values", "zero-n", "str"])
def test_demo_workload_with_a_malformed_request_is_refused_naming_it(tmp_path, requests, error, match):
    """run_demo's requests are checked before any model is built: each was another function's error (or a silent
    int() of a float or bool prompt length)."""
    with pytest.raises(error, match=match):
        run_demo(out=str(tmp_path), progress=False, requests=requests)


@pytest.mark.parametrize("requests,match", [
    ((("r", 2 ** 40, 0, 4, False),), r"requests need \d+ positions .* RANDOM_MAX_POSITIONS"),  # 8 TB of prompt ids
    ((("r", 5, 0, 2 ** 40, False),), r"requests need \d+ positions .* RANDOM_MAX_POSITIONS"),  # MemoryError
    ((("r", 5, 10 ** 6, 4, False),), r"requests\[0\]: arrival_step must be < DEMO_MAX_STEPS = 10000"),
], ids=["huge-random-prompt", "huge-n", "arrival-after-the-last-step"])
def test_demo_workload_too_large_for_the_demo_is_refused_naming_requests(tmp_path, requests, match):
    """Regression (the merged check_requests bounded each value from below only): a random prompt of 2**40 ids was the
    allocator's RuntimeError (8 TB), n = 2**40 a MemoryError, and a request arriving at step 10**6 ran the demo's
    10000 steps empty and then raised 'unfinished after 10000 steps'. Now a ValueError naming requests before
    any model is built or any prompt drawn."""
    with pytest.raises(ValueError, match=match):
        run_demo(out=str(tmp_path), progress=False, requests=requests)


def test_demo_random_prompt_past_a_checkpoint_s_positions_is_refused_before_it_is_drawn(smoke_checkpoint, tmp_path):
    """With a checkpoint, a random prompt length was drawn (torch.randint of that many ids) before the workload was
    compared with max_position_embeddings: 2**40 was the allocator's RuntimeError, not the DemoInputError."""
    with pytest.raises(DemoInputError, match=r"requests need \d+ positions"):
        run_demo(out=str(tmp_path), progress=False, checkpoint=smoke_checkpoint, requests=(("r", 2 ** 40, 0, 1, False),))


@pytest.mark.parametrize("threads,error", [(0, ValueError), (True, TypeError), (1.5, TypeError)])
def test_demo_threads_that_are_not_a_positive_int_are_refused_naming_threads(tmp_path, threads, error):
    """Was torch's RuntimeError ('set_num_threads expects a positive integer') for 0; True ran 1 thread."""
    with pytest.raises(error, match=r"threads must be an int >= 1 or None"):
        run_demo(out=str(tmp_path), progress=False, threads=threads)


def _copy_checkpoint(src, dst):
    os.makedirs(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    return str(dst)


def test_canvas_length_override_is_said_in_the_header(smoke_checkpoint, tmp_path, capsys):
    """--canvas-length 16 on a checkpoint trained with 8-token canvases runs, and the header says it overrides the
    checkpoint's 8 (was: 'canvas 16' as if it were the checkpoint's own)."""
    rc, out, err = _run(["--checkpoint", smoke_checkpoint, "--out", str(tmp_path), "--canvas-length", "16",
                         "--max-denoising-steps", "2"], capsys)
    assert rc == 0, err
    head = out.splitlines()[0]
    assert "canvas 16 (overrides the checkpoint's trained canvas length 8)" in head
    assert "step cap 2 (overrides the default 16, blockdiff train's evaluation cap)" in head
    rc, out, err = _run(["--checkpoint", smoke_checkpoint, "--out", str(tmp_path), "--canvas-length", "8",
                         "--max-denoising-steps", "2"], capsys)
    assert rc == 0 and "overrides the checkpoint" not in out.splitlines()[0]


def test_generation_config_json_gives_the_demo_defaults(smoke_checkpoint, tmp_path, monkeypatch, capsys):
    """A checkpoint's generation_config.json sets the step cap, temperatures, entropy bound and eos ids of every
    demo request (transformers' generation defaults; was: ignored); --max-denoising-steps still wins."""
    folder = _copy_checkpoint(smoke_checkpoint, tmp_path / "with-gen")
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"max_denoising_steps": 2, "t_min": 0.2, "t_max": 0.5, "eos_token_id": [1, 5],
                   "sampler_config": {"entropy_bound": 0.25, "_cls_name": "EntropyBoundSamplerConfig"}}, f)
    added = _record_params(monkeypatch)
    rc, out, err = _run(["--checkpoint", folder, "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    assert "step cap 2, eos id 1, 5" in out.splitlines()[0] and "overrides" not in out.splitlines()[0]
    noisy = [p for p in added if p.t_max > 0]
    assert noisy and all((p.max_denoising_steps, p.t_min, p.t_max, p.entropy_bound, p.eos_token_ids)
                         == (2, 0.2, 0.5, 0.25, (1, 5)) for p in noisy)
    added.clear()
    rc, out, err = _run(["--checkpoint", folder, "--out", str(tmp_path), "--max-denoising-steps", "3"], capsys)
    assert rc == 0 and "step cap 3 (overrides the checkpoint's 2)" in out.splitlines()[0]
    assert all(p.max_denoising_steps == 3 for p in added)


def _truncate(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-100])


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _text(path):
    _write(path, "not safetensors\n" * 20)


def _config(change):
    def edit(path):
        with open(path) as f:
            cfg = json.load(f)
        cfg = change(cfg)
        with open(path, "w") as f:
            json.dump(cfg, f)
    return edit


@pytest.mark.parametrize("name,edit", [
    ("model.safetensors", _truncate),
    ("model.safetensors", _text),
    ("config.json", _config(lambda c: [1, 2])),
    ("config.json", _config(lambda c: dict(c, final_logit_softcapping=0))),
    ("config.json", _config(lambda c: dict(c, head_dim="64"))),
    ("config.json", _config(lambda c: dict(c, canvas_length=10 ** 9))),
    ("config.json", _config(lambda c: dict(c, hidden_size=2 ** 62))),  # was torch's RuntimeError, a traceback
    ("generation_config.json", lambda p: _write(p, '{"tmin": 0.1}')),
], ids=["truncated-weights", "text-weights", "config-list", "softcap-0", "str-head-dim", "huge-canvas",
        "huge-hidden-size", "generation-typo"])
def test_unusable_checkpoint_exits_2_with_one_line_naming_checkpoint(smoke_checkpoint, tmp_path, capsys, name, edit):
    """Was: a SafetensorError / TypeError traceback (exit 1), or a config that loaded and failed every request."""
    folder = _copy_checkpoint(smoke_checkpoint, tmp_path / "bad")
    edit(os.path.join(folder, name))
    rc, out, err = _run(["--checkpoint", folder, "--out", str(tmp_path)], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"blockdiff demo: error: --checkpoint {folder!r} cannot be loaded")
    assert "blockdiff demo: trained" not in out


def test_demo_probes_the_attention_backend_in_the_dtype_the_model_runs_in(smoke_checkpoint, tmp_path, monkeypatch):
    """Was: the probe ran in float32 before the model was loaded, so on a GPU 'cute' (bf16 / fp16 only) was refused
    for the stored bf16 checkpoint it can serve. Here the checkpoint is loaded in bf16 (as on a GPU) on the CPU, and
    the probe is recorded: the device rules first (no probe), then the probe in the model's dtype."""
    import blockdiff.integration.demo as demo

    seen = []

    class Stop(Exception):
        pass

    def check(backend, device, dtype=torch.float32):
        seen.append(dtype)
        if dtype is not None:
            raise Stop
    real_load = demo.load_pretrained

    def load_bf16(*a, **kw):
        model, tok = real_load(*a, **kw)
        return model.to(torch.bfloat16), tok
    monkeypatch.setattr(demo, "check_attention_backend", check)
    monkeypatch.setattr(demo, "load_pretrained", load_bf16)
    with pytest.raises(Stop):
        run_demo(checkpoint=smoke_checkpoint, out=str(tmp_path), progress=False, stream=io.StringIO())
    assert seen == [None, torch.bfloat16]


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_an_unknown_or_unimportable_attention_backend_is_refused_before_the_model_is_built(
        smoke_checkpoint, tmp_path, monkeypatch, with_checkpoint):
    """Was (5cbc142, the probe moved after loading): an unknown backend name ('bogus': ValueError) and a backend whose
    module cannot be imported (BackendUnavailable) were found only after the checkpoint was loaded or the random
    model built; before that commit the probe refused both first, as the device rules still do."""
    import blockdiff.attention as attn
    import blockdiff.integration.demo as demo

    work = []
    real_load, real_gemma = demo.load_pretrained, demo.DiffusionGemma
    monkeypatch.setattr(demo, "load_pretrained", lambda *a, **k: (work.append("load"), real_load(*a, **k))[1])
    monkeypatch.setattr(demo, "DiffusionGemma", lambda *a, **k: (work.append("build"), real_gemma(*a, **k))[1])
    kw = dict(checkpoint=smoke_checkpoint) if with_checkpoint else {}
    with pytest.raises(ValueError, match="backend must be one of"):
        run_demo(backend="bogus", out=str(tmp_path), progress=False, stream=io.StringIO(), **kw)
    assert work == []
    monkeypatch.setitem(attn._MODULES, "reference", ("blockdiff.no_such_attention_module", "attention_reference"))
    with pytest.raises(demo.BackendUnavailable, match="'reference' is not available"):
        run_demo(backend="reference", out=str(tmp_path), progress=False, stream=io.StringIO(), **kw)
    assert work == []


@pytest.mark.parametrize("value, available", [("false", False), ("off", False), ("0", False), ("true", True),
                                              ("1", True)])
def test_demo_reads_triton_interpret_as_triton_does(monkeypatch, value, available):
    """The demo's CPU rule for the triton attention backend reads TRITON_INTERPRET as Triton does (break25b's
    triton_interpret): ``false`` was taken as the interpreter, so the demo went on to hand CPU tensors to a compiled
    kernel. (review25: no test covered the demo's two readers.)"""
    import blockdiff.integration.demo as demo

    monkeypatch.setenv("TRITON_INTERPRET", value)
    if available:
        demo.check_attention_backend("triton", "cpu", dtype=None)
    else:
        with pytest.raises(demo.BackendUnavailable, match="TRITON_INTERPRET"):
            demo.check_attention_backend("triton", "cpu", dtype=None)
        with pytest.raises(demo.BackendUnavailable, match="sampler backend 'triton' on CPU"):
            demo.run_demo(sampler_backend="triton", device="cpu", progress=False, stream=io.StringIO())


@pytest.mark.parametrize("log", ['{"steps": Infinity, "final_held_out_loss": 1.0}', '{"steps": NaN}', '[1, 2]',
                                 '{"steps": 5}', 'not json'])
def test_an_unreadable_train_log_gives_no_training_summary_not_a_crash(tmp_path, log):
    """train_log.json is an optional record: a log the summary cannot read gives no summary. Was: "steps": Infinity
    (json.load reads it as float inf) raised OverflowError from int() out of blockdiff demo's header line."""
    from blockdiff.integration.demo import _train_summary

    (tmp_path / "train_log.json").write_text(log)
    assert _train_summary(str(tmp_path)) == ""
