# The CuTe DSL's first staging part in two runs, for when the working tree plus .device/p1 (50.2 MB) would pass the
# run tool's 64 MiB upload limit (2026-12-05: the tracked tree is 16.5 MB, so ~450 KB were left). The one-run form
# stays `mkdir -p /tmp/site && tar -xJf .device/p1/part1.tar.xz -C /tmp/site` carrying .device/p1.
# Prepare on the CPU (once, .device is git-ignored; the two chunks concatenate to part1.tar.xz byte for byte):
#   mkdir -p .device/p1a .device/p1b && split -b 25M -d -a 1 .device/p1/part1.tar.xz /tmp/part1.xz. \
#     && mv /tmp/part1.xz.0 .device/p1a/ && mv /tmp/part1.xz.1 .device/p1b/
# Then two runs, the same machine (warm):
#   PART=a bash bench/experiments/device/stage1.sh   carrying .device/p1a   (keeps the chunk in /tmp)
#   PART=b bash bench/experiments/device/stage1.sh   carrying .device/p1b   (joins and unpacks into /tmp/site)
# after which the cute scripts' STAGE2=1 run (carrying .device/p2) follows as with the one-run form.
set -u
case ${PART:-} in
  a) cp .device/p1a/part1.xz.0 /tmp/part1.xz.0 && ls -la /tmp/part1.xz.0 ;;
  b) test -f /tmp/part1.xz.0 || { echo "COLD: PART=a first, on this machine"; exit 3; }
     mkdir -p /tmp/site && cat /tmp/part1.xz.0 .device/p1b/part1.xz.1 | tar -xJ -C /tmp/site && rm -f /tmp/part1.xz.0 \
       && echo "part 1 unpacked: $(du -sh /tmp/site | cut -f1)" ;;
  *) echo "PART must be a or b"; exit 2 ;;
esac
