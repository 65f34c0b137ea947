"""The backend matrix: how the shared attention tests run each name of ``blockdiff.attention.BACKENDS``.

The shared tests take their backends from :func:`backend_params` / :func:`validating_backend_params`, which read
``BACKENDS`` itself, never a hand list: a registered name is run by the contract suite
(``tests/attention/test_backends_contract.py``), the shared edges (``tests/attention/test_contract_edges.py``) and
the signature check. How a backend runs on this machine is its row of :data:`MATRIX`, the one table.

A name in ``BACKENDS`` without a row is red, not silently untested: ``test_every_registered_backend_has_a_row``
fails naming it, and so does every parametrised case of it (the ``pytest_runtest_call`` hook of
``tests/attention/conftest.py`` calls :func:`row`), with :data:`MISSING_ROW` saying what to add.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from blockdiff.attention import BACKENDS

CUDA = torch.cuda.is_available()
#: tiles the Triton interpreter runs in reasonable time (tl.dot's minimum): small batches still cross tiles and pages
_SMALL = dict(BLOCK_M=16, BLOCK_N=16)


#: The contract cases a row may name in ``known_gaps``, each with the gap docs/ARCHITECTURE.md section 4 records.
GAPS = {
    "underflow_in_a_cleaned_block": "a seen key whose weight underflows to 0 with +-Inf V, in a key block a NaN-safe "
                                    "V scan cleans: the fix-up gives the raw +-Inf where the reference gives "
                                    "0 * Inf = NaN",
    "fma_against_a_rounded_max": "scores beyond ~2^31 in log2 units (here ~-2e31): a softmax weighing each key "
                                 "exp2(fma(s, c, -round(max * c))) keeps the product's rounding error, up to half "
                                 "an ulp of the max, and gives the row's best key inf or 0: a NaN row",
}


@dataclasses.dataclass(frozen=True)
class BackendRun:
    """How the shared tests run one backend.

    Attributes:
        where: ``"cpu"`` (eager PyTorch on the CPU), ``"interpreter"`` (Triton kernels through TRITON_INTERPRET=1 on
            the CPU, set by ``tests/conftest.py``; compiled on the GPU where CUDA is visible: a CPU-suite run on a GPU
            machine with ``BLOCKDIFF_TEST_CUDA=1``) or ``"gpu"`` (CUDA only:
            its cases carry ``@pytest.mark.gpu``, deselected by pytest.ini's ``-m "not gpu"`` and skipped with the
            reason by ``tests/conftest.py`` where ``-m gpu`` selects them without a GPU).
        why: one line: why it runs there.
        configs: the ``config=`` values the contract suite passes (the first is the default; later ones, e.g. a
            split-KV one, are spread over the cases). ``(None,)`` with ``no_config``: no ``config`` keyword at all.
        dtypes: the dtypes of q / k / v it is run at (the contract's that it supports).
        head_dim: the head dim of the suite's batches (the Triton interpreter: small; a GPU kernel: one it runs).
        page_sizes: page sizes of the paged cases; some should not divide the backend's tiles.
        fuzz_examples: Hypothesis examples of the contract fuzz (derandomised; keep the suite under a minute).
        no_config: the backend takes no ``config`` keyword (the reference: passing one is a TypeError).
        extra_keywords: keywords it takes beyond the contract's (the reference's ``upcast``).
        default_overrides: documented defaults that differ from the contract table's (the reference's
            ``check_values=True``).
        validates_on_cpu: its argument errors (TypeError / ValueError of the contract) come before it needs its
            device, so the error-path edges run it on the CPU even where ``where`` is ``"gpu"``.
        differentiable: autograd differentiates its output (eager PyTorch ops, as the reference), so the autograd
            edge of ``tests/attention/test_contract_edges.py`` checks that gradients reach q, k_cache and v_cache;
            False (a kernel backend): it must refuse grad mode with ``validate.check_no_autograd``
            (docs/ARCHITECTURE.md section 4, "Errors").
        known_gaps: ``{case: reason}``, the contract cases where the backend departs from the reference in a way
            docs/ARCHITECTURE.md section 4 records as a known gap; the case runs as a strict xfail with the reason
            (it must fail: a gap closed shows as XPASS, red). Keys: :data:`GAPS`.
    """
    where: str
    why: str
    configs: tuple = (None,)
    dtypes: tuple = (torch.bfloat16, torch.float16, torch.float32)
    head_dim: int = 16
    page_sizes: tuple = (1, 3, 5, 16)
    fuzz_examples: int = 10
    no_config: bool = False
    extra_keywords: frozenset = frozenset()
    default_overrides: dict = dataclasses.field(default_factory=dict)
    validates_on_cpu: bool = True
    differentiable: bool = False
    known_gaps: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        # raised, not asserted: this module is not assertion-rewritten, and ``python -O`` would drop an assert
        if self.where not in ("cpu", "interpreter", "gpu"):
            raise ValueError(f"BackendRun(where={self.where!r}, why={self.why!r}): where must be 'cpu', "
                             "'interpreter' or 'gpu'")
        if not self.configs or (self.no_config and self.configs != (None,)):
            raise ValueError(f"BackendRun(why={self.why!r}): configs={self.configs!r} must be non-empty, and (None,) "
                             "with no_config=True")
        unknown = sorted(set(self.known_gaps) - set(GAPS))
        if unknown:
            raise ValueError(f"BackendRun(why={self.why!r}): known_gaps names {unknown}, not cases of GAPS "
                             f"{sorted(GAPS)} in tests/attention/backend_matrix.py: fix the name, or add the case to "
                             "GAPS with the gap docs/ARCHITECTURE.md section 4 records (and call expect_gap in its "
                             "test)")

    def expect_gap(self, request, case: str) -> None:
        """Mark the running test a strict xfail when ``case`` is one of this row's known gaps: only a failed check
        (an AssertionError) counts as the gap, so a test that breaks before its check (its input cannot be built, a
        kernel refuses the call) fails instead of passing as the expected failure."""
        if case in self.known_gaps:
            request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=self.known_gaps[case]))

    @property
    def device(self) -> str:
        """Where its tensors live: the CPU for "cpu"; CUDA for "gpu", and for "interpreter" where CUDA is visible."""
        return "cpu" if self.where == "cpu" or (self.where == "interpreter" and not CUDA) else "cuda"

    @property
    def marks(self) -> tuple:
        return (pytest.mark.gpu,) if self.where == "gpu" else ()

    def config_kwargs(self, i: int = 0) -> dict:
        """``{"config": configs[i % len]}``, or ``{}`` for a backend without the keyword."""
        return {} if self.no_config else {"config": self.configs[i % len(self.configs)]}


#: One row per name of blockdiff.attention.BACKENDS (docs/ARCHITECTURE.md section 3, "Adding an attention backend").
MATRIX: dict[str, BackendRun] = {
    "reference": BackendRun(
        "cpu", "dense PyTorch, the oracle: every case on the CPU in milliseconds",
        dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64), fuzz_examples=40, no_config=True,
        extra_keywords=frozenset({"upcast"}), default_overrides={"check_values": True}, differentiable=True),
    "triton": BackendRun(
        "interpreter", "the portable Triton kernel; on the CPU through the interpreter, 16 x 16 tiles",
        configs=(_SMALL, dict(_SMALL, num_splits=3)), fuzz_examples=16),
    "cute": BackendRun(
        "gpu", "CuTe DSL on FlashAttention-4's SM90 kernel: a Hopper GPU only (CUDA tensors, bf16 / fp16)",
        configs=(None, {"num_splits": 3, "split_merge": "triton"}), dtypes=(torch.bfloat16, torch.float16),
        # hd 128, a head dim the backend's own GPU tests build (128 / 256 / 512): at hd 64 FA4's heuristic gives a
        # 192 x 128 register-P tile no cute test compiles. Pages: 16 and 64 load by TMA page boxes, 48 by cp.async
        head_dim=128, page_sizes=(16, 48, 64), fuzz_examples=10,
        # the underflow batch's 48 keys are one key block, which the scan cleans (it is the first block, masked; a
        # split's first block too where skip_allowed_first is off): +-Inf, not NaN, in two of the three columns
        # (H100, 2026-12-06; cute's own test puts the key in an interior block and passes: test_cute_split_merge.py)
        known_gaps={"underflow_in_a_cleaned_block": "cute's NaN-safe V fix-up adds a cleaned block's raw +-Inf back "
                    "for p = 0 (config skip_allowed_first; docs/ARCHITECTURE.md section 4, known gaps)"}),
}

MISSING_ROW = (
    "attention backend {name!r} is registered in blockdiff.attention.BACKENDS but has no row in MATRIX of "
    "tests/attention/backend_matrix.py, so no test would run it. Add BackendRun(where='cpu' | 'interpreter' | 'gpu', "
    "why=..., configs=..., dtypes=..., head_dim=..., page_sizes=...) for it; the contract suite "
    "(tests/attention/test_backends_contract.py) and the shared edges then run it (docs/ARCHITECTURE.md section 3, "
    "'Adding an attention backend').")


def row(name: str) -> BackendRun:
    """The row of a registered backend; fails the calling test with :data:`MISSING_ROW` when it has none."""
    if name not in MATRIX:
        pytest.fail(MISSING_ROW.format(name=name), pytrace=False)
    return MATRIX[name]


def backend_params() -> list:
    """One ``pytest.param`` per name of ``BACKENDS``, in its order, marked as its row says (a GPU-only backend's cases
    carry ``@pytest.mark.gpu``); a name without a row gets a case that fails (:func:`row`)."""
    return [pytest.param(n, marks=MATRIX[n].marks if n in MATRIX else (), id=n) for n in BACKENDS]


def validating_backend_params() -> list:
    """As :func:`backend_params`, for tests of argument errors only (nothing computed): a backend whose row says
    ``validates_on_cpu`` runs them on the CPU unmarked, even a GPU-only one."""
    return [pytest.param(n, marks=() if n not in MATRIX or MATRIX[n].validates_on_cpu else MATRIX[n].marks, id=n)
            for n in BACKENDS]
