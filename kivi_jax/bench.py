"""Benchmarks against the full-precision cache: decode-step time, cache and temporary bytes with the largest batch
that fits a budget, and end-to-end generation throughput; synthetic caches at a given fill and model presets."""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import rotation, runtime, sharding
from kivi_jax import weights as weight_formats
from kivi_jax.cache import cache_bytes, make_cache, tree_bytes
from kivi_jax.config import REFERENCE, is_reference, parse_cache_spec, spec_name
from kivi_jax.models.config import ModelConfig
from kivi_jax.models.decoder import Params, cast_params, init_params


def random_cache(spec, cfg, batch: int, max_tokens: int, length: int, dtype=jnp.float32, impl: str = "auto",
                 seed: int = 0, mesh=None):
    """A cache of `max_tokens` holding `length` tokens of random content (decode cost does not depend on values);
    with `mesh`, made already sharded."""

    def fill():
        cache = make_cache(spec, cfg, batch, max_tokens, dtype, impl)
        key = jax.random.PRNGKey(seed)
        leaves, treedef = jax.tree_util.tree_flatten(cache)
        keys = jax.random.split(key, len(leaves))
        filled = []
        for k, leaf in zip(keys, leaves):
            if leaf.dtype == jnp.uint8:
                filled.append(jax.random.randint(k, leaf.shape, 0, 256, jnp.int32).astype(jnp.uint8))
            elif jnp.issubdtype(leaf.dtype, jnp.floating):
                filled.append((0.1 * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype))
            else:
                filled.append(leaf)
        cache = jax.tree_util.tree_unflatten(treedef, filled)
        return cache.replace(length=jnp.full((batch,), length, jnp.int32))

    return fill() if mesh is None else sharding.make_cache(fill, mesh)


def decode_step_fn():
    """The jit-compiled decode step with the cache donated (what generation runs per token)."""
    return jax.jit(runtime.decode_logits, donate_argnums=(2,))


def time_decode(params: Params, cache, repeats: int = 10, warmup: int = 2, mesh=None) -> dict:
    """Median / min / spread of the decode step's wall time (ms), the cache advancing one token per call; with
    `mesh`, params, cache and tokens sharded on it.

    The first call's time (compilation included) is reported as `compile_s`.
    """
    with sharding.use_mesh(mesh):
        return _time_decode(params, cache, repeats, warmup, mesh)


def _time_decode(params: Params, cache, repeats: int, warmup: int, mesh) -> dict:
    step = decode_step_fn()
    batch = cache.length.shape[0]
    tokens = jnp.ones((batch,), jnp.int32)
    if mesh is not None:
        params, tokens = sharding.shard_params(params, mesh), sharding.put_batch(np.ones((batch,), np.int32), mesh)
    t0 = time.perf_counter()
    logits, cache = step(params, tokens, cache)
    logits.block_until_ready()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        logits, cache = step(params, tokens, cache)
    logits.block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits, cache = step(params, tokens, cache)
        logits.block_until_ready()
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "step_ms_median": statistics.median(times),
        "step_ms_min": min(times),
        "step_ms_max": max(times),
        "compile_s": compile_s,
        "tokens_per_s": batch / (statistics.median(times) / 1e3),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Models to measure: the real SmolLM2 (or any path) and synthetic weights with the real shapes of larger models

PRESETS = {
    "llama2-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, bos_token_id=1,
        eos_token_ids=(2,), pad_token_id=0,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
}


def with_layers(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    """The config with its first `layers` layers (None: all)."""
    if layers is None or layers == cfg.num_layers:
        return cfg
    if not 1 <= layers <= cfg.num_layers:
        raise ValueError(f"--layers {layers} must be between 1 and the model's {cfg.num_layers} layers")
    return cfg.with_layers(layers)


def truncate_layers(params: Params, layers: int | None) -> Params:
    """Params keeping the first `layers` layers of the stacks (None: all)."""
    cfg = with_layers(params.config, layers)
    if cfg is params.config:
        return params
    stacks = jax.tree_util.tree_map(lambda a: a[:layers], params.layers)
    return params.replace(layers=stacks, config=cfg)


def model_config(name: str, layers: int | None = None) -> ModelConfig:
    """The config of a preset, a known model or a path, without materializing weights where it can."""
    if name in PRESETS:
        return with_layers(PRESETS[name], layers)
    return with_layers(load_model(name, None, None).config, layers)


def memory_params(name: str, dtype, layers: int | None = None, weights: str = "auto"):
    """Abstract params whose bytes a memory report counts: a preset's shapes in `weights` (float in `dtype`, or
    quantized), or a real model as loaded with `weights` (its float leaves in `dtype`)."""
    if name in PRESETS:
        return abstract_params(with_layers(PRESETS[name], layers), dtype, weights)
    params = load_model(name, None, layers, weights=weights)
    return jax.eval_shape(lambda p: cast_params(p, dtype), params)


def load_model(name: str, dtype=None, layers: int | None = None, seed: int = 0, weights: str = "auto") -> Params:
    """Params to benchmark: synthetic weights for a preset (`llama2-7b`, `llama3-8b`; quantized into `weights` when
    that names a quantized format), else `kivi_jax.load(name, weights=weights)`."""
    if name in PRESETS:
        cfg = with_layers(PRESETS[name], layers)
        params = init_params(cfg, jax.random.PRNGKey(seed), dtype or jnp.float32)
        return weight_formats.convert_params(params, weights)
    import kivi_jax

    return truncate_layers(kivi_jax.load(name, dtype, progress=False, weights=weights).params, layers)


def abstract_params(cfg: ModelConfig, dtype, weights: str = "auto") -> Params:
    """Params as ShapeDtypeStructs (nothing allocated), for lowering and byte counts: float in `dtype`, or the
    quantized format `weights` names."""
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), dtype))
    return weight_formats.abstract_params(params, weights)


def device_name() -> str:
    """The device the benchmarks run on, in words (CPU model and cores on a CPU)."""
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        return f"{dev.platform}: {dev.device_kind}"
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return f"cpu: {model}, {os.cpu_count()} cores, jaxlib {jax.__version__}"


def split_impl(spec, impl: str = "auto"):
    """A decode benchmark's cache entry may name its own attention impl: 'kivi2@native', 'full@xla' -> (spec, impl);
    without '@' the run's `impl`."""
    if isinstance(spec, str) and "@" in spec:
        from kivi_jax.cache import check_impl

        spec, own = spec.split("@", 1)
        return spec, check_impl(own.strip().lower())
    return spec, impl


def spec_label(spec) -> str:
    """How results name a cache spec: as given ('kivi2', 'k4v2-g64-r128', 'kivi2@native'), or a KIVIConfig's
    canonical spec."""
    return spec.strip().lower() if isinstance(spec, str) else spec_name(spec)


def spec_fields(spec) -> dict:
    """The names a result row gives its cache: `cache` as given, `spec` canonical."""
    return {"cache": spec_label(spec), "spec": spec_name(parse_cache_spec(split_impl(spec)[0]))}


def cache_tokens(context: int, extra: int, specs) -> int:
    """Capacity for a cache holding `context + extra` tokens: the runtime's allocation unit for every spec."""
    return runtime.rounded_tokens(context + extra, *specs)


def with_ratio_vs_full(group: list[dict], key: str) -> list[dict]:
    """The rows of one measured group with `ratio_vs_full`: each row's `key` over the first full-precision row's
    (None without one); with several full rows (e.g. 'full@xla,full@native'), `ratio_vs` over each of them too."""
    fulls = [r for r in group if is_reference(r.get("spec", r["cache"]))]
    base = fulls[0][key] if fulls else None
    out = []
    for row in group:
        row = {**row, "ratio_vs_full": None if base is None else row[key] / base}
        if len(fulls) > 1:
            row["ratio_vs"] = {f["cache"]: row[key] / f[key] for f in fulls}
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Decode speed


def bench_decode(params: Params, contexts, batches, specs, impl: str = "auto", repeats: int = 10,
                 warmup: int = 2, log=None, mesh=None) -> list[dict]:
    """Decode-step time for every (context, batch, cache spec), each spec's ratio against `full` of the same run.

    `impl` applies to every spec (the full-precision baseline too); an entry 'spec@impl' picks its own. With `mesh`
    (a Mesh or 'data=2,model=4'), sharded over its devices."""
    cfg, dtype = params.config, params.dtype
    mesh = sharding.resolve_mesh(mesh)
    rows = []
    for context in contexts:
        max_tokens = cache_tokens(context, warmup + repeats + 2, [split_impl(s)[0] for s in specs])
        for batch in batches:
            group = []
            for entry in specs:
                spec, spec_impl = split_impl(entry, impl)
                cache = random_cache(spec, cfg, batch, max_tokens, context, dtype, spec_impl, mesh=mesh)
                t = time_decode(rotation.prepare_params(params, cache), cache, repeats, warmup, mesh)
                del cache
                row = {**spec_fields(entry), "attention_impl": spec_impl, "context": context, "batch": batch, **t}
                group.append(row)
                if log:
                    log(f"{row['cache']:>16s} context {context:6d} batch {batch:3d}: {t['step_ms_median']:9.2f} ms "
                        f"(min {t['step_ms_min']:.2f}, max {t['step_ms_max']:.2f}, compile {t['compile_s']:.1f} s)")
            rows.extend(with_ratio_vs_full(group, "step_ms_median"))
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Memory: bytes from the pytree leaves (eval_shape), the formula, the compiled step's temporaries, the largest batch


def formula_bytes(spec, cfg: ModelConfig, batch: int, max_tokens: int, compute_bytes: int) -> int:
    """docs/design.md §2's byte formula for a spec."""
    return cache_bytes(spec, cfg, batch, max_tokens, compute_bytes)


def abstract_cache(spec, cfg: ModelConfig, batch: int, max_tokens: int, dtype, impl: str = "auto"):
    """A cache of ShapeDtypeStructs: its shapes and bytes without allocating it."""
    return jax.eval_shape(lambda: make_cache(spec, cfg, batch, max_tokens, dtype, impl))


def decode_temp_bytes(cfg: ModelConfig, spec, batch: int, max_tokens: int, dtype, impl: str = "auto",
                      params=None) -> int:
    """Peak temporary bytes of the compiled decode step (the cache donated), lowered from abstract values (`params`:
    abstract params to use, default float ones in `dtype`; prepared for `spec`, as every entry point prepares them)."""
    params = abstract_params(cfg, dtype) if params is None else params
    params = jax.eval_shape(lambda p: rotation.prepare_params(p, parse_cache_spec(spec)), params)
    cache = abstract_cache(spec, cfg, batch, max_tokens, dtype, impl)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    compiled = decode_step_fn().lower(params, tokens, cache).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def max_batch(budget: int, weights: int, per_seq: float, fixed: float = 0.0) -> int:
    """The largest batch with weights + fixed + batch * per_seq within the budget (0 when not even one fits)."""
    free = budget - weights - fixed
    return max(int(free // per_seq), 0) if per_seq > 0 else 0


def per_device_memory(cfg: ModelConfig, spec, context: int, dtype, budget: int, mesh, impl: str = "auto",
                      params=None) -> dict:
    """On a mesh of that shape (a string or sizes; no devices needed): bytes one device holds of the weights and of
    one sequence's cache (`context` tokens), the largest global batch (a multiple of the data axis) whose weights and
    caches fit `budget` per device, and the longest context for one sequence per data shard within it."""
    sizes = sharding.mesh_sizes(mesh)
    data = sizes["data"]
    weights_tree = abstract_params(cfg, dtype) if params is None else params
    weights = sharding.per_device_bytes(weights_tree, sharding.param_specs(weights_tree, sizes), sizes)
    multiple = cache_tokens(1, 0, [spec])  # the allocation unit of a cache's tokens

    def per_device(tokens: int) -> int:  # one sequence on each data shard
        cache = abstract_cache(spec, cfg, data, tokens, dtype, impl)
        return sharding.per_device_bytes(cache, sharding.cache_specs(cache, sizes), sizes)

    per_seq = per_device(context)
    base, slope = per_device(multiple), (per_device(2 * multiple) - per_device(multiple)) / multiple
    free = budget - weights
    longest = 0 if free < base else multiple + int((free - base) // slope) // multiple * multiple
    if longest and per_device(longest) > free:  # the linear model overshot (it should not): step back
        longest -= multiple
    return {
        "mesh": ",".join(f"{k}={v}" for k, v in sizes.items()),
        "heads_split": sharding.heads_sharded(cfg.num_kv_heads, sizes, warn=False),
        "weights_bytes_per_device": weights,
        "cache_bytes_per_device_per_seq": per_seq,
        "max_batch": data * max_batch(budget, weights, per_seq),
        "max_context_one_seq_per_data_shard": longest,
    }


def bench_memory(cfg: ModelConfig, context: int, specs, dtype, budget: int, impl: str = "auto",
                 temps: bool = True, mesh=None, params=None) -> dict:
    """Per spec at `context` tokens a sequence: cache bytes from the pytree leaves (batch 1) and from the formula,
    the ratio against the full cache, the largest batch with weights + batch * cache <= `budget`, and (`temps`) the
    compiled decode step's temporary bytes at batch 1 and per extra sequence (from batch 9), with the largest batch
    when those temporaries count too. With `mesh` (a shape such as 'data=1,model=8'; no devices needed), each row
    also has `per_device`: see `per_device_memory` (the budget is then per device). `params`: the (abstract)
    params whose bytes count as the weights (default float ones in `dtype`)."""
    compute_bytes = jnp.dtype(dtype).itemsize
    params = abstract_params(cfg, dtype) if params is None else params
    weights = tree_bytes(params)
    full = tree_bytes(abstract_cache(REFERENCE, cfg, 1, context, dtype, impl))
    results = {}
    for spec in specs:
        cache = tree_bytes(abstract_cache(spec, cfg, 1, context, dtype, impl))
        row = {
            "spec": spec_name(parse_cache_spec(spec)),
            "cache_bytes": cache,
            "formula_bytes": formula_bytes(spec, cfg, 1, context, compute_bytes),
            "bytes_per_token": cache / context,
            "ratio_vs_full": cache / full,
            "max_batch": max_batch(budget, weights, cache),
        }
        if temps:
            t1 = decode_temp_bytes(cfg, spec, 1, context, dtype, impl, params)
            per_seq = max(decode_temp_bytes(cfg, spec, 9, context, dtype, impl, params) - t1, 0) // 8
            row.update({
                "decode_temp_bytes": t1,
                "decode_temp_ratio_vs_full_cache": t1 / full,
                "decode_temp_per_seq_bytes": per_seq,
                "max_batch_with_temps": max_batch(budget, weights, cache + per_seq, t1 - per_seq),
            })
        if mesh is not None:
            row["per_device"] = per_device_memory(cfg, spec, context, dtype, budget, mesh, impl, params)
        results[spec_label(spec)] = row
    return {"context": context, "weights": weight_formats.summary(params), "weights_bytes": weights,
            "full_cache_bytes": full, "results": results}


# ---------------------------------------------------------------------------------------------------------------------
# End-to-end generation throughput: prefill + N greedy tokens in one compiled program (no Python per token)


@functools.partial(jax.jit, static_argnames=("new_tokens",), donate_argnames=("cache",))
def generate_greedy(params: Params, tokens: jax.Array, lengths: jax.Array, cache, new_tokens: int):
    """Prompt `tokens [batch, padded]` with `lengths [batch]` real tokens -> greedy new tokens `[batch, new_tokens]`
    and the cache; prefill and the decode loop are one compiled program (a `fori_loop` over decode steps)."""
    logits, cache = runtime.prefill_logits(params, tokens, cache, lengths)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch]
    out = jnp.zeros((tokens.shape[0], new_tokens), jnp.int32).at[:, 0].set(first)

    def body(i, carry):
        out, last, cache = carry
        logits, cache = runtime.decode_logits(params, last, cache)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return out.at[:, i].set(nxt), nxt, cache

    out, _, cache = jax.lax.fori_loop(1, new_tokens, body, (out, first, cache))
    return out, cache


def synthetic_prompts(cfg: ModelConfig, batch: int, prompt_len: int, seed: int = 0) -> np.ndarray:
    """Random prompt token ids `[batch, prompt_len]` (speed does not depend on the tokens)."""
    rng = np.random.RandomState(seed)
    return rng.randint(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)


def time_generate(params: Params, spec, batch: int, prompt_len: int, new_tokens: int, impl: str = "auto",
                  repeats: int = 3, mesh=None) -> dict:
    """Wall time of prefill + `new_tokens` greedy tokens (compiled once, then `repeats` timed runs) and the
    KIVI paper's throughput: batch * new_tokens / seconds. With `mesh`, params, cache and prompts sharded on it (the
    batch must divide its data axis)."""
    with sharding.use_mesh(mesh):
        return _time_generate(params, spec, batch, prompt_len, new_tokens, impl, repeats, mesh)


def _time_generate(params: Params, spec, batch: int, prompt_len: int, new_tokens: int, impl: str, repeats: int,
                   mesh) -> dict:
    cfg, dtype = params.config, params.dtype
    params = rotation.prepare_params(params, parse_cache_spec(spec))
    max_tokens = cache_tokens(prompt_len, new_tokens, [spec])
    tokens = synthetic_prompts(cfg, batch, prompt_len)
    lengths = np.full((batch,), prompt_len, np.int32)
    if mesh is None:
        tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    else:
        params = sharding.shard_params(params, mesh)
        tokens, lengths = sharding.put_batch(tokens, mesh), sharding.put_batch(lengths, mesh)

    def run():
        cache = make_cache(spec, cfg, batch, max_tokens, dtype, impl, mesh=mesh)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        out, cache = generate_greedy(params, tokens, lengths, cache, new_tokens)
        out.block_until_ready()
        return time.perf_counter() - t0

    compile_s = run()
    times = [run() for _ in range(repeats)]
    med = statistics.median(times)
    return {
        "seconds_median": med,
        "seconds_min": min(times),
        "seconds_max": max(times),
        "compile_s": compile_s,
        "tokens_per_s": batch * new_tokens / med,
    }


def bench_generate(params: Params, batches, specs, prompt_len: int, new_tokens: int, impl: str = "auto",
                   repeats: int = 3, log=None, mesh=None) -> list[dict]:
    """Generation throughput for every (batch, spec), each spec's throughput ratio against `full` of the same run;
    with `mesh` (a Mesh or 'data=2,model=4'), run sharded on it."""
    mesh = sharding.resolve_mesh(mesh)
    rows = []
    for batch in batches:
        group = []
        for spec in specs:
            t = time_generate(params, spec, batch, prompt_len, new_tokens, impl, repeats, mesh)
            row = {**spec_fields(spec), "batch": batch, **t}
            group.append(row)
            if log:
                log(f"{row['cache']:>16s} batch {batch:3d}: {t['seconds_median']:8.3f} s, "
                    f"{t['tokens_per_s']:9.1f} tokens/s (compile {t['compile_s']:.1f} s)")
        rows.extend(with_ratio_vs_full(group, "tokens_per_s"))
    return rows


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'24GiB' -> 25769803776, '80GB' -> 80e9, '1e9' -> 1e9 (decimal GB, binary GiB)."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"bad byte size {text!r}: give a number with an optional unit such as 24GiB, 80GB, 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_bytes(n: float) -> str:
    """Bytes in binary units, e.g. '1.50 GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
