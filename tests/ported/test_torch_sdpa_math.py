"""PyTorch's SDPA math-backend tests of fully masked rows, ported anew to sdpa.

Follows ``pytorch/pytorch``, file ``test/test_transformers.py``, ``test_fully_masked_out_rows``:
since PyTorch 2.5 its math backend gives a query row whose every key is masked out an output of
exactly 0 and a query gradient of exactly 0 (a "safe" softmax), with no NaN anywhere.

Kept: the inputs drawn uniformly from [0, 1); the boolean mask that hides every fourth query
row entirely and otherwise allows key ``j`` to query ``i`` when ``i % 5 == j % 5``; the loss
``out.sum()`` (so ``d_out`` is all ones); the checks: masked rows exactly 0 in ``out`` and in
the query's gradient, no NaN in any output or gradient, agreement with the math backend.
Changed: instead of comparing another PyTorch backend with the math backend, sdpa's forward
(``implementation`` "reference", "tiled" and "auto") and its backward
(``sdpa.scaled_dot_product_attention_backward``, the same three, with and without the forward's
``out`` and ``lse``) are compared with the math backend under ``torch.autograd``, in float64
(to 1e-12) and float32 (to 1e-5); added: the same mask as a float bias with ``-inf``, causal
masks with more queries than keys aligned at the bottom right (the first ``T - S`` rows see no
key; PyTorch gets the equivalent boolean mask), a causal mask combined with the row mask,
grouped-query attention, and a random upstream gradient.

PyTorch is a test-time reference only (the ``torch`` fixture of tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from sdpa import scaled_dot_product_attention, scaled_dot_product_attention_backward

pytestmark = pytest.mark.torch

PATHS = ["reference", "tiled", "auto"]
TOL = {np.float64: dict(rtol=1e-12, atol=1e-12), np.float32: dict(rtol=1e-5, atol=1e-5)}
DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])


def row_and_residue_mask(T: int, S: int, every: int = 4) -> np.ndarray:
    """PyTorch's test mask: rows ``0, every, 2 every, ...`` hide every key; elsewhere query
    ``i`` sees key ``j`` when ``i % 5 == j % 5``."""
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    return (i % every != 0) & (i % 5 == j % 5)


def bottom_right_causal(T: int, S: int) -> np.ndarray:
    """Query ``i`` sees keys ``j <= i + S - T``: with ``T > S`` the first rows see none."""
    return np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)


def torch_math(torch, q, k, v, d_out, attn_mask=None, enable_gqa=False):
    """``out`` and the gradients of ``(out * d_out).sum()`` from PyTorch's math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_numpy(np.array(x)).requires_grad_(True) for x in (q, k, v))
    mask = None if attn_mask is None else torch.from_numpy(np.array(attn_mask))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=mask, enable_gqa=enable_gqa
        )
    out.backward(torch.from_numpy(np.array(d_out)))
    return out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


def uniform(rng, shape, dtype):
    return rng.random(shape).astype(dtype)


def check_against_torch(torch, q, k, v, d_out, dead_rows, torch_mask, dtype, **sdpa_args):
    """sdpa's forward and backward on every path against the math backend, and the rows that
    see no key (``dead_rows``, a bool array over ``(..., T)``) exactly 0 in out and d_q."""
    enable_gqa = sdpa_args.get("enable_gqa", False)
    t_out, t_dq, t_dk, t_dv = torch_math(torch, q, k, v, d_out, torch_mask, enable_gqa)
    assert dead_rows.any(), "the case must have fully masked rows"
    # PyTorch's own claim, which the comparison below leans on
    np.testing.assert_array_equal(t_out[dead_rows], 0.0)
    np.testing.assert_array_equal(t_dq[dead_rows], 0.0)
    for implementation in PATHS:
        out, lse = scaled_dot_product_attention(
            q, k, v, **sdpa_args, return_lse=True, implementation=implementation
        )
        what = f"forward, implementation={implementation!r}"
        assert out.dtype == dtype, what
        np.testing.assert_array_equal(out[dead_rows], 0.0, err_msg=what)
        np.testing.assert_array_equal(lse[dead_rows], -np.inf, err_msg=what)
        np.testing.assert_allclose(out, t_out, err_msg=what, **TOL[dtype])
        for given in ({}, {"out": out, "lse": lse}):
            grads = scaled_dot_product_attention_backward(
                d_out, q, k, v, **sdpa_args, **given, implementation=implementation
            )
            what = f"backward, implementation={implementation!r}, given {sorted(given)}"
            for name, got, want in zip(("d_q", "d_k", "d_v"), grads, (t_dq, t_dk, t_dv)):
                assert got.dtype == dtype and got.shape == want.shape, f"{what}: {name}"
                assert np.isfinite(got).all(), f"{what}: {name} not finite"
                np.testing.assert_allclose(got, want, err_msg=f"{what}: {name}", **TOL[dtype])
            np.testing.assert_array_equal(grads[0][dead_rows], 0.0, err_msg=what)


@DTYPES
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("head_dim", [8, 17])
def test_fully_masked_out_rows(torch, rng, T, head_dim, dtype):
    q, k, v = (uniform(rng, (1, 1, T, head_dim), dtype) for _ in range(3))
    mask = row_and_residue_mask(T, T)[None, None]
    d_out = np.ones((1, 1, T, head_dim), dtype)  # the loss out.sum()
    dead = ~mask.any(axis=-1)
    check_against_torch(torch, q, k, v, d_out, dead, mask, dtype, attn_mask=mask)


@DTYPES
def test_fully_masked_out_rows_of_a_float_bias(torch, rng, dtype):
    # the same mask as a bias: 0 where allowed, -inf elsewhere, plus a finite bias
    B, H, T, S = 2, 3, 13, 11
    q, k = uniform(rng, (B, H, T, 8), dtype), uniform(rng, (B, H, S, 8), dtype)
    v, d_out = uniform(rng, (B, H, S, 5), dtype), rng.standard_normal((B, H, T, 5)).astype(dtype)
    allowed = row_and_residue_mask(T, S)
    bias = np.where(allowed, rng.standard_normal((B, H, T, S)), -np.inf).astype(dtype)
    dead = np.broadcast_to(~allowed.any(axis=-1), (B, H, T))
    check_against_torch(torch, q, k, v, d_out, dead, bias, dtype, attn_mask=bias)


@DTYPES
@pytest.mark.parametrize("T, S", [(9, 4), (20, 13), (5, 1)])
def test_causal_with_more_queries_than_keys(torch, rng, T, S, dtype):
    # bottom-right alignment: the first T - S queries precede every key
    B, H = 2, 3
    q, k = uniform(rng, (B, H, T, 6), dtype), uniform(rng, (B, H, S, 6), dtype)
    v, d_out = uniform(rng, (B, H, S, 7), dtype), rng.standard_normal((B, H, T, 7)).astype(dtype)
    allowed = bottom_right_causal(T, S)
    dead = np.broadcast_to(~allowed.any(axis=-1), (B, H, T))
    check_against_torch(
        torch, q, k, v, d_out, dead, allowed, dtype, is_causal=True, causal_alignment="bottom_right"
    )


@DTYPES
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_and_a_row_mask_with_grouped_query_attention(torch, rng, alignment, dtype):
    # sdpa ANDs is_causal with attn_mask (PyTorch refuses both): PyTorch gets the AND written out
    B, Hq, Hkv, T, S = 2, 6, 2, 17, 12
    q, k = uniform(rng, (B, Hq, T, 4), dtype), uniform(rng, (B, Hkv, S, 4), dtype)
    v, d_out = uniform(rng, (B, Hkv, S, 3), dtype), rng.standard_normal((B, Hq, T, 3)).astype(dtype)
    rows = rng.random((B, 1, T, 1)) < 0.7  # about 30 % of the rows of each batch entry hidden
    rows[:, :, 0] = False
    causal = np.tri(T, S, dtype=bool) if alignment == "top_left" else bottom_right_causal(T, S)
    dead = np.broadcast_to(~(rows & causal).any(axis=-1), (B, Hq, T))
    check_against_torch(
        torch, q, k, v, d_out, dead, rows & causal, dtype,
        attn_mask=rows, is_causal=True, causal_alignment=alignment, enable_gqa=True,
    )  # fmt: skip
