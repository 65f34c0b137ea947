"""Errors of the model package (stdlib only, so any layer can import them without torch)."""
from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointFileNotFoundError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded or served: a missing, unreadable or malformed file (``config.json``,
    ``generation_config.json``, ``model.safetensors`` or its shard index, ``tokenizer.json``), a config field
    breaking its rule, or weights that do not match the config. The message names the file (and the field or
    tensor) and the rule broken. A ``ValueError``, so callers catching ``ValueError`` still catch it."""


class CheckpointFileNotFoundError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is missing (the folder itself, ``config.json``, ``model.safetensors``, a
    shard named by ``model.safetensors.index.json``, ``tokenizer.json``). Both a :class:`CheckpointError` and a
    ``FileNotFoundError`` (an ``OSError``), so either ``except`` catches it."""
