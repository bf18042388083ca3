"""Building a server from a model and a capacity: the engine, the scheduler and the app, with the capacity line."""

from __future__ import annotations

import dataclasses

from kivi_jax import sharding
from kivi_jax.config import is_reference, parse_cache_spec, spec_name
from kivi_jax.serve.engine import DEFAULT_PREFILL_BATCH, DEFAULT_PREFILL_CHUNK, Engine, capacity_report, paged_capacity
from kivi_jax.serve.scheduler import (DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_TIMEOUT, STEP_PREFILL_TOKENS,  # noqa: F401
                                      Scheduler)

DEFAULT_MAX_LENGTH = 4096
DEFAULT_SLOTS = 8


SERVE_EXTRA = 'pip install "kivi-jax[serve]" (from a checkout: pip install ".[serve]")'


def check_serve_extra(modules=("fastapi", "uvicorn")) -> None:
    """RuntimeError naming the extra to install unless `modules` (of the serve extra) import."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise RuntimeError(f"this needs the serve extra (FastAPI, uvicorn, httpx), and {name} is missing ({e}); "
                               f"install it: {SERVE_EXTRA}") from None


def default_max_length(spec, cfg) -> int:
    """4096 tokens or the model's positions if fewer, rounded down to whole residual blocks for a KIVI cache."""
    n = min(DEFAULT_MAX_LENGTH, cfg.max_position_embeddings)
    spec = parse_cache_spec(spec)
    return n - n % spec.token_multiple


def precisions(engine) -> str:
    """The start line's note of a prefill or decode precision other than float32 ('' when both are)."""
    return "".join(f"; {stage} precision {p}" for stage, p in
                   (("prefill", engine.prefill_precision), ("decode", engine.decode_precision)) if p != "float32")


@dataclasses.dataclass
class Server:
    engine: Engine
    scheduler: Scheduler
    app: object
    model_name: str
    capacity: dict

    def describe(self) -> str:
        """The line printed at start: slots, bytes a slot, and what the full-precision cache would fit (and what the
        warm-up compiled)."""
        warm = self.capacity.get("warmup")
        tail = "" if warm is None else (f"; warmed up: {warm['programs']} programs run (compiled) in "
                                        f"{warm['seconds']} s before serving")
        return self._describe() + tail

    def _describe(self) -> str:
        from kivi_jax.bench import format_bytes

        e, c = self.engine, self.capacity
        if e.paged:
            return (f"cache {e.spec_name}, paged: {e.num_slots} rows of up to {e.max_length} tokens "
                    f"({format_bytes(c['row_bytes'])} a row), a pool of {c['pages']} pages of {c['page_tokens']} "
                    f"tokens ({format_bytes(c['page_bytes'])} a page), {format_bytes(e.cache_bytes)} in all; "
                    f"prompts prefilled in chunks of {e.prefill_chunk} tokens, up to "
                    f"{self.scheduler.step_prefill_tokens} tokens between two decode steps; "
                    + ("pages taken as sequences grow, the newest request preempted when the pool runs out" if e.grow
                       else "pages reserved for prompt and max_tokens at admission")
                    + (f"; up to {e.prefix_snapshots} prefix snapshots shared" if e.prefix_snapshots else "")
                    + precisions(e))
        line = (f"cache {e.spec_name}: {e.num_slots} slots of {e.max_length} tokens, "
                f"{format_bytes(e.slot_bytes)} a slot, {format_bytes(e.cache_bytes)} in all")
        full = c["full"]
        if not is_reference(e.spec) and "budget_bytes" in c:
            line += (f"; the budget of {format_bytes(c['budget_bytes'])} would fit {full['slots']} slots of the "
                     f"full-precision cache ({format_bytes(full['slot_bytes'])} a slot)")
        elif not is_reference(e.spec):
            line += (f"; the full-precision cache would take {format_bytes(full['slot_bytes'])} a slot, "
                     f"{format_bytes(full['slot_bytes'] * e.num_slots)} in all")
        line += f"; prompts prefilled in chunks of {e.prefill_chunk} tokens"
        if e.prefill_batch > 1:
            line += f", up to {e.prefill_batch} a call within {e.prefill_tokens} tokens"
            if e.pack_width:
                line += f" (those of at most {e.pack_width} tokens packed)"
        line += f", up to {self.scheduler.step_prefill_tokens} tokens between two decode steps"
        line += precisions(e)
        if len(e.groups) > 1:
            line += f"; decoded in {len(e.groups)} groups of up to {e.groups[0][1]} slots"
        line += f"; prefix reuse {'on' if e.prefix_reuse else 'off'}"
        return line


def build_server(model, cache="kivi2", *, slots: int | None = None, cache_budget: int | None = None,
                 max_length: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_queue: int = 64,
                 attention_impl: str = "auto", prefix_reuse: bool = True, model_name: str = "kivi-jax",
                 decode_group: int | None = None, mesh=None, max_body_bytes: int | None = None,
                 shutdown_timeout: float | None = None, prefill_batch: int = DEFAULT_PREFILL_BATCH,
                 prefill_tokens: int | None = None, paged: bool = False, grow: bool = True,
                 prefix_snapshots: int = 0, warmup: bool = False, prefill_precision: str = "float32",
                 decode_precision: str = "float32", step_prefill_tokens: int = STEP_PREFILL_TOKENS,
                 packed_prefill: bool = True, weight_strips: bool = True) -> Server:
    """The engine, its scheduler and the FastAPI app for `model` (a `kivi_jax.load` Model). Capacity: `slots`, or
    the most slots of `max_length` tokens whose cache fits `cache_budget` bytes (with `mesh`: bytes per device, the
    slots a multiple of its data axis). `max_body_bytes` (the largest request body) and `shutdown_timeout` (seconds
    running requests get at shutdown): see kivi_jax.serve.http; None: the defaults above. `prefill_batch` prompts
    at most are prefilled in one call, `prefill_tokens` tokens at most (rows x chunk width; None: 512 on a CPU,
    2048 elsewhere, `engine.default_prefill_tokens`). `paged`: a paged cache (docs/design.md §12): `cache_budget`
    sizes its rows and pool together (`engine.paged_capacity`), `slots` its rows; `grow`: a request's pages are
    taken as it grows, the newest preempted when the pool runs out (else all at admission); `prefix_snapshots`:
    prompt prefixes kept for sharing (paged). `warmup`: the engine compiles its prefill shapes and decode buckets
    before the server is returned (`Engine.warm_up`; its result in `capacity["warmup"]`). `prefill_precision`:
    the operands of a prompt's prefill matmuls (`weights.dot_view`; 'int8', or 'auto': int8 activations for
    quantized weights on a CPU with VNNI, else float32); `decode_precision`: every decode step's (float32, int8 or
    auto). `step_prefill_tokens`:
    the prompt token rows the scheduler prefills between two decode steps at most (`Scheduler`). `packed_prefill`:
    short prompts of any lengths are prefilled together, their tokens side by side (`Engine`; False: only prompts of
    one chunk width together, each padded to it). `weight_strips`: 4- and 8-bit weights also held strip-major for the
    native kernel's calls past 16 rows (`weights.with_strips`: faster batched steps, a second copy of the codes)."""
    check_serve_extra()
    from kivi_jax.serve import http

    max_body_bytes = DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes
    shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout

    mesh = sharding.resolve_mesh(mesh)
    params, tokenizer = model.params, model.tokenizer
    spec = parse_cache_spec(cache)
    max_length = default_max_length(spec, params.config) if max_length is None else max_length
    if slots is not None and cache_budget is not None and not paged:
        raise ValueError("give the slots or a cache budget, not both (both only with --paged: its rows and bytes)")
    spec.check_shapes(params.config.head_dim, max_length)
    if paged:
        capacity = paged_capacity(spec, params.config, max_length, params.dtype, cache_budget, slots, DEFAULT_SLOTS)
        engine = Engine(params, spec, slots=capacity["slots"], max_length=max_length, prefill_chunk=prefill_chunk,
                        attention_impl=attention_impl, mesh=mesh, prefill_batch=prefill_batch,
                        prefill_tokens=prefill_tokens, pages=capacity["pages"], grow=grow,
                        prefix_snapshots=prefix_snapshots, prefill_precision=prefill_precision,
                        decode_precision=decode_precision, packed_prefill=packed_prefill,
                        weight_strips=weight_strips)
        if warmup:
            capacity["warmup"] = engine.warm_up()
        scheduler = Scheduler(engine, tokenizer, max_queue=max_queue, step_prefill_tokens=step_prefill_tokens)
        app = http.create_app(scheduler, model_name, max_body_bytes, shutdown_timeout)
        return Server(engine, scheduler, app, model_name, capacity)
    capacity = capacity_report(spec, params.config, max_length, params.dtype, cache_budget or 1, mesh)
    if cache_budget is None:
        capacity.pop("budget_bytes")
        for part in ("cache", "full"):
            capacity[part].pop("slots")
        slots = DEFAULT_SLOTS if slots is None else slots
    else:
        slots = capacity["cache"]["slots"]
        if slots < 1:
            need = (f"{capacity['cache']['slot_bytes']} bytes a slot" if mesh is None else
                    f"{capacity['cache']['slot_bytes_per_device']} bytes of each device for one slot a data shard")
            raise ValueError(f"a cache budget of {cache_budget} bytes fits no slot of {max_length} tokens of "
                             f"{spec_name(spec)} ({need}); raise the budget or lower --max-length")
    if mesh is not None:
        capacity["mesh"] = sharding.mesh_sizes(mesh)
    capacity["slots"] = slots
    engine = Engine(params, spec, slots=slots, max_length=max_length, prefill_chunk=prefill_chunk,
                    attention_impl=attention_impl, prefix_reuse=prefix_reuse, decode_group=decode_group, mesh=mesh,
                    prefill_batch=prefill_batch, prefill_tokens=prefill_tokens, prefill_precision=prefill_precision,
                    decode_precision=decode_precision, packed_prefill=packed_prefill, weight_strips=weight_strips)
    if warmup:
        capacity["warmup"] = engine.warm_up()
    scheduler = Scheduler(engine, tokenizer, max_queue=max_queue, step_prefill_tokens=step_prefill_tokens)
    app = http.create_app(scheduler, model_name, max_body_bytes, shutdown_timeout)
    return Server(engine, scheduler, app, model_name, capacity)
