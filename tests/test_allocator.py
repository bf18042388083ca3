"""The serving process's allocator policy (kivi_jax/allocator.py): a freed large block is reused, not mapped afresh.
Each check runs in its own process, since the policy holds for the whole process."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the policy is glibc's (Linux)")

# Mallocs, touches and frees a 64 MiB block three times before and three times after the policy; prints the minor page
# faults of each round and what keep_freed_memory returned
ROUNDS = r"""
import ctypes, resource, sys
from kivi_jax import allocator
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20
def faults():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
before = [faults() for _ in range(3)]
kept = allocator.keep_freed_memory()
after = [faults() for _ in range(3)]
print(kept, *before, *after)
"""


def rounds(env_extra: dict | None = None) -> tuple[bool, list[int], list[int]]:
    """(what keep_freed_memory returned, each round's page faults before it, after it) in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "KIVI_JAX_KEEP_FREED_MEMORY"} | (env_extra or {})
    out = subprocess.run([sys.executable, "-c", ROUNDS], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    kept, *faults = out.stdout.split()
    return kept == "True", [int(f) for f in faults[:3]], [int(f) for f in faults[3:]]


def serve_args(tiny_dirs, *extra):
    """`serve`'s parsed flags for a tiny model with two small slots and no warm-up, plus `extra`."""
    from kivi_jax.cli import build_parser

    return build_parser().parse_args(["serve", "--model", str(tiny_dirs["llama_mha"][0]), "--cache", "k2v2-g8-r16",
                                      "--slots", "2", "--max-length", "64", "--no-warmup", *extra])


def test_freed_blocks_are_reused_once_kept():
    kept, before, after = rounds()
    pages = (64 << 20) // 4096
    assert kept
    assert min(before) > pages // 2, before  # glibc maps each 64 MiB block afresh: every page faults every round
    assert max(after[1:]) < pages // 100, after  # kept: the block freed in the round before is reused


def test_the_policy_can_be_left_off():
    kept, before, after = rounds({"KIVI_JAX_KEEP_FREED_MEMORY": "0"})
    assert not kept
    assert min(after) > (64 << 20) // 4096 // 2, after


def test_the_server_command_sets_the_policy_once_its_model_is_loaded(tiny_dirs, monkeypatch):
    """`serve` and `bench serve` build their server through `server_from_args`, which sets the policy (here only
    recorded: the policy holds for the whole process)."""
    from kivi_jax import allocator
    from kivi_jax.serve import cli as serve_cli

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append("kept") or True)
    server = serve_cli.server_from_args(serve_args(tiny_dirs), progress=False)
    assert calls == ["kept"] and server.scheduler.engine.live_slots() == []


def test_the_collector_leaves_what_lives_at_the_start_alone():
    """`frozen_heap`: garbage at its start is collected, not frozen; what lives is frozen until its end; what becomes
    garbage within it is collected as usual."""
    import gc
    import weakref

    from kivi_jax import allocator

    class Node:
        pass

    garbage = Node()
    garbage.me = garbage  # a cycle: only the collector frees it
    dead = weakref.ref(garbage)
    del garbage
    alive = Node()
    alive.me = alive
    before = gc.get_freeze_count()
    with allocator.frozen_heap():
        assert dead() is None
        inside = gc.get_freeze_count()
        assert inside > before
        late = Node()
        late.me = late
        late_dead = weakref.ref(late)
        del late
        gc.collect()
        assert late_dead() is None
        assert gc.get_freeze_count() == inside  # a collection within it frees nothing frozen nor thaws it
    assert gc.get_freeze_count() == before
    assert alive.me is alive


def test_the_server_command_serves_with_the_loaded_heap_frozen(tiny_dirs, monkeypatch):
    """`serve` runs its HTTP server inside `frozen_heap` (here a stand-in that records the freeze when it runs)."""
    import gc

    from kivi_jax.serve import cli as serve_cli
    from kivi_jax.serve import http

    seen = []

    class Uvicorn:
        def run(self, sockets):
            seen.append(gc.get_freeze_count())
            for s in sockets:
                s.close()

    monkeypatch.setattr(http, "make_uvicorn", lambda *a, **k: Uvicorn())
    before = gc.get_freeze_count()
    assert serve_cli.cmd_serve(serve_args(tiny_dirs, "--host", "127.0.0.1", "--port", "0")) == 0
    assert len(seen) == 1 and seen[0] > before
    assert gc.get_freeze_count() == before
