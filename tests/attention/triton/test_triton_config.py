"""The backend's configuration (attention/triton/config.py): validation errors naming the key and the rule, the
resolved-config cache, the split heuristic and occupancy estimates, the split regime, and the automatic Gluon
entries (roles / wide kernel, OVERLAP defaults, no inherited LAZY_RESCALE)."""
import inspect

import pytest
import torch
import triton.language as tl

from blockdiff.attention import attention
from blockdiff.attention.triton import config as tc
from blockdiff.attention.triton import interface as ta
from blockdiff.attention.triton.interface import attention_triton

from triton_helpers import GLUON, MIXED, ROLES, SMALL, WIDE, make_batch, run_and_check


def test_config_cache_tells_numpy_bool_from_bool():
    """The resolved-config cache keys on the value's type, not its name: numpy's bool_ is named "bool", and a
    cached {BT_PREFETCH: True} let {BT_PREFETCH: np.True_} skip the bool check (review finding)."""
    np = pytest.importorskip("numpy")
    inp = make_batch(**MIXED)
    attention_triton(**inp, config=dict(SMALL, BT_PREFETCH=True))
    with pytest.raises(TypeError, match="BT_PREFETCH.*numpy"):  # the wrong type: a TypeError naming numpy's type
        attention_triton(**inp, config=dict(SMALL, BT_PREFETCH=np.True_))


def test_split_heuristic_uses_only_host_shapes():
    assert tc.choose_num_splits(40, 33000, 64, 132) > 1  # one canvas over 32k: split
    assert tc.choose_num_splits(400, 33000, 64, 132) == 1  # enough programs
    assert tc.choose_num_splits(10, 100, 64, 132) == 1  # too few keys to split
    # resident programs per SM: 64 programs of 4 warps fill 128 of 264 slots -> 4 splits (one wave of 2 per SM)
    assert tc.choose_num_splits(64, 33000, 64, 132, ctas=2) == 4
    assert tc.choose_num_splits(64, 33000, 64, 132, ctas=1) == 2
    assert tc.choose_num_splits(256, 4096, 64, 132, ctas=2) == 1  # canvas_bs4_ctx4k_hd128: a full wave already


def test_resident_programs_per_sm_estimate():
    """Registers (~255 per thread: 8 // num_warps programs) and shared memory (Q + stages x (K + V)) bound it."""
    assert tc.ctas_per_sm(64, 64, 4, 3, 128, 128, 2) == 2     # 112 KB, 4 warps
    assert tc.ctas_per_sm(128, 64, 8, 2, 256, 256, 2) == 1    # 8 warps
    assert tc.ctas_per_sm(64, 64, 4, 2, 256, 256, 2) == 1     # 160 KB of shared memory
    assert tc.ctas_per_sm(16, 16, 1, 1, 16, 16, 4) == 8
    cfg = tc.default_config(512, 512, 8, torch.bfloat16)
    assert cfg["BLOCK_M"] >= 8 and cfg["BLOCK_DV"] == 512


def test_resident_program_estimate_sees_the_kernels_tile_widths(monkeypatch):
    """The split count's shared-memory estimate is given the widths the kernel's tiles have: the head dim padded
    to a power of two (24 -> 32) and the V slice of one program (BLOCK_DV 16 of head_dim_v 40), not the raw
    head dims (which under-count padded tiles and over-count V-sliced ones)."""
    seen = []
    real = tc.ctas_per_sm
    monkeypatch.setattr(tc, "ctas_per_sm", lambda *a: seen.append(a) or real(*a))
    inp = make_batch(seq_lens=[14, 6], q_lens=[4, 6], causal=[False, True], head_dim=24, head_dim_v=40, num_heads=4,
                     num_kv_heads=2)
    run_and_check(inp, config=dict(SMALL, BLOCK_DV=16), window_size=3)
    assert seen and all(a[4:6] == (32, 16) for a in seen), seen


def test_many_short_sequences_do_not_split_a_full_grid():
    """The automatic split count counts every non-empty sequence as at least one q tile: 150 one-token rows with a
    4096-key capacity are 150 tiles x 2 KV heads = 300 programs (more than 264 slots: no split); estimating
    cdiv(150, BLOCK_Q) = 19 tiles split them 6 ways."""
    n = 150
    inp = make_batch(seq_lens=[40] * n, q_lens=[1] * n, causal=[False] * n, num_heads=4, num_kv_heads=2, head_dim=16,
                     page_size=16)
    bt = inp["block_table"]   # a block table of 256 pages per row (capacity 4096 keys, as a serving cache has)
    inp["block_table"] = torch.cat([bt, torch.zeros(bt.shape[0], 256 - bt.shape[1], dtype=bt.dtype,
                                                    device=bt.device)], 1)
    run_and_check(inp, config=SMALL)
    assert ta.LAST_LAUNCH["num_splits"] == 1
    one = make_batch(seq_lens=[2000], q_lens=[16], causal=[False], num_heads=4, num_kv_heads=2, head_dim=16,
                     page_size=16)
    run_and_check(one, config=SMALL)                      # one sequence over a long context still splits
    assert ta.LAST_LAUNCH["num_splits"] > 1


def test_num_splits_beyond_the_grid_limit_is_a_clear_error():
    """num_splits is the launch grid's third dimension (CUDA: <= 65535): more is a ValueError naming it, not a
    launch failure after allocating num_splits x total_q x H x head_dim_v fp32 partials."""
    inp = make_batch(seq_lens=[8], q_lens=[8], causal=[True], page_size=16)
    with pytest.raises(ValueError, match=r"num_splits.*65535"):
        attention_triton(**inp, config=dict(SMALL, num_splits=65536))


def test_split_regime_uses_its_tuned_tiles_only_when_the_base_tiles_would_split():
    """A kernel with split-regime tiles (TUNED_SPLIT_CONFIGS; here set on an interpreter kernel) uses them for a
    few q tiles over a long context and keeps the base tiles otherwise or when the caller pins tiles; results
    equal the oracle either way."""
    inp = make_batch(seq_lens=[600], q_lens=[8], causal=[False], num_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
    kern = tc.get_kernel(16, 16, 2, torch.bfloat16, True, 16, False, False)
    split_tiles = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    old = kern.split_base
    kern.split_base = split_tiles
    try:
        run_and_check(inp)
        assert {k: ta.LAST_LAUNCH["config"][k] for k in split_tiles} == split_tiles
        assert ta.LAST_LAUNCH["num_splits"] > 1
        run_and_check(inp, config=dict(BLOCK_M=16, BLOCK_N=16))          # pinned tiles win
        assert ta.LAST_LAUNCH["config"]["BLOCK_M"] == 16
        many = make_batch(seq_lens=[20] * 40, q_lens=[20] * 40, causal=[True] * 40, num_heads=4, num_kv_heads=2,
                          head_dim=16, page_size=16)
        run_and_check(many)                                               # enough programs: no split, base tiles
        assert ta.LAST_LAUNCH["num_splits"] == 1 and ta.LAST_LAUNCH["config"]["BLOCK_N"] == kern.base["BLOCK_N"]
    finally:
        kern.split_base = old


def test_block_table_prefetch_option_must_be_a_bool():
    inp = make_batch(seq_lens=[8], q_lens=[8], causal=[True], page_size=16)
    with pytest.raises(TypeError, match="BT_PREFETCH.*bool"):  # an int for a bool: the wrong type
        attention(**inp, backend="triton", config=dict(BT_PREFETCH=1))


@pytest.mark.parametrize("good,bad,name", [(dict(BT_PREFETCH=True), dict(BT_PREFETCH=1), "BT_PREFETCH"),
                                           (dict(LAZY_RESCALE=False), dict(LAZY_RESCALE=0), "LAZY_RESCALE"),
                                           (dict(num_splits=1), dict(num_splits=True), "num_splits"),
                                           (dict(BLOCK_N=16), dict(BLOCK_N=16.0), "BLOCK_N")])
def test_a_cached_valid_config_does_not_let_an_equal_value_of_the_wrong_type_through(good, bad, name):
    """The resolved-config cache was keyed by the override's items: True == 1 == 1.0 hash alike, so after a call
    with {BT_PREFETCH: True} a call with {BT_PREFETCH: 1} hit the cache and skipped validation."""
    inp = make_batch(seq_lens=[8], q_lens=[8], causal=[True], page_size=16, head_dim=32)
    attention(**inp, backend="triton", config=good)
    with pytest.raises(TypeError, match=name):  # each bad value is of the wrong type
        attention(**inp, backend="triton", config=bad)
    with pytest.raises(TypeError, match="BLOCK_M"):   # unhashable values are validated: the key named
        attention(**inp, backend="triton", config=dict(BLOCK_M=[16]))


@pytest.mark.parametrize("bad,match", [
    (dict(num_warps=2), "num_warps"), (dict(BLOCK_M=32), "BLOCK_M"), (dict(BLOCK_M=64, num_warps=8), "BLOCK_M"),
    (dict(BLOCK_N=16), "BLOCK_N"), (dict(num_stages=5), "num_stages"), (dict(BLOCK_DV=32), "BLOCK_DV"),
    (dict(IMPL="cuda"), "IMPL"), (dict(OVERLAP="pv"), "OVERLAP"),
    (dict(OVERLAP="Chain"), "OVERLAP"), (dict(V_STAGES=0), "V_STAGES"), (dict(V_STAGES=5), "V_STAGES"),
    (dict(IMPL="triton", V_STAGES=1), "V_STAGES"),
    (dict(IMPL="triton", OVERLAP=False), "OVERLAP"), (dict(IMPL="cuda", V_STAGES=1), "IMPL"),
])
def test_bad_gluon_configs_name_the_field(bad, match):
    inp = make_batch([9], [4], causal=[False], head_dim=64, page_size=64, device="cpu")
    with pytest.raises(ValueError, match=match):
        attention(**inp, backend="triton", config=dict(GLUON, **bad))


@pytest.mark.parametrize("bad,match", [
    (dict(OVERLAP=1), "OVERLAP"), (dict(V_STAGES=True), "V_STAGES"), (dict(V_STAGES=2.0), "V_STAGES"),
    (dict(NAN_SAFE_V=1), "NAN_SAFE_V"), (dict(NAN_SAFE_V="yes"), "NAN_SAFE_V"), (dict(num_splits=True), "num_splits"),
    (dict(num_warps=True), "num_warps"), (dict(BLOCK_M=64.0), "BLOCK_M"), (dict(IMPL=1), "IMPL"),
])
def test_config_values_of_the_wrong_type_are_type_errors_naming_the_key(bad, match):
    """A bool where an int is required (``num_splits=True``), an int for a bool, a float for an int: TypeError."""
    inp = make_batch([9], [4], causal=[False], head_dim=64, page_size=64, device="cpu")
    with pytest.raises(TypeError, match=match):
        attention(**inp, backend="triton", config=dict(GLUON, **bad))


@pytest.mark.parametrize("bad,match", [
    (dict(num_warps=4), "num_warps=8 and BLOCK_M=64"), (dict(BLOCK_M=128), "num_warps=8 and BLOCK_M=64"),
    (dict(OVERLAP=True), "OVERLAP=False"), (dict(OVERLAP="chain"), "OVERLAP=False"),
    (dict(num_stages=2), "shared memory"), (dict(BLOCK_N=32, num_stages=3), "shared memory"),
    (dict(BLOCK_DV=256), "BLOCK_DV"),
    (dict(V_STAGES="2"), "V_STAGES"), (dict(num_stages="1"), "num_stages"),
])
def test_bad_wide_gluon_configs_name_the_rule(bad, match):
    # hd 512 (Gemma 4 global layers): two consumer warpgroups of 64 rows, Q + K / V rings + the partial-S
    # exchange within 227 KB of shared memory
    inp = make_batch([9], [4], causal=[False], num_heads=16, num_kv_heads=2, head_dim=512, page_size=64, device="cpu")
    kind = TypeError if any(isinstance(v, str) and k != "OVERLAP" for k, v in bad.items()) else ValueError
    with pytest.raises(kind, match=match):
        attention(**inp, backend="triton", config=dict(WIDE, **bad))
    tc.check_gluon_config(tc.TritonConfig(**dict(WIDE, V_STAGES=None)), 512, 512)  # the automatic hd-512 choice fits
    tc.check_gluon_config(tc.TritonConfig(**dict(WIDE, BLOCK_N=32, num_stages=2, V_STAGES=2)),
                          512, 512)


def test_hd512_configs_resolve_to_the_kernel_that_can_take_them():
    # the H200 tables (not the interpreter's): the portable kernel's hd-512 entry splits V (BLOCK_DV 256); an
    # explicit IMPL="gluon" holds all of V without being told
    kern = tc.TritonAttention(tc.StaticKey(512, 512, 8, torch.bfloat16, True, 64, False, False, False))
    assert kern.base["BLOCK_DV"] == 256 and kern.gluon_base is not None
    cfg = kern.config(dict(IMPL="gluon", BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=1, OVERLAP=False))
    assert cfg.BLOCK_DV == 512
    # the automatic hd-512 choice is the roles kernel, in both regimes
    assert kern.gluon_base["OVERLAP"] == kern.gluon_split["OVERLAP"] == "roles"
    assert kern.config(kern.gluon_base).num_warps == 12


def test_overlap_defaults_follow_the_measured_consumers():
    # the QK^T / softmax overlap where its consumer fits the registers (64-key blocks, hd <= 128), else the chained
    # consumer up to hd 256, and the wide hd-512 kernel sequential (it takes nothing else)
    for D, bn, want in [(128, 64, True), (128, 128, "chain"), (256, 64, "chain"), (64, 32, True)]:
        kern = tc.get_kernel(D, D, 2, torch.bfloat16, True, 64, False, False)
        assert kern.config(dict(GLUON, BLOCK_N=bn)).OVERLAP == want, (D, bn)
        assert type(kern.config(dict(GLUON, BLOCK_N=bn)).OVERLAP) is type(want)
    assert kern.config(dict(GLUON, OVERLAP=False)).OVERLAP is False
    wide = tc.get_kernel(512, 512, 8, torch.bfloat16, True, 64, False, False)
    assert wide.config({k: v for k, v in WIDE.items() if k != "OVERLAP"}).OVERLAP is False
    with pytest.raises(ValueError, match="OVERLAP"):
        tc.overlap_mode("pv")
    assert [tc.overlap_mode(v) for v in (False, True, "chain")] == [0, 1, 2]
    assert kern.config({"V_STAGES": 1}).V_STAGES == 1  # IMPL unset: applies if the Gluon kernel is chosen


def test_nan_safe_v_is_on_by_default_and_keeps_the_automatic_choice():
    """config["NAN_SAFE_V"] (the Gluon kernels' NaN / Inf V clean-up): on unless switched off, a Gluon constexpr
    only (the portable kernel always keeps such V out), and not a tile key, so the tuned Gluon entries still
    apply with it either way."""
    kern = tc.TritonAttention(tc.StaticKey(128, 128, 2, torch.bfloat16, True, 64, False, False, False))
    assert kern.config(None).NAN_SAFE_V is True and kern.config(kern.gluon_base).NAN_SAFE_V is True
    auto = kern.config(tc.gluon_auto(kern.gluon_base, {"NAN_SAFE_V": True}))
    assert auto.NAN_SAFE_V is True and auto.IMPL == "gluon" and auto.OVERLAP == "chain"
    off = kern.config(tc.gluon_auto(kern.gluon_base, {"NAN_SAFE_V": False}))
    assert off.NAN_SAFE_V is False and off.IMPL == "gluon" and off.OVERLAP == "chain"
    assert "NAN_SAFE_V" not in tc._TILE_KEYS
    shape = tc.KernelShape(group=2, head_dim=128, head_dim_v=128, dtype=torch.bfloat16, paged=True, page_size=64,
                           has_window=False, prefix=False, causal_flags=True, split=False, store_lse=True,
                           search_steps=1)
    assert tc.kernel_constexprs(auto, shape)["NAN_SAFE_V"] is True
    assert tc.kernel_constexprs(kern.config(kern.gluon_base), shape)["NAN_SAFE_V"] is True
    assert tc.kernel_constexprs(off, shape)["NAN_SAFE_V"] is False
    assert "NAN_SAFE_V" not in tc.kernel_constexprs(kern.config({"IMPL": "triton", "NAN_SAFE_V": True}), shape)


def test_resident_programs_per_sm_follow_shared_memory_and_the_launch_register_budget():
    # 64x128 hd 128 with 2 K + 1 V buffers: 115 KB, two programs per SM (the automatic hd-128 choice)
    assert tc.gluon_ctas_per_sm(64, 128, 4, 2, 128, 128, 2, v_stages=1) == 2
    assert tc.gluon_ctas_per_sm(64, 128, 4, 2, 128, 128, 2) == 1          # 2 + 2 buffers: 148 KB
    # hd 256 fits twice by shared memory with one stage, but its PV wgmma needs > 128 registers at launch
    assert tc.gluon_ctas_per_sm(64, 64, 4, 1, 256, 256, 2) == 1
    assert tc.gluon_max_regs(4, 2) == 128 and tc.gluon_max_regs(4, 1) is None


@pytest.mark.parametrize("bad,match", [
    (dict(num_warps=8), "num_warps=12"), (dict(BLOCK_M=128), "BLOCK_M=64"), (dict(LAZY_RESCALE=True), "LAZY"),
    (dict(num_stages=2), "shared memory"), (dict(OVERLAP="Roles"), "OVERLAP"),
])
def test_bad_roles_configs_name_the_rule(bad, match):
    # OVERLAP="roles" at hd 512: a softmax warpgroup + two PV warpgroups (12 warps), 64 rows, no lazy rescale,
    # Q + K / V rings + the P ring within 227 KB
    kern = tc.get_kernel(512, 512, 8, torch.bfloat16, True, 64, False, False)
    with pytest.raises(ValueError, match=match):
        kern.config(dict(ROLES, **bad))
    assert kern.config(ROLES).OVERLAP == "roles"
    assert kern.config(dict(ROLES, BLOCK_N=32, num_stages=2, V_STAGES=2)).num_warps == 12
    hd256 = tc.get_kernel(256, 256, 2, torch.bfloat16, True, 64, True, False)
    assert hd256.config(dict(ROLES, num_warps=8, num_stages=2)).OVERLAP == "roles"  # one PV warpgroup
    with pytest.raises(ValueError, match="num_warps=8"):
        hd256.config(ROLES)
    assert tc.overlap_mode("roles") == 3
    assert [tc.roles_pv_warpgroups(d) for d in (128, 256, 512)] == [1, 1, 2]
    assert tc.roles_max_regs(512) == 168 and tc.roles_max_regs(256) is None
    # two PV warpgroups at their setmaxnreg leave >= 96 registers a thread for the softmax warpgroup
    assert 4 * tc.roles_max_regs(512) * 3 // 4 - 2 * tc.roles_pv_regs(512) >= 96


def test_hd512_automatic_choice_gives_way_to_the_wide_kernel_for_the_keys_only_it_takes():
    # regression (review of the roles switch): the automatic hd-512 entry is the roles kernel; a caller's
    # OVERLAP=False or LAZY_RESCALE=True used to run the wide kernel and then raised about num_warps / OVERLAP keys
    # the caller never set. They resolve against the wide kernel's tiles again; OVERLAP=True / "chain" still raise,
    # naming the caller's key; other keys keep the roles kernel
    kern = tc.TritonAttention(tc.StaticKey(512, 512, 8, torch.bfloat16, True, 64, False, False, False))
    for entry in (kern.gluon_base, kern.gluon_split):
        wide = kern.config(tc.gluon_auto(entry, {"OVERLAP": False}))
        assert wide.OVERLAP is False and wide.num_warps == 8 and wide.BLOCK_DV == 512
        lazy = kern.config(tc.gluon_auto(entry, {"LAZY_RESCALE": True}))
        assert lazy.LAZY_RESCALE is True and lazy.OVERLAP is False and lazy.num_warps == 8
        for bad in (True, "chain"):
            with pytest.raises(ValueError, match="OVERLAP=False"):
                kern.config(tc.gluon_auto(entry, {"OVERLAP": bad}))
        for keep in ({}, None, {"num_splits": 2}, {"OVERLAP": "roles"}, {"V_STAGES": 1}):
            cfg = kern.config(tc.gluon_auto(entry, keep))
            assert cfg.OVERLAP == "roles" and cfg.num_warps == 12, keep
    # entries below hd 512 merge as before
    k128 = tc.TritonAttention(tc.StaticKey(128, 128, 2, torch.bfloat16, True, 64, False, False, False))
    assert tc.gluon_auto(k128.gluon_base, {"OVERLAP": False}) == dict(k128.gluon_base, OVERLAP=False)


@pytest.mark.parametrize("key", sorted(tc.TUNED_GLUON_CONFIGS, key=str))
def test_automatic_gluon_configs_do_not_inherit_the_portable_kernels_lazy_rescale(key):
    # regression: the hd-256 sliding Gluon split config inherited LAZY_RESCALE=True from the portable kernel's
    # tuned table (and slowed the sliding canvas); the automatic Gluon configs resolve to exactly their table
    # entries, LAZY_RESCALE off unless the caller asks for it
    D, group, has_window, prefix = key
    kern = tc.TritonAttention(tc.StaticKey(D, D, group, torch.bfloat16, True, 64, has_window, prefix, False))
    for entry in (kern.gluon_base, kern.gluon_split):
        if entry is None:
            continue
        cfg = kern.config(dict(entry))
        assert {k: getattr(cfg, k) for k in entry} == entry
        assert cfg.LAZY_RESCALE is False and cfg.BLOCK_DV == D
        if entry["OVERLAP"] == "roles":  # its PV warpgroups rescale every block: lazy rescaling is refused
            with pytest.raises(ValueError, match="LAZY_RESCALE"):
                kern.config(dict(entry, LAZY_RESCALE=True))
        else:
            assert kern.config(dict(entry, LAZY_RESCALE=True)).LAZY_RESCALE is True
    if key == (256, 2, True, False):
        assert kern.config(None).LAZY_RESCALE is True  # the portable kernel keeps its tuned setting


def test_resolved_configs_are_frozen_and_carry_every_config_key():
    kern = tc.get_kernel(16, 16, 2, torch.bfloat16, True, 16, False, False)
    cfg = kern.config(SMALL)
    with pytest.raises(AttributeError):
        cfg.BLOCK_M = 32
    assert set(cfg.as_dict()) == set(tc.CONFIG_KEYS)
    assert kern.config(dict(SMALL)) is cfg  # cached per override
    attention_triton(**make_batch(**MIXED), config=SMALL)
    assert set(ta.LAST_LAUNCH["config"]) == set(tc.CONFIG_KEYS)


@pytest.mark.parametrize("cfg,D", [(dict(SMALL), 16), (dict(GLUON), 128), (dict(GLUON, OVERLAP="chain"), 128),
                                   (dict(WIDE), 512), (dict(ROLES), 512), (dict(ROLES, num_warps=8), 256)])
@pytest.mark.parametrize("split", [False, True])
def test_kernel_constexprs_name_exactly_the_chosen_kernels_constexpr_parameters(cfg, D, split):
    """One builder serves the launch plans and the offline compile check: its keys are the chosen kernel's
    constexpr parameters (every one without a default) plus launch options."""
    from blockdiff.attention.triton.gluon import KERNELS
    from blockdiff.attention.triton.portable import _attn_fwd_kernel

    group = 8 if D == 512 else 2
    resolved = tc.resolve_config(tc.default_config(D, D, group, torch.bfloat16), cfg, group=group, head_dim=D,
                                 head_dim_v=D)
    shape = tc.KernelShape(group=group, head_dim=D, head_dim_v=D, dtype=torch.bfloat16, paged=True, page_size=64,
                           has_window=False, prefix=False, causal_flags=True, split=split, store_lse=True,
                           search_steps=1)
    variant = tc.kernel_variant(resolved, D)
    fn = _attn_fwd_kernel if variant == "portable" else KERNELS[variant]
    consts = tc.kernel_constexprs(resolved, shape)
    params = inspect.signature(fn.fn).parameters  # the Python function (a JIT or an interpreted kernel)
    constexpr = {n for n, p in params.items() if p.annotation is tl.constexpr}
    launch_options = set(consts) - set(params)
    assert launch_options <= {"num_warps", "num_stages", "maxnreg"}, launch_options
    assert set(consts) & set(params) <= constexpr
    required = {n for n in constexpr if params[n].default is inspect.Parameter.empty}
    assert required <= set(consts), required - set(consts)


@pytest.mark.parametrize("bad,match", [
    (dict(num_warps=3), r"num_warps'\] must be a power of two in \[1, 32\]"),
    (dict(num_warps=64), r"num_warps'\] must be a power of two in \[1, 32\]"),
    (dict(BLOCK_M=1 << 20), r"BLOCK_M'\] = 1048576 x BLOCK_N = 16 is a tile of 16777216 elements"),
    (dict(BLOCK_M=2048, BLOCK_N=1024), r"above Triton's largest tensor \(1048576 elements\)"),
])
def test_portable_configs_triton_cannot_launch_are_refused_naming_the_key(bad, match):
    """Were accepted: num_warps=3 ran in the interpreter but is Triton's AssertionError ('num_warps must be a power
    of 2') on a GPU, and a tile past Triton's largest tensor an InterpreterError / compile error from deep inside."""
    inp = make_batch(**MIXED)
    with pytest.raises(ValueError, match=match):
        attention_triton(**inp, config=dict(SMALL, **bad))
    with pytest.raises(ValueError, match=match):  # the launch-plan path validates the same way
        attention_triton(**inp, config=dict(SMALL, **bad), check_values=False)


@pytest.mark.parametrize("config", [{1: 2, "BLOCK_M": 16}, {("a",): 1, "x": 2}, {None: 1, "BLOCK_N": 16}])
@pytest.mark.parametrize("check_values", [None, False])
def test_config_keys_of_mixed_types_are_named_as_unknown_keys(config, check_values):
    """A config dict whose keys do not sort together (an int or a tuple beside a str) raised TypeError "'<' not
    supported between instances of 'str' and 'int'" from the resolved-config cache's key, naming neither the
    argument nor the rule. Now it is the unknown-keys ValueError naming the keys and the allowed ones."""
    inp = make_batch(**MIXED)
    with pytest.raises(ValueError, match=r"config has unknown keys .*allowed"):
        attention_triton(**inp, config=config, check_values=check_values)
