"""Launch configuration of the Triton sampler backend: :class:`SamplerConfig`, its validation, its defaults and the
choice of the soft-embedding path. The one owner of every tunable of :mod:`blockdiff.sampler.triton`; the
measured history of the defaults is in docs/tuning.md.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import triton

__all__ = ["SamplerConfig", "SOFT_IMPLS", "default_soft_impl", "check_config", "plan_key"]

#: Soft-embedding implementations selectable by ``SamplerConfig.soft_impl``.
SOFT_IMPLS = ("triton_gemm", "chunked")


def default_soft_impl(device: torch.device, embedding_dtype: torch.dtype) -> str:
    """The soft-embedding path used when ``SamplerConfig.soft_impl`` is None: ``"chunked"`` (bf16 probability
    chunks + cuBLAS, fp32 accumulation) on CUDA with a bf16/fp16 embedding, else ``"triton_gemm"``.

    Rationale: on the GPU cuBLAS runs the product near the tensor-core peak, faster than the split-K Triton GEMM
    that recomputes p per column tile; elsewhere (the interpreter, fp32 E) the Triton GEMM is the exact path.
    """
    cuda = torch.device(device).type == "cuda"
    return "chunked" if cuda and embedding_dtype in (torch.bfloat16, torch.float16) else "triton_gemm"


#: Launch fields that Triton needs as powers of two, with their least value: the stats tile's ``tl.arange`` extents
#: (``block_p`` positions, ``4 * block_g`` tokens), the soft GEMM's ``tl.dot`` tiles (>= 16 on the GPU) and
#: ``num_warps``. Another value failed at the first sampler step, inside Triton's compiler (on a serving engine).
_POW2_FIELDS = {"block_p": 1, "block_g": 1, "block_m": 16, "block_n": 16, "block_k": 16, "stats_warps": 1,
                "gemm_warps": 1}
_POW2_WHY = {"block_p": "the stats tile's positions (tl.arange)", "block_g": "the stats tile's 4 * block_g tokens "
             "(tl.arange)", "block_m": "a tl.dot tile", "block_n": "a tl.dot tile", "block_k": "a tl.dot tile",
             "stats_warps": "Triton's num_warps", "gemm_warps": "Triton's num_warps"}


@dataclass(frozen=True)
class SamplerConfig:
    """Static launch parameters (compile-cache keys). ``None`` = chosen from the shapes by :meth:`resolve`.

    block_p: canvas positions per stats program (1 on the GPU; many under the interpreter, whose cost is per op).
    block_g: token groups of 4 per stats tile (tile = block_p x 4 * block_g tokens). split_v: vocabulary splits of
    the stats pass. stats_warps / stats_stages: warps and load pipeline depth of the stats kernel.
    block_m/n/k, split_k, gemm_warps / gemm_stages: the split-K soft-embedding GEMM.
    use_tma: the GEMM reads logits and E through TMA tensor descriptors (None: wherever they apply; True: required,
    ValueError where they do not apply).
    soft_impl: the soft-embedding path, ``"chunked"`` (:func:`default_soft_impl` on CUDA with a bf16/fp16
    embedding: bf16 probabilities per vocabulary chunk + cuBLAS with fp32 accumulation) or ``"triton_gemm"``
    (otherwise: the split-K Triton GEMM); both in :mod:`blockdiff.sampler.triton.soft_embedding`.
    soft_chunk: the chunked path's vocabulary chunk in tokens (None:
        :func:`~blockdiff.sampler.triton.soft_embedding.chunk_size`: the buffer [N * CL, chunk] <= 32 MiB, up to
        256 MiB at large batches for 16,384-token chunks; with soft_overlap its two buffers together).
    soft_overlap: chunked path on CUDA: write the next chunk's probabilities on a side stream during the GEMM
        (two probability buffers within the one buffer's budget: half-size automatic chunks).
    stats_overlap: chunked path: take the soft embedding's normalisers from a memory-bound pre-pass
    (:func:`blockdiff.sampler.triton.stats.row_moments`) and run the soft embedding's GEMMs on a high-priority
    side stream while the compute-bound stats pass (Philox, logs) runs beside them (CUDA; on the CPU the same
    computation runs in order). Decisions are unchanged (exact); the soft rows differ from the default path by
    float rounding of the normalisers. None: off (cuBLAS's GEMMs hold every SM, so nothing overlaps; an option
    for GEMMs that leave SMs free). With the Triton GEMM it is an error (ValueError here for an explicit
    ``soft_impl="triton_gemm"``, in :meth:`check_stats_overlap` where None resolves to it).

    Raises:
        ValueError: unknown ``soft_impl``, ``soft_chunk < 1``, ``stats_overlap`` with ``soft_impl="triton_gemm"``,
            an integer field (``block_p`` ... ``gemm_stages``) < 1; ``block_p``, ``block_g``, ``stats_warps``,
            ``gemm_warps`` not a power of two, ``block_m`` / ``block_n`` / ``block_k`` not a power of two >= 16
            (:data:`_POW2_FIELDS`: Triton refused them at the first step).
        TypeError: ``use_tma`` / ``soft_overlap`` / ``stats_overlap`` not a bool or None; an integer field
            (``soft_chunk`` included) not an int or None.
    """

    block_p: int | None = None
    block_g: int | None = None
    split_v: int | None = None
    stats_warps: int | None = None
    stats_stages: int | None = None
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    split_k: int | None = None
    gemm_warps: int | None = None
    gemm_stages: int | None = None
    use_tma: bool | None = None
    soft_impl: str | None = None
    soft_chunk: int | None = None
    soft_overlap: bool | None = None
    stats_overlap: bool | None = None

    def __post_init__(self):
        for name in ("block_p", "block_g", "split_v", "stats_warps", "stats_stages", "block_m", "block_n", "block_k",
                     "split_k", "gemm_warps", "gemm_stages", "soft_chunk"):
            v = getattr(self, name)  # None chooses from the shapes; 0 is not a second spelling of it
            unit = " tokens" if name == "soft_chunk" else ""  # ("8", 2.5, True: refused, never coerced)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"SamplerConfig.{name} must be an int >= 1{unit} or None, got {type(v).__name__} "
                                f"({v!r})")
            if v is not None and v < 1:
                raise ValueError(f"SamplerConfig.{name} must be an int >= 1{unit} or None (chosen from the shapes), "
                                 f"got {v}")
        if self.soft_impl not in SOFT_IMPLS + (None,):
            raise ValueError(f"SamplerConfig.soft_impl must be one of {SOFT_IMPLS}, got {self.soft_impl!r}")
        for name, lo in _POW2_FIELDS.items():  # tl.arange extents (a power of two), tl.dot tiles (>= 16), num_warps
            v = getattr(self, name)
            if v is not None and (v < lo or v & (v - 1)):
                raise ValueError(f"SamplerConfig.{name} must be a power of two >= {lo} or None (chosen from the "
                                 f"shapes), got {v}: {_POW2_WHY[name]}")
        for name in ("use_tma", "soft_overlap", "stats_overlap"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"SamplerConfig.{name} must be a bool or None, got {type(v).__name__} ({v!r})")
        if self.stats_overlap and self.soft_impl == "triton_gemm":
            raise ValueError("SamplerConfig.stats_overlap=True needs the chunked soft embedding (soft_impl='chunked' "
                             "or None where that is the default), got soft_impl='triton_gemm'")

    def soft_impl_for(self, device: torch.device, embedding_dtype: torch.dtype) -> str:
        """The soft-embedding path of a call: ``soft_impl``, else :func:`default_soft_impl`."""
        return self.soft_impl or default_soft_impl(device, embedding_dtype)

    def check_stats_overlap(self, device: torch.device, embedding_dtype: torch.dtype) -> None:
        """No silent no-op: ``stats_overlap`` needs the chunked path, also where ``soft_impl=None`` resolves to the
        Triton GEMM (CPU logits, fp32 E).

        Raises:
            ValueError: ``stats_overlap`` and the call's soft-embedding path is ``"triton_gemm"``.
        """
        if self.stats_overlap and self.soft_impl_for(device, embedding_dtype) != "chunked":
            raise ValueError("config.stats_overlap=True needs the chunked soft embedding; soft_impl=None resolves "
                             f"to 'triton_gemm' for {torch.device(device).type} logits and a {embedding_dtype} "
                             "embedding (set soft_impl='chunked')")

    def resolve(self, rows: int, V: int, hidden: int, device: torch.device,
                embedding_dtype: torch.dtype | None = None) -> "SamplerConfig":
        """Every ``None`` field filled in for a call of ``rows`` canvas positions, vocabulary ``V``, ``hidden`` and
        the GEMM's embedding dtype (``torch.float32``: the exact-products tiles), on ``device``.

        Defaults (GPU; the interpreter takes tiles sized to the problem, whose cost is per op):
        - stats: one position per program, 256 x 4-token tiles (1024 tokens per iteration), 4 warps (8 were
          slower), 3-deep loads;
        - vocabulary splits: enough (<= 8) programs for two per SM;
        - soft GEMM, bf16/fp16 E: 128 x 256 x 64 tiles, 8 warps, 3 stages (a wide N tile halves how often the
          A operand's exp2 is recomputed: once per column tile); fp32 E (exact fp32 products on the FMA units):
          64 x 64 x 16, 4 warps (larger tiles spill the accumulators);
        - split_k: the count <= 4 (workspace) whose CTAs best fill whole waves over the SMs (sampler_n4 on 132
          SMs: 88 tiles x 3 = 2 waves).
        """
        cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        block_p = self.block_p or (1 if cuda else min(64, triton.next_power_of_2(max(rows, 1))))
        block_g = self.block_g or (256 if cuda else min(64, triton.next_power_of_2(max(1, (V + 3) // 4))))
        split_v = self.split_v or max(1, min(8, (2 * sms * block_p + rows - 1) // max(rows, 1)))
        gemm_warps = self.gemm_warps
        if cuda and embedding_dtype == torch.float32:
            bm, bn, bk = self.block_m or 64, self.block_n or 64, self.block_k or 16
            gemm_warps = gemm_warps or 4
        elif cuda:
            bm, bn, bk = self.block_m or 128, self.block_n or 256, self.block_k or 64
        else:
            bm = self.block_m or max(16, min(64, triton.next_power_of_2(max(rows, 1))))
            bn = self.block_n or max(16, min(64, triton.next_power_of_2(hidden)))
            bk = self.block_k or 64
        tiles = triton.cdiv(rows, bm) * triton.cdiv(hidden, bn)
        if self.split_k:
            split_k = self.split_k
        elif not cuda or tiles == 0:  # no rows (e.g. a step without denoise rows): nothing to split
            split_k = 1
        else:
            def eff(k):
                return tiles * k / (triton.cdiv(tiles * k, sms) * sms)
            split_k = max(range(1, 5), key=lambda k: (round(eff(k), 3), -k))
        split_k = max(1, min(split_k, triton.cdiv(V, bk)))
        return SamplerConfig(block_p, block_g, split_v, self.stats_warps or 4,
                             self.stats_stages or (3 if cuda else 1), bm, bn, bk, split_k,
                             gemm_warps or (8 if cuda else 4), self.gemm_stages or (3 if cuda else 1),
                             self.use_tma, self.soft_impl, self.soft_chunk, self.soft_overlap, self.stats_overlap)


def check_config(config) -> SamplerConfig:
    """The :class:`SamplerConfig` of a call: ``config`` itself, or the defaults for None. Every entry point that
    takes a ``config`` runs this before it launches anything.

    Raises:
        TypeError: ``config`` is neither a :class:`SamplerConfig` nor None (names ``config``). ``config or
            SamplerConfig()`` took an empty dict as the defaults, and anything else failed with an AttributeError
            inside the step, or (an empty TP shard returns before reading it) on some ranks only.
    """
    if config is None:
        return SamplerConfig()
    if not isinstance(config, SamplerConfig):
        raise TypeError(f"config must be a SamplerConfig or None, got {type(config).__name__} ({config!r})")
    return config


def plan_key(dims: tuple, device) -> tuple[tuple[int, ...], torch.device]:
    """``(dims as Python ints, device)`` for a cached launch plan (``stats_plan``, the soft embedding's plans): the
    key of a pure function. An index-less ``"cuda"`` means the current device, whose SM count
    :meth:`SamplerConfig.resolve` reads: it is pinned to that index here (a plan cached under ``cuda`` kept the
    device current at its first call, another GPU's split counts after a ``torch.cuda.set_device``). Numpy
    integers become ints (``np.int64(V)`` hashes as ``V``: a plan cached for a numpy caller handed its numpy
    values to every later int caller of the same shapes).

    Raises:
        TypeError: a dim that is not an integer (``operator.index``).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return tuple(operator.index(d) for d in dims), device
