"""bench/experiments/device/serve_fused.sh with DRY=1 (the server command only, no GPU, no env.sh): each variant's
scheduling mode, scheduler class, canvas length and fused-commit switch."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "bench/experiments/device/serve_fused.sh"
PKG = "blockdiff.integration.vllm_scheduler."


def _dry(variant, tmp_path, *extra, policy=None):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path)}
    env.pop("FUSE_POLICY", None)
    if policy is not None:
        env["FUSE_POLICY"] = policy
    r = subprocess.run(["bash", SCRIPT, variant, *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("variant, asynchronous, canvas, fuse", [
    ("parity", False, 64, True), ("parity_async", True, 64, True), ("fused", False, 512, True),
    ("fused_async", True, 512, True), ("layout", False, 512, False), ("sync", False, 256, False)])
def test_serve_fused_variants(tmp_path, variant, asynchronous, canvas, fuse):
    cmd = _dry(variant, tmp_path, "fp8", "cute") if not variant.startswith("parity") else _dry(variant, tmp_path)
    sched = "BlockdiffDiffusionAsyncScheduler" if asynchronous else "BlockdiffDiffusionScheduler"
    assert f"--scheduler-cls {PKG}{sched}" in cmd
    assert ("--no-async-scheduling" in cmd) is not asynchronous
    assert ("BLOCKDIFF_FUSE_COMMIT=1" in cmd) is fuse and "BLOCKDIFF_FUSE_POLICY" not in cmd
    if not (variant.startswith("parity") and Path("/tmp/exp/config.json").exists()):  # else that export's 2 * CL
        assert f'"canvas_length":{canvas}' in cmd
    if variant.startswith("parity"):  # both parity servers as before: float32, eager
        assert "--enforce-eager" in cmd and "--dtype float32" in cmd
        assert "--kv-cache-memory-bytes 1G" in cmd  # no memory profiling: the harness frees memory beside it


def test_serve_fused_refuses_an_unknown_variant(tmp_path):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path)}
    r = subprocess.run(["bash", SCRIPT, "fused_sync"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "fused_async" in r.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("variant, fuse", [("parity", True), ("parity_async", True), ("fused", True),
                                           ("fused_async", True), ("layout", False), ("sync", False)])
def test_serve_fused_passes_the_fuse_policy_to_the_fusing_servers(tmp_path, variant, fuse):
    """FUSE_POLICY=uniform / any reaches the fusing servers' environment as BLOCKDIFF_FUSE_POLICY (the rest of the
    command as without it); layout and sync fuse nothing and leave it out."""
    extra = () if variant.startswith("parity") else ("fp8", "cute")
    plain = _dry(variant, tmp_path, *extra)
    for policy in ("uniform", "any"):
        cmd = _dry(variant, tmp_path, *extra, policy=policy)
        assert (f"BLOCKDIFF_FUSE_POLICY={policy}" in cmd) is fuse
        assert cmd.replace(f" BLOCKDIFF_FUSE_POLICY={policy}", "") == plain


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_serve_fused_refuses_an_unknown_fuse_policy(tmp_path):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path),
           "FUSE_POLICY": "uniformly"}
    r = subprocess.run(["bash", SCRIPT, "fused_async", "fp8", "cute"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "FUSE_POLICY must be any or uniform" in r.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("block", ["parity", "bench"])
def test_serve_fused_prints_the_schedulers_last_fused_commit_coverage_line(tmp_path, block):
    """The log greps at the end of the parity variants (``$LOG``) and of the benchmark variants (``$W/$name.log``),
    run over a server log with the plugin's lines: the start line and the last coverage line of
    vllm_scheduler.FusedCommitCounts (the load's final count) are printed, each once, even after many coverage
    lines."""
    from blockdiff.integration.vllm_scheduler import FusedCommitCounts

    c = FusedCommitCounts(32, "asynchronous")
    start = "blockdiff: fused commits, asynchronous scheduler, fuse policy any (BLOCKDIFF_FUSE_POLICY)"
    log = [f"(EngineCore_DP0 pid=7) INFO 12-06 10:00:00 [vllm_scheduler.py:876] {start}"]
    for k in range(30):
        c.num_fused, c.num_plain = k, 2 * k
        log.append(f"(EngineCore_DP0 pid=7) INFO 12-06 10:00:{k:02d} [vllm_scheduler.py:351] {c.summary()}")
    final = c.summary("no request left")
    log.append(f"(EngineCore_DP0 pid=7) INFO 12-06 10:01:00 [vllm_scheduler.py:351] {final}")
    (tmp_path / "x.log").write_text("\n".join(log) + "\n")
    text = (ROOT / SCRIPT).read_text()
    target = "$LOG" if block == "parity" else "$W/$name.log"
    greps = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("grep") and target in ln]
    assert greps
    r = subprocess.run(["bash", "-c", "\n".join(greps)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LOG": str(tmp_path / "x.log"), "W": str(tmp_path), "name": "x"})
    out = r.stdout.splitlines()
    assert sum(start in ln for ln in out) == 1 and sum(final in ln for ln in out) == 1, r.stdout + r.stderr
    assert sum("fused commits so far" in ln for ln in out) <= 3  # the last few, not all 31


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("variant, cap, env_cap", [("parity_async", 3, None), ("parity", 16, None),
                                                    ("parity_async", 5, "5")])
def test_parity_async_runs_both_sides_at_a_step_cap_the_canvases_reach(tmp_path, variant, cap, env_cap):
    """Was: parity_async ran at the step cap 16, which the exported model's canvases never reach (they converge
    after 3-4.5 steps), so nothing fused and the run checked plain commits only (2026-12-06, H100: "0 of 24 commits
    fused"). The asynchronous variant now runs harness and clients at 3 (every canvas reaches it); STEP_CAP
    overrides; the synchronous parity keeps 16."""
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path)}
    env.pop("STEP_CAP", None)
    if env_cap is not None:
        env["STEP_CAP"] = env_cap
    r = subprocess.run(["bash", SCRIPT, variant], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"step cap {cap}" in r.stdout.splitlines()
    text = (ROOT / SCRIPT).read_text()
    assert text.count("--step-cap $cap") == 3  # the harness and both clients


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("bad", ["0", "x", "-1", "03", "16384", "99999999999999999999"])
def test_serve_fused_refuses_a_bad_step_cap(tmp_path, bad):
    env = {**os.environ, "DRY": "1", "SERVE_BENCH_ENV": "0", "SERVE_BENCH_DIR": str(tmp_path), "OUT": str(tmp_path),
           "STEP_CAP": bad}
    r = subprocess.run(["bash", SCRIPT, "parity_async"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "STEP_CAP must be an int >= 1" in r.stdout


def test_parity_variants_never_compare_a_client_record_of_an_earlier_run():
    """Was: the client records ($OUT/<tag>.json, <tag>_all.json) were compared whenever the file existed, so when this
    run's server never came up (no client ran) the comparison read an earlier run's record at the same step cap and
    printed its "equal: 6 of 6". They are removed before this run's clients."""
    text = (ROOT / SCRIPT).read_text()
    rm = text.index("rm -f $OUT/$tag.json $OUT/${tag}_all.json")
    assert rm < text.index("--out $OUT/$tag.json") and rm < text.index("--out $OUT/${tag}_all.json")


AB_SCRIPT = "bench/experiments/device/serve_fused_ab.sh"


def _ab_dry(tmp_path, *args, **env_extra):
    """serve_fused_ab.sh with DRY=1 and the default budgets: the completed process."""
    env = {**os.environ, "DRY": "1", "OUT": str(tmp_path), **env_extra}
    env.pop("BUDGET_S", None)
    env.pop("BUDGET2_S", None)
    return subprocess.run(["bash", AB_SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_fused_ab_runs_the_unfused_then_the_fused_server_in_one_command(tmp_path):
    """serve_fused_ab.sh (7.52's A/B in one call): the unfused asynchronous server kept for its sweep, then
    serve_fused.sh fused_async, same quant and attention, within 600 s (300 + 200 s budgets); bad arguments
    refused. Before each server it frees the GPU (the parity server that serve_fused.sh's parity variants leave up
    held 3.5 GiB in 7.52)."""
    r = _ab_dry(tmp_path, "fp8", "cute")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["unfused", "fused_async"]
    assert "KEEP=1 BUDGET_S=300" in lines[0] and "serve_alone.sh blockdiff fp8 cute" in lines[0]
    assert "BUDGET_S=200" in lines[1] and "serve_fused.sh fused_async fp8 cute" in lines[1]
    text = (ROOT / AB_SCRIPT).read_text()
    assert 'pkill -f "serve /tmp/exp"' in text and "serve_bench.sh stop" in text
    bad = _ab_dry(tmp_path, "fp16")
    assert bad.returncode == 2 and "quant must be fp8 or bf16" in bad.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("phases, labels, budgets", [
    ("unfused", ["unfused"], ["BUDGET_S=570"]),
    ("fused_async", ["fused_async"], ["BUDGET_S=570"]),
    ("unfused,fused_async", ["unfused", "fused_async"], ["BUDGET_S=300", "BUDGET_S=200"]),
])
def test_fused_ab_phases_split_the_a_b_over_two_calls_when_a_cold_start_does_not_fit_one(tmp_path, phases, labels,
                                                                                         budgets):
    """Under dummy_live the unfused server was healthy after 212 s on a cold H100 and its sweep's c1 was skipped at
    the one-call 300 s budget (2026-12-06): PHASES runs one server per call, each with 570 s."""
    r = _ab_dry(tmp_path, "fp8", "cute", PHASES=phases)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == labels
    assert all(b in ln for b, ln in zip(budgets, lines))
    bad = _ab_dry(tmp_path, "fp8", "cute", PHASES="fused_async,unfused")
    assert bad.returncode == 2 and "PHASES must be" in bad.stdout
