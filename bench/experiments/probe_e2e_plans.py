"""bench_e2e with the triton backend's launch plans off or on (GPU experiment; one process per mode).

    python3 -m blockdiff.bench.experiments.probe_e2e_plans --plans off -- --attn-backends triton \
        --sampler-backend triton --out DIR

Everything after ``--`` goes to :func:`blockdiff.bench.bench_e2e.main` (``--out`` defaults to ``$OUT``, else the
git-ignored bench/results/local/). ``--plans off`` sets the triton
backend's switch ``PLANS_ENABLED`` to False, so every call takes the full path. Record of the H200 run:
bench/results/history/e2e_plans-h200.{json,md} (docs/tuning.md).
"""
import argparse

from blockdiff.attention.triton import interface as triton_interface
from blockdiff.bench import bench_e2e, common


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plans", choices=("on", "off"), required=True, help="the triton backend's launch plans")
    p.add_argument("e2e_args", nargs=argparse.REMAINDER, help="arguments of bench_e2e (after --)")
    a = p.parse_args(argv)
    rest = a.e2e_args[1:] if a.e2e_args[:1] == ["--"] else a.e2e_args
    if "--out" not in rest:  # an experiment never writes over the tracked e2e record
        rest = rest + ["--out", str(common.results_dir(local=True))]
    triton_interface.PLANS_ENABLED = a.plans == "on"
    triton_interface.PLANS.clear()
    return bench_e2e.main(rest)


if __name__ == "__main__":
    main()
