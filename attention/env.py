"""Boolean environment switches (``BLOCKDIFF_*``): one parser, so every switch takes the same values.

A switch is on with ``1`` and off with ``0``, the empty string or when unset; any other value (``true``, ``yes``,
``on``, `` 1``, ...) is a ``ValueError`` naming the variable, never silently read as on or off. Standard library
only (the attention package's debug switch reads it at import; the vLLM plugin, its schedulers and the benchmarks
read theirs through it too).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["FLAG_ON", "FLAG_OFF", "env_flag"]

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
