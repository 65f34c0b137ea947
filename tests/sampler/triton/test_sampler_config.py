"""SamplerConfig (blockdiff.sampler.triton.config): field validation, resolution of the defaults, the default
soft-embedding path, and the stats_overlap rule (no silent no-op on the Triton GEMM path)."""
import pytest
import torch

from blockdiff.sampler import SamplerState, SamplingParams
from blockdiff.sampler import triton as ts
from blockdiff.sampler.triton.config import SamplerConfig, default_soft_impl


def test_sampler_config_flags_must_be_bools_and_stats_overlap_refuses_the_triton_gemm_path():
    """Regression: SamplerConfig(stats_overlap="no") silently meant True, and stats_overlap with the Triton GEMM
    soft embedding (explicit, or soft_impl=None resolving to it: CPU / fp32 E) silently did nothing. Now a
    TypeError / ValueError names the field, and sampler_step refuses before touching the state."""
    for name in ("use_tma", "soft_overlap", "stats_overlap"):
        with pytest.raises(TypeError, match=name):
            SamplerConfig(**{name: "no"})
        SamplerConfig(**{name: False})
    with pytest.raises(ValueError, match="stats_overlap"):
        SamplerConfig(soft_impl="triton_gemm", stats_overlap=True)
    st = SamplerState(1, 4, 30, 8)
    st.add_request(0, 3, SamplingParams(canvas_length=4))
    before = st.phase.clone()
    with pytest.raises(ValueError, match="stats_overlap"):   # CPU: soft_impl=None resolves to triton_gemm
        ts.sampler_step(st, torch.tensor([0]), torch.zeros(1, 4, 30), torch.tensor([True]), torch.zeros(30, 8),
                        config=SamplerConfig(stats_overlap=True))
    assert torch.equal(st.phase, before)


def test_default_soft_impl_is_chunked_on_cuda_for_half_embeddings_regression():
    """Regression: the default was once decided on the unresolved config and never picked the chunked path."""
    assert default_soft_impl(torch.device("cuda"), torch.bfloat16) == "chunked"
    assert default_soft_impl(torch.device("cuda"), torch.float16) == "chunked"
    assert default_soft_impl(torch.device("cuda"), torch.float32) == "triton_gemm"
    assert default_soft_impl(torch.device("cpu"), torch.bfloat16) == "triton_gemm"


def test_resolve_fills_every_field_and_keeps_explicit_ones():
    """resolve() leaves no None launch parameter and never overrides a given field; on the CPU the embedding dtype
    does not change the tiles (the fp32-E tiles are a GPU choice); split_k is clipped to the vocabulary's K tiles."""
    cpu = torch.device("cpu")
    r = SamplerConfig().resolve(64, 1000, 48, cpu)
    for name in ("block_p", "block_g", "split_v", "stats_warps", "stats_stages", "block_m", "block_n", "block_k",
                 "split_k", "gemm_warps", "gemm_stages"):
        assert getattr(r, name) is not None and getattr(r, name) >= 1, name
    assert r.resolve(64, 1000, 48, cpu) == r
    assert SamplerConfig().resolve(64, 1000, 48, cpu, torch.float32) == r
    mine = SamplerConfig(block_g=8, split_v=3, block_m=16, block_n=32, block_k=16, gemm_warps=2, soft_chunk=7)
    rm = mine.resolve(64, 1000, 48, cpu, torch.float32)
    assert (rm.block_g, rm.split_v, rm.block_m, rm.block_n, rm.block_k, rm.gemm_warps, rm.soft_chunk) == \
        (8, 3, 16, 32, 16, 2, 7)
    assert SamplerConfig(split_k=9).resolve(4, 100, 8, cpu).split_k == 2     # cdiv(V = 100, block_k = 64)


def test_check_stats_overlap_names_the_resolved_path():
    """check_stats_overlap passes without the option or with the chunked path, and names the path None resolved to
    otherwise; soft_impl_for follows default_soft_impl unless soft_impl is given."""
    SamplerConfig(stats_overlap=True, soft_impl="chunked").check_stats_overlap(torch.device("cpu"), torch.float32)
    SamplerConfig().check_stats_overlap(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="resolves to 'triton_gemm' for cpu"):
        SamplerConfig(stats_overlap=True).check_stats_overlap(torch.device("cpu"), torch.bfloat16)
    assert SamplerConfig().soft_impl_for(torch.device("cuda"), torch.bfloat16) == "chunked"
    assert SamplerConfig(soft_impl="triton_gemm").soft_impl_for(torch.device("cuda"), torch.bfloat16) == "triton_gemm"


@pytest.mark.parametrize("name, value, exc", [("split_k", 0, ValueError), ("gemm_warps", -1, ValueError),
                                              ("block_m", True, TypeError), ("split_v", 2.0, TypeError)])
def test_sampler_config_int_fields_must_be_ints_of_at_least_one(name, value, exc):
    """``split_k=0`` silently meant "automatic" (the same as None); a float or bool reached the launch."""
    with pytest.raises(exc, match=f"SamplerConfig.{name} must be an int >= 1"):
        SamplerConfig(**{name: value})


@pytest.mark.parametrize("name, value", [("block_p", 3), ("block_g", 3), ("block_g", 6), ("block_m", 3),
                                         ("block_m", 8), ("block_n", 5), ("block_k", 48), ("stats_warps", 3),
                                         ("gemm_warps", 6)])
def test_sampler_config_tiles_and_warps_must_be_powers_of_two(name, value):
    """block_p=3, block_g=3, block_m=3, ... were accepted and failed at the first sampler step inside Triton
    ("arange's range must be a power of 2"; on the GPU a tl.dot below 16 or a num_warps of 3 too): on a serving
    engine, mid-request. Now a ValueError at construction naming the field and why."""
    lo = 16 if name in ("block_m", "block_n", "block_k") else 1
    with pytest.raises(ValueError, match=rf"SamplerConfig.{name} must be a power of two >= {lo} or None .*got {value}"):
        SamplerConfig(**{name: value})
    SamplerConfig(**{name: 2 * lo})  # a power of two at least lo is taken
    for v in (16, 64, 1024):
        assert SamplerConfig().resolve(v, 1000, 48, torch.device("cpu")) is not None  # resolve's own tiles pass


@pytest.mark.parametrize("value", ["8", 2.5, True])
def test_sampler_config_soft_chunk_must_be_an_int(value):
    """soft_chunk went through int(): "8", 2.5 and True were taken as 8, 2 and 1 tokens (every other integer field
    refuses them); "x" was int()'s ValueError, naming nothing."""
    with pytest.raises(TypeError, match=rf"SamplerConfig.soft_chunk must be an int >= 1 tokens or None, got "
                                        rf"{type(value).__name__}"):
        SamplerConfig(soft_chunk=value)


@pytest.mark.parametrize("config", [{}, {"block_p": 1}, "chunked", 0, SamplerConfig])
def test_config_must_be_a_sampler_config_or_none_in_every_entry_point(config):
    """Regression: a config that is not a SamplerConfig was read as ``config or SamplerConfig()``: an empty dict (or 0,
    or "") silently ran the defaults, anything else failed with an AttributeError from inside the step
    ('dict' object has no attribute 'check_stats_overlap'), and the TP local pass of an empty shard returned before
    reading it (so ranks disagreed on whether the step failed). Now every entry point raises a TypeError naming
    config before it launches anything (the state untouched)."""
    from blockdiff.sampler.tp import sampler_step_sharded
    from blockdiff.sampler.tp.common import VocabShard
    from blockdiff.sampler.tp.step import local_pass
    from blockdiff.sampler.tp.triton import local_statistics_triton, soft_partial_triton
    from blockdiff.sampler.triton.soft_embedding import soft_embedding
    from blockdiff.sampler.triton.stats import row_stats
    st = SamplerState(2, 4, 30, 8)
    st.add_request(0, 3, SamplingParams(canvas_length=4))
    slots, pd = torch.tensor([0]), torch.tensor([True])
    x, E = torch.zeros(1, 4, 30), torch.zeros(30, 8)
    before = {k: v.clone() for k, v in vars(st).items() if isinstance(v, torch.Tensor)}
    with pytest.raises(TypeError, match="config must be a SamplerConfig or None"):
        ts.sampler_step(st, slots, x, pd, E, config)
    for backend in ("reference", "triton"):
        with pytest.raises(TypeError, match="config must be a SamplerConfig or None"):
            sampler_step_sharded(st, slots, x, pd, E, bounds=(0, 10, 30), backend=backend, config=config)
    for k, v in before.items():
        assert torch.equal(getattr(st, k), v), k
    one = torch.ones(1)
    z = torch.zeros(1, dtype=torch.int64)
    act = torch.ones(1, dtype=torch.bool)
    with pytest.raises(TypeError, match="config"):
        row_stats(x, one, z, z, z, z, act, config)
    with pytest.raises(TypeError, match="config"):
        soft_embedding(x, E, one, torch.zeros(1, 4), torch.ones(1, 4), torch.zeros(1, 4, dtype=torch.int64), act,
                       config)
    empty = VocabShard(30, 10, 10, 1, 3)                          # a rank holding no tokens refuses it too
    with pytest.raises(TypeError, match="config"):
        local_statistics_triton(x[..., :0], one, z, z, z, z, act, empty, config)
    with pytest.raises(TypeError, match="config"):
        local_pass("reference", x[..., :0], E[:0], one, z, z, z, z, act, empty, config)
    local = local_statistics_triton(x[..., :0], one, z, z, z, z, act, empty)
    with pytest.raises(TypeError, match="config"):
        soft_partial_triton(x[..., :0], E[:0], one, local, act, config)
