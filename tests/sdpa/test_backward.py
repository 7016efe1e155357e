"""The attention backward pass, checked three ways: finite differences, torch.autograd, and the
two implementations (whole-matrix and tiled) against each other.

Every dimension is a different size (B=2, H=3, T=5, S=7, Dk=4, Dv=6) so that a swapped axis
cannot pass.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from references import band_by_loop, central_differences

import sdpa
from sdpa import scaled_dot_product_attention as attention
from sdpa import scaled_dot_product_attention_backward as attention_backward

B, H, T, S, DK, DV = 2, 3, 5, 7, 4, 6
F64 = dict(rtol=1e-10, atol=1e-10)  # agreement with torch in float64
F32 = dict(rtol=1e-5, atol=1e-5)  # and in float32
IMPLEMENTATIONS = [
    pytest.param(dict(implementation="reference"), id="reference"),
    pytest.param(dict(implementation="tiled", block_q=2, block_k=3), id="tiled-2x3"),
]


# ---------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------


def torch_grads(
    torch,
    d_out,
    q,
    k,
    v,
    attn_mask=None,
    *,
    is_causal=False,
    bottom_right=False,
    window=None,
    scale=None,
    enable_gqa=False,
):
    """(out, d_q, d_k, d_v) from torch.autograd; masks we support beyond torch become explicit."""
    tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    T_, S_ = q.shape[-2], k.shape[-2]
    mask = None if attn_mask is None else np.asarray(attn_mask)
    if mask is not None and mask.ndim < 2:
        mask = np.broadcast_to(mask, (T_, S_))  # torch wants at least (T, S)
    torch_causal = False
    if window is not None or (is_causal and mask is not None and not bottom_right):
        allowed = band_by_loop(
            T_,
            S_,
            is_causal=is_causal,
            window=window,
            alignment="bottom_right" if bottom_right else "top_left",
        )
        if mask is None:
            mask = allowed
        elif mask.dtype == bool:
            mask = mask & allowed
        else:
            mask = np.where(allowed, mask, -np.inf)
    elif is_causal and bottom_right:
        assert mask is None, "the test combines bottom-right causality only with no mask"
    elif is_causal:
        torch_causal = True
    if is_causal and bottom_right and window is None:
        from torch.nn.attention.bias import causal_lower_right

        with warnings.catch_warnings():
            # torch warns that the CausalBias API is new ("prototype"); that is not our concern.
            warnings.simplefilter("ignore", UserWarning)
            torch_mask = causal_lower_right(T_, S_)
    else:
        torch_mask = None if mask is None else torch.tensor(mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = torch.nn.functional.scaled_dot_product_attention(
            *tensors,
            attn_mask=torch_mask,
            is_causal=torch_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        out.backward(torch.tensor(d_out))
    return (out.detach().numpy(), *(t.grad.numpy() for t in tensors))


def randn(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Against torch.autograd
# ---------------------------------------------------------------------------------------------


def _mask_cases(rng):
    """(name, q shape, k shape, v shape, options) over the API's surface."""
    padding = np.ones((B, 1, 1, S), dtype=bool)
    padding[1, 0, 0, 4:] = False
    bias = np.where(rng.random((1, H, 1, S)) < 0.3, -np.inf, rng.standard_normal((1, H, 1, S)))
    full_bool = rng.random((B, H, T, S)) < 0.6
    full_bool[..., 0] = True
    rows_off = rng.random((T, S)) < 0.7
    rows_off[2] = False  # a fully masked row
    bias_rows_off = rng.standard_normal((T, S))
    bias_rows_off[[0, 3]] = -np.inf  # fully masked rows through a float mask
    q4, k4, v4 = (B, H, T, DK), (B, H, S, DK), (B, H, S, DV)
    return [
        ("plain", q4, k4, v4, {}),
        ("2-D", (T, DK), (S, DK), (S, DV), {}),
        ("T>S", (B, H, 9, DK), (B, H, 4, DK), (B, H, 4, DV), {}),
        ("scale", q4, k4, v4, dict(scale=0.37)),
        ("bool (S,)", q4, k4, v4, dict(attn_mask=rng.random(S) < 0.7)),
        ("bool (T, S)", q4, k4, v4, dict(attn_mask=rng.random((T, S)) < 0.7)),
        ("bool padding (B,1,1,S)", q4, k4, v4, dict(attn_mask=padding)),
        ("bool full", q4, k4, v4, dict(attn_mask=full_bool)),
        ("float (1,H,1,S) with -inf", q4, k4, v4, dict(attn_mask=bias)),
        ("float (T, S)", q4, k4, v4, dict(attn_mask=rng.standard_normal((T, S)))),
        ("causal top-left T<S", q4, k4, v4, dict(is_causal=True)),
        ("causal top-left T>S", (B, H, 9, DK), (B, H, 4, DK), (B, H, 4, DV), dict(is_causal=True)),
        ("causal bottom-right T<S", q4, k4, v4, dict(is_causal=True, bottom_right=True)),
        (
            "causal bottom-right T>S (masked rows)",
            (B, H, 9, DK),
            (B, H, 4, DK),
            (B, H, 4, DV),
            dict(is_causal=True, bottom_right=True),
        ),
        ("causal and bool mask", q4, k4, v4, dict(is_causal=True, attn_mask=full_bool)),
        ("window (1, 0)", q4, k4, v4, dict(window=(1, 0))),
        ("window (2, 1) bottom-right", q4, k4, v4, dict(window=(2, 1), bottom_right=True)),
        ("window (None, 0) causal", q4, k4, v4, dict(window=(None, 1), is_causal=True)),
        ("fully masked rows, bool", q4, k4, v4, dict(attn_mask=rows_off)),
        ("fully masked rows, float", q4, k4, v4, dict(attn_mask=bias_rows_off)),
        ("broadcast q (H,T,Dk)", (H, T, DK), k4, v4, {}),
        ("broadcast k (1,H,S,Dk), v (B,1,S,Dv)", q4, (1, H, S, DK), (B, 1, S, DV), {}),
        ("MQA by broadcasting (Hkv=1)", q4, (B, 1, S, DK), (B, 1, S, DV), dict(is_causal=True)),
        ("GQA Hq=6 Hkv=3", (B, 6, T, DK), k4, v4, dict(enable_gqa=True)),
        (
            "GQA Hq=6 Hkv=2, per-head mask",
            (B, 6, T, DK),
            (B, 2, S, DK),
            (B, 2, S, DV),
            dict(enable_gqa=True, attn_mask=rng.random((B, 6, T, S)) < 0.7),
        ),
        (
            "GQA Hq=6 Hkv=1, causal",
            (B, 6, T, DK),
            (B, 1, S, DK),
            (B, 1, S, DV),
            dict(enable_gqa=True, is_causal=True),
        ),
        (
            "GQA, broadcast batch of q",
            (6, T, DK),
            (B, 2, S, DK),
            (B, 2, S, DV),
            dict(enable_gqa=True, attn_mask=padding),
        ),
    ]


CASES = _mask_cases(np.random.default_rng(7))


def _our_options(options):
    opts = dict(options)
    if opts.pop("bottom_right", False):
        opts["causal_alignment"] = "bottom_right"
    return opts


@pytest.mark.torch
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_autograd_float64(torch, rng, case, impl):
    _, q_shape, k_shape, v_shape, options = case
    q, k, v = randn(rng, *q_shape), randn(rng, *k_shape), randn(rng, *v_shape)
    opts = _our_options(options)
    out = attention(q, k, v, **opts)
    d_out = randn(rng, *out.shape)
    t_out, t_dq, t_dk, t_dv = torch_grads(torch, d_out, q, k, v, **options)
    np.testing.assert_allclose(out, t_out, **F64)  # the forward agrees: same problem
    d_q, d_k, d_v = attention_backward(d_out, q, k, v, **opts, **impl)
    for ours, theirs, like in ((d_q, t_dq, q), (d_k, t_dk, k), (d_v, t_dv, v)):
        assert ours.shape == like.shape and ours.dtype == np.float64
        assert np.isfinite(ours).all()
        np.testing.assert_allclose(ours, theirs, **F64)


@pytest.mark.torch
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "name",
    [
        "plain",
        "T>S",
        "float (1,H,1,S) with -inf",
        "causal top-left T>S",
        "causal bottom-right T<S",
        "window (1, 0)",
        "fully masked rows, bool",
        "fully masked rows, float",
        "GQA Hq=6 Hkv=2, per-head mask",
        "broadcast q (H,T,Dk)",
        "broadcast k (1,H,S,Dk), v (B,1,S,Dv)",
    ],
)
def test_matches_torch_autograd_float32(torch, rng, name, impl):
    _, q_shape, k_shape, v_shape, options = next(c for c in CASES if c[0] == name)
    q, k, v = (randn(rng, *s, dtype=np.float32) for s in (q_shape, k_shape, v_shape))
    opts = _our_options(options)
    if "attn_mask" in options and options["attn_mask"].dtype != bool:
        options = dict(options, attn_mask=options["attn_mask"].astype(np.float32))
    d_out = randn(rng, *attention(q, k, v, **opts).shape, dtype=np.float32)
    _, t_dq, t_dk, t_dv = torch_grads(torch, d_out, q, k, v, **options)
    grads = attention_backward(d_out, q, k, v, **opts, **impl)
    for ours, theirs in zip(grads, (t_dq, t_dk, t_dv)):
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, theirs, **F32)


# ---------------------------------------------------------------------------------------------
# Against finite differences (float64)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(is_causal=True, causal_alignment="bottom_right"),
        dict(window=(1, 1), scale=0.8),
        dict(attn_mask=np.array([True, False, True, True])),
    ],
    ids=["plain", "causal bottom-right", "window and scale", "bool mask"],
)
def test_matches_a_central_difference_loop(rng, options):
    q, k, v = randn(rng, 2, 3, 2), randn(rng, 2, 4, 2), randn(rng, 2, 4, 3)  # (H, L, D)
    d_out = randn(rng, 2, 3, 3)

    def loss(q_, k_, v_):
        return float(np.sum(d_out * attention(q_, k_, v_, **options)))

    d_q, d_k, d_v = attention_backward(d_out, q, k, v, **options)
    tol = dict(rtol=1e-7, atol=1e-9)  # central differences with eps=1e-6: error ~ 1e-10
    np.testing.assert_allclose(d_q, central_differences(lambda x: loss(x, k, v), q), **tol)
    np.testing.assert_allclose(d_k, central_differences(lambda x: loss(q, x, v), k), **tol)
    np.testing.assert_allclose(d_v, central_differences(lambda x: loss(q, k, x), v), **tol)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_passes_gradcheck_with_broadcasting_gqa_and_a_float_mask(rng, implementation):
    q = randn(rng, 4, 3, 2)  # (Hq, T, Dk), no batch axis
    k = randn(rng, 2, 2, 5, 2)  # (B, Hkv, S, Dk)
    v = randn(rng, 1, 2, 5, 3)  # (1, Hkv, S, Dv): broadcast over the batch
    bias = np.where(rng.random((3, 5)) < 0.3, -np.inf, rng.standard_normal((3, 5)))
    options = dict(attn_mask=bias, enable_gqa=True, is_causal=True, causal_alignment="bottom_right")

    def forward(q_, k_, v_):
        return attention(q_, k_, v_, **options)

    def vjp(d_out, q_, k_, v_):
        return attention_backward(
            d_out, q_, k_, v_, **options, implementation=implementation, block_q=2, block_k=2
        )

    assert sdpa.gradcheck(forward, vjp, (q, k, v), rtol=1e-7, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Hand-derived properties
# ---------------------------------------------------------------------------------------------


def test_value_gradient_of_a_sum_counts_attention_received(rng):
    # L = sum(out) = sum_i sum_j P_ij sum_c v_jc, so dL/dv_jc = sum_i P_ij: the total weight
    # that key j receives. Each row of P sums to one, so these totals add up to T.
    q, k, v = randn(rng, T, DK), randn(rng, S, DK), randn(rng, S, DV)
    _, weights = attention(q, k, v, return_weights=True)
    _, _, d_v = attention_backward(np.ones((T, DV)), q, k, v)
    np.testing.assert_allclose(d_v, np.repeat(weights.sum(0)[:, None], DV, axis=1), rtol=1e-13)
    np.testing.assert_allclose(d_v.sum(0), np.full(DV, T), rtol=1e-13)


def test_key_gradients_sum_to_zero(rng):
    # Moving every key by the same vector c adds q_i . c to a whole row of scores, which the
    # softmax ignores; so the derivative along that direction, sum_j d_k[j], is zero.
    q, k, v = randn(rng, B, H, T, DK), randn(rng, B, H, S, DK), randn(rng, B, H, S, DV)
    d_out = randn(rng, B, H, T, DV)
    for impl in ("reference", "tiled"):
        _, d_k, _ = attention_backward(d_out, q, k, v, is_causal=True, implementation=impl)
        np.testing.assert_allclose(d_k.sum(axis=-2), 0.0, atol=1e-13)


def test_hand_computed_two_keys():
    # One query, two keys, scale 1: scores (a, 0) with a = q . k_0, P = (p, 1 - p),
    # p = sigmoid(a); out = p v_0 + (1 - p) v_1. With L = out (Dv = 1):
    # dL/dv = (p, 1 - p) and dL/da = p (1 - p) (v_0 - v_1), so dL/dq = p (1 - p)(v_0 - v_1) k_0.
    q = np.array([[1.0, 2.0]])
    k = np.array([[0.5, 0.25], [0.0, 0.0]])
    v = np.array([[3.0], [1.0]])
    a = 1.0  # q . k_0
    p = 1 / (1 + np.exp(-a))
    d_q, d_k, d_v = attention_backward(np.ones((1, 1)), q, k, v, scale=1.0)
    np.testing.assert_allclose(d_v, [[p], [1 - p]], rtol=1e-14)
    np.testing.assert_allclose(d_q, [p * (1 - p) * 2.0 * k[0]], rtol=1e-14)
    np.testing.assert_allclose(
        d_k, [p * (1 - p) * 2.0 * q[0], -p * (1 - p) * 2.0 * q[0]], rtol=1e-14
    )


# ---------------------------------------------------------------------------------------------
# The two implementations, and out/lse reuse
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (2, 3), (3, 5), (4, 2), (7, 11), (64, 64)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_tiled_equals_reference(rng, block_q, block_k, num_threads):
    # 13 queries and 11 keys: no tile size divides both. Per-head bool mask with rows that are
    # fully masked only inside some tiles, a float bias, a window, GQA and a broadcast batch.
    q = randn(rng, 2, 4, 13, 3)  # (B, Hq, T, Dk)
    k = randn(rng, 1, 2, 11, 3)  # (1, Hkv, S, Dk)
    v = randn(rng, 2, 2, 11, 5)  # (B, Hkv, S, Dv)
    allowed = rng.random((2, 4, 13, 11)) < 0.6
    allowed[..., 3, :] = False  # one fully masked row
    allowed[..., 5, :6] = False  # masked in the first tiles only
    bias = rng.standard_normal((13, 11))
    options = dict(enable_gqa=True, window=(6, 2), causal_alignment="bottom_right")
    d_out = randn(rng, 2, 4, 13, 5)
    for mask in (allowed, bias):
        ref = attention_backward(d_out, q, k, v, mask, **options, implementation="reference")
        tiled = attention_backward(
            d_out,
            q,
            k,
            v,
            mask,
            **options,
            implementation="tiled",
            block_q=block_q,
            block_k=block_k,
            num_threads=num_threads,
        )
        for a, b in zip(ref, tiled):
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_out_and_lse_given_skip_the_forward(rng, monkeypatch, implementation):
    q, k, v = randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    d_out = randn(rng, H, T, DV)
    out, lse = attention(q, k, v, is_causal=True, return_lse=True)
    expected = attention_backward(d_out, q, k, v, is_causal=True, implementation=implementation)

    def no_forward(*args, **kwargs):
        raise AssertionError("the forward pass was recomputed")

    import sdpa.backward

    monkeypatch.setattr(sdpa.backward, "attention_reference", no_forward)
    monkeypatch.setattr(sdpa.backward, "attention_tiled", no_forward)
    with pytest.raises(AssertionError, match="recomputed"):  # the patch is effective
        attention_backward(d_out, q, k, v, is_causal=True, implementation=implementation)
    got = attention_backward(
        d_out, q, k, v, is_causal=True, out=out, lse=lse, implementation=implementation
    )
    for a, b in zip(expected, got):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)


def test_auto_tiles_large_problems_only(rng, monkeypatch):
    import sdpa.backward as backward

    calls = []
    real = backward.backward_tiled
    monkeypatch.setattr(
        backward, "backward_tiled", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    small = randn(rng, 4, 8, 2)
    attention_backward(randn(rng, 4, 8, 2), small, small, small)
    assert calls == []
    n = 1024  # 1024 * 1024 scores: above the threshold
    big = randn(rng, n, 2)
    attention_backward(randn(rng, n, 2), big, big, big, window=(1, 0))
    assert calls == [1]


def test_auto_tiles_exactly_when_the_forward_pass_does(rng, monkeypatch):
    # Problems on both sides of the forward pass's rule (sdpa.cost_model.worth_tiling): one head,
    # several, GQA, many small heads. The backward pass takes the tiled path iff the forward
    # pass does, and both decisions occur.
    import sdpa.attention
    import sdpa.backward as backward

    forward_calls, backward_calls = [], []
    real_forward, real_backward = sdpa.attention.attention_tiled, backward.backward_tiled
    monkeypatch.setattr(
        sdpa.attention,
        "attention_tiled",
        lambda *a, **kw: forward_calls.append(1) or real_forward(*a, **kw),
    )
    monkeypatch.setattr(
        backward,
        "backward_tiled",
        lambda *a, **kw: backward_calls.append(1) or real_backward(*a, **kw),
    )
    decisions = set()
    for heads, kv_heads, T_, S_ in (
        (1, 1, 64, 512),
        (1, 1, 512, 512),
        (2, 2, 300, 512),
        (4, 2, 512, 512),
        (2048, 2048, 8, 8),
    ):
        q, d_out = randn(rng, heads, T_, 2), randn(rng, heads, T_, 3)
        k, v = randn(rng, kv_heads, S_, 2), randn(rng, kv_heads, S_, 3)
        opts = dict(enable_gqa=heads != kv_heads, is_causal=True)
        forward_calls.clear()
        backward_calls.clear()
        attention(q, k, v, **opts)
        attention_backward(d_out, q, k, v, **opts)
        assert bool(forward_calls) == bool(backward_calls), (heads, kv_heads, T_, S_)
        decisions.add(bool(backward_calls))
    assert decisions == {False, True}


def test_tiled_backward_memory_does_not_grow_with_the_score_matrix(rng):
    import tracemalloc

    n, d = 1024, 8
    q, k, v, d_out = (randn(rng, n, d) for _ in range(4))
    out, lse = attention(q, k, v, return_lse=True)
    peaks = {}
    for impl in ("reference", "tiled"):
        tracemalloc.start()
        attention_backward(d_out, q, k, v, out=out, lse=lse, implementation=impl, num_threads=1)
        peaks[impl] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    scores_bytes = n * n * 8
    assert peaks["reference"] > 2 * scores_bytes  # P and dS at least
    assert peaks["tiled"] < scores_bytes / 4  # a few (Bq, Bk) tiles and O(n d) arrays


# ---------------------------------------------------------------------------------------------
# The tiled path: reproducible to the bit, and as accurate as the reference path
# ---------------------------------------------------------------------------------------------


def _reproducibility_case(rng, factor=3.0):
    """float32, causal, GQA, 11 key tiles of 8: the order of d_q's additions shows in its last
    bits (see the next test). q and k times 3 give scores in the tens, whose rows the tiled
    path renormalises; times 0.75, scores of RMS below 1, whose weights it takes from lse."""
    q = randn(rng, 3, 4, 61, 16, dtype=np.float32) * factor  # (B, Hq, T, Dk)
    k = randn(rng, 3, 2, 88, 16, dtype=np.float32) * factor  # (B, Hkv, S, Dk)
    v = randn(rng, 3, 2, 88, 5, dtype=np.float32)  # (B, Hkv, S, Dv)
    d_out = randn(rng, 3, 4, 61, 5, dtype=np.float32)
    options = dict(is_causal=True, enable_gqa=True, implementation="tiled", block_q=8, block_k=8)
    return (d_out, q, k, v), options


@pytest.mark.parametrize("factor", [0.75, 3.0], ids=["from lse", "renormalised"])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_tiled_backward_is_bitwise_reproducible_from_any_thread(rng, num_threads, factor):
    # Which worker adds which key tile into d_q, and so the rounding of d_q, must not depend on
    # the scheduling: 24 calls made at once from 6 threads equal a call from the main thread.
    args, options = _reproducibility_case(rng, factor)
    want = attention_backward(*args, **options, num_threads=num_threads)
    with ThreadPoolExecutor(max_workers=6) as pool:
        calls = [
            pool.submit(attention_backward, *args, **options, num_threads=num_threads)
            for _ in range(24)
        ]
        results = [call.result() for call in calls]
    for got in results:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_the_order_of_additions_shows_in_the_bits_of_d_q(rng, monkeypatch):
    # The test above can fail: with the key tiles shared out at random among the 3 workers,
    # d_q's bits change (and d_k, d_v, whose tiles one worker each computes, do not).
    import sdpa.backward as backward

    args, options = _reproducibility_case(rng)
    want = attention_backward(*args, **options, num_threads=3)
    shuffle = np.random.default_rng(1)

    def random_shares(costs, num_threads):
        owner = shuffle.integers(num_threads, size=len(costs))
        return [list(np.flatnonzero(owner == w)) for w in range(num_threads)]

    monkeypatch.setattr(backward, "_assign_tiles", random_shares)
    results = [attention_backward(*args, **options, num_threads=3) for _ in range(4)]
    assert any(not np.array_equal(got[0], want[0]) for got in results)
    for got in results:
        np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])


def test_key_tiles_are_shared_evenly_under_a_causal_mask():
    # Causal, T = S = 1024 in (128, 256) tiles: key tile j meets 8, 6, 4, 2 query tiles. The
    # fixed rule gives two workers 8 + 2 and 6 + 4 of them, as even as a shared queue would.
    import sdpa.backward as backward
    from sdpa.problem import prepare_attention

    x = np.zeros((1024, 2))
    problem = prepare_attention(x, x, x, is_causal=True)
    q_spans, k_spans = backward._spans(1024, 128), backward._spans(1024, 256)
    costs = [backward._band_area(problem, q_spans, [span]) for span in k_spans]
    assert costs == [n * 128 * 256 for n in (8, 6, 4, 2)]
    assert backward._assign_tiles(costs, 2) == [[0, 3], [1, 2]]
    assert backward._assign_tiles(costs, 3) == [[0], [1], [2, 3]]


def exact_gradients(d_out, q, k, v, allowed=None, *, is_causal=False, enable_gqa=False):
    """``(d_q, d_k, d_v)`` by the textbook formulas in extended precision (``np.longdouble``),
    the yardstick of the accuracy test: a float64 result needs one finer than float64."""
    X = np.longdouble
    q, k, v, d_out = (np.asarray(a, dtype=X) for a in (q, k, v, d_out))
    G = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    k, v = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3)  # key/value head h // G
    T_, S_, Dk = q.shape[-2], k.shape[-2], q.shape[-1]
    ok = band_by_loop(T_, S_, is_causal=is_causal)
    if allowed is not None:
        ok = ok & allowed
    scale = 1 / np.sqrt(X(Dk))
    scores = np.where(ok, (q @ np.swapaxes(k, -1, -2)) * scale, -np.inf)  # (..., T, S)
    top = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - np.where(np.isfinite(top), top, 0))
    total = e.sum(axis=-1, keepdims=True)
    weights = e / np.where(total > 0, total, 1)  # fully masked rows: zeros
    delta = np.sum(d_out * (weights @ v), axis=-1, keepdims=True)  # (..., T, 1)
    d_scores = weights * (d_out @ np.swapaxes(v, -1, -2) - delta) * scale
    d_q = d_scores @ k  # (..., T, S) @ (..., S, Dk)
    d_k = np.swapaxes(d_scores, -1, -2) @ q  # (..., S, T) @ (..., T, Dk)
    d_v = np.swapaxes(weights, -1, -2) @ d_out  # (..., S, T) @ (..., T, Dv)
    if G > 1:  # each key/value head receives the sum over its group
        d_k, d_v = (x.reshape(*x.shape[:-3], -1, G, *x.shape[-2:]).sum(-3) for x in (d_k, d_v))
    return d_q, d_k, d_v


def _relative_error(got, exact):
    """Normwise relative error ``|got - exact| / |exact|`` (Frobenius norms)."""
    diff = got.astype(np.longdouble) - exact
    return float(np.linalg.norm(diff.ravel()) / np.linalg.norm(exact.ravel()))


FACTORS = (1, 10, 30, 100)  # q and k times these: scores of order 1 to 10^4


@pytest.mark.parametrize("case", ["plain", "bool mask", "GQA"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tiled_backward_is_as_accurate_as_the_reference_at_large_scores(
    rng, dtype, is_causal, case
):
    # The tiled path rebuilds the weights from the forward pass's lse, computed from scores
    # rounded in another arithmetic; at scores in the thousands its rows summed to 1 +- |s| eps
    # and its errors were up to 10^4 times the reference path's. Within 2x on the whole grid.
    if np.finfo(np.longdouble).eps >= np.finfo(np.float64).eps and dtype == np.float64:
        pytest.skip("np.longdouble is no wider than float64 here: no yardstick for float64")
    Hq, Hkv = (6, 3) if case == "GQA" else (3, 3)
    allowed = rng.random((40, 56)) < 0.7 if case == "bool mask" else None
    options = dict(attn_mask=allowed, is_causal=is_causal, enable_gqa=case == "GQA")
    ratios = {}
    for factor in FACTORS:
        q = randn(rng, 2, Hq, 40, 16) * factor  # (B, Hq, T, Dk); Dk = 16: the scale 1/4 is exact
        k = randn(rng, 2, Hkv, 56, 16) * factor
        v, d_out = randn(rng, 2, Hkv, 56, 8), randn(rng, 2, Hq, 40, 8)
        args = tuple(a.astype(dtype) for a in (d_out, q, k, v))
        exact = exact_gradients(*args, allowed, is_causal=is_causal, enable_gqa=case == "GQA")
        errors = {}
        for impl in ("reference", "tiled"):
            grads = attention_backward(
                *args, **options, implementation=impl, block_q=16, block_k=24, num_threads=2
            )
            errors[impl] = np.array([_relative_error(g, e) for g, e in zip(grads, exact)])
        floor = np.finfo(dtype).eps  # below this an error is rounding of the result itself
        ratios[factor] = errors["tiled"] / np.maximum(errors["reference"], floor)
    worst = {f: float(np.round(r.max(), 2)) for f, r in ratios.items()}
    assert max(worst.values()) <= 2, f"tiled / reference error (d_q, d_k, d_v) by factor: {worst}"


# ---------------------------------------------------------------------------------------------
# Edge cases and dtypes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_fully_masked_rows_give_zero_gradients(rng, implementation):
    q, k, v = randn(rng, T, DK), randn(rng, S, DK), randn(rng, S, DV)
    mask = rng.random((T, S)) < 0.5
    mask[1] = False
    mask[:, 0] = mask[:, 0] | (np.arange(T) != 1)
    d_out = randn(rng, T, DV)
    d_q, d_k, d_v = attention_backward(d_out, q, k, v, mask, implementation=implementation)
    for g in (d_q, d_k, d_v):
        assert np.isfinite(g).all()
    np.testing.assert_array_equal(d_q[1], 0.0)
    # Row 1 contributes nothing: the other gradients are those of the problem without it.
    keep = np.arange(T) != 1
    _, d_k2, d_v2 = attention_backward(d_out[keep], q[keep], k, v, mask[keep])
    np.testing.assert_allclose(d_k, d_k2, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(d_v, d_v2, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_empty_keys_and_queries(rng, implementation):
    q, k, v = randn(rng, 3, 4), np.zeros((0, 4)), np.zeros((0, 2))
    d_q, d_k, d_v = attention_backward(np.ones((3, 2)), q, k, v, implementation=implementation)
    np.testing.assert_array_equal(d_q, np.zeros((3, 4)))
    assert d_k.shape == (0, 4) and d_v.shape == (0, 2)
    d_q, d_k, d_v = attention_backward(
        np.ones((0, 2)),
        np.zeros((0, 4)),
        randn(rng, 5, 4),
        randn(rng, 5, 2),
        implementation=implementation,
    )
    assert d_q.shape == (0, 4)
    np.testing.assert_array_equal(d_k, 0.0)
    np.testing.assert_array_equal(d_v, 0.0)


def test_dtypes_follow_each_input(rng):
    q = randn(rng, T, DK, dtype=np.float32)
    k = randn(rng, S, DK, dtype=np.float64)
    v = rng.integers(-3, 3, size=(S, DV))
    d_q, d_k, d_v = attention_backward(np.ones((T, DV)), q, k, v)
    assert (d_q.dtype, d_k.dtype, d_v.dtype) == (np.float32, np.float64, np.float64)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_float16_computes_in_float32(rng, implementation):
    q, k, v = (randn(rng, H, n, DK, dtype=np.float16) for n in (T, S, S))
    d_out = randn(rng, H, T, DK, dtype=np.float16)
    grads16 = attention_backward(d_out, q, k, v, is_causal=True, implementation=implementation)
    grads64 = attention_backward(
        d_out.astype(np.float64), *(a.astype(np.float64) for a in (q, k, v)), is_causal=True
    )
    for g16, g64 in zip(grads16, grads64):
        assert g16.dtype == np.float16
        np.testing.assert_allclose(g16.astype(np.float64), g64, rtol=1e-2, atol=1e-2)


def test_inputs_are_not_modified(rng):
    arrays = [
        randn(rng, H, T, DK),
        randn(rng, H, S, DK),
        randn(rng, H, S, DV),
        randn(rng, H, T, DV),
    ]
    for a in arrays:
        a.flags.writeable = False
    q, k, v, d_out = arrays
    copies = [a.copy() for a in arrays]
    out, lse = attention(q, k, v, return_lse=True)
    out.flags.writeable = lse.flags.writeable = False
    for impl in ("reference", "tiled"):
        attention_backward(d_out, q, k, v, out=out, lse=lse, implementation=impl)
        attention_backward(d_out, q, k, v, is_causal=True, implementation=impl)
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


def test_lists_are_accepted():
    d_q, d_k, d_v = attention_backward(
        [[1.0]], [[0.0, 1.0]], [[1.0, 1.0], [0.0, 1.0]], [[1.0], [0.0]]
    )
    assert d_q.shape == (1, 2) and d_k.shape == (2, 2) and d_v.shape == (2, 1)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def qkv(rng):
    return randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)


def test_error_d_out_shape(qkv):
    with pytest.raises(
        ValueError, match=r"d_out must have the shape .* \(3, 5, 6\); got d_out.shape=\(5, 6\)"
    ):
        attention_backward(np.ones((T, DV)), *qkv)


def test_error_out_without_lse(qkv):
    with pytest.raises(
        ValueError, match="out and lse must be given together .* got out without lse"
    ):
        attention_backward(np.ones((H, T, DV)), *qkv, out=np.ones((H, T, DV)))


def test_error_lse_without_out(qkv):
    with pytest.raises(ValueError, match="got lse without out"):
        attention_backward(np.ones((H, T, DV)), *qkv, lse=np.ones((H, T)))


def test_error_out_shape(qkv):
    with pytest.raises(ValueError, match=r"out must have the shape .* got out.shape=\(3, 5, 5\)"):
        attention_backward(np.ones((H, T, DV)), *qkv, out=np.ones((H, T, 5)), lse=np.ones((H, T)))


def test_error_lse_shape(qkv):
    with pytest.raises(
        ValueError, match=r"lse must have the shape .* \(3, 5\); got lse.shape=\(3, 5, 1\)"
    ):
        attention_backward(
            np.ones((H, T, DV)), *qkv, out=np.ones((H, T, DV)), lse=np.ones((H, T, 1))
        )


def test_error_implementation(qkv):
    with pytest.raises(ValueError, match="implementation must be one of .* got 'flash'"):
        attention_backward(np.ones((H, T, DV)), *qkv, implementation="flash")


@pytest.mark.parametrize("name", ["block_q", "block_k", "num_threads"])
def test_error_block_sizes(qkv, name):
    with pytest.raises(ValueError, match=f"{name} must be a positive integer; got 0"):
        attention_backward(np.ones((H, T, DV)), *qkv, **{name: 0})
    with pytest.raises(TypeError, match=f"{name} must be a positive integer; got 2.5"):
        attention_backward(np.ones((H, T, DV)), *qkv, **{name: 2.5})


def test_error_d_out_kind(qkv):
    with pytest.raises(TypeError, match="d_out must be a real floating"):
        attention_backward(np.ones((H, T, DV), dtype=complex), *qkv)


def test_errors_of_the_forward_pass_are_the_same(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="query and key must share the last dimension Dk"):
        attention_backward(np.ones((H, T, DV)), q, k[..., :2], v)
    with pytest.raises(TypeError, match="attn_mask has integer dtype"):
        attention_backward(np.ones((H, T, DV)), q, k, v, np.ones((T, S), dtype=int))


# ---------------------------------------------------------------------------------------------
# Large negative biases, shared keys, non-finite inputs
# ---------------------------------------------------------------------------------------------


def _huge_bias_case(rng, dtype, fill, pattern):
    q = randn(rng, 2, 8, 16, dtype=dtype)
    k = randn(rng, 2, 600, 16, dtype=dtype)
    v = randn(rng, 2, 600, 16, dtype=dtype)
    bias = np.zeros((2, 8, 600), dtype=dtype)
    if pattern == "first keys":  # left padding: the first key tile of every row is masked
        bias[..., :300] = fill
    elif pattern == "every key":
        bias[0] = fill
        bias[1, ::2] = fill
    return q, k, v, bias


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fill", ["finfo.min", -1e9, -1e30])
@pytest.mark.parametrize("pattern", ["first keys", "every key"])
@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_gradients_with_a_huge_negative_bias_match_torch(
    torch, rng, dtype, fill, pattern, implementation
):
    # The tiled backward's gradients were off by up to 1.4 (its forward's lse was wrong).
    fill = np.finfo(dtype).min if fill == "finfo.min" else fill
    q, k, v, bias = _huge_bias_case(rng, dtype, fill, pattern)
    d_out = randn(rng, 2, 8, 16, dtype=dtype)
    _, *want = torch_grads(torch, d_out, q, k, v, bias)
    got = attention_backward(d_out, q, k, v, bias, implementation=implementation)
    # Gradients of order 0.1 to 10, against the same computation in torch.
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-9, atol=1e-9)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradients_from_a_stored_lse_of_finfo_min_rows_are_exact(rng, dtype):
    # lse = finfo.min + log(600) rounds to finfo.min: exp(scores - lse) alone would give every
    # key the weight 1 instead of 1/600. Given out and lse, both paths still match the
    # gradients computed without them.
    q, k, v, bias = _huge_bias_case(rng, dtype, np.finfo(dtype).min, "every key")
    d_out = randn(rng, 2, 8, 16, dtype=dtype)
    out, lse = attention(q, k, v, bias, return_lse=True, implementation="reference")
    want = attention_backward(d_out, q, k, v, bias, implementation="reference")
    tol = F32 if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    for implementation in ("reference", "tiled"):
        got = attention_backward(
            d_out, q, k, v, bias, out=out, lse=lse, implementation=implementation
        )
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, **tol)


@pytest.mark.parametrize("implementation", ["auto", "tiled", "reference"])
def test_keys_and_values_shared_across_the_batch(rng, implementation):
    q = randn(rng, 2, 8, 256, 16)  # (B, H, T, Dk)
    k = randn(rng, 8, 256, 16)  # (H, S, Dk): one set of keys for every batch element
    v = randn(rng, 8, 256, 12)
    d_out = randn(rng, 2, 8, 256, 12)
    got = attention_backward(d_out, q, k, v, implementation=implementation)  # tiled raised
    # The same gradients with the keys copied along the batch, summed back over it.
    k2, v2 = np.broadcast_to(k, (2, 8, 256, 16)), np.broadcast_to(v, (2, 8, 256, 12))
    d_q, d_k2, d_v2 = attention_backward(d_out, q, k2, v2, implementation="reference")
    np.testing.assert_allclose(got[0], d_q, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], d_k2.sum(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[2], d_v2.sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_nan_rows_make_exactly_their_gradients_nan(rng, implementation):
    # Query row 1 holds a NaN; value 5 holds an inf. Causal: row 1 attends keys 0, 1; the
    # value at 5 reaches rows 5 and 6. NaN in, NaN out, and nothing else is touched.
    q, k, v = randn(rng, 7, DK), randn(rng, 7, DK), randn(rng, 7, DV)
    q[1, 2] = np.nan
    v[5, 0] = np.inf
    d_out = randn(rng, 7, DV)
    d_q, d_k, d_v = attention_backward(
        d_out, q, k, v, is_causal=True, implementation=implementation, block_q=2, block_k=3
    )
    np.testing.assert_array_equal(np.isnan(d_q).all(1), [0, 1, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(np.isnan(d_k).all(1), [1, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(np.isnan(d_v).all(1), [1, 1, 1, 1, 1, 1, 1])
    # Rows 0, 2, 3, 4 on their own: the gradients of the clean rows are those of the clean
    # problem restricted to them (d_out of the poisoned rows set to zero).
    clean = [0, 2, 3, 4]
    q2, v2 = q.copy(), v.copy()
    q2[1] = 0.0
    v2[5] = 0.0
    d_out2 = d_out.copy()
    d_out2[[1, 5, 6]] = 0.0
    want = attention_backward(d_out2, q2, k, v2, is_causal=True, implementation="reference")
    np.testing.assert_allclose(d_q[clean], want[0][clean], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_nan_in_a_hidden_value_leaves_the_gradients_alone(rng, implementation):
    q, k, v = randn(rng, 6, DK), randn(rng, 6, DK), randn(rng, 6, DV)
    mask = np.arange(6) != 3
    v_nan = v.copy()
    v_nan[3] = np.nan
    d_out = randn(rng, 6, DV)
    got = attention_backward(d_out, q, k, v_nan, mask, implementation=implementation)
    want = attention_backward(d_out, q, k, v, mask, implementation="reference")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
