# Sourced by the experiment-switch scripts (cute_roles_switch.sh, cute_mixed_switch.sh) after env.sh, with $OUT, $t
# (seconds a shard) and $SWITCH (switch_run's class attributes) set:
#  switch_run MODULE CLASS ON LOG [pytest arguments]: the GPU tests (-m gpu) with the class attributes of MODULE.CLASS
#    named in $SWITCH (one, or several separated by commas) set to ON (1 / 0) before any compile, at most $t s, into
#    $OUT/LOG.log;
#  config_run FIELD VALUE LOG [pytest arguments]: the GPU tests with the cute config field FIELD set to VALUE (a Python
#    literal, e.g. True) in every call's config before it resolves (interface.resolve_launch_config wrapped, so the
#    config's own rules still apply: where the field cannot act it resolves as it would; the config is part of the
#    compile key), at most $t s, into $OUT/LOG.log; a test's own value of FIELD is overridden;
#  gpu_run LOG [pytest arguments]: the GPU tests as they are (tests that set the switch themselves), at most $t s,
#    into $OUT/LOG.log;
#  switch_logs: each shard log's result lines and first failures;
#  gpu_health: after the shards, a few lines into $OUT/sw_gpu_health.log (packed with the shard logs):
#    nvidia-smi's view, then a CUDA round trip in a fresh process, capped at 20 s. A GPU a shard left hung (a
#    barrier that never completes) shows as FAIL here (rc 124: the cap), not as the next shard's time-out;
#  switch_pack: the shard logs concatenated into $OUT/shards.log (with a header each) and removed, since at most 8
#    files come back from $OUT.
# NO_AUTO_RECOMPUTE=1 (both runners): nan_safe_v_method "auto" keeps the scan at every head dim, for the scan's own
# switches (docs/tuning.md 2.35: "auto" takes the recompute at hd 256, where they do not act); named methods stay.
_no_auto_recompute() {
  [ "${NO_AUTO_RECOMPUTE:-0}" = 1 ] && echo "import blockdiff.attention.cute.config as _cc; _cc.AUTO_RECOMPUTE_HEAD_DIMS = frozenset()"
}
switch_run() {
  local mod=$1 cls=$2 on=$3 log=$4; shift 4
  timeout -k 15 $t python3 -c "
import sys, pytest
from $mod import $cls as C
$(_no_auto_recompute)
for name in '$SWITCH'.split(','):
    assert hasattr(C, name), 'no switch ' + name
    setattr(C, name, bool($on))
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider', '-rf', '--maxfail=5'] + sys.argv[1:]))
" "$@" > $OUT/$log.log 2>&1 < /dev/null
}
config_run() {
  local field=$1 value=$2 log=$3; shift 3
  timeout -k 15 $t python3 -c "
import dataclasses, sys, pytest
from blockdiff.attention.cute import config as C, interface as I
$(_no_auto_recompute)
C.check_config({'$field': $value})  # a bad field or value fails here, not in every test
real = I.resolve_launch_config
def forced(head_dim, head_dim_v, window_size, config=None, **kw):
    if isinstance(config, C.CuteConfig):
        config = dataclasses.replace(config, $field=$value)
    else:
        config = dict(config or {}, $field=$value)
    return real(head_dim, head_dim_v, window_size, config, **kw)
I.resolve_launch_config = forced
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider', '-rf', '--maxfail=5'] + sys.argv[1:]))
" "$@" > $OUT/$log.log 2>&1 < /dev/null
}
gpu_run() {
  local log=$1; shift
  timeout -k 15 $t python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=5 "$@" > $OUT/$log.log 2>&1 < /dev/null
}
switch_logs() {
  local f
  for f in $OUT/sw_*.log; do
    [ -f "$f" ] || continue
    echo "== $f"
    case $f in *sw_gpu_health.log) cat $f; continue ;; esac
    grep -E "passed|failed|error" $f | tail -2; grep -E "^FAILED|Timeout" $f | head -5
  done
}
gpu_health() {
  { date -u +%T; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>&1
    timeout -k 5 20 python3 -c "import torch; print('cuda round trip', torch.ones(4, device='cuda').sum().item())" \
      2>&1 \
      || echo "FAIL: no CUDA round trip (rc $?; 124: none in 20 s)"; } > $OUT/sw_gpu_health.log
}
switch_pack() {
  local f
  for f in $OUT/sw_*.log; do
    [ -f "$f" ] || continue
    echo "===== $(basename $f)"; cat "$f"
  done > $OUT/shards.log
  rm -f $OUT/sw_*.log
}
