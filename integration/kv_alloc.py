"""A simple paged-KV block allocator for the harness (vLLM's KV-cache manager does this when serving)."""
from __future__ import annotations

import numbers


class OutOfBlocks(RuntimeError):
    """The pool has fewer free pages than asked for."""


class BlockAllocator:
    """Free list of page ids ``[0, num_blocks)``; pages are handed out most-recently-freed first, so freed
    pages are reused at once (what the slot-reuse tests look for), then never-used ones from the highest id down.

    The never-used pages are a count, not a list: the pool costs memory for the pages handed out, not for
    ``num_blocks`` (a list of every id was built at construction: ``num_blocks=2**31`` took the process down for
    memory before the KV cache's own allocation could refuse it).

    Args:
        num_blocks: pages in the pool (>= 1).
        page_size: tokens per page (>= 1).

    Raises:
        ValueError: a size < 1 or not an int.
    """

    def __init__(self, num_blocks: int, page_size: int) -> None:
        for name, v in (("num_blocks", num_blocks), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.num_blocks = int(num_blocks)
        self.page_size = int(page_size)
        # Hand out high ids first so page ids are not the identity of positions (exercises block_table): the free
        # pages are [0, _fresh) followed by _freed, taken from the end.
        self._fresh = self.num_blocks
        self._freed: list[int] = []
        self._owned: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return self._fresh + len(self._freed)

    def blocks(self, owner: str) -> list[int]:
        """Pages held by ``owner`` in position order (empty list if none); a copy (changing it changes nothing
        here: appending to the held list made a later :meth:`free` return a page twice, to two owners)."""
        return list(self._owned.get(owner, ()))

    def blocks_needed(self, owner: str, num_tokens: int) -> int:
        """Extra pages ``owner`` needs so that positions ``[0, num_tokens)`` have a page.

        Raises:
            TypeError: ``num_tokens`` is not an int. ValueError: ``num_tokens < 0``.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral):
            raise TypeError(f"num_tokens must be an int >= 0, got {type(num_tokens).__name__} ({num_tokens!r})")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens}")
        need = -(-int(num_tokens) // self.page_size)
        return max(0, need - len(self._owned.get(owner, ())))

    def ensure(self, owner: str, num_tokens: int) -> list[int]:
        """Grow ``owner``'s pages to cover ``num_tokens`` tokens; returns its page list (a copy, as :meth:`blocks`).

        Raises:
            OutOfBlocks: not enough free pages (nothing is allocated then).
            TypeError / ValueError: ``num_tokens`` not an int >= 0.
        """
        extra = self.blocks_needed(owner, num_tokens)
        if extra > self.num_free:
            raise OutOfBlocks(f"{owner!r} needs {extra} more page(s) of {self.page_size} tokens, "
                              f"{self.num_free} free")
        if extra == 0:
            return self.blocks(owner)
        pages = self._owned.setdefault(owner, [])
        for _ in range(extra):
            if self._freed:
                pages.append(self._freed.pop())
            else:
                self._fresh -= 1
                pages.append(self._fresh)
        return list(pages)

    def free(self, owner: str) -> list[int]:
        """Return ``owner``'s pages to the pool (no-op for unknown owners, so a second free of one owner is one);
        returns them."""
        pages = self._owned.pop(owner, [])
        self._freed.extend(reversed(pages))
        return pages
