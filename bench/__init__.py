"""Benchmarks of blockdiff (``blockdiff.bench``): run each as ``python3 -m blockdiff.bench.<name>``.

See bench/README.md for the commands and the current tables, docs/ARCHITECTURE.md ("Benchmark records") for the
record format. Shared timing / record helpers live in :mod:`blockdiff.bench.common`, the named workloads in
:mod:`blockdiff.bench.workloads`; one-off probes and A/B drivers in :mod:`blockdiff.bench.experiments`.
"""
