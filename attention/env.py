"""Boolean environment switches (``BLOCKDIFF_*``): one parser, so every switch takes the same values.

A switch is on with ``1`` and off with ``0``, the empty string or when unset; any other value (``true``, ``yes``,
``on``, `` 1``, ...) is a ``ValueError`` naming the variable, never silently read as on or off. Standard library
only (the attention package's debug switch reads it at import; the vLLM plugin, its schedulers and the benchmarks
read theirs through it too).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["FLAG_ON", "FLAG_OFF", "env_flag", "TRITON_INTERPRET_ON", "triton_interpret"]

#: The value that turns a switch on.
FLAG_ON = "1"
#: The values that leave it off (unset is off too).
FLAG_OFF = ("", "0")


def env_flag(name: str, environ: Mapping[str, str] | None = None, *, meaning: str = "on") -> bool:
    """Whether the boolean switch ``name`` is on in ``environ`` (default ``os.environ``): ``"1"`` True; unset,
    ``""`` or ``"0"`` False. ``meaning`` words the on state in the error (e.g. ``"fused commits"``).

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: any other value (the variable, the value and the accepted values named).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (an environment variable), got {type(name).__name__}")
    env = os.environ if environ is None else environ
    v = env.get(name, "")
    if v in FLAG_OFF:
        return False
    if v == FLAG_ON:
        return True
    raise ValueError(f"{name} must be {FLAG_ON} ({meaning}) or 0 / empty / unset (off), got {v!r}")


#: The values of ``TRITON_INTERPRET`` that turn Triton's interpreter on, compared lower-cased: Triton's own reading
#: (``triton.knobs.runtime.interpret``, its C++ ``getenv_bool``; checked against it in tests/attention/test_env.py).
#: Any other value, ``false`` / ``no`` / ``off`` / ``2`` / `` 1`` included, leaves Triton compiling.
TRITON_INTERPRET_ON = ("1", "true", "yes", "on", "y")


def triton_interpret(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``TRITON_INTERPRET`` in ``environ`` (default ``os.environ``) turns Triton's interpreter on, read as
    Triton reads it (:data:`TRITON_INTERPRET_ON`), not as a :func:`env_flag` (the variable is Triton's). The one
    definition of the library (the sampler, independent of this package, mirrors it: ``sampler/triton/common.py``).
    Triton decides when a ``@triton.jit`` function is defined, so the variable must be set before Triton is imported
    (tests/conftest.py); this reads the environment now.

    Was: "set and not ``0``", so ``TRITON_INTERPRET=false`` (Triton: compile) counted as the interpreter: the
    triton backend took the interpreter's 16-row tiles and kernel paths on a GPU, and on a CPU let tensors reach a
    compiled kernel; ``=true`` (Triton: interpret) was refused by the cute tile order's CPU check.
    """
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET", "").lower() in TRITON_INTERPRET_ON
