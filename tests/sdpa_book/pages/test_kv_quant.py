"""sdpa_book.pages.kv_quant: asymmetric min-max quantisation per channel or per token, packed codes."""

from __future__ import annotations

import numpy as np
import pytest

from sdpa_book.pages.kv_quant import Quantised, dequantise, fake_quantise, quantise


def _expanded(stats: np.ndarray, q: Quantised) -> np.ndarray:
    """A scale or zero point per group, repeated over its group: the array's own shape."""
    axis = -2 if q.per == "channel" else -1
    return np.repeat(stats.astype(np.float64), q.group_size, axis=axis)


def _loop_reference(x: np.ndarray, bits: int, per: str, group_size: int):
    """Codes and dequantised numbers, group by group in float64 loops (no packing)."""
    x = np.asarray(x, dtype=np.float64)
    rows = x if per == "token" else np.swapaxes(x, -1, -2)  # (..., A, L): L quantised
    codes = np.zeros(rows.shape, dtype=np.int64)
    back = np.zeros(rows.shape)
    q_max = 2**bits - 1
    for index in np.ndindex(rows.shape[:-1]):
        for start in range(0, rows.shape[-1], group_size):
            group = rows[index][start : start + group_size]
            low, high = min(group), max(group)
            step = (high - low) / q_max
            for j, value in enumerate(group):
                code = 0 if step == 0 else min(max(round((value - low) / step), 0), q_max)
                codes[index + (start + j,)] = code
                back[index + (start + j,)] = low + step * code
    if per == "channel":
        codes, back = np.swapaxes(codes, -1, -2), np.swapaxes(back, -1, -2)
    return codes, back


# ---------------------------------------------------------------------------------------------
# Hand-computed cases


def test_per_channel_by_hand():
    # (T=4, D=2): channel 0 is 0..3 (step 1), channel 1 is 10, 30, 50, 70 (step 20) with 2 bits
    k = np.array([[0.0, 10.0], [1.0, 30.0], [2.0, 50.0], [3.0, 70.0]])
    q = quantise(k, 2, per="channel")
    np.testing.assert_array_equal(q.scale, [[1.0, 20.0]])
    np.testing.assert_array_equal(q.zero, [[0.0, 10.0]])
    np.testing.assert_array_equal(q.codes(), [[0, 0], [1, 1], [2, 2], [3, 3]])
    # channel 0's codes 0,1,2,3 in one byte: 00 01 10 11 = 0x1B; channel 1's the same
    np.testing.assert_array_equal(q.packed, [[[0x1B]], [[0x1B]]])
    np.testing.assert_array_equal(dequantise(q), k)
    assert q.nbytes == 2 + 2 * 2 + 2 * 2  # two bytes of codes, two float16 scales and zeros


def test_per_token_by_hand():
    # One token (T=1, D=4) with 2 bits: min -1, max 2, step 1; -0.4 -> 1 step -> 0.0,
    # 0.2 -> 1.2 steps -> 0.0, 2 -> 3 steps.
    v = np.array([[-1.0, -0.4, 0.2, 2.0]])
    q = quantise(v, 2, per="token")
    np.testing.assert_array_equal(q.scale, [[1.0]])
    np.testing.assert_array_equal(q.zero, [[-1.0]])
    np.testing.assert_array_equal(q.codes(), [[0, 1, 1, 3]])
    np.testing.assert_array_equal(dequantise(q), [[-1.0, 0.0, 0.0, 2.0]])


def test_int4_packs_two_codes_per_byte():
    # codes 1, 2, 3, 4 (min 1, max 4 on a 4-bit grid: step 3 / 15 = 0.2, values 1 + 0.2 c)
    x = np.array([[1.0, 1.2, 1.4, 4.0]])  # codes 0, 1, 2, 15
    q = quantise(x, 4, per="token", scale_dtype=np.float64)
    np.testing.assert_array_equal(q.codes(), [[0, 1, 2, 15]])
    np.testing.assert_array_equal(q.packed, [[[0x01, 0x2F]]])  # first code in the high nibble
    assert q.packed.nbytes == 2


def test_int8_codes_by_hand():
    # 0 .. 255 on a step of 0.5 from -10: the codes are the integers themselves
    x = (-10.0 + 0.5 * np.arange(256.0)).reshape(256, 1)  # (T=256, D=1)
    q = quantise(x, 8, per="channel")
    np.testing.assert_array_equal(q.codes()[:, 0], np.arange(256))
    np.testing.assert_array_equal(q.packed.ravel(), np.arange(256))  # a byte per code
    np.testing.assert_array_equal(dequantise(q), x)


def test_three_bit_codes_pack_into_whole_bytes_per_group():
    # (T=8, D=2), per token, 3 bits: a group of 2 codes takes 6 bits -> 1 byte
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 2))
    q = quantise(x, 3, per="token")
    assert q.packed.shape == (8, 1, 1)
    # 3 channels' groups of 8 tokens: 24 bits -> exactly 3 bytes each
    q = quantise(rng.standard_normal((8, 3)), 3, per="channel")
    assert q.packed.shape == (3, 1, 3)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("g", [1, 3, 8, 16])
def test_packed_codes_come_back(bits, g):
    # both ways of packing (shifts when whole codes fill bytes, a bit stream otherwise)
    rng = np.random.default_rng(bits * 10 + g)
    codes = rng.integers(0, 2**bits, size=(3, 5, g))
    codes[..., 0] = 0  # the ends of the grid, so that the codes are the quantised values
    if g > 1:
        codes[..., -1] = 2**bits - 1
    q = quantise(codes.astype(float), bits, per="token", scale_dtype=np.float64)
    np.testing.assert_array_equal(q.codes(), codes)
    assert q.packed.shape == (3, 5, 1, -(-g * bits // 8))
    # the stream by hand: every code's bits, most significant first, padded to whole bytes
    stream = "".join(format(int(c), f"0{bits}b") for c in codes[1, 2])
    stream += "0" * (-len(stream) % 8)
    expected = [int(stream[i : i + 8], 2) for i in range(0, len(stream), 8)]
    assert q.packed[1, 2, 0].tolist() == expected


@pytest.mark.parametrize(
    ("shape", "bits", "per", "group_size", "expected"),
    [
        # (T=6, D=11) per token, int4: 44 bits -> 6 bytes, + 2 + 2 for the float16 stats
        ((6, 11), 4, "token", None, 6 * (6 + 4)),
        # the same per channel: 6 tokens x 4 bits = 3 bytes per channel, + 4
        ((6, 11), 4, "channel", None, 11 * (3 + 4)),
        # groups of 3 tokens: 2 groups per channel, 12 bits -> 2 bytes each, + 4 each
        ((6, 11), 4, "channel", 3, 11 * 2 * (2 + 4)),
        # (B=2, H=3, T=4, D=8) int8 per token in groups of 4 channels: 4 + 4 bytes per group
        ((2, 3, 4, 8), 8, "token", 4, 2 * 3 * 4 * 2 * (4 + 4)),
    ],
)
def test_nbytes_counts_codes_scales_and_zero_points(shape, bits, per, group_size, expected):
    x = np.random.default_rng(0).standard_normal(shape)
    assert quantise(x, bits, per=per, group_size=group_size).nbytes == expected


def test_nbytes_with_float32_stats():
    x = np.random.default_rng(0).standard_normal((5, 8))
    q = quantise(x, 4, per="token", scale_dtype=np.float32)
    assert q.scale.dtype == np.float32 and q.zero.dtype == np.float32
    assert q.nbytes == 5 * (4 + 4 + 4)


# ---------------------------------------------------------------------------------------------
# An independent reference


@pytest.mark.parametrize("per", ["channel", "token"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_matches_a_float64_loop(per, bits):
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((3, 6, 10)) * rng.uniform(0.1, 5.0, size=(3, 1, 10))
    group_size = 3 if per == "channel" else 5
    q = quantise(x, bits, per=per, group_size=group_size, scale_dtype=np.float64)
    codes, back = _loop_reference(x, bits, per, group_size)
    np.testing.assert_array_equal(q.codes(), codes)
    np.testing.assert_allclose(dequantise(q), back, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Properties


@pytest.mark.parametrize("scale_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    ("per", "group_size"), [("channel", None), ("channel", 2), ("token", None), ("token", 7)]
)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_round_trip_within_half_a_step(bits, per, group_size, scale_dtype):
    rng = np.random.default_rng(11 * bits)
    x = (rng.standard_normal((3, 5, 4, 14)) * 3.0).astype(np.float32)  # (B, H, T, D)
    q = quantise(x, bits, per=per, group_size=group_size, scale_dtype=scale_dtype)
    error = np.abs(dequantise(q).astype(np.float64) - x)
    half_step = _expanded(q.scale, q) / 2
    # float32 output: allow its own rounding on top of the half step
    assert np.all(error <= half_step + 4e-7 * (1 + np.abs(x))), float((error - half_step).max())
    # the grid covers each group: zero at most the minimum, zero + scale * q_max at least the max
    zero = _expanded(q.zero, q)
    top = zero + _expanded(q.scale, q) * (2**bits - 1)
    assert np.all(zero <= x) and np.all(top >= x)


@pytest.mark.parametrize("per", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_exact_on_the_grid(per, bits):
    # every group: zero and step exact in float16, codes spanning 0 .. q_max
    rng = np.random.default_rng(bits)
    q_max = 2**bits - 1
    shape = (2, 3, 2 * (q_max + 1), 5) if per == "channel" else (2, 3, 5, 2 * (q_max + 1))
    axis = -2 if per == "channel" else -1
    codes = rng.integers(0, q_max + 1, size=shape)
    ends = [slice(None)] * 4
    ends[axis] = slice(0, 2)
    codes[tuple(ends)] = np.array([0, q_max]).reshape(
        [-1 if a == axis % 4 else 1 for a in range(4)]
    )
    stat_shape = list(shape)
    stat_shape[axis] = 1
    zero = rng.integers(-8, 8, size=stat_shape) / 4.0
    step = rng.integers(1, 16, size=stat_shape) / 8.0
    x = zero + step * codes
    q = quantise(x, bits, per=per)
    np.testing.assert_array_equal(q.codes(), codes)
    np.testing.assert_array_equal(dequantise(q), x)


def test_a_constant_group_comes_back_exactly():
    x = np.array([[0.5, 0.5, 0.5], [1.0, 2.0, 3.0]])  # token 0 constant
    q = quantise(x, 4, per="token")
    assert q.scale[0, 0] == 0 and np.all(q.codes()[0] == 0)
    np.testing.assert_array_equal(dequantise(q)[0], x[0])


def test_per_channel_is_unchanged_by_rescaling_a_channel():
    # Scaling a channel by a power of two scales its grid by the same factor: the same codes.
    # Per token it is not so: the large channel sets every token's step.
    rng = np.random.default_rng(5)
    k = rng.standard_normal((3, 16, 6))
    c = np.array([1.0, 16.0, 1.0, 1.0, 0.25, 1.0])
    by_channel = quantise(k, 3, per="channel")
    np.testing.assert_array_equal(quantise(k * c, 3, per="channel").codes(), by_channel.codes())
    np.testing.assert_array_equal(
        dequantise(quantise(k * c, 3, per="channel")), dequantise(by_channel) * c
    )
    by_token = quantise(k * c, 3, per="token")
    assert not np.array_equal(by_token.codes(), quantise(k, 3, per="token").codes())


def test_more_bits_never_hurt_much_and_groups_help():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 32, 8))
    errors = [np.abs(fake_quantise(x, b, per="token") - x).max() for b in range(1, 9)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    whole = np.abs(fake_quantise(x, 2, per="channel") - x).mean()
    grouped = np.abs(fake_quantise(x, 2, per="channel", group_size=8) - x).mean()
    assert grouped < whole


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtype_preserved_and_input_untouched(dtype):
    x = np.random.default_rng(1).standard_normal((5, 6)).astype(dtype)
    before = x.copy()
    q = quantise(x, 4, per="channel")
    assert q.dtype == dtype and dequantise(q).dtype == dtype
    assert fake_quantise(x, 4, per="token").dtype == dtype
    np.testing.assert_array_equal(x, before)


def test_integers_are_read_as_float64():
    q = quantise([[0, 255, 7], [10, 265, 100]], 8, per="token")  # steps of 1
    assert dequantise(q).dtype == np.float64
    np.testing.assert_array_equal(dequantise(q), [[0.0, 255.0, 7.0], [10.0, 265.0, 100.0]])


def test_fake_quantise_is_dequantise_of_quantise():
    x = np.random.default_rng(2).standard_normal((2, 4, 6))
    np.testing.assert_array_equal(
        fake_quantise(x, 3, per="channel", group_size=2),
        dequantise(quantise(x, 3, per="channel", group_size=2)),
    )


# ---------------------------------------------------------------------------------------------
# Bad input: one test per raise


def test_rejects_non_real_x():
    with pytest.raises(TypeError, match="x must be an array of real numbers; got dtype complex"):
        quantise(np.ones((2, 2), dtype=complex), 4, per="token")
    with pytest.raises(TypeError, match="got dtype bool"):
        quantise(np.ones((2, 2), dtype=bool), 4, per="token")


def test_rejects_one_dimensional_x():
    with pytest.raises(ValueError, match=r"at least 2-D; got x.shape=\(5,\)"):
        quantise(np.ones(5), 4, per="token")


def test_rejects_empty_x():
    with pytest.raises(ValueError, match=r"x must not be empty; got x.shape=\(0, 3\)"):
        quantise(np.ones((0, 3)), 4, per="token")


def test_rejects_non_finite_x():
    with pytest.raises(ValueError, match="only finite numbers"):
        quantise(np.array([[1.0, np.nan]]), 4, per="token")


def test_rejects_bits_of_the_wrong_kind():
    with pytest.raises(TypeError, match="bits must be an int; got 4.0"):
        quantise(np.ones((2, 2)), 4.0, per="token")
    with pytest.raises(TypeError, match="bits must be an int; got True"):
        quantise(np.ones((2, 2)), True, per="token")


@pytest.mark.parametrize("bits", [0, 9, 16])
def test_rejects_bits_out_of_range(bits):
    with pytest.raises(ValueError, match=f"bits must be from 1 to 8; got {bits}"):
        quantise(np.ones((2, 2)), bits, per="token")


def test_rejects_an_unknown_per():
    with pytest.raises(ValueError, match="per must be 'channel' or 'token'; got 'head'"):
        quantise(np.ones((2, 2)), 4, per="head")


def test_rejects_group_size_of_the_wrong_kind():
    with pytest.raises(TypeError, match="group_size must be an int or None; got 2.0"):
        quantise(np.ones((4, 2)), 4, per="channel", group_size=2.0)


@pytest.mark.parametrize("group_size", [0, 3, 8])
def test_rejects_a_group_size_that_does_not_divide_the_axis(group_size):
    match = (
        r"group_size must be a positive divisor of the tokens T = 4 of x with "
        rf"per='channel'; got group_size={group_size}, x.shape=\(4, 6\)"
    )
    with pytest.raises(ValueError, match=match):
        quantise(np.ones((4, 6)), 4, per="channel", group_size=group_size)
    with pytest.raises(ValueError, match="of the channels D = 6"):
        quantise(np.ones((4, 6)), 4, per="token", group_size=4)


@pytest.mark.parametrize("scale_dtype", [np.int8, "bfloat", np.complex64])
def test_rejects_a_scale_dtype_that_is_not_a_float(scale_dtype):
    with pytest.raises(TypeError, match="scale_dtype must be float16, float32 or float64"):
        quantise(np.ones((2, 2)), 4, per="token", scale_dtype=scale_dtype)


def test_rejects_magnitudes_float16_stats_cannot_hold():
    with pytest.raises(ValueError, match=r"at most 1\.638e\+04 .* in float16; got 1e\+05"):
        quantise(np.array([[0.0, 1e5]]), 4, per="token")
    quantise(np.array([[0.0, 1e5]]), 4, per="token", scale_dtype=np.float32)  # fine


def test_dequantise_rejects_anything_else():
    with pytest.raises(TypeError, match="q must be a Quantised array .* got ndarray"):
        dequantise(np.ones((2, 2)))
