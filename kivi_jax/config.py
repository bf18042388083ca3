"""KIVIConfig: bits, group size, residual length and axes of a KIVI cache; the cache-spec grammar."""

from __future__ import annotations

import dataclasses
import math
import re

from kivi_jax import codebook
from kivi_jax.quant import SCALE_DTYPES, SUPPORTED_BITS, pack_multiple

AXES = ("channel", "token")
RING_DTYPES = ("", "float16", "bfloat16")  # "": the ring in the compute dtype


@dataclasses.dataclass(frozen=True)
class KIVIConfig:
    """A KIVI cache: keys per-channel and values per-token by default (KIVI's axes).

    `group_size` (G) consecutive tokens (per-channel) or channels (per-token) share a scale and min; the newest tokens
    stay in full precision in a residual of `residual_length` (R, a multiple of G). `key_axis` / `value_axis` flip the
    axes for the ablation study only. Scales and mins are stored in `scale_dtype`.

    Beyond KIVI (docs/quality.md; all off by default): `pre_rope` quantizes keys before RoPE and rotates them after
    dequantization; `sinks` keeps the first S tokens' keys and values in full precision; `rotate_values` quantizes
    values in a per-head orthogonal basis folded into the value and output projections (`kivi_jax.rotation`);
    `rotate_keys` rotates queries and keys by the same basis every step (measured, see docs/quality.md);
    `first_layers = n` stores layers `[0, n)` with `first_k_bits` / `first_v_bits` instead (per-layer bits);
    `k_codebook` / `v_codebook` give keys / values non-uniform codes, the calibrated levels of `kivi_jax.codebook`.
    """

    k_bits: int = 2
    v_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    key_axis: str = "channel"
    value_axis: str = "token"
    scale_dtype: str = "float16"
    pre_rope: bool = False
    sinks: int = 0
    rotate_values: bool = False
    rotate_keys: bool = False
    first_layers: int = 0
    first_k_bits: int = 0
    first_v_bits: int = 0
    k_codebook: bool = False
    v_codebook: bool = False
    ring_dtype: str = ""  # the residual ring's dtype ("": the compute dtype)

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            bits = getattr(self, name)
            if bits not in SUPPORTED_BITS:
                raise ValueError(f"{name}={bits} is not supported; choose one of {SUPPORTED_BITS}")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"group_size={self.group_size} must be a positive integer")
        r, g = self.residual_length, self.group_size
        if not isinstance(r, int) or r <= 0 or r % g:
            raise ValueError(
                f"residual_length={r} must be a positive multiple of group_size={g} (e.g. {max(g, 128 // g * g)})"
            )
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in AXES:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {AXES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r} must be one of {tuple(SCALE_DTYPES)}")
        if self.ring_dtype not in RING_DTYPES:
            raise ValueError(f"ring_dtype={self.ring_dtype!r} must be one of {RING_DTYPES} ('': the compute dtype)")
        if not isinstance(self.sinks, int) or isinstance(self.sinks, bool) or self.sinks < 0:
            raise ValueError(f"sinks={self.sinks!r} must be a whole number of tokens >= 0 (e.g. 4)")
        for name in ("pre_rope", "rotate_values", "rotate_keys", "k_codebook", "v_codebook"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.first_layers, int) or self.first_layers < 0:
            raise ValueError(f"first_layers={self.first_layers!r} must be a whole number of layers >= 0")
        if self.first_layers:
            for name in ("first_k_bits", "first_v_bits"):
                if getattr(self, name) not in SUPPORTED_BITS:
                    raise ValueError(f"{name}={getattr(self, name)} is not supported for the first {self.first_layers} "
                                     f"layers; choose one of {SUPPORTED_BITS}")
        elif self.first_k_bits or self.first_v_bits:
            raise ValueError("first_k_bits/first_v_bits need first_layers > 0 (the layers they apply to)")
        for on, role, bits in ((self.k_codebook, "key", (self.k_bits, self.first_k_bits)),
                               (self.v_codebook, "value", (self.v_bits, self.first_v_bits))):
            for b in bits[: 1 + bool(self.first_layers)] if on else ():
                if b not in codebook.supported_bits(role):
                    raise ValueError(f"-nuq{role[0]} has no calibrated {b}-bit {role} codebook; choose {role} bits in "
                                     f"{codebook.supported_bits(role)} (kivi_jax/codebook.py) or drop -nuq{role[0]}")
        if self.rotate_keys and self.pre_rope:
            raise ValueError("rotate_keys rotates keys after RoPE; it cannot be combined with pre_rope (drop one)")

    def check_shapes(self, head_dim: int, max_tokens: int) -> None:
        """Raises a clear error unless a cache of `max_tokens` tokens with this `head_dim` can be built."""
        g, r = self.group_size, self.residual_length
        if head_dim % self.channel_group(head_dim) or (g > head_dim and g % head_dim):
            divisors = [d for d in (32, 64, 128) if head_dim % d == 0 and r % d == 0]
            raise ValueError(
                f"group_size={g} does not divide head_dim={head_dim} (nor is it a multiple of it); per-token groups "
                f"run over channels (try group_size in "
                f"{divisors or [d for d in range(1, head_dim + 1) if head_dim % d == 0]})"
            )
        for bits in (self.k_bits, self.v_bits):
            if head_dim % pack_multiple(bits):
                raise ValueError(f"head_dim={head_dim} must be a multiple of {pack_multiple(bits)} to pack {bits}-bit "
                                 "codes")
        if max_tokens <= 0 or max_tokens % r:
            up = -(-max(max_tokens, 1) // r) * r
            raise ValueError(
                f"max_tokens={max_tokens} must be a positive multiple of residual_length={r} (e.g. {up})"
            )

    def channel_group(self, head_dim: int) -> int:
        """Channels a per-token group spans: G, or the whole head when G > head_dim (e.g. G=128 with head_dim 64:
        per-channel stores group 128 tokens, per-token stores one (scale, min) per head of 64 channels)."""
        return min(self.group_size, head_dim)

    def store_group(self, axis: str, head_dim: int) -> int:
        """The group size of a store on `axis`: G tokens (per-channel) or `channel_group` channels (per-token)."""
        return self.group_size if axis == "channel" else self.channel_group(head_dim)

    @property
    def spec(self) -> str:
        """The canonical spec string, e.g. `k2v2-g32-r128` (printed from `SUFFIXES`, in its order)."""
        s = f"k{self.k_bits}v{self.v_bits}"
        for suffix, field, value, _ in SUFFIXES:
            if value is int:  # a number: G and R always, others when set
                n = getattr(self, field)
                s += f"-{suffix}{n}" if n or field in ("group_size", "residual_length") else ""
            elif isinstance(field, tuple):  # per-layer bits
                s += f"-{value.format(*(getattr(self, f) for f in field))}" if getattr(self, field[0]) else ""
            elif getattr(self, field) == value:
                s += f"-{suffix}"
        return s

    def levels(self, role: str) -> tuple[float, ...] | None:
        """The codebook of the key or value store (`role`), or None for uniform codes."""
        on = {"key": self.k_codebook, "value": self.v_codebook}[role]
        return codebook.levels(role, self.k_bits if role == "key" else self.v_bits) if on else None

    def first(self) -> "KIVIConfig":
        """The configuration of the first `first_layers` layers (their bits, everything else shared)."""
        return dataclasses.replace(self, k_bits=self.first_k_bits, v_bits=self.first_v_bits, first_layers=0,
                                   first_k_bits=0, first_v_bits=0)

    def rest(self) -> "KIVIConfig":
        """The configuration of the other layers (without the per-layer part)."""
        return dataclasses.replace(self, first_layers=0, first_k_bits=0, first_v_bits=0)

    @property
    def bits_per_value(self) -> float:
        """Bits a cached key or value costs in the quantized part (codes, scales and mins; not the ring or sinks),
        averaged over keys and values, for a head of `group_size` channels or more (see `bits_per_value`)."""
        return bits_per_value(self, None)

    # -- the cache-spec interface (shared with FullSpec and Dense8Config: what parse_cache_spec gives) --

    @property
    def token_multiple(self) -> int:
        """A cache of this spec holds a multiple of this many tokens (R: keys are quantized in whole R-blocks)."""
        return self.residual_length

    def exact_prefill(self, tokens: int) -> int:
        """How many of `tokens` prompt tokens one prefill call scores as decode steps would: the ring's R (nothing is
        quantized before it first fills)."""
        return min(tokens, self.residual_length)

    def quantized_tokens(self, length):
        """(keys, values) quantized when `length [batch]` tokens are in (`layout.quantized_end` on each axis)."""
        from kivi_jax import layout

        return (layout.quantized_end(self.key_axis, length, self.residual_length),
                layout.quantized_end(self.value_axis, length, self.residual_length))

    def value_bits(self, head_dim: int | None, tokens: int | None = None, num_layers: int | None = None) -> float:
        """Bits a cached value costs (`bits_per_value`)."""
        return bits_per_value(self, head_dim, tokens, num_layers)

    def describe(self) -> dict:
        """Keys, values, G, R and options, for tables."""
        options = [name for on, name in ((self.pre_rope, "pre-RoPE"), (self.sinks, f"{self.sinks} sinks"),
                                         (self.rotate_values, "rotated values"), (self.rotate_keys, "rotated keys"),
                                         (self.first_layers, f"first {self.first_layers} layers k{self.first_k_bits}"
                                                             f"v{self.first_v_bits}"),
                                         (self.k_codebook, "key codebook"), (self.v_codebook, "value codebook")) if on]
        return {"keys": f"{self.k_bits}-bit per-{self.key_axis}", "values": f"{self.v_bits}-bit per-{self.value_axis}",
                "G": self.group_size, "R": self.residual_length, "options": ", ".join(options)}


@dataclasses.dataclass(frozen=True)
class FullSpec:
    """The full-precision cache: keys and values in the compute dtype, the baseline every number is compared against.
    `parse_cache_spec("full")` gives `FULL`; it compares equal to the string "full"."""

    def __eq__(self, other) -> bool:
        return isinstance(other, FullSpec) or other == "full"

    def __hash__(self) -> int:
        return hash("full")

    def __str__(self) -> str:
        return "full"

    spec = property(lambda self: "full", doc="The spec string.")
    token_multiple = property(lambda self: 1, doc="Any number of tokens.")

    def check_shapes(self, head_dim: int, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens} must be positive")

    def exact_prefill(self, tokens: int) -> int:
        return tokens  # a prefill attends to exactly what decode steps would

    def quantized_tokens(self, length):
        return 0 * length, 0 * length

    def value_bits(self, head_dim: int | None, tokens: int | None = None, num_layers: int | None = None) -> float:
        return 16.0  # float16 / bfloat16 compute; a float32 cache stores 32

    def describe(self) -> dict:
        return {"keys": "full", "values": "full", "G": "", "R": "", "options": ""}


FULL = FullSpec()
REFERENCE = FULL.spec  # the spec every other is measured against: its name in results, JSON rows and tables


def is_reference(spec) -> bool:
    """Whether `spec` (a parsed spec, a spec string, or a result row's spec label) is the full-precision reference."""
    return spec == FULL if isinstance(spec, (str, FullSpec)) else False

# 8-bit caches: (spec name, storage dtype name, largest finite value); per-token-and-head scales for int8 always, for
# fp8 with `-tok` (else one scale of 1 per tensor, vLLM's default without calibrated scales)
EIGHT_BIT = {"int8": ("int8", 127.0), "fp8-e4m3": ("float8_e4m3fn", 448.0), "fp8-e5m2": ("float8_e5m2", 57344.0)}


@dataclasses.dataclass(frozen=True)
class Dense8Config:
    """An 8-bit cache, the simple baseline beside KIVI: every key and value stored as it comes in `fmt` (`int8`,
    `fp8-e4m3`, `fp8-e5m2`), no residual ring. `per_token`: a float16 scale per token and kv head (absmax / the
    format's largest value; int8 always has it), else the values themselves (a per-tensor scale of 1)."""

    fmt: str = "int8"
    per_token: bool = True

    def __post_init__(self):
        if self.fmt not in EIGHT_BIT:
            raise ValueError(f"fmt={self.fmt!r} must be one of {tuple(EIGHT_BIT)}")
        if self.fmt == "int8" and not self.per_token:
            raise ValueError("an int8 cache needs its per-token scales (int8 codes without a scale hold integers)")

    @property
    def spec(self) -> str:
        return self.fmt + ("-tok" if self.per_token and self.fmt != "int8" else "")

    @property
    def dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(EIGHT_BIT[self.fmt][0])

    @property
    def max_value(self) -> float:
        return EIGHT_BIT[self.fmt][1]

    token_multiple = property(lambda self: 1, doc="Any number of tokens.")

    def check_shapes(self, head_dim: int, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens} must be positive")

    def exact_prefill(self, tokens: int) -> int:
        return min(tokens, 1)  # a prefill's tokens see each other unquantized, decode steps see them stored

    def quantized_tokens(self, length):
        return length, length

    def value_bits(self, head_dim: int | None, tokens: int | None = None, num_layers: int | None = None) -> float:
        return 8.0 + (16.0 / head_dim if self.per_token and head_dim else 0.0)

    def describe(self) -> dict:
        scale = "per-token scale" if self.per_token else "no scale"
        return {"keys": f"{self.fmt} ({scale})", "values": f"{self.fmt} ({scale})", "G": "", "R": "", "options": ""}


def bits_per_value(kivi: KIVIConfig, head_dim: int | None, tokens: int | None = None,
                   num_layers: int | None = None) -> float:
    """Bits a cached value costs, keys and values averaged: codes plus (scale, min) per group in the scale dtype, and
    with `tokens` the sink tokens' full-precision (float16) keys and values spread over them. The ring is not
    counted (it is the same R tokens for every configuration). `head_dim` None: per-token groups of G channels.
    Per-layer bits (`first_layers`) are averaged over `num_layers` (required then)."""
    if kivi.first_layers:
        if num_layers is None or num_layers <= kivi.first_layers:
            raise ValueError(f"{kivi.spec} sets the first {kivi.first_layers} layers apart: give the model's "
                             f"num_layers (more than {kivi.first_layers})")
        n = kivi.first_layers
        return (n * bits_per_value(kivi.first(), head_dim, tokens)
                + (num_layers - n) * bits_per_value(kivi.rest(), head_dim, tokens)) / num_layers
    scale_bits = 2 * 8 * {"float16": 2, "bfloat16": 2, "float32": 4}[kivi.scale_dtype]  # a scale and a min
    total = 0.0
    for bits, axis in ((kivi.k_bits, kivi.key_axis), (kivi.v_bits, kivi.value_axis)):
        group = kivi.group_size if head_dim is None else kivi.store_group(axis, head_dim)
        total += bits + scale_bits / group
    sinks = 16 * min(kivi.sinks, tokens) / tokens if tokens else 0.0  # a float16 key and value, beside their codes
    return total / 2 + sinks


# The spec grammar, one table for parsing, printing and the help text, in the order a canonical spec prints its
# suffixes: (suffix, field, value, help). `int`: the number after the suffix (`-g64`; the help names it first); a tuple
# of fields: `-l<n>k<b>v<b>` (per-layer bits); otherwise a flag that sets the field to the value. A new option is a
# KIVIConfig field and one row here.
SUFFIXES = (
    ("g", "group_size", int, "G: group size (default 32: tokens per group for per-channel stores, channels, at most "
                             "head_dim, for per-token ones)"),
    ("r", "residual_length", int, "R: residual length (default 128, a multiple of G)"),
    ("ktok", "key_axis", "token", "quantizes keys per-token (the axis ablation)"),
    ("vchan", "value_axis", "channel", "quantizes values per-channel (the axis ablation)"),
    ("sf32", "scale_dtype", "float32", "stores scales and mins in float32 instead of float16"),
    ("sbf16", "scale_dtype", "bfloat16", "stores scales and mins in bfloat16 instead of float16"),
    ("prerope", "pre_rope", True, "quantizes keys before RoPE"),
    ("s", "sinks", int, "S: keeps the first S tokens in full precision"),
    ("rotv", "rotate_values", True, "quantizes values in a rotated basis"),
    ("rotk", "rotate_keys", True, "rotates queries and keys"),
    ("l", ("first_layers", "first_k_bits", "first_v_bits"), "l{}k{}v{}",
     "stores the first n layers with other key/value bits (e.g. -l2k4v4)"),
    ("nuqk", "k_codebook", True, "gives keys non-uniform codes (calibrated codebooks, kivi_jax/codebook.py)"),
    ("nuqv", "v_codebook", True, "gives values non-uniform codes (calibrated codebooks, kivi_jax/codebook.py)"),
    ("ringf16", "ring_dtype", "float16", "keeps the residual ring in float16 (KIVI's FP16 residual) instead of the "
                                         "compute dtype"),
    ("ringbf16", "ring_dtype", "bfloat16", "keeps the residual ring in bfloat16 instead of the compute dtype"),
)
FLAGS = {suffix: (field, value) for suffix, field, value, _ in SUFFIXES if value is not int and isinstance(field, str)}
NUMBERS = {suffix: field for suffix, field, value, _ in SUFFIXES if value is int}
_LAYERS = re.compile(r"^l(\d+)k(\d+)v(\d+)$")
_NUMBER = re.compile(r"^([a-z]+)(\d+)$")
_SPEC = re.compile(r"^k(\d+)v(\d+)((?:-(?:" + "|".join(
    [re.escape(f) for f in FLAGS] + [f"{n}\\d+" for n in NUMBERS] + [r"l\d+k\d+v\d+"]) + r"))*)$")


_EIGHT = re.compile(r"^(int8|fp8|fp8-e4m3|fp8-e5m2)(-tok)?$")

ALIASES = {
    "kivi2": KIVIConfig(2, 2, 32, 128),
    "kivi4": KIVIConfig(4, 4, 32, 128),
    # beyond KIVI (docs/quality.md): the best configuration measured on the development split within 3.2 and 4.2 bits
    # a value (codes, scales, mins and sinks)
    "kivi2+": KIVIConfig(3, 2, 64, 128, pre_rope=True, sinks=4, rotate_values=True),
    "kivi3+": KIVIConfig(4, 3, 64, 128, pre_rope=True, sinks=4, rotate_values=True),
    # within 2.6 bits a value at 32K tokens, ring included (docs/quality.md, "kivi2.5"): the best of the candidates
    # measured on the development split, 2-bit keys and values at G128 with the calibrated codebooks of
    # kivi_jax/codebook.py, the first 2 layers at 4 bits
    "kivi2.5": KIVIConfig(2, 2, 128, 128, pre_rope=True, sinks=4, rotate_values=True, first_layers=2, first_k_bits=4,
                          first_v_bits=4, k_codebook=True, v_codebook=True),
}

def _option_help() -> tuple[str, str]:
    """(the grammar `[-g<G>][-r<R>]...`, what each option does), from SUFFIXES."""
    grammar, meaning = "", []
    for suffix, field, value, text in SUFFIXES:
        if value is int:
            name, text = text.split(": ", 1)
            grammar += f"[-{suffix}<{name}>]"
            meaning.append(f"-{suffix}<{name}> {text}")
        elif isinstance(field, tuple):
            grammar += "[-l<n>k<b>v<b>]"
            meaning.append(f"-l<n>k<b>v<b> {text}")
        else:
            grammar += f"[-{suffix}]"
            meaning.append(f"-{suffix} {text}")
    return grammar, "; ".join(meaning)


SPEC_HELP = (
    "cache specs: 'full' (full precision in the compute dtype); "
    + "; ".join(f"'{name}' (= {a.spec})" for name, a in ALIASES.items()) + " (those with + and kivi2.5 go beyond KIVI); "
    f"or k<bits>v<bits>{_option_help()[0]} with bits in {{2,3,4,8}}, e.g. k4v2-g64-r128: {_option_help()[1]}; "
    "8-bit baselines: 'int8' (per token and kv head, a float16 scale each), 'fp8' (= fp8-e4m3) or 'fp8-e5m2' "
    "(as stored, a per-tensor scale of 1), '-tok' for fp8 with per-token scales (e.g. fp8-e4m3-tok)"
)

def parse_cache_spec(spec) -> "FullSpec | KIVIConfig | Dense8Config":
    """'full', an alias or a spec string -> its spec (FULL, a KIVIConfig or a Dense8Config); a spec passes through."""
    if isinstance(spec, (FullSpec, KIVIConfig, Dense8Config)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a cache spec is a string, KIVIConfig or Dense8Config, not {type(spec).__name__}")
    s = spec.strip().lower()
    if s == "full":
        return FULL
    if s in ALIASES:
        return ALIASES[s]
    eight = _EIGHT.match(s)
    if eight:
        fmt = {"fp8": "fp8-e4m3"}.get(eight.group(1), eight.group(1))
        return Dense8Config(fmt, per_token=fmt == "int8" or bool(eight.group(2)))
    m = _SPEC.match(s)
    if not m:
        raise ValueError(f"bad cache spec {spec!r}; {SPEC_HELP}")
    opts = [o for o in m.group(3).split("-") if o]
    kw: dict = {"k_bits": int(m.group(1)), "v_bits": int(m.group(2))}
    for o in opts:
        layers = _LAYERS.match(o)
        if layers:
            if "first_layers" in kw:
                raise ValueError(f"bad cache spec {spec!r}: first_layers given twice")
            kw.update(first_layers=int(layers.group(1)), first_k_bits=int(layers.group(2)),
                      first_v_bits=int(layers.group(3)))
            continue
        number = _NUMBER.match(o)
        key, value = FLAGS.get(o) or (NUMBERS[number.group(1)], int(number.group(2)))
        if key in kw:
            raise ValueError(f"bad cache spec {spec!r}: {key} given twice")
        kw[key] = value
    try:
        return KIVIConfig(**kw)
    except ValueError as e:
        raise ValueError(f"bad cache spec {spec!r}: {e}") from e


def allocation_multiple(bucket: int, *specs) -> int:
    """Tokens a cache is allocated in multiples of: `bucket` and every spec's `token_multiple` (KIVI's R)."""
    return math.lcm(bucket, *(parse_cache_spec(s).token_multiple for s in specs))


def spec_name(spec) -> str:
    """The canonical name of a parsed spec ('full', 'int8' or e.g. 'k2v2-g32-r128')."""
    return spec if isinstance(spec, str) else spec.spec
