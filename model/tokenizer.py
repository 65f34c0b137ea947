"""Byte-level tokenizer of the small trained DiffusionGemma (``model/train.py``).

Ids: ``pad = 0``, ``eos = 1``, ``bos = 2`` (DiffusionGemma's / Gemma's special-id layout: transformers'
``DiffusionGemmaTextConfig`` defaults ``pad_token_id=0, eos_token_id=1, bos_token_id=2``), then byte ``b`` is id
``3 + b``: vocabulary 259. Text is encoded as UTF-8 bytes, so every string round-trips exactly; decoding drops
special ids and replaces invalid UTF-8 (a byte sequence cut mid-character) with U+FFFD.
"""
from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """UTF-8 byte tokenizer with three special ids (pad 0, eos 1, bos 2); byte b -> id 3 + b; vocab 259."""

    pad_token_id = 0
    eos_token_id = 1
    bos_token_id = 2
    byte_offset = 3
    vocab_size = 256 + 3
    kind = "byte"

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (UTF-8 bytes + 3), optionally framed by bos / eos.

        Raises:
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = [b + self.byte_offset for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_bos else []) + ids + ([self.eos_token_id] if add_eos else [])

    def encode_bytes(self, data: bytes):
        """``numpy`` int16 ids ``[len(data)]`` of raw bytes (fast path for corpora)."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int16) + self.byte_offset

    def decode(self, ids, *, stop_at_eos: bool = False) -> str:
        """Text of ``ids`` (ints in [0, 259)); special ids are dropped (``stop_at_eos``: cut at the first eos).

        Raises:
            ValueError: an id outside [0, vocab_size).
        """
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside [0, {self.vocab_size})")
            if i == self.eos_token_id and stop_at_eos:
                break
            if i >= self.byte_offset:
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
        """Read a ``tokenizer.json`` written by :meth:`save` (a folder or the file).

        Raises:
            FileNotFoundError: no file. ValueError: not this tokenizer's layout.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        with open(path) as f:
            d = json.load(f)
        tok = cls()
        if d != tok.to_dict():
            raise ValueError(f"{path} describes {d}, not the byte tokenizer {tok.to_dict()}")
        return tok
