# Sourced first by the cute device scripts that double as the CuTe DSL's second staging run (carry .device/p2):
# with STAGE2=1 it unpacks part 2 into /tmp/site, after the first run (part 1) left it there; exits 3 when part 1
# is missing (a fresh machine: COLD) or the unpack fails.
if [ "${STAGE2:-0}" = 1 ]; then
  test -d /tmp/site/nvidia_cutlass_dsl || { echo COLD; exit 3; }
  tar -xJf .device/p2/part2.tar.xz -C /tmp/site || exit 3
fi
