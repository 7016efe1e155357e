"""The interactive figures' states (sdpa_book.widgets) against the package, and their HTML."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

import sdpa
from sdpa_book import widgets
from sdpa_book.widgets import (
    Control,
    flash_states,
    kv_cache_bytes,
    mask_weights,
    rope_states,
)

BUILDERS = [
    widgets.softmax_widget,
    widgets.mask_widget,
    widgets.flash_loop_widget,
    widgets.rope_widget,
    widgets.kv_cache_widget,
]


@pytest.mark.parametrize(
    "layers, kv_heads, head_dim, dtype, batch",
    [(32, 8, 128, np.float16, 1), (80, 8, 128, np.float32, 4), (2, 1, 64, np.float16, 3)],
)
def test_kv_cache_bytes_is_the_caches_own_count(layers, kv_heads, head_dim, dtype, batch):
    cache = sdpa.KVCache(layers, kv_heads, head_dim, batch_size=batch, dtype=dtype, capacity=1)
    got = kv_cache_bytes(
        1000,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype_bytes=np.dtype(dtype).itemsize,
        batch=batch,
    )
    assert got == 1000 * cache.bytes_per_token


def test_kv_cache_bytes_mla_ignores_the_heads():
    one = kv_cache_bytes(10, layers=4, kv_heads=1, head_dim=128, dtype_bytes=2, latent=512)
    many = kv_cache_bytes(10, layers=4, kv_heads=64, head_dim=128, dtype_bytes=2, latent=512)
    assert one == many == 10 * 4 * 512 * 2
    assert (
        kv_cache_bytes(
            10, layers=4, kv_heads=1, head_dim=128, dtype_bytes=2, latent=512, rope_dim=64
        )
        == 10 * 4 * 576 * 2
    )


@pytest.mark.parametrize("T, S", [(3, 5), (5, 3), (8, 8)])
def test_mask_states_are_the_masks(T, S):
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    expected = {
        "none": np.ones((T, S), dtype=bool),
        "causal-tl": j <= i,
        "causal-br": j <= i + S - T,
        "window": (j <= i + S - T) & (j >= i + S - T - 2),
        "padding": np.broadcast_to(j < S - 2, (T, S)),
    }
    for kind, allowed in expected.items():
        weights, got = mask_weights(kind, T, S)
        np.testing.assert_array_equal(got, allowed, err_msg=kind)
        rows = allowed.any(axis=1)
        np.testing.assert_allclose(weights.sum(axis=1)[rows], 1)
        assert np.all(weights[~rows] == 0)


def test_mask_weights_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown mask kind"):
        mask_weights("diagonal", 3, 3)


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_states_follow_the_online_softmax(is_causal):
    s = flash_states(is_causal=is_causal)
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((8, 4)), rng.standard_normal((8, 4)), rng.standard_normal((8, 1))
    want = sdpa.scaled_dot_product_attention(q, k, v, is_causal=is_causal)[:, 0]
    np.testing.assert_allclose(s["exact"], want, atol=1e-6)
    np.testing.assert_allclose(s["steps"][-1]["out"], want, atol=1e-6)
    scores = q @ k.T / 2
    if is_causal:
        scores = np.where(np.tril(np.ones((8, 8), dtype=bool)), scores, -np.inf)
    for (i0, j0), step in zip(s["tiles"], s["steps"]):
        i1, j1 = i0 + 4, j0 + 2
        for i in range(i0, i1):
            seen = scores[i, :j1]
            m = seen.max()
            l = np.exp(seen - m).sum()
            acc = np.exp(seen - m) @ v[:j1, 0]
            np.testing.assert_allclose([step["m"][i], step["l"][i], step["acc"][i]], [m, l, acc],
                                       atol=2e-6)  # fmt: skip
            np.testing.assert_allclose(step["out"][i], acc / l, atol=2e-6)
    n_full = 2 * 4
    assert len(s["tiles"]) == (n_full if not is_causal else 2 + 4)


def test_rope_scores_depend_on_the_offset_only():
    a = np.array(rope_states()["scores"])
    for d in range(-15, 16):
        assert np.ptp(np.diagonal(a, offset=d)) < 2e-6
    assert np.ptp(a) > 0.5  # and they do change with the offset


@pytest.mark.parametrize("build", BUILDERS, ids=lambda f: f.__name__)
def test_widget_html_is_accessible_and_small(build):
    w = build()
    text = w._repr_html_()
    assert len(text.encode()) < 300_000  # each page adds at most 300 KB beyond the library
    # every control labelled, sliders and menus are the browser's own
    for c in w.controls:
        ident = re.search(rf'id="([^"]+-{re.escape(c.name)})"', text).group(1)
        assert f'<label for="{ident}">' in text
    assert 'aria-live="polite"' in text and 'role="group"' in text
    assert re.search(
        r'<img class="sdpa-widget-static" src="data:image/png;base64,[^"]+" alt="[^"]{20,}"', text
    )
    # the controls and the live figure appear only when the script has run
    assert '<div class="sdpa-widget-controls" hidden>' in text
    assert '<div class="sdpa-widget-plot"' in text and "hidden></div>" in text
    payload = re.search(
        r'<script type="application/json" class="sdpa-widget-data">(.*?)</script>', text, re.S
    ).group(1)
    spec = json.loads(payload)
    assert set(spec) == {"item", "data", "code"}
    assert "return" in spec["code"]
    # the figure's text is at least 9 CSS px
    sizes = [int(m) for m in re.findall(r'"(\d+)px"', json.dumps(spec["item"]))]
    assert sizes and min(sizes) >= 9


def test_widget_without_bokeh_shows_the_static_picture(monkeypatch):
    monkeypatch.setitem(sys.modules, "bokeh.embed", None)  # import fails as when not installed
    text = widgets.kv_cache_widget()._repr_html_()
    assert "sdpa-widget-static-only" in text and "data:image/png;base64," in text
    assert "<script" not in text


def test_control_checks_its_value():
    with pytest.raises(ValueError, match="kind"):
        Control("x", "X", "knob", 1)
    with pytest.raises(ValueError, match="outside"):
        Control("x", "X", "range", 5, low=0, high=1)
    with pytest.raises(ValueError, match="not one of the options"):
        Control("x", "X", "select", "c", options=[("a", "A"), ("b", "B")])


def _small_lm(seed):
    from sdpa.nn import DecoderLM

    return DecoderLM(vocab_size=6, d_model=8, n_layers=2, n_heads=2, max_len=5,
                     rng=np.random.default_rng(seed))  # fmt: skip


def test_lm_widget_keeps_a_map_per_training_step_layer_head_and_sequence():
    early, late = _small_lm(0), _small_lm(1)
    tokens = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]]
    w = widgets.lm_attention_widget(late, tokens, ["up", "down"], snapshots=[(0, early), (9, late)])
    assert w.data["steps"] == [0, 9]
    assert len(w.data["maps"]) == 2 * 2 * 2 * 2  # steps x layers x heads x sequences
    assert [c.name for c in w.controls] == ["step", "layer", "head", "seq"]
    assert w.controls[0].value == "1" and w.controls[0].options == [("0", "0"), ("1", "9")]
    # each state's maps are its own model's weights, in thousandths
    for k, model in enumerate([early, late]):
        _, weights = model.forward(np.array(tokens), return_attention=True)
        for layer, head, s in np.ndindex(2, 2, 2):
            rows = w.data["maps"][f"{k}/{layer}/{head}/{s}"]
            want = weights[layer][s, head]
            for i, row in enumerate(rows):
                np.testing.assert_allclose(np.array(row) / 1000, want[i, : i + 1], atol=5e-4)
    assert w.data["maps"]["0/1/0/0"] != w.data["maps"]["1/1/0/0"]
    # without snapshots: one state, no step control
    one = widgets.lm_attention_widget(late, tokens, ["up", "down"])
    assert one.data["steps"] == [None] and "step" not in [c.name for c in one.controls]
    assert one.data["maps"]["0/1/0/0"] == w.data["maps"]["1/1/0/0"]


def test_lm_widget_wants_the_model_last_among_its_snapshots():
    early, late = _small_lm(0), _small_lm(1)
    with pytest.raises(ValueError, match="the last of the snapshots must be the model itself"):
        widgets.lm_attention_widget(late, [[0, 1, 2]], ["a"], snapshots=[(0, late), (9, early)])


def test_kv_cache_bytes_shared_layers_by_hand():
    # 32 layers in pairs: 16 caches; each holds 2 * 8 * 128 = 2,048 numbers a token, 4,096 bytes
    # in 16 bits; 16 caches: 65,536 bytes a token; 1,000 tokens: 65,536,000 bytes
    assert (
        kv_cache_bytes(1000, layers=32, kv_heads=8, head_dim=128, dtype_bytes=2, layers_per_cache=2)
        == 65_536_000
    )
    # 30 layers in fours: 7 groups of 4 and one of 2, 8 caches; 2 * 4 * 64 = 512 numbers, one
    # byte each, for 3 sequences of 10 tokens: 8 * 512 * 30 = 122,880
    assert (
        kv_cache_bytes(
            10, layers=30, kv_heads=4, head_dim=64, dtype_bytes=1, batch=3, layers_per_cache=4
        )
        == 122_880
    )
    # MLA with 3 layers a cache over 61 layers: 21 caches of (512 + 64) numbers in 16 bits
    assert (
        kv_cache_bytes(
            1, layers=61, kv_heads=1, head_dim=128, dtype_bytes=2, latent=512, rope_dim=64,
            layers_per_cache=3,
        )
        == 21 * 576 * 2
    )  # fmt: skip
    # more layers a cache than layers: one cache
    assert (
        kv_cache_bytes(1, layers=2, kv_heads=1, head_dim=4, dtype_bytes=4, layers_per_cache=8)
        == 2 * 4 * 4
    )


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_kv_cache_bytes_rejects_a_bad_sharing(bad):
    with pytest.raises(ValueError, match=r"layers_per_cache must be .* got"):
        kv_cache_bytes(1, layers=2, kv_heads=1, head_dim=4, dtype_bytes=4, layers_per_cache=bad)


def test_every_slider_has_step_buttons_of_its_own():
    for build in BUILDERS:
        text = build()._repr_html_()
        for ident in re.findall(r'<input type="range" id="([^"]+)"', text):
            buttons = re.findall(
                rf'<button type="button" class="sdpa-step" data-sdpa-step="(-?1)"'
                rf' aria-controls="{ident}" aria-label="[^"]+: one step (?:down|up)">',
                text,
            )
            assert sorted(buttons) == ["-1", "1"], (build.__name__, ident)


def test_kv_calculator_speaks_the_books_letters():
    w = widgets.kv_cache_widget()
    labels = {c.name: c.label for c in w.controls}
    assert "H_q" in labels["heads"] and "H_kv" in labels["kvheads"]
    assert "GQA groups" not in w._repr_html_()
    assert dict(next(c for c in w.controls if c.name == "share").options)["1"].startswith("1")
