"""The host-side page allocator (kivi_jax/serve/pages.py): refcounts, exhaustion, prefix sharing by hash chain, LRU."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kivi_jax.serve.pages import PageAllocator, PoolExhausted

R = 4  # tokens a page


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def fill(a: PageAllocator, tokens: list[int], salt: str = "") -> list[int]:
    """A request's block table for tokens: its cached prefix pages, then fresh pages, full ones registered."""
    pages = a.lookup_prefix(tokens, salt)
    keys = a.chain_keys(tokens, salt)
    fresh = a.allocate(-(-len(tokens) // R) - len(pages))
    for i, page in enumerate(fresh, start=len(pages)):
        if i < len(keys):
            assert a.register(page, keys[i])
    return pages + fresh


def test_allocate_release_round_trip():
    a = PageAllocator(8, R)
    p = a.allocate(3)
    assert len(set(p)) == 3 and all(a.refcount(x) == 1 for x in p)
    assert (a.free_pages, a.cached_pages, a.used_pages) == (5, 0, 3)
    q = a.allocate(5)
    assert set(p).isdisjoint(q) and a.free_pages == 0 and not a.can_allocate(1) and a.can_allocate(0)
    a.check()
    a.release(p + q)
    assert (a.free_pages, a.cached_pages, a.used_pages) == (8, 0, 0)
    assert all(a.refcount(x) == 0 for x in range(8))
    assert a.metrics() == {"pages_total": 8, "pages_free": 8, "pages_cached": 0, "pages_used": 0,
                           "pages_shared": 0, "evictions": 0, "prefix_hits": 0}
    a.check()


def test_pool_exhausted_changes_nothing_and_names_counts():
    a = PageAllocator(6, R)
    held = fill(a, toks(2 * R))  # 2 registered pages
    a.release(held)  # -> 2 cached
    a.allocate(1)  # 3 free, 2 cached, 1 used
    before = a.metrics()
    with pytest.raises(PoolExhausted) as e:
        a.allocate(6)
    msg = str(e.value)
    assert "6" in msg and "3 are free" in msg and "2 cached" in msg
    assert a.metrics() == before
    assert a.lookup_prefix(toks(2 * R)) == held  # the cached pages were not evicted
    a.check()


def test_double_free_raises():
    a = PageAllocator(4, R)
    p = a.allocate(2)
    a.release([p[0]])
    with pytest.raises(ValueError, match="double free"):
        a.release([p[0]])
    with pytest.raises(ValueError, match="double free"):
        a.release([p[1], p[1]])  # held once, released twice in one call
    assert a.refcount(p[1]) == 1 and a.used_pages == 1  # the failed call changed nothing
    with pytest.raises(ValueError):
        a.release([99])
    a.check()


def test_shared_prefix_between_two_requests():
    a = PageAllocator(10, R, namespace="kivi2|model-abc")
    prefix = toks(2 * R, 100)
    first = fill(a, prefix + toks(3, 900))  # 2 full pages + a partial one
    second = a.lookup_prefix(prefix + toks(R + 1, 500))
    assert second == first[:2]
    assert [a.refcount(x) for x in second] == [2, 2] and a.metrics()["pages_shared"] == 2
    assert a.metrics()["prefix_hits"] == 2
    second += a.allocate(2)
    a.check()
    a.release(first)
    a.release(second)
    assert all(a.refcount(x) == 0 for x in first + second)
    assert a.cached_pages == 2 and a.free_pages == 8 and a.used_pages == 0  # the prefix pages stay cached, not free
    assert a.lookup_prefix(prefix) == first[:2] and a.cached_pages == 0  # taken back out of the evictable set
    a.check()


def test_different_salts_share_nothing():
    a = PageAllocator(10, R)
    t = toks(3 * R)
    pages = fill(a, t, salt="alice")
    assert a.chain_keys(t, "alice") != a.chain_keys(t, "bob")
    assert set(a.chain_keys(t, "alice")).isdisjoint(a.chain_keys(t, ""))
    assert a.lookup_prefix(t, salt="bob") == [] and a.lookup_prefix(t) == []
    assert a.lookup_prefix(t, salt="alice") == pages
    a.check()


def test_different_namespaces_share_nothing():
    t = toks(2 * R)
    a, b = PageAllocator(4, R, namespace="kivi2|m1"), PageAllocator(4, R, namespace="kivi4|m1")
    assert set(a.chain_keys(t)).isdisjoint(b.chain_keys(t))
    # namespace and salt are length-prefixed: no concatenation of the two collides
    assert set(PageAllocator(4, R, "ab").chain_keys(t)).isdisjoint(PageAllocator(4, R, "a").chain_keys(t, "b"))
    fill(a, t)
    key_b = b.chain_keys(t)[0]
    assert key_b not in a._page_of and a.lookup_prefix(t)  # a hits its own keys, never b's
    c = PageAllocator(4, R, namespace="kivi2|m2")
    assert c.lookup_prefix(t) == []


def test_partial_last_page_is_never_keyed():
    a = PageAllocator(8, R)
    assert len(a.chain_keys(toks(R - 1))) == 0
    assert len(a.chain_keys(toks(2 * R + 3))) == 2 and len(a.chain_keys(toks(3 * R))) == 3
    assert a.chain_keys(toks(2 * R + 3)) == a.chain_keys(toks(3 * R))[:2]  # a key depends only on its prefix
    pages = fill(a, toks(2 * R + 3))
    assert len(pages) == 3 and len(a._key_of) == 2  # the partial page was not registered
    a.release(pages)
    assert a.cached_pages == 2 and a.free_pages == 6
    assert a.lookup_prefix(toks(3 * R)) == pages[:2]


def test_chain_keys_match_the_documented_hash():
    a = PageAllocator(4, R, namespace="spec|model")
    t = [5, -1, 2**31 - 1, 0, 7, 8, 9, 10, 11]

    def lp(s):
        return len(s.encode()).to_bytes(8, "little") + s.encode()

    key = hashlib.sha256(b"kivi-jax/pages/v1" + lp("spec|model") + lp("salt")).digest()
    want = []
    for i in range(2):
        key = hashlib.sha256(key + lp("spec|model") + np.array(t[i * R:(i + 1) * R], "<i4").tobytes()).digest()
        want.append(key)
    assert a.chain_keys(t, "salt") == want
    with pytest.raises(ValueError, match="int32"):
        a.chain_keys([2**31] * R)


def test_lru_eviction_order():
    a = PageAllocator(2, R)
    ta, tb = toks(R, 0), toks(R, 1000)
    pa, pb = fill(a, ta), fill(a, tb)
    a.release(pa)
    a.release(pb)  # A released first: A is least recently released
    assert a.free_pages == 0 and a.cached_pages == 2
    assert a.allocate(1) == pa and a.metrics()["evictions"] == 1  # only cached pages remain: A goes first
    assert a.lookup_prefix(ta) == []  # its key went with it
    assert a.lookup_prefix(tb) == pb  # B still hits
    a.release(pb)
    assert a.allocate(1) == pb and a.lookup_prefix(tb) == [] and a.metrics()["evictions"] == 2
    with pytest.raises(PoolExhausted):
        a.allocate(1)
    a.check()


def test_lru_evicts_a_block_tables_tail_first_and_eviction_drops_the_key():
    a = PageAllocator(3, R)
    t = toks(3 * R)
    pages = fill(a, t)
    a.release(pages)
    got = a.allocate(1)
    assert got == [pages[2]]  # the tail, so the rest of the chain still hits
    assert a.lookup_prefix(t) == pages[:2]
    a.release(got)  # never registered after its eviction: freed, not cached
    assert a.free_pages == 1 and a.cached_pages == 0
    a.check()


def test_touching_a_cached_page_renews_it():
    a = PageAllocator(4, R)
    ta, tb = toks(R, 0), toks(R, 1000)
    pa, pb = fill(a, ta), fill(a, tb)
    a.release(pa)
    a.release(pb)
    a.release(a.lookup_prefix(ta))  # A is now the most recently released
    a.allocate(2)  # 2 free first
    assert a.allocate(1) == pb and a.lookup_prefix(ta) == pa and a.lookup_prefix(tb) == []


def test_register_keeps_the_first_page_of_a_key():
    a = PageAllocator(4, R)
    key = a.chain_keys(toks(R))[0]
    p, q = a.allocate(2)
    assert a.register(p, key) and a.register(p, key)  # idempotent
    assert not a.register(q, key)  # the second page stays unregistered
    with pytest.raises(ValueError, match="another key"):
        a.register(p, a.chain_keys(toks(R, 7))[0])
    a.release([p, q])
    assert a.cached_pages == 1 and a.free_pages == 3
    with pytest.raises(ValueError, match="not referenced"):
        a.register(q, key)
    assert a.lookup_prefix(toks(R)) == [p]
    a.check()


def test_random_stress_against_a_model():
    rng = np.random.default_rng(1234)
    n_pages = 24
    a = PageAllocator(n_pages, R, namespace="stress")
    bases = [list(rng.integers(0, 50, size=6 * R)) for _ in range(3)]
    ref = [0] * n_pages  # model refcounts
    key_map: dict[bytes, int] = {}  # model key -> page
    ident: dict[int, tuple] = {}  # registered page -> (salt, tokens up to and including it)
    lru: list[int] = []  # model cached pages, oldest first
    seqs: list[tuple[list[int], list]] = []  # (block table, full pages not yet registered)
    evictions = hits = exhausted = dup_registers = most_shared = 0

    def model_release(pages):
        for p in reversed(pages):
            ref[p] -= 1
            if ref[p] == 0 and p in ident:
                lru.append(p)

    for step in range(3000):
        op = rng.random()
        if op < 0.45 or not seqs:
            base = bases[rng.integers(len(bases))]
            tokens = [int(x) for x in base[:rng.integers(0, len(base) + 1)]]
            tokens += [int(x) for x in rng.integers(0, 50, size=rng.integers(1 if not tokens else 0, 2 * R))]
            salt = ["", "s"][rng.integers(2)]
            keys = a.chain_keys(tokens, salt)
            want = []
            for k in keys:
                if k not in key_map:
                    break
                want.append(key_map[k])
            got = a.lookup_prefix(tokens, salt)
            assert got == want
            for i, p in enumerate(got):
                assert ident[p] == (salt, tuple(tokens[:(i + 1) * R]))  # never another salt's or content's page
                if ref[p] == 0:
                    lru.remove(p)
                ref[p] += 1
            hits += len(got)
            need = -(-len(tokens) // R) - len(got)
            n_free = n_pages - sum(r > 0 for r in ref) - len(lru)
            if need > n_free + len(lru):
                before = a.metrics()
                assert not a.can_allocate(need)
                with pytest.raises(PoolExhausted):
                    a.allocate(need)
                assert a.metrics() == before
                exhausted += 1
                a.release(got)
                model_release(got)
            else:
                fresh = a.allocate(need)
                k_evict = max(0, need - n_free)
                assert set(lru[:k_evict]) <= set(fresh) and len(set(fresh)) == need
                for p in fresh:
                    assert ref[p] == 0
                    if p in ident:
                        lru.remove(p)
                        del key_map[next(k for k, v in key_map.items() if v == p)]
                        del ident[p]
                        evictions += 1
                    ref[p] = 1
                # full fresh pages are registered later (once their prefill is done): until then another request
                # with the same prompt misses and fills its own pages, and its registration then finds the key taken
                pending = [(p, keys[i], (salt, tuple(tokens[:(i + 1) * R])))
                           for i, p in enumerate(fresh, start=len(got)) if i < len(keys)]
                seqs.append((got + fresh, pending))
        elif op < 0.75 and any(pending for _, pending in seqs):
            pending = [pending for _, pending in seqs if pending][0]
            for p, key, who in pending:
                expect = key not in key_map
                assert a.register(p, key) == expect
                if expect:
                    key_map[key] = p
                    ident[p] = who
                else:
                    dup_registers += 1
            pending.clear()
        else:
            pages, _ = seqs.pop(rng.integers(len(seqs)))
            a.release(pages)
            model_release(pages)
        a.check()
        assert [a.refcount(p) for p in range(n_pages)] == ref, step
        m = a.metrics()
        assert m["pages_used"] == sum(r > 0 for r in ref) and m["pages_cached"] == len(lru)
        assert m["pages_free"] == n_pages - m["pages_used"] - len(lru)
        assert m["pages_shared"] == sum(r >= 2 for r in ref)
        assert m["evictions"] == evictions and m["prefix_hits"] == hits
        most_shared = max(most_shared, m["pages_shared"])
    # the run went through every path it is meant to check
    assert evictions > 0 and hits > 0 and exhausted > 0 and dup_registers > 0 and most_shared > 0
    for pages, _ in seqs:
        a.release(pages)
    assert a.used_pages == 0 and a.free_pages + a.cached_pages == n_pages
    a.check()


def test_share_adds_a_reference_to_held_pages_only():
    a = PageAllocator(4, 16)
    held = a.allocate(2)
    a.share(held)
    assert [a.refcount(p) for p in held] == [2, 2] and a.metrics()["pages_shared"] == 2
    with pytest.raises(ValueError, match="not held"):
        a.share([p for p in range(4) if p not in held][:1])
    assert [a.refcount(p) for p in held] == [2, 2]  # a refused share takes nothing
    a.release(held)
    a.release(held)
    assert a.free_pages == 4
    a.check()
