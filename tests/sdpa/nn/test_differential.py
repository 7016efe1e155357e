"""sdpa.nn.DecoderLM's ``differential`` option: differential attention (Ye et al. 2024).

The loss gradient against central finite differences; the logits against a float64 loop over
positions written here from the paper's formulas; generation with and without the KV cache;
the differential maps' rows; the plain parameters as the plain model's; every bad config.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from nn_checks import assert_grads_match_differences

from sdpa import apply_rotary_embedding, nn

V, E, MAX_LEN = 7, 8, 6
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")

CONFIGS = {
    "rope-layer": {},
    "four-heads-qk_norm-gate-rms": dict(n_heads=4, qk_norm=True, output_gate=True, norm="rms"),
    "learned-attention-only-capped-logits": dict(
        positional="learned", attention_only=True, logit_softcap=1.5
    ),
}


def make_model(seed=0, **overrides):
    """A float64 model with random norm gains and larger lambda vectors, so that no gradient
    is tested at a special point."""
    config = dict(vocab_size=V, d_model=E, n_layers=2, n_heads=2, d_ff=12, max_len=MAX_LEN)
    model = nn.DecoderLM(rng=np.random.default_rng(seed), differential=True, **config | overrides)
    rng = np.random.default_rng(seed + 1)
    for name, p in model.params.items():
        if "norm" in name or "lambda" in name:
            p += 0.3 * rng.standard_normal(p.shape)
    return model


@pytest.fixture
def batch(rng):
    return rng.integers(0, V, size=(2, 5)), rng.integers(0, V, size=(2, 5))


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_loss_and_grads_match_finite_differences(config, batch):
    entries = lambda name: (8, 8) if "lambda" in name else (2, 2)  # noqa: E731
    assert_grads_match_differences(make_model(**config), *batch, entries)


def test_every_lambda_entry_gets_a_gradient(batch):
    _, grads = make_model().loss_and_grads(*batch)
    names = [n for n in grads if "lambda" in n]
    assert len(names) == 8
    assert all(np.all(grads[n] != 0) for n in names)


def loop_logits(model, tokens):
    """The model's logits, one position and one key at a time in float64 (attention-only,
    RoPE, layer norm), from the paper's formulas: two softmax maps per pair of heads, their
    difference with lam = exp(lq1.lk1) - exp(lq2.lk2) + 0.8 - 0.6 exp(-0.3 (l - 1)) for the
    l-th layer, the values of the pair side by side, RMS norm (eps 1e-5) times 1 - lam_init."""
    P, Dk, T = model.params, model.head_dim, len(tokens)
    x = P["token_embedding"][tokens].astype(np.float64)
    for i in range(model.n_layers):
        p = f"blocks.{i}.attn"
        h = nn.layer_norm(x, P[f"blocks.{i}.attn_norm.weight"], P[f"blocks.{i}.attn_norm.bias"])
        lam_init = 0.8 - 0.6 * math.exp(-0.3 * (i + 1 - 1))
        lq1, lk1, lq2, lk2 = (P[f"{p}.{n}"] for n in LAMBDAS)
        lam = math.exp(lq1 @ lk1) - math.exp(lq2 @ lk2) + lam_init
        heads = np.zeros((T, model.n_heads * Dk))
        for j in range(model.n_heads // 2):
            proj = {}
            for n, w in (("q", "w_q"), ("k", "w_k"), ("v", "w_v")):
                for half in (0, 1):
                    cols = slice((2 * j + half) * Dk, (2 * j + half + 1) * Dk)
                    y = h @ P[f"{p}.{w}"][:, cols]
                    proj[n, half] = apply_rotary_embedding(y, np.arange(T)) if n != "v" else y
            value = np.concatenate([proj["v", 0], proj["v", 1]], axis=-1)  # (T, 2 Dk)
            for t in range(T):
                maps = []
                for half in (0, 1):
                    z = [
                        proj["q", half][t] @ proj["k", half][s] / math.sqrt(Dk)
                        for s in range(t + 1)
                    ]
                    e = [math.exp(zs - max(z)) for zs in z]
                    maps.append([es / sum(e) for es in e])
                o = sum((maps[0][s] - lam * maps[1][s]) * value[s] for s in range(t + 1))
                o = o / math.sqrt(np.mean(o**2) + 1e-5) * (1 - lam_init)
                heads[t, 2 * j * Dk : (2 * j + 2) * Dk] = o
        x = x + heads @ P[f"{p}.w_o"]
    h = nn.layer_norm(x, P["final_norm.weight"], P["final_norm.bias"])
    return h @ P["unembedding"]


@pytest.mark.parametrize("n_heads", [2, 4])
def test_logits_match_a_float64_loop(rng, n_heads):
    model = make_model(n_heads=n_heads, attention_only=True)
    tokens = rng.integers(0, V, size=MAX_LEN)
    np.testing.assert_allclose(
        model.forward(tokens), loop_logits(model, tokens), rtol=1e-10, atol=1e-12
    )


def test_maps_are_the_difference_of_two_softmax_maps(rng):
    """return_attention gives A1 - lam A2 per pair of heads: each row sums to 1 - lam, and the
    two maps are the softmax of the scores of heads 2j and 2j + 1 (return_scores)."""
    model = make_model(n_heads=4)
    tokens = rng.integers(0, V, size=(3, MAX_LEN))
    _, maps, scores = model.forward(tokens, return_attention=True, return_scores=True)
    for i, (d, z) in enumerate(zip(maps, scores)):
        P = {n: model.params[f"blocks.{i}.attn.{n}"] for n in LAMBDAS}
        lam = (
            math.exp(P["lambda_q1"] @ P["lambda_k1"])
            - math.exp(P["lambda_q2"] @ P["lambda_k2"])
            + 0.8
            - 0.6 * math.exp(-0.3 * i)
        )
        assert d.shape == (3, 2, MAX_LEN, MAX_LEN)
        np.testing.assert_allclose(d.sum(axis=-1), 1 - lam, rtol=1e-12)
        a = np.exp(z - z.max(axis=-1, keepdims=True))
        a /= a.sum(axis=-1, keepdims=True)
        np.testing.assert_allclose(d, a[:, 0::2] - lam * a[:, 1::2], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_generation_with_and_without_the_cache_agree(config):
    model = make_model(**config)
    prompt = np.array([[1, 2], [3, 0]])
    cached = model.generate(prompt, 4, temperature=0)
    np.testing.assert_array_equal(cached, model.generate(prompt, 4, temperature=0, use_cache=False))


def test_the_plain_parameters_are_the_plain_models():
    """The lambda vectors are drawn after every other parameter, normal with std 0.1."""
    config = dict(vocab_size=V, d_model=E, n_layers=3, n_heads=2, max_len=MAX_LEN)
    plain = nn.DecoderLM(rng=np.random.default_rng(5), **config)
    diff = nn.DecoderLM(rng=np.random.default_rng(5), differential=True, **config)
    assert [n for n in diff.params if n not in plain.params] == [
        f"blocks.{i}.attn.{n}" for i in range(3) for n in LAMBDAS
    ]
    for name, p in plain.params.items():
        np.testing.assert_array_equal(diff.params[name], p)
    lams = np.concatenate([p for n, p in diff.params.items() if "lambda" in n])
    assert 0.03 < lams.std() < 0.3


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(n_heads=1), "even n_heads"),
        (dict(n_heads=4, n_kv_heads=2), "n_kv_heads == n_heads"),
        (dict(sink=True), "sink"),
        (dict(attn_softcap=5.0), "attn_softcap"),
    ],
)
def test_bad_configs_raise(bad, match):
    config = dict(vocab_size=V, d_model=E, n_layers=1, n_heads=2, max_len=MAX_LEN)
    with pytest.raises(ValueError, match=match):
        nn.DecoderConfig(differential=True, **config | bad)


def test_differential_must_be_a_bool():
    with pytest.raises(TypeError, match="differential"):
        nn.DecoderConfig(vocab_size=V, d_model=E, n_layers=1, n_heads=2, max_len=4, differential=1)
