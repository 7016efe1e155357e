"""Acceptance tests for part 1 of the 2026 API contract (``../shared/api-2026.md``), written from
the contract alone: ``sdpa.flex_attention``, ``sdpa.create_block_mask`` and ``sdpa.BlockMask``.

Every expected value comes from an explicit float64 formula written here (scores, an explicit
boolean mask, a softmax by hand), or from torch's FlexAttention when it is installed; none comes
from the code under test. ``tests/sdpa/test_flex.py`` holds the package's own, finer tests.
"""

from __future__ import annotations

import inspect
import math
import warnings

import numpy as np
import pytest

import sdpa
from sdpa import BlockMask, create_block_mask, flex_attention

IMPLEMENTATIONS = ["reference", "tiled", "auto"]


def _rand(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def _explicit(q, k, v, *, score_fn=None, allowed=None, scale=None):
    """The contract's meaning in float64 loops over (b, h): scores, modification, mask, softmax."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Hq, T, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(Dk) if scale is None else scale
    out = np.zeros((B, Hq, T, Dv))
    lse = np.full((B, Hq, T), -np.inf)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            for i in range(T):
                z = np.array([q[b, h, i] @ k[b, g, j] * scale for j in range(S)])
                if score_fn is not None:
                    z = np.array([score_fn(z[j], b, h, i, j) for j in range(S)])
                keep = z > -np.inf
                if allowed is not None:
                    keep &= np.array([bool(allowed(b, h, i, j)) for j in range(S)])
                if not keep.any():
                    continue
                m = z[keep].max()
                e = np.where(keep, np.exp(np.where(keep, z, m) - m), 0.0)
                out[b, h, i] = e @ v[b, g] / e.sum()
                lse[b, h, i] = m + np.log(e.sum())
    return out, lse


def test_names_are_public_and_signatures_follow_the_contract():
    for name in ("flex_attention", "create_block_mask", "BlockMask"):
        assert name in sdpa.__all__
    # Section 1's parameters, in order; section 5 adds the keyword-only return_aux after them.
    signature = inspect.signature(flex_attention).parameters.values()
    params = [p.name for p in signature if p.kind is not p.KEYWORD_ONLY]
    assert [p.name for p in signature if p.kind is p.KEYWORD_ONLY] == ["return_aux"]
    assert params == [
        "query",
        "key",
        "value",
        "score_mod",
        "block_mask",
        "scale",
        "enable_gqa",
        "return_lse",
        "implementation",
    ]
    sig = inspect.signature(create_block_mask)
    assert list(sig.parameters) == ["mask_mod", "B", "H", "Q_LEN", "KV_LEN", "BLOCK_SIZE"]
    assert sig.parameters["BLOCK_SIZE"].default == 128


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_plain_call_is_softmax_attention(rng, implementation):
    q, k, v = _rand(rng, 2, 3, 5, 4), _rand(rng, 2, 3, 7, 4), _rand(rng, 2, 3, 7, 6)
    out, lse = flex_attention(q, k, v, return_lse=True, implementation=implementation)
    want, want_lse = _explicit(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert flex_attention(q, k, v).shape == (2, 3, 5, 6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_alibi_and_softcap_score_mods(rng, implementation):
    q, k, v = _rand(rng, 1, 4, 9, 8), _rand(rng, 1, 4, 11, 8), _rand(rng, 1, 4, 11, 3)
    slope = np.array([0.5, 0.25, 0.125, 0.0625])

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slope[h] * (kv_idx - q_idx)

    out = flex_attention(q, k, v, score_mod=alibi, implementation=implementation)
    want, _ = _explicit(q, k, v, score_fn=lambda z, b, h, i, j: z + slope[h] * (j - i))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)

    cap = 0.7
    out = flex_attention(
        q,
        k,
        v,
        score_mod=lambda s, b, h, i, j: cap * np.tanh(s / cap),
        implementation=implementation,
    )
    want, _ = _explicit(q, k, v, score_fn=lambda z, b, h, i, j: cap * math.tanh(z / cap))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("name", "mask_mod", "rule"),
    [
        ("causal", lambda b, h, i, j: i >= j, lambda b, h, i, j: i >= j),
        ("window", lambda b, h, i, j: (i >= j) & (i - j < 5), lambda b, h, i, j: 0 <= i - j < 5),
        (
            "document",
            lambda b, h, i, j: (i // 7) == (j // 7),
            lambda b, h, i, j: i // 7 == j // 7,
        ),
        ("prefix", lambda b, h, i, j: (j < 6) | (i >= j), lambda b, h, i, j: j < 6 or i >= j),
    ],
)
def test_block_masks_exclude_exactly(rng, implementation, name, mask_mod, rule):
    T, S = 37, 29
    q, k, v = _rand(rng, 2, 2, T, 4), _rand(rng, 2, 2, S, 4), _rand(rng, 2, 2, S, 5)
    for block in (8, (16, 4), 128):
        bm = create_block_mask(mask_mod, None, None, T, S, BLOCK_SIZE=block)
        out, lse = flex_attention(
            q, k, v, block_mask=bm, return_lse=True, implementation=implementation
        )
        want, want_lse = _explicit(q, k, v, allowed=rule)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12, err_msg=f"{name} {block}")
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
        finite = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12)


def test_masked_entries_have_weight_exactly_zero(rng):
    # A masked key with a huge value would show through any non-zero weight.
    q, k = _rand(rng, 1, 1, 6, 4), _rand(rng, 1, 1, 6, 4)
    v = np.zeros((1, 1, 6, 1))
    v[0, 0, 5, 0] = 1e300
    bm = create_block_mask(lambda b, h, i, j: j < 5, None, None, 6, 6, BLOCK_SIZE=2)
    for impl in IMPLEMENTATIONS:
        out = flex_attention(q, k, v, block_mask=bm, implementation=impl)
        assert np.all(out == 0.0), impl


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fully_masked_rows_give_zero_and_minus_inf_without_warning(rng, implementation):
    T, S = 10, 12
    q, k, v = _rand(rng, 1, 2, T, 4), _rand(rng, 1, 2, S, 4), _rand(rng, 1, 2, S, 3)
    bm = create_block_mask(lambda b, h, i, j: (i < 4) & (j >= i), None, None, T, S, BLOCK_SIZE=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = flex_attention(
            q, k, v, block_mask=bm, return_lse=True, implementation=implementation
        )
    assert np.all(out[:, :, 4:] == 0) and np.all(lse[:, :, 4:] == -np.inf)
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, :4]).all()
    # A score_mod that sets every score of a row to -inf is a masked row too.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = flex_attention(
            q,
            k,
            v,
            score_mod=lambda s, b, h, i, j: np.where(i == 3, -np.inf, s),
            return_lse=True,
            implementation=implementation,
        )
    assert np.all(out[:, :, 3] == 0) and np.all(lse[:, :, 3] == -np.inf)
    want, _ = _explicit(q, k, v)
    np.testing.assert_allclose(np.delete(out, 3, axis=2), np.delete(want, 3, axis=2), atol=1e-12)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gqa_and_per_batch_head_masks(rng, implementation):
    B, Hq, Hkv, T, S = 2, 6, 2, 9, 13
    q, k, v = _rand(rng, B, Hq, T, 4), _rand(rng, B, Hkv, S, 4), _rand(rng, B, Hkv, S, 3)
    lengths = np.array([5, 13])

    def mask_mod(b, h, i, j):
        return (j < lengths[b]) & ((h % 2 == 0) | (i >= j))

    bm = create_block_mask(mask_mod, B, Hq, T, S, BLOCK_SIZE=4)
    assert bm.shape == (B, Hq, T, S)
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, implementation=implementation)
    rule = lambda b, h, i, j: j < lengths[b] and (h % 2 == 0 or i >= j)  # noqa: E731
    want, _ = _explicit(q, k, v, allowed=rule)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q, k, v, implementation=implementation)


def test_score_mod_receives_scaled_scores_and_broadcastable_indices(rng):
    B, H, T, S, Dk = 2, 3, 5, 7, 4
    q, k, v = _rand(rng, B, H, T, Dk), _rand(rng, B, H, S, Dk), _rand(rng, B, H, S, 2)
    seen = []

    def spy(score, b, h, q_idx, kv_idx):
        shape = np.broadcast_shapes(score.shape, b.shape, h.shape, q_idx.shape, kv_idx.shape)
        assert shape == np.shape(score)
        for idx in (b, h, q_idx, kv_idx):
            assert np.issubdtype(np.asarray(idx).dtype, np.integer)
        full = [np.broadcast_to(x, shape) for x in (b, h, q_idx, kv_idx)]
        seen.append((np.array(score, dtype=np.float64), *full))
        return score

    for impl in ("reference", "tiled"):
        seen.clear()
        flex_attention(q, k, v, score_mod=spy, scale=0.3, implementation=impl)
        for score, b, h, i, j in seen:
            assert ((0 <= i) & (i < T) & (0 <= j) & (j < S)).all()
            want = np.einsum("...d,...d->...", q[b, h, i], k[b, h, j]) * 0.3
            np.testing.assert_allclose(score, want, rtol=1e-12, atol=1e-12)


def test_mods_are_never_called_on_empty_blocks(rng):
    T = S = 64
    q, k, v = _rand(rng, 1, 1, T, 4), _rand(rng, 1, 1, S, 4), _rand(rng, 1, 1, S, 4)
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, S, BLOCK_SIZE=16)
    calls = []

    def record(score, b, h, q_idx, kv_idx):
        qi, kj = np.broadcast_arrays(q_idx, kv_idx)
        calls.append(np.stack([qi.ravel() // 16, kj.ravel() // 16]))
        return score

    flex_attention(q, k, v, score_mod=record, block_mask=bm, implementation="tiled")
    blocks = np.concatenate(calls, axis=1)
    assert blocks.size and np.all(blocks[0] >= blocks[1])  # never a block above the diagonal


def test_block_mask_shape_dense_and_sparsity():
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 100, 70, BLOCK_SIZE=32)
    assert isinstance(bm, BlockMask)
    assert bm.shape == (1, 1, 100, 70)
    assert bm.BLOCK_SIZE == (32, 32)
    dense = bm.to_dense()
    assert dense.shape == (1, 1, 4, 3) and dense.dtype == bool
    # Blocks (query block, key block) with no i >= j: (0, 1), (0, 2), (1, 2).
    want = np.ones((4, 3), dtype=bool)
    want[0, 1] = want[0, 2] = want[1, 2] = False
    np.testing.assert_array_equal(dense[0, 0], want)
    assert bm.sparsity() == pytest.approx(25.0)
    square = create_block_mask(lambda b, h, i, j: i >= j, 1, 2, 64, 64, BLOCK_SIZE=16)
    assert square.shape == (1, 2, 64, 64)
    assert square.sparsity() == pytest.approx(100 * 6 / 16)
    pair = create_block_mask(lambda b, h, i, j: i >= j, None, None, 64, 64, BLOCK_SIZE=(16, 32))
    assert pair.BLOCK_SIZE == (16, 32) and pair.to_dense().shape == (1, 1, 4, 2)
    mod = lambda b, h, i, j: j <= i  # noqa: E731
    assert create_block_mask(mod, None, None, 8, 8).mask_mod is mod


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes_are_kept_and_paths_agree(rng, dtype):
    q, k, v = (_rand(rng, 1, 2, n, 8, dtype=dtype) for n in (33, 40, 40))
    bm = create_block_mask(lambda b, h, i, j: i + 7 >= j, None, None, 33, 40, BLOCK_SIZE=8)
    outs = {}
    for impl in IMPLEMENTATIONS:
        out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, implementation=impl)
        assert out.dtype == dtype and out.shape == (1, 2, 33, 8)
        outs[impl] = (out.astype(np.float64), np.asarray(lse, dtype=np.float64))
    want, want_lse = _explicit(q, k, v, allowed=lambda b, h, i, j: i + 7 >= j)
    tol = {np.float16: 5e-3, np.float32: 2e-6, np.float64: 1e-12}[dtype]
    for impl, (out, lse) in outs.items():
        np.testing.assert_allclose(out, want, atol=tol * 4, rtol=tol, err_msg=impl)
        np.testing.assert_allclose(lse, want_lse, atol=tol * 4, rtol=tol, err_msg=impl)


def test_inputs_are_not_mutated(rng):
    q, k, v = _rand(rng, 1, 1, 5, 4), _rand(rng, 1, 1, 5, 4), _rand(rng, 1, 1, 5, 4)
    copies = [x.copy() for x in (q, k, v)]
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 5, 5, BLOCK_SIZE=2)
    for impl in IMPLEMENTATIONS:
        flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 2, block_mask=bm,
                       implementation=impl)  # fmt: skip
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


def test_bad_input_is_refused_with_the_argument_named(rng):
    q, k, v = _rand(rng, 1, 2, 8, 4), _rand(rng, 1, 2, 8, 4), _rand(rng, 1, 2, 8, 4)
    with pytest.raises(ValueError, match="query"):
        flex_attention(q[0], k, v)
    with pytest.raises(ValueError, match="key"):
        flex_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="implementation"):
        flex_attention(q, k, v, implementation="fast")
    causal = lambda b, h, i, j: i >= j  # noqa: E731
    with pytest.raises(ValueError, match="block_mask"):
        flex_attention(q, k, v, block_mask=create_block_mask(causal, None, None, 8, 9))
    with pytest.raises(ValueError, match="block_mask"):
        flex_attention(q, k, v, block_mask=create_block_mask(causal, None, 3, 8, 8))
    with pytest.raises(ValueError, match="block_mask"):
        flex_attention(q, k, v, block_mask=create_block_mask(causal, 2, None, 8, 8))
    with pytest.raises((TypeError, ValueError), match="block_mask"):
        flex_attention(q, k, v, block_mask=np.ones((8, 8), dtype=bool))
    with pytest.raises((TypeError, ValueError), match="BLOCK_SIZE"):
        create_block_mask(causal, None, None, 8, 8, BLOCK_SIZE=0)


def test_against_torch_flex_attention(rng):
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    B, H, T, S, D = 1, 2, 48, 48, 8
    q, k, v = _rand(rng, B, H, T, D), _rand(rng, B, H, S, D), _rand(rng, B, H, S, D)
    slopes = [0.5, 0.125]

    def torch_mod(score, b, h, q_idx, kv_idx):
        return score + torch.tensor(slopes, dtype=score.dtype)[h] * (kv_idx - q_idx)

    def ours_mod(score, b, h, q_idx, kv_idx):
        return score + np.array(slopes)[h] * (kv_idx - q_idx)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex_attention is unfused
        tbm = torch_block_mask(
            lambda b, h, i, j: i >= j, None, None, T, S, device="cpu", BLOCK_SIZE=16
        )
        t_out, t_lse = torch_flex(
            *(torch.from_numpy(x) for x in (q, k, v)),
            score_mod=torch_mod,
            block_mask=tbm,
            return_lse=True,
        )
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, S, BLOCK_SIZE=16)
    for impl in IMPLEMENTATIONS:
        out, lse = flex_attention(
            q, k, v, score_mod=ours_mod, block_mask=bm, return_lse=True, implementation=impl
        )
        np.testing.assert_allclose(out, t_out.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, t_lse.numpy(), rtol=1e-10, atol=1e-12)
