"""Pages of prompt prefixes kept for later requests (`PrefixCache`): a request whose prompt
starts with the same full pages of tokens as an earlier one (a system prompt, a few-shot
preamble) reuses their keys and values instead of computing them again.

Only full pages of prompt tokens are shared, and a request always feeds at least its last
prompt token itself, so every write lands in a page of its own: shared pages are never written
again and need no copy. A page is keyed by a chain of sha256 digests over the weight variant
and the tokens up to its end, so equal keys mean equal prefixes. Pages that no running request
holds stay cached until the pool needs them, least recently used first.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from tfx.generation.pages import PageAllocator

__all__ = ["PrefixCache", "page_keys"]


def page_keys(prompt: np.ndarray, variant: int, page_size: int) -> list[bytes]:
    """The key of each full page of `prompt` that a request can share: pages that end before
    its last token (which the request must feed itself to get its first logits)."""
    keys, key = [], hashlib.sha256(str(variant).encode()).digest()
    for end in range(page_size, len(prompt), page_size):
        key = hashlib.sha256(key + prompt[end - page_size:end].tobytes()).digest()
        keys.append(key)
    return keys


class PrefixCache:
    """The pool's pages with reuse of prompt prefixes (`enabled`), or plainly allocated.

    >>> pages = cache.admit(keys, total)      # shared prefix pages + new ones, or None
    >>> cache.register(keys, pages, written)  # after a step: full prompt pages become shared
    >>> cache.release(pages)                  # the request ended
    """

    def __init__(self, allocator: PageAllocator, *, enabled: bool):
        self.allocator, self.enabled = allocator, enabled
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._holders: dict[int, int] = {}  # shared page -> requests holding it
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        """Pages a new request could take: free ones and cached ones nobody holds."""
        return self.allocator.num_free + len(self._idle)

    def admit(self, keys: list[bytes], total: int) -> tuple[list[int], int] | None:
        """Pages for a request of `total` pages whose shareable pages have `keys`: (its pages,
        how many lead it from the cache), or None when the pool cannot hold it now."""
        shared = []
        for key in keys if self.enabled else ():
            if (page := self._page_of.get(key)) is None:
                break
            shared.append(page)
        idle_shared = sum(page in self._idle for page in shared)
        if total - len(shared) > self.num_free - idle_shared:
            return None
        for page in shared:
            self._holders[page] += 1
            self._idle.pop(page, None)
        return shared + self._allocate(total - len(shared)), len(shared)

    def register(self, keys: list[bytes], pages: list[int], written: int,
                 page_size: int) -> None:
        """Share the request's full prompt pages among its first `written` tokens (those its
        steps have written) that are not shared yet."""
        for i in range(min(written // page_size, len(keys)) if self.enabled else 0):
            page = pages[i]
            if page in self._key_of or keys[i] in self._page_of:
                continue  # shared already, or another request shares the same prefix
            self._page_of[keys[i]], self._key_of[page] = page, keys[i]
            self._holders[page] = 1

    def release(self, pages: list[int]) -> None:
        """A request let its pages go: shared ones stay cached, the others are free."""
        private = []
        for page in pages:
            if page not in self._key_of:
                private.append(page)
                continue
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._idle[page] = None
        self.allocator.release(private)

    def _allocate(self, count: int) -> list[int]:
        """`count` pages, evicting cached pages nobody holds (oldest first) when needed."""
        while self.allocator.num_free < count:
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(page)], self._holders[page]
            self.allocator.release([page])
        return self.allocator.allocate(count)
