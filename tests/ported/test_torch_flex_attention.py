"""PyTorch's FlexAttention tests, ported anew to sdpa.flex_attention and sdpa.create_block_mask.

Follows ``pytorch/pytorch``, file ``test/inductor/test_flex_attention.py`` (its score mods, mask
mods and the ``TestBlockMask`` sparsity checks) and the helpers of
``torch/nn/attention/flex_attention.py`` (``noop_mask``, ``and_masks``, ``or_masks``).

Kept: the mods themselves (relative bias, ALiBi, "inverse causal", times two, squared, head
offset, rel-causal, composition, skipped odd keys, captured buffers indexed by b, h, q and kv,
a relative-bias buffer, a per-query multiplier, floor division of indices, SiLU, a per-batch
bidirectional prefix, 2-D neighbourhood attention, padded-dense and jagged causal, document
masking, a captured scalar) and masks (causal, sliding window, prefix LM, documents, padding,
a batch-dependent mask, masks combined by and/or, fully masked rows), GQA, a key/value batch
of 1, T != S; the block-mask numbers (causal 2048 in blocks of 128: 46.875 % sparse; with a
per-batch offset: 29.1015625 %; causal and a 512 window: 28 partial blocks).
Changed: PyTorch compares a compiled kernel with its eager path by relative error in float16;
here every mod runs on both of sdpa's paths (``implementation="reference"`` and ``"tiled"``) in
float64 against (a) a float64 loop written below, which applies the mod to one score at a time,
and (b) PyTorch's eager ``flex_attention`` on CPU, to 1e-12; the sizes are small and odd
(T = 19, S = 27 in blocks of 8) instead of 2048; ``return_lse`` is always checked; the natten
mod uses floor division where PyTorch's test notes it should; per-batch sparsity (PyTorch's
``block_mask[b].sparsity()``) is read from ``kinds``, since sdpa's BlockMask has no indexing.
Every expected block count is computed by hand in the test.

PyTorch is a test-time reference only (the ``torch`` fixture of tests/conftest.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from references import torch_flex

from sdpa import create_block_mask, flex_attention

PATHS = ["reference", "tiled"]
TOL = dict(rtol=1e-12, atol=1e-12)  # float64 throughout

# ---------------------------------------------------------------------------------------------
# Score mods and mask mods: one named generator each (they may move to a shared tests module)
# ---------------------------------------------------------------------------------------------
# Every generator takes ``ops``, the array functions of NumPy (for sdpa and the loop) or of
# PyTorch (for its FlexAttention), so that one definition serves both; captured buffers are
# NumPy arrays that ``ops.asarray`` hands to PyTorch as float64/int64 tensors.


@dataclass(frozen=True)
class Ops:
    asarray: Callable
    where: Callable
    tanh: Callable
    exp: Callable


NUMPY = Ops(np.asarray, np.where, np.tanh, np.exp)


def torch_ops(torch) -> Ops:
    return Ops(torch.as_tensor, torch.where, torch.tanh, torch.exp)


def named(name: str, fn: Callable) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    return fn


# Captured buffers, large enough for every case below (T, S <= MAXLEN, B <= 4, H <= 8).
MAXLEN = 64
_BUFFERS = np.random.default_rng(34)
TOKEN_SCALE = _BUFFERS.standard_normal(MAXLEN)
BATCH_SCALE = _BUFFERS.standard_normal(4)
HEAD_SCALE = _BUFFERS.standard_normal(8)
HEAD_OFFSET = _BUFFERS.random(8)
BIAS_BHQK = _BUFFERS.standard_normal((4, 8, MAXLEN, MAXLEN))
REL_BIAS = _BUFFERS.standard_normal(2 * MAXLEN)
OFFSET_Q, OFFSET_KV = _BUFFERS.standard_normal((2, MAXLEN))


def generate_identity(ops=NUMPY):
    return named("identity", lambda score, b, h, q_idx, kv_idx: score)


def generate_times_two(ops=NUMPY):
    return named("times_two", lambda score, b, h, q_idx, kv_idx: score * 2)


def generate_squared(ops=NUMPY):
    return named("squared", lambda score, b, h, q_idx, kv_idx: score * score)


def generate_causal_score(ops=NUMPY):
    def causal_score(score, b, h, q_idx, kv_idx):
        return ops.where(q_idx >= kv_idx, score, -math.inf)

    return causal_score


def generate_inverse_causal_score(ops=NUMPY):
    def inverse_causal_score(score, b, h, q_idx, kv_idx):
        return ops.where(q_idx <= kv_idx, score, -math.inf)

    return inverse_causal_score


def generate_rel_bias(ops=NUMPY):
    return named("rel_bias", lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx))


def generate_rel_causal(ops=NUMPY):
    def rel_causal(score, b, h, q_idx, kv_idx):
        return ops.where(q_idx >= kv_idx, score + (q_idx - kv_idx), -math.inf)

    return rel_causal


def generate_alibi(num_heads, ops=NUMPY):
    """ALiBi ``score + (kv_idx - q_idx) * slope(h)``, ``slope(h) = 2 ** (-8 (h + 1) / H)``."""
    slopes = ops.asarray(2.0 ** (-8.0 * (np.arange(num_heads) + 1) / num_heads))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * slopes[h]

    return alibi


def generate_tanh_softcap(cap, ops=NUMPY):
    return named(f"tanh_softcap_{cap}", lambda score, b, h, q, kv: cap * ops.tanh(score / cap))


def generate_head_offset(ops=NUMPY):
    offsets = ops.asarray(HEAD_OFFSET)
    return named("head_offset", lambda score, b, h, q_idx, kv_idx: score * offsets[h])


def generate_all_dims_bias(ops=NUMPY):
    tok, batch, head = (ops.asarray(a) for a in (TOKEN_SCALE, BATCH_SCALE, HEAD_SCALE))

    def all_dims_bias(score, b, h, q_idx, kv_idx):
        return score + tok[q_idx] + batch[b] + head[h]

    return all_dims_bias


def generate_bias_bhqk(ops=NUMPY):
    bias = ops.asarray(BIAS_BHQK)
    return named("bias_bhqk", lambda score, b, h, q_idx, kv_idx: score + bias[b, h, q_idx, kv_idx])


def generate_bias_bqk(ops=NUMPY):
    bias = ops.asarray(BIAS_BHQK[:, 0])
    return named("bias_bqk", lambda score, b, h, q_idx, kv_idx: score + bias[b, q_idx, kv_idx])


def generate_bias_qk(ops=NUMPY):
    bias = ops.asarray(BIAS_BHQK[0, 0])
    return named("bias_qk", lambda score, b, h, q_idx, kv_idx: score + bias[q_idx, kv_idx])


def generate_rel_bias_buffer(ops=NUMPY):
    rel = ops.asarray(REL_BIAS)

    def rel_bias_buffer(score, b, h, q_idx, kv_idx):
        return score + rel[(q_idx - kv_idx) + MAXLEN]

    return rel_bias_buffer


def generate_query_multiplier(ops=NUMPY):
    multiplier = ops.asarray(TOKEN_SCALE)
    return named("query_multiplier", lambda score, b, h, q_idx, kv: score * multiplier[q_idx])


def generate_query_key_offsets(ops=NUMPY):
    off_q, off_kv = ops.asarray(OFFSET_Q), ops.asarray(OFFSET_KV)

    def query_key_offsets(score, b, h, q_idx, kv_idx):
        return score + off_q[q_idx] + off_kv[kv_idx]

    return query_key_offsets


def generate_skip_odd_keys(ops=NUMPY):
    def skip_odd_keys(score, b, h, q_idx, kv_idx):
        return ops.where(kv_idx % 2 == 0, score, -math.inf)

    return skip_odd_keys


def generate_composition(ops=NUMPY):
    """The relative bias, then the inverse causal score mod, applied to its result."""
    first, second = generate_rel_bias(ops), generate_inverse_causal_score(ops)

    def composition(score, b, h, q_idx, kv_idx):
        return second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    return composition


def generate_floor_division(ops=NUMPY):
    return named("floor_division", lambda score, b, h, q, kv: score - q // (1 + kv))


def generate_silu(ops=NUMPY):
    return named("silu", lambda score, b, h, q_idx, kv_idx: score / (1 + ops.exp(-score)))


def generate_bidirectional_prefix(prefixes, ops=NUMPY):
    """Causal, but batch entry ``b`` sees its first ``prefixes[b] + 1`` positions both ways."""
    prefix = ops.asarray(np.asarray(prefixes))

    def bidirectional_prefix(score, b, h, q_idx, kv_idx):
        both_ways = (q_idx <= prefix[b]) & (kv_idx <= prefix[b])
        return ops.where(both_ways | (q_idx >= kv_idx), score, -math.inf)

    return bidirectional_prefix


def generate_natten_2d(width, window, ops=NUMPY):
    """Positions on a grid ``width`` wide; near in either coordinate (PyTorch's ``|``)."""

    def natten_2d(score, b, h, q_idx, kv_idx):
        near_x = abs(q_idx // width - kv_idx // width) <= window
        near_y = abs(q_idx % width - kv_idx % width) <= window
        return ops.where(near_x | near_y, score, -math.inf)

    return natten_2d


def generate_padded_dense_causal(ops=NUMPY):
    """PyTorch's test compares the *score* with ``b + 1``: scores above it are excluded."""
    limit = ops.asarray(np.arange(1, 5))
    causal = generate_causal_score(ops)

    def padded_dense_causal(score, b, h, q_idx, kv_idx):
        return ops.where(score <= limit[b], causal(score, b, h, q_idx, kv_idx), -math.inf)

    return padded_dense_causal


def generate_jagged_causal(lengths, ops=NUMPY):
    """Causal in positions counted from the start of each packed sequence."""
    seq = np.repeat(np.arange(len(lengths)), lengths)
    starts = ops.asarray(np.concatenate([[0], np.cumsum(lengths)])[seq])

    def jagged_causal(score, b, h, q_idx, kv_idx):
        return ops.where(q_idx - starts[q_idx] >= kv_idx - starts[kv_idx], score, -math.inf)

    return jagged_causal


def generate_document_causal_score(lengths, ops=NUMPY):
    document = ops.asarray(np.repeat(np.arange(len(lengths)), lengths))

    def document_causal_score(score, b, h, q_idx, kv_idx):
        allowed = (q_idx >= kv_idx) & (document[q_idx] == document[kv_idx])
        return ops.where(allowed, score, -math.inf)

    return document_causal_score


def generate_captured_scalar(ops=NUMPY):
    scalar = ops.asarray(np.array(1))  # PyTorch's test captures a 0-d int32 tensor of 1
    return named("captured_scalar", lambda score, b, h, q_idx, kv_idx: score + scalar)


# mask mods


def generate_noop_mask(ops=NUMPY):
    return named("noop_mask", lambda b, h, q_idx, kv_idx: (q_idx >= 0) & (kv_idx >= 0))


def generate_causal_mask(ops=NUMPY):
    return named("causal_mask", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)


def generate_inverse_causal_mask(ops=NUMPY):
    return named("inverse_causal_mask", lambda b, h, q_idx, kv_idx: q_idx <= kv_idx)


def generate_strictly_anticausal_mask(ops=NUMPY):
    return named("strictly_anticausal_mask", lambda b, h, q_idx, kv_idx: q_idx < kv_idx)


def and_masks(*mods):
    def and_mask(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            result = result & mod(b, h, q_idx, kv_idx)
        return result

    return named("_and_".join(m.__name__ for m in mods), and_mask)


def or_masks(*mods):
    def or_mask(b, h, q_idx, kv_idx):
        result = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            result = result | mod(b, h, q_idx, kv_idx)
        return result

    return named("_or_".join(m.__name__ for m in mods), or_mask)


def generate_window_mask(window, ops=NUMPY):
    """Keys at most ``window`` positions back (with causal: a sliding window)."""
    return named(f"window_{window}", lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= window)


def generate_sliding_window(window, ops=NUMPY):
    return and_masks(generate_causal_mask(ops), generate_window_mask(window, ops))


def generate_prefix_lm(prefix, ops=NUMPY):
    return named(f"prefix_lm_{prefix}", lambda b, h, q, kv: (kv < prefix) | (q >= kv))


def generate_document_mask(lengths, ops=NUMPY):
    document = ops.asarray(np.repeat(np.arange(len(lengths)), lengths))
    return named("document_mask", lambda b, h, q, kv: document[q] == document[kv])


def generate_padding_mask(lengths, ops=NUMPY):
    """Batch entry ``b`` has ``lengths[b]`` real keys (PyTorch's jagged/padded batches)."""
    length = ops.asarray(np.asarray(lengths))
    return named("padding_mask", lambda b, h, q_idx, kv_idx: kv_idx < length[b])


def generate_first_rows_mask(rows, ops=NUMPY):
    """Only the first ``rows`` queries attend: the rest are fully masked rows."""
    return named(f"first_{rows}_rows", lambda b, h, q_idx, kv_idx: (q_idx < rows) & (kv_idx >= 0))


def generate_even_batch_causal(ops=NUMPY):
    """PyTorch's ``batch_flip_causal``: odd batch entries attend nothing."""
    return named("even_batch_causal", lambda b, h, q, kv: (q >= kv) & (b % 2 == 0))


def generate_causal_offset(offsets, block, ops=NUMPY):
    """Causal shifted by ``offsets[b] * block`` keys for batch entry ``b``."""
    offset = ops.asarray(np.asarray(offsets))
    return named("causal_offset", lambda b, h, q, kv: (q + offset[b] * block) >= kv)


def generate_head_window_mask(ops=NUMPY):
    """A window that widens with the head: head ``h`` sees ``2 h + 1`` keys back."""
    return named("head_window", lambda b, h, q, kv: (q >= kv) & (q - kv <= 2 * h + 1))


# ---------------------------------------------------------------------------------------------
# References: a float64 loop (one score at a time) and PyTorch's eager FlexAttention
# ---------------------------------------------------------------------------------------------


def loop_reference(q, k, v, score_mod=None, mask_mod=None):
    """``out`` and ``lse`` of FlexAttention, one score at a time with ``math.fsum``.

    The mods are called with scalar indices; query head ``h`` reads key head ``h // G``, and a
    key/value batch of 1 serves every batch entry.
    """
    B, Hq, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    out, lse = np.zeros((B, Hq, T, Dv)), np.full((B, Hq, T), -np.inf)
    for b, h, i in np.ndindex(B, Hq, T):
        bk, hk = b if k.shape[0] > 1 else 0, h // G
        b_, h_, i_ = np.intp(b), np.intp(h), np.intp(i)
        z = {}
        for j in range(S):
            j_ = np.intp(j)
            if mask_mod is not None and not bool(mask_mod(b_, h_, i_, j_)):
                continue
            s = math.fsum(q[b, h, i] * k[bk, hk, j]) / math.sqrt(D)
            s = s if score_mod is None else float(score_mod(np.float64(s), b_, h_, i_, j_))
            if s != -math.inf:
                z[j] = s
        if z:
            top = max(z.values())
            e = {j: math.exp(s - top) for j, s in z.items()}
            total = math.fsum(e.values())
            lse[b, h, i] = top + math.log(total)
            for d in range(Dv):
                out[b, h, i, d] = math.fsum(e[j] * v[bk, hk, j, d] for j in e) / total
    return out, lse


# ---------------------------------------------------------------------------------------------
# The cases: each mod at small, odd sizes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    score: Callable | None = None  # generator(ops) -> score_mod
    mask: Callable | None = None  # generator(ops) -> mask_mod
    B: int = 2
    Hq: int = 4
    Hkv: int = 4
    T: int = 19
    S: int = 27
    block: int | tuple = 8
    Bkv: int | None = None  # a key/value batch of 1 broadcasts
    mask_B: bool = False  # the mask depends on the batch entry
    mask_H: bool = False  # ... or on the head

    def inputs(self, rng):
        Bkv = self.Bkv or self.B
        q = rng.standard_normal((self.B, self.Hq, self.T, 8))
        k = rng.standard_normal((Bkv, self.Hkv, self.S, 8))
        v = rng.standard_normal((Bkv, self.Hkv, self.S, 5))
        return q, k, v

    def mods(self, ops):
        return (
            None if self.score is None else self.score(ops),
            None if self.mask is None else self.mask(ops),
        )

    def mask_dims(self):
        return (self.B if self.mask_B else None), (self.Hq if self.mask_H else None)


CASES = [
    Case("identity", generate_identity),
    Case("times_two", generate_times_two),
    Case("squared", generate_squared, Hkv=2),
    Case("causal_score", generate_causal_score, generate_causal_mask),
    Case("inverse_causal", generate_inverse_causal_score, generate_inverse_causal_mask),
    Case("rel_bias", generate_rel_bias, T=27, S=19),
    Case("rel_causal", generate_rel_causal, generate_causal_mask),
    Case("alibi_gqa", lambda ops: generate_alibi(8, ops), Hq=8, Hkv=2),
    Case("alibi_sliding_window", lambda ops: generate_alibi(4, ops), lambda ops: generate_sliding_window(5, ops)),
    Case("tanh_softcap", lambda ops: generate_tanh_softcap(0.7, ops), Hkv=1),
    Case("tanh_softcap_prefix_lm", lambda ops: generate_tanh_softcap(2.0, ops), lambda ops: generate_prefix_lm(6, ops)),
    Case("head_offset", generate_head_offset, Hq=8, Hkv=4),
    Case("all_dims_bias", generate_all_dims_bias, B=3, T=27, S=27),
    Case("bias_bhqk", generate_bias_bhqk, generate_causal_mask),
    Case("bias_bqk", generate_bias_bqk),
    Case("bias_qk_kv_batch_1", generate_bias_qk, generate_noop_mask, Bkv=1, mask_B=True),
    Case("rel_bias_buffer", generate_rel_bias_buffer),
    Case("query_multiplier", generate_query_multiplier, T=27, S=27),
    Case("query_key_offsets_causal", generate_query_key_offsets, generate_causal_mask, T=27, S=27),
    Case("skip_odd_keys", generate_skip_odd_keys),
    Case("composition", generate_composition),
    Case("floor_division", generate_floor_division),
    Case("silu", generate_silu),
    Case("bidirectional_prefix", lambda ops: generate_bidirectional_prefix([3, 11], ops)),
    Case("natten_2d", lambda ops: generate_natten_2d(6, 1, ops), T=24, S=24),
    Case("padded_dense_causal", generate_padded_dense_causal, B=4, Hq=2, Hkv=2),
    Case("jagged_causal", lambda ops: generate_jagged_causal([5, 13, 9], ops), T=27, S=27),
    Case("document_causal_score", lambda ops: generate_document_causal_score([5, 13, 9], ops), T=27, S=27),
    Case("captured_scalar", generate_captured_scalar),
    # mask mods (with or without a score mod)
    Case("sliding_window", None, lambda ops: generate_sliding_window(4, ops), Hkv=2),
    Case("prefix_lm", None, lambda ops: generate_prefix_lm(6, ops)),
    Case("document", None, lambda ops: generate_document_mask([5, 13, 9], ops), T=27, S=27),
    Case("padding_kv_batch_1", None, lambda ops: generate_padding_mask([11, 27], ops), Bkv=1, mask_B=True),
    Case("first_rows", None, lambda ops: generate_first_rows_mask(10, ops), Hkv=1),
    Case("even_batch_causal", generate_rel_bias, generate_even_batch_causal, B=3, mask_B=True),
    Case("causal_offset", None, lambda ops: generate_causal_offset([0, 1], 8, ops), mask_B=True, T=24, S=24),
    Case("head_window_gqa", generate_squared, generate_head_window_mask, Hq=4, Hkv=2, mask_H=True),
    Case("causal_and_anticausal", None, lambda ops: and_masks(generate_causal_mask(ops), generate_strictly_anticausal_mask(ops))),
    Case("causal_or_anticausal", generate_times_two, lambda ops: or_masks(generate_causal_mask(ops), generate_strictly_anticausal_mask(ops))),
    Case("causal_blocks_4_by_8", generate_rel_bias, generate_causal_mask, block=(4, 8)),
]  # fmt: skip


def run_sdpa(case, q, k, v, implementation):
    score_mod, mask_mod = case.mods(NUMPY)
    mask = None
    if mask_mod is not None:
        mask = create_block_mask(mask_mod, *case.mask_dims(), case.T, case.S, BLOCK_SIZE=case.block)
    return flex_attention(
        q, k, v, score_mod, mask, enable_gqa=case.Hq != case.Hkv, return_lse=True,
        implementation=implementation,
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_mod_on_both_paths_against_the_float64_loop(case, rng):
    q, k, v = case.inputs(rng)
    want_out, want_lse = loop_reference(q, k, v, *case.mods(NUMPY))
    for implementation in PATHS:
        out, lse = run_sdpa(case, q, k, v, implementation)
        what = f"{case.name}, implementation={implementation!r}"
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), err_msg=what)
        np.testing.assert_allclose(out, want_out, err_msg=what, **TOL)
        np.testing.assert_allclose(lse, want_lse, err_msg=what, **TOL)


@pytest.mark.torch
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_mod_on_both_paths_against_torch_flex_attention(torch, case, rng):
    q, k, v = case.inputs(rng)
    score_mod, mask_mod = case.mods(torch_ops(torch))
    t_out, t_lse, _ = torch_flex(
        torch, q, k, v, score_mod, mask_mod, *case.mask_dims(), case.block, case.Hq != case.Hkv
    )
    for implementation in PATHS:
        out, lse = run_sdpa(case, q, k, v, implementation)
        what = f"{case.name}, implementation={implementation!r}"
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(t_lse), err_msg=what)
        np.testing.assert_allclose(out, t_out, err_msg=what, **TOL)
        np.testing.assert_allclose(lse, t_lse, err_msg=what, **TOL)


# ---------------------------------------------------------------------------------------------
# Block masks: PyTorch's sparsity numbers, each computed by hand here
# ---------------------------------------------------------------------------------------------


def causal_empty_blocks(n: int, shift: int = 0) -> int:
    """Empty blocks of an ``n x n`` causal block grid whose queries are ``shift`` blocks ahead:
    block ``(m, c)`` is empty when ``c > m + shift``, so row ``m`` has ``n - 1 - m - shift``."""
    return sum(max(0, n - 1 - m - shift) for m in range(n))


def test_causal_2048_in_blocks_of_128():
    mask = create_block_mask(generate_causal_mask(), None, None, 2048, 2048)
    n = 16
    assert causal_empty_blocks(n) == n * (n - 1) // 2 == 120
    assert mask.shape == (1, 1, 2048, 2048) and mask.BLOCK_SIZE == (128, 128)
    assert mask.sparsity() == 100 * 120 / 256 == 46.875
    assert (
        repr(mask) == "BlockMask(shape=(1, 1, 2048, 2048), BLOCK_SIZE=(128, 128), sparsity=46.88%)"
    )
    np.testing.assert_array_equal(mask.to_dense()[0, 0], np.tri(n, dtype=bool))
    np.testing.assert_array_equal(mask.kv_num_blocks[0, 0], np.ones(n))  # the diagonal
    np.testing.assert_array_equal(mask.kv_indices[0, 0, :, 0], np.arange(n))
    np.testing.assert_array_equal(mask.full_kv_num_blocks[0, 0], np.arange(n))
    for m in range(n):
        np.testing.assert_array_equal(mask.full_kv_indices[0, 0, m, :m], np.arange(m))


def test_a_mask_of_every_batch_entry_and_head_keeps_its_sparsity():
    mask = create_block_mask(generate_causal_offset(np.zeros(4, int), 128), 4, 2, 2048, 2048)
    assert mask.shape == (4, 2, 2048, 2048)
    assert mask.kv_num_blocks.shape == (4, 2, 16) and mask.kv_indices.shape == (4, 2, 16, 16)
    assert mask.sparsity() == 46.875
    for b, h in np.ndindex(4, 2):  # PyTorch's block_mask[b, h].sparsity()
        assert 100 * np.mean(mask.kinds[b, h] == 0) == 46.875


def test_a_per_batch_offset_makes_each_entry_less_sparse():
    # batch entry b: queries 128 b positions ahead, so b blocks more below the diagonal
    mask = create_block_mask(generate_causal_offset(np.arange(8), 128), 8, None, 2048, 2048)
    per_batch = [causal_empty_blocks(16, b) for b in range(8)]
    assert per_batch == [120, 105, 91, 78, 66, 55, 45, 36]
    assert sum(per_batch) == 596
    assert mask.sparsity() == 100 * 596 / (8 * 256) == 29.1015625
    assert "sparsity=29.10%" in repr(mask)
    sparsity = [100 * np.mean(mask.kinds[b] == 0) for b in range(8)]
    np.testing.assert_allclose(sparsity, 100 * np.array(per_batch) / 256, rtol=0, atol=0)
    assert mask.sparsity() < sparsity[0] and sparsity[0] > sparsity[1]


def test_masks_combined_by_and_and_or():
    causal, anti = generate_causal_mask(), generate_strictly_anticausal_mask()
    window = create_block_mask(and_masks(causal, generate_window_mask(512)), 1, 1, 2048, 2048)
    # 128-blocks: the 16 diagonal blocks and the 12 four blocks below (q - kv from 385 to 639)
    # are partial; the 15 + 14 + 13 one to three blocks below are full
    assert window.kv_num_blocks.sum() == 16 + 12 == 28
    assert window.full_kv_num_blocks.sum() == 15 + 14 + 13
    assert window.sparsity() == 100 * (256 - 28 - 42) / 256
    nothing = create_block_mask(and_masks(causal, anti), 1, 1, 2048, 2048)
    assert nothing.kv_num_blocks.sum() == 0 and nothing.full_kv_num_blocks.sum() == 0
    assert nothing.sparsity() == 100.0
    everything = create_block_mask(or_masks(causal, anti), 1, 1, 2048, 2048)
    noop = create_block_mask(generate_noop_mask(), 1, 1, 2048, 2048)
    assert everything.sparsity() == noop.sparsity() == 0.0
    np.testing.assert_array_equal(everything.full_kv_num_blocks, np.full((1, 1, 16), 16))


@pytest.mark.parametrize("BLOCK_SIZE", [32, 64, 128, 256, (32, 64), (64, 32)])
def test_block_size_changes(BLOCK_SIZE):
    mask = create_block_mask(generate_noop_mask(), 4, 2, 2048, 2048, BLOCK_SIZE=BLOCK_SIZE)
    q_block, kv_block = BLOCK_SIZE if isinstance(BLOCK_SIZE, tuple) else (BLOCK_SIZE,) * 2
    assert mask.BLOCK_SIZE == (q_block, kv_block)
    assert mask.shape == (4, 2, 2048, 2048)
    n_q, n_kv = 2048 // q_block, 2048 // kv_block
    np.testing.assert_array_equal(mask.full_kv_num_blocks, np.full((4, 2, n_q), n_kv))
    np.testing.assert_array_equal(mask.kv_num_blocks, np.zeros((4, 2, n_q)))
    assert mask.sparsity() == 0.0


SEQ_127 = np.arange(512) // 127  # PyTorch's test_compiling_create_block_mask


def test_causal_documents_of_127_in_blocks_of_128():
    seq = SEQ_127
    mask = create_block_mask(
        lambda b, h, q, kv: (q >= kv) & (seq[q] == seq[kv]), 1, 1, 512, 512
    )  # fmt: skip
    # Documents start at 127, 254, 381, 508. Diagonal blocks: partial (causal). Block (m, m-1):
    # query 128 m and key 128 m - 1 share a document, query 128 m and key 128 (m - 1) do not:
    # partial. Two blocks below the diagonal, no document spans both: empty.
    want = np.tri(4, dtype=int) - np.tri(4, k=-2, dtype=int)
    np.testing.assert_array_equal(mask.kinds[0, 0], want)
    np.testing.assert_array_equal(mask.kv_num_blocks[0, 0], [1, 2, 2, 2])
    np.testing.assert_array_equal(mask.full_kv_num_blocks[0, 0], [0, 0, 0, 0])
    assert mask.kv_indices.shape == (1, 1, 4, 4)
    assert mask.sparsity() == 100 * 9 / 16


def generate_documents_of_127(ops=NUMPY):
    seq = ops.asarray(SEQ_127)
    return named("documents_of_127", lambda b, h, q, kv: (q >= kv) & (seq[q] == seq[kv]))


# (generator(ops) -> mask_mod, B) at 512 x 512 in blocks of 64
TABLE_MASKS = {
    "causal": (generate_causal_mask, None),
    "sliding_window": (lambda ops: generate_sliding_window(100, ops), None),
    "prefix_lm": (lambda ops: generate_prefix_lm(200, ops), None),
    "document": (lambda ops: generate_document_mask([100, 300, 112], ops), None),
    "documents_of_127": (generate_documents_of_127, None),
    "causal_offset": (lambda ops: generate_causal_offset([0, 1, 3], 64, ops), 3),
}


@pytest.mark.torch
@pytest.mark.parametrize("name", list(TABLE_MASKS))
def test_block_tables_match_torch(torch, name):
    # divisible lengths, where PyTorch's padding plays no part: the same tables
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    generate, B = TABLE_MASKS[name]
    ours = create_block_mask(generate(NUMPY), B, None, 512, 512, BLOCK_SIZE=64)
    theirs = torch_block_mask(
        generate(torch_ops(torch)), B, None, 512, 512, device="cpu", BLOCK_SIZE=64
    )
    assert ours.sparsity() == pytest.approx(theirs.sparsity(), abs=1e-12)
    np.testing.assert_array_equal(ours.to_dense(), theirs.to_dense().numpy() > 0)
    for nums, indices in (
        ("kv_num_blocks", "kv_indices"),
        ("full_kv_num_blocks", "full_kv_indices"),
    ):
        n, ours_i = getattr(ours, nums), getattr(ours, indices)
        theirs_n, theirs_i = getattr(theirs, nums).numpy(), getattr(theirs, indices).numpy()
        np.testing.assert_array_equal(n, theirs_n, err_msg=nums)
        for b, h, m in np.ndindex(n.shape):  # the first n entries are the meaningful ones
            used = slice(0, n[b, h, m])
            np.testing.assert_array_equal(ours_i[b, h, m, used], theirs_i[b, h, m, used])


# ---------------------------------------------------------------------------------------------
# Lengths that are not multiples of the block, and fully masked rows
# ---------------------------------------------------------------------------------------------

SEQ_1023 = np.arange(1023) // 128  # PyTorch's test_block_mask_non_divisible


def generate_documents_of_128(ops=NUMPY):
    seq = ops.asarray(SEQ_1023)
    return named("documents_of_128", lambda b, h, q, kv: seq[q] == seq[kv])


@pytest.mark.torch
def test_documents_over_1023_positions(torch, rng):
    mask = create_block_mask(generate_documents_of_128(), None, None, 1023, 1023)
    # document m is block m exactly: the 8 diagonal blocks full (the last one 127 x 127, which
    # sdpa counts as full; PyTorch pads it and calls it partial), the other 56 empty
    np.testing.assert_array_equal(mask.kinds[0, 0], 2 * np.eye(8, dtype=int))
    assert mask.sparsity() == 100 * 56 / 64
    q, k, v = (rng.standard_normal((1, 2, 1023, 8)) for _ in range(3))
    # the float64 formula with the mask written out
    allowed = SEQ_1023[:, None] == SEQ_1023[None, :]
    scores = np.where(allowed, q @ k.swapaxes(-1, -2) / math.sqrt(8), -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - top)
    want_out = weights @ v / weights.sum(axis=-1, keepdims=True)
    want_lse = top[..., 0] + np.log(weights.sum(axis=-1))
    t_out, t_lse, t_mask = torch_flex(
        torch, q, k, v, None, generate_documents_of_128(torch_ops(torch)), None, None, 128, False
    )
    np.testing.assert_array_equal(mask.to_dense(), t_mask.to_dense().numpy() > 0)
    np.testing.assert_array_equal(t_mask.kv_num_blocks.numpy()[0, 0], [0] * 7 + [1])
    for implementation in PATHS:
        out, lse = flex_attention(
            q, k, v, block_mask=mask, return_lse=True, implementation=implementation
        )
        np.testing.assert_allclose(out, want_out, err_msg=implementation, **TOL)
        np.testing.assert_allclose(lse, want_lse, err_msg=implementation, **TOL)
        np.testing.assert_allclose(out, t_out, err_msg=implementation, **TOL)
        np.testing.assert_allclose(lse, t_lse, err_msg=implementation, **TOL)


@pytest.mark.torch
@pytest.mark.parametrize("implementation", PATHS)
def test_fully_masked_rows_are_exactly_zero_with_lse_minus_inf(torch, rng, implementation):
    # PyTorch's test_fully_masked_out_rows_0_check: queries from M on attend nothing
    B, H, T, M = 2, 3, 37, 18
    q, k, v = (rng.standard_normal((B, H, T, 8)) for _ in range(3))
    mask = create_block_mask(generate_first_rows_mask(M), B, None, T, T, BLOCK_SIZE=16)
    out, lse = flex_attention(
        q, k, v, block_mask=mask, return_lse=True, implementation=implementation
    )
    np.testing.assert_array_equal(out[:, :, M:], 0.0)
    np.testing.assert_array_equal(lse[:, :, M:], -np.inf)
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, :M]).all()
    t_out, t_lse, _ = torch_flex(
        torch, q, k, v, None, generate_first_rows_mask(M, torch_ops(torch)), B, None, 16, False
    )
    np.testing.assert_array_equal(t_out[:, :, M:], 0.0)
    np.testing.assert_array_equal(t_lse[:, :, M:], -np.inf)
    np.testing.assert_allclose(out, t_out, **TOL)
    np.testing.assert_allclose(lse[:, :, :M], t_lse[:, :, :M], **TOL)
