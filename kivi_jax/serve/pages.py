"""The host-side page allocator of a paged KV cache: page ids, refcounts, and full prefix pages shared by hash chain.

A page is one block of `page_tokens` (R, the KIVI residual length) tokens of one sequence's cache, immutable once
full. A sequence owns a block table (page ids in token order). A page is in exactly one state: FREE (unreferenced,
holding nothing), USED (refcount >= 1) or CACHED (unreferenced but registered as a full prefix page: evictable, least
recently released first). A full page is keyed by a hash chain over the tokens up to and including it:

    key_{-1} = sha256(b"kivi-jax/pages/v1" || lp(namespace) || lp(cache_salt))
    key_i    = sha256(key_{i-1} || lp(namespace) || page i's token ids as little-endian int32)

with lp(s) = len(utf-8 s) as 8 little-endian bytes || utf-8 s, and namespace the cache spec and model identity, so
different specs, models or salts never share a page. No device memory here: pure Python and numpy.

Not thread-safe: one scheduler thread owns an allocator.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

ROOT_TAG = b"kivi-jax/pages/v1"


class PoolExhausted(Exception):
    """Fewer pages can be had (free plus evictable cached) than an allocation asked for."""


def _lp(s: str) -> bytes:
    b = s.encode("utf-8")
    return len(b).to_bytes(8, "little") + b


class PageAllocator:
    """Page ids 0..num_pages-1 of one pool: refcounts, a free list, an LRU of cached prefix pages, key <-> page maps."""

    def __init__(self, num_pages: int, page_tokens: int, namespace: str = ""):
        if num_pages < 1 or page_tokens < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_tokens ({page_tokens}) must be >= 1")
        self.num_pages = int(num_pages)
        self.page_tokens = int(page_tokens)
        self.namespace = namespace
        self._ns = _lp(namespace)
        self._ref = [0] * self.num_pages  # [num_pages] refcount of each page
        self._free: collections.deque[int] = collections.deque(range(self.num_pages))  # FREE pages, taken from the left
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # CACHED pages, oldest first
        self._key_of: dict[int, bytes] = {}  # registered page -> its key (USED or CACHED)
        self._page_of: dict[bytes, int] = {}  # key -> its one registered page
        self._evictions = 0
        self._prefix_hits = 0

    # -- counts ---------------------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages neither referenced nor cached."""
        return len(self._free)

    @property
    def cached_pages(self) -> int:
        """Unreferenced pages still holding a registered full prefix page (evictable)."""
        return len(self._cached)

    @property
    def used_pages(self) -> int:
        """Pages with refcount >= 1."""
        return self.num_pages - len(self._free) - len(self._cached)

    def _check_page(self, page: int) -> int:
        if not isinstance(page, (int, np.integer)) or not 0 <= page < self.num_pages:
            raise ValueError(f"page {page!r} is not a page id of this pool (0..{self.num_pages - 1})")
        return int(page)

    def refcount(self, page: int) -> int:
        return self._ref[self._check_page(page)]

    # -- allocation -----------------------------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free) + len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, refcount 1 each: free pages first, then cached ones evicted least recently released first.
        Raises PoolExhausted (allocating nothing) when fewer than n can be had."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if not self.can_allocate(n):
            raise PoolExhausted(f"asked for {n} pages, but only {len(self._free)} are free and {len(self._cached)} "
                                f"cached (evictable) of {self.num_pages}; {self.used_pages} are in use")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                self._evictions += 1
            self._ref[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: list[int]) -> None:
        """Refcount - 1 for each page (a page may appear as often as it is held). A page reaching 0 becomes CACHED
        if registered, else FREE. The pages of one call are queued for eviction last first, so a block table's tail
        is evicted before its head (a chain is unreachable past its first evicted page). Raises ValueError, changing
        nothing, when a page would be released more often than it is referenced."""
        pages = [self._check_page(p) for p in pages]
        for page, times in collections.Counter(pages).items():
            if self._ref[page] < times:
                raise ValueError(f"page {page} released {times} time(s) but its refcount is {self._ref[page]} "
                                 "(double free)")
        for page in reversed(pages):
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if page in self._key_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def share(self, pages: list[int]) -> None:
        """One more reference to each of `pages` (each held already: refcount >= 1)."""
        for page in pages:
            if self._ref[self._check_page(page)] < 1:
                raise ValueError(f"page {page} is not held (refcount 0): only a held page can be shared")
        for page in pages:
            self._ref[page] += 1

    # -- prefix sharing -------------------------------------------------------------------------------------------
    def chain_keys(self, tokens: list[int], salt: str = "") -> list[bytes]:
        """The hash-chain key of every FULL page of tokens: len(tokens) // page_tokens keys (a partial tail has none)."""
        full = len(tokens) // self.page_tokens
        ids = np.asarray(list(tokens[:full * self.page_tokens]), dtype=np.int64)  # [full * R]
        if ids.size and (ids.min() < np.iinfo(np.int32).min or ids.max() > np.iinfo(np.int32).max):
            raise ValueError("token ids must fit in int32")
        ids = ids.astype("<i4").reshape(full, self.page_tokens)  # [full, R]
        key = hashlib.sha256(ROOT_TAG + self._ns + _lp(salt)).digest()
        keys = []
        for row in ids:
            key = hashlib.sha256(key + self._ns + row.tobytes()).digest()
            keys.append(key)
        return keys

    def register(self, page: int, key: bytes) -> bool:
        """Marks a referenced page as holding the full page with this key, so lookups can share it. One key maps to
        one page: if another page already holds the key, the first mapping is kept, this page stays unregistered
        (it is freed, not cached, on its last release) and False is returned. True when the page holds the key."""
        page = self._check_page(page)
        if self._ref[page] < 1:
            raise ValueError(f"page {page} is not referenced: only a page in use can be registered")
        if page in self._key_of:
            if self._key_of[page] != key:
                raise ValueError(f"page {page} is already registered under another key")
            return True
        if key in self._page_of:
            return False
        self._key_of[page] = key
        self._page_of[key] = page
        return True

    def lookup_prefix(self, tokens: list[int], salt: str = "") -> list[int]:
        """The longest run of leading full pages of tokens already registered (stops at the first miss), each taken
        with refcount + 1 (a cached one leaves the evictable set). Only pages of this namespace and salt match."""
        pages = []
        for key in self.chain_keys(tokens, salt):
            page = self._page_of.get(key)
            if page is None:
                break
            self._cached.pop(page, None)
            self._ref[page] += 1
            pages.append(page)
        self._prefix_hits += len(pages)
        return pages

    # -- introspection --------------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        return {"pages_total": self.num_pages, "pages_free": self.free_pages, "pages_cached": self.cached_pages,
                "pages_used": self.used_pages, "pages_shared": sum(r >= 2 for r in self._ref),
                "evictions": self._evictions, "prefix_hits": self._prefix_hits}

    def check(self) -> None:
        """Raises AssertionError unless every page is in exactly one state and the key maps agree (for tests)."""
        free, cached = set(self._free), set(self._cached)
        used = {p for p, r in enumerate(self._ref) if r > 0}
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        if free & cached or free & used or cached & used:
            raise AssertionError(f"pages in two states: {sorted((free & cached) | (free & used) | (cached & used))}")
        if len(free) + len(cached) + len(used) != self.num_pages:
            raise AssertionError(f"free {len(free)} + cached {len(cached)} + used {len(used)} != {self.num_pages}")
        if any(r < 0 for r in self._ref):
            raise AssertionError("negative refcount")
        if free & self._key_of.keys() or not cached <= self._key_of.keys():
            raise AssertionError("a free page is registered, or a cached page is not")
        if len(self._page_of) != len(self._key_of) or any(self._page_of.get(k) != p for p, k in self._key_of.items()):
            raise AssertionError("key -> page and page -> key maps disagree")
