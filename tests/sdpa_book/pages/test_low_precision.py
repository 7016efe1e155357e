"""sdpa_book.pages.low_precision: FP8 / 16-bit rounding, scales, attention in low precision."""

from __future__ import annotations

import numpy as np
import pytest

import sdpa
from sdpa.nn import DecoderLM
from sdpa_book.pages.low_precision import (
    FORMATS,
    absmax_scales,
    fake_quantise,
    hadamard,
    low_precision_attention,
    random_hadamard,
    round_to_format,
    with_attention,
)

# (exponent bits, mantissa bits, bias, whether the top exponent is reserved for inf / nan)
LAYOUT = {"e4m3": (4, 3, 7, False), "e5m2": (5, 2, 15, True)}


def _all_codes(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every finite value of an FP8 format decoded from its 256 bit patterns, by the OCP rules
    (written here independently of the module), and whether each code is finite."""
    e_bits, m_bits, bias, ieee = LAYOUT[name]
    values, finite = [], []
    for code in range(256):
        sign = -1.0 if code >> 7 else 1.0
        exponent = (code >> m_bits) & ((1 << e_bits) - 1)
        mantissa = code & ((1 << m_bits) - 1)
        top = exponent == (1 << e_bits) - 1
        is_finite = not top if ieee else not (top and mantissa == (1 << m_bits) - 1)
        if exponent == 0:
            value = sign * mantissa / 2**m_bits * 2.0 ** (1 - bias)
        else:
            value = sign * (1 + mantissa / 2**m_bits) * 2.0 ** (exponent - bias)
        values.append(value if is_finite else np.nan)
        finite.append(is_finite)
    return np.array(values), np.array(finite)


def _nearest_even(x: float, grid: np.ndarray, m_bits: int, bias: int) -> float:
    """Round-to-nearest-even by search over the enumerated grid: the nearest value, and on a tie
    the one whose code has an even mantissa (its last bit zero)."""
    d = np.abs(grid - x)
    best = np.flatnonzero(d == d.min())
    if len(best) == 1:
        return float(grid[best[0]])
    # a tie: the two neighbours; the even one is an even multiple of its binade's step
    for i in best:
        g = abs(grid[i])
        e = max(np.floor(np.log2(g)), 1 - bias) if g > 0 else 1 - bias
        if (g / 2.0 ** (e - m_bits)) % 2 == 0:
            return float(grid[i])
    raise AssertionError("no even neighbour")


# ---------------------------------------------------------------------------------------------
# The grids


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_every_code_is_its_own_rounding(name):
    values, finite = _all_codes(name)
    grid = values[finite]
    np.testing.assert_array_equal(round_to_format(grid, name), grid)
    assert grid.max() == FORMATS[name].max
    assert grid[grid > 0].min() == FORMATS[name].min_subnormal
    # e4m3: 254 finite codes (2 NaN); e5m2: 248 (4 inf / nan patterns per sign)
    assert finite.sum() == (254 if name == "e4m3" else 248)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_rounding_matches_a_search_over_the_grid(name, rng):
    values, finite = _all_codes(name)
    grid = np.unique(values[finite])
    _, m_bits, bias, _ = LAYOUT[name]
    top = FORMATS[name].max
    # random numbers over the whole range, the midpoints between grid values (every tie),
    # and numbers a hair either side of them
    mids = (grid[:-1] + grid[1:]) / 2
    x = np.concatenate(
        [
            rng.uniform(-top, top, 300),
            np.exp(rng.uniform(-14, np.log(top), 300)) * rng.choice([-1, 1], 300),
            mids,
            np.nextafter(mids, np.inf),
            np.nextafter(mids, -np.inf),
        ]
    )
    expected = np.array([_nearest_even(v, grid, m_bits, bias) for v in x])
    np.testing.assert_array_equal(round_to_format(x, name), expected)


@pytest.mark.torch
@pytest.mark.parametrize("name", ["e4m3", "e5m2", "bf16"])
def test_matches_torch_casts_within_range(name, torch, rng):
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "bf16": torch.bfloat16}
    top = FORMATS[name].max
    # float32 inputs (torch converts float64 to these types through float32)
    x = (rng.standard_normal(50_000) * 10.0 ** rng.uniform(-8, 5, 50_000)).astype(np.float32)
    x = x[np.abs(x) <= top]
    ours = round_to_format(x, name)
    theirs = torch.from_numpy(x).to(dtype[name]).to(torch.float64).numpy()
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.torch
def test_overflow_against_torch(torch):
    # PyTorch 2.13's cast saturates to float8_e4m3fn and overflows to inf in float8_e5m2;
    # our saturate=True gives the former, saturate=False the latter
    x = np.array([440.0, 464.0, 465.0, 1e4, -1e4, 57344.0, 61439.0, 61440.0, 1e6])
    t = torch.from_numpy(x).to(torch.float32)
    e4 = t.to(torch.float8_e4m3fn).to(torch.float64).numpy()
    e5 = t.to(torch.float8_e5m2).to(torch.float64).numpy()
    np.testing.assert_array_equal(round_to_format(x, "e4m3"), e4)
    np.testing.assert_array_equal(round_to_format(x, "e5m2", saturate=False), e5)


def test_saturation_and_overflow_by_hand():
    # e4m3: 464 is the tie between 448 (mantissa 110) and 480 (not a value): to even, 448;
    # just above it rounds to 480, which saturates to 448 or becomes NaN
    x = np.array([464.0, 465.0, -1000.0, np.inf])
    np.testing.assert_array_equal(round_to_format(x, "e4m3"), [448.0, 448.0, -448.0, 448.0])
    out = round_to_format(x, "e4m3", saturate=False)
    assert out[0] == 448 and np.isnan(out[1:]).all()
    # e5m2: 61440 ties 57344 (mantissa 11, odd) with 65536 (even): up, to infinity
    y = np.array([61439.0, 61440.0, -1e9])
    np.testing.assert_array_equal(
        round_to_format(y, "e5m2", saturate=False), [57344, np.inf, -np.inf]
    )
    np.testing.assert_array_equal(round_to_format(y, "e5m2"), [57344, 57344, -57344])
    assert np.isnan(round_to_format(np.array([np.nan]), "e5m2")).all()


def test_fp16_matches_numpy(rng):
    x = rng.standard_normal(20_000) * 10.0 ** rng.uniform(-9, 4.8, 20_000)
    x = x[np.abs(x) < 65504]  # numpy's cast overflows to inf (with a warning) above
    np.testing.assert_array_equal(round_to_format(x, "fp16"), x.astype(np.float16).astype(float))


def test_subnormals_and_ties_by_hand():
    # e4m3: the smallest subnormal is 2**-9; half of it ties with 0 and goes to 0 (even)
    s = 2.0**-9
    x = np.array([s, s / 2, 0.75 * s, 1.5 * s, 2.5 * s, -0.0])
    np.testing.assert_array_equal(round_to_format(x, "e4m3"), [s, 0, s, 2 * s, 2 * s, 0])
    assert np.signbit(round_to_format(x, "e4m3")[-1])  # -0 stays -0


# ---------------------------------------------------------------------------------------------
# Scales and INT8


def test_int8_per_block_by_hand():
    # (T=3, D=2), blocks of 2 tokens: block 0's largest magnitude 31.75 = 127 / 4 gives the
    # scale 1/4, block 1's 63.5 the scale 1/2 (powers of two: the ties below are exact)
    x = np.array([[31.75, -0.125], [0.375, 10.0], [63.5, 0.75]])
    scale = absmax_scales(x, "int8", granularity=2).ravel()
    np.testing.assert_array_equal(scale, [0.25, 0.25, 0.5])
    codes = fake_quantise(x, "int8", granularity=2) / scale[:, None]
    # -0.125 / 0.25 = -0.5 -> -0; 0.375 / 0.25 = 1.5 -> 2; 0.75 / 0.5 = 1.5 -> 2 (to even)
    np.testing.assert_array_equal(codes, [[127, 0], [2, 40], [127, 2]])
    # symmetric: codes never reach -128
    assert fake_quantise(-x, "int8", granularity=2).min() / 0.5 == -127


def test_fp8_scales_per_tensor_and_head():
    x = np.zeros((1, 2, 3, 4))
    x[0, 0, 1, 2] = 896.0
    x[0, 1, 2, 0] = -44.8
    np.testing.assert_allclose(absmax_scales(x, "e4m3").ravel(), [2.0])
    np.testing.assert_allclose(absmax_scales(x, "e4m3", granularity="head").ravel(), [2.0, 0.1])
    back = fake_quantise(x, "e4m3", granularity="head")
    np.testing.assert_allclose(back, x, rtol=1e-7)  # the largest values land on 448 exactly
    # scale 1 (vLLM's default): 896 saturates to 448
    assert fake_quantise(x, "e4m3", scale=1.0).max() == 448


def test_fp8_relative_error_bound(rng):
    x = rng.standard_normal((2, 3, 64, 16)) * np.exp(rng.uniform(-3, 3, (2, 3, 64, 16)))
    for fmt, m_bits in (("e4m3", 3), ("e5m2", 2)):
        back = fake_quantise(x, fmt, granularity=16)
        scale = absmax_scales(x, fmt, granularity=16).astype(float)
        normal = np.abs(x / scale) >= FORMATS[fmt].min_normal
        rel = np.abs(back - x)[normal] / np.abs(x)[normal]
        assert rel.max() <= 2.0 ** -(m_bits + 1) * (1 + 1e-9)


def test_bad_inputs():
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="fmt"):
        round_to_format(x, "e3m4")
    with pytest.raises(TypeError, match="saturate"):
        round_to_format(x, "e4m3", saturate=1)
    with pytest.raises(TypeError, match="x must"):
        round_to_format(np.array(["a"]))
    with pytest.raises(ValueError, match="granularity"):
        absmax_scales(x, granularity=0)
    with pytest.raises(TypeError, match="granularity"):
        absmax_scales(x, granularity="row")
    with pytest.raises(ValueError, match="finite"):
        absmax_scales(np.array([[np.inf]]))
    with pytest.raises(ValueError, match="scale"):
        fake_quantise(x, scale=0.0)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(6)
    with pytest.raises(ValueError, match="qk"):
        low_precision_attention(x, x, x, qk="int4")


def test_inputs_not_mutated(rng):
    q, k, v = rng.standard_normal((3, 2, 8, 4))
    copies = [a.copy() for a in (q, k, v)]
    low_precision_attention(q, k, v, qk="int8", smooth_k=True, rotation=random_hadamard(4, rng))
    for a, b in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# The attention


def _softmax_attention(q, k, v, causal=False):
    """Float64 attention written out: a reference independent of the module."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        T, S = s.shape[-2:]
        s = np.where(np.arange(S) <= np.arange(T)[:, None] + S - T, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def test_hadamard_is_orthogonal_and_rotation_keeps_scores(rng):
    for n in (1, 2, 8, 64):
        h = hadamard(n)
        np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-14)
        np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(n))
    r = random_hadamard(16, rng)
    q, k = rng.standard_normal((2, 10, 16))
    np.testing.assert_allclose((q @ r) @ (k @ r).T, q @ k.T, atol=1e-12)


def test_smoothing_keeps_the_softmax(rng):
    q, k, v = rng.standard_normal((3, 2, 12, 8))
    k_offset = k + 5.0 * rng.standard_normal(8)  # a mean per channel
    smooth = k_offset - k_offset.mean(axis=-2, keepdims=True)
    np.testing.assert_allclose(
        _softmax_attention(q, smooth, v), _softmax_attention(q, k_offset, v), atol=1e-13
    )


def test_fp32_format_is_exact_attention(rng):
    q, k, v = rng.standard_normal((3, 2, 20, 8)).astype(np.float32)
    for causal in (False, True):
        out = low_precision_attention(q, k, v, qk="fp32", is_causal=causal)
        ref = _softmax_attention(q.astype(float), k.astype(float), v.astype(float), causal)
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)


def test_fp8_attention_against_a_loop(rng):
    # every operand rounded by its own per-block scale, written with explicit loops
    q, k, v = rng.standard_normal((3, 6, 4))
    bq, bk = 4, 2
    qr, kr, vr = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    for x, out, b in ((q, qr, bq), (k, kr, bk), (v, vr, bk)):
        for start in range(0, 6, b):
            block = x[start : start + b]
            s = np.float32(np.abs(block).max() / 448.0)
            out[start : start + b] = round_to_format(block / float(s), "e4m3") * float(s)
    s = qr @ kr.T / 2.0
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p_hat = round_to_format(p * 448.0, "e4m3") / 448.0
    expected = p_hat @ vr / p.sum(axis=1, keepdims=True)
    got = low_precision_attention(q, k, v, qk="e4m3", block_q=bq, block_k=bk)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)


def test_errors_order_with_precision(rng):
    q, k, v = rng.standard_normal((3, 2, 64, 32))
    ref = _softmax_attention(q, k, v)
    err = {
        f: np.linalg.norm(low_precision_attention(q, k, v, qk=f) - ref) / np.linalg.norm(ref)
        for f in ("fp16", "bf16", "int8", "e4m3", "e5m2")
    }
    assert err["fp16"] < err["bf16"] < err["int8"] < err["e4m3"] < err["e5m2"] < 0.2


def test_with_attention_reproduces_and_replaces_the_model(rng):
    model = DecoderLM(vocab_size=9, d_model=8, n_layers=2, n_heads=2, max_len=6, rng=rng)
    tokens = rng.integers(0, 9, size=(3, 6))
    seen = []

    def same(layer, q, k, v, mask):
        seen.append(layer)
        return sdpa.scaled_dot_product_attention(
            q, k, v, is_causal=True, implementation="reference"
        )

    np.testing.assert_array_equal(
        with_attention(model, same).forward(tokens), model.forward(tokens)
    )
    assert seen == [0, 1]

    def uniform(layer, q, k, v, mask):  # every allowed key the same weight
        w = mask / mask.sum(axis=1, keepdims=True)
        return w @ v

    assert not np.allclose(with_attention(model, uniform).forward(tokens), model.forward(tokens))
    np.testing.assert_array_equal(
        model.forward(tokens), with_attention(model, same).forward(tokens)
    )
    with pytest.raises(TypeError, match="attend"):
        with_attention(model, 3)
    with pytest.raises(TypeError, match="DecoderLM"):
        with_attention("model", same)
