"""Quality through the cache: teacher-forced next-token loss, KL and top-1 agreement against full precision; the axis
ablation; the error of quantized keys and values where attention consumes them.

Protocol (docs/design.md §6): windows of P + N + 1 tokens; prefill P tokens, then feed N tokens one at a time through the
cache, scoring each decode step's prediction of the next token (N scored tokens a window). All windows run as one
batch; `full` runs first and its log-probabilities are the reference for KL and top-1 agreement.
"""

from __future__ import annotations

import functools
import platform
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import quant, rotation, runtime, sharding, weights
from kivi_jax.cache import make_cache
from kivi_jax.config import REFERENCE, is_reference, parse_cache_spec, spec_name
from kivi_jax.models.attention import causal_attention
from kivi_jax.models.decoder import NoCache, Params, forward, rope_inv_freq

# ---------------------------------------------------------------------------------------------------------------------
# Text and windows


def default_text() -> str:
    """The prose of Python's own language reference (`pydoc_data.topics`), on every machine without downloads."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def default_text_name() -> str:
    """What `default_text` is on this machine: its content changes with the Python version."""
    return f"pydoc_data.topics (Python {platform.python_version()})"


def tokenize(tokenizer, text: str) -> np.ndarray:
    """Token ids `[n]` of a text as the tokenizer's plain call gives them (no chat template)."""
    return np.asarray(tokenizer(text)["input_ids"], np.int32)


SPLITS = ("eval", "dev")


def window_starts(n_tokens: int, prefill: int, decode: int, windows: int, split: str = "eval") -> list[int]:
    """Starts of `windows` evenly spaced windows of `prefill + decode + 1` tokens: i * (n - P - N - 1) / (W - 1).

    `split="dev"`: the development split for choosing configurations, `windows` windows at (i + f) * span / W with
    f = 1/2 for an even W and 1/4 for an odd one (so that none starts where an evaluation window does), each disjoint
    from every window of the evaluation split (an error if the text is too short for that)."""
    span = n_tokens - prefill - decode - 1
    if span < 0:
        raise ValueError(
            f"the text has {n_tokens} tokens; a window needs prefill + decode + 1 = {prefill + decode + 1}"
        )
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    evals = [0] if windows == 1 else [i * span // (windows - 1) for i in range(windows)]
    if split == "eval":
        return evals
    quarters = 2 if windows % 2 == 0 else 1  # f in quarters
    devs = [(4 * i + quarters) * span // (4 * windows) for i in range(windows)]
    size = prefill + decode + 1
    if any(abs(d - e) < size for d in devs for e in evals):
        raise ValueError(f"the text has {n_tokens} tokens: too few for {windows} development windows of {size} tokens "
                         "disjoint from the evaluation windows; give a longer --text or fewer --windows")
    return devs


def make_windows(tokens, prefill: int, decode: int, windows: int, split: str = "eval") -> np.ndarray:
    """`[windows, prefill + decode + 1]` token windows from a token list (of the `split`: see `window_starts`)."""
    tokens = np.asarray(tokens, np.int32)
    size = prefill + decode + 1
    return np.stack([tokens[s : s + size] for s in window_starts(len(tokens), prefill, decode, windows, split)])


def check_protocol(prefill: int, decode: int, windows: int) -> None:
    """A clear error for a protocol that cannot run."""
    for name, value in (("prefill", prefill), ("decode", decode), ("windows", windows)):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1 (got {value})")
    if prefill < 2:
        raise ValueError(f"--prefill must be at least 2 tokens (got {prefill}): a single token is a decode step")


# ---------------------------------------------------------------------------------------------------------------------
# Teacher-forced decoding through the cache


def cache_tokens(prefill: int, decode: int, spec) -> int:
    """Cache size for a run: prefill + decode rounded up to 128 and the spec's token multiple (KIVI: R)."""
    return runtime.rounded_tokens(prefill + decode, spec, bucket=128)


def chunk_size(decode: int, most: int = 32) -> int:
    """Decode steps a compiled call runs: the largest divisor of `decode` up to `most` (all of them when that is tiny)."""
    best = max(d for d in range(1, min(decode, most) + 1) if decode % d == 0)
    return best if best >= 4 else decode


@functools.partial(jax.jit, static_argnames=("spec", "max_tokens", "impl", "mesh"))
def _prefill(params: Params, prompts: jax.Array, spec, max_tokens: int, impl: str, mesh=None):
    """A fresh cache filled with `prompts [windows, prefill]` (sharded on `mesh` when one is given)."""
    n_win, prefill = prompts.shape
    cache = make_cache(spec, params.config, n_win, max_tokens, params.dtype, impl, mesh=mesh)
    _, cache = runtime.prefill_logits(params, prompts, cache)
    return sharding.constrain_cache(cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _decode_steps(params: Params, cache, inputs: jax.Array, targets: jax.Array, ref):
    """Feeds `inputs [steps, windows]` one step at a time and scores the predictions of `targets [steps, windows]`.

    Returns the cache and per step `[steps, windows]`: NLL, KL(ref || ours), top-1 agreement with ref; and, without a
    reference (`ref` None, the full-precision run), our log-probabilities `[steps, windows, vocab]`.
    """

    def step(cache, xs):
        tok, target, ref = xs  # [windows], [windows], [windows, vocab] or None
        logits, cache = runtime.decode_logits(params, tok, cache)
        logp = jax.nn.log_softmax(logits, axis=-1)  # [windows, vocab]
        nll = -jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
        if ref is None:
            return cache, (nll, jnp.zeros_like(nll), jnp.ones_like(nll), logp)
        kl = jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1)
        top1 = (jnp.argmax(logp, -1) == jnp.argmax(ref, -1)).astype(jnp.float32)
        return cache, (nll, kl, top1, None)

    cache, outs = jax.lax.scan(step, cache, (inputs, targets, ref))
    return sharding.constrain_cache(cache), outs


def teacher_forced(
    params: Params, windows, prefill: int, spec, ref_logprobs=None, impl: str = "auto",
    progress: Callable[[int], None] | None = None, mesh=None, prefill_precision: str = "float32",
    decode_precision: str = "float32",
) -> dict:
    """Runs one cache spec over `windows [windows, prefill + decode + 1]`.

    Returns per scored token `[windows, decode]` arrays `nll`, `kl`, `top1` (against `ref_logprobs`, the `logprobs`
    of an earlier run: step-major `[decode, windows, vocab]`), this run's `logprobs` when it had no reference, and
    timings: `compile_seconds`, `prefill_seconds`, `decode_seconds` (compilation excluded from both).
    `progress(steps)` is called as decode steps complete. `mesh` (a Mesh or 'data=2,model=4'): params and caches
    sharded, the windows split over the data axis. `prefill_precision`, `decode_precision`: the operands of the
    prefill's and of the scored decode steps' matmuls (`weights.dot_view`).
    """
    spec = parse_cache_spec(spec)
    params = rotation.prepare_params(params, spec)
    mesh = sharding.resolve_mesh(mesh)
    windows = np.asarray(windows, np.int32)
    n_win, size = windows.shape
    decode = size - prefill - 1
    check_protocol(prefill, decode, n_win)
    max_tokens = cache_tokens(prefill, decode, spec)
    inputs = windows[:, prefill : prefill + decode].T  # [decode, windows]
    targets = windows[:, prefill + 1 :].T
    chunk = chunk_size(decode)

    if mesh is None:
        put = jnp.asarray
    else:
        params = sharding.shard_params(params, mesh)
        put = functools.partial(sharding.put_batch, mesh=mesh, axis=1)  # [steps, windows(, vocab)]

    def ref_at(i):
        return None if ref_logprobs is None else put(ref_logprobs[i : i + chunk])

    t0 = time.perf_counter()
    prompts = windows[:, :prefill]
    prompts = jnp.asarray(prompts) if mesh is None else sharding.put_batch(prompts, mesh)
    with sharding.use_mesh(mesh):
        prefill_params = weights.dot_view(params, prefill_precision)
        decode_params = weights.dot_view(params, decode_precision, "decode")
        run_prefill = _prefill.lower(prefill_params, prompts, spec, max_tokens, impl, mesh).compile()
        cache_shape = jax.eval_shape(lambda p, w: _prefill(p, w, spec, max_tokens, impl, mesh), params, prompts)
        if mesh is not None:
            cache_shape = sharding.abstract_cache(cache_shape, mesh)
        run_steps = _decode_steps.lower(decode_params, cache_shape, put(inputs[:chunk]), put(targets[:chunk]),
                                        ref_at(0)).compile()
    t1 = time.perf_counter()
    cache = jax.block_until_ready(run_prefill(prefill_params, prompts))
    t2 = time.perf_counter()
    _, out = score_steps(decode_params, cache, inputs, targets, ref_logprobs, progress, run_steps, put)
    t3 = time.perf_counter()
    return {**out, "compile_seconds": t1 - t0, "prefill_seconds": t2 - t1, "decode_seconds": t3 - t2}


def score_steps(params: Params, cache, inputs, targets, ref_logprobs=None,
                progress: Callable[[int], None] | None = None, run_steps=_decode_steps, put=jnp.asarray):
    """Feeds `inputs [steps, windows]` one token a step through `cache` (donated), scoring each step's prediction of
    `targets [steps, windows]`, in compiled chunks of `chunk_size(steps)` steps.

    Returns the cache and `nll`, `kl`, `top1` `[windows, steps]` (against `ref_logprobs [steps, windows, vocab]`, an
    earlier run's `logprobs`) and, without a reference, this run's `logprobs`. `run_steps`: `_decode_steps` or its
    compiled form; `put` places a step-major array (on a mesh: split over the data axis)."""
    steps = len(inputs)
    chunk = chunk_size(steps)
    outs = []
    for i in range(0, steps, chunk):
        ref = None if ref_logprobs is None else put(ref_logprobs[i : i + chunk])
        cache, out = run_steps(params, cache, put(inputs[i : i + chunk]), put(targets[i : i + chunk]), ref)
        jax.block_until_ready(out[0])
        outs.append(out)
        if progress is not None:
            progress(chunk)
    nll, kl, top1 = (np.concatenate([sharding.to_host(o[j]) for o in outs]).T for j in range(3))  # [windows, steps]
    logp = None if ref_logprobs is not None else jnp.concatenate([o[3] for o in outs])
    return cache, {"nll": nll, "kl": kl, "top1": top1, "logprobs": logp}


def evaluate(
    params: Params, windows, prefill: int, specs, impl: str = "auto",
    progress: Callable[[str, int], None] | None = None, mesh=None, prefill_precision: str = "float32",
    decode_precision: str = "float32",
) -> dict:
    """Mean NLL, perplexity, KL vs full, top-1 agreement and decode throughput for each spec (`full` always included,
    first). `progress(spec_name, steps)` is called as decode steps complete; `mesh` as for `teacher_forced`.
    `prefill_precision` and `decode_precision` apply to every spec but the reference `full`, which stays exact."""
    names = list(dict.fromkeys(spec_name(parse_cache_spec(s)) for s in specs))
    names = [REFERENCE] + [n for n in names if not is_reference(n)]
    results, ref = {}, None
    for name in names:
        tick = None if progress is None else functools.partial(progress, name)
        exact = is_reference(name)
        out = teacher_forced(params, windows, prefill, name, ref, impl, tick, mesh,
                             "float32" if exact else prefill_precision, "float32" if exact else decode_precision)
        if exact:
            ref = out["logprobs"]
        tokens = out["nll"].size
        results[name] = {
            "nll": float(out["nll"].mean()),
            "ppl": float(np.exp(out["nll"].mean())),
            "kl_vs_full": float(out["kl"].mean()),
            "top1_agree": float(out["top1"].mean()),
            "tokens": int(tokens),
            "decode_tokens_per_s": tokens / out["decode_seconds"],
            "nll_per_window": out["nll"].mean(axis=1).tolist(),
        }
    return results


# ---------------------------------------------------------------------------------------------------------------------
# The ablation: axes, group size, residual length, mixed bits

ABLATION = (
    # (study, spec): every study holds KIVI's 2-bit configuration (k2v2-g32-r128) as its reference row
    ("reference", "full"),
    ("reference", "kivi4"),
    ("axes", "k2v2-g32-r128"),
    ("axes", "k2v2-g32-r128-ktok-vchan"),
    ("axes", "k2v2-g32-r128-vchan"),
    ("axes", "k2v2-g32-r128-ktok"),
    ("group size", "k2v2-g32-r128"),
    ("group size", "k2v2-g64-r128"),
    ("group size", "k2v2-g128-r128"),
    ("residual", "k2v2-g32-r32"),
    ("residual", "k2v2-g32-r64"),
    ("residual", "k2v2-g32-r128"),
    ("residual", "k2v2-g32-r256"),
    ("bits", "k2v2-g32-r128"),
    ("bits", "k4v2-g32-r128"),
    ("bits", "k2v4-g32-r128"),
    # beyond KIVI (docs/quality.md): each mechanism alone on kivi2, then added one at a time up to the presets
    ("beyond: alone", "k2v2-g32-r128"),
    ("beyond: alone", "k2v2-g32-r128-prerope"),
    ("beyond: alone", "k2v2-g32-r128-s4"),
    ("beyond: alone", "k2v2-g32-r128-rotv"),
    ("beyond: alone", "k2v2-g32-r128-rotk"),
    ("beyond: alone", "k3v2-g32-r128"),
    ("beyond: alone", "k2v3-g32-r128"),
    ("beyond: combined", "k3v2-g64-r128"),
    ("beyond: combined", "k3v2-g64-r128-prerope"),
    ("beyond: combined", "k3v2-g64-r128-prerope-s4"),
    ("beyond: combined", "k3v2-g64-r128-prerope-s4-rotv"),
    ("presets", "kivi2+"),
    ("presets", "kivi3+"),
    # the 8-bit baselines of vLLM / MaxText (kivi_jax/cache8.py): every token stored in 8 bits, no residual
    ("8-bit", "int8"),
    ("8-bit", "fp8-e4m3"),
    ("8-bit", "fp8-e5m2"),
    ("8-bit", "fp8-e4m3-tok"),
)


def ablation_specs() -> list[str]:
    """The distinct canonical specs of the ablation, in order (`full` first)."""
    return list(dict.fromkeys(spec_name(parse_cache_spec(s)) for _, s in ABLATION))


def describe(spec: str, head_dim: int | None = None, tokens: int | None = None, num_layers: int | None = None) -> dict:
    """Bits, axes, group size, residual length and the beyond-KIVI options of a spec, for tables; with `head_dim`
    also the bits a cached value costs (codes, scales and mins, sinks spread over `tokens`, per-layer bits averaged
    over `num_layers`)."""
    cfg = parse_cache_spec(spec)
    row = cfg.describe()
    if head_dim is not None or is_reference(cfg):
        row["bits"] = cfg.value_bits(head_dim, tokens, num_layers)
    return row


def ablation_rows(results: dict, head_dim: int | None = None, tokens: int | None = None,
                  num_layers: int | None = None) -> list[dict]:
    """One row per (study, spec) of ABLATION present in `results`, then any other spec of `results` (study "other");
    with ΔNLL against full (mean and its range over the windows) and, given the model's `head_dim`, bits a value."""
    full = results[REFERENCE]
    pairs = [(study, spec_name(parse_cache_spec(spec))) for study, spec in ABLATION]
    pairs += [("other", name) for name in results if name not in {n for _, n in pairs}]
    rows = []
    for study, name in pairs:
        if name not in results:
            continue
        r = results[name]
        deltas = [a - b for a, b in zip(r["nll_per_window"], full["nll_per_window"])]
        rows.append({"study": study, "spec": name, **describe(name, head_dim, tokens, num_layers), "nll": r["nll"],
                     "delta_nll": r["nll"] - full["nll"], "delta_min": min(deltas), "delta_max": max(deltas),
                     "kl_vs_full": r["kl_vs_full"], "top1_agree": r["top1_agree"]})
    return rows


def ablation_markdown(rows: list[dict]) -> str:
    """The ablation as a markdown table."""
    lines = ["| study | spec | keys | values | G | R | options | bits | NLL | ΔNLL | ΔNLL by window | KL(full‖q) | "
             "top-1 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bits = f"{r['bits']:.2f}" if "bits" in r else ""
        lines.append(
            f"| {r['study']} | `{r['spec']}` | {r['keys']} | {r['values']} | {r['G']} | {r['R']} | {r['options']} | "
            f"{bits} | {r['nll']:.4f} | {r['delta_nll']:+.4f} | {r['delta_min']:+.3f} … {r['delta_max']:+.3f} | "
            f"{r['kl_vs_full']:.4f} | {r['top1_agree']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def peer_rows(report: dict) -> list[dict]:
    """Rows for a peer's run (scripts/compare_hf_quantized_cache.py --json: transformers' quanto cache) on the same
    windows: ΔNLL against the peer's own full precision, and bits a value (codes plus a float32 scale and zero point
    a group, quanto's storage for a float32 model)."""
    results = report["results"]
    full = results[REFERENCE]
    rows = []
    for name, r in results.items():
        cache = r.get("cache")
        if not isinstance(cache, dict):
            continue
        group = cache.get("q_group_size", 64)
        rows.append({"study": "peer", "spec": name, "bits": cache["nbits"] + 2 * 32 / group,
                     "delta_nll": r["nll"] - full["nll"], "kl_vs_full": r["kl_vs_full"],
                     "top1_agree": r["top1_agree"]})
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Error at consumption: quantized keys and values where attention uses them (the KIVI paper's analysis)


class _Recorder(NoCache):
    """A stand-in cache for one prefill: full-precision causal attention, recording every layer's q, k, v."""

    recorded = None

    def attend(self, layer, q, k, v, positions, rope, num_new, window, softcap=None):
        k_rot = rope(k, positions)
        return causal_attention(q, k_rot, v, num_new, window, softcap), {"q": q, "k": k_rot, "v": v, "k_pre": k}

    def commit(self, updates, num_new):
        self.recorded = updates
        return self


@jax.jit
def capture_qkv(params: Params, tokens: jax.Array) -> dict:
    """Real activations of a full-precision forward over `tokens [batch, tokens]`: per layer the RoPE'd queries
    `q [layers, batch, tokens, q_heads, head_dim]` and keys `k`, and values `v` `[layers, batch, tokens, kv_heads,
    head_dim]`, as attention consumes them, and the keys before RoPE `k_pre`."""
    recorder = _Recorder(*tokens.shape)
    forward(params, tokens, recorder, logits_at=jnp.zeros((tokens.shape[0],), jnp.int32))
    return recorder.recorded


def fake_quant(x: jax.Array, axis: str, bits: int, group_size: int, scale_dtype=jnp.float16) -> jax.Array:
    """`x [..., tokens, head_dim]` quantized and restored: per-channel (groups of G tokens) or per-token (groups of
    min(G, head_dim) channels), exactly as the cache quantizes."""
    if axis == "channel":
        codes, scale, mn = quant.quantize(x, bits, group_size, axis=-2, scale_dtype=scale_dtype)
        return quant.dequantize(codes, scale, mn, group_size, axis=-2)
    g = min(group_size, x.shape[-1])
    codes, scale, mn = quant.quantize(x, bits, g, axis=-1, scale_dtype=scale_dtype)
    return quant.dequantize(codes, scale, mn, g, axis=-1)


def _rel(err: jax.Array, ref: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(err * err) / jnp.sum(ref * ref))


SINKS = 4  # sink tokens of the error diagnostics' beyond-KIVI columns


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _layer_errors(q, k, v, k_pre, inv_freq, bits: int, group_size: int) -> dict:
    """One layer: q `[batch, tokens, q_heads, D]`, k/v `[batch, tokens, kv_heads, D]` (k after RoPE, k_pre before)
    -> relative errors (scalars)."""
    from kivi_jax import attention, rotation

    batch, tokens, q_heads, d = q.shape
    kv_heads = k.shape[2]
    k = jnp.swapaxes(k, 1, 2).astype(jnp.float32)  # [batch, kv_heads, tokens, D]
    v = jnp.swapaxes(v, 1, 2).astype(jnp.float32)
    k_pre = jnp.swapaxes(k_pre, 1, 2).astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(batch, tokens, kv_heads, q_heads // kv_heads, d) * d**-0.5
    causal = jnp.tril(jnp.ones((tokens, tokens), bool))  # [query, key]

    def scores(keys):  # [batch, kv_heads, n_rep, query, key], zero above the diagonal
        s = jnp.einsum("bqhrd,bhkd->bhrqk", qg, keys, precision="highest")
        return jnp.where(causal, s, 0.0)

    def output(s, values):  # attention output [batch, kv_heads, n_rep, query, D]
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        return jnp.einsum("bhrqk,bhkd->bhrqd", p, values, precision="highest")

    s_ref = scores(k)
    o_ref = output(s_ref, v)
    out = {}
    for axis in ("channel", "token"):
        kq = fake_quant(k, axis, bits, group_size)
        s = scores(kq)
        out[f"k_{axis}_tensor"] = _rel(kq - k, k)
        out[f"k_{axis}_scores"] = _rel(s - s_ref, s_ref)
        out[f"k_{axis}_output"] = _rel(output(s, v) - o_ref, o_ref)
        vq = fake_quant(v, axis, bits, group_size)
        out[f"v_{axis}_tensor"] = _rel(vq - v, v)
        out[f"v_{axis}_output"] = _rel(output(s_ref, vq) - o_ref, o_ref)
    # beyond KIVI, on KIVI's axes (keys per-channel, values per-token): one option at a time
    pos = jnp.arange(tokens)[None, :]
    kq = attention.rotated(fake_quant(k_pre, "channel", bits, group_size), pos, inv_freq)  # quantized before RoPE
    s = scores(kq)
    out["k_prerope_scores"], out["k_prerope_output"] = _rel(s - s_ref, s_ref), _rel(output(s, v) - o_ref, o_ref)
    h = jnp.asarray(rotation.basis(d), jnp.float32)
    kq = fake_quant(k @ h, "channel", bits, group_size) @ h.T  # keys in the basis H (rotate q and k)
    out["k_rotated_output"] = _rel(output(scores(kq), v) - o_ref, o_ref)
    vq = fake_quant(v @ h, "token", bits, group_size) @ h.T  # values in the basis H (folded into wv, wo)
    out["v_rotated_output"] = _rel(output(s_ref, vq) - o_ref, o_ref)
    first = (jnp.arange(tokens) < SINKS)[None, None, :, None]  # sinks exact, standing in as token S in their group
    stand_in = jnp.where(first, k[:, :, SINKS : SINKS + 1], k)
    kq = jnp.where(first, k, fake_quant(stand_in, "channel", bits, group_size))
    vq = jnp.where(first, v, fake_quant(v, "token", bits, group_size))
    s = scores(kq)
    out["sinks_output"] = _rel(output(s, vq) - o_ref, o_ref)
    s = scores(fake_quant(k, "channel", bits, group_size))
    out["both_output"] = _rel(output(s, fake_quant(v, "token", bits, group_size)) - o_ref, o_ref)
    return out


def consumption_errors(params: Params, windows, bits: int = 2, group_size: int = 32) -> dict[str, np.ndarray]:
    """Per layer `[layers]`, over `windows [batch, tokens]` of real text, the relative (Frobenius) error that
    quantizing the whole sequence's keys or values on each axis causes in: the tensor itself (`*_tensor`), the
    attention scores q·k (`k_*_scores`), and the attention output softmax(q·k)·v (`*_output`; keys or values alone
    quantized). No residual: every token is quantized. Beyond KIVI, on KIVI's axes: keys quantized before RoPE
    (`k_prerope_*`), keys or values in the rotated basis (`k_rotated_output`, `v_rotated_output`), keys and values
    with the first SINKS tokens exact (`sinks_output`) against both quantized plainly (`both_output`)."""
    windows = jnp.asarray(windows, jnp.int32)
    if windows.shape[1] % group_size:
        raise ValueError(f"the windows' {windows.shape[1]} tokens must be a multiple of group_size={group_size}")
    acts = capture_qkv(params, windows)
    inv_freq = rope_inv_freq(params.config)
    per_layer = [_layer_errors(acts["q"][i], acts["k"][i], acts["v"][i], acts["k_pre"][i], inv_freq, bits, group_size)
                 for i in range(params.config.num_layers)]
    return {name: np.array([float(e[name]) for e in per_layer]) for name in per_layer[0]}


ERROR_COLUMNS = (
    # (column, key): keys quantized on each axis, then values
    ("K-chan tensor", "k_channel_tensor"), ("K-tok tensor", "k_token_tensor"),
    ("K-chan q·k", "k_channel_scores"), ("K-tok q·k", "k_token_scores"),
    ("K-chan out", "k_channel_output"), ("K-tok out", "k_token_output"),
    ("V-tok tensor", "v_token_tensor"), ("V-chan tensor", "v_channel_tensor"),
    ("V-tok out", "v_token_output"), ("V-chan out", "v_channel_output"),
)


BEYOND_COLUMNS = (
    # (column, key): one beyond-KIVI option at a time against KIVI's own (keys per-channel, values per-token)
    ("K q·k", "k_channel_scores"), ("K pre-RoPE q·k", "k_prerope_scores"),
    ("K out", "k_channel_output"), ("K pre-RoPE out", "k_prerope_output"), ("K rotated out", "k_rotated_output"),
    ("V out", "v_token_output"), ("V rotated out", "v_rotated_output"),
    ("K+V out", "both_output"), ("K+V sinks out", "sinks_output"),
)


def errors_summary(errors: dict[str, np.ndarray]) -> dict:
    """Means over layers and, per tensor, in how many layers each axis wins on reconstruction and on consumption."""
    n = len(errors["k_channel_tensor"])
    mean = {key: float(errors[key].mean()) for _, key in ERROR_COLUMNS}

    def wins(a, b):
        return int(np.sum(errors[a] < errors[b]))

    summary = {
        "layers": n,
        "mean": mean,
        "beyond_mean": {key: float(errors[key].mean()) for _, key in BEYOND_COLUMNS},
        "keys_channel_better_tensor": wins("k_channel_tensor", "k_token_tensor"),
        "keys_channel_better_output": wins("k_channel_output", "k_token_output"),
        "values_token_better_tensor": wins("v_token_tensor", "v_channel_tensor"),
        "values_token_better_output": wins("v_token_output", "v_channel_output"),
    }
    # layers where the axis with the smaller tensor error gives the larger attention-output error
    summary["values_disagree_layers"] = int(np.sum(
        (errors["v_token_tensor"] < errors["v_channel_tensor"]) != (errors["v_token_output"] < errors["v_channel_output"])
    ))
    summary["keys_disagree_layers"] = int(np.sum(
        (errors["k_channel_tensor"] < errors["k_token_tensor"]) != (errors["k_channel_output"] < errors["k_token_output"])
    ))
    return summary


def errors_summary_line(s: dict) -> str:
    """One line that says what the per-layer table shows."""
    m, n = s["mean"], s["layers"]
    return (
        f"keys: per-channel tensor error {m['k_channel_tensor']:.3f} vs per-token {m['k_token_tensor']:.3f} "
        f"(per-channel smaller in {s['keys_channel_better_tensor']}/{n} layers), attention output "
        f"{m['k_channel_output']:.3f} vs {m['k_token_output']:.3f} ({s['keys_channel_better_output']}/{n}); "
        f"values: per-token tensor error {m['v_token_tensor']:.3f} vs per-channel {m['v_channel_tensor']:.3f} "
        f"(per-token smaller in {s['values_token_better_tensor']}/{n} layers), attention output "
        f"{m['v_token_output']:.3f} vs {m['v_channel_output']:.3f} ({s['values_token_better_output']}/{n}); "
        f"for values the axis with the smaller reconstruction error has the larger output error in "
        f"{s['values_disagree_layers']}/{n} layers (keys: {s['keys_disagree_layers']}/{n})"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Formatting


def format_results(results: dict) -> str:
    """A readable table of `evaluate`'s results, with ΔNLL against full."""
    full = results[REFERENCE]["nll"]
    width = max(len(k) for k in results) + 2
    lines = [f"{'cache':<{width}}{'NLL':>8}{'ΔNLL':>9}{'ppl':>9}{'KL(full‖q)':>12}{'top-1':>8}{'tok/s':>9}"]
    for name, r in results.items():
        lines.append(
            f"{name:<{width}}{r['nll']:>8.4f}{r['nll'] - full:>+9.4f}{r['ppl']:>9.3f}{r['kl_vs_full']:>12.5f}"
            f"{r['top1_agree']:>8.3f}{r['decode_tokens_per_s']:>9.1f}"
        )
    return "\n".join(lines)


def format_errors(errors: dict[str, np.ndarray], columns=ERROR_COLUMNS) -> str:
    """The per-layer error table (`columns`: ERROR_COLUMNS, or BEYOND_COLUMNS), plus a mean row."""
    width = max(13, max(len(c) for c, _ in columns))
    head = f"{'layer':>5} " + " ".join(f"{c:>{width}}" for c, _ in columns)
    rows = [head]
    for i in range(len(errors["k_channel_tensor"])):
        rows.append(f"{i:>5} " + " ".join(f"{errors[k][i]:>{width}.4f}" for _, k in columns))
    rows.append(f"{'mean':>5} " + " ".join(f"{errors[k].mean():>{width}.4f}" for _, k in columns))
    return "\n".join(rows)
