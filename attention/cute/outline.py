"""Calls that stay out of line in a CuTe DSL kernel: :func:`outlined_call` traces DSL code into an ``llvm.func`` marked
``no_inline`` in the kernel's GPU module and calls it (PTX ``.func`` + ``call``), so its code and registers stay out
of the caller's body. The DSL itself has no such construct: nested ``@cute.jit`` functions are inlined while
tracing, and a ``func.func`` marked ``no_inline`` loses the attribute in the pipeline's lowering, so libNVVM inlines it
(docs/tuning.md 2.38). Built on nvidia-cutlass-dsl 4.8.1's MLIR bindings and its value-tree helpers
(``cutlass.base_dsl.utils.mlir_value_tree``), which are internals: a later DSL version may need this file changed.
Used by the recompute's experiment switch ``FlashAttentionForwardSm90Mixed._NR_COLD_NOINLINE`` (kernel.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Callable

from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.base_dsl.utils.mlir_value_tree import extract_mlir_values, new_from_mlir_values

__all__ = ["outlined_call", "trace_leaves", "StaticTensor", "DYNAMIC"]

#: A dynamic stride or shape of a :class:`StaticTensor` (not an int).
DYNAMIC = object()


def trace_leaves(obj):
    """Trace time: ``(values, rebuild)`` of ``obj``: its MLIR values (a DSL value, or those of the fields of a
    dataclass / the items of a tuple or list, recursively; Python constants and None have none) and a function that
    rebuilds an object like ``obj`` from as many new values (:func:`outlined_call`)."""
    if obj is None or isinstance(obj, (bool, int, float, str, type)):
        return [], lambda vs: obj
    if hasattr(obj, "__extract_mlir_values__"):
        return extract_mlir_values(obj), lambda vs: new_from_mlir_values(obj, list(vs))
    if isinstance(obj, (tuple, list)) or is_dataclass(obj):
        keys = ([f.name for f in fields(obj) if f.init] if is_dataclass(obj) else list(range(len(obj))))
        parts = [(k, trace_leaves(getattr(obj, k) if is_dataclass(obj) else obj[k])) for k in keys]
        vals = [v for _, (vs, _) in parts for v in vs]

        def rebuild(vs):
            out, i = {}, 0
            for k, (v0, rb) in parts:
                out[k] = rb(vs[i:i + len(v0)])
                i += len(v0)
            if is_dataclass(obj):
                return replace(obj, **out)
            return type(obj)(out[k] for k in keys)
        return vals, rebuild
    raise TypeError(f"outlined_call: cannot pass a {type(obj).__name__} into an outlined function")


@dataclass(frozen=True)
class StaticTensor:
    """A tensor's static structure (element type; strides and shapes, each dynamic one :data:`DYNAMIC`), for
    code traced where the tensor's values are not available (:func:`outlined_call`)."""

    element_type: type
    stride: tuple
    shape: tuple

    @staticmethod
    def of(t) -> "StaticTensor":
        return StaticTensor(t.element_type, tuple(x if isinstance(x, int) else DYNAMIC for x in t.stride),
                             tuple(x if isinstance(x, int) else DYNAMIC for x in t.shape))


def outlined_call(name: str, fn: Callable, *args):
    """Trace time: ``fn(*args)`` as a call of a function that is not inlined (PTX ``.func`` and ``call``): an
    ``llvm.func`` marked ``no_inline`` in the kernel's GPU module, whose body the DSL ops of ``fn`` fill. (A
    ``func.func`` with ``no_inline`` does not do: the pipeline's lowering drops its attributes and libNVVM inlines
    it.) ``args`` are passed by value as their MLIR values (:func:`trace_leaves`), which must be integers, floats or
    vectors of them (the function's LLVM signature; so a register tensor goes as its loaded values, since its
    address would put it in local memory), and are rebuilt inside; ``fn`` must take every kernel value it uses from
    them (a function body cannot use the kernel's values) and returns what it returns (None, or such values),
    rebuilt likewise at the call."""
    leaves = [trace_leaves(a) for a in args]
    flat = [v for vs, _ in leaves for v in vs]
    for v in flat:
        if not (ir.IntegerType.isinstance(v.type) or ir.F32Type.isinstance(v.type)
                or ir.VectorType.isinstance(v.type)):
            raise TypeError(f"outlined_call: an argument of type {v.type} (integers, floats and vectors only)")
    op = ir.InsertionPoint.current.block.owner
    while op.name not in ("gpu.module", "builtin.module"):
        op = op.parent
    table = ir.SymbolTable(op.operation)
    sym = next(f"{name}_{i}" for i in range(1, 1 << 20) if f"{name}_{i}" not in table)
    in_types = [v.type for v in flat]
    with ir.InsertionPoint.at_block_begin(op.regions[0].blocks[0]):
        fop = llvm.LLVMFuncOp(sym, ir.TypeAttr.get(llvm.FunctionType.get(ir.Type.parse("!llvm.void"), in_types)),
                              no_inline=True)
    block = fop.body.blocks.append(*in_types)
    with ir.InsertionPoint(block):
        inner, i = [], 0
        for vs, rb in leaves:
            inner.append(rb(list(block.arguments)[i:i + len(vs)]))
            i += len(vs)
        result = fn(*inner)
        res_vals, res_rb = trace_leaves(result)
        if len(res_vals) > 1:
            raise TypeError("outlined_call: more than one value returned")
        llvm.ReturnOp(arg=res_vals[0] if res_vals else None)
    ret = res_vals[0].type if res_vals else None
    fop.attributes["function_type"] = ir.TypeAttr.get(
        llvm.FunctionType.get(ret if ret is not None else ir.Type.parse("!llvm.void"), in_types))
    call = llvm.CallOp(ret, flat, [], [], callee=ir.FlatSymbolRefAttr.get(sym), no_inline=True)
    return res_rb(list(call.results))
