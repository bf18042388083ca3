"""The console script ends quietly when interrupted: Ctrl-C exits 130 and a closed stdout pipe exits 141, neither with
a traceback (real signals and pipes, so these run in a subprocess), also when Ctrl-C comes during the first compile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kivi_jax import cli_args

ROOT = Path(__file__).resolve().parent.parent

# The real `main`, with the generate command replaced by one that streams forever (no model needed).
WORKER = """
import signal, sys, time
# Python's own Ctrl-C handler, as in a terminal: a test run started in the background (`cmd &`) passes SIGINT on
# ignored, and a Python started so never raises KeyboardInterrupt
signal.signal(signal.SIGINT, signal.default_int_handler)
from kivi_jax import cli

def forever(args):
    while True:
        sys.stdout.write("token ")
        sys.stdout.flush()
        time.sleep(0.01)

cli.cmd_generate = forever
sys.exit(cli.main(["generate", "--prompt", "hi"]))
"""


def start_worker() -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    p = subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.read(6) == b"token ", p.stderr.read().decode()  # it is streaming
    return p


def test_ctrl_c_exits_130_without_a_traceback():
    p = start_worker()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == cli_args.EXIT_INTERRUPTED == 130
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err
    assert err.strip().endswith(b"kivi-jax: interrupted")


def test_closed_pipe_exits_141_without_a_traceback():
    p = start_worker()
    p.stdout.close()  # the reader went away (as `kivi-jax generate ... | head -c 6` does)
    err = p.stderr.read()
    p.wait(timeout=60)
    assert p.returncode == cli_args.EXIT_BROKEN_PIPE == 141
    assert b"Traceback" not in err and b"BrokenPipeError" not in err and b"Exception ignored" not in err, err


# The real `main` on the tiny model, SIGINT sent 20 ms into the XLA compile of the first prefill: the compile runs
# on XLA's thread pool and Ctrl-C ends only the wait for it, so jax's atexit clean_up destroyed the client under it
# (SIGSEGV after "interrupted").
FIRST_COMPILE = """
import os, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)
from jax._src import compiler
armed, real = [], compiler.backend_compile_and_load

def compile_and_load(backend, module, *args, **kwargs):
    if "prefill" in str(module.operation.attributes["sym_name"]) and not armed:
        armed.append(threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGINT)))
        armed[0].start()
    return real(backend, module, *args, **kwargs)

compiler.backend_compile_and_load = compile_and_load
from kivi_jax import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_during_the_first_compile_exits_130_cleanly(tiny_dirs):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    p = subprocess.Popen([sys.executable, "-c", FIRST_COMPILE, "chat", "--model", str(tiny_dirs["llama_mha"][0]),
                          "--max-new-tokens", "8"], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(b"tell me a story\n", timeout=300)
    assert p.returncode == cli_args.EXIT_INTERRUPTED, (p.returncode, err.decode()[-2000:])
    assert b"Traceback" not in err and b"Fatal Python" not in err, err
    assert err.strip().endswith(b"kivi-jax: interrupted") and out.strip() == b"", out


def test_ctrl_c_inside_a_gc_callback_still_interrupts(monkeypatch):
    """Python runs the SIGINT handler at its next bytecode; inside a gc callback (jax has one, run by allocations in
    XLA's code) a KeyboardInterrupt is only printed as "Exception ignored", and the command went on to exit 0."""
    import atexit
    import gc
    import time

    at_exit = []
    monkeypatch.setattr(atexit, "register", lambda *a: at_exit.append(a))  # not this test process's exit
    fired = []

    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # a Ctrl-C raises, whatever ran before

    def in_gc(phase, info):
        if not fired and threading.current_thread() is threading.main_thread():  # a gc in another thread is not ours
            fired.append(phase)
            raise KeyboardInterrupt  # as the handler does when the signal lands here

    def command():
        gc.callbacks.append(in_gc)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(in_gc)
        for _ in range(3000):  # the interrupt comes back here
            time.sleep(0.01)
        return 0

    try:
        assert cli_args.run(command) == cli_args.EXIT_INTERRUPTED and fired
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    assert at_exit == [(cli_args._exit_at_exit, cli_args.EXIT_INTERRUPTED)]
