"""One-off probes, A/B drivers and smoke scripts (``blockdiff.bench.experiments``), apart from the benchmarks.

Each runs as ``python3 -m blockdiff.bench.experiments.<name>`` and takes its switches as command-line arguments;
bench/experiments/README.md lists them. Output goes to ``--out`` / ``$OUT``, else to the git-ignored
bench/results/local/ (never over a tracked record); kept H200 runs live in bench/results/history/.
"""
