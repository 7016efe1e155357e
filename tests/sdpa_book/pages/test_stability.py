"""The logit and entropy probes of the page *QK-norm and soft-capping*."""

import numpy as np
import pytest

import sdpa
from sdpa.nn import DecoderLM, layer_norm, softcap
from sdpa_book.pages.stability import AttentionProbe, attention_entropy, attention_logits


def _model(rng, **options):
    # every size different: V 11, E 12, Hq 3 (Dk 4), Hkv 1, 2 blocks, max_len 7
    return DecoderLM(
        vocab_size=11,
        d_model=12,
        n_layers=2,
        n_heads=3,
        max_len=7,
        rng=rng,
        **options,
    )


def test_logits_of_the_first_block_match_a_hand_computation(rng):
    model = _model(rng)
    tokens = rng.integers(11, size=(2, 5))
    p = model.params
    h = layer_norm(
        p["token_embedding"][tokens], p["blocks.0.attn_norm.weight"], p["blocks.0.attn_norm.bias"]
    )  # (B, T, E)
    q = sdpa.apply_rotary_embedding(sdpa.split_heads(h @ p["blocks.0.attn.w_q"], 3), np.arange(5))
    k = sdpa.apply_rotary_embedding(sdpa.split_heads(h @ p["blocks.0.attn.w_k"], 3), np.arange(5))
    expected = np.einsum("bhtd,bhsd->bhts", q, k) / np.sqrt(4)  # (B, H, T, S)
    z = attention_logits(model, tokens)[0]
    allowed = np.tril(np.ones((5, 5), dtype=bool))
    np.testing.assert_allclose(z[..., allowed], expected[..., allowed], rtol=1e-12)
    assert np.all(np.isneginf(z[..., ~allowed]))


@pytest.mark.parametrize(
    "options",
    [{}, {"qk_norm": True}, {"n_kv_heads": 1}, {"attn_softcap": 2.0, "qk_norm": True}],
)
def test_softmax_of_the_logits_is_the_models_attention(rng, options):
    model = _model(rng, **options)
    tokens = rng.integers(11, size=(3, 6))
    logits = attention_logits(model, tokens)
    _, weights = model.forward(tokens, return_attention=True)
    cap = options.get("attn_softcap")
    assert len(logits) == len(weights) == 2
    for z, w in zip(logits, weights):
        assert z.shape == (3, 3, 6, 6)
        capped = z if cap is None else np.where(np.isfinite(z), softcap(z, cap), -np.inf)
        np.testing.assert_allclose(sdpa.softmax(capped, axis=-1), w, rtol=1e-10, atol=1e-12)


def test_logits_leave_the_model_as_it_was(rng):
    model = _model(rng)
    tokens = rng.integers(11, size=(1, 4))
    before = model.forward(tokens)
    attention_logits(model, tokens)
    np.testing.assert_array_equal(model.forward(tokens), before)
    with pytest.raises(ValueError, match="token ids"):
        attention_logits(model, np.array([[99]]))


def test_entropy_hand_values():
    weights = np.array([[1.0, 0.0, 0.0, 0.0], [0.25] * 4, [0.5, 0.25, 0.25, 0.0]])
    np.testing.assert_allclose(
        attention_entropy(weights), [0.0, np.log(4), 1.5 * np.log(2)], rtol=1e-15, atol=0
    )
    assert attention_entropy(np.zeros((2, 3, 5))).shape == (2, 3)


def test_probe_records_at_step_one_and_every_k_steps(rng):
    model = _model(rng)
    tokens = rng.integers(11, size=(2, 7))
    probe = AttentionProbe(tokens, every=3)
    for step in range(1, 8):
        probe(step, model, float(step))
    assert probe.steps == [1, 3, 6]
    assert probe.loss == [1.0, 3.0, 6.0]
    expected = [np.abs(z[np.isfinite(z)]).max() for z in attention_logits(model, tokens)]
    np.testing.assert_allclose(probe.max_logit[-1], expected)
    _, weights = model.forward(tokens, return_attention=True)
    entropy = attention_entropy(weights[1][:, :, 1:])  # queries 1.. of block 1: (B, H, T - 1)
    np.testing.assert_allclose(probe.entropy[-1][1], entropy.mean(axis=(0, 2)))
    assert probe.entropy[-1].shape == (2, 3)
