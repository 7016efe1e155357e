"""sdpa.nn.DecoderLM: every parameter's gradient against central finite differences in each
configuration, causality, the forward's probes (kv_transform, attn_mask, returned scores), and
every ``raise`` of the model's options (generation is tested in test_generation.py, the checks of
tokens and targets in test_inputs.py).

The models are tiny (V = 7, E = 8, two blocks, T = 5), so the finite differences of every
parameter of eight configurations take a few seconds.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from nn_checks import LM_CONFIGS as CONFIGS
from nn_checks import LM_SIZES, assert_grads_match_differences, make_model

from sdpa import nn

V, E, MAX_LEN = LM_SIZES["vocab_size"], LM_SIZES["d_model"], LM_SIZES["max_len"]


@pytest.fixture
def batch(rng):
    tokens = rng.integers(0, V, size=(2, 5))
    targets = rng.integers(0, V, size=(2, 5))
    return tokens, targets


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_loss_and_grads_match_finite_differences(config, batch):
    """Every parameter: entries one at a time (all of them for small arrays, 6 random ones
    otherwise) and one random direction through the whole array."""
    assert_grads_match_differences(make_model(**config), *batch, lambda name: (8, 6))


def test_every_parameter_gets_a_gradient(batch):
    """No parameter is left out of the backward pass (a zero gradient would also pass the
    finite differences if the parameter were unused by the forward pass)."""
    model = make_model(**CONFIGS["learned-layer"])
    tokens, targets = batch
    _, grads = model.loss_and_grads(tokens, targets)
    unused_rows = {
        "token_embedding": np.setdiff1d(np.arange(V), tokens),
        "position_embedding": np.arange(tokens.shape[1], MAX_LEN),
    }
    for name, g in grads.items():
        used = np.delete(g, unused_rows.get(name, []), axis=0)
        assert np.all(used != 0), name
        if name in unused_rows:
            np.testing.assert_array_equal(g[unused_rows[name]], 0.0)


def test_float32_model_agrees_with_float64(batch):
    tokens, targets = batch
    m64 = make_model(**CONFIGS["gqa-rope"])
    m32 = make_model(**CONFIGS["gqa-rope"], dtype=np.float32)
    m32.params = {name: p.astype(np.float32) for name, p in m64.params.items()}
    loss64, grads64 = m64.loss_and_grads(tokens, targets)
    loss32, grads32 = m32.loss_and_grads(tokens, targets)
    assert loss32 == pytest.approx(loss64, rel=1e-5)
    for name, g in grads32.items():
        assert g.dtype == np.float32, name
        np.testing.assert_allclose(g, grads64[name], rtol=1e-3, atol=1e-5, err_msg=name)


def test_training_reduces_the_loss():
    """Twenty AdamW steps on one repeated sequence drive the loss far below log V."""
    model = make_model(**CONFIGS["rope-layer"])
    tokens = np.array([[0, 1, 2, 3, 4, 5]])
    opt = nn.AdamW(model.params, lr=0.05)
    first, _ = model.loss_and_grads(tokens[:, :-1], tokens[:, 1:])
    for _ in range(20):
        loss, grads = model.loss_and_grads(tokens[:, :-1], tokens[:, 1:])
        opt.step(grads)
    assert first > 0.5 * np.log(V) and loss < 0.05


# ---------------------------------------------------------------------------------------------
# Forward properties
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_causal_the_future_does_not_change_the_past(config, rng):
    model = make_model(**config)
    a = rng.integers(0, V, size=6)
    b = a.copy()
    b[4:] = (b[4:] + 1) % V  # change the last two tokens
    np.testing.assert_allclose(model.forward(a)[:4], model.forward(b)[:4], rtol=1e-13, atol=1e-13)
    assert not np.allclose(model.forward(a)[4:], model.forward(b)[4:])


def test_attention_weights_are_causal_distributions(rng):
    model = make_model(**CONFIGS["gqa-rope"])
    logits, weights = model.forward(rng.integers(0, V, size=(3, 5)), return_attention=True)
    assert logits.shape == (3, 5, V) and len(weights) == 2
    for w in weights:
        assert w.shape == (3, 4, 5, 5)
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-14)
        np.testing.assert_array_equal(np.triu(w, k=1), 0.0)


def test_one_dimensional_tokens_are_one_sequence(rng):
    model = make_model()
    tokens = rng.integers(0, V, size=5)
    logits, weights = model.forward(tokens, return_attention=True)
    batched, batched_weights = model.forward(tokens[None], return_attention=True)
    np.testing.assert_array_equal(logits, batched[0])
    np.testing.assert_array_equal(weights[1], batched_weights[1][0])


def test_zeroing_a_blocks_output_rows_removes_the_block(rng):
    """The documented ablation: with every head of block 1 zeroed in w_o, an attention-only
    model computes what the one-block model with the same other parameters computes."""
    model = make_model(**CONFIGS["attention-only-rope"])
    ablated = copy.deepcopy(model)
    ablated.params["blocks.1.attn.w_o"][:] = 0.0
    one_block = make_model(**CONFIGS["attention-only-rope"], n_layers=1)
    one_block.params = {name: model.params[name] for name in one_block.params}
    tokens = rng.integers(0, V, size=5)
    np.testing.assert_allclose(ablated.forward(tokens), one_block.forward(tokens), rtol=1e-14)
    assert not np.allclose(model.forward(tokens), one_block.forward(tokens))


def test_one_block_by_hand_and_head_ablation(rng):
    """An attention-only block written out head by head from the formulas (the attention
    weights taken from the model): x = x0 + sum_h (A_h (h W_v)_h) W_o[rows of h]. Zeroing
    head h's rows of w_o removes exactly its term."""
    model = make_model(positional="learned", norm="rms", attention_only=True, n_layers=1)
    P, Dk = model.params, model.head_dim
    tokens = rng.integers(0, V, size=5)
    _, (A,) = model.forward(tokens, return_attention=True)  # (H, T, T)

    def rms(x, w):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * w

    x0 = P["token_embedding"][tokens] + P["position_embedding"][:5]
    v = rms(x0, P["blocks.0.attn_norm.weight"]) @ P["blocks.0.attn.w_v"]  # (T, H Dk)
    terms = [
        A[h] @ v[:, h * Dk : (h + 1) * Dk] @ P["blocks.0.attn.w_o"][h * Dk : (h + 1) * Dk]
        for h in range(2)
    ]
    for ablate in (None, 0, 1):
        m = copy.deepcopy(model)
        if ablate is not None:
            m.params["blocks.0.attn.w_o"][ablate * Dk : (ablate + 1) * Dk] = 0.0
        x = x0 + sum(t for h, t in enumerate(terms) if h != ablate)
        expected = rms(x, P["final_norm.weight"]) @ P["unembedding"]
        np.testing.assert_allclose(m.forward(tokens), expected, rtol=1e-12, atol=1e-12)


def test_inputs_are_not_modified(batch):
    model = make_model()
    tokens, targets = (np.array(a) for a in batch)
    tokens.flags.writeable = targets.flags.writeable = False
    model.loss_and_grads(tokens, targets)
    model.generate(tokens, 1, temperature=0)


def test_repr_names_the_configuration():
    assert repr(make_model(**CONFIGS["gqa-rope"])).startswith(
        "DecoderLM(vocab_size=7, d_model=8, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=12"
    )


# ---------------------------------------------------------------------------------------------
# Errors: one test per raise
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["vocab_size", "d_model", "n_layers", "n_heads", "max_len"])
def test_sizes_must_be_integers(size):
    with pytest.raises(TypeError, match=f"{size} must be a positive integer; got 2.0"):
        make_model(**{size: 2.0})


@pytest.mark.parametrize("size", ["vocab_size", "n_layers", "n_kv_heads", "d_ff", "max_len"])
def test_sizes_must_be_positive(size):
    with pytest.raises(ValueError, match=f"{size} must be a positive integer; got 0"):
        make_model(**{size: 0})


def test_n_heads_must_divide_d_model():
    with pytest.raises(ValueError, match="n_heads must divide d_model; got d_model=8, n_heads=3"):
        make_model(n_heads=3)


def test_n_kv_heads_must_divide_n_heads():
    with pytest.raises(
        ValueError, match="n_kv_heads must divide n_heads; got n_heads=4, n_kv_heads=3"
    ):
        make_model(n_heads=4, n_kv_heads=3)


def test_positional_choices():
    with pytest.raises(
        ValueError, match="positional must be 'rope', 'sinusoidal', 'learned' or None; got 'alibi'"
    ):
        make_model(positional="alibi")


def test_rope_needs_an_even_head_width():
    with pytest.raises(
        ValueError, match=r"positional='rope' needs an even head width.* 8 // 8 = 1"
    ):
        make_model(n_heads=8)


def test_norm_choices():
    with pytest.raises(ValueError, match="norm must be 'layer' or 'rms'; got 'batch'"):
        make_model(norm="batch")


def test_attention_only_must_be_bool():
    with pytest.raises(TypeError, match="attention_only must be a bool; got 1"):
        make_model(attention_only=1)


def test_dtype_must_be_a_dtype():
    with pytest.raises(
        ValueError, match="dtype must be np.float32 or np.float64; got 'double-ish'"
    ):
        make_model(dtype="double-ish")


def test_dtype_must_be_float32_or_float64():
    with pytest.raises(ValueError, match="dtype must be np.float32 or np.float64; got <class"):
        make_model(dtype=np.float16)


def test_rng_must_be_a_generator():
    with pytest.raises(TypeError, match="rng must be a numpy.random.Generator"):
        make_model(rng=0)


def test_return_attention_must_be_bool():
    with pytest.raises(TypeError, match="return_attention must be a bool; got 'yes'"):
        make_model().forward(np.array([1]), return_attention="yes")


# -- forward's probes: kv_transform and attn_mask --------------------------------------------


def _small_model(**kwargs):
    return nn.DecoderLM(
        vocab_size=9,
        d_model=8,
        n_layers=2,
        n_heads=2,
        max_len=6,
        rng=np.random.default_rng(3),
        **kwargs,
    )


def test_kv_transform_sees_every_layer_and_identity_changes_nothing():
    model, tokens = _small_model(n_kv_heads=1), np.array([[1, 4, 2, 7, 0]])
    seen = []

    def record(layer, k, v):
        seen.append((layer, k.shape, v.shape))
        return k, v

    assert np.array_equal(model.forward(tokens, kv_transform=record), model.forward(tokens))
    assert seen == [(0, (1, 1, 5, 4), (1, 1, 5, 4)), (1, (1, 1, 5, 4), (1, 1, 5, 4))]


def test_zero_values_remove_attention_like_zeroing_w_o():
    model, tokens = _small_model(), np.array([[1, 4, 2, 7, 0]])
    zeroed = model.forward(tokens, kv_transform=lambda i, k, v: (k, np.zeros_like(v)))
    for i in range(model.n_layers):
        model.params[f"blocks.{i}.attn.w_o"][:] = 0
    np.testing.assert_allclose(zeroed, model.forward(tokens), rtol=1e-12, atol=1e-12)


def test_kv_transform_gets_copies_and_bad_results_are_refused():
    model, tokens = _small_model(), np.array([1, 4, 2])
    before = model.forward(tokens)

    def scribble(i, k, v):
        k[...] = 0.0  # a copy: the model's own arrays are untouched
        return k, v

    model.forward(tokens, kv_transform=scribble)
    assert np.array_equal(model.forward(tokens), before)
    with pytest.raises(TypeError, match="kv_transform must return"):
        model.forward(tokens, kv_transform=lambda i, k, v: k)
    with pytest.raises(ValueError, match="kv_transform must keep the shapes"):
        model.forward(tokens, kv_transform=lambda i, k, v: (k[..., :1, :], v))
    with pytest.raises(TypeError, match="kv_transform must be callable"):
        model.forward(tokens, kv_transform=3)


def test_attn_mask_restricts_the_causal_attention():
    model, tokens = _small_model(), np.array([[1, 4, 2, 7, 0]])
    everything = np.ones((5, 5), dtype=bool)
    np.testing.assert_allclose(
        model.forward(tokens, attn_mask=everything), model.forward(tokens), rtol=1e-12, atol=1e-12
    )
    self_only = np.eye(5, dtype=bool)
    logits, weights = model.forward(tokens, attn_mask=self_only, return_attention=True)
    assert all(np.array_equal(w[0], np.broadcast_to(np.eye(5), w[0].shape)) for w in weights)
    other = model.forward(np.array([[8, 8, 8, 7, 0]]), attn_mask=self_only)  # earlier tokens
    np.testing.assert_array_equal(other[0, 3:], logits[0, 3:])  # no longer matter


def test_attn_mask_is_checked():
    model, tokens = _small_model(), np.array([1, 4, 2])
    with pytest.raises(ValueError, match=r"attn_mask must be a boolean \(T, T\)"):
        model.forward(tokens, attn_mask=np.ones((3, 4), dtype=bool))
    with pytest.raises(ValueError, match=r"attn_mask must be a boolean"):
        model.forward(tokens, attn_mask=np.ones((3, 3)))
    upper = np.triu(np.ones((3, 3), dtype=bool), k=1)  # only future keys: none left
    with pytest.raises(ValueError, match="leaves a query no key"):
        model.forward(tokens, attn_mask=upper)


@pytest.mark.parametrize("options", [{}, {"qk_norm": True, "n_kv_heads": 1}], ids=["plain", "qk"])
def test_return_scores_are_what_the_softmax_sees(options):
    model, tokens = _small_model(**options), np.array([[1, 4, 2, 7, 0]])
    logits, weights, scores = model.forward(tokens, return_attention=True, return_scores=True)
    assert np.array_equal(logits, model.forward(tokens))
    for w, z in zip(weights, scores):
        assert z.shape == (1, 2, 5, 5) and np.all(
            np.isneginf(z[..., np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]])
        )
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        np.testing.assert_allclose(e / e.sum(axis=-1, keepdims=True), w, rtol=1e-12, atol=1e-15)
    one_d = model.forward(tokens[0], return_scores=True)[1]
    assert np.array_equal(one_d[0], scores[0][0])


def test_return_scores_by_hand_and_checked():
    # One block, one head of width 2, no positions: the score is q . k / sqrt(2).
    model = nn.DecoderLM(
        vocab_size=3,
        d_model=2,
        n_layers=1,
        n_heads=1,
        max_len=2,
        positional=None,
        rng=np.random.default_rng(0),
    )
    tokens = np.array([0, 2])
    _, (z,) = model.forward(tokens, return_scores=True)
    h = nn.layer_norm(
        model.params["token_embedding"][tokens],
        model.params["blocks.0.attn_norm.weight"],
        model.params["blocks.0.attn_norm.bias"],
        eps=1e-5,
    )
    q, k = h @ model.params["blocks.0.attn.w_q"], h @ model.params["blocks.0.attn.w_k"]
    assert z.shape == (1, 2, 2)  # (Hq, T, T) for 1-D tokens
    assert z[0, 1, 0] == pytest.approx(q[1] @ k[0] / np.sqrt(2), rel=1e-12)
    assert z[0, 1, 1] == pytest.approx(q[1] @ k[1] / np.sqrt(2), rel=1e-12)
    assert np.isneginf(z[0, 0, 1])  # the future
    with pytest.raises(TypeError, match="return_scores must be a bool"):
        model.forward(tokens, return_scores=1)
