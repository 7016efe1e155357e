"""sdpa.nn.mla: multi-head latent attention, naive and absorbed, and its latent cache.

References: the naive forward against a float64 loop written from the definition and against
torch (forward and autograd); the backward against central differences; the absorbed decode,
token by token, against the naive causal forward; the absorption identity by hand; one test
per ``raise``. Every size differs (B=2, T=7, E=11, H=3, Dc=5, Dn=4, Dr=6, Dv=8, Dcq=10) so
that a swapped axis cannot pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa.nn import LatentKVCache, MultiHeadLatentAttention

B, T, E, H, DC, DN, DR, DV, DCQ = 2, 7, 11, 3, 5, 4, 6, 8, 10
TIGHT = dict(rtol=1e-12, atol=1e-12)  # float64, same maths in another order
FD = dict(rtol=1e-6, atol=1e-8)  # central differences with step 1e-6
F64 = dict(rtol=1e-10, atol=1e-10)  # against torch, float64


def make(rng, *, query_latent=True, dtype=np.float64, **sizes):
    kwargs = dict(d_model=E, n_heads=H, d_latent=DC, d_nope=DN, d_rope=DR, d_value=DV)
    kwargs |= sizes
    if query_latent:
        kwargs["d_query_latent"] = DCQ
    return MultiHeadLatentAttention(**kwargs, dtype=dtype, rng=rng)


@pytest.fixture(params=[True, False], ids=["query-latent", "full-rank-query"])
def mla(request, rng):
    return make(rng, query_latent=request.param)


@pytest.fixture
def x(rng):
    return rng.standard_normal((B, T, E))


# ---------------------------------------------------------------------------------------------
# An independent reference: the definition, one head and one pair (i, j) at a time
# ---------------------------------------------------------------------------------------------


def rotate(vec, position, base=10000.0):
    """RoPE of one vector (halves layout), pair i = (vec[i], vec[i + D/2])."""
    half = len(vec) // 2
    out = np.empty_like(vec)
    for i in range(half):
        angle = position * base ** (-2 * i / len(vec))
        a, b = vec[i], vec[i + half]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + half] = a * math.sin(angle) + b * math.cos(angle)
    return out


def mla_loop(p, x, n_heads, d_nope, d_rope, d_value):
    """The layer's output from the definition: loops over batch, head, query and key."""
    Bx, Tx, _ = x.shape
    out = np.zeros((Bx, Tx, p["w_o"].shape[1]))
    for b in range(Bx):
        c_q = x[b] @ p["w_dq"] if "w_dq" in p else x[b]
        c_kv = x[b] @ p["w_dkv"]
        k_rope = [rotate(x[b, j] @ p["w_kr"], j) for j in range(Tx)]
        for h in range(n_heads):
            w_uq = p["w_uq"][:, h * d_nope : (h + 1) * d_nope]
            w_qr = p["w_qr"][:, h * d_rope : (h + 1) * d_rope]
            w_uk = p["w_uk"][:, h * d_nope : (h + 1) * d_nope]
            w_uv = p["w_uv"][:, h * d_value : (h + 1) * d_value]
            w_o = p["w_o"][h * d_value : (h + 1) * d_value]
            for i in range(Tx):
                q_nope, q_rope = c_q[i] @ w_uq, rotate(c_q[i] @ w_qr, i)
                scores = [
                    (q_nope @ (c_kv[j] @ w_uk) + q_rope @ k_rope[j]) / math.sqrt(d_nope + d_rope)
                    for j in range(i + 1)
                ]
                weights = np.exp(np.array(scores) - max(scores))
                weights /= weights.sum()
                head = sum(weights[j] * (c_kv[j] @ w_uv) for j in range(i + 1))
                out[b, i] += head @ w_o
    return out


def test_forward_matches_the_definition(mla, x):
    expected = mla_loop(mla.params, x, H, DN, DR, DV)
    np.testing.assert_allclose(mla.forward(x), expected, **TIGHT)


def test_forward_is_causal(mla, x):
    changed = x.copy()
    changed[:, 4:] = 0.0
    np.testing.assert_allclose(mla.forward(changed)[:, :4], mla.forward(x)[:, :4], **TIGHT)


def test_forward_keeps_float32(rng, x):
    mla = make(rng, dtype=np.float32)
    assert mla.forward(x.astype(np.float32)).dtype == np.float32
    assert all(w.dtype == np.float32 for w in mla.params.values())


def test_parameter_shapes(rng):
    mla = make(rng)
    shapes = {name: w.shape for name, w in mla.params.items()}
    assert shapes == {
        "w_dq": (E, DCQ),
        "w_uq": (DCQ, H * DN),
        "w_qr": (DCQ, H * DR),
        "w_dkv": (E, DC),
        "w_uk": (DC, H * DN),
        "w_uv": (DC, H * DV),
        "w_kr": (E, DR),
        "w_o": (H * DV, E),
    }
    assert "w_dq" not in make(rng, query_latent=False).params
    assert mla.scale == 1 / math.sqrt(DN + DR)


# ---------------------------------------------------------------------------------------------
# The backward pass: central differences and torch.autograd
# ---------------------------------------------------------------------------------------------


def central_differences(f, array, d_y, eps=1e-6):
    """d/d array of sum(d_y * f()), entry by entry; ``f`` reads ``array``, modified in place."""
    grad = np.zeros_like(array)
    for idx in np.ndindex(*array.shape):
        saved = array[idx]
        array[idx] = saved + eps
        up = np.sum(d_y * f())
        array[idx] = saved - eps
        down = np.sum(d_y * f())
        array[idx] = saved
        grad[idx] = (up - down) / (2 * eps)
    return grad


def test_backward_matches_central_differences(mla, rng):
    x = rng.standard_normal((1, 5, E))  # one sequence keeps the loop short
    d_y = rng.standard_normal(x.shape)
    d_x, grads = mla.backward(x, d_y)
    assert grads.keys() == mla.params.keys()
    for name, w in mla.params.items():
        expected = central_differences(lambda: mla.forward(x), w, d_y)
        np.testing.assert_allclose(grads[name], expected, **FD, err_msg=name)
    np.testing.assert_allclose(
        d_x, central_differences(lambda: mla.forward(x), x, d_y), **FD, err_msg="x"
    )


def test_backward_does_not_mutate(mla, x, rng):
    d_y = rng.standard_normal(x.shape)
    before = {name: w.copy() for name, w in mla.params.items()}
    x_ro, d_y_ro = x.copy(), d_y.copy()
    x_ro.flags.writeable = d_y_ro.flags.writeable = False
    mla.backward(x_ro, d_y_ro)
    for name, w in mla.params.items():
        np.testing.assert_array_equal(w, before[name])


def torch_mla(torch, p, x, n_heads, d_nope, d_rope, d_value):
    """The layer in torch from the definition (its own RoPE, its own attention)."""
    Bx, Tx, _ = x.shape
    half = d_rope // 2
    theta = 10000.0 ** (-torch.arange(0, d_rope, 2, dtype=torch.float64) / d_rope)
    angles = torch.arange(Tx, dtype=torch.float64)[:, None] * theta  # (T, Dr/2)
    cos, sin = torch.cos(angles), torch.sin(angles)

    def rope(t):  # (..., T, Dr), halves layout
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def heads(t, width):  # (B, T, H width) -> (B, H, T, width)
        return t.reshape(Bx, Tx, n_heads, width).transpose(1, 2)

    c_q = x @ p["w_dq"] if "w_dq" in p else x
    q_nope, q_rope = heads(c_q @ p["w_uq"], d_nope), rope(heads(c_q @ p["w_qr"], d_rope))
    c_kv = x @ p["w_dkv"]
    k_nope, v = heads(c_kv @ p["w_uk"], d_nope), heads(c_kv @ p["w_uv"], d_value)
    k_rope = rope(x @ p["w_kr"])[:, None]  # (B, 1, T, Dr)
    scores = (q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)) / math.sqrt(
        d_nope + d_rope
    )
    causal = torch.ones(Tx, Tx, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, -torch.inf), dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(Bx, Tx, n_heads * d_value)
    return out @ p["w_o"]


@pytest.mark.torch
def test_forward_and_backward_match_torch(torch, mla, x, rng):
    d_y = rng.standard_normal(x.shape)
    p = {name: torch.tensor(w, requires_grad=True) for name, w in mla.params.items()}
    x_t = torch.tensor(x, requires_grad=True)
    y = torch_mla(torch, p, x_t, H, DN, DR, DV)
    (y * torch.tensor(d_y)).sum().backward()
    np.testing.assert_allclose(mla.forward(x), y.detach().numpy(), **F64)
    d_x, grads = mla.backward(x, d_y)
    np.testing.assert_allclose(d_x, x_t.grad.numpy(), **F64)
    for name in mla.params:
        np.testing.assert_allclose(grads[name], p[name].grad.numpy(), **F64, err_msg=name)


# ---------------------------------------------------------------------------------------------
# The absorbed form and the latent cache
# ---------------------------------------------------------------------------------------------


def test_absorption_identity(rng):
    """q . (W_uk^T c) == (W_uk q) . c, by hand for a 2 x 3 W_uk."""
    w_uk = np.array([[1.0, 2.0, 0.0], [0.0, -1.0, 3.0]])  # (Dc=2, Dn=3)
    q, c = np.array([1.0, 1.0, 2.0]), np.array([2.0, -1.0])
    assert q @ (c @ w_uk) == 1.0  # k = c W_uk = (2, 5, -3); q . k = 2 + 5 - 6
    assert (w_uk @ q) @ c == 1.0  # W_uk q = (3, 5); (3, 5) . (2, -1) = 6 - 5


def test_absorbed_weights_fold_the_up_projections(mla, x):
    w_q_latent, w_o_latent = mla.absorbed_weights()
    p = mla.params
    c_q = x @ p["w_dq"] if "w_dq" in p else x
    c_kv = x @ p["w_dkv"]
    for h in range(H):
        q_nope = c_q @ p["w_uq"][:, h * DN : (h + 1) * DN]  # (B, T, Dn)
        k_nope = c_kv @ p["w_uk"][:, h * DN : (h + 1) * DN]  # (B, T, Dn)
        np.testing.assert_allclose(
            (c_q @ w_q_latent[h]) @ c_kv.transpose(0, 2, 1),
            q_nope @ k_nope.transpose(0, 2, 1),
            **TIGHT,
        )
        v = c_kv @ p["w_uv"][:, h * DV : (h + 1) * DV]  # (B, T, Dv)
        np.testing.assert_allclose(
            c_kv @ w_o_latent[h], v @ p["w_o"][h * DV : (h + 1) * DV], **TIGHT
        )


def test_decode_token_by_token_equals_the_naive_forward(mla, x):
    cache = mla.new_cache(batch_size=B, capacity=T)
    steps = [mla.decode(x[:, t : t + 1], cache) for t in range(T)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), mla.forward(x), **TIGHT)
    assert cache.length == T


def test_decode_prefill_then_steps(mla, x):
    cache = mla.new_cache(batch_size=B, capacity=T + 2)
    first = mla.decode(x[:, :4], cache)
    rest = mla.decode(x[:, 4:], cache)
    np.testing.assert_allclose(np.concatenate([first, rest], axis=1), mla.forward(x), **TIGHT)


def test_cache_holds_latent_plus_rope_numbers_per_token(mla, x):
    cache = mla.new_cache(batch_size=B, capacity=T)
    for t in range(T):
        mla.decode(x[:, t : t + 1], cache)
        assert cache.latent.size + cache.rope_key.size == B * (t + 1) * (DC + DR)
    assert cache.numbers_per_token == DC + DR
    # what it holds: the latents x W_dkv and the rotated keys, nothing per head
    np.testing.assert_allclose(cache.latent, x @ mla.params["w_dkv"], **TIGHT)
    expected_keys = [rotate(x[b, j] @ mla.params["w_kr"], j) for b in range(B) for j in range(T)]
    np.testing.assert_allclose(cache.rope_key.reshape(B * T, DR), expected_keys, **TIGHT)


def test_cache_views_are_read_only(rng):
    cache = LatentKVCache(batch_size=1, d_latent=3, d_rope=2, capacity=4)
    cache.append(np.ones((1, 2, 3)), np.ones((1, 2, 2)))
    with pytest.raises(ValueError, match="read-only"):
        cache.latent[0, 0, 0] = 5.0


def test_a_decode_that_raises_leaves_the_cache_as_it_was(mla, x):
    """A step whose scores overflow fails after its latents are made (and, before the fix,
    stored): the cache keeps its length and contents, and the retry is a clean run's step."""
    clean = mla.new_cache(batch_size=B, capacity=T)
    mla.decode(x[:, :3], clean)
    expected = mla.decode(x[:, 3:4], clean)  # the step at position 3, never interrupted

    cache = mla.new_cache(batch_size=B, capacity=T)
    mla.decode(x[:, :3], cache)
    latent, rope_key = cache.latent.copy(), cache.rope_key.copy()
    huge = np.full((B, 1, E), 1e160)  # finite latents (~1e160), scores ~1e320: beyond float64
    with pytest.raises(ValueError, match=r"scores .* beyond the range of float64"):
        mla.decode(huge, cache)
    assert cache.length == 3
    np.testing.assert_array_equal(cache.latent, latent)
    np.testing.assert_array_equal(cache.rope_key, rope_key)
    # the retry is at position 3, not 4
    np.testing.assert_array_equal(mla.decode(x[:, 3:4], cache), expected)
    np.testing.assert_allclose(expected, mla.forward(x[:, :4])[:, 3:], **TIGHT)
    assert cache.length == 4


def test_a_decode_into_a_full_cache_changes_nothing(rng, x):
    mla = make(rng)
    cache = mla.new_cache(batch_size=B, capacity=T - 1)
    mla.decode(x[:, :5], cache)
    latent = cache.latent.copy()
    with pytest.raises(ValueError, match=r"holds 5 tokens of capacity=6; cannot append T=2"):
        mla.decode(x[:, 5:], cache)
    assert cache.length == 5
    np.testing.assert_array_equal(cache.latent, latent)


# ---------------------------------------------------------------------------------------------
# Errors: one test per raise
# ---------------------------------------------------------------------------------------------


def test_cache_append_beyond_its_dtype_raises_and_changes_nothing():
    """1e39 does not fit in float32 (largest 3.4e38): refused, as PagedKVCache refuses it,
    instead of stored as inf; the cache is unchanged."""
    cache = LatentKVCache(batch_size=1, d_latent=2, d_rope=2, capacity=3, dtype=np.float32)
    cache.append(np.ones((1, 1, 2)), np.ones((1, 1, 2)))
    with pytest.raises(
        ValueError,
        match=r"latent must fit in float32, the cache's dtype .*got 1e\+39, which would become \+inf",
    ):
        cache.append(np.array([[[1.0, 1e39]]]), np.ones((1, 1, 2)))
    with pytest.raises(ValueError, match=r"rope_key must fit in float32, .*got -1e\+39"):
        cache.append(np.ones((1, 1, 2)), np.array([[[-1e39, 0.0]]]))
    assert cache.length == 1
    np.testing.assert_array_equal(cache.latent, np.ones((1, 1, 2)))
    # float64 values that round to float32's largest are stored as it, not refused
    cache.append(np.full((1, 1, 2), 3.4028235e38), np.zeros((1, 1, 2)))
    np.testing.assert_array_equal(cache.latent[0, 1], np.finfo(np.float32).max)


def test_odd_rope_width_raises(rng):
    with pytest.raises(ValueError, match=r"d_rope must be even .* got d_rope=5"):
        make(rng, d_rope=5)


@pytest.mark.parametrize("name", ["d_model", "n_heads", "d_latent", "d_nope", "d_value"])
def test_nonpositive_size_raises(rng, name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer; got 0"):
        make(rng, **{name: 0})


def test_non_integer_size_raises(rng):
    with pytest.raises(TypeError, match=r"d_latent must be a positive integer; got 2.5"):
        make(rng, d_latent=2.5)


def test_bad_dtype_raises(rng):
    with pytest.raises(ValueError, match=r"dtype must be np.float32 or np.float64; got"):
        make(rng, dtype=np.int64)


def test_bad_rng_raises():
    with pytest.raises(TypeError, match="rng"):
        MultiHeadLatentAttention(d_model=4, n_heads=1, d_latent=2, d_nope=2, d_rope=2, rng=0)


def test_wrong_input_shape_raises(rng):
    mla = make(rng)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, E\) .* E = d_model = 11; "):
        mla.forward(np.zeros((2, 3, 7)))
    with pytest.raises(ValueError, match=r"got x.shape=\(3, 11\)"):
        mla.forward(np.zeros((3, 11)))


def test_complex_input_raises(rng):
    with pytest.raises(TypeError, match="x must"):
        make(rng).forward(np.zeros((1, 2, E), complex))


def test_wrong_d_y_shape_raises(rng, x):
    with pytest.raises(ValueError, match=r"d_y must have the shape of x, .*got d_y.shape=\(2, 7\)"):
        make(rng).backward(x, np.zeros((2, 7)))


def test_decode_wrong_cache_kind_raises(rng, x):
    with pytest.raises(TypeError, match="cache must be a LatentKVCache; got dict"):
        make(rng).decode(x, {})


def test_decode_wrong_cache_widths_raise(rng, x):
    cache = LatentKVCache(batch_size=B, d_latent=DC + 1, d_rope=DR, capacity=T)
    with pytest.raises(ValueError, match=r"cache must hold d_latent=5 and d_rope=6 .*d_latent=6"):
        make(rng).decode(x, cache)


def test_decode_wrong_batch_raises(rng, x):
    cache = make(rng).new_cache(batch_size=B + 1, capacity=T)
    with pytest.raises(ValueError, match=r"x must have the cache's batch size B=3"):
        make(rng).decode(x, cache)


def test_full_cache_raises(rng, x):
    mla = make(rng)
    cache = mla.new_cache(batch_size=B, capacity=T - 1)
    with pytest.raises(ValueError, match=r"holds 0 tokens of capacity=6; cannot append T=7"):
        mla.decode(x, cache)


def test_cache_append_wrong_latent_shape_raises():
    cache = LatentKVCache(batch_size=2, d_latent=3, d_rope=4, capacity=5)
    with pytest.raises(ValueError, match=r"latent must have shape \(B, T, Dc\) = \(2, T, 3\)"):
        cache.append(np.zeros((2, 1, 4)), np.zeros((2, 1, 4)))


def test_cache_append_wrong_rope_key_shape_raises():
    cache = LatentKVCache(batch_size=2, d_latent=3, d_rope=4, capacity=5)
    with pytest.raises(ValueError, match=r"rope_key must have shape \(B, T, Dr\) = \(2, 1, 4\)"):
        cache.append(np.zeros((2, 1, 3)), np.zeros((2, 1, 3)))


@pytest.mark.parametrize("name", ["batch_size", "d_latent", "d_rope", "capacity"])
def test_cache_nonpositive_size_raises(name):
    sizes = dict(batch_size=1, d_latent=2, d_rope=2, capacity=3) | {name: 0}
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer; got 0"):
        LatentKVCache(**sizes)


def test_cache_bad_dtype_raises():
    with pytest.raises(ValueError, match="dtype must be np.float32 or np.float64"):
        LatentKVCache(batch_size=1, d_latent=2, d_rope=2, capacity=3, dtype=np.float16)
