"""Multi-turn chat on a live cache, cache save/restore, and the `kivi-jax chat` REPL."""

import io
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import kivi_jax
from kivi_jax.chat import Chat, ConversationFullError
from kivi_jax.checkpoint import CheckpointError
from kivi_jax.models.llama import cast_params

# A template whose rendering of the history extends what the cache holds (as real chat templates do).
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def model(tiny_dirs):
    m = kivi_jax.load(str(tiny_dirs["llama_gqa_llama3"][0]))
    m.tokenizer.chat_template = TEMPLATE
    return m


def test_turn_two_appended_to_the_kept_cache_equals_prefilling_both_turns_at_once(model):
    chat = Chat(model, cache="full", max_new_tokens=12)
    chat.send("hello there")
    held = len(chat.ids)
    chat.send("and again")
    assert chat.reprefills == 0 and chat.last_turn["new_tokens"] == len(chat.ids) - held - len(
        chat.last_turn["reply_ids"])  # only turn 2's own tokens were prefilled
    reply = chat.last_turn["reply_ids"]
    prefix = chat.ids[: len(chat.ids) - len(reply)]
    once = kivi_jax.generate(model, prefix, max_new_tokens=len(reply) + 1, cache="full")
    assert len(reply) >= 4 and once.token_ids[: len(reply)] == reply


def test_a_turn_that_overflows_grows_the_cache_with_the_same_numbers(model):
    small = Chat(model, cache="k2v2-g16-r32", max_new_tokens=10, max_length=32)
    big = Chat(model, cache="k2v2-g16-r32", max_new_tokens=10, max_length=512)
    for text in ("a fairly long first message to fill things", "and a second one"):
        assert small.send(text) == big.send(text)
    assert small.cache.max_tokens > 32 and small.ids == big.ids
    stats = small.stats()
    assert stats["tokens"] == len(small.ids) and stats["keys_quantized"] == len(small.ids) // 32 * 32
    assert stats["cache_bytes"] < stats["full_precision_bytes"]


def test_past_the_model_positions_the_conversation_is_full(model):
    chat = Chat(model, cache="full", max_new_tokens=8)
    with pytest.raises(ConversationFullError, match=r"the conversation is full: it holds 0 tokens and this turn "
                                                     r"needs up to \d+ more .* past the 512 positions"):
        chat.send("x" * 600)


def test_save_restore_continues_exactly_and_mismatches_say_what_differs(model, tiny_dirs, tmp_path):
    from kivi_jax.cache_io import _meta_sha

    straight = Chat(model, cache="k2v2-g16-r32", max_new_tokens=10)
    straight.send("remember this sentence please")
    saved = Chat(model, cache="k2v2-g16-r32", max_new_tokens=10)
    saved.send("remember this sentence please")
    saved.save(tmp_path / "c")
    resumed = Chat(model, cache="k2v2-g16-r32", max_new_tokens=10)
    resumed.load(tmp_path / "c")
    assert resumed.send("what was it") == straight.send("what was it") and resumed.ids == straight.ids

    with pytest.raises(CheckpointError, match=r"holds a 'k2v2-g16-r32' cache, not 'full'"):
        Chat(model, cache="full").load(tmp_path / "c")
    other = kivi_jax.load(str(tiny_dirs["llama_mha"][0]))
    with pytest.raises(CheckpointError, match=r"belongs to another model: its config differs in num_kv_heads"):
        kivi_jax.restore_cache(tmp_path / "c", other.params)
    with pytest.raises(CheckpointError, match="already exists"):
        saved.save(tmp_path / "c")
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "c", broken)
    meta = json.loads((broken / "cache.json").read_text())
    meta["sha256"][next(iter(meta["sha256"]))] = "0" * 64
    meta["meta_sha256"] = _meta_sha(meta)  # as if the leaf, not cache.json, had changed
    (broken / "cache.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        kivi_jax.restore_cache(broken, model.params)
    truncated = tmp_path / "truncated"
    shutil.copytree(tmp_path / "c", truncated)
    for f in sorted((truncated / "arrays").rglob("*")):
        if f.is_file() and f.stat().st_size > 64:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        kivi_jax.restore_cache(truncated, model.params)
    (broken / "cache.json").unlink()
    with pytest.raises(CheckpointError, match="is not a kivi_jax cache save"):
        kivi_jax.restore_cache(broken, model.params)


def test_a_damaged_or_mismatched_save_says_which_it_is(model, tmp_path, capfd):
    from kivi_jax.cache_io import _meta_sha  # what a save writes over its cache.json

    for spec in ("k2v2-g16-r32", "k2v2-g16-r32-rotv"):
        Chat(model, cache=spec).save(tmp_path / spec)  # an empty conversation will do
    # another spec, rotated or not: the spec is what differs (the rotated params' weights differ too)
    with pytest.raises(CheckpointError, match=r"holds a 'k2v2-g16-r32' cache, not 'k2v2-g16-r32-rotv'"):
        Chat(model, cache="k2v2-g16-r32-rotv").load(tmp_path / "k2v2-g16-r32")
    with pytest.raises(CheckpointError, match=r"holds a 'k2v2-g16-r32-rotv' cache, not 'k2v2-g16-r32'"):
        Chat(model, cache="k2v2-g16-r32").load(tmp_path / "k2v2-g16-r32-rotv")
    kivi_jax.restore_cache(tmp_path / "k2v2-g16-r32-rotv", model.params)  # the model's own params, prepared here
    with pytest.raises(CheckpointError, match="saved with the model in float32, this model runs in bfloat16"):
        kivi_jax.restore_cache(tmp_path / "k2v2-g16-r32", cast_params(model.params, jnp.bfloat16))

    def edited(name, edit, resum):
        path = tmp_path / name
        shutil.copytree(tmp_path / "k2v2-g16-r32", path)
        meta = json.loads((path / "cache.json").read_text())
        edit(meta)
        if resum:
            meta["meta_sha256"] = _meta_sha(meta)
        (path / "cache.json").write_text(json.dumps(meta))
        return path

    # an edited cache.json is corruption, not another model
    weights = edited("weights", lambda m: m["model"].update(weights_sha256="0" * 64), resum=False)
    with pytest.raises(CheckpointError, match="cache.json is corrupt: its contents do not match"):
        kivi_jax.restore_cache(weights, model.params)
    weights = edited("weights2", lambda m: m["model"].update(weights_sha256="0" * 64), resum=True)
    with pytest.raises(CheckpointError, match="belongs to another model: the same architecture with different weights"):
        kivi_jax.restore_cache(weights, model.params)
    # a conversation without one of its keys: a clear error, not a KeyError
    nokey = edited("nokey", lambda m: m["metadata"].pop("cache_text"), resum=True)
    with pytest.raises(CheckpointError, match="metadata lacks cache_text"):
        Chat(model, cache="k2v2-g16-r32").load(nokey)
    # truncated array files: found before orbax reads them (which printed "Event loop is closed" tracebacks)
    truncated = tmp_path / "truncated"
    shutil.copytree(tmp_path / "k2v2-g16-r32", truncated)
    for f in sorted((truncated / "arrays").rglob("*")):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    capfd.readouterr()
    with pytest.raises(CheckpointError, match=r"is truncated or corrupt: arrays/.*d/\w+ has \d+ bytes, the save wrote"):
        Chat(model, cache="k2v2-g16-r32").load(truncated)
    assert "Traceback" not in capfd.readouterr().err


def test_the_chat_repl_reads_piped_stdin(model, tiny_dirs, tmp_path, monkeypatch, capsys):
    from kivi_jax import cli

    path = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama_gqa_llama3"][0], path)
    model.tokenizer.save_pretrained(str(path))  # with the test template
    script = f"hi\n/stats\n/save {tmp_path / 's'}\n/load {tmp_path / 'nowhere'}\n/nonsense\n/reset\n/stats\nagain\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert cli.main(["chat", "--model", str(path), "--cache", "full", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    stats = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert stats[0]["turns"] == 1 and stats[0]["tokens"] > 0 and stats[1]["tokens"] == 0
    assert "(conversation reset)" in out and "unknown command /nonsense" in err
    assert "is not a kivi_jax cache save" in err  # a bad /load is reported and the REPL goes on
    assert (tmp_path / "s" / "cache.json").is_file()


@pytest.mark.real_model
def test_the_real_model_recalls_a_fact_from_turn_one_through_a_kivi2_cache(smollm2):
    from kivi_jax.evaluate import default_text

    model = smollm2
    background = default_text()[20000:21500]  # enough text that turn 1 runs past the 128-token residual
    chat = Chat(model, cache="kivi2", max_new_tokens=24)
    chat.send(f"My name is Ada and my favourite fruit is the mango. Here is some text to read:\n{background}\n"
              "Just say OK.")
    assert chat.stats()["keys_quantized"] >= 256  # the fact now lives in 2-bit codes
    answer = chat.send("What is my favourite fruit? Answer in one word.")
    assert "mango" in answer.lower(), answer
