"""vLLM's merge of attention states, ported anew in NumPy.

Follows vllm-project/vllm ``tests/kernels/attention/test_merge_attn_states.py``
(``test_merge_attn_states`` and its naive PyTorch reference ``merge_attn_states_torch``, which
implements section 2.2 of arXiv:2501.01005). Written anew here; nothing is copied.

Kept:

* two states per query row and head, a *prefix* and a *suffix* (attention over two parts of
  the keys), each an output and a float32 log-sum-exp drawn from a standard normal;
* ``+inf`` in about 10 % of each part's lse positions, never in both parts at one position:
  the kernels' sentinel for a part with no keys, which the merge maps to ``-inf`` (the part
  weighs nothing, the row is the other part's state);
* ``prefill_tokens_with_context`` in ``{None, 128}``: tokens from that index on have no
  context, so their prefix is empty (vLLM's ``mask_empty_context_lse`` writes ``-inf`` in its
  lse) and their merge is the suffix's state;
* the grid's values: tokens 256, 512, 613, 1024, 1536, 4096; heads 4, 8, 16, 32, 48, 64;
  head sizes 32, 48, 64, 96, 128, 256;
* the reference formula (the largest lse subtracted, ``exp``, shares of the sum, ``log`` of
  the sum plus the largest), written here in float64, and a second time in PyTorch (float32,
  as upstream's naive reference computes in its inputs' precision) for one case per dtype;
* the tolerances: ``atol = rtol = 1e-3`` for float32 and float16 outputs and for the lse.

Changed:

* dtypes: float32 and float16 (bfloat16 and the fp8 output are GPU-side, not in NumPy);
* the grid is not crossed in full (6 x 6 x 6 x 3 shapes): each token count meets one head
  count and one head size, every value of each list once, so that the file runs in a few
  seconds on two shared cores;
* layout: upstream's outputs are ``(tokens, heads, head_size)`` with lses ``(heads, tokens)``;
  sdpa's merge takes ``(..., T, Dv)`` with ``(..., T)``, so the outputs go in as
  ``(heads, tokens, head_size)`` and come back transposed;
* no timing, no Triton/CUDA kernels compared with each other: sdpa's
  ``merge_attention_states`` is compared with the references, and the rows with a ``+inf``
  part with the other part's state exactly;
* a row whose two parts are both empty (a case upstream's masks exclude; a prefix-free token
  whose suffix lse is ``+inf``) merges to ``out = 0`` and ``lse = -inf``, sdpa's documented
  rule for a row with no keys; upstream's naive reference passes the suffix's output through.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from sdpa import merge_attention_states

# (tokens, heads, head_size): each value of upstream's three lists once
GRID = [(4096, 4, 32), (1536, 8, 48), (1024, 16, 64), (613, 32, 96), (512, 48, 128),
        (256, 64, 256)]  # fmt: skip
DTYPES = [np.float32, np.float16]
TOL = dict(atol=1e-3, rtol=1e-3)  # upstream's, for float32 and float16
PREFIX_FREE_FROM = 128  # upstream's prefill_tokens_with_context


def states(rng, tokens, heads, head_size, dtype, prefill_tokens_with_context=None):
    """Upstream's inputs: outputs ``(tokens, heads, head_size)`` in ``dtype``, float32 lses
    ``(heads, tokens)`` with +inf in about 10 % of each part's positions, never both."""
    prefix_lse = rng.standard_normal((heads, tokens)).astype(np.float32)
    suffix_lse = rng.standard_normal((heads, tokens)).astype(np.float32)
    mark_prefix = rng.random((heads, tokens)) < 0.1
    mark_suffix = rng.random((heads, tokens)) < 0.1
    both = mark_prefix & mark_suffix
    prefix_lse[mark_prefix & ~both] = np.inf
    suffix_lse[mark_suffix & ~both] = np.inf
    if prefill_tokens_with_context is not None:  # later tokens: no context, an empty prefix
        prefix_lse[:, prefill_tokens_with_context:] = -np.inf
    prefix_out = rng.standard_normal((tokens, heads, head_size)).astype(dtype)
    suffix_out = rng.standard_normal((tokens, heads, head_size)).astype(dtype)
    return prefix_out, prefix_lse, suffix_out, suffix_lse


def merge_reference(prefix_out, prefix_lse, suffix_out, suffix_lse):
    """The merge of two states in float64, upstream's layout; +inf is an empty part (-inf)
    and a row with no keys at all gives 0 and -inf."""
    lses = [
        np.where(np.isposinf(x), -np.inf, x.astype(np.float64)) for x in (prefix_lse, suffix_lse)
    ]
    top = np.maximum(*lses)  # (heads, tokens)
    keys = np.isfinite(top)
    shift = np.where(keys, top, 0.0)
    e_prefix, e_suffix = (np.exp(x - shift) for x in lses)  # 0 for an empty part
    total = e_prefix + e_suffix  # >= 1 in rows with keys, 0 in the others
    safe = np.where(keys, total, 1.0)
    share_prefix = (e_prefix / safe).T[..., None]  # (heads, tokens) -> (tokens, heads, 1)
    share_suffix = (e_suffix / safe).T[..., None]
    out = share_prefix * prefix_out.astype(np.float64)
    out += share_suffix * suffix_out.astype(np.float64)
    lse = np.where(keys, shift + np.log(safe), -np.inf)
    return out, lse


def merge_sdpa(prefix_out, prefix_lse, suffix_out, suffix_lse):
    """sdpa's merge in upstream's layout, with warnings as errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention_states(
            [prefix_out.transpose(1, 0, 2), suffix_out.transpose(1, 0, 2)],
            [prefix_lse, suffix_lse],
        )
    return out.transpose(1, 0, 2), lse  # (heads, tokens, D) -> (tokens, heads, D)


@pytest.mark.parametrize("prefill_tokens_with_context", [None, PREFIX_FREE_FROM])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16"])
@pytest.mark.parametrize(("tokens", "heads", "head_size"), GRID, ids=str)
def test_merge_attn_states(rng, tokens, heads, head_size, dtype, prefill_tokens_with_context):
    inputs = states(rng, tokens, heads, head_size, dtype, prefill_tokens_with_context)
    prefix_out, prefix_lse, suffix_out, suffix_lse = inputs
    before = [a.copy() for a in inputs]
    out, lse = merge_sdpa(*inputs)
    assert out.dtype == dtype and lse.dtype == np.float32
    assert out.shape == prefix_out.shape and lse.shape == prefix_lse.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    want, want_lse = merge_reference(*inputs)
    np.testing.assert_allclose(out, want, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    # a part marked +inf weighs nothing: the row is the other part's state, exactly
    prefix_gone = np.isposinf(prefix_lse) | np.isneginf(prefix_lse)
    rows = (prefix_gone & np.isfinite(suffix_lse)).T  # (tokens, heads)
    np.testing.assert_array_equal(out[rows], suffix_out[rows])
    np.testing.assert_array_equal(lse.T[rows], suffix_lse.T[rows])
    rows = (np.isposinf(suffix_lse) & np.isfinite(prefix_lse)).T
    np.testing.assert_array_equal(out[rows], prefix_out[rows])
    np.testing.assert_array_equal(lse.T[rows], prefix_lse.T[rows])
    # a row with no keys at all (no context and an empty suffix): 0 and -inf
    rows = (prefix_gone & np.isposinf(suffix_lse)).T
    assert rows.any() == (prefill_tokens_with_context is not None)
    np.testing.assert_array_equal(out[rows], 0.0)
    assert np.isneginf(lse.T[rows]).all()
    for a, b in zip(inputs, before):  # upstream's reference rewrites its lses; sdpa must not
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16"])
def test_merge_attn_states_against_torch(torch, rng, dtype):
    """The merge written in PyTorch float32 operations, as upstream's naive reference does
    (the same formula; +inf mapped to -inf on copies, not in place)."""
    prefix_out, prefix_lse, suffix_out, suffix_lse = states(rng, 613, 32, 96, dtype)
    p_lse, s_lse = torch.from_numpy(prefix_lse.copy()), torch.from_numpy(suffix_lse.copy())
    p_lse[p_lse == torch.inf] = -torch.inf
    s_lse[s_lse == torch.inf] = -torch.inf
    top = torch.maximum(p_lse, s_lse)  # never -inf here: the marks are never both set
    e_p, e_s = torch.exp(p_lse - top), torch.exp(s_lse - top)
    total = e_p + e_s
    want_lse = torch.log(total) + top
    share_p = (e_p / total).T.unsqueeze(-1)  # (heads, tokens) -> (tokens, heads, 1)
    share_s = (e_s / total).T.unsqueeze(-1)
    want = torch.from_numpy(prefix_out).float() * share_p
    want += torch.from_numpy(suffix_out).float() * share_s
    out, lse = merge_sdpa(prefix_out, prefix_lse, suffix_out, suffix_lse)
    np.testing.assert_allclose(out, want.to(torch.from_numpy(out).dtype).numpy(), **TOL)
    np.testing.assert_allclose(lse, want_lse.numpy(), **TOL)
