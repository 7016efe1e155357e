"""sdpa.nn.generation through sdpa.nn.DecoderLM.generate: with and without the KV cache in every
configuration, greedy decoding against the argmax of the forward pass, sampling against the
softmax of the logits over the temperature (frequencies within four standard deviations), top-k
and ties by the lowest token id on a model whose logits are set by hand, and every ``raise`` of
generate's arguments.

The module has no public names: DecoderLM.generate is its interface.
"""

from __future__ import annotations

import numpy as np
import pytest
from nn_checks import LM_CONFIGS as CONFIGS
from nn_checks import LM_SIZES, make_model

V, E = LM_SIZES["vocab_size"], LM_SIZES["d_model"]


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.0, top_k=3), dict(temperature=0.7)],
    ids=["greedy", "top3", "t0.7"],
)
def test_generation_with_and_without_cache_agree(config, sampling, rng):
    model = make_model(**config)
    prompt = rng.integers(0, V, size=(2, 2))
    runs = [
        model.generate(prompt, 4, rng=np.random.default_rng(5), use_cache=use_cache, **sampling)
        for use_cache in (True, False)
    ]
    assert runs[0].shape == (2, 6)
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0][:, :2], prompt)


def test_greedy_generation_follows_the_argmax(rng):
    model = make_model(**CONFIGS["sinusoidal-rms"])
    out = model.generate(np.array([3]), 5, temperature=0)
    for t in range(1, 6):
        assert out[t] == np.argmax(model.forward(out[:t])[-1])


def test_top_1_sampling_is_greedy(rng):
    model = make_model()
    prompt = np.array([1, 2])
    greedy = model.generate(prompt, 4, temperature=0)
    np.testing.assert_array_equal(
        model.generate(prompt, 4, temperature=2.0, top_k=1, rng=rng), greedy
    )


def test_sampling_follows_the_model_distribution():
    """With one new token, the sampled frequencies match softmax(logits / temperature)."""
    model = make_model(seed=3)
    prompt = np.zeros((4000, 3), dtype=int)
    samples = model.generate(prompt, 1, temperature=1.5, rng=np.random.default_rng(0))[:, -1]
    z = model.forward(prompt[0])[-1] / 1.5
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    freq = np.bincount(samples, minlength=V) / len(samples)
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(p * (1 - p) / len(samples)).max())


def model_with_logits(logits):
    """A model whose next-token logits are exactly ``logits`` after any prompt: the final
    layer norm has gain 0 and bias e_0, so the stream becomes e_0 at every position, and row 0
    of the unembedding is ``logits``."""
    model = make_model(norm="layer")
    model.params["final_norm.weight"][...] = 0.0
    model.params["final_norm.bias"][...] = np.eye(E)[0]
    model.params["unembedding"][...] = 0.0
    model.params["unembedding"][0] = logits
    np.testing.assert_array_equal(model.forward(np.array([4, 1]))[-1], logits)
    return model


TIED = [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, -1.0]  # tokens 1, 2 and 4 tie for the largest logit


N_SAMPLES = 600


def next_tokens(model, **sampling):
    prompt = np.zeros((N_SAMPLES, 1), dtype=int)
    return model.generate(prompt, 1, rng=np.random.default_rng(7), **sampling)[:, -1]


def assert_frequencies(samples, p):
    """The sampled frequencies of the tokens are p, within four standard deviations."""
    freq = np.bincount(samples, minlength=V) / len(samples)
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(0.25 / len(samples)))


@pytest.mark.parametrize(
    "top_k, kept",
    [(1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (4, [1, 2, 4, 5]), (7, list(range(V)))],
)
def test_top_k_keeps_exactly_k_tokens_and_breaks_ties_by_the_lowest_id(top_k, kept):
    """Tokens 1, 2 and 4 tie for the largest logit: top_k = 2 keeps 1 and 2 only (not all
    three), and they are sampled in proportion to exp(logit) among the kept ones."""
    samples = next_tokens(model_with_logits(TIED), temperature=1.0, top_k=top_k)
    weights = np.zeros(V)
    weights[kept] = np.exp(np.array(TIED)[kept])  # softmax restricted to the kept tokens
    assert set(np.unique(samples)) == set(kept)
    assert_frequencies(samples, weights / weights.sum())


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30])
def test_a_tiny_temperature_is_greedy(temperature, rng):
    """logits / 5e-324 overflow; as the temperature tends to 0, sampling tends to the argmax."""
    logits = [1.0, 2.5, 3.0, 0.0, 2.999, 2.0, -1.0]
    samples = next_tokens(model_with_logits(logits), temperature=temperature)
    np.testing.assert_array_equal(samples, np.full(N_SAMPLES, 2))
    model = make_model()  # random logits, several steps: the greedy continuation
    prompt = rng.integers(0, V, size=(3, 2))
    np.testing.assert_array_equal(
        model.generate(prompt, 4, temperature=temperature, rng=rng),
        model.generate(prompt, 4, temperature=0),
    )


def test_ties_for_the_largest_logit():
    """Greedy takes the lowest id among the tied largest logits; sampling, at any temperature
    > 0 (however small), gives them equal chances, the limit of softmax(logits / t)."""
    model = model_with_logits(TIED)
    assert set(next_tokens(model, temperature=0)) == {1}
    third = np.array([0, 1, 1, 0, 1, 0, 0]) / 3
    assert_frequencies(next_tokens(model, temperature=5e-324), third)
    assert_frequencies(next_tokens(model, temperature=1e-3, top_k=3), third)


def test_zero_new_tokens_returns_the_prompt():
    np.testing.assert_array_equal(make_model().generate(np.array([1, 2]), 0, temperature=0), [1, 2])


# ---------------------------------------------------------------------------------------------
# Errors: one test per raise
# ---------------------------------------------------------------------------------------------


def test_max_new_tokens_must_be_an_integer():
    with pytest.raises(TypeError, match="max_new_tokens must be a non-negative integer; got 2.0"):
        make_model().generate(np.array([1]), 2.0)


def test_generation_must_fit_max_len():
    with pytest.raises(
        ValueError, match="the prompt's T0=2 tokens plus max_new_tokens=5 exceed max_len=6"
    ):
        make_model().generate(np.array([1, 2]), 5)


def test_temperature_must_be_real():
    with pytest.raises(TypeError, match="temperature must be a real number; got None"):
        make_model().generate(np.array([1]), 2, temperature=None)


@pytest.mark.parametrize("temperature", [-0.5, np.inf])
def test_temperature_must_be_finite_and_non_negative(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        make_model().generate(np.array([1]), 2, temperature=temperature)


def test_top_k_must_be_an_integer():
    with pytest.raises(TypeError, match="top_k must be a non-negative integer; got 2.5"):
        make_model().generate(np.array([1]), 2, top_k=2.5, rng=np.random.default_rng(0))


@pytest.mark.parametrize("top_k", [0, V + 1])
def test_top_k_range(top_k):
    with pytest.raises(
        ValueError, match=rf"top_k must be in \[1, vocab_size=7\] or None; got {top_k}"
    ):
        make_model().generate(np.array([1]), 2, top_k=top_k, rng=np.random.default_rng(0))


def test_sampling_needs_rng():
    with pytest.raises(TypeError, match=r"sampling \(temperature > 0\) needs rng="):
        make_model().generate(np.array([1]), 2)


def test_rng_of_generate_must_be_a_generator():
    with pytest.raises(TypeError, match="rng must be a numpy.random.Generator"):
        make_model().generate(np.array([1]), 2, rng=np.random.RandomState(0))


def test_use_cache_must_be_bool():
    with pytest.raises(TypeError, match="use_cache must be a bool; got 'no'"):
        make_model().generate(np.array([1]), 2, temperature=0, use_cache="no")
