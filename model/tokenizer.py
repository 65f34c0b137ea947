"""Byte-level tokenizer of the small trained DiffusionGemma (``model/train.py``).

Ids: ``pad = 0``, ``eos = 1``, ``bos = 2`` (DiffusionGemma's / Gemma's special-id layout: transformers'
``DiffusionGemmaTextConfig`` defaults ``pad_token_id=0, eos_token_id=1, bos_token_id=2``), then byte ``b`` is id
``3 + b``: vocabulary 259. Text is encoded as UTF-8 bytes, so every string round-trips exactly; decoding drops
special ids and replaces invalid UTF-8 (a byte sequence cut mid-character) with U+FFFD.

Files: :meth:`ByteTokenizer.load` reads blockdiff's own ``tokenizer.json`` (:meth:`ByteTokenizer.to_dict`) and the
Hugging Face ``tokenizers`` file :func:`blockdiff.model.export.export_hf` writes (a byte-level BPE without merges,
the GPT-2 byte alphabet, ``<pad>`` / ``<eos>`` / ``<bos>`` at 0 / 1 / 2, byte ``b`` at ``3 + b``, optionally padded
with unused tokens up to the model's vocabulary), so an exported folder loads like a trained one.
"""
from __future__ import annotations

import json
import numbers
import os

import numpy as np
import torch

from .config import read_json_object
from .errors import CheckpointError

__all__ = ["ByteTokenizer", "bytes_to_unicode"]

HF_SPECIAL_TOKENS = {0: "<pad>", 1: "<eos>", 2: "<bos>"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ``tokenizers`` ByteLevel alphabet): printable Latin-1 bytes map
    to themselves, the other 68 to U+0100.. in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


class ByteTokenizer:
    """UTF-8 byte tokenizer with three special ids (pad 0, eos 1, bos 2); byte b -> id 3 + b; vocab 259.

    Args:
        vocab_size: None (259) or a larger int: ids 259 .. vocab_size - 1 are unused tokens (a Hugging Face
            export padded to the model's vocabulary), never produced by :meth:`encode` and dropped by
            :meth:`decode` like the special ids.

    Raises:
        TypeError, ValueError: ``vocab_size`` not an int >= 259.
    """

    pad_token_id = 0
    eos_token_id = 1
    bos_token_id = 2
    byte_offset = 3
    vocab_size = 256 + 3
    kind = "byte"

    def __init__(self, vocab_size: int | None = None):
        if vocab_size is not None:
            if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
                raise TypeError(f"vocab_size must be an int >= 259 or None, got {type(vocab_size).__name__}")
            if vocab_size < type(self).vocab_size:
                raise ValueError(f"vocab_size must be >= {type(self).vocab_size} (the byte ids), got {vocab_size}")
            self.vocab_size = vocab_size

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (UTF-8 bytes + 3), optionally framed by bos / eos.

        Raises:
            TypeError: ``text`` is not a str, ``add_bos`` / ``add_eos`` not a bool.
            ValueError: ``text`` holds a lone surrogate (e.g. ``"\\ud800"``, which ``json.loads`` makes of that
                escape), which has no UTF-8 bytes; the message names ``text`` and the position (was the codec's
                bare ``UnicodeEncodeError``).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        for name, v in (("add_bos", add_bos), ("add_eos", add_eos)):
            if not isinstance(v, (bool, np.bool_)):  # (add_bos="no" added a bos)
                raise TypeError(f"{name} must be a bool, got {type(v).__name__} ({v!r})")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text must be valid Unicode text (UTF-8 encodable): it holds a lone surrogate "
                             f"U+{ord(text[e.start]):04X} at position {e.start}, which has no UTF-8 bytes") from None
        ids = [b + self.byte_offset for b in data]
        return ([self.bos_token_id] if add_bos else []) + ids + ([self.eos_token_id] if add_eos else [])

    def encode_bytes(self, data: bytes):
        """``numpy`` int16 ids ``[len(data)]`` of raw bytes (fast path for corpora)."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int16) + self.byte_offset

    def decode(self, ids, *, stop_at_eos: bool = False) -> str:
        """Text of ``ids``: a sequence of int ids in [0, vocab_size), or a 1-D integer tensor / ndarray; ids that
        are not bytes (the special ids, the ``<unused>`` ids past 258) are dropped (``stop_at_eos``: cut at the
        first eos).

        Raises:
            TypeError: ``ids`` is a str / bytes or not iterable, a tensor / ndarray that is not 1-D integer, or an id
                that is not an int (a float, a bool: nothing is truncated to an id).
            ValueError: an id outside [0, vocab_size).
            TypeError: ``stop_at_eos`` not a bool.
        """
        if not isinstance(stop_at_eos, (bool, np.bool_)):
            raise TypeError(f"stop_at_eos must be a bool, got {type(stop_at_eos).__name__} ({stop_at_eos!r})")
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            integer = (not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool) \
                if isinstance(ids, torch.Tensor) else ids.dtype.kind in "iu"
            if ids.ndim != 1 or not integer:
                raise TypeError(f"ids must be a 1-D integer tensor / array, got {ids.ndim}-D {ids.dtype}")
            ids = ids.tolist()
        elif isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"ids must be a sequence of int token ids, got {type(ids).__name__}")
        out = bytearray()
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise TypeError(f"ids must hold int token ids, got {type(i).__name__} ({i!r})")
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside [0, {self.vocab_size})")
            if i == self.eos_token_id and stop_at_eos:
                break
            if self.byte_offset <= i < self.byte_offset + 256:
                out.append(i - self.byte_offset)
        return out.decode("utf-8", errors="replace")

    # ---- files ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"type": self.kind, "vocab_size": self.vocab_size, "pad_token_id": self.pad_token_id,
                "eos_token_id": self.eos_token_id, "bos_token_id": self.bos_token_id,
                "byte_offset": self.byte_offset}

    def save(self, path) -> str:
        """Write ``tokenizer.json`` to ``path`` (a folder or a file name); returns the file written."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
        return path

    @classmethod
    def load(cls, path) -> "ByteTokenizer":
        """Read a ``tokenizer.json`` (a folder or the file): the one :meth:`save` writes, or the Hugging Face
        ``tokenizers`` file of :func:`blockdiff.model.export.hf_tokenizer_json` (see the module docstring).

        Raises:
            TypeError: ``path`` not a str / os.PathLike.
            CheckpointFileNotFoundError: no file (also a FileNotFoundError).
            CheckpointError: not JSON, or not this tokenizer's layout (a ValueError; the message names the file
                and what differs).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        d = read_json_object(path, "tokenizer.json")
        if "model" in d:
            return cls(_hf_vocab_size(d, path))
        vs = d.get("vocab_size")
        tok = cls(vs) if isinstance(vs, int) and not isinstance(vs, bool) and vs >= cls.vocab_size else cls()
        if not _same_json(d, tok.to_dict()):  # (==: true == 1 and 259.0 == 259 passed as the ids)
            raise CheckpointError(f"tokenizer.json ({path}) describes {d}, not the byte tokenizer {tok.to_dict()}")
        return tok


def _same_json(a, b) -> bool:
    """``a == b`` with each JSON value of the same type: ``==`` holds for ``true`` and ``1``, ``259.0`` and
    ``259``, which a file of ids must not mix up."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return a == b


def _hf_vocab_size(d: dict, path: str) -> int:
    """The vocabulary size of a Hugging Face ``tokenizer.json`` that encodes and decodes as :class:`ByteTokenizer`
    (the module docstring's layout); CheckpointError naming ``path`` and the first difference otherwise."""
    def bad(what):
        return CheckpointError(f"tokenizer.json ({path}) is a Hugging Face tokenizer but not the byte tokenizer "
                               f"(byte-level BPE without merges, ids pad 0, eos 1, bos 2, byte b = 3 + b): {what}")
    m = d.get("model")
    if not isinstance(m, dict) or m.get("type") != "BPE":
        raise bad(f"model.type must be 'BPE', got {m.get('type') if isinstance(m, dict) else m!r}")
    merges = m.get("merges")
    if merges is not None and (not isinstance(merges, list) or merges):  # (a number's len() was a TypeError)
        raise bad(f"model.merges must be empty (an empty list), got "
                  f"{f'{len(merges)} merges' if isinstance(merges, list) else repr(merges)}")
    vocab = m.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()):
        raise bad("model.vocab must map token strings to int ids")
    n = len(vocab)
    if sorted(vocab.values()) != list(range(n)):
        raise bad(f"model.vocab ids must be 0 .. {n - 1}, each once")
    by_id = {i: t for t, i in vocab.items()}
    want = {**HF_SPECIAL_TOKENS, **{ByteTokenizer.byte_offset + b: c for b, c in bytes_to_unicode().items()}}
    diff = [f"id {i}: {by_id.get(i)!r} (want {t!r})" for i, t in sorted(want.items()) if by_id.get(i) != t]
    if diff:
        raise bad(f"model.vocab differs at {len(diff)} ids, e.g. {', '.join(diff[:4])}")
    added = d.get("added_tokens") or []
    if not isinstance(added, list) or any(not isinstance(a, dict) or type(a.get("id")) is not int  # (not true: 1)
                                          or HF_SPECIAL_TOKENS.get(a.get("id")) != a.get("content") for a in added):
        raise bad(f"added_tokens must be the special tokens {HF_SPECIAL_TOKENS} only")
    for key in ("pre_tokenizer", "decoder"):
        p = d.get(key)
        if not isinstance(p, dict) or p.get("type") != "ByteLevel" or p.get("add_prefix_space", False) is not False:
            raise bad(f"{key} must be ByteLevel without add_prefix_space, got {p!r}")
    for key in ("normalizer", "post_processor", "truncation", "padding"):
        if d.get(key) is not None:
            raise bad(f"{key} must be null (it would change the ids or the text), got {d[key]!r}")
    return n
