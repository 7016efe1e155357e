"""Attention sinks (``sinks=``): one extra logit per row in the softmax's denominator, no value.

Checked against a float64 loop written from the definition (``a_ij = exp(z_ij) / (sum_j
exp(z_ij) + exp(s_i))``), hand-computed cases, plain attention (a sink of ``-inf``, bit for bit),
and, for the gradients, finite differences and torch.autograd on the explicit formula (a sink
column concatenated to the scores, a softmax, the column dropped). Every dimension is a
different size (B=2, Hq=6, Hkv=2, T=5, S=7, Dk=4, Dv=3) so that a swapped axis cannot pass.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from references import attention_loop_2d, band_by_loop, central_differences

import sdpa
from sdpa import KVCache
from sdpa import scaled_dot_product_attention as attention
from sdpa import scaled_dot_product_attention_backward as attention_backward
from sdpa.problem import prepare_attention
from sdpa.tiled import TileStats, attention_tiled

B, HQ, HKV, T, S, DK, DV = 2, 6, 2, 5, 7, 4, 3
PATHS = ["reference", "tiled"]
TOL = {
    np.float64: dict(rtol=1e-12, atol=1e-12),
    np.float32: dict(rtol=2e-5, atol=2e-6),
    np.float16: dict(rtol=4e-3, atol=4e-3),
}


def randn(rng, *shape, dtype=np.float64, size=1.0):
    return (size * rng.standard_normal(shape)).astype(dtype)


# ---------------------------------------------------------------------------------------------
# The independent reference: float64 loops with math.fsum
# ---------------------------------------------------------------------------------------------


def sink_loop(q, k, v, sinks, *, attn_mask=None, is_causal=False, alignment="top_left",
              window=None, scale=None, enable_gqa=False):  # fmt: skip
    """The batched reference: broadcast everything explicitly, one
    ``references.attention_loop_2d`` (with ``sinks``) per head.

    With ``enable_gqa`` query head ``h`` reads key/value head ``h // G`` (``np.repeat``).
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T_, S_ = q.shape[-2], k.shape[-2]
    if enable_gqa:
        G = q.shape[-3] // k.shape[-3]
        k, v = (np.repeat(a, G, axis=-3) for a in (k, v))
    full = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (np.broadcast_to(a, (*full, *a.shape[-2:])) for a in (q, k, v))
    band = band_by_loop(T_, S_, is_causal=is_causal, window=window, alignment=alignment)
    s = np.broadcast_to(np.asarray(sinks, dtype=np.float64), (*full, T_))
    mask = None if attn_mask is None else np.broadcast_to(attn_mask, (*full, T_, S_))
    out, weights = np.zeros((*full, T_, v.shape[-1])), np.zeros((*full, T_, S_))
    lse = np.zeros((*full, T_))
    for idx in np.ndindex(*full):
        allowed, bias = band, None
        if mask is not None and mask.dtype == bool:
            allowed = band & mask[idx]
        elif mask is not None:
            bias = mask[idx]
        out[idx], weights[idx], lse[idx] = attention_loop_2d(
            q[idx], k[idx], v[idx], allowed, bias, scale, sinks=s[idx]
        )
    return out, weights, lse


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", PATHS)
def test_sink_zero_on_equal_scores_gives_one_over_s_plus_one(implementation):
    # A zero query gives every key the score 0; the sink at 0 is one more equal term.
    q = np.zeros((T, DK))
    k = np.arange(S * DK, dtype=float).reshape(S, DK)
    v = np.arange(S * DV, dtype=float).reshape(S, DV)
    out, lse = attention(q, k, v, sinks=0.0, return_lse=True, implementation=implementation)
    np.testing.assert_allclose(lse, np.full(T, math.log(S + 1)), rtol=1e-15)
    # out = sum_j v_j / (S + 1): the mean of the values times S / (S + 1)
    np.testing.assert_allclose(out, np.tile(v.sum(0) / (S + 1), (T, 1)), rtol=1e-14)
    if implementation == "reference":
        weights = attention(q, k, v, sinks=0.0, return_weights=True)[1]
        np.testing.assert_allclose(weights, np.full((T, S), 1 / (S + 1)), rtol=1e-15)


@pytest.mark.parametrize("implementation", PATHS)
def test_one_key_against_a_sink_of_log_three_weighs_one_quarter(implementation):
    # One key, score 0, value 8; a sink of log 3: weight 1 / (1 + 3), lse = log 4.
    out, lse = attention(
        np.zeros((1, 2)), np.ones((1, 2)), np.array([[8.0]]), sinks=math.log(3.0),
        return_lse=True, implementation=implementation,
    )  # fmt: skip
    np.testing.assert_allclose(out, [[2.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [math.log(4.0)], rtol=1e-15)


def test_weights_sum_to_one_minus_the_sink_share(rng):
    q, k, v = randn(rng, B, HQ, T, DK), randn(rng, B, HQ, S, DK), randn(rng, B, HQ, S, DV)
    sinks = randn(rng, HQ, 1, size=2.0)
    _, weights, lse = attention(q, k, v, sinks=sinks, return_weights=True, return_lse=True)
    share = np.exp(np.broadcast_to(sinks, lse.shape) - lse)  # the sink's weight
    assert np.all(weights.sum(-1) < 1) and np.all(share > 0)
    np.testing.assert_allclose(weights.sum(-1) + share, 1.0, rtol=1e-14)


# ---------------------------------------------------------------------------------------------
# Against the float64 loop: both paths, every option
# ---------------------------------------------------------------------------------------------

OPTIONS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "causal-bottom-right": dict(is_causal=True, alignment="bottom_right"),
    "window": dict(window=(2, 1)),
    "window-bottom-right": dict(window=(1, 0), alignment="bottom_right", is_causal=True),
    "gqa": dict(enable_gqa=True),
    "gqa-causal": dict(enable_gqa=True, is_causal=True, alignment="bottom_right"),
}
SINK_SHAPES = {
    "scalar": (),
    "per-query": (T,),
    "per-head": (HQ, 1),
    "full": (B, HQ, T),
}


def _call_options(opts):
    """sink_loop's options as scaled_dot_product_attention's keywords."""
    out = dict(opts)
    if "alignment" in out:
        out["causal_alignment"] = out.pop("alignment")
    return out


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("sink_shape", SINK_SHAPES)
def test_both_paths_equal_the_loop(rng, implementation, option, sink_shape):
    opts = OPTIONS[option]
    Hkv = HKV if opts.get("enable_gqa") else HQ
    q, k, v = randn(rng, B, HQ, T, DK), randn(rng, B, Hkv, S, DK), randn(rng, B, Hkv, S, DV)
    sinks = randn(rng, *SINK_SHAPES[sink_shape], size=2.0)
    want = sink_loop(q, k, v, sinks, **opts)
    got = attention(
        q, k, v, sinks=sinks, return_lse=True, implementation=implementation,
        **_call_options(opts),
    )  # fmt: skip
    for g, w in zip(got, (want[0], want[2])):
        np.testing.assert_allclose(g, w, **TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("mask_kind", ["bool", "bias"])
def test_masks_and_dtypes_equal_the_loop(rng, dtype, mask_kind):
    q, k, v = (randn(rng, B, HQ, n, d, dtype=dtype) for n, d in ((T, DK), (S, DK), (S, DV)))
    sinks = randn(rng, HQ, T, dtype=dtype)
    if mask_kind == "bool":
        mask = rng.random((HQ, T, S)) < 0.6
        mask[0, 1] = False  # a row with no allowed key
    else:
        mask = randn(rng, B, 1, T, S)
        mask[..., 2, :] = -np.inf
    want = sink_loop(q, k, v, sinks, attn_mask=mask)
    for implementation in PATHS:
        out, lse = attention(
            q, k, v, mask, sinks=sinks, return_lse=True, implementation=implementation
        )
        assert out.dtype == dtype and lse.dtype == np.promote_types(dtype, np.float32)
        np.testing.assert_allclose(out, want[0], **TOL[dtype], err_msg=implementation)
        np.testing.assert_allclose(lse, want[2], **TOL[dtype], err_msg=implementation)
    weights = attention(q, k, v, mask, sinks=sinks, return_weights=True)[1]
    np.testing.assert_allclose(weights, want[1], **TOL[dtype])


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("sink", [60.0, 100.0, -300.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sinks_far_from_the_scores_neither_overflow_nor_warn(rng, implementation, sink, dtype):
    # exp(100) overflows float32: the sink must join the shift, not be added as exp(s - m).
    q, k, v = (randn(rng, HQ, n, d, dtype=dtype) for n, d in ((T, DK), (S, DK), (S, DV)))
    want = sink_loop(q, k, v, sink)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention(q, k, v, sinks=sink, return_lse=True, implementation=implementation)
    np.testing.assert_allclose(lse, want[2], **TOL[dtype])
    # Relative to the output's own size, which exp(-sink) scales down; exp(-100) is below
    # float32's normal range, where the weights keep only a few bits (a few subnormal steps).
    size = float(np.abs(want[0]).max())
    subnormal = 8 * S * float(np.finfo(dtype).smallest_subnormal) * float(np.abs(v).max())
    atol = TOL[dtype]["atol"] * size + subnormal
    np.testing.assert_allclose(out, want[0], rtol=TOL[dtype]["rtol"], atol=atol)


def test_tiled_units_redone_from_the_exact_step_add_the_sink(rng):
    # Every score far below zero: the units that start at the shift 0 are walked again
    # (TileStats.redone) and the sink (at 0, far above the scores) must still be added.
    q = -np.ones((HQ, 40, 16))
    k = np.abs(randn(rng, HQ, 50, 16)) + 2.0  # every score below -2 * 16 / 4 = -8 ... -60
    v = randn(rng, HQ, 50, DV)
    sinks = np.linspace(-40, 0, HQ)[:, None]
    stats = TileStats()
    problem = prepare_attention(q, k, v, scale=1.0, sinks=sinks)
    out, lse = attention_tiled(problem, block_q=8, block_k=16, stats=stats)
    assert stats.redone > 0
    want = sink_loop(q, k, v, sinks, scale=1.0)
    np.testing.assert_allclose(lse, want[2], rtol=1e-13)
    size = np.abs(want[0]).max(axis=(-2, -1), keepdims=True)
    np.testing.assert_allclose(out / size, want[0] / size, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("end", ["largest", "smallest"])
def test_values_near_the_ends_of_the_range_keep_the_sinks_share(rng, end):
    # The tiled path computes again on values scaled by a power of two when its result comes
    # near the ends of the range; the sink's share must survive that.
    e = {"largest": 1000, "smallest": -1000}[end]
    q, k = randn(rng, HQ, T, DK), randn(rng, HQ, S, DK)
    v = np.ldexp(randn(rng, HQ, S, DV), e)
    sinks = randn(rng, HQ, 1)
    want = sink_loop(q, k, np.ldexp(v, -e), sinks)[0]
    for implementation in PATHS:
        out = attention(q, k, v, sinks=sinks, implementation=implementation)
        np.testing.assert_allclose(np.ldexp(out, -e), want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# -inf is plain attention; rows with no key; dropout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("option", OPTIONS)
def test_a_sink_of_minus_inf_is_plain_attention_bit_for_bit(rng, implementation, option):
    opts = _call_options(OPTIONS[option])
    Hkv = HKV if opts.get("enable_gqa") else HQ
    q, k, v = randn(rng, B, HQ, T, DK), randn(rng, B, Hkv, S, DK), randn(rng, B, Hkv, S, DV)
    mask = randn(rng, T, S)
    mask[1] = -np.inf  # one row with no key
    for m in (None, mask):
        plain = attention(q, k, v, m, return_lse=True, implementation=implementation, **opts)
        sunk = attention(
            q, k, v, m, sinks=np.full((HQ, 1), -np.inf), return_lse=True,
            implementation=implementation, **opts,
        )  # fmt: skip
        for a, b in zip(plain, sunk):
            np.testing.assert_array_equal(b, a)


def test_a_sink_of_minus_inf_with_weights_and_dropout_is_plain_attention(rng):
    q, k, v = randn(rng, B, HQ, T, DK), randn(rng, B, HQ, S, DK), randn(rng, B, HQ, S, DV)
    kw = dict(dropout_p=0.3, return_weights=True, return_lse=True, is_causal=True)
    plain = attention(q, k, v, rng=np.random.default_rng(5), **kw)
    sunk = attention(q, k, v, sinks=-np.inf, rng=np.random.default_rng(5), **kw)
    for a, b in zip(plain, sunk):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("implementation", PATHS)
def test_rows_with_no_key_give_zeros_and_lse_equal_to_the_sink(rng, implementation):
    # Bottom-right causal with T > S: the first T - S queries see no key.
    T_, S_ = 6, 4
    q, k, v = randn(rng, HQ, T_, DK), randn(rng, HQ, S_, DK), randn(rng, HQ, S_, DV)
    sinks = randn(rng, HQ, T_)
    sinks[0, 0] = -np.inf  # no key and no sink: lse -inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention(
            q, k, v, is_causal=True, causal_alignment="bottom_right", sinks=sinks,
            return_lse=True, implementation=implementation,
        )  # fmt: skip
    np.testing.assert_array_equal(out[:, :2], 0.0)
    np.testing.assert_array_equal(lse[:, :2], sinks[:, :2])  # exactly s_i
    assert lse[0, 0] == -np.inf and not np.isnan(out).any()


@pytest.mark.parametrize("implementation", PATHS)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_no_keys_at_all_give_lse_equal_to_the_sink(implementation, dtype):
    sinks = np.array([0.5, -np.inf, 3.0])
    out, lse = attention(
        np.ones((3, 2), dtype), np.ones((0, 2), dtype), np.ones((0, 4), dtype), sinks=sinks,
        return_lse=True, implementation=implementation,
    )  # fmt: skip
    assert out.shape == (3, 4) and out.dtype == dtype and not out.any()
    np.testing.assert_array_equal(lse, sinks)


def test_dropout_drops_the_keys_weights_and_never_the_sinks(rng):
    # The documented semantics: the weights with the sink's share taken out, then the usual
    # dropout of each key's weight (kept ones scaled by 1 / (1 - p)), from the same draws.
    q, k, v = randn(rng, HQ, T, DK), randn(rng, HQ, S, DK), randn(rng, HQ, S, DV)
    sinks, p = randn(rng, HQ, 1), 0.4
    out = attention(q, k, v, dropout_p=p, rng=np.random.default_rng(11), sinks=sinks)
    weights = sink_loop(q, k, v, sinks)[1]
    keep = np.random.default_rng(11).random(weights.shape) >= p
    np.testing.assert_allclose(out, (weights * keep / (1 - p)) @ v, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# The tiled path: threads, and its agreement with the reference under larger scores
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tiled_sinks_are_bitwise_the_same_on_any_number_of_threads(rng, dtype):
    q, k, v = (randn(rng, B, HQ, n, d, dtype=dtype) for n, d in ((37, 8), (53, 8), (53, 5)))
    sinks = randn(rng, HQ, 37, dtype=dtype, size=3.0)
    problem = prepare_attention(q, k, v, is_causal=True, sinks=sinks)
    results = [attention_tiled(problem, block_q=8, block_k=16, num_threads=n) for n in (1, 2, 3)]
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])


@pytest.mark.parametrize("size", [3.0, 30.0])
def test_tiled_equals_reference_with_large_scores_and_a_bias(rng, size):
    q, k, v = randn(rng, HQ, 40, 8, size=size), randn(rng, HQ, 60, 8), randn(rng, HQ, 60, DV)
    bias = np.where(rng.random((40, 60)) < 0.3, np.finfo(np.float64).min, 0.0)
    sinks = randn(rng, HQ, 1, size=size)
    for mask in (None, bias):
        ref = attention(q, k, v, mask, sinks=sinks, return_lse=True, implementation="reference")
        tiled = attention(q, k, v, mask, sinks=sinks, return_lse=True, implementation="tiled")
        for a, b in zip(ref, tiled):
            np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# The backward pass and the sinks' gradient
# ---------------------------------------------------------------------------------------------


def torch_sink_grads(torch, d_out, q, k, v, sinks, *, allowed=None, enable_gqa=False):
    """(out, d_q, d_k, d_v, d_sinks) by autograd on the explicit formula: the sink's column
    concatenated to the scores, a softmax, the column dropped."""
    tq, tk, tv, ts = (torch.tensor(a, requires_grad=True) for a in (q, k, v, sinks))
    kk, vv = tk, tv
    if enable_gqa:
        G = q.shape[-3] // k.shape[-3]
        kk, vv = (x.repeat_interleave(G, dim=-3) for x in (tk, tv))
    z = tq @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        z = z.masked_fill(~torch.tensor(allowed), -math.inf)
    col = ts.expand(z.shape[:-1]).unsqueeze(-1)
    a = torch.softmax(torch.cat([z, col], dim=-1), dim=-1)[..., :-1]
    out = a @ vv
    out.backward(torch.tensor(d_out))
    return out.detach().numpy(), *(t.grad.numpy() for t in (tq, tk, tv, ts))


BACKWARD_PATHS = [
    pytest.param(dict(implementation="reference"), id="reference"),
    pytest.param(dict(implementation="tiled", block_q=2, block_k=3), id="tiled-2x3"),
]


@pytest.mark.parametrize("kw", BACKWARD_PATHS)
@pytest.mark.parametrize("sink_shape", SINK_SHAPES)
@pytest.mark.parametrize("given", [False, True])
def test_gradients_equal_torch_autograd(torch, rng, kw, sink_shape, given):
    q, k, v = randn(rng, B, HQ, T, DK), randn(rng, B, HKV, S, DK), randn(rng, B, HKV, S, DV)
    sinks, d_out = randn(rng, *SINK_SHAPES[sink_shape]), randn(rng, B, HQ, T, DV)
    band = band_by_loop(T, S, is_causal=True, alignment="bottom_right")
    opts = dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True, sinks=sinks)
    want = torch_sink_grads(torch, d_out, q, k, v, sinks, allowed=band, enable_gqa=True)
    extra = {}
    if given:
        extra["out"], extra["lse"] = attention(q, k, v, return_lse=True, **opts)
    grads = attention_backward(d_out, q, k, v, **opts, **extra, **kw)
    assert len(grads) == 4
    for got, w, what in zip(grads, want[1:], ("d_query", "d_key", "d_value", "d_sinks")):
        assert got.shape == w.shape, what
        np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("kw", BACKWARD_PATHS)
def test_gradients_in_float32_equal_torch_autograd(torch, rng, kw):
    q, k, v = (randn(rng, HQ, n, d, dtype=np.float32) for n, d in ((T, DK), (S, DK), (S, DV)))
    sinks, d_out = randn(rng, HQ, 1, dtype=np.float32), randn(rng, HQ, T, DV, dtype=np.float32)
    want = torch_sink_grads(torch, d_out, *(a.astype(np.float64) for a in (q, k, v, sinks)))
    grads = attention_backward(d_out, q, k, v, sinks=sinks, **kw)
    for got, w in zip(grads, want[1:]):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", BACKWARD_PATHS)
def test_gradients_with_large_scores_equal_torch_autograd(torch, rng, kw):
    # Scores with a root-mean-square far above 1.5: the tiled backward renormalises these rows
    # from its own scores (m and l, the sink's term included) instead of trusting lse.
    q, k, v = (
        randn(rng, HQ, T, DK, size=4.0),
        randn(rng, HQ, S, DK, size=4.0),
        randn(rng, HQ, S, DV),
    )
    sinks, d_out = randn(rng, HQ, 1, size=8.0), randn(rng, HQ, T, DV)
    want = torch_sink_grads(torch, d_out, q, k, v, sinks)
    out, lse = attention(q, k, v, sinks=sinks, return_lse=True)
    grads = attention_backward(d_out, q, k, v, sinks=sinks, out=out, lse=lse, **kw)
    for got, w in zip(grads, want[1:]):
        scale = float(np.abs(w).max())
        np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-11 * scale)


@pytest.mark.parametrize("kw", BACKWARD_PATHS)
def test_gradients_equal_finite_differences(rng, kw):
    q, k, v = randn(rng, 3, T, DK), randn(rng, 3, S, DK), randn(rng, 3, S, DV)
    sinks, d_out = randn(rng, 3, T), randn(rng, 3, T, DV)
    mask = rng.random((T, S)) < 0.7
    mask[2] = False  # a row with no key: its sink gets no gradient

    def loss(q_, k_, v_, s_):
        return float(np.sum(d_out * attention(q_, k_, v_, mask, sinks=s_)))

    grads = attention_backward(d_out, q, k, v, mask, sinks=sinks, **kw)
    args = [q, k, v, sinks]
    for i, got in enumerate(grads):

        def f(x, i=i):
            return loss(*args[:i], x, *args[i + 1 :])

        np.testing.assert_allclose(got, central_differences(f, args[i]), rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(grads[3][:, 2], 0.0)


def test_sink_gradient_equals_sdpa_numerical_gradient(rng):
    q, k, v = randn(rng, HQ, T, DK), randn(rng, HQ, S, DK), randn(rng, HQ, S, DV)
    sinks, d_out = randn(rng, HQ, 1), randn(rng, HQ, T, DV)
    (want,) = sdpa.numerical_gradient(
        lambda s: attention(q, k, v, sinks=s, is_causal=True), (sinks,), d_out
    )
    got = attention_backward(d_out, q, k, v, sinks=sinks, is_causal=True)[3]
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize(
    "sinks, shape, dtype",
    [
        (0.5, (), np.float64),
        (np.float32(0.5), (), np.float32),
        (np.ones((HQ, 1), dtype=np.float32), (HQ, 1), np.float32),
        (np.ones((HQ, 1), dtype=np.int64), (HQ, 1), np.float64),
        ([0.0] * T, (T,), np.float64),
    ],
)
def test_sink_gradient_has_the_sinks_shape_and_dtype(rng, sinks, shape, dtype):
    q, k, v = randn(rng, HQ, T, DK), randn(rng, HQ, S, DK), randn(rng, HQ, S, DV)
    d_sinks = attention_backward(randn(rng, HQ, T, DV), q, k, v, sinks=sinks)[3]
    assert d_sinks.shape == shape and d_sinks.dtype == dtype


def test_sink_gradient_sums_over_the_rows_that_share_it(rng):
    q, k, v = randn(rng, HQ, T, DK), randn(rng, HQ, S, DK), randn(rng, HQ, S, DV)
    d_out, per_row = randn(rng, HQ, T, DV), randn(rng, HQ, 1) * np.ones((HQ, T))
    full = attention_backward(d_out, q, k, v, sinks=per_row)[3]  # (Hq, T)
    per_head = attention_backward(d_out, q, k, v, sinks=per_row[:, :1])[3]  # (Hq, 1)
    np.testing.assert_allclose(per_head, full.sum(-1, keepdims=True), rtol=1e-13)


def test_a_sink_of_minus_inf_gets_no_gradient_and_leaves_the_others_unchanged(rng):
    q, k, v = randn(rng, HQ, T, DK), randn(rng, HQ, S, DK), randn(rng, HQ, S, DV)
    d_out = randn(rng, HQ, T, DV)
    plain = attention_backward(d_out, q, k, v, implementation="reference")
    grads = attention_backward(d_out, q, k, v, sinks=-np.inf, implementation="reference")
    for a, b in zip(plain, grads[:3]):
        np.testing.assert_array_equal(b, a)
    assert grads[3] == 0.0


@pytest.mark.parametrize("implementation", PATHS)
def test_a_nan_query_row_makes_its_sink_gradient_nan(rng, implementation):
    q, k, v = randn(rng, HQ, T, DK), randn(rng, HQ, S, DK), randn(rng, HQ, S, DV)
    q[1, 3, 0] = np.nan
    sinks = randn(rng, HQ, T)
    d_sinks = attention_backward(
        randn(rng, HQ, T, DV), q, k, v, sinks=sinks, implementation=implementation
    )[3]
    assert np.isnan(d_sinks[1, 3]) and np.isnan(d_sinks).sum() == 1


def test_without_sinks_the_backward_still_returns_three_gradients(rng):
    q = randn(rng, T, DK)
    assert len(attention_backward(np.ones((T, DK)), q, q, q)) == 3


# ---------------------------------------------------------------------------------------------
# The KV cache passes sinks on
# ---------------------------------------------------------------------------------------------


def test_kv_cache_decoding_with_sinks_equals_causal_attention(rng):
    n = 9
    q, k, v = randn(rng, 1, HQ, n, DK), randn(rng, 1, HKV, n, DK), randn(rng, 1, HKV, n, DV)
    sinks = randn(rng, HQ, 1)
    cache = KVCache(1, HKV, DK, value_dim=DV, capacity=2)
    outs = []
    for t0, t1 in ((0, 4), (4, 5), (5, 7), (7, 8), (8, 9)):
        cache.append(0, k[:, :, t0:t1], v[:, :, t0:t1])
        outs.append(cache.attend(0, q[:, :, t0:t1], sinks=sinks))
    want = sink_loop(q, k, v, sinks, is_causal=True, enable_gqa=True)[0]
    np.testing.assert_allclose(np.concatenate(outs, axis=2), want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Bad sinks: one test per message
# ---------------------------------------------------------------------------------------------


def q_k_v(rng):
    return randn(rng, HQ, T, DK), randn(rng, HQ, S, DK), randn(rng, HQ, S, DV)


@pytest.mark.parametrize("shape", [(HQ,), (T, 1, 1), (2, HQ, T), (HQ, S)])
def test_sinks_that_do_not_broadcast_to_the_rows_raise(rng, shape):
    with pytest.raises(
        ValueError,
        match=r"sinks must broadcast to the weights' shape without the key axis, \(6, 5\) "
        r"\(\.\.\., H, T\): a per-head logit is sinks\[:, None\], of shape \(H, 1\); "
        rf"got sinks.shape={re_shape(shape)}",
    ):
        attention(*q_k_v(rng), sinks=np.zeros(shape))


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_gqa_sinks_are_checked_against_the_query_heads(rng):
    q, k, v = randn(rng, HQ, T, DK), randn(rng, HKV, S, DK), randn(rng, HKV, S, DV)
    with pytest.raises(ValueError, match=r"sinks must broadcast .* got sinks.shape=\(2, 1\)"):
        attention(q, k, v, enable_gqa=True, sinks=np.zeros((HKV, 1)))


@pytest.mark.parametrize("bad, word", [(np.nan, "NaN"), (np.inf, r"\+inf")])
def test_nan_or_plus_inf_sinks_raise(rng, bad, word):
    with pytest.raises(
        ValueError, match=rf"sinks must hold finite logits or -inf \(no sink\); got {word}"
    ):
        attention(*q_k_v(rng), sinks=np.array([0.0, bad, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("sinks", [np.zeros(T, dtype=bool), np.zeros(T, dtype=complex)])
def test_sinks_of_another_kind_raise(rng, sinks):
    with pytest.raises(
        TypeError,
        match=f"sinks must be a real floating or integer array of logits; got dtype {sinks.dtype}",
    ):
        attention(*q_k_v(rng), sinks=sinks)


def test_sinks_beyond_the_working_dtype_raise(rng):
    q, k, v = (a.astype(np.float32) for a in q_k_v(rng))
    with pytest.raises(ValueError, match=r"sinks must fit in float32, the dtype the scores are"):
        attention(q, k, v, sinks=np.full(T, 1e300))


def test_masked_array_sinks_raise(rng):
    with pytest.raises(TypeError, match="sinks must not be a numpy.ma.MaskedArray"):
        attention(*q_k_v(rng), sinks=np.ma.masked_array(np.zeros(T), mask=[1, 0, 0, 0, 0]))


def test_sinks_are_not_modified_and_their_dtype_does_not_change_the_output(rng):
    q, k, v = (a.astype(np.float32) for a in q_k_v(rng))
    sinks = randn(rng, HQ, 1)
    before = sinks.copy()
    sinks.flags.writeable = False
    out = attention(q, k, v, sinks=sinks, implementation="tiled")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(sinks, before)
