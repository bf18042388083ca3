"""A conversation on a live cache (docs/design.md §7): each turn appends only its new tokens.

The cache holds the text of the conversation so far as the chat template renders it, up to the last reply the model
gave. A new user turn renders the whole history with the template; what it adds beyond that text (the end of the
last reply's turn, the user's turn, the assistant's header) is tokenized and prefilled onto the cache, never the
history again. A template that rewrites earlier turns (so the text no longer extends what the cache holds) falls
back to prefilling the whole conversation, counted in `stats()["reprefills"]`. A turn that would overflow the cache
grows it (a new allocation with the same contents) up to the model's positions; past them the conversation is full.
"""

from __future__ import annotations

import time
from typing import Iterator

import jax
import numpy as np

from kivi_jax import rotation, runtime
from kivi_jax.cache import CacheCapacityError, full_cache_bytes, make_cache
from kivi_jax.config import parse_cache_spec, spec_name
from kivi_jax.generate import Model
from kivi_jax.runtime import PREFILL_CHUNK, TextStream
from kivi_jax.sampling import Sampling, check_int, row_settings


class ConversationFullError(CacheCapacityError):
    """The conversation has reached the model's positions."""


class Chat:
    """A multi-turn conversation with a model over one live cache.

    `Chat(model, cache="kivi2")` then `chat.send("Hi")` returns the reply; `chat.stream("Hi")` yields it in pieces
    as it is generated. Keywords: `system` (a system message), `max_new_tokens` (a reply's limit), `temperature`,
    `top_k`, `top_p`, `seed`, `max_length` (initial cache size in tokens; it grows as needed), `attention_impl`,
    `prefill_chunk`.
    """

    def __init__(self, model: Model, cache="kivi2", *, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 max_length: int | None = None, attention_impl: str = "auto", prefill_chunk: int | None = PREFILL_CHUNK):
        if not isinstance(model, Model):
            raise TypeError(f"Chat needs the Model from kivi_jax.load(...), not {type(model).__name__}")
        if model.tokenizer is None or not getattr(model.tokenizer, "chat_template", None):
            raise ValueError("Chat needs a tokenizer with a chat template; this model has none")
        check_int("max_new_tokens", max_new_tokens, 1)
        self.model, self.params, self.tokenizer = model, model.params, model.tokenizer
        self.spec = parse_cache_spec(cache)
        self.params = rotation.prepare_params(self.params, self.spec)
        self.sampling = Sampling(temperature, top_k, top_p)
        self.settings = row_settings([self.sampling])
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.impl, self.prefill_chunk = attention_impl, prefill_chunk
        self.system = system
        cfg = self.params.config
        self.multiple = runtime.rounded_tokens(1, self.spec)  # the allocation unit
        self.max_positions = cfg.max_position_embeddings // self.multiple * self.multiple
        self.initial_tokens = min(self._rounded(max_length or 1024), self.max_positions)
        self.reset()

    # -----------------------------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forgets the conversation (a fresh cache)."""
        self.messages: list[dict] = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.cache = make_cache(self.spec, self.params.config, 1, self.initial_tokens, self.params.dtype, self.impl)
        self.cache_text = ""  # the rendered conversation the cache holds
        self.ids: list[int] = []  # the token ids the cache holds
        self.key = jax.random.PRNGKey(self.seed)
        self.turns, self.reprefills = 0, 0
        self.last_turn: dict = {}

    def send(self, text: str) -> str:
        """Sends a user turn and returns the whole reply."""
        return "".join(self.stream(text))

    def stream(self, text: str) -> Iterator[str]:
        """Sends a user turn and yields the reply in pieces as it is generated."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a chat turn needs some text")
        t0 = time.perf_counter()
        messages = self.messages + [{"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not rendered.startswith(self.cache_text):  # the template rewrote history: start the cache over
            self.cache = make_cache(self.spec, self.params.config, 1, self.cache.max_tokens, self.params.dtype,
                                    self.impl)
            self.cache_text, self.ids, self.reprefills = "", [], self.reprefills + 1
        new_ids = self.tokenizer(rendered[len(self.cache_text):], add_special_tokens=False)["input_ids"]
        self._make_room(len(new_ids) + self.max_new_tokens)
        last, self.cache = runtime.prefill(self.params, np.asarray([new_ids], np.int32), np.asarray([len(new_ids)]),
                                           self.cache, self.prefill_chunk)
        state = runtime.Run(self.params, self.cache, self.key, self.settings, 1)
        first = runtime.start_run(state, last)
        first_token_s = None
        self.messages, self.cache_text = messages, rendered
        self.ids += new_ids
        text = TextStream(self.tokenizer)
        try:
            # every token of the reply is fed at once (the last too), so the cache holds all the reply given so far
            for step in runtime.run(state, first, self.max_new_tokens, self.params.config.eos_token_ids,
                                    feed_last=True, feed_first=True):
                token = int(step.tokens[0])
                if first_token_s is None:
                    first_token_s = time.perf_counter() - t0
                if token in self.params.config.eos_token_ids:
                    break
                text.add(token)
                self.ids.append(token)
                piece = text.piece()
                if piece:
                    yield piece
        finally:
            self.cache, self.key = state.cache, state.keys
            reply = text.text
            self.messages = messages + [{"role": "assistant", "content": reply}]
            self.cache_text = rendered + reply
            self.turns += 1
            self.last_turn = {"new_tokens": len(new_ids), "reply_ids": text.ids,
                              "first_token_seconds": first_token_s, "seconds": time.perf_counter() - t0}
            runtime.raise_cache_errors(self.cache)
        rest = text.piece(final=True)
        if rest:
            yield rest

    # -----------------------------------------------------------------------------------------------------------------

    def _rounded(self, tokens: int) -> int:
        return -(-max(tokens, 1) // self.multiple) * self.multiple

    def _make_room(self, need: int) -> None:
        """Grows the cache so `need` more tokens fit, up to the model's positions."""
        held = int(np.asarray(self.cache.length)[0])
        if held + need > self.max_positions:
            raise ConversationFullError(
                f"the conversation is full: it holds {held} tokens and this turn needs up to {need} more "
                f"(its text plus max_new_tokens={self.max_new_tokens}), past the {self.max_positions} positions this "
                "model and cache allow; reset it (/reset) or save it and start a new one")
        if held + need > self.cache.max_tokens:
            self.cache = self.cache.grown(min(self._rounded(2 * (held + need)), self.max_positions))

    def stats(self) -> dict:
        """Tokens in the cache, how many of them are quantized, cache bytes and what a full cache would take."""
        cfg = self.params.config
        length = self.cache.length
        held = int(np.asarray(length)[0])
        out = {"turns": self.turns, "tokens": held, "cache": spec_name(self.spec), "capacity": self.cache.max_tokens,
               "cache_bytes": int(self.cache.nbytes),
               "full_precision_bytes": full_cache_bytes(cfg, 1, self.cache.max_tokens,
                                                        np.dtype(self.params.dtype).itemsize),
               "reprefills": self.reprefills}
        keys, values = self.spec.quantized_tokens(length)
        out["keys_quantized"], out["values_quantized"] = int(np.asarray(keys)[0]), int(np.asarray(values)[0])
        return out

    def save(self, path) -> None:
        """Saves the conversation and its cache (kivi_jax.cache_io); `Chat.load` continues it exactly."""
        from kivi_jax.cache_io import save_cache

        save_cache(self.cache, path, self.params, {"kind": "chat", "messages": self.messages, "ids": self.ids,
                                                   "cache_text": self.cache_text, "turns": self.turns})

    def load(self, path) -> None:
        """Continues a conversation saved by `save` (same model and cache spec)."""
        from kivi_jax.cache_io import restore_cache

        from kivi_jax.checkpoint import CheckpointError

        cache, meta = restore_cache(path, self.params, self.spec, self.impl)
        if meta.get("kind") != "chat":
            raise CheckpointError(f"{path} holds a cache but no conversation")
        kinds = {"messages": list, "ids": list, "cache_text": str, "turns": int}
        wrong = [k for k, kind in kinds.items() if not isinstance(meta.get(k), kind)]
        if wrong:
            raise CheckpointError(f"{path} holds a conversation whose metadata lacks {', '.join(wrong)} (or has the "
                                  "wrong kind of value there); the save is damaged")
        self.cache, self.messages, self.cache_text = cache, meta["messages"], meta["cache_text"]
        self.ids, self.turns = meta["ids"], meta["turns"]
