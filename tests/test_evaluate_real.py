"""SmolLM2 through the cache, one window of the pydoc prose: KIVI's axes beat the flipped ones clearly."""

import pytest

from kivi_jax import evaluate

pytestmark = pytest.mark.real_model


def test_flipped_axes_lose_clearly_more_than_kivi(smollm2):
    model = smollm2
    tokens = evaluate.tokenize(model.tokenizer, evaluate.default_text())
    windows = evaluate.make_windows(tokens, 512, 128, 1)
    results = evaluate.evaluate(model.params, windows, 512, ["kivi2", "k2v2-g32-r128-ktok-vchan"])
    full = results["full"]["nll"]
    kivi = results["k2v2-g32-r128"]["nll"] - full
    flipped = results["k2v2-g32-r128-ktok-vchan"]["nll"] - full
    # measured (Python 3.11.7's pydoc prose, 2-core CPU, float32): kivi2 +0.135, flipped +0.464
    assert 0.05 < kivi < 0.25
    assert flipped > 2 * kivi and flipped - kivi > 0.2
