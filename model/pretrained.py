"""Trained checkpoints shipped inside the package, and loading of a trained checkpoint folder.

A checkpoint folder is what ``blockdiff train --out FOLDER`` (:func:`blockdiff.model.train.train`) writes: ``model.safetensors``
(transformers DiffusionGemma names), ``config.json``, ``tokenizer.json`` (:class:`ByteTokenizer`), and, for the
record, ``loss.png`` and ``train_log.json``. The shipped one lives at ``model/checkpoints/stdlib-byte/`` in the
repository (``blockdiff/model/checkpoints/stdlib-byte/`` once installed; ``setup.py`` ships
``checkpoints/*/*`` as package data, at most 10 MB per checkpoint).
"""
from __future__ import annotations

import os

from .errors import CheckpointError, CheckpointFileNotFoundError
from .modeling import DiffusionGemma
from .tokenizer import ByteTokenizer

__all__ = ["SHIPPED_CHECKPOINT", "CHECKPOINT_FILES", "shipped_checkpoint_dir", "load_pretrained"]

#: Name of the checkpoint ``blockdiff demo`` uses by default (a folder under ``model/checkpoints/``).
SHIPPED_CHECKPOINT = "stdlib-byte"
#: Files a checkpoint folder must hold to be served (``loss.png`` / ``train_log.json`` are optional records).
CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json")


def shipped_checkpoint_dir(name: str = SHIPPED_CHECKPOINT) -> str:
    """Path of the packaged checkpoint folder ``checkpoints/<name>`` beside this module, whether or not it
    exists (check with ``os.path.isdir``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", name)


def load_pretrained(folder, *, device=None, dtype=None, moe_impl: str | None = None):
    """Load a trained checkpoint folder (see the module docstring) for serving.

    Args:
        folder: the checkpoint folder.
        device: torch device of the weights (default CPU).
        dtype: parameter dtype, one of :data:`blockdiff.model.loading.MODEL_DTYPES` (bf16, fp16, fp32, fp64; default:
            as stored, bf16 for ``model/train.py``'s checkpoints).
        moe_impl: passed to :class:`DiffusionGemma` (None: its default for the device and dtype).

    Returns:
        ``(model, tokenizer)``: a :class:`DiffusionGemma` in eval mode (its ``generation_config`` from the folder's
        optional ``generation_config.json``, see :func:`blockdiff.model.load_generation_config`) and its
        :class:`ByteTokenizer`. The folder may be a trained checkpoint or a Hugging Face export of one
        (:func:`blockdiff.model.export.export_hf`: nested ``config.json``, ``tokenizers``-format ``tokenizer.json``).

    Raises:
        TypeError: ``folder`` not a str / os.PathLike; a ``dtype`` outside ``MODEL_DTYPES``; a bad ``device`` type.
        ValueError: a bad ``device`` or ``moe_impl``.
        CheckpointFileNotFoundError: ``folder`` is not a folder, or lacks one of :data:`CHECKPOINT_FILES` (all
            missing ones are named); also a ``FileNotFoundError``.
        CheckpointError: the tokenizer is not the byte tokenizer, its vocabulary differs from the config's, a bad
            config / generation config, or weights that do not match the config (from
            :meth:`DiffusionGemma.load_safetensors`); also a ``ValueError``.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a str or os.PathLike (a checkpoint folder), got {type(folder).__name__}")
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointFileNotFoundError(f"checkpoint folder {folder!r} does not exist or is not a folder")
    missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise CheckpointFileNotFoundError(f"checkpoint folder {folder!r} lacks {', '.join(missing)} "
                                          f"(a checkpoint holds {', '.join(CHECKPOINT_FILES)})")
    tokenizer = ByteTokenizer.load(folder)
    model = DiffusionGemma.load_safetensors(folder, device=device, dtype=dtype, moe_impl=moe_impl)
    if model.config.vocab_size != tokenizer.vocab_size:
        raise CheckpointError(f"checkpoint {folder!r}: config vocab_size {model.config.vocab_size} != tokenizer "
                              f"vocab_size {tokenizer.vocab_size}")
    return model.eval(), tokenizer
