"""generate(): greedy parity with transformers, ragged batches, sampling, streaming and its errors."""

import numpy as np
import pytest

import kivi_jax
from conftest import TINY_CONFIGS, TINY_VOCAB, torch_threads
from kivi_jax.cache import CacheCapacityError


@pytest.fixture(scope="module")
def tiny_models(tiny_dirs):
    return {name: (kivi_jax.load(str(path)), model) for name, (path, model) in tiny_dirs.items()}


def prompts(seed: int, lengths):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, TINY_VOCAB, n).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_greedy_generation_matches_transformers(tiny_models, name):
    torch = torch_threads()
    ours, hf = tiny_models[name]
    prompt = prompts(0, [13])[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=0)
    ref_new = ref[0, len(prompt):].tolist()
    gen = kivi_jax.generate(ours, prompt, max_new_tokens=32, cache="full")
    assert gen.token_ids == ref_new
    assert len(ref_new) >= 20  # the comparison covers many steps (crossing the Mistral window of 11)


def test_ragged_batch_gives_each_sequence_what_it_gives_alone(tiny_models):
    model, _ = tiny_models["mistral_window"]
    batch = prompts(1, [5, 17, 30])
    together = kivi_jax.generate(model, batch, max_new_tokens=24, cache="full", stop_at_eos=False)
    for p, seq in zip(batch, together.token_ids):
        alone = kivi_jax.generate(model, p, max_new_tokens=24, cache="full", stop_at_eos=False)
        assert alone.token_ids == seq
    assert together.prompt_tokens == [5, 17, 30]
    assert together.new_tokens == [24, 24, 24]


def test_text_prompts_chat_template_and_stream(tiny_models):
    model, _ = tiny_models["llama_mha"]
    gen = kivi_jax.generate(model, "hello", max_new_tokens=8, cache="full", stop_at_eos=False)
    assert isinstance(gen.text, str) and gen.new_tokens == 8
    assert gen.text == model.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    chat = kivi_jax.generate(model, "hello", chat=True, max_new_tokens=8, cache="full", stop_at_eos=False)
    assert chat.prompt_tokens == len("[hello]>")
    steps = list(kivi_jax.stream(model, "hello", max_new_tokens=8, cache="full", stop_at_eos=False))
    assert [int(s.tokens[0]) for s in steps] == gen.token_ids
    assert steps[-1].done.all() and not steps[0].done.any()


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny_models):
    model, _ = tiny_models["llama_mha"]
    p = prompts(2, [7])[0]
    kw = dict(max_new_tokens=16, cache="full", stop_at_eos=False)
    a = kivi_jax.generate(model, p, temperature=1.0, seed=3, **kw).token_ids
    b = kivi_jax.generate(model, p, temperature=1.0, seed=3, **kw).token_ids
    c = kivi_jax.generate(model, p, temperature=1.0, seed=4, **kw).token_ids
    assert a == b and a != c
    greedy = kivi_jax.generate(model, p, **kw).token_ids
    assert kivi_jax.generate(model, p, temperature=0.7, top_k=1, seed=5, **kw).token_ids == greedy
    assert kivi_jax.generate(model, p, temperature=0.7, top_p=1e-6, seed=6, **kw).token_ids == greedy


def test_generation_stops_at_eos(tiny_models):
    model, _ = tiny_models["llama_mha"]
    p = prompts(3, [9])[0]
    free = kivi_jax.generate(model, p, max_new_tokens=40, cache="full", stop_at_eos=False).token_ids
    eos_at = free.index(free[5])  # pretend the 6th token's id is the EOS
    params = model.params.replace(config=model.params.config.__class__(
        **{**model.params.config.__dict__, "eos_token_ids": (free[5],)}))
    stopped = kivi_jax.generate(params, p, max_new_tokens=40, cache="full").token_ids
    assert stopped == free[: eos_at + 1]


def test_bad_input_is_answered_clearly(tiny_models):
    model, _ = tiny_models["llama_mha"]
    with pytest.raises(CacheCapacityError, match="needs 60 tokens, but max_length=32"):
        kivi_jax.generate(model, prompts(0, [50])[0], max_new_tokens=10, max_length=32)
    with pytest.raises(CacheCapacityError, match="exceed the model's 512 positions"):
        kivi_jax.generate(model, prompts(0, [500])[0], max_new_tokens=20)
    with pytest.raises(ValueError, match="empty prompt"):
        kivi_jax.generate(model, "", max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        kivi_jax.generate(model, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        kivi_jax.generate(model.params, "hi", max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        kivi_jax.generate(model, [5, TINY_VOCAB + 7], max_new_tokens=4)
    with pytest.raises(ValueError, match="bad cache spec"):
        kivi_jax.generate(model, "hi", cache="k5v2")


def test_kivi_generation_warns_when_float16_scales_overflow(tiny_models):
    model, _ = tiny_models["llama_mha"]
    # Keys beyond float16's range: scale the key projection so |k| ~ 1e6.
    params = model.params.replace(layers=model.params.layers.replace(wk=model.params.layers.wk * 1e7))
    p = prompts(4, [40])[0]
    with pytest.warns(RuntimeWarning, match="overflowed float16.*-sf32"):
        gen = kivi_jax.generate(params, p, max_new_tokens=4, cache="k2v2-g16-r32", stop_at_eos=False)
    assert gen.overflow
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        safe = kivi_jax.generate(params, p, max_new_tokens=4, cache="k2v2-g16-r32-sf32", stop_at_eos=False)
    assert not safe.overflow
