# Sourced by the small-server parity scripts (serve_checks.sh, serve_graph_parity.sh): the elapsed-time log line,
# a server's health probe and its failed-start test. V runs vLLM's CLI.
V="python3 -m vllm.entrypoints.cli.main"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health')" 2>/dev/null; }  # port
dead() { grep -q "initialization failed\|Traceback\|Error in memory profiling" $1; }  # server log
