"""``blockdiff demo`` end to end on random weights (``--random-weights``): table, totals, PNG, ``--check``, backend
errors; ``blockdiff train --smoke``. The trained-checkpoint path is in test_demo.py."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest
from integration_helpers import needs_stack

import blockdiff.attention as A
import blockdiff.sampler as S
from blockdiff.integration import cli

pytestmark = needs_stack


def test_demo_main_runs_end_to_end_with_check_and_writes_png(tmp_path, capsys):
    rc = cli.main(["demo", "--random-weights", "--out", str(tmp_path), "--check", "--no-progress", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    png = tmp_path / "attention_pattern.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "attention backend: reference" in out and "sampler backend: reference" in out
    head = next(ln for ln in out.splitlines() if ln.lstrip().startswith("step "))
    assert head.split()[:8] == ["step", "pre", "den", "com", "q_tok", "acc_this_step", "mean_H", "emitted"]
    assert "acc_this_step = canvas positions the entropy bound accepted in this step" in out
    assert "not of newly fixed positions" in out
    assert "forward passes" in out and "tokens/forward" in out and "wall" in out
    assert "check:" in out and "matched the references" in out
    # the drawn step mixes phases
    line = next(ln for ln in out.splitlines() if ln.startswith("attention pattern of step"))
    assert "written to" in line


def test_demo_console_script_subprocess(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-m", "blockdiff.integration.cli", "demo", "--random-weights", "--out",
                        str(tmp_path), "--no-progress", "--canvas-length", "8", "--max-denoising-steps", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "attention_pattern.png").exists()
    assert "totals:" in p.stdout


def test_demo_piped_into_a_reader_that_stops_early_exits_without_a_traceback(tmp_path):
    """`blockdiff demo | head` closes the pipe while the demo still prints: a quiet exit 141 (a shell's SIGPIPE
    code), not a BrokenPipeError traceback."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.Popen([sys.executable, "-m", "blockdiff.integration.cli", "demo", "--random-weights", "--out",
                          str(tmp_path), "--no-progress", "--canvas-length", "8", "--max-denoising-steps", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.readline()  # as `head -1`: read one line, then close the pipe
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_unknown_backend_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--backend", "flash9000"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'flash9000'" in err and "reference" in err


def test_unavailable_backend_is_an_error_not_a_fallback(tmp_path, capsys, monkeypatch):
    rc = cli.main(["demo", "--random-weights", "--backend", "cute", "--device", "cpu", "--out", str(tmp_path),
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "'cute'" in err and "CUDA" in err
    assert not (tmp_path / "attention_pattern.png").exists()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = cli.main(["demo", "--random-weights", "--backend", "triton", "--device", "cpu", "--out", str(tmp_path),
                   "--no-progress"])
    assert rc == 2 and "TRITON_INTERPRET" in capsys.readouterr().err


def test_check_mismatch_exits_nonzero_with_message(tmp_path, capsys, monkeypatch):
    """A backend that disagrees with the reference makes --check fail loudly (exit 1)."""
    real = A.get_backend

    def bad_get_backend(backend):
        fn = real(backend)
        return lambda q, k, v, **kw: fn(q, k, v, **kw) * 1.01
    monkeypatch.setattr(A, "get_backend", bad_get_backend)
    rc = cli.main(["demo", "--random-weights", "--out", str(tmp_path), "--check", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "CHECK FAILED" in err and "attention check failed" in err


def test_demo_exits_1_when_every_request_finishes_error(tmp_path, capsys, monkeypatch):
    """An attention backend that returns NaN fails every request (finish reason 'error', vLLM's name): the demo says
    so and exits 1 instead of printing empty completions with exit 0."""
    real = A.get_backend

    def nan_get_backend(backend):
        fn = real(backend)
        return lambda q, k, v, **kw: fn(q, k, v, **kw) * float("nan")
    monkeypatch.setattr(A, "get_backend", nan_get_backend)
    rc = cli.main(["demo", "--random-weights", "--out", str(tmp_path), "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 1 and "requests failed" in err, (out, err)
    assert "(error)" in out and "(failed)" not in out


def test_sampler_check_mismatch_exits_nonzero_with_message(tmp_path, capsys, monkeypatch):
    """A sampler backend that disagrees with the reference makes --check fail loudly (exit 1)."""
    real = S.get_backend

    def bad_get_backend(backend):
        ref = real("reference")
        if backend != "triton":
            return ref

        def corrupted(state, slots, logits, prefill_done, embedding, **kw):
            out = ref(state, slots, logits, prefill_done, embedding, **kw)
            state.canvas.add_(1).remainder_(state.vocab_size)  # a wrong next canvas
            return out
        return corrupted
    monkeypatch.setattr(S, "get_backend", bad_get_backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc = cli.main(["demo", "--random-weights", "--out", str(tmp_path), "--check", "--no-progress", "--sampler-backend",
                   "triton"])
    err = capsys.readouterr().err
    assert rc == 1 and "CHECK FAILED" in err and "sampler check: state.canvas" in err


def test_demo_rejects_bad_arguments_before_running(tmp_path, capsys):
    assert cli.main(["demo", "--random-weights", "--embedding-scale", "nan", "--out", str(tmp_path)]) == 2
    assert cli.main(["demo", "--canvas-length", "100000", "--out", str(tmp_path)]) == 2
    assert cli.main(["demo", "--out", "/proc/no-such-folder/x"]) == 2
    err = capsys.readouterr().err
    assert "--embedding-scale" in err and "--canvas-length" in err and "--out" in err


@pytest.mark.parametrize("argv, flag", [
    (["demo", "--canvas-length", "0"], "--canvas-length"), (["demo", "--seed", "-1"], "--seed"),
    (["demo", "--device", "meta"], "--device"), (["demo", "--embedding-scale", "2"], "--embedding-scale"),
    (["demo", "--random-weights", "--backend", "cute", "--no-progress"], "cute"),  # refused after the flag checks
    (["train", "--device", "tpu"], "--device"), (["train", "--smoke", "--lr", "nan"], "--lr"),
    (["export", "--t-min", "-1"], "--t-min"), (["export", "--dtype", "float16", "--checkpoint", "/no/such"], "--checkpoint"),
])
def test_refused_flags_create_no_output_folder(tmp_path, capsys, argv, flag):
    """Was: blockdiff demo created --out before it reported the other flags' errors; every subcommand now checks
    every flag (the output folder without creating it) first."""
    out = tmp_path / "new" / "out"
    argv = [*argv, str(out)] if argv[0] == "export" else [*argv, "--out", str(out)]
    assert cli.main(argv) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("cmd", ["demo", "train", "export"])
def test_an_output_folder_below_a_file_is_refused_naming_the_flag(tmp_path, capsys, cmd):
    """--out / OUT below a file: one error naming the flag (train found out only after training)."""
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / "afile" / "sub")
    argv = {"demo": ["demo", "--random-weights", "--out", out], "train": ["train", "--smoke", "--out", out],
            "export": ["export", out]}[cmd]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("OUT" if cmd == "export" else "--out") in err[0] and "afile" in err[0], err


@pytest.mark.parametrize("flags, flag", [
    (["--batch-size", "0"], "--batch-size"), (["--lr", "nan"], "--lr"), (["--max-steps", "0"], "--max-steps"),
    (["--prefix", "10", "--prefix-min", "20"], "--prefix"), (["--log-every", "0"], "--log-every"),
    (["--self-cond-prob", "1.5"], "--self-cond-prob"), (["--eval-steps", "0"], "--eval-steps"),
    (["--seed", "-1"], "--seed"), (["--corpus", "/no/such/corpus"], "--corpus")])
def test_train_flag_errors_exit_2_naming_the_flag_before_training(tmp_path, capsys, flags, flag):
    """Regression: these trained silently (--smoke replaced --lr nan, --max-steps 0 ran 20 steps, batch 0 trained on
    nothing) or died with a traceback (--log-every 0: ZeroDivisionError; --seed -1, --corpus missing)."""
    rc = cli.main(["train", "--smoke", "--eval-prompts", "0", "--out", str(tmp_path / "o"), *flags])
    out = capsys.readouterr()
    assert rc == 2 and out.err.startswith(f"blockdiff train: error: {flag}: ") and "trained" not in out.out
    assert not (tmp_path / "o").exists()


def test_train_prefix_past_the_config_s_positions_exits_2_naming_prefix_before_training(tmp_path, capsys):
    """--prefix 5000 (the default config holds 4096 positions) trained on positions the checkpoint never serves."""
    rc = cli.main(["train", "--eval-prompts", "0", "--max-steps", "1", "--out", str(tmp_path / "o"),
                   "--prefix", "5000"])
    out = capsys.readouterr()
    assert rc == 2 and out.err.startswith("blockdiff train: error: --prefix: prefix (5000) + canvas_length (32) = "
                                          "5032 training positions exceed the config's max_position_embeddings (4096)")
    assert not (tmp_path / "o").exists()


def test_train_corpus_with_no_text_exits_2_naming_corpus(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc = cli.main(["train", "--smoke", "--eval-prompts", "0", "--out", str(tmp_path / "o"), "--corpus", str(empty)])
    assert rc == 2 and "blockdiff train: error: --corpus: no .py text found" in capsys.readouterr().err


def test_demo_canvas_longer_than_the_checkpoint_s_positions_exits_2(tmp_path, capsys):
    """--canvas-length 2000 with the shipped checkpoint (max_position_embeddings 4096) needs 6000+ positions: the
    harness refuses max_model_len past them; the demo says so in one line instead of a traceback."""
    assert cli.main(["demo", "--canvas-length", "2000", "--no-progress", "--out", str(tmp_path)]) == 2
    assert "--canvas-length 2000" in capsys.readouterr().err


def test_demo_rejects_out_of_range_seed_and_step_cap_with_a_message_not_a_traceback(tmp_path, capsys):
    """Regression: --seed -1 and --max-denoising-steps 20000 passed the CLI checks and died in SamplingParams
    with a ValueError traceback; now exit 2 naming the option, before anything runs."""
    assert cli.main(["demo", "--seed", "-1", "--out", str(tmp_path)]) == 2
    assert cli.main(["demo", "--max-denoising-steps", "20000", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert "--seed must be in [0, 2**63), got -1" in out.err and "--max-denoising-steps must be in [1, 16384)" in out.err
    assert "blockdiff demo:" not in out.out  # nothing ran


def test_train_smoke_runs_and_records_the_evaluation(tmp_path):
    """``blockdiff train --smoke`` (moved from ``python3 -m blockdiff.model.train``): trains, saves, and evaluates
    by generation through the harness (train_log.json's "eval")."""
    assert cli.main(["train", "--smoke", "--out", str(tmp_path), "--max-steps", "3", "--eval-prompts", "1"]) == 0
    assert (tmp_path / "model.safetensors").exists()
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["steps"] == 3 and log["args"]["smoke"] and log["eval"]["num_prompts"] == 1


def test_train_smoke_trains_on_one_cpu_thread(tmp_path, monkeypatch):
    """Regression: ``--smoke`` set ``min(2, threads)`` intra-op threads, so on a loaded 2-core machine the tiny
    config's 20 steps took 7x longer (once 111 s instead of ~1 s); it trains on one thread, as blockdiff demo runs."""
    import torch

    import blockdiff.model.train as T

    seen = {}

    def fake_train(args, evaluate=None):
        seen["threads"], seen["smoke"] = torch.get_num_threads(), args.smoke
        return {}

    monkeypatch.setattr(T, "train", fake_train)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cli.main(["train", "--smoke", "--out", str(tmp_path / "o"), "--eval-prompts", "0"]) == 0
    finally:
        torch.set_num_threads(threads)  # not left to the tests after this one
    assert seen == {"threads": 1, "smoke": True}


def _train_options():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["train"]._actions if a.option_strings and a.dest != "help"}


def test_train_help_states_every_default_and_what_smoke_overrides(tmp_path):
    """Regression: ``blockdiff train --help`` listed --batch-size, --lr, --warmup-steps, --self-cond-prob,
    --log-every and --seed without a word, so their defaults were nowhere but the source, and ``--smoke`` ("tiny
    config, ~20 steps on the CPU") silently replaced --device, --lr and --warmup-steps and capped five more flags.
    Each option's help now gives its default (checked against the parser's), and --smoke's help names every flag
    it sets, with the values ``smoke_args`` gives."""
    from blockdiff.model.train import TrainArgs, smoke_args

    opts = _train_options()
    for dest, a in opts.items():
        if a.default in (None, False) or dest == "out":
            continue
        m = re.search(r"default (\S+?)[);,]?(?:\s|$)", a.help or "")
        assert m, f"--{dest}: help {a.help!r} states no default"
        shown = m.group(1).rstrip(")")
        assert (shown == a.default if isinstance(a.default, str) else float(shown) == a.default), (dest, shown)
    smoke_help = opts["smoke"].help
    cut = smoke_args(TrainArgs(out=str(tmp_path)))
    for flag, field in (("--device", "device"), ("--lr", "lr"), ("--warmup-steps", "warmup_steps")):
        m = re.search(rf"{flag} (\S+?)[,;]?\s", smoke_help)
        assert m, (flag, smoke_help)
        value = getattr(cut, field)
        assert (m.group(1) == value if isinstance(value, str) else float(m.group(1)) == value), (flag, m.group(1))
    for flag, field in (("--batch-size", "batch_size"), ("--prefix", "prefix"), ("--prefix-min", "prefix_min"),
                        ("--eval-prompts", "eval_prompts"), ("--eval-steps", "eval_steps")):
        m = re.search(rf"{flag} at (\d+)", smoke_help)
        assert m and int(m.group(1)) == getattr(cut, field), (flag, smoke_help)
    assert cut.max_steps == 20 and "20 steps" in smoke_help


def test_train_smoke_help_says_it_does_not_use_log_every():
    """Regression: ``--smoke``'s help named every flag it sets or caps but not --log-every, which a smoke run does not
    use (model.train logs every step and prints a line every 5, and takes no held-out loss between steps), so
    ``--smoke --log-every 10`` was silently a run logged as any other smoke run."""
    assert "--log-every is not used" in _train_options()["smoke"].help


def test_train_argument_errors_come_before_torch():
    """An argument error of ``blockdiff train`` exits 2 from argparse, in a process that never imported torch."""
    code = ("import sys; from blockdiff.integration import cli\n"
            "try:\n    cli.main(['train', '--attn-backend', 'flash9000', '--out', '/tmp/x'])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "exit 2 False", p.stdout + p.stderr
    assert "invalid choice: 'flash9000'" in p.stderr


_NO_TORCH = ("import sys; from blockdiff.integration import cli\n"
             "rc = cli.main({argv!r})\n"
             "print('exit', rc, 'torch' in sys.modules)")


@pytest.mark.parametrize("argv,flag", [
    (["demo", "--device", "bogus"], "--device"),
    (["demo", "--device", ""], "--device"),
    (["demo", "--device", "meta"], "--device"),
    (["demo", "--max-denoising-steps", "0"], "--max-denoising-steps"),
    (["demo", "--max-denoising-steps", "16384"], "--max-denoising-steps"),
    (["demo", "--embedding-scale", "2"], "--embedding-scale"),        # the shipped checkpoint: needs --random-weights
    (["demo", "--checkpoint", "/nonexistent-blockdiff"], "--checkpoint"),
    (["demo", "--checkpoint", "/etc/hostname"], "--checkpoint"),      # a file, not a folder
    (["train", "--device", "cuda:x", "--out", "/tmp/x"], "--device"),
])
def test_argument_errors_exit_2_with_one_line_before_torch(tmp_path, argv, flag):
    """Each argument error is one line naming the option, exit 2, in a process that never imported torch (was:
    --device bogus / '' printed a traceback (exit 1); --max-denoising-steps, --embedding-scale with the shipped
    checkpoint and --checkpoint not a folder took the 2-6 s of the heavy imports)."""
    if argv[0] == "demo":
        argv = argv + ["--out", str(tmp_path)]
    p = subprocess.run([sys.executable, "-c", _NO_TORCH.format(argv=argv)], capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.strip() == "exit 2 False", p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_step_cap_bound_equals_the_samplers():
    from blockdiff.sampler.rng import MAX_STEPS

    assert cli.MAX_DENOISING_STEPS == MAX_STEPS


def test_a_cuda_device_that_is_not_here_is_one_line_naming_device(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = cli.main(["demo", "--random-weights", "--device", "cuda:3", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--device 'cuda:3'" in err and "CUDA is not available" in err


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1"])
def test_demo_on_an_indexed_cpu_device_runs(tmp_path, capsys, device):
    """Was a traceback: 'cpu:1' was refused by the harness as another device than its model's 'cpu', and 'cpu:0'
    built a sampler state that refused its own slots ("slots is on cpu, the state on cpu:0")."""
    rc = cli.main(["demo", "--random-weights", "--device", device, "--canvas-length", "4", "--max-denoising-steps",
                   "1", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    assert "device: cpu" in capsys.readouterr().out


def test_demo_refuses_an_embedding_scale_beyond_float32(tmp_path, capsys):
    """Was: --embedding-scale 1e39 passed the 'finite > 0' check in float64, made the float32 weights inf, ran the
    whole demo and ended 'all 6 requests failed' (exit 1); now exit 2 naming the flag before anything runs, and
    run_demo refuses it (and a NaN, a negative, a bool) itself."""
    from blockdiff.integration.demo import run_demo

    assert cli.main(["demo", "--random-weights", "--embedding-scale", "1e39", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert "--embedding-scale must be at most 3.4028e+38" in out.err and "blockdiff demo:" not in out.out
    for bad, exc in ((1e39, ValueError), (float("nan"), ValueError), (-1.0, ValueError), (0, ValueError),
                     (True, TypeError), ("30", TypeError)):
        with pytest.raises(exc, match="embedding_scale"):
            run_demo(embedding_scale=bad, out=str(tmp_path), progress=False)


def test_train_refuses_a_cuda_device_that_is_not_here_before_training(tmp_path, capsys, monkeypatch):
    """Was: --device cuda on a machine without CUDA loaded the corpus, then died with torch's AssertionError."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = cli.main(["train", "--device", "cuda", "--max-steps", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--device: device 'cuda': CUDA is not available" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("backend", ["cute", "triton"])
def test_train_refuses_an_attention_backend_its_evaluation_cannot_run_before_training(tmp_path, capsys,
                                                                                      monkeypatch, backend):
    """Was: --attn-backend cute on the CPU (or triton without TRITON_INTERPRET) trained for the whole budget, wrote
    the checkpoint, then died in the evaluation with a NotImplementedError / ValueError traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = cli.main(["train", "--smoke", "--attn-backend", backend, "--out", str(tmp_path / "o")])
    out = capsys.readouterr()
    assert rc == 2 and out.err.startswith(f"blockdiff train: error: --attn-backend: attention backend {backend!r}")
    assert "trained" not in out.out and not (tmp_path / "o").exists()


def test_train_prints_to_the_stdout_of_the_call_not_the_one_at_import(tmp_path, monkeypatch):
    """``model.train.train`` bound ``sys.stdout`` as its default stream at import, so after an earlier test's
    captured stdout was closed, ``blockdiff train`` died with 'I/O operation on closed file' (a pytest-xdist
    ordering flake found on 2026-12-06); the default now resolves at each call."""
    import io
    import sys

    import blockdiff.model.train  # noqa: F401  (imported before the stdout below, as a later test sees it)
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    assert cli.main(["train", "--smoke", "--out", str(tmp_path), "--max-steps", "1", "--eval-prompts", "1"]) == 0
    assert "corpus:" in buf.getvalue()


def _ckpt_with_generation_config(folder, gen: dict) -> str:
    from blockdiff.model.pretrained import CHECKPOINT_FILES, shipped_checkpoint_dir

    folder.mkdir()
    for name in CHECKPOINT_FILES:
        os.symlink(os.path.join(shipped_checkpoint_dir(), name), folder / name)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return str(folder)


def test_demo_checkpoint_schedule_the_sampler_refuses_exits_2_naming_the_file_or_the_flag(tmp_path, capsys):
    """Was: a ValueError traceback from SamplingParams (the loader took a generation_config.json whose float32
    schedule falls below 2**-126; a --max-denoising-steps that pushes a valid one there likewise)."""
    bad = _ckpt_with_generation_config(tmp_path / "bad", {"t_min": 0.0, "t_max": 1e-40})
    assert cli.main(["demo", "--checkpoint", bad, "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--checkpoint" in err[0] and "generation_config.json" in err[0] \
        and "MIN_TEMPERATURE" in err[0], err
    ok = _ckpt_with_generation_config(tmp_path / "ok", {"t_min": 0.0, "t_max": 1e-36})
    assert cli.main(["demo", "--checkpoint", ok, "--max-denoising-steps", "1000", "--no-progress",
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-denoising-steps 1000" in err[0] and "MIN_TEMPERATURE" in err[0], err


def test_demo_prompt_flag_replaces_the_built_in_snippets(tmp_path, capsys):
    """--prompt TEXT (repeatable) serves the user's prompts with the shipped checkpoint, --canvases N canvases each;
    a newcomer's first try (it was an unknown argument)."""
    rc = cli.main(["demo", "--prompt", "def add(a, b):\n    return ", "--prompt", "import os\n", "--canvases", "2",
                   "--max-denoising-steps", "4", "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "prompt-0" in out and "prompt-1" in out and "req-0" not in out


def test_prompt_requests_build_the_text_workload():
    args = cli.build_parser().parse_args(["demo", "--prompt", "x = ", "--prompt", "y", "--canvases", "3"])
    assert cli.prompt_requests(args) == (("prompt-0", "x = ", 0, 3, False), ("prompt-1", "y", 0, 3, False))
    assert cli.prompt_requests(cli.build_parser().parse_args(["demo"])) is None
    assert cli.prompt_requests(cli.build_parser().parse_args(["demo", "--prompt", "z"]))[0][3] == 1


@pytest.mark.parametrize("argv,flag", [
    (["--prompt", ""], "--prompt number 1 is empty"),
    (["--prompt", "ok", "--prompt", "\udcff"], "--prompt number 2 is not valid UTF-8"),
    (["--random-weights", "--prompt", "x"], "--prompt needs a trained checkpoint"),
    (["--canvases", "2"], "--canvases sets the canvases generated per --prompt"),
    (["--prompt", "x", "--canvases", "0"], "--canvases must be in [1, 64]"),
    (["--prompt", "x", "--canvases", "65"], "--canvases must be in [1, 64]"),
])
def test_demo_prompt_errors_exit_2_naming_the_flag_before_running(tmp_path, capsys, argv, flag):
    assert cli.main(["demo", *argv, "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_demo_prompt_past_the_checkpoints_positions_exits_2_naming_the_flags(tmp_path, capsys):
    """A prompt plus its canvases beyond max_position_embeddings: one line naming --prompt / --canvases."""
    rc = cli.main(["demo", "--prompt", "x" * 4000, "--canvases", "8", "--no-progress", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--canvases" in err and "--prompt" in err and "4000 tokens" in err
