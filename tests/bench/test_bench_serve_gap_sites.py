"""bench_serve.gap_sites: every GPU idle gap of a profiled load, however short, by the kernels on either side
(docs/tuning.md 7.23: 75 ms of a c1 request's 487 ms were GPU idle, none of it in gaps >= 1 ms)."""
import pytest

from blockdiff.bench import bench_serve as bs


def _k(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_gap_sites_sum_every_gap_by_the_kernels_around_it():
    """Gaps of 1, 2, 3 and 500 us (times in us); an overlapping kernel closes no gap; totals equal span - busy."""
    ks = [_k("a", 0, 10), _k("b", 11, 10), _k("c", 12, 4), _k("d", 23, 5), _k("e", 31, 9), _k("f", 540, 10)]
    labels = {id(ks[0]): "forward:moe", id(ks[1]): "forward:gemm", id(ks[2]): "forward:gemm",
              id(ks[3]): "forward:attention", id(ks[4]): "sample:sampler", id(ks[5]): "forward:attention"}
    g = bs.gap_sites(ks, labels, steps=2)
    assert g["gaps"] == 4 and g["total_ms"] == pytest.approx(0.506)
    busy = sum(b - a for a, b in bs.merge_intervals((float(k["ts"]), float(k["ts"]) + k["dur"]) for k in ks))
    assert g["total_ms"] == pytest.approx((550 - busy) / 1e3)
    assert g["by_phase"] == {"forward>forward": pytest.approx(0.003), "forward>sample": pytest.approx(0.003),
                             "sample>forward": pytest.approx(0.5)}
    assert g["per_canvas_step_ms"]["sample>forward"] == pytest.approx(0.25)
    assert g["pairs"][0] == ("sample:sampler", "forward:attention", pytest.approx(0.5), 1)
    # the gap after b/c opens at b's end (21), not c's (16): the kernel that ends last opens it
    assert ("forward:gemm", "forward:attention", pytest.approx(0.002), 1) in g["pairs"]
    assert g["kernel_pairs"][0] == ("e", "f", pytest.approx(0.5), 1)
    assert g["by_launch"] == {"no_launch": [pytest.approx(0.506), 4]}  # no launches given
    assert bs.gap_sites([], {}, steps=0) == {"total_ms": 0.0, "gaps": 0, "by_phase": {}, "per_canvas_step_ms": None,
                                             "pairs": [], "by_launch": {}, "kernel_pairs": []}


def test_gap_sites_tell_a_graphs_own_gaps_from_launch_gaps():
    """docs/tuning.md 7.26: blockdiff's forward idled 2.8 ms a canvas step against stock's 1.1, in gaps between the
    same kernels; whether they sit inside one graph replay or before eagerly launched kernels decides the remedy."""
    ks = [_k("a", 0, 10), _k("b", 11, 10), _k("c", 31, 5), _k("d", 40, 5), _k("e", 60, 5)]
    launches = {id(ks[0]): ("graph", 7), id(ks[1]): ("graph", 7), id(ks[2]): ("eager", 8), id(ks[3]): ("graph", 9),
                id(ks[4]): ("graph", 9)}
    g = bs.gap_sites(ks, {}, launches=launches, name_chars=1)
    assert g["by_launch"] == {"in_graph": [pytest.approx(0.001 + 0.015), 2], "eager": [pytest.approx(0.010), 1],
                              "graph_start": [pytest.approx(0.004), 1]}
    assert g["kernel_pairs"][0] == ("d", "e", pytest.approx(0.015), 1)
    assert [bs.launch_kind(n) for n in ("cudaGraphLaunch", "cuGraphLaunch", "cudaLaunchKernel", "cuLaunchKernelEx",
                                        None)] == ["graph", "graph", "eager", "eager", "no_launch"]


def test_summarize_trace_reports_gap_sites_per_canvas_step():
    """Three 256-token steps (as test_bench_serve's timeline test): gaps 8.9 and 4 ms, all forward>forward."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_1(256)", "ts": t,
           "dur": 1000} for t in (0, 10000, 20000)]
    for ts, dur in ((100, 2000), (2100, 1000), (12000, 6000), (22000, 1000)):
        ev.append(_k("fused_moe_kernel", ts, dur))
    gs = bs.summarize_trace(ev, max_canvases=1)["timeline"]["gap_sites"]
    assert gs["gaps"] == 2 and gs["total_ms"] == pytest.approx(12.9)
    # no launch events: the phase is "no_launch" on both sides
    assert gs["by_phase"] == {"no_launch>no_launch": pytest.approx(12.9)}
    assert gs["per_canvas_step_ms"]["no_launch>no_launch"] == pytest.approx(4.3)


def test_summarize_trace_counts_a_canvas_steps_graph_replays_and_eager_kernels():
    """Two 256-token steps: the first one graph replay (2 kernels) plus an eager kernel, the second two replays
    (piecewise); the gap inside a replay is ``in_graph``, the one before the eager kernel ``eager``."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_1(256)", "ts": t,
           "dur": 1000} for t in (0, 10000)]
    def launch(name, ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 5, "args": {"correlation": corr}}
    def kern(ts, corr, name="fused_moe_kernel"):
        return dict(_k(name, ts, 100), args={"correlation": corr})
    ev += [launch("cudaGraphLaunch", 10, 1), kern(100, 1), kern(300, 1), launch("cudaLaunchKernel", 20, 2),
           kern(500, 2, "rms_norm_kernel"),
           launch("cudaGraphLaunch", 10010, 3), kern(10100, 3), launch("cudaGraphLaunch", 10020, 4), kern(10300, 4)]
    s = bs.summarize_trace(ev, max_canvases=1)
    assert s["timeline"]["forward_launches_per_canvas_step"] == {"graph_replays": 1.5, "eager_kernels": 0.5,
                                                                   "kernels_without_launch": 0.0}
    gs = s["timeline"]["gap_sites"]
    assert gs["by_launch"]["in_graph"] == [pytest.approx(0.1), 1]
    assert gs["by_launch"]["eager"] == [pytest.approx(0.1), 1]
    assert gs["by_launch"]["graph_start"] == [pytest.approx(9.5 + 0.1), 2]


def test_the_profile_summary_prints_the_gap_sites(capsys):
    ev = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_1(256)", "ts": t,
           "dur": 1000} for t in (0, 10000, 20000)]
    for ts, dur in ((100, 2000), (2100, 1000), (12000, 6000), (22000, 1000)):
        ev.append(_k("fused_moe_kernel", ts, dur))
    s = bs.summarize_trace(ev, max_canvases=1)
    bs._print_profile({"backend": "vllm", "quant": "fp8", "status": "ok", **s})
    out = capsys.readouterr().out
    assert "all idle (2 gaps, 12.9 ms) by phase before>after: no_launch>no_launch 12.9 (4.30/canvas step)" in out
    assert "idle by launch: no_launch 12.9 (2); kernels around it: fused_moe_kernel>fused_moe_kernel 12.9 (2)" in out
    assert "a canvas step's forward: 0.0 graph replays, 0.0 eager kernels, 1.3 kernels without a launch event" in out
