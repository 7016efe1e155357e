"""The logit and entropy probes of the page *QK-norm and soft-capping*."""

import numpy as np
import pytest

import sdpa
from sdpa.nn import DecoderLM, layer_norm, softcap
from sdpa_book.pages.stability import (
    AttentionProbe,
    QKClip,
    RecipeBatches,
    attention_entropy,
    attention_logits,
)


def _model(rng, **options):
    # every size different: V 11, E 12, Hq 3 (Dk 4), Hkv 1, 2 blocks, max_len 7
    return DecoderLM(
        vocab_size=11,
        d_model=12,
        n_heads=3,
        max_len=7,
        rng=rng,
        **({"n_layers": 2} | options),
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


# -- QK-clip ------------------------------------------------------------------------------------


def _head_logit_max(model, tokens):
    """(Hq,) largest logit per head of block 0, in a float64 loop over the batch, queries and
    keys, independent of attention_logits: the layer norm, RoPE and dot products written out."""
    p, Dk, T = model.params, model.head_dim, tokens.shape[1]
    h = layer_norm(
        p["token_embedding"][tokens], p["blocks.0.attn_norm.weight"], p["blocks.0.attn_norm.bias"]
    )
    group = model.n_heads // model.n_kv_heads
    rows = []
    for head in range(model.n_heads):
        q = h @ p["blocks.0.attn.w_q"][:, head * Dk : (head + 1) * Dk]
        k = h @ p["blocks.0.attn.w_k"][:, head // group * Dk : (head // group + 1) * Dk]
        q = sdpa.apply_rotary_embedding(q, np.arange(T))
        k = sdpa.apply_rotary_embedding(k, np.arange(T))
        pairs = [(b, t, s) for b in range(len(tokens)) for t in range(T) for s in range(t + 1)]
        rows.append(max(q[b, t] @ k[b, s] / np.sqrt(Dk) for b, t, s in pairs))
    return np.array(rows)


def _big_model(rng, **options):
    model = _model(rng, attention_only=True, n_layers=1, **options)
    for name in ("blocks.0.attn.w_q", "blocks.0.attn.w_k"):
        model.params[name] *= 3.0  # logits of tens: some heads over the threshold, some not
    return model


@pytest.mark.parametrize("n_kv_heads", [3, 1])
def test_qk_clip_brings_every_head_to_tau_and_leaves_the_others(rng, n_kv_heads):
    model = _big_model(rng, n_kv_heads=n_kv_heads)
    tokens = rng.integers(11, size=(2, 7))
    before = _head_logit_max(model, tokens)
    tau = float(np.median(before))  # at least one head on each side
    assert np.any(before > tau) and np.any(before <= tau)
    params = {k: v.copy() for k, v in model.params.items()}
    w_q = model.params["blocks.0.attn.w_q"]
    clip = QKClip(tau, batches=lambda step: tokens)
    clip(1, model, 0.0)
    after = _head_logit_max(model, tokens)
    assert np.all(after <= tau * (1 + 1e-12))  # float64: no head's logit exceeds tau
    over = before > tau
    np.testing.assert_allclose(after[over], tau, rtol=1e-12)  # the largest is tau itself
    np.testing.assert_array_equal(clip.clipped[0][0], over)
    np.testing.assert_allclose(clip.max_logit[0][0], before, rtol=1e-12)
    assert model.params["blocks.0.attn.w_q"] is w_q  # in place: the optimiser's arrays
    Dk = model.head_dim
    for head in np.flatnonzero(~over):  # heads under tau: bit for bit
        cols = slice(head * Dk, (head + 1) * Dk)
        np.testing.assert_array_equal(w_q[:, cols], params["blocks.0.attn.w_q"][:, cols])
    for name in model.params:
        if name not in ("blocks.0.attn.w_q", "blocks.0.attn.w_k"):
            np.testing.assert_array_equal(model.params[name], params[name])
    if n_kv_heads == 1:  # the shared key head is left alone
        np.testing.assert_array_equal(
            model.params["blocks.0.attn.w_k"], params["blocks.0.attn.w_k"]
        )


def test_qk_clip_rescales_both_projections_by_the_square_root():
    model = _big_model(np.random.default_rng(3))
    tokens = np.random.default_rng(4).integers(11, size=(1, 6))
    before = {n: model.params[f"blocks.0.attn.{n}"].copy() for n in ("w_q", "w_k")}
    s = _head_logit_max(model, tokens)
    tau = float(s.min()) / 2  # every head over
    QKClip(tau, batches=lambda step: tokens)(1, model, 0.0)
    Dk = model.head_dim
    for head in range(3):
        cols = slice(head * Dk, (head + 1) * Dk)
        for n in ("w_q", "w_k"):
            np.testing.assert_allclose(
                model.params[f"blocks.0.attn.{n}"][:, cols],
                before[n][:, cols] * np.sqrt(tau / s[head]),
                rtol=1e-14,
            )


def test_recipe_batches_are_the_batches_train_lm_trains_on():
    """At learning rate 0 the model does not move, so the loss train_lm reports for a step is
    the model's loss on that step's batch only if the batches agree."""
    from sdpa.nn import cross_entropy
    from sdpa_book.pages.lm import corpus_data, train_lm

    batches, data, seen = RecipeBatches(batch=4), corpus_data(), []

    def check(step, model, loss):
        seen.append((loss, batches(step)))

    run = train_lm(steps=3, lr=0.0, batch=4, on_step=check)
    rng = np.random.default_rng(0)
    for loss, x in seen:
        windows = data.train_windows(rng.integers(len(data.train_starts), size=4))
        np.testing.assert_array_equal(x, windows[:, :-1])
        assert cross_entropy(run.model.forward(x), windows[:, 1:]) == pytest.approx(loss, rel=1e-6)


def test_qk_clip_rejects_bad_arguments(rng):
    with pytest.raises(ValueError, match="tau"):
        QKClip(0.0, batches=None)
    with pytest.raises(ValueError, match="qk_norm"):
        QKClip(1.0, batches=lambda s: np.zeros((1, 3), int))(1, _model(rng, qk_norm=True), 0.0)
    with pytest.raises(ValueError, match="step"):
        RecipeBatches()(0)
