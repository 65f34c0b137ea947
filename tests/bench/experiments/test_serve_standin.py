"""The serving stand-in (bench/experiments/serve_standin.py): its diffusion accounting, step-time model, step log,
load timeline and plugin folder on the CPU without vLLM; the whole stand-in server against ``vllm bench serve``
only where vLLM 0.26's Python side imports (tests/integration/vllm_cpu_env.sh 0.26.0; CI skips it)."""
import importlib.metadata
import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

from blockdiff.bench.experiments import serve_standin as st


def test_accounting_commits_a_canvas_after_the_denoising_steps():
    acc = st.DiffusionAccounting(denoising_steps=3, canvas_length=4)
    assert acc.step("a", canvas_row=False) == 0  # a prefill chunk samples nothing
    assert [acc.step("a", True) for _ in range(8)] == [0, 0, 0, 4, 0, 0, 0, 4]  # 3 denoise, commit, again


def test_accounting_restarts_a_preempted_requests_canvas():
    """vLLM's model runner v2 removes a preempted request like a finished one; resumed, it re-prefills and starts
    a new canvas, so the stand-in commits a full canvas of steps after the resume (review of 30ef6de)."""
    acc = st.DiffusionAccounting(denoising_steps=3, canvas_length=4)
    assert [acc.step("a", True) for _ in range(2)] == [0, 0]
    acc.finish({"a"})  # preempted mid-canvas
    assert acc.step("a", False) == 0  # the re-prefill
    assert [acc.step("a", True) for _ in range(4)] == [0, 0, 0, 4]


def test_accounting_keeps_requests_apart_and_forgets_finished_ones():
    acc = st.DiffusionAccounting(denoising_steps=2, canvas_length=8)
    assert [acc.step("a", True), acc.step("b", True), acc.step("a", True), acc.step("a", True)] == [0, 0, 0, 8]
    acc.finish(["b"])
    assert "b" not in acc.steps and acc.step("b", True) == 0


def test_accounting_of_fused_commit_rows():
    """A row of 2 * CL tokens is the commit plus the next canvas's first step; a wider row cut short of that (the
    token budget) is a plain commit; commits_next says when the canvas converged."""
    acc = st.DiffusionAccounting(denoising_steps=3, canvas_length=4)
    assert [acc.step("a", True, 4) for _ in range(3)] == [0, 0, 0] and acc.commits_next("a")
    assert acc.step("a", True, 8) == 4 and acc.steps["a"] == 1 and not acc.commits_next("a")
    assert [acc.step("a", True, 4) for _ in range(2)] == [0, 0] and acc.commits_next("a")
    assert acc.step("a", True, 6) == 4 and acc.steps["a"] == 0  # cut: the next canvas starts unstepped
    assert [acc.step("a", True) for _ in range(4)] == [0, 0, 0, 4]  # one canvas a row: as before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_accounting_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="denoising_steps"):
        st.DiffusionAccounting(denoising_steps=bad)
    with pytest.raises(ValueError, match="canvas_length"):
        st.DiffusionAccounting(canvas_length=bad)


def test_step_time_model_matches_its_calibration():
    model = st.parse_floats(st.STEP_MS, 3, st.STEP_ENV)
    assert st.step_seconds(model, 0, 256) == pytest.approx(0.0123, abs=8e-4)  # a lone canvas step (7.4: 12.3 ms)
    assert st.step_seconds(model, 4096, 0) == pytest.approx(0.0545, abs=5e-4)  # a 4096-token prefill (7.4)
    # the 64-request load (7.13: 80 steps, a 14.53 s span): 64 prompts of 4096 tokens, and per request 2 x 17
    # canvas rows plus the one row asynchronous scheduling adds after its last commit
    load = 80 * model[0] / 1e3 + st.step_seconds((0, model[1], model[2]), 64 * 4096, 64 * (2 * 17 + 1) * 256)
    assert load == pytest.approx(14.53, rel=0.01)


@pytest.mark.parametrize("text", ["1,2", "1,2,3,4", "a,b,c", "1,-2,3", "1,nan,3", "1,inf,3"])
def test_parse_floats_names_the_variable(text):
    with pytest.raises(ValueError, match=st.STEP_ENV):
        st.parse_floats(text, 3, st.STEP_ENV)


def test_platform_plugin_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(st.PLATFORM_ENV, raising=False)
    assert st.platform_plugin() is None
    monkeypatch.setenv(st.PLATFORM_ENV, "1")
    assert st.platform_plugin() == st.PLATFORM_CLASS


def test_a_bad_standin_switch_stops_the_start_instead_of_vllm_falling_back_to_its_own_platform(monkeypatch):
    """vLLM swallows an Exception from a platform plugin (import or call) and serves on its own platform; a bad value
    must be a SystemExit naming the variable, and the module's import must not read BLOCKDIFF_CHECK_VALUES."""
    monkeypatch.setenv(st.PLATFORM_ENV, "true")
    with pytest.raises(SystemExit, match=st.PLATFORM_ENV):
        st.platform_plugin()
    env = dict(os.environ, BLOCKDIFF_CHECK_VALUES="true")
    code = ("import sys, blockdiff.bench.experiments.serve_standin; "
            "print(any(m.startswith('blockdiff.attention') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]


def test_plugin_dir_declares_the_platform_entry_point(tmp_path):
    st.write_plugin_dir(tmp_path)
    dists = [d for d in importlib.metadata.distributions(path=[str(tmp_path)])]
    assert [d.metadata["Name"] for d in dists] == ["blockdiff_standin"]
    (ep,) = dists[0].entry_points
    assert (ep.group, ep.value) == ("vllm.platform_plugins",
                                    "blockdiff.bench.experiments.serve_standin:platform_plugin")


def test_timeline_places_the_client_window_on_the_steps(tmp_path):
    log = tmp_path / "steps.log"
    log.write_text("10.00 10.50 4096 0 1\n10.50 11.00 256 256 1\n99 100 1 1 1\nbad line\n")
    steps = st.read_steps(log)
    assert len(steps) == 3 and st.read_steps(tmp_path / "missing") == []
    # two requests: sent at 9.9 and 10.0; first outputs 0.6 / 0.7 s later; last at 11.2
    result = {"start_times": [9.9, 10.0], "ttfts": [0.6, 0.7], "itls": [[0.7], [0.5]], "output_lens": [2, 2]}
    t = st.load_timeline(result, steps)
    assert t["steps"] == 2 and t["window_s"] == pytest.approx(1.3) and t["gpu_span_s"] == pytest.approx(1.0)
    assert t["lead_in_s"] == pytest.approx(0.1) and t["tail_s"] == pytest.approx(0.2)
    assert t["ttft_median_s"] == pytest.approx(0.65) and t["e2e_median_s"] == pytest.approx(1.25)
    assert st.load_timeline({}, steps) == {}


def test_timeline_counts_the_steps_that_are_not_one_width(tmp_path):
    """Step lines with the width fields (uniform, mixed canvas, prefill rows, 2 * CL rows, budget-cut rows): the
    load's timeline counts the steps in its window vLLM 0.26 could not replay as one FULL graph, those mixing
    canvas widths, those with a prefill row, and the fused and cut rows; a five-field log (before those fields)
    gives none of these keys."""
    log = tmp_path / "steps.log"
    log.write_text("10.0 10.1 4608 512 3 0 0 1 0 0\n10.1 10.2 768 768 2 0 1 0 1 0\n10.2 10.3 1024 1024 2 1 0 0 2 0\n"
                   "10.3 10.4 640 640 2 0 1 0 0 1\n10.4 10.5 1 1 1 x 0 0 0 0\n")
    steps = st.read_steps(log)
    assert len(steps) == 4 and steps[1] == (10.1, 10.2, 768, 768, 2, 0, 1, 0, 1, 0)
    result = {"start_times": [9.9], "ttfts": [0.2], "itls": [[0.4]], "output_lens": [2]}
    t = st.load_timeline(result, steps)
    assert (t["steps"], t["non_uniform_steps"], t["mixed_canvas_steps"], t["prefill_steps"], t["wide_rows"],
            t["cut_rows"]) == (4, 3, 2, 1, 3, 1)
    assert "non_uniform_steps" not in st.load_timeline(result, [s[:5] for s in steps])


def test_server_command_is_the_benchmarks_with_the_standin_worker():
    env, argv = st.server_command(model="/m", port=8190, max_num_seqs=64, kv_cache_gib=40)
    assert argv[argv.index("--worker-cls") + 1] == st.WORKER_CLASS
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert "--async-scheduling" in argv and argv[argv.index("--quantization") + 1] == "fp8"
    assert env["VLLM_PLUGINS"] == "blockdiff" and "BLOCKDIFF_FUSE_COMMIT" not in env
    env, argv = st.server_command(model="/m", port=8190, max_num_seqs=64, kv_cache_gib=40, async_scheduling=False,
                                  canvas_length=512, fuse_commit=True)
    assert "--no-async-scheduling" in argv and "--async-scheduling" not in argv
    assert argv[argv.index("--scheduler-cls") + 1].endswith(".BlockdiffDiffusionScheduler")
    assert json.loads(argv[argv.index("--diffusion-config") + 1]) == {"canvas_length": 512, "max_denoising_steps": 16}
    assert env["BLOCKDIFF_FUSE_COMMIT"] == "1" and "BLOCKDIFF_FUSE_POLICY" not in env
    with pytest.raises(ValueError, match="fuse_commit"):
        st.server_command(model="/m", port=8190, max_num_seqs=64, kv_cache_gib=40, fuse_commit=1)
    for policy in ("any", "uniform"):
        env, _ = st.server_command(model="/m", port=8190, max_num_seqs=64, kv_cache_gib=40, canvas_length=512,
                                   fuse_commit=True, fuse_policy=policy)
        assert env["BLOCKDIFF_FUSE_POLICY"] == policy
    for bad in ("uniformly", "ANY", 1):
        with pytest.raises(ValueError, match="BLOCKDIFF_FUSE_POLICY must be one of any, uniform"):
            st.server_command(model="/m", port=8190, max_num_seqs=64, kv_cache_gib=40, fuse_policy=bad)


@pytest.mark.parametrize("name, value", [(st.STEP_ENV, "1,2"), (st.HOST_ENV, "x,0"), (st.TOKENS_ENV, "zeros")])
def test_bad_standin_variables_stop_the_run_before_a_server_starts(tmp_path, monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    assert st.main(["run", "--out", str(tmp_path), "--port", "8291"]) == 1
    assert name in capsys.readouterr().err and not (tmp_path / "server.cmd").exists()


@pytest.mark.parametrize("argv", [["--kv-cache-gib", "nan"], ["--kv-cache-gib", "-1"], ["--start-timeout", "nan"],
                                  ["--run-timeout", "-5"], ["--bench-cmd", '"'], ["--port", "0"],
                                  ["--fuse-policy", "all"]])
def test_cli_names_a_bad_option(argv, capsys):
    with pytest.raises(SystemExit) as e:
        st.main(["run", "--out", "/tmp/x", *argv])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FAKE_SERVER = f"{sys.executable} {os.path.join(REPO, 'tests', 'bench', 'serve_standins.py')} serve"
FAKE_CLIENT = f"{sys.executable} {os.path.join(REPO, 'tests', 'bench', 'fake_bench_serve.py')}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(")")[-1].split()[0] != "Z"


def test_run_drives_loads_and_stops_its_server(tmp_path):
    """The driver against a fake server and a fake client (no vLLM): one row per load, the server stopped after,
    its port free again."""
    port = _free_port()
    p = subprocess.run([sys.executable, "-m", "blockdiff.bench.experiments.serve_standin", "run", "--out",
                        str(tmp_path), "--port", str(port), "--concurrency", "1,4", "--server-cmd", FAKE_SERVER,
                        "--bench-cmd", FAKE_CLIENT, "--model", str(tmp_path / "model")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads((tmp_path / "standin.json").read_text())
    assert [r["concurrency"] for r in doc["loads"]] == [1, 4] and all(r["status"] == "ok" for r in doc["loads"])
    assert doc["standin"]["step_ms"] == st.STEP_MS
    assert not _alive(int((tmp_path / "server.pid").read_text())) and st._port_free(port)


def test_a_sigterm_stops_the_server(tmp_path):
    """`timeout` sends SIGTERM: the run must stop the server it started (its own process group), not leave it
    answering on the port for the next run to measure (review of 30ef6de)."""
    import signal
    import time

    port = _free_port()
    env = dict(os.environ, FAKE_BENCH_SLEEP="60")  # the client outlives the signal
    proc = subprocess.Popen([sys.executable, "-m", "blockdiff.bench.experiments.serve_standin", "run", "--out",
                             str(tmp_path), "--port", str(port), "--concurrency", "1", "--server-cmd", FAKE_SERVER,
                             "--bench-cmd", FAKE_CLIENT, "--model", str(tmp_path / "model")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "standin_c1_0.log").exists():
        time.sleep(0.5)  # the server is up and the first load has started
    pid = int((tmp_path / "server.pid").read_text())
    assert _alive(pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.time() + 30
    while time.time() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid) and st._port_free(port)


def test_a_taken_port_is_refused_before_starting(tmp_path, capsys):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert st.main(["run", "--out", str(tmp_path), "--port", str(port), "--server-cmd", FAKE_SERVER]) == 1
    err = capsys.readouterr().err
    assert f"--port {port} is in use" in err and not (tmp_path / "server.cmd").exists()


def test_cli_rejects_bad_concurrency(capsys):
    with pytest.raises(SystemExit) as e:
        st.main(["run", "--out", "/tmp/x", "--concurrency", "0"])
    assert e.value.code == 2 and "--concurrency" in capsys.readouterr().err


def _vllm_026() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None and importlib.metadata.version("vllm") == "0.26.0"
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _vllm_026(),
                    reason="needs vLLM 0.26.0's Python side (tests/integration/vllm_cpu_env.sh 0.26.0)")
def test_standin_server_answers_a_load_with_the_accounting(tmp_path):
    """The real vLLM 0.26 server with the stand-in worker on the CPU: every request answered in full, 16 denoising
    steps a canvas (vLLM's own diffusion metrics), the client's window covering the stand-in's steps."""
    env = dict(os.environ, BLOCKDIFF_STANDIN_STEP_MS="1,0.001,0.002")
    p = subprocess.run([sys.executable, "-m", "blockdiff.bench.experiments.serve_standin", "run", "--platform", "cpu",
                        "--out", str(tmp_path), "--concurrency", "2", "--min-prompts", "2", "--port", "8197"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + (tmp_path / "server.log").read_text()[-3000:]
    (row,) = json.loads((tmp_path / "standin.json").read_text())["loads"]
    assert row["status"] == "ok" and row["failed"] == 0 and row["complete"]
    assert row["diffusion_steps_per_canvas"] == 16.0
    assert row["timeline"]["steps"] >= 2 * 17 and row["timeline"]["gpu_span_s"] <= row["timeline"]["window_s"]


def _standin_run(out, port, *extra):
    env = dict(os.environ, BLOCKDIFF_STANDIN_STEP_MS="1,0.001,0.002")
    p = subprocess.run([sys.executable, "-m", "blockdiff.bench.experiments.serve_standin", "run", "--platform", "cpu",
                        "--out", str(out), "--concurrency", "1", "--prompts", "2", "--port", str(port), *extra],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:] + (out / "server.log").read_text()[-3000:]
    (row,) = json.loads((out / "standin.json").read_text())["loads"]
    return row, st.read_steps(out / "steps.log")


@pytest.mark.skipif(not _vllm_026(),
                    reason="needs vLLM 0.26.0's Python side (tests/integration/vllm_cpu_env.sh 0.26.0)")
def test_standin_server_fuses_commits_under_the_synchronous_scheduler(tmp_path):
    """The real vLLM 0.26 server, synchronous, --diffusion-config canvas_length 512 with BLOCKDIFF_FUSE_COMMIT=1
    against the same without the switch: every request answered in full with the same token count, one step fewer
    per request (2 canvases of 256 each, requests one at a time), each saved step a 512-token fused row."""
    base, base_steps = _standin_run(tmp_path / "base", 8198, "--no-async-scheduling", "--canvas-length", "512")
    fused, fused_steps = _standin_run(tmp_path / "fused", 8199, "--no-async-scheduling", "--canvas-length", "512",
                                      "--fuse-commit")
    for row in (base, fused):
        assert row["status"] == "ok" and row["failed"] == 0 and row["complete"]
    assert fused["output_tokens"] == base["output_tokens"] == 2 * 512
    assert len(base_steps) - len(fused_steps) == 2
    assert sorted(s[3] for s in fused_steps if s[3] > 256) == [512, 512]
    assert not any(s[3] > 256 for s in base_steps)


def test_cli_wants_one_prompt_count_per_concurrency(capsys):
    with pytest.raises(SystemExit) as e:
        st.main(["run", "--out", "/tmp/x", "--concurrency", "1,64", "--prompts", "4"])
    assert e.value.code == 2 and "--prompts" in capsys.readouterr().err


@pytest.mark.parametrize("mode, ids", [("unused", range(259, 1000)), ("bytes_high", range(3 + 128, 3 + 256)),
                                       ("pad", {0}), ("byte_e3", {3 + 0xE3})])
def test_commit_token_gives_each_modes_ids(mode, ids):
    rng = random.Random(0)
    assert {st.commit_token(mode, rng, 1000) for _ in range(300)} <= set(ids)
    with pytest.raises(ValueError, match="mode must be one of"):
        st.commit_token("zeros", rng, 1000)
    with pytest.raises(ValueError, match="vocab must be > 259"):
        st.commit_token(mode, rng, 259)


def test_pad_and_byte_e3_commits_are_text_the_incremental_detokenizer_never_completes(tmp_path):
    """docs/tuning.md 7.19: vLLM's fast incremental detokenizer (tokenizers' DecodeStream, primed with the prompt)
    emits nothing for a repeated <pad> (skip_special_tokens) or a repeated UTF-8 lead byte, so it keeps a growing
    window to re-decode at every token; random <unused_N> tokens give text at once."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.decoders import DecodeStream

    from blockdiff.bench import bench_serve as bs

    bs.write_model_folder(tmp_path / "m")
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    rng, prompt = random.Random(0), [3 + ord(c) for c in "def f(x):\n    return x\n" * 8]
    texts = {}
    for mode in ("unused", "pad", "byte_e3"):
        try:
            stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        except TypeError:  # tokenizers before the prompt-primed stream vLLM 0.26 uses
            pytest.skip("this tokenizers' DecodeStream takes no ids")
        texts[mode] = "".join(stream.step(tok, st.commit_token(mode, rng, 262144)) or "" for _ in range(64))
    assert texts["pad"] == texts["byte_e3"] == "" and texts["unused"].count("<unused_") == 64


def test_detok_times_each_token_mode_per_request(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from blockdiff.bench import bench_serve as bs

    bs.write_model_folder(tmp_path / "m")
    try:
        assert st.main(["detok", "--model", str(tmp_path / "m"), "--prompt-len", "64", "--output-len", "32"]) == 0
    except TypeError:
        pytest.skip("this tokenizers' DecodeStream takes no ids")
    out = json.loads(capsys.readouterr().out)
    ms = out["ms_per_request_special_tokens"]
    assert set(ms) == {"skipped", "kept"} and (out["prompt_len"], out["output_len"]) == (64, 32)
    assert all(set(v) == set(st.TOKEN_MODES) and min(v.values()) >= 0 for v in ms.values())
    with pytest.raises(ValueError, match="prompt_len and output_len must be >= 1"):
        st.detokenizer_ms(tmp_path / "m" / "tokenizer.json", prompt_len=0)
    with pytest.raises(TypeError, match="skip_special_tokens must be a bool"):
        st.detokenizer_ms(tmp_path / "m" / "tokenizer.json", skip_special_tokens="no")
