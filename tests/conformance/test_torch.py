"""Conformance with PyTorch 2.13: ``torch.nn.functional.scaled_dot_product_attention`` and
``torch.nn.MultiheadAttention(batch_first=True)``.

PyTorch is a test-time reference only (the ``torch`` fixture of conftest.py skips with a reason
when it is missing, and fails under ``SDPA_REQUIRE_REFERENCES=1`` in CI).

Tolerances: float64 within 1e-12 relative (with an absolute 1e-13 for values near zero, where a
relative bound means nothing), float32 within 1e-5 relative (absolute 1e-6).

Where our policy differs from PyTorch on purpose, the test checks OUR policy against an
equivalent PyTorch call and says why:

* ``is_causal`` with ``attn_mask``: PyTorch raises, we take the logical AND (as JAX does);
* a NaN in a masked-out key: PyTorch adds ``-inf`` to the score (NaN + -inf = NaN), we replace
  the score by ``-inf``, so the NaN never reaches the output;
* integer inputs: PyTorch raises, we compute in float64 (the seeds' examples are integers);
* mixed floating dtypes: PyTorch raises, we promote with ``np.result_type`` (NumPy's rule);
* a float mask of another floating dtype than the inputs: PyTorch raises, we cast the mask to
  the working dtype;
* a 1-D ``(S,)`` mask with 4-D inputs: PyTorch 2.13 raises IndexError, we broadcast it by
  NumPy rules, as for every other mask shape;
* dropout: both are random; ours takes an explicit NumPy generator, so the draws cannot match
  PyTorch's and dropout is tested in tests/sdpa/test_attention.py instead.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from cases import DK, DV, MASK_SHAPES, B, H, S, T

from sdpa import MultiHeadAttention, causal_mask, padding_mask, scaled_dot_product_attention

pytestmark = pytest.mark.torch

TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}


def torch_sdpa(torch, q, k, v, attn_mask=None, *, is_causal=False, scale=None, enable_gqa=False):
    """Call PyTorch on NumPy arrays; a NumPy mask is converted, a torch object passed through."""
    t = lambda a: torch.from_numpy(np.array(a, copy=True))  # noqa: E731
    if isinstance(attn_mask, np.ndarray):
        attn_mask = t(attn_mask)
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(
            t(q),
            t(k),
            t(v),
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return out.numpy()


def lower_right(torch, T_, S_):
    """PyTorch's bottom-right causal bias; creating/using it may warn, which pytest would turn
    into an error, so the warning is filtered here, locally."""
    from torch.nn.attention.bias import causal_lower_right

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return causal_lower_right(T_, S_)


def torch_sdpa_lower_right(torch, q, k, v, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch_sdpa(torch, q, k, v, lower_right(torch, q.shape[-2], k.shape[-2]), **kwargs)


def inputs(rng, q_shape, k_shape, v_shape, dtype):
    return tuple(rng.standard_normal(s).astype(dtype) for s in (q_shape, k_shape, v_shape))


def weights_shape(q, k, v, enable_gqa):
    lead = (
        np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        if enable_gqa
        else np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    )
    heads = (q.shape[-3],) if enable_gqa else ()
    return (*lead, *heads, q.shape[-2], k.shape[-2])


# --- the main grid -------------------------------------------------------------------------------

GRID_SHAPES = {
    "2d": ((T, DK), (S, DK), (S, DV), False),
    "2d-T>S": ((S, DK), (T, DK), (T, DV), False),
    "3d": ((B, T, DK), (B, S, DK), (B, S, DV), False),
    "4d": ((B, H, T, DK), (B, H, S, DK), (B, H, S, DV), False),
    "4d-T>S": ((B, H, S, DK), (B, H, T, DK), (B, H, T, DV), False),
    "4d-broadcast-batch": ((B, 1, T, DK), (1, H, S, DK), (1, H, S, DV), False),
    "5d": ((B, 2, H, T, DK), (B, 2, H, S, DK), (B, 2, H, S, DV), False),
    "gqa-3d": ((6, T, DK), (3, S, DK), (3, S, DV), True),
    "gqa-4d": ((B, 6, T, DK), (B, 2, S, DK), (B, 2, S, DV), True),
    "gqa-5d": ((B, 2, 6, S, DK), (B, 2, 3, T, DK), (B, 2, 3, T, DV), True),
    "mqa": ((B, H, T, DK), (B, 1, S, DK), (B, 1, S, DV), True),
    "S=1": ((B, H, T, DK), (B, H, 1, DK), (B, H, 1, DV), False),
    "T=1": ((B, H, 1, DK), (B, H, S, DK), (B, H, S, DV), False),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("name", GRID_SHAPES)
def test_sdpa_grid(torch, name, causal, mask_kind, dtype, rng):
    q_shape, k_shape, v_shape, gqa = GRID_SHAPES[name]
    q, k, v = inputs(rng, q_shape, k_shape, v_shape, dtype)
    T_, S_ = q.shape[-2], k.shape[-2]
    mask = None
    if mask_kind == "bool":
        mask = rng.random((T_, S_)) < 0.7
    elif mask_kind == "float":
        mask = np.where(rng.random((T_, S_)) < 0.8, rng.standard_normal((T_, S_)), -np.inf)
        mask = mask.astype(dtype)

    ours = scaled_dot_product_attention(
        q,
        k,
        v,
        mask,
        is_causal=causal is not None,
        causal_alignment=causal or "top_left",
        enable_gqa=gqa,
    )

    if causal is None:
        theirs = torch_sdpa(torch, q, k, v, mask, enable_gqa=gqa)
    elif mask is None and causal == "top_left":
        theirs = torch_sdpa(torch, q, k, v, is_causal=True, enable_gqa=gqa)
    elif mask is None:
        theirs = torch_sdpa_lower_right(torch, q, k, v, enable_gqa=gqa)
    else:
        # PyTorch raises for is_causal together with attn_mask; our policy is the logical
        # AND (JAX's too), so PyTorch gets the combined mask.
        tril = causal_mask(T_, S_, alignment=causal)
        if mask.dtype == bool:
            combined = mask & tril
        else:
            combined = np.where(tril, mask, -np.inf).astype(dtype)
        theirs = torch_sdpa(torch, q, k, v, combined, enable_gqa=gqa)

    assert ours.dtype == dtype and ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
def test_every_mask_shape(torch, mask_shape, mask_kind, dtype, rng):
    q, k, v = inputs(rng, (B, H, T, DK), (B, H, S, DK), (B, H, S, DV), dtype)
    if mask_kind == "bool":
        mask = rng.random(mask_shape) < 0.7
    else:
        mask = np.where(rng.random(mask_shape) < 0.8, rng.standard_normal(mask_shape), -np.inf)
        mask = mask.astype(dtype)
    ours = scaled_dot_product_attention(q, k, v, mask)
    # PyTorch 2.13 raises IndexError for a 1-D mask with 4-D inputs, so it gets the mask
    # expanded to the full weights shape; our side gets the mask as it is, so our own
    # broadcasting is what is under test.
    theirs = torch_sdpa(torch, q, k, v, np.broadcast_to(mask, (B, H, T, S)))
    np.testing.assert_allclose(ours, theirs, **TOL[dtype])
    if mask.ndim == 1:
        with pytest.raises(IndexError, match="Dimension out of range"):
            torch_sdpa(torch, q, k, v, mask)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("gqa", [False, True])
def test_fully_masked_rows(torch, gqa, mask_kind, dtype, rng):
    # PyTorch >= 2.5 returns 0 for a row whose every key is masked out; so do we.
    Hkv = 1 if gqa else H
    q, k, v = inputs(rng, (B, H, T, DK), (B, Hkv, S, DK), (B, Hkv, S, DV), dtype)
    allowed = rng.random((B, H, T, S)) < 0.6
    allowed[0, 1, 2] = False
    allowed[1, :, 0] = False
    mask = allowed if mask_kind == "bool" else np.where(allowed, 0.0, -np.inf).astype(dtype)
    ours = scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa)
    theirs = torch_sdpa(torch, q, k, v, mask, enable_gqa=gqa)
    np.testing.assert_array_equal(ours[0, 1, 2], 0.0)
    np.testing.assert_array_equal(theirs[0, 1, 2], 0.0)
    np.testing.assert_allclose(ours, theirs, **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_bottom_right_with_more_queries_than_keys(torch, dtype, rng):
    # the first T - S queries precede every key: PyTorch's causal_lower_right and ours give 0
    q, k, v = inputs(rng, (B, H, S, DK), (B, H, T, DK), (B, H, T, DV), dtype)
    ours = scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    theirs = torch_sdpa_lower_right(torch, q, k, v)
    np.testing.assert_array_equal(ours[..., : S - T, :], 0.0)
    np.testing.assert_allclose(ours, theirs, **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("scale", [0.05, 1.0, 2.5])
def test_explicit_scale(torch, scale, dtype, rng):
    q, k, v = inputs(rng, (B, H, T, DK), (B, H, S, DK), (B, H, S, DV), dtype)
    np.testing.assert_allclose(
        scaled_dot_product_attention(q, k, v, scale=scale),
        torch_sdpa(torch, q, k, v, scale=scale),
        **TOL[dtype],
    )


# --- empty and degenerate sizes ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_no_keys(torch, dtype, rng):
    q, k, v = inputs(rng, (B, H, T, DK), (B, H, 0, DK), (B, H, 0, DV), dtype)
    ours = scaled_dot_product_attention(q, k, v)
    theirs = torch_sdpa(torch, q, k, v)
    assert ours.shape == theirs.shape == (B, H, T, DV)
    np.testing.assert_array_equal(ours, theirs)  # both exactly zero


def test_no_queries(torch, rng):
    q, k, v = inputs(rng, (B, H, 0, DK), (B, H, S, DK), (B, H, S, DV), np.float64)
    assert scaled_dot_product_attention(q, k, v).shape == torch_sdpa(torch, q, k, v).shape


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_zero_width_keys(torch, with_bias, dtype, rng):
    # Dk = 0: every score is 0 (an empty dot product). PyTorch returns the plain average of the
    # values (its default scale 1/sqrt(0) never multiplies anything); ours uses scale 1.0 and
    # agrees, also with a float bias, which alone then decides the weights.
    q, k, v = inputs(rng, (B, H, T, 0), (B, H, S, 0), (B, H, S, DV), dtype)
    bias = rng.standard_normal((T, S)).astype(dtype) if with_bias else None
    ours = scaled_dot_product_attention(q, k, v, bias)
    theirs = torch_sdpa(torch, q, k, v, bias)
    np.testing.assert_allclose(ours, theirs, **TOL[dtype])
    if not with_bias:
        mean = np.broadcast_to(v.mean(-2, keepdims=True), ours.shape)
        np.testing.assert_allclose(ours, mean, **TOL[dtype])


# --- deliberate differences: test our policy ------------------------------------------------


def test_causal_with_mask_is_the_logical_and(torch, rng):
    q, k, v = inputs(rng, (B, H, T, DK), (B, H, S, DK), (B, H, S, DV), np.float64)
    mask = rng.random((T, S)) < 0.7
    with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal=True"):
        torch_sdpa(torch, q, k, v, mask, is_causal=True)  # PyTorch refuses the combination
    ours = scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    theirs = torch_sdpa(torch, q, k, v, mask & causal_mask(T, S))
    np.testing.assert_allclose(ours, theirs, **TOL[np.float64])


@pytest.mark.parametrize("how", ["bool", "causal"])
def test_nan_in_a_masked_out_key(torch, how, rng):
    # PyTorch *adds* -inf to the score of a masked key, and NaN + -inf = NaN spreads to every
    # output row. We *replace* the score by -inf, so a NaN in a key nobody may see (padding
    # filled with garbage, an uninitialised KV-cache slot) cannot reach the output. Our result
    # equals PyTorch's on the same inputs with that key's NaN replaced by zeros.
    q, k, v = inputs(rng, (B, H, S, DK), (B, H, S, DK), (B, H, S, DV), np.float64)
    k_nan = k.copy()
    k_nan[..., S - 1, :] = np.nan  # the last key: masked out, or in every earlier query's future
    if how == "bool":
        # (S, S) rather than (S,): PyTorch 2.13 raises IndexError for a 1-D mask on 4-D inputs
        mask, kwargs, rows = np.tile(np.arange(S) < S - 1, (S, 1)), {}, slice(None)
    else:
        mask, kwargs, rows = None, dict(is_causal=True), slice(0, S - 1)
    ours = scaled_dot_product_attention(q, k_nan, v, mask, **kwargs)
    assert np.isnan(torch_sdpa(torch, q, k_nan, v, mask, **kwargs)).any()
    k_clean = k_nan.copy()
    k_clean[..., S - 1, :] = 0.0
    np.testing.assert_allclose(
        ours[..., rows, :],
        torch_sdpa(torch, q, k_clean, v, mask, **kwargs)[..., rows, :],
        **TOL[np.float64],
    )


def test_integer_inputs(torch):
    # PyTorch's matmul refuses integer tensors here; we compute integer (and bool) inputs in
    # float64, so the seeds' integer examples run as they are written.
    q = np.array([[0, 1], [1, 0], [1, 1]])
    k = np.array([[1, 1], [0, 1], [1, 2]])
    v = np.array([[1, 0], [0, 2], [1, 2]])
    with pytest.raises(RuntimeError, match="same dtype"):
        torch_sdpa(torch, q, k, v)
    ours = scaled_dot_product_attention(q, k, v)
    assert ours.dtype == np.float64
    theirs = torch_sdpa(torch, *(a.astype(np.float64) for a in (q, k, v)))
    np.testing.assert_allclose(ours, theirs, **TOL[np.float64])


def test_mixed_dtypes_promote(torch, rng):
    # PyTorch requires one dtype for query, key and value; we promote with np.result_type,
    # so float32 queries with float64 keys and values compute (and return) float64.
    q = rng.standard_normal((B, H, T, DK)).astype(np.float32)
    k, v = rng.standard_normal((B, H, S, DK)), rng.standard_normal((B, H, S, DV))
    with pytest.raises(RuntimeError, match="same dtype"):
        torch_sdpa(torch, q, k, v)
    ours = scaled_dot_product_attention(q, k, v)
    assert ours.dtype == np.float64
    np.testing.assert_allclose(
        ours, torch_sdpa(torch, q.astype(np.float64), k, v), **TOL[np.float64]
    )


def test_float_mask_is_cast_to_the_working_dtype(torch, rng):
    # PyTorch wants a float mask in the query's dtype; we cast it (here float64 -> float32).
    q, k, v = inputs(rng, (B, H, T, DK), (B, H, S, DK), (B, H, S, DV), np.float32)
    bias = rng.standard_normal((T, S))
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        torch_sdpa(torch, q, k, v, bias)
    ours = scaled_dot_product_attention(q, k, v, bias)
    assert ours.dtype == np.float32
    theirs = torch_sdpa(torch, q, k, v, bias.astype(np.float32))
    np.testing.assert_allclose(ours, theirs, **TOL[np.float32])


# --- torch.nn.MultiheadAttention ------------------------------------------------------------------

E = 12  # model width; 3 heads of width 4


def make_pair(torch, rng, *, n_heads, bias, kdim=None, vdim=None, dtype=np.float64):
    """Our MultiHeadAttention and PyTorch's, holding the same random weights and biases."""
    kdim, vdim = kdim or E, vdim or E
    # divide before casting: float32 / np.sqrt(int) would be float64 under NumPy 2
    W_q, W_k, W_v = (
        (rng.standard_normal((d, E)) / np.sqrt(d)).astype(dtype) for d in (E, kdim, vdim)
    )
    W_o = (rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype)
    names = ("b_q", "b_k", "b_v", "b_o") if bias else ()
    b = {name: rng.standard_normal(E).astype(dtype) for name in names}
    ours = MultiHeadAttention(W_q, W_k, W_v, W_o, n_heads=n_heads, **b)

    theirs = torch.nn.MultiheadAttention(
        E,
        n_heads,
        bias=bias,
        batch_first=True,
        kdim=kdim,
        vdim=vdim,
        dtype=torch.float64 if dtype == np.float64 else torch.float32,
    )
    t = lambda a: torch.from_numpy(np.array(a, copy=True))  # noqa: E731
    with torch.no_grad():
        # nn.Linear stores the transpose of our right-multiplied weights
        if theirs._qkv_same_embed_dim:
            theirs.in_proj_weight.copy_(t(np.concatenate([W_q.T, W_k.T, W_v.T])))
        else:
            theirs.q_proj_weight.copy_(t(W_q.T))
            theirs.k_proj_weight.copy_(t(W_k.T))
            theirs.v_proj_weight.copy_(t(W_v.T))
        theirs.out_proj.weight.copy_(t(W_o.T))
        if bias:
            theirs.in_proj_bias.copy_(t(np.concatenate([b["b_q"], b["b_k"], b["b_v"]])))
            theirs.out_proj.bias.copy_(t(b["b_o"]))
    theirs.eval()
    return ours, theirs


def run_torch_mha(torch, mha, xq, xk, xv, **kwargs):
    t = lambda a: None if a is None else torch.from_numpy(np.array(a, copy=True))  # noqa: E731
    kwargs = {key: t(val) for key, val in kwargs.items()}
    with torch.no_grad():
        out, weights = mha(
            t(xq), t(xk), t(xv), need_weights=True, average_attn_weights=False, **kwargs
        )
    return out.numpy(), weights.numpy()


@pytest.mark.parametrize("masking", ["none", "causal", "mask-2d", "mask-per-head", "key-padding"])
@pytest.mark.parametrize("mode", ["self", "cross", "cross-kdim-vdim"])
@pytest.mark.parametrize("bias", [False, True])
def test_multihead_matches_torch(torch, bias, mode, masking, rng):
    kdim, vdim = (5, 7) if mode == "cross-kdim-vdim" else (None, None)
    ours, theirs = make_pair(torch, rng, n_heads=H, bias=bias, kdim=kdim, vdim=vdim)
    xq = rng.standard_normal((B, T, E))
    if mode == "self":
        xk = xv = xq
    else:
        xk = rng.standard_normal((B, S, kdim or E))
        xv = rng.standard_normal((B, S, vdim or E))
    S_ = xk.shape[1]

    our_kwargs, torch_kwargs = {}, {}
    if masking == "causal":
        our_kwargs = dict(is_causal=True)
        # nn.MultiheadAttention's bool masks mean True = masked out: the opposite of ours
        torch_kwargs = dict(attn_mask=~causal_mask(T, S_))
    elif masking == "mask-2d":
        allowed = rng.random((T, S_)) < 0.7
        allowed[:, 0] = True  # no fully masked row: PyTorch's weights path would give NaN
        our_kwargs, torch_kwargs = dict(attn_mask=allowed), dict(attn_mask=~allowed)
    elif masking == "mask-per-head":
        allowed = rng.random((B, H, T, S_)) < 0.7
        allowed[..., 0] = True
        # PyTorch wants (B * H, T, S), batch-major
        our_kwargs = dict(attn_mask=allowed)
        torch_kwargs = dict(attn_mask=~allowed.reshape(B * H, T, S_))
    elif masking == "key-padding":
        lengths = [S_, 2]
        our_kwargs = dict(attn_mask=padding_mask(lengths, S_))
        torch_kwargs = dict(key_padding_mask=np.arange(S_)[None, :] >= np.array(lengths)[:, None])

    out, weights = ours(
        xq,
        None if mode == "self" else xk,
        None if mode == "self" else xv,
        return_weights=True,
        **our_kwargs,
    )
    t_out, t_weights = run_torch_mha(torch, theirs, xq, xk, xv, **torch_kwargs)
    assert out.shape == t_out.shape == (B, T, E)
    assert weights.shape == t_weights.shape == (B, H, T, S_)
    np.testing.assert_allclose(weights, t_weights, **TOL[np.float64])
    np.testing.assert_allclose(out, t_out, **TOL[np.float64])


def test_multihead_float32_matches_torch(torch, rng):
    ours, theirs = make_pair(torch, rng, n_heads=4, bias=True, dtype=np.float32)
    x = rng.standard_normal((B, T, E)).astype(np.float32)
    out, weights = ours(x, is_causal=True, return_weights=True)
    t_out, t_weights = run_torch_mha(torch, theirs, x, x, x, attn_mask=~causal_mask(T))
    assert out.dtype == np.float32
    np.testing.assert_allclose(weights, t_weights, **TOL[np.float32])
    np.testing.assert_allclose(out, t_out, **TOL[np.float32])
