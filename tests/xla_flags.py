"""The XLA flags every test process runs under (the pytest workers through tests/conftest.py, and the processes the
tests start with flags of their own). Imports nothing: a process sets these before jax starts.

`--xla_cpu_use_fusion_emitters=false`: XLA:CPU compiles loop fusions with its older elemental emitter instead of the
MLIR fusion emitters. The tests' programs are tiny, so compiling is nearly all their time (74% of
tests/test_paged.py's in XLA's backend compile alone), and this flag halves that compile: tests/test_paged.py 186 ->
108 s, test_cache8.py 50 -> 39 s, the real-model checks of test_real_model.py 74 -> 60 s (2026-12-06, the 2-core VM
without AMX). Results may differ from the default emitters' in the last bits (other fused multiply-adds); every
comparison in the suite runs both sides in one process, under the same flags, except where a claim is bit for bit
across batch shapes (`xla_default_emitters`, below). The library itself keeps XLA's defaults: under this flag a batch
of rows is not always computed as each row alone, which the server's batching promises.
"""

TEST_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
# Set to "1" in a process that runs under XLA's default emitters: the child pytest that runs a test marked
# `xla_default_emitters` (tests/conftest.py). The older emitter's code for a batch of rows may round unlike its code
# for one row (a batched prefill's later layers differed from prefills alone by one ulp, 2026-12-06), so a claim that
# they are equal bit for bit is checked as users run it.
DEFAULT_EMITTERS_ENV = "KIVI_JAX_TEST_DEFAULT_EMITTERS"


def with_test_flags(flags: str = "") -> str:
    """`flags` (an XLA_FLAGS value) with the tests' flags added where it does not name them already."""
    named = {f.split("=")[0] for f in flags.split()}
    return " ".join([*flags.split(), *(f for f in TEST_XLA_FLAGS if f.split("=")[0] not in named)])


def without_test_flags(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) less the tests' flags."""
    ours = {f.split("=")[0] for f in TEST_XLA_FLAGS}
    return " ".join(f for f in flags.split() if f.split("=")[0] not in ours)
