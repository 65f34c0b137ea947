"""Offline sm_90a compile check of the Gluon kernels, of the portable kernel and of the split-KV merge: compile one
configuration for a ``GPUTarget`` without a GPU and run ``ptxas -v`` on its PTX (registers, spills, shared memory),
for CPU tests and for pre-screening tiles. The constexprs are :func:`.config.kernel_constexprs`' (the merge's:
:func:`.config.merge_constexprs`'), as a launch plan's.
"""
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from .config import KernelShape, TritonConfig, check_gluon_config, kernel_constexprs, kernel_variant, tma_boxes
from .gluon import KERNELS
from .portable import _attn_fwd_kernel
from .tma import make_kv_descriptors

#: the kernels' per-step integer arguments (Triton does not specialise them: ``do_not_specialize``)
_INT_ARGS = {"total_q", "num_seqs", "n_tiles", "window", "num_splits", "v_rows"}


def compile_for_sm90(*, block_m: int, block_n: int, num_warps: int, num_stages: int, head_dim: int, paged: bool,
                     split: bool, window: bool, group: int = 2, num_kv_heads: int = 8,
                     overlap: bool | str = True, page_size: int | None = None, v_stages: int | None = None,
                     causal_flags: bool = False, lazy: bool = False, nan_safe_v: bool = False) -> dict:
    """Compile the Gluon kernel of a config for sm_90a without a GPU (Triton ``GPUTarget``) and run ``ptxas -v``.

    bf16, ``head_dim == head_dim_v``, ``num_kv_heads * group`` query heads. ``page_size`` (default
    max(128, block_n)) sets the TMA box rows (:func:`.tma.tma_box_rows`), ``v_stages`` the V ring depth (None:
    ``num_stages``), ``causal_flags`` whether the kernel reads ``[B]`` bool causal flags instead of
    ``num_causal_q``, ``lazy`` the conditional rescaling (``config["LAZY_RESCALE"]``), ``nan_safe_v`` the NaN /
    Inf V clean-up and fix-up (``config["NAN_SAFE_V"]``: the kernel arguments ``V``, ``v_row_stride``, ``v_rows``;
    off, they are None, as a launch passes them, so no kernel parameter); ``overlap="roles"``
    compiles the roles kernel (``num_warps`` = 4 x (1 + its PV warpgroups)), else ``head_dim > 256`` the wide
    kernel. Must run in a process where ``TRITON_INTERPRET`` is unset (the interpreter replaces the
    ``@triton.jit`` helpers Gluon calls).

    Returns:
        ``{"shared": bytes, "ptxas": report, "wgmma": bool, "tma": bool, "setmaxnreg": bool,
        "setmaxnreg_values": [int], "exp2_from_fma": int}`` (:func:`exp2_operands_from_fma`).

    Raises:
        ValueError: a config the Gluon kernels refuse (:func:`.config.check_gluon_config`).
        RuntimeError: ptxas failed.
    """
    cfg = TritonConfig(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
                       BLOCK_DV=head_dim, LAZY_RESCALE=lazy, IMPL="gluon", OVERLAP=overlap, V_STAGES=v_stages,
                       NAN_SAFE_V=nan_safe_v)
    check_gluon_config(cfg, head_dim, head_dim)
    H, D = num_kv_heads * group, head_dim
    page = page_size or max(128, block_n)
    shape = KernelShape(group=group, head_dim=D, head_dim_v=D, dtype=torch.bfloat16, paged=paged, page_size=page,
                        has_window=window, prefix=False, causal_flags=causal_flags, split=split, store_lse=True,
                        search_steps=1)
    q = torch.empty(256, H, D, dtype=torch.bfloat16)
    kc = torch.empty(8, page, num_kv_heads, D, dtype=torch.bfloat16) if paged else \
        torch.empty(1024, num_kv_heads, D, dtype=torch.bfloat16)
    kd, vd = make_kv_descriptors(kc, kc, *tma_boxes(cfg, shape))
    i32, f32 = torch.empty(4, dtype=torch.int32), torch.empty(4, dtype=torch.float32)
    fn = KERNELS[kernel_variant(cfg, D)]
    args = dict(Q=q, k_desc=kd, v_desc=vd, O=q, LSE=f32, OPART=f32, STATPART=f32, CU_Q=i32, SEQ_LENS=i32,
                NCQ=torch.empty(4, dtype=torch.bool) if causal_flags else i32,
                BT=i32, CU_K=i32, stride_qt=H * D, stride_qh=D, stride_ot=H * D, stride_oh=D, stride_bt=7,
                qk_scale=0.1, num_heads=H, V=kc, v_row_stride=num_kv_heads * D)
    consts = kernel_constexprs(cfg, shape)
    maxnreg = consts.pop("maxnreg")  # a launch option, not a kernel argument
    if not nan_safe_v:  # plans.run_plan passes None: constexprs
        consts.update(V=None, v_row_stride=None, v_rows=None)
    sig = {n: "constexpr" if n in consts else "i32" if n in _INT_ARGS else mangle_type(args[n]) for n in fn.arg_names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=consts["num_warps"], maxnreg=maxnreg))
    ptx = ck.asm["ptx"]
    report = _ptxas(ptx)
    return {"shared": ck.metadata.shared, "ptxas": report, "wgmma": "wgmma.mma_async" in ptx,
            "tma": "cp.async.bulk.tensor" in ptx, "setmaxnreg": "setmaxnreg" in ptx,
            "exp2_from_fma": exp2_operands_from_fma(ptx),
            "setmaxnreg_values": sorted({int(v) for v in
                                         re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})}


_PTX_INSTR = re.compile(r"^\s*(?:@%\w+\s+)?([a-z][\w.]*)\s+(%\w+)\s*,?\s*([^;]*);")


def exp2_operands_from_fma(ptx: str) -> int:
    """How many ``ex2.approx`` instructions of a PTX text take an operand an ``fma`` wrote (the last write before
    them in the text, followed back through register-to-register ``mov``). The kernels' weights must be
    ``exp2((s - m) * c)``, a subtraction then a multiply: an FMA into ``exp2`` against a rounded row max
    (``exp2(fma(s, c, -round(m * c)))``, which LLVM contracts a multiply and a subtraction into) keeps the
    product's rounding error, inf or 0 for scores beyond ~2^31 in log2 units."""
    writer, n = {}, 0
    for line in ptx.splitlines():
        m = _PTX_INSTR.match(line)
        if not m:
            continue
        op, dst, rest = m.groups()
        src = rest.split(",")[0].strip()
        if op.startswith("ex2.approx"):
            n += writer.get(src, "").startswith("fma")
        # a register-to-register move passes its source's writer on (an FMA copied into an exp2 still counts)
        writer[dst] = writer.get(src, op) if op.startswith("mov.") and src.startswith("%") else op
    return n


def _ptxas(ptx: str) -> str:
    """``ptxas -v`` for sm_90a on a PTX text: its report (stderr). Raises RuntimeError if ptxas fails."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                           text=True, timeout=600)
    finally:
        os.unlink(f.name)
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {r.stderr[-2000:]}")
    return r.stderr


def compile_portable_for_sm90(*, block_m: int, block_n: int, num_warps: int, num_stages: int, head_dim: int,
                              paged: bool, page_size: int | None = None, window: bool = False, prefix: bool = False,
                              split: bool = False, group: int = 2, lazy: bool = False) -> dict:
    """Compile the portable kernel (:func:`.portable._attn_fwd_kernel`) of a config for sm_90a without a GPU and
    run ``ptxas -v``: bf16, ``head_dim == head_dim_v`` (no V slices), ``num_causal_q`` counts, LSE stored, with
    the 16-byte divisibility a GPU launch specialises pointers and strides on (so loads vectorise as they do
    there). Must run where ``TRITON_INTERPRET`` is unset.

    Returns:
        ``{"ptxas": report, "registers": int (the kernel's), "kernel_spills": bytes of spill stores in the kernel,
        "cold_spills": those of its non-inlined cold functions (:func:`.portable._nonfinite_tile`),
        "exp2_from_fma": int}`` (:func:`exp2_operands_from_fma`).

    Raises:
        RuntimeError: ptxas failed.
    """
    BV = max(16, 1 << (head_dim - 1).bit_length())
    cfg = TritonConfig(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, BLOCK_DV=BV,
                       LAZY_RESCALE=lazy)
    shape = KernelShape(group=group, head_dim=head_dim, head_dim_v=head_dim, dtype=torch.bfloat16, paged=paged,
                        page_size=page_size if paged else None, has_window=window, prefix=prefix,
                        causal_flags=False, split=split, store_lse=True, search_steps=1)
    consts = kernel_constexprs(cfg, shape)
    options = dict(num_warps=consts.pop("num_warps"), num_stages=consts.pop("num_stages"))
    fn = _attn_fwd_kernel
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "OPART": "*fp32",
                "STATPART": "*fp32", "CU_Q": "*i32", "SEQ_LENS": "*i32", "NCQ": "*i32", "BT": "*i32", "CU_K": "*i32"}
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if n in pointers or n == "num_heads"
               or (n.startswith("stride_") and n != "stride_bt")]
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    report = _ptxas(ck.asm["ptx"])
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", report)]
    spills = {name.strip(): int(n) for name, n in
              re.findall(r"Function properties for (\S+)\s+\d+ bytes stack frame, (\d+) bytes spill stores", report)}
    return {"ptxas": report, "registers": regs[0] if regs else 0, "kernel_spills": spills.get(fn.__name__, 0),
            "exp2_from_fma": exp2_operands_from_fma(ck.asm["ptx"]),
            "cold_spills": sum(n for name, n in spills.items() if name != fn.__name__)}


def compile_merge_for_sm90(*, num_splits: int, head_dim_v: int, raw_stats: bool, store_lse: bool = True,
                           pdl: bool = True, out_dtype: str = "bf16") -> dict:
    """Compile the split-KV merge (:func:`blockdiff.attention.split_merge._merge_kernel`) for sm_90a without a GPU,
    with its constexprs as a launch plan's (:func:`.config.merge_constexprs`; ``raw_stats``: the triton backend's
    raw max and sum, else the cute backend's LSE partials), and run ``ptxas -v``. Must run where
    ``TRITON_INTERPRET`` is unset.

    Returns:
        ``{"ptxas": report, "registers": int, "spills": bytes of spill stores, "exp2_from_fma": int,
        "griddepcontrol": bool}`` (:func:`exp2_operands_from_fma`).

    Raises:
        RuntimeError: ptxas failed.
    """
    from ..split_merge import _merge_kernel, merge_constexprs

    consts = merge_constexprs(num_splits, head_dim_v, store_lse, pdl, False, raw_stats=raw_stats)
    options = dict(num_warps=consts.pop("num_warps"))
    consts.pop("launch_pdl")
    fn = _merge_kernel
    types = dict(OPART="*fp32", STATS="*fp32", O=f"*{out_dtype}", LSE="*fp32", scale_log2="fp32")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = ck.asm["ptx"]
    report = _ptxas(ptx)
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", report)]
    return {"ptxas": report, "registers": regs[0] if regs else 0,
            "spills": sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report)),
            "exp2_from_fma": exp2_operands_from_fma(ptx), "griddepcontrol": "griddepcontrol.wait" in ptx}


__all__ = ["compile_for_sm90", "compile_portable_for_sm90", "compile_merge_for_sm90", "exp2_operands_from_fma"]
