"""Named attention workloads of docs/ARCHITECTURE.md ("Named workloads"), ladders, and their tensor batches.

A :class:`Workload` is a pure shape description (no tensors); :func:`build` turns it into a :class:`Batch` of
random tensors on any device/dtype through :func:`blockdiff.attention.testing.make_batch`: packed ``q``, paged
``k_cache``/``v_cache`` with a *permuted* ``block_table`` (page ids of one sequence are not consecutive, as in a
long-running serving cache) and the metadata ``attention()`` takes. The K/V of every query token is already in the cache (``seq_lens`` includes the
query tokens), as vLLM writes it before attention.

Page size: 64 tokens by default (``DEFAULT_PAGE_SIZE``). It is a multiple of 16 (what FlashAttention's paged
path and TMA-free loads want), it divides the Triton backend's usual BLOCK_N of 64/128 into whole pages or
pages into whole tiles, and it keeps the block table of a 32k context at 513 entries. vLLM's own default is 16;
pass ``page_size=`` (CLI ``--page-size``) to measure others. Sizes that do not divide tiles are a correctness
concern covered by tests/attention, not by these benchmarks.

``quick=True`` scales every workload down for CPU smoke runs (lengths / 128, canvas 256 -> 16, 4 query heads,
head dims / 8, W = 1023 -> 7) keeping its structure: same batch composition, causal flags, GQA grouping and
window mode.

Shapes: DiffusionGemma-26B-A4B attention (16 query heads; sliding layers 8 KV heads, hd 256, W = 1023;
global layers 2 KV heads, hd 512), from the model card / HF config as summarised in docs/ARCHITECTURE.md.
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from blockdiff.attention import causal_row_counts
from blockdiff.attention.masks import batch_key_ranges, count_allowed_pairs
from blockdiff.attention.testing import make_batch

DEFAULT_PAGE_SIZE = 64
QUICK_PAGE_SIZE = 16
CANVAS = 256

#: Attention layer presets: (num_heads, num_kv_heads, head_dim, window_size, bidirectional_window).
LAYERS = {
    "sliding": (16, 8, 256, 1023, "symmetric"),
    "sliding_prefix": (16, 8, 256, 1023, "prefix"),
    "global": (16, 2, 512, None, "symmetric"),
    "hd128": (16, 8, 128, None, "symmetric"),
}

#: Anchors measured on this H200 (docs/ARCHITECTURE.md): CUDA-graph medians in ms, per workload and backend.
ANCHORS_MS = {
    "mixed_sliding_ctx8k": {"fa4": 0.164, "flex": 0.372},
    "canvas_bs1_ctx32k_hd128": {"fa4": 0.345, "flex": 0.629},
    "canvas_bs1_ctx32k_sliding": {"fa4": 0.035, "flex": 0.048},
    "canvas_bs4_ctx4k_hd128": {"fa4": 0.059, "flex": 0.093},
    "prefill16k_hd128": {"fa4": 1.73, "flex": 2.81},
}
#: FlexAttention BlockMask build time measured with the anchors (ms, range over the workloads).
FLEX_BUILD_ANCHOR_MS = (2.5, 5.6)


@dataclass(frozen=True)
class Workload:
    """Shape of one attention batch (no tensors).

    Attributes:
        name: workload name (docs/ARCHITECTURE.md table, or a ladder name).
        q_lens, seq_lens: per sequence, query tokens and keys (keys include the query tokens).
        causal: per sequence causal flag (prefill/commit True, denoise False).
        kinds: per sequence "prefill" / "denoise" / "commit" (documentation and plots only).
        num_heads, num_kv_heads, head_dim, head_dim_v: attention shape.
        window_size: None or W (keys per side, FlashAttention convention); bidirectional_window: mode.
        layer: preset name from LAYERS; anchors_ms: measured H200 anchors {backend: ms} (empty for quick shapes).
    """

    name: str
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    causal: tuple[bool, ...]
    kinds: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    window_size: int | None
    bidirectional_window: str
    layer: str
    anchors_ms: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def num_causal_q(self) -> tuple[int, ...]:
        """Causal rows per sequence (``q_len`` for prefill / commit, 0 for a denoise canvas)."""
        return tuple(q if c else 0 for q, c in zip(self.q_lens, self.causal))

    def key_ranges(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(seq_id, lo, hi)`` int64 [total_q] of every query row (:func:`blockdiff.attention.masks.batch_key_ranges`)."""
        return batch_key_ranges(*self._length_tensors(), self.window_size, self.bidirectional_window)

    def allowed_pairs(self) -> int:
        """Exact allowed (query, key) pairs per head (:func:`blockdiff.attention.masks.count_allowed_pairs`)."""
        return count_allowed_pairs(*self._length_tensors(), self.window_size, self.bidirectional_window)

    def _length_tensors(self):
        return (torch.tensor(self.q_lens, dtype=torch.int64), torch.tensor(self.seq_lens, dtype=torch.int64),
                torch.tensor(self.num_causal_q, dtype=torch.int64))

    def describe(self) -> str:
        parts = [f"{k}:{q}/{s}" for k, q, s in zip(self.kinds, self.q_lens, self.seq_lens)]
        w = "full" if self.window_size is None else f"W={self.window_size} {self.bidirectional_window}"
        return (f"{self.name}: H={self.num_heads} Hkv={self.num_kv_heads} D={self.head_dim} {w}; "
                + ", ".join(parts))


class _Scale:
    """Length/head scaling: identity for the real shapes, shrunk for ``quick`` CPU runs; ``small`` keeps the
    heads, head dims, window and canvas and divides the other lengths by 8 (fast GPU smoke runs)."""

    def __init__(self, quick: bool, small: bool = False):
        self.quick = quick
        self.small = small

    def length(self, n: int) -> int:
        if self.small:
            return max(1, n // 8)
        return max(1, n // 128) if self.quick else n

    def canvas(self) -> int:
        return 16 if self.quick else CANVAS

    def layer(self, name: str):
        h, hkv, d, w, mode = LAYERS[name]
        if not self.quick:
            return h, hkv, d, w, mode
        hkv_q = 2 if h // hkv <= 2 else 1  # keeps "few KV heads" (global) apart from "many" (sliding)
        return 4, hkv_q, max(16, d // 8), (None if w is None else (w + 1) // 128 - 1), mode


def _make(name: str, layer: str, seqs: Sequence[tuple[str, int, int]], scale: _Scale) -> Workload:
    """seqs: (kind, q_len, context) with unscaled sizes; kind in prefill/denoise/commit."""
    h, hkv, d, w, mode = scale.layer(layer)
    q_lens, seq_lens, causal, kinds = [], [], [], []
    for kind, q, ctx in seqs:
        ql = scale.canvas() if (kind != "prefill" and q == CANVAS) else scale.length(q)
        ctx_s = scale.length(ctx) if ctx else 0
        q_lens.append(ql)
        seq_lens.append(ctx_s + ql)
        causal.append(kind != "denoise")
        kinds.append(kind)
    return Workload(name=name, q_lens=tuple(q_lens), seq_lens=tuple(seq_lens), causal=tuple(causal),
                    kinds=tuple(kinds), num_heads=h, num_kv_heads=hkv, head_dim=d, head_dim_v=d,
                    window_size=w, bidirectional_window=mode, layer=layer,
                    anchors_ms={} if (scale.quick or scale.small) else dict(ANCHORS_MS.get(name, {})))


def _mixed(ctx: int = 8192):
    return [("prefill", 4096, 0), ("denoise", CANVAS, ctx), ("denoise", CANVAS, ctx), ("commit", CANVAS, ctx)]


def named_workloads(quick: bool = False, small: bool = False) -> list[Workload]:
    """The eight attention workloads of docs/ARCHITECTURE.md (``sampler_n4`` belongs to bench_sampler.py).

    ``quick``: CPU-sized shapes; ``small``: real heads/head dims/window/canvas, other lengths / 8 (GPU smoke).
    """
    s = _Scale(quick, small and not quick)
    return [
        _make("mixed_sliding_ctx8k", "sliding", _mixed(), s),
        _make("mixed_sliding_prefix_ctx8k", "sliding_prefix", _mixed(), s),
        _make("mixed_global_ctx8k", "global", _mixed(), s),
        _make("canvas_bs1_ctx32k_global", "global", [("denoise", CANVAS, 32768)], s),
        _make("canvas_bs1_ctx32k_sliding", "sliding", [("denoise", CANVAS, 32768)], s),
        _make("canvas_bs1_ctx32k_hd128", "hd128", [("denoise", CANVAS, 32768)], s),
        _make("canvas_bs4_ctx4k_hd128", "hd128", [("denoise", CANVAS, 4096)] * 4, s),
        _make("prefill16k_hd128", "hd128", [("prefill", 16384, 0)], s),
    ]


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


_CANVAS_NAME = re.compile(r"^canvas_bs(?P<bs>\d+)_ctx(?P<ctx>\d+)(?P<k>k?)_(?P<layer>\w+)$")


def parse_canvas_name(name: str) -> tuple[int, int, str] | None:
    """``(canvases, context tokens, layer)`` of a ladder / canvas workload name ``canvas_bs{n}_ctx{c}_{layer}``
    (the inverse of the names built here), else None."""
    m = _CANVAS_NAME.match(name)
    if m is None:
        return None
    return int(m["bs"]), int(m["ctx"]) * (1024 if m["k"] else 1), m["layer"]


def batch_ladder(layers: Sequence[str] = ("sliding", "global", "hd128"), ctx: int = 8192,
                 sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), quick: bool = False) -> list[Workload]:
    """Denoise-only batches of ``n`` canvases of 256 over ``ctx`` context each: ``canvas_bs{n}_ctx{ctx}_{layer}``."""
    s = _Scale(quick)
    return [_make(f"canvas_bs{n}_ctx{_k(ctx)}_{layer}", layer, [("denoise", CANVAS, ctx)] * n, s)
            for layer in layers for n in sizes]


def context_ladder(layers: Sequence[str] = ("sliding", "global", "hd128"),
                   contexts: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
                   batch: int = 1, quick: bool = False) -> list[Workload]:
    """``batch`` denoise canvases over growing contexts: ``canvas_bs{batch}_ctx{c}_{layer}``."""
    s = _Scale(quick)
    return [_make(f"canvas_bs{batch}_ctx{_k(c)}_{layer}", layer, [("denoise", CANVAS, c)] * batch, s)
            for layer in layers for c in contexts]


def small_workloads(quick: bool = False) -> list[Workload]:
    """The named workloads with real heads, head dims, window and canvas but contexts / 8 (GPU smoke runs)."""
    return named_workloads(quick=quick, small=True)


SUITES = {
    "named": named_workloads,
    "small": small_workloads,
    "batch_ladder": batch_ladder,
    "ctx_ladder": context_ladder,
}


def select(workloads: Sequence[Workload], patterns: str | Sequence[str] | None) -> list[Workload]:
    """Workloads whose name matches any comma-separated glob of ``patterns`` (all when None/empty).

    Raises:
        ValueError: a pattern matches no workload, or ``patterns`` is given but names none (``","``, ``" "``, a list
            of empty strings: typos must not silently measure nothing).
        TypeError: ``patterns`` is neither None, a str nor a sequence of str.
    """
    if patterns is None:
        return list(workloads)
    items = patterns.split(",") if isinstance(patterns, str) else list(patterns) if isinstance(patterns, Sequence) \
        else None
    if items is None or not all(isinstance(p, str) for p in items):
        raise TypeError(f"--workloads patterns must be a str of comma-separated globs or a sequence of str, got "
                        f"{patterns!r}")
    if not patterns:  # "" or []: all (the CLI's default)
        return list(workloads)
    pats = [p.strip() for p in items if p.strip()]
    if not pats:
        raise ValueError(f"--workloads {patterns!r} names no pattern (comma-separated globs of workload names; "
                         "leave it empty for all)")
    out = []
    for p in pats:
        hit = [w for w in workloads if fnmatch.fnmatchcase(w.name, p)]
        if not hit:
            raise ValueError(f"--workloads pattern {p!r} matches none of {[w.name for w in workloads]}")
        out += [w for w in hit if w not in out]
    return out


@dataclass
class Batch:
    """Tensors of one built workload.

    q [total_q, H, D]; k_cache/v_cache [num_blocks, page_size, Hkv, D(v)]; block_table [B, max_blocks] int32;
    cu_seqlens_q [B+1] int32; seq_lens [B] int32; causal [B] bool (all on ``device``); host copies of the
    lengths in ``q_lens_host``/``seq_lens_host``; ``scale`` the softmax scale (head_dim**-0.5).
    """

    workload: Workload
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    causal: torch.Tensor
    page_size: int
    scale: float
    q_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def window_size(self):
        return self.workload.window_size

    @property
    def bidirectional_window(self):
        return self.workload.bidirectional_window

    @property
    def max_seqlen_q(self) -> int:
        return max(self.q_lens_host)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seq_lens_host)

    def attn_kwargs(self) -> dict:
        """Keyword arguments of ``blockdiff.attention.attention`` (everything but q/k_cache/v_cache/backend)."""
        return dict(cu_seqlens_q=self.cu_seqlens_q, seq_lens=self.seq_lens, causal=self.causal,
                    block_table=self.block_table, window_size=self.window_size,
                    bidirectional_window=self.bidirectional_window, scale=self.scale,
                    max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k)

    def kv_of(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K, V [seq_len_b, Hkv, D(v)] of sequence ``b`` gathered from the paged cache."""
        n = self.seq_lens_host[b]
        pages = self.block_table[b, : math.ceil(n / self.page_size)].long()
        k = self.k_cache[pages].flatten(0, 1)[:n]
        v = self.v_cache[pages].flatten(0, 1)[:n]
        return k, v

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed K [total_k, Hkv, D], V [total_k, Hkv, Dv] and cu_seqlens_k [B+1] int32 (the varlen form)."""
        ks, vs = zip(*(self.kv_of(b) for b in range(len(self.q_lens_host))))
        cu = torch.tensor([0] + list(_cumsum(self.seq_lens_host)), dtype=torch.int32, device=self.q.device)
        return torch.cat(ks), torch.cat(vs), cu

    def layouts(self) -> dict:
        """``{"paged": (k_cache, v_cache, kwargs), "contiguous": (k, v, kwargs)}``: both KV layouts of the batch
        with the keyword arguments of ``attention`` (:meth:`attn_kwargs`; the causal flags as ``num_causal_q`` row
        counts, built once outside any timing as a serving step builds its metadata)."""
        kw = self.attn_kwargs()
        kw["num_causal_q"] = causal_row_counts(kw.pop("causal"), kw["cu_seqlens_q"])
        kwc = {k: v for k, v in kw.items() if k != "block_table"}
        k, v, kwc["cu_seqlens_k"] = self.contiguous_kv()
        return {"paged": (self.k_cache, self.v_cache, kw), "contiguous": (k, v, kwc)}

    def q_of(self, b: int) -> torch.Tensor:
        s = sum(self.q_lens_host[:b])
        return self.q[s: s + self.q_lens_host[b]]


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


def build(w: Workload, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
          page_size: int = DEFAULT_PAGE_SIZE, seed: int = 0, spare_blocks: int = 1) -> Batch:
    """Random tensors for workload ``w`` (N(0, 1) q/k/v), paged with a permuted block table.

    The tensors come from :func:`blockdiff.attention.testing.make_batch` (the one batch builder; drawn on
    ``device``), with block-table rows padded with page 0 up to the longest sequence's pages.

    Args:
        w: the workload; device/dtype: where and how (bf16/fp16/fp32); page_size: tokens per page (>= 1);
        seed: generator seed (same seed -> same tensors on a device); spare_blocks: extra unused pages.

    Raises:
        ValueError: page_size < 1 (from make_batch).
    """
    t = make_batch(w.seq_lens, w.q_lens, causal=list(w.causal), num_heads=w.num_heads,
                   num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, head_dim_v=w.head_dim_v, page_size=page_size,
                   dtype=dtype, device=device, seed=seed, extra_blocks=spare_blocks, extra_columns=0,
                   block_table_pad="zeros")
    return Batch(workload=w, q=t["q"], k_cache=t["k_cache"], v_cache=t["v_cache"], block_table=t["block_table"],
                 cu_seqlens_q=t["cu_seqlens_q"], seq_lens=t["seq_lens"], causal=t["causal"], page_size=page_size,
                 scale=w.head_dim ** -0.5, q_lens_host=list(w.q_lens), seq_lens_host=list(w.seq_lens))
