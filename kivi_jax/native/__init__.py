"""The C++ CPU decode kernels (XLA FFI): built with the system compiler on first use, cached, loaded with ctypes.

`available()` builds and registers them (or says, once, why not); `decode_kivi` / `decode_full` / `decode_eight`
have the contract of `kivi_jax.attention.decode_kivi_xla` / `decode_full_xla` (for the 8-bit caches of
`kivi_jax.cache8` too), their pure-jnp twins; `unsupported_*` say which caches they do not serve. See docs/kernels.md ("CPU kernel").
"""

from kivi_jax.native.build import NativeBuildError, available, error, load, reset
from kivi_jax.native.decode import (FULL_AUTO, decode_eight, decode_full, decode_kivi, int8_dots,
                                    unsupported_eight, unsupported_full, unsupported_kivi)

__all__ = ["FULL_AUTO", "NativeBuildError", "available", "error", "load", "reset", "decode_eight", "decode_full",
           "decode_kivi", "int8_dots", "unsupported_eight", "unsupported_full", "unsupported_kivi"]
