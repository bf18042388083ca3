"""Long-context quality through the cache: passkey retrieval, a needle in real prose, and long-document loss.

Every case runs through the cache as generation runs it (docs/quality.md, "Long context"): the prompt prefilled in
chunks of `runtime.PREFILL_CHUNK` tokens (`runtime.prefill`), then greedy decoding with `runtime.run`.
Cases whose prompts share a prefix share its prefill: the cache after the shared whole chunks is computed once and
copied, which is the same computation as prefilling each prompt from the start (same chunks, same shapes, same
capacity; `tests/test_longctx.py` checks the answers against `generate`). Long-document loss prefills a document's
first C tokens the same way, then feeds the next 256 one at a time, scored as `kivi-jax eval ppl` scores
(`evaluate.score_steps`).

A results file (JSON lines) makes a run resumable: every finished case is appended as soon as it is done, and a rerun
with the same file skips the cases it holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import zlib
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax import evaluate, rotation, runtime
from kivi_jax.cache import make_cache
from kivi_jax.config import ALIASES, REFERENCE, is_reference, parse_cache_spec, spec_name
from kivi_jax.models.decoder import Params
from kivi_jax.runtime import PREFILL_CHUNK, cache_size, chunk_size, prefill
from kivi_jax.sampling import GREEDY, row_settings

TASKS = ("passkey", "needle", "longdoc")
RETRIEVAL = ("passkey", "needle")
LENGTHS = (1024, 2048, 3072, 4096, 8192)  # prompt tokens of a retrieval case (capped at the model's positions)
CASES = 20  # retrieval cases a length, their depths spread evenly over 0..100%
ANSWER_TOKENS = 12  # greedy tokens a retrieval answer gets at most
CONTEXTS = (2048, 4096, 7680)  # long-document loss: tokens of the document before the scored ones
SCORED = 256  # long-document loss: tokens scored after each context
DOCUMENTS = 4  # long-document loss: documents (windows of the text), run as one batch
SPECS = ("full", "kivi2", "kivi4", "kivi2+", "kivi3+")
# Whether the prompt goes through the chat template, per task: fixed from a test of both with the full cache before
# any quantized spec was measured (docs/quality.md, "Long context").
CHAT = {"passkey": False, "needle": False}
CEILING = 0.9  # a length counts in the pass/fail reading where the full cache reaches this accuracy
SLACK = 1 / 20  # a quantized cache passes there when it loses at most this fraction of the cases against full

# KIVI's passkey_examples format (from landmark attention): filler, the key, more filler, the question
PASSKEY_TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                "I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"

# The needle: a made-up fact in real prose, checkable by one word
DISHES = ("Aunt Velma's plum dumplings", "the Brask family's fish stew", "Old Tomas's rye bread",
          "the harbour inn's onion soup", "Grandmother Ilse's honey cake", "the Kessel brothers' pickled beets",
          "Mrs. Ondra's lamb pie", "the mountain hut's barley porridge", "Captain Reyes's bean chili",
          "the Lindqvist bakery's almond buns", "Uncle Piet's pea soup", "the Marlow sisters' lemon tart",
          "the night market's noodle broth", "Chef Amadou's peanut stew", "the abbey's cheese dumplings",
          "Farmer Hale's apple cider", "the Orsini cafe's tomato sauce", "Nana Cleo's corn fritters",
          "the lighthouse keeper's clam chowder", "Professor Quill's ginger biscuits")
INGREDIENTS = ("cardamom", "saffron", "anchovies", "walnuts", "juniper", "tamarind", "lavender", "fennel", "nutmeg",
               "rosewater", "miso", "sumac", "horseradish", "chestnuts", "molasses", "elderflower", "pistachios",
               "caraway", "wasabi", "turmeric")
NEEDLE_LINE = "The secret ingredient of {dish} is {ingredient}."
NEEDLE_QUESTION = "What is the secret ingredient of {dish}? The secret ingredient of {dish} is"


# ---------------------------------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One retrieval prompt: its token ids, where the hidden fact starts, and the answer that counts."""

    task: str
    length: int  # the nominal length (1024, ...); the prompt has at most this many tokens
    cases: int  # cases at this length (their depths are i / (cases - 1))
    index: int
    depth: float  # 0: the fact first, 1: last before the question
    answer: str  # the 5 digits, or the ingredient
    tokens: tuple  # the prompt's token ids
    fact_at: int  # token index where the fact begins
    chat: bool = False  # the prompt is wrapped in the chat template


def depth(index: int, cases: int) -> float:
    """The depth of case `index` of `cases`: evenly spread over [0, 1]."""
    return 0.0 if cases == 1 else index / (cases - 1)


def case_rng(task: str, length: int, index: int) -> np.random.RandomState:
    """A fixed random stream for one case (the same on every machine and run)."""
    return np.random.RandomState(zlib.crc32(f"{task}/{length}/{index}".encode()))


def prompt_budget(length: int, max_positions: int, answer_tokens: int = ANSWER_TOKENS) -> int:
    """Prompt tokens a case of nominal `length` may have: the length, or the model's positions less the answer."""
    return min(length, max_positions - answer_tokens)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """The chat template's token ids before and after a user message's content (with the assistant's header)."""
    marker = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(marker)
    return _ids(tokenizer, before), _ids(tokenizer, after)


def _framed(tokenizer, content: list[int], chat: bool) -> tuple[list[int], int]:
    """(prompt ids, offset of the content in them)."""
    if not chat:
        return content, 0
    before, after = chat_frame(tokenizer)
    return before + content + after, len(before)


def passkey_case(tokenizer, length: int, index: int, cases: int = CASES, chat: bool = False,
                 max_positions: int = 8192) -> Case:
    """Case `index` of `cases` at nominal `length`: a 5-digit key at depth `index / (cases - 1)` of the filler
    sentences, as many sentences as fit in `prompt_budget(length)` tokens."""
    key = str(case_rng("passkey", length, index).randint(10000, 100000))
    d = depth(index, cases)
    budget = prompt_budget(length, max_positions)
    line = PASSKEY_LINE.format(key=key)

    def build(n):  # n filler sentences -> (prompt ids, where the key line starts)
        before = round(d * n)
        sentences = [FILLER[i % len(FILLER)] for i in range(n)]
        head = "\n".join([PASSKEY_TASK, " ".join(sentences[:before])]) + "\n"
        rest = "\n".join([line, " ".join(sentences[before:]), PASSKEY_QUESTION])
        head_ids = _ids(tokenizer, head)
        ids, offset = _framed(tokenizer, head_ids + _ids(tokenizer, rest), chat)
        return ids, offset + len(head_ids)

    empty = len(build(0)[0])
    if empty > budget:
        raise ValueError(f"a passkey prompt needs more than {budget} tokens; give a longer length (got {length})")
    per = (len(build(50)[0]) - empty) / 50  # tokens a sentence; then the most sentences that fit, counted exactly
    n = max(int((budget - empty) / per), 0)
    while n > 0 and len(build(n)[0]) > budget:
        n -= 1
    while len(build(n + 1)[0]) <= budget:
        n += 1
    ids, fact_at = build(n)
    return Case("passkey", length, cases, index, d, key, tuple(ids), fact_at, chat)


def line_starts(tokenizer, tokens) -> np.ndarray:
    """Indices `i` in `tokens` after a newline (token `i - 1` holds one, maybe followed by indentation), 0 included."""
    ends = np.array(["\n" in tokenizer.decode([int(t)]) for t in tokens[:-1]], bool)
    return np.concatenate([[0], np.flatnonzero(ends) + 1])


def needle_case(tokenizer, haystack, length: int, index: int, cases: int = CASES, chat: bool = False,
                max_positions: int = 8192, starts: np.ndarray | None = None) -> Case:
    """Case `index` of `cases` at nominal `length`: the start of `haystack` (token ids of real prose) with a made-up
    fact inserted at the line start nearest below depth `index / (cases - 1)`, then its question; the prompt fills
    `prompt_budget(length)` tokens exactly. `starts`: `line_starts(tokenizer, haystack)`, when known."""
    rng = case_rng("needle", length, index)
    dish, ingredient = DISHES[rng.randint(len(DISHES))], INGREDIENTS[rng.randint(len(INGREDIENTS))]
    d = depth(index, cases)
    fact = _ids(tokenizer, NEEDLE_LINE.format(dish=dish, ingredient=ingredient) + "\n")
    question = _ids(tokenizer, "\n\n" + NEEDLE_QUESTION.format(dish=dish))
    frame = sum(map(len, chat_frame(tokenizer))) if chat else 0
    n_hay = prompt_budget(length, max_positions) - len(fact) - len(question) - frame
    if n_hay < 1 or n_hay > len(haystack):
        raise ValueError(f"a needle prompt of {length} tokens needs {n_hay} tokens of text; the text has "
                         f"{len(haystack)}")
    starts = line_starts(tokenizer, haystack[: n_hay + 1]) if starts is None else np.asarray(starts)
    at = int(starts[starts <= round(d * n_hay)].max())
    hay = [int(t) for t in haystack[:n_hay]]
    ids, offset = _framed(tokenizer, hay[:at] + fact + hay[at:] + question, chat)
    return Case("needle", length, cases, index, d, ingredient, tuple(ids), offset + at, chat)


def make_cases(task: str, tokenizer, length: int, cases: int, max_positions: int, haystack=None,
               chat: bool | None = None) -> list[Case]:
    """All `cases` cases of `task` at `length` (the needle's `haystack`: token ids of the prose)."""
    chat = CHAT[task] if chat is None else chat
    if task == "passkey":
        return [passkey_case(tokenizer, length, i, cases, chat, max_positions) for i in range(cases)]
    if task == "needle":
        starts = line_starts(tokenizer, haystack[: prompt_budget(length, max_positions) + 1])
        return [needle_case(tokenizer, haystack, length, i, cases, chat, max_positions, starts) for i in range(cases)]
    raise ValueError(f"task {task!r} is not a retrieval task; choose one of {RETRIEVAL}")


def is_correct(case: Case, text: str) -> bool:
    """Exact match: the answer's first number is the 5-digit key (passkey), or the ingredient appears as a word."""
    if case.task == "passkey":
        found = re.search(r"\d+", text)
        return found is not None and found.group() == case.answer
    return re.search(rf"\b{re.escape(case.answer)}\b", text, re.IGNORECASE) is not None


def decided(case: Case, text: str) -> bool:
    """Whether more answer tokens can change `is_correct`: a passkey's first number has ended, the needle's
    ingredient was named."""
    if case.task == "passkey":
        return re.search(r"\d+\D", text) is not None
    return is_correct(case, text)


# ---------------------------------------------------------------------------------------------------------------------
# Running prompts through the cache, sharing prefixes


def copy_cache(cache):
    """A cache with buffers of its own (prefill and decode donate theirs)."""
    return jax.tree.map(jnp.copy, cache)


def placed_like(params: Params, tree):
    """`tree`'s arrays committed to a device as `params` are (loaded weights are; a model built from numpy arrays is
    not). A jitted step compiles again when an input's commitment changes, as a fresh cache's does once the step's
    own outputs come back; placed so from the start, each step compiles once (the same program, the same numbers)."""
    like = jax.tree.leaves(params)[0]
    return jax.tree.map(lambda x: jax.device_put(x, like.sharding), tree) if like.committed else tree


def shared_prefill(params: Params, base: np.ndarray, stops: list[int], cache, step: int) -> Iterator[tuple]:
    """Prefills `base [batch, n]` onto `cache` (donated) in chunks of `step`, yielding `(stop, cache)` once the first
    `stop` tokens are in, for each of the `stops` (multiples of `step`, ascending). The cache yielded is the live one:
    copy it (`copy_cache`) to use it past the next iteration."""
    done = 0
    for stop in stops:
        if stop % step or stop < done or stop > base.shape[1]:
            raise ValueError(f"stops {stops} must ascend in multiples of {step} up to {base.shape[1]}")
        if stop > done:
            _, cache = prefill(params, base[:, done:stop], np.full(base.shape[0], stop - done), cache, step)
            done = stop
        yield stop, cache


def greedy(params: Params, last: jax.Array, cache, steps: int, eos, stop: Callable[[list[int]], bool]) -> list[int]:
    """Greedy tokens after a prefill (`last [1, vocab]` its logits) as `generate` decodes them, up to `steps`, an EOS
    or `stop(tokens)`."""
    state = runtime.Run(params, cache, placed_like(params, jax.random.PRNGKey(0)),
                        placed_like(params, row_settings([GREEDY])), 1)
    out = []
    for step in runtime.run(state, runtime.start_run(state, last), steps, eos):
        out.append(int(step.tokens[0]))
        if stop(out):
            break
    runtime.raise_cache_errors(state.cache)
    return out


def answer_cases(params: Params, cases: list[Case], spec, tokenizer, impl: str = "auto", chunk: int = PREFILL_CHUNK,
                 answer_tokens: int = ANSWER_TOKENS, on_done: Callable[[Case, dict], None] | None = None) -> list[dict]:
    """Runs every case through a `spec` cache: its prompt prefilled in chunks as `generate` does, then greedy
    decoding; cases with the same prompt length share the prefill of the whole chunks their prompts share. Returns
    (and passes to `on_done` as each finishes) a record per case: the answer text, whether it is correct, timings."""
    spec = parse_cache_spec(spec)
    params = rotation.prepare_params(params, spec)
    cfg = params.config
    eos = set(cfg.eos_token_ids)
    groups: dict[tuple, list[Case]] = {}  # cases whose caches and chunks have one shape
    for case in cases:
        n = len(case.tokens)
        groups.setdefault((cache_size(n, answer_tokens, spec, None, cfg), chunk_size(n, chunk)), []).append(case)
    records = []
    for (max_tokens, step), group in groups.items():
        spec.check_shapes(cfg.head_dim, max_tokens)
        prompts = [np.asarray(c.tokens, np.int32) for c in group]
        shared = np.array([[_common(a, b) for b in prompts] for a in prompts])  # [base, case] tokens in common
        base = int(np.argmax(shared.sum(axis=1)))
        # each case starts after the whole chunks it shares with the base, keeping at least one token of its own
        starts = [min(int(shared[base, i]), len(p) - 1) // step * step for i, p in enumerate(prompts)]
        order = np.argsort(starts, kind="stable")
        stops = sorted(set(starts))
        cache = placed_like(params, make_cache(spec, cfg, 1, max_tokens, params.dtype, impl))
        t0 = time.perf_counter()
        branches = shared_prefill(params, prompts[base][None], stops, cache, step)
        stop, branch = next(branches)
        for i in order:
            while stop < starts[i]:
                stop, branch = next(branches)
            t1 = time.perf_counter()
            own = copy_cache(branch)
            tail = prompts[i][None, starts[i]:]  # its chunks past starts[i] are the prompt's own (`ChunkPlan`)
            last, own = prefill(params, tail, np.array([tail.shape[1]]), own, step)
            case = group[i]
            ids = greedy(params, last, own, answer_tokens, eos,
                         lambda out, case=case: decided(case, tokenizer.decode(out, skip_special_tokens=True)))
            text = tokenizer.decode(ids, skip_special_tokens=True)
            record = {"task": case.task, "spec": spec_name(spec), "length": case.length, "cases": case.cases,
                      "index": case.index, "depth": case.depth, "prompt_tokens": len(prompts[i]),
                      "fact_at": case.fact_at, "shared_tokens": starts[i], "chat": case.chat, "answer": case.answer,
                      "output": text, "output_ids": ids,
                      "correct": is_correct(case, text), "seconds": round(time.perf_counter() - t1, 2),
                      "group_seconds": round(time.perf_counter() - t0, 2)}
            records.append(record)
            if on_done is not None:
                on_done(case, record)
    return records


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


# ---------------------------------------------------------------------------------------------------------------------
# Long-document loss


def document_starts(n_tokens: int, documents: int = DOCUMENTS, contexts=CONTEXTS, scored: int = SCORED) -> list[int]:
    """Starts of `documents` windows of the text, each long enough for the longest context plus the scored tokens,
    evenly spaced as `evaluate.window_starts` spaces the evaluation windows."""
    return evaluate.window_starts(n_tokens, max(contexts), scored, documents)


def longdoc_loss(params: Params, documents: np.ndarray, spec, contexts=CONTEXTS, scored: int = SCORED, refs=None,
                 impl: str = "auto", chunk: int = PREFILL_CHUNK, skip=(),
                 on_done: Callable[[int, dict], None] | None = None) -> dict:
    """Teacher-forced loss after each context length C in `contexts` of `documents [batch, >= max(C) + scored + 1]`:
    the first C tokens prefilled in chunks (a prefix shared by every C), then the next `scored` fed one at a time,
    each step's prediction scored (`evaluate.score_steps`). `refs`: {C: full's `logprobs`} for KL and top-1
    agreement; contexts in `skip` are prefilled past but not scored. Returns {C: {nll, kl, top1 `[batch, scored]`,
    logprobs (without a reference)}}, each also passed to `on_done(C, out)` when done."""
    spec = parse_cache_spec(spec)
    params = rotation.prepare_params(params, spec)
    cfg = params.config
    documents = np.asarray(documents, np.int32)
    contexts = sorted(contexts)
    if documents.shape[1] < contexts[-1] + scored + 1:
        raise ValueError(f"documents of {documents.shape[1]} tokens are too short for a context of {contexts[-1]} "
                         f"plus {scored} scored tokens")
    step = chunk_size(contexts[-1], chunk)
    if any(c % step or chunk_size(c, chunk) != step for c in contexts):
        raise ValueError(f"contexts {contexts} must be multiples of the prefill chunk {chunk} (or one context), so "
                         "that a shared prefill is the one each context's prompt would get")
    max_tokens = cache_size(contexts[-1], scored, spec, None, cfg)
    cache = placed_like(params, make_cache(spec, cfg, documents.shape[0], max_tokens, params.dtype, impl))
    results = {}
    for c, branch in shared_prefill(params, documents, contexts, cache, step):
        if c in skip:
            continue
        ref = None if refs is None else refs[c]
        inputs, targets = documents[:, c : c + scored].T, documents[:, c + 1 : c + scored + 1].T  # [scored, batch]
        _, out = evaluate.score_steps(params, copy_cache(branch), inputs, targets, ref)
        results[c] = out
        if on_done is not None:
            on_done(c, out)
    return results


# ---------------------------------------------------------------------------------------------------------------------
# The driver: resumable runs, the report


def parse_lengths(text: str, cases: int = CASES) -> list[tuple[int, int]]:
    """'1024,2048,8192:10' -> [(1024, cases), (2048, cases), (8192, 10)]: lengths, each with its case count."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        length, _, n = part.partition(":")
        try:
            pair = (int(length), int(n) if n else cases)
        except ValueError:
            raise ValueError(f"bad length {part!r}: give LENGTH or LENGTH:CASES, e.g. 4096 or 8192:10") from None
        if pair[0] < 64 or pair[1] < 1:
            raise ValueError(f"bad length {part!r}: a length of at least 64 tokens and at least 1 case")
        out.append(pair)
    if not out:
        raise ValueError("--lengths names no length")
    return out


def load_records(path: str | None) -> list[dict]:
    """The finished cases of a results file (none when it does not exist yet); a torn last line is dropped."""
    if path is None or not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a run killed mid-write
    return records


def record_key(r: dict) -> tuple:
    if r["task"] == "longdoc":
        return ("longdoc", r["spec"], r["context"], r["documents"])
    return (r["task"], r["spec"], r["length"], r["cases"], r["index"])


class Results:
    """The records of a run, appended to a JSON-lines file (when given) as each case finishes, each with the
    `protocol` it ran under; a file holding records of another protocol is refused (a field a record lacks, written
    before that field existed, is not compared)."""

    def __init__(self, path: str | None, protocol: dict):
        self.path, self.protocol = path, protocol
        self.records = {}
        for r in load_records(path):
            mismatch = {k: (r[k], v) for k, v in protocol.items() if k in r and r[k] != v}
            if mismatch:
                raise ValueError(f"{path} holds cases of another protocol ({mismatch}: file, now); give another "
                                 "--results file")
            self.records[record_key(r)] = r

    def __contains__(self, key) -> bool:
        return key in self.records

    def add(self, record: dict) -> None:
        record = {**record, **self.protocol}
        self.records[record_key(record)] = record
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())


def text_fingerprint(tokens) -> str:
    """Which prose a run read: its token count and a checksum of its token ids."""
    tokens = np.asarray(tokens, np.int32)
    return f"{len(tokens)} tokens, crc32 {zlib.crc32(tokens.tobytes()):08x}"


def _ref_path(path: str | None, context: int) -> str | None:
    return None if path is None else f"{path}.full-{context}.npy"


def run(model, specs=SPECS, tasks=TASKS, lengths=None, results_path: str | None = None, tokens=None,
        documents: int = DOCUMENTS, contexts=CONTEXTS, impl: str = "auto", log: Callable[[str], None] | None = None,
        answer_tokens: int = ANSWER_TOKENS, scored: int = SCORED) -> dict:
    """The long-context evaluation of `specs` on `tasks` (`lengths`: [(length, cases)], default LENGTHS at CASES);
    resumable through `results_path`. `tokens`: the prose (token ids) of the needle's haystack and the long documents
    (default: `evaluate.default_text()`). Retrieval runs length by length (every task and spec at a length before the
    next length), long-document loss after it. Returns the report (`report`)."""
    params, tokenizer = model.params, model.tokenizer
    cfg = params.config
    specs = list(dict.fromkeys([REFERENCE] + [spec_name(parse_cache_spec(s)) for s in specs]))  # the ceiling, first
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; choose from {TASKS}")
    lengths = [(n, CASES) for n in LENGTHS] if lengths is None else list(lengths)
    tokens = evaluate.tokenize(tokenizer, evaluate.default_text()) if tokens is None else np.asarray(tokens, np.int32)
    protocol = {"chunk": PREFILL_CHUNK, "answer_tokens": answer_tokens, "scored": scored, "impl": impl,
                "chat_template": dict(CHAT), "text": text_fingerprint(tokens)}
    results = Results(results_path, protocol)
    log = log or (lambda s: None)
    for length, n_cases in lengths:
        for task in (t for t in tasks if t in RETRIEVAL):
            cases = make_cases(task, tokenizer, length, n_cases, cfg.max_position_embeddings, tokens)
            for spec in specs:
                todo = [c for c in cases if (task, spec, length, n_cases, c.index) not in results]
                if not todo:
                    continue
                log(f"{task} {length} {spec}: {len(todo)} cases")

                def done(case, record):
                    results.add(record)
                    log(f"  {task} {length} {record['spec']} #{case.index} depth {case.depth:.2f}: "
                        f"{'ok ' if record['correct'] else 'no '} {record['output']!r} (key {case.answer}; "
                        f"{record['seconds']:.0f} s)")

                answer_cases(params, todo, spec, tokenizer, impl, answer_tokens=answer_tokens, on_done=done)
    if "longdoc" in tasks:
        starts = document_starts(len(tokens), documents, contexts, scored)
        docs = np.stack([tokens[s : s + max(contexts) + scored + 1] for s in starts])
        refs = {}
        for spec in specs:
            pending = [c for c in contexts if ("longdoc", spec, c, documents) not in results]
            need_ref = is_reference(spec) and any(
                ("longdoc", s, c, documents) not in results for s in specs if not is_reference(s) for c in contexts)
            if is_reference(spec) and need_ref:  # the reference: from an earlier run's file, else computed again
                refs = {c: _load_ref(results_path, c) for c in contexts}
                pending = [c for c in contexts if c in pending or refs[c] is None]
            if not pending:
                continue
            log(f"longdoc {spec}: contexts {pending}")
            t0 = time.perf_counter()

            def done(c, out, spec=spec):
                if is_reference(spec):
                    refs[c] = out["logprobs"]
                    if results_path is not None:
                        np.save(_ref_path(results_path, c), np.asarray(out["logprobs"]))
                if ("longdoc", spec, c, documents) in results:
                    return
                record = {"task": "longdoc", "spec": spec, "context": c, "documents": documents,
                          "document_starts": starts, "nll": float(out["nll"].mean()),
                          "nll_per_document": out["nll"].mean(axis=1).tolist(), "kl_vs_full": float(out["kl"].mean()),
                          "top1_agree": float(out["top1"].mean()), "seconds": round(time.perf_counter() - t0, 1)}
                results.add(record)
                log(f"  longdoc {spec} after {c}: NLL {record['nll']:.4f}, KL {record['kl_vs_full']:.4f}, top-1 "
                    f"{record['top1_agree']:.3f}")

            longdoc_loss(params, docs, spec, contexts, scored, None if is_reference(spec) else refs, impl,
                         skip=[c for c in contexts if c not in pending], on_done=done)
    return report(list(results.records.values()), specs, tasks, lengths, contexts, documents, scored)


def report_file(path: str, specs=SPECS, tasks=TASKS, lengths=None, documents: int = DOCUMENTS, contexts=CONTEXTS,
                scored: int = SCORED) -> dict:
    """The report (`report`) of the cases a results file holds, running none (cases it lacks are left out)."""
    if not os.path.exists(path):
        raise ValueError(f"no results file {path}; run the evaluation with --results {path} first")
    specs = list(dict.fromkeys([REFERENCE] + [spec_name(parse_cache_spec(s)) for s in specs]))
    lengths = [(n, CASES) for n in LENGTHS] if lengths is None else list(lengths)
    return report(load_records(path), specs, tasks, lengths, contexts, documents, scored)


def _load_ref(path: str | None, context: int):
    p = _ref_path(path, context)
    return jnp.asarray(np.load(p)) if p is not None and os.path.exists(p) else None


def report(records: list[dict], specs, tasks, lengths, contexts=CONTEXTS, documents: int = DOCUMENTS,
           scored: int = SCORED) -> dict:
    """Accuracy per task, spec and length (retrieval), and per context NLL, ΔNLL against full, KL and top-1
    agreement (long-document loss), from the records of the cases asked for."""
    by_key = {record_key(r): r for r in records}
    retrieval = {}
    for task in (t for t in tasks if t in RETRIEVAL):
        retrieval[task] = {}
        for spec in specs:
            rows = {}
            for length, n in lengths:
                got = [by_key[(task, spec, length, n, i)] for i in range(n) if (task, spec, length, n, i) in by_key]
                if got:
                    rows[length] = {"correct": sum(r["correct"] for r in got), "cases": len(got), "of": n,
                                    "accuracy": sum(r["correct"] for r in got) / len(got),
                                    "prompt_tokens": int(np.mean([r["prompt_tokens"] for r in got])),
                                    "wrong_depths": [round(r["depth"], 3) for r in got if not r["correct"]]}
            retrieval[task][spec] = rows
        full = retrieval[task].get(REFERENCE, {})
        for spec, rows in retrieval[task].items():
            for length, row in rows.items():
                ceiling = full.get(length)
                row["reading"] = ceiling is not None and ceiling["accuracy"] >= CEILING
                row["within_slack"] = None if ceiling is None else ceiling["accuracy"] - row["accuracy"] <= SLACK + 1e-9
    longdoc = {}
    if "longdoc" in tasks:
        for spec in specs:
            rows = {}
            for c in contexts:
                r, full = by_key.get(("longdoc", spec, c, documents)), by_key.get(("longdoc", REFERENCE, c, documents))
                if r is not None:
                    rows[c] = {"nll": r["nll"], "delta_nll": None if full is None else r["nll"] - full["nll"],
                               "kl_vs_full": r["kl_vs_full"], "top1_agree": r["top1_agree"],
                               "nll_per_document": r["nll_per_document"]}
            longdoc[spec] = rows
    return {"retrieval": retrieval, "longdoc": longdoc, "specs": list(specs), "lengths": [list(p) for p in lengths],
            "contexts": list(contexts), "documents": documents, "scored": scored, "chat": dict(CHAT),
            "labels": {spec: label(spec) for spec in specs}}


def label(spec: str) -> str:
    """A spec's name with its preset's, when it is one: `kivi2+ = k3v2-g64-r128-prerope-s4-rotv`."""
    names = {cfg.spec: name for name, cfg in ALIASES.items()}
    return f"{names[spec]} = {spec}" if spec in names else spec


def verdict(rows: dict, reading: list[int]) -> str:
    """'yes', 'no (at 2048)' or 'not run there' for one cache over the `reading` lengths, with those not run."""
    have = [n for n in reading if n in rows]
    lost = [n for n in have if not rows[n]["within_slack"]]
    out = "not run there" if not have else f"no (at {', '.join(map(str, lost))})" if lost else "yes"
    missing = [n for n in reading if n not in rows]
    return out + (f" ({', '.join(map(str, missing))} not run)" if have and missing else "")


def markdown(rep: dict) -> str:
    """The report as markdown tables: correct cases per length (retrieval), loss per context (long documents)."""
    out = []
    for task, by_spec in rep["retrieval"].items():
        lengths = [n for n, _ in rep["lengths"]]
        out += [f"{task} (correct of cases):", "", "| cache | " + " | ".join(f"{n}" for n in lengths) + " |",
                "|---|" + "---|" * len(lengths)]
        for spec, rows in by_spec.items():
            cells = [f"{rows[n]['correct']}/{rows[n]['cases']}" if n in rows else "" for n in lengths]
            out.append(f"| `{label(spec)}` | " + " | ".join(cells) + " |")
        full = by_spec.get(REFERENCE, {})
        reading = [n for n in lengths if n in full and full[n]["reading"]]
        head = f"Lengths where the full cache reaches {CEILING:.0%} (the pass/fail reading): "
        if not reading:
            out += ["", head + "none, so no cache is judged on this task", ""]
            continue
        out += ["", head + f"{', '.join(map(str, reading))}; within {SLACK * 20:.0f} case in 20 of full there: "
                + "; ".join(f"`{label(spec)}` {verdict(rows, reading)}" for spec, rows in by_spec.items()
                            if not is_reference(spec)), ""]
    if rep["longdoc"]:
        contexts = rep["contexts"]
        out += [f"long-document loss ({rep['documents']} documents, {rep['scored']} tokens scored after each context): "
                "NLL, ΔNLL, KL(full‖q), top-1", "",
                "| cache | " + " | ".join(f"NLL@{c} | ΔNLL@{c} | KL@{c} | top-1@{c}" for c in contexts) + " |",
                "|---|" + "---|---|---|---|" * len(contexts)]
        for spec, rows in rep["longdoc"].items():
            cells = []
            for c in contexts:
                r = rows.get(c)
                if r is None:
                    cells += [""] * 4
                else:
                    delta = "" if r["delta_nll"] is None else f"{r['delta_nll']:+.4f}"
                    cells += [f"{r['nll']:.4f}", delta, f"{r['kl_vs_full']:.4f}", f"{r['top1_agree']:.3f}"]
            out.append(f"| `{label(spec)}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)
