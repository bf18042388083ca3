"""The console script ends quietly when interrupted: Ctrl-C exits 130 and a closed stdout pipe exits 141, neither with
a traceback (real signals and pipes, so these run in a subprocess)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
