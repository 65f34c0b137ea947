"""Shared pieces of the blockdiff benchmarks: warm-up, timing, environment record, result files, FLOP counts.

Every benchmark in bench/ follows docs/ARCHITECTURE.md "Benchmark records": one JSON per suite and GPU
(``<suite>-<gpu>.json``) plus a CSV and PNG plots beside it, written to ``$OUT`` when that variable is set,
else to ``bench/results/`` (``--quick`` / CPU runs: the git-ignored ``bench/results/local/``). Rows are plain dicts; ``write_records`` adds the environment record.

Timing (docs/ARCHITECTURE.md "Benchmark records"): after a 1-3 s matmul warm-up, eager medians come from
``triton.testing.do_bench(..., return_mode="median")`` (CUDA events, L2 flushed between calls) and CUDA-graph
medians from the same timer around ``graph.replay()`` of one captured call. On the CPU (``--quick`` smoke
runs) a ``time.perf_counter`` median stands in; those numbers only prove the script runs.
"""
from __future__ import annotations

import csv
import datetime as _dt
import importlib
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
DEFAULT_RESULTS_DIR = BENCH_DIR / "results"
#: Git-ignored folder of runs that are not records: ``--quick`` / CPU smoke runs and experiments' output.
LOCAL_RESULTS_DIR = DEFAULT_RESULTS_DIR / "local"

#: Measured dense bf16 ceiling of one H200 (8192² matmuls), TFLOP/s.
PEAK_TFLOPS = 790.0
#: Measured HBM bandwidth ceiling of one H200, GB/s.
PEAK_GBPS = 4300.0


# ----------------------------------------------------------------------------------------------- progress
def progress(iterable: Iterable, total: int | None = None, desc: str = "", enabled: bool = True):
    """Wrap ``iterable`` in a tqdm progress bar on stderr (plain iterable when tqdm is missing/disabled).

    Only on a terminal: when stderr is not a TTY (``> log 2>&1``, a device run's captured output) the plain iterable
    comes back, so the bar's carriage-return redraws never interleave with the rows ``log`` prints.
    """
    isatty = getattr(sys.stderr, "isatty", None)
    if not enabled or not (isatty is not None and isatty()):
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is an install requirement; stay usable without it
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


def log(msg: str) -> None:
    """Print a progress message to stderr without breaking an active tqdm bar."""
    try:
        from tqdm.auto import tqdm

        tqdm.write(msg, file=sys.stderr)
    except ImportError:
        print(msg, file=sys.stderr)


# ----------------------------------------------------------------------------------------------- CLI values
def comma_list(text: str, flag: str) -> list[str]:
    """The items of a comma-separated command-line value (``--backends triton,cute``), stripped, blanks dropped.
    ``""`` gives ``[]`` (each flag says what its empty value means, e.g. "all"); a value that is not empty yet
    names nothing (``","``, ``" "``) is refused, not read as ``[]``: a run that selected nothing measured nothing
    and exited 0.

    Raises:
        ValueError: ``text`` is not empty and names no item (the message names ``flag``).
    """
    items = [x.strip() for x in text.split(",") if x.strip()]
    if text and not items:
        raise ValueError(f"{flag} {text!r} names nothing: give comma-separated names (or leave the flag out)")
    return items


# ----------------------------------------------------------------------------------------------- GPU warm-up
def warm_up_gpu(device: torch.device | str = "cuda", seconds: float = 2.0, n: int = 8192) -> float:
    """Run bf16 ``n x n`` matmuls for about ``seconds`` (clock ramp-up, lazy CUDA init); return seconds spent.

    No-op (returns 0.0) for a non-CUDA device. Without it the first case of a cold H200 runs 2-3x slow.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize(device)
    del a, b
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------- timing
def _cpu_median_ms(fn: Callable[[], object], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_eager_ms(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 25, rep: int = 100,
                  cpu_reps: int = 3) -> float:
    """Median wall time of one ``fn()`` call in ms.

    CUDA: ``triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")`` (warmup/rep in ms of
    GPU time; CUDA events per call; L2 flushed between calls), falling back to CUDA events when triton is
    missing. CPU: median of ``cpu_reps`` perf_counter timings (no warm-up: callers have made a first call).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return _cpu_median_ms(fn, cpu_reps, warmup=0)  # callers made the first (checked) call already
    try:
        from triton.testing import do_bench
    except ImportError:
        return _cuda_event_median_ms(fn, iters=50)
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _cuda_event_median_ms(fn: Callable[[], object], iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def capture_cuda_graph(fn: Callable[[], object], warmup_calls: int = 3) -> "torch.cuda.CUDAGraph":
    """Capture one ``fn()`` call into a CUDA graph (after ``warmup_calls`` eager calls on a side stream).

    Raises whatever capture raises (e.g. a host sync on the launch path); callers record it as ``graph_error``.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def time_graph_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median time in ms of one replay of a CUDA graph holding one ``fn()`` call (CUDA only)."""
    g = capture_cuda_graph(fn)
    try:
        return time_eager_ms(g.replay, "cuda", warmup=warmup, rep=rep)
    finally:
        del g


def peak_extra_memory_bytes(fn: Callable[[], object], device: torch.device | str) -> int | None:
    """Bytes allocated by one ``fn()`` call on top of what was allocated before it (CUDA peak); None on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


# ----------------------------------------------------------------------------------------------- FLOPs
# allowed-pair counts: blockdiff.attention.masks.count_allowed_pairs (Workload.allowed_pairs)
def attention_flops(num_heads: int, head_dim: int, pairs: int, head_dim_v: int | None = None) -> float:
    """FLOPs of attention forward over ``pairs`` allowed pairs: 2·H·(D + Dv)·pairs (= 4·H·D·pairs for Dv = D)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 2.0 * num_heads * (head_dim + dv) * pairs


def tflops(flops: float, ms: float | None) -> float | None:
    """Effective TFLOP/s of ``flops`` done in ``ms`` milliseconds (None when no time)."""
    if ms is None or not ms > 0 or not math.isfinite(ms):
        return None
    return flops / (ms * 1e-3) / 1e12


def share_of_peak(tf: float | None, peak: float = PEAK_TFLOPS) -> float | None:
    """``tf`` as a fraction of the measured bf16 ceiling (790 TFLOP/s on an H200)."""
    return None if tf is None else tf / peak


# ----------------------------------------------------------------------------------------------- environment
def _version(dist_names: Sequence[str], module: str | None = None) -> str | None:
    for name in dist_names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if module is not None:
        try:
            mod = importlib.import_module(module)
            return getattr(mod, "__version__", "unknown")
        except Exception:  # noqa: BLE001 - an optional package may fail in any way on import
            return None
    return None


def git_commit() -> str:
    """Commit of the working tree (``git rev-parse HEAD``, ``+dirty`` when tracked files changed).

    The GPU machine receives a copy without .git: set ``BLOCKDIFF_COMMIT`` there; otherwise "unknown".
    """
    env = os.environ.get("BLOCKDIFF_COMMIT")
    if env:
        return env
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_DIR,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_name(device: torch.device | str | None = None) -> str:
    """Device name ("NVIDIA H200"), or "cpu" when CUDA is unavailable."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return torch.cuda.get_device_name(device)
    return "cpu"


def gpu_slug(name: str) -> str:
    """File-name form of a device name: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100" (memory size
    and kind dropped: they name no other model), "NVIDIA H100 PCIe" -> "h100-pcie", "cpu" -> "cpu"."""
    s = name.lower().replace("nvidia", "").strip()
    s = "".join(ch if ch.isalnum() else "-" for ch in s)
    parts = [t for t in s.split("-") if t and not re.fullmatch(r"\d+gb|hbm\d*e?", t)]
    return "-".join(parts) or "gpu"


def env_record(device: torch.device | str | None = None) -> dict:
    """Environment of a run: gpu, driver, cuda, torch, triton, flash_attn_4, vllm (None when not installed; read
    from the package metadata, vLLM is not imported), commit, date (UTC ISO), python, host."""
    driver = None
    if torch.cuda.is_available():
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = None
    return {
        "gpu": gpu_name(device),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version(["triton"], "triton"),
        "flash_attn_4": _version(["flash-attn-4", "flash_attn_4"]) or _flash_attn_cute_version(),
        "vllm": _version(["vllm"]),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "host": platform.node(),
    }


def _flash_attn_cute_version() -> str | None:
    try:
        import flash_attn.cute  # noqa: F401
        import flash_attn
    except Exception:  # noqa: BLE001
        return None
    return getattr(flash_attn, "__version__", "unknown")


# ----------------------------------------------------------------------------------------------- records
def results_dir(local: bool = False) -> Path:
    """Output folder (created): ``$OUT`` when set (the GPU machine's output folder); else bench/results/ for a
    record, or with ``local=True`` (``--quick`` / CPU smoke runs, experiments) the git-ignored
    bench/results/local/, so a smoke run never overwrites a tracked record."""
    out = os.environ.get("OUT")
    d = Path(out) if out else (LOCAL_RESULTS_DIR if local else DEFAULT_RESULTS_DIR)
    d.mkdir(parents=True, exist_ok=True)
    return d


def script_argv(argv: Sequence[str] | None) -> list[str]:
    """A record's ``argv`` field (docs/ARCHITECTURE.md section 9): the script's arguments, ``argv`` as its ``main``
    got them, or the command line's after the program (``sys.argv[1:]``: no interpreter, ``-m`` or module) when
    ``argv`` is None, as a list of str."""
    return [str(a) for a in (sys.argv[1:] if argv is None else argv)]


def jsonable(x):
    """``x`` with what JSON cannot hold replaced: non-finite floats -> None, torch dtypes / devices -> str, tuples ->
    lists, dict keys -> str (what :func:`write_records` writes)."""
    return _jsonable(x)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_records(suite: str, rows: list[dict], *, env: dict | None = None, extra: dict | None = None,
                  out_dir: Path | str | None = None, stem: str | None = None) -> Path:
    """Write ``<suite>-<gpu>.json`` (env + rows) and ``<suite>-<gpu>.csv`` (rows, the JSON's values: a non-finite
    float an empty cell); return the JSON path. Each file is replaced whole (:func:`_write_whole`).

    Without ``out_dir``: :func:`results_dir`, the local folder when the record is from the CPU. ``stem``: the file
    names' stem instead of ``<suite>-<gpu>`` (a name the caller already checked; no other file is written)."""
    env = env_record() if env is None else env
    d = Path(out_dir) if out_dir is not None else results_dir(local=env["gpu"] == "cpu")
    d.mkdir(parents=True, exist_ok=True)
    stem = stem or f"{suite}-{gpu_slug(env['gpu'])}"
    doc = {**env, "suite": suite, **(extra or {}), "rows": rows}
    path = d / f"{stem}.json"
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    for r in rows:  # the JSON's values: a non-finite float is an empty cell as it is null there (was: nan / inf)
        w.writerow({k: (json.dumps(_jsonable(v)) if isinstance(v, (dict, list, tuple)) else _jsonable(v))
                    for k, v in r.items()})
    _write_whole(path, json.dumps(_jsonable(doc), indent=1) + "\n")
    _write_whole(d / f"{stem}.csv", buf.getvalue())
    return path


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename: a run cut short while writing (a
    sweep's config timeout exits the process from a watchdog thread, a device command's time limit) leaves the
    previous file whole, never a truncated record. As a write in place did, a symbolic link is written through (the
    file it names is replaced, the link kept) and a file that was there keeps its permission bits (a new one gets the
    umask's)."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", newline="") as f:
            f.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_png(fig, path: str | Path, dpi: int = 110) -> Path:
    """Write a matplotlib figure as a 256-colour palette PNG (~3x smaller than matplotlib's RGBA for these
    charts; the records travel to the GPU machine inside a 64 MiB working tree). Pillow comes with matplotlib."""
    import io

    from PIL import Image

    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(256).save(path, optimize=True)
    return path


def write_experiment_json(name: str, obj, out: str | Path | None = None) -> Path:
    """Write an experiment's result ``obj`` as ``<name>`` (JSON) to ``out``, else :func:`results_dir` with
    ``local=True`` ($OUT, else the git-ignored bench/results/local/), replaced whole (:func:`_write_whole`); print and
    return the path."""
    path = (Path(out) if out else results_dir(local=True)) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_whole(path, json.dumps(_jsonable(obj), indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def interleaved_graph_medians(fns: dict, rounds: int, label: str) -> dict:
    """Time every callable of ``fns`` (name -> zero-argument callable) in turn, ``rounds`` times, with
    ``triton.testing.do_bench_cudagraph(rep=200)`` (CUDA-graph replays; interleaving puts clock and thermal drift on
    every row alike); print each row's median and rounds (microseconds) after ``label``; return name -> list of
    the rounds' times (us). Needs a GPU and Triton (imported here)."""
    import statistics

    import triton.testing as tt
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(tt.do_bench_cudagraph(f, rep=200) * 1e3)
    for n, t in times.items():
        print(f"{label} {n:28s} median {statistics.median(t):8.2f} us  rounds {[round(x, 1) for x in t]}", flush=True)
    return times


def fmt(x, nd: int = 3) -> str:
    """Short number for tables: None -> "-", floats with ``nd`` significant decimals."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "-"
        return f"{x:.{nd}f}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def summary_table(rows: list[dict], columns: Sequence[str]) -> str:
    """Plain fixed-width text table of ``rows`` restricted to ``columns`` (printed last by every bench)."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
