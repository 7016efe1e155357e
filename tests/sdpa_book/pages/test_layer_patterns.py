"""sdpa_book.pages.layer_patterns: cache sizes of layer patterns, RoPE scaling types, MLA FLOPs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa_book.pages.layer_patterns import (
    MODELS,
    LayerKind,
    ModelPattern,
    dynamic_ntk_base,
    kv_bytes_per_token,
    llama3_inv_freq,
    longrope_inv_freq,
    mla_attention_flops,
    mla_crossover,
)

K128 = 128 * 1024

# ---------------------------------------------------------------------------------------------
# Hand-computed cache sizes


def test_gemma3_27b_by_hand():
    # Gemma 3 27B: 62 layers, every sixth global -> 10 global, 52 local with a 1024 window;
    # 16 KV heads of width 128. One token in one layer: K and V, 16 * 128 each, 2 bytes:
    per_layer_token = 2 * 16 * 128 * 2
    assert per_layer_token == 8192
    global_bytes = 10 * 131072 * 8192  # 10 global layers hold all 131072 tokens
    local_bytes = 52 * 1024 * 8192  # 52 local layers hold 1024 tokens each
    assert global_bytes == 10 * 2**30  # exactly 10 GiB
    assert local_bytes == 436_207_616  # 416 MiB
    gemma3 = MODELS["Gemma 3 27B"]
    assert gemma3.cache_bytes(K128) == global_bytes + local_bytes
    assert gemma3.growth_bytes_per_token() == 10 * 8192
    # short of the window, every layer holds every token: 62 * 8192 bytes a token
    assert gemma3.cache_bytes(1000) == 1000 * 62 * 8192


def test_gpt_oss_120b_by_hand():
    # 36 layers alternating window-128 and global; 8 KV heads of width 64.
    per_layer_token = 2 * 8 * 64 * 2  # 2048 bytes
    expected = 18 * 131072 * per_layer_token + 18 * 128 * per_layer_token
    assert expected == 4_836_556_800  # 4.5 GiB + 4.5 MiB
    assert MODELS["gpt-oss-120b"].cache_bytes(K128) == expected


def test_deepseek_v3_and_qwen3_next_by_hand():
    # DeepSeek-V3: 61 layers of (512 + 64) numbers a token, 2 bytes each
    assert MODELS["DeepSeek-V3"].cache_bytes(K128) == 61 * 576 * 2 * 131072
    # Qwen3-Next: 12 attention layers of 2 heads x 256; 36 linear layers of a fixed state
    state = 32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)
    qwen = MODELS["Qwen3-Next-80B-A3B"]
    assert qwen.cache_bytes(K128) == 2 * (12 * 131072 * 2 * 2 * 256 + 36 * state)
    assert qwen.cache_bytes(1) - qwen.cache_bytes(0) == 2 * 12 * 2 * 2 * 256


def test_deepseek_v4_pro_by_hand():
    # 30 CSA layers: an entry of 512 + 128 per 4 whole tokens; 31 HCA layers: 512 per 128;
    # every layer a window of the last 128 latents of 512, beside its entries
    v4 = MODELS["DeepSeek-V4-Pro"]
    for T in (0, 3, 4, 127, 128, 1000, K128):
        windows = 61 * min(T, 128) * 512
        assert v4.cache_bytes(T) == 2 * (30 * 640 * (T // 4) + 31 * 512 * (T // 128) + windows)
    assert v4.caching_layers() == 61
    assert v4.growth_bytes_per_token() == 2 * (30 * 640 / 4 + 31 * 512 / 128)
    # vLLM's serving notes: 9.62 GiB in bf16 at a million tokens
    assert round(v4.cache_bytes(2**20) / 2**30, 2) == 9.62


def test_compressed_layer_caches_whole_groups_only():
    kind = LayerKind("c", 2, 10, compress=4)
    assert [kind.entries(T) for T in (0, 3, 4, 7, 8)] == [0, 0, 1, 1, 2]
    assert kind.numbers(9) == 2 * 2 * 10
    with pytest.raises(ValueError, match="compress must be at least 1"):
        LayerKind("c", 1, 4, compress=0)


def test_every_model_names_its_source_and_layers_add_up():
    for name, model in MODELS.items():
        assert model.source, name
        own = sum(k.layers for k in model.kinds if not k.beside)
        assert own == model.caching_layers() <= model.layers
        # a pool kept beside another is kept by layers some other kind counts
        for kind in model.kinds:
            if kind.beside:
                assert kind.layers <= own, name
        assert model.cache_bytes(0) >= 0


def test_window_layers_hold_min_of_length_and_window():
    kind = LayerKind("window 4", 3, 10, window=4)
    assert [kind.tokens_held(T) for T in range(7)] == [0, 1, 2, 3, 4, 4, 4]
    assert kind.numbers(6) == 3 * 4 * 10
    linear = LayerKind("linear", 2, 0, state=7)
    assert linear.numbers(0) == linear.numbers(10**6) == 14


# ---------------------------------------------------------------------------------------------
# kv_bytes_per_token


def test_kv_bytes_per_token_by_hand_and_sharing():
    assert kv_bytes_per_token(32, 8, 128) == 32 * 2 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(32, 8, 128, dtype_bytes=4) == 2 * 131072
    # Gemma 3n E4B: 35 layers, 15 of them reading earlier layers' caches
    assert kv_bytes_per_token(35, 2, 256, shared_layers=15) == 20 * 2 * 2 * 256 * 2
    # every layer but the window-free model's global pool in Llama 3.1 8B
    assert kv_bytes_per_token(32, 8, 128) * K128 == MODELS["Llama 3.1 8B"].cache_bytes(K128)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"layers": 0}, ValueError, "layers must be at least 1; got 0"),
        ({"kv_heads": 2.0}, TypeError, "kv_heads must be an int; got 2.0"),
        ({"head_dim": True}, TypeError, "head_dim must be an int"),
        ({"shared_layers": 4}, ValueError, "shared_layers must be below layers"),
        ({"shared_layers": -1}, ValueError, "shared_layers must be at least 0"),
        ({"dtype_bytes": 0}, ValueError, "dtype_bytes must be at least 1"),
    ],
)
def test_kv_bytes_per_token_rejects_bad_input(kwargs, error, message):
    args = {"layers": 4, "kv_heads": 2, "head_dim": 8} | kwargs
    layers, kv_heads, head_dim = args.pop("layers"), args.pop("kv_heads"), args.pop("head_dim")
    with pytest.raises(error, match=message):
        kv_bytes_per_token(layers, kv_heads, head_dim, **args)


def test_model_pattern_rejects_more_caching_layers_than_layers():
    with pytest.raises(ValueError, match="3 caching layers"):
        ModelPattern("x", (LayerKind("global", 3, 4),), 2, "nowhere")


def test_layer_kind_rejects_a_zero_window():
    with pytest.raises(ValueError, match="window must be at least 1"):
        LayerKind("w", 1, 4, window=0)


# ---------------------------------------------------------------------------------------------
# RoPE scaling types against loops written from Hugging Face's definitions


def _llama3_loop(D, base, factor, low, high, original):
    out = []
    for c in range(D // 2):
        theta = base ** (-2 * c / D)
        wavelength = 2 * math.pi / theta
        if wavelength < original / high:
            out.append(theta)
        elif wavelength > original / low:
            out.append(theta / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * theta / factor + smooth * theta)
    return np.array(out)


@pytest.mark.parametrize("D, base", [(128, 500000.0), (64, 10000.0), (10, 1e6)])
def test_llama3_matches_the_branchy_loop(D, base):
    got = llama3_inv_freq(
        D, base, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
    )
    np.testing.assert_allclose(got, _llama3_loop(D, base, 8.0, 1.0, 4.0, 8192), rtol=1e-13)


def test_llama3_is_continuous_at_both_edges():
    # At wavelength = original / high the mix weight is 1 (kept); at original / low it is 0.
    original, low, high = 8192, 1.0, 4.0
    for wavelength, expected in [(original / high, 1.0), (original / low, 1 / 8)]:
        # with D = 4, pair 1 turns at base^(-1/2): this base gives it the wavelength wanted
        base = (wavelength / (2 * math.pi)) ** 2
        theta = llama3_inv_freq(
            4,
            base,
            factor=8.0,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position=original,
        )
        np.testing.assert_allclose(theta[1] * wavelength / (2 * math.pi), expected, rtol=1e-12)


def test_llama3_rejects_reversed_factors():
    with pytest.raises(ValueError, match="high_freq_factor must be above low_freq_factor"):
        llama3_inv_freq(
            8, 1e4, factor=8, low_freq_factor=4, high_freq_factor=1, original_max_position=8192
        )


def test_dynamic_ntk_by_hand():
    # unchanged up to the trained length; at twice the length with factor 2: base * 3^(D/(D-2))
    assert dynamic_ntk_base(1e4, 8, factor=2.0, max_position=100, length=100) == 1e4
    np.testing.assert_allclose(
        dynamic_ntk_base(1e4, 8, factor=2.0, max_position=100, length=200),
        1e4 * 3 ** (8 / 6),
        rtol=1e-14,
    )


def test_longrope_picks_short_or_long_factors():
    theta = 100.0 ** (-np.arange(0, 6, 2) / 6)
    short, long = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]
    kw = {"short_factor": short, "long_factor": long, "original_max_position": 10}
    np.testing.assert_allclose(longrope_inv_freq(6, 100.0, length=10, **kw), theta / short)
    np.testing.assert_allclose(longrope_inv_freq(6, 100.0, length=11, **kw), theta / long)
    with pytest.raises(ValueError, match="one factor per pair, 3; got shape \\(2,\\)"):
        longrope_inv_freq(
            6, 100.0, short_factor=[1, 1], long_factor=[1, 1], original_max_position=4, length=2
        )


# ---------------------------------------------------------------------------------------------
# MLA FLOPs against a count made by building the products' shapes


def _flops_from_shapes(T, S, H, Dc, Dr, Dn, Dv):
    """2 * m * k * n for each matrix product (m, k) @ (k, n) the forms perform."""
    mm = lambda m, k, n: 2 * m * k * n  # noqa: E731
    naive = H * (
        mm(S, Dc, Dn)
        + mm(S, Dc, Dv)  # a head's keys and values from the latents
        + mm(T, Dn + Dr, S)
        + mm(T, S, Dv)  # scores, weighted sum
    )
    absorbed = H * (
        mm(T, Dn, Dc)  # query into the latent's coordinates
        + mm(T, Dc + Dr, S)
        + mm(T, S, Dc)  # scores over latents, weighted sum of latents
        + mm(T, Dc, Dv)  # the head's output up-projected
    )
    return naive, absorbed


@pytest.mark.parametrize("T, S", [(1, 1), (1, 4096), (7, 300), (500, 500)])
def test_mla_flops_match_the_product_shapes(T, S):
    sizes = {"heads": 3, "d_latent": 11, "d_rope": 5, "d_nope": 7, "d_value": 2}
    got = mla_attention_flops(T, S, **sizes)
    naive, absorbed = _flops_from_shapes(T, S, 3, 11, 5, 7, 2)
    assert (got["naive"], got["absorbed"]) == (naive, absorbed)


def test_mla_crossover_is_where_the_counts_meet():
    ds = {"d_latent": 512, "d_nope": 128, "d_value": 128}
    S = 131072
    t_star = mla_crossover(S, **ds)
    assert 170 < t_star < 171  # DeepSeek-V3: about 512 * 256 / 768 = 170.7
    below = mla_attention_flops(170, S, heads=128, d_rope=64, **ds)
    above = mla_attention_flops(171, S, heads=128, d_rope=64, **ds)
    assert below["absorbed"] < below["naive"] and above["absorbed"] > above["naive"]
    assert mla_crossover(10, d_latent=4, d_nope=4, d_value=4) == math.inf
