# Sourced by the small-server parity scripts (serve_checks.sh, serve_graph_parity.sh, serve_parity.sh, serve_fused.sh's
# parity variants): the elapsed-time log line, a server's health probe and its failed-start test, and the command's
# overall cap. V runs vLLM's CLI.
# Every small server these scripts start passes --kv-cache-memory-bytes: with it vLLM skips its memory profiling,
# whose check (free memory may not grow while it profiles) fails a server that starts while the harness or another
# server on the GPU frees memory (2026-12-06, serve_fused.sh parity_async: "Error in memory profiling", 1.9 GiB).
# The cap: the run tool stops a command at 600 s and keeps only what is under $OUT by then, so a hung client or a
# server that never comes up must not eat the records. `left` is the seconds until DEADLINE_S (default 570) after
# the sourcing, less RESERVE_S (default 30) kept for writing the record and copying the logs; `capped CMD...` runs CMD
# under `timeout` for what is left (exit 124, and a log line, when nothing is left).
V="python3 -m vllm.entrypoints.cli.main"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=5)" 2>/dev/null; }  # port
dead() { grep -q "initialization failed\|Traceback\|Error in memory profiling" $1; }  # server log
left() { echo $(( T0 + ${DEADLINE_S:-570} - ${RESERVE_S:-30} - $(date +%s) )); }
capped() {
  local l; l=$(left)
  if [ "$l" -le 5 ]; then el "deadline: skipped $*" >&2; return 124; fi
  timeout "$l" "$@"; local rc=$?; [ $rc = 124 ] && el "deadline: stopped $*" >&2; return $rc
}
