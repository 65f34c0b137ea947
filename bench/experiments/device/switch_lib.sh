# Sourced by the experiment-switch scripts (cute_roles_switch.sh, cute_mixed_switch.sh) after env.sh, with $OUT, $t
# (seconds a shard) and $SWITCH set:
#  switch_run MODULE CLASS ON LOG [pytest arguments]: the GPU tests (-m gpu) with the class attributes of MODULE.CLASS
#    named in $SWITCH (one, or several separated by commas) set to ON (1 / 0) before any compile, at most $t s, into
#    $OUT/LOG.log;
#  switch_logs: each shard log's result lines and first failures;
#  switch_pack: the shard logs concatenated into $OUT/shards.log (with a header each) and removed, since at most 8
#    files come back from $OUT.
switch_run() {
  local mod=$1 cls=$2 on=$3 log=$4; shift 4
  timeout $t python3 -c "
import sys, pytest
from $mod import $cls as C
for name in '$SWITCH'.split(','):
    assert hasattr(C, name), 'no switch ' + name
    setattr(C, name, bool($on))
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider', '-rf', '--maxfail=5'] + sys.argv[1:]))
" "$@" > $OUT/$log.log 2>&1 < /dev/null
}
switch_logs() {
  local f
  for f in $OUT/sw_*.log; do
    [ -f "$f" ] || continue
    echo "== $f"; grep -E "passed|failed|error" $f | tail -2; grep -E "^FAILED|Timeout" $f | head -5
  done
}
switch_pack() {
  local f
  for f in $OUT/sw_*.log; do
    [ -f "$f" ] || continue
    echo "===== $(basename $f)"; cat "$f"
  done > $OUT/shards.log
  rm -f $OUT/sw_*.log
}
