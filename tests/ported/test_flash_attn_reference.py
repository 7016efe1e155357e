"""FlashAttention's reference grid, ported anew in NumPy.

Follows Dao-AILab/flash-attention: ``tests/cute/test_flash_attn.py`` (``test_flash_attn_output``
and its backward part, ``test_flash_attn_varlen_output``) and the reference formula
``attention_ref`` / ``construct_local_mask`` of ``flash_attn/cute/testing.py`` (the same as in
``hopper/test_util.py``). Written anew here; nothing is copied.

Kept:

* the reference formula: scores scaled by ``1/sqrt(D)``, soft-capping ``cap * tanh(s / cap)``,
  causal and local windows ``(left, right)`` aligned bottom-right (the last query on the last
  key), ``sink_token_length`` keys that every window keeps on its left, a learnable per-head sink
  logit in the denominator, GQA/MQA by repeating key heads, query/key padding aligned per
  sequence (FA's varlen), rows with no allowed key giving 0;
* the grid: head widths 64, 96, 128, 192, 256 (value width 128 for 192 and 64 or 128 for 128),
  the odd length pairs of the upstream list, MHA/GQA/MQA with 6 query heads (3 or 1 key heads),
  causal, the four local kinds (none, a random ``(left, right)``, ``(None, -right)`` and
  ``(-left, None)``, the last two negative windows), soft-cap 0 or 15 (queries scaled by
  ``cap / 4`` so that the cap bites), learnable sink on or off;
* the tolerance: sdpa's largest error against the high-precision reference may be at most
  ``rtol`` (2, or 3 with soft-capping) times the largest error of the same formula computed
  naively in the inputs' dtype with the scale moved onto the keys (upstream's ``upcast=False,
  reorder_ops=True``), plus twice the rounding of the reference's values in the inputs' dtype
  (``|x + 0.3 - 0.3 - x|``); for gradients, plus ``3e-4`` with soft-capping. Without a
  soft-cap, that naive formula is also computed in base 2, the way FlashAttention's kernels and
  sdpa's tiled paths compute it (``exp2`` of scores whose scale holds ``log2(e)``, FA's
  ``softmax_scale_log2``), and the larger of the two naive errors sets the bound: in float32
  the base-2 formula's own error is up to about three times the base-e one's (the queries'
  rounding after the scale by ``log2(e)``), which upstream never sees, its kernels being
  tested in bf16 and fp16, whose rounding hides it.

Changed:

* dtypes: float32 (the high-precision reference in float64) and float64 (the reference in
  ``np.longdouble``); bf16, fp16 and fp8 are GPU-side and not ported. Dropout is off, as
  upstream's forward grid has it. No ``qv``, descales, attention chunks, split-KV or
  ``pack_gqa`` (kernel options sdpa does not have);
* layout ``(B, H, T, D)`` (sdpa's and PyTorch's) instead of FA's ``(B, T, H, D)``;
* the grid is trimmed to run in under a minute on two shared cores: lengths of 2048 and above
  are dropped, (1023, 1024) runs once per test, batches hold 2 sequences (1 for the longer
  ones and in float64) instead of 9, and the options are not crossed in full: each length pair
  takes every mask kind, and the head width, head layout, soft-cap, sink tokens, learnable
  sink and dtype cycle through the cases (the ids say which);
* the features are reached through sdpa's public API: ``scaled_dot_product_attention`` (with
  ``is_causal``, ``window``, ``causal_alignment="bottom_right"``, ``sinks``, ``enable_gqa``,
  each ``implementation``) for causal, non-negative windows, learnable sinks and GQA.
  What it has no argument for goes through ``flex_attention``: soft-capping as a ``score_mod``,
  negative windows and sink tokens as a ``mask_mod`` of ``create_block_mask`` (sdpa's ``window``
  takes non-negative sides only), a learnable sink in flex as one more key with value 0 whose
  score the ``score_mod`` sets to the sink, per-sequence lengths as a ``mask_mod`` reading
  them. Varlen is also checked on ``scaled_dot_product_attention`` by calling it on each
  unpadded sequence, FA's own definition of varlen;
* the backward pass (``scaled_dot_product_attention_backward``; sdpa has no flex backward, so
  no soft-capping there) is compared with ``torch.autograd`` on the reference formula written
  in PyTorch, in float64, the low-precision reference being the same in float32, as upstream
  compares with autograd of ``attention_ref`` (upstream's rule, causal or local cases with more
  queries than keys are left out); the learnable sink's gradient by the same rule as dq, dk
  and dv (upstream allows it 2 ulp more per entry). float64 gradients, which upstream does not have, are
  checked against central differences of the longdouble reference along random directions.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import sdpa

IMPLEMENTATIONS = ["reference", "tiled", "auto"]
# Upstream's (seqlen_q, seqlen_k) list, without 2048 and above.
SEQLENS = [
    (1, 1),
    (3, 3),
    (64, 32),
    (64, 128),
    (64, 1),
    (128, 128),
    (128, 192),
    (256, 256),
    (255, 256),
    (239, 1),
    (799, 3),
    (113, 203),
    (113, 128),
    (128, 217),
    (113, 211),
    (108, 256),
    (256, 512),
    (384, 256),
    (640, 128),
    (512, 256),
    (1023, 1024),
]
HEAD_DIMS = [64, 96, 128, 192, 256]
HEAD_LAYOUTS = {"mha": 6, "gqa": 3, "mqa": 1}  # key heads for 6 query heads
HQ = 6


def value_dim(d: int, n: int) -> int:
    """Upstream's value widths: 128 for d = 192, 64 or d for d = 128, else d."""
    if d == 192:
        return 128
    if d == 128:
        return 64 if n % 2 else 128
    return d


def batch_size(T: int, S: int, dtype=np.float32) -> int:
    return 2 if T * S <= 10_000 and dtype == np.float32 else 1


def pick_dtype(n: int, every: int, T: int, S: int, d: int, dv: int) -> type:
    """Every ``every``-th case in float64, if small: its reference runs in slow longdouble."""
    small = HQ * T * S * (d + dv) <= 16_000_000  # one batch entry in float64
    return np.float64 if n % every == every - 1 and small else np.float32


# The largest pair runs once per test, with one mask kind: its cases take seconds each.
LARGEST = (1023, 1024)


# ---------------------------------------------------------------------------------------------
# The reference formula, in any NumPy float dtype


def fa_local_mask(T, S, window, sink_token_length=0, q_lens=None, k_lens=None):
    """FA's local mask, True = masked out, of shape (B, 1, T, S), or (T, S) without lengths.

    Query ``i`` of a sequence of ``sq`` queries and ``sk`` keys sees key ``j`` when
    ``i + sk - sq - left <= j <= i + sk - sq + right`` (bottom-right alignment); keys below
    ``sink_token_length`` are kept on the left side. A None side is unbounded.
    """
    left, right = window
    i = np.arange(T)[:, None]  # (T, 1)
    j = np.arange(S)[None, :]  # (1, S)
    if q_lens is not None:
        sq = np.asarray(q_lens)[:, None, None, None]  # (B, 1, 1, 1)
        sk = np.asarray(k_lens)[:, None, None, None]
    else:
        sq, sk = T, S
    diag = i + sk - sq  # the key aligned with query i
    if left is None and right is None:
        return np.zeros(np.broadcast_shapes(np.shape(diag), j.shape), dtype=bool)
    if left is None:
        return np.broadcast_to(j > diag + right, np.broadcast_shapes(np.shape(diag), j.shape))
    beyond_right = j > sk if right is None else j > np.minimum(diag + right, sk)
    beyond_left = (j < diag - left) & (j >= sink_token_length)
    return beyond_right | beyond_left


def attention_ref(
    q,
    k,
    v,
    *,
    dtype=np.float64,
    causal=False,
    window=(None, None),
    sink_token_length=0,
    learnable_sink=None,
    softcap=0.0,
    q_lens=None,
    k_lens=None,
    reorder_ops=False,
    base2=False,
):
    """Out ``(B, Hq, T, Dv)`` and lse ``(B, Hq, T)`` by the formula, computed in ``dtype``.

    ``reorder_ops`` puts the scale on the keys instead of the queries (upstream's way to make
    a second, differently rounded reference); ``base2`` computes ``exp2`` of the scores scaled
    by ``log2(e) / sqrt(D)`` (on the queries), the lse converted back to base e.
    """
    q, k, v = (np.asarray(x).astype(dtype) for x in (q, k, v))
    B, Hq, T, D = q.shape
    S = k.shape[2]
    k = np.repeat(k, Hq // k.shape[1], axis=1)  # (B, Hkv, S, D) -> (B, Hq, S, D)
    v = np.repeat(v, Hq // v.shape[1], axis=1)
    scale = np.asarray((math.log2(math.e) if base2 else 1.0) / math.sqrt(D), dtype)
    exp, log = (np.exp2, np.log2) if base2 else (np.exp, np.log)
    if reorder_ops and not base2:
        scores = q @ np.swapaxes(k * scale, -1, -2)  # (B, Hq, T, D) @ (B, Hq, D, S)
    else:
        scores = (q * scale) @ np.swapaxes(k, -1, -2)
    if softcap > 0:
        cap = np.asarray(softcap, dtype)
        scores = np.tanh(scores / cap) * cap
    if causal:
        window = (window[0], 0)
    masked = np.zeros((T, S), dtype=bool)
    if q_lens is not None:
        j, i = np.arange(S), np.arange(T)
        k_pad = j[None, :] >= np.asarray(k_lens)[:, None]  # (B, S)
        masked = masked | k_pad[:, None, None, :]
    if window != (None, None):
        masked = masked | fa_local_mask(T, S, window, sink_token_length, q_lens, k_lens)
    scores = np.where(masked, -np.inf, scores)
    m = scores.max(axis=-1)  # (B, Hq, T), -inf in a row with no allowed key
    if learnable_sink is not None:
        sink = np.asarray(learnable_sink).astype(dtype)[:, None]  # (Hq, 1)
        if base2:
            sink = sink * dtype(math.log2(math.e))
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0).astype(dtype)
    p = exp(scores - m[..., None])
    total = p.sum(axis=-1)
    if learnable_sink is not None:
        total = total + exp(sink - m)
    with np.errstate(divide="ignore"):
        lse = (log(total) + m) * (dtype(math.log(2)) if base2 else 1)
    out = (p / np.where(total > 0, total, 1)[..., None]) @ v  # (B, Hq, T, S) @ (B, Hq, S, Dv)
    if q_lens is not None:
        q_pad = i[None, :] >= np.asarray(q_lens)[:, None]  # (B, T)
        out = np.where(q_pad[:, None, :, None], 0, out)
    return out.astype(dtype), lse.astype(dtype)


def reference_error(got, ref):
    """Largest |got - ref| in the wider dtype of the two; -inf == -inf counts as 0."""
    wide = np.promote_types(np.asarray(got).dtype, np.asarray(ref).dtype)
    got, ref = np.asarray(got, wide), np.asarray(ref, wide)
    same = (got == ref) | (np.isneginf(got) & np.isneginf(ref))
    with np.errstate(invalid="ignore"):  # -inf - -inf: those entries are `same`
        diff = np.where(same, 0, np.abs(got - ref))
    return float(np.max(diff, initial=0.0)), np.unravel_index(np.argmax(diff), diff.shape)


def assert_like_reference(name, got, ref, low, dtype, *, rtol=2.0, extra_atol=0.0):
    """Upstream's rule: err(got) <= rtol * err(low) + 2 * rounding of ref in dtype (+ extra);
    ``low`` one naive result or a tuple of them (base e and base 2: the larger error counts)."""
    assert np.asarray(got).dtype == dtype, f"{name}: dtype {np.asarray(got).dtype}, not {dtype}"
    finite = np.where(np.isfinite(ref), ref, 0).astype(dtype)
    with np.errstate(over="ignore"):
        rounding = np.abs(finite + dtype(0.3) - dtype(0.3) - finite)
    atol = 2 * float(np.max(rounding, initial=0.0)) + extra_atol
    err, where = reference_error(got, ref)
    lows = low if isinstance(low, tuple) else (low,)
    low_err = max(reference_error(one, ref)[0] for one in lows)
    assert err <= rtol * low_err + atol, (
        f"{name}: max error {err:.3g} at {where} (got {np.asarray(got)[where]!r}, reference "
        f"{np.asarray(ref)[where]!r}) exceeds {rtol} x the naive {dtype.__name__} formula's "
        f"{low_err:.3g} + atol {atol:.3g}"
    )


HIGH = {np.float32: np.float64, np.float64: np.longdouble}


def make_qkv(rng, B, T, S, d, dv, hkv, dtype, softcap=0.0):
    """Upstream's inputs: standard normal, queries scaled by cap / 4 under soft-capping."""
    q = rng.standard_normal((B, HQ, T, d))
    if softcap > 0:
        q = q * softcap / 4
    k = rng.standard_normal((B, hkv, S, d))
    v = rng.standard_normal((B, hkv, S, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def random_window(rng, S, kind):
    """Upstream's local kinds: 1 a random (left, right) in [0, S), 2 (None, -right),
    3 (-left, None); 0 no window."""
    left, right = (int(x) for x in rng.integers(0, S, size=2))
    return {0: (None, None), 1: (left, right), 2: (None, -right), 3: (-left, None)}[kind]


def references(q, k, v, dtype, **options):
    """The high-precision reference and the naive ones in ``dtype`` (base e, and base 2 without
    a soft-cap): ``((out, lse), (outs, lses))``, the naive ones as tuples."""
    high = attention_ref(q, k, v, dtype=HIGH[dtype], **options)
    bases = (False,) if options.get("softcap", 0.0) > 0 else (False, True)
    lows = [
        attention_ref(q, k, v, dtype=dtype, reorder_ops=True, base2=b, **options) for b in bases
    ]
    return high, tuple(zip(*lows))


def check_against_reference(name, got, got_lse, refs, dtype, softcap=0.0):
    (ref, ref_lse), (low, low_lse) = refs
    rtol = 3.0 if softcap > 0 else 2.0
    assert_like_reference(f"{name} out", got, ref, low, dtype, rtol=rtol)
    assert_like_reference(f"{name} lse", got_lse, ref_lse, low_lse, dtype, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention: causal, non-negative windows, learnable sinks, GQA/MQA


def sdpa_cases():
    """Each length pair with no mask, causal and a local window; the rest cycles."""
    cases = []
    kinds = ["none", "causal", "local"]
    pairs = [(T, S, kind) for (T, S), kind in itertools.product(SEQLENS, kinds)]
    pairs = [p for p in pairs if p[:2] != LARGEST or p[2] == "causal"]
    for n, (T, S, kind) in enumerate(pairs):
        d = HEAD_DIMS[n % len(HEAD_DIMS)]
        layout = list(HEAD_LAYOUTS)[(n // 3) % 3]
        sink = (n // 2) % 2 == 1
        dtype = pick_dtype(n, 7, T, S, d, value_dim(d, n))
        case_id = f"{T}x{S}-{kind}-d{d}-{layout}-{'sink' if sink else 'nosink'}-{dtype.__name__}"
        cases.append(pytest.param(T, S, kind, d, value_dim(d, n), layout, sink, dtype, id=case_id))
    return cases


@pytest.mark.parametrize("T, S, kind, d, dv, layout, sink, dtype", sdpa_cases())
def test_sdpa_output(T, S, kind, d, dv, layout, sink, dtype):
    rng = np.random.default_rng([T, S, d, dv])
    B, hkv = batch_size(T, S, dtype), HEAD_LAYOUTS[layout]
    q, k, v = make_qkv(rng, B, T, S, d, dv, hkv, dtype)
    window = random_window(rng, S, 1 if kind == "local" else 0)
    learnable_sink = rng.standard_normal(HQ).astype(dtype) if sink else None
    options = dict(causal=kind == "causal", window=window, learnable_sink=learnable_sink)
    call = dict(
        is_causal=kind == "causal",
        causal_alignment="bottom_right",
        window=window if kind == "local" else None,
        sinks=None if learnable_sink is None else learnable_sink[:, None],  # (Hq, 1)
        enable_gqa=hkv != HQ,
        return_lse=True,
    )
    refs = references(q, k, v, dtype, **options)
    for implementation in IMPLEMENTATIONS:
        out, lse = sdpa.scaled_dot_product_attention(q, k, v, **call, implementation=implementation)
        check_against_reference(implementation, out, lse, refs, dtype)


# ---------------------------------------------------------------------------------------------
# flex_attention: soft-capping, the four local kinds, sink tokens, learnable sinks


def fa_mask_mod(T, S, causal, window, sink_token_length, q_lens=None, k_lens=None):
    """FA's allowed entries as a mask_mod, written from the rule (not from fa_local_mask)."""
    left, right = (window[0], 0) if causal else window

    def mask_mod(b, h, q_idx, kv_idx):
        sq = T if q_lens is None else q_lens[b]
        sk = S if k_lens is None else k_lens[b]
        diag = q_idx + sk - sq
        ok = (kv_idx < sk) & (q_idx < sq)
        if right is not None:
            ok = ok & (kv_idx <= diag + right)
        if left is not None:
            ok = ok & ((kv_idx >= diag - left) | (kv_idx < sink_token_length))
        return ok

    return mask_mod


def flex_call(
    q,
    k,
    v,
    *,
    causal,
    window,
    sink_token_length,
    softcap,
    learnable_sink,
    impl,
    q_lens=None,
    k_lens=None,
):
    """Out and lse of flex_attention for FA's options; a learnable sink is key S, value 0."""
    B, _, T, _ = q.shape
    S = k.shape[2]
    rule = fa_mask_mod(T, S, causal, window, sink_token_length, q_lens, k_lens)
    if learnable_sink is not None:
        zero_key = np.zeros(k.shape[:2] + (1,) + k.shape[3:], k.dtype)
        k = np.concatenate([k, zero_key], axis=2)
        v = np.concatenate([v, np.zeros(v.shape[:2] + (1,) + v.shape[3:], v.dtype)], axis=2)

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx, kv_idx) | (kv_idx == S)  # the sink's key: every row

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap > 0:
            score = softcap * np.tanh(score / softcap)
        if learnable_sink is not None:
            score = np.where(kv_idx == S, learnable_sink[h], score)
        return score

    per_batch = q_lens is not None
    block_mask = sdpa.create_block_mask(
        mask_mod, B if per_batch else None, None, T, k.shape[2], BLOCK_SIZE=32
    )
    return sdpa.flex_attention(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        enable_gqa=k.shape[1] != q.shape[1],
        return_lse=True,
        implementation=impl,
    )


FLEX_SEQLENS = [(1, 1), (3, 3), (64, 32), (64, 1), (239, 1), (113, 203), (128, 217), (108, 256),
                (384, 256), (640, 128), (1023, 1024)]  # fmt: skip


def flex_cases():
    """Each length pair with causal and the four local kinds; soft-cap, sink tokens, learnable
    sink, head width and layout cycle."""
    cases = []
    kinds = ["local0", "causal", "local1", "local2", "local3"]
    pairs = [(T, S, kind) for (T, S), kind in itertools.product(FLEX_SEQLENS, kinds)]
    pairs = [p for p in pairs if p[:2] != LARGEST or p[2] == "local1"]
    for n, (T, S, kind) in enumerate(pairs):
        d = HEAD_DIMS[(n + n // 5) % len(HEAD_DIMS)]  # shifted per pair: not tied to kind
        layout = list(HEAD_LAYOUTS)[(n // 2) % 3]
        softcap = 15.0 if n % 2 else 0.0
        sink = (n // 3) % 2 == 1
        sink_tokens = [0, 1, 4][(n // 4) % 3] if kind in ("local1", "local3") else 0
        dtype = pick_dtype(n, 3, T, S, d, value_dim(d, n))
        case_id = (
            f"{T}x{S}-{kind}-d{d}-{layout}-cap{softcap:g}-sinktok{sink_tokens}-"
            f"{'sink' if sink else 'nosink'}-{dtype.__name__}"
        )
        cases.append(
            pytest.param(T, S, kind, d, value_dim(d, n), layout, softcap, sink_tokens, sink,
                         dtype, id=case_id)
        )  # fmt: skip
    return cases


@pytest.mark.parametrize(
    "T, S, kind, d, dv, layout, softcap, sink_tokens, sink, dtype", flex_cases()
)
def test_flex_output(T, S, kind, d, dv, layout, softcap, sink_tokens, sink, dtype):
    rng = np.random.default_rng([T, S, d, dv, 1])
    B, hkv = batch_size(T, S, dtype), HEAD_LAYOUTS[layout]
    q, k, v = make_qkv(rng, B, T, S, d, dv, hkv, dtype, softcap)
    local_kind = 0 if kind == "causal" else int(kind[-1])
    window = random_window(rng, S, local_kind)
    learnable_sink = rng.standard_normal(HQ).astype(dtype) if sink else None
    options = dict(
        causal=kind == "causal",
        window=window,
        sink_token_length=sink_tokens,
        learnable_sink=learnable_sink,
        softcap=softcap,
    )
    refs = references(q, k, v, dtype, **options)
    for implementation in IMPLEMENTATIONS:
        out, lse = flex_call(q, k, v, **options, impl=implementation)
        check_against_reference(f"flex {implementation}", out, lse, refs, dtype, softcap)


# ---------------------------------------------------------------------------------------------
# Varlen: per-sequence lengths, bottom-right alignment per sequence


VARLEN_CASES = [
    # T, S, kind, window, sink tokens, layout
    (113, 203, "causal", (None, None), 0, "gqa"),
    (128, 217, "local", (40, 7), 0, "mha"),
    (108, 256, "local", (17, 0), 3, "mqa"),
    (64, 128, "none", (None, None), 0, "gqa"),
    (239, 64, "local", (100, 30), 0, "mha"),
]


def random_lengths(rng, B, n):
    """Upstream's 'random' padding: lengths in [max(1, n - 20), n]."""
    return rng.integers(max(1, n - 20), n + 1, size=B)


@pytest.mark.parametrize("T, S, kind, window, sink_tokens, layout", VARLEN_CASES)
def test_varlen_output(T, S, kind, window, sink_tokens, layout):
    dtype = np.float32
    rng = np.random.default_rng([T, S, 2])
    B, hkv, d = 3, HEAD_LAYOUTS[layout], 64
    q, k, v = make_qkv(rng, B, T, S, d, d, hkv, dtype)
    q_lens, k_lens = random_lengths(rng, B, T), random_lengths(rng, B, S)
    learnable_sink = rng.standard_normal(HQ).astype(dtype)
    options = dict(
        causal=kind == "causal",
        window=window,
        sink_token_length=sink_tokens,
        learnable_sink=learnable_sink,
        q_lens=q_lens,
        k_lens=k_lens,
    )
    (ref, ref_lse), (low, low_lse) = references(q, k, v, dtype, **options)
    real = np.arange(T)[None, :] < q_lens[:, None]  # (B, T): padded rows have out 0, any lse
    for implementation in IMPLEMENTATIONS:
        out, lse = flex_call(q, k, v, **options, softcap=0.0, impl=implementation)
        name = f"varlen flex {implementation}"
        assert_like_reference(f"{name} out", out, ref, low, dtype)
        sel = np.broadcast_to(real[:, None, :], lse.shape)
        low_sel = tuple(one[sel] for one in low_lse)
        assert_like_reference(f"{name} lse", lse[sel], ref_lse[sel], low_sel, dtype)
    if sink_tokens:
        return  # sdpa's window has no sink tokens: flex only
    # scaled_dot_product_attention on each unpadded sequence, FA's definition of varlen
    for implementation in IMPLEMENTATIONS:
        out = np.zeros_like(ref, dtype=dtype)
        for b in range(B):
            lq, lk = q_lens[b], k_lens[b]
            out[b, :, :lq] = sdpa.scaled_dot_product_attention(
                q[b, :, :lq],
                k[b, :, :lk],
                v[b, :, :lk],
                is_causal=kind == "causal",
                causal_alignment="bottom_right",
                window=window if kind == "local" else None,
                sinks=learnable_sink[:, None],
                enable_gqa=hkv != HQ,
                implementation=implementation,
            )
        assert_like_reference(f"varlen sdpa {implementation} out", out, ref, low, dtype)


# ---------------------------------------------------------------------------------------------
# Backward: dq, dk, dv (and the sink's gradient) against torch.autograd of the formula


def attention_ref_torch(
    torch, q, k, v, *, causal, window, learnable_sink, reorder_ops, base2=False
):
    """The reference formula in PyTorch, for autograd (same rules as attention_ref)."""
    Hq, T, D = q.shape[1], q.shape[2], q.shape[3]
    S = k.shape[2]
    k = k.repeat_interleave(Hq // k.shape[1], dim=1)
    v = v.repeat_interleave(Hq // v.shape[1], dim=1)
    scale = (math.log2(math.e) if base2 else 1.0) / math.sqrt(D)
    if reorder_ops and not base2:
        scores = q @ (k * scale).transpose(-1, -2)
    else:
        scores = (q * scale) @ k.transpose(-1, -2)
    if causal:
        window = (window[0], 0)
    if window != (None, None):
        masked = torch.tensor(fa_local_mask(T, S, window))  # a copy: the mask may be a view
        scores = scores.masked_fill(masked, -math.inf)
    if learnable_sink is not None:  # one more column, dropped after the softmax
        sink = learnable_sink * math.log2(math.e) if base2 else learnable_sink
        column = sink[:, None, None].expand(*scores.shape[:-1], 1)
        weights = _softmax(torch, torch.cat([scores, column], dim=-1), base2)[..., :-1]
    else:
        weights = _softmax(torch, scores, base2)
    return weights @ v


def _softmax(torch, scores, base2):
    """torch.softmax, or its base-2 form ``exp2(s - m) / sum`` (FA's kernels' exponential)."""
    if not base2:
        return torch.softmax(scores, dim=-1)
    p = torch.exp2(scores - scores.amax(dim=-1, keepdim=True))
    return p / p.sum(dim=-1, keepdim=True)


def sdpa_backward(d_out, q, k, v, kind, window, sinks, implementation):
    """sdpa's dq, dk, dv (and the sink's gradient, ``(Hq, 1)``) for one case of the grid."""
    return sdpa.scaled_dot_product_attention_backward(
        d_out,
        q,
        k,
        v,
        is_causal=kind == "causal",
        causal_alignment="bottom_right",
        window=window if kind == "local" else None,
        sinks=None if sinks is None else sinks[:, None],
        enable_gqa=k.shape[1] != q.shape[1],
        implementation=implementation,
    )


BACKWARD_CASES = [
    # T, S, kind, window, d, dv, layout, sink
    (113, 203, "causal", None, 64, 64, "mha", False),
    (128, 217, "local", (50, 20), 96, 96, "gqa", True),
    (108, 256, "local", (30, 0), 128, 64, "mqa", False),
    (64, 128, "none", None, 128, 128, "gqa", True),
    (128, 128, "causal", None, 64, 64, "mqa", True),
    (113, 211, "local", (None, 9), 64, 64, "mha", False),
    (3, 3, "causal", None, 64, 64, "gqa", False),
    (1, 239, "none", None, 96, 96, "mha", True),
]


@pytest.mark.torch
@pytest.mark.parametrize("T, S, kind, window, d, dv, layout, sink", BACKWARD_CASES)
def test_backward(torch, T, S, kind, window, d, dv, layout, sink):
    dtype = np.float32
    rng = np.random.default_rng([T, S, d, 3])
    B, hkv = 2, HEAD_LAYOUTS[layout]
    q, k, v = make_qkv(rng, B, T, S, d, dv, hkv, dtype)
    d_out = rng.standard_normal((B, HQ, T, dv)).astype(dtype)
    sinks = rng.standard_normal(HQ).astype(dtype) if sink else None
    local = window if kind == "local" else (None, None)

    def torch_grads(tdtype, reorder_ops, base2=False):
        leaves = [torch.tensor(x, dtype=tdtype, requires_grad=True) for x in (q, k, v)]
        if sink:
            leaves.append(torch.tensor(sinks, dtype=tdtype, requires_grad=True))
        out = attention_ref_torch(
            torch, *leaves[:3], causal=kind == "causal", window=local,
            learnable_sink=leaves[3] if sink else None, reorder_ops=reorder_ops, base2=base2,
        )  # fmt: skip
        grads = torch.autograd.grad(out, leaves, torch.tensor(d_out, dtype=tdtype))
        return [g.detach().numpy() for g in grads]

    refs = torch_grads(torch.float64, False)
    lows = list(zip(torch_grads(torch.float32, True), torch_grads(torch.float32, True, True)))
    for implementation in IMPLEMENTATIONS:
        grads = sdpa_backward(d_out, q, k, v, kind, window, sinks, implementation)
        names = ["dq", "dk", "dv", "dsink"]
        # The tiled backward, like FA's kernels, recomputes the weights as exp2(s - lse) from
        # its base-2 forward's lse: one more rounding than the naive formula's autograd has.
        # Measured at (108, 256), window (30, 0), MQA: dq 2.5 times the naive error, 1.1 times
        # when given the reference path's out and lse. Hence 3 there, upstream's 2 elsewhere.
        rtol = 2.0 if implementation == "reference" else 3.0
        for name, got, ref, low in zip(names, grads, refs, lows, strict=False):
            if name == "dsink":
                got = got[:, 0]  # (Hq, 1) -> (Hq,)
            assert_like_reference(f"{implementation} {name}", got, ref, low, dtype, rtol=rtol)


@pytest.mark.parametrize("T, S, kind, window, d, dv, layout, sink", BACKWARD_CASES[:4])
def test_backward_float64_directional(T, S, kind, window, d, dv, layout, sink):
    """float64 gradients without PyTorch: each input's gradient, dotted with a random direction,
    against central differences of ``sum(d_out * out)`` along it, on the longdouble reference
    (its rounding, ~1e-19, over the step 1e-6, leaves the step's ~1e-12 truncation)."""
    rng = np.random.default_rng([T, S, d, 4])
    B, hkv = 1, HEAD_LAYOUTS[layout]
    q, k, v = make_qkv(rng, B, T, S, d, dv, hkv, np.float64)
    d_out = rng.standard_normal((B, HQ, T, dv))
    sinks = rng.standard_normal(HQ) if sink else None
    local = window if kind == "local" else (None, None)
    inputs = [q, k, v] + ([sinks] if sink else [])

    def loss(*args):
        out, _ = attention_ref(
            *args[:3], dtype=np.longdouble, causal=kind == "causal", window=local,
            learnable_sink=args[3] if sink else None,
        )  # fmt: skip
        return np.sum(d_out * out)

    step = 1e-6
    directions = [rng.standard_normal(x.shape) for x in inputs]
    numeric = []  # the loss's derivative along each input's direction
    for n, direction in enumerate(directions):
        up = [x + step * direction if m == n else x for m, x in enumerate(inputs)]
        down = [x - step * direction if m == n else x for m, x in enumerate(inputs)]
        numeric.append(float((loss(*up) - loss(*down)) / (2 * step)))
    for implementation in ["reference", "tiled"]:
        grads = sdpa_backward(d_out, q, k, v, kind, window, sinks, implementation)
        for name, grad, direction, expected in zip(
            ["dq", "dk", "dv", "dsink"], grads, directions, numeric, strict=False
        ):
            analytic = float(np.sum(grad.reshape(direction.shape) * direction))
            np.testing.assert_allclose(
                analytic, expected, rtol=1e-8, atol=1e-9, err_msg=f"{implementation} {name}"
            )
