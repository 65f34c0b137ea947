"""bench/experiments/pyspy_top.py: the raw py-spy summary used to find the host thread behind a served load's
tail (docs/tuning.md 7.13)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("pyspy_top", ROOT / "bench" / "experiments" / "pyspy_top.py")
pyspy_top = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pyspy_top)

RAW = '''process 10:"python3 -m vllm.entrypoints.cli.main serve /m
 --port 8046";thread (10): MainThread;run (a.py:1);process_outputs (o.py:9);decode (d.py:3) 30
process 10:"python3 -m vllm.entrypoints.cli.main serve /m
 --port 8046";thread (10): MainThread;run (a.py:1);tokenize (t.py:4) 10
process 20:"VLLM::EngineCore";thread (21): zmq_out;send (z.py:2) 5
process 20:"VLLM::EngineCore";thread (20): ;step (c.py:7) 1
'''


def test_records_split_on_processes_even_with_newlines_in_the_command():
    recs = list(pyspy_top.parse(RAW))
    assert [(r[0], r[2], r[4]) for r in recs] == [(10, "MainThread (10)", 30), (10, "MainThread (10)", 10),
                                                   (20, "zmq_out (21)", 5), (20, "thread (20)", 1)]
    assert recs[0][1].endswith("--port 8046") and recs[0][3][-1] == "decode (d.py:3)"


def test_summary_ranks_threads_and_frames():
    text = pyspy_top.summarize(pyspy_top.parse(RAW), top=3, min_share=0.05)
    assert text.splitlines()[0] == "46 samples in 3 threads"
    assert "== pid 10 MainThread (10): 40 samples (87.0 %)" in text
    assert "75.0 %  decode (d.py:3)" in text and "100.0 %  run (a.py:1)" in text
    assert "thread (20)" not in text  # 1 of 46 samples: under min_share
