"""Serving (docs/design.md §8, docs/serving.md): the engine (slots over one batch cache), the scheduler thread that
owns it, and the OpenAI-compatible HTTP layer (`kivi_jax.serve.http`, which needs the `serve` extra)."""

from kivi_jax.serve.engine import Engine, capacity_report, slot_bytes, slots_in_budget
from kivi_jax.serve.scheduler import Event, QueueFull, Request, Scheduler
from kivi_jax.serve.server import Server, build_server

__all__ = ["Engine", "Event", "QueueFull", "Request", "Scheduler", "Server", "build_server",
           "capacity_report", "slot_bytes", "slots_in_budget"]
