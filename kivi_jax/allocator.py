"""The process's memory policy while it serves: glibc's malloc keeps the memory it frees, and Python's collector
leaves alone the objects that loading and warming up made.

XLA:CPU allocates each call's buffers afresh (a 32-row SmolLM2 decode step: one 54 MiB block of temporaries), and
glibc maps every block past its mmap threshold (at most 32 MiB) with its own `mmap` and unmaps it when freed, so each
call touches fresh pages again: about 6,000 page faults a 32-row step on the 2-core VM, whose served decode took 9%
less time without them (docs/serving.md, "Freed memory kept"). `keep_freed_memory` turns glibc's mapping of large blocks
and its trimming of the heap off, so that the next call of that size reuses the freed block. The price: the process
keeps the most heap it ever used (freed memory is not returned to the system).

Loading the model and compiling the server's programs leave about 1.2 million Python objects (traced programs and
their caches) that live as long as the process. A full collection of Python's cycle collector walks all of them:
about 0.9 s on the 2-core VM, with the GIL held, so the scheduler and every stream stop meanwhile; it ran every 10-30
s during warm-up (docs/serving.md, "The collector's pause"). `frozen_heap` collects once and freezes what is left
(`gc.freeze`, as vLLM does once it has started), so that later collections walk only the objects made while serving.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
OPT_OUT = "KIVI_JAX_KEEP_FREED_MEMORY"  # "0": leave the allocator as it is


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to serve every block from its heap (no `mmap` of its own) and never to trim the heap; True
    where it did (Linux with glibc, unless the environment sets KIVI_JAX_KEEP_FREED_MEMORY=0)."""
    if os.environ.get(OPT_OUT, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


@contextlib.contextmanager
def frozen_heap():
    """Within the block, Python's collector leaves the objects alive at its start alone (collected first, then
    frozen); at its end they are collectable again (`gc.unfreeze`)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
