"""sdpa.nn.DecoderConfig: a model's options as data, checked once, and DecoderLM made from it."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest

from sdpa.nn import DecoderConfig, DecoderLM

SIZES = dict(vocab_size=11, d_model=12, n_layers=2, n_heads=3, max_len=9)


def test_defaults_are_filled_in_and_checked():
    config = DecoderConfig(**SIZES)
    assert (config.n_kv_heads, config.d_ff, config.head_dim) == (3, 48, 4)
    assert config.dtype == np.dtype(np.float64) and isinstance(config.dtype, np.dtype)
    assert config.options == {}
    only = DecoderConfig(**SIZES, attention_only=True, d_ff=7)
    assert only.d_ff is None  # no MLP, so no MLP width


def test_checked_values_replace_the_given_ones():
    config = DecoderConfig(**{**SIZES, "d_model": np.int64(12)}, sink=np.bool_(True), dtype="f4")
    assert type(config.d_model) is int and config.sink is True
    assert config.dtype == np.dtype(np.float32)
    assert config.options == {"sink": True}


def test_config_is_frozen_and_compares_by_value():
    config = DecoderConfig(**SIZES)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 16
    assert config == DecoderConfig(**SIZES) and hash(config) == hash(DecoderConfig(**SIZES))
    assert config != DecoderConfig(**SIZES, qk_norm=True)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(n_heads=5), ValueError, "n_heads must divide d_model; got d_model=12, n_heads=5"),
        (dict(n_kv_heads=2), ValueError, "n_kv_heads must divide n_heads; got n_heads=3"),
        (dict(n_heads=4), ValueError, r"even head width d_model // n_heads; got 12 // 4 = 3"),
        (dict(max_len=0), ValueError, "max_len must be a positive integer; got 0"),
        (dict(d_ff=2.5), TypeError, "d_ff must be a positive integer; got 2.5"),
        (dict(norm="batch"), ValueError, "norm must be 'layer' or 'rms'; got 'batch'"),
        (dict(sink=1), TypeError, "sink must be a bool; got 1"),
        (dict(attn_softcap=-1.0), ValueError, "attn_softcap must be None or a positive"),
        (dict(dtype=np.float16), ValueError, "dtype must be np.float32 or np.float64"),
    ],
)
def test_each_bad_option_is_refused_with_its_name(options, error, message):
    with pytest.raises(error, match=message):
        DecoderConfig(**{**SIZES, **options})


def test_a_model_from_a_config_equals_the_model_from_keywords():
    config = DecoderConfig(**SIZES, qk_norm=True, sink=True, output_gate=True)
    a = DecoderLM(config, rng=np.random.default_rng(3))
    b = DecoderLM(**SIZES, qk_norm=True, sink=True, output_gate=True, rng=np.random.default_rng(3))
    assert a.config == b.config
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
    tokens = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(a.forward(tokens), b.forward(tokens))


def test_the_config_fields_read_as_the_models_attributes():
    model = DecoderLM(DecoderConfig(**SIZES, n_kv_heads=1), rng=np.random.default_rng(0))
    assert (model.d_model, model.n_kv_heads, model.head_dim, model.d_ff) == (12, 1, 4, 48)
    with pytest.raises(AttributeError, match="'DecoderLM' object has no attribute 'width'"):
        model.width  # noqa: B018


def test_config_and_keywords_together_are_refused():
    with pytest.raises(TypeError, match=r"not both; got config and \['d_model'\]"):
        DecoderLM(DecoderConfig(**SIZES), d_model=16, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match="config must be a DecoderConfig; got"):
        DecoderLM(SIZES, rng=np.random.default_rng(0))


def test_a_model_pickles_and_deep_copies_with_its_config():
    model = DecoderLM(**SIZES, attn_softcap=20.0, rng=np.random.default_rng(1))
    tokens = np.array([3, 1, 4, 1, 5])
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert clone.config == model.config
        np.testing.assert_array_equal(clone.forward(tokens), model.forward(tokens))
