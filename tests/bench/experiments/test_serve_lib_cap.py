"""serve_lib.sh's overall cap on the parity scripts (`left`, `capped`): a hung client or harness is stopped before
the run tool's 600 s limit, so the record and log tails written after it still come back. CPU only, bash."""
import subprocess
import time

LIB = "bench/experiments/device/serve_lib.sh"


def _bash(body: str, **env: str) -> subprocess.CompletedProcess:
    prefix = "".join(f"export {k}={v}; " for k, v in env.items())
    return subprocess.run(["bash", "-c", f"{prefix}source {LIB}; {body}"], capture_output=True, text=True, timeout=60)


def test_capped_stops_a_command_that_outlives_the_deadline():
    t = time.monotonic()
    r = _bash("capped sleep 30; echo rc=$?", DEADLINE_S="8", RESERVE_S="0")
    assert time.monotonic() - t < 20
    assert "rc=124" in r.stdout
    assert "deadline: stopped sleep 30" in r.stderr


def test_capped_skips_a_command_when_only_the_reserve_is_left():
    r = _bash("capped echo ran; echo rc=$?", DEADLINE_S="20", RESERVE_S="18")
    assert "ran" not in r.stdout.replace("rc=", "")
    assert "rc=124" in r.stdout
    assert "deadline: skipped echo ran" in r.stderr


def test_capped_passes_a_quick_command_and_its_exit_status_through():
    r = _bash("capped bash -c 'echo out; exit 3'; echo rc=$?")
    assert r.stdout.splitlines() == ["out", "rc=3"]
    assert r.stderr == ""


def test_left_counts_down_from_the_deadline_less_the_reserve():
    r = _bash("left", DEADLINE_S="100", RESERVE_S="30")
    assert 68 <= int(r.stdout) <= 70


def test_every_parity_script_caps_its_harness_and_client_calls():
    """No uncapped `python3 $M harness|client` line in the scripts that source the cap (a regression would let a hung
    request eat the whole record again)."""
    import re
    for script in ("serve_parity.sh", "serve_graph_parity.sh", "serve_fused.sh"):
        text = open(f"bench/experiments/device/{script}").read()
        assert "source bench/experiments/device/serve_lib.sh" in text, script
        calls = re.findall(r"^.*python3 \$M (?:harness|client).*$", text, flags=re.M)
        assert calls, script
        assert all("capped python3 $M" in c for c in calls), (script, [c for c in calls if "capped" not in c])


def test_small_servers_fix_their_kv_cache_so_a_memory_freeing_neighbour_cannot_fail_their_start():
    """Every device script that starts a small vLLM server (`$V serve /tmp/exp ...`, beside the harness or another
    server) fixes its KV cache with --kv-cache-memory-bytes, which skips vLLM's memory profiling and its check that
    free memory does not grow meanwhile: without it serve_fused.sh parity_async failed to start on an H100
    (2026-12-06, "Error in memory profiling", the harness freeing 1.9 GiB beside it)."""
    import glob
    import re
    scripts = []
    for path in sorted(glob.glob("bench/experiments/device/*.sh")):
        text = open(path).read().replace("\\\n", " ")  # backslash-continued lines joined
        serves = [line for line in text.splitlines() if re.search(r"\$V serve /tmp/exp", line)]
        if not serves:
            continue
        scripts.append(path)
        for line in serves:  # the flags inline, or in $C, whose every C="--language-model-only ..." line has them
            assert "--kv-cache-memory-bytes" in line or "$C" in line, (path, line)
        flags = re.findall(r"^\s*C=\"(--language-model-only[^\"]*)\"", text, flags=re.M)
        assert all("--kv-cache-memory-bytes" in f for f in flags), (path, flags)
    assert {"serve.sh", "serve_parity.sh", "serve_fused.sh", "serve_graph_parity.sh", "serve_checks.sh"} <= {
        p.rsplit("/", 1)[1] for p in scripts}, scripts
