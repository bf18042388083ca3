"""The C++ CPU decode kernels (XLA FFI): built with the system compiler on first use, cached, loaded with ctypes.

`available()` builds and registers them (or says, once, why not); `decode_kivi` / `decode_full` have the contract of
`kivi_jax.attention.decode_kivi_xla` / `decode_full_xla`, their pure-jnp twins; `unsupported_kivi` /
`unsupported_full` say which caches they do not serve. See docs/kernels.md ("CPU kernel").
"""

from kivi_jax.native.build import NativeBuildError, available, error, load, reset
from kivi_jax.native.decode import FULL_AUTO, decode_full, decode_kivi, unsupported_full, unsupported_kivi

__all__ = ["FULL_AUTO", "NativeBuildError", "available", "error", "load", "reset", "decode_full", "decode_kivi",
           "unsupported_full", "unsupported_kivi"]
