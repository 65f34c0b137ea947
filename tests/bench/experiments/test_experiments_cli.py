"""Every experiment imports without a GPU and takes its switches as command-line arguments (``--help``)."""
import importlib

import pytest

EXPERIMENTS = ["ab_cute_configs", "ab_roles_switch", "adversarial_pass2", "adversarial_pass3", "cute_ptx_snapshot", "cute_smoke", "probe_cluster_occupancy",
               "probe_cute_canvas_gap", "probe_cute_floor", "probe_e2e_plans", "probe_floor_sliding",
               "probe_host_overhead", "probe_warm_l2", "ptx_snapshot", "pyspy_top", "serve_smoke", "serve_standin",
               "sim_cute_nan_v_race", "sim_cute_nan_recompute"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_has_a_cli(name, capsys):
    mod = importlib.import_module(f"blockdiff.bench.experiments.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


def test_every_experiment_is_listed_in_the_readme():
    from pathlib import Path

    import blockdiff.bench.experiments as ex

    folder = Path(ex.__file__).parent
    readme = (folder / "README.md").read_text()
    scripts = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    assert scripts == sorted(EXPERIMENTS + ["probe_triton_hopper_ws"])
    for s in scripts:
        assert f"`{s}.py`" in readme, s
