# Source on the GPU machine (which runs the working tree without pip):  source bench/device_env.sh
# Makes `import blockdiff.<pkg>` (bench included: python3 -m blockdiff.bench.<name>) resolve to this checkout's
# top-level folders through a symlinked namespace.
_bd_root=$(pwd)
mkdir -p /tmp/bdpath/blockdiff
for _p in attention sampler model integration bench; do ln -sfn "$_bd_root/$_p" /tmp/bdpath/blockdiff/$_p; done
export PYTHONPATH=/tmp/bdpath:$_bd_root${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
unset _bd_root _p
