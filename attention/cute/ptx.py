"""Inline PTX for the cute backend's kernels: one wrapper around ``llvm.inline_asm`` (:func:`asm`) and the scalar
helpers the kernels share. The CuTe DSL (nvidia-cutlass-dsl 4.8.1) has no op for these instructions; each helper is a
``dsl_user_op`` taking and returning DSL scalars. Used by kernel.py (the NaN-safe V clean-up and the recompute) and
kernel_cluster.py (distributed shared memory)."""
from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

__all__ = ["asm", "barrier_or", "opaque", "fma_zero", "is_finite_f32"]


def asm(ret, args, text: str, constraints: str, side_effects: bool, loc=None, ip=None):
    """``llvm.inline_asm`` in AT&T dialect without stack alignment: ``ret`` the result's MLIR type (None for none),
    ``args`` MLIR values bound to ``$1...`` (``$0...`` without a result) in ``constraints`` order (LLVM's
    constraint string, e.g. ``"=r,f"``); ``side_effects`` keeps LLVM from moving or dropping it."""
    return llvm.inline_asm(ret, args, text, constraints, has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def barrier_or(pred: Int32, barrier_id: Int32, number_of_threads: int, *, loc=None, ip=None) -> Int32:
    """``bar.red.or.pred`` over a named barrier: every participating thread gets 1 when any passed a non-zero
    ``pred`` (and the barrier orders their prior shared-memory accesses, as ``bar.sync`` does)."""
    return Int32(asm(
        T.i32(),
        [Int32(pred).ir_value(loc=loc, ip=ip), Int32(barrier_id).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p, q;\nsetp.ne.u32 p, $1, 0;\n"
        f"bar.red.or.pred q, $2, {int(number_of_threads)}, p;\n"
        "selp.u32 $0, 1, 0, q;\n}",
        "=r,r,r", True,
    ))


@dsl_user_op
def opaque(x: Int32, *, loc=None, ip=None) -> Int32:
    """``x`` through an inline-asm ``mov``: the same value, which LLVM cannot relate to ``x``, so it does not merge
    what is computed from it with what the mainloop computed from ``x`` (ptxas folds the move). The recompute's
    cold path takes the tile's indices through it (``FlashAttentionForwardSm90Mixed._nonfinite_recompute``)."""
    return Int32(asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r", False))


@dsl_user_op
def fma_zero(x: Float32, s: Float32, *, loc=None, ip=None) -> Float32:
    """``x * 0 + s`` in one ``fma.rn.f32`` (inline asm, so neither LLVM nor the DSL folds ``x * 0`` to 0): ``s`` (a
    zero) for a finite ``x``, NaN for a NaN or +-Inf one (IEEE ``0 * Inf`` is NaN), and NaN for a NaN ``s``. So a
    chain of them over entries, from 0, is NaN iff an entry is non-finite (the recompute's epilogue test,
    ``FlashAttentionForwardSm90Mixed._nr_ffma_test``)."""
    return Float32(asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip), Float32(s).ir_value(loc=loc, ip=ip)],
        "fma.rn.f32 $0, $1, 0f00000000, $2;", "=f,f,f", False,
    ))


@dsl_user_op
def is_finite_f32(x: Float32, *, loc=None, ip=None) -> Int32:
    """1 when ``x`` is finite (``testp.finite``), 0 for NaN / +-Inf."""
    return Int32(asm(
        T.i32(),
        [Float32(x).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\ntestp.finite.f32 p, $1;\nselp.u32 $0, 1, 0, p;\n}",
        "=r,f", False,
    ))
