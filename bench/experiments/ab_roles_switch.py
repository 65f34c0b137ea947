#!/usr/bin/env python3
"""Interleaved A/B of an experiment switch of the roles kernel (a ``FlashAttentionForwardSm90Roles`` class attribute
read at compile time: ``_K_REFILL_ALL_WARPS``, docs/tuning.md 2.17-2.18; ``_SM_OVERLAP`` ran through it in 2.20, before
it became ``CuteConfig.qk_issue``; ``_EPILOGUE_LOCAL_WARP``, 2.25), off against on, one
process (GPU experiment, the bench's paged layout). A switch ``Class.ATTR`` names a class of
``attention/cute/kernel.py``, ``kernel_wide.py`` or ``kernel_roles.py`` instead (``compile_check.switch_target``).
A switch may also be a boolean field of the cute config (``CuteConfig``, e.g. ``skip_allowed_first``: FA4's consumer,
docs/tuning.md 2.27 / 2.30, a class attribute ``_SKIP_ALLOWED_FIRST`` until then): off / on set it False / True in
every variant's config (``nan_safe_v_method``, a field of named values: ``"scan"`` / ``"recompute"``,
:data:`STR_SWITCHES`) (the config is part of the compile key; its ``"auto"`` is a ``--plain`` row, e.g.
``'{"auto": {}}'``).

A class switch is not part of the compile key, so each row compiles into a compile cache of its own (the interface's
``_COMPILE_CACHE`` swapped per row; run with ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0``: the disk cache's key
does not see a class switch). For each named workload and config: both settings run once on the same inputs (outputs
must be bit-identical for the switches above; isfinite; each prints and records what it launched, :func:`launch_info`:
the kernel class, its resolved ``nan_safe_v`` / ``nan_safe_v_method`` and its class switches), then ``--rounds`` rounds time every row in turn with
``triton.testing.do_bench_cudagraph(rep=200)`` (CUDA-graph replays, microseconds, medians printed and written to
``ab_roles_switch.json`` in ``--out``). With ``--triton`` the triton backend's default dispatch on the same inputs
joins the rounds (issue 27's goal is a ratio to it in the same run), with ``--fa4`` FA4's paged launches
(``bench_attention.make_fa4``: one per causal flag; the hd-256 goals are ratios to it; left out, with the reason,
where FA4 cannot run the workload); every row's effective TFLOP/s (``bench.common.attention_flops`` over the
workload's allowed pairs) is printed and recorded beside the times, as "x TFLOP/s of a reference row (x its time)".
The record is rewritten after each workload.

``switch`` may instead be a JSON object of named settings, ``{"name": {"Class.ATTR": value, ...}, ...}`` (several
switches in one run, e.g. 2.30's NaN-safe V switches and their combinations; a boolean config field may be named
too): every config variant then runs once with every switch the settings name at its class default, and every
config field they name False (the row ``<variant>_off``), and once per setting (``<variant>_<name>``), each compared
with the off row bit for bit, all in the same rounds. ``--plain`` adds rows compiled once with every class switch at
its default and their own config as given (e.g. a config where the switches do not act: one compile, not one a
setting).

    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0 python3 -m blockdiff.bench.experiments.ab_roles_switch \
        _K_REFILL_ALL_WARPS mixed_global_ctx8k '{"whole": {"wide_design": "roles", "k_refill": "whole"}}' --triton
"""
import argparse
import json
import os
import statistics

import torch

from blockdiff.attention.cute import attention_cute
from blockdiff.attention.cute import interface as cute_interface
from blockdiff.bench import common
from blockdiff.bench import workloads as wl


def _row(b, w, cfg, values: dict):
    """The paged call of ``cfg`` compiled (into a compile cache of its own) with the class attributes ``values``
    (``{(class, attribute): value}``) set and its config fields (``{"field": value}`` entries) in the config."""
    k, v, a = b.layouts()["paged"]
    out = torch.empty(b.q.shape[0], w.num_heads, w.head_dim_v, dtype=b.q.dtype, device="cuda")
    cache: dict = {}
    attrs = {t: x for t, x in values.items() if not isinstance(t, str)}
    config = dict(cfg, **{t: x for t, x in values.items() if isinstance(t, str)})

    def f():
        cute_interface._COMPILE_CACHE = cache
        for (cls, attr), value in attrs.items():
            setattr(cls, attr, value)
        return attention_cute(b.q, k, v, out=out, check_values=False, config=config, **a)
    return f


def switch_settings(switch: str) -> dict:
    """``{setting name: {target: value}}`` of the ``switch`` argument, ``"off"`` first; a target is ``(class,
    attribute)`` for a class switch, the field name (a str) for a config field (:func:`config_field`). A
    bare name, ``Class.ATTR`` or a config field gives ``off`` / ``on`` (False / True; a field of :data:`STR_SWITCHES`
    its pair); a JSON object ``{"name": {"Class.ATTR" or "field": value}}`` gives ``off`` (every attribute it names at
    its class default, read now, every config field False or its :func:`config_off`) and its settings (the switches
    a setting leaves out as in ``off``).

    Raises:
        ValueError: a name that is neither a switch (:func:`switch_class`) nor a boolean config field, a setting
            named ``off``, or a JSON object whose settings are not objects."""
    if not switch.lstrip().startswith("{"):
        target = _target(switch)
        if isinstance(target, str):  # a config field: its off / on values
            return {"off": {target: config_off(target)}, "on": {target: config_on(target)}}
        return {"off": {target: False}, "on": {target: True}}
    named = json.loads(switch)
    if not isinstance(named, dict) or not named or not all(isinstance(x, dict) and x for x in named.values()):
        raise ValueError(f"switch settings must be a JSON object of non-empty objects, got {switch!r}")
    if "off" in named:
        raise ValueError("switch settings: 'off' is the row with every switch at its default; name it otherwise")
    targets = {n: _target(n) for x in named.values() for n in x}
    off = {t: (config_off(t) if isinstance(t, str) else getattr(*t)) for t in targets.values()}
    return {"off": off, **{name: {**off, **{targets[n]: val for n, val in x.items()}} for name, x in named.items()}}


#: Config fields of named values that the A/B takes as switches: ``(off, on)`` (``nan_safe_v_method``: the
#: mainloop scan against the epilogue test and recompute, docs/tuning.md 2.34).
STR_SWITCHES = {"nan_safe_v_method": ("scan", "recompute")}


def config_off(name: str):
    """The ``off`` value of a config-field switch: False, or the first of :data:`STR_SWITCHES`' pair."""
    return STR_SWITCHES[name][0] if name in STR_SWITCHES else False


def config_on(name: str):
    """The ``on`` value of a config-field switch: True, or the second of :data:`STR_SWITCHES`' pair."""
    return STR_SWITCHES[name][1] if name in STR_SWITCHES else True


def config_field(name: str) -> bool:
    """Whether ``name`` is a switch of the cute config: a ``CuteConfig`` field that takes both True and False
    (``nan_safe_v``, ``skip_allowed_first``; ``config.check_config``), or one of :data:`STR_SWITCHES`."""
    from blockdiff.attention.cute import config as cc  # imports without the CuTe DSL
    if name in STR_SWITCHES:
        return True
    if name not in cc._CONFIG_FIELDS:
        return False
    try:
        for value in (False, True):
            cc.check_config({name: value})
    except (TypeError, ValueError):
        return False
    return True


def _target(name: str):
    """A boolean config field's name as given, else :func:`switch_class`'s ``(class, attribute)``."""
    return name if config_field(name) else switch_class(name)


def switch_class(switch: str):
    """``(class, attribute)`` of ``switch``: ``"ATTR"`` the roles kernel's, ``"Class.ATTR"`` a class of kernel.py,
    kernel_wide.py or kernel_roles.py (``compile_check.switch_target``).

    Raises:
        ValueError: the class or the attribute does not exist, or the attribute is a method."""
    # the CuTe DSL is imported at first use: the module loads (and --help runs) without it
    from blockdiff.attention.cute.compile_check import switch_target
    return switch_target(switch if "." in switch else "FlashAttentionForwardSm90Roles." + switch)


def launch_info(values: dict) -> dict:
    """What the row's last call launched (``interface.LAST_LAUNCH``): the kernel class, its resolved ``nan_safe_v``
    and ``nan_safe_v_method`` (e.g. that a class switch of the recompute really ran with ``"recompute"``,
    docs/tuning.md 2.37), and the row's class switches as ``{"Class.ATTR": value}``."""
    cfg = cute_interface.LAST_LAUNCH.get("config")
    return dict(kernel=cute_interface.LAST_LAUNCH.get("kernel"), nan_safe_v=getattr(cfg, "nan_safe_v", None),
                nan_safe_v_method=getattr(cfg, "nan_safe_v_method", None),
                switches={f"{t[0].__name__}.{t[1]}": v for t, v in values.items() if not isinstance(t, str)})


def _fa4_row(b):
    """FA4's paged launches on the same inputs (one per causal flag; ``bench_attention.make_fa4``), or None with
    the reason printed where FA4 cannot run the workload (head dim > 256, a prefix window on bidirectional rows)."""
    from blockdiff.bench.bench_attention import Skip, make_fa4
    try:
        return make_fa4(b, None, "paged")[0]
    except Skip as e:
        print(f"fa4 row skipped: {e}", flush=True)
        return None


def _triton_row(b, w):
    """The triton backend's default dispatch on the same paged inputs (the goal's reference row)."""
    from blockdiff.attention.triton import attention_triton
    k, v, a = b.layouts()["paged"]
    out = torch.empty(b.q.shape[0], w.num_heads, w.head_dim_v, dtype=b.q.dtype, device="cuda")

    def f():
        return attention_triton(b.q, k, v, out=out, check_values=False, **a)
    return f


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("switch", help='the class attribute, e.g. _K_REFILL_ALL_WARPS, a boolean config field, e.g. '
                                  'skip_allowed_first, or JSON {"name": {"Class.ATTR" or "field": value, ...}, ...} '
                                  '(several settings)')
    p.add_argument("workloads", help="comma-separated named workloads")
    p.add_argument("variants", help='JSON {"name": config dict (wide_design "roles"), ...}')
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results/local/)")
    p.add_argument("--triton", action="store_true", help="time the triton backend on the same inputs too")
    p.add_argument("--fa4", action="store_true", help="time FA4's paged launches on the same inputs too")
    p.add_argument("--plain", default=None, help='JSON {"name": config dict}: rows with every switch at its default '
                                                 'only (e.g. nan_safe_v off, where the switches do not act)')
    a = p.parse_args(argv)
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1":
        raise SystemExit("set FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0: the disk cache's key does not see the switch")
    try:
        settings = switch_settings(a.switch)  # before any workload is built
    except ValueError as e:
        p.error(str(e))
    names, variants = a.workloads.split(","), json.loads(a.variants)
    res, checks, tf, launches = {}, {}, {}, {}
    for name in names:
        w = next(x for x in wl.named_workloads() if x.name == name)
        b = wl.build(w, device="cuda", dtype=torch.bfloat16)
        fns = {}
        for vn, cfg in variants.items():
            outs = {}
            for tag, values in settings.items():
                fns[f"{vn}_{tag}"] = _row(b, w, cfg, values)
                outs[tag] = fns[f"{vn}_{tag}"]().clone()
                launches[f"{name}/{vn}_{tag}"] = launch_info(values)
                print(f"{name} {vn}_{tag}: launch {launches[f'{name}/{vn}_{tag}']}", flush=True)
            torch.cuda.synchronize()
            for tag in list(settings)[1:]:
                same = torch.equal(outs["off"], outs[tag])
                finite = bool(torch.isfinite(outs[tag]).all())
                diff = (outs["off"].float() - outs[tag].float()).abs().max().item()
                key = f"{name}/{vn}" if tag == "on" and len(settings) == 2 else f"{name}/{vn}/{tag}"
                checks[key] = dict(bit_identical=same, finite=finite, max_diff=diff)
                print(f"{name} {vn}: {tag} bit-identical to off: {same}, finite {finite}, max diff {diff}",
                      flush=True)
        class_off = {t: x for t, x in settings["off"].items() if not isinstance(t, str)}
        for vn, cfg in json.loads(a.plain or "{}").items():  # one row each, every class switch at its default
            fns[vn] = _row(b, w, cfg, class_off)
        for (cls, attr), value in class_off.items():  # every class switch at its default for the reference rows
            setattr(cls, attr, value)
        if a.triton:
            fns["triton"] = _triton_row(b, w)
        if a.fa4 and (fa4 := _fa4_row(b)) is not None:
            fns["fa4"] = fa4
        res[name] = common.interleaved_graph_medians(fns, a.rounds, name)
        flops = common.attention_flops(w.num_heads, w.head_dim, w.allowed_pairs(), w.head_dim_v)
        tf[name] = {n: common.tflops(flops, statistics.median(t) * 1e-3) for n, t in res[name].items()}
        for n, x in tf[name].items():
            ratio = "".join(f"  {x / tf[name][r]:.3f}x {r} ({tf[name][r] / x:.3f}x its time)"
                            for r in ("triton", "fa4") if r in tf[name] and n != r)
            print(f"{name} {n:28s} {x:7.1f} TFLOP/s{ratio}", flush=True)
        # after every workload: a run stopped by its time limit keeps the workloads it finished
        common.write_experiment_json("ab_roles_switch.json",
                                     dict(commit=os.environ.get("BLOCKDIFF_COMMIT"), gpu=torch.cuda.get_device_name(),
                                          switch=a.switch,
                                          variants=variants, checks=checks, launches=launches, res=res,
                                          tflops=tf), a.out)


if __name__ == "__main__":
    main()
