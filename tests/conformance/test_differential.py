"""Differential tests: the fast paths against the slow, readable ones, on inputs Hypothesis draws.

* the tiled attention path (forward and backward) against the reference path, and both against
  PyTorch where it is installed, over shapes from 2-D to 5-D with ``T != S`` both ways,
  ``Dk != Dv``, batch and head broadcasting (keys and values shared across the batch
  included), grouped-query and multi-query heads, bool and float masks (``finfo.min``, -1e9,
  -inf and 0 in per-row, per-tile and padding patterns), both causal alignments, sliding
  windows, float16/32/64 and tile sizes of 1, odd sizes and sizes larger than ``S``; and
  the same with attention sinks of every broadcast shape (``-inf`` entries included), their
  gradient too;
* the tiled path called from a thread pool against the same call from the main thread (bit for
  bit), with values near each dtype's largest and smallest normal numbers;
* linear attention against its quadratic form, written out with an explicit mask;
* decoding with a :class:`sdpa.KVCache` (appends of several tokens, crops, grouped heads)
  against causal attention over the whole sequence.

Every example is small (at most a few thousand tiles), and the numbers of examples are bounded
so that the file runs in well under a minute on two cores. Inputs come from a seeded NumPy
generator drawn by Hypothesis, so a failure shrinks to a seed and a handful of sizes.
"""

from __future__ import annotations

import math
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from references import band_by_loop

from sdpa import KVCache, elu_feature_map, linear_attention
from sdpa import scaled_dot_product_attention as attention
from sdpa import scaled_dot_product_attention_backward as attention_backward
from sdpa.problem import prepare_attention
from sdpa.tiled import attention_tiled

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Tolerances: float64 1e-12, float32 1e-5; float16 results are rounded to float16
# (a unit in the last place is 2**-11 relative), so they are compared at 4e-3.
FORWARD_TOL = {
    np.float64: dict(rtol=1e-12, atol=1e-12),
    np.float32: dict(rtol=1e-5, atol=1e-5),
    np.float16: dict(rtol=4e-3, atol=4e-3),
}


def backward_tol(dtype, scale):
    """Gradients are sums of many terms that cancel (each d_key row sums to zero): an absolute
    tolerance relative to their size ``scale`` as well as a relative one."""
    rel = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 4e-3}[dtype]
    return dict(rtol=rel, atol=rel * max(1.0, scale))


# ---------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------


def _operand_lead(draw, full):
    """A leading shape that broadcasts to ``full``: each axis kept or 1, leading axes dropped."""
    drop = draw(st.integers(0, len(full)))
    return tuple(n if draw(st.booleans()) else 1 for n in full[drop:])


@st.composite
def problems(draw):
    """Everything one call needs, as a dict: arrays, options and tile sizes."""
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    n_lead = draw(st.integers(0, 3))  # 2-D to 5-D
    T = draw(st.integers(0, 13))
    S = draw(st.integers(0, 13))
    Dk = draw(st.integers(1, 6))
    Dv = draw(st.integers(1, 6))
    gqa = n_lead >= 1 and draw(st.booleans())
    full = tuple(draw(st.integers(1, 3)) for _ in range(n_lead))
    if gqa:
        Hkv, G = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        batch = full[:-1]
        q_lead = (*_operand_lead(draw, batch), Hkv * G)
        k_lead = (*_operand_lead(draw, batch), Hkv)  # the heads axis is always there
        v_lead = (*_operand_lead(draw, batch), Hkv)
        full = (*np.broadcast_shapes(q_lead[:-1], k_lead[:-1], v_lead[:-1]), Hkv * G)
    else:
        q_lead, k_lead, v_lead = (_operand_lead(draw, full) for _ in range(3))
        full = np.broadcast_shapes(q_lead, k_lead, v_lead)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    size = draw(st.sampled_from([0.3, 1.0, 3.0]))
    q = (size * rng.standard_normal((*q_lead, T, Dk))).astype(dtype)
    k = (size * rng.standard_normal((*k_lead, S, Dk))).astype(dtype)
    v = rng.standard_normal((*v_lead, S, Dv)).astype(dtype)

    weights_shape = (*full, T, S)
    kind = draw(st.sampled_from([None, "bool", "float"]))
    mask = None
    if kind is not None:
        n_mask = draw(st.integers(1, len(weights_shape)))
        mask_shape = tuple(
            n if draw(st.booleans()) else 1 for n in weights_shape[len(weights_shape) - n_mask :]
        )
        if kind == "bool":
            mask = rng.random(mask_shape) < draw(st.sampled_from([0.3, 0.7, 0.95]))
        else:
            mask = _float_mask(draw, rng, mask_shape, dtype)
    is_causal = draw(st.booleans())
    alignment = draw(st.sampled_from(["top_left", "bottom_right"]))
    window = None
    if draw(st.booleans()):
        window = (
            draw(st.one_of(st.none(), st.integers(0, 5))),
            draw(st.one_of(st.none(), st.integers(0, 5))),
        )
    block_q = draw(st.sampled_from([1, 2, 3, 5, T + 3]))
    block_k = draw(st.sampled_from([1, 2, 5, 7, S + 4]))
    exp = draw(st.sampled_from([np.exp, np.exp2]))  # base e or base 2, whichever is faster
    n_units = math.prod(weights_shape[:-2]) * -(-T // block_q)
    assume(n_units * -(-S // block_k) <= 3000)  # keep every example small
    return dict(
        q=q,
        k=k,
        v=v,
        mask=mask,
        is_causal=is_causal,
        alignment=alignment,
        window=window,
        gqa=gqa,
        block_q=block_q,
        block_k=block_k,
        exp=exp,
        dtype=dtype,
        seed=seed,
    )


def _float_mask(draw, rng, shape, dtype):
    """A bias of 0, huge negative fills and -inf, in one of the patterns real models produce."""
    bias_dtype = np.float32 if dtype == np.float16 else dtype  # the working dtype
    fill = draw(st.sampled_from(["finfo.min", "-1e9", "-inf", "0", "normal"]))
    fill = {
        "finfo.min": np.finfo(bias_dtype).min,
        "-1e9": -1e9,
        "-inf": -np.inf,
        "0": 0.0,
        "normal": None,
    }[fill]
    bias = (
        rng.standard_normal(shape).astype(bias_dtype)
        if fill is None
        else np.zeros(shape, bias_dtype)
    )
    fill = -np.inf if fill is None else fill
    S_ = shape[-1]
    pattern = draw(st.sampled_from(["rows", "tiles", "left padding", "right padding", "random"]))
    if pattern == "rows" and len(shape) >= 2:  # whole rows of the fill
        bias[rng.random(shape[:-1]) < 0.5] = fill
    elif pattern == "tiles":  # blocks of keys, the size of some tiles
        width = draw(st.integers(1, 5))
        for s0 in range(0, S_, 2 * width):
            bias[..., s0 : s0 + width] = fill
    elif pattern == "left padding":
        bias[..., : draw(st.integers(0, S_))] = fill
    elif pattern == "right padding":
        bias[..., S_ - draw(st.integers(0, S_)) :] = fill
    else:
        bias[rng.random(shape) < 0.4] = fill
    if draw(st.booleans()):  # and some keys disallowed outright
        bias[rng.random(shape) < 0.2] = -np.inf
    return bias


def options(p):
    return dict(
        is_causal=p["is_causal"],
        causal_alignment=p["alignment"],
        window=p["window"],
        enable_gqa=p["gqa"],
    )


def tiled_forward(p):
    problem = prepare_attention(p["q"], p["k"], p["v"], p["mask"], **options(p))
    out, lse = attention_tiled(problem, block_q=p["block_q"], block_k=p["block_k"], exp=p["exp"])
    return problem.finish(out, lse=lse)


def assert_close(got, want, tol, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
    np.testing.assert_allclose(got, want, err_msg=what, **tol)


# ---------------------------------------------------------------------------------------------
# The tiled path equals the reference path
# ---------------------------------------------------------------------------------------------


@settings(max_examples=90, **SETTINGS)
@given(p=problems())
def test_tiled_equals_reference_forward_and_backward(p):
    tol = FORWARD_TOL[p["dtype"]]
    want = attention(
        p["q"], p["k"], p["v"], p["mask"], implementation="reference", return_lse=True, **options(p)
    )
    got = tiled_forward(p)
    for g, w, what in zip(got, want, ("out", "lse")):
        assert not np.isnan(g).any(), what
        assert_close(g, w, tol, what)

    d_out = np.random.default_rng(p["seed"] + 1).standard_normal(want[0].shape)
    d_out = d_out.astype(p["dtype"])
    kwargs = dict(options(p), block_q=p["block_q"], block_k=p["block_k"])
    grads_tiled = attention_backward(
        d_out, p["q"], p["k"], p["v"], p["mask"], implementation="tiled", **kwargs
    )
    grads_ref = attention_backward(
        d_out, p["q"], p["k"], p["v"], p["mask"], implementation="reference", **kwargs
    )
    for g, w, what in zip(grads_tiled, grads_ref, ("d_query", "d_key", "d_value")):
        scale = float(np.abs(w).max()) if w.size else 0.0
        assert_close(g, w, backward_tol(p["dtype"], scale), what)
    # Given the forward pass's out and lse, the backward pass rebuilds the same weights.
    given_tiled = attention_backward(
        d_out,
        p["q"],
        p["k"],
        p["v"],
        p["mask"],
        out=got[0],
        lse=got[1],
        implementation="tiled",
        **kwargs,
    )
    for g, w, what in zip(given_tiled, grads_ref, ("d_query", "d_key", "d_value")):
        scale = float(np.abs(w).max()) if w.size else 0.0
        assert_close(g, w, backward_tol(p["dtype"], 4 * scale), what + " from out, lse")


@st.composite
def sinks_for(draw, rows_shape, dtype):
    """Sinks that broadcast to ``rows_shape`` ``(..., H, T)``: each trailing axis kept or 1,
    leading axes dropped; normal logits of a drawn size, some entries ``-inf``."""
    drop = draw(st.integers(0, len(rows_shape)))
    shape = tuple(n if draw(st.booleans()) else 1 for n in rows_shape[drop:])
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    size = draw(st.sampled_from([0.3, 3.0, 30.0]))
    work = np.float32 if dtype == np.float16 else dtype
    sinks = np.asarray(size * rng.standard_normal(shape), dtype=work)  # 0-d stays an array
    if draw(st.booleans()):
        sinks[rng.random(shape) < 0.3] = -np.inf
    return sinks


@settings(max_examples=60, **SETTINGS)
@given(p=problems(), data=st.data())
def test_tiled_equals_reference_with_sinks_forward_and_backward(p, data):
    tol = FORWARD_TOL[p["dtype"]]
    args = (p["q"], p["k"], p["v"], p["mask"])
    plain = attention(*args, implementation="reference", **options(p))
    sinks = data.draw(sinks_for(plain.shape[:-1], p["dtype"]))
    want = attention(*args, sinks=sinks, implementation="reference", return_lse=True, **options(p))
    problem = prepare_attention(*args, sinks=sinks, **options(p))
    out, lse = attention_tiled(problem, block_q=p["block_q"], block_k=p["block_k"], exp=p["exp"])
    got = problem.finish(out, lse=lse)
    for g, w, what in zip(got, want, ("out", "lse")):
        assert not np.isnan(g).any(), what
        assert_close(g, w, tol, what)

    d_out = np.random.default_rng(p["seed"] + 3).standard_normal(plain.shape).astype(p["dtype"])
    kwargs = dict(options(p), sinks=sinks, block_q=p["block_q"], block_k=p["block_k"])
    grads_tiled = attention_backward(d_out, *args, implementation="tiled", **kwargs)
    grads_ref = attention_backward(d_out, *args, implementation="reference", **kwargs)
    given_tiled = attention_backward(
        d_out, *args, out=got[0], lse=got[1], implementation="tiled", **kwargs
    )
    names = ("d_query", "d_key", "d_value", "d_sinks")
    for g, f, w, what in zip(grads_tiled, given_tiled, grads_ref, names):
        assert g.shape == np.shape(w) and g.dtype == w.dtype, what
        scale = float(np.abs(w).max()) if w.size else 0.0
        assert_close(g, w, backward_tol(p["dtype"], scale), what)
        assert_close(f, w, backward_tol(p["dtype"], 4 * scale), what + " from out, lse")


# ---------------------------------------------------------------------------------------------
# ... from any thread, and with values near the ends of the range
# ---------------------------------------------------------------------------------------------


def in_a_thread(fn):
    """``fn()`` in a worker thread of a pool, as a web server's handler would call it."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return pool.submit(fn).result()


@settings(max_examples=60, **SETTINGS)
@given(p=problems(), end=st.sampled_from(["largest", "smallest", "ordinary"]))
def test_tiled_from_a_thread_equals_the_main_thread_and_the_reference(p, end):
    # Values scaled by a power of two that puts them near the dtype's largest normal number
    # (|v| up to 7/8 of it) or its smallest (some subnormal): the tiled path, called from a
    # pool's thread, gives the main thread's bits, and both match the reference path relative
    # to the values' size (plus, at the small end, the subnormal spacing that the reference
    # path's own products round to).
    finfo = np.finfo(p["dtype"])
    e = {"largest": finfo.maxexp - 2, "smallest": finfo.minexp + 4, "ordinary": 0}[end]
    v = np.ldexp(np.clip(p["v"], -3.5, 3.5), e)  # |v| <= 3.5 * 2**(maxexp - 2) < finfo.max
    args = (p["q"], p["k"], v, p["mask"])

    def call(implementation):
        return attention(*args, implementation=implementation, return_lse=True, **options(p))

    main = call("tiled")
    threaded = in_a_thread(lambda: call("tiled"))
    for g, w in zip(threaded, main):
        np.testing.assert_array_equal(g, w)
    want = call("reference")
    assert_close(main[1], want[1], FORWARD_TOL[p["dtype"]], "lse")
    assert not np.isnan(main[0]).any() and np.isfinite(main[0]).all()
    S = p["k"].shape[-2]
    tol = dict(FORWARD_TOL[p["dtype"]])
    subnormal = float(finfo.smallest_subnormal) * max(S, 1)  # the reference's rounding
    tol["atol"] = tol["atol"] + (subnormal / 2.0**e if end == "smallest" else 0.0)
    got, ref = (np.ldexp(x.astype(np.float64), -e) for x in (main[0], want[0]))
    np.testing.assert_allclose(got, ref, **tol)


# ---------------------------------------------------------------------------------------------
# ... and both agree with PyTorch
# ---------------------------------------------------------------------------------------------


def _sum_to(x, shape):
    """Sum a full-shape gradient over the axes along which its input was broadcast."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


@pytest.mark.torch
@settings(max_examples=50, **SETTINGS)
@given(p=problems())
def test_both_paths_agree_with_torch(torch, p):
    assume(p["dtype"] != np.float16)  # PyTorch's float16 CPU kernels round differently
    q, k, v, dtype = p["q"], p["k"], p["v"], p["dtype"]
    T, S = q.shape[-2], k.shape[-2]
    assume(T > 0 and S > 0)
    want_shape = attention(q, k, v, p["mask"], implementation="reference", **options(p)).shape
    full = want_shape[:-2]
    kv_full = (*full[:-1], k.shape[-3]) if p["gqa"] else full
    # torch needs equal batch dimensions and its own masks: broadcast everything explicitly
    qf = np.ascontiguousarray(np.broadcast_to(q, (*full, T, q.shape[-1])))
    kf = np.ascontiguousarray(np.broadcast_to(k, (*kv_full, S, k.shape[-1])))
    vf = np.ascontiguousarray(np.broadcast_to(v, (*kv_full, S, v.shape[-1])))
    band = band_by_loop(
        T, S, is_causal=p["is_causal"], window=p["window"], alignment=p["alignment"]
    )
    mask = p["mask"]
    if mask is None:
        mask = band
    elif mask.dtype == bool:
        mask = mask & band
    else:
        mask = np.where(band, mask, -np.inf).astype(dtype)
    mask = np.ascontiguousarray(np.broadcast_to(mask, (*full, T, S)))
    tensors = [torch.tensor(a, requires_grad=True) for a in (qf, kf, vf)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out_t = torch.nn.functional.scaled_dot_product_attention(
            *tensors, attn_mask=torch.tensor(mask), enable_gqa=p["gqa"]
        )
    d_out = np.random.default_rng(p["seed"] + 2).standard_normal(want_shape).astype(dtype)
    out_t.backward(torch.tensor(d_out))
    theirs = out_t.detach().numpy()
    grads_t = [_sum_to(t.grad.numpy(), a.shape) for t, a in zip(tensors, (q, k, v))]
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == np.float64 else dict(rtol=1e-4, atol=1e-5)
    # PyTorch's CPU backward rebuilds the weights as exp(scores - lse) from a rounded lse: for
    # rows whose every key carries finfo.min, lse = finfo.min + log(S) rounds to finfo.min and
    # every weight becomes 1 instead of 1/S (its gradients are then S times too large). Ours
    # are exact there (see tests/sdpa/test_backward.py); such rows are compared with the reference only.
    _, lse = attention(
        q, k, v, p["mask"], implementation="reference", return_lse=True, **options(p)
    )
    torch_backward_exact = not (np.abs(lse[np.isfinite(lse)]) > 64).any()
    for implementation in ("reference", "tiled"):
        ours = attention(q, k, v, p["mask"], implementation=implementation, **options(p))
        np.testing.assert_allclose(ours, theirs, err_msg=implementation, **tol)
        if not torch_backward_exact:
            continue
        grads = attention_backward(
            d_out,
            q,
            k,
            v,
            p["mask"],
            implementation=implementation,
            block_q=p["block_q"],
            block_k=p["block_k"],
            **options(p),
        )
        for g, w, what in zip(grads, grads_t, ("d_query", "d_key", "d_value")):
            scale = float(np.abs(w).max()) if w.size else 0.0
            np.testing.assert_allclose(
                g,
                w,
                rtol=tol["rtol"],
                atol=tol["atol"] * max(1.0, scale),
                err_msg=f"{implementation} {what}",
            )


# ---------------------------------------------------------------------------------------------
# Linear attention against its quadratic form
# ---------------------------------------------------------------------------------------------


def relu_eps(x):
    return np.maximum(x, 0.0) + 0.1


@settings(max_examples=60, **SETTINGS)
@given(
    T=st.integers(0, 12),
    S=st.integers(0, 12),
    Dk=st.integers(1, 5),
    Dv=st.integers(1, 5),
    n_lead=st.integers(0, 2),
    data=st.data(),
    is_causal=st.booleans(),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    chunk_size=st.sampled_from([1, 2, 3, 64]),
    eps=st.sampled_from([0.0, 1e-6, 0.5]),
    feature_map=st.sampled_from([None, relu_eps]),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_linear_attention_equals_its_quadratic_form(
    T, S, Dk, Dv, n_lead, data, is_causal, alignment, chunk_size, eps, feature_map, dtype, seed
):
    full = tuple(data.draw(st.integers(1, 3)) for _ in range(n_lead))
    leads = [tuple(n if data.draw(st.booleans()) else 1 for n in full) for _ in range(3)]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*leads[0], T, Dk)).astype(dtype)
    k = rng.standard_normal((*leads[1], S, Dk)).astype(dtype)
    v = rng.standard_normal((*leads[2], S, Dv)).astype(dtype)
    out = linear_attention(
        q,
        k,
        v,
        is_causal=is_causal,
        causal_alignment=alignment,
        feature_map=feature_map,
        eps=eps,
        chunk_size=chunk_size,
    )
    # The quadratic form, in float64: sim = phi(Q) phi(K)^T, masked, normalised row by row.
    phi = elu_feature_map if feature_map is None else feature_map
    sim = phi(q.astype(np.float64)) @ np.swapaxes(phi(k.astype(np.float64)), -1, -2)
    if is_causal:
        sim = np.where(band_by_loop(T, S, is_causal=True, alignment=alignment), sim, 0.0)
    den = sim.sum(axis=-1, keepdims=True) + eps
    num = sim @ v.astype(np.float64)
    want = np.divide(
        num, den, out=np.zeros(np.broadcast_shapes(num.shape, den.shape)), where=den > 0
    )
    assert out.shape == want.shape and out.dtype == dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, want, **tol)


# ---------------------------------------------------------------------------------------------
# KV-cache decoding against causal attention over the whole sequence
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40, **SETTINGS)
@given(
    B=st.integers(1, 2),
    Hkv=st.integers(1, 3),
    G=st.integers(1, 3),
    D=st.integers(1, 6),
    Dv=st.integers(1, 5),
    prompt=st.integers(1, 9),
    steps=st.lists(st.integers(1, 4), max_size=5),
    crop=st.one_of(st.none(), st.integers(0, 8)),
    capacity=st.integers(1, 8),
    window=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.just(0))),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_kv_cache_decoding_equals_causal_attention(
    B, Hkv, G, D, Dv, prompt, steps, crop, capacity, window, dtype, seed
):
    rng = np.random.default_rng(seed)
    n = prompt + sum(steps)
    q = rng.standard_normal((B, Hkv * G, n, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, n, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, n, Dv)).astype(dtype)
    cache = KVCache(1, Hkv, D, value_dim=Dv, batch_size=B, dtype=dtype, capacity=capacity)
    if crop is not None:  # a draft that is appended, looked at, then rejected
        junk = rng.standard_normal((B, Hkv, crop + 1, D)).astype(dtype)
        viewed, _ = cache.append(0, junk, junk[..., :1].repeat(Dv, axis=-1))
        cache.crop(0)
        before = viewed.copy()
    outs, t = [], 0
    for size in [prompt, *steps]:
        cache.append(0, k[:, :, t : t + size], v[:, :, t : t + size])
        outs.append(cache.attend(0, q[:, :, t : t + size], window=window))
        t += size
    if crop is not None:
        np.testing.assert_array_equal(viewed, before)  # views never change
    got = np.concatenate(outs, axis=2)
    want = attention(
        q, k, v, is_causal=True, enable_gqa=G > 1, window=window, implementation="reference"
    )
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, **tol)
