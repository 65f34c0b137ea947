"""bench_e2e with the triton backend's launch plans off or on (H200 probe; record:
bench/results/e2e_plans-h200.{json,md}). One process per mode: ``python3 bench/probe_e2e_plans.py off|on
--attn-backends triton --sampler-backend triton --out DIR``; the other arguments go to bench_e2e.py. "off"
clears ``triton_attention._PLANS_ENABLED``, so every call takes the full path.
"""
import os, runpy, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blockdiff.attention.triton import interface as TA

TA._PLANS_ENABLED = sys.argv[1] != "off"
sys.argv = ["bench_e2e.py"] + sys.argv[2:]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_e2e.py"), run_name="__main__")
