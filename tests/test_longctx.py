"""`kivi-jax eval longctx`: the passkey and needle prompts are deterministic with checkable answers; prompts sharing a
prefix get the answers `generate` gives them; a run writes each case as it finishes and a rerun skips them; the
report, table and plots build. Plumbing on a tiny random model, not accuracy."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kivi_jax import cli, longctx
from kivi_jax.generate import Model, generate
from kivi_jax.models.config import LlamaConfig
from kivi_jax.models.llama import param_shapes, params_from_dict

SPEC = "k2v2-g16-r32"  # a KIVI cache that quantizes within the tiny prompts (head_dim 16)
# Every run below has one cache shape, so each spec compiles once: prompts of 1200 tokens plus the answer and contexts
# up to 1024 plus the scored tokens all take caches of 1280 tokens, filled in chunks of 512.
LENGTH, ANSWER, SCORED, CONTEXTS = 1200, 4, 8, (512, 1024)
PROSE = "".join(f"Paragraph {i} tells of the river and the mill.\n  It runs on, line after line of plain prose.\n"
                for i in range(60))


class CharTokenizer:
    """One token a character (id 3 + its index in CHARS; pad 0, bos 1, eos 2), with a chat template: the calls
    kivi_jax makes of a Hugging Face tokenizer, without importing transformers."""

    CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
    chat_template = "<{content}>A:"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.CHARS.index(c) + 3 if c in self.CHARS else 0 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        def char(i):  # ids past the characters (the tiny model's vocabulary is larger) decode as one mark
            return self.CHARS[i - 3] if 3 <= i < 3 + len(self.CHARS) else "" if i < 3 and skip_special_tokens else "¤"

        return "".join(map(char, ids))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return self.chat_template.format(content=messages[0]["content"])


@pytest.fixture(scope="module")
def tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=2048, pad_token_id=0)
    rng = np.random.RandomState(1)  # numpy, not jax.random: no compilations

    def weights(tree):
        return {k: weights(v) if isinstance(v, dict) else None if v is None else
                np.ones(v, np.float32) if k.endswith("norm") else 0.15 * rng.standard_normal(v).astype(np.float32)
                for k, v in tree.items()}

    params = params_from_dict(jax.tree.map(jnp.asarray, weights(param_shapes(cfg))), cfg)
    return Model(params, cfg, tokenizer)


def text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids))


def test_passkey_prompts_are_deterministic_and_checkable(tokenizer):
    cases = longctx.make_cases("passkey", tokenizer, 400, 5, 2048)
    assert cases == longctx.make_cases("passkey", tokenizer, 400, 5, 2048)  # the same prompts on every run
    assert [c.depth for c in cases] == [0, 0.25, 0.5, 0.75, 1]
    keys = [c.answer for c in cases]
    assert all(re.fullmatch(r"[1-9]\d{4}", k) for k in keys) and len(set(keys)) == 5
    ats = [c.fact_at for c in cases]
    assert ats == sorted(ats) and ats[-1] - ats[0] > 120  # the key moves through the filler with the depth
    for c in cases:
        prompt = text(tokenizer, c.tokens)
        assert 400 - 22 < len(c.tokens) <= 400  # the budget, to within a filler sentence (one token a character)
        assert prompt.startswith(longctx.PASSKEY_TASK + "\n")
        assert prompt.endswith("\n" + longctx.PASSKEY_QUESTION)
        assert text(tokenizer, c.tokens[c.fact_at:]).startswith(f"The pass key is {c.answer}. Remember it. "
                                                                f"{c.answer} is the pass key.\n")
        assert "The grass is green. The sky is blue." in prompt
    key = cases[2].answer
    assert longctx.is_correct(cases[2], f" {key}.") and longctx.is_correct(cases[2], f"The pass key is {key}")
    for wrong in (f"{key[:4]}{(int(key[4]) + 1) % 10}", f"{(int(key[0]) % 9) + 1}{key[1:]}", f"{key}7", f"1{key}",
                  key[:4]):  # the last digit changed, the first (never to 0), a digit more at either end, one less
        assert wrong != key and not longctx.is_correct(cases[2], f" {wrong}."), wrong
    assert not longctx.decided(cases[2], f" {key[:3]}") and longctx.decided(cases[2], f" {key}.")
    chat = longctx.passkey_case(tokenizer, 400, 2, 5, chat=True)
    assert chat.answer == key and text(tokenizer, chat.tokens).startswith("<There is")
    assert text(tokenizer, chat.tokens).endswith(longctx.PASSKEY_QUESTION + ">A:") and len(chat.tokens) <= 400


def test_needle_prompts_are_deterministic_and_checkable(tokenizer):
    hay = np.asarray(tokenizer(PROSE)["input_ids"])
    cases = longctx.make_cases("needle", tokenizer, 500, 4, 2048, hay)
    assert cases == longctx.make_cases("needle", tokenizer, 500, 4, 2048, hay)
    for c in cases:
        prompt = text(tokenizer, c.tokens)
        assert len(c.tokens) == 500 and c.answer in longctx.INGREDIENTS
        fact = text(tokenizer, c.tokens[c.fact_at:])
        dish = re.match(r"The secret ingredient of (.+) is (\w+)\.\n", fact).group(1)
        assert fact.startswith(f"The secret ingredient of {dish} is {c.answer}.\n") and dish in longctx.DISHES
        assert prompt.endswith(f"\n\nWhat is the secret ingredient of {dish}? The secret ingredient of {dish} is")
        assert c.fact_at == 0 or prompt[c.fact_at - 1] == "\n"  # the fact starts a line of the prose
        assert prompt.replace(longctx.NEEDLE_LINE.format(dish=dish, ingredient=c.answer) + "\n", "").startswith(
            PROSE[:200])  # the prose around it is the text's own start
    assert cases[0].fact_at == 0 and cases[-1].fact_at > 250  # the last line start of the ~300 prose tokens
    assert longctx.is_correct(cases[0], f" {cases[0].answer.capitalize()}, of course.")
    assert not longctx.is_correct(cases[0], " nothing at all")


def test_shared_prefill_gives_what_generate_gives(model, spec=SPEC):
    cases = longctx.make_cases("passkey", model.tokenizer, LENGTH, 3, 2048)
    records = longctx.answer_cases(model.params, cases, spec, model.tokenizer, answer_tokens=ANSWER)
    assert sorted(r["shared_tokens"] for r in records) == [0, 512, 1024]  # keys at 0, 50, 100%: 0, 1, 2 chunks shared
    for case, r in zip(cases, sorted(records, key=lambda r: r["index"])):
        if not r["shared_tokens"]:
            continue  # prefilled from the start: nothing shared to check
        alone = generate(model, list(case.tokens), cache=spec, max_new_tokens=ANSWER)
        assert alone.token_ids[: len(r["output_ids"])] == r["output_ids"]  # stopped early at most, once decided
        assert r["output"] == model.tokenizer.decode(r["output_ids"], skip_special_tokens=True)
        assert r["correct"] == longctx.is_correct(case, r["output"])
    assert max(len(r["output_ids"]) for r in records) == ANSWER  # not a model that stops at once


def test_run_writes_each_case_resumes_and_reports(model, tmp_path):
    path = tmp_path / "longctx.jsonl"
    kw = dict(specs=["full", SPEC], tasks=longctx.TASKS, lengths=[(LENGTH, 2)], results_path=str(path),
              tokens=model.tokenizer(PROSE)["input_ids"], documents=1, contexts=CONTEXTS, scored=SCORED,
              answer_tokens=ANSWER)
    first = longctx.run(model, **kw)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 * (2 + 2) + 2 * 2  # two specs: 2 passkey and 2 needle cases, 2 contexts
    assert (tmp_path / "longctx.jsonl.full-1024.npy").exists()
    longdoc = first["longdoc"]
    assert longdoc["full"][1024]["delta_nll"] == 0 and longdoc["full"][1024]["kl_vs_full"] == 0
    quant = longdoc[SPEC][1024]
    assert quant["kl_vs_full"] > 0 and 0 < quant["top1_agree"] <= 1
    assert quant["delta_nll"] == pytest.approx(quant["nll"] - longdoc["full"][1024]["nll"])
    assert all(first["retrieval"][t][s][LENGTH]["cases"] == 2 for t in longctx.RETRIEVAL for s in kw["specs"])

    ran = []
    again = longctx.run(model, **kw, log=ran.append)
    assert path.read_text().splitlines() == lines and not ran  # nothing left to run
    assert json.dumps(again, sort_keys=True) == json.dumps(first, sort_keys=True)

    # killed mid-run: the last case lost, the one before it torn mid-line
    path.write_text("\n".join(lines[:-2] + [lines[-2][:40]]) + "\n")
    (tmp_path / "longctx.jsonl.full-1024.npy").unlink()  # and the reference gone: full runs again, unrecorded
    longctx.run(model, **kw, log=ran.append)
    assert [json.loads(x)["spec"] for x in path.read_text().splitlines()[len(lines) - 1:]] == [SPEC] * 2
    assert any(line.startswith("longdoc full") for line in ran)

    table = longctx.markdown(first)
    assert f"| `{SPEC}` |" in table and "ΔNLL@1024" in table and "passkey (correct of cases)" in table


def test_results_of_another_protocol_are_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"task": "passkey", "spec": "full", "length": 300, "cases": 3, "index": 0,
                                "chunk": 256}) + "\n")
    with pytest.raises(ValueError, match="holds cases of another protocol"):
        longctx.Results(str(path), {"chunk": 512})
    assert len(longctx.Results(str(path), {"chunk": 256, "text": "9 tokens"}).records) == 1  # "text": not recorded


def test_lengths_parse_with_case_counts():
    assert longctx.parse_lengths("1024, 4096,8192:10", 20) == [(1024, 20), (4096, 20), (8192, 10)]
    with pytest.raises(ValueError, match="give LENGTH or LENGTH:CASES"):
        longctx.parse_lengths("4k")


def test_cli_eval_longctx(model, tmp_path, capsys, monkeypatch):
    import kivi_jax

    monkeypatch.setattr(kivi_jax, "load", lambda *args, **kwargs: model)  # the tiny model stands in for a download
    md, png, res, prose = tmp_path / "l.md", tmp_path / "l.png", tmp_path / "l.jsonl", tmp_path / "prose.txt"
    prose.write_text(PROSE)
    code = cli.main(["eval", "longctx", "--model", "tiny", "--text", str(prose), "--cache", "full", "--tasks",
                     "needle", "--lengths", f"{LENGTH}:1", "--results", str(res), "--out", str(md),
                     "--plot", str(png), "--quiet", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    got = json.loads(out.out)
    assert list(got["retrieval"]) == ["needle"] and list(got["retrieval"]["needle"]) == ["full"]
    assert got["retrieval"]["needle"]["full"][str(LENGTH)]["cases"] == 1 and got["text"] == str(prose)
    assert len(res.read_text().splitlines()) == 1 and "| `full` |" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    monkeypatch.setattr(kivi_jax, "load", None)  # reporting the file's cases loads no model and runs nothing
    again = tmp_path / "again.md"
    code = cli.main(["eval", "longctx", "--model", "tiny", "--cache", "full", "--tasks", "needle", "--lengths",
                     f"{LENGTH}:1", "--results", str(res), "--report-only", "--out", str(again), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["retrieval"] == got["retrieval"] and len(res.read_text().splitlines()) == 1
    assert again.read_text().split("\n\n", 1)[1] == md.read_text().split("\n\n", 1)[1]  # the same tables


def test_the_pass_fail_reading_counts_only_lengths_where_full_passes():
    def cases(spec, length, correct, n=20):
        return [{"task": "passkey", "spec": spec, "length": length, "cases": n, "index": i, "depth": i / (n - 1),
                 "prompt_tokens": length, "correct": i < correct} for i in range(n)]

    records = (cases("full", 1024, 20) + cases("a", 1024, 19) + cases("b", 1024, 18)
               + cases("full", 4096, 9) + cases("a", 4096, 2) + cases("b", 4096, 9))
    records += cases("full", 2048, 19) + cases("a", 2048, 18)  # b not run at 2048
    records += [dict(r, task="needle") for r in cases("full", 1024, 17) + cases("a", 1024, 17)]
    rep = longctx.report(records, ["full", "a", "b"], ["passkey", "needle"], [(1024, 20), (2048, 20), (4096, 20)])
    rows = rep["retrieval"]["passkey"]
    assert rows["a"][1024]["within_slack"] and not rows["b"][1024]["within_slack"]  # 1 case lost of 20, and 2
    assert rows["full"][1024]["reading"] and not rows["full"][4096]["reading"]  # full at 45%: out of the reading
    assert rows["b"][1024]["wrong_depths"] == [round(18 / 19, 3), 1.0]
    table = longctx.markdown(rep)
    assert "| `a` | 19/20 | 18/20 | 2/20 |" in table and "| `b` | 18/20 |  | 9/20 |" in table
    assert ("(the pass/fail reading): 1024, 2048; within 1 case in 20 of full there: `a` yes; `b` no (at 1024) "
            "(2048 not run)") in table
    assert "(the pass/fail reading): none, so no cache is judged on this task" in table  # the needle: full at 85%
    plus = longctx.spec_name(longctx.parse_cache_spec("kivi2+"))
    assert longctx.label(plus) == f"kivi2+ = {plus}" and longctx.label("k2v2-g16-r32") == "k2v2-g16-r32"


def test_caches_are_placed_as_the_params_are():
    fresh = {"k": jnp.zeros(3), "length": jnp.zeros(1, jnp.int32)}
    assert not any(x.committed for x in jax.tree.leaves(longctx.placed_like({"w": jnp.ones(2)}, fresh)))
    loaded = {"w": jax.device_put(jnp.ones(2), jax.devices()[0])}  # as loaded weights are
    placed = longctx.placed_like(loaded, fresh)
    assert all(x.committed for x in jax.tree.leaves(placed))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(fresh)))
