"""The decode step of `kivi-jax serve`'s engine with every slot held to a JSON schema against the same step free.

    python scripts/bench_constrained_step.py --cache kivi2 --slots 8 --steps 24 --repeats 5

Each repeat admits the same `--slots` prompts twice, once with no grammar and once with every choice under a JSON
schema (xgrammar, the `grammar` extra), and times `--steps` decode steps of each (the host's mask fill, its transfer,
the masked sampling and the step itself), interleaved so that a change in the machine's load hits both; it prints the
median step times and their ratio (the target: constrained <= 1.2x free at batch 8). Numbers on a shared CPU are
noisy: read the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cache", default="kivi2")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-length", type=int, default=512)
    args = p.parse_args(argv)

    import kivi_jax
    from kivi_jax.serve.engine import Engine
    from kivi_jax.serve.grammar import Compiler
    from kivi_jax.serve.loadtest import BENCH_SCHEMA, PROMPTS
    from kivi_jax.sampling import Sampling

    model = kivi_jax.load(args.model, progress=False)
    tok = model.tokenizer
    eng = Engine(model.params, args.cache, slots=args.slots, max_length=args.max_length, prefix_reuse=False)
    grammar = Compiler(lambda: tok, model.config.vocab_size, eng.eos).compile(
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": BENCH_SCHEMA}})
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=False,
                                     add_generation_prompt=True) for i in range(args.slots)]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]  # as the server encodes a chat

    def run(constrained: bool) -> list[float]:
        for i, q in enumerate(prompts):
            eng.admit_choices(q, [Sampling(0.0)], constraints=[grammar.matcher()] if constrained else None)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step_scored()
            times.append(time.perf_counter() - t0)
        for slot in list(eng.live_slots()):
            eng.free(slot)
        return times

    run(False), run(True)  # compile both paths
    free, held = [], []
    for _ in range(args.repeats):
        free += run(False)
        held += run(True)
    out = {"model": args.model, "cache": eng.spec_name, "slots": args.slots, "steps": args.steps,
           "repeats": args.repeats, "free_step_ms_median": round(1000 * statistics.median(free), 2),
           "constrained_step_ms_median": round(1000 * statistics.median(held), 2)}
    out["ratio"] = round(out["constrained_step_ms_median"] / out["free_step_ms_median"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
