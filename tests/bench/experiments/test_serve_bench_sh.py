"""bench/experiments/device/serve_bench.sh on the CPU: its wait / bench / profile / stop phases against two fake vLLM
servers (tests/bench/serve_standins.py) and the stand-in client (tests/bench/fake_bench_serve.py), so a shell
mistake shows here and not in the GPU lease. ``start`` launches real servers and is not run here."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SCRIPT = REPO / "bench" / "experiments" / "device" / "serve_bench.sh"
STANDINS = REPO / "tests" / "bench" / "serve_standins.py"


#: The scripts derive every port from PORT0 (serve_bench.sh: stock PORT0, blockdiff-triton +1, blockdiff-cute +5),
#: so a test needs PORT0 .. PORT0 + 5 free, and a fake server binds them only after the check: each pytest-xdist
#: worker (README runs ``-n 2``) searches its own range of bases, so two workers never pick the same ports (Linux
#: hands out ephemeral ports from 32768 up).
PORT_SPAN = 6
WORKER_RANGE = 500


def _two_free_ports() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    first = 18041 + WORKER_RANGE * ((int(worker[2:]) if worker[2:].isdigit() else 0) % 29)  # below 32768
    for base in range(first, first + WORKER_RANGE - PORT_SPAN + 1, PORT_SPAN + 1):
        socks = []
        try:
            for p in range(base, base + PORT_SPAN):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.skip(f"no {PORT_SPAN} consecutive free ports from {first}")


def _run(phase, env, *args, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), phase, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@contextlib.contextmanager
def _fake_server(port: int, trace_dir: Path):
    p = subprocess.Popen([sys.executable, str(STANDINS), "serve", str(port), str(trace_dir)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()
        p.wait()


def test_phases_against_fake_servers(tmp_path):
    base = _two_free_ports()
    work, out = tmp_path / "w", tmp_path / "out"
    env = dict(os.environ, SERVE_BENCH_ENV="0", SERVE_BENCH_DIR=str(work), OUT=str(out), PORT0=str(base),
               BENCH_CMD=f"{sys.executable} {REPO / 'tests' / 'bench' / 'fake_bench_serve.py'}", CONC="1,4",
               WAIT_S="10", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", TMPDIR=str(tmp_path))
    with _fake_server(base, work / "trace_vllm-fp8"), _fake_server(base + 1, work / "trace_blockdiff-triton-fp8"):
        p = _run("wait", env)
        assert p.returncode == 0 and "blockdiff-triton-fp8 healthy" in p.stdout and "vllm-fp8 healthy" in p.stdout, \
            p.stdout + p.stderr
        p = _run("bench", env)
        assert p.returncode == 0, p.stdout + p.stderr
        lines = [json.loads(x) for x in (out / "serve_rows_fp8.jsonl").read_text().splitlines()]
        rows = [x for x in lines if "env" not in x]
        assert [(r["backend"], r["concurrency"]) for r in rows] == [("blockdiff-triton", 1), ("blockdiff-triton", 4),
                                                                    ("vllm", 1), ("vllm", 4)]
        assert sum("env" in x for x in lines) == 2 and all(r["complete"] for r in rows)
        assert [r["max_num_seqs"] for r in rows] == [32, 32, 16, 16]
        assert "goal c1_fp8_vs_vllm" in p.stdout  # the provisional record's goals, printed last
        p = _run("profile", dict(env, PROFILE_REQUESTS="2"), "fp8", "triton", "vllm")  # the fake trace: 2 canvases
        assert p.returncode == 0, p.stdout + p.stderr
        prof = json.loads((out / "serve_profile_vllm_fp8.json").read_text())
        assert prof["status"] == "ok" and prof["canvas_steps"] == 4
    p = _run("bench", env)
    assert "not healthy: skipped" in p.stdout
    assert _run("stop", env).returncode == 0
    assert _run("bench", env, "int4").returncode == 2


def test_interleaved_bench_runs_one_concurrency_at_a_time_on_both_sides(tmp_path):
    """INTERLEAVE=1: c1 on both sides, then c4 on both (a lease that ends early keeps same-run pairs); each side's
    warm-up only before its first run; the record is built from the rows of the several sweeps."""
    base = _two_free_ports()
    work, out = tmp_path / "w", tmp_path / "out"
    env = dict(os.environ, SERVE_BENCH_ENV="0", SERVE_BENCH_DIR=str(work), OUT=str(out), PORT0=str(base),
               BENCH_CMD=f"{sys.executable} {REPO / 'tests' / 'bench' / 'fake_bench_serve.py'}", CONC="1,4",
               INTERLEAVE="1", TOTAL_S="200", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               TMPDIR=str(tmp_path))
    with _fake_server(base, work / "trace_vllm-fp8"), _fake_server(base + 1, work / "trace_blockdiff-triton-fp8"):
        p = _run("bench", env)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [json.loads(x) for x in (out / "serve_rows_fp8.jsonl").read_text().splitlines()]
    rows = [x for x in lines if "env" not in x]
    assert [(r["backend"], r["concurrency"]) for r in rows] == [("blockdiff-triton", 1), ("vllm", 1),
                                                                ("blockdiff-triton", 4), ("vllm", 4)]
    envs = [x["env"] for x in lines if "env" in x]
    assert [e.get("warm_up", {}).get("concurrency") for e in envs] == [32, 16, None, None]
    assert "goal c1_fp8_vs_vllm" in p.stdout


def test_serve_alone_runs_one_side_start_to_stop_with_64_seqs(tmp_path):
    """serve_alone.sh: start (a stand-in server through SERVER_CMD), wait, the sweep at max-num-seqs 64, a
    profile, stop: rows of that side only, the server gone afterwards."""
    base = _two_free_ports()
    work, out = tmp_path / "w", tmp_path / "out"
    env = dict(os.environ, SERVE_BENCH_ENV="0", SERVE_BENCH_DIR=str(work), OUT=str(out), PORT0=str(base),
               BENCH_CMD=f"{sys.executable} {REPO / 'tests' / 'bench' / 'fake_bench_serve.py'}", CONC="1,4",
               SERVER_CMD=f"{sys.executable} {STANDINS} serve", PROFILE_REQUESTS="2", BUDGET_S="200",
               WAIT_S="30", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", TMPDIR=str(tmp_path))
    p = subprocess.run(["bash", str(SCRIPT.parent / "serve_alone.sh"), "blockdiff", "fp8"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "blockdiff-triton-fp8 healthy" in p.stdout and "stopped blockdiff-triton-fp8" in p.stdout
    rows = [json.loads(x) for x in (out / "serve_rows_fp8.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "env" not in r]
    assert [(r["backend"], r["concurrency"], r["max_num_seqs"]) for r in rows] == [("blockdiff-triton", 1, 64),
                                                                                   ("blockdiff-triton", 4, 64)]
    assert json.loads((out / "serve_profile_blockdiff-triton_fp8.json").read_text())["status"] == "ok"
    assert not list(work.glob("*.pid"))
    bad = subprocess.run(["bash", str(SCRIPT.parent / "serve_alone.sh"), "both"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "side must be" in bad.stdout


def test_serve_alone_keep_runs_the_sweep_only_and_leaves_the_server_for_the_next_command(tmp_path):
    """KEEP=1 (docs/tuning.md 7.12: a 64-request profile does not fit after a sweep in one command): the sweep, no
    profile, no stop; the next commands profile the same server and stop it."""
    base = _two_free_ports()
    work, out = tmp_path / "w", tmp_path / "out"
    env = dict(os.environ, SERVE_BENCH_ENV="0", SERVE_BENCH_DIR=str(work), OUT=str(out), PORT0=str(base),
               BENCH_CMD=f"{sys.executable} {REPO / 'tests' / 'bench' / 'fake_bench_serve.py'}", CONC="1",
               SERVER_CMD=f"{sys.executable} {STANDINS} serve", BUDGET_S="200", KEEP="1",
               WAIT_S="30", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", TMPDIR=str(tmp_path))
    try:
        p = subprocess.run(["bash", str(SCRIPT.parent / "serve_alone.sh"), "vllm", "fp8"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "server kept (KEEP=1)" in p.stdout and "stopped" not in p.stdout
        assert not (out / "serve_profile_vllm_fp8.json").exists() and list(work.glob("*.pid"))
        prof = _run("profile", dict(env, PROFILE_REQUESTS="2"), "fp8", "triton", "vllm")
        assert prof.returncode == 0, prof.stdout + prof.stderr
        assert json.loads((out / "serve_profile_vllm_fp8.json").read_text())["status"] == "ok"
        # a later bench on the kept server, without SEQS (serve_bench.sh's own default is 16): its rows carry the
        # server's 64 (docs/tuning.md 7.26: a c64 row was labelled 16 this way)
        (out / "serve_rows_fp8.jsonl").unlink()
        again = _run("bench", dict(env, CONC="4", INTERLEAVE="1", TOTAL_S="120"), "fp8", "triton", "vllm")
        assert again.returncode == 0, again.stdout + again.stderr
        rows = [json.loads(x) for x in (out / "serve_rows_fp8.jsonl").read_text().splitlines()]
        assert [(r["concurrency"], r["max_num_seqs"]) for r in rows if "env" not in r] == [(4, 64)]
        assert _run("info", env, "fp8", "triton", "vllm").stdout.split()[2] == "64"
    finally:
        stop = _run("stop", env)
    assert "stopped vllm-fp8" in stop.stdout and not list(work.glob("*.pid"))
    assert _run("info", env, "fp8", "triton", "vllm").stdout.split()[2] == "16"  # stopped: the default again


def test_serve_profiles_keeps_one_profile_per_batched_load_then_stops(tmp_path):
    """serve_profiles.sh: start one side (a stand-in server), wait, per request count R in REQS a warm-up load of R
    then a profile of R, each kept
    under its own name (the next does not overwrite it), stop; a bad side is refused before anything starts."""
    base = _two_free_ports()
    work, out = tmp_path / "w", tmp_path / "out"
    env = dict(os.environ, SERVE_BENCH_ENV="0", SERVE_BENCH_DIR=str(work), OUT=str(out), PORT0=str(base),
               BENCH_CMD=f"{sys.executable} {REPO / 'tests' / 'bench' / 'fake_bench_serve.py'}",
               SERVER_CMD=f"{sys.executable} {STANDINS} serve", REQS="1,2", BUDGET_S="200",
               WAIT_S="30", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", TMPDIR=str(tmp_path))
    p = subprocess.run(["bash", str(SCRIPT.parent / "serve_profiles.sh"), "blockdiff", "fp8", "cute"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "profile R=1 done" in p.stdout and "profile R=2 done" in p.stdout, p.stdout
    for r in (1, 2):
        prof = json.loads((out / f"serve_profile_blockdiff-cute_fp8_r{r}.json").read_text())
        assert prof["status"] == "ok" and prof["requests"] == r, prof
        assert prof["warm_up"] == dict(prof["warm_up"], requests=r, ok=True)  # an unprofiled load of R first
    assert not (out / "serve_profile_blockdiff-cute_fp8.json").exists()
    assert "stopped blockdiff-cute-fp8" in p.stdout and not list(work.glob("*.pid"))
    bad = subprocess.run(["bash", str(SCRIPT.parent / "serve_profiles.sh"), "both"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "side must be" in bad.stdout


def test_device_scripts_background_servers_never_hold_the_callers_output():
    """`up PORT || setsid ... &` backgrounds a subshell that keeps the caller's stdout open while the server runs,
    so `script | tail` waits until the command's limit (serve_parity.sh, sixth lease): every such list is wrapped
    as `(up PORT || setsid ... < /dev/null) > /dev/null 2>&1 &`, optionally behind a `[ ... ] && { ... }` guard."""
    import re
    from pathlib import Path

    folder = Path(__file__).resolve().parents[3] / "bench" / "experiments" / "device"
    wrapped = re.compile(r"^(\[ [^]]* \] && \{ )?\(up \S+ \|\| setsid [^()]*< /dev/null\) > /dev/null 2>&1 &( \})?$")
    seen = 0
    for script in sorted(folder.glob("*.sh")):
        for line in script.read_text().replace("\\\n", " ").splitlines():  # continuation lines joined
            if "|| setsid" in line:
                seen += 1
                assert wrapped.match(line.strip()), f"{script.name}: {line.strip()[:160]!r}"
    assert seen >= 5


def test_info_phase_names_each_sides_port_seqs_and_pid_file(tmp_path):
    """serve_host.sh reads the side's backend, port, max-num-seqs and pid file from ``info`` (no duplicated port
    arithmetic); cute moves blockdiff's port by 5, bf16 the base by 2."""
    env = dict(os.environ, SERVE_BENCH_ENV="0", SERVE_BENCH_DIR=str(tmp_path), OUT=str(tmp_path / "out"))
    r = _run("info", env, "fp8", "cute", "both")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"blockdiff-cute 8046 32 16 0.55 {tmp_path}/blockdiff-cute-fp8.pid",
                                     f"vllm 8041 16 8 0.35 {tmp_path}/vllm-fp8.pid"]
    r = _run("info", dict(env, BD_SEQS="64"), "bf16", "triton", "blockdiff")
    assert r.stdout.split() == ["blockdiff-triton", "8044", "64", "8", "0.47", f"{tmp_path}/blockdiff-triton-bf16.pid"]
    assert "info" in _run("bogus", env).stdout


@pytest.mark.parametrize("with_pyspy", [False, True])
def test_serve_host_runs_two_c64_loads_with_host_cpu_then_stops(tmp_path, with_pyspy):
    """serve_host.sh (docs/tuning.md 7.13): start a stand-in server, the warm-up and a c64 load, a second c64 load
    (py-spy on the server's processes when its wheel is there, else without), rows with host_cpu, stop."""
    wheels = REPO / ".device" / "pyspy"
    if with_pyspy and not list(wheels.glob("py_spy-*.whl")):
        pytest.skip("no py-spy wheel under .device/pyspy (the device staging brings it)")
    base = _two_free_ports()
    work, out = tmp_path / "w", tmp_path / "out"
    env = dict(os.environ, SERVE_BENCH_ENV="0", SERVE_BENCH_DIR=str(work), OUT=str(out), PORT0=str(base),
               BENCH_CMD=f"{sys.executable} {REPO / 'tests' / 'bench' / 'fake_bench_serve.py'}",
               SERVER_CMD=f"{sys.executable} {STANDINS} serve", BUDGET_S="200", WAIT_S="30", PYSPY_S="2",
               PYSPY_WHEEL_DIR=str(wheels if with_pyspy else tmp_path / "none"),
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", TMPDIR=str(tmp_path))
    p = subprocess.run(["bash", str(SCRIPT.parent / "serve_host.sh"), "vllm", "fp8"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [json.loads(x) for x in (out / "host_rows_vllm_a1.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "env" not in r]
    assert [(r["workload"], r["max_num_seqs"]) for r in rows] == [("serve_c64_fp8", 64)] * 2
    assert all(r["host_cpu"]["samples"] >= 1 for r in rows), rows
    assert ("no py-spy wheel" in p.stdout) is not with_pyspy
    if with_pyspy:  # --idle: the stand-in server only waits, and its waiting threads are sampled all the same
        top = (out / "pyspy_top_vllm_a1.txt").read_text()
        assert int(top.split()[0]) > 0 and "wait" in top, top
    assert "stopped vllm-fp8" in p.stdout and not list(work.glob("*.pid"))
