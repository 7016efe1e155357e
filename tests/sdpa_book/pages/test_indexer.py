"""sdpa_book.pages.indexer: the lightning indexer's top-k mask, its warm-up loss, the book's
model under chosen keys, and compressed sparse attention, each against a float64 loop."""

from __future__ import annotations

import numpy as np
import pytest

import sdpa
from sdpa.nn import DecoderLM
from sdpa_book.pages.indexer import (
    compress,
    compressed_sparse_attention,
    index_scores,
    indexer_kl,
    indexer_scores,
    init_indexer,
    sparse_forward,
    top_k_keys,
    top_k_mask_mod,
    train_indexer,
)


def _softmax_over(z, keep):
    """Softmax of the entries ``keep`` of a 1-D row, written out."""
    e = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return e / e.sum()


# -- the indexer's scores and its top-k ---------------------------------------------------------


def test_index_scores_match_a_loop():
    rng = np.random.default_rng(0)
    q, w, k = (
        rng.standard_normal((5, 3, 4)),
        rng.standard_normal((5, 3)),
        rng.standard_normal((6, 4)),
    )
    expected = np.zeros((5, 6))
    for t in range(5):
        for s in range(6):
            for j in range(3):
                expected[t, s] += w[t, j] * max(0.0, float(q[t, j] @ k[s]))
    np.testing.assert_allclose(index_scores(q, w, k), expected, rtol=1e-12, atol=1e-12)


def _loop_top_k(scores, k, offset):
    chosen = np.zeros(scores.shape, dtype=bool)
    for t in range(scores.shape[0]):
        visible = range(t + offset + 1)
        best = sorted(visible, key=lambda s: (-scores[t, s], s))[:k]
        chosen[t, best] = True
    return chosen


@pytest.mark.parametrize(("T", "S", "k"), [(9, 9, 1), (9, 9, 3), (4, 11, 5), (12, 12, 12)])
def test_top_k_keys_match_a_loop_and_stay_causal(T, S, k):
    scores = np.random.default_rng(T * S + k).standard_normal((2, T, S))
    chosen = top_k_keys(scores, k)
    for b in range(2):
        np.testing.assert_array_equal(chosen[b], _loop_top_k(scores[b], k, S - T))
    positions = np.arange(S - T, S)
    assert not (chosen & (np.arange(S)[None, :] > positions[:, None])).any()
    assert (chosen.sum(axis=-1) == np.minimum(k, positions + 1)).all()


def test_top_k_keys_ties_go_to_the_earlier_key_and_visible_restricts():
    chosen = top_k_keys(np.zeros((1, 4)), 2, visible=np.array([[True, False, True, True]]))
    np.testing.assert_array_equal(chosen, [[True, False, True, False]])


def test_the_top_k_block_mask_gives_attention_over_the_chosen_keys():
    rng = np.random.default_rng(1)
    B, H, n, D = 2, 3, 24, 8
    q, k, v = rng.standard_normal((3, B, H, n, D))
    chosen = top_k_keys(rng.standard_normal((B, n, n)), 5)
    mask = sdpa.create_block_mask(top_k_mask_mod(chosen), B, None, n, n, BLOCK_SIZE=8)
    out = sdpa.flex_attention(q, k, v, block_mask=mask)
    expected = np.zeros_like(out)
    for b in range(B):
        for h in range(H):
            for t in range(n):
                a = _softmax_over(q[b, h, t] @ k[b, h].T / np.sqrt(D), chosen[b, t])
                expected[b, h, t] = a @ v[b, h]
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


def test_the_mask_mod_refuses_a_future_key_even_if_the_table_holds_one():
    chosen = np.ones((1, 4, 4), dtype=bool)  # a table that wrongly keeps everything
    dense = sdpa.create_mask(top_k_mask_mod(chosen), 1, None, 4, 4)[0, 0]
    np.testing.assert_array_equal(dense, np.tril(np.ones((4, 4), dtype=bool)))


# -- the warm-up loss and its gradient ----------------------------------------------------------


def _problem(seed=2, B=2, T=6, E=5):
    rng = np.random.default_rng(seed)
    params = init_indexer(rng, E, heads=2, dim=4)
    h = rng.standard_normal((B, T, E))
    target = rng.random((B, T, T)) * np.tril(np.ones((T, T)))
    target[0, 3, 1] = 0.0  # a zero target entry: 0 log 0 = 0
    return params, h, target / target.sum(axis=-1, keepdims=True)


def test_indexer_kl_is_the_kl_divergence_written_out():
    params, h, target = _problem()
    scores = indexer_scores(params, h)
    B, T = target.shape[:2]
    total = 0.0
    for b in range(B):
        for t in range(T):
            q = _softmax_over(scores[b, t], np.arange(T) <= t)
            total += sum(p * np.log(p / q[s]) for s, p in enumerate(target[b, t]) if p > 0)
    assert indexer_kl(params, h, target, grads=False) == pytest.approx(total / (B * T), rel=1e-12)


def test_indexer_kl_gradient_matches_finite_differences():
    params, h, target = _problem()
    _, grads = indexer_kl(params, h, target)
    eps = 1e-6
    for name, array in params.items():
        numeric = np.zeros_like(array)
        for idx in np.ndindex(array.shape):
            shifted = {n: a.copy() for n, a in params.items()}
            shifted[name][idx] += eps
            up = indexer_kl(shifted, h, target, grads=False)
            shifted[name][idx] -= 2 * eps
            down = indexer_kl(shifted, h, target, grads=False)
            numeric[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-8)


def test_train_indexer_lowers_the_loss_and_leaves_its_input_alone():
    params, h, target = _problem(B=4, T=8)
    before = {n: a.copy() for n, a in params.items()}
    trained, losses = train_indexer(params, h, target, steps=60, lr=0.05)
    assert losses[-1] < 0.5 * losses[0]
    assert indexer_kl(trained, h, target, grads=False) < losses[0]
    for n in params:
        np.testing.assert_array_equal(params[n], before[n])


# -- the book's model under chosen keys ----------------------------------------------------------


def _model(**options):
    kwargs = dict(vocab_size=11, d_model=16, n_layers=2, n_heads=2, max_len=10)
    kwargs |= dict(positional="rope", norm="layer", dtype=np.float64)
    return DecoderLM(rng=np.random.default_rng(3), **(kwargs | options))


def test_sparse_forward_without_a_choice_is_the_model_forward():
    model = _model()
    tokens = np.random.default_rng(4).integers(0, 11, (3, 10))
    logits, record = sparse_forward(model, tokens)
    np.testing.assert_allclose(logits, model.forward(tokens), rtol=1e-10, atol=1e-12)
    _, weights = model.forward(tokens, return_attention=True)
    for r, w in zip(record, weights):
        np.testing.assert_allclose(r["weights"], w, atol=1e-12)


def test_sparse_forward_with_one_mask_everywhere_is_the_model_forward_with_it():
    model = _model()
    tokens = np.random.default_rng(5).integers(0, 11, (2, 10))
    mask = np.random.default_rng(6).random((10, 10)) < 0.5
    mask[np.arange(10), np.arange(10)] = True  # every query keeps a key
    select = lambda layer, h, q, k: np.broadcast_to(mask, (2, 10, 10))  # noqa: E731
    logits, _ = sparse_forward(model, tokens, select)
    np.testing.assert_allclose(
        logits, model.forward(tokens, attn_mask=mask), rtol=1e-10, atol=1e-12
    )


def test_sparse_forward_refuses_options_it_does_not_write():
    with pytest.raises(ValueError, match="sparse_forward"):
        sparse_forward(_model(qk_norm=True), np.zeros((1, 4), dtype=int))


# -- compressed sparse attention ----------------------------------------------------------------


def test_compress_pools_complete_groups_with_softmax_weights():
    x = np.random.default_rng(7).standard_normal((2, 11, 3))
    bias = np.array([0.5, -1.0, 2.0])
    weights = np.exp(bias) / np.exp(bias).sum()
    expected = np.stack(
        [np.stack([weights @ x[b, 3 * c : 3 * c + 3] for c in range(3)]) for b in range(2)]
    )
    np.testing.assert_allclose(compress(x, 3, bias), expected, rtol=1e-12)
    np.testing.assert_allclose(compress(x, 3), x[:, :9].reshape(2, 3, 3, 3).mean(axis=2))


@pytest.mark.parametrize(("m", "top_k", "window"), [(4, 2, 3), (2, 5, 1), (3, 1, 8)])
def test_compressed_sparse_attention_is_one_softmax_over_the_union(m, top_k, window):
    rng = np.random.default_rng(m * 10 + top_k)
    B, H, n, D = 2, 2, 20, 4
    q, k, v = rng.standard_normal((3, B, H, n, D))
    n_c = n // m
    scores = rng.standard_normal((B, n, n_c))
    out, lse, chosen = compressed_sparse_attention(q, k, v, scores, m=m, top_k=top_k, window=window)
    for b in range(B):
        for t in range(n):
            complete = [c for c in range(n_c) if (c + 1) * m - 1 <= t]
            best = sorted(complete, key=lambda c: (-scores[b, t, c], c))[:top_k]
            assert set(np.flatnonzero(chosen[b, t])) == set(best)
            for h in range(H):
                # the union of two disjoint key sets: the chosen entries and the window's keys
                k_c = np.array([k[b, h, c * m : (c + 1) * m].mean(axis=0) for c in best])
                v_c = np.array([v[b, h, c * m : (c + 1) * m].mean(axis=0) for c in best])
                recent = list(range(max(0, t - window + 1), t + 1))
                keys = np.concatenate([k_c.reshape(-1, D), k[b, h, recent]])
                values = np.concatenate([v_c.reshape(-1, D), v[b, h, recent]])
                z = keys @ q[b, h, t] / np.sqrt(D)
                a = np.exp(z - z.max())
                np.testing.assert_allclose(out[b, h, t], a @ values / a.sum(), rtol=1e-10)
                expected_lse = z.max() + np.log(a.sum())
                assert lse[b, h, t] == pytest.approx(expected_lse, rel=1e-12)


# -- bad input ----------------------------------------------------------------------------------


def test_bad_input_is_refused_with_the_argument_named():
    with pytest.raises(TypeError, match="k must be an int"):
        top_k_keys(np.zeros((2, 2)), 1.0)
    with pytest.raises(ValueError, match="k must be at least 1"):
        top_k_keys(np.zeros((2, 2)), 0)
    with pytest.raises(ValueError, match="visible must broadcast"):
        top_k_keys(np.zeros((2, 2)), 1, visible=np.ones((3, 3), dtype=bool))
    with pytest.raises(ValueError, match="index_scores needs"):
        index_scores(np.zeros((2, 3, 4)), np.zeros((2, 2)), np.zeros((5, 4)))
    with pytest.raises(ValueError, match="chosen must be"):
        top_k_mask_mod(np.zeros((2, 2), dtype=bool))
    with pytest.raises(ValueError, match="bias must have shape"):
        compress(np.zeros((4, 2)), 2, bias=np.zeros(3))
    q = np.zeros((1, 1, 8, 2))
    with pytest.raises(ValueError, match="scores must be"):
        compressed_sparse_attention(q, q, q, np.zeros((1, 8, 3)), m=4, top_k=1, window=2)
    with pytest.raises(ValueError, match="at least m"):
        compressed_sparse_attention(q, q, q, np.zeros((1, 8, 0)), m=9, top_k=1, window=2)
    params, h, target = _problem()
    with pytest.raises(ValueError, match="target must be"):
        indexer_kl(params, h, target[:, :3])
