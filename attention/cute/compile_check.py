"""Offline sm_90a compile check of the ``"cute"`` kernels: compile one static configuration without a GPU (FA4's
fake-tensor route, :func:`.interface.compile_only`) and report what ptxas made of it, for CPU tests and for
screening tiles before GPU time is spent on them.

Per compiled kernel: registers at launch, stack frame, spill stores / loads (ptxas' own report, through the CuTe
DSL's ``remarks{ptx}`` diagnostics), the same spills located in the SASS by warp role (the producer runs after
``setmaxnreg.dec``, the consumers after ``setmaxnreg.inc``), the register counts the roles ask for, the number of
wgmma instructions, and the dynamic shared memory (the DSL's launch-time allocation, checked against
:func:`.config.config_smem_bytes`).

The DSL reads its artifact switches (``CUTE_DSL_KEEP``, ``CUTE_DSL_DUMP_DIR``) once per process, so every check
runs in a fresh interpreter: :func:`compile_for_sm90` spawns ``python -m blockdiff.attention.cute.compile_check``.
Needs flash-attn-4 and nvidia-cutlass-dsl (``ImportError`` in the child otherwise, a RuntimeError here), and
``cuobjdump`` (Triton's, or on ``PATH``) for the SASS part.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

__all__ = ["compile_for_sm90", "parse_ptxas_report", "strip_ptx", "sass_spills_by_role", "sass_loops", "LOOP_OPS",
           "sass_epilogue_test", "EPILOGUE_TEST_OPS", "sass_ex2_operands",
           "SPEC_KEYS", "WIDE_MATRIX", "wide_report", "ROLES_MATRIX"]

#: Part of the name of every attention kernel of this backend (FA4's class name prefix; the combine kernel of a
#: split-KV configuration is ``FlashAttentionForwardCombine``).
_ATTENTION_KERNEL = "FlashAttentionForwardSm90"

#: The keyword arguments of :func:`.interface.compile_only` a spec may set.
SPEC_KEYS = ("head_dim", "num_heads", "num_kv_heads", "page_size", "window_size", "bidirectional_window",
             "return_lse", "config", "max_seqlen_q", "max_seqlen_k")


def parse_ptxas_report(text: str, kernel_substring: str | None = None) -> dict:
    """Registers, stack frame and spill bytes from ``ptxas -v`` lines.

    ``kernel_substring``: take the report of the first entry function whose name contains it (None: the last
    one reported). Returns ``{"registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes"}`` (None
    where absent)."""
    sections = re.split(r"Compiling entry function\s+'", text)[1:] or [text]
    if kernel_substring is not None:
        sections = [sec for sec in sections if kernel_substring in sec.split("'", 1)[0]][:1] or [""]
    sec = sections[-1]
    out = dict(registers=None, stack_bytes=None, spill_store_bytes=None, spill_load_bytes=None)
    for m in re.finditer(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", sec):
        out.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)), spill_load_bytes=int(m.group(3)))
    for m in re.finditer(r"Used (\d+) registers", sec):
        out["registers"] = int(m.group(1))
    return out


def sass_spills_by_role(sass: str) -> dict:
    """Local-memory spill instructions (``STL`` / ``LDL``) of a warp-specialised kernel's SASS, by role.

    The producer's code follows its ``USETMAXREG.DEALLOC`` and ends where the consumers' ``USETMAXREG``
    (``TRY_ALLOC``) section begins; code before the first one (set-up) counts as ``"setup"``.

    Returns ``{"setup": n, "producer": n, "consumer": n, "setmaxreg": [(kind, registers), ...]}``.
    """
    counts = {"setup": 0, "producer": 0, "consumer": 0}
    regs = []
    role = "setup"
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.(\w+)[.\w]*\s+(?:\w+,\s*)?(0x[0-9a-f]+|\d+)", line)
        if m:
            kind = "producer" if m.group(1) == "DEALLOC" else "consumer"
            regs.append((kind, int(m.group(2), 0)))
            role = kind
            continue
        if re.search(r"\b(STL|LDL)(\.\w+)*\s", line):
            counts[role] += 1
    return dict(counts, setmaxreg=regs)


#: The instruction classes :func:`sass_loops` counts in a key-block loop: (name, regular expression on the opcode).
LOOP_OPS = (
    ("HGMMA", r"HGMMA\b"),                         # warpgroup MMA (wgmma)
    ("WARPGROUP.DEPBAR", r"WARPGROUP\.DEPBAR\b"),   # wgmma.wait_group
    ("BAR.SYNC", r"BAR\.SYNC\b"),                   # named barrier: wait
    ("BAR.ARV", r"BAR\.ARV\b"),                     # named barrier: arrive
    ("MUFU.EX2", r"MUFU\.EX2\b"),                   # exp2 of the softmax
    ("FMUL", r"FMUL\b"),                            # e.g. the rescale of O
    ("FFMA", r"FFMA\b"),                            # e.g. FA4's key weight s * c - m * c
    ("VOTE.ALL", r"VOTE\.ALL\b"),                   # exact_weight "auto": the warp's choice of key weight
    ("SYNCS", r"SYNCS\b"),                          # mbarrier arrive / try-wait
    ("UTMALDG", r"UTMALDG\b"),                      # TMA loads issued
    ("LDG", r"LDG\b"),                              # global loads (page-table entries)
    ("STL/LDL", r"(?:STL|LDL)\b"),                  # local-memory spills
    ("R2UR", r"R2UR\b"),                            # vector -> uniform register moves (wgmma descriptors computed
                                                    # outside the uniform datapath: docs/tuning.md 2.29)
)

_SASS_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);")
_SASS_LABEL = re.compile(r"^\s*(\.L\w+):")
_SASS_FUNCTION = re.compile(r"^\s*(?:Function\s*:\s*(\S+)|\.text\.(\S+?):)")


def sass_loops(sass: str, require: str = "HGMMA") -> list[dict]:
    """The loops of a kernel's SASS (``cuobjdump -sass`` text, branch targets as addresses, or ``nvdisasm`` text,
    targets as labels): every backward branch whose body holds a ``require`` instruction (default: the key-block
    loops, which hold the warpgroup MMAs). Text with several functions (``Function :`` / ``.text.<name>:``
    headers; their addresses restart) is read one function at a time.

    A backward branch whose body holds an unpredicated ``EXIT`` or ``RET`` is not a loop but an out-of-line slow
    path (ptxas puts e.g. mbarrier retries after the kernel's exits) jumping back, and is left out.

    Returns one dict per loop, by function and start address: ``function`` (None without a header), ``start`` /
    ``end`` (byte addresses of the target instruction and of the branch), ``instructions`` (static count in the
    body, nested loops included) and a count per class of :data:`LOOP_OPS`. Static counts: what one pass issues
    depends on the branches taken inside.

    Raises:
        TypeError: ``sass`` is not a str.
        ValueError: ``require`` is not a class name of :data:`LOOP_OPS`.
    """
    if not isinstance(sass, str):
        raise TypeError(f"sass must be a str (SASS text), got {type(sass).__name__}")
    if require not in dict(LOOP_OPS):
        raise ValueError(f"require must be one of {[n for n, _ in LOOP_OPS]}, got {require!r}")
    functions: list[tuple[str | None, list, dict]] = [(None, [], {})]
    pending: list[str] = []
    for line in sass.splitlines():
        m = _SASS_FUNCTION.match(line)
        if m:
            functions.append((m.group(1) or m.group(2), [], {}))
            pending = []
            continue
        m = _SASS_LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _SASS_INSTRUCTION.match(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        _, ins, labels = functions[-1]
        for name in pending:
            labels[name] = addr
        pending = []
        ins.append((addr, bool(m.group(2)), m.group(3), m.group(4)))
    loops = []
    for fname, ins, labels in functions:
        for addr, _, op, args in ins:
            if not op.startswith("BRA"):
                continue
            t = re.search(r"\((\.L\w+)\)", args)  # nvdisasm: a label; cuobjdump: the target's address
            if t:
                start = labels.get(t.group(1))
            else:
                hexes = re.findall(r"\b0x([0-9a-f]+)\b", args)
                start = int(hexes[-1], 16) if hexes else None
            if start is None or start > addr:
                continue
            body = [(pred, o) for a, pred, o, _ in ins if start <= a <= addr]
            if any(not pred and (o in ("EXIT", "RET") or o.startswith(("EXIT.", "RET."))) for pred, o in body):
                continue  # an out-of-line slow path (e.g. an mbarrier retry) jumping back across an exit
            counts = {name: sum(1 for _, o in body if re.match(rx, o)) for name, rx in LOOP_OPS}
            if counts[require]:
                loops.append(dict(function=fname, start=start, end=addr, instructions=len(body), **counts))
    return loops


#: The instructions of the recompute's epilogue test (:func:`sass_epilogue_test`): (name, opcode regex, operand
#: regex or None). The mask test's AND with the fp32 exponent mask and its integer max (ptxas folds pairs of maxes
#: into ``VIMNMX3``; the test before docs/tuning.md 2.39, counted so that a build with it shows), the FFMA test's
#: ``x * 0 + s`` (``FlashAttentionForwardSm90Mixed._nr_ffma_test``: an ``RZ`` factor).
EPILOGUE_TEST_OPS = (
    ("LOP3 exponent mask", r"LOP3\b", r"0x7f800000"),
    ("integer max", r"V?IMNMX", None),
    ("FFMA x*0", r"FFMA\b", r"^\s*\S+,\s*(?:RZ,|[^,]+,\s*RZ,)"),
)


def sass_epilogue_test(sass: str) -> dict | None:
    """The recompute's epilogue test in a kernel's SASS (``cuobjdump -sass`` text, the first function): the
    instructions from the last warpgroup MMA (``HGMMA``) before the first ``VOTE.ANY`` that follows one, to that
    vote (the epilogue's: the P V MMA's wait, FA4's normalisation of O, the test, the vote). Returns None where no
    vote follows an MMA (no recompute), else ``instructions`` (the region's length), ``test`` (the instructions of
    :data:`EPILOGUE_TEST_OPS` in it) and a count per class. Static counts, one epilogue site.

    Raises:
        TypeError: ``sass`` is not a str.
    """
    if not isinstance(sass, str):
        raise TypeError(f"sass must be a str (SASS text), got {type(sass).__name__}")
    ins: list[tuple[str, str]] = []
    for line in sass.splitlines():
        if _SASS_FUNCTION.match(line) and ins:
            break
        m = _SASS_INSTRUCTION.match(line)
        if m:
            ins.append((m.group(3), m.group(4)))
    last_mma = None
    for i, (op, _) in enumerate(ins):
        if op.startswith("HGMMA"):
            last_mma = i
        elif op.startswith("VOTE.ANY") and last_mma is not None:
            region = ins[last_mma + 1:i + 1]
            counts = {name: sum(1 for o, a in region if re.match(rx, o) and (arx is None or re.search(arx, a)))
                      for name, rx, arx in EPILOGUE_TEST_OPS}
            return dict(instructions=len(region), test=sum(counts.values()), **counts)
    return None


_SASS_REG = re.compile(r"^[-|!]*(U?R\d+)")


def _sass_move_source(op: str, operands: list) -> str | None:
    """The source register of a plain register copy (``MOV Rd, Rs``, or ``IMAD.MOV.U32 Rd, RZ, RZ, Rs``, the copy
    ptxas often emits), None for anything else (a negated or absolute source is not a copy)."""
    if op == "MOV" and len(operands) >= 2:
        src = operands[1]
    elif op.startswith("IMAD.MOV") and len(operands) >= 4 and operands[1] == "RZ" and operands[2] == "RZ":
        src = operands[3]
    else:
        return None
    m = re.fullmatch(r"(U?R\d+)", src)
    return m.group(1) if m else None


def sass_ex2_operands(sass: str) -> dict:
    """Which instruction wrote the operand of each ``MUFU.EX2`` (exp2) of a kernel's SASS (``cuobjdump -sass``
    text; several functions are read one after another): the last write to that register before it in the text
    and, where that write is predicated (``@P0 FMUL``: the range fix-up ptxas puts around an exp2 without
    flush-to-zero), the writes before it back to an unpredicated one; a register copy (``MOV``, ``IMAD.MOV``) passes
    its source's writers on. A straight-line reading (the softmax's weights and rescales are straight-line code in
    each key-block step; a value reaching an exp2 only around a loop's back edge is not followed).

    The exact key weight (``CuteConfig.exact_weight``, :class:`.kernel.ExactWeightSoftmax`) is ``exp2((s - m) * c)``:
    its exp2s take an ``FMUL``. FA4's weight ``exp2(s * c - m * c)`` takes an ``FFMA`` (against the rounded
    product ``m * c``), as did the recompute's ``exp2(x * c - lse * log2(e))``.

    Returns:
        ``{"ex2": n, "from_ffma": n, "from_fmul": n, "from_other": n}``: the exp2s, and how many of them take an
        operand an FFMA (in the chain above), else an FMUL, else anything else wrote.

    Raises:
        TypeError: ``sass`` is not a str.
    """
    if not isinstance(sass, str):
        raise TypeError(f"sass must be a str (SASS text), got {type(sass).__name__}")
    out = dict(ex2=0, from_ffma=0, from_fmul=0, from_other=0)
    writers: dict[str, list] = {}  # register -> its writers' opcodes, newest last, back to an unpredicated one
    for line in sass.splitlines():
        if _SASS_FUNCTION.match(line):
            writers = {}
            continue
        m = _SASS_INSTRUCTION.match(line)
        if not m:
            continue
        pred, op, args = bool(m.group(2)), m.group(3), m.group(4)
        operands = [a.strip().replace(".reuse", "") for a in args.split(",")]
        if op.startswith("MUFU.EX2") and len(operands) >= 2:
            src = _SASS_REG.match(operands[1])
            chain = writers.get(src.group(1), []) if src else []
            out["ex2"] += 1
            if any(w.startswith("FFMA") for w in chain):
                out["from_ffma"] += 1
            elif any(w.startswith("FMUL") for w in chain):
                out["from_fmul"] += 1
            else:
                out["from_other"] += 1
        dst = _SASS_REG.match(operands[0]) if operands and operands[0] else None
        if dst and not op.startswith(("ST", "BRA", "BAR", "SYNCS", "RED", "ATOM", "ISETP", "FSETP", "HGMMA")):
            reg = dst.group(1)
            moved = _sass_move_source(op, operands)
            written = writers.get(moved, [op]) if moved else [op]  # a move passes its source's writers on
            writers[reg] = (writers.get(reg, []) + written) if pred else list(written)
    return out


def _cuobjdump() -> str | None:
    try:
        import triton  # optional: Triton ships cuobjdump (the GPU stack and the CPU test env have it)
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def compile_for_sm90(timeout: float = 900, ptx_dir: str | None = None, switches: dict | None = None,
                     **spec) -> dict:
    """Compile one configuration of the cute backend for sm_90a in a fresh process and report its resources.

    Args:
        timeout: seconds for the child process.
        ptx_dir: also keep the attention kernel's PTX there (``<kernel>.ptx``, without ``.loc`` / ``.file`` lines,
            comments and debug sections: :func:`strip_ptx`) and report its file and sha256 (``ptx_file``,
            ``ptx_sha256``), to compare the instruction streams of two trees.
        switches: experiment class attributes set in the child before it compiles, ``{"Class.ATTR": value}``
            (:func:`set_switches`; e.g. ``{"FlashAttentionForwardSm90Roles._K_REFILL_ALL_WARPS": True}``).
        **spec: keyword arguments of :func:`.interface.compile_only` (:data:`SPEC_KEYS`); ``config`` as a dict.

    Returns:
        ``{"kernel", "registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes", "smem_bytes",
        "smem_formula_bytes", "wgmma", "sass_spills": {...}, "setmaxreg": [...], "loops": [...], "config",
        "merge", "ptxas_warnings", "epilogue_test", "ex2_operands"}`` (the attention kernel's; ``loops``:
        :func:`sass_loops`, the key-block loops' instruction mix; ``ex2_operands``: :func:`sass_ex2_operands`; ``ptxas_warnings``: the compile's distinct ptxas warning and performance-remark lines,
        e.g. C7518 where ptxas serialised the wgmma; ``merge``: ptxas' report of FA4's combine kernel for split-KV
        configurations with ``split_merge="combine"``, None otherwise: the default Triton merge is not a CuTe
        kernel). ``config`` is the configuration compiled, resolved for :func:`.interface.compile_only`'s
        own shapes (``skip_allowed_first`` as its launch resolved it): a partial ``config`` may resolve to other
        tiles than a workload's launch does (pass the launch's whole configuration).

    Raises:
        ValueError: a spec key outside :data:`SPEC_KEYS`.
        RuntimeError: the child failed (its stderr tail in the message; a missing package or an unknown switch
            names it).
    """
    bad = set(spec) - set(SPEC_KEYS)
    if bad:
        raise ValueError(f"unknown compile spec keys {sorted(bad)}; allowed: {SPEC_KEYS}")
    argv = [sys.executable, "-m", "blockdiff.attention.cute.compile_check", "--child", json.dumps(spec),
            ptx_dir or "", json.dumps(switches or {})]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        raise RuntimeError(f"cute compile check failed (rc {r.returncode}): {r.stderr[-3000:]}")
    return json.loads(lines[-1])


def strip_ptx(ptx: str) -> str:
    """PTX without ``.loc`` / ``.file`` lines, ``//`` comments and ``.section .debug_*`` blocks (source line info
    changes with any edit of the Python sources; the instructions must not)."""
    ptx = re.sub(r"^\s*\.section\s+\.debug_\w+\s*\{.*?^\s*\}", "", ptx, flags=re.S | re.M)
    out = []
    for line in ptx.splitlines():
        line = re.sub(r"//.*", "", line).rstrip()
        if not line or re.match(r"\s*\.(loc|file)\b", line):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def switch_target(name: str):
    """``(class, attribute)`` of an experiment switch ``"Class._ATTR"``: an existing, non-callable class attribute
    of a class of ``kernel.py``, ``kernel_wide.py`` or ``kernel_roles.py``.

    Raises:
        ValueError: anything else (a missing class or attribute, a public name, a method), naming the switch.
    """
    from . import kernel, kernel_roles, kernel_wide  # the CuTe DSL (optional dependency)
    cls_name, _, attr = name.rpartition(".")
    modules = (kernel, kernel_wide, kernel_roles)
    cls = next((getattr(m, cls_name) for m in modules if cls_name and hasattr(m, cls_name)), None)
    if (not isinstance(cls, type) or not attr.startswith("_") or not hasattr(cls, attr)
            or callable(getattr(cls, attr))):
        raise ValueError(f"switch {name!r}: not Class._ATTR of an existing class attribute (not a method) in "
                         "kernel.py, kernel_wide.py or kernel_roles.py")
    return cls, attr


def set_switches(switches: dict) -> None:
    """Set experiment class attributes, ``{"Class.ATTR": value}``, on a class of ``kernel.py``, ``kernel_wide.py``
    or ``kernel_roles.py`` (e.g. ``FlashAttentionForwardSm90Roles._K_REFILL_ALL_WARPS``), in this process, before
    compiling.

    Raises:
        ValueError: a name that is not ``Class.ATTR`` of an existing class attribute there (:func:`switch_target`).
    """
    targets = [(switch_target(name), value) for name, value in switches.items()]  # all checked before any is set
    for (cls, attr), value in targets:
        setattr(cls, attr, value)


def _child(spec: dict, ptx_dir: str | None = None, switches: dict | None = None) -> dict:
    """In the fresh process: set the DSL's switches (and the experiment ``switches``, :func:`set_switches`),
    compile, collect the report (and the PTX into ``ptx_dir``)."""
    dump = tempfile.mkdtemp(prefix="cute_compile_check_")
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
                      CUTE_DSL_KEEP="cubin,ptx" if ptx_dir else "cubin", CUTE_DSL_DUMP_DIR=dump)
    os.environ.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)  # a cached kernel would skip ptxas
    import io
    from contextlib import redirect_stderr, redirect_stdout

    import cutlass.cute as cute  # optional dependency: the CuTe DSL (this is the compile check's child)

    from . import interface
    from .config import config_smem_bytes, resolve_config

    set_switches(switches or {})

    real_compile = cute.compile
    captured: list = []

    def compile_with_ptxas_remarks(*args, **kwargs):
        kwargs["options"] = (kwargs.get("options", "") + " remarks{ptx}").strip()
        result = real_compile(*args, **kwargs)
        captured.append(result)
        return result

    log = io.StringIO()
    cute.compile = compile_with_ptxas_remarks
    try:
        with redirect_stdout(log), redirect_stderr(log):
            interface.compile_only(**spec)
    finally:
        cute.compile = real_compile
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.getvalue())
    # the attention kernel (first compile); a split-KV configuration with split_merge "combine" also compiles FA4's
    # combine kernel
    report = parse_ptxas_report(text, _ATTENTION_KERNEL)
    merge = parse_ptxas_report(text, "FlashAttentionForwardCombine") if len(captured) > 1 else None
    if captured:
        ir = str(captured[0].ir_module)
    else:
        raise RuntimeError("compile_only compiled nothing (already in the compile cache?)")
    hd = spec.get("head_dim", 128)
    # what compile_only resolved (its defaults: page size 128, max_seqlen_q 512 here; wide_design "auto" reads the
    # page size)
    cfg = resolve_config(hd, hd, spec.get("window_size"), spec.get("config"), spec.get("max_seqlen_q", 512),
                         page_size=spec.get("page_size", 128))
    formula = config_smem_bytes(cfg, hd, hd)
    launched = interface.LAST_LAUNCH["config"]  # as the launch resolved it (skip_allowed_first needs the split count)
    consts = [int(v) for v in re.findall(r"llvm\.mlir\.constant\((\d+) : i64\)", ir)]
    smem = formula if formula in consts else None
    sass, kernel = "", None
    tool = _cuobjdump()
    cubins = [c for c in glob.glob(os.path.join(dump, "*.cubin")) if _ATTENTION_KERNEL in os.path.basename(c)]
    if tool and cubins:
        sass = subprocess.run([tool, "-sass", cubins[-1]], capture_output=True, text=True).stdout
        m = re.search(r"Function : (\S+)", sass)
        kernel = m.group(1) if m else None
    by_role = sass_spills_by_role(sass) if sass else None
    ptx = {}
    if ptx_dir:
        ptxs = [c for c in glob.glob(os.path.join(dump, "*.ptx")) if _ATTENTION_KERNEL in os.path.basename(c)]
        if not ptxs:
            raise RuntimeError(f"no PTX of the attention kernel in {dump}")
        with open(ptxs[-1]) as f:
            text_ptx = strip_ptx(f.read())
        os.makedirs(ptx_dir, exist_ok=True)
        path = os.path.join(ptx_dir, os.path.basename(ptxs[-1]))
        with open(path, "w") as f:
            f.write(text_ptx)
        ptx = dict(ptx_file=path, ptx_sha256=hashlib.sha256(text_ptx.encode()).hexdigest())
    shutil.rmtree(dump, ignore_errors=True)
    # ptxas warnings and its performance remarks (C7515-C7520 "Potential Performance Loss: wgmma.mma_async
    # instructions are serialized ...", printed as info lines)
    warnings = sorted({ln.strip() for ln in text.splitlines()
                       if re.search(r"ptxas.*warning|\(C75\d\d\)|Potential Performance Loss", ln)})
    return dict(report, **ptx, kernel=kernel, smem_bytes=smem, smem_formula_bytes=formula, merge=merge,
                ptxas_warnings=warnings,
                wgmma=len(re.findall(r"\bHGMMA\b", sass)) if sass else None,
                sass_spills=None if by_role is None else {k: by_role[k] for k in ("setup", "producer", "consumer")},
                setmaxreg=None if by_role is None else by_role["setmaxreg"],
                loops=sass_loops(sass) if sass else None,
                epilogue_test=sass_epilogue_test(sass) if sass else None,
                ex2_operands=sass_ex2_operands(sass) if sass else None,
                config=dict(tile_m=cfg.tile_m, tile_n=cfg.tile_n, num_stages=cfg.num_stages, lpt=cfg.lpt,
                            num_splits=cfg.num_splits, wide_design=cfg.wide_design, batch_order=cfg.batch_order,
                            v_refill=cfg.v_refill, qk_issue=cfg.qk_issue, k_refill=cfg.k_refill,
                            skip_allowed_first=launched.skip_allowed_first,
                            nan_safe_v_method=launched.nan_safe_v_method, exact_weight=launched.exact_weight))


#: The split-value (hd 512, 16 q / 2 KV heads) configurations the report compiles (``--report``, with
#: ``wide_design="split_v"``: ``"auto"`` would take the roles kernel for most): both KV layouts, every load path
#: (page boxes: one / two per stage; cp.async), both window modes, both tile shapes, GQA without TMA Q.
WIDE_MATRIX = [
    dict(page_size=None, window_size=None),
    dict(page_size=None, window_size=1023, bidirectional_window="prefix"),
    dict(page_size=64, window_size=None),
    dict(page_size=64, window_size=1023),
    dict(page_size=16, window_size=1023, bidirectional_window="prefix"),
    dict(page_size=256, window_size=None),
    dict(page_size=8, window_size=None),
    dict(page_size=48, window_size=1023),
    dict(page_size=64, window_size=None, config=dict(tile_n=64)),
    dict(page_size=None, window_size=1023, config=dict(tile_n=64)),
    dict(page_size=64, window_size=None, num_heads=12, num_kv_heads=4),
    dict(page_size=64, window_size=None, return_lse=False, max_seqlen_q=4096),
]


#: The roles kernel's configurations (``wide_design="roles"``, hd 512, 16 q / 2 KV heads): both KV layouts, page boxes
#: of 1 / 4 / 8 per stage (pages 64, 16, 8 at 64-key tiles), both window modes, both tile shapes, GQA without TMA
#: Q, split-KV, the bench's mixed_global_ctx8k launch, and 2.17's one-warp V refill with S serial (the default is the
#: refill by halves with S ahead from 16-token pages; docs/tuning.md 2.20).
ROLES_MATRIX = [
    dict(page_size=None, window_size=None),
    dict(page_size=None, window_size=1023, bidirectional_window="prefix"),
    dict(page_size=64, window_size=None),
    dict(page_size=64, window_size=1023),
    dict(page_size=16, window_size=1023, bidirectional_window="prefix"),
    dict(page_size=8, window_size=None),
    dict(page_size=256, window_size=None),
    dict(page_size=64, window_size=None, config=dict(tile_n=32)),
    dict(page_size=16, window_size=1023, config=dict(tile_n=32)),
    dict(page_size=64, window_size=None, num_heads=12, num_kv_heads=4),
    dict(page_size=64, window_size=None, return_lse=False, max_seqlen_q=4096),
    dict(page_size=64, window_size=None, config=dict(num_splits=2)),
    dict(page_size=None, window_size=None, config=dict(nan_safe_v=False)),
    dict(page_size=64, window_size=None, config=dict(v_refill="one_warp", qk_issue="serial")),
]


def _with_design(matrix, design: str | None):
    """The matrix's specs with ``config["wide_design"] = design`` (None: unchanged)."""
    if design is None:
        return matrix
    return [dict(extra, config=dict(extra.get("config") or {}, wide_design=design)) for extra in matrix]


def wide_report(matrix=None) -> list[dict]:
    """Compile every spec of ``matrix`` (default :data:`WIDE_MATRIX` with ``wide_design="split_v"``, hd 512 / 16 q
    / 2 KV heads, LSE, canvas hint 256 unless a spec says otherwise) and return one row per spec: the spec plus
    :func:`compile_for_sm90`."""
    rows = []
    for extra in matrix or _with_design(WIDE_MATRIX, "split_v"):
        spec = dict(dict(head_dim=512, num_heads=16, num_kv_heads=2, return_lse=True, max_seqlen_q=256), **extra)
        rows.append(dict(spec=spec, **compile_for_sm90(**spec)))
    return rows


def main(argv=None) -> None:
    """``--child SPEC [PTX_DIR [SWITCHES]]``: compile one JSON spec in this process (what :func:`compile_for_sm90`
    spawns; an empty PTX_DIR keeps no PTX, SWITCHES is a JSON object for :func:`set_switches`) and print its report
    as JSON. ``--report [OUT.json]``: compile :data:`WIDE_MATRIX` with ``wide_design="split_v"``, print
    a table, write the rows;
    ``--report-roles [OUT.json]``: the same for :data:`ROLES_MATRIX` with ``wide_design="roles"``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        ptx_dir = argv[2] if len(argv) > 2 and argv[2] else None
        print(json.dumps(_child(json.loads(argv[1]), ptx_dir, json.loads(argv[3]) if len(argv) > 3 else None)))
        return
    if argv[:1] in (["--report"], ["--report-roles"]):
        rows = wide_report(_with_design(ROLES_MATRIX, "roles") if argv[0] == "--report-roles" else None)
        print(f"{'page':>5} {'window':>12} {'tile':>8} {'regs':>4} {'prod/cons':>9} {'spill st/ld':>11} "
              f"{'spills p/c':>10} {'smem':>7} {'wgmma':>5}  extra")
        for r in rows:
            sp, cfg = r["spec"], r["config"]
            mode = sp.get("bidirectional_window", "sym")[:3]
            win = "-" if sp.get("window_size") is None else f"{sp['window_size']} {mode}"
            regs = "/".join(str(v) for _, v in (r["setmaxreg"] or []))
            extra = {k: v for k, v in sp.items() if k in ("num_heads", "num_kv_heads", "return_lse", "max_seqlen_q")
                     and v != dict(num_heads=16, num_kv_heads=2, return_lse=True, max_seqlen_q=256)[k]}
            extra.update({k: v for k, v in (sp.get("config") or {}).items() if k not in ("tile_n", "wide_design")})
            print(f"{str(sp.get('page_size')):>5} {win:>12} {cfg['tile_m']}x{cfg['tile_n']}/{cfg['num_stages']:<2} "
                  f"{r['registers']:>4} {regs:>9} {r['spill_store_bytes']:>5}/{r['spill_load_bytes']:<5} "
                  f"{r['sass_spills']['producer']:>4}/{r['sass_spills']['consumer']:<5} {r['smem_bytes']:>7} "
                  f"{r['wgmma']:>5}  {extra or ''}")
        if len(argv) > 1:
            with open(argv[1], "w") as f:
                json.dump(rows, f, indent=1)
        return
    raise SystemExit("usage: python -m blockdiff.attention.cute.compile_check --report [OUT.json] | --report-roles "
                     "[OUT.json] | --child SPEC [PTX_DIR [SWITCHES]]")


if __name__ == "__main__":
    main()
