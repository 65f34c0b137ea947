"""A simple paged-KV block allocator for the harness (vLLM's KV-cache manager does this when serving)."""
from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """The pool has fewer free pages than asked for."""


class BlockAllocator:
    """Free list of page ids ``[0, num_blocks)``; pages are handed out most-recently-freed first, so freed
    pages are reused at once (what the slot-reuse tests look for).

    Args:
        num_blocks: pages in the pool (>= 1).
        page_size: tokens per page (>= 1).

    Raises:
        ValueError: a size < 1.
    """

    def __init__(self, num_blocks: int, page_size: int) -> None:
        for name, v in (("num_blocks", num_blocks), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        # Hand out high ids first so page ids are not the identity of positions (exercises block_table).
        self._free: list[int] = list(range(num_blocks))
        self._owned: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks(self, owner: str) -> list[int]:
        """Pages held by ``owner`` in position order (empty list if none)."""
        return self._owned.get(owner, [])

    def blocks_needed(self, owner: str, num_tokens: int) -> int:
        """Extra pages ``owner`` needs so that positions ``[0, num_tokens)`` have a page.

        Raises:
            TypeError: ``num_tokens`` is not an int. ValueError: ``num_tokens < 0``.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(f"num_tokens must be an int >= 0, got {type(num_tokens).__name__} ({num_tokens!r})")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens}")
        need = -(-num_tokens // self.page_size)
        return max(0, need - len(self._owned.get(owner, [])))

    def ensure(self, owner: str, num_tokens: int) -> list[int]:
        """Grow ``owner``'s pages to cover ``num_tokens`` tokens; returns its page list.

        Raises:
            OutOfBlocks: not enough free pages (nothing is allocated then).
            TypeError / ValueError: ``num_tokens`` not an int >= 0.
        """
        extra = self.blocks_needed(owner, num_tokens)
        if extra > len(self._free):
            raise OutOfBlocks(f"{owner!r} needs {extra} more page(s) of {self.page_size} tokens, "
                              f"{len(self._free)} free")
        pages = self._owned.setdefault(owner, [])
        for _ in range(extra):
            pages.append(self._free.pop())
        return pages

    def free(self, owner: str) -> list[int]:
        """Return ``owner``'s pages to the pool (no-op for unknown owners); returns them."""
        pages = self._owned.pop(owner, [])
        self._free.extend(reversed(pages))
        return pages
